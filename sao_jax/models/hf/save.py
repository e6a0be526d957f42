"""Writing a `CausalLM` as a Hugging Face directory (`save_hf`), with bounded host memory.

`save_hf` streams, as `load_hf` does (`load.py`): each file's header is computed from shapes and
dtypes before any data is fetched (`save_plan`), then the tensors are fetched and written one
bucket at a time (a parameter, or one layer of a stacked one with all of its experts, never split
between files: `jax.jit` slices the layer and converts it to the HF layout on the device). A model
on this process's devices alone is written by this process, whatever the others do (a leader saving
its warm start), each piece on a thread while the next one converts. Parameters in host memory (one
CPU device) are converted by NumPy, a few MiB at a time into two reused buffers (a transpose of
nearly every byte: on CPU it costs about what the write into the page cache does, and XLA's runs
one program at a time, into fresh memory, in whole buckets: benchmarks/bench_publish.py); others by
`_to_hf` on their device, and fetched with `jax.device_get`. A model over several processes'
devices: every file has one writer, the files dealt to the processes by bytes (`file_owners`), and
each bucket goes to its writer only. Every process runs the same programs in the same order, in
rounds (each process's next bucket): `_to_hf` splits the bucket by rows over every device, and
`_gather_to` moves each device's rows to the writer's devices with `ppermute` (JAX will not reshard
onto one process's devices: in multi-controller JAX, `jax.device_put` and `jit` want the same
device set on both sides). A process thus holds its shards, the bucket it writes and the one being
fetched (another's as zeros on its devices for the moment of the gather), and copies to its host
only what it writes. The writes run on a thread while the next round is fetched; before each round
every process waits for its last write, then meets the others at the coordinator's barrier, so that
none waits in a device collective while another writes to a slow disk. The directory must be
shared; process 0 writes config.json and the index. Tensors are written in model order
(safetensors' own writer sorts them by name; readers only need the offsets), so the bytes depend on
neither the layout nor the process count (tests/models/test_hf_scale.py: two processes write the
files one process writes, each growing by 4-65 MiB while saving a 206 MiB model whose largest
bucket is 16 MiB; one process alone, from host memory, 0-8 MiB).

Completion: `save_hf` first writes PENDING_MARKER, and writes COMPLETE_MARKER last, after every
process has finished (a barrier), then removes PENDING_MARKER. `check_complete` (called by
`load_hf` and the engines) refuses a directory holding PENDING_MARKER without COMPLETE_MARKER:
one being written, or whose writer died. A directory with neither marker (a downloaded
checkpoint, anything transformers wrote) loads as before; so does one with COMPLETE_MARKER, which
also lists the files written and their sizes (for people; nothing checks them).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import io
import itertools
import json
import math
import os
import queue
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

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
    ST_NAMES,
    HfTensor,
    hf_layout,
)
from sao_jax.models.transformer import CausalLM

SAVE_TIMEOUT_S = 3600  # save_hf's processes wait this long for each other at a barrier


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


def _nothing() -> None:
    """The `release` of blocks that go back to no one."""


class _Fetched(NamedTuple):
    """A piece of a bucket: uint8 blocks whose concatenation, cut to `nbytes`, is what the file
    holds there. `owned`: the blocks are memory of the piece's own, which only its write keeps
    alive (so the writer holds few of them at once); else they are a view of a parameter or a
    buffer of `_Buffers`, whose number bounds them. `release` is called once they are
    written."""

    blocks: list[np.ndarray]
    nbytes: int
    owned: bool
    release: Callable[[], None] = _nothing


class _Buffers:
    """`count` host buffers of `_PIECE_BYTES` for pieces converted on the host, each taken for a
    piece and given back once it is written: converting into fresh memory costs its page faults
    (2 GB/s here against 5). `count` 0: a new buffer each time, never given back."""

    def __init__(self, count: int = 2):
        self.count = count
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(np.empty(_PIECE_BYTES, np.uint8))

    def take(self, nbytes: int) -> _Fetched:
        """A piece of `nbytes` in a free buffer (waits for one), to fill (`blocks[0]`)."""
        if not self.count:
            return _Fetched([np.empty(nbytes, np.uint8)], nbytes, owned=True)
        buf = self._free.get()
        if buf.nbytes < nbytes:  # a piece is larger only where a row is (`_host_pieces`)
            buf = np.empty(nbytes, np.uint8)
        return _Fetched([buf[:nbytes]], nbytes, owned=False,
                        release=functools.partial(self._free.put, buf))


class _Fetcher:
    """A model's buckets in HF layout, as pieces of host bytes in file order (`pieces`).
    Parameters in host memory (`_host_view`: on CPU devices, unsplit) are converted by NumPy,
    a piece of about `_PIECE_BYTES` at a time into `buffers`. Otherwise, `local` (every parameter
    on this process's devices): `_to_hf` on the device, and `jax.device_get`. Else every
    process takes part in each bucket's fetch, in the same order, and only its `owner` gets the
    bytes: `_to_hf` converts and splits it by rows over every device, `_gather_to` moves the
    rows to the owner's devices, and the owner copies its devices' blocks to the host."""

    def __init__(self, model: CausalLM, plan: SavePlan, local: bool, buffers: _Buffers):
        self.params = dict(nnx.to_flat_state(nnx.state(model)))
        self.plan = plan
        self.rows = None if local else _rows_sharding()
        self.buffers = buffers

    def pieces(self, b: int, owner: int) -> Iterator[_Fetched]:
        """Bucket `b`'s pieces, on the owner; none elsewhere."""
        bucket = self.plan.buckets[b]
        tensor, dtype = self.plan.tensors[bucket.first], self.plan.dtypes[bucket.first]
        x = self.params[tensor.path].get_value()
        host = _host_view(x) if self.rows is None else None
        if host is not None:
            yield from _host_pieces(host if tensor.layer is None else host[tensor.layer],
                                    tensor, dtype, self.buffers)
            return
        if tensor.layer is not None:
            x = _layer_of(x, tensor.layer)
        if self.rows is None:
            same = (tensor.perm == tuple(range(len(tensor.perm))) and tensor.expert is None
                    and tensor.view == tensor.shape and x.dtype == dtype)
            y = x if same else _to_hf(x, experts=tensor.expert is not None, perm=tensor.perm,
                                      shape=tensor.shape, dtype=dtype)
            yield _Fetched([_bytes(np.asarray(jax.device_get(y)))], bucket.nbytes, owned=True)
            return
        y = _to_hf(x, experts=tensor.expert is not None, perm=tensor.perm, shape=tensor.shape,
                   dtype=dtype, rows=self.rows)
        gathered = _gather_to(owner, self.rows)(y)
        if owner != jax.process_index():
            return
        by_device = {s.device: s.data for s in gathered.addressable_shards}
        mine = [d for d in self.rows.mesh.devices if d in by_device]
        for d in mine:
            by_device[d].copy_to_host_async()
        yield _Fetched([_bytes(np.asarray(by_device[d])) for d in mine], bucket.nbytes,
                       owned=True)


def _host_view(x: jax.Array) -> np.ndarray | None:
    """`x` as a NumPy view of its one buffer when that is host memory (one CPU device, or
    replicated over CPU devices); None otherwise."""
    devices = x.sharding.device_set
    if any(d.platform != "cpu" for d in devices):
        return None
    if len(devices) > 1 and not x.sharding.is_fully_replicated:
        return None
    return np.asarray(x.addressable_shards[0].data)


_PIECE_BYTES = 4 << 20  # a piece converted on the host: small enough that the writes keep pace
# Threads that convert a piece on the host, together: a core is left to the writer (on 2 cores
# a second converter slowed a save by 10-20%).
_HOST_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))
_THREAD_MIN_BYTES = 1 << 20  # a smaller piece is not worth a thread
_SLAB = 32  # source rows a transposed copy takes at once


@functools.cache
def _host_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The converting threads besides the caller (started as they are first needed)."""
    return concurrent.futures.ThreadPoolExecutor(3, thread_name_prefix="save_hf-convert")


def _host_pieces(x: np.ndarray, tensor: HfTensor, dtype: np.dtype,
                 buffers: _Buffers) -> Iterator[_Fetched]:
    """`_to_hf` in NumPy, for the host array `x` (a parameter, or one layer of a stacked one),
    in pieces of about `_PIECE_BYTES` (at least a row). Every tensor that moves is a torch
    `Linear` weight, ours `[*in, *out]` (per expert) and HF's `[prod(out), prod(in)]`: a piece is
    some of its rows, a transposed copy of some of our columns (`_transpose`)."""
    if tensor.perm == tuple(range(len(tensor.perm))):  # stored as we store it
        flat = x.reshape(-1)
        if flat.dtype == dtype:
            yield _Fetched([_bytes(flat)], flat.nbytes, owned=False)  # no copy
            return
        step = max(_PIECE_BYTES // dtype.itemsize, 1)
        parts = ((flat[first:first + step], _cast) for first in range(0, flat.size, step))
    else:
        n_out = math.prod(tensor.view[:tensor.perm[0]])
        src = x.reshape(-1, math.prod(tensor.view) // n_out, n_out)
        step = max(_PIECE_BYTES // (src.shape[1] * dtype.itemsize), 1)
        parts = ((matrix[:, first:first + step], _transpose)
                 for matrix in src for first in range(0, n_out, step))
    for part, convert in parts:
        piece = buffers.take(part.size * dtype.itemsize)
        convert(part, piece.blocks[0].view(dtype))
        yield piece


def _cast(src: np.ndarray, dst: np.ndarray) -> None:
    """`dst[:] = src` (both flat), cast to `dst`'s dtype."""
    np.copyto(dst, src, casting="unsafe")


def _transpose(src: np.ndarray, dst: np.ndarray) -> None:
    """`dst[:] = src.T` (`dst` flat, filled in `src.T`'s shape), `_SLAB` rows of `src` at a
    time (NumPy's own transposed copy walks `src` across rows: 0.6 GB/s here against 5), the
    rows shared among `_HOST_THREADS` threads (NumPy's copies let go of the GIL)."""
    def rows(first: int, last: int) -> None:
        for i in range(first, last, _SLAB):
            j = min(i + _SLAB, last)
            dst[:, i:j] = src[i:j].T

    n = src.shape[0]
    dst = dst.reshape(src.shape[1], n)
    parts = _HOST_THREADS if dst.nbytes >= _THREAD_MIN_BYTES else 1
    bounds = [n * k // parts // _SLAB * _SLAB for k in range(parts)] + [n]
    futures = [_host_pool().submit(rows, a, b)
               for a, b in zip(bounds[1:-1], bounds[2:], strict=True)]
    rows(bounds[0], bounds[1])
    for future in futures:
        future.result()


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def hf_tensors(model: CausalLM) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(hf_name, array)` for every weight of `model` (either layer layout, on this
    process's devices), in Hugging Face layout, one bucket on the host at a time."""
    params = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    plan = save_plan(model.cfg, [np.dtype(params[t.path].dtype) for t in hf_layout(model.cfg)])
    fetcher = _Fetcher(model, plan, local=True, buffers=_Buffers(0))
    for b, bucket in enumerate(plan.buckets):
        blocks = [block[:piece.nbytes] for piece in fetcher.pieces(b, 0)
                  for block in piece.blocks]
        data = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
        offset = 0
        for i in range(bucket.first, bucket.last):
            tensor, n = plan.tensors[i], plan.sizes[i]
            yield tensor.name, data[offset:offset + n].view(plan.dtypes[i]).reshape(tensor.shape)
            offset += n


class _Writer:
    """This process's files, written bucket by bucket in the order of `_fetch_order`: a file is
    opened, its header written, when its first bucket comes, and closed (its size checked) when
    the next file's does, or at the end. The buckets are written in turn on a thread while the
    next ones are fetched. A bucket of its own memory (`_Fetched.owned`) first waits for
    every earlier write, so that the host holds at most two (it and the one being fetched);
    others queue at once. `wait()` returns when every bucket given is written, and raises what
    writing one raised; `write` raises it too, once seen."""

    def __init__(self, path: str, plan: SavePlan):
        self.path, self.plan = path, plan
        self.headers = plan.headers()
        self.sizes = [len(h) + n for h, n in zip(self.headers, plan.file_bytes(), strict=True)]
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self._pending: collections.deque[concurrent.futures.Future] = collections.deque()
        self._file: tuple[int, io.BufferedWriter] | None = None

    def write(self, k: int, fetched: _Fetched) -> None:
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()
        if fetched.owned:
            self.wait()
        self._pending.append(self._pool.submit(self._write, k, fetched))

    def wait(self) -> None:
        pending, self._pending = self._pending, collections.deque()
        concurrent.futures.wait(pending)
        for future in pending:
            future.result()

    def _write(self, k: int, fetched: _Fetched) -> None:
        nbytes = fetched.nbytes
        try:
            if self._file is None or self._file[0] != k:
                self._close()
                f = open(os.path.join(self.path, self.plan.files[k][0]), "wb")  # noqa: SIM115
                self._file = (k, f)
                f.write(self.headers[k])
            f = self._file[1]
            for block in fetched.blocks:
                if nbytes <= 0:
                    break
                f.write(memoryview(block[:nbytes]))
                nbytes -= len(block)
        finally:
            fetched.release()

    def _close(self) -> None:
        if self._file is not None:
            (k, f), self._file = self._file, None
            size = f.tell()
            f.close()
            if size != self.sizes[k]:
                raise AssertionError(f"{self.plan.files[k][0]}: wrote {size} bytes, its header "
                                     f"says {self.sizes[k]}")

    def close(self) -> None:
        """Waits for the writes and closes the last file (its size checked)."""
        try:
            self.wait()
        except BaseException:
            self.abort()
            raise
        self._pool.submit(self._close).result()
        self._pool.shutdown()

    def abort(self) -> None:
        """After a failure: waits for the writes queued, ignoring what they raise, and closes the
        file unchecked (a size check would only hide the failure)."""
        concurrent.futures.wait(self._pending)
        self._pending.clear()
        if self._file is not None:
            self._file[1].close()
            self._file = None
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
    fetcher = _Fetcher(model, plan, local, _Buffers())
    writer = _Writer(path, plan)
    try:
        for r, fetches in enumerate(_fetch_order(plan, processes)):
            if save is not None:  # this process's last bucket written, then everyone fetches
                writer.wait()
                _barrier(f"{save}/round {r}")
            for k, b in fetches:  # each written on the writer's thread while the next converts
                for fetched in fetcher.pieces(b, plan.owners[k]):
                    writer.write(k, fetched)
                    del fetched  # so that the bucket is freed before the next one is fetched
    except BaseException:
        writer.abort()
        raise
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
