"""The recording proxy's sessions (proxy.py): one episode's history as ids with what the engine
reported for each token, and the Trajectory it becomes when the session closes. No HTTP here: the
proxy's handlers check each request's messages against the history (`RecordingProxy._extend`)
and append to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

from sao_jax.rollout.trajectory import Trajectory, new_trajectory_id

# Session metadata that names fields of the trajectory, not facts for its env_metadata.
_TRAJECTORY_FIELDS = ("prompt_id", "lease_id", "group_id", "prompt_index")


class SessionError(RuntimeError):
    """A session cannot become a trajectory (it failed, or holds no action)."""


@dataclasses.dataclass(frozen=True)
class SessionConfig:
    """How the proxy ends sessions that the scaffold does not end cleanly (proxy.py's docstring).

    rewritten_reward: the reward of a session whose history the scaffold rewrote or dropped
      (it ends there); 0: the policy's unparseable reply is trained on as a failure.
    idle_timeout_s: seconds without a request after which an open session is closed and its
      trajectory dropped (counted in `RecordingProxy.counters()`); None: never.
    """

    rewritten_reward: float = 0.0
    idle_timeout_s: float | None = 1800.0

    def __post_init__(self):
        reward = self.rewritten_reward
        if (isinstance(reward, bool) or not isinstance(reward, int | float)
                or not math.isfinite(reward)):
            raise ValueError(f"SessionConfig.rewritten_reward must be a finite number (the reward "
                             f"of a session whose history was rewritten, 0.0 by default), got "
                             f"{reward!r}.")
        idle = self.idle_timeout_s
        if idle is not None and (isinstance(idle, bool) or not isinstance(idle, int | float)
                                 or not (math.isfinite(idle) and idle > 0)):
            raise ValueError(f"SessionConfig.idle_timeout_s must be a positive number of seconds, "
                             f"or None to never close idle sessions, got {idle!r}.")


@dataclasses.dataclass
class Session:
    """One episode's history as ids, and the messages served so far."""

    id: str
    metadata: dict
    started: float = dataclasses.field(default_factory=time.perf_counter)
    last_seen: float = dataclasses.field(default_factory=time.monotonic)  # for the idle close
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    prompt: list[int] | None = None
    served: list[dict] = dataclasses.field(default_factory=list)
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    last_action: list[int] = dataclasses.field(default_factory=list)
    turns: int = 0
    generate_s: float = 0.0
    # "length" | "turn_limit" | "abort" | "history_rewritten": nothing more is recorded
    ended: str | None = None
    rewritten: str | None = None  # the reward_reason of a session ended by a rewritten history
    failure: str | None = None
    # the generator's engine session (`SGLangClient.session`): every turn on one engine, so its
    # prefix cache serves the history again; None for a generator without sessions
    engine: object | None = None

    def append(self, ids, mask: bool, logprobs=None, versions=None):
        ids = [int(i) for i in ids]
        self.ids += ids
        self.mask += [mask] * len(ids)
        self.logprobs += ([math.nan] * len(ids) if logprobs is None else
                          [math.nan if lp is None else float(lp) for lp in logprobs])
        self.versions += [-1] * len(ids) if versions is None else [int(v) for v in versions]


def to_trajectory(session: Session, reward: float, truncated: bool, metadata: dict, *,
                  rewritten_reward: float) -> Trajectory:
    """The Trajectory a closed session becomes, `reward` on its last action token (a session
    ended by a rewritten history gets `rewritten_reward` instead and is not truncated; one the
    proxy cut is truncated). Raises SessionError for a failed session, one without an action,
    or a reward that is not finite."""
    session_id = session.id
    if session.failure is not None:
        raise SessionError(f"session {session_id!r} failed: {session.failure}")
    if not any(session.mask):
        raise SessionError(f"session {session_id!r} has no action: nothing to train on.")
    if not math.isfinite(reward):
        raise SessionError(f"session {session_id!r}: reward {reward} is not finite.")
    info = {**session.metadata, **metadata}
    if session.rewritten is not None:  # the policy's history ends there: a failure
        reward, truncated = rewritten_reward, False
        info["reward_reason"] = session.rewritten
    rewards = [0.0] * len(session.ids)
    last = max(i for i, m in enumerate(session.mask) if m)
    rewards[last] = float(reward)
    env_metadata = {k: v for k, v in info.items()
                    if isinstance(v, str | int | float | bool)
                    and k not in _TRAJECTORY_FIELDS}
    env_metadata["turns"] = session.turns
    total = time.perf_counter() - session.started
    finish = session.ended or ("turn_limit" if truncated else "stop")
    cut = session.ended is not None and session.rewritten is None
    return Trajectory(
        prompt_ids=session.prompt, response_ids=session.ids, action_mask=session.mask,
        rollout_logprobs=session.logprobs, weight_versions=session.versions,
        rewards=rewards, truncated=truncated or cut,
        finish_reason=finish, prompt_id=str(info.get("prompt_id", session_id)),
        trajectory_id=new_trajectory_id(), lease_id=str(info.get("lease_id", "")),
        group_id=info.get("group_id"), prompt_index=info.get("prompt_index"),
        env_metadata=env_metadata,
        timings={"generate": session.generate_s, "env": total - session.generate_s,
                 "total": total})
