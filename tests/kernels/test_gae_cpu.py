"""The one-pass CPU kernel (`kernels.gae_cpu`, an XLA FFI call into kernels/gae_cpu.cc) against
the pure-jnp reference: forward on ragged lengths (blocks of 16 tokens, the rest one by one),
its gradient against autodiff of the reference, under vmap and a row sharding, inside a jitted
step; and its build: compiled once a host, rebuilt when the source changes, and a clear error
without a compiler. The float64 oracles of tests/rl/test_advantages.py run it too (impl="cpu")."""

import importlib
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sao_jax import kernels, rl
from tests import cpu_gae_runs
from tests.rl.gae_reference import random_spans_mask

module = importlib.import_module("sao_jax.kernels.gae_cpu")  # the package's gae_cpu is the function

pytestmark = pytest.mark.skipif(not cpu_gae_runs(), reason="a CPU kernel, built by a C++ compiler "
                                "(none here; SAO_REQUIRE_CXX=1 makes this a failure)")


def inputs(seed, batch, length):
    rng = np.random.default_rng(seed)
    mask = random_spans_mask(rng, batch, length, mean_span=5)
    mask[0] = False  # a row without actions
    rewards = ((rng.random((batch, length)) < 0.2) * rng.normal(size=(batch, length)))
    values = rng.normal(size=(batch, length))
    last_value = rng.normal(size=batch).astype(np.float32)
    truncated = rng.random(batch) < 0.5
    lam = np.resize(np.array([0.9, 0.0, 1.0, 0.5, 0.95], np.float32), batch)
    return (rewards.astype(np.float32), values.astype(np.float32), mask, last_value, truncated,
            lam)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 47, 160, 333])
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_forward_matches_the_reference(length, gamma):
    rewards, values, mask, last_value, truncated, lam = inputs(length, 5, length)
    args = dict(gamma=gamma, lam=lam, last_value=last_value, truncated=truncated)
    got = jax.jit(lambda r, v: kernels.gae_cpu(r, v, mask, **args))(rewards, values)
    want = kernels.gae_reference(rewards, values, mask, **args)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [7, 16, 100])
def test_vjp_matches_autodiff_of_the_reference(length):
    rewards, values, mask, last_value, truncated, lam = inputs(2, 5, length)
    rng = np.random.default_rng(3)
    cotangents = tuple(rng.normal(size=(5, length)).astype(np.float32) for _ in range(2))

    def vjp(fn):
        f = lambda r, v, lv: fn(r, v, mask, gamma=0.9, lam=lam, last_value=lv,
                                truncated=truncated)
        _, pullback = jax.vjp(f, rewards, values, last_value)
        return pullback(cotangents)

    got = jax.jit(lambda: vjp(kernels.gae_cpu))()
    want = vjp(kernels.gae_reference)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_vmap_adds_rows():
    rewards, values, mask, *_ = inputs(4, 3, 40)
    stacked = np.stack([rewards, 2 * rewards]), np.stack([values, -values])
    fn = lambda impl: jax.vmap(lambda r, v: rl.gae(r, v, mask, gamma=0.95, lam=0.8, impl=impl))
    for x, y in zip(fn("cpu")(*stacked), fn("reference")(*stacked), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_rows_split_over_a_mesh_run_on_each_shard():
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    rewards, values, mask, last_value, truncated, lam = inputs(5, 2 * len(devices), 64)
    args = dict(gamma=0.99, lam=lam, last_value=last_value, truncated=truncated)
    placed = [jax.device_put(x, sharding) for x in (rewards, values, mask)]
    got = jax.jit(lambda r, v, m: rl.gae(r, v, m, impl="cpu", sharding=sharding, **args))(*placed)
    want = kernels.gae_reference(rewards, values, mask, **args)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_empty_operands():
    for shape in ((0, 5), (3, 0)):
        adv, ret = kernels.gae_cpu(np.zeros(shape, np.float32), np.zeros(shape, np.float32),
                                   np.zeros(shape, bool), gamma=1.0, lam=1.0)
        assert adv.shape == ret.shape == shape


def test_the_library_is_built_once_per_source_and_named_by_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = module.build()
    assert os.path.dirname(first) == str(tmp_path / "sao_jax" / "kernels")
    stamp = os.stat(first).st_mtime_ns
    assert module.build() == first and os.stat(first).st_mtime_ns == stamp  # found, not rebuilt
    source = tmp_path / "gae_cpu.cc"
    source.write_text(open(module.SOURCE).read() + "\n// changed\n")
    monkeypatch.setattr(module, "SOURCE", str(source))
    assert module.build() != first  # a changed source is another library


def test_without_a_compiler_the_error_names_the_fix(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    module.compiler.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"no C\+\+ compiler.*apt-get install g\+\+.*"
                                               r"impl='xla' needs none"):
            module.build()
    finally:
        module.compiler.cache_clear()
