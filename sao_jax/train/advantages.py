"""The learner step's critic phase, then its advantages (docs/algorithm.md §4, steps 1-5).

    phase = critic_phase(critic, critic_opt, batch, config=config, sharding=rows,
                         values_fn=values_fn, update_fn=update_fn)
    values, last = ((phase.values, phase.last_value) if config.reuse_values
                    else values_fn(phase.critic))
    adv, baseline, metrics = advantages(batch, baseline, config=config, sharding=rows,
                                        values=values, last_value=last)

The critic phase reads the critic's values on the batch, computes their targets and makes the K
critic updates; it returns the critic it trained and what it measured, and changes nothing of its
caller's. The advantages are computed apart, by the algorithm's estimator (`Estimator`, one part
of an `algorithms.Algorithm`): GAE from the values the caller passes (the pre-update ones with
`reuse_values`, else the updated critic's), or an estimator without a critic (`Outcome`: GRPO's
group normalisation, the running mean). `steps.LearnerStep` runs both inside the jitted step and
supplies the model passes as functions, so nothing here holds a model.

An estimator is a small object the step calls; the step never asks which one it is. Adding one:
docs/algorithm.md, "Adding an algorithm".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from sao_jax import rl
from sao_jax.train.batch import Batch


class Estimator:
    """An algorithm's advantage estimator: `Algorithm.advantage`.

    Attributes:
      name: how the tables and error messages call it.
      title: how it is called in a sentence ("GAE needs a critic").
      critic: it reads a critic's values (`estimate`'s `values`, `last_value`), so an algorithm
        with it trains a critic (`critic_steps >= 1`) on the targets it gives
        (`targets(batch, config, sharding)`, as `GAE`'s); False: the algorithm has no critic.
      min_group_size: the fewest rollouts per prompt it is defined for (`Algorithm.group_size`).

    `estimate` returns the step's advantages; `init_state` what the estimator carries from one
    step to the next (`TrainState.baseline`).
    """

    name: ClassVar[str]
    title: ClassVar[str]
    critic: ClassVar[bool] = False
    min_group_size: ClassVar[int] = 1

    def init_state(self, num_prompts: int, window: int) -> Any:
        """The state carried across steps for a dataset of `num_prompts` prompts, keeping
        `window` rewards per prompt (`Trainer`'s `num_prompts`, `baseline_window`); None:
        none."""
        return None

    def estimate(self, batch: Batch, state, *, config, sharding, values: jax.Array | None,
                 last_value: jax.Array | None) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
        """`(advantages [B, L - 1] (zero off the action tokens), state after this batch,
        metrics)`; see `advantages` for the arguments."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class GAE(Estimator):
    """Skip-observation GAE over the critic's values with the length-adaptive policy lambda
    `1 - 1/(alpha n)` (docs/algorithm.md §2; `rl.decoupled_gae`).

    Attributes:
      turns: step-level values (`rl.step_gae`): the critic holds one value per action, read at
        its first token, so its mask is those first tokens and lambda counts turns.
    """

    turns: bool = False
    title: ClassVar[str] = "GAE"
    critic: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return "step_gae" if self.turns else "gae"

    def targets(self, batch: Batch, config, sharding):
        """`(gae, critic_mask, lam)` of the batch: `gae(values=, last_value=)` returns
        `(advantages, returns)` (`rl.decoupled_gae`), `critic_mask` the positions the critic is
        trained and measured on, `lam` the policy's per-row lambda."""
        m = batch.action_mask
        critic_mask = rl.first_action_tokens(m) if self.turns else m
        lam = rl.length_adaptive_lambda(critic_mask, config.algorithm.lam_alpha)
        gae = partial(rl.decoupled_gae, batch.rewards, action_mask=m, gamma=config.gamma,
                      lam_policy=lam, lam_critic=config.critic_lambda,
                      truncated=(batch.truncated if config.bootstrap_truncated
                                 else jnp.zeros_like(batch.truncated)),
                      impl=config.gae_impl, sharding=sharding, turns=self.turns)
        return gae, critic_mask, lam

    def estimate(self, batch, state, *, config, sharding, values, last_value):
        if values is None or last_value is None:
            raise ValueError(f"algorithm {config.algorithm.name} has a critic: its advantages "
                             "need values and last_value.")
        gae, _, lam = self.targets(batch, config, sharding)
        adv, _ = gae(values=values, last_value=last_value)
        return adv, state, {"critic/lambda_mean": jnp.mean(lam)}


class Outcome(Estimator):
    """Each row's outcome (its summed reward) less a baseline, on every action token of the
    row: an estimator without a critic. A subclass gives `row_advantages`."""

    def row_advantages(self, outcome: jax.Array, batch: Batch, state, *, group_size: int
                       ) -> tuple[jax.Array, Any]:
        """`(advantages [B], state after this batch)` of the rows' outcomes `[B]`; the batch
        holds whole groups of `group_size` consecutive rows."""
        raise NotImplementedError

    def estimate(self, batch, state, *, config, sharding, values=None, last_value=None):
        outcome = jnp.sum(batch.rewards, axis=1)
        row_adv, state = self.row_advantages(outcome, batch, state,
                                             group_size=config.algorithm.group_size)
        return jnp.where(batch.action_mask, row_adv[:, None], 0.0), state, {}


@dataclasses.dataclass(frozen=True)
class GroupNormalised(Outcome):
    """GRPO: the outcome less its group's mean over its group's standard deviation
    (`rl.grpo_advantages`)."""

    name: ClassVar[str] = "grpo"
    title: ClassVar[str] = "group-normalised advantages"
    min_group_size: ClassVar[int] = 2

    def row_advantages(self, outcome, batch, state, *, group_size):
        return rl.grpo_advantages(outcome.reshape(-1, group_size)).reshape(-1), state


@dataclasses.dataclass(frozen=True)
class RunningMean(Outcome):
    """The outcome less its prompt's running-mean baseline (`rl.running_mean_advantages`; one
    global slot if the state has a single row)."""

    name: ClassVar[str] = "running_mean"
    title: ClassVar[str] = "running-mean advantages"

    def init_state(self, num_prompts, window):
        return rl.running_mean_init(num_prompts, window)

    def row_advantages(self, outcome, batch, state, *, group_size):
        index = batch.prompt_index if state.rewards.shape[0] > 1 else None
        return rl.running_mean_advantages(state, outcome, index)


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
    """The critic's values `V_pre` on `batch`, their targets `R` (the estimator's `targets`:
    `rl.decoupled_gae` with `config.critic_lambda`; 1: Monte-Carlo returns bootstrapped from the
    last value on truncated rows), and `config.algorithm.critic_steps` updates on
    `0.5 (V - R)^2` under a scan.

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
    gae, critic_mask, _ = config.algorithm.advantage.targets(batch, config, sharding)
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
      baseline: the estimator's state after this batch (`Estimator.init_state`: the
        running-mean state, `rl.running_mean_advantages`; None for the others).
      metrics: "advantages/mean", "advantages/abs_mean" (over action tokens), and the
        estimator's own: with GAE "critic/lambda_mean" (the policy's lambda, mean over rows).
    """

    advantages: jax.Array
    baseline: Any
    metrics: dict[str, jax.Array]


def advantages(batch: Batch, baseline, *, config, sharding, values: jax.Array | None = None,
               last_value: jax.Array | None = None) -> Advantages:
    """The advantages of `config.algorithm`'s estimator (`Estimator.estimate`), whitened over
    the action tokens with `config.whiten_advantages`.

    With a critic (`GAE`), GAE with the length-adaptive `lam = 1 - 1/(alpha n)` over `values`
    `[B, L - 1]` and `last_value` `[B]` (required). Without one (`Outcome`), each row's outcome
    (its summed reward) less a baseline on every action token: its group's mean over its
    group's standard deviation (GRPO), or its prompt's running-mean baseline
    (`rl.running_mean_advantages` on `baseline`; one global slot if it has a single row).

    Args:
      batch: the step's batch.
      baseline: the estimator's state (`TrainState.baseline`; None for those without one).
      config: the step's `StepConfig`.
      sharding: the row sharding of `[B, T]` arrays on the mesh (None without one).
      values, last_value: the critic's values the advantages read.

    Returns:
      an `Advantages`.
    """
    m = batch.action_mask
    adv, baseline, metrics = config.algorithm.advantage.estimate(
        batch, baseline, config=config, sharding=sharding, values=values, last_value=last_value)
    if config.whiten_advantages:
        adv = jnp.where(m, rl.masked_whiten(adv, m), 0.0)
    metrics["advantages/mean"] = rl.masked_mean(adv, m)
    metrics["advantages/abs_mean"] = rl.masked_mean(jnp.abs(adv), m)
    return Advantages(adv, baseline, metrics)
