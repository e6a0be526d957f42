"""The learner's end of the trajectory stream (`TrajectoryServer`); see `sao_jax.rollout.stream`
for what it promises. The RPCs workers call are in service.py (`TrajectoryService`, which
`TrajectoryServer` mixes in); the server listens through a `network.Listener`, starts from its
directory with `restart.py` (the lock, the log's replay, the prompt iterator resumed) and keeps
the learner's limits in an `admission.Admission`. This module holds the state they share, the
log's upkeep (compaction, retiring trajectories) and the learner's side."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from sao_jax.rollout.proto import trajectory_pb2 as pb
from sao_jax.rollout.stream.admission import Admission, newest_version
from sao_jax.rollout.stream.client import DEFAULT_MAX_MESSAGE_BYTES
from sao_jax.rollout.stream.leases import Leases
from sao_jax.rollout.stream.log import LOG_NAME, TrajectoryLog
from sao_jax.rollout.stream.network import Listener
from sao_jax.rollout.stream.restart import lock_directory, replay, resume_prompts
from sao_jax.rollout.stream.service import TrajectoryService
from sao_jax.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)

class TrajectoryServer(TrajectoryService):
    """The learner's end of the stream: a bounded queue of durably accepted trajectories.

    Args:
      workdir: where the log lives; reopening the same directory resumes (see the module doc).
        One server per directory at a time (a file lock enforces it).
      vocab_size: token ids must lie in [0, vocab_size).
      prompts: the prompt source: an iterable whose iterator has `get_state()` / `set_state()`
        (e.g. `grain.MapDataset.source(rows).shuffle(seed=0).repeat().to_iter_dataset()`), yielding
        mappings. Give the same source on every restart. None: LeasePrompts is refused.
      max_length: prompt + response tokens allowed (None: no limit).
      routes: `(layers, top_k, num_experts)` a trajectory's `routed_experts` must fit, or None.
      maxsize: accepted trajectories the queue holds before producers wait.
      host, port, token, max_workers, max_message_bytes, handshake_timeout_s, idle_timeout_s,
        max_connections: where and how it listens, and the token every call must carry
        (`network.Listener`, which says what each means); binding a non-loopback host requires
        a token.
      lease_timeout_s: re-issue a lease not answered within this time (None: only at restarts).
      compact_bytes: compact the log once it exceeds this and is mostly dead records.
      max_in_flight: staleness control by admission (AReaL): fresh prompts are leased only while
        unanswered leases plus accepted-but-unconsumed trajectories number fewer than this. With
        `(max_staleness + 1) * batch_size`, a prompt leased while the learner is at step i is
        consumed by step i + max_staleness + 1 at the latest. None: no limit. Re-issued leases
        are always handed out.
      group_size: each prompt drawn from the source is leased this many times, as a group: its
        leases share one integer `group_id` (a re-issued lease keeps it). GRPO batches hold whole
        groups.
      iterator_state: the prompt iterator's state (`iterator_state()` of an earlier server) to
        start from when the log holds none, e.g. from a learner checkpoint whose stream
        directory was lost. The log's state wins when there is one.
      lease_budget: None, or how many fresh prompts may be leased before `grant_leases` allows
        more (the synchronous learner grants one batch at a time). Re-issued leases are always
        handed out.
      policy_version: required: the learner's policy version at start (its checkpoint's, on a
        resume), before anything is accepted: newer submits are rejected, and (with
        `discard_newer`) replayed trajectories newer than it are discarded and their prompts
        issued again (module doc, "Versions"). None, said explicitly: versions are not compared
        (tests, benchmarks).
      discard_newer: what replayed trajectories newer than `policy_version` meet at start-up:
        True, discarded; False, kept in their place in the queue, for a consumer that redoes the
        steps after its checkpoint on the same data and so reaches their versions again before
        it takes them (the learner: module doc, "Versions").
    """

    def __init__(self, workdir: str, *, vocab_size: int, prompts: Iterable[Any] | None = None,
                 max_length: int | None = None, routes: tuple[int, int, int] | None = None,
                 maxsize: int = 256, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, lease_timeout_s: float | None = None,
                 max_workers: int = 64, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 compact_bytes: int = 2**30, max_in_flight: int | None = None,
                 lease_budget: int | None = None, group_size: int = 1,
                 iterator_state: str | None = None, policy_version: int | None,
                 discard_newer: bool = True,
                 handshake_timeout_s: float = 10.0, idle_timeout_s: float | None = 120.0,
                 max_connections: int = 256):
        if maxsize < 1:
            raise ValueError(f"maxsize must be at least 1, got {maxsize}")
        self._admission = Admission(max_in_flight=max_in_flight, lease_budget=lease_budget,
                                    policy_version=policy_version)
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        self._group_size = group_size
        self._listener = Listener(host, port, token=token, max_workers=max_workers,
                                  max_message_bytes=max_message_bytes,
                                  handshake_timeout_s=handshake_timeout_s,
                                  idle_timeout_s=idle_timeout_s, max_connections=max_connections)
        self._limits = (vocab_size, max_length, routes)  # `Trajectory.validate`'s, per submit
        self._maxsize = maxsize
        self._lease_timeout_s = lease_timeout_s
        self._compact_bytes = compact_bytes

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
        self._leases = Leases()
        self._live_bytes = 0
        self._stopping = False
        self._compacting = False
        self._counts: collections.Counter[str] = collections.Counter()
        self._queue_max_seen = 0
        self._wait_s = 0.0

        self._lock_fd = lock_directory(workdir)
        try:
            self._log = TrajectoryLog(os.path.join(workdir, LOG_NAME))
            replayed = replay(self._log, self._leases)
            self._queue.extend(replayed.queue)
            self._unconsumed.update(replayed.unconsumed)
            self._consumed.update(replayed.consumed)
            self._state_json, self._exhausted = replayed.iterator_state_json, replayed.exhausted
            self._iterator = None
            if prompts is not None:
                self._iterator = resume_prompts(prompts, self._state_json or iterator_state or "")
            self._log.open()
            if policy_version is not None and discard_newer:
                self._drop_newer(policy_version)
            self.compact()
        except BaseException:
            self._log.close()
            os.close(self._lock_fd)
            raise

    # -- restart ---------------------------------------------------------------------------

    def _drop_newer(self, version: int) -> None:
        """Discards replayed trajectories sampled by weights newer than `version` (module doc,
        "Versions"), issuing their prompts again."""
        newer = [t.trajectory_id for t in self._queue if newest_version(t) > version]
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
                                       iterator_exhausted=self._exhausted,
                                       next_group_id=self._leases.next_group_id)
                self._unconsumed.update(self._log.compact(snapshot, self._leases.live_prompts(),
                                                          self._unconsumed))
                self._live_bytes = self._log.size
                self._counts["stream/compactions"] += 1
            finally:
                self._compacting = False
                self._cond.notify_all()

    # -- network ---------------------------------------------------------------------------

    def start(self) -> TrajectoryServer:
        """Binds and starts serving; returns self."""
        self._listener.start(self, on_unauthenticated=self._count_unauthenticated)
        return self

    @property
    def port(self) -> int:
        return self._listener.port

    @property
    def address(self) -> str:
        return self._listener.address

    def stop(self, grace: float = 5.0) -> None:
        """Stops serving: waiting Submits get UNAVAILABLE (their producers resend), the log is
        synced and closed, and the directory is released."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify_all()
        self._listener.stop(grace)
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
        with self._cond:
            self._admission.set_policy_version(version)

    def set_learner_step(self, step: int) -> None:
        """The learner's step from now on: every prompt handed out carries it
        (`Prompt.learner_step`), for an environment whose reward moves with training. Not
        logged: a prompt issued again carries the step of its new hand-out."""
        self._admission.set_learner_step(step)

    def iterator_state(self) -> str:
        """The prompt iterator's state after the last lease, as JSON ("" before any)."""
        with self._lease_lock:
            return self._state_json

    def grant_leases(self, n: int) -> None:
        """Allows `n` more fresh prompts to be leased (servers built with a `lease_budget`)."""
        with self._cond:
            self._admission.grant(n)

    def qsize(self) -> int:
        with self._cond:
            return len(self._queue)

    def unanswered(self) -> int:
        """Prompts on their way to the learner, counted at one instant: granted but not yet
        leased (`grant_leases`), leased but not answered, or answered and queued. A prompt given
        up leaves this count, so a learner that keeps it at a batch grants a replacement."""
        with self._cond:
            return len(self._leases) + len(self._queue) + self._admission.granted

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
                    prompt = self._leases.reissue(tid)
                    if prompt is not None:
                        reissued.append(prompt)
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
                self._leases.retire(tid)
                self._consumed.add(tid)
            self._leases.add(reissued, pending=True)
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
                "stream/outstanding_leases": float(len(self._leases)),
                "stream/log_bytes": float(self._log.size),
            })
            for key in ("accepted", "duplicates", "rejected", "submits_waited", "leased",
                        "consumed", "discarded", "unauthenticated", "episodes_failed",
                        "prompts_given_up", "replay_discarded_newer", "invalid_requests",
                        "give_backs_ignored"):
                out.setdefault(f"stream/{key}", 0.0)
            return out
