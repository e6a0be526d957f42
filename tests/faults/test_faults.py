"""Faults injected into real toy runs (two embedded engines, two workers): each run finishes,
and no accepted trajectory is lost or trained twice (`harness.check_exactly_once`).

    make test-faults    # = pytest -m faults tests/faults

Measured outcomes: docs/faults.md, "The fault suite: `make test-faults`".
"""

import os
import random
import re
import shutil
import signal
import subprocess
import time

import pytest

from tests.faults.harness import (
    LearnerRun,
    check_exactly_once,
    engine_port,
    leases_came_back,
    leases_of,
    scalar_max,
    steps_log,
    summary_of,
    wait_gone,
    weight_version,
)
from tests.train.learner_runs import scalars_as_shown

pytestmark = pytest.mark.faults


def test_a_killed_engine_is_restarted_with_the_current_weights(tmp_path, cache_dir):
    """SIGKILL engine0 mid-run: engine1 serves, the learner starts engine0 again on its port from
    the newest published weights, and it holds the learner's current version once back."""
    workdir = tmp_path / "run"
    run = LearnerRun(workdir, cache_dir, "--config.total_steps=16",
                     "--config.checkpoint_every=4")
    run.wait_step(4)
    before = run.children()
    port = engine_port(before["engine0"])
    killed_at = weight_version(port)  # what engine0 held: published, so the restart's floor
    os.kill(before["engine0"], signal.SIGKILL)
    back = run.wait_for(lambda: re.search(r"engine0 is back on http://127.0.0.1:(\d+) with "
                                          r"weights v(\d+)", run.output()), "engine0 back")
    assert int(back.group(1)) == port  # the same port: the workers' URLs stay valid
    held = weight_version(port)
    assert held >= int(back.group(2)) >= killed_at
    started = re.search(r"engine0 exited with code -9: restarting it \(restart 1 of 3\) on port "
                        rf"{port} from weights v(\d+), the ones served", run.output())
    assert started and int(started.group(1)) >= killed_at, run.output()[-3000:]
    assert run.finish() == 0, run.output()[-3000:]
    check_exactly_once(workdir, 16, single_run=True)
    for other in ("engine1", "worker0", "worker1"):
        assert f"{other} exited" not in run.output()


def test_b_a_killed_worker_is_restarted_and_its_leases_come_back(tmp_path, cache_dir):
    """SIGKILL worker0 mid-run: the learner starts it again, the leases it held are issued again
    once `lease_timeout_s` passes and answered by a live worker, and the run finishes on whole,
    fresh data."""
    workdir = tmp_path / "run"
    # A killed worker loses only the episodes it had not yet sent: most of the time a toy
    # worker's slots all wait in Submit for room in the queue, and the learner accepts those
    # answers after the sender is gone (CI runs killed worker0 holding nothing else, and nothing
    # expired). So the stream log names the worker each fresh lease went to, worker0 is killed
    # as soon as the log shows it a new lease (its episode has barely begun), and again
    # (restart 2, then 3 of 3) until one of its leases has come back. The run is long enough for
    # three tries on a quiet machine (40 steps took 29 s in CI, too few for a second). The
    # admission limit (max_staleness x batch, capped at both workers' 16 slots + a batch) is 24
    # here, so both workers hold leases while a batch waits. At 2 s a busy live worker's lease
    # can expire too: issued twice, answered twice, each answer a distinct trajectory.
    total = 120
    run = LearnerRun(workdir, cache_dir, f"--config.total_steps={total}",
                     "--config.checkpoint_every=10", "--config.rollout.lease_timeout_s=2",
                     "--config.max_staleness=4")
    run.wait_step(3)
    killed, spared = [], run.children()["worker1"]  # `children` names workers in pid order
    for restart in (1, 2, 3):
        pid = run.wait_for(lambda: next((p for name, p in run.children().items()
                                         if name.startswith("worker") and p != spared), None),
                           "worker0 running")
        held = len(leases_of(workdir, f"worker-{pid}"))
        run.wait_for(lambda: len(leases_of(workdir, f"worker-{pid}")) > held,  # noqa: B023
                     "a new lease for worker0", timeout_s=60)
        os.kill(pid, signal.SIGKILL)
        killed.append(f"worker-{pid}")
        run.wait_for(lambda: f"worker0 exited with code -9: restarted it (restart {restart} of "  # noqa: B023
                             "3); the leases it held come back after 2 s" in run.output(),
                     f"worker0 restart {restart}")
        deadline = time.monotonic() + 10  # 2 s to expire, then an episode and a Submit
        while not leases_came_back(workdir, killed[-1]) and time.monotonic() < deadline:
            assert run.proc.poll() is None, f"the run ended {restart} kill(s) in"
            time.sleep(0.2)
        if leases_came_back(workdir, killed[-1]):
            break
    assert run.finish() == 0, run.output()[-3000:]
    check_exactly_once(workdir, total, single_run=True)
    came_back = set().union(*(leases_came_back(workdir, w) for w in killed))
    assert came_back, f"none of the leases that {len(killed)} kills of worker0 lost came back"
    assert scalar_max(workdir, "stream/leases_expired") >= 1  # the only way back for them
    for other in ("engine0", "engine1", "worker1"):
        assert f"{other} exited" not in run.output()


def test_c_a_frozen_engine_is_failed_over_and_caught_up(tmp_path, cache_dir):
    """SIGSTOP engine0 for 30 s, then SIGCONT: its requests time out and move to engine1, the
    weight updates it misses leave it behind, and once it answers it loads the newest weights;
    nothing is restarted, nothing lost."""
    workdir = tmp_path / "run"
    run = LearnerRun(workdir, cache_dir, "--config.total_steps=48",
                     "--config.checkpoint_every=12", "--config.rollout.request_timeout_s=10",
                     "--config.rollout.weight_update_timeout_s=10")
    run.wait_step(3)
    pid = run.children()["engine0"]
    port = engine_port(pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        frozen_at = run.last_step()
        time.sleep(30)
        during = run.last_step() - frozen_at
    finally:
        os.kill(pid, signal.SIGCONT)
    assert during >= 1, "no step while engine0 was frozen: engine1 did not take over"
    url = f"http://127.0.0.1:{port}"
    assert f"not loaded on {url}, which cannot be reached" in run.output()
    back = run.wait_for(lambda: re.search(rf"{url} is back: it loaded weights v(\d+)",
                                          run.output()), "engine0 caught up", timeout_s=120)
    assert weight_version(port) >= int(back.group(1))
    assert run.finish() == 0, run.output()[-3000:]
    check_exactly_once(workdir, 48, single_run=True)
    for name in ("engine0", "engine1", "worker0", "worker1"):  # frozen is not dead
        assert f"{name} exited" not in run.output()
    assert summary_of(workdir)["steps"] == 48


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mounted where the run keeps its checkpoints, `resize(bytes)` to fill it up or
    give the space back (needs root: mount(2)); unmounted afterwards."""
    path = tmp_path / "run" / "checkpoints"
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs (root needed): {mounted.stderr.strip()}")

    def resize(size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)

    try:
        yield path, resize
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_d_a_full_disk_stops_the_run_at_a_good_checkpoint_and_it_resumes(tmp_path, cache_dir,
                                                                          small_disk):
    """The checkpoint disk fills (a real ENOSPC, from a tmpfs shrunk under the run): the save
    fails, the previous checkpoint stays good, the run stops saying so and how to resume, and
    the same command resumes once space is back, on exactly-once data."""
    checkpoints, resize = small_disk
    workdir = tmp_path / "run"
    overrides = ("--config.total_steps=12", "--config.checkpoint_every=4")
    run = LearnerRun(workdir, cache_dir, *overrides)
    run.wait_for(lambda: (checkpoints / "4").is_dir(), "the checkpoint of step 4")
    used = shutil.disk_usage(checkpoints).used
    resize(used + used // 2)  # room for half a checkpoint more: step 8's save fails midway
    assert run.finish() == 1, run.output()[-3000:]
    out = run.output()
    assert "the disk is full: the checkpoint of step 8 could not be written" in out, out[-3000:]
    assert f"the last good one is step 4 ({checkpoints / '4'})" in out
    assert "run the same command again" in out and "Traceback" not in out
    assert sorted(os.listdir(checkpoints)) == ["4"]  # the partial save was removed
    killed = steps_log(workdir)
    assert killed[-1]["step"] >= 8

    resize(64 * 2**20)  # space is back
    again = LearnerRun(workdir, cache_dir, *overrides, name="resumed")
    assert again.finish() == 0, again.output()[-3000:]
    assert "resuming from the checkpoint of step 4" in again.output()
    records = check_exactly_once(workdir, 12, single_run=False)
    by_step = {r["step"]: r["ids"] for r in records}
    for record in killed:  # steps 5..8 were trained again on the same data
        assert by_step[record["step"]] == record["ids"], record["step"]


def test_e_the_learner_killed_at_five_random_points_resumes_exactly_once(tmp_path, cache_dir):
    """SIGKILL the learner five times in one run, at seeded random points (while it starts
    again, mid-step, around checkpoints), after a Ctrl-C (SIGINT: it stops its children and exits
    130); every resume continues from its last checkpoint on the same data, the finished
    run trained every step once on distinct trajectories, and TensorBoard shows each step once
    (what a killed run logged past its checkpoint is purged)."""
    rng = random.Random(5)
    workdir = tmp_path / "run"
    total, every = 40, 3
    overrides = (f"--config.total_steps={total}", f"--config.checkpoint_every={every}")
    run = LearnerRun(workdir, cache_dir, *overrides, name="interrupted")
    run.wait_step(every + 1)  # past its first checkpoint
    children = list(run.children().values())
    assert len(children) == 4, children
    run.proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert run.finish(timeout_s=60) == 130, run.output()[-3000:]
    assert "interrupted" in run.output() and "Traceback" not in run.output()
    wait_gone(children)
    history = [steps_log(workdir)]  # each stopped run's steps.jsonl
    for kill in range(5):
        run = LearnerRun(workdir, cache_dir, *overrides, name=f"run{kill}")
        if kill == 2:  # while it starts again: restoring, starting engines, compiling
            run.wait_for(lambda r=run: r.output().strip(), "the learner's first words")
            time.sleep(rng.uniform(0.0, 5.0))
        else:
            base = max((r["step"] for r in steps_log(workdir)), default=0)
            run.wait_step(min(total - 1, base + rng.randint(1, every + 1)))
            time.sleep(rng.uniform(0.0, 0.3))  # wherever the loop is then (a step: ~0.15 s)
        children = list(run.children().values())
        run.kill()
        wait_gone(children)
        history.append(steps_log(workdir))
        assert history[-1][-1]["step"] < total, f"run{kill} had finished: no fault injected"
    last = LearnerRun(workdir, cache_dir, *overrides, name="final")
    assert last.finish() == 0, last.output()[-3000:]
    records = check_exactly_once(workdir, total, single_run=False)
    by_step = {r["step"]: r["ids"] for r in records}
    for killed in history:  # every step a stopped run made was made again on the same data
        for record in killed:
            assert by_step[record["step"]] == record["ids"], record["step"]
    assert not (workdir / "children.json").exists()
    scalars, _ = scalars_as_shown(workdir / "tb")
    for tag in ("reward/mean", "critic/loss", "rollout/policy_lag_max"):
        assert sorted(scalars[tag]) == list(range(1, total + 1)), (tag, scalars[tag])
