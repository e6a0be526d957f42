"""The learner's state (`TrainState`): what it holds, what it starts as, and where each part lives
on a mesh (`StateFactory`).

The state is a pytree of arrays (parameters as plain nested dicts, Optax states, counters, the
running-mean baseline, an RNG key): what `checkpoint` saves, donated to the step
(`steps.Trainer`). On a mesh, where the step keeps each part is decided once, here, and every
state the step sees is placed so.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


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


class StateFactory:
    """Makes `TrainState`s from the initial parameters: fresh ones to train (`fresh`), abstract
    ones to compile for (`abstract`), and given ones (e.g. restored) placed where the step keeps
    them (`place`).

    Args:
      policy, critic: the initial parameters as nested dicts (critic None without one); on a
        mesh, each leaf's `NamedSharding` is where the state keeps that parameter.
      policy_tx, critic_tx: their Optax transformations (critic_tx None without a critic).
      baseline: `() -> the advantage estimator's state at step 0` (the running-mean baseline;
        None for an estimator that carries none).
      mesh: the device mesh (None: the default device).
    """

    def __init__(self, policy, critic, *, policy_tx: optax.GradientTransformation,
                 critic_tx: optax.GradientTransformation | None, baseline: Callable[[], Any],
                 mesh=None):
        self._initial_policy = policy
        self._initial_critic = critic
        self._policy_tx = policy_tx
        self._critic_tx = critic_tx
        self._baseline = baseline
        self._mesh = mesh
        # On a mesh, where the step keeps each part of the state, decided here once: every state
        # the step sees is placed so (`place`), and the step leaves it so.
        self.shardings = None if mesh is None else self._decide_shardings()

    def fresh(self, seed: int) -> TrainState:
        """The state at step 0, in fresh buffers: the state is donated to the step, and the
        critic's backbone starts as the policy's (same arrays)."""
        return self._state_of(jax.tree.map(jnp.copy, self._initial_policy),
                              jax.tree.map(jnp.copy, self._initial_critic), seed=seed)

    def place(self, state: TrainState) -> TrainState:
        """`state` in `shardings` (unchanged without a mesh)."""
        if self._mesh is None:
            return state
        return jax.device_put(state, self.shardings)

    def abstract(self, seed: int = 0) -> TrainState:
        """The state's shapes, dtypes and (on a mesh) shardings, with no memory behind them."""
        state = jax.eval_shape(partial(self._state_of, seed=seed), self._initial_policy,
                               self._initial_critic)
        if self._mesh is None:
            return state
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state, self.shardings)

    def _state_of(self, policy, critic, *, seed: int) -> TrainState:
        return TrainState(
            step=jnp.zeros((), jnp.int32), version=jnp.zeros((), jnp.int32),
            policy=policy, policy_opt=self._policy_tx.init(policy),
            critic=critic, critic_opt=None if critic is None else self._critic_tx.init(critic),
            baseline=self._baseline(), rng=jax.random.key_data(jax.random.key(seed)))

    def _decide_shardings(self):
        """Where the step keeps the state on the mesh: parameters where the rules put them (the
        policy's as given, the critic's as copied from it), Optax moments with their parameter,
        everything else (counters, the baseline, the key) replicated."""
        state = jax.eval_shape(partial(self._state_of, seed=0), self._initial_policy,
                               self._initial_critic)
        given = {}  # parameter path -> its sharding
        for part, params in (("policy", self._initial_policy), ("critic", self._initial_critic)):
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
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
