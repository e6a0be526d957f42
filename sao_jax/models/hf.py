"""Hugging Face interop: Qwen3-MoE / Qwen3 safetensors directories in and out.

A directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Tensor names and layouts are those of the published checkpoints
(and of what transformers writes): torch `Linear` weights are `[out, in]`, experts are separate
`mlp.experts.{e}.{gate,up,down}_proj.weight` tensors. Our parameters are `[in, out]` with heads and
experts as their own axes; the conversion is a reshape and a transpose, so load -> save -> load is
bit-identical.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import CausalLM, stack_layers, unstack_layers

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _to_numpy(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def hf_tensors(model: CausalLM) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(hf_name, array)` for every weight of `model` (either layer layout), in Hugging
    Face layout."""
    model = unstack_layers(model)
    cfg = model.cfg
    n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    bb = model.backbone
    yield "model.embed_tokens.weight", _to_numpy(bb.embed.embedding[...])
    for i, layer in enumerate(bb.layers):
        p = f"model.layers.{i}."
        attn = layer.attn
        yield p + "input_layernorm.weight", _to_numpy(layer.input_norm.scale[...])
        yield p + "post_attention_layernorm.weight", _to_numpy(layer.post_attn_norm.scale[...])
        yield p + "self_attn.q_proj.weight", _to_numpy(attn.q_proj.kernel[...]).reshape(d, n * h).T
        yield p + "self_attn.k_proj.weight", _to_numpy(attn.k_proj.kernel[...]).reshape(d, k * h).T
        yield p + "self_attn.v_proj.weight", _to_numpy(attn.v_proj.kernel[...]).reshape(d, k * h).T
        yield p + "self_attn.o_proj.weight", _to_numpy(attn.o_proj.kernel[...]).reshape(n * h, d).T
        yield p + "self_attn.q_norm.weight", _to_numpy(attn.q_norm.scale[...])
        yield p + "self_attn.k_norm.weight", _to_numpy(attn.k_norm.scale[...])
        if hasattr(layer, "moe"):
            moe = layer.moe
            yield p + "mlp.gate.weight", _to_numpy(moe.router.kernel[...]).T
            gate, up, down = (_to_numpy(w[...]) for w in (moe.gate_proj, moe.up_proj,
                                                           moe.down_proj))
            for e in range(cfg.num_experts):
                yield p + f"mlp.experts.{e}.gate_proj.weight", gate[e].T
                yield p + f"mlp.experts.{e}.up_proj.weight", up[e].T
                yield p + f"mlp.experts.{e}.down_proj.weight", down[e].T
        else:
            for name in ("gate_proj", "up_proj", "down_proj"):
                yield p + f"mlp.{name}.weight", _to_numpy(getattr(layer.mlp, name).kernel[...]).T
    yield "model.norm.weight", _to_numpy(bb.final_norm.scale[...])
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", _to_numpy(model.lm_head.kernel[...]).T


def set_from_hf(model: CausalLM, get, dtype) -> None:
    """Fills `model` (per-layer layout) in place; `get(name)` returns an HF tensor (KeyError
    naming it if absent)."""
    cfg = model.cfg
    n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size

    def put(param: nnx.Param, name: str, value: np.ndarray):
        expected = tuple(param.get_value().shape)
        if tuple(value.shape) != expected:
            raise ValueError(f"checkpoint tensor {name}: shape {tuple(value.shape)} (our layout) "
                             f"does not fit the config, which expects {expected}.")
        param.set_value(jnp.asarray(value, dtype))

    def linear(param, name, shape):  # torch Linear [out, in] -> ours [in, ...out]
        put(param, name, get(name).T.reshape(shape))

    bb = model.backbone
    put(bb.embed.embedding, "model.embed_tokens.weight", get("model.embed_tokens.weight"))
    for i, layer in enumerate(bb.layers):
        p = f"model.layers.{i}."
        attn = layer.attn
        for param, name in ((layer.input_norm.scale, "input_layernorm.weight"),
                            (layer.post_attn_norm.scale, "post_attention_layernorm.weight"),
                            (attn.q_norm.scale, "self_attn.q_norm.weight"),
                            (attn.k_norm.scale, "self_attn.k_norm.weight")):
            put(param, p + name, get(p + name))
        linear(attn.q_proj.kernel, p + "self_attn.q_proj.weight", (d, n, h))
        linear(attn.k_proj.kernel, p + "self_attn.k_proj.weight", (d, k, h))
        linear(attn.v_proj.kernel, p + "self_attn.v_proj.weight", (d, k, h))
        # o_proj: [D, N*H] -> [N*H, D] -> [N, H, D]
        put(attn.o_proj.kernel, p + "self_attn.o_proj.weight",
            get(p + "self_attn.o_proj.weight").T.reshape(n, h, d))
        if hasattr(layer, "moe"):
            moe = layer.moe
            linear(moe.router.kernel, p + "mlp.gate.weight", (d, cfg.num_experts))
            for param, name in ((moe.gate_proj, "gate_proj"), (moe.up_proj, "up_proj"),
                                (moe.down_proj, "down_proj")):
                names = [p + f"mlp.experts.{e}.{name}.weight" for e in range(cfg.num_experts)]
                put(param, names[0].replace(".0.", ".*."),
                    np.stack([get(one).T for one in names]))
        else:
            mlp = layer.mlp
            f = cfg.intermediate_size
            linear(mlp.gate_proj.kernel, p + "mlp.gate_proj.weight", (d, f))
            linear(mlp.up_proj.kernel, p + "mlp.up_proj.weight", (d, f))
            linear(mlp.down_proj.kernel, p + "mlp.down_proj.weight", (f, d))
    put(bb.final_norm.scale, "model.norm.weight", get("model.norm.weight"))
    if not cfg.tie_word_embeddings:
        linear(model.lm_head.kernel, "lm_head.weight", (d, cfg.vocab_size))


def read_config(path: str, **overrides) -> ModelConfig:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} not found: a Hugging Face model directory holds "
                                "config.json and model.safetensors (or an index and shards).")
    with open(config_path) as f:
        return ModelConfig.from_hf(json.load(f), **overrides)


def _tensor_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.exists(os.path.join(path, SINGLE_FILE)):
        return [SINGLE_FILE]
    raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found.")


def load_hf(path: str, dtype=jnp.float32, *, rngs: nnx.Rngs | None = None,
            like: CausalLM | None = None, **overrides) -> CausalLM:
    """Loads a Qwen3-MoE or Qwen3 safetensors directory into a `CausalLM`.

    Args:
      path: directory with config.json and model.safetensors or model.safetensors.index.json.
      dtype: parameter dtype (e.g. jnp.float32, jnp.bfloat16).
      rngs: only used to build the module before the weights overwrite it.
      like: a model of the same config, e.g. `nnx.eval_shape(lambda: CausalLM(cfg, rngs))`,
        whose copy is filled instead of building the module: building traces it (44 ms for the
        toy model, more for larger ones), which a server reloading weights every learner step
        should not repeat. `like` itself is not changed.
      **overrides: ModelConfig fields to set on top of config.json (e.g. moe_dispatch, or
        scan_layers=True for the scanned layout a training step wants).

    Returns:
      The model; `model(input_ids [B, T])` gives logits `[B, T, V]`.
    """
    cfg = read_config(path, param_dtype=jnp.dtype(dtype).name, **overrides)
    wanted = cfg
    cfg = cfg.replace(scan_layers=False, remat="none")  # filled per layer, then stacked
    if like is not None:
        like = unstack_layers(like)
    tensors: dict[str, np.ndarray] = {}
    for name in _tensor_files(path):
        tensors.update(load_file(os.path.join(path, name)))
    if like is None:
        model = nnx.eval_shape(lambda: CausalLM(cfg, rngs or nnx.Rngs(0)))  # no memory, no init
    elif like.cfg != cfg:
        raise ValueError(f"{path}: its config differs from the model given as `like`.")
    else:
        model = nnx.clone(like)  # fresh variables: filling them leaves `like` as it was

    def get(name):
        if name not in tensors:
            raise KeyError(f"{path}: checkpoint has no tensor {name!r}, which the config "
                           f"({cfg.num_layers} layers, {cfg.num_experts} experts) needs.")
        return tensors[name]

    set_from_hf(model, get, dtype)
    return stack_layers(model, wanted.remat) if wanted.scan_layers else model


def save_hf(model: CausalLM, path: str, *, max_shard_bytes: int = 4 << 30,
            dtype: str | None = None) -> None:
    """Writes `model` as a Hugging Face directory that transformers and SGLang load.

    Shards of at most `max_shard_bytes` (the index file is written when there is more than one).
    `dtype` (e.g. "bfloat16") converts on the way out; the default keeps the parameter dtype.
    """
    os.makedirs(path, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    out_dtype = None
    for name, array in hf_tensors(model):
        if dtype is not None:
            array = np.asarray(jnp.asarray(array).astype(dtype))
        array = np.ascontiguousarray(array)
        out_dtype = out_dtype or array.dtype
        if size and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    config = model.cfg.to_hf(dtype=jnp.dtype(out_dtype).name)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    for stale in os.listdir(path):
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", stale):
            os.remove(os.path.join(path, stale))
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    total = sum(a.nbytes for s in shards for a in s.values())
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
