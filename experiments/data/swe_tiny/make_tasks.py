"""Builds swe_tiny: one-line bug fixes in small functions, a task family a 0.1M-parameter policy
can learn through the real SWE path (workspaces, hidden tests, the grader).

    python experiments/data/swe_tiny/make_tasks.py   # writes tasks.jsonl and repo.bundle here

The repository `tinyfix` holds one short function per file (`tinyfix/f000.py` ...), each an
instance of one of the `TEMPLATES` (clamp, sign, power, count_above, ...) with its own parameter
names and constants. A task is one single-token mutation of one file, of five kinds:

  compare  a comparison operator flipped (`<` / `<=` / `>`, `==` / `!=`)
  arith    an arithmetic operator flipped (`+` / `-`, `*` -> `+`, `//` -> `/`)
  const    an integer constant off by one
  name     a name replaced by another one in scope (a parameter or a local)
  swap     the two arguments of a call swapped

kept only where some input tells the mutant from the original. The hidden test (the
`test_patch` adds `tests/test_fNNN.py`) checks four calls, at least one of which the bug breaks;
the problem statement shows one of those calls, what it gives and what it should give. Every
eleventh file (`f005`, `f016`, ...) is held out: its `HELD_OUT` tasks are the last rows of
tasks.jsonl, which a run holds out (`env.num_eval_prompts`), in files no training task touches,
so that the held-out rate measures fixing bugs of the known kinds in code the policy has not
seen, not recalling lines. (With the last files held out instead, f400-f439, the warm-started
policy resolved none of them: it had never written a path starting `f4`.)

Each row keeps, in `extra["mutation"]`: the kind, the file, the line number, the buggy and the
fixed line, and `decoys`: other one-token edits of the fixed line that the hidden test rejects
(plausible wrong fixes, for a teacher that makes mistakes: `envs.swe.expert.edit_actions`),
each checked, as the fix is, to be what the expert's sed substitution writes.

Deterministic (seed `SEED`, fixed git dates): rerunning writes the same bytes.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import tokenize

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 7
NUM_TASKS = 440
HELD_OUT = 40
PACKAGE = "tinyfix"
GIT_DATE = "2026-12-05T12:00:00+00:00"
NAMES = ("a", "b", "c", "d", "k", "m", "n", "p", "q", "r", "s", "t", "u", "v", "w", "x", "y",
         "z", "lo", "hi", "num", "val", "top", "cap")


@dataclasses.dataclass(frozen=True)
class Template:
    name: str
    params: int  # p0, p1, ...; the body may use locals p<params>...
    locals: int
    source: str  # with {f} (the function's name), {p0}... and {k0} (a constant)
    inputs: object  # rng -> a tuple of arguments
    constant: tuple[int, int] = (2, 9)


def _ints(lo, hi, n):
    return lambda r: tuple(r.randint(lo, hi) for _ in range(n))


def _list_and_int(r):
    return ([r.randint(0, 9) for _ in range(r.randint(2, 6))], r.randint(0, 9))


TEMPLATES = (
    Template("clamp", 3, 0, "def {f}({p0}, {p1}, {p2}):\n    if {p0} < {p1}:\n        return {p1}\n"
             "    if {p0} > {p2}:\n        return {p2}\n    return {p0}\n",
             lambda r: (r.randint(-5, 15), r.randint(0, 4), r.randint(6, 10))),
    Template("add_const", 1, 0, "def {f}({p0}):\n    return {p0} + {k0}\n", _ints(-9, 9, 1)),
    Template("affine", 2, 0, "def {f}({p0}, {p1}):\n    return {p0} * {p1} + {k0}\n",
             _ints(-5, 9, 2)),
    Template("sign", 1, 0, "def {f}({p0}):\n    if {p0} > 0:\n        return 1\n"
             "    if {p0} < 0:\n        return -1\n    return 0\n", _ints(-3, 3, 1)),
    Template("diff", 2, 0, "def {f}({p0}, {p1}):\n    return {p0} - {p1}\n", _ints(-9, 9, 2)),
    Template("larger", 2, 0, "def {f}({p0}, {p1}):\n    if {p0} > {p1}:\n        return {p0}\n"
             "    return {p1}\n", _ints(-5, 9, 2)),
    Template("smaller", 2, 0, "def {f}({p0}, {p1}):\n    if {p0} < {p1}:\n        return {p0}\n"
             "    return {p1}\n", _ints(-5, 9, 2)),
    Template("count_above", 2, 2, "def {f}({p0}, {p1}):\n    {p2} = 0\n    for {p3} in {p0}:\n"
             "        if {p3} > {p1}:\n            {p2} = {p2} + 1\n    return {p2}\n",
             _list_and_int),
    Template("index_of", 2, 1, "def {f}({p0}, {p1}):\n    for {p2} in range(len({p0})):\n"
             "        if {p0}[{p2}] == {p1}:\n            return {p2}\n    return -1\n",
             _list_and_int),
    Template("power", 2, 0, "def {f}({p0}, {p1}):\n    return pow({p0}, {p1})\n",
             lambda r: (r.randint(2, 5), r.randint(0, 4))),
    Template("midpoint", 2, 0, "def {f}({p0}, {p1}):\n    return ({p0} + {p1}) // 2\n",
             _ints(0, 20, 2)),
    Template("last", 1, 0, "def {f}({p0}):\n    return {p0}[len({p0}) - 1]\n",
             lambda r: ([r.randint(0, 9) for _ in range(r.randint(2, 6))],)),
    Template("between", 3, 0,
             "def {f}({p0}, {p1}, {p2}):\n    return {p1} <= {p0} and {p0} <= {p2}\n",
             lambda r: (r.randint(-2, 12), r.randint(0, 4), r.randint(6, 10))),
    Template("triangle", 1, 0, "def {f}({p0}):\n    return {p0} * ({p0} + 1) // 2\n",
             _ints(0, 12, 1)),
    Template("remainder", 2, 0, "def {f}({p0}, {p1}):\n    return divmod({p0}, {p1})[1]\n",
             lambda r: (r.randint(5, 30), r.randint(2, 7))),
    Template("scaled_gap", 2, 0, "def {f}({p0}, {p1}):\n    return ({p0} - {p1}) * {k0}\n",
             _ints(-9, 9, 2)),
)

FLIPS = {"<": ("<=", ">"), "<=": ("<",), ">": (">=", "<"), ">=": (">",), "==": ("!=",),
         "!=": ("==",), "+": ("-",), "-": ("+",), "*": ("+",), "//": ("/",)}
KINDS = ("compare", "arith", "const", "name", "swap")


@dataclasses.dataclass(frozen=True)
class Edit:
    kind: str
    line: int  # 1-based
    text: str  # the mutated line


def _tokens(line: str):
    return [t for t in tokenize.generate_tokens(io.StringIO(line + "\n").readline)
            if t.type in (tokenize.OP, tokenize.NUMBER, tokenize.NAME)]


def _replace(line: str, token, new: str) -> str:
    return line[:token.start[1]] + new + line[token.end[1]:]


def one_token_edits(line: str, number: int, names: list[str]) -> list[Edit]:
    """Every edit of the five kinds on `line` (one of a function's lines, `names` its parameters
    and locals)."""
    if line.lstrip().startswith("def "):
        return []
    out = []
    tokens = _tokens(line)
    for i, token in enumerate(tokens):
        if token.type == tokenize.OP and token.string in FLIPS:
            kind = "compare" if token.string in "<=>=!=" else "arith"
            if token.string == "-" and i + 1 < len(tokens) and (
                    i == 0 or tokens[i - 1].string in ("return", "(", ",")):
                continue  # a unary minus
            out += [Edit(kind, number, _replace(line, token, new)) for new in FLIPS[token.string]]
        elif token.type == tokenize.NUMBER and token.string.isdigit():
            value = int(token.string)
            out += [Edit("const", number, _replace(line, token, str(v)))
                    for v in (value - 1, value + 1) if v >= 0]
        elif token.type == tokenize.NAME and token.string in names:
            if i + 1 < len(tokens) and tokens[i + 1].string == "=" or (
                    i > 0 and tokens[i - 1].string == "for"):
                continue  # an assignment target
            out += [Edit("name", number, _replace(line, token, other))
                    for other in names if other != token.string]
        elif token.type == tokenize.NAME and token.string in ("pow", "divmod"):
            call = line[token.end[1]:]
            inner = call[1:call.index(")")]
            first, _, second = inner.partition(", ")
            if second and "," not in second:
                out.append(Edit("swap", number, line[:token.end[1]] + f"({second}, {first})"
                                + call[call.index(")") + 1:]))
    return out


def _run(source: str, name: str, args):
    namespace = {}
    exec(compile(source, "<task>", "exec"), namespace)
    try:
        return ("ok", namespace[name](*[list(a) if isinstance(a, list) else a for a in args]))
    except Exception as e:  # noqa: BLE001 - a mutant may raise anything
        return ("raises", type(e).__name__)


def _shown(result) -> str:
    status, value = result
    return f"raises {value}" if status == "raises" else f"returns {value!r}"


def make_instance(index: int, rng: random.Random) -> dict | None:
    """One task on file `f<index>`, or None when no edit of the drawn instance shows."""
    template = TEMPLATES[index % len(TEMPLATES)]
    names = rng.sample(NAMES, template.params + template.locals)
    fields = {f"p{i}": n for i, n in enumerate(names)}
    fields.update(f=template.name, k0=rng.randint(*template.constant))
    source = template.source.format(**fields)
    lines = source.splitlines()
    inputs = list(dict.fromkeys(repr(template.inputs(rng)) for _ in range(60)))
    inputs = [eval(text) for text in inputs]  # noqa: S307 - our own reprs
    right = [_run(source, template.name, args) for args in inputs]
    edits = [e for n, line in enumerate(lines, 1) for e in one_token_edits(line, n, names)]
    by_kind = {}
    for edit in edits:
        mutant = "\n".join(lines[:edit.line - 1] + [edit.text] + lines[edit.line:]) + "\n"
        try:
            compile(mutant, "<task>", "exec")
        except SyntaxError:
            continue
        wrong = [_run(mutant, template.name, args) for args in inputs]
        broken = [i for i, (a, b) in enumerate(zip(right, wrong, strict=True)) if a != b]
        if broken:
            by_kind.setdefault(edit.kind, []).append((edit, mutant, broken))
    if not by_kind:
        return None
    kind = KINDS[index % len(KINDS)] if KINDS[index % len(KINDS)] in by_kind else rng.choice(
        sorted(by_kind))
    edit, mutant, broken = rng.choice(by_kind[kind])
    shown = rng.choice(broken)
    others = [i for i in range(len(inputs)) if i != shown and right[i][0] == "ok"]
    checked = [shown] + rng.sample(others, min(3, len(others)))
    # Wrong fixes a teacher may make: other one-token edits of the fixed line, of the buggy one
    # (the bug kept, something else changed), that the hidden test catches.
    fixed_line = lines[edit.line - 1]
    decoys = []
    for other in one_token_edits(edit.text, edit.line, names):
        if other.text in (fixed_line, edit.text) or other.text in decoys:
            continue
        candidate = "\n".join(lines[:edit.line - 1] + [other.text] + lines[edit.line:]) + "\n"
        try:
            compile(candidate, "<task>", "exec")
        except SyntaxError:
            continue
        if any(_run(candidate, template.name, inputs[i]) != right[i] for i in checked):
            decoys.append(other.text)
    if not decoys:
        return None
    file = f"{PACKAGE}/f{index:03d}.py"
    call = f"{template.name}({', '.join(map(repr, inputs[shown]))})"
    problem = (f"In `{file}`, `{call}` {_shown(wrong_of(mutant, template.name, inputs[shown]))},"
               f" but it should return {right[shown][1]!r}.")
    module = f"f{index:03d}"
    test = (f"import unittest\n\nfrom {PACKAGE}.{module} import {template.name}\n\n\n"
            f"class Test{template.name.title().replace('_', '')}(unittest.TestCase):\n"
            f"    def test_{template.name}(self):\n"
            + "".join(f"        self.assertEqual({template.name}"
                      f"({', '.join(map(repr, inputs[i]))}), {right[i][1]!r})\n" for i in checked))
    return {"index": index, "file": file, "module": module, "source": source, "mutant": mutant,
            "test": test, "problem": problem, "template": template.name,
            "test_id": f"tests.test_{module}.Test{template.name.title().replace('_', '')}"
                       f".test_{template.name}",
            "mutation": {"kind": edit.kind, "file": file, "line": edit.line,
                         "buggy": edit.text, "fixed": fixed_line, "decoys": decoys[:6]}}


def wrong_of(source, name, args):
    return _run(source, name, args)


def git(*args: str, cwd: str) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent",
           "LANG": "C.UTF-8", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "GIT_AUTHOR_NAME": "swe-tiny", "GIT_AUTHOR_EMAIL": "swe-tiny@sao-jax.invalid",
           "GIT_COMMITTER_NAME": "swe-tiny", "GIT_COMMITTER_EMAIL": "swe-tiny@sao-jax.invalid",
           "GIT_AUTHOR_DATE": GIT_DATE, "GIT_COMMITTER_DATE": GIT_DATE}
    done = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "-c", "init.templateDir=",
                           "-c", "core.abbrev=10", "-c", "pack.threads=1", *args], cwd=cwd,
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def write(root: str, path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
    with open(os.path.join(root, path), "w", encoding="ascii") as f:
        f.write(text)


def build(instances: list[dict], workdir: str) -> list[dict]:
    """The repository (main: every function right; one commit per task on top), its bundle, and
    the task rows."""
    repo = os.path.join(workdir, "repo")
    os.makedirs(repo)
    git("init", "-q", "-b", "main", cwd=repo)
    write(repo, f"{PACKAGE}/__init__.py", "")
    write(repo, "tests/__init__.py", "")
    for inst in instances:
        write(repo, inst["file"], inst["source"])
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "tinyfix 1.0", cwd=repo)
    pristine = git("rev-parse", "HEAD", cwd=repo).strip()
    rows = []
    for inst in instances:
        instance_id = f"sao-jax__swe-tiny-{inst['index']}"
        git("checkout", "-q", "--detach", pristine, cwd=repo)
        write(repo, inst["file"], inst["mutant"])
        git("commit", "-q", "-am", f"{instance_id}: {inst['mutation']['kind']} in {inst['file']}"
            f" line {inst['mutation']['line']}", cwd=repo)
        base = git("rev-parse", "HEAD", cwd=repo).strip()
        git("branch", instance_id, cwd=repo)
        patch = git("diff", "--no-color", base, pristine, cwd=repo)
        write(repo, f"tests/test_{inst['module']}.py", inst["test"])
        git("add", "-A", cwd=repo)
        test_patch = git("diff", "--no-color", "--cached", base, cwd=repo)
        git("reset", "-q", "--hard", base, cwd=repo)
        rows.append({
            "instance_id": instance_id, "repo": "sao-jax/swe-tiny", "base_commit": base,
            "problem_statement": inst["problem"], "patch": patch, "test_patch": test_patch,
            "FAIL_TO_PASS": [inst["test_id"]], "PASS_TO_PASS": [], "version": "1.0",
            "environment_setup_commit": pristine, "workspace": "repo.bundle",
            "test_cmd": f"python -m unittest -v tests.test_{inst['module']}",
            "log_parser": "unittest", "mutation": inst["mutation"], "template": inst["template"]})
    git("checkout", "-q", "main", cwd=repo)
    git("bundle", "create", "-q", os.path.join(workdir, "repo.bundle"), "--all", cwd=repo)
    return rows


def check_edits(rows: list[dict]) -> list[str]:
    """The expert's sed substitution (`envs.swe.expert.sed_substitution`) of every fix and decoy,
    run by sed on the buggy line, gives that line; decoys it cannot write are dropped."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
    from sao_jax.envs.swe.expert import sed_substitution

    problems = []
    for row in rows:
        mutation = row["mutation"]

        def sed_gives(target, buggy=mutation["buggy"]):
            try:
                script = sed_substitution(1, buggy, target)
            except ValueError:
                return False
            done = subprocess.run(["sed", script], input=buggy + "\n",
                                  capture_output=True, text=True)
            return done.stdout == target + "\n" and "'" not in script

        if not sed_gives(mutation["fixed"]):
            problems.append(f"{row['instance_id']}: no sed substitution makes the fix")
        mutation["decoys"] = [d for d in mutation["decoys"] if sed_gives(d)]
        if not mutation["decoys"]:
            problems.append(f"{row['instance_id']}: no decoy")
    return problems


def validate(rows: list[dict], workdir: str) -> list[str]:
    """Each task from the bundle: the hidden test fails at the base, passes with the gold patch."""
    clone = os.path.join(workdir, "clone")
    git("clone", "-q", os.path.join(workdir, "repo.bundle"), clone, cwd=workdir)
    problems = []
    for row in rows:
        git("checkout", "-q", "-f", row["base_commit"], cwd=clone)
        git("clean", "-fdqx", cwd=clone)
        for patch, want in ((row["test_patch"], 1), (row["patch"], 0)):
            subprocess.run(["git", "apply"], input=patch, text=True, cwd=clone, check=True)
            done = subprocess.run([sys.executable, "-m", "unittest", "-q",
                                   row["FAIL_TO_PASS"][0]], cwd=clone, capture_output=True)
            if (done.returncode != 0) != bool(want):
                problems.append(f"{row['instance_id']}: exit {done.returncode} "
                                f"{'at the base' if want else 'with the gold patch'}")
    return problems


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-tasks", type=int, default=NUM_TASKS)
    parser.add_argument("--out", default=HERE, help="where tasks.jsonl and repo.bundle go")
    args = parser.parse_args()
    rng = random.Random(SEED)
    instances, index = [], 0
    while len(instances) < args.num_tasks:
        made = make_instance(index, rng)
        if made is not None:
            instances.append(made)
        index += 1
    with tempfile.TemporaryDirectory() as workdir:
        rows = build(instances, workdir)
        problems = check_edits(rows) + validate(rows, workdir)
        if problems:
            sys.exit("\n".join(problems[:20]))
        shutil.copy(os.path.join(workdir, "repo.bundle"), os.path.join(args.out, "repo.bundle"))
    held = [r for r in rows
            if int(r["mutation"]["file"].split("/f")[1][:-3]) % 11 == 5][:HELD_OUT]
    rows = [r for r in rows if r not in held] + held
    with open(os.path.join(args.out, "tasks.jsonl"), "w", encoding="ascii") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    kinds = {k: sum(r["mutation"]["kind"] == k for r in rows) for k in KINDS}
    print(f"{len(rows)} tasks ({HELD_OUT} held out at the end), kinds {kinds}")


if __name__ == "__main__":
    main()
