"""Reading a Hugging Face directory into a `CausalLM` (`load_hf`), each process only its shards.

`load_hf` never holds the model on the host: the model is built abstract-first (`like`: an
abstract model whose leaves may carry shardings, e.g. `train.sharding.abstract_model`), and each
parameter is made with `jax.make_array_from_callback`, whose shards are read straight from
the files: a safetensors file is an 8-byte little-endian header length, a JSON header (each
tensor's dtype, shape and byte range) and the raw little-endian bytes. `Checkpoint` parses the
headers itself and reads byte ranges with `os.preadv`, in chunks of at most READ_CHUNK_BYTES of
whole rows, copying from each chunk only the block that this process's shards need. It does not
mmap: with `safe_open`'s mapping every page a read touches counts in the process's RSS while the
mapping lives, and a column block of a row-major tensor touches all of its pages. A host's peak
memory is therefore its own shards, plus one parameter's local shards on their way to the
devices, plus a chunk (tests/models/test_hf_scale.py: each of two processes holding half of a
206 MiB checkpoint peaks at 0.54x of it; one process at the model plus the 8 MiB chunk).

`check_complete` refuses a directory that `save_hf` began and has not finished (`save.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import mmap
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models.config import ModelConfig
from sao_jax.models.hf.format import (
    COMPLETE_MARKER,
    CONFIG_FILE,
    INDEX_FILE,
    PENDING_MARKER,
    SINGLE_FILE,
    ST_DTYPES,
    HfTensor,
    hf_layout,
)
from sao_jax.models.transformer import CausalLM

READ_CHUNK_BYTES = 8 << 20  # the most `Checkpoint` reads at once (whole rows; at least one)
MAX_HEADER_BYTES = 100_000_000  # as the safetensors library
# numpy transposes a block of 16 rows into place ~8x faster than a whole chunk (3.2 vs 0.4 GB/s
# for [4096, 1024] float32 here): the block stays in cache.
TRANSPOSE_ROWS = 16


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's bytes are: `file`, bytes `[start, stop)`, stored as `dtype` (safetensors'
    name) and `shape`, row-major little-endian."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int


def read_header(file: str) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header alone.

    Raises:
      ValueError: naming the file, when it is not safetensors or is shorter than its header says.
    """
    with open(file, "rb") as f:
        head = f.read(8)
        (n,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
        if n is None or n > MAX_HEADER_BYTES:
            raise ValueError(f"{file}: not a safetensors file (no valid header length).")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    tensors = {name: TensorInfo(file, info["dtype"], tuple(info["shape"]),
                                8 + n + info["data_offsets"][0], 8 + n + info["data_offsets"][1])
               for name, info in header.items()}
    end = max((t.stop for t in tensors.values()), default=8 + n)
    if os.path.getsize(file) < end:
        raise ValueError(f"{file}: truncated: {os.path.getsize(file)} bytes, its header "
                         f"describes {end}.")
    return tensors


class Checkpoint:
    """The tensors of a safetensors directory, read by byte range (module docstring: no mmap).

    Use as a context manager (it keeps one descriptor per file open).
    """

    def __init__(self, path: str):
        self.path = path
        self.tensors: dict[str, TensorInfo] = {}
        for file in _tensor_files(path):
            self.tensors.update(read_header(os.path.join(path, file)))
        self._fds: dict[str, int] = {}
        self._chunk: np.ndarray | None = None

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._chunk = None

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` whole, as stored, in a new array."""
        info = self.tensors[name]
        buf = np.empty(info.stop - info.start, np.uint8)
        self._pread(info, 0, buf)
        return buf.view(ST_DTYPES[info.dtype]).reshape(info.shape)

    def _rows(self, info: TensorInfo, first: int, last: int, row_bytes: int) -> np.ndarray:
        """Rows `[first, last)` of `info` (rows of `row_bytes`), flat, in a buffer that the next
        call reuses (one allocation for the whole load: memory freed and taken again in other
        sizes would stay in the allocator's free lists, counted in RSS)."""
        n = (last - first) * row_bytes
        if self._chunk is None or self._chunk.size < n:
            self._chunk = np.empty(max(n, READ_CHUNK_BYTES), np.uint8)
        buf = self._chunk[:n]
        self._pread(info, first * row_bytes, buf)
        return buf.view(ST_DTYPES[info.dtype])

    def _pread(self, info: TensorInfo, offset: int, buf: np.ndarray) -> None:
        """Fills `buf` with `info`'s bytes from `offset` on."""
        fd = self._fds.get(info.file)
        if fd is None:
            fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
        view, start = memoryview(buf), info.start + offset
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], start + done)
            if n == 0:
                raise ValueError(f"{info.file}: ends inside tensor bytes (truncated).")
            done += n

    def fill(self, tensor: HfTensor, boxes: list[tuple[tuple[int, int], ...]],
             outs: list[np.ndarray]) -> None:
        """Writes the block `boxes[b]` (a `(start, stop)` per axis of our layout, after the
        leading indices) of `tensor` into `outs[b]`, casting to its dtype. Reads the rows the
        boxes need (rows of `tensor.view`) in chunks of at most READ_CHUNK_BYTES, once for all
        boxes."""
        info = self.tensors[tensor.name]
        view, perm = tensor.view, tensor.perm
        row_axis = perm.index(0)  # our axis that runs along the file's rows
        in_view = [tuple(box[perm.index(a)] for a in range(len(view))) for box in boxes]
        row_bytes = math.prod(view[1:]) * ST_DTYPES[info.dtype].itemsize
        step = max(1, READ_CHUNK_BYTES // max(row_bytes, 1))
        first = min(b[0][0] for b in in_view)
        last = max(b[0][1] for b in in_view)
        for a in range(first, last, step):
            z = min(a + step, last)
            wanted = [(b, out) for b, out in zip(in_view, outs, strict=True)
                      if b[0][0] < z and a < b[0][1]]
            if not wanted:
                continue
            chunk = self._rows(info, a, z, row_bytes).reshape((z - a, *view[1:]))
            for b, out in wanted:
                lo, hi = max(a, b[0][0]), min(z, b[0][1])
                cols = tuple(slice(*r) for r in b[1:])
                dest = [slice(None)] * out.ndim
                slab = TRANSPOSE_ROWS if row_axis else hi - lo
                for s in range(lo, hi, slab):
                    e = min(s + slab, hi)
                    dest[row_axis] = slice(s - b[0][0], e - b[0][0])
                    out[tuple(dest)] = chunk[(slice(s - a, e - a), *cols)].transpose(perm)


def _tensor_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.exists(os.path.join(path, SINGLE_FILE)):
        return [SINGLE_FILE]
    raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found.")


def read_config(path: str, **overrides) -> ModelConfig:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} not found: a Hugging Face model directory holds "
                                "config.json and model.safetensors (or an index and shards).")
    with open(config_path) as f:
        return ModelConfig.from_hf(json.load(f), **overrides)


def check_complete(path: str) -> None:
    """Raises ValueError if `path` is a directory `save_hf` began but has not finished (its
    PENDING_MARKER is there, its COMPLETE_MARKER is not). Directories without either marker,
    e.g. downloaded checkpoints, pass."""
    pending = os.path.exists(os.path.join(path, PENDING_MARKER))
    if pending and not os.path.exists(os.path.join(path, COMPLETE_MARKER)):
        raise ValueError(f"{path} is incomplete: it holds {PENDING_MARKER} but not "
                         f"{COMPLETE_MARKER}, which save_hf writes last, once every file is "
                         "whole (it is still being written, or its writer died).")


def _check_tensors(checkpoint: Checkpoint, layout: list[HfTensor], cfg: ModelConfig) -> None:
    """Every tensor of `layout` present with its shape, before any data is read."""
    for tensor in layout:
        if tensor.name not in checkpoint.tensors:
            raise KeyError(f"{checkpoint.path}: checkpoint has no tensor {tensor.name!r}, which "
                           f"the config ({cfg.num_layers} layers, {cfg.num_experts} experts) "
                           "needs.")
        found = checkpoint.tensors[tensor.name]
        if found.shape != tensor.shape:
            raise ValueError(f"{checkpoint.path}: checkpoint tensor {tensor.name} has shape "
                             f"{found.shape}, which does not fit the config: it expects "
                             f"{tensor.shape}.")
        if found.dtype not in ST_DTYPES:
            raise ValueError(f"{checkpoint.path}: checkpoint tensor {tensor.name} has dtype "
                             f"{found.dtype}, which is not one of {sorted(ST_DTYPES)}.")


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _host_array(shape, dtype) -> np.ndarray:
    """An uninitialised array in its own anonymous mapping, unmapped as soon as it is dropped.
    (From malloc, a shard freed after its device copy would raise glibc's mmap threshold and
    leave the allocator's heap fragmented between long-lived device buffers: tens of MB of RSS
    held after a load.) Page-aligned, so the CPU client may also use it without a copy."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    return np.frombuffer(mmap.mmap(-1, max(size, 1)), dtype, math.prod(shape)).reshape(shape)


def _read_param(checkpoint: Checkpoint, tensors: dict[tuple[int, ...], HfTensor], leaf,
                dtype) -> jax.Array:
    """One parameter, made shard by shard from the files in `leaf`'s sharding (its shape and,
    when it has one, sharding; else this process's first device). Each distinct shard of this
    process is read once, every HF tensor it spans in one pass over that tensor's rows."""
    shape = tuple(leaf.shape)
    sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
        jax.local_devices()[0])
    boxes = list(dict.fromkeys(_box(index, shape) for index in
                               sharding.addressable_devices_indices_map(shape).values()))
    outs = [_host_array([b - a for a, b in box], dtype) for box in boxes]
    lead = len(next(iter(tensors)))  # leading index axes: layer and/or expert
    wanted = sorted({i for box in boxes for i in itertools.product(
        *(range(a, b) for a, b in box[:lead]))})
    for i in wanted:  # each HF tensor this process needs, once, into every shard it is in
        blocks, into = [], []
        for box, out in zip(boxes, outs, strict=True):
            if all(a <= k < b for k, (a, b) in zip(i, box[:lead], strict=True)):
                blocks.append(box[lead:])
                into.append(out[tuple(k - a for k, (a, _) in zip(i, box[:lead], strict=True))])
        checkpoint.fill(tensors[i], blocks, into)
    shards = dict(zip(boxes, outs, strict=True))
    return jax.make_array_from_callback(shape, sharding, lambda index: shards[_box(index, shape)])


def load_hf(path: str, dtype=jnp.float32, *, rngs: nnx.Rngs | None = None,
            like: CausalLM | None = None, **overrides) -> CausalLM:
    """Loads a Qwen3-MoE or Qwen3 safetensors directory into a `CausalLM`, tensor by tensor
    into each parameter's sharding (module docstring).

    Args:
      path: directory with config.json and model.safetensors or model.safetensors.index.json.
      dtype: parameter dtype (e.g. jnp.float32, jnp.bfloat16); the files' dtype is cast to it.
      rngs: only used to build the abstract module when `like` is None.
      like: a model of the same config (layout included) whose structure, and whose leaves'
        shardings, the result takes, e.g. `train.sharding.abstract_model(lambda: CausalLM(cfg,
        nnx.Rngs(0)), mesh, rules)` (sharded: each process reads only its shards) or
        `nnx.eval_shape(lambda: CausalLM(cfg, rngs))` (no sharding: one device). It saves
        building the module (44 ms for the toy model, more for larger ones), which a server
        reloading weights every learner step should not repeat. `like` itself is not changed.
      **overrides: ModelConfig fields to set on top of config.json (e.g. moe_dispatch, or
        scan_layers=True for the scanned layout a training step wants).

    Returns:
      The model; `model(input_ids [B, T])` gives logits `[B, T, V]`.

    Raises:
      ValueError: an incomplete directory (`check_complete`), a tensor whose shape does not fit
        the config, or a `like` of another config. KeyError: a tensor the config needs is
        missing. Each names the directory and the tensor.
    """
    check_complete(path)
    cfg = read_config(path, param_dtype=jnp.dtype(dtype).name, **overrides)
    if like is None:
        like = nnx.eval_shape(lambda: CausalLM(cfg, rngs or nnx.Rngs(0)))  # no memory, no init
    elif like.cfg != cfg:
        raise ValueError(f"{path}: its config differs from the model given as `like`.")
    graphdef, abstract = nnx.split(like)
    by_path: dict[tuple, dict[tuple[int, ...], HfTensor]] = {}
    layout = hf_layout(cfg)
    for tensor in layout:
        by_path.setdefault(tensor.path, {})[tensor.index] = tensor
    with Checkpoint(path) as checkpoint:
        _check_tensors(checkpoint, layout, cfg)
        flat = [(p, v.replace(_read_param(checkpoint, by_path[p], v.get_value(), dtype)))
                for p, v in nnx.to_flat_state(abstract)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
