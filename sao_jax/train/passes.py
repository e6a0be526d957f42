"""The learner step's model passes, a micro-batch at a time: the policy's log-probs, the critic's
values, and gradients accumulated over micro-batches.

    passes = ModelPasses(policy_graph, critic_graph, cfg, microbatches=4)
    loss, aux, grads = passes.accumulate(loss_fn, params, (inputs, returns, mask))

`StepConfig.microbatches` cuts a batch's rows into chunks; a pass with gradients (`accumulate`)
or without (`per_microbatch`) runs under one `lax.scan` / `lax.map` over them, so the compiled
step holds one micro-batch's program and activations whatever their number. The policy losses
get these passes as `policy_losses.PolicyPasses` and the critic phase as its `values_fn` and
`update_fn` (`steps.LearnerStep`); nothing else runs the models in the step.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models import route_agreement, token_logprobs
from sao_jax.models.params import cast_floating
from sao_jax.train.batch import Batch, Packing, batch_rows, model_inputs, model_rows, model_targets


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
    """One aux leaf of `ModelPasses.accumulate`, stacked over its n chunks: a scalar `[n]` (a
    metric) as the chunks' mean, a per-row array `[n, B / n, ...]` (log-probs) in row order."""
    return jnp.mean(x, axis=0) if x.ndim == 1 else _row_order(x)


class PolicyPass(NamedTuple):
    """What one pass of the policy over a batch gives (`ModelPasses.policy_pass`), each
    `[B, L - 1]` in the batch's layout."""

    logp: jax.Array  # the log-probs of the batch's tokens
    entropy: jax.Array | None = None  # the policy's entropy at each position, when asked
    # Where the batch carries the engines' routes: `models.route_agreement` of the tokens the
    # log-probs condition on (1 the pass's own router chose the engine's experts, 0 others,
    # -1 unreported); None without routes
    routed_same: jax.Array | None = None


class ModelPasses:
    """The policy's and the critic's passes over a batch, and the micro-batching they run under.

    Args:
      policy_graph, critic_graph: the models' `nnx.split` graphs (critic None without one); the
        passes take their parameters as nested dicts (`TrainState.policy`, `.critic`).
      cfg: the model config (its `logprob_dispatch` and `moe_dispatch`).
      microbatches: row chunks per pass (`StepConfig.microbatches`).
      batch_sharding: `ndim -> the sharding of a batch array of that rank` on the mesh
        (`sharding.batch_sharding`); None without one.
      replay: the policy's passes route the tokens of a batch that carries the engines'
        routes (`Batch.routes`) to those experts (routing replay); False: they route
        themselves and only compare (`PolicyPass.routed_same`).
      compute_dtype: the dtype the passes compute in: the parameters (the learner's master
        copy, float32 say) are cast to it on the way in, so their gradients come back in the
        master dtype; None: the parameters' own. The whole tree is cast at once: cast inside
        the layers' scan instead, one layer at a time, the 30B step (`make plan EXP=swe`)
        needed 3.9 GiB more per device (its gradients then pile up in float32 through the
        scan).
    """

    def __init__(self, policy_graph, critic_graph, cfg, *, microbatches: int,
                 batch_sharding: Callable | None = None, replay: bool = True,
                 compute_dtype=None):
        self._policy_graph = policy_graph
        self._critic_graph = critic_graph
        self.cfg = cfg
        self.microbatches = microbatches
        self._batch_sharding = batch_sharding
        self.replay = replay
        self.compute_dtype = compute_dtype

    def _model(self, graph, params):
        """The model of `graph` holding `params` in the compute dtype."""
        if self.compute_dtype is not None:
            params = cast_floating(params, self.compute_dtype)
        return nnx.merge(graph, params)

    @property
    def row_sharding(self):
        """The `[B, T]` arrays' row sharding on the mesh (None without one): the Pallas
        kernels run per shard on it, as the mesh's platform's variant."""
        return None if self._batch_sharding is None else self._batch_sharding(2)

    @property
    def hidden_sharding(self):
        """The hidden states' sharding on the mesh: rows over the batch axes (None without
        one)."""
        return None if self._batch_sharding is None else self._batch_sharding(3)

    def policy_pass(self, params, inputs, entropy: bool = False) -> PolicyPass:
        """The policy's log-probs of the batch's tokens, its entropy with `entropy`, and where
        `inputs` carry the engines' routes, its routing against theirs; `inputs` is
        `batch.tokens` or `batch.packing` (`batch.model_inputs`)."""
        model = self._model(self._policy_graph, params)
        ids, positions, segments, routes = model_rows(inputs)
        out = model.backbone(ids, positions, segments_BxT=segments,
                             dispatch=self.cfg.logprob_dispatch,
                             hidden_sharding=self.hidden_sharding,
                             replay_BxTxLxA=routes if self.replay else None)
        targets = inputs.targets if isinstance(inputs, Packing) else model_targets(inputs)
        logp = token_logprobs(out.hidden_BxTxD, model.head_weight(), targets,
                              return_entropy=entropy)
        logp, ent = logp if entropy else (logp, None)
        same = None
        if routes is not None:
            same = batch_rows(route_agreement(self.cfg, out.router_logits, routes), inputs)
        return PolicyPass(batch_rows(logp, inputs),
                          None if ent is None else batch_rows(ent, inputs), same)

    def logp(self, params, inputs):
        """`[B, L - 1]` the policy's log-probs of the batch's tokens (`policy_pass`)."""
        return self.policy_pass(params, inputs).logp

    def critic_values(self, params, inputs):
        """`[B, L - 1]` values (see `logp` for `inputs`; the critic routes every token itself:
        its experts are not the engine's policy's)."""
        ids, positions, segments, _ = model_rows(inputs)
        values, _ = self._model(self._critic_graph, params)(
            ids, positions, segments_BxT=segments, dispatch=self.cfg.moe_dispatch,
            hidden_sharding=self.hidden_sharding)
        return batch_rows(values, inputs)

    def values(self, params, inputs, last_index):
        """`[B, L - 1]` values and `[B]` the value at each row's `last_index`."""
        values = self.critic_values(params, inputs)
        last = jnp.take_along_axis(values, last_index[:, None], axis=1)[:, 0]
        return values, last

    def accumulate(self, loss_fn, params, arrays):
        """`(loss, aux, grads)` of `loss_fn(params, *chunk)` summed over row chunks, under a
        `lax.scan` (the compiled step holds one chunk's program whatever their number). Of the
        aux, scalars (metrics) come back as the chunks' mean and per-row arrays (rows first:
        log-probs) in row order."""
        n = self.microbatches
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

    def per_microbatch(self, fn, *arrays):
        """`fn(*arrays)` for a forward pass without gradients, run one micro-batch at a time
        (a `lax.map` over `accumulate`'s row chunks) and put back in row order: the compiled
        step holds one micro-batch's activations, as the updates do, not the whole batch's."""
        n = self.microbatches
        if n == 1:
            return fn(*arrays)
        out = jax.lax.map(lambda chunk: fn(*chunk), _row_chunks(arrays, n))
        return jax.tree.map(_row_order, out)

    def start_pass(self, params, batch: Batch) -> PolicyPass:
        """`policy_pass` over `batch` on its own (no gradients, a micro-batch at a time): the
        policy at the start of the step, where no policy loss pass gives it."""
        return self.per_microbatch(partial(self.policy_pass, params), model_inputs(batch))
