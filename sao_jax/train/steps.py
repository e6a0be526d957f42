"""The learner's jitted step: critic, advantages and policy update (docs/algorithm.md §4), one
call.

    state, metrics = trainer.step(state, batch, update_policy=True)

One SAO step on a batch of single rollouts:
  1. `V_pre, last_value = critic(batch)`; value targets `R = gae(..., lam=1)` (Monte-Carlo returns
     that bootstrap from `last_value` on truncated rows); explained variance of `V_pre`.
  2. K critic steps on `0.5 (V - R)^2`.
  3. `V = critic(batch)` with the updated critic (or `V_pre`: `reuse_values`).
  4. Advantages `A = gae(..., lam = 1 - 1/(alpha n))`, no whitening unless asked.
  5. One policy step on the DIS loss (or several PPO mini-batch steps for grpo/vapo, against the
     policy as it was at the start of the step).
A critic warm-up step (`update_policy=False`) stops after step 4 and only measures the policy's
log-probs. The other algorithms of `algorithms.ALGORITHMS` replace steps 1-4 and 5 with their
parts: the step calls the algorithm's advantage estimator and policy loss, and never asks which
they are. Steps 1-2 (the critic phase) and 4 (the advantages) are the functions of
`train/advantages.py`, step 5 the algorithm's `policy_losses.PolicyLoss`; the model passes they
run, a micro-batch at a time, are `passes.ModelPasses`. This module holds the step as a function
(`LearnerStep`: the phases in order, the critic's updates, the skip guard) and its compiled
programs (`Trainer`).

The state (`state.TrainState`) is a pytree of arrays (parameters as plain nested dicts, Optax
states, counters, the running-mean baseline, an RNG key): what `checkpoint` saves, donated to the
step; `state.StateFactory` makes it and decides where it lives on a mesh. A step whose
losses or gradient norms are not all finite changes nothing but the counters: `metrics["skipped"]`
is 1 and the caller counts it. The version counts policy steps, skipped ones too (that version's
weights are the previous one's), so the host knows every version without reading the state back
and waiting for the step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sao_jax import rl
from sao_jax.models import CausalLM, ValueModel
from sao_jax.models.params import cast_floating
from sao_jax.train import sharding
from sao_jax.train.advantages import advantages, critic_phase
from sao_jax.train.algorithms import Algorithm
from sao_jax.train.batch import Batch, is_shape, model_inputs
from sao_jax.train.optimizers import (
    FROZEN,
    FROZEN_ATTENTION,
    OptimizerConfig,
    make_optimizer,
    param_labels,
    trainable_global_norm,
)
from sao_jax.train.passes import ModelPasses
from sao_jax.train.policy_losses import PolicyPasses
from sao_jax.train.programs import Programs
from sao_jax.train.state import StateFactory, TrainState


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Hyperparameters of the step (docs/algorithm.md §1-§4).

    Attributes:
      algorithm: which advantage, policy loss and critic (`algorithms.get_algorithm`).
      gamma: discount.
      critic_lambda: the GAE lambda of the critic's targets (docs/algorithm.md §2, decoupled GAE:
        1, Monte-Carlo returns; the policy's lambda is the algorithm's, length-adaptive).
      eps_low, eps_high: the DIS band `[1 - eps_low, 1 + eps_high]`.
      dis_denominator: "action_tokens" (every action token, rejected ones too) or
        "in_band_tokens".
      ppo_clip_low, ppo_clip_high: PPO clip-higher range (grpo, vapo).
      ppo_minibatches: PPO optimizer steps per learner step, over disjoint row blocks.
      whiten_advantages: whiten advantages over the batch's action tokens.
      reuse_values: advantages from the pre-update values instead of a second critic pass.
      value_clip: PPO-style value clipping range (None: off).
      microbatches: rows are processed in this many chunks with gradients accumulated; each
        chunk's loss is divided by the whole batch's action-token count, so the sum is the
        full-batch gradient.
      gae_impl: `rl.gae`'s impl.
      bootstrap_truncated: a truncated row's return ends in the critic's `last_value` (the
        episode was cut, not finished); False: in its rewards alone, as a finished one's. An
        environment whose limits end the task (an SWE episode cut before it submits is graded
        0) wants False: bootstrapping pays a policy V for stalling until the cut, more than
        it earns by submitting a wrong fix (docs/algorithm.md §2).
      dis_impl: `rl.dis_loss`'s impl ("auto": the Pallas kernel on TPU).
      routing_replay: the policy's passes replay the engines' experts where a batch carries
        them (`Batch.routes`); False: they route themselves, and the step only logs how often
        they agree (`policy/routed_same`; docs/models.md, "Routing replay").
    """

    algorithm: Algorithm
    gamma: float = 1.0
    critic_lambda: float = 1.0
    eps_low: float = 0.3
    eps_high: float = 5.0
    dis_denominator: str = "action_tokens"
    ppo_clip_low: float = 0.2
    ppo_clip_high: float = 0.28
    ppo_minibatches: int = 4
    whiten_advantages: bool = False
    reuse_values: bool = False
    value_clip: float | None = None
    microbatches: int = 1
    gae_impl: str = "auto"
    dis_impl: str = "auto"
    bootstrap_truncated: bool = True
    routing_replay: bool = True


log = logging.getLogger(__name__)

# XLA:CPU runs a program's ops on a thread pool in the order its scheduler picks. The default order
# keeps many ops in flight; a learner step is thousands of small ops, and on a few cores that
# concurrency costs more than it wins. On 2 cores the memory-optimized order took a toy SAO step
# of 16 x 128 tokens from 95 to 78 ms (16 x 256: 290 -> 234 ms), with ~18% less CPU time.
CPU_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


@functools.cache
def compiler_options() -> dict[str, str] | None:
    """XLA compiler options for training programs on the default backend: `CPU_COMPILER_OPTIONS`
    on CPU when this jaxlib knows them (else None, with a warning), None elsewhere."""
    if jax.default_backend() != "cpu":
        return None
    try:
        jax.jit(lambda x: x + 1, compiler_options=CPU_COMPILER_OPTIONS).lower(1.0).compile()
    except Exception as e:  # noqa: BLE001 - an older jaxlib: train with XLA's default order
        log.warning("this jaxlib does not take %s (%s); training programs use XLA's default "
                    "scheduler, which is slower on CPU", CPU_COMPILER_OPTIONS, e)
        return None
    return dict(CPU_COMPILER_OPTIONS)


def _finite(*xs) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))


def _fresh_gap(logp, rollout_logp, mask, policy_lag) -> dict[str, jax.Array]:
    """The log-prob gap over the action tokens of the rows sampled with the step's own weights
    (`policy_lag` 0): the engine's numerics apart from the policy's movement, which the whole
    batch's gap mixes in under lag (docs/algorithm.md, "The training-inference gap"). NaN when
    no row is fresh (injected lag)."""
    tokens = jnp.asarray(mask, bool) & (policy_lag == 0)[:, None]
    gap = rl.logp_gap(logp, rollout_logp, tokens)
    some = jnp.any(tokens)
    return {"policy/fresh_frac": jnp.sum(tokens) / jnp.maximum(jnp.sum(mask), 1),
            **{f"policy/logp_mismatch_fresh{suffix}": jnp.where(some, value, jnp.nan)
               for suffix, value in (("", gap.mean), ("_p99", gap.p99), ("_max", gap.max))}}


class LearnerStep:
    """The learner step as a pure function of `(state, batch)`, for `Trainer` to jit: the critic
    phase, the advantages and the policy update (steps 1-5 of this module's docstring), and the
    guard that keeps a step with a non-finite loss or gradient norm from changing anything but
    the counters.

    Args:
      config: the step's hyperparameters.
      passes: the model passes (`passes.ModelPasses`).
      policy_tx, critic_tx: the Optax transformations (critic_tx None without a critic).
      critic_labels: the critic's parameter labels (`optimizers.param_labels`): its gradient
        norm counts the trainable ones.
      attention_labels: where the critic's attention trains, its parameters labelled "frozen":
        `critic/attention_grad_norm`, the part of `critic/grad_norm` that freezing it would
        remove (None where it is frozen).
    """

    def __init__(self, config: StepConfig, passes: ModelPasses, *,
                 policy_tx: optax.GradientTransformation,
                 critic_tx: optax.GradientTransformation | None, critic_labels=None,
                 attention_labels=None):
        self.config = config
        self.passes = passes
        self.policy_tx = policy_tx
        self.critic_tx = critic_tx
        self._critic_labels = critic_labels
        self._attention_labels = attention_labels

    def __call__(self, state: TrainState, batch: Batch, *, update_policy: bool):
        c, algo = self.config, self.config.algorithm
        m = batch.action_mask
        metrics: dict[str, jax.Array] = {}
        next_key, minibatch_key = jax.random.split(jax.random.wrap_key_data(state.rng))
        finite: list[jax.Array] = []
        critic, critic_opt = state.critic, state.critic_opt
        values = last_value = None
        if algo.uses_critic:
            inputs = model_inputs(batch)

            def values_fn(params):  # the critic's values on the batch, a micro-batch at a time
                return self.passes.per_microbatch(partial(self.passes.values, params), inputs,
                                                  batch.last_index)

            phase = critic_phase(critic, critic_opt, batch, config=c,
                                 sharding=self.passes.row_sharding, values_fn=values_fn,
                                 update_fn=partial(self._critic_update, inputs=inputs))
            critic, critic_opt = phase.critic, phase.critic_opt
            metrics.update(phase.metrics)
            finite += phase.checks
            values, last_value = phase.values, phase.last_value
            if not c.reuse_values:  # the advantages from the updated critic's values
                values, last_value = values_fn(critic)
        adv, baseline, adv_metrics = advantages(batch, state.baseline, config=c,
                                                sharding=self.passes.row_sharding, values=values,
                                                last_value=last_value)
        metrics.update(adv_metrics)
        policy, policy_opt = state.policy, state.policy_opt

        if not update_policy:  # critic warm-up: measure the policy, change nothing
            start = self.passes.start_pass(policy, batch)
            logp, routed_same = start.logp, start.routed_same
            _, dis = rl.dis_loss(logp, batch.rollout_logp, adv, m, eps_low=c.eps_low,
                                 eps_high=c.eps_high, impl=c.dis_impl,
                                 sharding=self.passes.row_sharding)
        else:
            update = algo.policy_loss.update(policy, policy_opt, batch, adv, config=c,
                                             passes=self._policy_passes(), key=minibatch_key)
            policy, policy_opt, dis, logp = (update.policy, update.policy_opt, update.dis,
                                             update.logp)
            routed_same = update.routed_same
            finite += update.checks
            metrics.update(update.metrics)
        # The gap's tail, from the log-probs the mean came from (the policy at the start of the
        # step; docs/algorithm.md, "The training-inference gap").
        gap = rl.logp_gap(logp, batch.rollout_logp, m)
        metrics["policy/dis_frac_below"] = dis.below_band_frac
        metrics["policy/dis_frac_above"] = dis.above_band_frac
        metrics["policy/logp_mismatch"] = dis.logp_mismatch
        metrics["policy/logp_mismatch_p99"] = gap.p99
        metrics["policy/logp_mismatch_max"] = gap.max
        if batch.policy_lag is not None:  # the numerics alone: rows of the step's own weights
            metrics.update(_fresh_gap(logp, batch.rollout_logp, m, batch.policy_lag))
        metrics["policy/ratio_mean"] = dis.ratio_mean
        metrics["policy/nonfinite_logp_frac"] = dis.nonfinite_frac
        if routed_same is not None:  # the gap split by routing (docs/models.md)
            split = rl.routing_split(logp, batch.rollout_logp, m, routed_same)
            metrics["policy/routed_same"] = split.same_frac
            metrics["policy/logp_mismatch_same"] = split.mean_same
            metrics["policy/logp_mismatch_different"] = split.mean_different

        ok = _finite(*finite) if finite else jnp.array(True)
        updated = state._replace(policy=policy, policy_opt=policy_opt, critic=critic,
                                 critic_opt=critic_opt, baseline=baseline)
        new = jax.tree.map(lambda a, b: jnp.where(ok, a, b), updated, state)
        new = new._replace(step=state.step + 1,
                           version=state.version + int(update_policy),
                           rng=jax.random.key_data(next_key))
        metrics["skipped"] = (~ok).astype(jnp.float32)
        return new, metrics

    def _critic_update(self, params, opt_state, returns, mask, old_values, *, inputs):
        normalizer = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)

        def loss_fn(p, inputs, returns, mask, old_values):
            values = self.passes.critic_values(p, inputs)
            clip = self.config.value_clip
            loss, _ = rl.value_loss(values, returns, mask, normalizer=normalizer,
                                    old_values=old_values if clip else None, clip=clip)
            return loss, ()

        loss, _, grads = self.passes.accumulate(loss_fn, params,
                                                (inputs, returns, mask, old_values))
        norm = trainable_global_norm(grads, self._critic_labels)
        attention = None  # frozen: XLA drops those gradients, nothing reads them
        if self._attention_labels is not None:
            attention = trainable_global_norm(grads, self._attention_labels, label=FROZEN)
        updates, opt_state = self.critic_tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, norm, attention

    def _policy_passes(self) -> PolicyPasses:
        """The model passes and the optimizer the policy loss updates the policy with."""
        p = self.passes
        return PolicyPasses(logp=p.logp, policy_pass=p.policy_pass, accumulate=p.accumulate,
                            per_microbatch=p.per_microbatch, optimizer=self.policy_tx,
                            sharding=p.row_sharding)


def _phase(update_policy: bool) -> str:
    """A step program's phase, as the logs and errors name it."""
    return "policy update" if update_policy else "critic only"


class Trainer:
    """The learner step, compiled and run: builds its parts from the policy and the
    configuration (the model passes, `ModelPasses`; the step's function, `LearnerStep`; its
    states, `state.StateFactory`), checks and places each batch, and runs `step` as one jitted,
    donated program per phase and batch shape (or the ones `precompile` compiled ahead).

    Args:
      policy: the initial policy (its parameters become `init_state`'s).
      config: the step's hyperparameters.
      policy_optimizer, critic_optimizer: AdamW settings (`optimizers.policy_optimizer_config`,
        `critic_optimizer_config`); the critic's frozen patterns follow
        `config.algorithm.freeze_attention`.
      num_prompts: running-mean slots (prompts of the dataset); 1 with `global_baseline`.
      baseline_window: rewards per running-mean slot (the learner passes
        `config.rl.baseline_window`, or `global_baseline_window` for the global slot).
      mesh, rules: batches are placed on `mesh`, rows split by the rule for "batch"
        (`sharding.batch_sharding`); None: the default device.
      compute_dtype: the dtype the passes compute in and the engines serve (`policy_of`),
        e.g. bfloat16 over a float32 `policy`: the state keeps the parameters and the
        optimizers' moments in the policy's own dtype (master weights), where AdamW adds its
        update; None: the policy's dtype, one dtype throughout.
    """

    def __init__(self, policy: CausalLM, config: StepConfig, *,
                 policy_optimizer: OptimizerConfig, critic_optimizer: OptimizerConfig,
                 num_prompts: int = 1, baseline_window: int = 8, mesh=None, rules=None,
                 compute_dtype=None):
        algo = config.algorithm
        algo.policy_loss.check(config)
        if config.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {config.microbatches}.")
        self.config = config
        self.cfg = policy.cfg
        self.compute_dtype = jnp.dtype(compute_dtype or policy.cfg.param_dtype)
        self._policy_graph, policy_params = nnx.split(policy)
        initial_policy = nnx.to_pure_dict(policy_params)
        policy_tx = make_optimizer(policy_optimizer, initial_policy)
        critic_graph = initial_critic = critic_tx = critic_labels = attention_labels = None
        if algo.uses_critic:
            frozen = FROZEN_ATTENTION if algo.freeze_attention else ()
            critic_optimizer = dataclasses.replace(critic_optimizer, frozen_patterns=frozen)
            critic_graph, critic_params = nnx.split(ValueModel.from_policy(policy))
            initial_critic = nnx.to_pure_dict(critic_params)
            critic_tx = make_optimizer(critic_optimizer, initial_critic)
            critic_labels = param_labels(initial_critic, frozen)
            if not algo.freeze_attention:
                attention_labels = param_labels(initial_critic, FROZEN_ATTENTION)
        self._mesh = mesh
        self._batch_sharding = None
        if mesh is not None:
            self._batch_sharding = lambda ndim: sharding.batch_sharding(
                mesh, rules or sharding.DEFAULT_RULES, ndim)
        self.passes = ModelPasses(self._policy_graph, critic_graph, self.cfg,
                                  microbatches=config.microbatches,
                                  batch_sharding=self._batch_sharding,
                                  replay=config.routing_replay,
                                  compute_dtype=self.compute_dtype)
        self._step = LearnerStep(config, self.passes, policy_tx=policy_tx, critic_tx=critic_tx,
                                 critic_labels=critic_labels, attention_labels=attention_labels)
        self.states = StateFactory(
            initial_policy, initial_critic, policy_tx=policy_tx, critic_tx=critic_tx,
            baseline=partial(algo.advantage.init_state, num_prompts, baseline_window), mesh=mesh)
        self._placed = False  # a state stepped before any was placed is placed first
        self._steps: dict[bool, Any] = {}
        self._compiled = Programs()  # (update_policy, batch shapes) -> executable
        self._logprobs = None  # `logprobs`, jitted on first use
        self._served = jax.jit(partial(cast_floating, dtype=self.compute_dtype))

    # -- state ------------------------------------------------------------------------------

    def init_state(self, seed: int = 0) -> TrainState:
        """The state at step 0: the given policy, a critic copied from it (zero value head)."""
        return self.place(self.states.fresh(seed))

    def place(self, state: TrainState) -> TrainState:
        """`state` (e.g. restored from a checkpoint) in the shardings the step keeps it in."""
        if self._mesh is None:
            return state
        self._placed = True
        return self.states.place(state)

    def abstract_state(self, seed: int = 0) -> TrainState:
        """The state's shapes, dtypes and (on a mesh) shardings, with no memory behind them:
        for compiling the step ahead of time (`lower`), e.g. for devices this host does not
        have (`train.plan`). Built from a policy whose parameters may themselves be abstract
        (`sharding.abstract_model`)."""
        return self.states.abstract(seed)

    def policy_model(self, state: TrainState) -> CausalLM:
        """`state`'s policy as the engines serve it (`policy_of`)."""
        return self.policy_of(state.policy)

    def policy_of(self, params) -> CausalLM:
        """The policy holding `params` (a `TrainState.policy` tree, or `served_params`) as the
        engines serve it: in the compute dtype (its layout and config are the learner's; the
        arrays' dtype is what `save_hf` writes)."""
        return nnx.merge(self._policy_graph, cast_floating(params, self.compute_dtype))

    def served_params(self, params):
        """A copy of `params` (a `TrainState.policy` tree) in the compute dtype, in new buffers
        (the state is donated to the next step): what a publish in the background holds."""
        return self._served(params)

    # -- the compiled step ------------------------------------------------------------------

    def _jitted_step(self, update_policy: bool):
        """The jitted step; on a mesh the state leaves it in exactly the shardings it entered
        with (those of `place`), so each (batch length, phase) compiles one program."""
        if update_policy not in self._steps:
            out = None if self._mesh is None else (self.states.shardings, None)
            self._steps[update_policy] = jax.jit(partial(self._step, update_policy=update_policy),
                                                 donate_argnums=0, out_shardings=out,
                                                 compiler_options=compiler_options())
        return self._steps[update_policy]

    @property
    def programs(self) -> Programs:
        """The step's ahead-of-time compiled programs (`precompile`; `Programs.report`)."""
        return self._compiled

    def step(self, state: TrainState, batch: Batch, *, update_policy: bool = True
             ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One learner step on `batch` (donates `state`). Metrics stay on device."""
        self._check_rows(batch.tokens.shape[0])
        if batch.packing is not None and not self.packs:
            raise ValueError("a packed batch (make_batch(pack_length=...)) needs the DIS policy "
                             "loss and microbatches=1: PPO mini-batches and microbatches split "
                             f"batch rows (algorithm {self.config.algorithm.name}, microbatches="
                             f"{self.config.microbatches}); make the batch without packing.")
        batch = jax.tree.map(np.asarray, batch)
        if self._mesh is not None:
            batch = jax.device_put(batch, jax.tree.map(
                lambda x: self._batch_sharding(x.ndim), batch))
            if not self._placed:
                state = self.place(state)
        if self._compiled.failed is not None:  # a batch of that shape would fail: stop now
            (phase, shapes), error = self._compiled.failed
            raise RuntimeError(f"the learner step did not compile ahead of time for a batch of "
                               f"shapes {shapes} ({_phase(phase)}): "
                               f"{type(error).__name__}: {error}") from error
        key = (bool(update_policy), tuple(x.shape for x in jax.tree.leaves(batch)))
        if update_policy:  # the critic-only phase is over: its programs are not needed
            self._compiled.retire(False)
        step = self._compiled.take(key) or self._jitted_step(bool(update_policy))
        return step(state, batch)

    def logprobs(self, policy, batch: Batch) -> jax.Array:
        """`[B, L - 1]` the log-probs of `batch`'s tokens under the policy's parameters
        `policy` (a `TrainState.policy`), computed as the step computes them before it updates
        the policy (jitted): the learner's side of the training-inference gap
        (`benchmarks/logp_gap.py`)."""
        if self._logprobs is None:
            self._logprobs = jax.jit(lambda p, b: self.passes.start_pass(p, b).logp,
                                     compiler_options=compiler_options())
        return self._logprobs(policy, jax.tree.map(np.asarray, batch))

    def _check_rows(self, rows: int) -> None:
        """A batch of `rows` rows splits as the step splits it: into groups, PPO mini-batches,
        micro-batches, and each micro-batch over the mesh's batch shards."""
        algo = self.config.algorithm
        if rows % algo.group_size:
            raise ValueError(f"a batch of {rows} rows does not hold whole groups of "
                             f"{algo.group_size} (algorithm {algo.name}).")
        algo.policy_loss.check_rows(rows, self.config)
        if rows % self.config.microbatches:
            raise ValueError(f"batch of {rows} rows does not split into microbatches="
                             f"{self.config.microbatches}.")
        per_chunk = rows // self.config.microbatches
        if per_chunk % self.row_multiple:
            raise ValueError(f"microbatches={self.config.microbatches} leaves {per_chunk} rows "
                             f"per micro-batch, which do not split over the mesh's "
                             f"{self.row_multiple} batch shards: use fewer micro-batches (at "
                             f"most {max(rows // self.row_multiple, 1)}) or more rows.")

    @property
    def mesh(self):
        return self._mesh

    @property
    def row_multiple(self) -> int:
        """Batch rows, and packed model rows, come in multiples of this: the number of shards
        of the batch dimension on the mesh (1 without one)."""
        if self._mesh is None:
            return 1
        axes = self._batch_sharding(1).spec[0] or ()
        return math.prod(self._mesh.shape[a] for a in ((axes,) if isinstance(axes, str)
                                                       else axes))

    @property
    def packs(self) -> bool:
        """Whether this step takes packed batches: only with a policy loss that takes them (DIS)
        and one microbatch (PPO mini-batches and microbatches split batch rows, not model
        rows)."""
        return self.config.algorithm.policy_loss.packs and self.config.microbatches == 1

    def precompile(self, state: TrainState, shapes: Sequence[Batch],
                   phases: Sequence[bool] = (True, False), *, log=None,
                   stop: threading.Event | None = None) -> int:
        """Compiles the step ahead of time for batches of each of `shapes` (`batch_shapes`) and
        each phase (`update_policy`), so the first step of each shape does not stall the
        learner; `step` then runs these programs. `state` (placed, e.g. from `init_state`) is
        only read for its shapes and shardings. Runs beside `step` on another thread (the
        learner's loop starts while it works): a step whose program this is compiling waits
        for it, and a step that came first compiles its own, which this then skips (`Programs`).
        The phases in the order given, every shape of one before the next (a run's first
        steps are critic-only, `(False, True)`), and none whose steps are over: the first
        policy update retires the critic-only programs not yet compiled. Returns how many
        programs it compiled. Once `stop` is set, it returns after the program it is
        compiling."""
        abstract_state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        count = 0
        for flag in phases:
            for spec in shapes:
                shape_key = tuple(x[0] for x in jax.tree.leaves(spec, is_leaf=is_shape))
                if stop is not None and stop.is_set():
                    return count
                start = time.perf_counter()
                if not self._compiled.compile(
                        (bool(flag), shape_key),
                        lambda s=spec, f=bool(flag): self.lower(abstract_state, s, f).compile()):
                    continue  # compiled already, or the step took it
                count += 1
                if log is not None:
                    model = (spec.packing or spec).tokens[0]
                    log(f"compiled the learner step for {model[0]} x {model[1]} tokens "
                        f"({_phase(flag)}) in "
                        f"{time.perf_counter() - start:.1f} s")
        return count

    def abstract_batch(self, spec: Batch) -> Batch:
        """`ShapeDtypeStruct`s of a batch of `spec` (`batch_shapes`), placed as `step` places
        it."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x[0], x[1], sharding=None if self._mesh is None
            else self._batch_sharding(len(x[0]))), spec, is_leaf=is_shape)

    def lower(self, state: TrainState, spec: Batch, update_policy: bool = True):
        """The step lowered for a state like `state` (arrays or `abstract_state`) and batches
        of `spec` (`batch_shapes`): `.compile()` it, or read its cost."""
        self._check_rows(spec.tokens[0][0])
        return self._jitted_step(bool(update_policy)).lower(state, self.abstract_batch(spec))
