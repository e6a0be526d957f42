"""Test outcomes, and reading them from a test runner's printed log.

`parse_log` and `runner_finished` read what pytest or unittest printed. The grader decides no
verdict from them (`grading.py` takes each outcome from its reporter inside the runner:
docs/swe-grading.md); they read logs for people and for tests that compare the two readings.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

PASSED, FAILED, ERROR, SKIPPED = "PASSED", "FAILED", "ERROR", "SKIPPED"
_SEVERITY = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}  # a test seen twice keeps the worse


def worst_outcomes(found: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Test id -> its worst outcome among `found`'s `(test id, outcome)` pairs, ERROR > FAILED >
    SKIPPED > PASSED: a test reported more than once keeps the worst."""
    tests: dict[str, str] = {}
    for test_id, status in found:
        if _SEVERITY[status] >= _SEVERITY.get(tests.get(test_id, PASSED), 0):
            tests[test_id] = status
    return tests


_PYTEST_STATUS = {"PASSED": PASSED, "FAILED": FAILED, "ERROR": ERROR, "SKIPPED": SKIPPED,
                  "XFAIL": PASSED, "XPASS": FAILED}
_PYTEST_SUMMARY = re.compile(r"^(?:\[gw\d+\] \[ *\d+%\] )?(PASSED|FAILED|ERROR|SKIPPED|XFAIL|"
                             r"XPASS) (.+)$")
_PYTEST_VERBOSE = re.compile(r"^(\S.*?::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
                             r"(?: .*)?$")
_UNITTEST_HEAD = re.compile(r"^\s*([\w.]+) \(([\w.]+)\)(?: \(.*\))?(?: \.\.\. ?(.*))?$")
_UNITTEST_RESULTS = (("ok", PASSED), ("FAIL", FAILED), ("ERROR", ERROR),
                     ("skipped", SKIPPED), ("expected failure", PASSED),
                     ("unexpected success", FAILED))


def parse_log(parser: str, text: str) -> dict[str, str]:
    """Test id -> "PASSED" | "FAILED" | "ERROR" | "SKIPPED", read from a test command's output.

    `pytest`: the `-rA` short summary (`PASSED tests/a.py::test_x`, `FAILED tests/a.py::test_y -
    msg`, `ERROR ...`; `SKIPPED [1] tests/a.py:3: why` names no test and is not read) and verbose
    lines (`tests/a.py::test_x PASSED [ 50%]`, xdist's `[gw0] [ 50%] PASSED ...`); ids are node
    ids. `unittest`: verbose lines `test_x (tests.test_m.T.test_x) ... ok` (Python 3.11+) or
    `test_x (tests.test_m.T) ... ok` (older), a docstring's first line on the line after the
    name, a result on a later line when the test printed, failing subtests (`  test_x (...)
    (i=1) ... FAIL`); ids are `TestCase.id()`, `tests.test_m.T.test_x`.

    Expected outcomes as the runners count them: an expected failure (pytest XFAIL, unittest
    "expected failure") is PASSED, an unexpected success (XPASS, "unexpected success") FAILED,
    as SWE-bench's grading reads them. A test reported more than once keeps its worst status
    (ERROR > FAILED > SKIPPED > PASSED), so a printed "ok" cannot hide a real failure.
    """
    if parser == "pytest":
        found = _parse_pytest(text)
    elif parser == "unittest":
        found = _parse_unittest(text)
    else:
        raise ValueError(f"unknown log parser {parser!r}; known: pytest, unittest")
    return worst_outcomes(found)


def _parse_pytest(text: str):
    for line in text.splitlines():
        line = line.rstrip()
        summary = _PYTEST_SUMMARY.match(line)
        if summary:
            status, rest = summary.groups()
            if rest.startswith("["):  # SKIPPED [1] path:line: reason
                continue
            yield _pytest_id(rest), _PYTEST_STATUS[status]
            continue
        verbose = _PYTEST_VERBOSE.match(line)
        if verbose:
            yield verbose.group(1), _PYTEST_STATUS[verbose.group(2)]


def _pytest_id(rest: str) -> str:
    """The node id at the start of a summary line's rest: up to ` - message`, outside [...]."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(depth - 1, 0)
        elif depth == 0 and rest.startswith(" - ", i):
            return rest[:i]
    return rest.strip()


def _unittest_result(text: str) -> str | None:
    text = re.sub(r" \(\d+(?:\.\d+)?s\)$", "", text.strip())  # --durations adds the time
    for word, status in _UNITTEST_RESULTS:
        if text == word or (word == "skipped" and text.startswith("skipped ")):
            return status
    return None


def _parse_unittest(text: str):
    pending = None  # the test whose description was printed and whose result was not yet
    docstring = False  # the line after a bare name may be the docstring's first line
    for line in text.splitlines():
        line = line.rstrip("\r")
        head = _UNITTEST_HEAD.match(line)
        if head:
            method, where, result = head.groups()
            test_id = where if where.endswith("." + method) else f"{where}.{method}"
            status = _unittest_result(result) if result else None
            if status:
                yield test_id, status
                pending, docstring = None, False
            else:
                pending, docstring = test_id, result is None
            continue
        if pending is None:
            continue
        if docstring and " ... " in line + " ":
            status = _unittest_result(line.rpartition(" ...")[2])
            docstring = False
        else:
            status = _unittest_result(line)
            docstring = False
        if status:
            yield pending, status
            pending = None


_SUMMARY = {
    "unittest": re.compile(r"^Ran \d+ tests? in \d+(?:\.\d+)?s$[\s\S]*^(?:OK|FAILED|NO TESTS RAN)"
                           r"\b", re.M),
    "pytest": re.compile(r"^(?:=+ )?(?:no tests ran|\d+ \w+)(?:, \d+ \w+)* in \d+(?:\.\d+)?s"
                         r"(?: \([^)]*\))?(?: =+)?$", re.M),
}


def runner_finished(parser: str, text: str) -> bool:
    """Whether the runner's closing summary is in the output (`Ran N tests in Xs` then `OK` or
    `FAILED (...)`; pytest's `=== 3 passed in 0.12s ===`)."""
    return bool(_SUMMARY[parser].search(text))
