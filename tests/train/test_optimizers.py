"""Partitioned optimizers: frozen attention, trainable-only clipping, no state for frozen params."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sao_jax import train

D, HEADS, HEAD_DIM, VOCAB, EXPERTS, FFN, B, T = 8, 2, 4, 16, 4, 8, 2, 5


# A stand-in critic whose parameter paths follow the model convention exactly (models/ is not
# imported): layer 0 is MoE, layer 1 dense; both have an attention block.


def _param(rng, shape, scale=0.3):
    return nnx.Param(jnp.asarray(scale * rng.standard_normal(shape), jnp.float32))


class Linear(nnx.Module):
    def __init__(self, rng, d_in, d_out):
        self.kernel = _param(rng, (d_in, d_out), d_in**-0.5)

    def __call__(self, x):
        return x @ self.kernel[...]


class RMSNorm(nnx.Module):
    def __init__(self, rng, d):
        self.scale = nnx.Param(jnp.asarray(1.0 + 0.1 * rng.standard_normal(d), jnp.float32))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]


class Attention(nnx.Module):
    def __init__(self, rng):
        self.q_proj = Linear(rng, D, HEADS * HEAD_DIM)
        self.k_proj = Linear(rng, D, HEADS * HEAD_DIM)
        self.v_proj = Linear(rng, D, HEADS * HEAD_DIM)
        self.o_proj = Linear(rng, HEADS * HEAD_DIM, D)
        self.q_norm = RMSNorm(rng, HEAD_DIM)
        self.k_norm = RMSNorm(rng, HEAD_DIM)

    def __call__(self, x_BxTxD):
        heads = lambda y: y.reshape(B, T, HEADS, HEAD_DIM)
        q_BxTxHxK = self.q_norm(heads(self.q_proj(x_BxTxD)))
        k_BxTxHxK = self.k_norm(heads(self.k_proj(x_BxTxD)))
        v_BxTxHxK = heads(self.v_proj(x_BxTxD))
        logits_BxHxTxT = jnp.einsum("bthk,bshk->bhts", q_BxTxHxK, k_BxTxHxK) * HEAD_DIM**-0.5
        causal = jnp.tril(jnp.ones((T, T), bool))
        probs_BxHxTxT = jax.nn.softmax(jnp.where(causal, logits_BxHxTxT, -1e9), axis=-1)
        out_BxTxHxK = jnp.einsum("bhts,bshk->bthk", probs_BxHxTxT, v_BxTxHxK)
        return self.o_proj(out_BxTxHxK.reshape(B, T, HEADS * HEAD_DIM))


class Mlp(nnx.Module):
    def __init__(self, rng):
        self.gate_proj = Linear(rng, D, FFN)
        self.up_proj = Linear(rng, D, FFN)
        self.down_proj = Linear(rng, FFN, D)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Moe(nnx.Module):
    """Every token goes to every expert, weighted by the router (so all experts get gradients)."""

    def __init__(self, rng):
        self.router = Linear(rng, D, EXPERTS)
        self.gate_proj = _param(rng, (EXPERTS, D, FFN))
        self.up_proj = _param(rng, (EXPERTS, D, FFN))
        self.down_proj = _param(rng, (EXPERTS, FFN, D))

    def __call__(self, x_BxTxD):
        weights_BxTxE = jax.nn.softmax(self.router(x_BxTxD), axis=-1)
        gate_BxTxExF = jnp.einsum("btd,edf->btef", x_BxTxD, self.gate_proj[...])
        up_BxTxExF = jnp.einsum("btd,edf->btef", x_BxTxD, self.up_proj[...])
        out_BxTxExD = jnp.einsum("btef,efd->bted", jax.nn.silu(gate_BxTxExF) * up_BxTxExF,
                                 self.down_proj[...])
        return jnp.einsum("bte,bted->btd", weights_BxTxE, out_BxTxExD)


class Layer(nnx.Module):
    def __init__(self, rng, moe):
        self.input_norm = RMSNorm(rng, D)
        self.attn = Attention(rng)
        self.post_attn_norm = RMSNorm(rng, D)
        if moe:
            self.moe = Moe(rng)
        else:
            self.mlp = Mlp(rng)

    def __call__(self, x):
        x = x + self.attn(self.input_norm(x))
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return x + ffn(self.post_attn_norm(x))


class Embed(nnx.Module):
    def __init__(self, rng):
        self.embedding = _param(rng, (VOCAB, D), 1.0)

    def __call__(self, ids):
        return self.embedding[...][ids]


class Backbone(nnx.Module):
    def __init__(self, rng):
        self.embed = Embed(rng)
        self.layers = nnx.List([Layer(rng, moe=True), Layer(rng, moe=False)])
        self.final_norm = RMSNorm(rng, D)

    def __call__(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x)


class ValueHead(nnx.Module):
    def __init__(self, rng):
        self.kernel = _param(rng, (D, 1))
        self.bias = nnx.Param(jnp.zeros((1,)))


class ValueModel(nnx.Module):
    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.backbone = Backbone(rng)
        self.value_head = ValueHead(rng)

    def __call__(self, ids):
        h = self.backbone(ids)
        return (h @ self.value_head.kernel[...] + self.value_head.bias[...])[..., 0]


def _batch(seed=1):
    rng = np.random.default_rng(seed + 100)
    return (jnp.asarray(rng.integers(0, VOCAB, (B, T)), jnp.int32),
            jnp.asarray(rng.standard_normal((B, T)), jnp.float32))


def _loss(model, batch):
    ids, returns = batch
    return 0.5 * jnp.mean(jnp.square(model(ids) - returns))


ATTN_PATHS = {f"backbone/layers/{i}/attn/{name}" for i in (0, 1) for name in (
    "q_proj/kernel", "k_proj/kernel", "v_proj/kernel", "o_proj/kernel", "q_norm/scale",
    "k_norm/scale")}
ALL_PATHS = ATTN_PATHS | {
    "backbone/embed/embedding", "backbone/final_norm/scale", "value_head/kernel",
    "value_head/bias", "backbone/layers/1/mlp/gate_proj/kernel",
    "backbone/layers/1/mlp/up_proj/kernel", "backbone/layers/1/mlp/down_proj/kernel",
    "backbone/layers/0/moe/router/kernel", "backbone/layers/0/moe/gate_proj",
    "backbone/layers/0/moe/up_proj", "backbone/layers/0/moe/down_proj",
} | {f"backbone/layers/{i}/{n}/scale" for i in (0, 1) for n in ("input_norm", "post_attn_norm")}


def _flat(tree):
    """{path: array} over the parameters of `tree` (a State with or without Variables)."""
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {train.param_path(k): np.asarray(v[...] if isinstance(v, nnx.Variable) else v)
            for k, v in leaves}


def _flat_labels(labels):
    return {train.param_path(k): v for k, v in jax.tree_util.tree_flatten_with_path(labels)[0]}


def _critic_config(**kwargs):
    kwargs.setdefault("learning_rate", 1e-2)  # Large enough that every trainable param moves.
    return train.critic_optimizer_config(**kwargs)


# --------------------------------------------------------------------------------------------
# Labels.


def test_paths_of_the_stand_in_follow_the_convention():
    assert set(_flat(nnx.state(ValueModel(), nnx.Param))) == ALL_PATHS


def test_labels_freeze_exactly_attention():
    params = nnx.state(ValueModel(), nnx.Param)
    labels = _flat_labels(train.param_labels(params, train.FROZEN_ATTENTION))
    assert set(labels) == ALL_PATHS
    assert {p for p, label in labels.items() if label == train.FROZEN} == ATTN_PATHS
    assert labels["backbone/layers/0/post_attn_norm/scale"] == train.TRAINABLE
    # Same labels on the pure (Variable-free) state: the labels tree is a prefix of both.
    pure = _flat_labels(train.param_labels(nnx.as_pure(params), train.FROZEN_ATTENTION))
    assert pure == labels


def test_full_parameter_critic_and_policy_freeze_nothing():
    params = nnx.state(ValueModel(), nnx.Param)
    for config in (train.critic_optimizer_config(freeze_attention=False),
                   train.policy_optimizer_config()):
        assert config.frozen_patterns == ()
        labels = _flat_labels(train.param_labels(params, config.frozen_patterns))
        assert set(labels.values()) == {train.TRAINABLE}


def test_labels_on_plain_pytrees_and_flat_paths():
    a = jnp.zeros((2, 2))
    params = {"backbone": {"layers": [{"attn": {"q_proj": {"kernel": a}},
                                       "mlp": {"up_proj": {"kernel": a}}}]},
              "lm_head": {"kernel": a}}
    labels = _flat_labels(train.param_labels(params, train.FROZEN_ATTENTION))
    assert labels == {"backbone/layers/0/attn/q_proj/kernel": train.FROZEN,
                      "backbone/layers/0/mlp/up_proj/kernel": train.TRAINABLE,
                      "lm_head/kernel": train.TRAINABLE}
    assert train.param_path(("backbone", "layers", 3, "attn")) == "backbone/layers/3/attn"
    # Abstract parameters are enough.
    abstract = jax.eval_shape(lambda: nnx.state(ValueModel(), nnx.Param))
    assert _flat_labels(train.param_labels(abstract, train.FROZEN_ATTENTION)) == _flat_labels(
        train.param_labels(nnx.state(ValueModel(), nnx.Param), train.FROZEN_ATTENTION))


def test_unmatched_frozen_pattern_raises_naming_it():
    params = nnx.state(ValueModel(), nnx.Param)
    with pytest.raises(ValueError, match="attention/"):
        train.param_labels(params, (r"(^|/)attn/", r"attention/"))
    config = train.OptimizerConfig(learning_rate=1e-3, frozen_patterns=(r"self_attn/",))
    with pytest.raises(ValueError, match="self_attn/"):
        train.make_optimizer(config, params)


# --------------------------------------------------------------------------------------------
# Optimizer steps.


def _functional_run(config, model, steps):
    """`steps` jitted functional updates on `nnx.state(model, nnx.Param)`."""
    graphdef = nnx.graphdef(model)
    params = nnx.state(model, nnx.Param)
    tx = train.make_optimizer(config, params)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: _loss(nnx.merge(graphdef, p), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads

    for i in range(steps):
        params, opt_state, grads = step(params, opt_state, _batch(i))
        assert all(np.any(g != 0) for g in _flat(grads).values())  # Every param gets a gradient.
    return params, opt_state


def _check_frozen_identical_trainable_moved(before, after, frozen_paths):
    for path, old in before.items():
        if path in frozen_paths:
            assert np.array_equal(after[path], old) and after[path].tobytes() == old.tobytes(), path
        else:
            assert not np.array_equal(after[path], old), path


def _state_arrays(opt_state):
    """(path, array) for every array in an optimizer state."""
    return [(train.param_path(k), np.asarray(v))
            for k, v in jax.tree_util.tree_flatten_with_path(opt_state)[0]]


def _check_moments_only_for_trainable(opt_state, params, frozen_paths):
    arrays = _state_arrays(opt_state)
    n_trainable = sum(v.size for p, v in _flat(params).items() if p not in frozen_paths)
    attn_state = [path for path, _ in arrays if "/attn/" in path]
    assert bool(attn_state) != bool(frozen_paths), attn_state  # Moments for attention iff trained.
    scalars = [path for path, v in arrays if v.ndim == 0]  # Step counters.
    assert 1 <= len(scalars) <= 3, scalars
    # Adam's mu and nu, each the size of the trainable parameters; nothing for frozen ones.
    assert sum(v.size for _, v in arrays if v.ndim > 0) == 2 * n_trainable


@pytest.mark.parametrize("freeze_attention", [True, False])
def test_functional_steps_keep_frozen_params_bit_identical(freeze_attention):
    model = ValueModel()
    before = _flat(nnx.state(model, nnx.Param))
    config = _critic_config(freeze_attention=freeze_attention)
    params, opt_state = _functional_run(config, model, steps=3)
    frozen = ATTN_PATHS if freeze_attention else set()
    _check_frozen_identical_trainable_moved(before, _flat(params), frozen)
    _check_moments_only_for_trainable(opt_state, params, frozen)


def test_nnx_optimizer_keeps_frozen_params_bit_identical():
    model = ValueModel()
    before = _flat(nnx.state(model, nnx.Param))
    tx = train.make_optimizer(_critic_config(), nnx.state(model, nnx.Param))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, _batch(0))) for _ in range(4)]
    assert losses[-1] < losses[0]
    _check_frozen_identical_trainable_moved(before, _flat(nnx.state(model, nnx.Param)), ATTN_PATHS)
    _check_moments_only_for_trainable(optimizer.opt_state, nnx.state(model, nnx.Param), ATTN_PATHS)
    assert int(optimizer.step[...]) == 4


# --------------------------------------------------------------------------------------------
# Clipping, grad norm, schedule.


def _synthetic_grads(params, frozen_scale):
    """Trainable grads in [-1, 1]; frozen ones multiplied by `frozen_scale`."""
    def grad(key_path, p):
        path = train.param_path(key_path)
        rng = np.random.default_rng(sum(map(ord, path)))
        g = rng.uniform(-1.0, 1.0, p.shape).astype(np.float32)
        return jnp.asarray(g * frozen_scale if path in ATTN_PATHS else g)

    return jax.tree_util.tree_map_with_path(grad, nnx.as_pure(params))


def test_clipping_and_grad_norm_cover_trainable_params_only():
    params = nnx.as_pure(nnx.state(ValueModel(), nnx.Param))
    lr, clip, eps = 0.1, 0.5, 1.0  # eps = 1 makes the Adam update depend on the gradient scale.
    config = _critic_config(learning_rate=lr, grad_clip_norm=clip, eps=eps, weight_decay=0.0)
    tx = train.make_optimizer(config, params)
    labels = train.param_labels(params, config.frozen_patterns)

    huge = _synthetic_grads(params, frozen_scale=1e6)
    zeroed = _synthetic_grads(params, frozen_scale=0.0)
    trainable = {p: g for p, g in _flat(zeroed).items() if p not in ATTN_PATHS}
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in trainable.values()))
    assert norm > 10 * clip  # The clip is active.
    np.testing.assert_allclose(train.trainable_global_norm(huge, labels), norm, rtol=1e-6)
    np.testing.assert_allclose(train.trainable_global_norm(zeroed, labels), norm, rtol=1e-6)
    # the matched (attention) parameters' own norm: 1e6 times theirs, none of the others'
    attention = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for p, g in _flat(huge).items()
                            if p in ATTN_PATHS))
    np.testing.assert_allclose(train.trainable_global_norm(huge, labels, label=train.FROZEN),
                               attention, rtol=1e-6)
    with pytest.raises(ValueError, match="label must be one of"):
        train.trainable_global_norm(huge, labels, label="attention")

    update = jax.jit(tx.update)
    upd_huge = _flat(update(huge, tx.init(params), params)[0])
    upd_zeroed = _flat(update(zeroed, tx.init(params), params)[0])
    for path in ALL_PATHS:
        assert np.array_equal(upd_huge[path], upd_zeroed[path]), path
        if path in ATTN_PATHS:
            assert not np.any(upd_huge[path]), path
        else:
            # First bias-corrected Adam step on clipped g_c: -lr * g_c / (|g_c| + eps).
            g_c = trainable[path] * (clip / norm)
            np.testing.assert_allclose(upd_huge[path], -lr * g_c / (np.abs(g_c) + eps),
                                       rtol=1e-5, atol=1e-9)


def test_grad_norm_with_variable_labels_on_pure_grads():
    state = nnx.state(ValueModel(), nnx.Param)
    labels = train.param_labels(state, train.FROZEN_ATTENTION)  # Labels from the Variable state.
    grads = _synthetic_grads(state, frozen_scale=1e6)
    assert float(train.trainable_global_norm(grads, labels)) < 1e3
    no_frozen = train.param_labels(state, ())
    assert float(train.trainable_global_norm(grads, no_frozen)) > 1e6


def test_warmup_schedule():
    config = train.policy_optimizer_config(learning_rate=1.0, warmup_steps=4)
    schedule = train.learning_rate_schedule(config)
    np.testing.assert_allclose([schedule(n) for n in range(6)], [0.25, 0.5, 0.75, 1, 1, 1])
    flat = train.learning_rate_schedule(train.policy_optimizer_config(learning_rate=3e-6))
    np.testing.assert_allclose([flat(0), flat(100)], [3e-6, 3e-6])

    # The optimizer uses it: a first Adam step moves each trainable param by lr(0) = lr / 4.
    params = {"w": jnp.ones((3,))}
    config = dataclasses.replace(config, weight_decay=0.0, grad_clip_norm=None)
    tx = train.make_optimizer(config, params)
    state = tx.init(params)
    grads = {"w": jnp.array([0.5, -2.0, 1.0])}
    updates, state = tx.update(grads, state, params)
    # rtol: optax bias-corrects in float32 (1 - 0.999 is off by 1e-5 relative).
    np.testing.assert_allclose(updates["w"], [-0.25, 0.25, -0.25], rtol=1e-5)


def test_config_defaults_and_hashable():
    critic = train.critic_optimizer_config()
    assert critic.learning_rate == 5e-6 and critic.frozen_patterns == train.FROZEN_ATTENTION
    policy = train.policy_optimizer_config()
    assert policy.learning_rate == 1e-6 and policy.frozen_patterns == ()
    listed = train.OptimizerConfig(learning_rate=1e-3, frozen_patterns=["attn/"])
    assert listed.frozen_patterns == ("attn/",)
    hash(listed)
    with pytest.raises(ValueError, match="frozen_patterns"):
        train.critic_optimizer_config(frozen_patterns=("x",))


def test_first_moment_in_bfloat16_keeps_the_rest_in_float32():
    """`mu_dtype="bfloat16"` keeps AdamW's first moment in bfloat16 (half its bytes); the
    second moment and the updates stay in the parameters' float32, and the first update is
    AdamW's, -lr * sign(g), as in float32."""
    params = {"w": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)}
    grads = {"w": jnp.linspace(0.3, -0.2, 8, dtype=jnp.float32)}
    dtypes = {}
    for mu_dtype in ("", "bfloat16"):
        tx = train.make_optimizer(train.OptimizerConfig(1e-3, weight_decay=0.0, mu_dtype=mu_dtype),
                                   params)
        state = tx.init(params)
        updates, state = tx.update(grads, state, params)
        dtypes[mu_dtype] = (optax.tree.get(state, "mu")["w"].dtype,
                            optax.tree.get(state, "nu")["w"].dtype, updates["w"].dtype)
        np.testing.assert_allclose(updates["w"], -1e-3 * np.sign(grads["w"]), rtol=1e-5)
    assert dtypes == {"": (jnp.float32,) * 3,
                      "bfloat16": (jnp.bfloat16, jnp.float32, jnp.float32)}


@pytest.mark.parametrize("kwargs, field", [
    ({"learning_rate": -1e-6}, "learning_rate"),
    ({"learning_rate": 0.0}, "learning_rate"),
    ({"learning_rate": float("nan")}, "learning_rate"),
    ({"b1": 1.0}, "b1"),
    ({"b2": -0.1}, "b2"),
    ({"eps": 0.0}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"grad_clip_norm": 0.0}, "grad_clip_norm"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"warmup_steps": 2.5}, "warmup_steps"),
    ({"frozen_patterns": ("attn/[",)}, "frozen_patterns"),
    ({"frozen_patterns": "attn/"}, "frozen_patterns"),
    ({"frozen_patterns": (3,)}, "frozen_patterns"),
    ({"mu_dtype": "bf16"}, "mu_dtype"),
])
def test_bad_config_names_the_field(kwargs, field):
    kwargs = {"learning_rate": 1e-3, **kwargs}
    with pytest.raises(ValueError, match=field):
        train.OptimizerConfig(**kwargs)


@pytest.mark.parametrize("scan_layers", [False, True])  # per-layer, or stacked paths
def test_real_value_model_freezes_exactly_its_attention(scan_layers):
    from sao_jax.models import ModelConfig
    from sao_jax.models import ValueModel as RealValueModel

    cfg = ModelConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=8, intermediate_size=24, num_experts=3, moe_intermediate_size=8,
                      mlp_only_layers=(1,), scan_layers=scan_layers)
    critic = RealValueModel(cfg, nnx.Rngs(0))
    config = train.critic_optimizer_config(learning_rate=1e-2)
    optimizer = nnx.Optimizer(critic, train.make_optimizer(config, nnx.state(critic, nnx.Param)),
                              wrt=nnx.Param)
    ids = jnp.arange(12).reshape(2, 6)
    loss = lambda m: jnp.sum((m(ids)[0] - 1.0) ** 2)
    before = jax.tree_util.tree_flatten_with_path(
        jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(critic, nnx.Param))))[0]
    @nnx.jit
    def step(critic, optimizer):
        optimizer.update(critic, nnx.grad(loss)(critic))

    for _ in range(2):
        step(critic, optimizer)
    after = jax.tree.leaves(jax.tree.map(np.asarray,
                                         nnx.to_pure_dict(nnx.state(critic, nnx.Param))))
    for (path, old), new in zip(before, after, strict=True):
        name = train.param_path(path)
        if "/attn/" in name:
            assert np.array_equal(old, new), name
        elif "value_head/kernel" in name or "moe/router" in name or "embed" in name:
            assert not np.array_equal(old, new), name


def test_updates_rounded_away_in_bfloat16_are_counted():
    from sao_jax.train.optimizers import rounded_away_share

    # bfloat16 keeps 8 significant bits: around 1.0 it moves by 2^-7, around 0.02 by 2^-13
    # (1.2e-4), so an update of 1e-4 is lost at 1.0 and kept at 0.02 and 1e-5
    params = {"norm": jnp.array([1.0], jnp.bfloat16),
              "w": jnp.array([0.02, 1e-5], jnp.bfloat16),
              "count": jnp.array([3, 4], jnp.int32)}  # not a float: not counted
    assert rounded_away_share(params, 1e-4) == pytest.approx(1 / 3)
    assert rounded_away_share(params, 1e-2) == 0.0
    assert rounded_away_share(jax.tree.map(lambda x: x.astype(jnp.float32)
                                           if x.dtype == jnp.bfloat16 else x, params), 1e-4) == 0
    assert rounded_away_share({}, 1e-4) == 0.0


def test_a_bfloat16_master_copy_whose_updates_round_away_is_warned_of():
    from experiments import toy
    from sao_jax.train.learner import rounding_warning

    config = toy.get_config()
    config.model.dtype = config.model.master_dtype = "bfloat16"
    config.optim.policy.learning_rate = 1e-6  # swe's
    weights = {"w": jnp.full((100,), 0.02, jnp.bfloat16)}
    warning = rounding_warning(config, weights)
    assert "leaves 100% of its parameters as they are" in warning and "1e-06" in warning
    assert "--config.model.master_dtype=float32" in warning
    config.optim.policy.learning_rate = 1e-3  # moves every 0.02
    assert rounding_warning(config, weights) is None
    config.model.master_dtype = "float32"  # bfloat16 compute over float32 master weights
    config.optim.policy.learning_rate = 1e-6
    assert rounding_warning(config, {"w": jnp.full((100,), 0.02, jnp.float32)}) is None
