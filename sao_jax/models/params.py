"""Parameters carrying logical axis names only, shared by the decoder (`transformer.py`) and the
MoE layers (`moe.py`); `transformer.py` says how parameters are stored and placed on a mesh.
`cast_floating` puts a tree of them in another dtype (the learner's float32 master weights into
the dtype its passes compute in).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


def named_param(value, axes) -> nnx.Param:
    """A parameter carrying logical axis names only.

    Placing it on a mesh is the caller's job (eval_shape -> shardings -> jit(init,
    out_shardings=...)), so modules never need a mesh to be built. Flax's eager sharding, which
    would want one, is switched off here, per call: the setting is thread-local, and engines build
    models on worker threads.
    """
    with nnx.use_eager_sharding(False):
        return nnx.Param(value, out_sharding=axes)


def normal_param(rngs: nnx.Rngs, shape, axes, dtype, scale: float | None = None) -> nnx.Param:
    """A normal(0, scale) parameter (scale defaults to 1/sqrt(fan_in)) with logical axis names."""
    fan_in = shape[0] if len(shape) < 3 or axes[0] != "expert" else shape[1]
    std = scale if scale is not None else 1.0 / math.sqrt(fan_in)
    return named_param(std * jax.random.normal(rngs.params(), shape, dtype), axes)


class Projection(nnx.Module):
    """A bias-free weight `kernel` of any rank, applied by the caller's einsum."""

    def __init__(self, rngs, shape, axes, dtype, fan_in: int | None = None):
        scale = None if fan_in is None else 1.0 / math.sqrt(fan_in)
        self.kernel = normal_param(rngs, shape, axes, dtype, scale)


def cast_floating(tree, dtype):
    """`tree` (parameters: arrays, or `ShapeDtypeStruct`s) with its floating-point leaves in
    `dtype`; leaves already in it, and integer ones, are left as they are (not copied)."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(cast, tree)
