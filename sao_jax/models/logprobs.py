"""Token log-probs (and entropies) under an LM head, computed in vocabulary chunks.

The learner needs log pi(y_t) for every response token and, for the entropy bonus and metrics, the
entropy of pi(. | t). Both are reductions over the vocabulary of `logits = hidden @ lm_head`, and at
LLM sizes those logits are the largest array of the step: T = 8192, V = 151936 is 5 GB in float32
per sequence, before autodiff keeps a softmax of the same size. `token_logprobs` never builds them.
It walks the vocabulary in chunks of `chunk_size` columns of `lm_head` (and the tokens in blocks of
`token_chunk_size` rows), keeping an online log-sum-exp per token, and its `custom_vjp` recomputes
each chunk of logits in the backward pass instead of storing it.

Dimensions (the legend of `transformer.py`, plus local letters): B batch, T tokens, X = B * T
tokens flattened, D hidden, V vocabulary; C vocabulary columns per chunk, R tokens (rows) per block,
M = ceil(X / R) blocks.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Tiles measured on CPU by benchmarks/bench_logprobs.py (X = 2048 and 8192 tokens, D = 512,
# V = 32768, float32 and bfloat16): C = R = 2048 was fastest or within 5% of it, with each [R, C]
# float32 temporary at 16 MiB whatever the batch and vocabulary. On accelerators, measure.
DEFAULT_CHUNK_SIZE = 2048
DEFAULT_TOKEN_CHUNK_SIZE = 2048


def token_logprobs(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    token_chunk_size: int = DEFAULT_TOKEN_CHUNK_SIZE,
    return_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Log-probability of each target token, without materialising the `[B, T, V]` logits.

        logits[b, t, v] = sum_d hidden[b, t, d] * lm_head[d, v]     (float32 accumulation)
        logp[b, t]      = logits[b, t, y] - logsumexp_v logits[b, t, v],   y = targets[b, t]
        entropy[b, t]   = -sum_v p_v log p_v,   p_v = exp(logits[b, t, v] - logsumexp(...))

    Position t holds the hidden state that predicts token t: `targets` are the inputs shifted left
    by one, as the caller aligns them. The log-sum-exp runs online over chunks of vocabulary columns
    (a running max m and sum of exp(logit - m), and for the entropy the running sum of
    exp(logit - m) * (m - logit), every term non-negative so small entropies keep their precision).

    Gradients (`jax.custom_vjp`; each chunk of logits is recomputed, never stored):

        d logp / d logits_v    = [v == y] - p_v
        d entropy / d logits_v = -p_v (log p_v + entropy)
        d / d hidden  = sum_v (d / d logits_v) lm_head[:, v],
        d / d lm_head[:, v] = sum_{b,t} (d / d logits_v) hidden[b, t]

    `targets` get no gradient. The backward pass multiplies float32 d logits with `lm_head` and
    `hidden` promoted to float32, as autodiff of the naive `hidden @ lm_head` does, and accumulates
    both gradients in float32 before casting them to the dtypes of `hidden` and `lm_head`. Results
    agree with `token_logprobs_reference` up to float32 rounding of the sums.

    Args:
      hidden: `[B, T, D]` float (bfloat16, float32, ...): final hidden states, after the final norm.
      lm_head: `[D, V]` float: the unembedding matrix (a tied embedding is `embedding.T`).
      targets: `[B, T]` int: the token whose log-prob position t reports. Targets outside [0, V)
        raise `ValueError` when `targets` is concrete (this reads them back to the host); traced
        under `jit` they give a NaN log-prob (the entropy is still exact), so pad with a valid id
        such as 0, not -1.
      chunk_size: vocabulary columns per chunk, C >= 1 (clipped to V). V need not be a multiple of
        C: the last chunk is shifted left to end at V and skips the columns it re-reads.
      token_chunk_size: tokens per block, R >= 1 (clipped to X = B * T): bounds the `[R, C]`
        temporaries when B * T is large. X need not be a multiple of R (the last block is
        zero-padded).
      return_entropy: also return the entropy of the full softmax at every position.

    Returns:
      `logp` `[B, T]` float32, or `(logp, entropy)`, both `[B, T]` float32, if `return_entropy`.
    """
    _check_args(hidden, lm_head, targets, chunk_size, token_chunk_size)
    batch, length, width = hidden.shape
    vocab = lm_head.shape[1]
    tokens = batch * length
    if tokens == 0:
        empty = jnp.zeros((batch, length), jnp.float32)
        return (empty, empty) if return_entropy else empty
    tiles = (min(chunk_size, vocab), min(token_chunk_size, tokens))
    out = _chunked_logprobs(tiles, return_entropy, hidden.reshape(tokens, width), lm_head,
                            targets.reshape(tokens).astype(jnp.int32))
    if return_entropy:
        return out[0].reshape(batch, length), out[1].reshape(batch, length)
    return out.reshape(batch, length)


def token_logprobs_reference(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array,
                             return_entropy: bool = False):
    """`token_logprobs` the obvious way: full `[B, T, V]` logits and `jax.nn.log_softmax`.

    For tests and benchmarks; plain autodiff gives its gradients. Same arguments and conventions,
    out-of-range targets clipped to [0, V) (jnp's gather default) instead of NaN.
    """
    logits_BxTxV = jnp.einsum("btd,dv->btv", hidden, lm_head, preferred_element_type=jnp.float32)
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    logp_BxT = jnp.take_along_axis(logp_BxTxV, targets[..., None], axis=-1)[..., 0]
    if not return_entropy:
        return logp_BxT
    return logp_BxT, -jnp.sum(jnp.exp(logp_BxTxV) * logp_BxTxV, axis=-1)


def _check_args(hidden, lm_head, targets, chunk_size, token_chunk_size) -> None:
    """Raises ValueError naming the argument, its shape and what was expected."""
    if np.ndim(hidden) != 3:
        raise ValueError(f"hidden must have rank 3 [B, T, D], got shape {np.shape(hidden)}.")
    if np.ndim(lm_head) != 2:
        raise ValueError(f"lm_head must have rank 2 [D, V], got shape {np.shape(lm_head)}.")
    if lm_head.shape[0] != hidden.shape[2]:
        raise ValueError(
            f"lm_head must have shape [D, V] with D = hidden.shape[-1] = {hidden.shape[2]}, got "
            f"shape {lm_head.shape} (pass the transpose of a [V, D] embedding).")
    if lm_head.shape[1] < 1:
        raise ValueError(f"lm_head must have at least one vocabulary column, got {lm_head.shape}.")
    if np.shape(targets) != hidden.shape[:2]:
        raise ValueError(
            f"targets must have shape [B, T] = {hidden.shape[:2]} (hidden.shape[:2]), got "
            f"{np.shape(targets)}.")
    for name, x in (("hidden", hidden), ("lm_head", lm_head)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must have a floating dtype, got {x.dtype}.")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must have an integer dtype, got {targets.dtype}.")
    for name, size in (("chunk_size", chunk_size), ("token_chunk_size", token_chunk_size)):
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be an int >= 1, got {size!r}.")
    if not isinstance(targets, jax.core.Tracer) and np.size(targets):
        values = np.asarray(targets)
        low, high = values.min(), values.max()
        if low < 0 or high >= lm_head.shape[1]:
            raise ValueError(
                f"targets must lie in [0, V) = [0, {lm_head.shape[1]}), got values in "
                f"[{low}, {high}].")


def _logits(hidden_RxD: jax.Array, w_DxC: jax.Array) -> jax.Array:
    return jnp.einsum("rd,dc->rc", hidden_RxD, w_DxC, preferred_element_type=jnp.float32)


def _loop(n: int, body, carry, operands):
    """`for i in range(n): carry = body(i, carry, *operands)` as one XLA while loop.

    The operands ride in the loop state behind an optimization barrier, so XLA cannot see that they
    are loop-invariant. XLA:CPU computes a bfloat16 (dynamic-)slice in float32 (float
    normalization); with the operand visibly invariant it hoists that convert out of the loop and
    keeps a float32 copy of all of `lm_head`, [D, V] * 4 bytes, the very temporary this module is
    written to avoid. Behind the barrier the convert fuses into the slice of each chunk.
    """

    def step(i, state):
        carry, operands = state
        operands = lax.optimization_barrier(operands)
        return body(i, carry, *operands), operands

    return lax.fori_loop(0, n, step, (carry, operands))[0]


def _vocab_chunk(lm_head_DxV: jax.Array, c: jax.Array, chunk: int):
    """Columns [start, start + C) of chunk c, and the mask `[C]` of those that are its own.

    Chunk c owns columns [c C, (c + 1) C). The last chunk, when C does not divide V, is shifted
    left to end at V: it re-reads some columns of the chunk before, which it does not own.
    """
    own_start = c * chunk
    start = jnp.minimum(own_start, lm_head_DxV.shape[1] - chunk)
    w_DxC = lax.dynamic_slice_in_dim(lm_head_DxV, start, chunk, axis=1)
    return w_DxC, start, start + jnp.arange(chunk) >= own_start


def _token_blocks(x: jax.Array, block: int) -> jax.Array:
    """`[X, ...]` -> `[M, R, ...]`, M = ceil(X / R) blocks, zero-padding X up to M R."""
    pad = -x.shape[0] % block
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(-1, block, *x.shape[1:])


def _forward_block(chunk: int, with_entropy: bool, hidden_RxD: jax.Array, targets_R: jax.Array,
                   lm_head_DxV: jax.Array):
    """Online log-sum-exp, target logit and entropy of one block of R tokens, over all of V."""

    def vocab_step(c, carry, lm_head_DxV):
        max_R, sum_R, ent_R, target_R = carry
        w_DxC, start, own_C = _vocab_chunk(lm_head_DxV, c, chunk)
        logits_RxC = _logits(hidden_RxD, w_DxC)
        new_max_R = jnp.maximum(max_R, jnp.max(logits_RxC, axis=1, where=own_C, initial=-jnp.inf))
        rescale_R = jnp.exp(max_R - new_max_R)
        gap_RxC = new_max_R[:, None] - logits_RxC  # >= 0 on own columns
        exp_RxC = jnp.where(own_C, jnp.exp(-gap_RxC), 0.0)
        if with_entropy:
            # sum_v exp(l_v - m) (m - l_v), re-based from the old max m to the new max m'. Before
            # the first chunk sum = 0 and m = -inf: nothing to re-base.
            rebased_R = jnp.where(sum_R > 0, rescale_R * (ent_R + (new_max_R - max_R) * sum_R), 0)
            ent_R = rebased_R + jnp.sum(exp_RxC * jnp.where(own_C, gap_RxC, 0.0), axis=1)
        sum_R = rescale_R * sum_R + jnp.sum(exp_RxC, axis=1)
        local_R = targets_R - start
        hit_R = (targets_R >= c * chunk) & (local_R < chunk)
        picked_R = jnp.take_along_axis(logits_RxC, jnp.clip(local_R, 0, chunk - 1)[:, None],
                                       axis=1)[:, 0]
        return new_max_R, sum_R, ent_R, jnp.where(hit_R, picked_R, target_R)

    rows = hidden_RxD.shape[0]
    carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows,), jnp.float32), jnp.full((rows,), jnp.nan, jnp.float32))
    chunks = -(-lm_head_DxV.shape[1] // chunk)
    max_R, sum_R, ent_R, target_R = _loop(chunks, vocab_step, carry, (lm_head_DxV,))
    # log p_v = (l_v - m) - log(sum): l_v - m is exact near the max, where m + log(sum) would round
    # to the float32 grid of the logits. H = sum_v p_v (lse - l_v) = log(sum) + ent / sum.
    log_sum_R = jnp.log(sum_R)
    return (target_R - max_R) - log_sum_R, max_R, log_sum_R, log_sum_R + ent_R / sum_R


def _forward(tiles, with_entropy, hidden_XxD, lm_head_DxV, targets_X):
    """(logp, max logit, log sum exp(logit - max), entropy), each `[X]` float32.

    The entropy is meaningless unless with_entropy.
    """
    chunk, block = tiles
    tokens = hidden_XxD.shape[0]
    hidden_MxRxD = _token_blocks(hidden_XxD, block)
    blocks = hidden_MxRxD.shape[0]

    def block_step(i, outs, hidden_MxRxD, targets_MxR, lm_head_DxV):
        stats = _forward_block(chunk, with_entropy, hidden_MxRxD[i], targets_MxR[i], lm_head_DxV)
        return tuple(out.at[i].set(x) for out, x in zip(outs, stats, strict=True))

    outs = tuple(jnp.zeros(hidden_MxRxD.shape[:2], jnp.float32) for _ in range(4))
    outs = _loop(blocks, block_step, outs,
                 (hidden_MxRxD, _token_blocks(targets_X, block), lm_head_DxV))
    return tuple(x.reshape(-1)[:tokens] for x in outs)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_logprobs(tiles, with_entropy, hidden_XxD, lm_head_DxV, targets_X):
    logp_X, _, _, entropy_X = _forward(tiles, with_entropy, hidden_XxD, lm_head_DxV, targets_X)
    return (logp_X, entropy_X) if with_entropy else logp_X


def _chunked_logprobs_fwd(tiles, with_entropy, hidden_XxD, lm_head_DxV, targets_X):
    logp_X, max_X, log_sum_X, entropy_X = _forward(tiles, with_entropy, hidden_XxD, lm_head_DxV,
                                                   targets_X)
    out = (logp_X, entropy_X) if with_entropy else logp_X
    return out, (hidden_XxD, lm_head_DxV, targets_X, max_X, log_sum_X,
                 entropy_X if with_entropy else None)


def _chunked_logprobs_bwd(tiles, with_entropy, residuals, cotangents):
    hidden_XxD, lm_head_DxV, targets_X, max_X, log_sum_X, entropy_X = residuals
    chunk, block = tiles
    tokens, width = hidden_XxD.shape
    g_logp_X, g_ent_X = cotangents if with_entropy else (cotangents, None)
    # Zero-padded tokens have zero cotangents: they add nothing to either gradient.
    per_token = [hidden_XxD, targets_X, max_X, log_sum_X, g_logp_X]
    if with_entropy:
        per_token += [entropy_X, g_ent_X]
    per_token = tuple(_token_blocks(x, block) for x in per_token)
    blocks = per_token[0].shape[0]

    def vocab_step(c, carry, lm_head_DxV):
        d_hidden, d_lm_head = carry
        w_DxC, start, own_C = _vocab_chunk(lm_head_DxV, c, chunk)

        def token_step(i, carry, w_DxC, *per_token):
            d_hidden, d_w_DxC = carry
            hidden_RxD, targets_R, max_R, log_sum_R, g_R, *ent = (x[i] for x in per_token)
            logits_RxC = _logits(hidden_RxD, w_DxC)
            logp_RxC = (logits_RxC - max_R[:, None]) - log_sum_R[:, None]
            p_RxC = jnp.exp(logp_RxC)
            coef_RxC = g_R[:, None]
            if with_entropy:
                entropy_R, g_ent_R = ent
                coef_RxC = coef_RxC + g_ent_R[:, None] * (logp_RxC + entropy_R[:, None])
            is_target_RxC = (targets_R - start)[:, None] == jnp.arange(chunk)
            d_logits_RxC = jnp.where(is_target_RxC, g_R[:, None], 0.0) - p_RxC * coef_RxC
            # Every column's d lm_head is complete after the loop over tokens, so a re-read
            # column is simply written again; d hidden sums over columns and takes own ones only.
            d_hidden = d_hidden.at[i].add(jnp.einsum(
                "rc,dc->rd", jnp.where(own_C, d_logits_RxC, 0.0), w_DxC,
                preferred_element_type=jnp.float32))
            d_w_DxC += jnp.einsum("rd,rc->dc", hidden_RxD, d_logits_RxC,
                                  preferred_element_type=jnp.float32)
            return d_hidden, d_w_DxC

        d_w_DxC = jnp.zeros((width, chunk), jnp.float32)
        d_hidden, d_w_DxC = _loop(blocks, token_step, (d_hidden, d_w_DxC), (w_DxC, *per_token))
        # In place, except that XLA:CPU runs a bfloat16 dynamic-update-slice in float32 over the
        # whole of d lm_head (float normalization): time, not memory, amortised by large chunks.
        d_lm_head = lax.dynamic_update_slice_in_dim(
            d_lm_head, d_w_DxC.astype(d_lm_head.dtype), start, axis=1)
        return d_hidden, d_lm_head

    carry = (jnp.zeros((blocks, block, width), jnp.float32), jnp.zeros_like(lm_head_DxV))
    chunks = -(-lm_head_DxV.shape[1] // chunk)
    d_hidden, d_lm_head = _loop(chunks, vocab_step, carry, (lm_head_DxV,))
    d_hidden_XxD = d_hidden.reshape(-1, width)[:tokens].astype(hidden_XxD.dtype)
    return d_hidden_XxD, d_lm_head, None


_chunked_logprobs.defvjp(_chunked_logprobs_fwd, _chunked_logprobs_bwd)
