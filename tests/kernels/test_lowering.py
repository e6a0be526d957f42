"""The kernels lower for TPU and CUDA from any host; `sao_jax.rl` runs them for impl="pallas".

`jax.export` lowers a function for a platform without one present: Pallas' Mosaic (TPU) and Triton
(CUDA) lowerings run here, on a CPU. The TPU's tpu_custom_call is on export's list of stable custom
calls; Triton's `__gpu$xla.gpu.triton` is not (its IR may change between jaxlib versions), so the
CUDA export disables exactly that check. What this cannot catch: Mosaic's and Triton's own
compilers run on the device, so a kernel that exports may still be refused there (what the
`kernels_device` tests are for).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax import kernels, rl

TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
B, T = 16, 1000
F32 = jax.ShapeDtypeStruct((B, T), jnp.float32)
MASK = jax.ShapeDtypeStruct((B, T), jnp.bool_)
ROW = jax.ShapeDtypeStruct((B,), jnp.float32)


def gae_forward(backend):
    return lambda r, v, m, lam, lv: kernels.gae(r, v, m, gamma=1.0, lam=lam, last_value=lv,
                                                truncated=lv > 0, backend=backend, interpret=False)


def gae_vjp(backend):
    def fn(r, v, m, lam, lv):
        f = lambda r, v, lv: gae_forward(backend)(r, v, m, lam, lv)
        out, pullback = jax.vjp(f, r, v, lv)
        return pullback(out)
    return fn


def dis_forward(backend):
    return lambda lp, rlp, a, m: kernels.dis_loss(lp, rlp, a, m, eps_low=0.3, eps_high=5.0,
                                                  backend=backend, interpret=False)


def dis_vjp(backend):
    return lambda lp, rlp, a, m: jax.grad(lambda lp: dis_forward(backend)(lp, rlp, a, m)[0])(lp)


KERNELS = {
    "gae_forward": (gae_forward, (F32, F32, MASK, ROW, ROW), ["gae_forward"]),
    "gae_vjp": (gae_vjp, (F32, F32, MASK, ROW, ROW), ["gae_forward", "gae_backward"]),
    "dis_forward": (dis_forward, (F32, F32, F32, MASK), ["dis_forward"]),
    "dis_vjp": (dis_vjp, (F32, F32, F32, MASK), ["dis_forward", "dis_backward"]),
}


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_exports_for_accelerator(kernel, platform):
    make, args, names = KERNELS[kernel]
    backend = "tpu" if platform == "tpu" else "gpu"
    exported = jax.export.export(jax.jit(make(backend)), platforms=[platform],
                                 disabled_checks=[TRITON])(*args)
    module = exported.mlir_module()
    target = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
    assert module.count(f"@{target}") == len(names), module[:2000]
    for name in names:  # the kernels keep their names down to the custom call
        assert name in module


def test_cuda_export_needs_the_triton_check_disabled():
    # Documents the one thing a CPU host cannot do for CUDA: serialize Triton IR "stably".
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
        jax.export.export(jax.jit(dis_forward("gpu")), platforms=["cuda"])(F32, F32, F32, MASK)


def _inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 40)).astype(np.float32)
    return x, x - 0.1, rng.random((3, 40)) < 0.7


def test_rl_pallas_runs_the_kernels_forward_and_backward():
    x, y, mask = _inputs()
    gae = lambda v, impl: rl.gae(x, v, mask, gamma=1.0, lam=0.9, impl=impl)
    dis = lambda lp, impl: rl.dis_loss(lp, y, x, mask, eps_low=0.3, eps_high=5.0, impl=impl)
    jaxprs = {
        "gae": str(jax.make_jaxpr(lambda v: gae(v, "pallas"))(x)),
        "gae_grad": str(jax.make_jaxpr(jax.grad(lambda v: gae(v, "pallas")[0].sum()))(x)),
        "dis": str(jax.make_jaxpr(lambda lp: dis(lp, "pallas"))(x)),
        "dis_grad": str(jax.make_jaxpr(jax.grad(lambda lp: dis(lp, "pallas")[0]))(x)),
    }
    for key, jaxpr in jaxprs.items():
        assert "pallas_call" in jaxpr, key
    assert "gae_backward" in jaxprs["gae_grad"]
    assert "dis_backward" in jaxprs["dis_grad"]
    # And the numbers are the pure-JAX ones.
    for impl_got, impl_want, fn in (("pallas", "xla", gae), ("pallas", "xla", dis)):
        got, want = fn(x, impl_got), fn(x, impl_want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_auto_picks_pallas_on_accelerators_and_xla_on_cpu():
    x, y, mask = _inputs()
    on_accelerator = jax.default_backend() in ("gpu", "tpu")
    gae = jax.make_jaxpr(lambda v: rl.gae(x, v, mask, gamma=1.0, lam=0.9))(x)
    dis = jax.make_jaxpr(lambda lp: rl.dis_loss(lp, y, x, mask, eps_low=0.3, eps_high=5.0))(x)
    assert ("pallas_call" in str(gae)) == on_accelerator
    assert ("pallas_call" in str(dis)) == on_accelerator


def test_variant_and_interpret_follow_the_backend():
    from sao_jax.kernels import _common

    on_cpu = jax.default_backend() == "cpu"
    assert _common.resolve("cuda", None) == ("gpu", on_cpu)
    assert _common.resolve("tpu", False) == ("tpu", False)
    assert _common.resolve(None, None)[1] == on_cpu
    with pytest.raises(ValueError, match="backend must be one of"):
        _common.resolve("metal", None)


class _Devices:
    """A stand-in for a sharding over devices of one platform (all `platform_of` reads)."""

    def __init__(self, platform):
        self.device_set = {type("Device", (), {"platform": platform})()}


@pytest.mark.parametrize("platform,impl,variant,interpret", [
    ("tpu", "pallas", "tpu", False), ("gpu", "xla", "gpu", False), ("cpu", "xla", "gpu", True)])
def test_auto_and_the_variant_follow_the_devices_not_this_host(platform, impl, variant,
                                                               interpret):
    """A sharding's devices decide: a step compiled on a CPU host for a TPU mesh gets the TPU
    kernel, compiled, and "auto" picks it; GPU devices get the compiled GPU variant, which
    "auto" does not pick (`AUTO_KERNEL_PLATFORMS`); CPU devices the interpreted GPU variant and
    XLA."""
    sharding = _Devices(platform)
    assert kernels.platform_of(sharding) == platform
    assert kernels.resolve_impl("auto", sharding) == impl
    assert kernels.resolve_impl("reference", sharding) == "reference"
    from sao_jax.kernels import _common

    assert _common.resolve(None, None, sharding) == (variant, interpret)
    assert _common.resolve("tpu", None, sharding) == ("tpu", interpret)
    assert kernels.resolve_impl("auto") == ("pallas" if jax.default_backend() == "tpu" else "xla")


def test_rl_returns_the_one_metrics_tuple_from_either_implementation():
    x, y, mask = _inputs()
    for impl in ("xla", "pallas"):
        _, metrics = rl.dis_loss(x, y, x, mask, eps_low=0.3, eps_high=5.0, impl=impl)
        assert type(metrics) is rl.DisMetrics is kernels.DisMetrics


def test_sharded_kernels_run_per_shard_and_match_unsharded():
    """`sharding=`: rows split over 4 simulated devices, each kernel under shard_map; the
    results and gradients are the unsharded kernels' (and the reference's), and a bad sharding
    names what is wrong."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]), ("rows",))
    rows = NamedSharding(mesh, PartitionSpec("rows"))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 40)).astype(np.float32)
    x, y, mask = (jax.device_put(a, rows) for a in (x, x - 0.1, rng.random((8, 40)) < 0.7))

    def losses(lp, v, sharding):
        loss, metrics = kernels.dis_loss(lp, y, x, mask, eps_low=0.3, eps_high=5.0,
                                         normalizer=jnp.sum(mask), sharding=sharding)
        adv, ret = kernels.gae(x, v, mask, gamma=1.0, lam=0.9, sharding=sharding)
        return loss + jnp.sum(adv * ret) * 1e-3, metrics

    fn = jax.jit(jax.value_and_grad(losses, argnums=(0, 1), has_aux=True), static_argnums=2)
    (got, got_metrics), got_grads = fn(y, x, rows)
    (want, want_metrics), want_grads = fn(y, x, None)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):  # d/dlogp (DIS), d/dvalues (GAE)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        assert np.abs(b).sum() > 0
    for a, b in zip(got_metrics, want_metrics, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    hlo = jax.jit(losses, static_argnums=2).lower(y, x, rows).as_text()
    assert "shard_map" in hlo or "sdy.manual_computation" in hlo
    with pytest.raises(ValueError, match="splits the time axis"):
        kernels.gae(x, x, mask, gamma=1.0, lam=0.9,
                    sharding=NamedSharding(mesh, PartitionSpec(None, "rows")))
    with pytest.raises(ValueError, match="do not split into the 4 row shards"):
        kernels.dis_loss(x[:6], y[:6], x[:6], mask[:6], eps_low=0.3, eps_high=5.0,
                         sharding=rows)
