"""Blockwise causal attention (FlashAttention's algorithm, in JAX): no `[T, S]` array anywhere.

    out_BxTxNxH = blockwise_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segments_BxT)

Query t attends key s when s <= t and both belong to the same segment (one trajectory of a packed
row; an unpacked row is one segment). That is the training mask of `causal_mask` and
`train.batch.packed_mask` whenever positions rise with the index inside a segment, which is how
rows are built. Grouped-query attention: the N query heads share the K key/value heads in
groups of N / K, as in `Attention`.

Forward: for each block of `block` queries, a loop over the key blocks up to the diagonal keeps a
running max, sum and output (the online softmax), and saves only the output and the
log-sum-exp per query. Backward (`custom_vjp`): for each key block, a loop over the query blocks
from the diagonal on recomputes the probabilities from the saved log-sum-exp and accumulates dQ,
dK and dV. Memory is O(T) per head plus one block pair's scores, against the dense form's
`[B, N, T, T]` scores and `[B, T, T]` mask (580 TB of temporaries for `experiments/swe.py`'s
rows on a v5p slice); the work above the diagonal is skipped. Scores and sums are float32.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Segments(NamedTuple):
    """The training mask in O(T): `[B, T]` segment ids, for `blockwise_attention`."""

    ids_BxT: jax.Array


def blockwise_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segments_BxT, *, block: int = 512):
    """Causal, segment-local attention of `q` to `k`/`v` (the same T tokens); returns `[B, T, N,
    H]` in q's dtype. `block` tokens per query and key block (T is padded up to a multiple)."""
    b, t, n, h = q_BxTxNxH.shape
    kv = k_BxTxKxH.shape[2]
    if n % kv:
        raise ValueError(f"{n} query heads do not split into groups over {kv} key/value heads.")
    block = max(1, min(block, t))
    padded = -(-t // block) * block
    segments = jnp.asarray(segments_BxT, jnp.int32)
    if padded != t:  # padded queries see only padded keys (segment -1), and are cut off
        pad = ((0, 0), (0, padded - t))
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = (jnp.pad(x, pad + ((0, 0), (0, 0)))
                                           for x in (q_BxTxNxH, k_BxTxKxH, v_BxTxKxH))
        segments = jnp.pad(segments, pad, constant_values=-1)
    q = q_BxTxNxH.reshape(b, padded, kv, n // kv, h)
    out = _attention(q, k_BxTxKxH, v_BxTxKxH, segments, block)
    return out.reshape(b, padded, n, h)[:, :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH, segments_BxT, block):
    return _forward(q_BxTxKxGxH, k_BxTxKxH, v_BxTxKxH, segments_BxT, block)[0]


def _blocks(x, block):
    """`[B, T, ...]` -> `[B, T / block, block, ...]`."""
    return x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:])


def _scores(q_blk, k_blk, segq_blk, segk_blk, i, j, block):
    """Masked float32 scores `[B, K, G, bq, bk]` of query block i against key block j."""
    h = q_blk.shape[-1]
    s = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk,
                   preferred_element_type=jnp.float32) / math.sqrt(h)
    rows = i * block + jnp.arange(block)
    cols = j * block + jnp.arange(block)
    same = segq_blk[:, :, None] == segk_blk[:, None, :]
    allowed = (cols[None, :] <= rows[:, None])[None] & same
    return jnp.where(allowed[:, None, None], s, -jnp.inf)


def _forward(q, k, v, segments, block):
    b, t, kv, g, h = q.shape
    nblocks = t // block
    qb, kb, vb, sb = (_blocks(x, block) for x in (q, k, v, segments))

    def query_block(i):
        q_blk, segq = qb[:, i], sb[:, i]

        def key_block(j, carry):
            out, top, total = carry
            s = _scores(q_blk, kb[:, j], segq, sb[:, j], i, j, block)
            new_top = jnp.maximum(top, jnp.max(s, axis=-1))
            # A block with no key for a query (another segment) leaves its max at -inf.
            safe = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
            p = jnp.exp(s - safe[..., None])
            scale = jnp.exp(top - safe)
            total = total * scale + jnp.sum(p, axis=-1)
            out = out * scale[..., None] + jnp.einsum(
                "bkgqs,bskh->bkgqh", p.astype(v.dtype), vb[:, j],
                preferred_element_type=jnp.float32)
            return out, new_top, total

        init = (jnp.zeros((b, kv, g, block, h), jnp.float32),
                jnp.full((b, kv, g, block), -jnp.inf, jnp.float32),
                jnp.zeros((b, kv, g, block), jnp.float32))
        # Key blocks 0..i: every query sees at least itself, so total > 0.
        out, top, total = lax.fori_loop(0, i + 1, key_block, init)
        # in q's dtype block by block: the stacked output of all blocks is the row's size
        return (out / total[..., None]).astype(q.dtype), top + jnp.log(total)

    out, lse = lax.map(query_block, jnp.arange(nblocks))  # [nb, B, K, G, bq, H], [nb, B, K, G, bq]
    out_BxTxKxGxH = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(b, t, kv, g, h)
    return out_BxTxKxGxH, (q, k, v, segments, out_BxTxKxGxH, lse)


def _attention_bwd(block, residuals, d_out):
    q, k, v, segments, out, lse = residuals
    b, t, kv, g, h = q.shape
    nblocks = t // block
    qb, kb, vb, sb = (_blocks(x, block) for x in (q, k, v, segments))
    dob = _blocks(d_out, block)  # widened a block at a time: a float32 copy is twice the row
    # D_t = sum_h dO * O: the softmax's correction term, per query and head.
    delta = _blocks(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1), block)
    scale = 1.0 / math.sqrt(h)

    def key_block(j, dq):
        k_blk, v_blk, segk = kb[:, j], vb[:, j], sb[:, j]

        def query_block(i, carry):
            dq, dk, dv = carry
            s = _scores(qb[:, i], k_blk, sb[:, i], segk, i, j, block)
            p = jnp.exp(s - lse[i][..., None])  # [B, K, G, bq, bk]
            do = dob[:, i].astype(jnp.float32)  # [B, bq, K, G, H]
            dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p, do)
            dp = jnp.einsum("bqkgh,bskh->bkgqs", do, v_blk.astype(jnp.float32))
            ds = p * (dp - jnp.transpose(delta[:, i], (0, 2, 3, 1))[..., None]) * scale
            dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds, qb[:, i].astype(jnp.float32))
            dq_i = jnp.einsum("bkgqs,bskh->bqkgh", ds, k_blk.astype(jnp.float32))
            dq = lax.dynamic_update_index_in_dim(dq, dq[:, i] + dq_i, i, axis=1)
            return dq, dk, dv

        zeros = jnp.zeros((b, block, kv, h), jnp.float32)
        dq, dk, dv = lax.fori_loop(j, nblocks, query_block, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dk, dv) = lax.scan(lambda dq, j: key_block(j, dq), jnp.zeros(qb.shape, jnp.float32),
                            jnp.arange(nblocks))
    def to_tokens(x):  # [key blocks, B, block, K, H] -> [B, T, K, H]
        return jnp.moveaxis(x, 0, 1).reshape(b, t, *x.shape[3:])

    return (dq.reshape(q.shape).astype(q.dtype), to_tokens(dk).astype(k.dtype),
            to_tokens(dv).astype(v.dtype), None)


_attention.defvjp(_forward, _attention_bwd)
