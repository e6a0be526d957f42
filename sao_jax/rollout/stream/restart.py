"""A trajectory server's start-up from its directory (`sao_jax.rollout.stream`, "Restart"): the
lock that keeps the directory one server's (`lock_directory`), what the log says the server held
when it stopped (`replay`), and the prompt iterator resumed where the log left it
(`resume_prompts`).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from sao_jax.rollout.proto import trajectory_pb2 as pb
from sao_jax.rollout.stream.leases import Leases, decode_state
from sao_jax.rollout.stream.log import TrajectoryLog
from sao_jax.rollout.trajectory import Trajectory

log = logging.getLogger("sao_jax.rollout.stream.server")  # the server's logger: its messages

_LOCK_NAME = "trajectories.lock"


def lock_directory(workdir: str) -> int:
    """Creates `workdir` if needed and locks it for this server; returns the lock's file
    descriptor (closing it releases the lock). RuntimeError if another server holds it."""
    os.makedirs(workdir, exist_ok=True)
    fd = os.open(os.path.join(workdir, _LOCK_NAME), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"another TrajectoryServer is using {workdir}") from None
    return fd


class Replayed(NamedTuple):
    """What a log says its server held.

    Attributes:
      queue: the accepted trajectories not consumed, in the order they were accepted.
      unconsumed: their ids -> `(offset, length)` of their records in the log.
      consumed: the ids of the trajectories consumed.
      iterator_state_json: the prompt iterator's state after the last lease ("" before any).
      exhausted: whether the prompt iterator had run out.
    """

    queue: list[Trajectory]
    unconsumed: dict[str, tuple[int, int]]
    consumed: set[str]
    iterator_state_json: str
    exhausted: bool


def replay(trajectory_log: TrajectoryLog, leases: Leases) -> Replayed:
    """Reads `trajectory_log` from its start: the leases it records go into `leases` (those
    outstanding pending, to be issued again), the rest comes back."""
    state_json, exhausted = "", False
    accepted: dict[str, pb.Trajectory] = {}
    unconsumed: dict[str, tuple[int, int]] = {}
    consumed: set[str] = set()
    records = 0
    for offset, length, payload in trajectory_log.frames():
        records += 1
        record = pb.LogRecord.FromString(payload)
        kind = record.WhichOneof("kind")
        if kind == "snapshot":
            consumed.update(record.snapshot.consumed_ids)
            state_json = record.snapshot.iterator_state_json
            exhausted = record.snapshot.iterator_exhausted
            leases.next_group_id = max(leases.next_group_id, record.snapshot.next_group_id)
        elif kind == "leased":
            leases.add(record.leased.prompts, pending=False)
            if record.leased.iterator_state_json:
                state_json = record.leased.iterator_state_json
                exhausted = record.leased.iterator_exhausted
        elif kind == "accepted":
            tid = record.accepted.trajectory_id
            accepted[tid] = record.accepted
            unconsumed[tid] = (offset, length)
            leases.answer(record.accepted.lease_id, tid)
        elif kind == "consumed":
            for tid in record.consumed.trajectory_ids:
                accepted.pop(tid, None)
                unconsumed.pop(tid, None)
                leases.retire(tid)
                consumed.add(tid)
            leases.add(record.consumed.reissued, pending=False)
    queue = [Trajectory.from_proto(msg) for msg in accepted.values()]
    reissue = leases.pend_all()
    if records:
        log.info("trajectory log %s: %d records; %d accepted trajectories to use, %d used, "
                 "%d leases to issue again", trajectory_log.path, records, len(queue),
                 len(consumed), reissue)
    return Replayed(queue, unconsumed, consumed, state_json, exhausted)


def resume_prompts(prompts: Iterable[Any], state_json: str) -> Iterator[Any]:
    """An iterator over `prompts`, set to `state_json` (an `encode_state` text; "": as it
    starts). TypeError if it cannot tell its state (`get_state()` / `set_state()`)."""
    iterator = iter(prompts)
    if not (hasattr(iterator, "get_state") and hasattr(iterator, "set_state")):
        raise TypeError("the prompt source's iterator needs get_state() and "
                        "set_state() (e.g. a grain IterDataset)")
    if state_json:
        iterator.set_state(decode_state(state_json))
    return iterator
