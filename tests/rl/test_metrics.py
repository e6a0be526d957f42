"""`rl.metrics`: masked statistics, explained variance, loss aggregation."""

import jax
import numpy as np
import pytest

from sao_jax import rl


def test_masked_statistics_ignore_off_mask_entries_even_nan():
    x = np.array([[1.0, 2.0, np.nan], [3.0, np.inf, 6.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 1]], bool)
    np.testing.assert_allclose(rl.masked_sum(x, mask), 12.0)
    np.testing.assert_allclose(rl.masked_mean(x, mask), 3.0)
    np.testing.assert_allclose(rl.masked_mean(x, mask, axis=1), [1.5, 4.5])
    np.testing.assert_allclose(rl.masked_var(x, mask), np.var([1, 2, 3, 6]))
    np.testing.assert_allclose(rl.masked_var(x, mask, unbiased=True), np.var([1, 2, 3, 6], ddof=1),
                               rtol=1e-6)
    np.testing.assert_allclose(rl.masked_mean(x, np.zeros_like(mask)), 0.0)


def test_masked_whiten():
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, size=(4, 50)).astype(np.float32)
    mask = rng.random((4, 50)) < 0.6
    w = np.asarray(rl.masked_whiten(x, mask))
    np.testing.assert_allclose(w[mask].mean(), 0.0, atol=1e-5)
    np.testing.assert_allclose(w[mask].std(), 1.0, rtol=1e-4)
    assert np.all(w[~mask] == 0)
    scaled = np.asarray(rl.masked_whiten(x, mask, shift_mean=False))
    np.testing.assert_allclose(scaled[mask].mean(), x[mask].mean(), rtol=1e-4)


def test_explained_variance():
    returns = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    mask = np.array([[1, 1, 1, 0]], bool)
    np.testing.assert_allclose(rl.explained_variance(returns, returns, mask), 1.0)
    const = np.full_like(returns, 2.0)
    np.testing.assert_allclose(rl.explained_variance(const, returns, mask), 0.0, atol=1e-6)
    noisy = returns + np.array([[0.5, -0.5, 0.5, 100.0]], np.float32)
    # Var(R) = 2/3 over three tokens; Var(R - V) = Var([-0.5, 0.5, -0.5]) = 2/9.
    np.testing.assert_allclose(rl.explained_variance(noisy, returns, mask), 1 - (2 / 9) / (2 / 3),
                               rtol=1e-5)
    flat = np.ones((1, 4), np.float32)
    np.testing.assert_allclose(rl.explained_variance(flat, flat, mask), 1.0)
    # Constant returns: 1 if the error is constant too (as scikit-learn), else 0.
    np.testing.assert_allclose(rl.explained_variance(flat * 2, flat, mask), 1.0)
    np.testing.assert_allclose(rl.explained_variance(returns, flat, mask), 0.0)


def test_aggregate_loss_is_a_token_mean():
    per_token = np.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
    np.testing.assert_allclose(rl.aggregate_loss(per_token, mask), 10.0 / 4)
    np.testing.assert_allclose(rl.aggregate_loss(per_token, mask, normalizer=10.0), 1.0)
    np.testing.assert_allclose(rl.aggregate_loss(per_token, mask & False), 0.0)


def test_logp_gap_hand_computed():
    # Gaps 0, 1, ..., 100 on the mask: NumPy's linear quantile at 0.99 sits at position 99.
    logp = np.arange(102, dtype=np.float32)[None]
    mask = np.ones_like(logp, bool)
    mask[0, -1] = False  # a gap of 101 off the mask
    gap = rl.logp_gap(logp, np.zeros_like(logp), mask)
    assert (float(gap.mean), float(gap.p99), float(gap.max)) == (50.0, 99.0, 100.0)


@pytest.mark.parametrize("jit", [False, True])
def test_logp_gap_is_numpys_over_the_finite_action_tokens(jit):
    """Mean, 0.99 quantile and max of |logp - rollout_logp| as NumPy computes them over the
    action tokens where both are finite: masked tokens (set far off here) and non-finite pairs
    do not count, and the mean is the DIS metric `logp_mismatch`."""
    rng = np.random.default_rng(0)
    logp = rng.normal(-2.0, 1.0, (6, 40)).astype(np.float32)
    rollout_logp = (logp + 0.01 * rng.standard_t(2, logp.shape)).astype(np.float32)  # a tail
    mask = rng.random(logp.shape) < 0.7
    rollout_logp[~mask] = 50.0
    logp[0, :3], rollout_logp[1, :2] = [np.nan, -np.inf, np.inf], [np.nan, -np.inf]
    mask[:2, :3] = True
    fn = jax.jit(rl.logp_gap) if jit else rl.logp_gap
    got = fn(logp, rollout_logp, mask)
    valid = mask & np.isfinite(logp) & np.isfinite(rollout_logp)
    gap = np.abs(logp - rollout_logp)[valid]
    np.testing.assert_allclose(got.mean, gap.mean(), rtol=1e-5)
    np.testing.assert_allclose(got.p99, np.quantile(gap, 0.99), rtol=1e-6)
    np.testing.assert_allclose(got.max, gap.max(), rtol=1e-6)
    assert got.p99 < got.max and all(x.dtype == np.float32 for x in got)
    _, dis = rl.dis_loss(logp, rollout_logp, np.zeros_like(logp), mask, eps_low=0.3,
                         eps_high=5.0)
    np.testing.assert_allclose(got.mean, dis.logp_mismatch, rtol=1e-6)
    # No action token, or no entry at all: zeros, not NaN.
    for args in ((logp, rollout_logp, np.zeros_like(mask)), (logp[:0], logp[:0], mask[:0])):
        assert [float(x) for x in fn(*args)] == [0.0, 0.0, 0.0]


def test_routing_split_hand_computed():
    """Same-routed, re-routed and unreported action tokens: the share counts the reported ones,
    each mean its own side; a side without tokens is NaN."""
    logp = np.array([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]], np.float32)
    rollout = np.zeros_like(logp)
    mask = np.array([[True, True, True, True, True, False]])
    routed = np.array([[1, 1, 0, -1, 1, 0]], np.float32)  # the last is off the mask
    split = jax.jit(rl.routing_split)(logp, rollout, mask, routed)
    np.testing.assert_allclose(split.same_frac, 3 / 4)
    np.testing.assert_allclose(split.mean_same, (0.1 + 0.2 + 0.5) / 3, rtol=1e-6)
    np.testing.assert_allclose(split.mean_different, 0.3, rtol=1e-6)
    none = rl.routing_split(logp, rollout, mask, np.ones_like(routed))
    assert float(none.same_frac) == 1.0 and np.isnan(none.mean_different)
    with pytest.raises(ValueError, match="routed_same"):
        rl.routing_split(logp, rollout, mask, routed[:, :3])


def test_logp_gap_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="rollout_logp"):
        rl.logp_gap(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3), bool))
