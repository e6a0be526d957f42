"""Grading a SWE patch as SWE-bench does: apply it and the task's tests in a fresh workspace, run
the tests, read their log.

    patch = extract_patch(ws)                       # the agent's changes, in its workspace
    result = grade(task, patch, WorkspaceConfig())  # -> GradeResult(resolved, status, reason, ...)
    result = await Grader(config).grade(task, patch)  # the same, off the event loop, bounded

`grade` steps: `check_patch` (a patch that touches test infrastructure is "rejected" before any
workspace exists), a fresh workspace, the patch applied (`git apply -v`, else
`patch --batch --fuzz=5 -p1` after a dry run, as SWE-bench's harness falls back), the task's
`test_patch` applied the same way, `task.test_cmd` run, its output read by `parse_log`.

Resolved means: every FAIL_TO_PASS test PASSED, every PASS_TO_PASS test PASSED (SKIPPED too with
`skipped_p2p_passes=True`), the test command exited 0, and the runner printed its closing summary.
A skipped PASS_TO_PASS test does not pass by default because source code can skip the tests it
would fail (`raise unittest.SkipTest` or `pytest.skip()` from a function they call), as
SWE-bench's own grading now counts a skip as a failure; set the flag for tasks whose environment
skips some listed tests for reasons of its own (the gold patches show which). The last two are
what keep a
patch from winning by printing: source code the tests import can print `test_x (...) ... ok`
lines, but a real failure still prints its own line (a test reported twice keeps its worse
status), still makes the command exit nonzero, and an import-time `os._exit(0)` leaves no summary.
This is a defence against naive forgeries only: code that runs inside the test process can
rewrite the runner itself, and nothing that reads the process's output can tell.

The exit-status rule assumes the test command runs only tests that pass with the gold patch; a
task whose command also runs tests that fail either way grades its gold patch "unresolved"
("exited 1 although every listed test passed"). Give such a task a `test_cmd` that names its
listed tests; `python -m sao_jax.envs.swe.grade` with the gold patches finds them.

Statuses: "resolved"; "unresolved" (tests failed or missing, the patch does not apply, the test
command timed out...); "rejected" (`check_patch` refused the patch); "error" (the grader could not
do its job: no workspace, the task's own test_patch does not apply, a backend failure).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import re
import secrets
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from sao_jax.envs.swe.tasks import SWETask
from sao_jax.envs.swe.workspace import Workspace, WorkspaceConfig, open_workspace

log = logging.getLogger(__name__)

PASSED, FAILED, ERROR, SKIPPED = "PASSED", "FAILED", "ERROR", "SKIPPED"
_SEVERITY = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}  # a test seen twice keeps the worse

DEFAULT_TIMEOUT = 1800.0  # seconds for the test command, SWE-bench's default
APPLY_TIMEOUT = 120.0
LOG_CHARS = 50_000  # GradeResult.log keeps the first fifth and the last four fifths of this

TEST_DIRS = frozenset({"test", "tests", "testing"})
# Files Python or pytest execute without being asked: a patch may not add or change them.
STARTUP_FILES = frozenset({"conftest.py", "sitecustomize.py", "usercustomize.py"})
# Modules that a file at the repository's root would replace for `python -m unittest|pytest`
# (the working directory comes before the standard library on sys.path).
SHADOWED_MODULES = frozenset(sys.stdlib_module_names) | {"pytest", "_pytest", "pluggy", "py"}

# Git inside a workspace: no hooks, no fsmonitor, no global or system configuration. The
# repository's own configuration stays (it is the workspace user's, and can only hurt the patch
# of whoever wrote it); every diff option it could change is given explicitly below.
_GIT_ENV = ("export GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_NOSYSTEM=1 GIT_TERMINAL_PROMPT=0 "
            "GIT_OPTIONAL_LOCKS=0 LC_ALL=C\nunset GIT_DIR GIT_WORK_TREE GIT_INDEX_FILE\n")
_GIT = "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c core.untrackedCache=false"


class GradingError(RuntimeError):
    """The agent's patch could not be taken from its workspace (git failed there)."""


@dataclasses.dataclass(frozen=True)
class GradeResult:
    instance_id: str
    resolved: bool
    status: str  # resolved | unresolved | rejected | error
    reason: str  # one line: why
    tests: Mapping[str, str] = dataclasses.field(default_factory=dict)  # parse_log's reading
    fail_to_pass: tuple[int, int] = (0, 0)  # (passed, listed)
    pass_to_pass: tuple[int, int] = (0, 0)
    test_exit_code: int | None = None  # None: not run, or killed
    seconds: float = 0.0
    log: str = ""  # the test output (or the failing apply's), cut to LOG_CHARS


# ----------------------------------------------------------------------------- test paths


def is_test_path(path: str) -> bool:
    """Whether `path` (relative to the repository, or with a/ b/ prefix) is a test file.

    True for anything under (or named) `test`, `tests` or `testing`, and for files named
    `test_*.py`, `*_test.py`, `*_tests.py` or `conftest.py`; compared case-insensitively.
    """
    parts = [p.lower() for p in path.replace("\\", "/").split("/") if p]
    if not parts:
        return False
    name = parts[-1]
    return (any(p in TEST_DIRS for p in parts) or name == "conftest.py"
            or (name.startswith("test_") and name.endswith(".py"))
            or name.endswith(("_test.py", "_tests.py")))


def _is_bytecode(path: str) -> bool:
    parts = path.replace("\\", "/").split("/")
    return "__pycache__" in parts or parts[-1].endswith((".pyc", ".pyo"))


def _forbidden(path: str) -> str | None:
    """Why a patch may not touch `path`, or None."""
    name = path.replace("\\", "/").rsplit("/", 1)[-1].lower()
    if is_test_path(path):
        return "a test file"
    if name in STARTUP_FILES:
        return "a file Python runs at start-up"
    if name.endswith(".pth"):
        return "a .pth file (Python runs its import lines at start-up)"
    if _is_bytecode(path):
        return "Python bytecode"
    return None


# ----------------------------------------------------------------------------- patch parsing


class _PatchSyntaxError(ValueError):
    pass


@dataclasses.dataclass
class _Section:
    """One file's part of a diff: lines [start, end) of the patch and every name it gives."""

    start: int
    end: int = 0
    prefixed: list[str] = dataclasses.field(default_factory=list)  # a/X, b/X (-p1 strips a/)
    bare: list[str] = dataclasses.field(default_factory=list)  # rename/copy names: X
    unified: bool = False  # has its ---/+++ pair

    @property
    def paths(self) -> list[str]:
        return [p for p in self.prefixed + self.bare if p != "/dev/null"]

    def in_repository(self) -> list[str]:
        """The names as the repository's paths: without the prefix that -p1 strips."""
        return [p.split("/", 1)[1] for p in self.prefixed if "/" in p
                and p != "/dev/null"] + self.bare


_C_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_GIT_HEADER = re.compile(r"^(old mode|new mode|deleted file mode|new file mode|index|"
                         r"similarity index|dissimilarity index) ")
_RENAME_COPY = re.compile(r"^(rename|copy) (from|to) (.+)$")
_BINARY_BLOCK = re.compile(r"^(literal|delta) \d+$")


def _unquote(text: str) -> tuple[str, str]:
    """A C-quoted name at the start of `text` (as git writes unusual names) and the rest."""
    out, i = bytearray(), 1
    while i < len(text):
        ch = text[i]
        if ch == '"':
            return out.decode("utf-8", errors="replace"), text[i + 1:]
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt in _C_ESCAPES:
                out.append(_C_ESCAPES[nxt])
                i += 2
                continue
            if re.match(r"[0-7]{3}", text[i + 1:i + 4]):
                out.append(int(text[i + 1:i + 4], 8))
                i += 4
                continue
            raise _PatchSyntaxError(f"bad escape in quoted name {text[:80]!r}")
        out.extend(ch.encode("utf-8"))
        i += 1
    raise _PatchSyntaxError(f"unterminated quoted name {text[:80]!r}")


def _name(text: str) -> str:
    """The name of a ---/+++/rename/copy line's rest: unquoted, without a trailing tab part."""
    if text.startswith('"'):
        return _unquote(text)[0]
    return text.split("\t", 1)[0].rstrip("\r")


def _git_line_names(rest: str) -> list[str]:
    """The names of `diff --git A B`. Unquoted names with spaces are ambiguous: then the split
    where both sides name the same file wins, or, failing that, every split counts."""
    rest = rest.rstrip("\r")
    if rest.startswith('"'):
        first, tail = _unquote(rest)
        tail = tail.lstrip(" ")
        return [first, _unquote(tail)[0] if tail.startswith('"') else tail]
    if ' "' in rest:
        first, _, second = rest.partition(' "')
        return [first, _unquote('"' + second)[0]]
    spaces = [i for i, ch in enumerate(rest) if ch == " "]
    for i in spaces:
        a, b = rest[:i], rest[i + 1:]
        if a.partition("/")[2] == b.partition("/")[2]:
            return [a, b]
    return [half for i in spaces for half in (rest[:i], rest[i + 1:])] or [rest]


def _parse_patch(patch: str) -> list[_Section]:
    """The file sections of a git or plain unified diff, reading hunks by their line counts.

    Anything else is refused (context and normal diffs, mail headers, text between files), since
    `patch` would read file names from places this parser does not.
    """
    lines = patch.split("\n")
    sections: list[_Section] = []
    index_names: list[str] = []  # `Index: X` lines (svn), which GNU patch also reads
    i, n = 0, len(lines)

    def new_section(at):
        if sections:
            sections[-1].end = at
        sections.append(_Section(start=at, prefixed=list(index_names)))
        index_names.clear()
        return sections[-1]

    while i < n:
        line = lines[i]
        if line.startswith("diff --git "):
            section = new_section(i)
            section.prefixed += _git_line_names(line[len("diff --git "):])
            i += 1
            while i < n and (_GIT_HEADER.match(lines[i]) or _RENAME_COPY.match(lines[i])):
                moved = _RENAME_COPY.match(lines[i].rstrip("\r"))
                if moved:
                    section.bare.append(_name(moved.group(3)))
                i += 1
        elif line.startswith("--- ") and i + 1 < n and lines[i + 1].startswith("+++ "):
            if not sections or sections[-1].unified or sections[-1].end:
                new_section(i)
            section = sections[-1]
            section.unified = True
            section.prefixed += [_name(lines[i][4:]), _name(lines[i + 1][4:])]
            i += 2
            if i >= n or not lines[i].startswith("@@"):
                raise _PatchSyntaxError(f"line {i + 1}: a ---/+++ pair without a hunk")
            while i < n and lines[i].startswith("@@"):
                i = _skip_hunk(lines, i)
        elif line.startswith("GIT binary patch") and sections and not sections[-1].unified:
            i = _skip_binary(lines, i + 1)
            sections[-1].unified = True  # the file's content is given: a new section may start
        elif line.startswith("Binary files ") and sections:
            i += 1
        elif line.startswith("Index: "):
            index_names.append(_name(line[len("Index: "):]))
            i += 1
            if i < n and re.fullmatch(r"=+\r?", lines[i]):
                i += 1
        elif line.startswith("diff ") and not line.startswith("diff --git"):
            new_section(i)  # a `diff -u a b` line; its ---/+++ pair follows
            i += 1
        elif not line.strip():
            i += 1
        else:
            raise _PatchSyntaxError(f"line {i + 1} is not part of a unified diff: {line[:80]!r}")
    if sections:
        sections[-1].end = n
    if index_names:
        raise _PatchSyntaxError(f"an `Index: {index_names[0]}` line with no diff after it")
    return sections


def _skip_hunk(lines: list[str], i: int) -> int:
    match = _HUNK.match(lines[i])
    if not match:
        raise _PatchSyntaxError(f"line {i + 1}: bad hunk header {lines[i][:80]!r}")
    old = 1 if match.group(1) is None else int(match.group(1))
    new = 1 if match.group(2) is None else int(match.group(2))
    start, i = i, i + 1
    while old > 0 or new > 0:
        if i >= len(lines):
            raise _PatchSyntaxError(f"line {start + 1}: the hunk ends early")
        line = lines[i]
        first = line[:1]
        if first in (" ", "") or line == "\r":
            old, new = old - 1, new - 1
        elif first == "-":
            old -= 1
        elif first == "+":
            new -= 1
        elif first != "\\":
            raise _PatchSyntaxError(f"line {i + 1}: the hunk of line {start + 1} ends early")
        if old < 0 or new < 0:
            raise _PatchSyntaxError(f"line {i + 1}: more lines than the hunk of line "
                                    f"{start + 1} counts")
        i += 1
    while i < len(lines) and lines[i].startswith("\\"):  # "\ No newline at end of file"
        i += 1
    return i


def _skip_binary(lines: list[str], i: int) -> int:
    for block in range(2):  # forward data, then optionally the reverse
        if i >= len(lines) or not _BINARY_BLOCK.match(lines[i].rstrip("\r")):
            if block == 0:
                raise _PatchSyntaxError(f"line {i + 1}: `GIT binary patch` without data")
            return i
        i += 1
        while i < len(lines) and lines[i].strip():
            if not re.fullmatch(r"[A-Za-z][0-9A-Za-z!#$%&()*+\-;<=>?@^_`{|}~]+\r?", lines[i]):
                raise _PatchSyntaxError(f"line {i + 1}: not base85 data of a binary patch")
            i += 1
        i += 1  # the blank line after the block
    return i


def patch_paths(patch: str) -> list[str]:
    """Every file name the patch gives (both sides, renames, copies), a/ b/ prefixes kept.

    Raises:
      ValueError: the text is not a unified diff this module can read.
    """
    return list(dict.fromkeys(p for section in _parse_patch(patch) for p in section.paths))


def check_patch(patch: str) -> str | None:
    """Why the patch may not be graded, or None when it may (an empty patch may).

    Refused: a patch that names a test file (`is_test_path`), `conftest.py`, `sitecustomize.py`,
    `usercustomize.py`, a `*.pth` file or bytecode anywhere, or a module or package at the
    repository's root named like one of the standard library's or the test runner's
    (`SHADOWED_MODULES`: `python -m unittest` would import the patch's `unittest.py`), under any
    of the names a diff gives (`diff --git a/X b/Y`, `---`/`+++`, `rename`/`copy from`/`to`,
    `Index:`); and text that is not a unified diff (so that `patch` cannot find names this
    check did not read).
    """
    if not patch.strip():
        return None
    try:
        sections = _parse_patch(patch)
    except ValueError as e:
        return f"the patch is not a unified diff this grader reads: {e}"
    names = list(dict.fromkeys(p for section in sections for p in section.paths))
    if not names:
        return "the patch names no file"
    for name in names:
        why = _forbidden(name)
        if why:
            return f"the patch touches {why}: {name}"
    for name in dict.fromkeys(p for s in sections for p in s.paths + s.in_repository()):
        module = _top_level_module(name)
        if module in SHADOWED_MODULES:
            return (f"the patch adds or changes {name}, which would shadow the module "
                    f"{module!r} for the test runner (the repository's root comes first on "
                    f"sys.path)")
    return None


def _top_level_module(name: str) -> str | None:
    """The module that `name`, a path from the repository's root, defines there, if any."""
    parts = name.replace("\\", "/").split("/")
    if len(parts) == 1 and parts[0].endswith((".py", ".pyw", ".so", ".pyd")):
        return parts[0].split(".", 1)[0]
    if len(parts) >= 2 and parts[1].split(".", 1)[0] == "__init__":
        return parts[0]
    return None


# ----------------------------------------------------------------------------- extract_patch


def extract_patch(ws: Workspace, timeout: float = 60, base: str = "HEAD") -> str:
    """The agent's changes in `ws` since `base`, as a git patch (binary files included), without
    test files (`is_test_path`) and bytecode; "" when nothing changed.

    Git runs inside the workspace, as its user, on a fresh index read from HEAD (the workspace's
    own is left as it was; no stat data is trusted, so every file is hashed): `git add -A`
    (untracked files too, .gitignore respected), then
    `git diff --cached --binary --no-renames <base>` with hooks, fsmonitor, external diff and
    text conversion off and the a/ b/ prefixes forced. Pass `base=task.base_commit` where the
    workspace holds the task's history, so that changes the agent committed count too.

    Raises:
      GradingError: git failed in the workspace (the message says how), it ran out of time, or
        the patch is larger than the workspace's output limit. The workspace is the agent's, so
        this is almost always the agent's doing (it removed .git, made a million files, wrote
        a huge file): a caller may count it as the episode's failure, not the environment's.
      WorkspaceError: the backend itself failed (as from any `ws.run`).
      ValueError: `base` is not a revision name.
    """
    if not re.fullmatch(r"[\w./^~@{}-]+", base) or base.startswith("-"):
        raise ValueError(f"base must be a git revision, got {base!r}")
    marker = f"SAO_PATCH_{secrets.token_hex(8)}"
    exclude = "':(exclude,glob)**/__pycache__/**' ':(exclude,glob)**/*.py[co]'"
    script = (
        _GIT_ENV +
        't=$(mktemp -d) || exit 90\ntrap \'rm -rf "$t"\' EXIT\n'
        f'{_GIT} rev-parse --git-dir >/dev/null 2>"$t/err" || '
        '{ echo "git rev-parse failed:"; cat "$t/err"; exit 91; }\n'
        'export GIT_INDEX_FILE="$t/index"\n'
        # A fresh index with no stat data: `add -A` then hashes every file rather than trusting
        # timestamps (a copied index missed same-size edits whose stat data matched its entries).
        f'{_GIT} read-tree HEAD 2>"$t/err" || '
        '{ echo "git read-tree failed:"; cat "$t/err"; exit 92; }\n'
        f'{_GIT} add -A -- . {exclude} >/dev/null 2>"$t/err" || '
        '{ echo "git add -A failed:"; cat "$t/err"; exit 93; }\n'
        f'{_GIT} diff --cached --binary --no-color --no-ext-diff --no-textconv --no-renames '
        f'--src-prefix=a/ --dst-prefix=b/ {shlex.quote(base)} -- >"$t/patch" 2>"$t/err" || '
        '{ echo "git diff failed:"; cat "$t/err"; exit 94; }\n'
        f'echo {marker}\ncat "$t/patch"\n')
    result = ws.run(script, timeout=timeout)
    if result.timed_out:
        raise GradingError(f"taking the patch timed out after {timeout:g} s")
    if result.truncated:
        raise GradingError("the patch is larger than the workspace's output limit")
    head, found, patch = result.output.partition(marker + "\n")
    if result.returncode != 0 or not found:
        raise GradingError(f"taking the patch failed (exit {result.returncode}): "
                           f"{' '.join(head.split())[-500:]}")
    try:
        sections = _parse_patch(patch)
    except ValueError as e:  # git's own output: only a git bug gets here
        raise GradingError(f"git diff printed a patch this module cannot read: {e}") from None
    offsets = [0]  # where each line of patch.split("\n") starts
    for line in patch.split("\n"):
        offsets.append(offsets[-1] + len(line) + 1)
    texts = (patch[offsets[s.start]:offsets[s.end]] for s in sections
             if not any(is_test_path(p) or _is_bytecode(p) for p in s.paths))
    return "".join(text if text.endswith("\n") else text + "\n" for text in texts)


# ----------------------------------------------------------------------------- parse_log

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
    tests: dict[str, str] = {}
    for test_id, status in found:
        if _SEVERITY[status] >= _SEVERITY.get(tests.get(test_id, PASSED), 0):
            tests[test_id] = status
    return tests


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


# ----------------------------------------------------------------------------- grade


def default_test_cmd(task: SWETask) -> str:
    """`task.test_cmd`, or the log parser's default: `python -m unittest -v`, or pytest on the
    files of the listed tests, `-rA` for the summary and `-v` for a line per test (the summary
    names a skipped test only by its file and line)."""
    if task.test_cmd:
        return task.test_cmd
    if task.log_parser == "unittest":
        return "python -m unittest -v"
    files = dict.fromkeys(t.split("::", 1)[0] for t in task.fail_to_pass + task.pass_to_pass
                          if "::" in t)
    return " ".join(["python -m pytest -rA -v -p no:cacheprovider", *map(shlex.quote, files)])


def verdict(tests: Mapping[str, str], fail_to_pass, pass_to_pass, *, exit_code: int | None,
            finished: bool, timed_out: bool = False, truncated: bool = False,
            timeout: float = 0.0, skipped_p2p_passes: bool = False,
            ) -> tuple[str, str, tuple[int, int], tuple[int, int]]:
    """(status, reason, fail_to_pass counts, pass_to_pass counts) of a test run; see the
    module docstring for the rule and for `skipped_p2p_passes`."""
    f2p_ok = [t for t in fail_to_pass if tests.get(t) == PASSED]
    p2p_passing = (PASSED, SKIPPED) if skipped_p2p_passes else (PASSED,)
    p2p_ok = [t for t in pass_to_pass if tests.get(t) in p2p_passing]
    f2p, p2p = (len(f2p_ok), len(fail_to_pass)), (len(p2p_ok), len(pass_to_pass))
    counts = (f"{f2p[0]}/{f2p[1]} FAIL_TO_PASS and {p2p[0]}/{p2p[1]} PASS_TO_PASS pass")
    if timed_out:
        return "unresolved", f"the test command timed out after {timeout:g} s", f2p, p2p
    if truncated:
        return ("unresolved", "the test command printed more than the output limit and was "
                "killed", f2p, p2p)
    if not tests:
        return ("unresolved", f"nothing parsed from the test output (exit status {exit_code})",
                f2p, p2p)
    bad = [f"{t} ({tests.get(t, 'missing')})" for t in fail_to_pass if t not in f2p_ok]
    bad += [f"{t} ({tests.get(t, 'missing')})" for t in pass_to_pass if t not in p2p_ok]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return "unresolved", f"{counts}; not passing: {', '.join(bad[:3])}{more}", f2p, p2p
    if exit_code != 0:
        return ("unresolved", f"the test command exited {exit_code} although every listed test "
                "passed", f2p, p2p)
    if not finished:
        return ("unresolved", "every listed test passed but the runner printed no closing "
                "summary (it was cut short)", f2p, p2p)
    return "resolved", f"resolved: {counts}", f2p, p2p


def _apply(ws: Workspace, patch: str, timeout: float):
    """Applies `patch` at the workspace root; returns (ok, output)."""
    script = (_GIT_ENV + 'f=$(mktemp) && cat > "$f" || exit 90\n'
              f'if {_GIT} apply -v "$f"; then exit 0; fi\n'
              'echo ">>> git apply failed; trying patch --batch --fuzz=5 -p1"\n'
              'patch --batch --fuzz=5 -p1 --no-backup-if-mismatch --dry-run -i "$f" && '
              'patch --batch --fuzz=5 -p1 --no-backup-if-mismatch -i "$f"\n')
    result = ws.run(script, timeout=timeout, input=patch)
    return result.returncode == 0, result.output


def _cut(text: str, limit: int = LOG_CHARS) -> str:
    if len(text) <= limit:
        return text
    head, tail = limit // 5, limit - limit // 5
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[-tail:]}"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(">>>")]
    return lines[-1][:200] if lines else "no output"


# What a backend raises when it cannot make or drive a workspace (WorkspaceError, the sandbox's
# SandboxUnavailable, a runtime's CLI that is missing or hangs).
_BACKEND_FAILURES = (RuntimeError, OSError, subprocess.SubprocessError)


def grade(task: SWETask, patch: str | None, config: WorkspaceConfig, *,
          timeout: float = DEFAULT_TIMEOUT, model_patch_name: str = "model",
          skipped_p2p_passes: bool = False) -> GradeResult:
    """Grades `patch` on `task` in a fresh workspace; never raises for the workspace's sake.

    Args:
      task: the instance; its `test_patch` is applied after `patch`, then `default_test_cmd`.
      patch: the model's patch (git or unified diff); None or "" applies as nothing.
      config: how the workspace is made (backend, limits).
      timeout: seconds for the test command (applying each patch gets APPLY_TIMEOUT).
      model_patch_name: what reasons call the patch ("model", "gold", ...).
      skipped_p2p_passes: whether a SKIPPED PASS_TO_PASS test counts as passing (module
        docstring).
    Returns:
      a GradeResult; status "error" when no workspace could be made or used (its reason says
      why: a `WorkspaceError`, or whatever else the backend raised).
    """
    start = time.monotonic()
    patch = patch or ""
    result = functools.partial(GradeResult, task.instance_id)

    def elapsed():
        return time.monotonic() - start

    rejected = check_patch(patch)
    if rejected:
        return result(False, "rejected", rejected, seconds=elapsed())
    try:
        ws = open_workspace(task, config)
    except _BACKEND_FAILURES as e:  # this instance's error, not the caller's
        return result(False, "error", f"no workspace: {type(e).__name__}: "
                      f"{' '.join(str(e).split())}", seconds=elapsed())
    try:
        if patch.strip():
            ok, output = _apply(ws, patch, APPLY_TIMEOUT)
            if not ok:
                return result(False, "unresolved", f"{model_patch_name} patch does not apply: "
                              f"{_last_line(output)}", seconds=elapsed(), log=_cut(output))
        if task.test_patch.strip():
            ok, output = _apply(ws, task.test_patch, APPLY_TIMEOUT)
            if not ok:
                return result(False, "error", f"the task's test_patch does not apply after the "
                              f"{model_patch_name} patch: {_last_line(output)}",
                              seconds=elapsed(), log=_cut(output))
        ran = ws.run(default_test_cmd(task), timeout=timeout)
        tests = parse_log(task.log_parser, ran.output)
        status, reason, f2p, p2p = verdict(
            tests, task.fail_to_pass, task.pass_to_pass, exit_code=ran.returncode,
            finished=runner_finished(task.log_parser, ran.output), timed_out=ran.timed_out,
            truncated=ran.truncated, timeout=timeout, skipped_p2p_passes=skipped_p2p_passes)
        return result(status == "resolved", status, reason, tests, f2p, p2p, ran.returncode,
                      elapsed(), _cut(ran.output))
    except _BACKEND_FAILURES as e:  # the backend failed mid-way: an error, with what it said
        return result(False, "error", f"workspace failed: {type(e).__name__}: "
                      f"{' '.join(str(e).split())}", seconds=elapsed())
    finally:
        try:
            ws.close()
        except _BACKEND_FAILURES as e:  # the verdict stands; the leak is the backend's to report
            log.warning("grading %s: closing the workspace failed: %s", task.instance_id, e)


class Grader:
    """Grades off the event loop, at most `max_concurrent` at a time, for any number of loops.

    `await grader.grade(task, patch)` runs `grade` in one of `max_concurrent` threads of the
    grader's own pool: a bounded pool rather than an asyncio.Semaphore because one grader serves
    every episode of a worker process (`options.grader`), whichever event loop they run on, and
    a semaphore binds to the first loop that waits on it. Gradings beyond the limit queue; one
    whose caller was cancelled before it started is dropped.
    """

    def __init__(self, config: WorkspaceConfig, max_concurrent: int = 2,
                 timeout: float = DEFAULT_TIMEOUT, *, skipped_p2p_passes: bool = False,
                 grade_fn: Callable[..., GradeResult] = grade):
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {max_concurrent}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.config, self.max_concurrent, self.timeout = config, max_concurrent, timeout
        self.skipped_p2p_passes = skipped_p2p_passes
        self._grade_fn = grade_fn
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrent,
                                                           thread_name_prefix="sao-grade")

    async def grade(self, task: SWETask, patch: str | None) -> GradeResult:
        call = functools.partial(self._grade_fn, task, patch, self.config, timeout=self.timeout,
                                 skipped_p2p_passes=self.skipped_p2p_passes)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def close(self) -> None:
        """Drops queued gradings; running ones finish in their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
