"""Children of the learner: priority and stopping (end-to-end kill tests: test_learner.py)."""

import os
import time

from sao_jax.train.processes import Children


def test_children_run_at_the_configured_lower_priority(tmp_path):
    children = Children(str(tmp_path), log=lambda *_: None, niceness=7)
    proc = children._spawn("sleeper", ["-c", "import time; time.sleep(30)"])
    try:
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, os.getpriority(
            os.PRIO_PROCESS, 0) + 7)
        assert children.procs == [("sleeper", proc)]
    finally:
        start = time.monotonic()
        children.stop()
        assert proc.poll() is not None and time.monotonic() - start < 10
