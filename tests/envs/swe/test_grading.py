"""Grading: logs read as the runners print them, tampering refused before any workspace, fake
test lines not counted, the verdict of a tiny live task on the namespace backend, and a grader
that never runs more than its limit at once."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from sao_jax.envs.swe import grading, testrun
from sao_jax.envs.swe.canaries import Canaries
from sao_jax.envs.swe.grading import (
    Grader,
    GradeResult,
    Report,
    attach_reporter,
    extract_patch,
    grade,
    read_report,
    verdict,
)
from sao_jax.envs.swe.patches import check_patch, is_test_path, patch_paths
from sao_jax.envs.swe.tasks import SWETask
from sao_jax.envs.swe.testlog import ERROR, FAILED, PASSED, SKIPPED, parse_log, runner_finished
from sao_jax.envs.swe.workspace import WorkspaceConfig, open_workspace
from tests.envs.swe.tiny_task import CALC, change_as_patch, make_tiny_task

# ----------------------------------------------------------------------------- parse_log

# Python 3.11's `python -m unittest -v` on a TestCase with one test of each outcome.
UNITTEST_311 = """\
test_doc (tests.test_a.T.test_doc)
First doc line. ... ok
test_err (tests.test_a.T.test_err) ... ERROR
test_fail (tests.test_a.T.test_fail) ... FAIL
test_ok (tests.test_a.T.test_ok) ... ok
test_print (tests.test_a.T.test_print) ... hello out
ok
test_skip (tests.test_a.T.test_skip) ... skipped 'why'
test_sub (tests.test_a.T.test_sub) ... \n\
  test_sub (tests.test_a.T.test_sub) (i=1) ... FAIL
test_xf (tests.test_a.T.test_xf) ... expected failure
test_xp (tests.test_a.T.test_xp) ... unexpected success

======================================================================
ERROR: test_err (tests.test_a.T.test_err)
----------------------------------------------------------------------
Traceback (most recent call last):
KeyError

----------------------------------------------------------------------
Ran 9 tests in 0.001s

FAILED (failures=2, errors=1, skipped=1, expected failures=1, unexpected successes=1)
"""

# The same run as Python 3.10 and older print it: the class in parentheses, not the method.
UNITTEST_OLD = """\
test_doc (tests.test_a.T)
First doc line. ... ok
test_err (tests.test_a.T) ... ERROR
test_fail (tests.test_a.T) ... FAIL
test_ok (tests.test_a.T) ... ok
test_skip (tests.test_a.T) ... skipped 'why'
test_xf (tests.test_a.T) ... expected failure
test_xp (tests.test_a.T) ... unexpected success

----------------------------------------------------------------------
Ran 7 tests in 0.001s

FAILED (failures=1, errors=1, skipped=1, expected failures=1, unexpected successes=1)
"""

# pytest 8 -rA: the short summary (SKIPPED names a location, not a test).
PYTEST_SUMMARY = """\
=========================== short test summary info ============================
PASSED tests/test_p.py::test_ok
PASSED tests/test_p.py::test_par[a b]
SKIPPED [1] tests/test_p.py:4: nope
XFAIL tests/test_p.py::test_xf
XPASS tests/test_p.py::test_xp
ERROR tests/test_p.py::test_err - RuntimeError: fx
FAILED tests/test_p.py::test_fail - AssertionError: boom - x
FAILED tests/test_p.py::test_par[c - d] - AssertionError: assert 'c - d' != '...
==== 2 failed, 2 passed, 1 skipped, 1 xfailed, 1 xpassed, 1 error in 1.79s =====
"""

PYTEST_VERBOSE = """\
tests/test_p.py::test_ok PASSED                                          [ 12%]
tests/test_p.py::test_fail FAILED                                        [ 25%]
tests/test_p.py::test_skip SKIPPED (nope)                                [ 37%]
tests/test_p.py::test_xf XFAIL                                           [ 50%]
tests/test_p.py::test_xp XPASS                                           [ 62%]
tests/test_p.py::test_par[a b] PASSED                                    [ 75%]
tests/test_p.py::test_par[c - d] FAILED                                  [ 87%]
tests/test_p.py::test_err ERROR                                          [100%]
"""


def test_unittest_311_form():
    expected = {"tests.test_a.T.test_doc": PASSED, "tests.test_a.T.test_err": ERROR,
                "tests.test_a.T.test_fail": FAILED, "tests.test_a.T.test_ok": PASSED,
                "tests.test_a.T.test_print": PASSED, "tests.test_a.T.test_skip": SKIPPED,
                "tests.test_a.T.test_sub": FAILED, "tests.test_a.T.test_xf": PASSED,
                "tests.test_a.T.test_xp": FAILED}
    assert parse_log("unittest", UNITTEST_311) == expected
    assert runner_finished("unittest", UNITTEST_311)


def test_unittest_older_form_gives_the_same_ids():
    tests = parse_log("unittest", UNITTEST_OLD)
    assert tests == {"tests.test_a.T.test_doc": PASSED, "tests.test_a.T.test_err": ERROR,
                     "tests.test_a.T.test_fail": FAILED, "tests.test_a.T.test_ok": PASSED,
                     "tests.test_a.T.test_skip": SKIPPED, "tests.test_a.T.test_xf": PASSED,
                     "tests.test_a.T.test_xp": FAILED}


def test_pytest_summary_and_verbose():
    summary = {"tests/test_p.py::test_ok": PASSED, "tests/test_p.py::test_par[a b]": PASSED,
               "tests/test_p.py::test_xf": PASSED, "tests/test_p.py::test_xp": FAILED,
               "tests/test_p.py::test_err": ERROR, "tests/test_p.py::test_fail": FAILED,
               "tests/test_p.py::test_par[c - d]": FAILED}
    assert parse_log("pytest", PYTEST_SUMMARY) == summary
    assert parse_log("pytest", PYTEST_VERBOSE) == {**summary,
                                                   "tests/test_p.py::test_skip": SKIPPED}
    assert parse_log("pytest", PYTEST_VERBOSE + PYTEST_SUMMARY) == parse_log("pytest",
                                                                            PYTEST_VERBOSE)
    assert runner_finished("pytest", PYTEST_SUMMARY)
    assert runner_finished("pytest", "3 passed in 0.12s\n")  # -q
    assert not runner_finished("pytest", PYTEST_VERBOSE)
    assert parse_log("pytest", "[gw1] [ 50%] PASSED tests/a.py::test_x\n") == {
        "tests/a.py::test_x": PASSED}


def test_a_test_seen_twice_keeps_its_worse_status():
    fake_then_real = ("test_x (tests.t.T.test_x) ... ok\n" + "test_x (tests.t.T.test_x) ... FAIL\n")
    real_then_fake = ("test_x (tests.t.T.test_x) ... FAIL\n" + "test_x (tests.t.T.test_x) ... ok\n")
    assert parse_log("unittest", fake_then_real) == {"tests.t.T.test_x": FAILED}
    assert parse_log("unittest", real_then_fake) == {"tests.t.T.test_x": FAILED}


def test_nothing_parsed_and_unknown_parser():
    assert parse_log("unittest", "Traceback ...\nSyntaxError: invalid syntax\n") == {}
    assert parse_log("pytest", "") == {}
    assert not runner_finished("unittest", "test_x (a.T.test_x) ... ok\n")
    with pytest.raises(ValueError, match="unknown log parser"):
        parse_log("tap", "")


# ----------------------------------------------------------------------------- verdict

F2P, P2P = ("t.A.test_fix",), ("t.A.test_old", "t.A.test_skip")
CANARIES = Canaries("t.py", must_pass="t.A.test_c1", must_fail="t.A.test_c2")


def report(outcomes, done=1, garbled=0, extra=()):
    """A supervisor's report of `outcomes` (id -> status) with the canaries as they should be."""
    records = [*outcomes.items(), ("t.A.test_c1", PASSED), ("t.A.test_c2", FAILED), *extra]
    return Report(records=tuple(records), done=done, garbled=garbled, exit_code=None)


def test_verdict_rules():
    ok = {"t.A.test_fix": PASSED, "t.A.test_old": PASSED, "t.A.test_skip": SKIPPED}
    status, reason, _, p2p = verdict(report(ok), F2P, P2P, CANARIES)
    assert (status, p2p) == ("unresolved", (1, 2)) and "t.A.test_skip (SKIPPED)" in reason
    status, reason, f2p, p2p = verdict(report(ok), F2P, P2P, CANARIES, skipped_p2p_passes=True)
    assert (status, f2p, p2p) == ("resolved", (1, 1), (2, 2))
    assert reason == "resolved: 1/1 FAIL_TO_PASS and 2/2 PASS_TO_PASS pass"
    ok = {**ok, "t.A.test_skip": PASSED}
    assert verdict(report(ok), F2P, P2P, CANARIES)[0] == "resolved"
    skipped_fix = {**ok, "t.A.test_fix": SKIPPED}  # a skipped FAIL_TO_PASS test fixed nothing
    status, reason, f2p, _ = verdict(report(skipped_fix), F2P, P2P, CANARIES,
                                     skipped_p2p_passes=True)
    assert (status, f2p) == ("unresolved", (0, 1)) and "t.A.test_fix (SKIPPED)" in reason
    missing = {"t.A.test_fix": PASSED, "t.A.test_old": PASSED}
    assert "t.A.test_skip (missing)" in verdict(report(missing), F2P, P2P, CANARIES)[1]
    assert verdict(None, F2P, P2P, CANARIES)[1].startswith(
        "no report from the grader's supervisor")
    assert "timed out after 5 s" in verdict(None, F2P, P2P, timed_out=True, timeout=5)[1]
    # Forgery shows: a must-fail canary that passed, a test reported twice, a runner that did
    # not return, lines on the channel that are not records.
    forged = Report(records=(*report(ok).records[:-1], ("t.A.test_c2", PASSED)), done=1,
                    garbled=0, exit_code=0)
    assert "canary test t.A.test_c2" in verdict(forged, F2P, P2P, CANARIES)[1]
    assert "was reported PASSED" in verdict(forged, F2P, P2P, CANARIES)[1]
    assert "was not reported" in verdict(report(ok), F2P, P2P, Canaries("t.py", "t.A.x",
                                                                        "t.A.y"))[1]
    twice = report(ok, extra=[("t.A.test_fix", PASSED)])
    assert "t.A.test_fix (2 times)" in verdict(twice, F2P, P2P, CANARIES)[1]
    assert "did not finish (0 of 1" in verdict(report(ok, done=0), F2P, P2P, CANARIES)[1]
    assert "did not finish (1 of 2" in verdict(report(ok), F2P, P2P, CANARIES, runs=2)[1]
    assert "carried 3 line(s)" in verdict(report(ok, garbled=3), F2P, P2P, CANARIES)[1]


def test_the_reporter_attaches_to_every_runner():
    command, runs = attach_reporter("python -m unittest -v")
    assert runs == 1 and command.startswith("python -c ") and command.endswith(
        " report unittest -v")
    command, runs = attach_reporter("cd src && PYTHONWARNINGS=ignore pytest -rA tests; "
                                    "/opt/env/bin/python3.9 -m pytest -x")
    assert runs == 2 and "PYTHONWARNINGS=ignore python -c " in command
    assert "/opt/env/bin/python3.9 -c " in command and command.endswith(" report pytest -x")
    with pytest.raises(ValueError, match="test_cmd './runtests.py' runs neither"):
        attach_reporter("./runtests.py")


def test_only_the_line_with_the_key_counts():
    import base64
    import hmac
    import zlib

    payload = zlib.compress(b'{"records": [["a.T.t", "PASSED"]], "done": 1, "garbled": 0, '
                            b'"exit": null}')
    key = b"k" * 32

    good = f"{testrun.MARK} {base64.b64encode(payload).decode()} " + hmac.new(
        key, payload, "sha256").hexdigest()
    forged = f"{testrun.MARK} {base64.b64encode(payload).decode()} " + "0" * 64
    found, rest = read_report(f"x\n{forged}\n{good}\ny", key)
    assert found.records == (("a.T.t", PASSED),) and rest == "x\ny"
    assert read_report(f"x\n{forged}\n", key)[0] is None
    assert read_report(f"{good}\n{good}\n", key)[0] is None  # exactly one, or none counts


# ----------------------------------------------------------------------------- check_patch


def diff(path, old="a = 1", new="a = 2", new_path=None):
    new_path = new_path or path
    return (f"diff --git a/{path} b/{new_path}\nindex 1111111..2222222 100644\n"
            f"--- a/{path}\n+++ b/{new_path}\n@@ -1 +1 @@\n-{old}\n+{new}\n")


SOURCE = diff("src/calc.py")


def test_test_paths():
    for path in ("tests/test_x.py", "pkg/tests/helpers.py", "test/data.json", "testing/util.py",
                 "pkg/test_calc.py", "pkg/calc_test.py", "pkg/calc_tests.py", "conftest.py",
                 "src/conftest.py", "a/tests/x.py", "Tests/x.py"):
        assert is_test_path(path), path
    for path in ("src/calc.py", "src/testament.py", "src/contest.py", "docs/testing.rst",
                 "src/attest/x.py", "setup.py"):
        assert not is_test_path(path), path


def test_a_clean_source_patch_is_accepted():
    assert check_patch(SOURCE) is None
    assert check_patch(SOURCE + diff("src/other.py")) is None
    assert check_patch("") is None and check_patch("\n") is None


@pytest.mark.parametrize("path", ["tests/test_calc.py", "src/tests/helper.py", "test/x.py",
                                  "testing/x.py", "src/test_calc.py", "src/calc_test.py",
                                  "src/calc_tests.py", "conftest.py", "src/conftest.py",
                                  "sitecustomize.py", "lib/usercustomize.py", "evil.pth",
                                  "src/__pycache__/calc.cpython-311.pyc", "calc.pyc"])
def test_each_forbidden_kind_is_rejected(path):
    assert path in check_patch(SOURCE + diff(path))


@pytest.mark.parametrize("path, module", [("unittest.py", "unittest"),
                                          ("pytest/__init__.py", "pytest"),
                                          ("traceback.py", "traceback"),
                                          ("_pytest/__init__.py", "_pytest")])
def test_modules_that_would_shadow_the_runner_are_rejected(path, module):
    assert f"shadow the module {module!r}" in check_patch(SOURCE + diff(path))
    renamed = (f"diff --git a/calc2.py b/{path}\nsimilarity index 100%\n"
               f"rename from calc2.py\nrename to {path}\n")
    assert f"shadow the module {module!r}" in check_patch(renamed)
    assert check_patch(diff(f"src/{path}")) is None  # below the root it shadows nothing


def test_names_are_read_wherever_a_diff_gives_them():
    rename_into_tests = ("diff --git a/src/helper.py b/tests/helper.py\nsimilarity index 100%\n"
                         "rename from src/helper.py\nrename to tests/helper.py\n")
    assert "tests/helper.py" in check_patch(rename_into_tests)
    copy_to_conftest = ("diff --git a/src/x.py b/conftest.py\nsimilarity index 100%\n"
                        "copy from src/x.py\ncopy to conftest.py\n")
    assert "conftest.py" in check_patch(copy_to_conftest)
    # A plain unified diff (what `patch` reads) that disagrees with its `diff --git` line.
    mismatched = ("diff --git a/src/calc.py b/src/calc.py\n--- a/src/calc.py\n"
                  "+++ b/tests/test_calc.py\n@@ -1 +1 @@\n-a\n+b\n")
    assert "tests/test_calc.py" in check_patch(mismatched)
    plain = "--- src/calc.py\n+++ tests/test_calc.py\t2024-01-01 00:00:00\n@@ -1 +1 @@\n-a\n+b\n"
    assert "tests/test_calc.py" in check_patch(plain)
    quoted = ('diff --git "a/tests/t\\303\\251st.py" "b/tests/t\\303\\251st.py"\n'
              'new file mode 100644\nindex 0000000..1111111\n--- /dev/null\n'
              '+++ "b/tests/t\\303\\251st.py"\n@@ -0,0 +1 @@\n+x\n')
    assert "tests/tést.py" in check_patch(quoted)
    binary = ("diff --git a/tests/data.bin b/tests/data.bin\nnew file mode 100644\n"
              "index 0000000..1111111\nGIT binary patch\nliteral 3\nKcmZ?wWB>pF0RR91\n\n"
              "literal 0\nHcmV?d00001\n\n")
    assert "tests/data.bin" in check_patch(SOURCE + binary)
    assert patch_paths(binary + SOURCE) == ["a/tests/data.bin", "b/tests/data.bin",
                                            "a/src/calc.py", "b/src/calc.py"]
    spaces = diff("src/my file.py") + diff("tests/my test.py")
    assert "tests/my test.py" in check_patch(spaces)
    index_line = "Index: tests/test_calc.py\n" + "=" * 20 + "\n" + SOURCE
    assert "tests/test_calc.py" in check_patch(index_line)


def test_a_hunk_line_that_looks_like_a_header_is_content():
    # Removed "-- x" and added "++ y" read "--- x", "+++ y": inside the hunk's counts they are
    # content; past them, they start a new file.
    sql = ("diff --git a/q.sql b/q.sql\n--- a/q.sql\n+++ b/q.sql\n@@ -1,2 +1,2 @@\n"
           "--- tests/x\n+++ tests/y\n-a\n+b\n")
    assert check_patch(sql) is None
    past_the_counts = sql.replace("@@ -1,2 +1,2 @@", "@@ -1 +1 @@").replace("-a\n+b\n", "")
    past_the_counts = past_the_counts.replace("--- tests/x\n+++ tests/y\n",
                                              "-a\n+b\n--- tests/x\n+++ tests/y\n@@ -1 +1 @@\n"
                                              "-c\n+d\n")
    assert check_patch(past_the_counts) == "the patch touches a test file: tests/x"


@pytest.mark.parametrize("text", [
    "hello, here is my fix\n" + SOURCE,  # prose before the diff
    SOURCE + "*** tests/x.py\n--- tests/x.py\n***************\n",  # a context diff after it
    "1c1\n< a\n---\n> b\n",  # a normal diff
    "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,3 @@\n-a\n+b\n",  # cut short
])
def test_unreadable_text_is_rejected(text):
    assert check_patch(text).startswith("the patch is not a unified diff this grader reads")


def test_rejected_before_any_workspace(monkeypatch):
    def no_workspace(*args, **kwargs):
        raise AssertionError("a rejected patch must not open a workspace")

    monkeypatch.setattr(grading, "open_and_run", no_workspace)
    result = grade(tiny_task_stub(), diff("tests/test_calc.py"), WorkspaceConfig())
    assert (result.status, result.resolved) == ("rejected", False)
    assert result.reason == "the patch touches a test file: a/tests/test_calc.py"


def test_a_workspace_that_cannot_be_built_is_an_error(monkeypatch):
    from sao_jax.envs.swe.workspace import WorkspaceError

    def broken(*args, **kwargs):
        raise WorkspaceError("image docker.io/x not found")

    monkeypatch.setattr(grading, "open_and_run", broken)
    result = grade(tiny_task_stub(), SOURCE, WorkspaceConfig())
    assert (result.status, result.resolved) == ("error", False)
    assert result.reason == "no workspace: WorkspaceError: image docker.io/x not found"


def tiny_task_stub(**fields):
    row = dict(instance_id="tiny__calc-1", repo="tiny/calc", base_commit="HEAD",
               problem_statement="add subtracts", patch="", test_patch="",
               fail_to_pass=("tests.test_add.TestAdd.test_add",), pass_to_pass=(),
               version="1", environment_setup_commit="HEAD", log_parser="unittest")
    return SWETask(**{**row, **fields})


# ----------------------------------------------------------------------------- Grader


def test_grader_never_runs_more_than_its_limit():
    lock, running, peak, threads = threading.Lock(), [0], [0], set()

    def fake_grade(task, patch, config, *, timeout, skipped_p2p_passes):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            threads.add(threading.get_ident())
        time.sleep(0.1)
        with lock:
            running[0] -= 1
        return GradeResult(task.instance_id, patch == "good", "resolved", "fake")

    grader = Grader(WorkspaceConfig(), max_concurrent=3, timeout=5, grade_fn=fake_grade)

    async def main():  # three at once can only happen if none blocks the event loop
        return await asyncio.gather(*(grader.grade(tiny_task_stub(instance_id=f"t{i}"), "good")
                                      for i in range(10)))

    start = time.monotonic()
    results = asyncio.run(main())
    assert peak[0] == 3 and len(threads) == 3
    assert [r.instance_id for r in results] == [f"t{i}" for i in range(10)]
    assert time.monotonic() - start >= 4 * 0.1  # ceil(10 / 3) rounds
    results = asyncio.run(main())  # the same grader on a second event loop
    assert len(results) == 10 and peak[0] == 3
    grader.close()
    with pytest.raises(ValueError, match="max_concurrent"):
        Grader(WorkspaceConfig(), max_concurrent=0)


# ----------------------------------------------------------------------------- a tiny live task

def calc_patch(task, source: str) -> str:
    return change_as_patch(task.workspace, {"calc.py": source})


# Source that prints what unittest would print for every listed test, at import time.
FAKE_LINES = ("import sys\n"
              "for _t in ('test_add (tests.test_add.TestAdd.test_add)',\n"
              "           'test_mul (tests.test_mul.TestMul.test_mul)',\n"
              "           'test_skip (tests.test_mul.TestMul.test_skip)'):\n"
              "    print(_t + ' ... ok', file=sys.stderr)\n")
FAKE_SUMMARY = "print('-' * 70 + '\\nRan 3 tests in 0.001s\\n\\nOK', file=sys.stderr)\n"


@pytest.fixture(scope="module")
def namespace_config(isolated):
    """The namespace backend (skipped, with the reason, where the sandbox cannot run)."""
    return WorkspaceConfig(backend="namespace", memory_bytes=1 << 30, cpu_seconds=60)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_task(tmp_path_factory.mktemp("tiny"))


def test_gold_resolves_and_nothing_else_does(tiny, namespace_config):
    gold = grade(tiny, tiny.patch, namespace_config, timeout=60, model_patch_name="gold")
    assert (gold.status, gold.resolved) == ("resolved", True), gold.reason + gold.log
    assert gold.reason == "resolved: 1/1 FAIL_TO_PASS and 1/1 PASS_TO_PASS pass"
    assert (gold.fail_to_pass, gold.pass_to_pass) == ((1, 1), (1, 1))
    must_pass, must_fail = gold.canaries  # planted in tests/test_add.py, class TestAdd
    assert must_pass.startswith("tests.test_add.TestAdd.test_") and must_pass != must_fail
    assert (gold.tests[must_pass], gold.tests[must_fail]) == (PASSED, FAILED)
    assert gold.tests["tests.test_add.TestAdd.test_add"] == PASSED  # read past its docstring
    assert gold.tests["tests.test_mul.TestMul.test_skip"] == SKIPPED

    for empty in ("", None):
        result = grade(tiny, empty, namespace_config, timeout=60)
        assert (result.status, result.fail_to_pass, result.pass_to_pass) == (
            "unresolved", (0, 1), (1, 1)), result.reason
        assert "tests.test_add.TestAdd.test_add (FAILED)" in result.reason

    wrong = grade(tiny, calc_patch(tiny, CALC.replace("a - b", "a * b")), namespace_config,
                  timeout=60)
    assert (wrong.status, wrong.fail_to_pass) == ("unresolved", (0, 1))

    fuzzy = tiny.patch.replace(" def mul(a, b):", " def mul(x, y):")  # git apply refuses it
    result = grade(tiny, fuzzy, namespace_config, timeout=60)
    assert result.status == "resolved", result.reason  # `patch --fuzz=5` applies it

    stale = tiny.patch.replace("-    return a - b", "-    return a // b")
    result = grade(tiny, stale, namespace_config, timeout=60)
    assert result.status == "unresolved"
    assert result.reason.startswith("model patch does not apply: "), result.reason

    broken = grade(tiny, calc_patch(tiny, "def add(:\n"), namespace_config, timeout=60)
    assert broken.status == "unresolved"  # both test modules fail to import: ERRORs parsed
    assert broken.tests and broken.fail_to_pass == (0, 1)

    # Fixing add while mul skips the test it would fail: by default that is not a pass.
    skipping = CALC.replace("a - b", "a + b").replace(
        "    return a * b", "    import unittest\n    raise unittest.SkipTest('later')")
    result = grade(tiny, calc_patch(tiny, skipping), namespace_config, timeout=60)
    assert (result.status, result.pass_to_pass) == ("unresolved", (0, 1))
    assert result.reason.endswith("not passing: tests.test_mul.TestMul.test_mul (SKIPPED)")
    result = grade(tiny, calc_patch(tiny, skipping), namespace_config, timeout=60,
                   skipped_p2p_passes=True)
    assert result.status == "resolved", result.reason

    silent = grade(tiny, calc_patch(tiny, "import os\nos._exit(3)\n"), namespace_config,
                   timeout=60)
    assert silent.status == "unresolved"
    assert silent.reason.startswith("the test runner did not finish (0 of 1 run(s) returned")


def test_the_patches_apply_in_the_first_command_and_fail_apart(tiny, namespace_config,
                                                                monkeypatch):
    """The model patch and the task's test_patch apply in the workspace's first command, with
    the read of the test module (the probe of a namespace workspace): a grading takes two
    sandboxes, and what does not apply is still told apart: the model patch (unresolved) or
    the task's test_patch (error), each with the reason and the log of its own apply."""
    import dataclasses

    from sao_jax.envs.swe import namespace

    spawned, run_program = [], namespace.run_program
    monkeypatch.setattr(namespace, "run_program",
                        lambda *args, **kwargs: spawned.append(args) or run_program(*args,
                                                                                    **kwargs))
    gold = grade(tiny, tiny.patch, namespace_config, timeout=60)
    assert gold.status == "resolved" and len(spawned) == 2
    stale = tiny.patch.replace("-    return a - b", "-    return a // b")
    broken_tests = dataclasses.replace(tiny, test_patch=(
        "--- a/tests/test_gone.py\n+++ b/tests/test_gone.py\n@@ -1 +1 @@\n-import x\n"
        "+import y\n"))
    for task, patch, status, reason in [
        (tiny, stale, "unresolved", "model patch does not apply: "),
        (broken_tests, tiny.patch, "error",
         "the task's test_patch does not apply after the model patch: "),
        (broken_tests, stale, "unresolved", "model patch does not apply: "),  # the first
        (broken_tests, "", "error", "the task's test_patch does not apply after the model "),
    ]:
        spawned.clear()
        result = grade(task, patch, namespace_config, timeout=60)
        assert (result.status, len(spawned)) == (status, 1), result.reason
        assert result.reason.startswith(reason), result.reason
        applied = "tests/test_gone.py" if status == "error" else "calc.py"
        assert result.log.startswith(f"Checking patch {applied}...\n")  # its own apply's log
        assert ">>> git apply failed; trying patch --batch --fuzz=5 -p1" in result.log
        assert result.reason.endswith(": 1 out of 1 hunk " + (
            "ignored" if status == "error" else "FAILED"))
        assert "SAO_STEP_" not in result.log and "SAO_MODULE_" not in result.log


NOT_FIXED = ("0/1 FAIL_TO_PASS and 1/1 PASS_TO_PASS pass; not passing: "
             "tests.test_add.TestAdd.test_add (FAILED)")
NOT_DONE = ("the test runner did not finish (0 of 1 run(s) returned; 0 tests reported): the "
            "test process exited or was killed before its runner returned")


def test_a_task_the_grader_cannot_run_is_an_error(tiny, namespace_config):
    import dataclasses

    no_runner = grade(dataclasses.replace(tiny, test_cmd="./runtests.py"), tiny.patch,
                      namespace_config, timeout=60)
    assert no_runner.status == "error" and "test_cmd './runtests.py' runs neither" in (
        no_runner.reason)
    elsewhere = dataclasses.replace(tiny, fail_to_pass=("tests.test_gone.TestX.test_x",),
                                    pass_to_pass=())
    missing = grade(elsewhere, tiny.patch, namespace_config, timeout=60)
    assert missing.status == "error", missing.reason
    assert missing.reason.startswith("the test module of tests.test_gone.TestX.test_x is not in "
                                     "the workspace after the test_patch (looked for "
                                     "tests/test_gone.py")


def test_pytest_tasks_by_default_command(tiny, namespace_config):
    import dataclasses

    def node(test_id):  # tests.test_add.TestAdd.test_add -> tests/test_add.py::TestAdd::test_add
        module, cls, name = test_id.rsplit(".", 2)
        return f"{module.replace('.', '/')}.py::{cls}::{name}"

    task = dataclasses.replace(tiny, log_parser="pytest", test_cmd=None,
                               fail_to_pass=tuple(map(node, tiny.fail_to_pass)),
                               pass_to_pass=tuple(map(node, tiny.pass_to_pass)))
    assert grading.default_test_cmd(task) == ("python -m pytest -rA -v -p no:cacheprovider "
                                              "tests/test_add.py tests/test_mul.py")
    gold = grade(task, task.patch, namespace_config, timeout=60)
    assert gold.status == "resolved", gold.reason + gold.log
    assert gold.tests["tests/test_mul.py::TestMul::test_skip"] == SKIPPED
    empty = grade(task, "", namespace_config, timeout=60)
    assert (empty.status, empty.fail_to_pass, empty.pass_to_pass) == ("unresolved", (0, 1),
                                                                      (1, 1))


@pytest.mark.parametrize("source, reason", [
    # Printed lines are not read: the reporter's records of the real run are.
    (CALC + FAKE_LINES, NOT_FIXED),
    (CALC + FAKE_LINES + FAKE_SUMMARY, NOT_FIXED),
    # unittest's loader reports the SystemExit as an import error: the listed tests are missing.
    (CALC + FAKE_LINES + "raise SystemExit(0)\n",
     "0/1 FAIL_TO_PASS and 0/1 PASS_TO_PASS pass; not passing: tests.test_add.TestAdd.test_add "
     "(missing), tests.test_mul.TestMul.test_mul (missing)"),
    (CALC + FAKE_LINES + "import os\nos._exit(1)\n", NOT_DONE),
    (CALC + FAKE_LINES + "import os\nos._exit(0)\n", NOT_DONE),
], ids=["real-run", "with-summary", "SystemExit", "_exit-1", "_exit-0"])
def test_printed_test_lines_do_not_resolve(tiny, namespace_config, source, reason):
    result = grade(tiny, calc_patch(tiny, source), namespace_config, timeout=60)
    assert (result.status, result.resolved, result.reason) == ("unresolved", False, reason)


def test_printing_does_not_hurt_a_real_fix(tiny, namespace_config):
    fixed = CALC.replace("a - b", "a + b") + FAKE_LINES + FAKE_SUMMARY
    result = grade(tiny, calc_patch(tiny, fixed), namespace_config, timeout=60)
    assert result.status == "resolved", result.reason


def test_extract_patch_takes_the_agents_changes_only(tiny, namespace_config):
    ws = open_workspace(tiny, namespace_config)
    try:
        edit = ("sed -i 's/a - b/a + b/' calc.py && printf 'X = 1\\n' > 'new module.py' && "
                "printf '\\000\\001\\002' > data.bin && "
                "printf 'def test_x():\\n    pass\\n' > tests/test_new.py && "
                "printf 'pass\\n' > conftest.py && mkdir -p __pycache__ && "
                "printf 'junk' > __pycache__/calc.cpython-311.pyc && git add calc.py")
        assert ws.run(edit, timeout=30).returncode == 0
        status = ws.run("git status --porcelain", timeout=30).output
        patch = extract_patch(ws)
        assert ws.run("git status --porcelain", timeout=30).output == status  # index untouched
        commit = ("git -c user.name=a -c user.email=a@a commit -q -m fix && "
                  "git status --porcelain calc.py")
        assert ws.run(commit, timeout=30).output == ""  # the agent committed its fix
        assert extract_patch(ws, base=tiny.base_commit) == patch
        assert "calc.py" not in extract_patch(ws)  # HEAD moved with the commit
        assert ws.run("rm -rf .git", timeout=30).returncode == 0
        with pytest.raises(grading.GradingError, match="taking the patch failed"):
            extract_patch(ws)
    finally:
        ws.close()
    assert patch_paths(patch) == ["a/calc.py", "b/calc.py", "a/data.bin", "b/data.bin",
                                  "a/new module.py", "b/new module.py"]
    assert "GIT binary patch" in patch and check_patch(patch) is None
    result = grade(tiny, patch, namespace_config, timeout=60)
    assert result.status == "resolved", result.reason
    with pytest.raises(ValueError, match="revision"):
        extract_patch(ws, base="--output=/tmp/x")


def test_the_same_verdicts_in_a_podman_container(tiny, image):
    """On podman (the base image of tests/envs/swe/conftest.py)."""
    import dataclasses

    task = dataclasses.replace(tiny, image=image)
    config = WorkspaceConfig(backend="podman", memory_bytes=1 << 30)
    ws = open_workspace(task, config)
    try:  # as the container's unprivileged user
        ws.run("sed -i 's/a - b/a + b/' calc.py && echo 'X = 1' > new.py", timeout=30)
        patch = extract_patch(ws)
    finally:
        ws.close()
    assert patch_paths(patch) == ["a/calc.py", "b/calc.py", "a/new.py", "b/new.py"]
    assert grade(task, patch, config, timeout=60).status == "resolved"
    assert grade(task, "", config, timeout=60).status == "unresolved"
    faked = grade(task, calc_patch(task, CALC + FAKE_LINES + "import os\nos._exit(0)\n"), config,
                  timeout=60)
    assert (faked.status, faked.reason) == ("unresolved", NOT_DONE)


def test_a_grading_cancelled_before_it_starts_never_runs():
    release, calls = threading.Event(), []

    def fake_grade(task, patch, config, *, timeout, skipped_p2p_passes):
        calls.append(task.instance_id)
        release.wait(5)
        return GradeResult(task.instance_id, False, "unresolved", "fake")

    grader = Grader(WorkspaceConfig(), max_concurrent=1, grade_fn=fake_grade)

    async def main():
        first = asyncio.ensure_future(grader.grade(tiny_task_stub(instance_id="first"), ""))
        queued = asyncio.ensure_future(grader.grade(tiny_task_stub(instance_id="queued"), ""))
        await asyncio.sleep(0.05)
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)  # the cancellation has landed
        release.set()
        return await first

    assert asyncio.run(main()).instance_id == "first"
    grader.close()
    assert calls == ["first"]


@pytest.mark.parametrize("patch, reason", [
    ("--- /dev/null\n+++ b/./json.py\n@@ -0,0 +1 @@\n+x\n", "shadow the module 'json'"),
    ("--- /dev/null\n+++ b//json.py\n@@ -0,0 +1 @@\n+x\n", "shadow the module 'json'"),
    ("--- /dev/null\n+++ b/JSON.py\n@@ -0,0 +1 @@\n+x\n", "shadow the module 'json'"),
    ("--- /dev/null\n+++ b/json.py 2024-01-01 00:00:00 +0000\n@@ -0,0 +1 @@\n+x\n",
     "shadow the module 'json'"),
    ("--- /dev/null\n+++ b/src/../json/__init__.py\n@@ -0,0 +1 @@\n+x\n", "goes up with `..`"),
    ("--- /dev/null\n+++ /etc/x.py\n@@ -0,0 +1 @@\n+x\n", "an absolute path"),
    ("--- a/.git/config\n+++ b/.git/config\n@@ -1,0 +2 @@\n+[x]\n", "git's own directory"),
    ("--- /dev/null\n+++ b/src/.GIT/hooks/x\n@@ -0,0 +1 @@\n+x\n", "git's own directory"),
    ("--- /dev/null\n+++ b/.gitattributes\n@@ -0,0 +1 @@\n+* filter=x\n", "(.gitattributes)"),
    ("--- /dev/null\n+++ b/lib/.gitmodules\n@@ -0,0 +1 @@\n+x\n", "(.gitmodules)"),
    ("diff --git a/json b/json\nnew file mode 120000\nindex 0000000..1111111\n--- /dev/null\n"
     "+++ b/json\n@@ -0,0 +1 @@\n+src\n\\ No newline at end of file\n", "symbolic link"),
    ("diff --git a/src/x b/src/x\nindex 1111111..2222222 120000\n--- a/src/x\n+++ b/src/x\n"
     "@@ -1 +1 @@\n-a\n+b\n", "symbolic link"),
    ("diff --git a/vendor b/vendor\nnew file mode 160000\nindex 0000000..1111111\n", "submodule"),
])
def test_every_spelling_of_a_forbidden_path_is_rejected(patch, reason):
    """Names as git and GNU patch read them: `./x`, `a//x`, case, a timestamp after the name
    (GNU patch and git drop it), `..`; git's files and links, which git apply refuses and GNU
    patch wrote."""
    assert reason in (check_patch(SOURCE + patch) or ""), check_patch(SOURCE + patch)


def test_git_apply_refusing_a_path_has_no_fallback(tiny, namespace_config):
    """A path git refuses is never written by GNU patch: here `.git/x`, which check_patch also
    refuses, applied directly."""
    ws = open_workspace(tiny, namespace_config)
    try:
        ok, output = grading._apply(ws, "--- /dev/null\n+++ b/.git/evil\n@@ -0,0 +1 @@\n+x\n", 60)
        assert not ok and "no fallback" in output, output
        assert ws.run("test -e .git/evil && echo there || echo absent", 30).output == "absent\n"
        # A filter that the repository's configuration names does not run when patches apply.
        ws.run("git config filter.evil.smudge 'sed s/5/6/' && "
               "echo 'tests/*.py filter=evil' > .gitattributes", 30)
        ok, output = grading._apply(ws, tiny.test_patch, 60)
        assert ok, output
        assert "add(2, 3), 5)" in ws.run("cat tests/test_add.py", 30).output
    finally:
        ws.close()


HOSTILE = ("json", "zlib", "hmac", "base64", "subprocess", "select", "signal", "unittest",
           "argparse", "difflib")


def test_nothing_in_the_repository_runs_in_the_supervisor_or_before_the_reporter(tmp_path):
    """Modules named like those the supervisor and the reporter import, at the repository's
    root: none is imported (each would leave a file behind), and the report is intact."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    for name in HOSTILE:
        (repo / f"{name}.py").write_text(
            f"open({str(tmp_path / name)!r}, 'w').close()\nraise SystemExit('hostile {name}')\n")
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "test_a.py").write_text(
        "import unittest\n\n\nclass TestA(unittest.TestCase):\n"
        "    def test_a(self):\n        self.assertEqual(1 + 1, 2)\n")
    command, runs = grading.attach_reporter("python -m unittest -v tests.test_a")
    key = os.urandom(32)
    spec = {"key": key.hex(), "root": str(repo), "command": command, "runs": runs, "write": {}}
    done = subprocess.run(["bash", "-c", grading._SUPERVISE], cwd=repo, input=json.dumps(spec),
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": os.path.dirname(sys.executable) + ":"
                               + os.environ["PATH"]})
    report, _ = grading.read_report(done.stdout, key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"], done.stderr
    assert report is not None and report.outcomes() == {"tests.test_a.TestA.test_a": "PASSED"}
