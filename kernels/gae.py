"""Skip-observation GAE (docs/algorithm.md §2) as a Pallas kernel, with its VJP as another kernel.

The recurrence. Let g = gamma * lam and u = gamma * (1 - lam) (per row), and carry through every
position t the "value seen from the token before t":

    H_t = u * V_t + g * (r_t + H_{t+1})    where m_t (an action token)
        = r_t + H_{t+1}                    where not m_t (observation or padding)
    H_T = gamma * bootstrap                (bootstrap = last_value for truncated rows, else 0)

and the lambda-return is G_t = r_t + H_{t+1}; the outputs are R_t = m_t G_t and
A_t = m_t (G_t - V_t). At action tokens G_t = r_t + (rewards on the observations after t) +
gamma * ((1 - lam) V[next action] + lam G[next action]): the G-form of `gae_reference`, rewards on
observation tokens moving to the preceding action and the chain jumping over observations.
`H_t = e_t + c_t H_{t+1}` is one affine recurrence with c_t = g^{m_t} and
e_t = (m_t ? u V_t + g r_t : r_t), read from position t alone: no neighbour of t is needed, so a
block of tokens is self-contained except for one carried number.

Per block of `rows x time` tokens the kernel composes the maps x -> e_t + c_t x (an exclusive
suffix scan), applies them to the carry H coming from the block to its right, writes A and R, and
hands H at its first token to the block to its left. A composed coefficient is g^k, k the action
tokens it spans: the scan adds the counts exactly and evaluates g^k = exp(k log g) once per
composition, never dividing, so any g in [0, 1] is safe (lam = 0 included) and no rounding error
repeats from block to block (on 5000-token rows the kernel is within 3e-6 of float64, the reverse
`lax.scan` within 1e-5).

  TPU variant: grid (row blocks, time blocks), the time axis "arbitrary" (sequential) and its
    index_map reversed, the carry in a VMEM scratch that persists across grid steps; the scan inside
    a block is a log-step (Hillis-Steele) scan of lane rotations (`pltpu.roll`).
  GPU variant: Triton programs run concurrently, so one program owns a block of rows and walks
    the whole row right to left in a `fori_loop` over time chunks, the carry in registers; the scan
    inside a chunk halves the chunk recursively (even/odd split and join: log-depth, no lane
    shifts, which Triton lacks).

The VJP is linear and runs forward in time: with lambda_t the cotangent of G_t (including what flows
into G_{t-1}), lambda_t = m_t (dA_t + dR_t) + c_t lambda_{t-1}; then dr_t = lambda_t,
dV_t = m_t (u lambda_{t-1} - dA_t), and d(H_T) = lambda_{T-1}. The same kernels, scanning the other
way. Rewards, values and last_value are differentiable; gamma and lam are constants here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

from . import _common, checks


@dataclasses.dataclass(frozen=True)
class GaeBlocks:
    """Tokens per kernel block: `rows` trajectories x `time` tokens.

    TPU: rows a multiple of 8 (32 keeps the int8 mask on its native tiling), time a multiple of
    128; one grid step per block. GPU: powers of two; one program per `rows`, looping over chunks
    of `time` tokens, `num_warps` warps each (ignored on TPU).
    """

    rows: int
    time: int
    num_warps: int = 4

    def __post_init__(self):
        for name in ("rows", "time", "num_warps"):
            _common.check_positive_int("GaeBlocks", name, getattr(self, name))

    @classmethod
    def default(cls, variant: str) -> GaeBlocks:
        # GPU: one row per program, so B = 128 rows fill the streaming multiprocessors.
        return cls(rows=32, time=512) if variant == "tpu" else cls(rows=1, time=1024, num_warps=4)


def gae(
    rewards: jax.Array,
    values: jax.Array,
    action_mask: jax.Array,
    *,
    gamma: float | jax.Array,
    lam: float | jax.Array,
    last_value: jax.Array | None = None,
    truncated: jax.Array | None = None,
    blocks: GaeBlocks | None = None,
    interpret: bool | None = None,
    backend: str | None = None,
    sharding: jax.sharding.NamedSharding | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Skip-observation GAE in one pass over rewards, values and mask (see the module docstring).

    Arguments and results as `sao_jax.rl.gae` and `gae_reference` (checked by `check_gae_args`):
    `[B, T]` rewards, values (V before token t) and action mask; scalar gamma in [0, 1]; lam in
    [0, 1], scalar or `[B]`; `[B]` last_value and truncated together or neither. Returns
    `(advantages, returns)`, `[B, T]` float32, zero off the mask. Rows of any length: the kernel
    walks them in blocks, carrying one number per row.

    Args:
      blocks: block sizes; None picks `GaeBlocks.default` for the variant.
      interpret: run in Pallas' interpreter; None does so exactly where the devices are CPUs.
      backend: "tpu" or "gpu" (or "cuda"/"rocm") picks the kernel variant; None follows the
        platform of `sharding`'s devices, else `jax.default_backend()` (the GPU variant on a CPU).
      sharding: how the `[B, T]` operands' rows are split over a mesh, inside a sharded jit:
        the kernels then run on each device's rows (`jax.shard_map`; rows are independent, so
        nothing crosses devices). Without it, XLA cannot partition a TPU kernel at all.
    """
    check_gae_args(rewards, values, action_mask, gamma, lam, last_value, truncated)
    batch = jnp.shape(rewards)[0]
    _common.check_sharding("gae", sharding, batch)
    variant, interpret = _common.resolve(backend, interpret, sharding)
    blocks = GaeBlocks.default(variant) if blocks is None else blocks
    if not isinstance(blocks, GaeBlocks):
        raise ValueError(f"blocks must be a GaeBlocks, got {type(blocks).__name__}.")
    _common.check_blocks("GaeBlocks", blocks.rows, blocks.time, variant)

    g, u, h_end = linear_coefficients(gamma, lam, last_value, truncated, batch)
    if 0 in jnp.shape(rewards):  # no block to launch
        zeros = jnp.zeros(jnp.shape(rewards), jnp.float32)
        return zeros, zeros
    mask = _common.mask_operand(action_mask, variant)
    config = _Config(variant, blocks, interpret)
    linear = _common.per_shard(lambda *a: _gae_linear(*a, config), sharding, 6)
    return linear(jnp.asarray(rewards, jnp.float32), jnp.asarray(values, jnp.float32), h_end,
                  mask, g, u)


def linear_coefficients(gamma, lam, last_value, truncated, batch: int):
    """`(g, u, h_end)`, each `[B]`: g = gamma * lam and u = gamma * (1 - lam) per row, held
    constant (the kernels differentiate in rewards, values and last_value only), and H past the
    last token, gamma times the bootstrap value."""
    gamma = lax.stop_gradient(jnp.asarray(gamma, jnp.float32))
    lam_b = lax.stop_gradient(jnp.broadcast_to(jnp.asarray(lam, jnp.float32), (batch,)))
    return (gamma * lam_b, gamma * (1.0 - lam_b),
            gamma * bootstrap_value(last_value, truncated, batch))


@dataclasses.dataclass(frozen=True)
class _Config:
    variant: str
    blocks: GaeBlocks
    interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _gae_linear(r, v, h_end, mask, g, u, config):
    """(A, R) as a linear function of (r, v, h_end), for fixed mask and discounts."""
    return _forward(r, v, h_end, mask, g, u, config)


def _gae_linear_fwd(r, v, h_end, mask, g, u, config):
    return _forward(r, v, h_end, mask, g, u, config), (mask, g, u)


def _gae_linear_bwd(config, residuals, cotangents):
    mask, g, u = residuals
    adv_ct, ret_ct = (jnp.asarray(x, jnp.float32) for x in cotangents)
    r_ct, v_ct, h_end_ct = _backward(adv_ct, ret_ct, mask, g, u, config)
    return r_ct, v_ct, h_end_ct, None, None, None


_gae_linear.defvjp(_gae_linear_fwd, _gae_linear_bwd)


# --------------------------------------------------------------------------------------------------
# The block math, shared by both variants. Every coefficient is a power of the row's g, so a map is
# held as (k, d): x -> d + g^k x, with k an exact integer count of action tokens. Composing adds the
# counts and evaluates g^k afresh as exp(k log g): one rounding, whatever k. Multiplying rounded
# coefficients instead (g^2 = g * g, g^4 = g^2 * g^2, ...) repeats the same rounding error in every
# block of a row, and over a 5000-token row with g near 1 that bias grows to 1e-4.
# `scan(k, d, log_g, reverse)` returns the exclusive composition along time of the maps after t
# (reverse) or before t.


def _power(k, log_g):
    """g^k for integer-valued k >= 0 (g^0 = 1, also for g = 0, whose log is -inf)."""
    return jnp.where(k > 0, jnp.exp(k * log_g), 1.0)


def _forward_tile(r, v, m, g, u, log_g, h_in, scan):
    """A, R and H over one block, given H just past its last token."""
    k = jnp.where(m, 1.0, 0.0)
    e = jnp.where(m, u * v + g * r, r)
    xk, xd = scan(k, e, log_g, reverse=True)
    h_next = xd + _power(xk, log_g) * h_in  # H_{t+1}
    ret = r + h_next  # G_t
    h = e + jnp.where(m, g, 1.0) * h_next  # H_t: the first token's goes to the block on the left
    return jnp.where(m, ret - v, 0.0), jnp.where(m, ret, 0.0), h


def _backward_tile(adv_ct, ret_ct, m, g, u, log_g, lam_in, scan):
    """dr, dV and lambda over one block, given lambda at the token before its first."""
    k = jnp.where(m, 1.0, 0.0)
    ct = jnp.where(m, adv_ct + ret_ct, 0.0)
    xk, xd = scan(k, ct, log_g, reverse=False)
    lam_prev = xd + _power(xk, log_g) * lam_in  # lambda_{t-1}
    lam = ct + jnp.where(m, g, 1.0) * lam_prev
    return lam, jnp.where(m, u * lam_prev - adv_ct, 0.0), lam


def _roll_scan(k, d, log_g, *, reverse):
    """Exclusive scan along lanes by log-step lane rotations (TPU)."""
    n = k.shape[1]
    lane = lax.broadcasted_iota(jnp.int32, k.shape, 1)

    def partner(x, step):  # x at t + step (reverse) or t - step, and whether that is in the block
        if reverse:
            return pltpu.roll(x, n - step, 1), lane < n - step
        return pltpu.roll(x, step, 1), lane >= step

    step = 1
    while step < n:  # after this, (k, d) composes the 2 * step maps nearest t, t included
        d_far, inside = partner(d, step)
        k_far, _ = partner(k, step)
        d = d + jnp.where(inside, _power(k, log_g) * d_far, 0.0)
        k = jnp.where(inside, k + k_far, k)
        step *= 2
    k, inside = partner(k, 1)
    d, _ = partner(d, 1)
    return jnp.where(inside, k, 0.0), jnp.where(inside, d, 0.0)


def _split_scan(k, d, log_g, *, reverse):
    """Exclusive scan along the last axis by recursive even/odd halving (GPU; n a power of two).

    Pairs (2i, 2i+1) are composed into one map, the half-length problem is solved, and each pair's
    result gives both of its elements': the element applied second sees the pairs after it, the
    other also its partner. Only reshapes, size-2 splits and joins: what Triton lowers. The
    recursion stops at two lanes (`_pair_scan`), where a one-row block would join two
    one-element tensors.
    """
    n = k.shape[-1]
    if n == 1:
        return jnp.zeros_like(k), jnp.zeros_like(d)
    if n == 2:
        return _pair_scan(k, reverse=reverse), _pair_scan(d, reverse=reverse)
    k_even, k_odd = _deinterleave(k)
    d_even, d_odd = _deinterleave(d)
    # The outer map of a pair is applied last: 2i in a suffix scan, 2i + 1 in a prefix scan.
    if reverse:
        k_out, d_out, k_in, d_in = k_even, d_even, k_odd, d_odd
    else:
        k_out, d_out, k_in, d_in = k_odd, d_odd, k_even, d_even
    yk, yd = _split_scan(k_out + k_in, d_out + _power(k_out, log_g) * d_in, log_g,
                         reverse=reverse)
    ok, od = k_in + yk, d_in + _power(k_in, log_g) * yd  # the outer element also sees its partner
    if reverse:
        return _interleave(ok, yk), _interleave(od, yd)
    return _interleave(yk, ok), _interleave(yd, od)


def _lane_value(x, lane_index: int):
    """x[:, lane_index] as [rows, 1] (a masked sum: Triton cannot slice a register tile)."""
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.sum(jnp.where(lane == lane_index, x, 0.0), axis=1, keepdims=True)


def _pair_scan(x, *, reverse):
    """The exclusive scan of a two-lane block by selects: each lane gets its partner's map, or
    the identity (0) where no partner is on that side. The same numbers as splitting the pair
    and joining it back; but Triton's compiler (in jaxlib 0.10.2's CUDA plugin) segfaults on a
    join of two one-element tensors, which is what that join is in a one-row block
    (`tests/kernels/test_gpu_compile.py` compiles one-row blocks)."""
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    if reverse:  # lane 0 sees lane 1; nothing follows lane 1
        return jnp.where(lane == 0, _lane_value(x, 1), 0.0)
    return jnp.where(lane == 1, _lane_value(x, 0), 0.0)


def _deinterleave(x):
    rows, n = x.shape
    return lax.unstack(x.reshape(rows, n // 2, 2), axis=2)


def _interleave(even, odd):
    rows, n = even.shape
    return lax.stack([even, odd], axis=2).reshape(rows, 2 * n)


# --------------------------------------------------------------------------------------------------
# TPU: a sequential time axis with a VMEM carry.


def _tpu_tiles(batch: int, length: int, blocks: GaeBlocks, reverse: bool):
    rows, time = blocks.rows, blocks.time
    num_time = pl.cdiv(length, time)
    if reverse:
        tile = pl.BlockSpec((rows, time), lambda i, j: (i, num_time - 1 - j))
    else:
        tile = pl.BlockSpec((rows, time), lambda i, j: (i, j))
    row = pl.BlockSpec((rows, 1), lambda i, j: (i, 0))
    grid = (pl.cdiv(batch, rows), num_time)
    params = pltpu.CompilerParams(dimension_semantics=(pltpu.PARALLEL, pltpu.ARBITRARY))
    return grid, tile, row, params


def _tpu_valid(shape, length, time_block):
    lane = lax.broadcasted_iota(jnp.int32, shape, 1)
    return time_block * shape[1] + lane < length


def _forward_tpu_kernel(g_ref, u_ref, log_g_ref, h_end_ref, r_ref, v_ref, m_ref, adv_ref, ret_ref,
                        h_ref, *, length):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        h_ref[...] = h_end_ref[...]

    valid = _tpu_valid(r_ref.shape, length, pl.num_programs(1) - 1 - j)
    r = jnp.where(valid, r_ref[...], 0.0)
    v = jnp.where(valid, v_ref[...], 0.0)
    m = valid & (m_ref[...].astype(jnp.int32) != 0)  # int8 compares widen first on TPU
    adv, ret, h = _forward_tile(r, v, m, g_ref[...], u_ref[...], log_g_ref[...], h_ref[...],
                                _roll_scan)
    adv_ref[...] = adv
    ret_ref[...] = ret
    h_ref[...] = h[:, :1]


def _backward_tpu_kernel(g_ref, u_ref, log_g_ref, adv_ct_ref, ret_ct_ref, m_ref, r_ct_ref, v_ct_ref,
                         lam_out_ref, lam_ref, *, length):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        lam_ref[...] = jnp.zeros_like(lam_ref)

    valid = _tpu_valid(m_ref.shape, length, j)
    adv_ct = jnp.where(valid, adv_ct_ref[...], 0.0)
    ret_ct = jnp.where(valid, ret_ct_ref[...], 0.0)
    m = valid & (m_ref[...].astype(jnp.int32) != 0)  # int8 compares widen first on TPU
    r_ct, v_ct, lam = _backward_tile(adv_ct, ret_ct, m, g_ref[...], u_ref[...], log_g_ref[...],
                                     lam_ref[...], _roll_scan)
    r_ct_ref[...] = r_ct
    v_ct_ref[...] = v_ct
    lam_ref[...] = lam[:, -1:]
    lam_out_ref[...] = lam[:, -1:]


def _forward_tpu(r, v, h_end, mask, g, u, log_g, blocks, interpret):
    batch, length = r.shape
    grid, tile, row, params = _tpu_tiles(batch, length, blocks, reverse=True)
    out = jax.ShapeDtypeStruct((batch, length), jnp.float32)
    return pl.pallas_call(
        functools.partial(_forward_tpu_kernel, length=length),
        grid=grid,
        in_specs=[row, row, row, row, tile, tile, tile],
        out_specs=[tile, tile],
        out_shape=[out, out],
        scratch_shapes=[pltpu.VMEM((blocks.rows, 1), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="gae_forward",
    )(g[:, None], u[:, None], log_g[:, None], h_end[:, None], r, v, mask)


def _backward_tpu(adv_ct, ret_ct, mask, g, u, log_g, blocks, interpret):
    batch, length = adv_ct.shape
    grid, tile, row, params = _tpu_tiles(batch, length, blocks, reverse=False)
    out = jax.ShapeDtypeStruct((batch, length), jnp.float32)
    r_ct, v_ct, lam_end = pl.pallas_call(
        functools.partial(_backward_tpu_kernel, length=length),
        grid=grid,
        in_specs=[row, row, row, tile, tile, tile],
        out_specs=[tile, tile, row],
        out_shape=[out, out, jax.ShapeDtypeStruct((batch, 1), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((blocks.rows, 1), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="gae_backward",
    )(g[:, None], u[:, None], log_g[:, None], adv_ct, ret_ct, mask)
    return r_ct, v_ct, lam_end[:, 0]


# --------------------------------------------------------------------------------------------------
# GPU: one program per row block, looping over the row in chunks.


def _gpu_rows(batch: int, rows: int):
    """Row indices of this program's block as [rows, 1], and which of them exist."""
    index = pl.program_id(0) * rows + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    return index < batch


def _gpu_load_row_param(ref, row_ok):
    rows = row_ok.shape[0]
    return pltr.load(ref, mask=row_ok.reshape(rows), other=0.0).reshape(rows, 1)


def _forward_gpu_kernel(g_ref, u_ref, log_g_ref, h_end_ref, r_ref, v_ref, m_ref, adv_ref, ret_ref,
                        *, batch, length, chunk):
    rows = r_ref.shape[0]
    row_ok = _gpu_rows(batch, rows)
    g = _gpu_load_row_param(g_ref, row_ok)
    u = _gpu_load_row_param(u_ref, row_ok)
    log_g = _gpu_load_row_param(log_g_ref, row_ok)
    lane = lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
    num_chunks = pl.cdiv(length, chunk)

    def step(i, h_in):  # chunks right to left
        start = (num_chunks - 1 - i) * chunk
        ok = row_ok & (start + lane < length)
        at = (slice(None), pl.ds(start, chunk))
        r = pltr.load(r_ref.at[at], mask=ok, other=0.0)
        v = pltr.load(v_ref.at[at], mask=ok, other=0.0)
        m = ok & pltr.load(m_ref.at[at], mask=ok, other=False)
        adv, ret, h = _forward_tile(r, v, m, g, u, log_g, h_in, _split_scan)
        pltr.store(adv_ref.at[at], adv, mask=ok)
        pltr.store(ret_ref.at[at], ret, mask=ok)
        return _lane_value(h, 0)

    lax.fori_loop(0, num_chunks, step, _gpu_load_row_param(h_end_ref, row_ok))


def _backward_gpu_kernel(g_ref, u_ref, log_g_ref, adv_ct_ref, ret_ct_ref, m_ref, r_ct_ref, v_ct_ref,
                         lam_out_ref, *, batch, length, chunk):
    rows = m_ref.shape[0]
    row_ok = _gpu_rows(batch, rows)
    g = _gpu_load_row_param(g_ref, row_ok)
    u = _gpu_load_row_param(u_ref, row_ok)
    log_g = _gpu_load_row_param(log_g_ref, row_ok)
    lane = lax.broadcasted_iota(jnp.int32, (1, chunk), 1)

    def step(i, lam_in):  # chunks left to right
        start = i * chunk
        ok = row_ok & (start + lane < length)
        at = (slice(None), pl.ds(start, chunk))
        adv_ct = pltr.load(adv_ct_ref.at[at], mask=ok, other=0.0)
        ret_ct = pltr.load(ret_ct_ref.at[at], mask=ok, other=0.0)
        m = ok & pltr.load(m_ref.at[at], mask=ok, other=False)
        r_ct, v_ct, lam = _backward_tile(adv_ct, ret_ct, m, g, u, log_g, lam_in, _split_scan)
        pltr.store(r_ct_ref.at[at], r_ct, mask=ok)
        pltr.store(v_ct_ref.at[at], v_ct, mask=ok)
        return _lane_value(lam, chunk - 1)

    lam_end = lax.fori_loop(0, pl.cdiv(length, chunk), step, jnp.zeros((rows, 1), jnp.float32))
    pltr.store(lam_out_ref, lam_end.reshape(rows), mask=row_ok.reshape(rows))


def _gpu_specs(batch: int, length: int, blocks: GaeBlocks):
    rows = blocks.rows
    tile = pl.BlockSpec((rows, length), lambda i: (i, 0))
    row = pl.BlockSpec((rows,), lambda i: (i,))
    return (pl.cdiv(batch, rows),), tile, row, pltr.CompilerParams(num_warps=blocks.num_warps)


def _forward_gpu(r, v, h_end, mask, g, u, log_g, blocks, interpret):
    batch, length = r.shape
    grid, tile, row, params = _gpu_specs(batch, length, blocks)
    out = jax.ShapeDtypeStruct((batch, length), jnp.float32)
    kernel = functools.partial(_forward_gpu_kernel, batch=batch, length=length, chunk=blocks.time)
    return pl.pallas_call(
        kernel, grid=grid, in_specs=[row, row, row, row, tile, tile, tile], out_specs=[tile, tile],
        out_shape=[out, out], compiler_params=params, interpret=interpret, name="gae_forward",
    )(g, u, log_g, h_end, r, v, mask)


def _backward_gpu(adv_ct, ret_ct, mask, g, u, log_g, blocks, interpret):
    batch, length = adv_ct.shape
    grid, tile, row, params = _gpu_specs(batch, length, blocks)
    out = jax.ShapeDtypeStruct((batch, length), jnp.float32)
    kernel = functools.partial(_backward_gpu_kernel, batch=batch, length=length,
                               chunk=blocks.time)
    return pl.pallas_call(
        kernel, grid=grid, in_specs=[row, row, row, tile, tile, tile], out_specs=[tile, tile, row],
        out_shape=[out, out, jax.ShapeDtypeStruct((batch,), jnp.float32)],
        compiler_params=params, interpret=interpret, name="gae_backward",
    )(g, u, log_g, adv_ct, ret_ct, mask)


def _forward(r, v, h_end, mask, g, u, config):
    run = _forward_tpu if config.variant == "tpu" else _forward_gpu
    adv, ret = run(r, v, h_end, mask, g, u, jnp.log(g), config.blocks, config.interpret)
    return adv, ret


def _backward(adv_ct, ret_ct, mask, g, u, config):
    run = _backward_tpu if config.variant == "tpu" else _backward_gpu
    return run(adv_ct, ret_ct, mask, g, u, jnp.log(g), config.blocks, config.interpret)


# --------------------------------------------------------------------------------------------------
# The arguments, and the reference: the one pure-jnp statement of skip-observation GAE, which
# `sao_jax.rl.gae` runs as impl="reference" and the kernels and rl's chunked form are tested
# against.


def check_gae_args(rewards, values, action_mask, gamma, lam, last_value=None,
                   truncated=None) -> None:
    """The checks of every GAE implementation's arguments (`sao_jax.rl.gae` documents them);
    each failure is a ValueError naming the argument."""
    checks.check_rank("rewards", rewards, 2, checks.TOKENS_BxT)
    checks.check_same_shape("values", values, "rewards", rewards)
    checks.check_same_shape("action_mask", action_mask, "rewards", rewards)
    batch = np.shape(rewards)[0]
    if np.ndim(gamma) != 0:
        raise ValueError(f"gamma must be a scalar, got shape {tuple(np.shape(gamma))}.")
    checks.check_in_range("gamma", gamma, 0.0, 1.0)
    if np.ndim(lam) not in (0, 1):
        raise ValueError(f"lam must be a scalar or have shape [B] = ({batch},), got shape "
                         f"{tuple(np.shape(lam))}.")
    if np.ndim(lam) == 1:
        checks.check_row_vector("lam", lam, batch, "one lambda per row")
    checks.check_in_range("lam", lam, 0.0, 1.0)
    if (last_value is None) != (truncated is None):
        raise ValueError(
            "last_value and truncated go together: last_value bootstraps exactly the rows whose "
            "truncated flag is set. Pass both, or neither when every episode terminated.")
    if truncated is not None:
        checks.check_row_vector("truncated", truncated, batch, "bool per row")
        checks.check_row_vector("last_value", last_value, batch, "V after the final token")


def bootstrap_value(last_value, truncated, batch: int) -> jax.Array:
    """`[B]` float32 V after each row's final token: last_value where truncated, else 0."""
    if truncated is None:
        return jnp.zeros((batch,), jnp.float32)
    return jnp.where(jnp.asarray(truncated, bool), jnp.asarray(last_value, jnp.float32), 0.0)


def gae_reference(rewards, values, action_mask, *, gamma, lam, last_value=None, truncated=None):
    """Skip-observation GAE as a plain reverse `lax.scan` over tokens, in the G-form.

    Carries, from the right, the lambda-return G and the value V of the next action token and the
    rewards waiting for an action (those that arrived on observation tokens):

        G_t = r_t + pending + gamma * ((1 - lam) * V[next action] + lam * G[next action])

    at action tokens, with G = V = bootstrap past the last action; A_t = G_t - V_t. Expanding
    A = G - V gives the delta form of `sao_jax.rl.gae` (docs/algorithm.md §2); G is better
    conditioned in float32, staying on the scale of the returns instead of summing TD errors.
    Same arguments and results as `gae`; pure jnp, differentiable by autodiff in every float
    argument.
    """
    check_gae_args(rewards, values, action_mask, gamma, lam, last_value, truncated)
    batch = np.shape(rewards)[0]
    gamma = jnp.asarray(gamma, jnp.float32)
    lam_b = jnp.broadcast_to(jnp.asarray(lam, jnp.float32), (batch,))
    discount_b, value_weight_b = gamma * lam_b, gamma * (1.0 - lam_b)
    bootstrap_b = bootstrap_value(last_value, truncated, batch)
    r_TxB, v_TxB = (jnp.asarray(x, jnp.float32).T for x in (rewards, values))
    m_TxB = jnp.asarray(action_mask).T != 0

    def step(carry, xs):
        ret_next, value_next, pending = carry
        r_t, v_t, m_t = xs
        ret = r_t + pending + value_weight_b * value_next + discount_b * ret_next
        new_carry = (jnp.where(m_t, ret, ret_next), jnp.where(m_t, v_t, value_next),
                     jnp.where(m_t, 0.0, pending + r_t))  # rewards off the mask wait for an action
        return new_carry, (jnp.where(m_t, ret - v_t, 0.0), jnp.where(m_t, ret, 0.0))

    init = (bootstrap_b, bootstrap_b, jnp.zeros((batch,), jnp.float32))
    _, (adv_TxB, ret_TxB) = lax.scan(step, init, (r_TxB, v_TxB, m_TxB), reverse=True)
    return adv_TxB.T, ret_TxB.T
