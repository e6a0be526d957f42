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
`train/advantages.py`, step 5 the algorithm's `policy_losses.PolicyLoss`; this module holds the
model passes, the critic's updates, the state and the compiled programs.

The state is a pytree of arrays (parameters as plain nested dicts, Optax states, counters, the
running-mean baseline, an RNG key): what `checkpoint` saves, donated to the step. A step whose
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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sao_jax import rl
from sao_jax.models import CausalLM, ValueModel, token_logprobs
from sao_jax.train import sharding
from sao_jax.train.advantages import advantages, critic_phase
from sao_jax.train.algorithms import Algorithm
from sao_jax.train.batch import (
    Batch,
    Packing,
    batch_rows,
    is_shape,
    model_inputs,
    model_rows,
)
from sao_jax.train.optimizers import (
    FROZEN,
    FROZEN_ATTENTION,
    OptimizerConfig,
    make_optimizer,
    param_labels,
    trainable_global_norm,
)
from sao_jax.train.policy_losses import PolicyPasses


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


class TrainState(NamedTuple):
    """Everything the learner updates. A pytree of arrays; `None` where an algorithm has no part.

    Attributes:
      step: learner updates done (critic-only warm-up steps included).
      version: policy steps done, skipped ones included: the weight version of `policy`.
      policy, critic: parameters as nested dicts (`nnx.to_pure_dict(nnx.split(model)[1])`).
      policy_opt, critic_opt: their Optax states.
      baseline: the running-mean baseline (`rl.RunningMeanState`), for `running_mean`.
      rng: a PRNG key (raw uint32 data), split once per step: the step's randomness (the
        rows of each PPO mini-batch), so a resumed run draws what the killed one would have.
    """

    step: jax.Array
    version: jax.Array
    policy: Any
    policy_opt: Any
    critic: Any
    critic_opt: Any
    baseline: Any
    rng: jax.Array


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


def _row_chunks(arrays, n: int):
    """`arrays`' rows as n micro-batches `[n, B / n, ...]`: chunk k holds rows k, k + n,
    k + 2n, ..., so that on a mesh each device keeps its share of every chunk (contiguous chunks
    would sit on a few devices each)."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] // n, n, *a.shape[1:]).swapaxes(0, 1),
                        arrays)


def _row_order(x):
    """A per-row array cut by `_row_chunks` `[n, B / n, ...]` back in row order `[B, ...]`."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def _from_chunks(x):
    """One aux leaf of `Trainer._accumulate`, stacked over its n chunks: a scalar `[n]` (a
    metric) as the chunks' mean, a per-row array `[n, B / n, ...]` (log-probs) in row order."""
    return jnp.mean(x, axis=0) if x.ndim == 1 else _row_order(x)


class Trainer:
    """Holds the models' structure and optimizers; `step` is the jitted, donated learner step.

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
    """

    def __init__(self, policy: CausalLM, config: StepConfig, *,
                 policy_optimizer: OptimizerConfig, critic_optimizer: OptimizerConfig,
                 num_prompts: int = 1, baseline_window: int = 8, mesh=None, rules=None):
        algo = config.algorithm
        algo.policy_loss.check(config)
        if config.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {config.microbatches}.")
        self.config = config
        self.cfg = policy.cfg
        self._policy_graph, policy_params = nnx.split(policy)
        self._initial_policy = nnx.to_pure_dict(policy_params)
        self.policy_tx = make_optimizer(policy_optimizer, self._initial_policy)
        self._critic_graph = self.critic_tx = self._critic_labels = None
        self._initial_critic = None
        if algo.uses_critic:
            frozen = FROZEN_ATTENTION if algo.freeze_attention else ()
            critic_optimizer = dataclasses.replace(critic_optimizer, frozen_patterns=frozen)
            self._critic_graph, critic_params = nnx.split(ValueModel.from_policy(policy))
            self._initial_critic = nnx.to_pure_dict(critic_params)
            self.critic_tx = make_optimizer(critic_optimizer, self._initial_critic)
            self._critic_labels = param_labels(self._initial_critic, frozen)
        # where the critic's attention trains, its own gradient norm: the part of
        # `critic/grad_norm` that freezing it would remove (labelled "frozen" here)
        self._attention_labels = None
        if algo.uses_critic and not algo.freeze_attention:
            self._attention_labels = param_labels(self._initial_critic, FROZEN_ATTENTION)
        self._num_prompts = num_prompts
        self._baseline_window = baseline_window
        self._mesh = mesh
        self._batch_sharding = None
        if mesh is not None:
            self._batch_sharding = lambda ndim: sharding.batch_sharding(
                mesh, rules or sharding.DEFAULT_RULES, ndim)
        # On a mesh, where the step keeps each part of the state, decided here once: every state
        # the step sees is placed so (`place`), and the step leaves it so.
        self._state_shardings = None if mesh is None else self._decide_shardings()
        self._placed = False  # a state stepped before any was placed is placed first
        self._steps: dict[bool, Any] = {}
        self._compiled: dict[tuple, Any] = {}  # (update_policy, batch shapes) -> executable
        self._logprobs = None  # `logprobs`, jitted on first use

    # -- state ------------------------------------------------------------------------------

    def init_state(self, seed: int = 0) -> TrainState:
        """The state at step 0: the given policy, a critic copied from it (zero value head)."""
        return self.place(self._fresh_state(seed))

    def place(self, state: TrainState) -> TrainState:
        """`state` (e.g. restored from a checkpoint) in the shardings the step keeps it in."""
        if self._mesh is None:
            return state
        self._placed = True
        return jax.device_put(state, self._state_shardings)

    def _jitted_step(self, update_policy: bool):
        """The jitted step; on a mesh the state leaves it in exactly the shardings it entered
        with (those of `place`), so each (batch length, phase) compiles one program."""
        if update_policy not in self._steps:
            out = None if self._mesh is None else (self._state_shardings, None)
            self._steps[update_policy] = jax.jit(partial(self._step, update_policy=update_policy),
                                                 donate_argnums=0, out_shardings=out,
                                                 compiler_options=compiler_options())
        return self._steps[update_policy]

    def abstract_state(self, seed: int = 0) -> TrainState:
        """The state's shapes, dtypes and (on a mesh) shardings, with no memory behind them:
        for compiling the step ahead of time (`lower`), e.g. for devices this host does not
        have (`train.plan`). Built from a policy whose parameters may themselves be abstract
        (`sharding.abstract_model`)."""
        state = jax.eval_shape(partial(self._state_of, seed=seed), self._initial_policy,
                               self._initial_critic)
        if self._mesh is None:
            return state
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state, self._state_shardings)

    def _decide_shardings(self):
        """Where the step keeps the state on the mesh: parameters where the rules put them (the
        policy's as given, the critic's as copied from it), Optax moments with their parameter,
        everything else (counters, the baseline, the key) replicated."""
        state = jax.eval_shape(partial(self._state_of, seed=0), self._initial_policy,
                               self._initial_critic)
        given = {}  # parameter path -> its sharding
        for part in ("policy", "critic"):
            for path, leaf in jax.tree_util.tree_flatten_with_path(
                    getattr(self, f"_initial_{part}"))[0]:
                s = getattr(leaf, "sharding", None)
                if isinstance(s, jax.sharding.NamedSharding) and s.mesh == self._mesh:
                    given[(part, tuple(path))] = s
        replicated = jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())

        def sharding_of(path, leaf):
            part = {"policy_opt": "policy", "critic_opt": "critic"}.get(path[0].name,
                                                                        path[0].name)
            for start in range(1, len(path)):  # a moment's path ends in its parameter's
                found = given.get((part, tuple(path[start:])))
                if found is not None and len(found.spec) <= len(leaf.shape):
                    return found
            return replicated

        return jax.tree_util.tree_map_with_path(sharding_of, state)

    def _fresh_state(self, seed: int) -> TrainState:
        # Fresh buffers: the state is donated to the step, and the critic's backbone starts as
        # the policy's (same arrays).
        return self._state_of(jax.tree.map(jnp.copy, self._initial_policy),
                              jax.tree.map(jnp.copy, self._initial_critic), seed=seed)

    def _state_of(self, policy, critic, *, seed: int) -> TrainState:
        baseline = self.config.algorithm.advantage.init_state(self._num_prompts,
                                                              self._baseline_window)
        return TrainState(
            step=jnp.zeros((), jnp.int32), version=jnp.zeros((), jnp.int32),
            policy=policy, policy_opt=self.policy_tx.init(policy),
            critic=critic, critic_opt=None if critic is None else self.critic_tx.init(critic),
            baseline=baseline, rng=jax.random.key_data(jax.random.key(seed)))

    def policy_model(self, state: TrainState) -> CausalLM:
        return self.policy_of(state.policy)

    def policy_of(self, params) -> CausalLM:
        """The policy model holding `params` (a `TrainState.policy` tree)."""
        return nnx.merge(self._policy_graph, params)

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
        key = (bool(update_policy), tuple(x.shape for x in jax.tree.leaves(batch)))
        step = self._compiled.get(key) or self._jitted_step(bool(update_policy))
        return step(state, batch)

    def logprobs(self, policy, batch: Batch) -> jax.Array:
        """`[B, L - 1]` the log-probs of `batch`'s tokens under the policy's parameters
        `policy` (a `TrainState.policy`), computed as the step computes them before it updates
        the policy (jitted): the learner's side of the training-inference gap
        (`benchmarks/logp_gap.py`)."""
        if self._logprobs is None:
            self._logprobs = jax.jit(self._start_logp, compiler_options=compiler_options())
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
        only read for its shapes and shardings. Thread-safe against `step`; returns how many
        programs it compiled. Once `stop` is set, it returns after the program it is
        compiling."""
        abstract_state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        count = 0
        for spec in shapes:
            shape_key = tuple(x[0] for x in jax.tree.leaves(spec, is_leaf=is_shape))
            for flag in phases:
                key = (bool(flag), shape_key)
                if key in self._compiled:
                    continue
                if stop is not None and stop.is_set():
                    return count
                start = time.perf_counter()
                self._compiled[key] = self.lower(abstract_state, spec, bool(flag)).compile()
                count += 1
                if log is not None:
                    model = (spec.packing or spec).tokens[0]
                    log(f"compiled the learner step for {model[0]} x {model[1]} tokens "
                        f"({'policy update' if flag else 'critic only'}) in "
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

    # -- model passes -----------------------------------------------------------------------

    def _rows(self):
        """The `[B, T]` arrays' row sharding on the mesh (None without one): the Pallas
        kernels run per shard on it, as the mesh's platform's variant."""
        return None if self._mesh is None else self._batch_sharding(2)

    def _hidden(self):
        """The hidden states' sharding on the mesh: rows over the batch axes (None without
        one)."""
        return None if self._mesh is None else self._batch_sharding(3)

    def _logp(self, params, inputs, entropy: bool = False):
        """`[B, L - 1]` log-probs of the batch's tokens; `inputs` is `batch.tokens` or
        `batch.packing` (`batch.model_inputs`). With `entropy`, `(logp, entropy)`: the policy's
        entropy at each position too."""
        model = nnx.merge(self._policy_graph, params)
        ids, positions, segments = model_rows(inputs)
        hidden = model.backbone(ids, positions, segments_BxT=segments,
                                dispatch=self.cfg.logprob_dispatch,
                                hidden_sharding=self._hidden()).hidden_BxTxD
        targets = inputs.targets if isinstance(inputs, Packing) else inputs[:, 1:]
        out = token_logprobs(hidden, model.head_weight(), targets, return_entropy=entropy)
        if entropy:
            return batch_rows(out[0], inputs), batch_rows(out[1], inputs)
        return batch_rows(out, inputs)

    def _critic_values(self, params, inputs):
        """`[B, L - 1]` values (see `_logp` for `inputs`)."""
        ids, positions, segments = model_rows(inputs)
        values, _ = nnx.merge(self._critic_graph, params)(
            ids, positions, segments_BxT=segments, dispatch=self.cfg.moe_dispatch,
            hidden_sharding=self._hidden())
        return batch_rows(values, inputs)

    def _values(self, params, inputs, last_index):
        """`[B, L - 1]` values and `[B]` the value at each row's `last_index`."""
        values = self._critic_values(params, inputs)
        last = jnp.take_along_axis(values, last_index[:, None], axis=1)[:, 0]
        return values, last

    def _accumulate(self, loss_fn, params, arrays):
        """`(loss, aux, grads)` of `loss_fn(params, *chunk)` summed over row chunks, under a
        `lax.scan` (the compiled step holds one chunk's program whatever their number). Of the
        aux, scalars (metrics) come back as the chunks' mean and per-row arrays (rows first:
        log-probs) in row order."""
        n = self.config.microbatches
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if n == 1:
            (loss, aux), grads = grad_fn(params, *arrays)
            return loss, aux, grads
        chunks = _row_chunks(arrays, n)
        (loss_shape, _), grads_shape = jax.eval_shape(
            grad_fn, params, *jax.tree.map(lambda c: c[0], chunks))
        zero = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), (loss_shape, grads_shape))

        def add_chunk(total, chunk):
            (loss, aux), grads = grad_fn(params, *chunk)
            return jax.tree.map(jnp.add, total, (loss, grads)), aux

        (loss, grads), aux = jax.lax.scan(add_chunk, zero, chunks)
        return loss, jax.tree.map(_from_chunks, aux), grads

    def _per_microbatch(self, fn, *arrays):
        """`fn(*arrays)` for a forward pass without gradients, run one micro-batch at a time
        (a `lax.map` over `_accumulate`'s row chunks) and put back in row order: the compiled
        step holds one micro-batch's activations, as the updates do, not the whole batch's."""
        n = self.config.microbatches
        if n == 1:
            return fn(*arrays)
        out = jax.lax.map(lambda chunk: fn(*chunk), _row_chunks(arrays, n))
        return jax.tree.map(_row_order, out)

    def _start_logp(self, params, batch: Batch):
        """`[B, L - 1]` the policy's log-probs of `batch` in a pass of their own (no
        gradients, a micro-batch at a time): where no policy loss pass gives them."""
        return self._per_microbatch(partial(self._logp, params), model_inputs(batch))

    # -- updates ----------------------------------------------------------------------------

    def _critic_update(self, params, opt_state, returns, mask, old_values, *, inputs):
        normalizer = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)

        def loss_fn(p, inputs, returns, mask, old_values):
            values = self._critic_values(p, inputs)
            clip = self.config.value_clip
            loss, _ = rl.value_loss(values, returns, mask, normalizer=normalizer,
                                    old_values=old_values if clip else None, clip=clip)
            return loss, ()

        loss, _, grads = self._accumulate(loss_fn, params,
                                          (inputs, returns, mask, old_values))
        norm = trainable_global_norm(grads, self._critic_labels)
        attention = None  # frozen: XLA drops those gradients, nothing reads them
        if self._attention_labels is not None:
            attention = trainable_global_norm(grads, self._attention_labels, label=FROZEN)
        updates, opt_state = self.critic_tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, norm, attention

    def _policy_passes(self) -> PolicyPasses:
        """The model passes and the optimizer the policy loss updates the policy with."""
        return PolicyPasses(logp=self._logp, accumulate=self._accumulate,
                            per_microbatch=self._per_microbatch, optimizer=self.policy_tx,
                            sharding=self._rows())

    # -- the step ---------------------------------------------------------------------------

    def _step(self, state: TrainState, batch: Batch, *, update_policy: bool):
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
                return self._per_microbatch(partial(self._values, params), inputs,
                                            batch.last_index)

            phase = critic_phase(critic, critic_opt, batch, config=c, sharding=self._rows(),
                                 values_fn=values_fn,
                                 update_fn=partial(self._critic_update, inputs=inputs))
            critic, critic_opt = phase.critic, phase.critic_opt
            metrics.update(phase.metrics)
            finite += phase.checks
            values, last_value = phase.values, phase.last_value
            if not c.reuse_values:  # the advantages from the updated critic's values
                values, last_value = values_fn(critic)
        adv, baseline, adv_metrics = advantages(batch, state.baseline, config=c,
                                                sharding=self._rows(), values=values,
                                                last_value=last_value)
        metrics.update(adv_metrics)
        policy, policy_opt = state.policy, state.policy_opt

        if not update_policy:  # critic warm-up: measure the policy, change nothing
            logp = self._start_logp(policy, batch)
            _, dis = rl.dis_loss(logp, batch.rollout_logp, adv, m, eps_low=c.eps_low,
                                 eps_high=c.eps_high, impl=c.dis_impl, sharding=self._rows())
        else:
            update = algo.policy_loss.update(policy, policy_opt, batch, adv, config=c,
                                             passes=self._policy_passes(), key=minibatch_key)
            policy, policy_opt, dis, logp = (update.policy, update.policy_opt, update.dis,
                                             update.logp)
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
        metrics["policy/ratio_mean"] = dis.ratio_mean
        metrics["policy/nonfinite_logp_frac"] = dis.nonfinite_frac

        ok = _finite(*finite) if finite else jnp.array(True)
        updated = state._replace(policy=policy, policy_opt=policy_opt, critic=critic,
                                 critic_opt=critic_opt, baseline=baseline)
        new = jax.tree.map(lambda a, b: jnp.where(ok, a, b), updated, state)
        new = new._replace(step=state.step + 1,
                           version=state.version + int(update_policy),
                           rng=jax.random.key_data(next_key))
        metrics["skipped"] = (~ok).astype(jnp.float32)
        return new, metrics
