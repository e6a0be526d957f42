"""`rl.metrics`: masked statistics, explained variance, loss aggregation."""

import numpy as np

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
