"""Sharding on 8 simulated CPU devices (see tests/conftest.py): placement and equal numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import CausalLM, ModelConfig, ValueModel
from sao_jax.train import sharding

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, mlp_only_layers=(1,))
MESHES = {
    "fsdp2_expert2_tensor2": {"fsdp": 2, "expert": 2, "tensor": 2},
    "data4_tensor2": {"data": 4, "tensor": 2},
}


def loss_fn(graphdef, state, ids):
    model = nnx.merge(graphdef, state)
    logp = jax.nn.log_softmax(model(ids), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], axis=-1))


def assert_sharded_as_rules(model, mesh, rules):
    """Each parameter's sharding is the rule's; sharded dimensions really are split."""
    split_somewhere = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        logical = tuple(var.get_metadata().get("out_sharding") or ())
        logical += (None,) * (value.ndim - len(logical))
        want = sharding.logical_to_mesh(logical, rules, mesh)
        assert value.sharding.spec == want, (path, value.sharding.spec, want)
        shard_shape = value.addressable_shards[0].data.shape
        for dim, axes in enumerate(want):
            if axes is not None:
                size = np.prod([mesh.shape[a] for a in np.atleast_1d(axes)])
                assert shard_shape[dim] == value.shape[dim] // size, path
                split_somewhere += 1
    assert split_somewhere > 0, "nothing is sharded"


@pytest.fixture(scope="module")
def reference():
    assert jax.device_count() == 8, "tests/conftest.py should give 8 CPU devices"
    model = CausalLM(CFG, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    ids = jax.random.randint(jax.random.key(1), (8, 12), 0, CFG.vocab_size)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn, argnums=1), static_argnums=0)(
        graphdef, state, ids)
    return model, ids, jax.device_get(model(ids)), loss, jax.device_get(grads)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_forward_and_backward_equal_single_device(reference, mesh_name):
    model, ids, logits, loss, grads = reference
    mesh = sharding.make_mesh(MESHES[mesh_name])
    rules = sharding.DEFAULT_RULES
    sharded = sharding.shard_model(model, mesh, rules)
    assert_sharded_as_rules(sharded, mesh, rules)
    graphdef, state = nnx.split(sharded)
    ids_sharded = jax.device_put(ids, sharding.batch_sharding(mesh, rules))
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    np.testing.assert_allclose(jax.device_get(forward(state, ids_sharded)), logits, atol=1e-5)
    got_loss, got_grads = jax.jit(jax.value_and_grad(loss_fn, argnums=1), static_argnums=0)(
        graphdef, state, ids_sharded)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
    for (path, want), (_, got) in zip(nnx.to_flat_state(grads),
                                      nnx.to_flat_state(jax.device_get(got_grads)), strict=True):
        np.testing.assert_allclose(got.get_value(), want.get_value(), atol=1e-5, err_msg=str(path))


def test_create_sharded_initialises_in_place_and_replication_fails_the_check():
    mesh = sharding.make_mesh(MESHES["fsdp2_expert2_tensor2"])
    critic = sharding.create_sharded(lambda: ValueModel(CFG, nnx.Rngs(0)), mesh,
                                     sharding.DEFAULT_RULES)
    assert_sharded_as_rules(critic, mesh, sharding.DEFAULT_RULES)
    replicated_rules = tuple((name, None) for name, _ in sharding.DEFAULT_RULES)
    replicated = sharding.shard_model(critic, mesh, replicated_rules)
    with pytest.raises(AssertionError):
        assert_sharded_as_rules(replicated, mesh, sharding.DEFAULT_RULES)


def test_mesh_and_rule_errors():
    with pytest.raises(ValueError, match="needs 6 devices, but 8 are available"):
        sharding.make_mesh({"data": 2, "tensor": 3})
    with pytest.raises(ValueError, match=r"mesh axes must be among"):
        sharding.make_mesh({"pipeline": 8})
    mesh = sharding.make_mesh({"data": 8})
    with pytest.raises(ValueError, match="logical axis 'embedd' has no sharding rule"):
        sharding.logical_to_mesh(("embedd",), sharding.DEFAULT_RULES, mesh)


@pytest.mark.parametrize("dispatch", ["dense", "ragged"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_forward_and_backward_export_for_accelerators(platform, dispatch):
    # Lowering for another platform catches unsupported ops without the hardware.
    cfg = CFG.replace(logprob_dispatch=dispatch)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, nnx.Rngs(0))))
    state = jax.tree.map(lambda v: v.replace(jax.ShapeDtypeStruct(v.get_value().shape,
                                                                   v.get_value().dtype)),
                         state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    ids = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    grad_fn = jax.jit(jax.value_and_grad(lambda s, x: loss_fn(graphdef, s, x)))
    exported = jax.export.export(grad_fn, platforms=[platform])(state, ids)
    assert exported.platforms == (platform,)
    assert len(exported.out_avals) == 1 + len(jax.tree.leaves(state))  # loss and every gradient
