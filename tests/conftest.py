"""Test-session set-up: 8 simulated CPU devices, so that sharding tests run on any machine, and
XLA's quick CPU compiles (`tests.FAST_COMPILE`), inherited by the runs the tests start.

This must happen before JAX initialises its backend, hence here and at import time. Computations
that are not sharded still run on one device. Off a TPU VM, libtpu (which compiles for TPU
topologies in the tests) is told not to look for the VM's workers (importing `sao_jax` tells
it), so that lowering a Mosaic kernel for TPU anywhere in the session logs no error.

The fixtures that test modules of several packages share are here, each defined once: the
sandbox's skip (`isolated`), SGLang's virtualenv (`sglang_venv`) and the learner runs' cache
(`cache_dir`). What test modules share besides fixtures lives in helper modules beside them.
"""

import json
import os

import pytest

from tests import FAST_COMPILE  # noqa: E402

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE

import sao_jax  # noqa: E402, F401 - its import quiets libtpu off a TPU VM (sao_jax.quiet_libtpu)

TESTS = os.path.dirname(os.path.abspath(__file__))


def helper_modules() -> list[str]:
    """The suite's modules that are neither test modules nor conftests: what several test modules
    share (tests/engine/engines.py, ...), since no test module imports another
    (tests/test_tests.py)."""
    names = []
    for root, dirs, files in os.walk(TESTS):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        package = os.path.relpath(root, os.path.dirname(TESTS)).replace(os.sep, ".")
        names += [f"{package}.{f[:-3]}" for f in files if f.endswith(".py")
                  and not f.startswith("test_") and f not in ("conftest.py", "__init__.py")]
    return sorted(names)


# pytest explains a failing assert (the values compared) in test modules and conftests only;
# registered before any of them is imported, the helpers' checks fail as informatively.
pytest.register_assert_rewrite(*helper_modules())

# Seconds each test file took (setup, call and teardown of its tests, summed), measured by
# `make test-durations` (`--record-durations`) and committed: `make test` hands whole files to
# its two workers longest first (`--no-loadscope-reorder`: xdist's default order, by number of
# tests, had started a 100 s file last while the other worker idled), so that the last files to
# finish are short. A file not measured yet goes after the measured ones.
DURATIONS_FILE = os.path.join(TESTS, "durations.json")
_measured: dict[str, float] = {}


def file_durations() -> dict[str, float]:
    """`{test file: seconds}` as last recorded (empty before the first recording)."""
    if not os.path.exists(DURATIONS_FILE):
        return {}
    with open(DURATIONS_FILE) as f:
        return json.load(f)


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help=f"write each test file's seconds into {DURATIONS_FILE}, the order "
                          "in which the next runs start the files")


LONG_MARKERS = ("slow", "faults", "sglang")
LONG_TIMEOUT_S = 3600


def pytest_collection_modifyitems(items):
    seconds = file_durations()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))  # stable: the
    # order within a file, and of the files not measured, stays
    for item in items:  # whole training runs: an hour each, not pyproject's 900 s
        if any(item.get_closest_marker(m) for m in LONG_MARKERS):
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S))


@pytest.fixture(scope="module")
def isolated():
    """Skips a test that runs code in the sandbox where isolation is impossible, with the reason,
    unless SAO_REQUIRE_SANDBOX=1 (set by .ci/run) turns that skip into a failure."""
    from sao_jax.envs.sandbox import SandboxConfig, SandboxUnavailable, check_isolation

    try:
        check_isolation(SandboxConfig(cpu_seconds=1, wall_seconds=4))
    except SandboxUnavailable as e:
        if os.environ.get("SAO_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"sandbox required but unavailable: {e}")
        pytest.skip(f"sandbox unavailable here: {e}")


@pytest.fixture(scope="session")
def sglang_venv() -> str:
    """The directory of SGLang's virtualenv (made first where it is missing: minutes, once per
    machine); skips the test, with the reason, where it cannot be made."""
    from sao_jax.engine import sglang_server

    try:
        sglang_server.ensure_venv(log=lambda *_: None)
    except sglang_server.SGLangUnavailable as e:
        pytest.skip(f"SGLang's virtualenv cannot be made here: {e}")
    return sglang_server.venv_dir()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """The cache directory (`XDG_CACHE_HOME`) of the session's learner runs (tests/faults,
    tests/test_notebooks.py, tests/train/test_multihost.py): a run reuses the programs the runs
    before it compiled. Their warm starts are off or cached in a directory of their own."""
    return str(tmp_path_factory.mktemp("cache"))


def pytest_runtest_logreport(report):
    """Sums each file's test phases (on xdist's controller, which gets every worker's reports)."""
    path = report.nodeid.split("::")[0]
    _measured[path] = _measured.get(path, 0.0) + report.duration


def pytest_sessionfinish(session):
    if not session.config.getoption("--record-durations") or hasattr(session.config,
                                                                     "workerinput"):
        return
    merged = {**file_durations(), **{p: round(s, 1) for p, s in _measured.items()}}
    root = os.path.dirname(os.path.dirname(DURATIONS_FILE))
    merged = {p: s for p, s in merged.items() if os.path.exists(os.path.join(root, p))}
    with open(DURATIONS_FILE, "w") as f:
        json.dump(dict(sorted(merged.items(), key=lambda kv: -kv[1])), f, indent=0)
        f.write("\n")
