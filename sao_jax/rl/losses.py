"""Policy and value losses: DIS (SAO's), PPO clip-higher, and the critic's squared error.

Each takes per-token arrays `[B, T]` and an action mask and returns `(loss, metrics)`, with metrics
a NamedTuple of float32 scalars. Forward passes stay in the train step: these never call a model.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sao_jax import kernels
from sao_jax.kernels import checks
from sao_jax.kernels.dis import MAX_LOG_RATIO, DisMetrics
from sao_jax.rl.metrics import aggregate_loss, masked_mean

DIS_IMPLS = ("auto", "xla", "pallas")


def dis_loss(
    logp: jax.Array,
    rollout_logp: jax.Array,
    advantages: jax.Array,
    action_mask: jax.Array,
    *,
    eps_low: float,
    eps_high: float,
    denominator: str = "action_tokens",
    normalizer: jax.Array | float | None = None,
    impl: str = "auto",
    sharding: jax.sharding.NamedSharding | None = None,
) -> tuple[jax.Array, DisMetrics]:
    """Direct double-sided importance sampling loss (docs/algorithm.md §1).

    The behaviour policy is the inference engine's own log-prob; there is no old-policy pass:

        r_t    = exp(logp_t - rollout_logp_t)
        band_t = 1[1 - eps_low <= r_t <= 1 + eps_high]         (whatever the sign of A)
        loss   = - sum_t m_t * sg(band_t) * r_t * sg(A_t) / N
        d loss / d logp_t = - m_t * band_t * r_t * A_t / N

    Out-of-band tokens get weight 0 (not a clamped ratio); no min/clip, no KL, no entropy term. N is
    the number of action tokens in the batch, rejected ones included, so rejection never up-weights
    the survivors (`denominator="action_tokens"`); `"in_band_tokens"` divides by the in-band count
    instead. A pair with a non-finite log-prob is out of band with zero gradient; finite log-ratios
    are clamped to +-20 before `exp`. The loss and its gradient are never NaN.

    Args:
      logp: `[B, T]` log pi_theta(token_t | prefix) under the current parameters (differentiable).
      rollout_logp: `[B, T]` the engine's log-prob of the same token when it sampled it, from
        the same distribution as `logp`: the model's own temperature-1 full softmax, whatever
        temperature, top-p or top-k the engine sampled with. The ratio then measures how far the
        policy moved since the engine's weights (staleness) plus the engines' numerical gap, which
        is what DIS bounds; the sampling transform is part of how actions were explored, not of
        the policy trained. (At the paper's temperature 1 and top-p 1 the two coincide.) The
        embedded engine reports this log-prob; SGLang does with
        `SGLANG_RETURN_ORIGINAL_LOGPROB=1`, which `sao_jax.engine.sglang_server` sets (with it
        unset, SGLang reports the log-prob after temperature scaling).
      advantages: `[B, T]` per-token advantages, constants of the loss: `sg(A)`, so that no
        gradient reaches whatever computed them (a critic, say) through the policy loss, in both
        implementations (the one choice; `tests/rl/test_losses.py`).
      action_mask: `[B, T]` true on action tokens.
      eps_low: in [0, 1]; 1 means no lower bound. Reasoning/TIR 0.3, coding/SWE 0.8.
      eps_high: >= 0. Reasoning/TIR 5.0, coding/SWE 3.0.
      denominator: "action_tokens" (default) or "in_band_tokens".
      normalizer: overrides N, e.g. the action-token count of the whole batch when this call sees
        one micro-batch, so accumulated gradients equal the full-batch gradient.
      impl: "xla" (`sao_jax.kernels.dis_loss_reference`, the pure-JAX form: the one statement
        of this loss, which the kernels are tested against), "pallas" (`sao_jax.kernels.dis_loss`:
        one forward kernel writing per-row partial sums, a backward kernel for the gradient;
        Pallas' interpreter on a CPU, for correctness only), "auto" ("pallas" on TPU, "xla" on
        GPU and CPU: `sao_jax.kernels.resolve_impl` says why). The "pallas" VJP treats rollout_logp,
        advantages and normalizer as constants (zero cotangents).
      sharding: the `[B, T]` arrays' row sharding inside a sharded jit, as in `rl.gae`: "pallas"
        runs per shard, for the platform of its devices.

    Returns:
      `(loss, DisMetrics)` (`DisMetrics` is `sao_jax.kernels.DisMetrics`).
    """
    checks.check_choice("impl", impl, DIS_IMPLS)
    kernels.check_dis_args(logp, rollout_logp, advantages, action_mask, eps_low, eps_high,
                           denominator, normalizer)
    args = (logp, rollout_logp, advantages, action_mask)
    kwargs = dict(eps_low=eps_low, eps_high=eps_high, denominator=denominator,
                  normalizer=normalizer)
    if kernels.resolve_impl(impl, sharding) == "pallas":
        return kernels.dis_loss(*args, **kwargs, sharding=sharding)
    return kernels.dis_loss_reference(*args, **kwargs)


class PpoMetrics(NamedTuple):
    clip_frac: jax.Array  # fraction of action tokens whose clipped term was the active one
    approx_kl: jax.Array  # mean (old_logp - logp) over action tokens
    ratio_mean: jax.Array


def ppo_clip_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    action_mask: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    weights: jax.Array | None = None,
) -> tuple[jax.Array, PpoMetrics]:
    """PPO clipped surrogate with DAPO's clip-higher (docs/algorithm.md §1, baselines).

        u_t = exp(logp_t - old_logp_t)
        l_t = - w_t min(u_t A_t, clip(u_t, 1 - clip_low, 1 + clip_high) A_t)

    `old_logp` is the "latest old policy": recomputed by the learner at the start of the step, not
    the engine's log-prob. A token-level mean (`aggregate_loss`) over every action token, those
    of weight 0 included. `w_t` is 1 unless `weights` are given: a training-inference mismatch
    correction's (`rl.tis_weights`, `rl.icepop_weights`, `rl.geometric_mask_weights`).

    Args:
      logp, old_logp, advantages, action_mask: `[B, T]`.
      clip_low: in [0, 1]. clip_high: >= 0.
      weights: `[B, T]` or None; constants of the loss (`sg(w)`): no gradient reaches them.

    Returns:
      `(loss, PpoMetrics)`; the metrics do not depend on `weights`.
    """
    _check_token_arrays("logp", logp, old_logp=old_logp, advantages=advantages,
                        action_mask=action_mask)
    checks.check_in_range("clip_low", clip_low, 0.0, 1.0)
    checks.check_in_range("clip_high", clip_high, 0.0, float("inf"))
    log_ratio = jnp.clip(logp - old_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = jnp.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -jnp.minimum(unclipped, clipped)
    if weights is not None:
        checks.check_same_shape("weights", weights, "logp", logp)
        per_token = per_token * jax.lax.stop_gradient(weights)
    loss = aggregate_loss(per_token, action_mask)
    metrics = PpoMetrics(
        clip_frac=masked_mean(clipped < unclipped, action_mask).astype(jnp.float32),
        approx_kl=masked_mean(old_logp - logp, action_mask),
        ratio_mean=masked_mean(ratio, action_mask),
    )
    return loss, metrics


def positive_example_lm_loss(logp: jax.Array, action_mask: jax.Array,
                             outcome: jax.Array) -> jax.Array:
    """VAPO's positive-example LM loss: the negative log-likelihood of the action tokens of the
    trajectories that succeeded, token-mean over those tokens (0 when none did).

        P     = {b : outcome_b > 0}
        L_lm  = - sum_{b in P, t} m_t logp_t  /  max(sum_{b in P, t} m_t, 1)

    VAPO adds `mu * L_lm` (mu = 0.1) to its PPO loss, so that what the policy already gets right
    is imitated as well as reinforced (`Algorithm.lm_coef`).

    Args:
      logp, action_mask: `[B, T]`. outcome: `[B]`, each trajectory's outcome reward.
    """
    _check_token_arrays("logp", logp, action_mask=action_mask)
    if outcome.shape != logp.shape[:1]:
        raise ValueError(f"outcome must have shape {logp.shape[:1]} (one per row), got "
                         f"{outcome.shape}.")
    positive = jnp.asarray(action_mask, bool) & (outcome > 0)[:, None]
    return -jnp.sum(jnp.where(positive, logp, 0.0)) / jnp.maximum(jnp.sum(positive), 1)


class ValueMetrics(NamedTuple):
    clip_frac: jax.Array  # fraction of action tokens where the clipped error was the larger one
    value_mean: jax.Array
    return_mean: jax.Array


def value_loss(
    values: jax.Array,
    returns: jax.Array,
    action_mask: jax.Array,
    *,
    old_values: jax.Array | None = None,
    clip: float | None = None,
    normalizer: jax.Array | float | None = None,
) -> tuple[jax.Array, ValueMetrics]:
    """Critic loss `0.5 * (V - R)^2`, token-mean over action tokens (docs/algorithm.md §3).

    With `clip` (off by default) and `old_values`, PPO-style value clipping:
    `0.5 * max((V - R)^2, (old_V + clip(V - old_V, -clip, clip) - R)^2)`.

    Args:
      values: `[B, T]` current critic outputs (differentiable).
      returns: `[B, T]` targets (treated as constants).
      action_mask: `[B, T]`.
      old_values: `[B, T]` critic outputs before this update; required with `clip`.
      clip: clipping range > 0, or None.
      normalizer: replaces the action-token count (micro-batching, as in `aggregate_loss`).

    Returns:
      `(loss, ValueMetrics)`.
    """
    _check_token_arrays("values", values, returns=returns, action_mask=action_mask)
    if (clip is None) != (old_values is None):
        given = "given" if old_values is not None else "None"
        raise ValueError("value clipping needs both clip and old_values (or neither), got "
                         f"clip={clip!r} and old_values {given}.")
    returns = jax.lax.stop_gradient(returns)
    err = jnp.square(values - returns)
    clip_frac = jnp.zeros((), jnp.float32)
    if clip is not None:
        checks.check_same_shape("old_values", old_values, "values", values)
        checks.check_in_range("clip", clip, 0.0, float("inf"))
        clipped_v = old_values + jnp.clip(values - old_values, -clip, clip)
        err_clipped = jnp.square(clipped_v - returns)
        clip_frac = masked_mean(err_clipped > err, action_mask).astype(jnp.float32)
        err = jnp.maximum(err, err_clipped)
    loss = 0.5 * aggregate_loss(err, action_mask, normalizer=normalizer)
    metrics = ValueMetrics(
        clip_frac=clip_frac,
        value_mean=masked_mean(values, action_mask),
        return_mean=masked_mean(returns, action_mask),
    )
    return loss, metrics


def _check_token_arrays(first_name: str, first: jax.Array, **others: jax.Array) -> None:
    """`first` is `[B, T]`; every other array has its shape."""
    checks.check_rank(first_name, first, 2, checks.TOKENS_BxT)
    for name, x in others.items():
        checks.check_same_shape(name, x, first_name, first)
