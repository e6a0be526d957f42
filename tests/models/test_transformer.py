"""Policy and critic heads: shapes, alignment with the logits, critic built from the policy."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models import CausalLM, ValueModel
from sao_jax.models.config import preset


def test_value_model_from_policy_copies_the_backbone_and_starts_at_zero():
    policy = CausalLM(preset("toy"), nnx.Rngs(0))
    critic = ValueModel.from_policy(policy)
    ids = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)
    values, router_logits = critic(ids)
    assert values.shape == (2, 9) and values.dtype == jnp.float32
    np.testing.assert_array_equal(values, 0.0)
    assert len(router_logits) == 1  # toy: layer 0 dense, layer 1 MoE
    np.testing.assert_array_equal(critic.backbone(ids).hidden_BxTxD,
                                  policy.backbone(ids).hidden_BxTxD)
    # A copy, not a view: training the critic leaves the policy alone.
    critic.backbone.final_norm.scale[...] = critic.backbone.final_norm.scale[...] * 2
    assert not np.array_equal(critic.backbone.final_norm.scale[...],
                              policy.backbone.final_norm.scale[...])


def test_values_align_with_logits_and_are_causal():
    critic = ValueModel(preset("toy"), nnx.Rngs(0))
    critic.value_head.kernel[...] = jax.random.normal(jax.random.key(1), (64, 1))
    policy = CausalLM(preset("toy"), nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(2), (1, 10), 0, 64)
    changed = ids.at[0, 6].set((ids[0, 6] + 1) % 64)
    v0, v1 = critic(ids)[0], critic(changed)[0]
    l0, l1 = policy(ids), policy(changed)
    # Position t reads tokens <= t: values and logits before 6 are unchanged, from 6 on they move.
    np.testing.assert_allclose(v0[:, :6], v1[:, :6], atol=1e-6)
    np.testing.assert_allclose(l0[:, :6], l1[:, :6], atol=1e-6)
    assert np.abs(np.asarray(v0[:, 6:] - v1[:, 6:])).min() > 0
    assert np.abs(np.asarray(l0[:, 6] - l1[:, 6])).max() > 0
