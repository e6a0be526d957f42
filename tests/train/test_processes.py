"""Children of the learner: priority, publishing and stopping (end-to-end kill tests:
test_learner.py)."""

import os
import threading
import time

import pytest

from sao_jax.train.processes import Children


@pytest.mark.parametrize("priority", ["low", "idle"])
def test_children_run_at_the_configured_lower_priority(tmp_path, priority):
    children = Children(str(tmp_path), log=lambda *_: None, priority=priority)
    proc = children._spawn("sleeper", ["-c", "import time; time.sleep(30)"])
    try:
        if priority == "low":
            assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, os.getpriority(
                os.PRIO_PROCESS, 0) + 10)
        else:
            assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        assert children.procs == [("sleeper", proc)]
    finally:
        start = time.monotonic()
        children.stop()
        assert proc.poll() is not None and time.monotonic() - start < 10
    with pytest.raises(ValueError, match="rollout.priority"):
        Children(str(tmp_path), priority="nice")


def test_background_publish_writes_the_newest_version_and_reports_a_dead_engine(tmp_path):
    """`Publisher.submit` returns at once; the thread writes `weights/v<N>` for a new version
    (not for one already published or off the `every` grid) and a failed engine update comes
    back as a TrainingError from `wait`."""
    import jax.numpy as jnp

    from sao_jax.train.learner import Publisher, TrainingError
    from tests.train.test_steps import trainer_for

    trainer = trainer_for("grpo_dis")
    state = trainer.init_state()
    publisher = Publisher(str(tmp_path), ["http://127.0.0.1:9"])  # nothing listens there
    publisher.version = 0
    publisher.submit(trainer, state)  # version 0: already published, nothing to do
    publisher.wait()
    publisher.submit(trainer, state._replace(version=jnp.int32(3)), every=2)  # off the grid
    publisher.wait()
    assert not os.listdir(os.path.join(str(tmp_path), "weights"))
    publisher.submit(trainer, state._replace(version=jnp.int32(2)), every=2)
    with pytest.raises(TrainingError, match="publishing weights"):
        publisher.wait()
    assert os.path.exists(os.path.join(publisher.path(2), "config.json"))
    assert publisher.version == 0  # the engine never took it


def _deliver(sig):
    """Sends `sig` to this process and gives the main thread bytecodes to run its handler on."""
    import signal

    signal.pthread_kill(threading.main_thread().ident, sig)
    for _ in range(100):
        time.sleep(0.001)


def test_stop_requests_defer_signals_to_safe_points_and_restore_the_handlers():
    import signal

    from sao_jax.train.learner import StopRequests

    before = {s: signal.getsignal(s) for s in StopRequests.SIGNALS}
    with StopRequests() as stops:
        _deliver(signal.SIGINT)  # outside interruptible(): only the flag
        assert stops.requested
        with pytest.raises(KeyboardInterrupt):
            stops.check()
    assert {s: signal.getsignal(s) for s in StopRequests.SIGNALS} == before

    with StopRequests() as stops:
        stops.check()  # nothing requested: no-op
        with pytest.raises(KeyboardInterrupt), stops.interruptible():
            _deliver(signal.SIGTERM)  # raises here, at once
            raise AssertionError("the signal did not interrupt the wait")
    assert {s: signal.getsignal(s) for s in StopRequests.SIGNALS} == before
