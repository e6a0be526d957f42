"""`train.roofline`: bytes counted from compiled HLO, each loop body by its trip count (XLA's
cost analysis counts it once), on small programs compiled for 4 simulated CPU devices."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from sao_jax.train import roofline

ROW = jax.ShapeDtypeStruct((64, 16), jnp.float32)  # 16 x 16 float32 per device: 1 KiB


def counts(fn, *args, sharded=True):
    if sharded:
        mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:4])
        fn = jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    return roofline.count(jax.jit(fn).lower(*args).compile().as_text())


def test_a_collective_in_a_loop_counts_once_per_trip():
    """An all-gather of 1 KiB into 4 KiB, 5 times: 5 x 4 KiB."""
    def fn(x):
        return lax.fori_loop(0, 5, lambda i, a: a + lax.all_gather(x * i, "x", tiled=True)[:16],
                             x)

    got = counts(fn, ROW)
    assert got.collective_bytes == 5 * 64 * 16 * 4
    assert got.unknown_loops == 0


@pytest.mark.parametrize("outer", ["fori_loop", "map_over_arange"])
def test_a_loop_bounded_by_the_enclosing_counter_runs_its_average(outer):
    """Causal attention's shape: key blocks 0..q for each query block q of 6, a psum of 1 KiB in
    each: 1 + 2 + ... + 6 = 21 psums, whether q is the loop's counter or an arange's element."""
    def inner(q, a):
        return lax.fori_loop(0, q + 1, lambda j, b: b + lax.psum(b * j, "x"), a)

    def fn(x):
        if outer == "fori_loop":
            return lax.fori_loop(0, 6, inner, x)
        return lax.map(lambda q: inner(q, x), jnp.arange(6)).sum(0)

    got = counts(fn, ROW)
    assert got.collective_bytes == 21 * 16 * 16 * 4
    assert got.unknown_loops == 0


def test_a_loop_that_depends_on_the_data_counts_once_and_is_reported():
    def fn(x):
        return lax.while_loop(lambda a: a.sum() < 100.0, lambda a: a + lax.psum(a, "x"), x)

    got = counts(fn, ROW)
    assert got.collective_bytes == 16 * 16 * 4
    assert got.unknown_loops == 1


def test_hbm_bytes_match_xlas_count_without_loops():
    def fn(x, w):
        return jnp.tanh(x @ w).sum(0)

    args = (jax.ShapeDtypeStruct((256, 512), jnp.float32),
            jax.ShapeDtypeStruct((512, 128), jnp.float32))
    compiled = jax.jit(fn).lower(*args).compile()
    assert roofline.count(compiled.as_text()).hbm_bytes == \
        compiled.cost_analysis()["bytes accessed"]


def test_a_scan_reads_one_slice_of_its_inputs_per_trip():
    """Each trip reads a 4 KiB row of `xs` (not all of `xs`), reads the 4 KiB carry and writes
    it: 4 more trips over twice the rows cost 4 x 12 KiB (and a few bytes of counter)."""
    def fn(xs):
        return lax.scan(lambda c, x: (c + jnp.sin(x), None), jnp.zeros(1024), xs)[0]

    def hbm(rows):
        return counts(fn, jax.ShapeDtypeStruct((rows, 1024), jnp.float32),
                      sharded=False).hbm_bytes

    assert hbm(8) - hbm(4) == pytest.approx(4 * 3 * 4096, rel=0.01)


def test_the_bound_is_the_resource_that_takes_longest():
    roof = roofline.Roofline(flops=459e12, hbm_bytes=2 * 2765e9, collective_bytes=600e9,
                             peak_flops=459e12, hbm_bytes_per_s=2765e9, ici_bytes_per_s=1200e9)
    assert roof.seconds == pytest.approx({"compute": 1.0, "HBM": 2.0, "ICI": 0.5})
    assert roof.bound == "HBM"
    lines = roof.report()
    assert lines[0].endswith("HBM-bound") and len(lines) == 4
    assert lines[1].split() == ["compute", "4.590e+14", "FLOPs", "1.0", "s", "at", "459",
                                "TFLOP/s"]
    assert lines[2].split() == ["HBM", "5.530e+12", "bytes", "2.0", "s", "at", "2,765", "GB/s"]
    assert lines[3].split() == ["ICI", "6.000e+11", "bytes", "500.0", "ms", "at", "1,200",
                                "GB/s"]
    unknown = roofline.Roofline(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, unknown_loops=2)
    assert "2 loop(s) whose trips depend on the data" in unknown.report()[-1]
