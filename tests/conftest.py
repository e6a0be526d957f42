"""Test-session set-up: 8 simulated CPU devices, so that sharding tests run on any machine, and
XLA's quick CPU compiles (`tests.FAST_COMPILE`), inherited by the runs the tests start.

This must happen before JAX initialises its backend, hence here and at import time. Computations
that are not sharded still run on one device. Off a TPU VM, libtpu (which compiles for TPU
topologies in the tests) is told not to look for the VM's workers (importing `sao_jax` tells
it), so that lowering a Mosaic kernel for TPU anywhere in the session logs no error.
"""

import os

import pytest

from tests import FAST_COMPILE  # noqa: E402

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE

import sao_jax  # noqa: E402, F401 - its import quiets libtpu off a TPU VM (sao_jax.quiet_libtpu)

# The files that take longest (seconds each on 2 cores, measured: 114, 116, 54, 50, ...),
# started first: `make test` hands whole files to its two workers in this order
# (`--no-loadscope-reorder`: xdist's default order, by number of tests, had started the notebooks'
# 100 s file last, while the other worker idled), so the last files to finish are short.
LONGEST_FIRST = ("tests/train/test_steps.py", "tests/test_notebooks.py",
                 "tests/train/test_plan.py", "tests/rl/test_gae.py",
                 "tests/envs/swe/test_swe_path.py", "tests/envs/swe/test_forgery.py",
                 "tests/kernels/test_gae.py",
                 "tests/models/test_logprobs.py", "tests/models/test_layers.py",
                 "tests/kernels/test_dis.py", "tests/models/test_moe.py",
                 "tests/models/test_hf_parity.py", "tests/rollout/test_proxy.py",
                 "tests/train/test_warm_start.py", "tests/rollout/test_engine_sglang.py",
                 "tests/train/test_sharding.py", "tests/train/test_multihost.py")


LONG_MARKERS = ("slow", "faults", "sglang")
LONG_TIMEOUT_S = 3600


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within files, and of the others, stays
    for item in items:  # whole training runs: an hour each, not pyproject's 900 s
        if any(item.get_closest_marker(m) for m in LONG_MARKERS):
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S))
