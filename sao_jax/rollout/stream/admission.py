"""What the learner lets into the trajectory stream (`Admission`): fresh prompts while few enough
are on their way (staleness control by admission, AReaL) and within the budget it grants,
trajectories sampled by weights no newer than its policy version (`sao_jax.rollout.stream`,
"Versions"), and its step on every prompt handed out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sao_jax.rollout.proto import trajectory_pb2 as pb
from sao_jax.rollout.trajectory import Trajectory, TrajectoryError


def newest_version(trajectory: Trajectory) -> int:
    """The newest weight version that sampled an action token of `trajectory` (-1: none)."""
    versions = trajectory.weight_versions[trajectory.action_mask]
    return int(versions.max()) if versions.size else -1


def _version_arg(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
        raise TypeError(f"a policy version is an int, got {type(version).__name__}")
    if version < 0:
        raise ValueError(f"a policy version is >= 0, got {version}")
    return int(version)


class Admission:
    """The learner's limits on the stream; `TrajectoryServer` reads and changes them under its
    condition (its arguments of the same names say what each means).

    Args:
      max_in_flight: fresh prompts are leased only while fewer than this are on their way
        (None: no limit).
      lease_budget: fresh prompts that may be leased until `grant` allows more (None: no
        budget).
      policy_version: the learner's policy version (None: versions are not compared).
    """

    def __init__(self, *, max_in_flight: int | None, lease_budget: int | None,
                 policy_version: int | None):
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1 (or None), got {max_in_flight}")
        if lease_budget is not None and lease_budget < 0:
            raise ValueError(f"lease_budget must be >= 0 (or None), got {lease_budget}")
        self._max_in_flight = max_in_flight
        self._lease_budget = lease_budget
        self._policy_version = None if policy_version is None else _version_arg(policy_version)
        self._learner_step: int | None = None  # stamped on prompts as they are handed out

    # -- fresh prompts ---------------------------------------------------------------------

    def in_flight_room(self, n: int, in_flight: int) -> int:
        """How many of `n` fresh prompts `max_in_flight` lets out while `in_flight` prompts
        (leased and unanswered, or answered and queued) are on their way."""
        if self._max_in_flight is None:
            return n
        return max(0, min(n, self._max_in_flight - in_flight))

    def within_budget(self, room: int) -> int:
        """`room` cut to the lease budget left."""
        return room if self._lease_budget is None else min(room, self._lease_budget)

    def spend(self, n: int) -> None:
        """`n` fresh prompts were leased: they come off the budget."""
        if self._lease_budget is not None:
            self._lease_budget -= n

    def grant(self, n: int) -> None:
        if self._lease_budget is None:
            raise ValueError("grant_leases needs a server built with lease_budget=...")
        self._lease_budget += int(n)

    @property
    def granted(self) -> int:
        """Fresh prompts granted and not yet leased (0 without a budget)."""
        return self._lease_budget or 0

    # -- versions and steps ----------------------------------------------------------------

    def set_policy_version(self, version: int) -> None:
        version = _version_arg(version)
        if self._policy_version is not None and version < self._policy_version:
            raise ValueError(f"policy version {version} is older than the learner's "
                             f"{self._policy_version}: versions never go down (a resumed "
                             "learner starts a new server with policy_version=...)")
        self._policy_version = version

    def version_error(self, trajectory: Trajectory) -> TrajectoryError | None:
        """A (valid) trajectory sampled by weights newer than the learner's policy is refused."""
        limit = self._policy_version
        newest = newest_version(trajectory)
        if limit is None or newest <= limit:
            return None
        position = int(np.flatnonzero(trajectory.action_mask
                                      & (trajectory.weight_versions == newest))[0])
        return TrajectoryError(
            "weight_versions", f"version {newest} on action token at position {position} is "
                               f"newer than the learner's policy version {limit}: an engine "
                               "holds weights this learner never published (from beyond the "
                               "checkpoint it resumed from?)")

    def set_learner_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"a learner step is an int >= 0, got {step!r}")
        self._learner_step = int(step)

    def stamp(self, prompts: list[pb.Prompt]) -> list[pb.Prompt]:
        """`prompts` as handed out: copies carrying the learner's step once it has set one (the
        logged messages stay without it)."""
        step = self._learner_step
        if step is None:
            return prompts
        return [_at_step(p, step) for p in prompts]


def _at_step(prompt: pb.Prompt, learner_step: int) -> pb.Prompt:
    """A copy of `prompt` carrying `learner_step` (the logged message stays without it)."""
    out = pb.Prompt()
    out.CopyFrom(prompt)
    out.learner_step = learner_step
    return out
