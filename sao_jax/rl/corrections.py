"""Training-inference mismatch corrections of PPO: per-token weights of its clipped terms.

The engine that sampled a trajectory and the learner that recomputes the policy's log-probs at the
start of a step do not give the same numbers for the same tokens (other kernels, precisions, MoE
routing; here also the versions the policy moved since the engine's weights). A correction turns
the per-token ratio of the two,

    rho_t = exp(old_logp_t - rollout_logp_t)     (old: the learner's pass; rollout: the engine's)

into a weight `w_t` of the token's PPO term (`rl.ppo_clip_loss(..., weights=w)`):

    tis_weights              w_t = min(rho_t, cap)                                   TIS
    icepop_weights           w_t = rho_t if low <= rho_t <= high else 0              IcePop
    geometric_mask_weights   w_t = 1 if low <= exp(mean_{s in row} log rho_s) <= high else 0

The weights are constants of the loss (computed from `sg` of both log-probs) and 0 off the action
mask, so observation tokens never count; a token whose log-ratio is not finite gets weight 0 (and
masks its whole row in the geometric mask, whose mean it would make undefined). Log-ratios are
clamped to +-20 before `exp`, as in `dis_loss`. docs/algorithm.md §5 has the sources and defaults.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sao_jax.kernels import checks
from sao_jax.kernels.dis import MAX_LOG_RATIO


class CorrectionMetrics(NamedTuple):
    """What a correction did to a batch: float32 scalars.

    below_frac, above_frac: shares of action tokens whose ratio (the token's, or its row's
      geometric mean in the geometric mask) lay below / above the correction's band or cap, so
      that their weight is 0 (masked) or, above TIS's cap, the cap (truncated). TIS has no lower
      bound: its `below_frac` is 0.
    weight_mean: the mean weight over action tokens (1 where nothing was corrected).
    rows_masked_frac: share of rows with action tokens none of which keeps a weight: the
      sequences the geometric mask rejects, rarely any for a token-level correction.
    """

    below_frac: jax.Array
    above_frac: jax.Array
    weight_mean: jax.Array
    rows_masked_frac: jax.Array


def tis_weights(old_logp: jax.Array, rollout_logp: jax.Array, action_mask: jax.Array, *,
                cap: float = 2.0) -> tuple[jax.Array, CorrectionMetrics]:
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training"): each token's PPO term weighted by its engine-to-learner
    ratio, truncated from above.

        w_t = min(rho_t, cap)

    Args:
      old_logp: `[B, T]` the policy's log-probs recomputed by the learner at the start of the step.
      rollout_logp: `[B, T]` the engine's log-probs of the same tokens when it sampled them.
      action_mask: `[B, T]` true on action tokens.
      cap: C >= 1 (the source's default, and verl's `rollout_is_threshold`: 2).

    Returns:
      `(weights [B, T], CorrectionMetrics)`; `above_frac` is the share truncated.
    """
    checks.check_in_range("cap", cap, 1.0, float("inf"))
    rho, valid = _ratios(old_logp, rollout_logp, action_mask)
    weights = jnp.where(valid, jnp.minimum(rho, cap), 0.0)
    return weights, _metrics(weights, jnp.zeros_like(valid), valid & (rho > cap), action_mask)


def icepop_weights(old_logp: jax.Array, rollout_logp: jax.Array, action_mask: jax.Array, *,
                   low: float = 0.5, high: float = 5.0) -> tuple[jax.Array, CorrectionMetrics]:
    """IcePop (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for
    Trillion-Scale Thinking Model", Ring-1T): the ratio as the token's weight inside the band
    `[low, high]` (the paper's `[alpha, beta]`), and the token masked outside it.

        w_t = rho_t * 1[low <= rho_t <= high]

    Args:
      old_logp, rollout_logp, action_mask: as `tis_weights`.
      low, high: the band, `0 <= low <= 1 <= high` (defaults 0.5 and 5, as verl's
        `decoupled_token_icepop`).

    Returns:
      `(weights [B, T], CorrectionMetrics)`: `below_frac`, `above_frac` the tokens masked.
    """
    _check_band(low, high)
    rho, valid = _ratios(old_logp, rollout_logp, action_mask)
    below, above = valid & (rho < low), valid & (rho > high)
    weights = jnp.where(valid & ~below & ~above, rho, 0.0)
    return weights, _metrics(weights, below, above, action_mask)


def geometric_mask_weights(old_logp: jax.Array, rollout_logp: jax.Array,
                           action_mask: jax.Array, *, low: float = 0.999,
                           high: float = 1.001) -> tuple[jax.Array, CorrectionMetrics]:
    """Geometric sequence mask (the geometric-mean rejection of Liu, Li et al. 2025, "When Speed
    Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"; verl's
    rollout correction `seq_mean_k1`, preset `decoupled_geo_rs`): a row keeps all its action
    tokens at weight 1 when the geometric mean of its tokens' ratios lies in `[low, high]`, and
    is masked whole otherwise.

        g_b = exp( sum_t m_bt log rho_bt / sum_t m_bt )
        w_bt = m_bt * 1[low <= g_b <= high]

    The mean runs over the row's action tokens only; a row with a non-finite log-prob on one of
    them (or whose mean is not finite) is masked, its mean being undefined, and counted in
    neither fraction.

    Args:
      old_logp, rollout_logp, action_mask: as `tis_weights`.
      low, high: the band, `0 <= low <= 1 <= high` (defaults 0.999 and 1.001, verl's
        `decoupled_geo_rs`: a mean deviation of 0.1% per token).

    Returns:
      `(weights [B, T], CorrectionMetrics)`: `below_frac`, `above_frac` the tokens of masked
      rows, `rows_masked_frac` the rows.
    """
    _check_band(low, high)
    m = jnp.asarray(action_mask) != 0
    log_rho, valid = _log_ratios(old_logp, rollout_logp, m)
    count = jnp.sum(m, axis=1)
    mean = jnp.sum(log_rho, axis=1) / jnp.maximum(count, 1)
    # a row with a non-finite pair, or whose sum overflowed both ways, has no mean to test
    row_finite = (jnp.sum(valid, axis=1) == count) & jnp.isfinite(mean)
    g = jnp.exp(jnp.clip(mean, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    below_b, above_b = row_finite & (g < low), row_finite & (g > high)
    keep_b = row_finite & ~below_b & ~above_b
    weights = jnp.where(m & keep_b[:, None], 1.0, 0.0)
    return weights, _metrics(weights, m & below_b[:, None], m & above_b[:, None], m)


def _check_band(low: float, high: float) -> None:
    checks.check_in_range("low", low, 0.0, 1.0)
    checks.check_in_range("high", high, 1.0, float("inf"))


def _log_ratios(old_logp, rollout_logp, m):
    """`(log rho [B, T], valid [B, T])`: the log-ratio of sg(old_logp) to sg(rollout_logp) where
    both are finite on an action token (0 elsewhere), and where that is."""
    checks.check_rank("old_logp", old_logp, 2, checks.TOKENS_BxT)
    checks.check_same_shape("rollout_logp", rollout_logp, "old_logp", old_logp)
    checks.check_same_shape("action_mask", m, "old_logp", old_logp)
    old = jax.lax.stop_gradient(jnp.asarray(old_logp, jnp.float32))
    rollout = jax.lax.stop_gradient(jnp.asarray(rollout_logp, jnp.float32))
    valid = m & jnp.isfinite(old) & jnp.isfinite(rollout)
    # non-finite entries are replaced before the subtraction: no inf - inf, no NaN anywhere
    diff = jnp.where(valid, old, 0.0) - jnp.where(valid, rollout, 0.0)
    return diff, valid


def _ratios(old_logp, rollout_logp, action_mask):
    """`(rho [B, T], valid [B, T])`: the clamped token ratios (1 where not valid)."""
    log_rho, valid = _log_ratios(old_logp, rollout_logp, jnp.asarray(action_mask) != 0)
    return jnp.exp(jnp.clip(log_rho, -MAX_LOG_RATIO, MAX_LOG_RATIO)), valid


def _metrics(weights, below, above, action_mask) -> CorrectionMetrics:
    m = jnp.asarray(action_mask) != 0
    tokens = jnp.maximum(jnp.sum(m), 1)
    has_actions = jnp.any(m, axis=1)
    masked_rows = has_actions & ~jnp.any(m & (weights != 0), axis=1)
    return CorrectionMetrics(
        below_frac=(jnp.sum(below & m) / tokens).astype(jnp.float32),
        above_frac=(jnp.sum(above & m) / tokens).astype(jnp.float32),
        weight_mean=(jnp.sum(jnp.where(m, weights, 0.0)) / tokens).astype(jnp.float32),
        rows_masked_frac=(jnp.sum(masked_rows) / jnp.maximum(jnp.sum(has_actions), 1)
                          ).astype(jnp.float32),
    )
