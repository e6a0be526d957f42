"""The scripted SWE expert: its replies follow the protocol, and played in a real SWEEnv
(namespace backend) they solve bundled swe_mini tasks, while doing nothing earns nothing; the
one-line edit's sed substitution writes the line it is asked for."""

import hashlib
import json
import os
import subprocess
import time

import pytest

from sao_jax.envs.swe import expert
from sao_jax.envs.swe.env import SUBMIT_MARKER, SWEEnv, SWEEnvConfig, parse_command
from sao_jax.envs.swe.expert import (
    _first_hunk,
    expert_actions,
    play_sync,
    teacher_transcript,
    zero_context_patch,
)
from sao_jax.envs.swe.tasks import SWETask, load_tasks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
TASKS = os.path.join(ROOT, "experiments", "data", "swe_mini", "tasks.jsonl")

PATCH = "".join(line + "\n" for line in [
    "diff --git a/pkg/util.py b/pkg/util.py",
    "index 1111111..2222222 100644",
    "--- a/pkg/util.py",
    "+++ b/pkg/util.py",
    "@@ -40,7 +40,7 @@ class Table:",
    " ",
    "     def width(self):",
    "         cells = self.cells",
    "-        return max(len(c) for c in cells)",
    "+        return max((len(c) for c in cells), default=0)",
    " ",
    " ",
    " def height(rows):",
])


def _task(patch: str, log_parser: str = "unittest") -> SWETask:
    return SWETask(instance_id="t-1", repo="t/t", base_commit="0" * 40, problem_statement="bug",
                   patch=patch, test_patch="", fail_to_pass=("t",), pass_to_pass=(),
                   version="1", environment_setup_commit="0" * 40, log_parser=log_parser)


def test_first_hunk_names_the_function_around_the_change():
    # the last def among the context lines before the change wins over the header's class
    assert _first_hunk(PATCH) == ("pkg/util.py", 40, 7, ("def", "width"))
    header_only = PATCH.replace("\n     def width(self):\n", "\n     # width\n")
    assert _first_hunk(header_only)[3] == ("class", "Table")
    anonymous = header_only.replace(" class Table:", "")
    assert _first_hunk(anonymous)[3] is None
    with pytest.raises(ValueError, match="no `diff --git`"):
        _first_hunk("not a patch")


def test_expert_replies_follow_the_protocol():
    actions = expert_actions(_task(PATCH))
    commands = [parse_command(a) for a in actions]  # each exactly one closed block
    assert commands[0] == 'grep -rn "def width\\b" --include=*.py .'
    assert commands[1] == "sed -n '37,50p' pkg/util.py"
    assert commands[2] == f"git apply <<'EOF'\n{PATCH}EOF"
    assert commands[3] == "python -m unittest -q 2>&1 | tail -n 3"
    assert commands[4] == f"echo {SUBMIT_MARKER}"
    for action in actions:  # a short thought, then the block
        thought, _, _ = action.partition("```bash\n")
        assert thought.count("\n") == 1 and len(thought) < 50
    assert "pytest -q" in parse_command(expert_actions(_task(PATCH, "pytest"))[3])
    anonymous = PATCH.replace("\n     def width(self):\n", "\n").replace(" class Table:", "")
    assert len(expert_actions(_task(anonymous))) == 4  # nothing to grep for
    tricky = PATCH.replace(" def height(rows):", "EOF")  # a line the heredoc would end at
    assert "<<'EOF_'\n" in expert_actions(_task(tricky))[2]


# ----------------------------------------------------------------------------- live episodes

@pytest.fixture(scope="module")
def bundled(isolated):
    tasks = load_tasks(TASKS)  # shipped in the repository: its absence is a failure
    # three fixed tasks spread over the set (the set is ordered by module and mutation)
    return [tasks[0], tasks[len(tasks) // 2], tasks[-1]]


def test_expert_solves_bundled_tasks(bundled, grader):
    config = SWEEnvConfig()
    for task in bundled[:2]:
        started = time.perf_counter()
        (prompt, turns), reward, infos = play_sync(SWEEnv(task, config, grader),
                                                   expert_actions(task))
        seconds = time.perf_counter() - started
        assert reward == 1.0, (task.instance_id, infos[-1])
        assert infos[-1]["resolved"] and infos[-1]["turns"] == len(turns) <= config.max_turns
        assert (infos[-1]["format_errors"], infos[-1]["timeouts"]) == (0, 0)
        assert task.problem_statement.strip() in prompt
        assert turns[-1][1] == "" and all(o.startswith("<returncode>0</returncode>")
                                          for _, o in turns[:-1]), turns
        assert "Ran " in turns[-2][1] and "OK" in turns[-2][1]  # the visible tests pass
        print(f"{task.instance_id}: expert episode {seconds:.2f} s")
        assert seconds < 15


def test_teacher_transcript_is_the_played_episode(bundled, grader):
    task = bundled[2]
    prompt, turns = teacher_transcript(task, SWEEnvConfig(), grader)
    assert prompt == SWEEnv(task, SWEEnvConfig(), grader).reset()
    assert [a for a, _ in turns] == expert_actions(task)
    assert task.patch.splitlines()[0] in turns[-3][0]
    assert "<output>" in turns[0][1] and turns[-1][1] == ""


def test_doing_nothing_earns_nothing(bundled, grader):
    submit = expert_actions(bundled[0])[-1]
    _, reward, infos = play_sync(SWEEnv(bundled[0], SWEEnvConfig(), grader), [submit])
    assert reward == 0.0 and infos[-1]["submitted"] and not infos[-1]["resolved"]
    with pytest.raises(RuntimeError, match="the expert did not solve"):
        teacher_transcript(bundled[0], SWEEnvConfig(max_turns=2), grader)


def test_zero_context_patches_keep_only_the_changed_lines():
    assert zero_context_patch(PATCH) == (
        "--- a/pkg/util.py\n+++ b/pkg/util.py\n@@ -43,1 +43,1 @@\n"
        "-        return max(len(c) for c in cells)\n"
        "+        return max((len(c) for c in cells), default=0)\n")
    insert = PATCH.replace("-        return max(len(c) for c in cells)\n", "")
    assert "@@ -42,0 +43,1 @@\n+" in zero_context_patch(insert)  # after old line 42
    delete = PATCH.replace("+        return max((len(c) for c in cells), default=0)\n", "")
    assert "@@ -43,1 +42,0 @@\n-" in zero_context_patch(delete)
    new_file = PATCH.replace("index 1111111", "new file mode 100644\nindex 0000000")
    assert zero_context_patch(new_file) is None  # applied whole


def test_compact_replies_are_short_and_solve_every_kind_of_bundled_change(bundled, grader):
    # the compact expert (the swe_mini warm start's) on tasks whose fixes insert, delete and
    # change lines: zero-context patches apply where the full ones did
    tasks = load_tasks(TASKS)
    kinds = {}
    for task in tasks:
        kinds.setdefault(task.extra["mutation"]["kind"], task)
    chosen = [kinds[k] for k in ("drop_statement", "drop_branch", "swap_args")]
    for task in chosen:
        actions = expert_actions(task, compact=True)
        assert len(actions) == 4 and "--unidiff-zero" in actions[1]
        assert sum(map(len, actions)) < sum(map(len, expert_actions(task)))
        _, reward, infos = play_sync(SWEEnv(task, SWEEnvConfig(), grader), actions)
        assert reward == 1.0, (task.instance_id, infos[-1])


@pytest.mark.parametrize("old, new, script", [
    ("    if s > k:", "    if s < k:", "2s/>/</"),
    ("    return lo <= x and x < hi", "    return lo <= x and x <= hi", "2s/</<=/2"),
    ("    return (a + b) / 2", "    return (a + b) // 2", "2s|/|//|"),
    ("    return pow(b, a)", "    return pow(a, b)", "2s/b, a/a, b/"),
    ("    if k > k:", "    if s > k:", "2s/\\bk\\b/s/"),
    ("        n = n + 11", "        n = n + 1", "2s/\\b11\\b/1/"),
    ("    return a * b", "    return a + b", "2s/\\*/+/"),
])
def test_the_sed_substitution_writes_the_line(old, new, script):
    assert expert.sed_substitution(2, old, new) == script
    done = subprocess.run(["sed", script], input=f"x\n{old}\n", capture_output=True, text=True)
    assert done.stdout == f"x\n{new}\n"


def test_no_substitution_for_equal_lines_or_an_insertion():
    with pytest.raises(ValueError, match="no token"):
        expert.sed_substitution(1, "return a", "return a")


def test_the_expert_version_pins_its_replies():
    """`expert.VERSION` stands for the replies in the warm start's cache key: the replies to the
    swe_mini tasks (full and compact) and to every 20th swe_tiny task (fixed or mistaken, each
    way of reading and editing) hash to the digest recorded for the version. A change of
    replies must raise VERSION (and ship a new swe_tiny warm start, experiments/data/
    warm_starts); a change of code that keeps them keeps the shipped one."""
    tiny_tasks = load_tasks(os.path.join(ROOT, "experiments", "data", "swe_tiny",
                                         "tasks.jsonl"))[::20]
    made = {"patch": [expert_actions(t, compact=c) for t in load_tasks(TASKS)
                      for c in (False, True)],
            "edit": [expert.edit_actions(t, line=line, read=read, fix=fix) for t in tiny_tasks
                     for line in (None, t.extra["mutation"]["decoys"][0])
                     for read in ("cat", "grep") for fix in ("sub", "line")]}
    digest = hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()[:16]
    assert (expert.VERSION, digest) == (1, "5c620fd081e257d2")
