"""The learner's append-only trajectory log (`TrajectoryLog`) and what it says (`Ledger`).

The file (`<workdir>/trajectories.log`, `sao_jax/rollout/proto/README.md`): the magic
`SAOLOG2\\n`, then frames of `uint32 LE length | uint32 LE crc32 | uint32 LE crc32 of those 8
bytes | LogRecord bytes`. Writers append and fsync by group commit (`append`, `sync`); a torn tail
is cut off when the log is read, and a bad frame with data after it is refused
(`CorruptLogError`). A log of the first format (`SAOLOG1\\n`, before trajectories and prompts
carried `group_id` and `prompt_index`) is refused with `OldLogFormatError`, which says how to go
on: nothing in it says which group or prompt row a record belongs to but a lease id that no
longer means anything.

Readers outside the server (the fault harness, the benchmarks) use `TrajectoryLog.records` and
`Ledger.read`; the server rebuilds its own richer state from the same records.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator

from sao_jax.rollout.proto import trajectory_pb2 as pb

log = logging.getLogger(__name__)

LOG_NAME = "trajectories.log"
MAGIC = b"SAOLOG2\n"
_OLD_MAGIC = b"SAOLOG1\n"
# A frame: payload length, crc32 of the payload, crc32 of those 8 bytes; then the payload.
_FRAME = struct.Struct("<III")


class CorruptLogError(RuntimeError):
    """The log has a damaged frame that is not its last one: refuse to guess."""


class OldLogFormatError(RuntimeError):
    """The log was written before prompts and trajectories carried `group_id` and
    `prompt_index`."""


class TrajectoryLog:
    """Length-prefixed, checksummed `LogRecord` frames in one file; fsync by group commit.

    Reading (`frames`, `records`) needs no `open`; appending does, and `close` ends it.
    """

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
        after it raises `CorruptLogError` rather than guess; a log of the first format raises
        `OldLogFormatError`.
        """
        if not os.path.exists(self.path) or os.path.getsize(self.path) < len(MAGIC):
            return
        with open(self.path, "rb") as f:
            magic = f.read(len(MAGIC))
            if magic == _OLD_MAGIC:
                raise OldLogFormatError(
                    f"{self.path} was written by an older sao_jax, before prompts and "
                    "trajectories carried group_id and prompt_index: its records cannot say "
                    "which group or prompt row they belong to. Finish that run with the version "
                    "that started it, or move the stream directory "
                    f"({os.path.dirname(self.path) or '.'}) aside and resume: the run goes on "
                    "from its checkpoint with a fresh stream, the prompt iterator from the "
                    "checkpoint's state (prompts leased and not yet trained on at that "
                    "checkpoint are skipped).")
            if magic != MAGIC:
                raise CorruptLogError(f"{self.path} is not a trajectory log (bad magic)")
            size = os.fstat(f.fileno()).st_size
            offset = len(MAGIC)
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

    def records(self) -> Iterator[pb.LogRecord]:
        """Every whole record, in order (`frames`, decoded)."""
        for _, _, payload in self.frames():
            yield pb.LogRecord.FromString(payload)

    def open(self) -> None:
        """Opens for appending; a missing or empty file starts a new log."""
        if not os.path.exists(self.path) or os.path.getsize(self.path) < len(MAGIC):
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
            self._file.write(frame_header(payload))
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
            f.write(MAGIC)
            offset = len(MAGIC)
            for payload in payloads:
                f.write(frame_header(payload))
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

    def compact(self, snapshot: pb.Snapshot, prompts: list[pb.Prompt],
                kept: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        """Rewrites the log (`rewrite`) as all a restart needs: `snapshot`, the leases of
        `prompts`, and the accepted records at `kept` (trajectory id -> `(offset, length)`);
        returns the kept records' new locations. Callers hold off appends while this runs."""
        ids = list(kept)

        def payloads():
            yield pb.LogRecord(snapshot=snapshot).SerializeToString()
            if prompts:
                yield pb.LogRecord(leased=pb.LeaseRecord(prompts=prompts)).SerializeToString()
            for tid in ids:
                yield self.read(*kept[tid])

        locations = self.rewrite(payloads())
        return dict(zip(ids, locations[len(locations) - len(ids):], strict=True))

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


@dataclasses.dataclass
class Ledger:
    """The log's account of every trajectory and lease, as a reader outside the server sees it.

    Attributes:
      accepted: ids of trajectories ever durably recorded (a compacted log keeps the retired ones
        in its snapshot).
      retired: ids the learner declared consumed or discarded.
      issued: lease ids handed out (fresh, or in place of a discarded trajectory).
      answered: lease ids that an accepted trajectory answers.
      leased_to: fresh lease id -> the worker it was handed to ("" if the worker gave no id;
        leases rewritten by a compaction keep no worker).
      answered_by: lease id -> the workers whose accepted trajectories answer it (two when a
        lease expired and both of its holders answered).
    """

    accepted: set[str] = dataclasses.field(default_factory=set)
    retired: set[str] = dataclasses.field(default_factory=set)
    issued: set[str] = dataclasses.field(default_factory=set)
    answered: set[str] = dataclasses.field(default_factory=set)
    leased_to: dict[str, str] = dataclasses.field(default_factory=dict)
    answered_by: dict[str, set[str]] = dataclasses.field(default_factory=dict)

    @property
    def pending(self) -> set[str]:
        """Accepted trajectories neither consumed nor discarded."""
        return self.accepted - self.retired

    @property
    def unanswered(self) -> set[str]:
        """Leases issued that no accepted trajectory answers yet (a compacted log keeps the
        outstanding ones and those of pending trajectories)."""
        return self.issued - self.answered

    @classmethod
    def read(cls, path: str) -> Ledger:
        """The ledger of the log at `path` (a stream directory's `LOG_NAME`)."""
        ledger = cls()
        for record in TrajectoryLog(path).records():
            kind = record.WhichOneof("kind")
            if kind == "snapshot":
                ledger.accepted.update(record.snapshot.consumed_ids)
                ledger.retired.update(record.snapshot.consumed_ids)
            elif kind == "leased":
                ledger.issued.update(p.lease_id for p in record.leased.prompts)
                ledger.leased_to.update((p.lease_id, record.leased.worker_id)
                                        for p in record.leased.prompts)
            elif kind == "accepted":
                ledger.accepted.add(record.accepted.trajectory_id)
                ledger.answered.add(record.accepted.lease_id)
                ledger.answered_by.setdefault(record.accepted.lease_id, set()).add(
                    record.accepted.worker_id)
            elif kind == "consumed":
                ledger.retired.update(record.consumed.trajectory_ids)
                ledger.issued.update(p.lease_id for p in record.consumed.reissued)
        return ledger


def _only_zeros_left(f) -> bool:
    while chunk := f.read(2**20):
        if chunk.strip(b"\0"):
            return False
    return True


def frame_header(payload: bytes) -> bytes:
    """The 12 bytes that precede `payload` in the log."""
    head = struct.pack("<II", len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head))


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
