"""swe_tiny (experiments/data/swe_tiny, sao_jax/envs/swe/tiny.py, experiments/swe_tiny.py): the
task family's shape, the generator that made it, its gold, decoy and empty patches graded in real
workspaces, the one-line-edit expert played through the env, the warm start's stream of fresh
tasks (rendered byte for byte as the env plays them, never a held-out file or bug). A few steps
of `make train EXP=swe_tiny` (warm start included) through the real workspaces and grader run in
tests/test_notebooks.py, as the swe notebook's runs."""

import hashlib
import itertools
import json
import os
import random
import re
import subprocess

import ml_collections
import pytest

from experiments import swe_tiny
from sao_jax.envs.swe import expert, options, teacher, tiny
from sao_jax.envs.swe.env import SWEEnv, SWEEnvConfig
from sao_jax.envs.swe.grading import Grader, grade
from sao_jax.envs.swe.tasks import load_tasks
from sao_jax.envs.swe.workspace import WorkspaceConfig

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
        # writing the whole line (`sed -i 'Nc\\LINE'`): the fix resolves, the mistake does not
        for line, resolved in ((None, 1.0), (wrong, 0.0)):
            actions = expert.edit_actions(task, line=line, fix="line")
            assert f"sed -i '{task.extra['mutation']['line']}c\\" in actions[1]
            _, reward, infos = expert.play_sync(SWEEnv(task, config, grader), actions)
            assert reward == resolved and infos[-1]["submitted"], infos[-1]["reward_reason"]
    finally:
        grader.close()
    mistaken = [t for t in TASKS if teacher.mistake(t, 0.5) is not None]
    assert 0.4 < len(mistaken) / len(TASKS) < 0.6
    assert all(teacher.mistake(t, 0.5) in t.extra["mutation"]["decoys"] for t in mistaken)
    assert all(teacher.mistake(t, 0.0) is None for t in TASKS)
    # a habit: the same tasks mistaken, always with the first decoy
    assert [teacher.mistake(t, 0.5, "first") for t in mistaken] == [
        t.extra["mutation"]["decoys"][0] for t in mistaken]
    assert len({teacher.mistake(t, 0.5) == t.extra["mutation"]["decoys"][0]
                for t in mistaken}) == 2  # "random" draws others too
    # errs on some kinds only: the same draw on those tasks, none on the others
    operators = ("compare", "arith")
    assert [t for t in TASKS if teacher.mistake(t, 0.5, "first", operators)] == [
        t for t in mistaken if t.extra["mutation"]["kind"] in operators]
    with pytest.raises(ValueError, match="fix must be one of"):
        expert.edit_actions(task, fix="ed")


def test_the_generator_makes_the_committed_tasks():
    """tiny.make_instance, drawn as make_tasks.py draws, gives every committed task's bug."""
    made = {instance["file"]: instance for instance in tiny.first_instances(len(TASKS), 7)}
    for task in TASKS:
        mutation = task.extra["mutation"]
        instance = made[mutation["file"]]
        assert instance["problem"] == task.problem_statement
        assert {k: instance["mutation"][k] for k in ("kind", "line", "buggy", "fixed")} == {
            k: mutation[k] for k in ("kind", "line", "buggy", "fixed")}
        assert tiny.held_out(int(mutation["file"][-6:-3])) == (task in TASKS[-HELD_OUT:])


def test_the_stream_renders_what_the_env_shows(namespace, tmp_path):
    """The warm start's swe_tiny stream renders episodes without a workspace (tiny.render): for
    committed tasks, the fix and a mistake, its transcript is the one the expert plays through
    a real SWEEnv, byte for byte, in the experiment's prompt and in the env's default one, with
    either way of reading the file (`cat -n`, `grep -Hn`)."""
    bare = tmp_path / "bare"
    subprocess.run(["git", "clone", "-q", "--bare", os.path.join(
        REPO, "experiments", "data", "swe_tiny", "repo.bundle"), str(bare)], check=True)
    grader = Grader(namespace)
    try:
        for task, prompt in ((TASKS[3], swe_tiny.PROMPT), (TASKS[-1], "")):
            m = task.extra["mutation"]
            mutant = subprocess.run(["git", f"--git-dir={bare}", "show",
                                     f"{task.base_commit}:{m['file']}"], check=True,
                                    capture_output=True, text=True).stdout
            config = options.env_config({"prompt_template": prompt, "output_chars": 600,
                                         "backend": "namespace", "memory_bytes": 1 << 30},
                                        max_turns=3)
            for target, read, fix in ((m["fixed"], "cat", "sub"), (m["decoys"][0], "cat", "sub"),
                                      (m["fixed"], "grep", "sub"), (m["fixed"], "grep", "line"),
                                      (m["decoys"][0], "cat", "line")):
                played, _, _ = expert.play_sync(
                    SWEEnv(task, config, grader),
                    expert.edit_actions(task, line=None if target == m["fixed"] else target,
                                        read=read, fix=fix))
                assert tiny.render(config, task.problem_statement, task.instance_id, mutant, m,
                                   target, read=read, fix=fix) == played
                assert (m["file"] + ":1:" in played[1][0][1]) == (read == "grep")
                assert (f"{m['line']}c\\{target}' " in played[1][1][0]) == (fix == "line")
    finally:
        grader.close()


def test_the_stream_is_fresh_tasks_in_training_files_without_held_out_bugs():
    held = TASKS[-HELD_OUT:]
    held_files = {t.extra["mutation"]["file"] for t in held}
    config = options.env_config({"prompt_template": swe_tiny.PROMPT}, max_turns=3)

    def take(seed, mistakes, n=50):
        return list(itertools.islice(tiny.transcripts(seed, config=config, mistakes=mistakes), n))

    right, mixed = take(1, 0.0), take(1, 0.5)
    assert right == take(1, 0.0) and right != take(2, 0.0)  # a seed gives one stream
    assert len({prompt for prompt, _ in right}) == len(right)  # fresh tasks, not a pool
    for prompt, turns in right:
        file = re.search(r"`(tinyfix/f\d+\.py)`", prompt).group(1)
        assert file not in held_files and not tiny.held_out(int(file[-6:-3]))
        assert turns[0][0] == f"Read it.\n```bash\ncat -n {file}\n```\n"
        assert f"' {file} && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in turns[1][0]
    # the mistakes: the same tasks, another edit on about half of them
    assert [p for p, _ in mixed] == [p for p, _ in right]
    changed = sum(a[1][0] != b[1][0] for (_, a), (_, b) in zip(right, mixed, strict=True))
    assert 0.3 < changed / len(right) < 0.7
    # a habit: each mistake is the task's first decoy, and the whole line is written
    habit = list(itertools.islice(tiny.transcripts(1, config=config, mistakes=0.5, fix="line",
                                                   decoy="first"), 50))
    made = [i["mutation"] for i in itertools.islice(tiny.instances(1), 50)]
    wrong = 0
    for (prompt, turns), m in zip(habit, made, strict=True):
        number, line = re.search(r"sed -i '(\d+)c\\(.*)' ", turns[1][0]).groups()
        assert number == str(m["line"]) and line in (m["fixed"], m["decoys"][0])
        assert f"`{m['file']}`" in prompt
        wrong += line != m["fixed"]
    assert 15 < wrong < 35
    # errs on the operator kinds only: the other instances fixed, these drawn as before
    operators = ("compare", "arith")
    some = tiny.transcripts(1, config=config, mistakes=0.5, fix="line", decoy="first",
                            kinds=operators)
    for (_, turns), (_, habit_turns), m in zip(itertools.islice(some, 50), habit, made,
                                               strict=True):
        line = re.search(r"sed -i '\d+c\\(.*)' ", turns[1][0]).group(1)
        assert turns == habit_turns if m["kind"] in operators else line == m["fixed"]
    # excluded bugs (the held-out tasks') are never drawn
    drawn = [(m["mutation"]["buggy"], m["mutation"]["fixed"])
             for m in itertools.islice(tiny.instances(3), 40)]
    kept = list(itertools.islice(tiny.instances(3, exclude=drawn[:20]), 40))
    assert not {(m["mutation"]["buggy"], m["mutation"]["fixed"]) for m in kept} & set(drawn[:20])
    assert len(kept) == 40


def test_swe_options_check_the_teacher():
    base = ml_collections.ConfigDict({"env": {"swe": {
        "backend": "namespace", "expert": "patch", "expert_mistakes": 0.0,
        "expert_tasks": "rows"}}})
    for field, value, message in (("expert", "sed", "expert must be one of"),
                                  ("expert_mistakes", 1.0, "expert_mistakes"),
                                  ("expert_tasks", "tiny", "expert_tasks must be one of"),
                                  ("expert_tasks", "swe_tiny", "expert = 'edit'"),
                                  ("expert_read", "less", "expert_read"),
                                  ("expert_fix", "ed", "expert_fix"),
                                  ("expert_decoy", "last", "expert_decoy"),
                                  ("expert_mistake_kinds", "compare,names",
                                   r"expert_mistake_kinds names \['names'\]")):
        config = ml_collections.ConfigDict(base.to_dict())
        config.env.swe[field] = value
        with pytest.raises(ValueError, match=message):
            options.from_config(config)


def test_the_stream_version_pins_what_it_makes():
    """`tiny.VERSION` stands for the stream in the warm start's cache key: the instances and
    transcripts it makes hash to the digest recorded for the version. A change of output must
    raise VERSION (and ship a new swe_tiny warm start, experiments/data/warm_starts); a change
    of code that keeps them keeps the shipped one."""
    config = options.env_config({"prompt_template": swe_tiny.PROMPT}, max_turns=3)
    made = {"instances": list(itertools.islice(tiny.instances(5), 40)),
            "transcripts": list(itertools.islice(tiny.transcripts(
                5, config=config, mistakes=0.5, read="grep", decoy="first"), 40)),
            "files": [tiny.make_instance(i, random.Random(i)) for i in range(0, 440, 11)]}
    digest = hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()[:16]
    assert (tiny.VERSION, digest) == (1, "a477a83f27b071bc")
