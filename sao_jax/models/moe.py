"""Mixture-of-experts layers: the softmax router, the SwiGLU experts and the three ways of
dispatching tokens to them (`ModelConfig.moe_dispatch`).

Array names follow the dimension legend of `transformer.py`.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from sao_jax.models.config import ModelConfig
from sao_jax.models.params import Projection, normal_param


class MoE(nnx.Module):
    """Softmax router, top-A experts (optionally renormalised), SwiGLU experts.

        p = softmax(x W_router);  {e_1..e_A} = top-A of p;  w_a = p_{e_a} (/ sum_a p_{e_a})
        y = sum_a w_a * down_{e_a}(silu(gate_{e_a}(x)) * up_{e_a}(x))
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.router = Projection(rngs, (d, e), ("embed", None), dtype)
        self.gate_proj = normal_param(rngs, (e, d, f), ("expert", "embed", "mlp"), dtype)
        self.up_proj = normal_param(rngs, (e, d, f), ("expert", "embed", "mlp"), dtype)
        self.down_proj = normal_param(rngs, (e, f, d), ("expert", "mlp", "embed"), dtype)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.capacity_factor = cfg.capacity_factor
        self.token_chunk = cfg.moe_token_chunk

    def route(self, x_XxD, router_DxE=None, replay_XxA=None):
        """Router logits `[X, E]` (float32), top-A weights `[X, A]` and expert ids `[X, A]`.

        `replay_XxA` (routing replay): expert ids chosen elsewhere, by the inference engine
        that sampled these tokens, used in place of this router's top-A for each token whose
        row holds no negative id (-1: route it here). Their weights are this router's
        probabilities of them, renormalised as top-A's, so that the router still trains."""
        router_DxE = self.router.kernel[...] if router_DxE is None else router_DxE
        logits_XxE = jnp.einsum("xd,de->xe", x_XxD, router_DxE,
                                preferred_element_type=jnp.float32)
        probs_XxE = jax.nn.softmax(logits_XxE, axis=-1)
        weights_XxA, experts_XxA = expert_choices(probs_XxE, self.top_k)
        if replay_XxA is not None:
            replayed_Xx1 = jnp.all(replay_XxA >= 0, axis=-1, keepdims=True)
            experts_XxA = jnp.where(replayed_Xx1, replay_XxA.astype(experts_XxA.dtype),
                                    experts_XxA)
            weights_XxA = jnp.take_along_axis(probs_XxE, experts_XxA, axis=-1)
        if self.norm_topk_prob:
            weights_XxA = weights_XxA / jnp.sum(weights_XxA, axis=-1, keepdims=True)
        return logits_XxE, weights_XxA.astype(x_XxD.dtype), experts_XxA

    def __call__(self, x_BxTxD, dispatch: str, sharding=None, replay_BxTxA=None):
        """Returns `(y_BxTxD, router_logits_XxE)`; `dispatch` as `ModelConfig.moe_dispatch`,
        `replay_BxTxA` the expert ids to replay (`route`; None: this router's own).

        `sharding` (inside a sharded jit): the `[B, T, D]` hidden states' sharding, rows over
        the batch axes. Routing and experts then run per shard under `jax.shard_map`: each
        device routes its own rows' tokens and dispatches them to every expert, whose weights
        it gathers for the layer (as FSDP gathers any layer's). Left to XLA, the global sort of
        "ragged" (and top-A on some backends) gathers the whole micro-batch's assignments onto
        every device. Either way a shard's tokens go through the experts `token_chunk` at a
        time."""
        b, t, d = x_BxTxD.shape
        params = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        experts = partial(_chunked_experts, dispatch, self.capacity_factor, self.token_chunk)

        def tokens(x_bxTxD, router_DxE, params, replay_bxTxA=None):
            x_XxD = x_bxTxD.reshape(-1, d)
            replay_XxA = None if replay_bxTxA is None else replay_bxTxA.reshape(-1, self.top_k)
            logits_XxE, weights_XxA, experts_XxA = self.route(x_XxD, router_DxE, replay_XxA)
            y_XxD = experts(x_XxD, weights_XxA, experts_XxA, params)
            return y_XxD.reshape(x_bxTxD.shape), logits_XxE

        args = (x_BxTxD, self.router.kernel[...], params)
        if replay_BxTxA is not None:
            args += (replay_BxTxA,)
        if sharding is None:
            return tokens(*args)
        rows = PartitionSpec(sharding.spec[0] if len(sharding.spec) else None)
        in_specs = (rows, PartitionSpec(), PartitionSpec(), rows)[:len(args)]
        return jax.shard_map(tokens, mesh=sharding.mesh, in_specs=in_specs,
                             out_specs=(rows, rows))(*args)


def expert_choices(probs_XxE, top_k: int):
    """`(weights_XxA, experts_XxA)`: the top-A router probabilities and their expert ids (the
    choice the engines report for routing replay is this one, on the same probabilities)."""
    return jax.lax.top_k(probs_XxE, top_k)


def _chunked_experts(dispatch: str, capacity_factor: float, chunk: int, x_XxD, weights_XxA,
                     experts_XxA, params):
    """`_EXPERTS[dispatch]` over the tokens `chunk` at a time (a `lax.map` of a rematerialised
    body, so that the backward pass holds one chunk's dispatch, not all of them; 0: at once),
    in `chunk_layout(tokens, chunk)`: tokens padded up to whole chunks get zero routing weights
    and are dropped from the output. "capacity" counts its capacity per chunk (a padding token
    takes a slot of expert 0)."""
    x_n = x_XxD.shape[0]
    fn = partial(_EXPERTS[dispatch], params=params, capacity_factor=capacity_factor)
    if not chunk or x_n <= chunk:
        return fn(x_XxD, weights_XxA, experts_XxA)
    count, size = chunk_layout(x_n, chunk)
    pad = count * size - x_n
    chunks = [jnp.pad(z, ((0, pad),) + ((0, 0),) * (z.ndim - 1)).reshape(count, size,
                                                                          *z.shape[1:])
              for z in (x_XxD, weights_XxA, experts_XxA)]
    y = jax.lax.map(jax.checkpoint(lambda c: fn(*c)), chunks)
    return y.reshape(count * size, -1)[:x_n]


def chunk_layout(tokens: int, chunk: int) -> tuple[int, int]:
    """`(count, size)`: `tokens` in `count` chunks of `size` <= `chunk` tokens. The fewest
    chunks whose size divides the tokens, as long as that leaves chunks of at least half of
    `chunk`; else ceil(tokens / chunk) chunks and the last padded. (Dividing at any size, a
    prime number of tokens, such as a 131,072-token row's 131,071 inputs, went through the
    experts one token at a time.)"""
    count = -(-tokens // chunk)
    divides = next((k for k in range(count, 2 * count + 1) if tokens % k == 0), None)
    if divides is not None:
        return divides, tokens // divides
    return count, -(-tokens // count)


def _expert_mlp(x_ExCxD, params):
    gate_w, up_w, down_w = params
    gate = jnp.einsum("ecd,edf->ecf", x_ExCxD, gate_w)
    up = jnp.einsum("ecd,edf->ecf", x_ExCxD, up_w)
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, down_w)


def _dense(x_XxD, weights_XxA, experts_XxA, *, params, capacity_factor):
    """Every expert on every token, summed with the routing weights (zero for the unchosen)."""
    e = params[0].shape[0]
    combine_XxE = jnp.sum(weights_XxA[..., None] * jax.nn.one_hot(experts_XxA, e,
                                                                  dtype=x_XxD.dtype), axis=1)
    y_ExXxD = _expert_mlp(jnp.broadcast_to(x_XxD, (e, *x_XxD.shape)), params)
    return jnp.einsum("exd,xe->xd", y_ExXxD, combine_XxE)


def _ragged(x_XxD, weights_XxA, experts_XxA, *, params, capacity_factor):
    """Assignments sorted by expert, grouped matrix products (`lax.ragged_dot`): drop-free."""
    gate_w, up_w, down_w = params
    a = experts_XxA.shape[1]
    flat_expert = experts_XxA.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    token = order // a
    group_sizes_E = jnp.bincount(flat_expert, length=gate_w.shape[0]).astype(jnp.int32)
    xs = x_XxD[token]
    gate = jax.lax.ragged_dot(xs, gate_w, group_sizes_E)
    up = jax.lax.ragged_dot(xs, up_w, group_sizes_E)
    ys = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down_w, group_sizes_E)
    ys = ys * weights_XxA.reshape(-1)[order][:, None]
    return jnp.zeros_like(x_XxD).at[token].add(ys)


def _capacity(x_XxD, weights_XxA, experts_XxA, *, params, capacity_factor):
    """At most C tokens per expert, in token order; assignments past C contribute nothing."""
    x_n, a = experts_XxA.shape
    e = params[0].shape[0]
    capacity = max(1, math.ceil(capacity_factor * x_n * a / e))
    onehot_XAxE = jax.nn.one_hot(experts_XxA.reshape(-1), e, dtype=jnp.int32)
    slot_XA = jnp.sum((jnp.cumsum(onehot_XAxE, axis=0) - 1) * onehot_XAxE, axis=1)
    expert_XA = experts_XxA.reshape(-1)
    kept_XA = slot_XA < capacity
    token_XA = jnp.arange(x_n * a) // a
    # Gather: slot (e, c) holds token index, or x_n (an appended zero row) when empty.
    index_ExC = jnp.full((e, capacity), x_n, jnp.int32).at[
        jnp.where(kept_XA, expert_XA, e), slot_XA].set(token_XA, mode="drop")
    x_padded = jnp.concatenate([x_XxD, jnp.zeros((1, x_XxD.shape[1]), x_XxD.dtype)])
    y_ExCxD = _expert_mlp(x_padded[index_ExC], params)
    y_XAxD = y_ExCxD.at[expert_XA, jnp.minimum(slot_XA, capacity - 1)].get()
    y_XAxD = jnp.where(kept_XA[:, None], y_XAxD, 0.0) * weights_XxA.reshape(-1)[:, None]
    return jnp.sum(y_XAxD.reshape(x_n, a, -1), axis=1)


_EXPERTS = {"dense": _dense, "ragged": _ragged, "capacity": _capacity}
