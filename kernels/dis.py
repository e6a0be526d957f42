"""The DIS policy loss (docs/algorithm.md §1) as Pallas kernels: forward partial sums, backward
gradient.

    r_t    = exp(clip(logp_t - rollout_logp_t, -20, 20))      (0 log-ratio where either is inf/NaN)
    band_t = 1[1 - eps_low <= r_t <= 1 + eps_high],  w_t = m_t * finite_t * band_t * r_t * A_t
    loss   = - sum w / N,   d loss / d logp_t = - w_t / N

Forward: a grid over (row blocks, time blocks), every step independent ("parallel" on both axes),
each reading its `rows x time` block of logp, rollout_logp, advantages and mask once and writing
nine per-row partial sums (loss numerator, action tokens, in-band tokens, below / above the band,
non-finite, |log-ratio|, ratio, finite action tokens) to a `[time blocks, B, 16]` array. The
wrapper adds those up (counts as int32, exactly) into the loss and `DisMetrics`.

Backward (a `custom_vjp`; autodiff cannot see through `pallas_call`): the same grid, recomputing the
ratio and band from the inputs and writing `d loss / d logp` scaled by the loss cotangent / N, plus
the `logp_mismatch` cotangent times sign(log-ratio) / (finite action tokens). Recomputing keeps no
`[B, T]` residual alive between the passes. rollout_logp, advantages and the normalizer are data
here: their cotangents are zero.

Same numbers as `dis_loss_reference` (`sao_jax.rl.dis_loss(..., impl="xla")`) up to the order of
float32 summation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

from . import _common, checks

DENOMINATORS = ("action_tokens", "in_band_tokens")
MAX_LOG_RATIO = 20.0  # log-ratios are clamped to this before exp: exp(20) ~ 4.9e8, no overflow
_SUMS = 16  # lanes of the partial-sums array; the first 9 are used
(_WEIGHT, _ACTIONS, _IN_BAND, _BELOW, _ABOVE, _NONFINITE, _ABS_LOG_RATIO, _RATIO,
 _FINITE) = range(9)
_COUNTS = (_ACTIONS, _IN_BAND, _BELOW, _ABOVE, _NONFINITE, _FINITE)


class DisMetrics(NamedTuple):
    """What to log from the DIS loss: float32 scalars over action tokens (`sao_jax.rl.DisMetrics`
    is this class)."""

    below_band_frac: jax.Array  # ratio < 1 - eps_low (zero weight)
    above_band_frac: jax.Array  # ratio > 1 + eps_high (zero weight)
    nonfinite_frac: jax.Array  # logp or rollout_logp was inf/NaN (zero weight)
    logp_mismatch: jax.Array  # mean |logp - rollout_logp| over finite pairs: train-inference gap
    # (its tail, the p99 and max of the same pairs: `sao_jax.rl.logp_gap`)
    ratio_mean: jax.Array  # mean ratio over finite pairs


@dataclasses.dataclass(frozen=True)
class DisBlocks:
    """Tokens per grid step: `rows` trajectories x `time` tokens.

    TPU: rows a multiple of 8 (32 keeps the int8 mask on its native tiling), time a multiple of
    128. GPU: powers of two, `num_warps` warps per program (ignored on TPU).
    """

    rows: int
    time: int
    num_warps: int = 4

    def __post_init__(self):
        for name in ("rows", "time", "num_warps"):
            _common.check_positive_int("DisBlocks", name, getattr(self, name))

    @classmethod
    def default(cls, variant: str) -> DisBlocks:
        return cls(rows=32, time=1024) if variant == "tpu" else cls(rows=4, time=1024, num_warps=4)


def dis_loss(
    logp: jax.Array,
    rollout_logp: jax.Array,
    advantages: jax.Array,
    action_mask: jax.Array,
    *,
    eps_low: float | jax.Array,
    eps_high: float | jax.Array,
    denominator: str = "action_tokens",
    normalizer: float | jax.Array | None = None,
    blocks: DisBlocks | None = None,
    interpret: bool | None = None,
    backend: str | None = None,
    sharding: jax.sharding.NamedSharding | None = None,
) -> tuple[jax.Array, DisMetrics]:
    """DIS loss and metrics, differentiable in `logp` (see the module docstring).

    Arguments and results as `sao_jax.rl.dis_loss` and `dis_loss_reference` (checked by
    `check_dis_args`): `[B, T]` logp, rollout_logp, advantages and action_mask; scalar eps_low in
    [0, 1], eps_high >= 0; denominator "action_tokens" (N = action tokens, or `normalizer` when
    given) or "in_band_tokens".

    Args:
      blocks: block sizes; None picks `DisBlocks.default` for the variant.
      interpret: run in Pallas' interpreter; None does so exactly where the devices are CPUs.
      backend: "tpu" or "gpu" (or "cuda"/"rocm") picks the kernel variant; None follows the
        platform of `sharding`'s devices, else `jax.default_backend()` (the GPU variant on a CPU).
      sharding: how the `[B, T]` operands' rows are split over a mesh, inside a sharded jit:
        both kernels then run on each device's rows (`jax.shard_map`) and only the per-row sums
        cross devices. Without it, XLA cannot partition a TPU kernel at all.
    """
    check_dis_args(logp, rollout_logp, advantages, action_mask, eps_low, eps_high, denominator,
                   normalizer)
    _common.check_sharding("dis_loss", sharding, jnp.shape(logp)[0])
    variant, interpret = _common.resolve(backend, interpret, sharding)
    blocks = DisBlocks.default(variant) if blocks is None else blocks
    if not isinstance(blocks, DisBlocks):
        raise ValueError(f"blocks must be a DisBlocks, got {type(blocks).__name__}.")
    _common.check_blocks("DisBlocks", blocks.rows, blocks.time, variant)

    if 0 in jnp.shape(logp):  # no block to launch: the loss and every metric are 0
        return dis_loss_reference(logp, rollout_logp, advantages, action_mask, eps_low=eps_low,
                                  eps_high=eps_high, denominator=denominator,
                                  normalizer=normalizer)
    # The band edges as the reference computes them (1 - eps in Python, then float32).
    band = jnp.stack([jnp.asarray(1.0 - eps_low, jnp.float32),
                      jnp.asarray(1.0 + eps_high, jnp.float32)])
    norm = jnp.asarray(0.0 if normalizer is None else normalizer, jnp.float32)
    config = _Config(variant, blocks, interpret, denominator, normalizer is not None, sharding)
    loss, metrics = _dis(jnp.asarray(logp, jnp.float32), jnp.asarray(rollout_logp, jnp.float32),
                         jnp.asarray(advantages, jnp.float32),
                         _common.mask_operand(action_mask, variant), lax.stop_gradient(band),
                         lax.stop_gradient(norm), config)
    return loss, DisMetrics(*metrics)


@dataclasses.dataclass(frozen=True)
class _Config:
    variant: str
    blocks: DisBlocks
    interpret: bool
    denominator: str
    has_normalizer: bool
    sharding: jax.sharding.NamedSharding | None = None

    @property
    def local(self) -> _Config:
        """This config for one shard's rows (inside `shard_map`)."""
        return dataclasses.replace(self, sharding=None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _dis(logp, rollout_logp, advantages, mask, band, norm, config):
    return _dis_fwd(logp, rollout_logp, advantages, mask, band, norm, config)[0]


def _dis_fwd(logp, rollout_logp, advantages, mask, band, norm, config):
    # [B, time blocks, sums]: rows first, so that each shard's rows come back in place.
    partial_sums = _common.per_shard(
        lambda *a: jnp.moveaxis(_forward(*a, config.local), 1, 0), config.sharding, 4, 1)(
        logp, rollout_logp, advantages, mask, band)
    sums = jnp.sum(partial_sums, axis=(0, 1))
    # Each block's counts are exact in float32; their total need not be: add them as integers.
    counts = jnp.sum(partial_sums[..., jnp.array(_COUNTS)].astype(jnp.int32), axis=(0, 1))
    actions, in_band, below, above, nonfinite, finite = (counts[i] for i in range(len(_COUNTS)))
    if config.has_normalizer:
        n = norm
    else:
        n = actions if config.denominator == "action_tokens" else in_band
    n = jnp.maximum(n, 1)
    per_action = jnp.maximum(actions, 1)
    per_finite = jnp.maximum(finite, 1)
    loss = -sums[_WEIGHT] / n
    metrics = (below / per_action, above / per_action, nonfinite / per_action,
               sums[_ABS_LOG_RATIO] / per_finite, sums[_RATIO] / per_finite)
    metrics = tuple(x.astype(jnp.float32) for x in metrics)
    return (loss, metrics), (logp, rollout_logp, advantages, mask, band, n, per_finite)


def _dis_bwd(config, residuals, cotangents):
    logp, rollout_logp, advantages, mask, band, n, per_finite = residuals
    loss_ct, metrics_ct = cotangents
    scales = jnp.stack([band[0], band[1], -loss_ct / n, metrics_ct[3] / per_finite])
    grad = _common.per_shard(lambda *a: _backward(*a, config.local), config.sharding, 4, 1)(
        logp, rollout_logp, advantages, mask, scales.astype(jnp.float32))
    return grad, None, None, None, None, None


_dis.defvjp(_dis_fwd, _dis_bwd)


# --------------------------------------------------------------------------------------------------
# The block math, shared by both variants.


def _terms(logp, rollout_logp, advantages, m, low, high):
    """Per-token ratio, band and weight, exactly as `dis_loss_reference` computes them."""
    finite = (jnp.abs(logp) < jnp.inf) & (jnp.abs(rollout_logp) < jnp.inf)
    log_ratio = jnp.where(finite, jnp.where(finite, logp, 0.0) - rollout_logp, 0.0)
    ratio = jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    below = ratio < low
    above = ratio > high
    valid = m & finite
    in_band = valid & ~below & ~above
    weight = jnp.where(in_band, ratio * advantages, 0.0)
    return finite, log_ratio, ratio, below, above, valid, in_band, weight


def _block_ok(shape, batch, length):
    rows, time = shape
    row = pl.program_id(0) * rows + lax.broadcasted_iota(jnp.int32, shape, 0)
    col = pl.program_id(1) * time + lax.broadcasted_iota(jnp.int32, shape, 1)
    return (row < batch) & (col < length)


def _load_block(logp_ref, rollout_ref, adv_ref, m_ref, ok, variant):
    load = functools.partial(_common.load_tile, ok=ok, variant=variant)
    logp = load(logp_ref, other=0.0)
    rollout_logp = load(rollout_ref, other=0.0)
    advantages = load(adv_ref, other=0.0)
    if variant == "gpu":
        m = ok & load(m_ref, other=False)
    else:  # int8, widened before comparing
        m = ok & (m_ref[...].astype(jnp.int32) != 0)
    return logp, rollout_logp, advantages, m


def _forward_kernel(band_ref, logp_ref, rollout_ref, adv_ref, m_ref, out_ref,
                    *, batch, length, variant):
    ok = _block_ok(logp_ref.shape, batch, length)
    logp, rollout_logp, advantages, m = _load_block(logp_ref, rollout_ref, adv_ref, m_ref, ok,
                                                    variant)
    finite, log_ratio, ratio, below, above, valid, in_band, weight = _terms(
        logp, rollout_logp, advantages, m, band_ref[0], band_ref[1])
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    per_token = {
        _WEIGHT: weight,
        _ACTIONS: f32(m),
        _IN_BAND: f32(in_band),
        _BELOW: f32(valid & below),
        _ABOVE: f32(valid & above),
        _NONFINITE: f32(m & ~finite),
        _ABS_LOG_RATIO: jnp.where(valid, jnp.abs(log_ratio), 0.0),
        _RATIO: jnp.where(valid, ratio, 0.0),
        _FINITE: f32(valid),
    }
    rows = logp_ref.shape[0]
    column = lax.broadcasted_iota(jnp.int32, (rows, _SUMS), 1)
    sums = jnp.zeros((rows, _SUMS), jnp.float32)
    for index, x in per_token.items():  # Triton cannot concatenate: place each sum by a select
        sums = sums + jnp.where(column == index, jnp.sum(x, axis=1, keepdims=True), 0.0)
    row_ok = pl.program_id(0) * rows + lax.broadcasted_iota(jnp.int32, (rows, _SUMS), 0) < batch
    _common.store_tile(out_ref, sums, row_ok, variant)


def _backward_kernel(scale_ref, logp_ref, rollout_ref, adv_ref, m_ref, grad_ref,
                     *, batch, length, variant):
    ok = _block_ok(logp_ref.shape, batch, length)
    logp, rollout_logp, advantages, m = _load_block(logp_ref, rollout_ref, adv_ref, m_ref, ok,
                                                    variant)
    _, log_ratio, _, _, _, valid, _, weight = _terms(
        logp, rollout_logp, advantages, m, scale_ref[0], scale_ref[1])
    # d|x|/dx as jnp.abs differentiates it (0 at 0). Not jnp.sign: Mosaic lowers it by asking the
    # TPU's chip version, which a host exporting for TPU does not have.
    sign = jnp.where(log_ratio > 0, 1.0, jnp.where(log_ratio < 0, -1.0, 0.0))
    grad = scale_ref[2] * weight + scale_ref[3] * jnp.where(valid, sign, 0.0)
    _common.store_tile(grad_ref, grad, ok, variant)


def _specs(batch, length, config):
    rows, time = config.blocks.rows, config.blocks.time
    grid = (pl.cdiv(batch, rows), pl.cdiv(length, time))
    tile = pl.BlockSpec((rows, time), lambda i, j: (i, j))
    sums = pl.BlockSpec((None, rows, _SUMS), lambda i, j: (j, i, 0))
    if config.variant == "tpu":
        scalars = pl.BlockSpec(memory_space=pltpu.SMEM)
        params = pltpu.CompilerParams(dimension_semantics=(pltpu.PARALLEL, pltpu.PARALLEL))
    else:
        scalars = pl.BlockSpec((4,), lambda i, j: (0,))
        params = pltr.CompilerParams(num_warps=config.blocks.num_warps)
    return grid, tile, sums, scalars, params


def _forward(logp, rollout_logp, advantages, mask, band, config):
    batch, length = logp.shape
    grid, tile, sums, scalars, params = _specs(batch, length, config)
    kernel = functools.partial(_forward_kernel, batch=batch, length=length,
                               variant=config.variant)
    band4 = jnp.concatenate([band, jnp.zeros((2,), jnp.float32)])  # one scalar spec for both
    return pl.pallas_call(
        kernel, grid=grid, in_specs=[scalars, tile, tile, tile, tile], out_specs=sums,
        out_shape=jax.ShapeDtypeStruct((grid[1], batch, _SUMS), jnp.float32),
        compiler_params=params, interpret=config.interpret, name="dis_forward",
    )(band4, logp, rollout_logp, advantages, mask)


def _backward(logp, rollout_logp, advantages, mask, scales, config):
    batch, length = logp.shape
    grid, tile, _, scalars, params = _specs(batch, length, config)
    kernel = functools.partial(_backward_kernel, batch=batch, length=length,
                               variant=config.variant)
    return pl.pallas_call(
        kernel, grid=grid, in_specs=[scalars, tile, tile, tile, tile], out_specs=tile,
        out_shape=jax.ShapeDtypeStruct((batch, length), jnp.float32),
        compiler_params=params, interpret=config.interpret, name="dis_backward",
    )(scales, logp, rollout_logp, advantages, mask)


# --------------------------------------------------------------------------------------------------
# The arguments, and the reference: the one pure-jnp statement of the DIS loss, which
# `sao_jax.rl.dis_loss` runs as impl="xla" and the kernels are tested against.


def check_dis_args(logp, rollout_logp, advantages, action_mask, eps_low, eps_high,
                   denominator="action_tokens", normalizer=None) -> None:
    """The checks of every DIS implementation's arguments (`sao_jax.rl.dis_loss` documents
    them); each failure is a ValueError naming the argument."""
    checks.check_choice("denominator", denominator, DENOMINATORS)
    checks.check_rank("logp", logp, 2, checks.TOKENS_BxT)
    for name, x in (("rollout_logp", rollout_logp), ("advantages", advantages),
                    ("action_mask", action_mask)):
        checks.check_same_shape(name, x, "logp", logp)
    checks.check_in_range("eps_low", eps_low, 0.0, 1.0, " (1 means no lower bound)")
    checks.check_in_range("eps_high", eps_high, 0.0, float("inf"))
    for name, x in (("eps_low", eps_low), ("eps_high", eps_high)):
        if np.ndim(x) != 0:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(np.shape(x))}.")
    if normalizer is not None:
        if denominator != "action_tokens":
            raise ValueError("normalizer replaces the action-token count; it needs "
                             f"denominator='action_tokens', got {denominator!r}.")
        if np.ndim(normalizer) != 0:
            raise ValueError(f"normalizer must be a scalar, got shape "
                             f"{tuple(np.shape(normalizer))}.")


def dis_loss_reference(logp, rollout_logp, advantages, action_mask, *, eps_low, eps_high,
                       denominator="action_tokens", normalizer=None):
    """The DIS loss in plain jnp, differentiable by autodiff (in `logp` only: the advantages are
    `sg(A)`); same arguments and results as `dis_loss`."""
    check_dis_args(logp, rollout_logp, advantages, action_mask, eps_low, eps_high, denominator,
                   normalizer)
    m = jnp.asarray(action_mask) != 0
    logp = jnp.asarray(logp, jnp.float32)
    rollout_logp = jnp.asarray(rollout_logp, jnp.float32)
    finite = jnp.isfinite(logp) & jnp.isfinite(rollout_logp)
    # Non-finite entries are replaced before any arithmetic, so no NaN reaches the gradient.
    logp_safe = jnp.where(finite, logp, 0.0)
    log_ratio = jnp.where(finite, logp_safe - rollout_logp, 0.0)
    ratio = jnp.exp(jnp.clip(lax.stop_gradient(log_ratio), -MAX_LOG_RATIO, MAX_LOG_RATIO))
    below = ratio < 1.0 - eps_low
    above = ratio > 1.0 + eps_high
    valid = m & finite
    in_band = valid & ~below & ~above
    weight = jnp.where(in_band, ratio * lax.stop_gradient(advantages), 0.0)
    # Value r*A*band, gradient r*A*band: the ratio enters through sg(r) * (1 + logp - sg(logp)),
    # written so that the value is exactly the weight even where 1 + logp rounds (|logp| > 2^24).
    surrogate = weight + weight * (logp_safe - lax.stop_gradient(logp_safe))
    if denominator == "action_tokens":
        n = jnp.sum(m) if normalizer is None else normalizer
    else:
        n = jnp.sum(in_band)
    loss = -jnp.sum(surrogate) / jnp.maximum(n, 1)

    def mean(x, where):
        return jnp.sum(jnp.where(where, x, 0.0)) / jnp.maximum(jnp.sum(where), 1)

    metrics = DisMetrics(
        below_band_frac=mean(below & finite, m).astype(jnp.float32),
        above_band_frac=mean(above & finite, m).astype(jnp.float32),
        nonfinite_frac=mean(~finite, m).astype(jnp.float32),
        logp_mismatch=mean(jnp.abs(log_ratio), valid),
        ratio_mean=mean(ratio, valid),
    )
    return loss, metrics
