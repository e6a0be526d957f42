"""The embedded engine's jitted programs: the prefill, the decode step and per-row sampling.

`scheduler.py`'s `Engine` compiles `prefill` and `decode` (bound to the model's graph definition)
and calls them between its scheduling decisions; nothing here keeps state between calls.

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

Routed experts (an engine started with them, for routing replay: docs/models.md): both programs
write the experts each token they run went to at each layer into a route buffer beside the KV
cache, `[slots, positions, layers, top-k]` int16, so that a finished request's routes are one
read of its slot, prefix-cached tokens included (they were written when the prefix was run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.sampling import filter_logits_rows
from sao_jax.models.transformer import CausalLM, KVCache, causal_mask, expert_routes

KEY_IMPL = "threefry2x32"  # seeds are two uint32 words of key data
MIN_PREFILL_BUCKET = 16


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
    """Hidden states of new tokens written at their positions into the (per-row) caches, and
    the pass's router logits (one `[B * T, E]` array per MoE layer)."""
    b = ids_BxT.shape[0]
    s = caches[0].k_BxSxKxH.shape[1]
    mask_BxTxS = causal_mask(positions_BxT, key_positions_BxS=jnp.broadcast_to(jnp.arange(s),
                                                                               (b, s)))
    out = model.backbone(ids_BxT, positions_BxT, mask_BxTxS, dispatch=model.cfg.logprob_dispatch,
                         caches=caches, slots_BxT=positions_BxT)
    return out.hidden_BxTxD, out.caches, out.router_logits


def _record_routes(model: CausalLM, routes_BxSxLxA, router_logits, rows_B, positions_BxT):
    """The experts the pass routed each token to (`expert_routes`), written into the slots'
    route buffer at `rows_B` and the tokens' positions (past a row's end: dropped). None: the
    engine keeps no routes."""
    if routes_BxSxLxA is None:
        return None
    b, t = positions_BxT.shape
    chosen_BxTxLxA = expert_routes(model.cfg, router_logits, b, t).astype(routes_BxSxLxA.dtype)
    return routes_BxSxLxA.at[rows_B[:, None], positions_BxT].set(chosen_BxTxLxA, mode="drop")


def _logits(model: CausalLM, hidden_BxD):
    return jnp.einsum("bd,dv->bv", hidden_BxD, model.head_weight(),
                      preferred_element_type=jnp.float32)


def prefill(graphdef, state, caches, routes, ids_1xP, ints_4, floats_1x2, key, seed_1x2=None,
            ids_K=None, *, input_logprobs: bool):
    """Writes a (right-padded) prompt into a cache row and samples the first new token. `ints_4`:
    the prompt's length, the slot, top_k, and how many of its first tokens the row holds already
    (the prefix cache: `ids_1xP` then holds the rest, from that position on; 0 with
    `input_logprobs`); `floats_1x2`: temperature, top_p.

    `routes` (None: not kept): the slots' route buffer `[B, S, L, A]`, where the experts each
    prompt token went to are written (`_record_routes`).

    Returns `(caches, routes, token, logp, key, ids_logp_K, next_logp_P, ids_logp_PxK)`: the token's
    log-prob and those of `ids_K`; with `input_logprobs` (static), also the teacher-forced
    log-prob of each prompt token from the position before it (`next_logp_P[i]` is that of token
    i + 1) and of `ids_K` at each position. What was not asked for is None, and so are
    `seed_1x2` (the request's seed) and `ids_K` when there is none: as in `decode`, unused
    inputs and outputs are left out of the compiled step rather than passed empty."""
    length, slot, top_k, cached = ints_4[0], ints_4[1], ints_4[2:3], ints_4[3]
    temperature_1, top_p_1 = floats_1x2.T
    model = nnx.merge(graphdef, state)
    row = tuple(KVCache(*(jax.lax.dynamic_slice_in_dim(x, slot, 1) for x in c)) for c in caches)
    positions_1xP = cached + jnp.arange(ids_1xP.shape[1])[None]  # past the row's end: dropped
    hidden_1xPxD, row, router_logits = _forward_cached(model, ids_1xP, positions_1xP, row)
    routes = _record_routes(model, routes, router_logits, slot[None], positions_1xP)
    caches = tuple(KVCache(*(jax.lax.dynamic_update_slice_in_dim(x, r, slot, 0)
                             for x, r in zip(c, rc, strict=True)))
                   for c, rc in zip(caches, row, strict=True))
    last_1xD = jax.lax.dynamic_slice_in_dim(hidden_1xPxD[0], length - 1 - cached, 1)
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
    return caches, routes, token_1[0], logp_1[0], key, ids_logp_K, next_logp_P, ids_logp_PxK


def decode(graphdef, state, caches, routes, ints_Nx4, floats_Nx2, key, seed_Nx2=None,
           ids_NxK=None):
    """One decode step for the first N slots (N a batch bucket): each row's token (`ints_Nx4`
    columns: token, position, top_k, seeded; `floats_Nx2`: temperature, top_p) goes to its
    position; samples the next ones. Slots from N on are left as they are. `routes` as in
    `prefill`: each row's experts are written at its token's position.

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
    hidden_Nx1xD, rows, router_logits = _forward_cached(model, tokens_N[:, None],
                                                        positions_N[:, None], rows)
    routes = _record_routes(model, routes, router_logits, jnp.arange(n), positions_N[:, None])
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
    return caches, routes, token_N, logp_N, key, ids_logp_NxK


def seed_words(seed: int) -> tuple[int, int]:
    """An int64 seed as the two uint32 words of its key (high, low), as jax.random.key does."""
    u = seed & (2 ** 64 - 1)
    return u >> 32, u & 0xFFFFFFFF

