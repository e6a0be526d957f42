"""The Hugging Face directory as sao_jax reads and writes it: its file names, safetensors' dtype
names, and the layout table that both directions read (the package docstring says how).

A directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Tensor names and layouts are those of the published checkpoints
(and of what transformers writes): torch `Linear` weights are `[out, in]`, experts are separate
`mlp.experts.{e}.{gate,up,down}_proj.weight` tensors. Our parameters are `[in, out]` with heads and
experts as their own axes, and with `scan_layers` each layer group's parameters are stacked
along a leading layer axis; `hf_layout(cfg)` lists, for every HF tensor, the parameter and the
indices (layer, expert) it lives at and the reshape and transpose between the two layouts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from sao_jax.models.config import ModelConfig
from sao_jax.models.layout import scanned_places

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PENDING_MARKER = "save_hf.pending"  # written first by save_hf
COMPLETE_MARKER = "save_hf.complete"  # written last by save_hf, when every file is whole

# safetensors' dtype names; bfloat16 is ml_dtypes' numpy type.
ST_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
             "F16": np.dtype(np.float16), "BF16": np.dtype(jnp.bfloat16),
             "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
             "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}



class HfTensor(NamedTuple):
    """One Hugging Face tensor and where it lives in our model.

    `param[layer][expert]` (each index only where it is not None: `layer` for a stacked
    parameter, `expert` for an expert weight) equals the HF tensor, stored as `shape`, reshaped
    to `view` and transposed by `perm`: `hf.reshape(view).transpose(perm)`.
    """

    name: str
    path: tuple  # the parameter's path in `nnx.state(model)`
    layer: int | None
    expert: int | None
    shape: tuple[int, ...]
    view: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def index(self) -> tuple[int, ...]:
        """The leading indices into the parameter: `(layer?, expert?)`."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


def _same(name: str, path: tuple, shape: tuple[int, ...]) -> HfTensor:
    """A tensor stored as we store it (embedding, norms)."""
    return HfTensor(name, path, None, None, shape, shape, tuple(range(len(shape))))


def _linear(name: str, path: tuple, out_dims: tuple[int, ...], in_dims: tuple[int, ...],
            expert: int | None = None) -> HfTensor:
    """A torch `Linear` weight `[prod(out), prod(in)]`; ours is `[*in, *out]`."""
    view = (*out_dims, *in_dims)
    o = len(out_dims)
    return HfTensor(name, path, None, expert, (math.prod(out_dims), math.prod(in_dims)), view,
                    (*range(o, len(view)), *range(o)))


def _layer_tensors(cfg: ModelConfig, i: int) -> Iterator[HfTensor]:
    """Layer i's tensors, with paths inside the layer module."""
    n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    p = f"model.layers.{i}."
    yield _same(p + "input_layernorm.weight", ("input_norm", "scale"), (d,))
    yield _same(p + "post_attention_layernorm.weight", ("post_attn_norm", "scale"), (d,))
    yield _linear(p + "self_attn.q_proj.weight", ("attn", "q_proj", "kernel"), (n, h), (d,))
    yield _linear(p + "self_attn.k_proj.weight", ("attn", "k_proj", "kernel"), (k, h), (d,))
    yield _linear(p + "self_attn.v_proj.weight", ("attn", "v_proj", "kernel"), (k, h), (d,))
    yield _linear(p + "self_attn.o_proj.weight", ("attn", "o_proj", "kernel"), (d,), (n, h))
    yield _same(p + "self_attn.q_norm.weight", ("attn", "q_norm", "scale"), (h,))
    yield _same(p + "self_attn.k_norm.weight", ("attn", "k_norm", "scale"), (h,))
    if cfg.is_moe_layer(i):
        f = cfg.moe_intermediate_size
        yield _linear(p + "mlp.gate.weight", ("moe", "router", "kernel"), (cfg.num_experts,),
                      (d,))
        # One projection's experts in a row: saving fetches each projection once per layer.
        for proj, out, into in (("gate_proj", f, d), ("up_proj", f, d), ("down_proj", d, f)):
            for e in range(cfg.num_experts):
                yield _linear(p + f"mlp.experts.{e}.{proj}.weight", ("moe", proj), (out,),
                              (into,), e)
    else:
        f = cfg.intermediate_size
        for proj, out, into in (("gate_proj", f, d), ("up_proj", f, d), ("down_proj", d, f)):
            yield _linear(p + f"mlp.{proj}.weight", ("mlp", proj, "kernel"), (out,), (into,))


def hf_layout(cfg: ModelConfig) -> list[HfTensor]:
    """Every HF tensor of a `CausalLM` of `cfg`, in file order, placed in `cfg`'s layer layout
    (`backbone/layers/<i>/...`, or `backbone/layers/<g>/block/<j>/...` at layer index r when
    `cfg.scan_layers`)."""
    places = scanned_places(cfg) if cfg.scan_layers else None
    tensors = [_same("model.embed_tokens.weight", ("backbone", "embed", "embedding"),
                     (cfg.vocab_size, cfg.hidden_size))]
    for i in range(cfg.num_layers):
        if places is None:
            prefix, layer = ("backbone", "layers", i), None
        else:
            g, layer, j = places[i]
            prefix = ("backbone", "layers", g, "block", j)
        tensors += [t._replace(path=prefix + t.path, layer=layer) for t in _layer_tensors(cfg, i)]
    tensors.append(_same("model.norm.weight", ("backbone", "final_norm", "scale"),
                         (cfg.hidden_size,)))
    if not cfg.tie_word_embeddings:
        tensors.append(_linear("lm_head.weight", ("lm_head", "kernel"), (cfg.vocab_size,),
                               (cfg.hidden_size,)))
    return tensors
