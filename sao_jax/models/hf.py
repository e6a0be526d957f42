"""Hugging Face interop: Qwen3-MoE / Qwen3 safetensors directories in and out, at any scale.

A directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Tensor names and layouts are those of the published checkpoints
(and of what transformers writes): torch `Linear` weights are `[out, in]`, experts are separate
`mlp.experts.{e}.{gate,up,down}_proj.weight` tensors. Our parameters are `[in, out]` with heads and
experts as their own axes, and with `scan_layers` each layer group's parameters are stacked
along a leading layer axis; `hf_layout(cfg)` lists, for every HF tensor, the parameter and the
indices (layer, expert) it lives at and the reshape and transpose between the two layouts, and
both directions below read that one table. Load -> save -> load is bit-identical.

Loading (`load_hf`) never holds the model on the host: the model is built abstract-first (`like`:
an abstract model whose leaves may carry shardings, e.g. `train.sharding.abstract_model`), and
each parameter is made with `jax.make_array_from_callback`, whose shards are read straight from
the files: a safetensors file is an 8-byte little-endian header length, a JSON header (each
tensor's dtype, shape and byte range) and the raw little-endian bytes. `Checkpoint` parses the
headers itself and reads byte ranges with `os.preadv`, in chunks of at most READ_CHUNK_BYTES of
whole rows, copying from each chunk only the block that this process's shards need. It does not
mmap: with `safe_open`'s mapping every page a read touches counts in the process's RSS while the
mapping lives, and a column block of a row-major tensor touches all of its pages. A host's peak
memory is therefore its own shards, plus one parameter's local shards on their way to the
devices, plus a chunk (tests/models/test_hf_scale.py: each of two processes holding half of a
206 MiB checkpoint peaks at 0.54x of it; one process at the model plus the 8 MiB chunk).

Saving (`save_hf`) streams too: each file's header is computed from shapes and dtypes before any
data is fetched (`save_plan`), then the tensors are fetched and written one bucket at a time (a
parameter, or one layer of a stacked one with all of its experts, never split between files:
`jax.jit` slices the layer and converts it to the HF layout on the device). A model on this
process's devices alone is fetched with `jax.device_get` and written by this process, whatever the
others do (a leader saving its warm start); there too each bucket is written on a thread while the
next one is converted (on CPU the conversion, a transpose of nearly every byte, costs about what the
write into the page cache does: benchmarks/bench_publish.py). A model over several processes'
devices: every file has one writer, the files dealt to the processes by bytes (`file_owners`), and
each bucket goes to its writer only. Every process runs the same programs in the same order, in
rounds (each process's next bucket): `_to_hf` splits the bucket by rows over every device, and
`_gather_to` moves each device's rows to the writer's devices with `ppermute` (JAX will not reshard
onto one process's devices: in multi-controller JAX, `jax.device_put` and `jit` want the same device
set on both sides). A process thus holds its shards, the bucket it writes and the one being fetched
(another's as zeros on its devices for the moment of the gather), and copies to its host only what
it writes. The writes run on a thread while the next round is fetched; before each round every
process waits for its last write, then meets the others at the coordinator's barrier, so that none
waits in a device collective while another writes to a slow disk. The directory must be shared;
process 0 writes config.json and the index. Tensors are written in model order (safetensors' own
writer sorts them by name; readers only need the offsets), so the bytes depend on neither the layout
nor the process count (tests/models/test_hf_scale.py: two processes write the files one process
writes, each growing by 4-65 MiB while saving a 206 MiB model whose largest bucket is 16 MiB;
one process alone, writing on its thread, 16-80 MiB).

Completion: `save_hf` first writes PENDING_MARKER, and writes COMPLETE_MARKER last, after every
process has finished (a barrier), then removes PENDING_MARKER. `check_complete` (called by
`load_hf` and the engines) refuses a directory holding PENDING_MARKER without COMPLETE_MARKER:
one being written, or whose writer died. A directory with neither marker (a downloaded
checkpoint, anything transformers wrote) loads as before; so does one with COMPLETE_MARKER, which
also lists the files written and their sizes (for people; nothing checks them).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import io
import itertools
import json
import math
import mmap
import os
import re
import struct
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models.config import ModelConfig
from sao_jax.models.layout import _scanned_places
from sao_jax.models.transformer import CausalLM

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PENDING_MARKER = "save_hf.pending"  # written first by save_hf
COMPLETE_MARKER = "save_hf.complete"  # written last by save_hf, when every file is whole
READ_CHUNK_BYTES = 8 << 20  # the most `Checkpoint` reads at once (whole rows; at least one)
MAX_HEADER_BYTES = 100_000_000  # as the safetensors library
SAVE_TIMEOUT_S = 3600  # save_hf's processes wait this long for each other at a barrier
# numpy transposes a block of 16 rows into place ~8x faster than a whole chunk (3.2 vs 0.4 GB/s
# for [4096, 1024] float32 here): the block stays in cache.
TRANSPOSE_ROWS = 16

# safetensors' dtype names; bfloat16 is ml_dtypes' numpy type.
ST_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
             "F16": np.dtype(np.float16), "BF16": np.dtype(jnp.bfloat16),
             "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
             "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}


# -- the layout table ------------------------------------------------------------------------------


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
    places = _scanned_places(cfg) if cfg.scan_layers else None
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


# -- reading ---------------------------------------------------------------------------------------


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


# -- writing ---------------------------------------------------------------------------------------


class _Bucket(NamedTuple):
    """HF tensors `[first, last)` of the layout, fetched together: one parameter, or one layer of
    a stacked one, with all of its experts (their bytes are consecutive in the file)."""

    first: int
    last: int
    nbytes: int


def _buckets(tensors: list[HfTensor], sizes: list[int]) -> list[_Bucket]:
    out: list[_Bucket] = []
    for i, tensor in enumerate(tensors):
        key = (tensor.path, tensor.layer)
        if out and (tensors[out[-1].first].path, tensors[out[-1].first].layer) == key:
            out[-1] = out[-1]._replace(last=i + 1, nbytes=out[-1].nbytes + sizes[i])
        else:
            out.append(_Bucket(i, i + 1, sizes[i]))
    return out


def _plan_files(buckets: list[_Bucket], max_shard_bytes: int) -> list[tuple[str, list[int]]]:
    """`(file name, bucket indices)` per file, buckets in order: a new file when the next bucket
    would take the current one past `max_shard_bytes` (a bucket is never split, so that one
    process can fetch and write it whole)."""
    groups: list[list[int]] = [[]]
    size = 0
    for b, bucket in enumerate(buckets):
        if size and size + bucket.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(b)
        size += bucket.nbytes
    if len(groups) == 1:
        return [(SINGLE_FILE, groups[0])]
    return [(f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors", g)
            for k, g in enumerate(groups)]


def file_owners(file_bytes: list[int], processes: int) -> list[int]:
    """The process that writes each file: the largest file first, each to the process with the
    fewest bytes so far (the lowest index on a tie)."""
    load, owners = [0] * processes, [0] * len(file_bytes)
    for k in sorted(range(len(file_bytes)), key=lambda k: (-file_bytes[k], k)):
        owners[k] = min(range(processes), key=lambda p: (load[p], p))
        load[owners[k]] += file_bytes[k]
    return owners


class SavePlan(NamedTuple):
    """What `save_hf` writes for a model: every HF tensor in file order, its dtype and bytes, the
    buckets, the files (name and bucket indices) and the process that writes each file."""

    tensors: list[HfTensor]
    dtypes: list[np.dtype]
    sizes: list[int]
    buckets: list[_Bucket]
    files: list[tuple[str, list[int]]]
    owners: list[int]

    def file_bytes(self) -> list[int]:
        return [sum(self.buckets[b].nbytes for b in members) for _, members in self.files]

    def process_bytes(self, processes: int) -> list[int]:
        """Tensor bytes each process writes."""
        out = [0] * processes
        for owner, size in zip(self.owners, self.file_bytes(), strict=True):
            out[owner] += size
        return out

    def headers(self) -> list[bytes]:
        return [_header([self.tensors[i] for b in members for i in range(*self.buckets[b][:2])],
                        [self.dtypes[i] for b in members for i in range(*self.buckets[b][:2])])
                for _, members in self.files]


def save_plan(cfg: ModelConfig, dtypes: list[np.dtype] | np.dtype, processes: int = 1,
              max_shard_bytes: int = 4 << 30) -> SavePlan:
    """The files `save_hf` writes for a model of `cfg` with tensors of `dtypes` (one per HF
    tensor, or one for all), and which of `processes` writes each. Needs no weights."""
    tensors = hf_layout(cfg)
    if not isinstance(dtypes, list):
        dtypes = [np.dtype(dtypes)] * len(tensors)
    sizes = [math.prod(t.shape) * d.itemsize for t, d in zip(tensors, dtypes, strict=True)]
    buckets = _buckets(tensors, sizes)
    files = _plan_files(buckets, max_shard_bytes)
    owners = file_owners([sum(buckets[b].nbytes for b in m) for _, m in files], processes)
    return SavePlan(tensors, dtypes, sizes, buckets, files, owners)


def _fetch_order(plan: SavePlan, processes: int) -> list[list[tuple[int, int]]]:
    """`(file, bucket)` pairs in rounds: round r holds each process's r-th bucket (its files in
    order, each file's buckets in order), so that consecutive fetches go to different
    processes, which write while the others fetch."""
    queues = [[(k, b) for k, (_, members) in enumerate(plan.files) if plan.owners[k] == p
               for b in members] for p in range(processes)]
    return [[q[r] for q in queues if r < len(q)] for r in range(max(map(len, queues)))]


@jax.jit
def _layer_of(x, layer):
    """Layer `layer` of a stacked parameter (the index traced: one program for every layer)."""
    return jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)


@functools.partial(jax.jit, static_argnames=("experts", "perm", "shape", "dtype", "rows"))
def _to_hf(x, *, experts: bool, perm, shape, dtype, rows=None):
    """On the device: one layer's parameter `x` in the HF layout (`[E, *shape]` for an expert
    weight, else `shape`) and `dtype`. A program of its own, apart from `_layer_of`: fused with
    the slice, XLA:CPU's transpose runs ~8x slower (28 vs 3.8 ms for [4, 1024, 1024] float32).

    With `rows` (`_rows_sharding`), as rows `[R, C]` in the order of the bytes (`R` the leading
    HF axis, times the experts), padded to a multiple of the devices and split over them: what
    `_gather_to` takes."""
    lead = 1 if experts else 0
    x = x.transpose((*range(lead), *(lead + a for a in np.argsort(perm))))
    x = x.reshape((*x.shape[:lead], *shape)).astype(dtype)
    if rows is None:
        return x
    x = x.reshape(math.prod(x.shape[:lead + 1]), -1)
    x = jnp.pad(x, ((0, -x.shape[0] % rows.mesh.size), (0, 0)))
    return jax.lax.with_sharding_constraint(x, rows)


def _rows_sharding() -> jax.sharding.NamedSharding:
    """Rows split over every device, process by process (axis "all")."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len({sum(d.process_index == p for d in devices) for p in range(jax.process_count())}) > 1:
        raise ValueError("save_hf needs the same number of devices on every process.")
    mesh = jax.sharding.Mesh(np.array(devices), ("all",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("all"))


@functools.cache
def _gather_to(owner: int, rows: jax.sharding.NamedSharding):
    """A program that moves rows split by `rows` (D devices, P processes of L devices each, in
    process order) to process `owner`'s devices: in round k, the device at position
    `i * P + k` sends its block to the owner's i-th device, so that device ends with the blocks
    `i * P ... i * P + P - 1`, rows in order. Each block crosses once, to the owner only; the
    result, `[P * R, C]`, holds zeros on every other process's devices (every device of an SPMD
    program holds a block of the same shape)."""
    mesh = rows.mesh
    processes = jax.process_count()
    local = mesh.size // processes

    def body(block):
        return jnp.concatenate([jax.lax.ppermute(block, "all", [
            (i * processes + k, owner * local + i) for i in range(local)])
            for k in range(processes)])

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=rows.spec, out_specs=rows.spec))


class _Fetcher:
    """A model's buckets in HF layout, as host arrays of their bytes in file order, one bucket at
    a time. `local` (every parameter on this process's devices): `jax.device_get`. Otherwise
    every process takes part in each bucket's fetch, in the same order, and only its `owner`
    gets the bytes: `_to_hf` converts and splits it by rows over every device, `_gather_to`
    moves the rows to the owner's devices, and the owner copies its devices' blocks to the
    host."""

    def __init__(self, model: CausalLM, plan: SavePlan, local: bool):
        self.params = dict(nnx.to_flat_state(nnx.state(model)))
        self.plan = plan
        self.rows = None if local else _rows_sharding()

    def get(self, b: int, owner: int) -> list[np.ndarray]:
        """Bucket `b`'s bytes as uint8 blocks (their concatenation, cut to the bucket's size, is
        what the file holds); empty on a process that is not the owner."""
        bucket = self.plan.buckets[b]
        tensor, dtype = self.plan.tensors[bucket.first], self.plan.dtypes[bucket.first]
        x = self.params[tensor.path].get_value()
        if tensor.layer is not None:
            x = _layer_of(x, tensor.layer)
        same = (tensor.perm == tuple(range(len(tensor.perm))) and tensor.view == tensor.shape
                and tensor.expert is None and x.dtype == dtype)
        if self.rows is None:
            y = x if same else _to_hf(x, experts=tensor.expert is not None, perm=tensor.perm,
                                      shape=tensor.shape, dtype=dtype)
            return [_bytes(np.asarray(jax.device_get(y)))]
        y = _to_hf(x, experts=tensor.expert is not None, perm=tensor.perm, shape=tensor.shape,
                   dtype=dtype, rows=self.rows)
        gathered = _gather_to(owner, self.rows)(y)
        if owner != jax.process_index():
            return []
        by_device = {s.device: s.data for s in gathered.addressable_shards}
        mine = [d for d in self.rows.mesh.devices if d in by_device]
        for d in mine:
            by_device[d].copy_to_host_async()
        return [_bytes(np.asarray(by_device[d])) for d in mine]


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def hf_tensors(model: CausalLM) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(hf_name, array)` for every weight of `model` (either layer layout, on this
    process's devices), in Hugging Face layout, one bucket on the host at a time."""
    params = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    plan = save_plan(model.cfg, [np.dtype(params[t.path].dtype) for t in hf_layout(model.cfg)])
    fetcher = _Fetcher(model, plan, local=True)
    for b, bucket in enumerate(plan.buckets):
        data = fetcher.get(b, 0)[0]
        offset = 0
        for i in range(bucket.first, bucket.last):
            tensor, n = plan.tensors[i], plan.sizes[i]
            yield tensor.name, data[offset:offset + n].view(plan.dtypes[i]).reshape(tensor.shape)
            offset += n


class _Writer:
    """This process's files, written bucket by bucket in the order of `_fetch_order`: a file is
    opened, its header written, when its first bucket comes, and closed (its size checked) when
    the next file's does, or at the end. Each bucket is written on a thread while the next ones
    are fetched; `wait()` returns when the last one given is written (and raises what writing it
    raised)."""

    def __init__(self, path: str, plan: SavePlan):
        self.path, self.plan = path, plan
        self.headers = plan.headers()
        self.sizes = [len(h) + n for h, n in zip(self.headers, plan.file_bytes(), strict=True)]
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self._pending: concurrent.futures.Future | None = None
        self._file: tuple[int, io.BufferedWriter] | None = None

    def write(self, k: int, blocks: list[np.ndarray], nbytes: int) -> None:
        self.wait()
        self._pending = self._pool.submit(self._write, k, blocks, nbytes)

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _write(self, k: int, blocks: list[np.ndarray], nbytes: int) -> None:
        if self._file is None or self._file[0] != k:
            self._close()
            f = open(os.path.join(self.path, self.plan.files[k][0]), "wb")  # noqa: SIM115
            self._file = (k, f)
            f.write(self.headers[k])
        f = self._file[1]
        for block in blocks:
            if nbytes <= 0:
                break
            f.write(memoryview(block[:nbytes]))
            nbytes -= len(block)

    def _close(self) -> None:
        if self._file is not None:
            (k, f), self._file = self._file, None
            size = f.tell()
            f.close()
            if size != self.sizes[k]:
                raise AssertionError(f"{self.plan.files[k][0]}: wrote {size} bytes, its header "
                                     f"says {self.sizes[k]}")

    def close(self) -> None:
        """Waits for the writes and closes the last file."""
        self.wait()
        self._pool.submit(self._close).result()
        self._pool.shutdown()


def _header(tensors: Iterable[HfTensor], dtypes: Iterable[np.dtype]) -> bytes:
    """A safetensors header (length and JSON, padded with spaces to 8 bytes) for `tensors` in
    this order, with contiguous data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor, dtype in zip(tensors, dtypes, strict=True):
        n = math.prod(tensor.shape) * dtype.itemsize
        header[tensor.name] = {"dtype": ST_NAMES[dtype], "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _begin(path: str) -> None:
    """Marks `path` pending (before anything else changes), then clears a previous save."""
    with open(os.path.join(path, PENDING_MARKER), "w") as f:
        f.write("save_hf is writing this directory\n")
    for stale in os.listdir(path):
        if stale == COMPLETE_MARKER or re.fullmatch(
                r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", stale):
            os.remove(os.path.join(path, stale))


_SAVES = itertools.count()  # this process's multi-process saves: every process counts the same


def _barrier(name: str) -> None:
    """Waits for every process at the coordinator (not in a device collective: the others may be
    writing to a slow disk for a while)."""
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(f"sao_jax/save_hf/{name}",
                                                    SAVE_TIMEOUT_S * 1000)


def save_hf(model: CausalLM, path: str, *, max_shard_bytes: int = 4 << 30,
            dtype: str | None = None) -> None:
    """Writes `model` (either layer layout, sharded or not) as a Hugging Face directory that
    transformers and SGLang load, with bounded host memory (module docstring).

    Shards of at most `max_shard_bytes` (the index file is written when there is more than one;
    a bucket larger than that gets a file of its own). `dtype` (e.g. "bfloat16") converts on the
    way out; the default keeps the parameter dtype. A model on several processes' devices: every
    process must call it (with the same arguments; `path` on a filesystem they share), and each
    writes the files `file_owners` gives it. A model on this process's devices alone (a warm
    start on the leader, say) is written by this process alone, whatever the others do.
    COMPLETE_MARKER is written last.
    """
    params = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    local = all(getattr(x, "is_fully_addressable", True) for x in params.values())
    process, processes = (0, 1) if local else (jax.process_index(), jax.process_count())
    plan = save_plan(model.cfg, [np.dtype(dtype or params[t.path].dtype)
                                 for t in hf_layout(model.cfg)], processes, max_shard_bytes)
    save = None if processes == 1 else next(_SAVES)
    os.makedirs(path, exist_ok=True)
    if process == 0:
        _begin(path)
    if save is not None:
        _barrier(f"{save}/begun")
    fetcher = _Fetcher(model, plan, local)
    writer = _Writer(path, plan)
    try:
        for r, fetches in enumerate(_fetch_order(plan, processes)):
            if save is not None:  # this process's last bucket written, then everyone fetches
                writer.wait()
                _barrier(f"{save}/round {r}")
            for k, b in fetches:  # each written on the writer's thread while the next converts
                blocks = fetcher.get(b, plan.owners[k])
                if blocks:
                    writer.write(k, blocks, plan.buckets[b].nbytes)
                del blocks  # so that the bucket is freed before the next one is fetched
    finally:
        writer.close()
    if process == 0:
        config = model.cfg.to_hf(dtype=jnp.dtype(plan.dtypes[0]).name)
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2)
        if len(plan.files) > 1:
            weight_map = {plan.tensors[i].name: name for name, members in plan.files
                          for b in members for i in range(*plan.buckets[b][:2])}
            with open(os.path.join(path, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": sum(plan.sizes)},
                           "weight_map": weight_map}, f, indent=2)
    if save is not None:
        _barrier(f"{save}/written")
    if process == 0:
        written = {name: os.path.getsize(os.path.join(path, name)) for name, _ in plan.files}
        with open(os.path.join(path, COMPLETE_MARKER), "w") as f:
            json.dump({"files": written}, f, indent=2)
        os.remove(os.path.join(path, PENDING_MARKER))
