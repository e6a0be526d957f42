"""The learner step's critic phase, then its advantages (docs/algorithm.md §4, steps 1-5).

    phase = critic_phase(critic, critic_opt, batch, config=config, sharding=rows,
                         values_fn=values_fn, update_fn=update_fn)
    values, last = ((phase.values, phase.last_value) if config.reuse_values
                    else values_fn(phase.critic))
    adv, baseline, metrics = advantages(batch, baseline, config=config, sharding=rows,
                                        values=values, last_value=last)

The critic phase reads the critic's values on the batch, computes their targets and makes the K
critic updates; it returns the critic it trained and what it measured, and changes nothing of its
caller's. The advantages are computed apart, from the values the caller passes (the pre-update
ones with `reuse_values`, else the updated critic's), or by the critic-free estimators (GRPO, the
running mean). `steps.Trainer` runs both inside its jitted step and supplies the model passes as
functions, so nothing here holds a model.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sao_jax import rl
from sao_jax.train.batch import Batch


def _estimator(batch: Batch, config, sharding):
    """`(gae, critic_mask, lam)` of the batch for an algorithm with a critic: `gae(values=,
    last_value=)` returns `(advantages, returns)` (`rl.decoupled_gae`), `critic_mask` the
    positions the critic is trained and measured on, `lam` the policy's per-row lambda.

    With step-level values (`rl.step_gae`) the critic holds one value per action, read at its
    first token, so its mask is those first tokens and lambda counts turns."""
    algo, m = config.algorithm, batch.action_mask
    turns = algo.advantage == "step_gae"
    critic_mask = rl.first_action_tokens(m) if turns else m
    lam = rl.length_adaptive_lambda(critic_mask, algo.lam_alpha)
    gae = partial(rl.decoupled_gae, batch.rewards, action_mask=m, gamma=config.gamma,
                  lam_policy=lam, lam_critic=config.critic_lambda,
                  truncated=(batch.truncated if config.bootstrap_truncated
                             else jnp.zeros_like(batch.truncated)),
                  impl=config.gae_impl, sharding=sharding, turns=turns)
    return gae, critic_mask, lam


class CriticPhase(NamedTuple):
    """What the critic phase changed and measured.

    Attributes:
      critic, critic_opt: the critic's parameters and Optax state after its K updates.
      values, last_value: `[B, L - 1]` and `[B]` values of the critic before them.
      metrics: "critic/explained_variance" (of `values` against the targets), "critic/loss"
        (the first update's: on this batch, before its updates), "critic/grad_norm" (mean over
        the updates), "critic/value_mean", "critic/return_mean", and where the attention trains
        "critic/attention_grad_norm" (its part of the gradient norm, mean over the updates).
      checks: the updates' losses and gradient norms, `[K]` each; the step changes nothing
        unless all are finite.
    """

    critic: Any
    critic_opt: Any
    values: jax.Array
    last_value: jax.Array
    metrics: dict[str, jax.Array]
    checks: tuple[jax.Array, ...]


def critic_phase(critic, critic_opt, batch: Batch, *, config, sharding,
                 values_fn: Callable, update_fn: Callable) -> CriticPhase:
    """The critic's values `V_pre` on `batch`, their targets `R` (`rl.decoupled_gae` with
    `config.critic_lambda`; 1: Monte-Carlo returns bootstrapped from the last value on truncated
    rows), and `config.algorithm.critic_steps` updates on `0.5 (V - R)^2` under a scan.

    Args:
      critic, critic_opt: the critic's parameters and Optax state.
      batch: the step's batch.
      config: the step's `StepConfig`.
      sharding: the row sharding of `[B, T]` arrays on the mesh (None without one).
      values_fn: `params -> (values [B, L - 1], last_value [B])`, the critic's values on
        `batch`.
      update_fn: `(params, opt_state, returns, mask, old_values) -> (params, opt_state, loss,
        grad_norm, attention_grad_norm)`, one critic update on `batch` (the attention's
        gradient norm None where it is frozen).

    Returns:
      a `CriticPhase`.
    """
    gae, critic_mask, _ = _estimator(batch, config, sharding)
    values, last_value = values_fn(critic)
    _, returns = gae(values=values, last_value=last_value)

    def update(carry, _):
        params, opt_state, loss, norm, attention = update_fn(*carry, returns, critic_mask,
                                                              values)
        return (params, opt_state), (loss, norm, attention)

    (critic, critic_opt), (losses, norms, attention) = jax.lax.scan(
        update, (critic, critic_opt), None, length=config.algorithm.critic_steps)
    metrics = {"critic/explained_variance": rl.explained_variance(values, returns, critic_mask),
               "critic/loss": losses[0],
               "critic/grad_norm": jnp.mean(norms),
               "critic/value_mean": rl.masked_mean(values, critic_mask),
               "critic/return_mean": rl.masked_mean(returns, critic_mask)}
    if attention is not None:
        metrics["critic/attention_grad_norm"] = jnp.mean(attention)
    return CriticPhase(critic, critic_opt, values, last_value, metrics, (losses, norms))


class Advantages(NamedTuple):
    """The step's advantages.

    Attributes:
      advantages: `[B, L - 1]`, zero off the action tokens.
      baseline: the running-mean state after this batch (`rl.running_mean_advantages`); the
        one passed in for the other estimators.
      metrics: "advantages/mean", "advantages/abs_mean" (over action tokens), and with a critic
        "critic/lambda_mean" (the policy's lambda, mean over rows).
    """

    advantages: jax.Array
    baseline: Any
    metrics: dict[str, jax.Array]


def advantages(batch: Batch, baseline, *, config, sharding, values: jax.Array | None = None,
               last_value: jax.Array | None = None) -> Advantages:
    """The advantages of `config.algorithm`, whitened over the action tokens with
    `config.whiten_advantages`.

    With a critic, GAE with the length-adaptive `lam = 1 - 1/(alpha n)` over `values` `[B,
    L - 1]` and `last_value` `[B]` (required). Without one, each row's outcome (its summed
    reward) less its group's mean over its group's standard deviation (GRPO), or less its
    prompt's running-mean baseline (`rl.running_mean_advantages` on `baseline`; one global slot
    if it has a single row), on every action token.

    Args:
      batch: the step's batch.
      baseline: the running-mean state (`TrainState.baseline`; None for other estimators).
      config: the step's `StepConfig`.
      sharding: the row sharding of `[B, T]` arrays on the mesh (None without one).
      values, last_value: the critic's values the advantages read.

    Returns:
      an `Advantages`.
    """
    algo, m = config.algorithm, batch.action_mask
    metrics = {}
    if algo.uses_critic:
        if values is None or last_value is None:
            raise ValueError(f"algorithm {algo.name} has a critic: its advantages need "
                             "values and last_value.")
        gae, _, lam = _estimator(batch, config, sharding)
        adv, _ = gae(values=values, last_value=last_value)
        metrics["critic/lambda_mean"] = jnp.mean(lam)
    else:
        outcome = jnp.sum(batch.rewards, axis=1)
        if algo.advantage == "grpo":
            row_adv = rl.grpo_advantages(outcome.reshape(-1, algo.group_size)).reshape(-1)
        else:
            index = batch.prompt_index if baseline.rewards.shape[0] > 1 else None
            row_adv, baseline = rl.running_mean_advantages(baseline, outcome, index)
        adv = jnp.where(m, row_adv[:, None], 0.0)
    if config.whiten_advantages:
        adv = jnp.where(m, rl.masked_whiten(adv, m), 0.0)
    metrics["advantages/mean"] = rl.masked_mean(adv, m)
    metrics["advantages/abs_mean"] = rl.masked_mean(jnp.abs(adv), m)
    return Advantages(adv, baseline, metrics)
