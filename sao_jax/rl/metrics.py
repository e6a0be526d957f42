"""Masked statistics, loss aggregation and explained variance over `[B, T]` token arrays.

A mask selects the tokens that count (usually the action mask). Every function is NaN-free on an
empty mask: sums are 0, means are 0, and a row without selected tokens drops out of row averages.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sao_jax.kernels import checks


def masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Sum of `x` where `mask` is true (entries off the mask may be anything, even NaN)."""
    return jnp.sum(jnp.where(jnp.asarray(mask, bool), x, 0.0), axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Mean of `x` over `mask`; 0 where the mask selects nothing."""
    count = jnp.sum(jnp.asarray(mask, bool), axis=axis)
    return masked_sum(x, mask, axis) / jnp.maximum(count, 1)


def masked_var(x: jax.Array, mask: jax.Array, *, unbiased: bool = False) -> jax.Array:
    """Variance of `x` over all selected entries (population variance unless `unbiased`)."""
    mean = masked_mean(x, mask)
    count = jnp.sum(jnp.asarray(mask, bool))
    sq = masked_sum(jnp.square(x - mean), mask)
    return sq / jnp.maximum(count - 1 if unbiased else count, 1)


def masked_whiten(x: jax.Array, mask: jax.Array, *, shift_mean: bool = True,
                  eps: float = 1e-8) -> jax.Array:
    """`(x - mean) / sqrt(var + eps)` over the selected entries; 0 off the mask.

    With `shift_mean=False` the mean is added back (scale only), as some PPO codebases whiten.
    """
    checks.check_same_shape("mask", mask, "x", x)
    mean = masked_mean(x, mask)
    whitened = (x - mean) * jax.lax.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(jnp.asarray(mask, bool), whitened, 0.0)


def explained_variance(values: jax.Array, returns: jax.Array, action_mask: jax.Array) -> jax.Array:
    """Explained variance of the critic, `1 - Var(R - V) / Var(R)`, over action tokens.

    1 is a perfect critic (up to a constant offset), 0 no better than a constant, negative worse
    than one. When the returns do not vary (Var(R) = 0) the answer is 1 if R - V does not vary
    either and 0 otherwise (as scikit-learn's `explained_variance_score`).

    Args:
      values: `[B, T]` V before the critic update.
      returns: `[B, T]` value targets R.
      action_mask: `[B, T]` tokens that count.

    Returns:
      A float32 scalar.
    """
    checks.check_rank("values", values, 2, "[B, T]")
    checks.check_same_shape("returns", returns, "values", values)
    checks.check_same_shape("action_mask", action_mask, "values", values)
    var_r = masked_var(returns, action_mask)
    var_err = masked_var(returns - values, action_mask)
    safe = jnp.where(var_r > 0, var_r, 1.0)
    return jnp.where(var_r > 0, 1.0 - var_err / safe, jnp.where(var_err > 0, 0.0, 1.0))


def aggregate_loss(per_token: jax.Array, mask: jax.Array, *,
                   normalizer: jax.Array | float | None = None) -> jax.Array:
    """Reduces a `[B, T]` per-token loss to a scalar: the sum over selected tokens divided by
    their number (DAPO's token-level loss). Every algorithm here uses it, `grpo` too, as the
    clip-higher recipe does, not GRPO's original per-sequence mean:
    docs/algorithm.md, "Each baseline against its source".
    `normalizer` replaces the count, e.g. the action-token count of the whole batch when this is
    one micro-batch of it."""
    checks.check_rank("per_token", per_token, 2, "[B, T]")
    checks.check_same_shape("mask", mask, "per_token", per_token)
    total = masked_sum(per_token, mask)
    count = jnp.sum(jnp.asarray(mask, bool)) if normalizer is None else normalizer
    return total / jnp.maximum(count, 1)


GAP_QUANTILE = 0.99  # LogpGap.p99


class LogpGap(NamedTuple):
    """The training-inference gap `|logp - rollout_logp|` per action token, summarised: float32
    scalars over the action tokens where both log-probs are finite (0 where there are none)."""

    mean: jax.Array  # equals `DisMetrics.logp_mismatch` of the same arrays
    p99: jax.Array  # the 0.99 quantile, interpolated linearly (NumPy's default method)
    max: jax.Array


def logp_gap(logp: jax.Array, rollout_logp: jax.Array, action_mask: jax.Array) -> LogpGap:
    """The distribution of `|logp_t - rollout_logp_t|` over the action tokens: its mean, 0.99
    quantile and maximum (docs/algorithm.md, "The training-inference gap").

    The mean says how far the learner's and the engine's log-probs drift on the whole; the tail
    says whether a few tokens (a flipped MoE route, a bf16 rounding at a near-tie) drift far, and
    those are the tokens a ratio-based correction cuts. The quantile sorts the `B * T` entries
    once on the device.

    Args:
      logp: `[B, T]` the learner's log-probs of the tokens.
      rollout_logp: `[B, T]` the engine's log-probs of the same tokens.
      action_mask: `[B, T]` the tokens that count; a pair where either log-prob is inf or NaN
        does not count (the DIS metrics count it in `nonfinite_frac`).

    Returns:
      A `LogpGap` of float32 scalars.
    """
    checks.check_rank("logp", logp, 2, "[B, T]")
    checks.check_same_shape("rollout_logp", rollout_logp, "logp", logp)
    checks.check_same_shape("action_mask", action_mask, "logp", logp)
    logp = jnp.asarray(logp, jnp.float32)
    rollout_logp = jnp.asarray(rollout_logp, jnp.float32)
    valid = jnp.asarray(action_mask, bool) & jnp.isfinite(logp) & jnp.isfinite(rollout_logp)
    gap = jnp.where(valid, jnp.abs(logp - rollout_logp), 0.0)
    if gap.size == 0:  # no entry to take a quantile of
        return LogpGap(*(jnp.zeros((), jnp.float32),) * 3)
    p99 = jnp.nanquantile(jnp.where(valid, gap, jnp.nan), GAP_QUANTILE)  # NaN: not counted
    return LogpGap(mean=masked_mean(gap, valid), p99=jnp.where(jnp.any(valid), p99, 0.0),
                   max=jnp.max(gap))


class RoutingSplit(NamedTuple):
    """The training-inference gap split by routing (`routing_split`): float32 scalars."""

    same_frac: jax.Array  # the share of reported action tokens routed as the engine routed them
    mean_same: jax.Array  # the mean gap over those; NaN where there are none
    mean_different: jax.Array  # over the reported action tokens routed otherwise; NaN: none


def routing_split(logp: jax.Array, rollout_logp: jax.Array, action_mask: jax.Array,
                  routed_same: jax.Array) -> RoutingSplit:
    """How often the learner routed an action token as the engine did, and the mean gap
    `|logp - rollout_logp|` on either side (docs/algorithm.md, "The training-inference gap").

    In a model with experts a token whose experts differ between the two sides has a far larger
    gap than one whose experts agree; this says how much of the gap re-routing explains, and
    how often routing replay overrides the learner's router.

    Args:
      logp, rollout_logp, action_mask: as in `logp_gap`.
      routed_same: `[B, T]` per token, 1 where the learner chose the engine's experts at every
        layer, 0 where it did not, -1 where the engine did not report them (not counted):
        `models.route_agreement` in the log-probs' layout.

    Returns:
      A `RoutingSplit`.
    """
    checks.check_same_shape("routed_same", routed_same, "logp", logp)
    reported = jnp.asarray(action_mask, bool) & (routed_same >= 0)
    same = reported & (routed_same == 1)

    def mean(tokens):
        return jnp.where(jnp.any(tokens), logp_gap(logp, rollout_logp, tokens).mean, jnp.nan)

    return RoutingSplit(same_frac=jnp.sum(same) / jnp.maximum(jnp.sum(reported), 1),
                        mean_same=mean(same), mean_different=mean(reported & ~same))
