"""The fault suite (`make test-faults`): real toy runs with two engines and two workers, each
with one fault injected. Marked `faults`, which `pytest tests` (and so `make test`) deselects
(pyproject.toml): a few minutes of learner runs."""

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One JAX compilation cache for the suite: later runs reuse the first's programs."""
    return str(tmp_path_factory.mktemp("cache"))
