"""Which engine an `SGLangClient` request goes to (`Router`; client.py's module doc, "Routing").

A request of a session (one agent episode) goes to the engine its session used before while that
engine is up, so the engine's prefix cache serves the history; a new session goes to the engine
with the fewest sessions (then requests in flight), and the session of an engine in backoff moves
to another (`num_moves`). A request outside sessions goes to the engine with the fewest requests in
flight. Ties go in turn. An engine that failed is skipped until its backoff ends (`skip`), or, if
it was frozen, until it answers again (`skip(url, math.inf)`, then `restore`).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence

log = logging.getLogger("sao_jax.rollout.client")  # the client's logger: its messages


class Router:
    """The engines' load, backoff and sessions, for one client.

    Attributes:
      inflight: requests in flight per engine URL (the client counts them in and out).
      num_moves: sessions moved to another engine.
    """

    def __init__(self, urls: Sequence[str]):
        self.urls = list(urls)
        self.inflight = dict.fromkeys(self.urls, 0)
        self._down_until = dict.fromkeys(self.urls, 0.0)
        self._turn = 0
        self.sessions: dict[str, str] = {}  # session -> engine URL
        self._open_sessions: set[str] = set()
        self._bound: collections.Counter[str] = collections.Counter()  # sessions per engine
        self.num_moves = 0

    # -- sessions --------------------------------------------------------------------------

    def open(self, key: str) -> None:
        if key in self._open_sessions:
            raise ValueError(f"session {key!r} is already open on this client.")
        self._open_sessions.add(key)

    def close(self, key: str) -> None:
        self._open_sessions.discard(key)
        url = self.sessions.pop(key, None)
        if url is not None:
            self._bound[url] -= 1

    # -- backoff ---------------------------------------------------------------------------

    def skip(self, url: str, until: float) -> None:
        """`url` is in backoff until the monotonic time `until` (or later, if it already was)."""
        self._down_until[url] = max(self._down_until[url], until)

    def restore(self, url: str) -> None:
        """`url` answers again: it is routed to at once."""
        self._down_until[url] = 0.0

    def any_up(self, now: float) -> bool:
        """Whether some engine is out of backoff at `now`."""
        return any(t <= now for t in self._down_until.values())

    # -- routing ---------------------------------------------------------------------------

    def route(self, session: str | None) -> str:
        """The engine for a request of `session` (None: outside sessions)."""
        if session is None:
            return self._pick_url()
        bound = self.sessions.get(session)
        if bound is not None and self._down_until[bound] <= time.monotonic():
            return bound
        if bound is not None:
            self._bound[bound] -= 1
        target = self._pick_url(for_session=True)
        if bound is not None and target != bound:
            self.num_moves += 1
            log.info("session %s moves from %s (not answering) to %s", session, bound, target)
        self.sessions[session] = target
        self._bound[target] += 1
        return target

    def _up(self) -> list[str]:
        now = time.monotonic()
        return [u for u in self.urls if self._down_until[u] <= now]

    def _pick_url(self, for_session: bool = False) -> str:
        """The least-loaded engine not in backoff: fewest requests in flight, or for a new
        session, fewest sessions, then fewest requests in flight (ties in turn)."""
        up = self._up()
        if not up:  # all in backoff: the one that comes back first
            return min(self.urls, key=self._down_until.__getitem__)

        def load(u):
            return (self._bound[u], self.inflight[u]) if for_session else self.inflight[u]

        least = min(map(load, up))
        ties = [u for u in up if load(u) == least]
        self._turn += 1
        return ties[self._turn % len(ties)]
