"""The embedded engine's model on disk: what a Hugging Face directory declares beyond its weights
(dtype, tokenizer, EOS ids), and the validation of a weight update against the served model.

`scheduler.py`'s `Engine` reads these at start-up and calls `load_state` (on its compute thread)
for each `/update_weights_from_disk`, before any request is touched.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from flax import nnx

from sao_jax.models.config import ModelConfig
from sao_jax.models.hf import CONFIG_FILE, Checkpoint, check_complete, load_hf, read_config
from sao_jax.models.transformer import CausalLM

FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors' names


def config_dtype(path: str) -> str:
    """The parameter dtype config.json names (`torch_dtype`, else `dtype`) if it is float32,
    bfloat16 or float16; float32 otherwise."""
    with open(os.path.join(path, CONFIG_FILE)) as f:
        hf = json.load(f)
    name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def read_eos_ids(path: str) -> frozenset[int]:
    """`eos_token_id` (an int or a list) of config.json and generation_config.json, if any."""
    ids: set[int] = set()
    for name in (CONFIG_FILE, "generation_config.json"):
        file = os.path.join(path, name)
        if os.path.exists(file):
            with open(file) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(int(i) for i in ids)


def read_tokenizer(path: str):
    """`path/tokenizer.json` as a `tokenizers.Tokenizer`, or None when there is none."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    import tokenizers
    return tokenizers.Tokenizer.from_file(file)


def tensor_specs(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's shape and dtype in a safetensors directory, from the file headers."""
    return {name: (info.shape, info.dtype) for name, info in Checkpoint(path).tensors.items()}


def check_tensors(path: str, expected: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """A weight update's tensors against the served model's (`expected`, by name): every tensor
    present with its shape, floating point, and finite. Raises ValueError naming the first that
    is not. Reads one tensor at a time."""
    found = tensor_specs(path)
    for name, (shape, _) in expected.items():
        if name not in found:
            raise ValueError(f"{path}: tensor {name} is missing.")
        if found[name][0] != shape:
            raise ValueError(f"{path}: tensor {name} has shape {found[name][0]}; the served "
                             f"model's is {shape}.")
        if found[name][1] not in FLOAT_DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {found[name][1]}; weights must "
                             f"be one of {', '.join(FLOAT_DTYPES)}.")
    with Checkpoint(path) as checkpoint:
        for name in checkpoint.tensors:
            if not np.isfinite(np.asarray(checkpoint.read(name), np.float32)).all():
                raise ValueError(f"{path}: tensor {name} holds NaN or infinite values.")


def load_state(path: str, *, cfg: ModelConfig, dtype: np.dtype, abstract: CausalLM,
               tensors: dict[str, tuple[tuple[int, ...], str]], state: nnx.State,
               overrides: dict):
    """New weights for a served model, validated completely (files, config, each tensor's dtype,
    values and shape, by name); raises ValueError if they do not fit it. The served model: its
    `cfg` and `dtype`, `abstract` (its `nnx.eval_shape` model), `tensors` (`tensor_specs` of its
    directory), `state` (its parameters) and the config `overrides` it was loaded with."""
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such directory.")
    check_complete(path)
    new_cfg = read_config(path, param_dtype=dtype.name, **overrides)
    changed = [f.name for f in dataclasses.fields(new_cfg)
               if getattr(new_cfg, f.name) != getattr(cfg, f.name)]
    if changed:
        raise ValueError(f"{path}: config.json differs from the served model in {changed}; "
                         "a weight update must keep the architecture.")
    check_tensors(path, tensors)
    _, new_state = nnx.split(load_hf(path, dtype, like=abstract, **overrides))
    if jax.tree.structure(new_state) != jax.tree.structure(state):
        raise ValueError(f"{path}: the loaded parameters do not match the served model's.")
    return jax.block_until_ready(new_state)
