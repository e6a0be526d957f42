"""What the kernels share: whether "auto" runs a kernel, which variant, interpret mode, block
checks, tile loads.

Two variants of every kernel, chosen by the wrapper from the backend (never inside a kernel):

  "tpu"  Mosaic TPU: a grid over (row blocks, time blocks); blocks are DMA'd into VMEM by
         BlockSpecs, the time axis runs in order ("arbitrary") where state is carried.
  "gpu"  Triton: a grid of independent programs (Triton runs them in any order, concurrently);
         refs are pointers into global memory and every load and store is masked explicitly,
         since Triton does not bound-check partial blocks.

On a CPU both run in Pallas' interpreter (`interpret=True`), which is how the tests check them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as pltr
from jax.sharding import NamedSharding, PartitionSpec

VARIANTS = ("tpu", "gpu")
# The interpreter runs either variant on a CPU. The GPU variant interprets faster there: one loop
# over time inside each program instead of one grid step per block.
_CPU_VARIANT = "gpu"


def platform_of(sharding) -> str:
    """The platform ("cpu", "gpu", "tpu") of the devices a computation over `sharding` runs on;
    without a sharding, this host's default backend."""
    if sharding is None:
        return jax.default_backend()
    return next(iter(sharding.device_set)).platform


# Where "auto" runs the kernels. Not on GPUs: compiled on an H200 (JAX 0.11.2, 2026-12-04), the
# GAE kernel passed the device tests at small blocks (2 rows x 32 tokens) but crashed XLA's
# compile (a segfault, the process gone) at its default blocks (1 row x 1024 tokens), in a
# learner step too; the DIS kernel was not reached (docs/kernels.md, "On a GPU"). That crash
# (Triton's, on every one-row block) is fixed and both kernels compile for H100 and H200 targets
# without a GPU (`make test-gpu-compile`), but neither has passed the device tests at its
# default blocks yet.
AUTO_KERNEL_PLATFORMS = ("tpu",)


def resolve_impl(impl: str, sharding=None) -> str:
    """What `impl="auto"` of `sao_jax.rl.gae` and `sao_jax.rl.dis_loss` runs: "pallas" where the
    devices (`sharding`'s, else this host's) are in `AUTO_KERNEL_PLATFORMS` (TPUs), else "xla":
    on CPUs a kernel could only be interpreted, and on GPUs the Triton variants have not yet
    passed the device tests at their default blocks (`impl="pallas"` runs them). Any other
    `impl` is returned as it is."""
    if impl == "auto":
        return "pallas" if platform_of(sharding) in AUTO_KERNEL_PLATFORMS else "xla"
    return impl


def resolve(backend: str | None, interpret: bool | None, sharding=None) -> tuple[str, bool]:
    """`(variant, interpret)` for a kernel call.

    Args:
      backend: "tpu" or "gpu" (also "cuda", "rocm") picks the variant; None takes the platform of
        `sharding`'s devices, or without one `jax.default_backend()` ("cpu" runs the GPU variant
        in the interpreter). A step compiled on a CPU host for a TPU mesh so gets the TPU kernel.
      interpret: None interprets where those devices are CPUs. Pass False with an explicit
        backend to lower for that accelerator from any host (`jax.export`).
      sharding: the `NamedSharding` of the call's `[B, T]` operands, or None.
    """
    platform = platform_of(sharding)
    name = platform if backend is None else backend
    name = {"cuda": "gpu", "rocm": "gpu", "cpu": _CPU_VARIANT}.get(name, name)
    if name not in VARIANTS:
        raise ValueError(f"backend must be one of ('tpu', 'gpu', 'cuda', 'rocm', None), got "
                         f"{backend!r}.")
    if interpret is None:
        interpret = platform == "cpu"
    return name, bool(interpret)


def check_sharding(owner: str, sharding, rows: int) -> None:
    """`sharding` (of a kernel's `[B, T]` operands) splits rows only, into equal shards."""
    if sharding is None:
        return
    if not isinstance(sharding, NamedSharding):
        raise ValueError(f"{owner}: sharding must be a jax.sharding.NamedSharding of the [B, T] "
                         f"operands, got {type(sharding).__name__}.")
    spec = tuple(sharding.spec) + (None,) * 2
    if any(axis is not None for axis in spec[1:]):
        raise ValueError(f"{owner}: sharding {sharding.spec} splits the time axis; the kernels "
                         "split rows only (PartitionSpec(<batch axes>)).")
    shards = _row_shards(sharding)
    if rows % shards:
        raise ValueError(f"{owner}: {rows} rows do not split into the {shards} row shards of "
                         f"sharding {sharding.spec}.")


def _row_shards(sharding: NamedSharding) -> int:
    axes = sharding.spec[0] if len(sharding.spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([sharding.mesh.shape[a] for a in axes], dtype=np.int64))


def per_shard(fn, sharding: NamedSharding | None, row_args: int, scalar_args: int = 0):
    """`fn` over row shards: the first `row_args` arguments (and every output) split by rows as
    `sharding` says, the next `scalar_args` replicated; `fn` itself unchanged without a
    sharding. Mosaic kernels cannot be partitioned by XLA (it would refuse, or gather the
    operands whole on every device): a kernel under `jax.shard_map` runs on each device's rows
    and moves nothing between devices."""
    if sharding is None:
        return fn
    rows = PartitionSpec(sharding.spec[0] if len(sharding.spec) else None)
    return jax.shard_map(fn, mesh=sharding.mesh,
                         in_specs=(rows,) * row_args + (PartitionSpec(),) * scalar_args,
                         out_specs=rows, check_vma=False)


def is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def check_positive_int(owner: str, name: str, value) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}.")


def check_blocks(owner: str, rows: int, time: int, variant: str) -> None:
    """What each compiler needs of a block: Triton power-of-two tensors, Mosaic (8, 128) tiles."""
    if variant == "gpu":
        for name, value in (("rows", rows), ("time", time)):
            if not is_power_of_two(value):
                raise ValueError(f"{owner}.{name} must be a power of two for the GPU (Triton) "
                                 f"kernel, got {value}.")
    else:
        if rows % 8:
            raise ValueError(f"{owner}.rows must be a multiple of 8 for the TPU kernel (sublane "
                             f"tiles), got {rows}.")
        if time % 128:
            raise ValueError(f"{owner}.time must be a multiple of 128 for the TPU kernel (lane "
                             f"tiles), got {time}.")


def mask_operand(action_mask: jax.Array, variant: str) -> jax.Array:
    """The action mask as the kernel reads it: one byte per token.

    Triton reads bool directly. Pallas TPU would widen a bool operand to int32 (4 bytes a token), so
    the TPU variant reads int8 instead (32-row blocks keep int8 on its native (32, 128) tiling).
    """
    m = jnp.asarray(action_mask)
    if variant == "gpu":
        return m if m.dtype == jnp.bool_ else m != 0
    return m if m.dtype == jnp.int8 else (m != 0).astype(jnp.int8)


def load_tile(ref, ok: jax.Array, other, variant: str) -> jax.Array:
    """The block in `ref`, with `other` wherever `ok` is false (outside the array).

    TPU blocks past the array's edge hold unspecified data: read, then select. Triton has no bound
    checks at all: the load itself is masked, so nothing outside the array is touched.
    """
    if variant == "gpu":
        return pltr.load(ref, mask=ok, other=other)
    return jnp.where(ok, ref[...], other)


def store_tile(ref, value: jax.Array, ok: jax.Array, variant: str) -> None:
    """Writes `value`; on the GPU only where `ok` (the TPU drops writes past the array itself)."""
    if variant == "gpu":
        pltr.store(ref, value, mask=ok)
    else:
        ref[...] = value
