"""The embedded engine's requests between the HTTP handlers and the scheduler: those waiting for a
slot, those held behind the admission gate, every live one by id, and the commands the scheduler
applies at its next step boundary (`scheduler.py`).

Admission gate: requests that arrive while generation is paused or a weight update is in
progress wait in `held` (as SGLang's tokenizer manager holds them before its model-update lock)
and join `waiting` when it reopens.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Iterable

from sao_jax.engine.sglang_api import BadRequest, RequestSpec
from sao_jax.engine.slots import Request


class RequestQueue:
    """The requests not yet in a slot, the live ones by id, the gate and the pending commands.

    Lives in the event loop's thread: handlers queue requests and commands here, and the
    scheduler takes them between its steps (`wake` wakes it; it sets `idle` when nothing is
    waiting or running).
    """

    def __init__(self, eos_ids: Iterable[int]):
        self.eos_ids = frozenset(eos_ids)
        self.waiting: collections.deque[Request] = collections.deque()
        self.held: collections.deque[Request] = collections.deque()  # behind the closed gate
        self.by_rid: dict[str, Request] = {}
        self.paused = False
        self.updating = False
        self.commands: list[tuple[str, object, asyncio.Future | None]] = []
        self.wake: asyncio.Event | None = None
        self.idle: asyncio.Event | None = None
        self.update_lock: asyncio.Lock | None = None

    def ensure_loop_objects(self):
        if self.wake is None:
            self.wake, self.idle = asyncio.Event(), asyncio.Event()
            self.update_lock = asyncio.Lock()

    @property
    def gate_closed(self) -> bool:
        """New requests wait (in `held`) while paused or during a weight update."""
        return self.paused or self.updating

    def submit(self, spec: RequestSpec) -> Request:
        """Queues a request; its `future` resolves to the reply dict."""
        self.ensure_loop_objects()
        rid = spec.rid or uuid.uuid4().hex
        if rid in self.by_rid:
            raise BadRequest("rid", f"duplicate request id {rid!r}: a request with this id is "
                                    "still running.")
        stop = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(self.eos_ids))
        req = Request(spec, rid, frozenset(stop), asyncio.get_running_loop().create_future(),
                      time.perf_counter())
        self.by_rid[rid] = req
        (self.held if self.gate_closed else self.waiting).append(req)
        self.idle.clear()
        self.wake.set()
        return req

    def cancel(self, req: Request, message: str) -> None:
        """Aborts `req` at the next step without waiting (e.g. its client went away)."""
        if self.by_rid.get(req.rid) is req:
            del self.by_rid[req.rid]  # the id is free again at once
        self.enqueue("abort", ([req], message), None)

    def enqueue(self, kind, arg, future):
        self.ensure_loop_objects()
        self.commands.append((kind, arg, future))
        self.wake.set()

    async def command(self, kind: str, arg=None):
        """Runs a scheduler command at the next step boundary: "abort" ([requests], message),
        "abort_all" (message: running and waiting requests), "abort_running" (message),
        "pause" (mode), "continue", "hold_waiting" (a draining weight update)."""
        future = asyncio.get_running_loop().create_future()
        self.enqueue(kind, arg, future)
        return await future

    async def abort(self, rids: list[str] | None, message: str) -> int:
        """Aborts the given requests (all when `rids` is None); returns how many were live."""
        reqs = (list(self.by_rid.values()) if rids is None
                else [self.by_rid[r] for r in rids if r in self.by_rid])
        return await self.command("abort", (reqs, message))

    def release_held(self):
        """The held requests join the waiting ones, once the gate is open."""
        if not self.gate_closed and self.held:
            self.waiting.extend(self.held)
            self.held.clear()
            self.wake.set()

    def hold_waiting(self):
        """The waiting requests go behind the gate, ahead of those held (a draining update:
        they start under the new weights)."""
        self.held.extendleft(reversed(self.waiting))
        self.waiting.clear()

    def remove(self, req: Request) -> bool:
        """Takes `req` out of the queue; False if it was in neither deque."""
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.held:
            self.held.remove(req)
        else:
            return False
        return True

    def fail_held(self, error: Exception) -> None:
        """Fails the held requests with `error` (the engine is shutting down)."""
        for req in list(self.held):
            if not req.future.done():
                req.future.set_exception(error)
        self.held.clear()
