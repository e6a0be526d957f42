"""Faults in runs through real SGLang (`experiments/toy_sglang.py`, two SGLang servers and two
workers): a server killed, frozen for 30 s, refusing an update. Each run finishes or stops
cleanly, and no accepted trajectory is lost or trained twice (`harness.check_exactly_once`).
Skipped, with the reason, where SGLang's virtualenv cannot be made (`make test-sglang` makes
it first in `.ci/run`).

    make test-faults    # = pytest -m faults tests/faults ...
"""

import os
import re
import signal
import time

import pytest

from sao_jax.models.hf import COMPLETE_MARKER
from tests.faults.harness import (
    LearnerRun,
    check_exactly_once,
    engine_port,
    server_of,
    steps_log,
    weight_version,
)

pytestmark = [pytest.mark.faults, pytest.mark.usefixtures("sglang_venv")]

SGLANG = dict(experiment="toy_sglang")


def test_a_killed_sglang_server_is_restarted_with_the_current_weights(tmp_path, cache_dir):
    """SIGKILL engine0's SGLang server mid-run: its wrapper stops what is left of it and exits,
    engine1 serves meanwhile, the learner starts engine0 again from the newest published
    weights, and it holds the learner's current version once back."""
    workdir = tmp_path / "run"
    run = LearnerRun(workdir, cache_dir, "--config.total_steps=12",
                     "--config.checkpoint_every=4", **SGLANG)
    run.wait_step(3, timeout_s=900)
    wrapper = run.children()["engine0"]
    port = engine_port(wrapper)
    killed_at = weight_version(port)
    os.kill(server_of(wrapper), signal.SIGKILL)
    back = run.wait_for(lambda: re.search(r"engine0 is back on http://127.0.0.1:(\d+) with "
                                          r"weights v(\d+)", run.output()), "engine0 back",
                        timeout_s=900)
    assert int(back.group(2)) >= killed_at
    assert run.finish(900) == 0, run.output()[-3000:]
    check_exactly_once(workdir, 12, single_run=True)
    assert "engine0 exited with code" in run.output()
    for other in ("engine1", "worker0", "worker1"):
        assert f"{other} exited" not in run.output()


def test_b_a_frozen_sglang_server_is_failed_over_and_caught_up(tmp_path, cache_dir):
    """SIGSTOP every process of engine0's SGLang server for 30 s, then SIGCONT: its requests
    time out and move to engine1, the updates it misses leave it behind, and once it answers it
    loads the newest weights; nothing is restarted, nothing lost."""
    workdir = tmp_path / "run"
    run = LearnerRun(workdir, cache_dir, "--config.total_steps=24",
                     "--config.checkpoint_every=12", "--config.rollout.request_timeout_s=10",
                     "--config.rollout.weight_update_timeout_s=10", **SGLANG)
    run.wait_step(3, timeout_s=900)
    wrapper = run.children()["engine0"]
    port = engine_port(wrapper)
    group = os.getpgid(server_of(wrapper))
    os.killpg(group, signal.SIGSTOP)
    try:
        frozen_at = run.last_step()
        time.sleep(30)
        during = run.last_step() - frozen_at
    finally:
        os.killpg(group, signal.SIGCONT)
    assert during >= 1, "no step while engine0 was frozen: engine1 did not take over"
    url = f"http://127.0.0.1:{port}"
    assert f"not loaded on {url}, which cannot be reached" in run.output()
    back = run.wait_for(lambda: re.search(rf"{url} is back: it loaded weights v(\d+)",
                                          run.output()), "engine0 caught up", timeout_s=300)
    assert weight_version(port) >= int(back.group(1))
    assert run.finish(900) == 0, run.output()[-3000:]
    check_exactly_once(workdir, 24, single_run=True)
    for name in ("engine0", "engine1", "worker0", "worker1"):  # frozen is not dead
        assert f"{name} exited" not in run.output()


def test_c_an_update_sglang_refuses_stops_the_run_cleanly_and_it_resumes(tmp_path, cache_dir):
    """Version 3's weights directory holds no tensors yet is marked complete, so the publisher
    takes it as written: SGLang refuses to load it (400, "Failed to get weights iterator") and
    keeps serving, which is no outage, so the run stops naming the refusal, its servers stopped.
    Once the directory is gone, the same command resumes from the last checkpoint on
    exactly-once data. (A directory whose files are unreadable is another matter: SGLang 0.5.23
    dies on it, as its rollback reloads from the new path; docs/sglang.md, "Where the two
    engines differ".)"""
    workdir = tmp_path / "run"
    bad = workdir / "weights" / "v3"
    bad.mkdir(parents=True)
    (bad / COMPLETE_MARKER).write_text("{}")
    overrides = ("--config.total_steps=8", "--config.checkpoint_every=2")
    run = LearnerRun(workdir, cache_dir, *overrides, **SGLANG)
    assert run.finish(900) != 0
    out = run.output()
    assert "publishing weights to the engines failed" in out, out[-3000:]
    assert "Failed to get weights iterator" in out
    assert "exited" not in out  # refused, not dead: nothing was restarted
    assert not os.path.exists(workdir / "children.json")  # its servers were stopped
    stopped = steps_log(workdir)
    assert stopped and stopped[-1]["step"] < 8

    for name in os.listdir(bad):
        os.remove(bad / name)
    bad.rmdir()
    again = LearnerRun(workdir, cache_dir, *overrides, name="resumed", **SGLANG)
    assert again.finish(900) == 0, again.output()[-3000:]
    assert "resuming from the checkpoint of step" in again.output()
    check_exactly_once(workdir, 8, single_run=False)
