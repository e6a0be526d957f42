"""Blockwise attention against the dense form it replaces: values and gradients, packed segments,
ragged lengths, grouped-query heads; and the model with `attention="blockwise"`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import CausalLM
from sao_jax.models.attention import blockwise_attention
from sao_jax.models.config import preset
from sao_jax.train.batch import packed_mask


def dense_attention(q, k, v, segments, positions):
    """The model's dense form: [B, N, T, T] scores under the packed mask."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    mask = packed_mask(segments, positions)
    qg = q.reshape(b, t, kv, n // kv, h)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k) / np.sqrt(h)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    out = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(s, -1), v)
    return out.reshape(b, t, n, h)


def packed_rows(rng, b, t):
    """Segment ids and positions of rows holding several trajectories (positions restart in
    each), the last segment of a row being its padding."""
    segments = np.zeros((b, t), np.int32)
    positions = np.zeros((b, t), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=3, replace=False))
        for seg, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, t], strict=True)):
            segments[row, lo:hi] = seg + 1
            positions[row, lo:hi] = np.arange(hi - lo)
    return segments, positions


@pytest.mark.parametrize("t,block", [(40, 8), (37, 16), (16, 64)])
def test_values_and_gradients_match_the_dense_form(t, block):
    rng = np.random.default_rng(t)
    b, n, kv, h = 2, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, heads, h)), jnp.float32)
               for heads in (n, kv, kv))
    segments, positions = packed_rows(rng, b, t)
    cotangent = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * cotangent)

    blockwise = lambda q, k, v: blockwise_attention(q, k, v, segments, block=block)
    dense = lambda q, k, v: dense_attention(q, k, v, segments, positions)
    np.testing.assert_allclose(jax.jit(blockwise)(q, k, v), dense(q, k, v), rtol=1e-5,
                               atol=1e-5)
    got = jax.jit(jax.grad(lambda *a: loss(blockwise, *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2))(q, k, v)
    for name, x, y in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


def test_the_model_trains_alike_with_either_attention():
    """A packed batch through the policy's backbone: blockwise gives the dense hidden states
    and gradients, and its compiled gradient holds no [T, T] array."""
    cfg = preset("toy")
    rng = np.random.default_rng(0)
    b, t = 2, 48
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    segments, positions = (jnp.asarray(x) for x in packed_rows(rng, b, t))
    results = {}
    for attention in ("dense", "blockwise"):
        model = CausalLM(cfg.replace(attention=attention, attention_block=16), nnx.Rngs(1))
        graph, params = nnx.split(model)

        def f(params, graph=graph):
            hidden = nnx.merge(graph, params).backbone(
                ids, positions, segments_BxT=segments).hidden_BxTxD
            return jnp.sum(jnp.sin(hidden))

        compiled = jax.jit(jax.value_and_grad(f)).lower(params).compile()
        results[attention] = compiled(params)
        if attention == "blockwise":
            assert f",{t},{t}]" not in compiled.as_text()
    (a, ga), (b_, gb) = results["dense"], results["blockwise"]
    np.testing.assert_allclose(a, b_, rtol=1e-4)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-5)


def test_bad_heads_and_blocks_are_refused():
    q = jnp.zeros((1, 8, 3, 4))
    k = jnp.zeros((1, 8, 2, 4))
    with pytest.raises(ValueError, match="3 query heads do not split"):
        blockwise_attention(q, k, k, jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="attention must be one of"):
        preset("toy", attention="flash")
