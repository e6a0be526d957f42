"""The Qwen3-MoE / Qwen3 decoder in Flax NNX, with policy (LM) and critic (value) heads.

Dimension legend (array names end in these letters, einsum strings use them):
  B batch            T query tokens        S key tokens (cache slots)
  D hidden (embed)   N query heads         K key/value heads      G = N / K query heads per K
  H head dim         F MLP hidden          E experts              A experts per token (top-k)
  V vocabulary       C expert capacity     X tokens flattened (B * T)

Parameters are stored [in, out] and carry logical axis names (`out_sharding` metadata) only; the
mesh and the logical-to-mesh rules come from the config (`sao_jax.train.sharding`).

The MoE layers (router, experts, dispatch) are in `moe.py`; the two layer
layouts (per-layer or scanned stacks, remat, conversion between them) in `layout.py`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.attention import Segments, blockwise_attention
from sao_jax.models.config import ModelConfig
from sao_jax.models.layout import LayerStack, constrain
from sao_jax.models.moe import MoE, expert_choices
from sao_jax.models.params import Projection, named_param, normal_param


class RMSNorm(nnx.Module):
    """`x / sqrt(mean(x^2) + eps) * scale`, in float32, cast back before the scale (as HF)."""

    def __init__(self, dim: int, eps: float, dtype, axis_name: str = "norm"):
        self.scale = named_param(jnp.ones((dim,), dtype), (axis_name,))
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
                 hidden_sharding=None, replay_BxTxA=None):
        attn_out, cache = self.attn(self.input_norm(x_BxTxD), positions_BxT, mask_BxTxS, cache,
                                    slots_BxT)
        x_BxTxD = x_BxTxD + attn_out
        h_BxTxD = self.post_attn_norm(x_BxTxD)
        if hasattr(self, "moe"):
            mlp_out, router_logits = self.moe(h_BxTxD, dispatch, hidden_sharding, replay_BxTxA)
        else:
            mlp_out, router_logits = self.mlp(h_BxTxD), None
        return x_BxTxD + mlp_out, router_logits, cache


class BackboneOutput(NamedTuple):
    hidden_BxTxD: jax.Array  # after the final norm
    router_logits: tuple  # [X, E] float32 arrays, one per MoE layer ([R, X, E] when scanned)
    caches: tuple | None  # per layer, when decoding with a cache


def expert_routes(cfg: ModelConfig, router_logits: tuple, batch: int, length: int):
    """`[B, T, L, A]` int32: the experts each token went to at each layer (`MoE.route`'s
    top-A; -1 at layers without experts), from a forward pass's `router_logits` in either
    layout: what an engine reports for routing replay (`Transformer`'s `replay_BxTxLxA`)."""
    def chosen(logits_XxE):
        return expert_choices(jax.nn.softmax(logits_XxE, axis=-1),
                              cfg.num_experts_per_tok)[1].reshape(batch, length, -1)

    dense = jnp.full((batch, length, cfg.num_experts_per_tok), -1, jnp.int32)
    layers = [dense] * cfg.num_layers
    logits = iter(router_logits)
    if cfg.scan_layers:  # per group, one [R, X, E] array per expert layer of its block
        for first, period, repeats in cfg.layer_groups():
            for j in range(period):
                if cfg.is_moe_layer(first + j):
                    logits_RxXxE = next(logits)
                    for r in range(repeats):
                        layers[first + r * period + j] = chosen(logits_RxXxE[r])
    else:
        for i in range(cfg.num_layers):
            if cfg.is_moe_layer(i):
                layers[i] = chosen(next(logits))
    return jnp.stack(layers, axis=2).astype(jnp.int32)


def route_agreement(cfg: ModelConfig, router_logits: tuple, engine_BxTxLxA):
    """`[B, T]` float32, per token: 1 where a forward pass's router (`router_logits`, as
    `expert_routes` reads them) chose the experts `engine_BxTxLxA` reports at every layer with
    experts (the top-A sets equal, in any order), 0 where it chose others at one layer or
    more, -1 where the engine reported none (-1) at such a layer. The learner's own routing
    against the engine's, whether or not the pass replayed the engine's (its router still
    scores every expert): `policy/routed_same`, docs/models.md, "Routing replay"."""
    own = expert_routes(cfg, router_logits, *engine_BxTxLxA.shape[:2])
    engine = jnp.asarray(engine_BxTxLxA, jnp.int32)
    experts = own >= 0  # the layers with experts
    reported = jnp.all(~experts | (engine >= 0), axis=(2, 3))
    same = jnp.all(~experts | (jnp.sort(own, -1) == jnp.sort(engine, -1)), axis=(2, 3))
    return jnp.where(reported, same.astype(jnp.float32), -1.0)

def causal_mask(positions_BxT, valid_BxS=None, key_positions_BxS=None):
    """`[B, T, S]`: query t sees key s when s is not later than t and is a valid token."""
    keys = positions_BxT if key_positions_BxS is None else key_positions_BxS
    mask = keys[:, None, :] <= positions_BxT[:, :, None]
    if valid_BxS is not None:
        mask = mask & valid_BxS[:, None, :]
    return mask


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
                 segments_BxT=None, hidden_sharding=None, replay_BxTxLxA=None) -> BackboneOutput:
        """`segments_BxT` (instead of a mask, no cache): packed rows, each query attending the
        earlier tokens of its own segment; None with no mask: causal over the whole row. With
        `cfg.attention == "blockwise"` these run blockwise, else as a dense mask.

        `hidden_sharding` (inside a sharded jit): the `[B, T, D]` hidden states' sharding,
        imposed after the embedding and between layers, e.g. rows split over the batch axes.
        Without it XLA may follow the fsdp-split embedding table and split D instead, holding
        every row on every device (16x the activations of `experiments/swe.py`).

        `replay_BxTxLxA` (routing replay, `MoE.route`): for each token and each of the
        `num_layers` layers, the experts an inference engine chose (int; -1: route here, and
        ignored at layers without experts)."""
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
        x_BxTxD = constrain(self.embed.embedding[...][input_ids_BxT], hidden_sharding)
        router_logits, new_caches = [], []
        if self.cfg.scan_layers:
            if caches is not None:
                raise ValueError("decoding with a KV cache needs the per-layer layout "
                                 "(scan_layers=False): convert with unstack_layers(model).")
            for stack, group in zip(self.layers, self.cfg.layer_groups(), strict=True):
                x_BxTxD, logits = stack(x_BxTxD, positions_BxT, mask_BxTxS, dispatch,
                                        hidden_sharding, stack_replay(replay_BxTxLxA, *group))
                router_logits.extend(logits)
            return BackboneOutput(self.final_norm(x_BxTxD), tuple(router_logits), None)
        for i, layer in enumerate(self.layers):
            cache = None if caches is None else caches[i]
            x_BxTxD, logits, cache = layer(constrain(x_BxTxD, hidden_sharding), positions_BxT,
                                           mask_BxTxS, dispatch, cache, slots_BxT,
                                           hidden_sharding,
                                           None if replay_BxTxLxA is None
                                           else replay_BxTxLxA[:, :, i])
            if logits is not None:
                router_logits.append(logits)
            new_caches.append(cache)
        return BackboneOutput(self.final_norm(x_BxTxD), tuple(router_logits),
                              None if caches is None else tuple(new_caches))


def stack_replay(replay_BxTxLxA, first: int, period: int, repeats: int):
    """The replayed experts of a scanned group's layers `first + r * period + j` as the
    `LayerStack` scans them: `[repeats, period, B, T, A]` (None: none)."""
    if replay_BxTxLxA is None:
        return None
    b, t, _, a = replay_BxTxLxA.shape
    group = replay_BxTxLxA[:, :, first:first + period * repeats].reshape(b, t, repeats, period, a)
    return jnp.transpose(group, (2, 3, 0, 1, 4))


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, dtype, rngs: nnx.Rngs):
        self.embedding = normal_param(rngs, (vocab, dim), ("vocab", "embed"), dtype, scale=1.0)


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
                 segments_BxT=None, hidden_sharding=None, replay_BxTxLxA=None):
        out = self.backbone(input_ids_BxT, positions_BxT, mask_BxTxS,
                            dispatch=dispatch or self.cfg.logprob_dispatch,
                            segments_BxT=segments_BxT, hidden_sharding=hidden_sharding,
                            replay_BxTxLxA=replay_BxTxLxA)
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
        self.kernel = named_param(jnp.zeros((cfg.hidden_size, 1), dtype), ("embed", None))
        self.bias = named_param(jnp.zeros((1,), dtype), (None,))

    def __call__(self, hidden_BxTxD):
        return (jnp.einsum("btd,do->bto", hidden_BxTxD, self.kernel[...],
                           preferred_element_type=jnp.float32) + self.bias[...])[..., 0]
