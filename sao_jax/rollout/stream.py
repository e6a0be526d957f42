"""The trajectory stream: rollout workers lease prompts and submit trajectories to the learner.

Learner side, `TrajectoryServer` (a threaded gRPC server, `proto/trajectory.proto`):
  - Accepted means durably recorded (docs/design.md, "Rules that keep it real"): a valid
    trajectory is appended to `<workdir>/trajectories.log` and fsynced before its ack goes out.
    Concurrent submits share fsyncs (group commit).
  - Backpressure, nothing dropped: the learner's queue holds at most `maxsize` accepted
    trajectories; a Submit that finds it full waits, holding its ack, until the learner takes a
    batch (`get_batch`). The producer is blocked on its ack, so it is held back.
  - Idempotent ids: a trajectory id accepted before (in this run or, through the log, any earlier
    one) is acknowledged as DUPLICATE and neither queued nor counted again.
  - Malformed trajectories (`Trajectory.validate` fails) are acknowledged as REJECTED with the
    field and message, logged, and counted in `metrics()`; resending them will not help. Their
    lease is issued again, as is the lease of an episode a worker reports failed
    (`ReportFailure`: its environment raised), until the prompt has failed 3 times; then it is
    given up (`stream/prompts_given_up`).
  - Prompts (docs/design.md, "Prompts"): the server owns the prompt iterator (grain's, or any one
    with `get_state()` / `set_state()`) and leases prompts; each lease, with the iterator state
    after it, is on disk before the worker hears of it. Leases outstanding at a restart, or older
    than `lease_timeout_s`, are issued again (the same lease id), before fresh prompts.
  - Restart: the log is replayed. Accepted trajectories that the learner has not declared
    `consumed` are queued again, consumed ones never come back, outstanding leases are re-issued,
    and the prompt iterator resumes where it was. The log is compacted at start-up and whenever
    dead records outgrow `compact_bytes`.
  - The learner calls `consumed(ids)` once a checkpoint holding the step that used them is saved,
    so that a restart from that checkpoint neither loses nor re-uses a trajectory; `discard(ids)`
    drops trajectories unused (e.g. too stale) and issues their prompts again.
  - Loopback by default. Binding any other address needs a `token`, which every call must then
    carry as `authorization: Bearer <token>` metadata (UNAUTHENTICATED otherwise). There is no TLS:
    the token keeps strangers out of a trusted network, not eavesdroppers.

Versions: the learner tells the server its policy version (`policy_version=` at start,
`set_policy_version(v)` before engines may sample with v). A trajectory that an action token's
weight version places ahead of it cannot come from weights this learner published (its policy lag
would be negative, so it would never count as stale): it is REJECTED naming `weight_versions`, and
its lease is issued again without spending one of its attempts (the prompt is not at fault: an
engine still holds weights from beyond the learner's checkpoint). At start-up, accepted
trajectories in the log that are newer than `policy_version` (accepted after the checkpoint the
learner resumed from, sampled by weights it published later) are discarded as `discard` does:
their prompts are issued again under new lease ids, counted in `stream/replay_discarded_newer`, so
that none is trained with a negative lag and no leased prompt is lost (one that answered no lease
is only dropped). Without a policy version (None) versions are not compared.

Hostile input: every string of every message is bounded (`trajectory.py` names the limits: ids
and metadata keys 256 characters, metadata string values 64 Ki). An over-long one is REJECTED
(Submit; the log is not written) or refused with INVALID_ARGUMENT (`LeaseRequest.worker_id`,
`EpisodeFailure.lease_id` / `prompt_id` / `worker_id`), naming the field and the limit; log lines
show over-long texts clipped (`trajectory.clip`). `EpisodeFailure.error`, free
text for the log only, is clipped in the log, never refused. A trajectory answering an outstanding
lease must carry that lease's `prompt_id` (REJECTED naming `prompt_id` otherwise). A client that
opens a connection and never completes the HTTP/2 handshake is disconnected after
`handshake_timeout_s`, and connections past `max_connections` are closed as they open (so that a
flood of them cannot take the file descriptors the learner needs for its log and checkpoints; a
worker holds one). `LeasePrompts` hands out at most 4096 prompts a call.

Worker side, `TrajectoryClient`: `lease_prompts(n)`, `submit(trajectory) -> Ack` and
`report_failure(lease_id, ...)`, retrying while the server is UNAVAILABLE (e.g. restarting);
retries are safe because ids are idempotent.

Messages are not chunked: both ends raise gRPC's limit to 256 MiB (~15M tokens).
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import fcntl
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator, Mapping
from concurrent import futures
from typing import Any

import grpc
import numpy as np

from sao_jax.rollout.proto import trajectory_pb2 as pb
from sao_jax.rollout.proto import trajectory_pb2_grpc as pb_grpc
from sao_jax.rollout.trajectory import (
    MAX_ID_CHARS,
    Trajectory,
    TrajectoryError,
    check_length,
    clip,
)

log = logging.getLogger(__name__)

LOG_NAME = "trajectories.log"
DEFAULT_MAX_MESSAGE_BYTES = 256 * 2**20
_LOCK_NAME = "trajectories.lock"
_MAGIC = b"SAOLOG1\n"
# A frame: payload length, crc32 of the payload, crc32 of those 8 bytes; then the payload.
_FRAME = struct.Struct("<III")
_MAX_LEASE = 4096  # prompts per LeasePrompts call
_POLL_S = 0.25  # how often a waiting Submit checks that its caller is still there
_ERROR_LOG_CHARS = 2000  # an EpisodeFailure's error text, as the log shows it
_ACK_STATUS = {pb.Ack.ACCEPTED: "accepted", pb.Ack.DUPLICATE: "duplicate",
               pb.Ack.REJECTED: "rejected"}


@dataclasses.dataclass(frozen=True)
class Ack:
    """The learner's answer to a submitted trajectory.

    `status` is "accepted" (durably recorded now), "duplicate" (recorded before) or "rejected"
    (failed validation; `field` and `message` say why).
    """

    trajectory_id: str
    status: str
    field: str = ""
    message: str = ""

    @property
    def ok(self) -> bool:
        """The learner holds this trajectory: accepted now or before."""
        return self.status in ("accepted", "duplicate")


@dataclasses.dataclass(frozen=True)
class LeasedPrompt:
    """A prompt leased to a worker: answer it with a trajectory carrying `lease_id`."""

    lease_id: str
    prompt_id: str
    data: dict[str, Any]  # the prompt source's element, as JSON gave it back


# A lease whose answers were rejected this many times is given up (a prompt that cannot yield a
# valid trajectory, e.g. one too long for max_length, must not circulate forever).
_MAX_ATTEMPTS = 3


class PromptsExhausted(Exception):
    """The prompt source is finished and no lease is outstanding: nothing more will be issued."""


class CorruptLogError(RuntimeError):
    """The log has a damaged frame that is not its last one: refuse to guess."""


def _version_arg(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
        raise TypeError(f"a policy version is an int, got {type(version).__name__}")
    if version < 0:
        raise ValueError(f"a policy version is >= 0, got {version}")
    return int(version)


def _newest_version(trajectory: Trajectory) -> int:
    """The newest weight version that sampled an action token of `trajectory` (-1: none)."""
    versions = trajectory.weight_versions[trajectory.action_mask]
    return int(versions.max()) if versions.size else -1


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# The append-only log.


class _Log:
    """Length-prefixed, checksummed `LogRecord` frames in one file; fsync by group commit."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()  # appends and the file handle
        self._sync_lock = threading.Lock()
        self._file = None
        self._size = 0
        self._synced = 0

    def frames(self) -> Iterator[tuple[int, int, bytes]]:
        """Yields (payload offset, payload length, payload) of every whole frame.

        A torn tail — the last appends cut short by a crash, never acknowledged since acks
        follow fsync — is cut off: a partial header, a payload running past the end, or a bad
        frame followed only by zeros (pages a power loss never wrote). A bad frame with data
        after it raises `CorruptLogError` rather than guess.
        """
        if not os.path.exists(self.path) or os.path.getsize(self.path) < len(_MAGIC):
            return
        with open(self.path, "rb") as f:
            if f.read(len(_MAGIC)) != _MAGIC:
                raise CorruptLogError(f"{self.path} is not a trajectory log (bad magic)")
            size = os.fstat(f.fileno()).st_size
            offset = len(_MAGIC)
            while offset < size:
                head = f.read(_FRAME.size)
                problem = None  # None: a torn tail
                if len(head) == _FRAME.size:
                    n, crc, head_crc = _FRAME.unpack(head)
                    end = offset + _FRAME.size + n
                    if zlib.crc32(head[:8]) != head_crc:
                        if not _only_zeros_left(f):
                            problem = "a bad frame header"
                    elif end <= size:
                        payload = f.read(n)
                        if zlib.crc32(payload) == crc:
                            yield offset + _FRAME.size, n, payload
                            offset = end
                            continue
                        if not _only_zeros_left(f):
                            problem = "a frame failing its checksum"
                if problem:
                    raise CorruptLogError(
                        f"{self.path}: {problem} at byte {offset}, with data after it. If the "
                        "machine lost power, nothing from there on was acknowledged: "
                        f"`truncate -s {offset}` the file to recover.")
                log.warning("%s: cutting off a torn tail at byte %d (%d bytes)", self.path,
                            offset, size - offset)
                os.truncate(self.path, offset)
                return

    def open(self) -> None:
        if not os.path.exists(self.path) or os.path.getsize(self.path) < len(_MAGIC):
            self.rewrite([])
            return
        self._file = open(self.path, "ab")
        self._size = self._synced = self._file.tell()

    def append(self, record: pb.LogRecord) -> tuple[int, int, int]:
        """Appends a frame; returns (payload offset, payload length, end of the frame)."""
        payload = record.SerializeToString()
        with self._lock:
            if self._file is None:
                raise ValueError("the log is closed")
            self._file.write(_frame_header(payload))
            self._file.write(payload)
            offset = self._size + _FRAME.size
            self._size = offset + len(payload)
            return offset, len(payload), self._size

    def sync(self, end: int) -> None:
        """Returns once every byte before `end` is on disk; one fsync serves all waiting writers."""
        with self._sync_lock:
            if self._synced >= end:
                return
            with self._lock:
                if self._file is None:
                    raise ValueError("the log is closed")
                self._file.flush()
                target, fd = self._size, self._file.fileno()
            os.fsync(fd)
            self._synced = target

    def read(self, offset: int, length: int) -> bytes:
        with self._lock:
            self._file.flush()
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def rewrite(self, payloads: Iterable[bytes]) -> list[tuple[int, int]]:
        """Atomically replaces the log by these frames; returns each one's (offset, length).

        Callers hold off appends while this runs.
        """
        tmp = self.path + ".tmp"
        locations = []
        with open(tmp, "wb") as f:
            f.write(_MAGIC)
            offset = len(_MAGIC)
            for payload in payloads:
                f.write(_frame_header(payload))
                f.write(payload)
                locations.append((offset + _FRAME.size, len(payload)))
                offset += _FRAME.size + len(payload)
            f.flush()
            os.fsync(f.fileno())
        with self._lock:
            if self._file is not None:
                self._file.close()
            os.replace(tmp, self.path)
            _fsync_dir(os.path.dirname(self.path))
            self._file = open(self.path, "ab")
            self._size = self._synced = offset
        return locations

    @property
    def size(self) -> int:
        return self._size

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None


def _only_zeros_left(f) -> bool:
    while chunk := f.read(2**20):
        if chunk.strip(b"\0"):
            return False
    return True


def _frame_header(payload: bytes) -> bytes:
    head = struct.pack("<II", len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head))


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Prompts.


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode()
    raise TypeError(f"a prompt holds a {type(value).__name__}, which JSON cannot carry")


def _prompt_message(element: Any, lease_id: str) -> pb.Prompt:
    """A prompt source's element (a mapping) as a leasable prompt.

    Its `prompt_id` is the element's "prompt_id" if it has one, else a hash of its content, so the
    same prompt keeps its id across epochs (the running-mean baseline keys on it).
    """
    if not isinstance(element, Mapping):
        raise TypeError(f"prompt source elements must be mappings, got {type(element).__name__}")
    data_json = json.dumps(dict(element), sort_keys=True, default=_json_default)
    prompt_id = element.get("prompt_id")
    if prompt_id is None:
        prompt_id = hashlib.sha256(data_json.encode()).hexdigest()[:16]
    return pb.Prompt(lease_id=lease_id, prompt_id=str(prompt_id), data_json=data_json)


def lease_group(lease_id: str) -> str:
    """The group a lease belongs to: the prompt draw it came from (`TrajectoryServer`)."""
    return lease_id.split("-", 1)[0]


def _reissued_lease_id(lease_id: str) -> str:
    """A fresh lease id in the same group."""
    return f"{lease_group(lease_id)}-{uuid.uuid4().hex}" if lease_id else uuid.uuid4().hex


def _encode_state(state: Any) -> str:
    if isinstance(state, bytes):
        return json.dumps({"bytes_b64": base64.b64encode(state).decode()})
    return json.dumps({"json": state}, default=_json_default)


def _decode_state(text: str) -> Any:
    wrapped = json.loads(text)
    if "bytes_b64" in wrapped:
        return base64.b64decode(wrapped["bytes_b64"])
    return wrapped["json"]


# ---------------------------------------------------------------------------------------------
# The learner's server.


class _TokenCheck(grpc.ServerInterceptor):
    def __init__(self, token: str, on_reject):
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            on_reject()
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong token (send 'authorization: Bearer <token>')")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and hmac.compare_digest(value.encode(), self._expected):
                return continuation(handler_call_details)
        return self._deny


class TrajectoryServer(pb_grpc.TrajectoryServiceServicer):
    """The learner's end of the stream: a bounded queue of durably accepted trajectories.

    Args:
      workdir: where the log lives; reopening the same directory resumes (see the module doc).
        One server per directory at a time (a file lock enforces it).
      vocab_size: token ids must lie in [0, vocab_size).
      prompts: the prompt source: an iterable whose iterator has `get_state()` / `set_state()`
        (e.g. `grain.MapDataset.source(rows).shuffle(seed=0).repeat().to_iter_dataset()`), yielding
        mappings. Give the same source on every restart. None: LeasePrompts is refused.
      max_length: prompt + response tokens allowed (None: no limit).
      maxsize: accepted trajectories the queue holds before producers wait.
      host, port: where to listen; port 0 picks a free one (see `port`, `address`).
      token: required on every call when set; binding a non-loopback host requires one.
      lease_timeout_s: re-issue a lease not answered within this time (None: only at restarts).
      max_workers: server threads. A Submit waiting for room holds one; further calls queue.
      max_message_bytes: gRPC message limit, both directions.
      compact_bytes: compact the log once it exceeds this and is mostly dead records.
      max_in_flight: staleness control by admission (AReaL): fresh prompts are leased only while
        unanswered leases plus accepted-but-unconsumed trajectories number fewer than this. With
        `(max_staleness + 1) * batch_size`, a prompt leased while the learner is at step i is
        consumed by step i + max_staleness + 1 at the latest. None: no limit. Re-issued leases
        are always handed out.
      group_size: each prompt drawn from the source is leased this many times, as a group: the
        lease ids are `<group>-<k>` (`lease_group` reads the group back; a re-issued lease keeps
        it). GRPO batches hold whole groups.
      iterator_state: the prompt iterator's state (`iterator_state()` of an earlier server) to
        start from when the log holds none, e.g. from a learner checkpoint whose stream
        directory was lost. The log's state wins when there is one.
      lease_budget: None, or how many fresh prompts may be leased before `grant_leases` allows
        more (the synchronous learner grants one batch at a time). Re-issued leases are always
        handed out.
      policy_version: the learner's policy version at start (e.g. its checkpoint's): replayed
        trajectories newer than it are discarded and their prompts issued again, and newer
        submits are rejected (module doc, "Versions"). None: versions are not compared.
      handshake_timeout_s: a connection that has not completed its HTTP/2 handshake this long
        after it opened is closed (gRPC's default is 120 s).
      max_connections: open connections allowed at once (each rollout worker holds one); more
        are closed as they open, and their clients retry.
    """

    def __init__(self, workdir: str, *, vocab_size: int, prompts: Iterable[Any] | None = None,
                 max_length: int | None = None, maxsize: int = 256, host: str = "127.0.0.1",
                 port: int = 0, token: str | None = None, lease_timeout_s: float | None = None,
                 max_workers: int = 64, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 compact_bytes: int = 2**30, max_in_flight: int | None = None,
                 lease_budget: int | None = None, group_size: int = 1,
                 iterator_state: str | None = None, policy_version: int | None = None,
                 handshake_timeout_s: float = 10.0, max_connections: int = 256):
        if maxsize < 1:
            raise ValueError(f"maxsize must be at least 1, got {maxsize}")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1 (or None), got {max_in_flight}")
        self._max_in_flight = max_in_flight
        if lease_budget is not None and lease_budget < 0:
            raise ValueError(f"lease_budget must be >= 0 (or None), got {lease_budget}")
        self._lease_budget = lease_budget
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        self._group_size = group_size
        if not handshake_timeout_s > 0:
            raise ValueError(f"handshake_timeout_s must be positive, got {handshake_timeout_s}")
        self._handshake_timeout_s = handshake_timeout_s
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self._max_connections = max_connections
        self._policy_version: int | None = None
        if policy_version is not None:
            self._policy_version = _version_arg(policy_version)
        self._prompt_extra: dict[str, Any] = {}
        # lease id -> its rejected answers and failed episodes (`_retry_lease`)
        self._failed_attempts: collections.Counter[str] = collections.Counter()
        if not is_loopback(host) and not token:
            raise ValueError(f"binding {host!r} would expose the trajectory stream beyond this "
                             "machine: pass token=... (workers send it as metadata)")
        self._vocab_size = vocab_size
        self._max_length = max_length
        self._maxsize = maxsize
        self._host, self._port = host, port
        self._token = token
        self._lease_timeout_s = lease_timeout_s
        self._max_workers = max_workers
        self._max_message_bytes = max_message_bytes
        self._compact_bytes = compact_bytes
        self._server: grpc.Server | None = None

        self._cond = threading.Condition()  # guards everything below unless noted
        self._lease_lock = threading.Lock()  # serialises leasing: the iterator and its records
        self._queue: collections.deque[Trajectory] = collections.deque()
        self._reserved = 0  # submits that have room and are writing the log or landing
        self._inflight: set[str] = set()  # ids being submitted right now
        # log offset -> None while its fsync runs, then (trajectory, location or None if the
        # write failed); drained in offset order into the queue
        self._landing: dict[int, tuple | None] = {}
        self._unconsumed: dict[str, tuple[int, int]] = {}  # id -> (offset, length) in the log
        self._consumed: set[str] = set()
        self._outstanding: dict[str, pb.Prompt] = {}  # lease id -> prompt, not yet answered
        self._fulfilled: dict[str, pb.Prompt] = {}  # trajectory id -> its lease's prompt
        self._pending: collections.deque[str] = collections.deque()  # lease ids to issue again
        self._handed: dict[str, float] = {}  # lease id -> when it was handed out
        self._live_bytes = 0
        self._stopping = False
        self._compacting = False
        self._counts: collections.Counter[str] = collections.Counter()
        self._queue_max_seen = 0
        self._wait_s = 0.0

        os.makedirs(workdir, exist_ok=True)
        self._lock_fd = os.open(os.path.join(workdir, _LOCK_NAME), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"another TrajectoryServer is using {workdir}") from None
        try:
            self._log = _Log(os.path.join(workdir, LOG_NAME))
            self._state_json, self._exhausted = self._replay()
            self._iterator = None
            if prompts is not None:
                self._iterator = iter(prompts)
                if not (hasattr(self._iterator, "get_state")
                        and hasattr(self._iterator, "set_state")):
                    raise TypeError("the prompt source's iterator needs get_state() and "
                                    "set_state() (e.g. a grain IterDataset)")
                if self._state_json or iterator_state:
                    state = _decode_state(self._state_json or iterator_state)
                    self._iterator.set_state(state)
            self._log.open()
            if self._policy_version is not None:
                self._drop_newer(self._policy_version)
            self.compact()
        except BaseException:
            self._log.close()
            os.close(self._lock_fd)
            raise

    # -- restart ---------------------------------------------------------------------------

    def _replay(self) -> tuple[str, bool]:
        """Rebuilds the state from the log; returns the prompt iterator's last state."""
        state_json, exhausted = "", False
        unconsumed: dict[str, pb.Trajectory] = {}
        records = 0
        for offset, length, payload in self._log.frames():
            records += 1
            record = pb.LogRecord.FromString(payload)
            kind = record.WhichOneof("kind")
            if kind == "snapshot":
                self._consumed.update(record.snapshot.consumed_ids)
                state_json = record.snapshot.iterator_state_json
                exhausted = record.snapshot.iterator_exhausted
            elif kind == "leased":
                for prompt in record.leased.prompts:
                    self._outstanding[prompt.lease_id] = prompt
                if record.leased.iterator_state_json:
                    state_json = record.leased.iterator_state_json
                    exhausted = record.leased.iterator_exhausted
            elif kind == "accepted":
                tid = record.accepted.trajectory_id
                unconsumed[tid] = record.accepted
                self._unconsumed[tid] = (offset, length)
                prompt = self._outstanding.pop(record.accepted.lease_id, None)
                if prompt is not None:
                    self._fulfilled[tid] = prompt
            elif kind == "consumed":
                for tid in record.consumed.trajectory_ids:
                    unconsumed.pop(tid, None)
                    self._unconsumed.pop(tid, None)
                    self._fulfilled.pop(tid, None)
                    self._consumed.add(tid)
                for prompt in record.consumed.reissued:
                    self._outstanding[prompt.lease_id] = prompt
        self._queue.extend(Trajectory.from_proto(msg) for msg in unconsumed.values())
        self._pending.extend(self._outstanding)
        if records:
            log.info("trajectory log %s: %d records; %d accepted trajectories to use, %d used, "
                     "%d leases to issue again", self._log.path, records, len(self._queue),
                     len(self._consumed), len(self._pending))
        return state_json, exhausted

    def _drop_newer(self, version: int) -> None:
        """Discards replayed trajectories sampled by weights newer than `version` (module doc,
        "Versions"), issuing their prompts again."""
        newer = [t.trajectory_id for t in self._queue if _newest_version(t) > version]
        if newer:
            self._retire(newer, reissue=True, counter="stream/replay_discarded_newer")
            log.warning("trajectory log %s: discarded %d accepted trajectories sampled by weights "
                        "newer than the learner's policy version %d (published after the "
                        "checkpoint it resumed from); their prompts are issued again",
                        self._log.path, len(newer), version)

    def compact(self) -> None:
        """Rewrites the log with only what a restart needs; waits for in-flight appends."""
        with self._lease_lock, self._cond:
            self._compacting = True
            try:
                while self._reserved:
                    self._cond.wait()
                snapshot = pb.Snapshot(consumed_ids=sorted(self._consumed),
                                       iterator_state_json=self._state_json,
                                       iterator_exhausted=self._exhausted)
                prompts = [*self._outstanding.values(), *self._fulfilled.values()]
                ids = list(self._unconsumed)

                def payloads():
                    yield pb.LogRecord(snapshot=snapshot).SerializeToString()
                    if prompts:
                        yield pb.LogRecord(leased=pb.LeaseRecord(prompts=prompts)) \
                            .SerializeToString()
                    for tid in ids:
                        yield self._log.read(*self._unconsumed[tid])

                locations = self._log.rewrite(payloads())
                for tid, location in zip(ids, locations[len(locations) - len(ids):],
                                         strict=True):
                    self._unconsumed[tid] = location
                self._live_bytes = self._log.size
                self._counts["stream/compactions"] += 1
            finally:
                self._compacting = False
                self._cond.notify_all()

    # -- network ---------------------------------------------------------------------------

    def start(self) -> TrajectoryServer:
        """Binds and starts serving; returns self."""
        interceptors = []
        if self._token:
            interceptors.append(_TokenCheck(self._token, self._count_unauthenticated))
        options = [("grpc.max_receive_message_length", self._max_message_bytes),
                   ("grpc.max_send_message_length", self._max_message_bytes),
                   ("grpc.so_reuseport", 0),  # never share a port with a stale server
                   # A connection that never finishes its handshake is closed (default: 120 s).
                   ("grpc.server_handshake_timeout_ms",
                    max(1, round(self._handshake_timeout_s * 1000))),
                   ("grpc.max_allowed_incoming_connections", self._max_connections)]
        self._server = grpc.server(
            futures.ThreadPoolExecutor(self._max_workers, thread_name_prefix="trajectory-stream"),
            interceptors=interceptors, options=options)
        pb_grpc.add_TrajectoryServiceServicer_to_server(self, self._server)
        host = f"[{self._host}]" if ":" in self._host else self._host
        self._port = self._server.add_insecure_port(f"{host}:{self._port}")
        self._server.start()
        log.info("trajectory stream listening on %s", self.address)
        return self

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._port}"

    def stop(self, grace: float = 5.0) -> None:
        """Stops serving: waiting Submits get UNAVAILABLE (their producers resend), the log is
        synced and closed, and the directory is released."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.stop(grace).wait()
        self._log.close()
        os.close(self._lock_fd)

    def __enter__(self) -> TrajectoryServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _count_unauthenticated(self) -> None:
        with self._cond:
            self._counts["stream/unauthenticated"] += 1

    # -- the learner's side ----------------------------------------------------------------

    def get_batch(self, n: int, timeout: float | None = None) -> list[Trajectory]:
        """Takes n trajectories in arrival order, waiting up to `timeout` seconds for them.

        Returns fewer (possibly none) only if the timeout passes or the server stops. Taken
        trajectories stay in the log until `consumed`: a restart before that queues them again.
        """
        if n > self._maxsize:
            raise ValueError(f"a batch of {n} can never gather in a queue of maxsize "
                             f"{self._maxsize}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._queue) < n and not self._stopping:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(remaining)
            batch = [self._queue.popleft() for _ in range(min(n, len(self._queue)))]
            if batch:
                self._cond.notify_all()  # room for waiting producers
            return batch

    def set_policy_version(self, version: int) -> None:
        """The learner's policy version from now on; Submits sampled by newer weights are
        rejected (module doc, "Versions"). Call it before any engine can sample with `version`
        (before `/update_weights_from_disk`), or their first trajectories are refused (and their
        prompts issued again). Versions never go down: a lower one raises ValueError."""
        version = _version_arg(version)
        with self._cond:
            if self._policy_version is not None and version < self._policy_version:
                raise ValueError(f"policy version {version} is older than the learner's "
                                 f"{self._policy_version}: versions never go down (a resumed "
                                 "learner starts a new server with policy_version=...)")
            self._policy_version = version

    def set_prompt_extra(self, **fields: Any) -> None:
        """Fields added to every prompt's data as it is handed out from now on (e.g. the
        learner's step, for an environment whose reward moves with it). JSON values only."""
        json.dumps(fields)
        self._prompt_extra = dict(fields)

    def iterator_state(self) -> str:
        """The prompt iterator's state after the last lease, as JSON ("" before any)."""
        with self._lease_lock:
            return self._state_json

    def grant_leases(self, n: int) -> None:
        """Allows `n` more fresh prompts to be leased (servers built with a `lease_budget`)."""
        with self._cond:
            if self._lease_budget is None:
                raise ValueError("grant_leases needs a server built with lease_budget=...")
            self._lease_budget += int(n)

    def qsize(self) -> int:
        with self._cond:
            return len(self._queue)

    def unanswered(self) -> int:
        """Prompts on their way to the learner, counted at one instant: granted but not yet
        leased (`grant_leases`), leased but not answered, or answered and queued. A prompt given
        up leaves this count, so a learner that keeps it at a batch grants a replacement."""
        with self._cond:
            return len(self._outstanding) + len(self._queue) + (self._lease_budget or 0)

    def consumed(self, trajectory_ids: Iterable[str]) -> None:
        """Marks trajectories as used by a learner step whose checkpoint is saved: a restart
        never queues them again. Ids consumed before are ignored; unknown ids raise KeyError."""
        self._retire(trajectory_ids, reissue=False, counter="stream/consumed")

    def discard(self, trajectory_ids: Iterable[str]) -> None:
        """Drops trajectories unused (e.g. too stale) and issues their prompts again, under new
        lease ids (the prompts of trajectories that answered a lease; others are only dropped)."""
        self._retire(trajectory_ids, reissue=True, counter="stream/discarded")

    def _retire(self, trajectory_ids: Iterable[str], reissue: bool, counter: str) -> None:
        ids = list(dict.fromkeys(trajectory_ids))
        with self._cond:
            unknown = [t for t in ids if t not in self._unconsumed and t not in self._consumed]
            if unknown:
                raise KeyError(f"{len(unknown)} trajectory ids were never accepted, e.g. "
                               f"{unknown[:3]}")
            fresh = [t for t in ids if t in self._unconsumed]
            if not fresh:
                return
            reissued = []
            if reissue:
                for tid in fresh:
                    prompt = self._fulfilled.get(tid)
                    if prompt is not None:
                        reissued.append(pb.Prompt(lease_id=_reissued_lease_id(prompt.lease_id),
                                                  prompt_id=prompt.prompt_id,
                                                  data_json=prompt.data_json))
            record = pb.LogRecord(consumed=pb.ConsumedRecord(trajectory_ids=fresh,
                                                             reissued=reissued))
            *_, end = self._log.append(record)
            self._log.sync(end)
            fresh_set = set(fresh)
            if any(t.trajectory_id in fresh_set for t in self._queue):
                self._queue = collections.deque(
                    t for t in self._queue if t.trajectory_id not in fresh_set)
                self._cond.notify_all()
            for tid in fresh:
                self._live_bytes -= self._unconsumed.pop(tid)[1]
                self._fulfilled.pop(tid, None)
                self._consumed.add(tid)
            for prompt in reissued:
                self._outstanding[prompt.lease_id] = prompt
                self._pending.append(prompt.lease_id)
            self._counts[counter] += len(fresh)
            self._counts["stream/prompts_reissued"] += len(reissued)
            dead = self._log.size - self._live_bytes
            compact = self._log.size > self._compact_bytes and dead > self._live_bytes
        if compact:
            self.compact()

    def metrics(self) -> dict[str, float]:
        """Counters since start-up, and the queue's state, for the learner's logs."""
        with self._cond:
            out = {key: float(value) for key, value in self._counts.items()}
            out.update({
                "stream/queue_size": float(len(self._queue)),
                "stream/queue_max_seen": float(self._queue_max_seen),
                "stream/submit_wait_s": self._wait_s,
                "stream/outstanding_leases": float(len(self._outstanding)),
                "stream/log_bytes": float(self._log.size),
            })
            for key in ("accepted", "duplicates", "rejected", "submits_waited", "leased",
                        "consumed", "discarded", "unauthenticated", "episodes_failed",
                        "prompts_given_up", "replay_discarded_newer", "invalid_requests"):
                out.setdefault(f"stream/{key}", 0.0)
            return out

    # -- RPCs --------------------------------------------------------------------------------

    def Submit(self, request: pb.Trajectory, context: grpc.ServicerContext) -> pb.Ack:
        tid = request.trajectory_id
        spend_attempt = True  # a rejection is one of the lease's attempts, unless...
        try:
            trajectory = Trajectory.from_proto(request)
            trajectory.validate(self._vocab_size, self._max_length)
            error = self._lease_error(trajectory)
            if error is None:
                error = self._version_error(trajectory)
                spend_attempt = False  # ...the learner is behind: the prompt is not at fault
        except TrajectoryError as e:
            error = e
        if error is not None:
            with self._cond:
                self._counts["stream/rejected"] += 1
                self._counts[f"stream/rejected/{error.field}"] += 1
                self._retry_lease(request.lease_id, spend_attempt)
            log.warning("rejected trajectory %r: %s", clip(tid, 40), error)
            return pb.Ack(trajectory_id=clip(tid, MAX_ID_CHARS), status=pb.Ack.REJECTED,
                          field=error.field, message=error.message)

        with self._cond:
            while tid in self._inflight:  # a resend racing its original: wait for its outcome
                self._wait(context)
            if tid in self._unconsumed or tid in self._consumed:
                self._counts["stream/duplicates"] += 1
                return pb.Ack(trajectory_id=tid, status=pb.Ack.DUPLICATE)
            self._inflight.add(tid)
            try:
                start = time.monotonic()
                waited = False
                while len(self._queue) + self._reserved >= self._maxsize or self._compacting:
                    waited = True
                    self._wait(context)
            except BaseException:
                self._inflight.discard(tid)
                self._cond.notify_all()
                raise
            self._reserved += 1
            if waited:
                self._counts["stream/submits_waited"] += 1
                self._wait_s += time.monotonic() - start

        location = None
        offset = None
        try:
            with self._cond:  # append order = queue order, so a replay queues the same order
                offset, length, end = self._log.append(pb.LogRecord(accepted=request))
                self._landing[offset] = None
            self._log.sync(end)
            location = (offset, length)
        except ValueError:  # the log closed under us: stopping
            pass
        finally:
            with self._cond:
                self._inflight.discard(tid)
                if offset is None:
                    self._reserved -= 1
                else:
                    self._landing[offset] = (trajectory, location)
                    self._land()  # releases the reservation of every entry it drains
                self._cond.notify_all()
        if location is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the learner is stopping; resend")
        return pb.Ack(trajectory_id=tid, status=pb.Ack.ACCEPTED)

    def _wait(self, context: grpc.ServicerContext) -> None:
        """One wait on the condition (held), giving up if the server stops or the caller left."""
        if self._stopping:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the learner is stopping; resend")
        if not context.is_active():
            context.abort(grpc.StatusCode.CANCELLED, "the caller went away")
        self._cond.wait(_POLL_S)

    def _lease_error(self, trajectory: Trajectory) -> TrajectoryError | None:
        """A trajectory answering an outstanding lease must be about that lease's prompt."""
        with self._cond:
            prompt = self._outstanding.get(trajectory.lease_id)
        if prompt is None or prompt.prompt_id == trajectory.prompt_id:
            return None
        return TrajectoryError("prompt_id", f"{clip(trajectory.prompt_id, 40)!r} is not the "
                                            f"prompt of lease {trajectory.lease_id!r} "
                                            f"({clip(prompt.prompt_id, 40)!r})")

    def _version_error(self, trajectory: Trajectory) -> TrajectoryError | None:
        """A (valid) trajectory sampled by weights newer than the learner's policy is refused."""
        limit = self._policy_version
        newest = _newest_version(trajectory)
        if limit is None or newest <= limit:
            return None
        position = int(np.flatnonzero(trajectory.action_mask
                                      & (trajectory.weight_versions == newest))[0])
        return TrajectoryError(
            "weight_versions", f"version {newest} on action token at position {position} is "
                               f"newer than the learner's policy version {limit}: an engine "
                               "holds weights this learner never published (from beyond the "
                               "checkpoint it resumed from?)")

    def _retry_lease(self, lease_id: str, spend_attempt: bool = True) -> bool:
        """A rejected answer or a failed episode frees its lease for another attempt (held: the
        condition), up to `_MAX_ATTEMPTS` in all; then the prompt is given up and counted.
        `spend_attempt=False` issues it again without counting an attempt. Returns whether the
        lease will be issued again."""
        if lease_id not in self._outstanding or lease_id in self._pending:
            return False
        self._handed.pop(lease_id, None)
        if spend_attempt:
            self._failed_attempts[lease_id] += 1
        if self._failed_attempts[lease_id] >= _MAX_ATTEMPTS:
            del self._outstanding[lease_id]  # not logged: a restart would offer it once more
            self._counts["stream/prompts_given_up"] += 1
            self._cond.notify_all()  # wakes a learner waiting for a batch (`unanswered`)
            return False
        self._pending.append(lease_id)
        return True

    def ReportFailure(self, request: pb.EpisodeFailure,
                      context: grpc.ServicerContext) -> pb.FailureAck:
        self._check_lengths(context, request, "EpisodeFailure", ("lease_id", "prompt_id",
                                                                 "worker_id"))
        with self._cond:
            self._counts["stream/episodes_failed"] += 1
            reissued = self._retry_lease(request.lease_id)
        log.warning("%s: the episode of prompt %r (lease %s) failed%s: %s", request.worker_id,
                    request.prompt_id, request.lease_id,
                    "" if reissued else "; the prompt is given up",
                    clip(request.error, _ERROR_LOG_CHARS))
        return pb.FailureAck(reissued=reissued)

    def _check_lengths(self, context: grpc.ServicerContext, request, message: str,
                       fields: tuple[str, ...]) -> None:
        """Refuses a request whose named string fields exceed `MAX_ID_CHARS`: INVALID_ARGUMENT
        naming the field and the limit."""
        for name in fields:
            try:
                check_length(f"{message}.{name}", getattr(request, name), MAX_ID_CHARS)
            except TrajectoryError as e:
                with self._cond:
                    self._counts["stream/invalid_requests"] += 1
                log.warning("refused a %s: %s", message, e)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _land(self) -> None:
        """Queues synced trajectories in log order (held: the condition): one whose fsync
        finished early waits for those appended before it."""
        while self._landing:
            offset, landed = next(iter(self._landing.items()))
            if landed is None:
                return
            del self._landing[offset]
            self._reserved -= 1
            trajectory, location = landed
            if location is not None:
                self._accept(trajectory, location)

    def _accept(self, trajectory: Trajectory, location: tuple[int, int]) -> None:
        tid = trajectory.trajectory_id
        self._unconsumed[tid] = location
        self._live_bytes += location[1]
        self._queue.append(trajectory)
        self._queue_max_seen = max(self._queue_max_seen, len(self._queue))
        self._counts["stream/accepted"] += 1
        prompt = self._outstanding.pop(trajectory.lease_id, None)
        if prompt is not None:
            self._fulfilled[tid] = prompt
            self._handed.pop(trajectory.lease_id, None)
        elif trajectory.lease_id:
            self._counts["stream/answers_to_closed_leases"] += 1

    def LeasePrompts(self, request: pb.LeaseRequest,
                     context: grpc.ServicerContext) -> pb.LeaseReply:
        self._check_lengths(context, request, "LeaseRequest", ("worker_id",))
        if self._iterator is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this learner has no prompt source")
        n = min(request.n, _MAX_LEASE)
        with self._lease_lock:
            now = time.monotonic()
            with self._cond:
                if self._lease_timeout_s is not None:
                    for lease_id, handed_at in list(self._handed.items()):
                        if now - handed_at > self._lease_timeout_s:
                            del self._handed[lease_id]
                            if lease_id in self._outstanding:
                                self._pending.append(lease_id)
                                self._counts["stream/leases_expired"] += 1
                prompts = []
                while len(prompts) < n and self._pending:
                    lease_id = self._pending.popleft()
                    if lease_id in self._outstanding:
                        prompts.append(self._outstanding[lease_id])
                self._counts["stream/leases_reissued"] += len(prompts)
                room = n
                if self._max_in_flight is not None:
                    in_flight = len(self._outstanding) + len(self._queue)
                    room = max(0, min(n, self._max_in_flight - in_flight))
                    if room < n - len(prompts):
                        self._counts["stream/leases_held_back"] += n - len(prompts) - room
                if self._lease_budget is not None:
                    room = min(room, self._lease_budget)

            fresh = []
            exhausted = self._exhausted
            while len(prompts) + len(fresh) < n and len(fresh) < room and not exhausted:
                try:
                    element = next(self._iterator)
                except StopIteration:
                    exhausted = True
                    break
                group = uuid.uuid4().hex
                if self._group_size == 1:
                    fresh.append(_prompt_message(element, group))
                else:
                    fresh.extend(_prompt_message(element, f"{group}-{k}")
                                 for k in range(self._group_size))
            if fresh or exhausted != self._exhausted:
                state_json = _encode_state(self._iterator.get_state())
                record = pb.LeaseRecord(prompts=fresh, iterator_state_json=state_json,
                                        iterator_exhausted=exhausted)
                *_, end = self._log.append(pb.LogRecord(leased=record))
                self._log.sync(end)
                self._state_json, self._exhausted = state_json, exhausted

            with self._cond:
                if self._lease_budget is not None:
                    self._lease_budget -= len(fresh)
                for prompt in fresh:
                    self._outstanding[prompt.lease_id] = prompt
                prompts.extend(fresh)
                for prompt in prompts:
                    self._handed[prompt.lease_id] = now
                self._counts["stream/leased"] += len(fresh)
                done = self._exhausted and not self._outstanding
        log.debug("leased %d prompts to %r", len(prompts), request.worker_id)
        extra = self._prompt_extra
        if extra:  # the learner's current context, as of handing out (not logged)
            prompts = [pb.Prompt(lease_id=p.lease_id, prompt_id=p.prompt_id,
                                 data_json=json.dumps({**json.loads(p.data_json), **extra},
                                                      sort_keys=True))
                       for p in prompts]
        return pb.LeaseReply(prompts=prompts, exhausted=done)


# ---------------------------------------------------------------------------------------------
# The worker's client.


class TrajectoryClient:
    """A rollout worker's connection to the learner. Thread-safe; one per process is enough.

    Calls block (a submit for as long as the learner applies backpressure): from asyncio code, call
    them through `asyncio.to_thread`.

    Args:
      address: the learner's "host:port".
      token: sent as `authorization: Bearer <token>` metadata when set.
      retry_timeout_s: keep retrying an UNAVAILABLE server (e.g. restarting) this long.
      max_message_bytes: gRPC message limit, both directions.
    """

    def __init__(self, address: str, *, token: str | None = None, retry_timeout_s: float = 60.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   # Reconnect to a restarted learner within a second or two, not minutes.
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 2000)]
        self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.TrajectoryServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._retry_timeout_s = retry_timeout_s

    def _call(self, method, request, timeout: float | None):
        deadline = time.monotonic() + self._retry_timeout_s
        delay = 0.05
        while True:
            try:
                return method(request, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, 2.0)

    def submit(self, trajectory: Trajectory, timeout: float | None = None) -> Ack:
        """Sends a trajectory; returns once the learner has recorded it (or rejected it).

        Blocks while the learner's queue is full (backpressure). `timeout` bounds each attempt
        (None: wait as long as the learner makes us).
        """
        reply = self._call(self._stub.Submit, trajectory.to_proto(), timeout)
        return Ack(reply.trajectory_id, _ACK_STATUS.get(reply.status, "rejected"), reply.field,
                   reply.message)

    def lease_prompts(self, n: int, worker_id: str = "",
                      timeout: float | None = 60.0) -> list[LeasedPrompt]:
        """Leases up to n prompts (fewer, or none, while others hold the rest).

        Raises `PromptsExhausted` when nothing more will ever be issued.
        """
        reply = self._call(self._stub.LeasePrompts, pb.LeaseRequest(n=n, worker_id=worker_id),
                           timeout)
        if reply.exhausted and not reply.prompts:
            raise PromptsExhausted("the learner's prompt source is finished")
        return [LeasedPrompt(p.lease_id, p.prompt_id, json.loads(p.data_json))
                for p in reply.prompts]

    def report_failure(self, lease_id: str, prompt_id: str, error: str, worker_id: str = "",
                       timeout: float | None = 60.0) -> bool:
        """Tells the learner that the episode of a lease failed (its environment raised);
        returns whether the lease will be issued again (False: the prompt is given up)."""
        reply = self._call(self._stub.ReportFailure, pb.EpisodeFailure(
            lease_id=lease_id, prompt_id=prompt_id, error=error[:2000], worker_id=worker_id),
            timeout)
        return reply.reissued

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TrajectoryClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
