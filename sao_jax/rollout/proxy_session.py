"""The recording proxy's sessions (proxy.py): one episode's history as ids with what the engine
reported for each token, the Trajectory it becomes when the session closes, and the proxy's book
of sessions (`Sessions`: open, closed, closed for idleness, counted). No HTTP here: the proxy's
handlers check each request's messages against the history (`ChatCompletions.extend`) and append
to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import re
import time

from sao_jax.rollout.trajectory import Trajectory, new_trajectory_id

log = logging.getLogger("sao_jax.rollout.proxy")  # the proxy's logger: its messages

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


# The session ids a proxy takes: in its URLs, so plain characters only.
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# `RecordingProxy.counters()`: sessions opened, closed into a trajectory, refused at close (failed,
# no action), ended by a rewritten history, and closed for idleness (their trajectory dropped).
COUNTERS = ("sessions_opened", "sessions_closed", "sessions_failed", "sessions_rewritten",
            "sessions_idle_closed")


def check_id(session_id: str) -> None:
    """A ValueError unless `session_id` is a valid session id (`SESSION_ID`)."""
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise ValueError(f"session id {session_id!r}: use 1-128 of A-Z a-z 0-9 . _ : -")


class Sessions:
    """A proxy's sessions: the open ones by id, the ids closed (never reused) and how, and the
    running `counters` (`COUNTERS`). Used on the proxy's loop only.

    Args:
      config: how rewritten histories and idle sessions end (`SessionConfig`).
    """

    def __init__(self, config: SessionConfig):
        self.config = config
        self.open: dict[str, Session] = {}
        self.closed: dict[str, str] = {}  # id -> "closed" | "idle": ids are not reused
        self.counters = dict.fromkeys(COUNTERS, 0)

    def new(self, session_id: str, metadata: dict, generator) -> Session:
        """Opens a session; its turns go to one engine when `generator` has sessions
        (`SGLangClient.session`)."""
        session = self.open[session_id] = Session(session_id, metadata)
        self.counters["sessions_opened"] += 1
        if hasattr(generator, "session"):
            session.engine = generator.session(session_id)
        return session

    def open_new(self, session_id: str, metadata: dict, generator) -> Session:
        """`new`, for an id never used before (a ValueError otherwise)."""
        check_id(session_id)
        if session_id in self.open or session_id in self.closed:
            raise ValueError(f"session {session_id!r} exists already (ids are not reused).")
        return self.new(session_id, metadata, generator)

    def forget(self, session: Session, how: str) -> None:
        """Closes `session` ("closed", or "idle") without a trajectory."""
        del self.open[session.id]
        self.closed[session.id] = how
        if session.engine is not None:
            session.engine.close()

    async def close(self, session_id: str, reward: float, truncated: bool,
                    metadata: dict) -> Trajectory:
        """Closes a session into its Trajectory (`to_trajectory`), once a request in flight
        finished. A KeyError for an unknown, closed or idle-closed session; SessionError for one
        that cannot become a trajectory (it is closed either way)."""
        session = self.open.get(session_id)
        if session is None:
            if self.closed.get(session_id) == "idle":
                raise KeyError(f"session {session_id!r} was closed after "
                               f"{self.config.idle_timeout_s:g} s without a request "
                               "(SessionConfig.idle_timeout_s); its trajectory was dropped")
            raise KeyError(f"no open session {session_id!r}")
        async with session.lock:  # a request in flight finishes first
            if self.open.get(session_id) is not session:  # closed while we waited
                raise KeyError(f"no open session {session_id!r}")
            self.forget(session, "closed")
            try:
                traj = to_trajectory(session, reward, truncated, metadata,
                                     rewritten_reward=self.config.rewritten_reward)
            except SessionError:
                self.counters["sessions_failed"] += 1
                raise
            self.counters["sessions_closed"] += 1
            return traj

    async def close_idle(self, idle_timeout_s: float):
        """Closes, every few seconds, the sessions without a request for `idle_timeout_s`; their
        trajectories are dropped (proxy.py's docstring)."""
        while True:
            await asyncio.sleep(min(max(idle_timeout_s / 4, 0.05), 5.0))
            now = time.monotonic()
            for session in list(self.open.values()):
                if session.lock.locked() or now - session.last_seen < idle_timeout_s:
                    continue  # a request in flight is not idleness
                self.forget(session, "idle")
                self.counters["sessions_idle_closed"] += 1
                log.warning("session %s closed after %.0f s without a request; its trajectory "
                            "is dropped", session.id, now - session.last_seen)
