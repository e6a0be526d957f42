"""Grading a SWE patch as SWE-bench does: apply it and the task's tests in a fresh workspace, run
the tests, and take each test's outcome from a reporter inside the runner, not from the log.

    patch = extract_patch(ws)                       # the agent's changes, in its workspace
    result = grade(task, patch, WorkspaceConfig())  # -> GradeResult(resolved, status, reason, ...)
    result = await Grader(config).grade(task, patch)  # the same, off the event loop, bounded

`grade` steps (docs/swe-grading.md states the rules, the threat model and what is not
guaranteed): `patches.check_patch` (a patch that touches test infrastructure is "rejected"
before any workspace exists), a fresh workspace, the patch applied (`git apply -v`, else
`patch --batch --fuzz=5 -p1` after a dry run, as SWE-bench's harness falls back), the task's
`test_patch` applied the same way, two canary tests planted in a listed test's module
(`canaries.plant`: one must pass, one must fail), then `task.test_cmd` run under the grader's
supervisor with its reporter inside the runner (`testrun.py`). The verdict comes from the
supervisor's one line, MAC'd with a key that never enters the test process: the outcome of each
test as the runner's own result saw it, sent over a pipe, never read from the output.

Resolved means: every runner returned, every FAIL_TO_PASS and PASS_TO_PASS test was reported
exactly once and PASSED (a skipped PASS_TO_PASS test too with `skipped_p2p_passes=True`), the
must-fail canary failed and the must-pass one passed, nothing but records came down the pipe,
and none of the framework's functions the reporter watches was replaced. The test output is
kept in `GradeResult.log` for people; printed test lines, the runner's summary and the exit
status decide nothing (the test process is killed once its reports are in). A skipped
PASS_TO_PASS test does not pass by default because source code can skip the tests it would
fail, as SWE-bench's own grading now counts a skip as a failure; set the flag for tasks whose
environment skips some listed tests for reasons of its own (the gold patches show which).

The test command must run `python -m unittest`, `python -m pytest` or `pytest` (the reporter
takes their place) and the whole module of its listed tests (the canaries are there); the
gold patches with `python -m sao_jax.envs.swe.grade` show a task that does not.

`testlog.parse_log` and `testlog.runner_finished` read a runner's printed log; they decide no
verdict.

Statuses: "resolved"; "unresolved" (tests failed or missing, the patch does not apply, the test
command timed out, a forgery showed...); "rejected" (`check_patch` refused the patch); "error"
(the grader could not do its job: no workspace, the task's own test_patch does not apply, its
test_cmd starts no runner the reporter knows, its listed test's module is missing, a backend
failure).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import concurrent.futures
import dataclasses
import functools
import hmac
import json
import logging
import re
import secrets
import shlex
import subprocess
import time
import zlib
from collections.abc import Callable, Mapping

from sao_jax.envs.swe import testrun
from sao_jax.envs.swe.canaries import Canaries, module_candidates, plant
from sao_jax.envs.swe.patches import check_patch, is_bytecode, is_test_path, parse_patch
from sao_jax.envs.swe.tasks import SWETask
from sao_jax.envs.swe.testlog import PASSED, SKIPPED, worst_outcomes
from sao_jax.envs.swe.workspace import (
    CommandResult,
    Step,
    Steps,
    Workspace,
    WorkspaceConfig,
    open_and_run,
)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 1800.0  # seconds for the test command, SWE-bench's default
APPLY_TIMEOUT = 120.0
LOG_CHARS = 50_000  # GradeResult.log keeps the first fifth and the last four fifths of this

# Git inside a workspace: no hooks, no fsmonitor, no global or system configuration. In
# `extract_patch` the repository's own configuration stays (it is the workspace user's, and can
# only hurt the patch of whoever wrote it; every diff option it could change is given
# explicitly below); `_apply` uses none of it.
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
    tests: Mapping[str, str] = dataclasses.field(default_factory=dict)  # Report.outcomes()
    fail_to_pass: tuple[int, int] = (0, 0)  # (passed, listed)
    pass_to_pass: tuple[int, int] = (0, 0)
    test_exit_code: int | None = None  # None: not run, or killed (information only)
    seconds: float = 0.0
    log: str = ""  # the test output (or the failing apply's), cut to LOG_CHARS
    canaries: tuple[str, ...] = ()  # (must pass, must fail) test ids planted for this grading


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
    `patch_step` and `read_patch` are its two halves, for a caller that runs the command
    among others (`workspace.Steps`).

    Raises:
      GradingError: git failed in the workspace (the message says how), it ran out of time, or
        the patch is larger than the workspace's output limit. The workspace is the agent's, so
        this is almost always the agent's doing (it removed .git, made a million files, wrote
        a huge file): a caller may count it as the episode's failure, not the environment's.
      WorkspaceError: the backend itself failed (as from any `ws.run`).
      ValueError: `base` is not a revision name.
    """
    step = patch_step(base, timeout)
    return read_patch(ws.run(step.command, timeout=step.timeout), step)


def patch_step(base: str = "HEAD", timeout: float = 60) -> PatchStep:
    """The workspace command of `extract_patch`; `read_patch` reads its result.

    Raises:
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
    return PatchStep(script, timeout, marker=marker)


@dataclasses.dataclass(frozen=True)
class PatchStep(Step):
    """`patch_step`'s command; its output has the patch after the line `marker`."""

    marker: str = ""


def read_patch(result: CommandResult, step: PatchStep) -> str:
    """The patch in `result`, the result of `step` (a `patch_step`); see `extract_patch`.

    Raises:
      GradingError: as `extract_patch`.
    """
    if result.timed_out:
        raise GradingError(f"taking the patch timed out after {step.timeout:g} s")
    if result.truncated:
        raise GradingError("the patch is larger than the workspace's output limit")
    head, found, patch = result.output.partition(step.marker + "\n")
    if result.returncode != 0 or not found:
        raise GradingError(f"taking the patch failed (exit {result.returncode}): "
                           f"{' '.join(head.split())[-500:]}")
    try:
        sections = parse_patch(patch)
    except ValueError as e:  # git's own output: only a git bug gets here
        raise GradingError(f"git diff printed a patch this module cannot read: {e}") from None
    offsets = [0]  # where each line of patch.split("\n") starts
    for line in patch.split("\n"):
        offsets.append(offsets[-1] + len(line) + 1)
    texts = (patch[offsets[s.start]:offsets[s.end]] for s in sections
             if not any(is_test_path(p) or is_bytecode(p) for p in s.paths))
    return "".join(text if text.endswith("\n") else text + "\n" for text in texts)


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


@dataclasses.dataclass(frozen=True)
class Report:
    """What the supervisor (`testrun.py`) sent, its MAC checked: each record in arrival order."""

    records: tuple[tuple[str, str], ...]  # (test id, PASSED | FAILED | ERROR | SKIPPED)
    done: int  # runners that returned
    garbled: int  # lines on the report channel that were not records
    exit_code: int | None  # the test command's, None when the supervisor killed it
    tampered: tuple[str, ...] = ()  # framework functions the reporter found replaced
    undumpable: bool = True  # whether the supervisor's prctl(PR_SET_DUMPABLE, 0) took

    def outcomes(self) -> dict[str, str]:
        """Test id -> its worst reported outcome (`testlog.worst_outcomes`)."""
        return worst_outcomes(self.records)


_PYTHON_RUNNER = re.compile(r"(?<![\w/.-])((?:[\w./-]*/)?python[0-9.]*)\s+-m\s+(unittest|pytest)"
                            r"(?=\s|$|[;&|)])")
_BARE_PYTEST = re.compile(r"(^|[;&|(]\s*|\b(?:then|do|else)\s+)((?:\w+=\S*\s+)*)(?:py\.test|pytest)"
                          r"(?=\s|$|[;&|)])")


def attach_reporter(test_cmd: str) -> tuple[str, int]:
    """`test_cmd` with every `python -m unittest|pytest` and bare `pytest` run through the
    reporter of `testrun.py`, and how many runners it starts.

    Raises:
      ValueError: the command starts no runner that the reporter can attach to.
    """
    hole = "\0SAO_TESTRUN\0"  # the source goes in last: its own text names the runners
    command, python_runs = _PYTHON_RUNNER.subn(
        lambda m: f"{m.group(1)} -c {hole} report {m.group(2)}", test_cmd)
    command, bare_runs = _BARE_PYTEST.subn(
        lambda m: f"{m.group(1)}{m.group(2)}python -c {hole} report pytest", command)
    command = command.replace(hole, shlex.quote(_TESTRUN_SOURCE))
    if not python_runs + bare_runs:
        raise ValueError(f"test_cmd {test_cmd!r} runs neither `python -m unittest`, "
                         "`python -m pytest` nor `pytest`: the grader reads outcomes from its "
                         "own reporter inside one of those runners. Give the task a test_cmd "
                         "that runs one of them.")
    return command, python_runs + bare_runs


with open(testrun.__file__, encoding="utf-8") as _f:
    _TESTRUN_SOURCE = _f.read()  # shipped as `python -c` text, never written into a workspace
# From /, in isolated mode: nothing of the repository is on the supervisor's sys.path.
_SUPERVISE = ("cd / || exit 90\nif command -v python3 >/dev/null; then exec python3 -I -c "
              f"{shlex.quote(_TESTRUN_SOURCE)} supervise; fi\n"
              f"exec python -I -c {shlex.quote(_TESTRUN_SOURCE)} supervise\n")


def read_report(output: str, key: bytes) -> tuple[Report | None, str]:
    """The supervisor's report in `output` (None when no line carries a valid MAC) and the
    output without it."""
    found, kept = [], []
    for line in output.split("\n"):
        if not line.startswith(testrun.MARK + " "):
            kept.append(line)
            continue
        _, payload_b64, mac = (line.split(" ") + ["", ""])[:3]
        try:
            payload = base64.b64decode(payload_b64, validate=True)
        except (binascii.Error, ValueError):
            continue
        if hmac.compare_digest(hmac.new(key, payload, "sha256").hexdigest(), mac.strip()):
            found.append(json.loads(zlib.decompress(payload)))
    if len(found) != 1:
        return None, "\n".join(kept)
    data = found[0]
    return Report(records=tuple((t, o) for t, o in data["records"]), done=data["done"],
                  garbled=data["garbled"], exit_code=data["exit"],
                  tampered=tuple(data.get("tampered", ())),
                  undumpable=bool(data.get("undumpable"))), "\n".join(kept)


def verdict(report: Report | None, fail_to_pass, pass_to_pass, canaries: Canaries | None = None,
            *, runs: int = 1, timed_out: bool = False, truncated: bool = False,
            timeout: float = 0.0, skipped_p2p_passes: bool = False,
            ) -> tuple[str, str, tuple[int, int], tuple[int, int]]:
    """(status, reason, fail_to_pass counts, pass_to_pass counts) of a test run from the
    supervisor's `report`; the rules in order are in docs/swe-grading.md."""
    tests = report.outcomes() if report else {}
    f2p_ok = [t for t in fail_to_pass if tests.get(t) == PASSED]
    p2p_passing = (PASSED, SKIPPED) if skipped_p2p_passes else (PASSED,)
    p2p_ok = [t for t in pass_to_pass if tests.get(t) in p2p_passing]
    f2p, p2p = (len(f2p_ok), len(fail_to_pass)), (len(p2p_ok), len(pass_to_pass))
    counts = (f"{f2p[0]}/{f2p[1]} FAIL_TO_PASS and {p2p[0]}/{p2p[1]} PASS_TO_PASS pass")

    def unresolved(reason):
        return "unresolved", reason, f2p, p2p

    if timed_out:
        return unresolved(f"the test command timed out after {timeout:g} s")
    if truncated:
        return unresolved("the test command printed more than the output limit and was killed")
    if report is None:
        return unresolved("no report from the grader's supervisor (it was killed, or its "
                          "line was missing or forged)")
    if report.garbled:
        return unresolved(f"the report channel carried {report.garbled} line(s) that are not "
                          "the reporter's records: something in the test process wrote to it")
    if report.tampered:
        more = f" and {len(report.tampered) - 3} more" if len(report.tampered) > 3 else ""
        return unresolved(f"the test process replaced or changed {', '.join(report.tampered[:3])}"
                          f"{more} (the test framework's or its reporter's functions or state)")
    if report.done < runs:
        return unresolved(f"the test runner did not finish ({report.done} of {runs} run(s) "
                          f"returned; {len(report.records)} tests reported): the test process "
                          "exited or was killed before its runner returned")
    seen = collections.Counter(t for t, _ in report.records)
    planted = ((canaries.must_fail, "a failure"), (canaries.must_pass, PASSED)) if canaries else ()
    for test_id, want in planted:
        got = [o for t, o in report.records if t == test_id]
        if len(got) > 1 or (want != PASSED and PASSED in got):
            return unresolved(f"canary test {test_id} (planted by the grader; it must report "
                              f"{want} once) was reported {', '.join(got)}: the test process "
                              "changed how results are reported")
    twice = [f"{t} ({seen[t]} times)" for t in (*fail_to_pass, *pass_to_pass) if seen[t] > 1]
    if twice:
        return unresolved(f"tests reported more than once: {', '.join(twice[:3])}")
    bad = [f"{t} ({tests.get(t, 'missing')})" for t in fail_to_pass if t not in f2p_ok]
    bad += [f"{t} ({tests.get(t, 'missing')})" for t in pass_to_pass if t not in p2p_ok]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return unresolved(f"{counts}; not passing: {', '.join(bad[:3])}{more}")
    for test_id, want in planted:
        got = [o for t, o in report.records if t == test_id]
        if not got or (want == PASSED and got != [PASSED]):
            return unresolved(f"canary test {test_id} (planted by the grader; it must report "
                              f"{want} once) was {', '.join(got) or 'not reported'} although "
                              "every listed test passed: the test process changed or hid it, "
                              "or the task's test_cmd does not run the whole module of its "
                              "listed tests")
    return "resolved", f"resolved: {counts}", f2p, p2p


# Patches are applied by a git of its own: an empty repository made for the apply, so that no
# configuration, hook or attributes file of the workspace's repository (filters that rewrite
# files as git writes them) takes part. GNU patch is the fallback only where git failed on the
# content (hunks), never where it refused a path.
_REFUSED_PATH = "invalid path|beyond a symbolic link|is a symbolic link|has type|outside repository"


# Applies the patch on stdin at the workspace root.
_APPLY = (_GIT_ENV + 'f=$(mktemp) && g=$(mktemp -d) && cat > "$f" || exit 90\n'
          f'{_GIT} init -q --bare "$g" || exit 90\n'
          f'{_GIT} -c core.attributesFile=/dev/null --git-dir="$g" --work-tree=. '
          'apply -v "$f" 2>"$f.err"\nrc=$?\ncat "$f.err"\n'
          'if [ $rc -ne 0 ]; then\n'
          f'  if grep -qE {shlex.quote(_REFUSED_PATH)} "$f.err"; then\n'
          '    echo ">>> git apply refused a path; no fallback"; exit 97\n'
          '  fi\n'
          '  echo ">>> git apply failed; trying patch --batch --fuzz=5 -p1"\n'
          '  patch --batch --fuzz=5 -p1 --no-backup-if-mismatch --dry-run -i "$f" && '
          'patch --batch --fuzz=5 -p1 --no-backup-if-mismatch -i "$f" || exit $?\n'
          'fi\n')


def _apply(ws: Workspace, patch: str, timeout: float) -> tuple[bool, str]:
    """Applies `patch` at the workspace root in a command of its own; returns (ok, output)."""
    result = ws.run(_APPLY, timeout=timeout, input=patch)
    return result.returncode == 0, result.output


def _apply_step(patch: str) -> Step:
    """Applies `patch` (`_APPLY`) in APPLY_TIMEOUT, printing what it did only where it fails."""
    return Step(_APPLY, APPLY_TIMEOUT, input=patch, quiet=True)


def _cut(text: str, limit: int = LOG_CHARS) -> str:
    if len(text) <= limit:
        return text
    head, tail = limit // 5, limit - limit // 5
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[-tail:]}"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(">>>")]
    return lines[-1][:200] if lines else "no output"


@dataclasses.dataclass(frozen=True)
class _Probe:
    """Where the canaries go: a listed test (`anchor`), the paths its module may have, and the
    shell code that prints `marker PATH` then the first one that exists (`marker` alone when
    none does)."""

    anchor: str
    framework: str
    candidates: list[str]
    marker: str
    script: str


def _probe(task: SWETask) -> _Probe | str:
    """The probe of a listed test's module (a FAIL_TO_PASS test when there is one), or why there
    is none: an "error" reason naming the field."""
    listed = task.fail_to_pass or task.pass_to_pass
    if not listed:
        return (f"task {task.instance_id} lists no FAIL_TO_PASS or PASS_TO_PASS test: the "
                "grader needs one (its module gets the canaries)")
    framework = "pytest" if task.log_parser == "pytest" else "unittest"
    anchor = secrets.choice(list(listed))
    candidates = module_candidates(anchor, framework)
    marker = f"SAO_MODULE_{secrets.token_hex(8)}"
    script = "".join(f"if [ -f {shlex.quote(c)} ]; then echo {marker} {shlex.quote(c)}; "
                     f"cat -- {shlex.quote(c)}; exit 0; fi\n" for c in candidates)
    return _Probe(anchor, framework, candidates, marker, script + f"echo {marker}\n")


def _plant_canaries(task: SWETask, probe: _Probe, output: str) -> tuple[str, Canaries] | str:
    """The probed module with canaries planted (`canaries.plant`), or the "error" reason."""
    _, found, rest = output.partition(probe.marker + " ")
    if not found:
        return (f"the test module of {probe.anchor} is not in the workspace after the "
                f"test_patch (looked for {', '.join(probe.candidates)}): check the task's "
                f"FAIL_TO_PASS ids and log_parser ({task.log_parser!r})")
    path, _, text = rest.partition("\n")
    return plant(text, path, probe.anchor, probe.framework, passing=task.pass_to_pass,
                 failing=task.fail_to_pass)


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
    try:  # the task's own faults, before any workspace
        command, runs = attach_reporter(default_test_cmd(task))
    except ValueError as e:
        return result(False, "error", str(e), seconds=elapsed())
    probe = _probe(task)
    if isinstance(probe, str):
        return result(False, "error", probe, seconds=elapsed())
    # The workspace's first command: the patch, the test_patch, each in its own time, then the
    # module read; a step that fails ends it (`Steps`).
    model, tests = bool(patch.strip()), bool(task.test_patch.strip())
    first = Steps([*([_apply_step(patch)] if model else []),
                   *([_apply_step(task.test_patch)] if tests else []),
                   Step(probe.script, APPLY_TIMEOUT)], stop_at_failure=True)
    try:
        ws, ran = open_and_run(task, config, first.command, first.timeout, first.input)
    except _BACKEND_FAILURES as e:  # this instance's error, not the caller's
        return result(False, "error", f"no workspace: {type(e).__name__}: "
                      f"{' '.join(str(e).split())}", seconds=elapsed())
    try:
        steps = iter(first.results(ran))
        applied = next(steps) if model else None
        if applied is not None and applied.returncode != 0:
            return result(False, "unresolved", f"{model_patch_name} patch does not apply: "
                          f"{_last_line(applied.output)}", seconds=elapsed(),
                          log=_cut(applied.output))
        applied = next(steps) if tests else None
        if applied is not None and applied.returncode != 0:
            return result(False, "error", f"the task's test_patch does not apply after the "
                          f"{model_patch_name} patch: {_last_line(applied.output)}",
                          seconds=elapsed(), log=_cut(applied.output))
        planted = _plant_canaries(task, probe, next(steps).output)
        if isinstance(planted, str):
            return result(False, "error", planted, seconds=elapsed())
        text, canaries = planted
        key = secrets.token_bytes(32)
        spec = {"key": key.hex(), "root": ws.root, "command": command, "runs": runs,
                "write": {canaries.path: text}}
        ran = ws.run(_SUPERVISE, timeout=timeout, input=json.dumps(spec))
        report, output = read_report(ran.output, key)
        status, reason, f2p, p2p = verdict(
            report, task.fail_to_pass, task.pass_to_pass, canaries, runs=runs,
            timed_out=ran.timed_out, truncated=ran.truncated, timeout=timeout,
            skipped_p2p_passes=skipped_p2p_passes)
        return result(status == "resolved", status, reason, report.outcomes() if report else {},
                      f2p, p2p, report.exit_code if report else ran.returncode, elapsed(),
                      _cut(output), (canaries.must_pass, canaries.must_fail))
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
