"""The embedded engine's core: the continuous-batching scheduler over the model's slot KV cache.

`Engine` holds no HTTP: `server.py` serves it, `sglang_api.py` turns request bodies into the
`RequestSpec`s it runs, and `sglang_replies.py` shapes its replies. Its parts: the requests not yet
in a slot, the admission gate and the pending commands (`requests.py`, `RequestQueue`); the model on
the device and the programs it compiles and calls between its decisions (`runner.py`,
`ModelRunner`, over `programs.py`: the prefill, the decode step, per-row sampling and log-probs);
the slots' bookkeeping (`slots.py`); the model directory and the checks of a weight update
(`model_io.py`); when a request finishes and what its reply says (`sglang_replies.Replies`). The
`Engine` itself is the scheduler: its loop and step, commands and weight updates.

Scheduling: `max_batch` KV-cache slots of `max_seq_len` positions each. Between decode steps the
scheduler applies commands (aborts, pauses), then prefills waiting requests into free slots (the
one holding the longest prefix of the prompt, else the lowest; dispatched one after another, the
prompt padded to a power-of-two bucket, each bucket compiled on first use), then decodes every
occupied slot together in one jitted step; a request leaves its slot as soon as it finishes, and
new ones join at the next step (continuous batching). A step decodes slots [0, N) for the
smallest power-of-two bucket N (or `max_batch`) past the highest occupied slot, one program per
bucket, all compiled at start-up (as SGLang captures CUDA graphs per batch size). Sampling
parameters (temperature, top-p, top-k, seed) are per row, so requests with different parameters
share a step.

Prefix cache (`slots.py`, which keeps the slots' bookkeeping): a slot keeps the keys and values of
the request that left it (its prompt and all but its last output token) until another request
takes it. A request whose prompt begins with what a free slot holds (at least MIN_CACHED_PREFIX
tokens; a multi-turn episode's next turn, its history grown by an observation) takes that slot
and is prefilled from where the held tokens end: its reply's `cached_tokens` says how many it
reused, as SGLang's radix cache does. Nothing is reused across a weight load (the held keys are
the old weights'), after `/flush_cache`, or for a request that wants its prompt's log-probs
(those come from a whole prefill).

Admission gate (`requests.py`): requests that arrive while generation is paused or a weight
update is in progress wait in `held` and join `waiting` when it reopens.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from functools import partial

from sao_jax.engine.model_io import read_eos_ids, read_tokenizer
from sao_jax.engine.requests import RequestQueue
from sao_jax.engine.runner import ModelRunner
from sao_jax.engine.sglang_api import RequestSpec
from sao_jax.engine.sglang_replies import Replies
from sao_jax.engine.slots import Request, Slots

log = logging.getLogger("sao_jax.engine")

ABORT_MESSAGE = "Aborted: generation paused (pause_generation or a weight update)."

# ------------------------------------------------------------------------------------------------
# The scheduler.


class EngineFailure(RuntimeError):
    """The scheduler failed while running a request (HTTP 500)."""


class Engine:
    """The model, its slot KV cache and the continuous-batching scheduler.

    All scheduler state lives in the event loop's thread; compiled programs run on one worker
    thread (`runner.compute`), so HTTP handlers keep answering while the device works. Handlers
    never touch slots: they queue requests and commands (`requests`), which the scheduler applies
    between steps.
    """

    def __init__(self, model_path: str, *, max_batch: int = 32, max_seq_len: int | None = None,
                 dtype: str = "auto", weight_version: str = "0", seed: int = 0,
                 dispatch: str | None = None, routed_experts: bool = False):
        self.runner = ModelRunner(model_path, max_batch=max_batch, max_seq_len=max_seq_len,
                                  dtype=dtype, seed=seed, dispatch=dispatch,
                                  routed_experts=routed_experts)
        self.cfg, self.dtype = self.runner.cfg, self.runner.dtype
        self.max_batch, self.max_seq_len = max_batch, self.runner.max_seq_len
        self.model_path = self.served_model_name = model_path
        self.weight_version = str(weight_version)
        self.tokenizer = read_tokenizer(model_path)
        self.eos_ids = read_eos_ids(model_path)
        self.slots = Slots(max_batch, self.max_seq_len)
        self.requests = RequestQueue(self.eos_ids)  # and the commands (`requests.command`)
        self.replies = Replies(self.tokenizer, self.max_seq_len)
        self.failure: str | None = None
        self.last_step_time = 0.0
        self.started = time.time()
        self.stats = collections.Counter()
        self.decode_batch_sizes = collections.Counter()

    def warmup(self, prefills: bool = False) -> None:
        """Compiles the programs before the first request (`ModelRunner.warmup`)."""
        self.runner.warmup(self.slots, prefills)

    # -- requests and commands (called from handlers) --------------------------------------------

    def submit(self, spec: RequestSpec) -> Request:
        """Queues a request; its `future` resolves to the reply dict."""
        return self.requests.submit(spec)

    def cancel(self, req: Request, message: str) -> None:
        """Aborts `req` at the next step without waiting (e.g. its client went away)."""
        self.requests.cancel(req, message)

    async def _drain(self):
        """Waits until no request is waiting or running (new ones are held meanwhile)."""
        while self.requests.waiting or self.num_running:
            self.requests.idle.clear()
            await self.requests.idle.wait()

    async def update_weights(self, path: str, version: str | None, *, abort_all: bool,
                             keep_pause: bool = False, drain_s: float = 0.0):
        """SGLang's `/update_weights_from_disk`: validate and load, then swap.

        The new weights are read and checked completely before any request is touched; a failure
        leaves everything running. Then new requests are held; with `abort_all` the running and
        waiting ones return at once (`finish_reason.type == "abort"`, partial tokens); without
        it they finish first (as SGLang's model-update lock waits for them), except that while
        generation is paused the requests in slots are aborted (SGLang would continue them under
        the new weights; here every reply keeps one version). `version` None keeps the version.
        `drain_s` (not SGLang's; with `abort_all`, while not paused): the waiting requests are
        held for the new weights, and the running ones get up to `drain_s` seconds to finish
        under the old before those still running are aborted. A request cut by a load is
        resubmitted and prefilled again, its whole history, under the new weights; one that
        finishes in the drain is not (a turn of a few tokens finishes within a few decode steps).
        Returns `(success, message, num_aborted)`.
        """
        queue = self.requests
        queue.ensure_loop_objects()
        async with queue.update_lock:
            try:
                state = await self.runner.compute(partial(self.runner.load_state, path))
            except Exception as e:  # noqa: BLE001 - reported to the caller, the engine goes on
                log.warning("weight update from %s failed: %s", path, e)
                return False, f"Failed to update weights from {path}: {e}", 0
            queue.updating = True
            try:
                if abort_all and drain_s > 0 and not queue.paused:
                    await queue.command("hold_waiting", None)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._drain(), drain_s)
                    aborted = await queue.command("abort_running", ABORT_MESSAGE)
                elif abort_all:
                    aborted = await queue.command("abort_all", ABORT_MESSAGE)
                elif queue.paused:
                    aborted = await queue.command("abort_running", ABORT_MESSAGE)
                else:
                    aborted = 0
                    await self._drain()
                self.runner.state, self.model_path, self.served_model_name = state, path, path
                self.slots.new_weights()  # the held prefixes are of the old weights
                message = "Succeeded to update model weights."
                if version is not None:
                    self.weight_version = str(version)
                    message += f" Weight version updated to {self.weight_version}."
                self.stats["weight_updates"] += 1
                log.info("loaded weights %s from %s (%d requests aborted)", self.weight_version,
                         path, aborted)
            finally:
                queue.updating = False
                queue.paused = queue.paused or keep_pause
                queue.release_held()
            return True, message, aborted

    # -- the scheduler ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self.slots.running

    async def run(self) -> None:
        """The scheduler loop: commands, admissions, one decode step; sleeps when idle."""
        queue = self.requests
        queue.ensure_loop_objects()
        while True:
            self._apply_commands()
            if not (queue.waiting or self.num_running):
                queue.idle.set()
            if queue.paused or not (queue.waiting or self.num_running):
                queue.wake.clear()
                await queue.wake.wait()
                continue
            try:
                await self._admit()
                if self.num_running:
                    await self._decode_step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("scheduler step failed")
                self.failure = f"{type(e).__name__}: {e}"
                self._fail_all(EngineFailure(f"engine step failed: {self.failure}"))
                self.runner.reset_caches()  # donated buffers may be gone
                self.slots.forget()

    def _apply_commands(self):
        queue = self.requests
        commands, queue.commands = queue.commands, []
        for kind, arg, future in commands:
            result = None
            if kind == "abort":
                reqs, message = arg
                result = sum(self._abort(req, message) for req in reqs)
            elif kind in ("abort_all", "abort_running"):
                reqs = self.slots.active()
                if kind == "abort_all":
                    reqs += queue.waiting
                result = sum(self._abort(req, arg) for req in reqs)
            elif kind == "pause":
                # abort: SGLang aborts everything its scheduler holds (running and waiting);
                # in_place and retract keep them (retract keeps the slots too: same tokens).
                queue.paused = True
                reqs = self.slots.active() + list(queue.waiting) if arg == "abort" else []
                result = sum(self._abort(req, ABORT_MESSAGE) for req in reqs)
            elif kind == "hold_waiting":  # a draining update: they start under the new weights
                queue.hold_waiting()
            elif kind == "continue":
                queue.paused = False
                queue.release_held()
            if future is not None and not future.done():
                future.set_result(result)

    def _abort(self, req: Request, message: str) -> bool:
        if not self.requests.remove(req) and req.slot < 0:  # already finished
            return False
        self._finish(req, {"type": "abort", "message": message, "status_code": None,
                           "err_type": None})
        return True

    def flush_cache(self) -> None:
        """Forgets the prefix cache: later requests are prefilled whole (SGLang's `/flush_cache`;
        running requests keep their slots)."""
        self.slots.forget()

    async def _admit(self):
        """Gives every waiting request a free slot (while no command is pending) and prefills
        them together (`ModelRunner.run_prefills`)."""
        queue = self.requests
        admitted = []
        while queue.waiting and not queue.commands and self.slots.has_free:
            req = queue.waiting.popleft()
            req.version = self.weight_version
            if req.spec.max_new_tokens == 0 and not req.spec.wants_input_logprobs:
                self._finish(req, {"type": "length", "length": 0})
                continue
            req.slot, req.cached = self.slots.choose(req.spec)
            self.slots.take(req)
            admitted.append(req)
        if not admitted:
            return
        start = time.perf_counter()
        results = await self.runner.compute(partial(self.runner.run_prefills, admitted))
        self.stats["prefill_s"] += time.perf_counter() - start
        for req, (token, logp, ids_logp, next_logp, ids_rows) in zip(admitted, results,
                                                                      strict=True):
            spec = req.spec
            if req.slot < 0:  # aborted while the prefill ran: its slot is free again
                continue
            self.slots.start(req)
            self.stats["prefills"] += 1
            self.stats["prefill_tokens"] += len(spec.prompt) - req.cached
            self.stats["cached_tokens"] += req.cached
            if spec.wants_input_logprobs:
                req.input_logprobs = next_logp.tolist()
                if spec.token_ids_logprob is not None:
                    req.input_ids_logprobs = ids_rows[:, :len(spec.token_ids_logprob)].tolist()
            if spec.max_new_tokens == 0:  # only the prompt's log-probs were wanted
                self._finish(req, {"type": "length", "length": 0})
                continue
            self._append(req, token, logp, ids_logp)

    async def _decode_step(self):
        active = self.slots.active()
        n = len(active)
        start = time.perf_counter()
        token_B, logp_B, ids_logp_BxK = await self.runner.decode_step(self.slots, active)
        self.stats["decode_s"] += time.perf_counter() - start
        self.last_step_time = time.monotonic()
        self.decode_batch_sizes[n] += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += n
        for req in active:
            if req.slot < 0:  # finished while the step ran (cannot happen today; be safe)
                continue
            req.max_batch = max(req.max_batch, n)
            self.slots.advance(req.slot)
            self._append(req, int(token_B[req.slot]), float(logp_B[req.slot]),
                         None if ids_logp_BxK is None else ids_logp_BxK[req.slot])

    def _append(self, req: Request, token: int, logp: float, ids_logp=None):
        """Records a new token and finishes the request when it should stop
        (`Replies.finish_reason`)."""
        req.output.append(token)
        req.logprobs.append(logp)
        if ids_logp is not None and req.spec.token_ids_logprob is not None:
            req.ids_logprobs.append(ids_logp[:len(req.spec.token_ids_logprob)].tolist())
        self.slots.feed(req.slot, token)
        req.changed.set()
        if (finish_reason := self.replies.finish_reason(req, token)) is not None:
            self._finish(req, finish_reason)

    def _finish(self, req: Request, finish_reason: dict):
        if req.slot >= 0:
            req.routed_experts = self.runner.request_routes(req)
            self.slots.leave(req)
        if self.requests.by_rid.get(req.rid) is req:
            del self.requests.by_rid[req.rid]
        self.stats[f"finish_{finish_reason['type']}"] += 1
        req.finish_reason = finish_reason
        req.changed.set()
        if not req.future.done():
            try:
                req.future.set_result(self.reply(req))
            except Exception as e:  # noqa: BLE001 - this reply failed; the others go on
                log.exception("building the reply of %s failed", req.rid)
                req.future.set_exception(EngineFailure(f"building the reply failed: {e!r}"))
        if not (self.requests.waiting or self.num_running):
            self.requests.idle.set()

    def reply(self, req: Request) -> dict:
        """The request's reply so far (cumulative, as SGLang streams it); final once finished."""
        return self.replies.reply(req, self.weight_version)

    def _fail_all(self, error: Exception):
        for req in [*self.requests.waiting, *self.slots.active()]:
            if req.slot >= 0:
                self.slots.leave(req, keep_prefix=False)
            self.requests.by_rid.pop(req.rid, None)
            req.changed.set()
            if not req.future.done():
                req.future.set_exception(error)
        self.requests.waiting.clear()

    def server_info(self) -> dict:
        queue = self.requests
        sizes = {str(k): v for k, v in sorted(self.decode_batch_sizes.items())}
        return {
            "model_path": self.model_path,
            "weight_version": self.weight_version,
            "max_batch": self.max_batch,
            "max_seq_len": self.max_seq_len,
            "vocab_size": self.cfg.vocab_size,
            "dtype": self.dtype.name,
            "logprob_dispatch": self.cfg.logprob_dispatch,
            "eos_token_ids": sorted(self.eos_ids),
            "has_tokenizer": self.tokenizer is not None,
            "paused": queue.paused,
            "updating": queue.updating,
            "num_running": self.num_running,
            "num_waiting": len(queue.waiting) + len(queue.held),
            "num_held": len(queue.held),
            "running": {r.rid: len(r.output) for r in self.slots.active()},
            "decode_batch_sizes": sizes,
            "max_decode_batch_size": max(self.decode_batch_sizes, default=0),
            "failure": self.failure,
            **dict(self.stats),
        }

    def close(self):
        self._fail_all(EngineFailure("the engine is shutting down"))
        self.requests.fail_held(EngineFailure("the engine is shutting down"))
        self.runner.close()
