"""Tests of the DIS, PPO and value losses: hand-computed values, analytic gradients, extremes."""

from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax import rl
from tests.rl.loss_inputs import BAND, dis_inputs


class DisLossTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_computed_value_and_metrics(self):
        logp, rollout, adv, mask = dis_inputs()
        loss, m = self.variant(lambda *a: rl.dis_loss(*a, **BAND))(logp, rollout, adv, mask)
        # In band: (0,0) r=1 A=1; (0,2) r=2 A=0.5; (1,0) r=1.2 A=-2. Seven action tokens.
        want = -(1.0 * 1.0 + 2.0 * 0.5 + 1.2 * -2.0) / 7
        np.testing.assert_allclose(loss, want, rtol=1e-6)
        np.testing.assert_allclose(m.below_band_frac, 1 / 7, rtol=1e-6)
        np.testing.assert_allclose(m.above_band_frac, 1 / 7, rtol=1e-6)
        np.testing.assert_allclose(m.nonfinite_frac, 2 / 7, rtol=1e-6)
        ratios = np.array([1.0, 0.5, 2.0, 7.0, 1.2])
        np.testing.assert_allclose(m.ratio_mean, ratios.mean(), rtol=1e-5)
        np.testing.assert_allclose(m.logp_mismatch, np.abs(np.log(ratios)).mean(), rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gradient_is_reinforce_weighted_by_in_band_ratio(self):
        logp, rollout, adv, mask = dis_inputs()
        grad = self.variant(jax.grad(lambda lp: rl.dis_loss(lp, rollout, adv, mask, **BAND)[0]))(
            logp)
        ratio = np.exp(np.nan_to_num(logp.astype(np.float64) - rollout, nan=0.0, neginf=0.0))
        band = (ratio >= 0.7) & (ratio <= 6.0) & np.isfinite(logp) & mask
        want = np.where(band, -ratio * adv / mask.sum(), 0.0)
        np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)
        # Exactly zero (not merely small) off the band, off the mask and on non-finite pairs.
        assert np.all(np.asarray(grad)[~band] == 0.0)
        assert np.all(np.isfinite(grad))

    def test_advantages_are_constants_in_both_implementations(self):
        """One choice, `sg(A)`: the loss passes no gradient to what computed the advantages
        (the pure-JAX reference and the Pallas kernels agree)."""
        logp, rollout, adv, mask = dis_inputs()
        for name, loss in (("xla", partial(rl.dis_loss, impl="xla", **BAND)),
                           ("pallas", partial(rl.dis_loss, impl="pallas", **BAND))):
            d_adv = jax.grad(lambda a, loss=loss: loss(logp, rollout, a, mask)[0])(adv)
            assert np.all(np.asarray(d_adv) == 0.0), name

    def test_in_band_denominator_and_normalizer(self):
        logp, rollout, adv, mask = dis_inputs()
        loss_all, _ = rl.dis_loss(logp, rollout, adv, mask, **BAND)
        loss_band, _ = rl.dis_loss(logp, rollout, adv, mask, denominator="in_band_tokens", **BAND)
        np.testing.assert_allclose(loss_band, loss_all * 7 / 3, rtol=1e-6)
        loss_norm, _ = rl.dis_loss(logp, rollout, adv, mask, normalizer=14.0, **BAND)
        np.testing.assert_allclose(loss_norm, loss_all / 2, rtol=1e-6)

    def test_micro_batches_with_batch_normalizer_sum_to_full_batch_gradient(self):
        rng = np.random.default_rng(0)
        logp = rng.normal(-2, 0.3, size=(6, 20)).astype(np.float32)
        rollout = (logp + rng.normal(0, 0.3, size=(6, 20))).astype(np.float32)
        adv = rng.normal(size=(6, 20)).astype(np.float32)
        mask = rng.random((6, 20)) < 0.7
        loss_fn = lambda lp, sl, n=None: rl.dis_loss(lp, rollout[sl], adv[sl], mask[sl],
                                                     normalizer=n, **BAND)[0]
        full = jax.grad(loss_fn)(logp, slice(None))
        n = mask.sum()
        parts = [jax.grad(loss_fn)(logp[sl], sl, n) for sl in (slice(0, 2), slice(2, 6))]
        np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-6, atol=1e-8)

    def test_extreme_inputs_never_give_nan(self):
        logp = np.array([[0.0, -1e30, 1e30, -np.inf, np.inf, np.nan, -80.0, 50.0]], np.float32)
        rollout = np.array([[-1e30, 0.0, -1e30, -np.inf, 0.0, 0.0, -120.0, -1.0]], np.float32)
        adv = np.full((1, 8), 1e6, np.float32)
        mask = np.ones((1, 8), bool)
        for eps_low, eps_high in ((0.3, 5.0), (1.0, 1e12)):
            fn = lambda lp, lo=eps_low, hi=eps_high: rl.dis_loss(lp, rollout, adv, mask,
                                                                 eps_low=lo, eps_high=hi)
            (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(logp)
            assert np.isfinite(loss)
            assert np.all(np.isfinite(grad))
            assert all(np.isfinite(x) for x in metrics)
        # With no band at all, clamped ratios still weight finite tokens: exp(20) at most.
        assert np.abs(np.asarray(grad)).max() <= np.exp(20.0) * 1e6 / 8 * (1 + 1e-6)

    def test_loss_value_is_exact_for_huge_log_probs(self):
        # The surrogate's value must be the weight itself: 1 + logp - logp is 0 for logp = 1e30.
        logp = np.array([[1e30, -1.0]], np.float32)
        rollout = np.array([[-1e30, -1.0]], np.float32)
        loss, _ = rl.dis_loss(logp, rollout, np.ones((1, 2), np.float32), np.ones((1, 2), bool),
                              eps_low=1.0, eps_high=1e12)
        np.testing.assert_allclose(loss, -(np.exp(np.float32(20.0)) + 1.0) / 2, rtol=1e-6)

    def test_bad_arguments(self):
        logp, rollout, adv, mask = dis_inputs()
        with pytest.raises(ValueError, match=r"eps_low must lie in \[0.0, 1.0\].*got 1.5"):
            rl.dis_loss(logp, rollout, adv, mask, eps_low=1.5, eps_high=1.0)
        with pytest.raises(ValueError, match=r"eps_high must lie in \[0.0, inf\].*got -0.1"):
            rl.dis_loss(logp, rollout, adv, mask, eps_low=0.2, eps_high=-0.1)
        with pytest.raises(ValueError, match=r"rollout_logp must have the shape of logp \(2, 4\)"):
            rl.dis_loss(logp, rollout[:, :3], adv, mask, **BAND)
        with pytest.raises(ValueError, match=r"logp must have rank 2"):
            rl.dis_loss(logp[0], rollout[0], adv[0], mask[0], **BAND)
        with pytest.raises(ValueError, match=r"denominator must be one of"):
            rl.dis_loss(logp, rollout, adv, mask, denominator="tokens", **BAND)
        with pytest.raises(ValueError, match=r"impl must be one of"):
            rl.dis_loss(logp, rollout, adv, mask, impl="triton", **BAND)


class PpoLossTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_clip_higher_value_and_gradient(self):
        old = np.zeros((1, 4), np.float32)
        # Ratios 1.1 (inside), 1.5 with A>0 (clipped at 1.28), 0.5 with A<0 (clipped at 0.8),
        # 0.5 with A>0 (unclipped: min picks the smaller, unclipped term).
        logp = np.log(np.array([[1.1, 1.5, 0.5, 0.5]], np.float32))
        adv = np.array([[1.0, 1.0, -1.0, 1.0]], np.float32)
        mask = np.ones((1, 4), bool)
        fn = self.variant(lambda lp: rl.ppo_clip_loss(lp, old, adv, mask))
        loss, metrics = fn(logp)
        want = -(1.1 + 1.28 - 0.8 + 0.5) / 4
        np.testing.assert_allclose(loss, want, rtol=1e-6)
        np.testing.assert_allclose(metrics.clip_frac, 0.5)
        grad = jax.grad(lambda lp: rl.ppo_clip_loss(lp, old, adv, mask)[0])(logp)
        np.testing.assert_allclose(grad, [[-1.1 / 4, 0.0, 0.0, -0.5 / 4]], rtol=1e-6)

    def test_the_loss_is_a_mean_over_action_tokens_not_rows(self):
        logp = np.zeros((2, 3), np.float32)
        adv = np.array([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]], np.float32)
        mask = np.array([[1, 1, 1], [1, 0, 0]], bool)
        loss, _ = rl.ppo_clip_loss(logp, logp, adv, mask)
        np.testing.assert_allclose(loss, -(3 * 1.0 + 4.0) / 4)


class ValueLossTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_mse_and_clipping(self):
        values = np.array([[1.0, 2.0, 5.0]], np.float32)
        returns = np.array([[0.0, 2.0, 1.0]], np.float32)
        mask = np.array([[1, 1, 0]], bool)
        loss, _ = self.variant(lambda v: rl.value_loss(v, returns, mask))(values)
        np.testing.assert_allclose(loss, 0.5 * (1.0 + 0.0) / 2)
        old = np.array([[0.5, 2.0, 5.0]], np.float32)
        # Clipped V for token 0 is 0.5 + 0.2 = 0.7, error 0.49 < 1: the unclipped error stays.
        loss_c, metrics = rl.value_loss(values, returns, mask, old_values=old, clip=0.2)
        np.testing.assert_allclose(loss_c, loss)
        old = np.array([[3.0, 2.0, 5.0]], np.float32)  # clipped V = 2.8: error 7.84 > 1
        loss_c, metrics = rl.value_loss(values, returns, mask, old_values=old, clip=0.2)
        np.testing.assert_allclose(loss_c, 0.5 * (2.8**2 + 0.0) / 2, rtol=1e-6)
        np.testing.assert_allclose(metrics.clip_frac, 0.5)

    def test_gradient_and_arguments(self):
        values = jnp.array([[1.0, 3.0]])
        grad = jax.grad(lambda v: rl.value_loss(v, jnp.zeros((1, 2)), jnp.ones((1, 2), bool))[0])(
            values)
        np.testing.assert_allclose(grad, [[0.5, 1.5]])
        with pytest.raises(ValueError, match="value clipping needs both"):
            rl.value_loss(values, values, values > 0, clip=0.2)


def test_positive_example_lm_loss_is_the_nll_of_successful_rows_only():
    logp = jnp.log(jnp.array([[0.5, 0.25, 0.9], [0.1, 0.2, 0.3], [0.4, 0.4, 0.4]]))
    mask = jnp.array([[1, 1, 0], [1, 1, 1], [0, 1, 1]], bool)
    outcome = jnp.array([1.0, 0.0, 2.0])  # row 1 failed: not imitated
    want = -(np.log(0.5) + np.log(0.25) + 2 * np.log(0.4)) / 4
    np.testing.assert_allclose(rl.positive_example_lm_loss(logp, mask, outcome), want, rtol=1e-6)
    grad = jax.grad(lambda x: rl.positive_example_lm_loss(x, mask, outcome))(logp)
    np.testing.assert_allclose(grad, -np.array([[1, 1, 0], [0, 0, 0], [0, 1, 1]]) / 4)
    assert float(rl.positive_example_lm_loss(logp, mask, jnp.zeros(3))) == 0.0
    with pytest.raises(ValueError, match="outcome must have shape"):
        rl.positive_example_lm_loss(logp, mask, jnp.zeros(2))
