"""The learner step's policy update (docs/algorithm.md §4, step 5): one part of an
`algorithms.Algorithm`, its `policy_loss`.

    update = config.algorithm.policy_loss.update(policy, policy_opt, batch, adv, config=config,
                                                 passes=passes, key=key)

`DIS` makes one optimizer step on the DIS loss against the engine's log-probs (docs/algorithm.md
§1); `PPO` recomputes the policy's log-probs at the start of the step and makes
`ppo_minibatches` clip-higher steps against them, over disjoint row blocks, each token's term
weighted by its `correction` when it has one (`TIS`, `IcePop`, `GeometricMask`: the
training-inference mismatch corrections, from those log-probs and the engine's). The step
supplies the model passes and the optimizer (`PolicyPasses`), as it supplies the critic's to
`advantages.critic_phase`, so nothing here holds a model; the losses themselves are
`sao_jax.rl`'s. The step never asks which loss it has: it calls `update`, and reads the loss's
attributes where batches are made (`packs`) and checked (`check`, `check_rows`). Adding one:
docs/algorithm.md, "Adding an algorithm".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sao_jax import rl
from sao_jax.kernels import DisMetrics
from sao_jax.train.batch import Batch, model_inputs


class PolicyPasses(NamedTuple):
    """What the step gives a policy loss: its model passes and the policy's optimizer.

    Attributes:
      logp: `(params, inputs) -> [B, L - 1] log-probs`; `inputs` is `batch.tokens` or
        `model_inputs(batch)` (packed rows where the step packs them).
      policy_pass: `(params, inputs, entropy=False) -> passes.PolicyPass`: the log-probs, the
        entropy at each position with `entropy`, and the routing against the engines' where
        the batch carries their routes (`PolicyUpdate.routed_same`).
      accumulate: `(loss_fn, params, arrays) -> (loss, aux, grads)`: `loss_fn(params, *chunk)`
        summed over the step's micro-batches of `arrays`' rows; of its aux, the scalars
        averaged and the per-row arrays (rows first) put back in row order.
      per_microbatch: `(fn, *arrays) -> fn(*arrays)`, a forward pass without gradients run a
        micro-batch at a time.
      optimizer: the policy's Optax transformation.
      sharding: the row sharding of `[B, T]` arrays on the mesh (None without one).
    """

    logp: Callable
    policy_pass: Callable
    accumulate: Callable
    per_microbatch: Callable
    optimizer: optax.GradientTransformation
    sharding: Any


class PolicyUpdate(NamedTuple):
    """What a policy update changed and measured.

    Attributes:
      policy, policy_opt: the policy's parameters and Optax state after the update.
      metrics: "policy/loss", "policy/grad_norm" and the loss's own.
      checks: its losses and gradient norms; the step changes nothing unless all are finite.
      dis: `rl.dis_loss`'s diagnostics of the policy's log-probs at the start of the step
        against the engine's (the band fractions, the mismatch), which the step logs whatever
        the loss.
      logp: `[B, L - 1]` those log-probs, from a pass the loss makes anyway (PPO's old policy,
        DIS's loss pass): the step logs their gap to the engine's (`rl.logp_gap`).
      routed_same: `[B, L - 1]` that pass's `PolicyPass.routed_same` (None where the batch
        carries no routes): the step logs the gap split by it.
    """

    policy: Any
    policy_opt: Any
    metrics: dict[str, jax.Array]
    checks: tuple[jax.Array, ...]
    dis: DisMetrics
    logp: jax.Array
    routed_same: jax.Array | None = None


class PolicyLoss:
    """An algorithm's policy update: `Algorithm.policy_loss`.

    Attributes:
      name: how the tables and error messages call it.
      packs: it takes packed batches (several trajectories in one model row) when the step has
        one micro-batch; False: it splits the batch's rows itself, so rows stay padded.
      old_policy_passes: forward passes over the batch it makes before its updates (PPO's old
        policy), in units of one policy forward pass over the batch (`make plan` counts them).
      lm_loss: it can add the positive-example LM loss (`Algorithm.lm_coef`).
    """

    name: ClassVar[str]
    packs: ClassVar[bool] = False
    old_policy_passes: ClassVar[int] = 0
    lm_loss: ClassVar[bool] = False

    def check(self, config) -> None:
        """Raises ValueError, naming the field, for a `StepConfig` it cannot run with."""

    def check_rows(self, rows: int, config) -> None:
        """Raises ValueError for a batch of `rows` rows it cannot split."""

    def update(self, params, opt_state, batch: Batch, adv: jax.Array, *, config,
               passes: PolicyPasses, key: jax.Array) -> PolicyUpdate:
        """The policy update on `batch` with advantages `adv` `[B, L - 1]`; `key` is the step's
        randomness for it (the rows of PPO's mini-batches)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class DIS(PolicyLoss):
    """One optimizer step on the DIS loss against the engine's log-probs (`rl.dis_loss`),
    gradients accumulated over the step's micro-batches; no old-policy pass."""

    name: ClassVar[str] = "dis"
    packs: ClassVar[bool] = True

    def check(self, config):
        if config.dis_denominator == "in_band_tokens" and config.microbatches > 1:
            raise ValueError(
                "rl.dis_denominator='in_band_tokens' needs rl.microbatches=1: each micro-batch "
                "would divide by its own in-band count, and their sum is not the batch's loss. "
                "Use dis_denominator='action_tokens' (the default) with micro-batches.")

    def update(self, params, opt_state, batch, adv, *, config, passes, key):
        c, m = config, batch.action_mask
        normalizer = jnp.maximum(jnp.sum(m), 1).astype(jnp.float32)
        if c.dis_denominator == "in_band_tokens":
            normalizer = None  # dis_loss counts the in-band tokens itself (microbatches=1)

        def loss_fn(p, inputs, rollout_logp, adv, mask):
            out = passes.policy_pass(p, inputs)
            loss, dis = rl.dis_loss(out.logp, rollout_logp, adv, mask, eps_low=c.eps_low,
                                    eps_high=c.eps_high, denominator=c.dis_denominator,
                                    normalizer=normalizer, impl=c.dis_impl,
                                    sharding=passes.sharding)
            return loss, (dis, out)  # the log-probs out too: no second pass to measure them

        loss, (dis, out), grads = passes.accumulate(
            loss_fn, params, (model_inputs(batch), batch.rollout_logp, adv, m))
        norm = optax.tree.norm(grads)
        updates, opt_state = passes.optimizer.update(grads, opt_state, params)
        return PolicyUpdate(optax.apply_updates(params, updates), opt_state,
                            {"policy/loss": loss, "policy/grad_norm": norm}, (loss, norm), dis,
                            out.logp, out.routed_same)


class Correction:
    """A training-inference mismatch correction of PPO (`PPO.correction`): constant weights of
    the tokens' clipped terms from the engine-to-learner ratio `exp(old_logp - rollout_logp)`,
    computed once per step from the recomputed old policy's log-probs and the engine's.

    Attributes:
      name: how the tables call it, and the prefix of its metrics: `policy/<name>_frac_below`,
        `_frac_above`, `_weight_mean`, `_rows_masked` (`rl.CorrectionMetrics`).
    """

    name: ClassVar[str]

    def weights(self, old_logp: jax.Array, rollout_logp: jax.Array, action_mask: jax.Array
                ) -> tuple[jax.Array, rl.CorrectionMetrics]:
        """`(weights [B, T], metrics)`: the math is `sao_jax.rl`'s."""
        raise NotImplementedError

    def check(self) -> None:
        """Raises ValueError for settings the weights refuse (traced shapes only, no compile)."""
        spec = jax.ShapeDtypeStruct((1, 1), jnp.float32)
        jax.eval_shape(self.weights, spec, spec, jax.ShapeDtypeStruct((1, 1), jnp.bool_))

    def metrics(self, m: rl.CorrectionMetrics) -> dict[str, jax.Array]:
        return {f"policy/{self.name}_frac_below": m.below_frac,
                f"policy/{self.name}_frac_above": m.above_frac,
                f"policy/{self.name}_weight_mean": m.weight_mean,
                f"policy/{self.name}_rows_masked": m.rows_masked_frac}


@dataclasses.dataclass(frozen=True)
class TIS(Correction):
    """Truncated importance sampling: `w = min(rho, cap)` (`rl.tis_weights`)."""

    name: ClassVar[str] = "tis"
    cap: float = 2.0

    def weights(self, old_logp, rollout_logp, action_mask):
        return rl.tis_weights(old_logp, rollout_logp, action_mask, cap=self.cap)


@dataclasses.dataclass(frozen=True)
class IcePop(Correction):
    """IcePop: `w = rho` inside `[low, high]`, 0 outside (`rl.icepop_weights`)."""

    name: ClassVar[str] = "icepop"
    low: float = 0.5
    high: float = 5.0

    def weights(self, old_logp, rollout_logp, action_mask):
        return rl.icepop_weights(old_logp, rollout_logp, action_mask, low=self.low,
                                 high=self.high)


@dataclasses.dataclass(frozen=True)
class GeometricMask(Correction):
    """The geometric sequence mask: a row's tokens keep weight 1 when the geometric mean of
    their ratios lies in `[low, high]`, else the row is masked (`rl.geometric_mask_weights`)."""

    name: ClassVar[str] = "geomask"
    low: float = 0.999
    high: float = 1.001

    def weights(self, old_logp, rollout_logp, action_mask):
        return rl.geometric_mask_weights(old_logp, rollout_logp, action_mask, low=self.low,
                                         high=self.high)


@dataclasses.dataclass(frozen=True)
class PPO(PolicyLoss):
    """PPO with clip-higher (`rl.ppo_clip_loss`) against the policy recomputed at the start of
    the step: `ppo_minibatches` optimizer steps over a random partition of the rows (a scan),
    plus `lm_coef` times the positive-example LM loss when the algorithm has one
    (`rl.positive_example_lm_loss`). Logs the mini-batches' mean loss, gradient norm and clip
    fraction, the policy's entropy and, with the LM loss, its value.

    Attributes:
      correction: a training-inference mismatch correction (`Correction`), whose weights of
        the tokens' terms are computed once from the recomputed log-probs and the engine's,
        before the mini-batches, and logged; None: none, the engine's log-probs are only
        measured (`PolicyUpdate.dis`).
    """

    name: ClassVar[str] = "ppo"
    old_policy_passes: ClassVar[int] = 1
    lm_loss: ClassVar[bool] = True
    correction: Correction | None = None

    def check(self, config):
        if config.ppo_minibatches < 1:
            raise ValueError(f"ppo_minibatches must be >= 1, got {config.ppo_minibatches}.")
        if self.correction is not None:
            self.correction.check()

    def check_rows(self, rows, config):
        if rows % config.ppo_minibatches:
            raise ValueError(f"batch of {rows} rows does not split into ppo_minibatches="
                             f"{config.ppo_minibatches}.")

    def update(self, params, opt_state, batch, adv, *, config, passes, key):
        c, m = config, batch.action_mask
        inputs = model_inputs(batch)  # unpacked: the rows (with routes to replay, if any)
        old = jax.lax.stop_gradient(passes.per_microbatch(
            partial(passes.policy_pass, params, entropy=True), inputs))
        old_logp, entropy = old.logp, old.entropy
        _, dis = rl.dis_loss(old_logp, batch.rollout_logp, adv, m, eps_low=c.eps_low,
                             eps_high=c.eps_high, impl=c.dis_impl, sharding=passes.sharding)
        weights, metrics = None, {}
        if self.correction is not None:
            weights, corrected = self.correction.weights(old_logp, batch.rollout_logp, m)
            metrics = self.correction.metrics(corrected)
        params, opt_state, losses, norms, clip_frac, lm = self._minibatches(
            params, opt_state, inputs, old_logp, adv, m, jnp.sum(batch.rewards, axis=1),
            weights, key, config=c, passes=passes)
        metrics.update({"policy/loss": jnp.mean(losses), "policy/grad_norm": jnp.mean(norms),
                        "policy/ppo_clip_frac": clip_frac,
                        "policy/entropy": rl.masked_mean(entropy, m)})
        if c.algorithm.lm_coef:
            metrics["policy/lm_loss"] = lm
        return PolicyUpdate(params, opt_state, metrics, (losses, norms), dis, old_logp,
                            old.routed_same)

    @staticmethod
    def _minibatches(params, opt_state, inputs, old_logp, adv, mask, outcome, weights, key, *,
                     config, passes):
        """`ppo_minibatches` optimizer steps over a random partition of the rows (a scan), each
        token's term weighted by `weights` (None: 1); returns the mini-batches' losses,
        gradient norms, clip fraction and LM losses."""
        c = config
        lm_coef = c.algorithm.lm_coef
        order = jax.random.permutation(key, mask.shape[0])
        chunks = jax.tree.map(  # None (no weights) stays None
            lambda a: a[order].reshape(c.ppo_minibatches, -1, *a.shape[1:]),
            (inputs, old_logp, adv, mask, outcome, weights))

        def loss_fn(p, inputs, old_logp, adv, mask, outcome, weights):
            logp = passes.logp(p, inputs)
            loss, metrics = rl.ppo_clip_loss(logp, old_logp, adv, mask,
                                             clip_low=c.ppo_clip_low, clip_high=c.ppo_clip_high,
                                             weights=weights)
            lm = rl.positive_example_lm_loss(logp, mask, outcome) if lm_coef else jnp.zeros(())
            return loss + lm_coef * lm, (metrics, lm)

        def minibatch(carry, chunk):
            params, opt_state = carry
            (loss, (metrics, lm)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, *chunk)
            updates, opt_state = passes.optimizer.update(grads, opt_state, params)
            return ((optax.apply_updates(params, updates), opt_state),
                    (loss, optax.tree.norm(grads), metrics.clip_frac, lm))

        (params, opt_state), (losses, norms, clip_fracs, lms) = jax.lax.scan(
            minibatch, (params, opt_state), chunks)
        return params, opt_state, losses, norms, jnp.mean(clip_fracs), jnp.mean(lms)
