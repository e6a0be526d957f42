"""Expert dispatch against a per-token loop, token dropping, and the load-balancing loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import CausalLM, ModelConfig
from sao_jax.models.moe import MoE, chunk_layout


def config(**changes):
    base = dict(vocab_size=61, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=4, intermediate_size=20, num_experts=5, num_experts_per_tok=2,
                moe_intermediate_size=12)
    base.update(changes)
    return ModelConfig(**base)


def per_token_loop(moe: MoE, x_XxD: np.ndarray) -> np.ndarray:
    """The obvious MoE: one token at a time, float64, every chosen expert evaluated on its own."""
    router = np.asarray(moe.router.kernel[...], np.float64)
    gate, up, down = (np.asarray(w[...], np.float64) for w in (moe.gate_proj, moe.up_proj,
                                                               moe.down_proj))
    out = np.zeros_like(x_XxD, np.float64)
    for i, x in enumerate(np.asarray(x_XxD, np.float64)):
        logits = x @ router
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs, kind="stable")[: moe.top_k]
        weights = probs[chosen]
        if moe.norm_topk_prob:
            weights = weights / weights.sum()
        for e, w in zip(chosen, weights, strict=True):
            h = x @ gate[e]
            out[i] += w * ((h / (1 + np.exp(-h))) * (x @ up[e])) @ down[e]
    return out


@pytest.mark.parametrize("top_k,norm", [(1, False), (2, True), (3, False)])
@pytest.mark.parametrize("dispatch", ["dense", "ragged", "capacity"])
def test_dispatch_matches_per_token_loop(dispatch, top_k, norm):
    cfg = config(num_experts_per_tok=top_k, norm_topk_prob=norm, capacity_factor=5.0)
    moe = MoE(cfg, nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (3, 7, cfg.hidden_size))
    y, _ = moe(x, dispatch)
    want = per_token_loop(moe, np.asarray(x).reshape(21, -1)).reshape(3, 7, -1)
    np.testing.assert_allclose(np.asarray(y), want, atol=1e-5)


def test_capacity_drops_tokens_and_log_probs_never_use_it():
    # Identical tokens all pick the same experts: a capacity of 1.25 * X * A / E overflows.
    cfg = config(moe_dispatch="capacity", capacity_factor=1.0)
    model = CausalLM(cfg, nnx.Rngs(3))
    ids = jnp.full((2, 12), 7)
    moe = model.backbone.layers[0].moe
    x = jax.random.normal(jax.random.key(4), (1, 24, cfg.hidden_size))
    x = jnp.broadcast_to(x[:, :1], x.shape)
    dropped, _ = moe(x, "capacity")
    exact = per_token_loop(moe, np.asarray(x[0]))
    assert np.abs(np.asarray(dropped[0]) - exact).max() > 1e-3, "capacity should drop here"
    # The policy's log-prob path ignores moe_dispatch and uses the drop-free logprob_dispatch:
    logits = model(ids)
    np.testing.assert_allclose(logits, model(ids, dispatch="dense"), atol=1e-6)
    assert np.abs(np.asarray(logits - model(ids, dispatch="capacity"))).max() > 1e-4
    with pytest.raises(ValueError, match="logprob_dispatch must be drop-free"):
        config(logprob_dispatch="capacity")


def test_chunks_divide_the_tokens_or_pad_the_last():
    """The fewest chunks of at most `chunk` tokens that divide the tokens, unless they would be
    under half a chunk: then ceil(tokens / chunk) of them, the last padded."""
    assert chunk_layout(96, 5) == (24, 4)
    assert chunk_layout(23, 5) == (5, 5)  # 23 is prime: 2 tokens of padding, not 23 chunks
    assert chunk_layout(147_455, 8192) == (35, 4213)  # swe's 147,456-token rows, as before
    assert chunk_layout(131_071, 8192) == (16, 8192)  # 131,072-token rows: 2^17 - 1 is prime


@pytest.mark.parametrize("dispatch", ["dense", "ragged"])
def test_a_prime_number_of_tokens_in_padded_chunks_matches_one_pass(dispatch):
    """23 tokens in chunks of at most 5 (5 chunks, the last with 2 padding tokens): outputs and
    gradients (inputs and expert weights) equal one pass over all tokens."""
    cfg = config(moe_dispatch=dispatch, moe_token_chunk=0, num_experts=4)
    x = jax.random.normal(jax.random.key(4), (1, 23, cfg.hidden_size))

    def loss_and_grads(moe, x):
        graphdef, params = nnx.split(moe)

        def loss(params, x):
            y, _ = nnx.merge(graphdef, params)(x, dispatch)
            return jnp.sum(jnp.sin(y))

        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    want, (want_params, want_x) = jax.jit(loss_and_grads)(MoE(cfg, nnx.Rngs(1)), x)
    chunked = MoE(cfg.replace(moe_token_chunk=5), nnx.Rngs(1))
    got, (got_params, got_x) = jax.jit(loss_and_grads)(chunked, x)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_x, want_x, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("dispatch", ["dense", "ragged"])
def test_experts_per_shard_and_in_chunks_match_one_pass(dispatch):
    """Under a mesh, with rows over the batch axes, each device dispatches its own tokens
    (`jax.shard_map`), in chunks of `moe_token_chunk`: outputs and gradients (inputs and expert
    weights) equal one pass over all tokens, and the compiled program gathers no
    assignment-sized array (ragged's global sort would gather every device's tokens)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from sao_jax.train import sharding

    cfg = config(moe_dispatch=dispatch, moe_token_chunk=0, num_experts=4)
    x = jax.random.normal(jax.random.key(3), (8, 12, cfg.hidden_size))
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "expert": 2})
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, None))
    whole = MoE(cfg, nnx.Rngs(1))
    chunked = MoE(cfg.replace(moe_token_chunk=5), nnx.Rngs(1))
    placed = sharding.shard_model(MoE(cfg, nnx.Rngs(1)), mesh, sharding.DEFAULT_RULES)

    def loss_and_grads(moe, x, sharding=None):
        def loss(params, x):
            y, _ = nnx.merge(graphdef, params)(x, dispatch, sharding)
            return jnp.sum(jnp.sin(y))

        graphdef, params = nnx.split(moe)
        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    want, (want_params, want_x) = jax.jit(loss_and_grads)(whole, x)
    for moe, shard in ((chunked, None), (placed, rows)):
        f = jax.jit(loss_and_grads, static_argnums=2)
        got, (got_params, got_x) = f(moe, jax.device_put(x, rows), shard)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        np.testing.assert_allclose(got_x, want_x, atol=1e-5)
        for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    hlo = jax.jit(loss_and_grads, static_argnums=2).lower(placed, jax.device_put(x, rows),
                                                          rows).compile().as_text()
    assignments = 8 * 12 * cfg.num_experts_per_tok
    gathered = [line for line in hlo.splitlines() if "all-gather(" in line
                and any(f"[{n}," in line.split("all-gather(")[0] or f"[{n}]" in
                        line.split("all-gather(")[0] for n in (assignments, 8 * 12))]
    assert not gathered, gathered
