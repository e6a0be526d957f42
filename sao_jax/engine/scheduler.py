"""The embedded engine's core: the continuous-batching scheduler over the model's slot KV cache.

`Engine` holds no HTTP: `engine.py` serves it, `sglang_api.py` turns request bodies into the
`RequestSpec`s it runs, and `sglang_replies.py` shapes its replies. What it compiles and calls
between its decisions (the prefill, the decode step, per-row sampling and log-probs) is in
`programs.py`; what it reads from the model directory and how it validates a weight update, in
`model_io.py`.

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

Admission gate: requests that arrive while generation is paused or a weight update is in
progress wait in `held` (as SGLang's tokenizer manager holds them before its model-update lock)
and join `waiting` when it reopens.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
import uuid
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.engine.model_io import (
    config_dtype,
    load_state,
    read_eos_ids,
    read_tokenizer,
    tensor_specs,
)
from sao_jax.engine.programs import (
    KEY_IMPL,
    decode,
    decode_buckets,
    ids_bucket,
    prefill,
    prefill_buckets,
    seed_words,
)
from sao_jax.engine.sglang_api import BadRequest, RequestSpec
from sao_jax.engine.sglang_replies import build_meta_info, build_reply
from sao_jax.engine.slots import Request, Slots
from sao_jax.models.hf import check_complete, load_hf
from sao_jax.models.transformer import CausalLM, empty_caches

log = logging.getLogger("sao_jax.engine")

ABORT_MESSAGE = "Aborted: generation paused (pause_generation or a weight update)."

# ------------------------------------------------------------------------------------------------
# The scheduler.


class EngineFailure(RuntimeError):
    """The scheduler failed while running a request (HTTP 500)."""


class Engine:
    """The model, its slot KV cache and the continuous-batching scheduler.

    All scheduler state lives in the event loop's thread; compiled programs run on one worker
    thread (`_compute`), so HTTP handlers keep answering while the device works. Handlers never
    touch slots: they queue requests and commands, which the scheduler applies between steps.
    """

    def __init__(self, model_path: str, *, max_batch: int = 32, max_seq_len: int | None = None,
                 dtype: str = "auto", weight_version: str = "0", seed: int = 0,
                 dispatch: str | None = None):
        check_complete(model_path)  # a directory save_hf is still writing is refused
        self.dtype = jnp.dtype(config_dtype(model_path) if dtype == "auto" else dtype)
        self._overrides = {"logprob_dispatch": dispatch} if dispatch else {}
        model = load_hf(model_path, self.dtype, **self._overrides)
        self.cfg = model.cfg
        self.model_path = model_path
        self.served_model_name = model_path
        self.weight_version = str(weight_version)
        self.tokenizer = read_tokenizer(model_path)
        self.tensors = tensor_specs(model_path)  # what a weight update must match, by name
        graphdef, self.state = nnx.split(model)
        self._abstract = nnx.eval_shape(lambda: CausalLM(self.cfg, nnx.Rngs(0)))  # load_state
        self.max_batch = max_batch
        self.max_seq_len = min(max_seq_len or 2048, self.cfg.max_position_embeddings)
        if self.max_seq_len < 2:
            raise ValueError(f"--max-seq-len must be >= 2, got {self.max_seq_len}.")
        self.buckets = prefill_buckets(self.max_seq_len)  # compiled on first use
        self._compiled: set[tuple] = set()
        self.decode_buckets = decode_buckets(max_batch)
        self.eos_ids = read_eos_ids(model_path)
        # Indexed by `input_logprobs`, bound here: a static keyword argument would take jit's
        # slower dispatch path on every call.
        self._prefill = tuple(jax.jit(partial(prefill, graphdef, input_logprobs=wants),
                                      donate_argnums=(1,)) for wants in (False, True))
        self._decode = jax.jit(partial(decode, graphdef), donate_argnums=(1,))
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "engine-compute")
        self._key = jax.random.key(seed, impl=KEY_IMPL)
        self.caches = self._empty_caches()
        self.slots = Slots(max_batch, self.max_seq_len)
        self.waiting: collections.deque[Request] = collections.deque()
        self.held: collections.deque[Request] = collections.deque()  # behind the closed gate
        self.by_rid: dict[str, Request] = {}
        self.paused = False
        self.updating = False
        self._commands: list[tuple[str, object, asyncio.Future | None]] = []
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._update_lock: asyncio.Lock | None = None
        self.failure: str | None = None
        self.last_step_time = 0.0
        self.started = time.time()
        self.stats = collections.Counter()
        self.decode_batch_sizes = collections.Counter()

    # -- compute ---------------------------------------------------------------------------------

    def _empty_caches(self):
        return empty_caches(self.cfg, self.max_batch, self.max_seq_len, self.dtype)

    async def _compute(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _note_compile(self, what: tuple, message: str, *args):
        if what not in self._compiled:
            self._compiled.add(what)
            log.info(message, *args)

    def _run_prefills(self, reqs: list[Request]):
        """Prefills several requests one after another, dispatching them all before reading any
        result: one thread hop and one wait for the lot, and the host prepares the next while the
        device computes the last (each uses the caches the previous returned)."""
        results = [self._dispatch_prefill(req.spec, req.slot, req.cached) for req in reqs]
        return [(int(token), float(logp), *(None if x is None else np.asarray(x) for x in extra))
                for token, logp, *extra in results]

    def _dispatch_prefill(self, spec: RequestSpec, slot: int, cached: int = 0):
        """Prefills `spec`'s prompt into `slot`, whose first `cached` positions hold its first
        tokens already; returns the program's outputs (device arrays)."""
        n = len(spec.prompt) - cached
        bucket = next(b for b in self.buckets if b >= n)
        ids = spec.token_ids_logprob
        k = ids_bucket(len(ids or ()))
        wants_input = spec.wants_input_logprobs
        self._note_compile(("prefill", bucket, k, wants_input),
                           "compiling the prefill of prompts of up to %d tokens (%d ids, input "
                           "log-probs %s)", bucket, k, wants_input)
        ids_1xP = np.zeros((1, bucket), np.int32)
        ids_1xP[0, :n] = spec.prompt[cached:]
        ids_K = None
        if k:
            ids_K = np.zeros(k, np.int32)
            ids_K[:len(ids)] = ids
        seed_1x2 = None
        if spec.sampling_seed is not None:
            seed_1x2 = np.asarray([seed_words(spec.sampling_seed)], np.uint32)
        self.caches, *out, self._key, ids_logp, next_logp, ids_logp_rows = self._prefill[
            wants_input](self.state, self.caches, ids_1xP,
                         np.int32([len(spec.prompt), slot, spec.top_k, cached]),
                         np.float32([[spec.temperature, spec.top_p]]), self._key, seed_1x2,
                         ids_K)
        return (*out, ids_logp, next_logp, ids_logp_rows)

    def _run_decode(self, n: int, ids_NxK: np.ndarray | None = None, seeded: bool = False):
        """Decodes slots [0, n) (host arrays copied at call time); returns tokens, log-probs and
        the log-probs of `ids_NxK` (None: none gathered). `seeded`: some row has a seed (the
        caller knows; asking the rows costs ~2% of a one-row step)."""
        if seeded:
            self._note_compile(("decode", n, "seeded"), "compiling the decode of %d slots for "
                               "seeded requests", n)
        ints_Nx4, floats_Nx2, seed_Nx2 = self.slots.decode_inputs(n, seeded)
        self.caches, token_N, logp_N, self._key, ids_logp_NxK = self._decode(
            self.state, self.caches, ints_Nx4, floats_Nx2, self._key, seed_Nx2, ids_NxK)
        return (np.asarray(token_N), np.asarray(logp_N),
                None if ids_logp_NxK is None else np.asarray(ids_logp_NxK))

    def warmup(self, prefills: bool = False) -> None:
        """Compiles every decode bucket and the smallest prefill bucket; with `prefills`, every
        prefill bucket of the hot path (no input log-probs, no gathered ids), so that no request
        of a run waits for a compile (one stalls every request of the engine: ~2 s per bucket
        for the toy model on a loaded CPU). Otherwise larger prompts compile theirs on first
        use. Slot contents are garbage until a prefill overwrites them."""
        start = time.perf_counter()
        for bucket in self.buckets if prefills else self.buckets[:1]:
            self._dispatch_prefill(RequestSpec(prompt=(0,) * (bucket - 1 or 1)), 0)
        for n in self.decode_buckets:
            self._run_decode(n)
        jax.block_until_ready(self.caches)
        log.info("compiled %d prefill and %d decode buckets in %.1f s",
                 len(self.buckets) if prefills else 1, len(self.decode_buckets),
                 time.perf_counter() - start)

    def load_state(self, path: str):
        """New weights for the running model, validated completely (`model_io.load_state`);
        raises ValueError if they do not fit it."""
        return load_state(path, cfg=self.cfg, dtype=self.dtype, abstract=self._abstract,
                          tensors=self.tensors, state=self.state, overrides=self._overrides)

    def decode_text(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- requests and commands (called from handlers) --------------------------------------------

    def _ensure_loop_objects(self):
        if self._wake is None:
            self._wake, self._idle = asyncio.Event(), asyncio.Event()
            self._update_lock = asyncio.Lock()

    @property
    def gate_closed(self) -> bool:
        """New requests wait (in `held`) while paused or during a weight update."""
        return self.paused or self.updating

    def submit(self, spec: RequestSpec) -> Request:
        """Queues a request; its `future` resolves to the reply dict."""
        self._ensure_loop_objects()
        rid = spec.rid or uuid.uuid4().hex
        if rid in self.by_rid:
            raise BadRequest("rid", f"duplicate request id {rid!r}: a request with this id is "
                                    "still running.")
        stop = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(self.eos_ids))
        req = Request(spec, rid, frozenset(stop), asyncio.get_running_loop().create_future(),
                      time.perf_counter())
        self.by_rid[rid] = req
        (self.held if self.gate_closed else self.waiting).append(req)
        self._idle.clear()
        self._wake.set()
        return req

    def cancel(self, req: Request, message: str) -> None:
        """Aborts `req` at the next step without waiting (e.g. its client went away)."""
        if self.by_rid.get(req.rid) is req:
            del self.by_rid[req.rid]  # the id is free again at once
        self._enqueue("abort", ([req], message), None)

    def _enqueue(self, kind, arg, future):
        self._ensure_loop_objects()
        self._commands.append((kind, arg, future))
        self._wake.set()

    async def command(self, kind: str, arg=None):
        """Runs a scheduler command at the next step boundary: "abort" ([requests], message),
        "abort_all" (message: running and waiting requests), "abort_running" (message),
        "pause" (mode), "continue"."""
        future = asyncio.get_running_loop().create_future()
        self._enqueue(kind, arg, future)
        return await future

    async def abort(self, rids: list[str] | None, message: str) -> int:
        """Aborts the given requests (all when `rids` is None); returns how many were live."""
        reqs = (list(self.by_rid.values()) if rids is None
                else [self.by_rid[r] for r in rids if r in self.by_rid])
        return await self.command("abort", (reqs, message))

    def _release_held(self):
        if not self.gate_closed and self.held:
            self.waiting.extend(self.held)
            self.held.clear()
            self._wake.set()

    async def _drain(self):
        """Waits until no request is waiting or running (new ones are held meanwhile)."""
        while self.waiting or self.num_running:
            self._idle.clear()
            await self._idle.wait()

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
        self._ensure_loop_objects()
        async with self._update_lock:
            try:
                state = await self._compute(partial(self.load_state, path))
            except Exception as e:  # noqa: BLE001 - reported to the caller, the engine goes on
                log.warning("weight update from %s failed: %s", path, e)
                return False, f"Failed to update weights from {path}: {e}", 0
            self.updating = True
            try:
                if abort_all and drain_s > 0 and not self.paused:
                    await self.command("hold_waiting", None)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._drain(), drain_s)
                    aborted = await self.command("abort_running", ABORT_MESSAGE)
                elif abort_all:
                    aborted = await self.command("abort_all", ABORT_MESSAGE)
                elif self.paused:
                    aborted = await self.command("abort_running", ABORT_MESSAGE)
                else:
                    aborted = 0
                    await self._drain()
                self.state, self.model_path, self.served_model_name = state, path, path
                self.slots.new_weights()  # the held prefixes are of the old weights
                message = "Succeeded to update model weights."
                if version is not None:
                    self.weight_version = str(version)
                    message += f" Weight version updated to {self.weight_version}."
                self.stats["weight_updates"] += 1
                log.info("loaded weights %s from %s (%d requests aborted)", self.weight_version,
                         path, aborted)
            finally:
                self.updating = False
                self.paused = self.paused or keep_pause
                self._release_held()
            return True, message, aborted

    # -- the scheduler ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self.slots.running

    async def run(self) -> None:
        """The scheduler loop: commands, admissions, one decode step; sleeps when idle."""
        self._ensure_loop_objects()
        while True:
            self._apply_commands()
            if not (self.waiting or self.num_running):
                self._idle.set()
            if self.paused or not (self.waiting or self.num_running):
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._admit()
                if self.num_running:
                    await self._decode_step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("scheduler step failed")
                self.failure = f"{type(e).__name__}: {e}"
                self._fail_all(EngineFailure(f"engine step failed: {self.failure}"))
                self.caches = self._empty_caches()  # donated buffers may be gone
                self.slots.forget()

    def _apply_commands(self):
        commands, self._commands = self._commands, []
        for kind, arg, future in commands:
            result = None
            if kind == "abort":
                reqs, message = arg
                result = sum(self._abort(req, message) for req in reqs)
            elif kind in ("abort_all", "abort_running"):
                reqs = self.slots.active()
                if kind == "abort_all":
                    reqs += self.waiting
                result = sum(self._abort(req, arg) for req in reqs)
            elif kind == "pause":
                # abort: SGLang aborts everything its scheduler holds (running and waiting);
                # in_place and retract keep them (retract keeps the slots too: same tokens).
                self.paused = True
                reqs = self.slots.active() + list(self.waiting) if arg == "abort" else []
                result = sum(self._abort(req, ABORT_MESSAGE) for req in reqs)
            elif kind == "hold_waiting":  # a draining update: they start under the new weights
                self.held.extendleft(reversed(self.waiting))
                self.waiting.clear()
            elif kind == "continue":
                self.paused = False
                self._release_held()
            if future is not None and not future.done():
                future.set_result(result)

    def _abort(self, req: Request, message: str) -> bool:
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.held:
            self.held.remove(req)
        elif req.slot < 0:  # already finished
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
        them together (`_run_prefills`)."""
        admitted = []
        while self.waiting and not self._commands and self.slots.has_free:
            req = self.waiting.popleft()
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
        results = await self._compute(partial(self._run_prefills, admitted))
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
        rows = next(b for b in self.decode_buckets if b > max(req.slot for req in active))
        k = ids_bucket(max(len(r.spec.token_ids_logprob or ()) for r in active))
        ids_NxK = None
        if k:
            ids_NxK = np.zeros((rows, k), np.int32)
            self._note_compile(("decode", rows, k), "compiling the decode of %d slots with %d "
                               "token ids", rows, k)
            for req in active:
                ids = req.spec.token_ids_logprob or ()
                ids_NxK[req.slot, :len(ids)] = ids
        seeded = any(req.spec.sampling_seed is not None for req in active)
        start = time.perf_counter()
        token_B, logp_B, ids_logp_BxK = await self._compute(
            partial(self._run_decode, rows, ids_NxK, seeded))
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
        """Records a new token and finishes the request when it should stop (SGLang's order:
        the length limit first, then stop tokens, then stop strings)."""
        req.output.append(token)
        req.logprobs.append(logp)
        if ids_logp is not None and req.spec.token_ids_logprob is not None:
            req.ids_logprobs.append(ids_logp[:len(req.spec.token_ids_logprob)].tolist())
        self.slots.feed(req.slot, token)
        req.changed.set()
        n = len(req.output)
        if n >= req.spec.max_new_tokens:
            self._finish(req, {"type": "length", "length": req.spec.max_new_tokens})
        elif token in req.stop_ids:
            self._finish(req, {"type": "stop", "matched": token})
        elif req.spec.stop and (matched := self._stop_string(req)) is not None:
            self._finish(req, {"type": "stop", "matched": matched})
        elif len(req.spec.prompt) + n >= self.max_seq_len:  # the cache row is full
            self._finish(req, {"type": "length", "length": n})

    def _stop_string(self, req: Request) -> str | None:
        """The stop string the output's tail now holds, if any (tokens are >= 1 character, so
        the last `longest + 1` tokens hold any stop string that the newest token completed)."""
        window = max(map(len, req.spec.stop)) + 1
        tail = self.decode_text(req.output[-window:], req.spec.skip_special_tokens)
        return next((s for s in req.spec.stop if s in tail), None)

    def _finish(self, req: Request, finish_reason: dict):
        if req.slot >= 0:
            self.slots.leave(req)
        if self.by_rid.get(req.rid) is req:
            del self.by_rid[req.rid]
        self.stats[f"finish_{finish_reason['type']}"] += 1
        req.finish_reason = finish_reason
        req.changed.set()
        if not req.future.done():
            try:
                req.future.set_result(self.reply(req))
            except Exception as e:  # noqa: BLE001 - this reply failed; the others go on
                log.exception("building the reply of %s failed", req.rid)
                req.future.set_exception(EngineFailure(f"building the reply failed: {e!r}"))
        if not (self.waiting or self.num_running):
            self._idle.set()

    def text(self, req: Request) -> str | None:
        """The output as text (with a tokenizer): SGLang trims a matched stop (string or token)
        unless `no_stop_trim`."""
        if self.tokenizer is None:
            return None
        ids, finish = req.output, req.finish_reason or {}
        trim = finish.get("type") == "stop" and not req.spec.no_stop_trim
        if trim and isinstance(finish.get("matched"), int):
            ids = ids[:-1]
        text = self.decode_text(ids, req.spec.skip_special_tokens)
        if trim and isinstance(finish.get("matched"), str):
            text = text[:text.find(finish["matched"])] if finish["matched"] in text else text
        return text

    def reply(self, req: Request) -> dict:
        """The request's reply so far (cumulative, as SGLang streams it); final once finished."""
        decode = None if self.tokenizer is None else self.decode_text
        meta = build_meta_info(
            req.spec, req.rid, req.output, req.logprobs, finish_reason=req.finish_reason,
            weight_version=req.version or self.weight_version,
            latency=time.perf_counter() - req.created, decode_batch_size_max=req.max_batch,
            cached_tokens=req.cached,
            input_logprobs=req.input_logprobs, output_ids_logprobs=req.ids_logprobs,
            input_ids_logprobs=req.input_ids_logprobs, decode=decode)
        return build_reply(req.spec, req.output, meta, self.text(req))

    def _fail_all(self, error: Exception):
        for req in [*self.waiting, *self.slots.active()]:
            if req.slot >= 0:
                self.slots.leave(req, keep_prefix=False)
            self.by_rid.pop(req.rid, None)
            req.changed.set()
            if not req.future.done():
                req.future.set_exception(error)
        self.waiting.clear()

    def server_info(self) -> dict:
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
            "paused": self.paused,
            "updating": self.updating,
            "num_running": self.num_running,
            "num_waiting": len(self.waiting) + len(self.held),
            "num_held": len(self.held),
            "running": {r.rid: len(r.output) for r in self.slots.active()},
            "decode_batch_sizes": sizes,
            "max_decode_batch_size": max(self.decode_batch_sizes, default=0),
            "failure": self.failure,
            **dict(self.stats),
        }

    def close(self):
        self._fail_all(EngineFailure("the engine is shutting down"))
        for req in list(self.held):
            if not req.future.done():
                req.future.set_exception(EngineFailure("the engine is shutting down"))
        self.held.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
