"""The policy losses as parts: PPO's update with each training-inference mismatch correction of
the registry, against the float64 reference, on a policy small enough to need no model.

The "policy" here is a table of log-probs, one row per trajectory (`table_passes`), and the
optimizer plain SGD with learning rate 1, so that one update moves each log-prob by exactly minus
the loss's gradient: the learner's update, its weights and its metrics checked token by token.
The learner step of every row, corrections included, with the model is
tests/train/test_steps.py (`test_two_steps_train_what_they_should_and_nothing_else`).
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sao_jax.train.algorithms import ALGORITHMS
from sao_jax.train.passes import PolicyPass
from sao_jax.train.policy_losses import PPO, TIS, GeometricMask, IcePop, PolicyPasses
from sao_jax.train.steps import StepConfig
from tests.rl.correction_reference import (
    geometric_mask_reference,
    icepop_reference,
    mismatch_inputs,
    tis_reference,
    weighted_ppo_reference,
)

# The registry's correction rows, and the reference of each (grpo: none, weight 1).
ROWS = {"grpo": lambda old, rollout, mask: mask.astype(np.float64),
        "grpo_tis": tis_reference, "grpo_icepop": icepop_reference,
        "grpo_geomask": geometric_mask_reference}


def table_passes():
    """Passes of a policy whose parameters are its log-probs `[B, L - 1]`: row `b` of the batch
    (its tokens all `b`) reads row `b` of the table, whatever order the mini-batches take."""
    def logp(params, tokens):
        return params["logp"][tokens[:, 0]]

    def policy_pass(params, tokens, entropy=False):
        out = logp(params, tokens)
        return PolicyPass(out, jnp.zeros_like(out) if entropy else None)

    return PolicyPasses(logp=logp, policy_pass=policy_pass, accumulate=None,
                        per_microbatch=lambda fn, *a: fn(*a), optimizer=optax.sgd(1.0),
                        sharding=None)


def update(name, logp, rollout, mask, adv):
    """One policy update of the row `name` on the table `logp`: `(new table, metrics)`."""
    config = StepConfig(algorithm=ALGORITHMS[name], ppo_minibatches=1, dis_impl="xla")
    passes = table_passes()
    rows, length = logp.shape
    tokens = np.repeat(np.arange(rows, dtype=np.int32)[:, None], length + 1, axis=1)

    @jax.jit
    def run(params, tokens, rollout, mask, adv):
        batch = types.SimpleNamespace(tokens=tokens, rollout_logp=rollout, action_mask=mask,
                                      rewards=jnp.zeros(mask.shape, jnp.float32), packing=None,
                                      routes=None)
        out = config.algorithm.policy_loss.update(
            params, passes.optimizer.init(params), batch, adv, config=config, passes=passes,
            key=jax.random.key(0))
        return out.policy["logp"], out.metrics

    return run({"logp": jnp.asarray(logp)}, tokens, rollout, mask, adv)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_the_update_is_the_weighted_ppo_gradient(name):
    old, rollout, mask = mismatch_inputs()
    adv = np.where(np.arange(6) % 2 == 0, 1.0, -2.0)[None].repeat(5, 0).astype(np.float32)
    new, metrics = update(name, old, rollout, mask, adv)
    # At the start of the step the policy is the old policy: every PPO ratio is 1, so the
    # gradient is -w A / N with the correction's weights from the old log-probs and the engine's.
    w = ROWS[name](old, rollout, mask)
    _, grad = weighted_ppo_reference(old, old, adv, mask, w)
    np.testing.assert_allclose(np.asarray(new) - old, -grad, rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(new)[w == 0] == old[w == 0])  # masked and observation tokens stay
    loss = -np.sum(w * adv * mask) / mask.sum()
    np.testing.assert_allclose(metrics["policy/loss"], loss, rtol=1e-5)
    correction = ALGORITHMS[name].policy_loss.correction
    tags = {k for k in metrics if k.startswith("policy/") and k.endswith(
        ("_frac_below", "_frac_above", "_weight_mean", "_rows_masked"))}
    if correction is None:
        assert not tags
        return
    prefix = f"policy/{correction.name}"
    assert tags == {f"{prefix}_frac_below", f"{prefix}_frac_above", f"{prefix}_weight_mean",
                    f"{prefix}_rows_masked"}
    np.testing.assert_allclose(metrics[f"{prefix}_weight_mean"], w[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics[f"{prefix}_rows_masked"],
                               {"tis": 0.0, "icepop": 0.0, "geomask": 3 / 4}[correction.name])


def test_each_correction_row_is_grpo_with_another_correction():
    """The comparison is clean: the rows differ from `grpo` in their correction alone."""
    grpo = ALGORITHMS["grpo"]
    assert isinstance(grpo.policy_loss, PPO) and grpo.policy_loss.correction is None
    for name, correction in (("grpo_tis", TIS(cap=2.0)),
                             ("grpo_icepop", IcePop(low=0.5, high=5.0)),
                             ("grpo_geomask", GeometricMask(low=0.999, high=1.001))):
        assert ALGORITHMS[name] == dataclasses.replace(
            grpo, name=name, policy_loss=PPO(correction=correction))


def test_settings_a_correction_refuses_fail_when_the_step_is_built():
    config = types.SimpleNamespace(ppo_minibatches=2)
    for correction, message in ((TIS(cap=0.5), r"cap must lie in \[1.0, inf\]"),
                                (IcePop(low=1.5), r"low must lie in \[0.0, 1.0\]"),
                                (GeometricMask(high=0.9), r"high must lie in \[1.0, inf\]")):
        with pytest.raises(ValueError, match=message):
            PPO(correction=correction).check(config)
    PPO(correction=TIS()).check(config)
