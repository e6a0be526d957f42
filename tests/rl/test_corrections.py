"""Tests of the training-inference mismatch corrections (`rl.tis_weights`, `rl.icepop_weights`,
`rl.geometric_mask_weights`) and of PPO weighted by them: hand-computed weights and metrics, the
loss and its gradient against a float64 NumPy loop, observation tokens ignored, no gradient
through the weights, nothing NaN.

Each function runs jitted, its settings traced, so that a shape compiles once for every test
(eager JAX compiles each op per shape); the argument checks run where the settings are concrete,
outside jit (`test_bad_arguments`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax import rl
from tests.rl.correction_reference import (
    geometric_mask_reference,
    icepop_reference,
    mismatch_inputs,
    tis_reference,
    weighted_ppo_reference,
)

TIS = jax.jit(rl.tis_weights)
ICEPOP = jax.jit(rl.icepop_weights)
GEOMASK = jax.jit(rl.geometric_mask_weights)
CORRECTIONS = {  # name: (the function with its defaults, jitted; the NumPy reference)
    "tis": (TIS, tis_reference),
    "icepop": (ICEPOP, icepop_reference),
    "geomask": (GEOMASK, geometric_mask_reference),
}
ACTION_TOKENS = 16  # of mismatch_inputs: 5 + 4 + 5 + 2 + 0


@jax.jit
def weighted_ppo(logp, old, adv, mask, weights):
    """`(loss, d loss / d logp, d loss / d weights)` of PPO clip-higher weighted by `weights`."""
    fn = lambda lp, w: rl.ppo_clip_loss(lp, old, adv, mask, weights=w)[0]  # noqa: E731
    loss, (d_logp, d_w) = jax.value_and_grad(fn, argnums=(0, 1))(logp, weights)
    return loss, d_logp, d_w


def policy_inputs():
    """`(logp, old_logp, rollout_logp, advantages, mask)`: `mismatch_inputs` with a current policy
    whose PPO ratios `exp(logp - old)` are clipped on some tokens (1.5 with A > 0 at [0, 0],
    0.5 with A < 0 at [0, 4]) and not on others, and advantages of both signs."""
    old, rollout, mask = mismatch_inputs()
    u = np.ones(old.shape)
    u[0, 0], u[0, 1], u[0, 4], u[1, 0], u[2, 1], u[3, 0] = 1.5, 1.1, 0.5, 0.9, 1.2, 0.7
    logp = (old + np.log(u)).astype(np.float32)
    adv = np.where(np.arange(5)[:, None] % 2 == 0, 1.0, -1.0) * np.linspace(0.5, 2.0, 6)
    adv[0, 4] = -1.0
    return logp, old, rollout, adv.astype(np.float32), mask


# ------------------------------------------------------------------ each correction, by hand

def test_tis_truncates_the_ratio_at_the_cap():
    old, rollout, mask = mismatch_inputs()
    w, m = TIS(old, rollout, mask)
    # Row 0: ratios 1, 3, (observation), 0.4, 6, 1.5 -> 1, 2, 0, 0.4, 2, 1.5.
    np.testing.assert_allclose(w[0], [1.0, 2.0, 0.0, 0.4, 2.0, 1.5], rtol=1e-5)
    np.testing.assert_allclose(w[1, :4], [1.0005, 0.9998, 1.0004, 1.0001], rtol=1e-5)
    np.testing.assert_allclose(w[3], [1.2, 0, 0, 0, 0, 0], rtol=1e-5)  # the NaN pair: 0
    np.testing.assert_allclose(m.above_frac, 2 / ACTION_TOKENS)  # 3 and 6 truncated
    assert float(m.below_frac) == 0.0 and float(m.rows_masked_frac) == 0.0
    np.testing.assert_allclose(m.weight_mean, np.sum(w) / ACTION_TOKENS, rtol=1e-6)
    # The cap is an argument; a ratio equal to it is not counted as truncated.
    old[0, 1] = rollout[0, 1] + np.log(2.0)
    w, m = TIS(old, rollout, mask, cap=5.0)
    np.testing.assert_allclose(w[0], [1.0, 2.0, 0.0, 0.4, 5.0, 1.5], rtol=1e-5)
    np.testing.assert_allclose(m.above_frac, 1 / ACTION_TOKENS)
    _, m = TIS(old, rollout, mask, cap=2.0)
    np.testing.assert_allclose(m.above_frac, 1 / ACTION_TOKENS)  # only the 6


def test_icepop_keeps_the_ratio_inside_the_band_and_masks_outside():
    old, rollout, mask = mismatch_inputs()
    w, m = ICEPOP(old, rollout, mask)
    np.testing.assert_allclose(w[0], [1.0, 3.0, 0.0, 0.0, 0.0, 1.5], rtol=1e-5)
    np.testing.assert_allclose(w[3], [1.2, 0, 0, 0, 0, 0], rtol=1e-5)
    np.testing.assert_allclose(m.below_frac, 1 / ACTION_TOKENS)  # 0.4
    np.testing.assert_allclose(m.above_frac, 1 / ACTION_TOKENS)  # 6
    assert float(m.rows_masked_frac) == 0.0
    w, m = ICEPOP(old, rollout, mask, low=0.3, high=7.0)  # the band is an argument
    np.testing.assert_allclose(w[0], [1.0, 3.0, 0.0, 0.4, 6.0, 1.5], rtol=1e-5)
    assert float(m.below_frac) == float(m.above_frac) == 0.0


def test_the_geometric_mask_keeps_or_masks_whole_rows():
    old, rollout, mask = mismatch_inputs()
    w, m = GEOMASK(old, rollout, mask)
    # Row 0 above (1.61), row 2 below (0.9968), row 3 non-finite: masked; row 1 (1.0002) kept.
    np.testing.assert_array_equal(w, np.where(mask & (np.arange(5) == 1)[:, None], 1.0, 0.0))
    np.testing.assert_allclose(m.above_frac, 5 / ACTION_TOKENS)
    np.testing.assert_allclose(m.below_frac, 5 / ACTION_TOKENS)
    np.testing.assert_allclose(m.weight_mean, 4 / ACTION_TOKENS)
    np.testing.assert_allclose(m.rows_masked_frac, 3 / 4)  # of the 4 rows with actions
    # A wider band keeps rows 0 and 2; row 3 stays masked: its mean is undefined.
    w, _ = GEOMASK(old, rollout, mask, low=0.99, high=2.0)
    np.testing.assert_array_equal(w, np.where(mask & (np.arange(5) != 3)[:, None], 1.0, 0.0))


# ------------------------------------------------------------------ every correction

@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_against_the_numpy_reference_on_random_inputs(name):
    fn, reference = CORRECTIONS[name]
    rng = np.random.default_rng(1)
    rollout = rng.normal(-2, 1, (6, 40)).astype(np.float32)
    if name == "geomask":  # rows whose mean log-ratio is 0, +-0.0005 (kept), +-0.002 (masked)
        shift = np.array([0.0, 0.002, -0.002, 0.0005, -0.0005, 0.002])[:, None]
        old = rollout + shift + rng.normal(0, 1e-4, (6, 40))
    else:
        old = rollout + rng.normal(0, 1.0, (6, 40))
    old = old.astype(np.float32)
    mask = rng.random((6, 40)) < 0.7
    w, _ = fn(old, rollout, mask)
    want = reference(old, rollout, mask)
    np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-7)
    assert 0 < np.sum(want) < np.sum(np.exp(np.abs(old - rollout))[mask])  # it corrected
    if name == "geomask":
        np.testing.assert_array_equal(want.any(axis=1), [1, 0, 0, 1, 1, 0])


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_observation_tokens_never_count(name):
    fn, _ = CORRECTIONS[name]
    old, rollout, mask = mismatch_inputs()
    w, m = fn(old, rollout, mask)
    assert np.all(np.asarray(w)[~mask] == 0.0)
    rng = np.random.default_rng(0)
    other_old = np.where(mask, old, rng.normal(0, 30, old.shape)).astype(np.float32)
    other_rollout = np.where(mask, rollout, np.inf).astype(np.float32)
    w2, m2 = fn(other_old, other_rollout, mask)
    np.testing.assert_array_equal(w2, w)
    jax.tree.map(np.testing.assert_array_equal, m2, m)


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_the_weights_are_constants(name):
    fn, _ = CORRECTIONS[name]
    old, rollout, mask = mismatch_inputs()
    d_old, d_rollout = jax.jit(jax.grad(lambda o, r: jnp.sum(fn(o, r, mask)[0]),
                                        argnums=(0, 1)))(old, rollout)
    assert np.all(np.asarray(d_old) == 0.0) and np.all(np.asarray(d_rollout) == 0.0)


def test_extreme_inputs_never_give_nan():
    old, rollout, mask = mismatch_inputs()
    old[0] = [0.0, -1e30, 1e30, -np.inf, np.inf, np.nan]
    rollout[0] = [-1e30, 0.0, -1e30, -np.inf, 0.0, 0.0]
    old[1, :4], rollout[1, :4] = [-80.0, 50.0, 3e38, -3e38], [-120.0, -1.0, -3e38, 3e38]
    mask[0] = True
    for fn, _ in CORRECTIONS.values():
        w, m = fn(old, rollout, mask)
        assert np.all(np.isfinite(w)) and all(np.isfinite(x) for x in m)
        assert np.max(w) <= np.exp(20.0) * (1 + 1e-6)
    # Row 1's log-ratios overflow to +inf and -inf: no mean, so the row is masked, not kept.
    w, m = GEOMASK(old, rollout, mask)
    assert np.all(np.asarray(w)[:2] == 0.0) and float(m.above_frac + m.below_frac) < 1.0


def test_bad_arguments():
    old, rollout, mask = mismatch_inputs()
    with pytest.raises(ValueError, match=r"cap must lie in \[1.0, inf\].*got 0.5"):
        rl.tis_weights(old, rollout, mask, cap=0.5)
    with pytest.raises(ValueError, match=r"low must lie in \[0.0, 1.0\].*got 1.5"):
        rl.icepop_weights(old, rollout, mask, low=1.5)
    with pytest.raises(ValueError, match=r"high must lie in \[1.0, inf\].*got 0.9"):
        rl.geometric_mask_weights(old, rollout, mask, high=0.9)
    with pytest.raises(ValueError, match=r"rollout_logp must have the shape of old_logp"):
        rl.tis_weights(old, rollout[:, :3], mask)
    with pytest.raises(ValueError, match=r"old_logp must have rank 2"):
        rl.icepop_weights(old[0], rollout[0], mask[0])


# ------------------------------------------------------------------ PPO weighted by them

def test_loss_and_gradient_of_each_correction_against_the_reference():
    logp, old, rollout, adv, mask = policy_inputs()
    for name, (fn, reference) in CORRECTIONS.items():
        w, _ = fn(old, rollout, mask)
        np.testing.assert_allclose(w, reference(old, rollout, mask), rtol=1e-5, atol=1e-7)
        loss, grad, d_w = weighted_ppo(logp, old, adv, mask, w)
        want_loss, want_grad = weighted_ppo_reference(logp, old, adv, mask, w)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8, err_msg=name)
        # Exactly zero where the correction masks and off the mask; none reaches the weights.
        assert np.all(np.asarray(grad)[(np.asarray(w) == 0) | ~mask] == 0.0), name
        assert np.all(np.asarray(d_w) == 0.0), name
    # The clip and the weights both bind: TIS at [0, 1] (ratio 3 -> 2, PPO ratio 1.1 unclipped)
    # and the clipped PPO term at [0, 0] (ratio 1.5, A > 0) has no gradient whatever its weight.
    w, _ = TIS(old, rollout, mask)
    _, grad, _ = weighted_ppo(logp, old, adv, mask, w)
    np.testing.assert_allclose(grad[0, 1], -2.0 * 1.1 * adv[0, 1] / ACTION_TOKENS, rtol=1e-5)
    assert grad[0, 0] == 0.0


def test_no_weights_and_unit_weights_are_the_same_loss():
    logp, old, _, adv, mask = policy_inputs()
    loss, grad, _ = weighted_ppo(logp, old, adv, mask, np.ones(logp.shape, np.float32))
    plain = jax.jit(jax.value_and_grad(lambda lp: rl.ppo_clip_loss(lp, old, adv, mask)[0]))
    jax.tree.map(np.testing.assert_array_equal, (loss, grad), plain(logp))
    with pytest.raises(ValueError, match=r"weights must have the shape of logp"):
        rl.ppo_clip_loss(logp, old, adv, mask, weights=np.ones((5, 2), np.float32))
