"""The test suite (`make test`); helpers shared by its modules."""

# XLA's CPU backend without its expensive optimisation passes: the suite compiles hundreds of
# small programs and runs each a few times, so compiling is most of its time (the learner-step
# tests took 69 s with the default passes and 38 s with these). Numbers are unchanged within
# every test's tolerance; benchmarks and real runs keep the defaults.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def one_device_flags(flags: str) -> str:
    """`XLA_FLAGS` without the simulated device count (a run that sees one CPU device, as
    `make train` does), keeping the rest (`FAST_COMPILE`)."""
    return " ".join(f for f in flags.split()
                    if not f.startswith("--xla_force_host_platform_device_count"))
