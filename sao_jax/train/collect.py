"""Batches from the trajectory stream: whole groups of fresh trajectories, in arrival order
(`BatchCollector`); sync mode's one batch of prompts at a time (`grant_one_batch`)."""

from __future__ import annotations

import collections
import time

from sao_jax.rollout.stream import TrajectoryServer
from sao_jax.rollout.trajectory import Trajectory


def policy_lag(trajectory: Trajectory, version: int) -> int:
    """Policy versions between the trajectory's oldest action token and `version`."""
    versions = trajectory.weight_versions[trajectory.action_mask]
    return int(version - versions.min()) if versions.size else 0


class BatchCollector:
    """Takes trajectories in arrival order and forms batches of whole groups of fresh ones.

    A group is the trajectories sharing a `group_id` (the leases of one prompt draw); one without
    a group is a group of its own. Trajectories of incomplete groups wait here (they are not
    consumed, so a restart queues them again). A trajectory more than `max_staleness` versions old
    is discarded and its prompt is issued again (in the same group); `stale` counts those of the
    last `collect`.
    """

    def __init__(self, server: TrajectoryServer, batch_size: int, group_size: int,
                 max_staleness: int):
        self.server = server
        self.batch_size, self.group_size = batch_size, group_size
        self.max_staleness = max_staleness
        # group_id (or, for a trajectory of no group, its id) -> its trajectories so far
        self.groups: dict[int | str, list[Trajectory]] = collections.OrderedDict()
        self.complete: list[list[Trajectory]] = []
        self.stale = 0  # trajectories the last `collect` discarded as stale

    def collect(self, version: int, poll) -> tuple[list[Trajectory], float]:
        """`(batch, seconds waited)`; `poll()` runs while it waits, and aborts it by raising.
        `stale` then counts the trajectories it discarded as stale."""
        waited = 0.0
        self.stale = 0
        need = self.batch_size // self.group_size
        while len(self.complete) < need:
            poll()
            missing = (need - len(self.complete)) * self.group_size - sum(
                len(g) for g in self.groups.values())
            take = max(1, min(missing, self.batch_size)) if self.group_size == 1 else 1
            start = time.monotonic()
            got = self.server.get_batch(take, timeout=0.5 if take > 1 else 0.2)
            waited += time.monotonic() - start
            stale = [t for t in got if policy_lag(t, version) > self.max_staleness]
            if stale:
                self.server.discard([t.trajectory_id for t in stale])
                self.stale += len(stale)
            for t in got:
                if t in stale:
                    continue
                key = t.trajectory_id if t.group_id is None else t.group_id
                group = self.groups.setdefault(key, [])
                group.append(t)
                if len(group) == self.group_size:
                    self.complete.append(self.groups.pop(key))
        batch = [t for group in self.complete[:need] for t in group]
        self.complete = self.complete[need:]
        return batch, waited

    def held(self) -> int:
        """Trajectories taken from the server and not yet in a batch."""
        return sum(map(len, self.groups.values())) + sum(map(len, self.complete))


def grant_one_batch(server: TrajectoryServer, batch_size: int, held: int = 0) -> int:
    """Sync mode: grants prompts until one batch of `batch_size` is on its way (granted, leased,
    queued, or among the `held` trajectories collected), also after a prompt is given up
    mid-step; returns how many it granted."""
    missing = batch_size - held - server.unanswered()
    if missing > 0:
        server.grant_leases(missing)
    return max(0, missing)
