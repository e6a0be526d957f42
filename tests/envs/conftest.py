"""Shared by the sandbox tests: skip live tests where isolation is impossible, with the reason,
unless SAO_REQUIRE_SANDBOX=1 (set by .ci/run) turns that skip into a failure."""

import os

import pytest

from sao_jax.envs.sandbox import SandboxConfig, SandboxUnavailable, check_isolation


@pytest.fixture(scope="module")
def isolated():
    try:
        check_isolation(SandboxConfig(cpu_seconds=1, wall_seconds=4))
    except SandboxUnavailable as e:
        if os.environ.get("SAO_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"sandbox required but unavailable: {e}")
        pytest.skip(f"sandbox unavailable here: {e}")
