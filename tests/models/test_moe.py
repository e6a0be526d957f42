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


def per_token_loop(moe: MoE, x_XxD: np.ndarray, replay_XxA: np.ndarray | None = None
                   ) -> np.ndarray:
    """The obvious MoE: one token at a time, float64, every chosen expert evaluated on its own.
    With `replay_XxA` (routing replay) a token whose row holds no -1 goes to those experts,
    weighted by this router's probabilities of them (renormalised as top-A's)."""
    router = np.asarray(moe.router.kernel[...], np.float64)
    gate, up, down = (np.asarray(w[...], np.float64) for w in (moe.gate_proj, moe.up_proj,
                                                               moe.down_proj))
    out = np.zeros_like(x_XxD, np.float64)
    for i, x in enumerate(np.asarray(x_XxD, np.float64)):
        logits = x @ router
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs, kind="stable")[: moe.top_k]
        if replay_XxA is not None and (replay_XxA[i] >= 0).all():
            chosen = replay_XxA[i]
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


@pytest.mark.parametrize("dispatch", ["dense", "ragged"])  # the drop-free log-prob dispatches
def test_replayed_routes_take_the_engines_experts_and_train_the_router(dispatch):
    """Routing replay: each token with a replayed row goes to those experts, weighted by this
    router's probabilities of them; a row with a -1 is routed here. The router's gradient
    flows through the replayed weights."""
    cfg = config(num_experts_per_tok=2, norm_topk_prob=True)
    moe = MoE(cfg, nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (3, 7, cfg.hidden_size))
    rng = np.random.default_rng(0)
    replay = np.stack([rng.choice(cfg.num_experts, 2, replace=False) for _ in range(21)])
    replay[::4, 1] = -1  # every 4th token: no replay, routed by this router
    graphdef, params = nnx.split(moe)

    @jax.jit
    def loss_and_grad(params, x, replay_BxTxA):
        def loss(params):
            y, _ = nnx.merge(graphdef, params)(x, dispatch, replay_BxTxA=replay_BxTxA)
            return jnp.sum(jnp.sin(y)), y

        return jax.grad(loss, has_aux=True)(params)

    grads, y = loss_and_grad(params, x, jnp.asarray(replay.reshape(3, 7, 2), jnp.int32))
    want = per_token_loop(moe, np.asarray(x).reshape(21, -1), replay).reshape(3, 7, -1)
    np.testing.assert_allclose(np.asarray(y), want, atol=1e-5)
    assert np.abs(want - per_token_loop(moe, np.asarray(x).reshape(21, -1)).reshape(
        3, 7, -1)).max() > 1e-3, "the replayed experts should differ from the router's"
    assert np.abs(np.asarray(grads["router"]["kernel"][...])).max() > 1e-4


def test_a_model_replaying_its_own_routes_is_unchanged_and_layouts_agree():
    """`expert_routes` reads the experts each token went to at each layer, in either layout;
    replaying them gives the same logits, replaying others changes them the same way in every
    layout. Layers 0 and 2-5 have experts, layer 1 none: two scanned groups, one of 4 repeats
    (nested remat groups them 2 x 2)."""
    from sao_jax.models import expert_routes, stack_layers

    cfg = config(num_layers=6, mlp_only_layers=(1,), scan_layers=False)
    per_layer = CausalLM(cfg, nnx.Rngs(5))
    ids = jax.random.randint(jax.random.key(6), (2, 9), 0, cfg.vocab_size)
    want = None
    for model in (per_layer, stack_layers(per_layer), stack_layers(per_layer, "nested")):
        graphdef, state = nnx.split(model)

        @jax.jit
        def run(state, other_BxTxLxA, graphdef=graphdef):
            model = nnx.merge(graphdef, state)
            out = model.backbone(ids)
            routes = expert_routes(model.cfg, out.router_logits, 2, 9)
            return (routes, model(ids), model(ids, replay_BxTxLxA=routes),
                    model(ids, replay_BxTxLxA=other_BxTxLxA))

        if want is None:  # every expert layer sent elsewhere
            routes = run(state, jnp.full((2, 9, 6, 2), -1, jnp.int32))[0]
            other = jnp.where(routes < 0, -1, (routes + 1) % cfg.num_experts)
        got = run(state, other)
        routes, logits, own, replayed = got
        assert routes.shape == (2, 9, 6, cfg.num_experts_per_tok) and routes.dtype == jnp.int32
        assert (np.asarray(routes[:, :, 1]) == -1).all()
        assert (np.asarray(routes[:, :, [0, 2, 3, 4, 5]]) >= 0).all()
        np.testing.assert_allclose(own, logits, atol=1e-6)
        assert np.abs(np.asarray(replayed - logits)).max() > 1e-3
        want = want or got
        np.testing.assert_array_equal(routes, want[0])
        np.testing.assert_allclose(replayed, want[3], atol=1e-5)
