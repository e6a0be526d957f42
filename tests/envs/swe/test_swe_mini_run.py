"""`make train EXP=swe_mini` as a subprocess, a few steps of it: learner, embedded engine, a rollout
worker playing SWE episodes in namespace workspaces, evaluation, the swe/* scalars (the
reward-hacking monitor's swe/suspicious* among them)."""

import json
import os
import subprocess
import sys

import pytest

from sao_jax.envs.swe import monitor
from tests.train.learner_runs import environment, scalars_as_shown

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


@pytest.mark.slow  # ~60 s on 2 cores (make test-slow, which CI runs); the whole SWE path in
def test_a_few_steps_of_swe_mini(tmp_path, isolated):  # process: test_swe_path.py
    workdir = tmp_path / "run"
    # No warm start (minutes on this CPU): the random policy rarely writes a bash block, which
    # the env answers with its format-error observation; the expert's path is test_swe_path's.
    overrides = [
        "--config.warm_start.enabled=False", "--config.total_steps=2",
        "--config.batch_size=2", "--config.env.num_eval_prompts=1", "--config.env.max_turns=2",
        "--config.env.max_action_tokens=32", "--config.precompile_steps=False",
        "--config.rl.critic_warmup_steps=1", "--config.rollout.worker_concurrency=2",
        "--config.checkpoint_every=2", "--config.compilation_cache=False",
        "--config.rollout.engine_max_seq_len=1023"]  # rows of 1024: a quicker compile
    proc = subprocess.run(
        [sys.executable, "-m", "sao_jax.main", "--config=experiments/swe_mini.py",
         f"--workdir={workdir}", *overrides],
        cwd=REPO, env=environment(str(tmp_path / "cache")), capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(workdir / "summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 2 and summary["trajectories"] == 4
    assert summary["this_run_stream"]["episodes_failed"] == 0
    scalars, _ = scalars_as_shown(str(workdir / "tb"))
    monitor_tags = [f"swe/suspicious_{kind}" for kind in monitor.KINDS] + ["swe/suspicious"]
    for tag in ["swe/resolved", "swe/submitted", "swe/format_errors", "swe/timeouts",
                "swe/turns", *monitor_tags]:
        assert scalars[tag] == [1, 2], tag
    with open(workdir / "config.json") as f:
        assert json.load(f)["env"]["swe"]["backend"] == "namespace"

    # `make eval`: the checkpoint's score, with the environment's metrics of the sampled
    # episodes and the monitor's notes on them.
    scored = subprocess.run(
        [sys.executable, "-m", "sao_jax.main", "--config=experiments/swe_mini.py",
         f"--eval={workdir}", *overrides],
        cwd=REPO, env=environment(str(tmp_path / "cache")), capture_output=True, text=True,
        timeout=600)
    assert scored.returncode == 0, scored.stdout[-3000:] + scored.stderr[-3000:]
    result = json.loads(scored.stdout[scored.stdout.index("{"):])
    assert set(result) >= {"accuracy", "greedy_accuracy", "swe/resolved", *monitor_tags}
    assert isinstance(result["notes"], list)
