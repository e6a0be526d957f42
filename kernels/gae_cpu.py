"""Skip-observation GAE in one pass over memory on CPU devices: `gae_cpu.cc` as an XLA FFI call.

    from sao_jax import kernels
    adv, ret = kernels.gae_cpu(rewards, values, mask, gamma=1.0, lam=0.95)

XLA's CPU code cannot run a recurrence along the minor axis in one pass: `rl.gae(impl="xla")`
reads and writes its `[B, T]` temporaries three times. This kernel reads rewards, values and the
mask once and writes the two results once, each row's blocks of 16 tokens one vector register
(the algorithm is in `gae_cpu.cc`'s header), its rows split over the host's threads; its
transpose is the same pass from the left, so the gradient is one pass too.

The C++ source is compiled on first use, with the host's C++ compiler (`$CXX`, else `c++` or
`g++`), for the host's CPU (`-march=native`) against the FFI headers of the installed jaxlib,
into `$XDG_CACHE_HOME/sao_jax/kernels` (or `~/.cache/sao_jax/kernels`, beside the warm starts).
The library's name holds a hash of the source, the flags, the compiler, JAX's version and the
CPU's flags, so a change to any builds a new one. Without a compiler it raises, naming the fix;
`rl.gae(impl="xla")` needs none.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp

from . import _common
from .gae import check_gae_args, linear_coefficients

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gae_cpu.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", "-w")
FORWARD, BACKWARD = "sao_jax_gae_forward", "sao_jax_gae_backward"
_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def gae_cpu(rewards, values, action_mask, *, gamma, lam, last_value=None, truncated=None,
            sharding=None):
    """`gae_reference`'s results (arguments as `sao_jax.rl.gae`), in one pass over memory on
    CPU devices. Differentiable in rewards, values and last_value; gamma and lam are held
    constant. `sharding`: inside a sharded jit, how the rows are split over the mesh; the
    kernel then runs on each device's rows."""
    check_gae_args(rewards, values, action_mask, gamma, lam, last_value, truncated)
    batch = jnp.shape(rewards)[0]
    _common.check_sharding("gae_cpu", sharding, batch)
    register()
    g, u, h_end = linear_coefficients(gamma, lam, last_value, truncated, batch)
    mask = jnp.asarray(action_mask) != 0
    linear = _common.per_shard(_gae_linear, sharding, 6)
    return linear(jnp.asarray(rewards, jnp.float32), jnp.asarray(values, jnp.float32), h_end,
                  mask, g, u)


@jax.custom_vjp
def _gae_linear(r, v, h_end, mask, g, u):
    """(A, R) as a linear function of (r, v, h_end), for a fixed mask and discounts."""
    out = jax.ShapeDtypeStruct(jnp.shape(r), jnp.float32)
    return jax.ffi.ffi_call(FORWARD, (out, out), vmap_method="broadcast_all")(
        r, v, mask, h_end, g, u)


def _gae_linear_fwd(r, v, h_end, mask, g, u):
    return _gae_linear(r, v, h_end, mask, g, u), (mask, g, u)


def _gae_linear_bwd(residuals, cotangents):
    mask, g, u = residuals
    adv_ct, ret_ct = (jnp.asarray(x, jnp.float32) for x in cotangents)
    tokens = jax.ShapeDtypeStruct(jnp.shape(adv_ct), jnp.float32)
    rows = jax.ShapeDtypeStruct(jnp.shape(g), jnp.float32)
    r_ct, v_ct, h_end_ct = jax.ffi.ffi_call(BACKWARD, (tokens, tokens, rows),
                                            vmap_method="broadcast_all")(
        adv_ct, ret_ct, mask, g, u)
    return r_ct, v_ct, h_end_ct, None, None, None


_gae_linear.defvjp(_gae_linear_fwd, _gae_linear_bwd)


def register() -> None:
    """Compiles the library if this host has none yet and registers its two FFI targets with
    XLA's CPU backend (once a process)."""
    global _library
    with _lock:
        if _library is not None:
            return
        library = ctypes.cdll.LoadLibrary(build())
        for name, symbol in ((FORWARD, library.SaoJaxGaeForward),
                             (BACKWARD, library.SaoJaxGaeBackward)):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
        _library = library


def build() -> str:
    """The path of the compiled library, compiling it first if this host has none yet."""
    cxx = compiler()
    key = hashlib.sha256()
    for part in (open(SOURCE, "rb").read(), " ".join(FLAGS).encode(),
                 _compiler_version(cxx), jax.__version__.encode(), _cpu_flags()):
        key.update(part)
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(root, "sao_jax", "kernels")
    path = os.path.join(folder, f"gae_cpu-{key.hexdigest()[:16]}.so")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    include = jax.ffi.include_dir()
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        built = os.path.join(scratch, "gae_cpu.so")
        result = subprocess.run([cxx, *FLAGS, "-I", include, SOURCE, "-o", built],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE} with {cxx} failed "
                               f"(exit {result.returncode}):\n{result.stderr[-3000:]}")
        os.replace(built, path)  # atomic: a process compiling beside this one finds it whole
    return path


@functools.cache
def compiler() -> str:
    """The C++ compiler that builds the kernel: `$CXX`, else `c++` or `g++` on the PATH."""
    for name in filter(None, (os.environ.get("CXX"), "c++", "g++")):
        if path := shutil.which(name):
            return path
    raise RuntimeError(
        "impl='cpu' compiles kernels/gae_cpu.cc on first use and found no C++ compiler: install "
        "one (apt-get install g++) or name it in $CXX; impl='xla' needs none.")


@functools.cache
def _compiler_version(compiler: str) -> bytes:
    return subprocess.run([compiler, "--version"], capture_output=True, check=False).stdout


def _cpu_flags() -> bytes:
    """What -march=native compiles for: the CPU's feature flags where Linux lists them."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return platform.processor().encode()
