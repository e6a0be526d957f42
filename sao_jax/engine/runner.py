"""The embedded engine's model on the device: its weights, the slots' KV cache, the jitted
programs (`programs.py`: the prefill, the decode step, sampling) and the one thread they run on.

The scheduler (`scheduler.py`) decides what to prefill and decode, and when; `ModelRunner` runs it
and returns host arrays. The slots' bookkeeping (`slots.py`) is the scheduler's: the decode step
reads its per-row inputs when it runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.engine.model_io import config_dtype, load_state, tensor_specs
from sao_jax.engine.programs import (
    KEY_IMPL,
    decode,
    decode_buckets,
    ids_bucket,
    prefill,
    prefill_buckets,
    seed_words,
)
from sao_jax.engine.sglang_api import RequestSpec
from sao_jax.engine.slots import Request, Slots
from sao_jax.models.hf import check_complete, load_hf
from sao_jax.models.transformer import CausalLM, empty_caches

log = logging.getLogger("sao_jax.engine")


class ModelRunner:
    """The model's weights and slot KV cache on the device, and its compiled programs.

    Programs run on one worker thread (`compute`), so that the event loop keeps answering while
    the device works. Prefill programs compile per prompt bucket on first use (`buckets`); the
    decode step's, one per slot bucket (`decode_buckets`), at `warmup`. `compiled` names the
    programs compiled so far.
    """

    def __init__(self, model_path: str, *, max_batch: int, max_seq_len: int | None,
                 dtype: str, seed: int, dispatch: str | None, routed_experts: bool = False):
        check_complete(model_path)  # a directory save_hf is still writing is refused
        self.dtype = jnp.dtype(config_dtype(model_path) if dtype == "auto" else dtype)
        self._overrides = {"logprob_dispatch": dispatch} if dispatch else {}
        model = load_hf(model_path, self.dtype, **self._overrides)
        self.cfg = model.cfg
        self.tensors = tensor_specs(model_path)  # what a weight update must match, by name
        graphdef, self.state = nnx.split(model)
        self._abstract = nnx.eval_shape(lambda: CausalLM(self.cfg, nnx.Rngs(0)))  # load_state
        self.max_batch = max_batch
        self.max_seq_len = min(max_seq_len or 2048, self.cfg.max_position_embeddings)
        if self.max_seq_len < 2:
            raise ValueError(f"--max-seq-len must be >= 2, got {self.max_seq_len}.")
        self.buckets = prefill_buckets(self.max_seq_len)  # compiled on first use
        self.compiled: set[tuple] = set()
        self.decode_buckets = decode_buckets(max_batch)
        # Indexed by `input_logprobs`, bound here: a static keyword argument would take jit's
        # slower dispatch path on every call.
        self._prefill = tuple(jax.jit(partial(prefill, graphdef, input_logprobs=wants),
                                      donate_argnums=(1, 2)) for wants in (False, True))
        self._decode = jax.jit(partial(decode, graphdef), donate_argnums=(1, 2))
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "engine-compute")
        self._key = jax.random.key(seed, impl=KEY_IMPL)
        if routed_experts and not self.cfg.num_experts:
            raise ValueError("--enable-return-routed-experts: the model has no experts "
                             f"({model_path}: num_experts is 0).")
        self.routed_experts = routed_experts
        self._slot_routes = jax.jit(lambda routes, slot: routes[slot])
        self.reset_caches()

    def reset_caches(self) -> None:
        """Empty KV caches and route buffer (after a failed step: its donated buffers may be
        gone). The route buffer, `[slots, positions, layers, top-k]` int16 (-1: not run), is
        None unless the engine keeps routes (`routed_experts`)."""
        self.caches = empty_caches(self.cfg, self.max_batch, self.max_seq_len, self.dtype)
        self.routes = None
        if self.routed_experts:
            self.routes = jnp.full((self.max_batch, self.max_seq_len, self.cfg.num_layers,
                                    self.cfg.num_experts_per_tok), -1, jnp.int16)

    def request_routes(self, req: Request) -> np.ndarray | None:
        """The routed experts a finishing request asked for (`return_routed_experts`, else
        None), read from its slot between steps: `[tokens, layers, top-k]` int32 for positions
        [`routed_experts_start_len`, seqlen - 1), as SGLang (the last token never ran). None
        too when the engine keeps no routes (the HTTP API refuses such a request)."""
        if not req.spec.return_routed_experts or self.routes is None:
            return None
        stop = len(req.spec.prompt) + len(req.output) - 1
        slot = np.asarray(self._slot_routes(self.routes, np.int32(req.slot)))
        return slot[req.spec.routed_experts_start_len:stop].astype(np.int32)

    async def compute(self, fn):
        """`fn()` on the compute thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def note_compile(self, what: tuple, message: str, *args):
        """Logs `message` the first time the program `what` is called (it compiles then)."""
        if what not in self.compiled:
            self.compiled.add(what)
            log.info(message, *args)

    def run_prefills(self, reqs: list[Request]):
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
        self.note_compile(("prefill", bucket, k, wants_input),
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
        self.caches, self.routes, *out, self._key, ids_logp, next_logp, ids_logp_rows = \
            self._prefill[wants_input](
                self.state, self.caches, self.routes, ids_1xP,
                np.int32([len(spec.prompt), slot, spec.top_k, cached]),
                np.float32([[spec.temperature, spec.top_p]]), self._key, seed_1x2, ids_K)
        return (*out, ids_logp, next_logp, ids_logp_rows)

    def run_decode(self, slots: Slots, n: int, ids_NxK: np.ndarray | None = None,
                   seeded: bool = False):
        """Decodes slots [0, n) (`slots`' host arrays copied at call time); returns tokens,
        log-probs and the log-probs of `ids_NxK` (None: none gathered). `seeded`: some row has a
        seed (the caller knows; asking the rows costs ~2% of a one-row step)."""
        if seeded:
            self.note_compile(("decode", n, "seeded"), "compiling the decode of %d slots for "
                              "seeded requests", n)
        ints_Nx4, floats_Nx2, seed_Nx2 = slots.decode_inputs(n, seeded)
        self.caches, self.routes, token_N, logp_N, self._key, ids_logp_NxK = self._decode(
            self.state, self.caches, self.routes, ints_Nx4, floats_Nx2, self._key, seed_Nx2,
            ids_NxK)
        return (np.asarray(token_N), np.asarray(logp_N),
                None if ids_logp_NxK is None else np.asarray(ids_logp_NxK))

    async def decode_step(self, slots: Slots, active: list[Request]):
        """One decode step of the requests `active` in `slots`, on the compute thread: over the
        smallest decode bucket past the highest occupied slot, gathering the log-probs of the
        ids they ask for (`run_decode`'s results, indexed by slot)."""
        rows = next(b for b in self.decode_buckets if b > max(req.slot for req in active))
        k = ids_bucket(max(len(r.spec.token_ids_logprob or ()) for r in active))
        ids_NxK = None
        if k:
            ids_NxK = np.zeros((rows, k), np.int32)
            self.note_compile(("decode", rows, k), "compiling the decode of %d slots with %d "
                              "token ids", rows, k)
            for req in active:
                ids = req.spec.token_ids_logprob or ()
                ids_NxK[req.slot, :len(ids)] = ids
        seeded = any(req.spec.sampling_seed is not None for req in active)
        return await self.compute(partial(self.run_decode, slots, rows, ids_NxK, seeded))

    def warmup(self, slots: Slots, prefills: bool = False) -> None:
        """Compiles every decode bucket and the smallest prefill bucket; with `prefills`, every
        prefill bucket of the hot path (no input log-probs, no gathered ids), so that no request
        of a run waits for a compile (one stalls every request of the engine: ~2 s per bucket
        for the toy model on a loaded CPU). Otherwise larger prompts compile theirs on first
        use. Slot contents are garbage until a prefill overwrites them."""
        start = time.perf_counter()
        for bucket in self.buckets if prefills else self.buckets[:1]:
            self._dispatch_prefill(RequestSpec(prompt=(0,) * (bucket - 1 or 1)), 0)
        for n in self.decode_buckets:
            self.run_decode(slots, n)
        jax.block_until_ready(self.caches)
        log.info("compiled %d prefill and %d decode buckets in %.1f s",
                 len(self.buckets) if prefills else 1, len(self.decode_buckets),
                 time.perf_counter() - start)

    def load_state(self, path: str):
        """New weights for the running model, validated completely (`model_io.load_state`);
        raises ValueError if they do not fit it."""
        return load_state(path, cfg=self.cfg, dtype=self.dtype, abstract=self._abstract,
                          tensors=self.tensors, state=self.state, overrides=self._overrides)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
