"""The test suite (`make test`); helpers shared by its modules."""

# XLA's CPU backend without its expensive optimisation passes, and with its older fusion
# emitters: the suite compiles hundreds of small programs and runs each a few times, so compiling
# is most of its time (the learner-step tests took 69 s with the default passes and 38 s with the
# first two flags; the toy learner step compiles in 1.5 s instead of 3.3 s with the third, and
# make test took 743 s instead of 1009 s). Numbers are unchanged within every test's tolerance;
# benchmarks and real runs keep the defaults.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                " --xla_cpu_use_fusion_emitters=false")


def one_device_flags(flags: str) -> str:
    """`XLA_FLAGS` without the simulated device count (a run that sees one CPU device, as
    `make train` does), keeping the rest (`FAST_COMPILE`)."""
    return " ".join(f for f in flags.split()
                    if not f.startswith("--xla_force_host_platform_device_count"))


def cpu_gae_runs() -> bool:
    """Whether the tests run `rl.gae(impl="cpu")`: on CPU devices, where a C++ compiler builds
    its kernel. Without one they skip it, unless SAO_REQUIRE_CXX=1 (set by .ci/run): then its
    tests run and fail with the kernel's own error, which names the fix."""
    import importlib
    import os

    import jax

    if jax.default_backend() != "cpu":
        return False
    try:  # the kernel's own search for a compiler
        importlib.import_module("sao_jax.kernels.gae_cpu").compiler()
    except RuntimeError:
        return os.environ.get("SAO_REQUIRE_CXX") == "1"
    return True
