"""The Qwen3-MoE / Qwen3 decoder in Flax NNX, with policy (LM) and critic (value) heads.

Dimension legend (array names end in these letters, einsum strings use them):
  B batch            T query tokens        S key tokens (cache slots)
  D hidden (embed)   N query heads         K key/value heads      G = N / K query heads per K
  H head dim         F MLP hidden          E experts              A experts per token (top-k)
  V vocabulary       C expert capacity     X tokens flattened (B * T)

Parameters are stored [in, out] and carry logical axis names (`out_sharding` metadata) only; the
mesh and the logical-to-mesh rules come from the config (`sao_jax.train.sharding`).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from sao_jax.models.attention import Segments, blockwise_attention
from sao_jax.models.config import ModelConfig


def _named(value, axes) -> nnx.Param:
    """A parameter carrying logical axis names only.

    Placing it on a mesh is the caller's job (eval_shape -> shardings -> jit(init,
    out_shardings=...)), so modules never need a mesh to be built. Flax's eager sharding, which
    would want one, is switched off here, per call: the setting is thread-local, and engines build
    models on worker threads.
    """
    with nnx.use_eager_sharding(False):
        return nnx.Param(value, out_sharding=axes)


def _param(rngs: nnx.Rngs, shape, axes, dtype, scale: float | None = None) -> nnx.Param:
    """A normal(0, scale) parameter (scale defaults to 1/sqrt(fan_in)) with logical axis names."""
    fan_in = shape[0] if len(shape) < 3 or axes[0] != "expert" else shape[1]
    std = scale if scale is not None else 1.0 / math.sqrt(fan_in)
    return _named(std * jax.random.normal(rngs.params(), shape, dtype), axes)


class RMSNorm(nnx.Module):
    """`x / sqrt(mean(x^2) + eps) * scale`, in float32, cast back before the scale (as HF)."""

    def __init__(self, dim: int, eps: float, dtype, axis_name: str = "norm"):
        self.scale = _named(jnp.ones((dim,), dtype), (axis_name,))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


def rope(x_BxTxNxH, positions_BxT, theta: float):
    """Rotary embedding as Hugging Face applies it: halves rotated, `cat(freqs, freqs)` layout."""
    head_dim = x_BxTxNxH.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs_BxTxh = positions_BxT[..., None].astype(jnp.float32) * inv_freq
    angles = jnp.concatenate([freqs_BxTxh, freqs_BxTxh], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x_BxTxNxH.dtype), jnp.sin(angles).astype(x_BxTxNxH.dtype)
    first, second = jnp.split(x_BxTxNxH, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return x_BxTxNxH * cos + rotated * sin


class KVCache(NamedTuple):
    """One layer's keys and values by slot; `length_B` slots of each row are filled."""

    k_BxSxKxH: jax.Array
    v_BxSxKxH: jax.Array


def empty_caches(cfg: ModelConfig, batch: int, slots: int, dtype) -> tuple[KVCache, ...]:
    """Zeroed KV caches for decoding `batch` rows of up to `slots` tokens, one per layer (the
    per-layer layout: decoding needs `scan_layers=False`)."""
    shape = (batch, slots, cfg.num_kv_heads, cfg.head_dim)
    return tuple(KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                 for _ in range(cfg.num_layers))


class Attention(nnx.Module):
    """Grouped-query attention with per-head q/k RMSNorm and RoPE (Qwen3)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Projection(rngs, (d, n, h), ("embed", "q_heads", "head_dim"), dtype)
        self.k_proj = Projection(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
        self.v_proj = Projection(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
        self.o_proj = Projection(rngs, (n, h, d), ("q_heads", "head_dim", "embed"), dtype,
                                 fan_in=n * h)
        self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, "head_dim")
        self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, "head_dim")
        self.num_kv_heads, self.head_dim, self.rope_theta = k, h, cfg.rope_theta
        self.attention_block = cfg.attention_block

    def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, cache: KVCache | None = None,
                 slots_BxT=None):
        """Attends from T new tokens to S keys: themselves, or the cache after writing them.

        Args:
          x_BxTxD: hidden states of the new tokens.
          positions_BxT: their positions (RoPE).
          mask_BxTxS: true where query t may attend key s (causality and padding included);
            or `Segments` (no cache): blockwise attention, causal within each segment.
          cache: keys/values by slot, or None (keys are the new tokens themselves, S = T).
          slots_BxT: cache slot of each new token (required with a cache).

        Returns:
          `(out_BxTxD, cache)` with the new tokens' keys/values written into the cache.
        """
        q_BxTxNxH = self.q_norm(jnp.einsum("btd,dnh->btnh", x_BxTxD, self.q_proj.kernel[...]))
        k_BxTxKxH = self.k_norm(jnp.einsum("btd,dkh->btkh", x_BxTxD, self.k_proj.kernel[...]))
        v_BxTxKxH = jnp.einsum("btd,dkh->btkh", x_BxTxD, self.v_proj.kernel[...])
        q_BxTxNxH = rope(q_BxTxNxH, positions_BxT, self.rope_theta)
        k_BxTxKxH = rope(k_BxTxKxH, positions_BxT, self.rope_theta)
        if cache is None:
            k_BxSxKxH, v_BxSxKxH = k_BxTxKxH, v_BxTxKxH
        else:
            rows_Bx1 = jnp.arange(x_BxTxD.shape[0])[:, None]
            k_BxSxKxH = cache.k_BxSxKxH.at[rows_Bx1, slots_BxT].set(
                k_BxTxKxH.astype(cache.k_BxSxKxH.dtype))
            v_BxSxKxH = cache.v_BxSxKxH.at[rows_Bx1, slots_BxT].set(
                v_BxTxKxH.astype(cache.v_BxSxKxH.dtype))
            cache = KVCache(k_BxSxKxH, v_BxSxKxH)
        b, t, n, h = q_BxTxNxH.shape
        if isinstance(mask_BxTxS, Segments):  # blockwise: no [T, S] array (models.attention)
            out_BxTxNxH = blockwise_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH,
                                              mask_BxTxS.ids_BxT, block=self.attention_block)
            return jnp.einsum("btnh,nhd->btd", out_BxTxNxH, self.o_proj.kernel[...]), cache
        q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, self.num_kv_heads, n // self.num_kv_heads, h)
        scores_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH,
                                      preferred_element_type=jnp.float32) / math.sqrt(h)
        scores_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], scores_BxKxGxTxS, -jnp.inf)
        probs = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(v_BxSxKxH.dtype)
        out_BxTxKxGxH = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxSxKxH)
        out_BxTxNxH = out_BxTxKxGxH.reshape(b, t, n, h)
        return jnp.einsum("btnh,nhd->btd", out_BxTxNxH, self.o_proj.kernel[...]), cache


class Projection(nnx.Module):
    """A bias-free weight `kernel` of any rank, applied by the caller's einsum."""

    def __init__(self, rngs, shape, axes, dtype, fan_in: int | None = None):
        scale = None if fan_in is None else 1.0 / math.sqrt(fan_in)
        self.kernel = _param(rngs, shape, axes, dtype, scale)


class MLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Projection(rngs, (d, f), ("embed", "mlp"), dtype)
        self.up_proj = Projection(rngs, (d, f), ("embed", "mlp"), dtype)
        self.down_proj = Projection(rngs, (f, d), ("mlp", "embed"), dtype)

    def __call__(self, x_BxTxD):
        gate = jnp.einsum("btd,df->btf", x_BxTxD, self.gate_proj.kernel[...])
        up = jnp.einsum("btd,df->btf", x_BxTxD, self.up_proj.kernel[...])
        return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.down_proj.kernel[...])


class MoE(nnx.Module):
    """Softmax router, top-A experts (optionally renormalised), SwiGLU experts.

        p = softmax(x W_router);  {e_1..e_A} = top-A of p;  w_a = p_{e_a} (/ sum_a p_{e_a})
        y = sum_a w_a * down_{e_a}(silu(gate_{e_a}(x)) * up_{e_a}(x))
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.router = Projection(rngs, (d, e), ("embed", None), dtype)
        self.gate_proj = _param(rngs, (e, d, f), ("expert", "embed", "mlp"), dtype)
        self.up_proj = _param(rngs, (e, d, f), ("expert", "embed", "mlp"), dtype)
        self.down_proj = _param(rngs, (e, f, d), ("expert", "mlp", "embed"), dtype)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.capacity_factor = cfg.capacity_factor
        self.token_chunk = cfg.moe_token_chunk

    def route(self, x_XxD, router_DxE=None):
        """Router logits `[X, E]` (float32), top-A weights `[X, A]` and expert ids `[X, A]`."""
        router_DxE = self.router.kernel[...] if router_DxE is None else router_DxE
        logits_XxE = jnp.einsum("xd,de->xe", x_XxD, router_DxE,
                                preferred_element_type=jnp.float32)
        probs_XxE = jax.nn.softmax(logits_XxE, axis=-1)
        weights_XxA, experts_XxA = jax.lax.top_k(probs_XxE, self.top_k)
        if self.norm_topk_prob:
            weights_XxA = weights_XxA / jnp.sum(weights_XxA, axis=-1, keepdims=True)
        return logits_XxE, weights_XxA.astype(x_XxD.dtype), experts_XxA

    def __call__(self, x_BxTxD, dispatch: str, sharding=None):
        """Returns `(y_BxTxD, router_logits_XxE)`; `dispatch` as `ModelConfig.moe_dispatch`.

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

        def tokens(x_bxTxD, router_DxE, params):
            x_XxD = x_bxTxD.reshape(-1, d)
            logits_XxE, weights_XxA, experts_XxA = self.route(x_XxD, router_DxE)
            y_XxD = experts(x_XxD, weights_XxA, experts_XxA, params)
            return y_XxD.reshape(x_bxTxD.shape), logits_XxE

        if sharding is None:
            return tokens(x_BxTxD, self.router.kernel[...], params)
        rows = PartitionSpec(sharding.spec[0] if len(sharding.spec) else None)
        return jax.shard_map(tokens, mesh=sharding.mesh,
                             in_specs=(rows, PartitionSpec(), PartitionSpec()),
                             out_specs=(rows, rows))(x_BxTxD, self.router.kernel[...], params)


def _chunked_experts(dispatch: str, capacity_factor: float, chunk: int, x_XxD, weights_XxA,
                     experts_XxA, params):
    """`_EXPERTS[dispatch]` over the tokens `chunk` at a time (a `lax.map` of a rematerialised
    body, so that the backward pass holds one chunk's dispatch, not all of them; 0: at once).
    The chunk count is the smallest that divides the tokens. "capacity" counts its capacity per
    chunk."""
    x_n = x_XxD.shape[0]
    fn = partial(_EXPERTS[dispatch], params=params, capacity_factor=capacity_factor)
    if not chunk or x_n <= chunk:
        return fn(x_XxD, weights_XxA, experts_XxA)
    count = next(k for k in range(-(-x_n // chunk), x_n + 1) if x_n % k == 0)
    chunks = [z.reshape(count, x_n // count, *z.shape[1:])
              for z in (x_XxD, weights_XxA, experts_XxA)]
    y = jax.lax.map(jax.checkpoint(lambda c: fn(*c)), chunks)
    return y.reshape(x_XxD.shape)


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


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.is_moe_layer(layer):
            self.moe = MoE(cfg, rngs)
        else:
            self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, dispatch, cache=None, slots_BxT=None,
                 hidden_sharding=None):
        attn_out, cache = self.attn(self.input_norm(x_BxTxD), positions_BxT, mask_BxTxS, cache,
                                    slots_BxT)
        x_BxTxD = x_BxTxD + attn_out
        h_BxTxD = self.post_attn_norm(x_BxTxD)
        if hasattr(self, "moe"):
            mlp_out, router_logits = self.moe(h_BxTxD, dispatch, hidden_sharding)
        else:
            mlp_out, router_logits = self.mlp(h_BxTxD), None
        return x_BxTxD + mlp_out, router_logits, cache


class BackboneOutput(NamedTuple):
    hidden_BxTxD: jax.Array  # after the final norm
    router_logits: tuple  # [X, E] float32 arrays, one per MoE layer ([R, X, E] when scanned)
    caches: tuple | None  # per layer, when decoding with a cache


def causal_mask(positions_BxT, valid_BxS=None, key_positions_BxS=None):
    """`[B, T, S]`: query t sees key s when s is not later than t and is a valid token."""
    keys = positions_BxT if key_positions_BxS is None else key_positions_BxS
    mask = keys[:, None, :] <= positions_BxT[:, :, None]
    if valid_BxS is not None:
        mask = mask & valid_BxS[:, None, :]
    return mask


def _constrain(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


REMAT = {"full": None, "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _stack(layers: list[DecoderLayer]) -> DecoderLayer:
    """One module of `layers` (alike) whose every parameter has a leading "layers" axis."""
    splits = [nnx.split(layer) for layer in layers]
    graphdef = splits[0][0]

    def stacked(*variables):
        first = variables[0]
        axes = ("layers", *(first.get_metadata().get("out_sharding") or ()))
        with nnx.use_eager_sharding(False):
            return first.replace(jnp.stack([v.get_value() for v in variables]),
                                 out_sharding=axes)

    state = jax.tree.map(stacked, *(state for _, state in splits),
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


class LayerStack(nnx.Module):
    """`repeats` scan steps over a block of `period` decoder layers (`ModelConfig.layer_groups`):
    `block[j]` holds layers `first + r * period + j` stacked along a leading "layers" axis, and
    `lax.scan` runs r, so the compiled program holds the block once whatever `repeats` is."""

    def __init__(self, layers: list[DecoderLayer], period: int, remat: str):
        self.block = nnx.List([_stack(layers[j::period]) for j in range(period)])
        self.remat = remat

    def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, dispatch, hidden_sharding=None):
        graphdef, state = nnx.split(self.block)

        def body(x_BxTxD, state_r):
            x_BxTxD = _constrain(x_BxTxD, hidden_sharding)
            logits = []
            for layer in nnx.merge(graphdef, state_r):
                x_BxTxD, layer_logits, _ = layer(x_BxTxD, positions_BxT, mask_BxTxS, dispatch,
                                                 hidden_sharding=hidden_sharding)
                if layer_logits is not None:
                    logits.append(layer_logits)
            return x_BxTxD, tuple(logits)

        if self.remat == "none":
            return jax.lax.scan(body, x_BxTxD, state)
        body = jax.checkpoint(body, policy=REMAT.get(self.remat))
        repeats = jax.tree.leaves(state)[0].shape[0]
        group = _nested_group(repeats) if self.remat == "nested" else 1
        if group == 1:
            return jax.lax.scan(body, x_BxTxD, state)

        # Nested: an outer scan over groups of `group` repeats, each group rematerialised as a
        # whole, keeps only the groups' inputs through the forward pass; the backward pass
        # recomputes one group at a time, keeping its repeats' inputs (about 2 sqrt(repeats)
        # saved inputs instead of repeats, for one more forward pass).
        @jax.checkpoint
        def group_body(x_BxTxD, state_g):
            return jax.lax.scan(body, x_BxTxD, state_g)

        grouped = jax.tree.map(lambda a: a.reshape(repeats // group, group, *a.shape[1:]), state)
        x_BxTxD, logits = jax.lax.scan(group_body, x_BxTxD, grouped)
        return x_BxTxD, jax.tree.map(lambda a: a.reshape(repeats, *a.shape[2:]), logits)


def _nested_group(repeats: int) -> int:
    """The divisor of `repeats` nearest its square root (remat "nested"'s group size)."""
    return min((d for d in range(1, repeats + 1) if repeats % d == 0),
               key=lambda d: (abs(d - math.sqrt(repeats)), d))


class Transformer(nnx.Module):
    """Token embedding, decoder layers, final norm: `input_ids [B, T]` -> hidden `[B, T, D]`.

    `layers` holds a `DecoderLayer` per layer, or with `cfg.scan_layers` a `LayerStack` per
    layer group; both are built from the same per-layer initialisation, in layer order, so a
    seed gives the same weights in either layout (`stack_layers` / `unstack_layers` convert).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, rngs)
        layers = [DecoderLayer(cfg, i, rngs) for i in range(cfg.num_layers)]
        if cfg.scan_layers:
            layers = [LayerStack(layers[first:first + period * repeats], period, cfg.remat)
                      for first, period, repeats in cfg.layer_groups()]
        self.layers = nnx.List(layers)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def __call__(self, input_ids_BxT, positions_BxT=None, mask_BxTxS=None, *,
                 dispatch: str | None = None, caches=None, slots_BxT=None,
                 segments_BxT=None, hidden_sharding=None) -> BackboneOutput:
        """`segments_BxT` (instead of a mask, no cache): packed rows, each query attending the
        earlier tokens of its own segment; None with no mask: causal over the whole row. With
        `cfg.attention == "blockwise"` these run blockwise, else as a dense mask.

        `hidden_sharding` (inside a sharded jit): the `[B, T, D]` hidden states' sharding,
        imposed after the embedding and between layers, e.g. rows split over the batch axes.
        Without it XLA may follow the fsdp-split embedding table and split D instead, holding
        every row on every device (16x the activations of `experiments/swe.py`)."""
        b, t = input_ids_BxT.shape
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(t), (b, t))
        if mask_BxTxS is None and caches is None and self.cfg.attention == "blockwise":
            mask_BxTxS = Segments(jnp.zeros((b, t), jnp.int32) if segments_BxT is None
                                  else segments_BxT)
        elif mask_BxTxS is None:
            mask_BxTxS = causal_mask(positions_BxT)
            if segments_BxT is not None:
                mask_BxTxS = mask_BxTxS & (segments_BxT[:, None, :] == segments_BxT[:, :, None])
        dispatch = dispatch or self.cfg.moe_dispatch
        x_BxTxD = _constrain(self.embed.embedding[...][input_ids_BxT], hidden_sharding)
        router_logits, new_caches = [], []
        if self.cfg.scan_layers:
            if caches is not None:
                raise ValueError("decoding with a KV cache needs the per-layer layout "
                                 "(scan_layers=False): convert with unstack_layers(model).")
            for stack in self.layers:
                x_BxTxD, logits = stack(x_BxTxD, positions_BxT, mask_BxTxS, dispatch,
                                        hidden_sharding)
                router_logits.extend(logits)
            return BackboneOutput(self.final_norm(x_BxTxD), tuple(router_logits), None)
        for i, layer in enumerate(self.layers):
            cache = None if caches is None else caches[i]
            x_BxTxD, logits, cache = layer(_constrain(x_BxTxD, hidden_sharding), positions_BxT,
                                           mask_BxTxS, dispatch, cache, slots_BxT,
                                           hidden_sharding)
            if logits is not None:
                router_logits.append(logits)
            new_caches.append(cache)
        return BackboneOutput(self.final_norm(x_BxTxD), tuple(router_logits),
                              None if caches is None else tuple(new_caches))


def _scanned_places(cfg: ModelConfig) -> dict[int, tuple[int, int, int]]:
    """Layer i -> `(group, repeat, position)`: its place in the scanned layout."""
    return {first + r * period + j: (g, r, j)
            for g, (first, period, repeats) in enumerate(cfg.layer_groups())
            for r in range(repeats) for j in range(period)}


def _relayout(model, cfg: ModelConfig):
    """A copy of `model` (CausalLM or ValueModel) built for `cfg`, which differs from its own
    config only in `scan_layers` / `remat`: every parameter moves to its place in the other
    layout (`backbone/layers/<i>/...` <-> `backbone/layers/<g>/block/<j>/...`, stacked over r).
    Works on concrete arrays and inside jit."""
    source = dict(nnx.to_flat_state(nnx.state(model)))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: type(model)(cfg, nnx.Rngs(0))))
    places = _scanned_places(cfg)
    stacked_from = {}  # scanned (g, j) -> the layers stacked there, in repeat order
    for i in sorted(places):
        g, _, j = places[i]
        stacked_from.setdefault((g, j), []).append(i)
    flat = []
    for path, variable in nnx.to_flat_state(abstract):
        if path[:2] != ("backbone", "layers"):
            value = source[path].get_value()
        elif cfg.scan_layers:  # (backbone, layers, g, block, j, *rest) <- layers i, stacked
            g, _, j, *rest = path[2:]
            value = jnp.stack([source[("backbone", "layers", i, *rest)].get_value()
                               for i in stacked_from[(g, j)]])
        else:  # (backbone, layers, i, *rest) <- the r-th slice of its stacked parameter
            i, *rest = path[2:]
            g, r, j = places[i]
            value = source[("backbone", "layers", g, "block", j, *rest)].get_value()[r]
        flat.append((path, variable.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def reconfigure(model, cfg: ModelConfig):
    """`model` (CausalLM or ValueModel) with config `cfg`, which may differ from its own in the
    fields that hold no parameters (layout, remat, dispatch, attention): the same weights, moved
    to the other layout when `scan_layers` differs. `model` itself when nothing differs."""
    if cfg == model.cfg:
        return model
    if cfg.scan_layers != model.cfg.scan_layers:
        return _relayout(model, cfg)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: type(model)(cfg, nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


def stack_layers(model, remat: str = "none"):
    """`model` (CausalLM or ValueModel) in the scanned layout (`ModelConfig.scan_layers`), with
    `remat`: the same weights, each layer group's parameters stacked. A copy."""
    return reconfigure(model, model.cfg.replace(scan_layers=True, remat=remat))


def unstack_layers(model):
    """`model` in the per-layer layout (what decoding with a KV cache needs). A copy, or
    `model` itself if it is per-layer already."""
    if not model.cfg.scan_layers:
        return model
    return _relayout(model, model.cfg.replace(scan_layers=False, remat="none"))


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, dtype, rngs: nnx.Rngs):
        self.embedding = _param(rngs, (vocab, dim), ("vocab", "embed"), dtype, scale=1.0)


class CausalLM(nnx.Module):
    """The policy: backbone and LM head (tied to the embedding when the config says so).

    `model(input_ids)` returns logits `[B, T, V]` float32; `logits[:, t]` predicts token t + 1.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.backbone = Transformer(cfg, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Projection(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                      jnp.dtype(cfg.param_dtype))

    def head_weight(self):
        """`[D, V]` output projection."""
        if self.cfg.tie_word_embeddings:
            return self.backbone.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def __call__(self, input_ids_BxT, positions_BxT=None, mask_BxTxS=None, *, dispatch=None,
                 segments_BxT=None, hidden_sharding=None):
        out = self.backbone(input_ids_BxT, positions_BxT, mask_BxTxS,
                            dispatch=dispatch or self.cfg.logprob_dispatch,
                            segments_BxT=segments_BxT, hidden_sharding=hidden_sharding)
        return jnp.einsum("btd,dv->btv", out.hidden_BxTxD, self.head_weight(),
                          preferred_element_type=jnp.float32)


class ValueModel(nnx.Module):
    """The critic: the same backbone and a scalar value head.

    `model(input_ids)` returns values `[B, T]` float32 aligned with the policy's logits:
    `values[:, t]` is read from the hidden state at t, the one that predicts token t + 1, so it is
    V(state just before token t + 1) (docs/algorithm.md, "Notation").
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.backbone = Transformer(cfg, rngs)
        self.value_head = ValueHead(cfg, rngs)

    @classmethod
    def from_policy(cls, policy: CausalLM) -> ValueModel:
        """A critic initialised from the policy's checkpoint: a copy of its backbone, zero head.

        The zero head makes the initial values 0 everywhere (docs/algorithm.md §3: the critic starts
        from the same checkpoint; value pretraining, if any, fits the head and the trainable
        backbone parts from there).
        """
        critic = nnx.eval_shape(lambda: cls(policy.cfg, nnx.Rngs(0)))
        critic.backbone = nnx.clone(policy.backbone)
        critic.value_head = ValueHead(policy.cfg, None)
        return critic

    def __call__(self, input_ids_BxT, positions_BxT=None, mask_BxTxS=None, *, dispatch=None,
                 segments_BxT=None, hidden_sharding=None):
        out = self.backbone(input_ids_BxT, positions_BxT, mask_BxTxS, dispatch=dispatch,
                            segments_BxT=segments_BxT, hidden_sharding=hidden_sharding)
        return self.value_head(out.hidden_BxTxD), out.router_logits


class ValueHead(nnx.Module):
    """`V = h w + b`, initialised to zero (needs no randomness)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | None = None):
        dtype = jnp.dtype(cfg.param_dtype)
        self.kernel = _named(jnp.zeros((cfg.hidden_size, 1), dtype), ("embed", None))
        self.bias = _named(jnp.zeros((1,), dtype), (None,))

    def __call__(self, hidden_BxTxD):
        return (jnp.einsum("btd,do->bto", hidden_BxTxD, self.kernel[...],
                           preferred_element_type=jnp.float32) + self.bias[...])[..., 0]


def load_balancing_loss(router_logits, top_k: int, token_mask_X=None):
    """Switch-Transformer load-balancing loss over all MoE layers, as Hugging Face computes it.

        f_e = mean over tokens and choices of 1[token routed to e]    (per top-k choice)
        P_e = mean over tokens of softmax(router logits)_e
        loss = E * sum_{a, e} f_{a,e} * P_e

    Args:
      router_logits: tuple of `[X, E]` arrays, one per MoE layer, or `[R, X, E]` (R layers of a
        scanned group); concatenated over layers (the loss does not depend on their order).
      top_k: experts per token.
      token_mask_X: optional `[X]` bool, tokens that count (e.g. not padding), repeated per layer.

    Returns:
      A float32 scalar (0 for a dense model).
    """
    if not router_logits:
        return jnp.zeros((), jnp.float32)
    e = router_logits[0].shape[-1]
    logits_LXxE = jnp.concatenate([x.reshape(-1, e) for x in router_logits], axis=0)
    probs = jax.nn.softmax(logits_LXxE.astype(jnp.float32), axis=-1)
    _, chosen = jax.lax.top_k(probs, top_k)
    routed = jax.nn.one_hot(chosen, e, dtype=jnp.float32)  # [LX, A, E]
    if token_mask_X is None:
        f = routed.mean(axis=0)
        p = probs.mean(axis=0)
    else:
        w = jnp.tile(token_mask_X.astype(jnp.float32), logits_LXxE.shape[0] //
                     token_mask_X.shape[0])
        f = jnp.sum(routed * w[:, None, None], axis=0) / jnp.maximum(w.sum(), 1)
        p = jnp.sum(probs * w[:, None], axis=0) / jnp.maximum(w.sum(), 1)
    return e * jnp.sum(f * p[None, :])
