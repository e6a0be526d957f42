"""The shipped offline SWE task set (experiments/data/swe_mini): its rows, patches, bundle and
generator. Grading every task through the sandbox is test_grading's business, not this file's."""

import difflib
import filecmp
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from sao_jax.envs.swe.tasks import load_tasks
from sao_jax.envs.swe.workspace import prepare_snapshot

DATA = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "experiments",
                                    "data", "swe_mini"))
TASKS = os.path.join(DATA, "tasks.jsonl")
BUNDLE = os.path.join(DATA, "repo.bundle")
LIBRARY = os.path.join(DATA, "library")
GIT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"}

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


@functools.cache
def _generator():
    """experiments/data/swe_mini/make_tasks.py as a module (registered: its dataclass needs it)."""
    name = "swe_mini_make_tasks"
    spec = importlib.util.spec_from_file_location(name, os.path.join(DATA, "make_tasks.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, capture_output=True, text=True,
                          check=True).stdout


def _touched(patch):
    """The paths a git diff changes, from its `diff --git a/X b/X` headers."""
    return re.findall(r"^diff --git a/(\S+) b/\S+$", patch, re.MULTILINE)


@pytest.fixture(scope="module")
def tasks():
    return load_tasks(TASKS)


def test_the_shipped_rows_load(tasks):
    assert len(tasks) >= 40
    ids = [t.instance_id for t in tasks]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"sao-jax__swe-mini-\d+", i) for i in ids)
    for task in tasks:
        assert task.workspace == BUNDLE
        assert (task.repo, task.version, task.log_parser) == ("sao-jax/swe-mini", "0.1",
                                                              "unittest")
        assert task.test_cmd == "python -m unittest -v"
        assert task.fail_to_pass and task.pass_to_pass
        assert not set(task.fail_to_pass) & set(task.pass_to_pass)
        assert all(t.startswith("tests.test_") for t in task.fail_to_pass + task.pass_to_pass)
        assert task.extra["mutation"]["kind"] in _generator().KINDS
    assert len({t.environment_setup_commit for t in tasks}) == 1
    assert os.path.getsize(BUNDLE) < 200_000


def test_gold_patches_fix_source_and_test_patches_add_tests(tasks):
    for task in tasks:
        source, tests = _touched(task.patch), _touched(task.test_patch)
        assert source and all(p.startswith("minilib/") for p in source), task.instance_id
        assert tests and all(p.startswith("tests/") for p in tests), task.instance_id
        failing_modules = {"/".join(t.split(".")[:2]) + ".py" for t in task.fail_to_pass}
        assert set(tests) == failing_modules, task.instance_id
        # the problem statement shows the behaviour, never the fixed line
        fixed = [line[1:].strip() for line in task.patch.splitlines()
                 if line.startswith("+") and not line.startswith("+++")]
        assert not any(line and line in task.problem_statement for line in fixed)


@needs_git
def test_every_base_commit_is_a_branch_of_the_bundle(tasks):
    heads = dict(reversed(line.split()) for line in
                 _git("bundle", "list-heads", BUNDLE, cwd=DATA).splitlines())
    for task in tasks:
        assert heads[f"refs/heads/{task.instance_id}"] == task.base_commit
    assert heads["refs/heads/main"] == tasks[0].environment_setup_commit


@needs_git
@pytest.mark.parametrize("index", [0, 24, -1])
def test_a_snapshot_is_the_library_with_the_bug_and_without_the_failing_tests(tasks, index,
                                                                              tmp_path):
    task = tasks[index]
    dest = str(tmp_path / "repo")
    prepare_snapshot(task, dest)
    mutation = task.extra["mutation"]
    buggy = os.path.join(dest, mutation["module"])
    pristine = os.path.join(LIBRARY, mutation["module"])
    assert not filecmp.cmp(buggy, pristine, shallow=False)
    for name in os.listdir(os.path.join(LIBRARY, "tests")):
        rel = os.path.join("tests", name)
        if rel in _touched(task.test_patch):
            assert not os.path.exists(os.path.join(dest, rel))
        elif name.endswith(".py"):
            assert filecmp.cmp(os.path.join(dest, rel), os.path.join(LIBRARY, rel), shallow=False)

    # the generator rebuilds the same buggy file from the row's mutation record
    with open(pristine, encoding="ascii") as f:
        source = f.read()
    module = os.path.basename(mutation["module"])[:-3]
    candidate = _generator().mutate(source, module, mutation["kind"], mutation["site"])
    with open(buggy, encoding="ascii") as f:
        assert candidate.source == f.read()
    assert candidate.function == mutation["function"]

    # the gold patch changes the buggy file exactly back into the library's
    (tmp_path / "gold.diff").write_text(task.patch)
    (tmp_path / "tests.diff").write_text(task.test_patch)
    _git("apply", str(tmp_path / "gold.diff"), str(tmp_path / "tests.diff"), cwd=dest)
    for rel in _generator().library_files():
        assert filecmp.cmp(os.path.join(dest, rel), os.path.join(LIBRARY, rel), shallow=False), rel


def test_candidate_enumeration_is_deterministic():
    generator = _generator()
    modules = generator.library_modules()
    first = generator.enumerate_candidates({"intervals": modules["intervals"]})
    again = generator.enumerate_candidates({"intervals": modules["intervals"]})
    assert first == again
    assert len(first) > 50
    assert {c.kind for c in first} == set(generator.KINDS)
    old = modules["intervals"].splitlines()
    for candidate in first:  # one small edit each: one changed or deleted run of lines
        matcher = difflib.SequenceMatcher(a=old, b=candidate.source.splitlines(), autojunk=False)
        edits = [op for op in matcher.get_opcodes() if op[0] != "equal"]
        assert len(edits) == 1 and edits[0][0] in ("replace", "delete"), candidate.description
