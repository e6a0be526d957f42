"""The embedded inference engine: SGLang's native HTTP API over a continuous-batching JAX decoder.

    python -m sao_jax.rollout.engine --model-path DIR [--host 127.0.0.1] [--port 30000]
        [--max-batch 32] [--max-seq-len 2048] [--weight-version 0] [--dtype auto]

`DIR` is a Hugging Face directory as `sao_jax.models.save_hf` writes it. Requests carry token ids
(`input_ids`): like SGLang's `--skip-tokenizer-init`, the engine needs no tokenizer files.

Endpoints (SGLang's names and fields; DESIGN.md, "Contracts"):
  POST /generate                  `input_ids` (a list of ints, or a list of lists for a batch),
                                  `sampling_params`, `return_logprob`, `rid` -> `output_ids` and
                                  `meta_info` {id, finish_reason, prompt_tokens, completion_tokens,
                                  cached_tokens, weight_version, e2e_latency,
                                  output_token_logprobs = [[logprob, token_id, null], ...],
                                  decode_batch_size_max}; a list of those for a batch
  POST /update_weights_from_disk  `model_path`, `weight_version` -> {success, message,
                                  num_paused_requests}
  POST /abort_request             `rid` (or `abort_all`)
  POST /pause_generation          `mode`: "abort" (the default, as SGLang), "in_place", "retract"
  POST /continue_generation
  GET  /health, /health_generate, /get_weight_version, /get_model_info, /get_server_info
  POST /flush_cache               a no-op (there is no prefix cache)
Bad input gets HTTP 400 and SGLang's error body `{"object": "error", "message", "type", "code"}`,
with `param` naming the offending field.

Scheduling: `--max-batch` KV-cache slots of `--max-seq-len` positions each. Between decode steps
the scheduler applies commands (aborts, pauses), then prefills waiting requests into the lowest free
slots (one at a time, the prompt padded to a power-of-two bucket, each bucket compiled on first
use), then decodes every occupied slot together in one jitted step; a request leaves its slot as
soon as it finishes, and new ones join at the next step (continuous batching). A step decodes slots
[0, N) for the smallest power-of-two bucket N (or `--max-batch`) past the highest occupied slot,
one program per bucket, all compiled at start-up (as SGLang captures CUDA graphs per batch size).
Attention spans all `--max-seq-len` positions of a slot, so set it to what rollouts need. Sampling
parameters (temperature, top-p, top-k) are per row, so requests with different parameters share a
step. The decode batch sizes (occupied slots per step) are counted in `/get_server_info`
(`decode_batch_sizes`) and in each reply's `meta_info.decode_batch_size_max`.

Log-probs: every token's `logprob` is its temperature-1 log-softmax under the full vocabulary, from
the same forward pass that sampled it and with the drop-free `logprob_dispatch`, whatever the
sampling filters (DESIGN.md, "Numerics that DIS depends on"); it equals the learner's teacher-forced
log-prob of the token.

Weight updates (DESIGN.md, "Processes"): `/update_weights_from_disk` pauses generation, so running
requests return at once with `finish_reason.type == "abort"` and their partial tokens (requests not
yet started stay queued), loads the new weights into the running model, sets the version, and
continues. An update always aborts running requests, as SGLang's `abort_all_requests=true`; every
reply's tokens come from one weight version, its `meta_info.weight_version`. Without a
`weight_version`, an integer version is incremented (other versions are kept, as SGLang).

Lifetime: the engine exits when its parent process dies (it polls its parent pid; `--parent-pid 0`
turns that off), so a learner killed even by SIGKILL leaves no engine behind.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import signal
import time
import uuid
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from aiohttp import web
from flax import nnx

from sao_jax.models.hf import CONFIG_FILE, load_hf, read_config
from sao_jax.models.transformer import CausalLM, KVCache, causal_mask
from sao_jax.rollout.lifetime import watch_parent

log = logging.getLogger("sao_jax.engine")

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
GREEDY_BELOW = 1e-6  # temperatures below this decode greedily (SGLang's _SAMPLING_EPS)
MIN_PREFILL_BUCKET = 16
HEALTH_TIMEOUT_S = 20.0

# ------------------------------------------------------------------------------------------------
# Sampling with per-row parameters, and the two jitted programs.


def filter_logits_rows(logits_BxV, temperature_B, top_p_B, top_k_B):
    """`sampling.filter_logits` with a temperature, top-p and top-k per row.

    Rows with `temperature <= 0` are left unscaled (they decode greedily), `top_k <= 0` (or >= V)
    and `top_p >= 1` disable their filter. Filtered entries become -inf.
    """
    temperature_B = jnp.where(temperature_B > 0, temperature_B, 1.0)
    logits_BxV = logits_BxV / temperature_B[:, None]
    v = logits_BxV.shape[-1]
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    k_B = jnp.where((top_k_B > 0) & (top_k_B < v), top_k_B, v)
    kth_Bx1 = jnp.take_along_axis(sorted_BxV, k_B[:, None] - 1, axis=-1)
    logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    sorted_BxV = jnp.where(sorted_BxV < kth_Bx1, -jnp.inf, sorted_BxV)  # still sorted
    # Nucleus: keep the smallest prefix whose mass reaches top_p (as `filter_logits`).
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    kept_BxV = jnp.where(before_BxV < top_p_B[:, None], sorted_BxV, jnp.inf)
    threshold_Bx1 = jnp.min(kept_BxV, axis=-1, keepdims=True)
    threshold_Bx1 = jnp.where(top_p_B[:, None] < 1.0, threshold_Bx1, -jnp.inf)
    return jnp.where(logits_BxV < threshold_Bx1, -jnp.inf, logits_BxV)


def sample_rows(logits_BxV, key, temperature_B, top_p_B, top_k_B):
    """One token per row and its temperature-1 full-softmax log-prob: `(token_B, logp_B)`."""
    filtered_BxV = filter_logits_rows(logits_BxV, temperature_B, top_p_B, top_k_B)
    sampled_B = jax.random.categorical(key, filtered_BxV).astype(jnp.int32)
    greedy_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    token_B = jnp.where(temperature_B > 0, sampled_B, greedy_B)
    logp_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BxV, axis=-1), token_B[:, None], 1)
    return token_B, logp_B[:, 0]


def _forward_cached(model: CausalLM, ids_BxT, positions_BxT, caches):
    """Hidden states of new tokens written at their positions into the (per-row) caches."""
    b = ids_BxT.shape[0]
    s = caches[0].k_BxSxKxH.shape[1]
    mask_BxTxS = causal_mask(positions_BxT, key_positions_BxS=jnp.broadcast_to(jnp.arange(s),
                                                                               (b, s)))
    out = model.backbone(ids_BxT, positions_BxT, mask_BxTxS, dispatch=model.cfg.logprob_dispatch,
                         caches=caches, slots_BxT=positions_BxT)
    return out.hidden_BxTxD, out.caches


def _logits(model: CausalLM, hidden_BxD):
    return jnp.einsum("bd,dv->bv", hidden_BxD, model.head_weight(),
                      preferred_element_type=jnp.float32)


def _prefill(graphdef, state, caches, ids_1xP, length, slot, temperature_1, top_p_1, top_k_1,
             key):
    """Writes a (right-padded) prompt into cache row `slot`; samples the first new token."""
    model = nnx.merge(graphdef, state)
    row = tuple(KVCache(*(jax.lax.dynamic_slice_in_dim(x, slot, 1) for x in c)) for c in caches)
    positions_1xP = jnp.arange(ids_1xP.shape[1])[None]
    hidden_1xPxD, row = _forward_cached(model, ids_1xP, positions_1xP, row)
    caches = tuple(KVCache(*(jax.lax.dynamic_update_slice_in_dim(x, r, slot, 0)
                             for x, r in zip(c, rc, strict=True)))
                   for c, rc in zip(caches, row, strict=True))
    last_1xD = jax.lax.dynamic_slice_in_dim(hidden_1xPxD[0], length - 1, 1)
    key, sub = jax.random.split(key)
    token_1, logp_1 = sample_rows(_logits(model, last_1xD), sub, temperature_1, top_p_1, top_k_1)
    return caches, token_1[0], logp_1[0], key


def _decode(graphdef, state, caches, tokens_N, positions_N, temperature_N, top_p_N, top_k_N,
            key):
    """One decode step for the first N slots (N = len(tokens_N), a batch bucket): `tokens_N` go
    to `positions_N`; samples the next ones. Slots from N on are left as they are."""
    model = nnx.merge(graphdef, state)
    n = tokens_N.shape[0]
    rows = caches if n == caches[0].k_BxSxKxH.shape[0] else tuple(
        KVCache(*(x[:n] for x in c)) for c in caches)
    hidden_Nx1xD, rows = _forward_cached(model, tokens_N[:, None], positions_N[:, None], rows)
    caches = rows if rows[0].k_BxSxKxH.shape == caches[0].k_BxSxKxH.shape else tuple(
        KVCache(*(jax.lax.dynamic_update_slice_in_dim(x, r, 0, 0) for x, r in zip(c, rc,
                                                                                   strict=True)))
        for c, rc in zip(caches, rows, strict=True))
    key, sub = jax.random.split(key)
    token_N, logp_N = sample_rows(_logits(model, hidden_Nx1xD[:, 0]), sub, temperature_N, top_p_N,
                                  top_k_N)
    return caches, token_N, logp_N, key


# ------------------------------------------------------------------------------------------------
# Requests and the scheduler.


class BadRequest(ValueError):
    """Invalid request input; `field` names what is wrong (HTTP 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class EngineFailure(RuntimeError):
    """The scheduler failed while running a request (HTTP 500)."""


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One validated generation request."""

    prompt: tuple[int, ...]
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    return_logprob: bool = False
    rid: str | None = None


@dataclasses.dataclass(eq=False)
class _Request:
    spec: RequestSpec
    rid: str
    stop_ids: frozenset[int]
    future: asyncio.Future
    created: float
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    slot: int = -1
    version: str | None = None  # the weights that generated its tokens (set when admitted)
    max_batch: int = 0


def prefill_buckets(max_seq_len: int) -> list[int]:
    """Padded prompt lengths: powers of two from 16, and `max_seq_len` itself."""
    buckets, b = [], MIN_PREFILL_BUCKET
    while b < max_seq_len:
        buckets.append(b)
        b *= 2
    return [*buckets, max_seq_len]


def decode_buckets(max_batch: int) -> list[int]:
    """Decoded slot counts: powers of two below `max_batch`, and `max_batch` itself."""
    buckets, b = [], 1
    while b < max_batch:
        buckets.append(b)
        b *= 2
    return [*buckets, max_batch]


def read_eos_ids(path: str) -> frozenset[int]:
    """`eos_token_id` (an int or a list) of config.json and generation_config.json, if any."""
    ids: set[int] = set()
    for name in (CONFIG_FILE, "generation_config.json"):
        file = os.path.join(path, name)
        if os.path.exists(file):
            with open(file) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(int(i) for i in ids)


def _bump(version: str) -> str:
    return str(int(version) + 1) if version.isdigit() else version


class Engine:
    """The model, its slot KV cache and the continuous-batching scheduler.

    All scheduler state lives in the event loop's thread; compiled programs run on one worker
    thread (`_compute`), so HTTP handlers keep answering while the device works. Handlers never
    touch slots: they queue requests and commands, which the scheduler applies between steps.
    """

    def __init__(self, model_path: str, *, max_batch: int = 32, max_seq_len: int | None = None,
                 dtype: str = "auto", weight_version: str = "0", seed: int = 0,
                 dispatch: str | None = None):
        self.dtype = jnp.dtype(_config_dtype(model_path) if dtype == "auto" else dtype)
        self._overrides = {"logprob_dispatch": dispatch} if dispatch else {}
        model = load_hf(model_path, self.dtype, **self._overrides)
        self.cfg = model.cfg
        self.model_path = model_path
        self.weight_version = str(weight_version)
        graphdef, self.state = nnx.split(model)
        self._abstract = nnx.eval_shape(lambda: CausalLM(self.cfg, nnx.Rngs(0)))  # load_state
        self.max_batch = max_batch
        self.max_seq_len = min(max_seq_len or 2048, self.cfg.max_position_embeddings)
        if self.max_seq_len < 2:
            raise ValueError(f"--max-seq-len must be >= 2, got {self.max_seq_len}.")
        self.buckets = prefill_buckets(self.max_seq_len)  # compiled on first use
        self._prefill_compiled: set[int] = set()
        self.decode_buckets = decode_buckets(max_batch)
        self.eos_ids = read_eos_ids(model_path)
        self._prefill = jax.jit(partial(_prefill, graphdef), donate_argnums=(1,))
        self._decode = jax.jit(partial(_decode, graphdef), donate_argnums=(1,))
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "engine-compute")
        self._key = jax.random.key(seed)
        self.caches = self._empty_caches()
        # Slot state: the token each slot feeds to the next decode step and its position.
        self.slots: list[_Request | None] = [None] * max_batch
        self._tokens_B = np.zeros(max_batch, np.int32)
        self._positions_B = np.zeros(max_batch, np.int32)
        self._temperature_B = np.zeros(max_batch, np.float32)
        self._top_p_B = np.ones(max_batch, np.float32)
        self._top_k_B = np.zeros(max_batch, np.int32)
        self.waiting: collections.deque[_Request] = collections.deque()
        self.by_rid: dict[str, _Request] = {}
        self.paused = False
        self._commands: list[tuple[str, object, asyncio.Future | None]] = []
        self._wake: asyncio.Event | None = None
        self._update_lock: asyncio.Lock | None = None
        self.failure: str | None = None
        self.last_step_time = 0.0
        self.stats = collections.Counter()
        self.decode_batch_sizes = collections.Counter()

    # -- compute ---------------------------------------------------------------------------------

    def _empty_caches(self):
        shape = (self.max_batch, self.max_seq_len, self.cfg.num_kv_heads, self.cfg.head_dim)
        return tuple(KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
                     for _ in range(self.cfg.num_layers))

    async def _compute(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _run_prefills(self, jobs: list[tuple[Sequence[int], int, RequestSpec]]):
        """Prefills several (prompt, slot, spec) one after another, dispatching them all before
        reading any result: one thread hop and one wait for the lot, and the host prepares the
        next while the device computes the last (each uses the caches the previous returned)."""
        results = [self._dispatch_prefill(*job) for job in jobs]
        return [(int(token), float(logp)) for token, logp in results]

    def _dispatch_prefill(self, prompt, slot, spec: RequestSpec):
        n = len(prompt)
        bucket = next(b for b in self.buckets if b >= n)
        if bucket not in self._prefill_compiled:
            self._prefill_compiled.add(bucket)
            log.info("compiling the prefill of prompts of up to %d tokens", bucket)
        ids_1xP = np.zeros((1, bucket), np.int32)
        ids_1xP[0, :n] = prompt
        self.caches, token, logp, self._key = self._prefill(
            self.state, self.caches, ids_1xP, np.int32(n), np.int32(slot),
            np.float32([spec.temperature]), np.float32([spec.top_p]), np.int32([spec.top_k]),
            self._key)
        return token, logp

    def _run_decode(self, n: int):
        """Decodes slots [0, n) (host arrays copied at call time); returns tokens and log-probs."""
        self.caches, token_N, logp_N, self._key = self._decode(
            self.state, self.caches, self._tokens_B[:n].copy(), self._positions_B[:n].copy(),
            self._temperature_B[:n].copy(), self._top_p_B[:n].copy(), self._top_k_B[:n].copy(),
            self._key)
        return np.asarray(token_N), np.asarray(logp_N)

    def warmup(self) -> None:
        """Compiles every decode bucket and the smallest prefill bucket (larger prompts compile
        theirs on first use). Slot contents are garbage until a prefill overwrites them."""
        start = time.perf_counter()
        self._run_prefills([([0], 0, RequestSpec(prompt=(0,)))])
        for n in self.decode_buckets:
            self._run_decode(n)
        log.info("compiled prefill and %d decode buckets in %.1f s", len(self.decode_buckets),
                 time.perf_counter() - start)

    def load_state(self, path: str):
        """New weights for the running model; raises ValueError if they do not fit it."""
        cfg = read_config(path, param_dtype=self.dtype.name, **self._overrides)
        changed = [f.name for f in dataclasses.fields(cfg)
                   if getattr(cfg, f.name) != getattr(self.cfg, f.name)]
        if changed:
            raise ValueError(f"{path}: config.json differs from the served model in {changed}; "
                             "a weight update must keep the architecture.")
        _, state = nnx.split(load_hf(path, self.dtype, like=self._abstract, **self._overrides))
        if jax.tree.structure(state) != jax.tree.structure(self.state):
            raise ValueError(f"{path}: the loaded parameters do not match the served model's.")
        return jax.block_until_ready(state)

    # -- requests and commands (called from handlers) --------------------------------------------

    def _ensure_loop_objects(self):
        if self._wake is None:
            self._wake, self._update_lock = asyncio.Event(), asyncio.Lock()

    def submit(self, spec: RequestSpec) -> _Request:
        """Queues a request; its `future` resolves to the reply dict."""
        self._ensure_loop_objects()
        rid = spec.rid or uuid.uuid4().hex
        if rid in self.by_rid:
            raise BadRequest("rid", f"duplicate request id {rid!r}: a request with this id is "
                                    "still running.")
        stop = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(self.eos_ids))
        req = _Request(spec, rid, frozenset(stop), asyncio.get_running_loop().create_future(),
                       time.perf_counter())
        self.by_rid[rid] = req
        self.waiting.append(req)
        self._wake.set()
        return req

    def cancel(self, req: _Request, message: str) -> None:
        """Aborts `req` at the next step without waiting (e.g. its client went away)."""
        if self.by_rid.get(req.rid) is req:
            del self.by_rid[req.rid]  # the id is free again at once
        self._enqueue("abort", ([req], message), None)

    def _enqueue(self, kind, arg, future):
        self._ensure_loop_objects()
        self._commands.append((kind, arg, future))
        self._wake.set()

    async def command(self, kind: str, arg=None):
        """Runs a scheduler command ("abort", "pause", "continue") at the next step boundary."""
        future = asyncio.get_running_loop().create_future()
        self._enqueue(kind, arg, future)
        return await future

    async def abort(self, rids: list[str] | None, message: str) -> int:
        """Aborts the given requests (all when `rids` is None); returns how many were live."""
        reqs = (list(self.by_rid.values()) if rids is None
                else [self.by_rid[r] for r in rids if r in self.by_rid])
        return await self.command("abort", (reqs, message))

    async def update_weights(self, path: str, version: str | None, keep_pause: bool = False):
        """Pause (aborting running requests), load, set the version, continue.

        Returns `(success, message, num_paused_requests)`; on failure the old weights stay.
        """
        self._ensure_loop_objects()
        async with self._update_lock:
            was_paused = self.paused
            aborted = await self.command("pause", "abort")
            try:
                state = await self._compute(partial(self.load_state, path))
            except Exception as e:  # noqa: BLE001 - reported to the caller, the engine goes on
                log.warning("weight update from %s failed: %s", path, e)
                if not was_paused:
                    await self.command("continue")
                return False, f"Failed to update weights from {path}: {e}", aborted
            self.state, self.model_path = state, path
            self.weight_version = str(version) if version is not None else _bump(
                self.weight_version)
            self.stats["weight_updates"] += 1
            log.info("loaded weights %s from %s (%d running requests aborted)",
                     self.weight_version, path, aborted)
            if not (was_paused or keep_pause):
                await self.command("continue")
            return (True, "Succeeded to update model weights. Weight version updated to "
                    f"{self.weight_version}.", aborted)

    # -- the scheduler ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    async def run(self) -> None:
        """The scheduler loop: commands, admissions, one decode step; sleeps when idle."""
        self._ensure_loop_objects()
        while True:
            self._apply_commands()
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

    def _apply_commands(self):
        commands, self._commands = self._commands, []
        for kind, arg, future in commands:
            result = None
            if kind == "abort":
                reqs, message = arg
                result = sum(self._abort(req, message) for req in reqs)
            elif kind == "pause":
                self.paused = True
                if arg == "abort":
                    result = sum(self._abort(req, "Aborted: generation paused (pause_generation "
                                             "or a weight update).")
                                 for req in list(self.slots) if req is not None)
                else:
                    result = 0
            elif kind == "continue":
                self.paused = False
            if future is not None and not future.done():
                future.set_result(result)

    def _abort(self, req: _Request, message: str) -> bool:
        if req in self.waiting:
            self.waiting.remove(req)
        elif req.slot < 0:  # already finished
            return False
        self._finish(req, {"type": "abort", "message": message, "status_code": None,
                           "err_type": None})
        return True

    async def _admit(self):
        """Gives every waiting request a free slot (while no command is pending) and prefills
        them together (`_run_prefills`)."""
        admitted = []
        while self.waiting and not self._commands and None in self.slots:
            req = self.waiting.popleft()
            spec = req.spec
            if spec.max_new_tokens == 0:
                req.version = self.weight_version
                self._finish(req, {"type": "length", "length": 0})
                continue
            slot = self.slots.index(None)
            req.slot, req.version = slot, self.weight_version
            self.slots[slot] = req
            admitted.append(req)
        if not admitted:
            return
        results = await self._compute(partial(
            self._run_prefills, [(req.spec.prompt, req.slot, req.spec) for req in admitted]))
        for req, (token, logp) in zip(admitted, results, strict=True):
            spec, slot = req.spec, req.slot
            if slot < 0:  # aborted while the prefill ran: its slot is free again
                continue
            self.stats["prefills"] += 1
            self._positions_B[slot] = len(spec.prompt)
            self._temperature_B[slot] = spec.temperature
            self._top_p_B[slot], self._top_k_B[slot] = spec.top_p, spec.top_k
            self._append(req, token, logp)

    async def _decode_step(self):
        active = [req for req in self.slots if req is not None]
        n = len(active)
        rows = next(b for b in self.decode_buckets if b > max(req.slot for req in active))
        token_B, logp_B = await self._compute(partial(self._run_decode, rows))
        self.last_step_time = time.monotonic()
        self.decode_batch_sizes[n] += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += n
        for req in active:
            if req.slot < 0:  # finished while the step ran (cannot happen today; be safe)
                continue
            req.max_batch = max(req.max_batch, n)
            self._positions_B[req.slot] += 1
            self._append(req, int(token_B[req.slot]), float(logp_B[req.slot]))

    def _append(self, req: _Request, token: int, logp: float):
        """Records a new token and finishes the request when it should stop (SGLang's order:
        the length limit first, then stop tokens)."""
        req.output.append(token)
        req.logprobs.append(logp)
        self._tokens_B[req.slot] = token
        n = len(req.output)
        if n >= req.spec.max_new_tokens:
            self._finish(req, {"type": "length", "length": req.spec.max_new_tokens})
        elif token in req.stop_ids:
            self._finish(req, {"type": "stop", "matched": token})
        elif len(req.spec.prompt) + n >= self.max_seq_len:  # the cache row is full
            self._finish(req, {"type": "length", "length": n})

    def _finish(self, req: _Request, finish_reason: dict):
        if req.slot >= 0:
            self.slots[req.slot] = None
            self._tokens_B[req.slot] = self._positions_B[req.slot] = 0
            req.slot = -1
        if self.by_rid.get(req.rid) is req:
            del self.by_rid[req.rid]
        self.stats[f"finish_{finish_reason['type']}"] += 1
        if not req.future.done():
            req.future.set_result(self._reply(req, finish_reason))

    def _reply(self, req: _Request, finish_reason: dict) -> dict:
        meta = {
            "id": req.rid,
            "finish_reason": finish_reason,
            "prompt_tokens": len(req.spec.prompt),
            "completion_tokens": len(req.output),
            "cached_tokens": 0,
            "weight_version": req.version or self.weight_version,
            "e2e_latency": time.perf_counter() - req.created,
            "decode_batch_size_max": req.max_batch,
        }
        if req.spec.return_logprob:
            meta["output_token_logprobs"] = [
                [lp if math.isfinite(lp) else None, tok, None]
                for lp, tok in zip(req.logprobs, req.output, strict=True)]
        return {"output_ids": list(req.output), "meta_info": meta}

    def _fail_all(self, error: Exception):
        for req in [*self.waiting, *(r for r in self.slots if r is not None)]:
            if req.slot >= 0:
                self.slots[req.slot] = None
                req.slot = -1
            self.by_rid.pop(req.rid, None)
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
            "paused": self.paused,
            "num_running": self.num_running,
            "num_waiting": len(self.waiting),
            "running": {r.rid: len(r.output) for r in self.slots if r is not None},
            "decode_batch_sizes": sizes,
            "max_decode_batch_size": max(self.decode_batch_sizes, default=0),
            "failure": self.failure,
            **dict(self.stats),
        }

    def close(self):
        self._fail_all(EngineFailure("the engine is shutting down"))
        self._executor.shutdown(wait=False, cancel_futures=True)


def _config_dtype(path: str) -> str:
    with open(os.path.join(path, CONFIG_FILE)) as f:
        hf = json.load(f)
    name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"


# ------------------------------------------------------------------------------------------------
# Request parsing (SGLang's field names).

# Sampling parameters that change only text output (no tokenizer here), and ones accepted only at
# their neutral value; anything else is refused rather than silently ignored.
_TEXT_ONLY_PARAMS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                     "stream_interval"}
_NEUTRAL_PARAMS = {"stop": (None, "", ()), "stop_regex": (None, "", ()), "min_new_tokens": (0,),
                   "n": (1,), "frequency_penalty": (0,), "presence_penalty": (0,),
                   "repetition_penalty": (1,), "min_p": (0,), "json_schema": (None,),
                   "regex": (None,), "ebnf": (None,), "structural_tag": (None,),
                   "sampling_seed": (None,), "logit_bias": (None,), "custom_params": (None,)}
_UNSUPPORTED_FIELDS = {"text": "this engine has no tokenizer (as SGLang's --skip-tokenizer-init): "
                               "send input_ids",
                       "input_embeds": "embeddings are not supported: send input_ids",
                       "image_data": "multimodal input is not supported",
                       "stream": "streaming is not supported: send stream=false",
                       "top_logprobs_num": "top log-probs are not supported",
                       "lora_path": "LoRA adapters are not supported"}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _neutral(value, allowed) -> bool:
    return any(value == a or (a == () and value == []) for a in allowed)


def parse_sampling_params(params, field: str = "sampling_params") -> dict:
    """SGLang `sampling_params` -> RequestSpec fields; raises BadRequest naming the field."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise BadRequest(field, f"must be a JSON object, got {type(params).__name__}.")
    out = {}
    for key, value in params.items():
        name = f"{field}.{key}"
        if key == "temperature":
            if not _is_number(value) or value < 0:
                raise BadRequest(name, f"must be a number >= 0, got {value!r}.")
            out["temperature"] = float(value) if value >= GREEDY_BELOW else 0.0
        elif key == "top_p":
            if not _is_number(value) or not 0 < value <= 1:
                raise BadRequest(name, f"must lie in (0, 1], got {value!r}.")
            out["top_p"] = float(value)
        elif key == "top_k":
            if not _is_int(value) or value < -1:
                raise BadRequest(name, f"must be an integer >= 1, or -1 / 0 for no limit, got "
                                       f"{value!r}.")
            out["top_k"] = max(value, 0)
        elif key == "max_new_tokens":
            if value is None:
                continue
            if not _is_int(value) or value < 0:
                raise BadRequest(name, f"must be an integer >= 0, got {value!r}.")
            out["max_new_tokens"] = value
        elif key == "stop_token_ids":
            if value is None:
                continue
            if not isinstance(value, list) or not all(_is_int(t) for t in value):
                raise BadRequest(name, f"must be a list of token ids, got {value!r}.")
            out["stop_token_ids"] = frozenset(value)
        elif key == "ignore_eos":
            if not isinstance(value, bool):
                raise BadRequest(name, f"must be true or false, got {value!r}.")
            out["ignore_eos"] = value
        elif key in _TEXT_ONLY_PARAMS:
            continue
        elif key in _NEUTRAL_PARAMS:
            if not _neutral(value, _NEUTRAL_PARAMS[key]):
                raise BadRequest(name, f"is not supported by the embedded engine (only its "
                                       f"neutral value {_NEUTRAL_PARAMS[key][0]!r}).")
        else:
            raise BadRequest(name, "unknown sampling parameter; supported: temperature, top_p, "
                                   "top_k, max_new_tokens, stop_token_ids, ignore_eos.")
    return out


def _per_item(value, n: int, field: str, batch: bool):
    """A request field that may be given once or as a list with one entry per prompt."""
    if batch and isinstance(value, list):
        if len(value) != n:
            raise BadRequest(field, f"has {len(value)} entries for {n} prompts.")
        return value
    return [value] * n


def parse_generate(body, vocab_size: int, max_seq_len: int) -> tuple[list[RequestSpec], bool]:
    """A `/generate` body -> one RequestSpec per prompt, and whether it was a batch."""
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object.")
    for key, why in _UNSUPPORTED_FIELDS.items():
        if body.get(key) not in (None, False, 0, "", []):
            raise BadRequest(key, why + ".")
    ids = body.get("input_ids")
    if ids is None:
        raise BadRequest("input_ids", "required: a list of token ids, or a list of such lists "
                                      "for a batch.")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids", "must be a non-empty list of token ids (or of lists).")
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    for i, prompt in enumerate(prompts):
        name = f"input_ids[{i}]" if batch else "input_ids"
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest(name, "must be a non-empty list of token ids.")
        bad = next((t for t in prompt if not _is_int(t) or not 0 <= t < vocab_size), None)
        if bad is not None or not all(_is_int(t) for t in prompt):
            raise BadRequest(name, f"token ids must be integers in [0, {vocab_size}), got "
                                   f"{bad!r}.")
        if len(prompt) >= max_seq_len:
            raise BadRequest(name, f"prompt of {len(prompt)} tokens leaves no room for a new "
                                   f"token in --max-seq-len {max_seq_len}.")
    n = len(prompts)
    params = _per_item(body.get("sampling_params"), n, "sampling_params", batch)
    rids = _per_item(body.get("rid"), n, "rid", batch)
    logprob = _per_item(body.get("return_logprob", False), n, "return_logprob", batch)
    specs = []
    for i in range(n):
        if rids[i] is not None and not isinstance(rids[i], str):
            raise BadRequest("rid", f"must be a string, got {rids[i]!r}.")
        if not isinstance(logprob[i], bool):
            raise BadRequest("return_logprob", f"must be true or false, got {logprob[i]!r}.")
        fields = parse_sampling_params(params[i])
        specs.append(RequestSpec(prompt=tuple(prompts[i]), return_logprob=logprob[i],
                                 rid=rids[i], **fields))
    named = [s.rid for s in specs if s.rid is not None]
    if len(set(named)) != len(named):
        raise BadRequest("rid", "request ids within a batch must be distinct.")
    return specs, batch


# ------------------------------------------------------------------------------------------------
# HTTP.


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = {400: "BadRequest", 404: "NotFound", 500: "InternalServerError",
            503: "ServiceUnavailable"}.get(status, "Error")
    return web.json_response({"object": "error", "message": message, "type": kind,
                              "param": param, "code": status}, status=status)


async def _json_body(request: web.Request, required: bool = True):
    raw = await request.read()
    if not raw.strip():
        if required:
            raise BadRequest("body", "empty request body; send a JSON object.")
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest("body", f"invalid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object.")
    return body


@web.middleware
async def _errors_middleware(request, handler):
    try:
        return await handler(request)
    except BadRequest as e:
        return _error(400, str(e), e.field)
    except EngineFailure as e:
        return _error(500, str(e))


def build_app(engine: Engine) -> web.Application:
    """The aiohttp application serving `engine` (run `engine.run()` beside it)."""

    async def generate(request):
        specs, batch = parse_generate(await _json_body(request), engine.cfg.vocab_size,
                                      engine.max_seq_len)
        taken = [s.rid for s in specs if s.rid in engine.by_rid]
        if taken:
            raise BadRequest("rid", f"duplicate request id {taken[0]!r}: a request with this id "
                                    "is still running.")
        reqs = [engine.submit(spec) for spec in specs]
        try:
            replies = await asyncio.gather(*(r.future for r in reqs))
        except asyncio.CancelledError:  # the client went away: free the slots
            for r in reqs:
                engine.cancel(r, "Aborted: the client disconnected.")
            raise
        return web.json_response(replies if batch else replies[0])

    async def update_weights_from_disk(request):
        body = await _json_body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path", "required: the directory of the new weights.")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str | int):
            raise BadRequest("weight_version", f"must be a string, got {version!r}.")
        if body.get("abort_all_requests") is False:
            raise BadRequest("abort_all_requests", "false is not supported: an update always "
                                                   "aborts running requests (DESIGN.md).")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest("load_format", "only safetensors directories are supported.")
        # Shielded: a client that hangs up must not leave the engine paused.
        ok, message, paused = await asyncio.shield(engine.update_weights(
            path, None if version is None else str(version), bool(body.get("keep_pause"))))
        return web.json_response({"success": ok, "message": message,
                                  "num_paused_requests": paused}, status=200 if ok else 400)

    async def abort_request(request):
        body = await _json_body(request, required=False)
        rid = body.get("rid")
        if body.get("abort_all"):
            n = await asyncio.shield(engine.abort(None, "Aborted by /abort_request."))
        elif isinstance(rid, str) or (isinstance(rid, list) and
                                      all(isinstance(r, str) for r in rid)):
            rids = [rid] if isinstance(rid, str) else rid
            n = await asyncio.shield(engine.abort(rids, "Aborted by /abort_request."))
        else:
            raise BadRequest("rid", "required: the request id to abort (or abort_all=true).")
        return web.json_response({"success": True, "num_aborted": n})

    async def pause_generation(request):
        body = await _json_body(request, required=False)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest("mode", f"must be abort, in_place or retract, got {mode!r}.")
        # retract keeps requests in their slots, as in_place: nothing is recomputed, same tokens.
        n = await asyncio.shield(engine.command("pause", mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok",
                                  "num_aborted": n})

    async def continue_generation(request):
        await asyncio.shield(engine.command("continue"))
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def health(request):
        return web.json_response({"status": "ok"})

    async def health_generate(request):
        if engine.paused:
            return web.json_response({"status": "paused"})
        if engine.num_running and time.monotonic() - engine.last_step_time < HEALTH_TIMEOUT_S:
            return web.json_response({"status": "ok"})
        req = engine.submit(RequestSpec(prompt=(0,), max_new_tokens=1, temperature=0.0,
                                        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}"))
        try:
            await asyncio.wait_for(asyncio.shield(req.future), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineFailure) as e:
            engine.cancel(req, "health check timed out")
            return _error(503, f"the engine did not generate a token: {e!r}")
        return web.json_response({"status": "ok"})

    async def get_weight_version(request):
        return web.json_response({"weight_version": engine.weight_version})

    async def get_model_info(request):
        return web.json_response({"model_path": engine.model_path, "tokenizer_path": None,
                                  "is_generation": True,
                                  "weight_version": engine.weight_version})

    async def get_server_info(request):
        return web.json_response(engine.server_info())

    async def flush_cache(request):
        return web.Response(text="Cache flushed (the embedded engine keeps no prefix cache).\n")

    app = web.Application(client_max_size=64 << 20, middlewares=[_errors_middleware])
    app.add_routes([
        web.post("/generate", generate),
        web.put("/generate", generate),
        web.post("/update_weights_from_disk", update_weights_from_disk),
        web.post("/abort_request", abort_request),
        web.post("/pause_generation", pause_generation),
        web.post("/continue_generation", continue_generation),
        web.get("/health", health),
        web.get("/health_generate", health_generate),
        web.get("/get_weight_version", get_weight_version),
        web.get("/get_model_info", get_model_info),
        web.get("/get_server_info", get_server_info),
        web.post("/flush_cache", flush_cache),
        web.get("/flush_cache", flush_cache),
    ])
    return app


# ------------------------------------------------------------------------------------------------
# Process.


async def serve(args) -> None:
    engine = Engine(args.model_path, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                    dtype=args.dtype, weight_version=args.weight_version, seed=args.seed,
                    dispatch=args.dispatch)
    engine.warmup()
    runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    scheduler = asyncio.create_task(engine.run())
    stop = asyncio.Event()

    def scheduler_ended(task: asyncio.Task):
        if not task.cancelled():
            log.critical("the scheduler stopped (%r): exiting", task.exception())
            stop.set()

    scheduler.add_done_callback(scheduler_ended)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("serving %s (version %s, %d slots x %d positions) on http://%s:%d",
             args.model_path, engine.weight_version, engine.max_batch, engine.max_seq_len,
             args.host, args.port)
    await stop.wait()
    log.info("shutting down")
    scheduler.remove_done_callback(scheduler_ended)
    scheduler.cancel()
    engine.close()
    await runner.cleanup()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="HF directory written by save_hf")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--max-batch", type=int, default=32, help="KV-cache slots")
    parser.add_argument("--max-seq-len", type=int, default=2048,
                        help="positions per slot (prompt + output), capped by the config")
    parser.add_argument("--dtype", default="auto", help="auto (config.json), float32, bfloat16")
    parser.add_argument("--dispatch", default=None, choices=("dense", "ragged"),
                        help="MoE dispatch (drop-free); default: the config's logprob_dispatch")
    parser.add_argument("--weight-version", default="0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process dies (default: the parent; 0: never)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
    parent = os.getppid() if args.parent_pid is None else args.parent_pid
    if parent:
        watch_parent(parent)  # first, so that even a slow start cannot outlive the parent
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
