"""Masked statistics, explained variance, loss aggregation, GRPO and running-mean baselines."""

import jax
import jax.numpy as jnp
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


def test_aggregate_loss_modes():
    per_token = np.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
    np.testing.assert_allclose(rl.aggregate_loss(per_token, mask), 10.0 / 4)
    np.testing.assert_allclose(rl.aggregate_loss(per_token, mask, "seq-mean-token-sum"), 5.0)
    np.testing.assert_allclose(rl.aggregate_loss(per_token, mask, "seq-mean-token-mean"), 3.0)
    np.testing.assert_allclose(rl.aggregate_loss(per_token, mask, normalizer=10.0), 1.0)
    with pytest.raises(ValueError, match="mode must be one of"):
        rl.aggregate_loss(per_token, mask, "mean")


def test_grpo_advantages():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
    adv = rl.grpo_advantages(rewards)
    std = np.std([1, 0, 0, 1], ddof=1)
    np.testing.assert_allclose(adv[0], np.array([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(adv[1], 0.0)
    with pytest.raises(ValueError, match=r"G >= 2 rollouts per prompt"):
        rl.grpo_advantages(rewards[:, :1])
    with pytest.raises(ValueError, match=r"rewards must have rank 2"):
        rl.grpo_advantages(rewards[0])


def test_running_mean_per_prompt_window():
    state = rl.running_mean_init(num_prompts=3, window=2)
    adv, state = rl.running_mean_advantages(state, jnp.array([1.0, 0.0]), jnp.array([0, 1]))
    np.testing.assert_allclose(adv, [1.0, 0.0])  # empty windows: baseline 0
    adv, state = rl.running_mean_advantages(state, jnp.array([0.0, 1.0]), jnp.array([0, 0]))
    np.testing.assert_allclose(adv, [-1.0, 0.0])  # both see the window [1.0]
    # Slot 0 saw 1, 0, 1: its window of 2 holds the last two, 0 and 1.
    adv, state = rl.running_mean_advantages(state, jnp.array([1.0]), jnp.array([0]))
    np.testing.assert_allclose(adv, [0.5])


def test_running_mean_many_rewards_of_one_slot_in_a_batch_keep_the_last():
    state = rl.running_mean_init(num_prompts=2, window=3)
    rewards = jnp.arange(7, dtype=jnp.float32)
    _, state = rl.running_mean_advantages(state, rewards, jnp.zeros(7, jnp.int32))
    assert int(state.count[0]) == 7
    assert sorted(np.asarray(state.rewards[0]).tolist()) == [4.0, 5.0, 6.0]
    adv, _ = rl.running_mean_advantages(state, jnp.array([5.0]), jnp.array([0]))
    np.testing.assert_allclose(adv, [0.0])


def test_running_mean_state_round_trips_through_numpy_and_jit():
    state = rl.running_mean_init(num_prompts=4, window=8)
    rng = np.random.default_rng(1)
    step = jax.jit(rl.running_mean_advantages)
    for _ in range(5):
        _, state = step(state, jnp.asarray(rng.normal(size=6), jnp.float32),
                        jnp.asarray(rng.integers(0, 4, size=6), jnp.int32))
    saved = {k: np.asarray(v) for k, v in state._asdict().items()}
    restored = rl.RunningMeanState(**{k: jnp.asarray(v) for k, v in saved.items()})
    rewards, slots = jnp.array([0.3, -0.2]), jnp.array([1, 3])
    np.testing.assert_array_equal(step(state, rewards, slots)[0], step(restored, rewards, slots)[0])


def test_running_mean_global_window():
    state = rl.running_mean_init(num_prompts=1, window=128)
    _, state = rl.running_mean_advantages(state, jnp.array([1.0, 3.0]))
    adv, _ = rl.running_mean_advantages(state, jnp.array([2.0]))
    np.testing.assert_allclose(adv, [0.0])


def test_running_mean_bad_slot():
    state = rl.running_mean_init(num_prompts=2)
    with pytest.raises(ValueError, match=r"prompt_index must lie in \[0, 1\]"):
        rl.running_mean_advantages(state, jnp.array([1.0]), jnp.array([2]))
