"""The podman base image, shared by the container tests and the whole-path test: built once from
Debian packages (`images.build_debian_image`, about a minute), then reused. Where podman is missing
its tests are skipped with the reason, unless SAO_REQUIRE_CONTAINER=1 (set by .ci/run) turns the
skip into a failure."""

import os
import shutil
import time

import pytest

from sao_jax.envs.swe import images
from sao_jax.envs.swe.workspace import WorkspaceError


def unavailable(reason: str):
    if os.environ.get("SAO_REQUIRE_CONTAINER") == "1":
        pytest.fail(f"container backend required but unavailable: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def image():
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
