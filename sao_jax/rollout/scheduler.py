"""The embedded engine's core: the model, its slot KV cache and the continuous-batching scheduler.

`Engine` holds no HTTP: `engine.py` serves it, `sglang_api.py` turns request bodies into the
`RequestSpec`s it runs.

Scheduling: `max_batch` KV-cache slots of `max_seq_len` positions each. Between decode steps the
scheduler applies commands (aborts, pauses), then prefills waiting requests into the lowest free
slots (dispatched one after another, the prompt padded to a power-of-two bucket, each bucket
compiled on first use), then decodes every occupied slot together in one jitted step; a request
leaves its slot as soon as it finishes, and new ones join at the next step (continuous batching).
A step decodes slots [0, N) for the smallest power-of-two bucket N (or `max_batch`) past the
highest occupied slot, one program per bucket, all compiled at start-up (as SGLang captures CUDA
graphs per batch size). Sampling parameters (temperature, top-p, top-k, seed) are per row, so
requests with different parameters share a step.

Sampling: each row draws with its own key. A request with a `sampling_seed` uses
`fold_in(key(seed), position)` for the token at `position`, so it gets the same tokens whatever
else shares its steps (and when resubmitted with its partial output); others use a split of the
engine's key. The seeds are host arrays copied with the other per-row parameters: no extra sync.

Log-probs: every token's `logprob` is its temperature-1 log-softmax under the full vocabulary,
from the same forward pass that sampled it and with the drop-free `logprob_dispatch`, whatever the
sampling filters (docs/design.md, "Numerics that DIS depends on"); it equals the learner's
teacher-forced log-prob of the token. Prompt log-probs (`logprob_start_len`) come from the
prefill's teacher-forced pass over the prompt (a second prefill program per bucket, compiled on
first use); `token_ids_logprob` gathers the given ids' log-probs from the same rows (decode
programs with K gathered ids, K a power of two, compiled on first use; K = 0 is the hot path).

Admission gate: requests that arrive while generation is paused or a weight update is in
progress wait in `held` (as SGLang's tokenizer manager holds them before its model-update lock)
and join `waiting` when it reopens.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import time
import uuid
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models.hf import CONFIG_FILE, Checkpoint, check_complete, load_hf, read_config
from sao_jax.models.sampling import filter_logits_rows
from sao_jax.models.transformer import CausalLM, KVCache, causal_mask, empty_caches
from sao_jax.rollout.sglang_api import BadRequest, RequestSpec, build_meta_info, build_reply

log = logging.getLogger("sao_jax.engine")

MIN_PREFILL_BUCKET = 16
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors' names
KEY_IMPL = "threefry2x32"  # seeds are two uint32 words of key data
ABORT_MESSAGE = "Aborted: generation paused (pause_generation or a weight update)."

# ------------------------------------------------------------------------------------------------
# Sampling with per-row parameters, and the jitted programs.


def row_keys(key, seed_Bx2, seeded_B, positions_B):
    """One key per row: `fold_in(key(seed), position)` for seeded rows, a split of `key` for the
    others. Returns `(next_key, keys_B)`."""
    key, sub = jax.random.split(key)
    b = seed_Bx2.shape[0]
    free_Bx2 = jax.random.key_data(jax.random.split(sub, b))
    seeded_Bx2 = jax.random.key_data(jax.vmap(
        lambda d, p: jax.random.fold_in(jax.random.wrap_key_data(d, impl=KEY_IMPL), p))(
        seed_Bx2, positions_B))
    data_Bx2 = jnp.where(seeded_B[:, None], seeded_Bx2, free_Bx2)
    return key, jax.random.wrap_key_data(data_Bx2, impl=KEY_IMPL)


def sample_rows(logits_BxV, keys_B, temperature_B, top_p_B, top_k_B):
    """One token per row, its temperature-1 full-softmax log-prob and the rows' log-softmax:
    `(token_B, logp_B, logp_BxV)`. `keys_B`: a key per row, or one key for the batch."""
    filtered_BxV = filter_logits_rows(logits_BxV, temperature_B, top_p_B, top_k_B)
    if keys_B.ndim == 0:  # one key for the whole batch (no row is seeded)
        sampled_B = jax.random.categorical(keys_B, filtered_BxV).astype(jnp.int32)
    else:
        sampled_B = jax.vmap(jax.random.categorical)(keys_B, filtered_BxV).astype(jnp.int32)
    greedy_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    token_B = jnp.where(temperature_B > 0, sampled_B, greedy_B)
    logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
    logp_B = jnp.take_along_axis(logp_BxV, token_B[:, None], 1)[:, 0]
    return token_B, logp_B, logp_BxV


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


def _prefill(graphdef, state, caches, ids_1xP, ints_3, floats_1x2, key, seed_1x2=None,
             ids_K=None, *, input_logprobs: bool):
    """Writes a (right-padded) prompt into a cache row and samples the first new token. `ints_3`:
    the prompt's length, the slot, top_k; `floats_1x2`: temperature, top_p.

    Returns `(caches, token, logp, key, ids_logp_K, next_logp_P, ids_logp_PxK)`: the token's
    log-prob and those of `ids_K`; with `input_logprobs` (static), also the teacher-forced
    log-prob of each prompt token from the position before it (`next_logp_P[i]` is that of token
    i + 1) and of `ids_K` at each position. What was not asked for is None, and so are
    `seed_1x2` (the request's seed) and `ids_K` when there is none: as in `_decode`, unused
    inputs and outputs are left out of the compiled step rather than passed empty."""
    length, slot, top_k = ints_3[0], ints_3[1], ints_3[2:]
    temperature_1, top_p_1 = floats_1x2.T
    model = nnx.merge(graphdef, state)
    row = tuple(KVCache(*(jax.lax.dynamic_slice_in_dim(x, slot, 1) for x in c)) for c in caches)
    positions_1xP = jnp.arange(ids_1xP.shape[1])[None]
    hidden_1xPxD, row = _forward_cached(model, ids_1xP, positions_1xP, row)
    caches = tuple(KVCache(*(jax.lax.dynamic_update_slice_in_dim(x, r, slot, 0)
                             for x, r in zip(c, rc, strict=True)))
                   for c, rc in zip(caches, row, strict=True))
    last_1xD = jax.lax.dynamic_slice_in_dim(hidden_1xPxD[0], length - 1, 1)
    if seed_1x2 is None:
        key, keys_1 = jax.random.split(key)
    else:
        key, keys_1 = row_keys(key, seed_1x2, jnp.ones(1, bool), length[None])
    token_1, logp_1, logp_1xV = sample_rows(_logits(model, last_1xD), keys_1, temperature_1,
                                            top_p_1, top_k)
    ids_logp_K = next_logp_P = ids_logp_PxK = None
    if ids_K is not None:
        ids_logp_K = logp_1xV[0, ids_K]
    if input_logprobs:
        all_logp_PxV = jax.nn.log_softmax(_logits(model, hidden_1xPxD[0]), axis=-1)
        next_P = jnp.roll(ids_1xP[0], -1)
        next_logp_P = jnp.take_along_axis(all_logp_PxV, next_P[:, None], 1)[:, 0]
        if ids_K is not None:
            ids_logp_PxK = all_logp_PxV[:, ids_K]
    return caches, token_1[0], logp_1[0], key, ids_logp_K, next_logp_P, ids_logp_PxK


def _decode(graphdef, state, caches, ints_Nx4, floats_Nx2, key, seed_Nx2=None, ids_NxK=None):
    """One decode step for the first N slots (N a batch bucket): each row's token (`ints_Nx4`
    columns: token, position, top_k, seeded; `floats_Nx2`: temperature, top_p) goes to its
    position; samples the next ones. Slots from N on are left as they are.

    The two optional inputs are None when no row needs them, which compiles a step without
    them: `seed_Nx2` gives each row its own key (`row_keys`), which seeded rows need (else one
    key samples the batch); `ids_NxK` are token ids whose log-probs each row gathers (else the
    gathered output is None too). A vmapped draw per row, or an empty `[N, 0]` argument and
    output, each cost the toy engine 5-10% of its decode throughput at small batches."""
    tokens_N, positions_N, top_k_N, seeded_N = ints_Nx4.T
    temperature_N, top_p_N = floats_Nx2.T
    model = nnx.merge(graphdef, state)
    n = tokens_N.shape[0]
    rows = caches if n == caches[0].k_BxSxKxH.shape[0] else tuple(
        KVCache(*(x[:n] for x in c)) for c in caches)
    hidden_Nx1xD, rows = _forward_cached(model, tokens_N[:, None], positions_N[:, None], rows)
    caches = rows if rows[0].k_BxSxKxH.shape == caches[0].k_BxSxKxH.shape else tuple(
        KVCache(*(jax.lax.dynamic_update_slice_in_dim(x, r, 0, 0) for x, r in zip(c, rc,
                                                                                   strict=True)))
        for c, rc in zip(caches, rows, strict=True))
    if seed_Nx2 is None:
        key, keys_N = jax.random.split(key)
    else:
        key, keys_N = row_keys(key, seed_Nx2, seeded_N > 0, positions_N + 1)
    token_N, logp_N, logp_NxV = sample_rows(_logits(model, hidden_Nx1xD[:, 0]), keys_N,
                                            temperature_N, top_p_N, top_k_N)
    ids_logp_NxK = None if ids_NxK is None else jnp.take_along_axis(logp_NxV, ids_NxK, 1)
    return caches, token_N, logp_N, key, ids_logp_NxK


# ------------------------------------------------------------------------------------------------
# Requests and the scheduler.


class EngineFailure(RuntimeError):
    """The scheduler failed while running a request (HTTP 500)."""


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence in the engine: its spec, its tokens so far, where it runs."""

    spec: RequestSpec
    rid: str
    stop_ids: frozenset[int]
    future: asyncio.Future  # resolves to the reply dict
    created: float
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    ids_logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    input_logprobs: list[float] | None = None  # [i]: prompt token i + 1's, from position i
    input_ids_logprobs: list[list[float]] | None = None
    slot: int = -1
    version: str | None = None  # the weights that generated its tokens (set when admitted)
    max_batch: int = 0
    finish_reason: dict | None = None
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # for streams


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


def ids_bucket(k: int) -> int:
    """Gathered token-id count: 0, or the power of two >= k."""
    return 0 if k == 0 else 1 << (k - 1).bit_length()


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


def read_tokenizer(path: str):
    """`path/tokenizer.json` as a `tokenizers.Tokenizer`, or None when there is none."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    import tokenizers
    return tokenizers.Tokenizer.from_file(file)


def tensor_specs(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's shape and dtype in a safetensors directory, from the file headers."""
    return {name: (info.shape, info.dtype) for name, info in Checkpoint(path).tensors.items()}


def check_tensors(path: str, expected: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """A weight update's tensors against the served model's (`expected`, by name): every tensor
    present with its shape, floating point, and finite. Raises ValueError naming the first that
    is not. Reads one tensor at a time."""
    found = tensor_specs(path)
    for name, (shape, _) in expected.items():
        if name not in found:
            raise ValueError(f"{path}: tensor {name} is missing.")
        if found[name][0] != shape:
            raise ValueError(f"{path}: tensor {name} has shape {found[name][0]}; the served "
                             f"model's is {shape}.")
        if found[name][1] not in FLOAT_DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {found[name][1]}; weights must "
                             f"be one of {', '.join(FLOAT_DTYPES)}.")
    with Checkpoint(path) as checkpoint:
        for name in checkpoint.tensors:
            if not np.isfinite(np.asarray(checkpoint.read(name), np.float32)).all():
                raise ValueError(f"{path}: tensor {name} holds NaN or infinite values.")


def _seed_words(seed: int) -> tuple[int, int]:
    """An int64 seed as the two uint32 words of its key (high, low), as jax.random.key does."""
    u = seed & (2 ** 64 - 1)
    return u >> 32, u & 0xFFFFFFFF


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
        self.dtype = jnp.dtype(_config_dtype(model_path) if dtype == "auto" else dtype)
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
        self._prefill = tuple(jax.jit(partial(_prefill, graphdef, input_logprobs=wants),
                                      donate_argnums=(1,)) for wants in (False, True))
        self._decode = jax.jit(partial(_decode, graphdef), donate_argnums=(1,))
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "engine-compute")
        self._key = jax.random.key(seed, impl=KEY_IMPL)
        self.caches = self._empty_caches()
        # Slot state: the token each slot feeds to the next decode step and its position.
        self.slots: list[Request | None] = [None] * max_batch
        # Per-row parameters packed by dtype, so that a step sends three arrays (the names below
        # are column views of them).
        self._ints_Bx4 = np.zeros((max_batch, 4), np.int32)  # token, position, top_k, seeded
        self._floats_Bx2 = np.zeros((max_batch, 2), np.float32)  # temperature, top_p
        self._seed_Bx2 = np.zeros((max_batch, 2), np.uint32)
        self._tokens_B, self._positions_B, self._top_k_B, self._seeded_B = self._ints_Bx4.T
        self._temperature_B, self._top_p_B = self._floats_Bx2.T
        self._top_p_B[:] = 1.0
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
        results = [self._dispatch_prefill(req.spec, req.slot) for req in reqs]
        return [(int(token), float(logp), *(None if x is None else np.asarray(x) for x in extra))
                for token, logp, *extra in results]

    def _dispatch_prefill(self, spec: RequestSpec, slot: int):
        n = len(spec.prompt)
        bucket = next(b for b in self.buckets if b >= n)
        ids = spec.token_ids_logprob
        k = ids_bucket(len(ids or ()))
        wants_input = spec.wants_input_logprobs
        self._note_compile(("prefill", bucket, k, wants_input),
                           "compiling the prefill of prompts of up to %d tokens (%d ids, input "
                           "log-probs %s)", bucket, k, wants_input)
        ids_1xP = np.zeros((1, bucket), np.int32)
        ids_1xP[0, :n] = spec.prompt
        ids_K = None
        if k:
            ids_K = np.zeros(k, np.int32)
            ids_K[:len(ids)] = ids
        seed_1x2 = None
        if spec.sampling_seed is not None:
            seed_1x2 = np.asarray([_seed_words(spec.sampling_seed)], np.uint32)
        self.caches, *out, self._key, ids_logp, next_logp, ids_logp_rows = self._prefill[
            wants_input](self.state, self.caches, ids_1xP, np.int32([n, slot, spec.top_k]),
                         np.float32([[spec.temperature, spec.top_p]]), self._key, seed_1x2,
                         ids_K)
        return (*out, ids_logp, next_logp, ids_logp_rows)

    def _run_decode(self, n: int, ids_NxK: np.ndarray | None = None, seeded: bool = False):
        """Decodes slots [0, n) (host arrays copied at call time); returns tokens, log-probs and
        the log-probs of `ids_NxK` (None: none gathered). `seeded`: some row has a seed (the
        caller knows; asking `_seeded_B` costs ~2% of a one-row step)."""
        seed_Nx2 = None
        if seeded:
            self._note_compile(("decode", n, "seeded"), "compiling the decode of %d slots for "
                               "seeded requests", n)
            seed_Nx2 = self._seed_Bx2[:n].copy()
        self.caches, token_N, logp_N, self._key, ids_logp_NxK = self._decode(
            self.state, self.caches, self._ints_Bx4[:n].copy(), self._floats_Bx2[:n].copy(),
            self._key, seed_Nx2, ids_NxK)
        return (np.asarray(token_N), np.asarray(logp_N),
                None if ids_logp_NxK is None else np.asarray(ids_logp_NxK))

    def warmup(self) -> None:
        """Compiles every decode bucket and the smallest prefill bucket (larger prompts compile
        theirs on first use). Slot contents are garbage until a prefill overwrites them."""
        start = time.perf_counter()
        self._dispatch_prefill(RequestSpec(prompt=(0,)), 0)
        for n in self.decode_buckets:
            self._run_decode(n)
        log.info("compiled prefill and %d decode buckets in %.1f s", len(self.decode_buckets),
                 time.perf_counter() - start)

    def load_state(self, path: str):
        """New weights for the running model, validated completely (files, config, each tensor's
        dtype, values and shape, by name); raises ValueError if they do not fit it."""
        if not os.path.isdir(path):
            raise ValueError(f"{path}: no such directory.")
        check_complete(path)
        cfg = read_config(path, param_dtype=self.dtype.name, **self._overrides)
        changed = [f.name for f in dataclasses.fields(cfg)
                   if getattr(cfg, f.name) != getattr(self.cfg, f.name)]
        if changed:
            raise ValueError(f"{path}: config.json differs from the served model in {changed}; "
                             "a weight update must keep the architecture.")
        check_tensors(path, self.tensors)
        _, state = nnx.split(load_hf(path, self.dtype, like=self._abstract, **self._overrides))
        if jax.tree.structure(state) != jax.tree.structure(self.state):
            raise ValueError(f"{path}: the loaded parameters do not match the served model's.")
        return jax.block_until_ready(state)

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
                             keep_pause: bool = False):
        """SGLang's `/update_weights_from_disk`: validate and load, then swap.

        The new weights are read and checked completely before any request is touched; a failure
        leaves everything running. Then new requests are held; with `abort_all` the running and
        waiting ones return at once (`finish_reason.type == "abort"`, partial tokens); without
        it they finish first (as SGLang's model-update lock waits for them), except that while
        generation is paused the requests in slots are aborted (SGLang would continue them under
        the new weights; here every reply keeps one version). `version` None keeps the version.
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
                if abort_all:
                    aborted = await self.command("abort_all", ABORT_MESSAGE)
                elif self.paused:
                    aborted = await self.command("abort_running", ABORT_MESSAGE)
                else:
                    aborted = 0
                    await self._drain()
                self.state, self.model_path, self.served_model_name = state, path, path
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
        return len(self.slots) - self.slots.count(None)  # C-speed: asked several times a step

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

    def _apply_commands(self):
        commands, self._commands = self._commands, []
        for kind, arg, future in commands:
            result = None
            if kind == "abort":
                reqs, message = arg
                result = sum(self._abort(req, message) for req in reqs)
            elif kind in ("abort_all", "abort_running"):
                reqs = [r for r in self.slots if r is not None]
                if kind == "abort_all":
                    reqs += self.waiting
                result = sum(self._abort(req, arg) for req in reqs)
            elif kind == "pause":
                # abort: SGLang aborts everything its scheduler holds (running and waiting);
                # in_place and retract keep them (retract keeps the slots too: same tokens).
                self.paused = True
                reqs = ([r for r in self.slots if r is not None] + list(self.waiting)
                        if arg == "abort" else [])
                result = sum(self._abort(req, ABORT_MESSAGE) for req in reqs)
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

    async def _admit(self):
        """Gives every waiting request a free slot (while no command is pending) and prefills
        them together (`_run_prefills`)."""
        admitted = []
        while self.waiting and not self._commands and None in self.slots:
            req = self.waiting.popleft()
            req.version = self.weight_version
            if req.spec.max_new_tokens == 0 and not req.spec.wants_input_logprobs:
                self._finish(req, {"type": "length", "length": 0})
                continue
            slot = self.slots.index(None)
            req.slot = slot
            self.slots[slot] = req
            admitted.append(req)
        if not admitted:
            return
        results = await self._compute(partial(self._run_prefills, admitted))
        for req, (token, logp, ids_logp, next_logp, ids_rows) in zip(admitted, results,
                                                                      strict=True):
            spec, slot = req.spec, req.slot
            if slot < 0:  # aborted while the prefill ran: its slot is free again
                continue
            self.stats["prefills"] += 1
            if spec.wants_input_logprobs:
                req.input_logprobs = next_logp.tolist()
                if spec.token_ids_logprob is not None:
                    req.input_ids_logprobs = ids_rows[:, :len(spec.token_ids_logprob)].tolist()
            if spec.max_new_tokens == 0:  # only the prompt's log-probs were wanted
                self._finish(req, {"type": "length", "length": 0})
                continue
            self._positions_B[slot] = len(spec.prompt)
            self._temperature_B[slot] = spec.temperature
            self._top_p_B[slot], self._top_k_B[slot] = spec.top_p, spec.top_k
            self._seeded_B[slot] = spec.sampling_seed is not None
            self._seed_Bx2[slot] = _seed_words(spec.sampling_seed or 0)
            self._append(req, token, logp, ids_logp)

    async def _decode_step(self):
        active = [req for req in self.slots if req is not None]
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
        token_B, logp_B, ids_logp_BxK = await self._compute(
            partial(self._run_decode, rows, ids_NxK, seeded))
        self.last_step_time = time.monotonic()
        self.decode_batch_sizes[n] += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += n
        for req in active:
            if req.slot < 0:  # finished while the step ran (cannot happen today; be safe)
                continue
            req.max_batch = max(req.max_batch, n)
            self._positions_B[req.slot] += 1
            self._append(req, int(token_B[req.slot]), float(logp_B[req.slot]),
                         None if ids_logp_BxK is None else ids_logp_BxK[req.slot])

    def _append(self, req: Request, token: int, logp: float, ids_logp=None):
        """Records a new token and finishes the request when it should stop (SGLang's order:
        the length limit first, then stop tokens, then stop strings)."""
        req.output.append(token)
        req.logprobs.append(logp)
        if ids_logp is not None and req.spec.token_ids_logprob is not None:
            req.ids_logprobs.append(ids_logp[:len(req.spec.token_ids_logprob)].tolist())
        self._tokens_B[req.slot] = token
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
            self.slots[req.slot] = None
            self._tokens_B[req.slot] = self._positions_B[req.slot] = 0
            self._seeded_B[req.slot] = False
            req.slot = -1
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
            input_logprobs=req.input_logprobs, output_ids_logprobs=req.ids_logprobs,
            input_ids_logprobs=req.input_ids_logprobs, decode=decode)
        return build_reply(req.spec, req.output, meta, self.text(req))

    def _fail_all(self, error: Exception):
        for req in [*self.waiting, *(r for r in self.slots if r is not None)]:
            if req.slot >= 0:
                self.slots[req.slot] = None
                self._seeded_B[req.slot] = False
                req.slot = -1
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
            "running": {r.rid: len(r.output) for r in self.slots if r is not None},
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


def _config_dtype(path: str) -> str:
    with open(os.path.join(path, CONFIG_FILE)) as f:
        hf = json.load(f)
    name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"
