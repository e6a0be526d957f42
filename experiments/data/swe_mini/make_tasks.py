"""Builds swe_mini: SWE-smith-style bug-fix tasks on `library/` (minilib), with a git bundle.

    .venv/bin/python experiments/data/swe_mini/make_tasks.py

Steps, all deterministic under SEED:
  1. Enumerate candidate bugs: every site of every mutation kind (`KINDS`) inside the functions and
     methods of library/minilib/*.py, one mutation per candidate. Each is a small text edit of the
     pristine source (an operator token, a constant, two swapped arguments, deleted lines, an
     inserted `not`), checked with `ast`: the edited file must parse to exactly the mutated tree.
  2. Run the library's unittest suite on each mutated copy (a subprocess in a temp dir with a
     timeout) and collect every test's outcome by `TestCase.id()`. Keep the candidates with at
     least one FAIL_TO_PASS test (fails or errors with the bug, passes without) and one
     PASS_TO_PASS test; drop duplicates (the same buggy file, or the same function failing the
     same tests).
  3. Pick N_TASKS of them round-robin over (module, kind) groups, each group shuffled with SEED,
     at most MAX_PER_FUNCTION per function. For each, write an issue-like problem statement from
     the failing behaviour: the failing tests are run again with the module's public functions
     and methods wrapped to record their calls; one recorded call whose result differs between
     the buggy and the pristine library is shown (actual vs expected, both obtained by running
     it), with a failing test's assertion message. A candidate without such a call is skipped.
  4. Build one git repository: the pristine library (`environment_setup_commit`) and, per task, one
     commit on top of it with the buggy source and without the test modules that hold a
     FAIL_TO_PASS test (`base_commit`, branch named after the instance id). `test_patch` adds those
     modules back; `patch` (gold) restores the source. Fixed names, e-mails and dates and a clean
     git configuration make every commit hash reproducible.
  5. Validate every task from the bundle as a user gets it: clone, check out base_commit, apply
     test_patch, run `python -m unittest -v`: each FAIL_TO_PASS test fails and each PASS_TO_PASS
     test passes; apply the gold patch as well: all of them pass.
  6. Only then write tasks.jsonl and repo.bundle next to this file, and print a summary.
"""

from __future__ import annotations

import ast
import collections
import concurrent.futures
import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARY = os.path.join(HERE, "library")
PACKAGE = "minilib"
SEED = 20260101
N_TASKS = 50
MAX_PER_FUNCTION = 2
TEST_TIMEOUT_S = 5
REPO = "sao-jax/swe-mini"
VERSION = "0.1"
TEST_CMD = "python -m unittest -v"
GIT_DATE = "2026-01-01T00:00:00+0000"
PASSED = "pass"
FAILED = ("fail", "error")

# ---------------------------------------------------------------------------------------------
# Mutations: each kind finds its sites in a module's tree; `mutate` applies the site-th one.
# ---------------------------------------------------------------------------------------------

COMPARE_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
                ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
                ast.Is: ast.IsNot, ast.IsNot: ast.Is}
ARITH_FLIP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.Div: ast.FloorDiv,
              ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult}
OP_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
           ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not", ast.Add: "+",
           ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
           ast.Pow: "**", ast.And: "and", ast.Or: "or"}
DROPPABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Raise, ast.Return,
             ast.Continue, ast.Break)
KINDS = ("flip_compare", "flip_arith", "flip_boolop", "negate_condition", "off_by_one",
         "flip_bool", "swap_args", "drop_branch", "drop_statement")


@dataclasses.dataclass(frozen=True)
class Candidate:
    module: str  # "text" for minilib/text.py
    kind: str
    site: int  # index among `kind`'s sites in the module
    function: str  # qualified name of the function holding the site, e.g. "Interval.overlaps"
    line: int
    description: str
    source: str  # the whole mutated module

    @property
    def key(self) -> str:
        return f"{self.module}:{self.kind}:{self.site}"


def _functions(tree: ast.Module):
    """(qualname, function node) of every top-level function and method, in source order."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield f"{node.name}.{item.name}", item


def _is_docstring(node: ast.AST) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def _body_nodes(tree: ast.Module):
    """(qualname, node) for every node of every function body (no signature, no docstring)."""
    for qualname, func in _functions(tree):
        for stmt in func.body:
            if _is_docstring(stmt):
                continue
            for node in ast.walk(stmt):
                yield qualname, node


def _statement_lists(tree: ast.Module):
    """(qualname, owner node, list of statements) for every block inside every function."""
    for qualname, func in _functions(tree):
        for node in ast.walk(func):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    yield qualname, node, block


def _sites(tree: ast.Module, source_lines: list[str], kind: str) -> list[tuple]:
    """Every site of `kind`, as (qualname, ...node refs...), in a fixed order."""
    sites = []
    if kind == "flip_compare":
        for q, node in _body_nodes(tree):
            if isinstance(node, ast.Compare):
                sites += [(q, node, i) for i, op in enumerate(node.ops)
                          if type(op) in COMPARE_FLIP]
    elif kind == "flip_arith":
        for q, node in _body_nodes(tree):
            if isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in ARITH_FLIP:
                operands = (node.left, node.right) if isinstance(node, ast.BinOp) else (
                    node.target, node.value)
                if not any(isinstance(x, ast.JoinedStr) or (isinstance(x, ast.Constant)
                                                            and isinstance(x.value, str))
                           for x in operands):  # string concatenation is not arithmetic
                    sites.append((q, node))
    elif kind == "flip_boolop":
        sites = [(q, node) for q, node in _body_nodes(tree) if isinstance(node, ast.BoolOp)]
    elif kind == "negate_condition":
        sites = [(q, node) for q, node in _body_nodes(tree)
                 if isinstance(node, ast.If | ast.While | ast.IfExp)]
    elif kind == "off_by_one":
        sites = [(q, node) for q, node in _body_nodes(tree)
                 if isinstance(node, ast.Constant) and type(node.value) is int]
    elif kind == "flip_bool":
        sites = [(q, node) for q, node in _body_nodes(tree)
                 if isinstance(node, ast.Constant) and type(node.value) is bool]
    elif kind == "swap_args":
        for q, node in _body_nodes(tree):
            if (isinstance(node, ast.Call) and len(node.args) >= 2
                    and not any(isinstance(a, ast.Starred) for a in node.args[:2])
                    and ast.dump(node.args[0]) != ast.dump(node.args[1])):
                sites.append((q, node))
    elif kind == "drop_branch":
        for q, owner, block in _statement_lists(tree):
            for i, stmt in enumerate(block):
                if not isinstance(stmt, ast.If):
                    continue
                if not stmt.orelse and len(block) >= 2:
                    sites.append((q, owner, block, i, "if"))
                if (len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If)
                        and source_lines[stmt.orelse[0].lineno - 1].lstrip().startswith("elif")):
                    sites.append((q, owner, block, i, "elif"))
    elif kind == "drop_statement":
        for q, owner, block in _statement_lists(tree):
            for i, stmt in enumerate(block):
                if isinstance(stmt, DROPPABLE) and not _is_docstring(stmt) and len(block) >= 2:
                    sites.append((q, owner, block, i))
    else:
        raise ValueError(f"unknown mutation kind {kind!r}; known: {KINDS}")
    return sites


class _Text:
    """The module's source with (line, col) -> offset conversion (the library is ASCII)."""

    def __init__(self, source: str):
        self.source = source
        self.starts = [0]
        for line in source.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def at(self, line: int, col: int = 0) -> int:
        return self.starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.at(node.lineno, node.col_offset), self.at(node.end_lineno, node.end_col_offset)

    def lines(self, first: int, last: int) -> tuple[int, int]:
        """The span of whole lines first..last (1-based, inclusive)."""
        return self.at(first), self.at(last + 1)

    def edit(self, start: int, end: int, new: str) -> str:
        return self.source[:start] + new + self.source[end:]


def _replace_op(text: _Text, left: ast.AST, right: ast.AST, old: type, new: type) -> str:
    """The source with the operator token between `left` and `right` replaced."""
    start, end = text.span(left)[1], text.span(right)[0]
    gap = text.source[start:end]
    pattern = r"\s+".join(rf"\b{w}\b" if w.isalpha() else re.escape(w)
                          for w in OP_TEXT[old].split())
    new_gap, n = re.subn(pattern, OP_TEXT[new], gap, count=1)
    if n != 1:
        return ""
    return text.edit(start, end, new_gap)


def _negated(text: _Text, test: ast.expr) -> tuple[ast.expr, str]:
    segment = text.source[slice(*text.span(test))]
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        operand = text.source[slice(*text.span(test.operand))]
        if isinstance(test.operand, ast.BoolOp | ast.IfExp | ast.Lambda | ast.NamedExpr):
            operand = f"({operand})"
        return test.operand, operand
    simple = (ast.Compare, ast.Call, ast.Name, ast.Attribute, ast.Subscript, ast.Constant)
    return (ast.UnaryOp(op=ast.Not(), operand=test),
            f"not {segment}" if isinstance(test, simple) else f"not ({segment})")


def _apply(tree: ast.Module, text: _Text, kind: str, site: tuple, rng: random.Random):
    """Mutates `tree` at `site` in place; returns (new source, description) or None."""
    source = text.source
    if kind == "flip_compare":
        _, node, i = site
        old = type(node.ops[i])
        node.ops[i] = COMPARE_FLIP[old]()
        left = node.left if i == 0 else node.comparators[i - 1]
        new = _replace_op(text, left, node.comparators[i], old, COMPARE_FLIP[old])
        return new, f"`{OP_TEXT[old]}` -> `{OP_TEXT[COMPARE_FLIP[old]]}`"
    if kind == "flip_arith":
        _, node = site
        old = type(node.op)
        node.op = ARITH_FLIP[old]()
        left, right = (node.left, node.right) if isinstance(node, ast.BinOp) else (
            node.target, node.value)
        new = _replace_op(text, left, right, old, ARITH_FLIP[old])
        return new, f"`{OP_TEXT[old]}` -> `{OP_TEXT[ARITH_FLIP[old]]}`"
    if kind == "flip_boolop":
        _, node = site
        old = type(node.op)
        flipped = ast.Or if old is ast.And else ast.And
        node.op = flipped()
        new = source
        for left, right in reversed(list(zip(node.values, node.values[1:], strict=False))):
            new = _replace_op(_Text(new), left, right, old, flipped)
            if not new:
                return None
        return new, f"`{OP_TEXT[old]}` -> `{OP_TEXT[flipped]}`"
    if kind == "negate_condition":
        _, node = site
        start, end = text.span(node.test)
        node.test, replacement = _negated(text, node.test)
        return text.edit(start, end, replacement), "condition negated"
    if kind == "off_by_one":
        _, node = site
        delta = 1 if node.value == 0 else rng.choice((1, -1))
        old, node.value = node.value, node.value + delta
        return text.edit(*text.span(node), repr(node.value)), f"`{old}` -> `{node.value}`"
    if kind == "flip_bool":
        _, node = site
        node.value = not node.value
        new = text.edit(*text.span(node), repr(node.value))
        return new, f"`{not node.value}` -> `{node.value}`"
    if kind == "swap_args":
        _, node = site
        a, b = node.args[0], node.args[1]
        (a0, a1), (b0, b1) = text.span(a), text.span(b)
        node.args[0], node.args[1] = b, a
        new = text.edit(a0, b1, source[b0:b1] + source[a1:b0] + source[a0:a1])
        return new, "first two arguments swapped"
    if kind == "drop_branch":
        _, owner, block, i, what = site
        stmt = block[i]
        if what == "if":
            del block[i]
            return text.edit(*text.lines(stmt.lineno, stmt.end_lineno), ""), "`if` block removed"
        branch = stmt.orelse[0]
        if not branch.orelse:
            last = branch.end_lineno
        elif source.splitlines()[branch.orelse[0].lineno - 1].lstrip().startswith("elif"):
            last = branch.orelse[0].lineno - 1
        else:
            lines = source.splitlines()
            last = next((n for n in range(branch.body[-1].end_lineno + 1, branch.orelse[0].lineno)
                         if lines[n - 1].lstrip().startswith("else")), 0) - 1
            if last < 0:
                return None
        stmt.orelse = branch.orelse
        return text.edit(*text.lines(branch.lineno, last), ""), "`elif` branch removed"
    if kind == "drop_statement":
        _, owner, block, i = site
        stmt = block.pop(i)
        return (text.edit(*text.lines(stmt.lineno, stmt.end_lineno), ""),
                f"`{type(stmt).__name__.lower()}` statement removed")
    raise ValueError(f"unknown mutation kind {kind!r}")


def mutate(source: str, module: str, kind: str, site: int) -> Candidate | None:
    """The `site`-th mutation of `kind` in `source`, or None when its edit is not exactly the
    mutated tree (the operator precedence or layout would change more than intended)."""
    tree = ast.parse(source)
    text = _Text(source)
    sites = _sites(tree, source.splitlines(), kind)
    found = sites[site]
    qualname = found[0]
    node = found[1] if kind not in ("drop_branch", "drop_statement") else found[2][found[3]]
    line = node.lineno
    if kind == "drop_branch" and found[4] == "elif":
        line = node.orelse[0].lineno
    rng = random.Random(f"{SEED}/{module}/{kind}/{site}")
    result = _apply(tree, text, kind, found, rng)
    if not result or not result[0] or result[0] == source:
        return None
    new_source, what = result
    try:
        if ast.dump(ast.parse(new_source)) != ast.dump(tree):
            return None
    except SyntaxError:
        return None
    return Candidate(module=module, kind=kind, site=site, function=qualname, line=line,
                     description=f"{kind} in {qualname} (line {line}): {what}",
                     source=new_source)


def library_modules() -> dict[str, str]:
    """{module name: pristine source} of the library's package, sorted by name."""
    folder = os.path.join(LIBRARY, PACKAGE)
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py") and name != "__init__.py":
            with open(os.path.join(folder, name), encoding="ascii") as f:
                out[name[:-3]] = f.read()
    return out


def enumerate_candidates(modules: dict[str, str]) -> list[Candidate]:
    """Every valid single-site mutation of every module, in a fixed order."""
    out = []
    for module, source in modules.items():
        for kind in KINDS:
            count = len(_sites(ast.parse(source), source.splitlines(), kind))
            for site in range(count):
                candidate = mutate(source, module, kind, site)
                if candidate is not None:
                    out.append(candidate)
    return out


# ---------------------------------------------------------------------------------------------
# Running the library's tests.
# ---------------------------------------------------------------------------------------------

RUNNER = r'''
import functools, importlib, inspect, json, resource, sys, traceback, unittest

resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # a mutant must not eat the machine

MARK = "@@SWE_MINI@@"


def run_all():
    class Result(unittest.TestResult):
        def __init__(self):
            super().__init__()
            self.outcomes = {}

        def _set(self, test, outcome, err=None):
            message = ""
            if err is not None:
                message = "".join(traceback.format_exception_only(err[0], err[1])).strip()
            self.outcomes[test.id()] = [outcome, message]

        def addSuccess(self, test):
            self._set(test, "pass")

        def addFailure(self, test, err):
            self._set(test, "fail", err)

        def addError(self, test, err):
            self._set(test, "error", err)

        def addSkip(self, test, reason):
            self._set(test, "skip")

        def addExpectedFailure(self, test, err):
            self._set(test, "xfail")

        def addUnexpectedSuccess(self, test):
            self._set(test, "xpass")

    result = Result()
    unittest.defaultTestLoader.discover(".").run(result)
    return result.outcomes


def trace(module, test_ids):
    mod = importlib.import_module(module)
    depth, calls, current = [0], [], [None]

    def args_text(args, kwargs):
        return ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])

    def wrap(fn, qualname, render):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if depth[0] == 0:
                try:
                    call = [render(args, kwargs), qualname]
                except Exception:
                    call = None
                if call and call not in [c[:2] for c in calls]:
                    calls.append(call + [current[0]])
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    for name, obj in list(vars(mod).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isfunction(obj):
            setattr(mod, name, wrap(obj, name, lambda a, k, n=name: f"{n}({args_text(a, k)})"))
        elif inspect.isclass(obj):
            for attr, fn in list(vars(obj).items()):
                if not inspect.isfunction(fn):
                    continue
                if attr == "__init__":
                    render = lambda a, k, n=name: f"{n}({args_text(a[1:], k)})"
                    qualname = name
                elif attr.startswith("_"):
                    continue
                else:
                    render = lambda a, k, at=attr: f"{a[0]!r}.{at}({args_text(a[1:], k)})"
                    qualname = f"{name}.{attr}"
                setattr(obj, attr, wrap(fn, qualname, render))
    for test_id in test_ids:
        current[0] = test_id
        unittest.defaultTestLoader.loadTestsFromName(test_id).run(unittest.TestResult())
    return calls


def evaluate(module, exprs):
    mod = importlib.import_module(module)
    names = {n: getattr(mod, n) for n in dir(mod) if not n.startswith("_")}
    out = []
    for expr in exprs:
        try:
            code = compile(expr, "<call>", "eval")
            value = eval(code, dict(names))
            out.append(["value", repr(value)])
        except SyntaxError:
            out.append(None)
        except Exception as e:
            out.append(["raise", "".join(traceback.format_exception_only(type(e), e)).strip()])
    return out


mode = sys.argv[1]
if mode == "run":
    answer = run_all()
elif mode == "trace":
    answer = trace(sys.argv[2], json.loads(sys.argv[3]))
else:
    answer = evaluate(sys.argv[2], json.loads(sys.argv[3]))
print(MARK + json.dumps(answer))
'''


def _clean_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/nonexistent"}


def run_runner(tree: str, *args: str):
    """The runner's JSON answer in the library copy `tree`, or None (timeout, crash)."""
    try:
        done = subprocess.run([sys.executable, "-c", RUNNER, *args], cwd=tree, env=_clean_env(),
                              capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None
    lines = [x for x in done.stdout.splitlines() if x.startswith("@@SWE_MINI@@")]
    if done.returncode != 0 or not lines:
        return None
    return json.loads(lines[-1][len("@@SWE_MINI@@"):])


def copy_library(dest: str, source_override: dict[str, str] | None = None) -> None:
    """The library's tracked files under `dest`, with some modules' sources replaced."""
    for rel in library_files():
        os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
        shutil.copyfile(os.path.join(LIBRARY, rel), os.path.join(dest, rel))
    for module, source in (source_override or {}).items():
        with open(os.path.join(dest, PACKAGE, f"{module}.py"), "w", encoding="ascii") as f:
            f.write(source)


def library_files() -> list[str]:
    """Paths (relative to library/) of the files that make up the repository."""
    files = [".gitignore"]
    for folder in (PACKAGE, "tests"):
        files += [f"{folder}/{n}" for n in sorted(os.listdir(os.path.join(LIBRARY, folder)))
                  if n.endswith(".py")]
    return files


def run_candidate(candidate: Candidate, workdir: str):
    """{test id: [outcome, message]} of the suite on the mutated library, or None."""
    tree = os.path.join(workdir, candidate.key.replace(":", "_"))
    copy_library(tree, {candidate.module: candidate.source})
    try:
        return run_runner(tree, "run")
    finally:
        shutil.rmtree(tree, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Problem statements.
# ---------------------------------------------------------------------------------------------

OPENINGS = ("I think `{qual}` has a bug.", "`{qual}` misbehaves for me.",
            "Something is off with `{qual}`.")


def _shown(outcome: list[str]) -> str:
    kind, text = outcome
    if kind == "value":
        return text
    return "Traceback (most recent call last):\n  ...\n" + text


def _title(qual: str, actual: list[str], expected: list[str]) -> str:
    if actual[0] == "value" and expected[0] == "value":
        return f"`{qual}` returns a wrong result"
    if actual[0] == "raise" and expected[0] == "value":
        return f"`{qual}` raises {actual[1].split(':')[0]} on valid input"
    if actual[0] == "value":
        return f"`{qual}` does not raise {expected[1].split(':')[0]}"
    return f"`{qual}` raises the wrong error"


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def problem_statement(candidate: Candidate, f2p: list[str], messages: dict[str, str],
                      pristine_tree: str, workdir: str, rng: random.Random) -> str | None:
    """An issue text from the buggy behaviour; None when no call shows it."""
    module = f"{PACKAGE}.{candidate.module}"
    tree = os.path.join(workdir, "ps_" + candidate.key.replace(":", "_"))
    copy_library(tree, {candidate.module: candidate.source})
    try:
        calls = run_runner(tree, "trace", module, json.dumps(f2p[:30]))
        if not calls:
            return None
        calls = [c for c in calls if len(c[0]) <= 160][:60]
        exprs = json.dumps([c[0] for c in calls])
        buggy = run_runner(tree, "eval", module, exprs)
        good = run_runner(pristine_tree, "eval", module, exprs)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    if not buggy or not good:
        return None
    wanted = candidate.function if not candidate.function.split(".")[-1].startswith("_") else ""
    differing = [(call, b, g) for call, b, g in zip(calls, buggy, good, strict=True)
                 if b and g and b != g]
    if not differing:
        return None
    differing.sort(key=lambda d: (d[0][1] != wanted, len(d[0][0])))
    (expr, qual, test_id), actual, expected = differing[0]
    qual = f"{module}.{qual}"
    names = sorted({n.id for n in ast.walk(ast.parse(expr, mode="eval"))
                    if isinstance(n, ast.Name)} & set(_public_names(pristine_tree, module)))
    message = "\n".join(messages[test_id][1].splitlines()[:12])
    example = f">>> from {module} import {', '.join(names)}\n>>> {expr}\n{_shown(actual)}"
    return "\n".join([
        _title(qual, actual, expected), "",
        rng.choice(OPENINGS).format(qual=qual), "", _indent(example), "",
        "but I expected" + (" it to raise:" if expected[0] == "raise" else ":"), "",
        _indent(expected[1] if expected[0] == "value" else _shown(expected)), "",
        "A test of this behaviour fails with:", "", _indent(message), ""])


_PUBLIC_CACHE: dict[str, list[str]] = {}


def _public_names(tree: str, module: str) -> list[str]:
    if module not in _PUBLIC_CACHE:
        with open(os.path.join(tree, *module.split(".")) + ".py", encoding="ascii") as f:
            source = f.read()
        names = []
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                names.append(node.name)
        _PUBLIC_CACHE[module] = names
    return _PUBLIC_CACHE[module]


# ---------------------------------------------------------------------------------------------
# Git: one repository, the pristine commit and one commit per task, then a bundle.
# ---------------------------------------------------------------------------------------------


def git(*args: str, cwd: str, input: str | None = None) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent",
           "LANG": "C.UTF-8", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "GIT_AUTHOR_NAME": "swe-mini", "GIT_AUTHOR_EMAIL": "swe-mini@sao-jax.invalid",
           "GIT_COMMITTER_NAME": "swe-mini", "GIT_COMMITTER_EMAIL": "swe-mini@sao-jax.invalid",
           "GIT_AUTHOR_DATE": GIT_DATE, "GIT_COMMITTER_DATE": GIT_DATE,
           "GIT_TERMINAL_PROMPT": "0"}
    config = ["-c", "core.hooksPath=/dev/null", "-c", "init.templateDir=", "-c", "core.abbrev=10",
              "-c", "pack.threads=1", "-c", "core.autocrlf=false", "-c", "diff.noprefix=false"]
    done = subprocess.run(["git", *config, *args], cwd=cwd, env=env, input=input,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {cwd}: {done.stderr.strip()}")
    return done.stdout


def test_module_path(test_id: str) -> str:
    """'tests.test_text.TestWrap.test_width' -> 'tests/test_text.py'."""
    parts = test_id.split(".")
    return "/".join(parts[:2]) + ".py"


def build_repository(repo: str, tasks: list[dict], sources: dict[str, Candidate]) -> str:
    """Commits the pristine library and each task's buggy snapshot; fills in the commits and
    patches of `tasks`; returns the pristine commit."""
    os.makedirs(repo)
    git("init", "-q", "-b", "main", repo, cwd=HERE)
    copy_library(repo)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "minilib 0.1", cwd=repo)
    pristine = git("rev-parse", "HEAD", cwd=repo).strip()
    for task in tasks:
        candidate = sources[task["instance_id"]]
        git("checkout", "-q", "--detach", pristine, cwd=repo)
        with open(os.path.join(repo, PACKAGE, f"{candidate.module}.py"), "w",
                  encoding="ascii") as f:
            f.write(candidate.source)
        removed = sorted({test_module_path(t) for t in task["FAIL_TO_PASS"]})
        git("rm", "-q", *removed, cwd=repo)
        git("add", "-A", cwd=repo)
        git("commit", "-q", "-m", f"{task['instance_id']}: {candidate.description}", cwd=repo)
        base = git("rev-parse", "HEAD", cwd=repo).strip()
        git("branch", task["instance_id"], base, cwd=repo)
        task["base_commit"] = base
        task["environment_setup_commit"] = pristine
        task["patch"] = git("diff", "--no-color", "--no-ext-diff", base, pristine, "--",
                            PACKAGE, cwd=repo)
        task["test_patch"] = git("diff", "--no-color", "--no-ext-diff", base, pristine, "--",
                                 "tests", cwd=repo)
    git("checkout", "-q", "main", cwd=repo)
    return pristine


# ---------------------------------------------------------------------------------------------
# Validation from the bundle, with the task's own test command.
# ---------------------------------------------------------------------------------------------

_VERBOSE_LINE = re.compile(r"^(\w+) \(([\w.]+)\)(?:\n.*?)? \.\.\. (ok|FAIL|ERROR|skipped.*|"
                           r"expected failure|unexpected success)$", re.MULTILINE)


def parse_unittest_verbose(output: str) -> dict[str, str]:
    """{test id: pass|fail|error|skip|...} from `python -m unittest -v` output (Python 3.10 prints
    the class in parentheses, 3.11+ the whole id)."""
    outcomes = {}
    names = {"ok": "pass", "FAIL": "fail", "ERROR": "error", "expected failure": "xfail",
             "unexpected success": "xpass"}
    for name, where, status in _VERBOSE_LINE.findall(output):
        test_id = where if where.endswith("." + name) else f"{where}.{name}"
        outcomes[test_id] = names.get(status, "skip")
    return outcomes


def run_test_cmd(tree: str) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-m", "unittest", "-v"], cwd=tree, env=_clean_env(),
                          capture_output=True, text=True, timeout=60)
    return parse_unittest_verbose(done.stdout + done.stderr)


def validate(bundle: str, tasks: list[dict], workdir: str) -> list[str]:
    """Problems found checking every task from a clone of `bundle` (empty: all good)."""
    clone = os.path.join(workdir, "clone")
    git("clone", "-q", "--no-checkout", bundle, clone, cwd=workdir)
    problems = []
    for task in tasks:
        name, f2p, p2p = task["instance_id"], task["FAIL_TO_PASS"], task["PASS_TO_PASS"]
        git("checkout", "-q", "-f", "--detach", task["base_commit"], cwd=clone)
        git("clean", "-q", "-fdx", cwd=clone)
        present = run_test_cmd(clone)
        if any(t in present for t in f2p):
            problems.append(f"{name}: a FAIL_TO_PASS test is present before test_patch")
        for label, patch in (("test_patch", task["test_patch"]), ("patch", task["patch"])):
            patch_file = os.path.join(workdir, f"{label}.diff")
            with open(patch_file, "w", encoding="utf-8") as f:
                f.write(patch)
            git("apply", patch_file, cwd=clone)
            outcomes = run_test_cmd(clone)
            if set(outcomes) != set(f2p) | set(p2p):
                problems.append(f"{name} after {label}: the tests run are not F2P + P2P")
            bad_p2p = [t for t in p2p if outcomes.get(t) != PASSED]
            if bad_p2p:
                problems.append(f"{name} after {label}: PASS_TO_PASS not passing: {bad_p2p[:3]}")
            if label == "test_patch":
                bad = [t for t in f2p if outcomes.get(t) not in FAILED]
                what = "FAIL_TO_PASS passing without the fix"
            else:
                bad = [t for t in f2p if outcomes.get(t) != PASSED]
                what = "FAIL_TO_PASS not passing with the gold patch"
            if bad:
                problems.append(f"{name}: {what}: {bad[:3]}")
        git("add", "-A", cwd=clone)
        changed = git("diff", "--cached", "--name-only", task["environment_setup_commit"],
                      cwd=clone)
        if changed.strip():
            problems.append(f"{name}: base + test_patch + patch differs from the pristine commit: "
                            f"{changed.split()}")
    return problems


# ---------------------------------------------------------------------------------------------
# Selection and the whole run.
# ---------------------------------------------------------------------------------------------


def select(evaluated: list[tuple], rng: random.Random):
    """Yields candidates round-robin over the modules and, within a module, round-robin over its
    mutation kinds (in a shuffled order), each (module, kind) group in shuffled order; skips
    duplicates (the same buggy source, or the same function failing the same tests) and more than
    MAX_PER_FUNCTION per function. The caller stops when it has enough."""
    groups = collections.defaultdict(lambda: collections.defaultdict(list))
    for item in evaluated:
        groups[item[0].module][item[0].kind].append(item)
    order = {}
    for module in sorted(groups):
        for kind in sorted(groups[module]):
            rng.shuffle(groups[module][kind])
        order[module] = sorted(groups[module])
        rng.shuffle(order[module])
    turn = collections.Counter()  # module -> how many kinds it has been asked for
    seen_sources, seen_behaviour = set(), set()
    per_function = collections.Counter()

    def next_from(module):
        kinds = order[module]
        while any(groups[module][k] for k in kinds):
            kind = kinds[turn[module] % len(kinds)]
            turn[module] += 1
            while groups[module][kind]:
                item = groups[module][kind].pop(0)
                candidate, f2p = item[0], item[1]
                where = (candidate.module, candidate.function)
                behaviour = (*where, tuple(f2p))
                if (candidate.source in seen_sources or behaviour in seen_behaviour
                        or per_function[where] >= MAX_PER_FUNCTION):
                    continue
                seen_sources.add(candidate.source)
                seen_behaviour.add(behaviour)
                per_function[where] += 1
                return item
        return None

    live = sorted(groups)
    while live:
        for module in list(live):
            item = next_from(module)
            if item is None:
                live.remove(module)
            else:
                yield item


def main() -> int:
    started = time.time()
    rng = random.Random(SEED)
    modules = library_modules()
    candidates = enumerate_candidates(modules)
    print(f"{len(candidates)} candidate mutations in {len(modules)} modules", flush=True)
    with tempfile.TemporaryDirectory(prefix="swe_mini_") as workdir:
        pristine_tree = os.path.join(workdir, "pristine")
        copy_library(pristine_tree)
        baseline = run_runner(pristine_tree, "run")
        if not baseline or any(o != PASSED for o, _ in baseline.values()):
            print("the pristine library's tests do not all pass", file=sys.stderr)
            return 1
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            results = list(pool.map(lambda c: run_candidate(c, workdir), candidates))
        evaluated = []
        for candidate, outcomes in zip(candidates, results, strict=True):
            if outcomes is None or set(outcomes) != set(baseline):
                continue
            f2p = sorted(t for t, (o, _) in outcomes.items() if o in FAILED)
            p2p = sorted(t for t, (o, _) in outcomes.items() if o == PASSED)
            if f2p and p2p and len(f2p) + len(p2p) == len(baseline):
                evaluated.append((candidate, f2p, p2p, outcomes))
        print(f"{len(evaluated)} candidates break at least one test "
              f"({time.time() - started:.0f} s)", flush=True)
        tasks, sources = [], {}
        chosen = []
        for candidate, f2p, p2p, outcomes in select(evaluated, rng):
            statement = problem_statement(candidate, f2p, outcomes, pristine_tree, workdir, rng)
            if statement is None:
                continue
            chosen.append((candidate, f2p, p2p, statement))
            if len(chosen) == N_TASKS:
                break
        chosen.sort(key=lambda c: (c[0].module, c[0].kind, c[0].site))
        for number, (candidate, f2p, p2p, statement) in enumerate(chosen, 1):
            instance_id = f"{REPO.split('/')[0]}__{REPO.split('/')[1]}-{number}"
            sources[instance_id] = candidate
            tasks.append({
                "instance_id": instance_id, "repo": REPO, "base_commit": "",
                "problem_statement": statement, "patch": "", "test_patch": "",
                "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "version": VERSION,
                "environment_setup_commit": "", "workspace": "repo.bundle",
                "test_cmd": TEST_CMD, "log_parser": "unittest",
                "mutation": {"module": f"{PACKAGE}/{candidate.module}.py", "kind": candidate.kind,
                             "site": candidate.site, "function": candidate.function,
                             "line": candidate.line, "description": candidate.description}})
        repo = os.path.join(workdir, "repo")
        pristine = build_repository(repo, tasks, sources)
        bundle = os.path.join(workdir, "repo.bundle")
        git("bundle", "create", "-q", bundle, "--all", cwd=repo)
        problems = validate(bundle, tasks, workdir)
        if problems:
            print("validation failed; nothing written:", *problems, sep="\n  ", file=sys.stderr)
            return 1
        jsonl = "".join(json.dumps(t) + "\n" for t in tasks)
        with open(os.path.join(HERE, "tasks.jsonl.tmp"), "w", encoding="utf-8") as f:
            f.write(jsonl)
        shutil.copyfile(bundle, os.path.join(HERE, "repo.bundle.tmp"))
        os.replace(os.path.join(HERE, "tasks.jsonl.tmp"), os.path.join(HERE, "tasks.jsonl"))
        os.replace(os.path.join(HERE, "repo.bundle.tmp"), os.path.join(HERE, "repo.bundle"))
    by_module = collections.Counter(sources[t["instance_id"]].module for t in tasks)
    by_kind = collections.Counter(sources[t["instance_id"]].kind for t in tasks)
    print(f"{len(tasks)} tasks validated and written (pristine commit {pristine[:10]}, bundle "
          f"{os.path.getsize(os.path.join(HERE, 'repo.bundle'))} bytes)")
    print("  per module:", ", ".join(f"{k} {v}" for k, v in sorted(by_module.items())))
    print("  per kind:  ", ", ".join(f"{k} {v}" for k, v in sorted(by_kind.items())))
    print(f"  {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
