"""What the SWE tests share: the podman base image (`image`, for the container tests, the
whole-path test and grading's podman verdicts), built once from Debian packages
(`images.build_debian_image`, about a minute), then reused, where podman is missing skipped with
the reason, unless SAO_REQUIRE_CONTAINER=1 (set by .ci/run) turns the skip into a failure; and a
grader of the default workspace (`grader`)."""

import os
import shutil
import time

import pytest

from sao_jax.envs.swe import images
from sao_jax.envs.swe.grading import Grader
from sao_jax.envs.swe.workspace import WorkspaceConfig, WorkspaceError


def unavailable(reason: str):
    if os.environ.get("SAO_REQUIRE_CONTAINER") == "1":
        pytest.fail(f"container backend required but unavailable: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def image():
    """The base image's tag (skipped, or failed under SAO_REQUIRE_CONTAINER=1, without podman)."""
    if shutil.which("podman") is None:
        unavailable("podman is not installed (apt-get install podman)")
    if os.geteuid() != 0:
        unavailable("the podman tests run rootful (root needed)")
    try:
        start = time.monotonic()
        tag = images.build_debian_image("podman")
    except WorkspaceError as e:
        unavailable(f"no base image: {e}")
    print(f"base image {tag} ready in {time.monotonic() - start:.1f} s")
    return tag


@pytest.fixture(scope="module")
def grader():
    """Grades in the default workspace (the namespace sandbox), each grade stopped after 120 s."""
    grader = Grader(WorkspaceConfig(), timeout=120)
    yield grader
    grader.close()
