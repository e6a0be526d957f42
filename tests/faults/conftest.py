import pytest

from tests.faults.harness import stop_leftover_runs


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test():
    yield
    stop_leftover_runs()
