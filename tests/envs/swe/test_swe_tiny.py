"""swe_tiny (experiments/data/swe_tiny, experiments/swe_tiny.py): the task family's shape, its
gold, decoy and empty patches graded in real workspaces, the one-line-edit expert played through
the env, and a few steps of `make train EXP=swe_tiny` (warm start included) on a handful of its
tasks, through the real workspaces and grader."""

import json
import os
import subprocess
import sys

import pytest

from sao_jax.envs.swe import expert, teacher
from sao_jax.envs.swe.env import SWEEnv, SWEEnvConfig
from sao_jax.envs.swe.grading import Grader, grade
from sao_jax.envs.swe.tasks import load_tasks
from sao_jax.envs.swe.workspace import WorkspaceConfig
from tests.train.learner_runs import environment, scalars_as_shown

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
TASKS = load_tasks(os.path.join(REPO, "experiments", "data", "swe_tiny", "tasks.jsonl"))
HELD_OUT = 40


def test_every_task_is_a_one_line_fix_with_decoys_and_held_out_files_are_untouched():
    kinds = set()
    for task in TASKS:
        path, line, fixed = expert.single_line_fix(task.patch)
        mutation = task.extra["mutation"]
        assert (path, line, fixed) == (mutation["file"], mutation["line"], mutation["fixed"])
        assert mutation["decoys"] and fixed not in mutation["decoys"]
        assert path in task.problem_statement and len(task.fail_to_pass) == 1
        kinds.add(mutation["kind"])
    assert kinds == {"compare", "arith", "const", "name", "swap"}
    train_files = {t.extra["mutation"]["file"] for t in TASKS[:-HELD_OUT]}
    held_files = {t.extra["mutation"]["file"] for t in TASKS[-HELD_OUT:]}
    assert not train_files & held_files and len(held_files) == HELD_OUT


@pytest.fixture(scope="module")
def namespace(isolated):
    return WorkspaceConfig(backend="namespace", memory_bytes=1 << 30, cpu_seconds=60)


@pytest.mark.parametrize("index", [0, 9, 123, len(TASKS) - 1])
def test_gold_resolves_a_decoy_and_nothing_do_not(index, namespace):
    task = TASKS[index]
    assert grade(task, task.patch, namespace, timeout=60).resolved
    assert not grade(task, "", namespace, timeout=60).resolved
    path, line, _ = expert.single_line_fix(task.patch)
    decoy = task.patch.replace("+" + task.extra["mutation"]["fixed"] + "\n",
                               "+" + task.extra["mutation"]["decoys"][0] + "\n")
    assert decoy != task.patch
    result = grade(task, decoy, namespace, timeout=60)
    assert result.status == "unresolved", result.reason


def test_the_edit_expert_fixes_through_the_env_and_its_mistake_does_not(namespace):
    task = TASKS[3]
    config = SWEEnvConfig(max_turns=3, workspace=namespace)
    grader = Grader(namespace)
    try:
        (_, turns), reward, infos = expert.play_sync(SWEEnv(task, config, grader),
                                                     expert.edit_actions(task))
        assert reward == 1.0 and len(turns) == 2 and infos[-1]["submitted"]
        assert f"{task.extra['mutation']['line']}\t{task.extra['mutation']['buggy']}" in turns[0][1]
        wrong = task.extra["mutation"]["decoys"][0]
        _, reward, infos = expert.play_sync(SWEEnv(task, config, grader),
                                            expert.edit_actions(task, line=wrong))
        assert reward == 0.0 and infos[-1]["submitted"] and not infos[-1]["resolved"]
    finally:
        grader.close()
    mistaken = [t for t in TASKS if teacher.mistake(t, 0.5) is not None]
    assert 0.4 < len(mistaken) / len(TASKS) < 0.6
    assert all(teacher.mistake(t, 0.5) in t.extra["mutation"]["decoys"] for t in mistaken)
    assert all(teacher.mistake(t, 0.0) is None for t in TASKS)


def test_a_few_steps_of_swe_tiny(tmp_path, isolated):
    """Warm start on 6 tasks' transcripts, two RL steps, an evaluation: every episode plays in
    a namespace workspace and submitted patches are graded by the hidden tests."""
    tasks = tmp_path / "tasks.jsonl"
    rows = [t.to_row() for t in TASKS[:4] + TASKS[-2:]]
    for row in rows:
        row["workspace"] = os.path.join(REPO, "experiments", "data", "swe_tiny", "repo.bundle")
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    workdir = tmp_path / "run"
    overrides = [
        f"--config.env.train_path={tasks}", "--config.env.num_eval_prompts=2",
        "--config.warm_start.max_steps=20", "--config.warm_start.eval_every=10",
        "--config.total_steps=2", "--config.batch_size=2", "--config.eval_every=0",
        "--config.precompile_steps=False", "--config.rl.critic_warmup_steps=1",
        "--config.rollout.worker_concurrency=2", "--config.checkpoint_every=2",
        "--config.compilation_cache=False"]
    proc = subprocess.run(
        [sys.executable, "-m", "sao_jax.main", "--config=experiments/swe_tiny.py",
         f"--workdir={workdir}", *overrides],
        cwd=REPO, env=environment(str(tmp_path / "cache")), capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "warm start: 6 expert transcripts" in proc.stdout + proc.stderr
    with open(workdir / "summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == 2 and summary["trajectories"] == 4
    assert summary["this_run_stream"]["episodes_failed"] == 0
    scalars, _ = scalars_as_shown(str(workdir / "tb"))
    for tag in ["swe/resolved", "swe/submitted", "swe/format_errors", "swe/turns",
                "swe/suspicious"]:
        assert scalars[tag] == [1, 2], tag
