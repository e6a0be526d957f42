"""The swe_tiny task family: one-token bugs in one-function files, the SWE tasks a CPU-sized
policy can learn (`experiments/swe_tiny.py`; the committed tasks are
`experiments/data/swe_tiny`, written by its `make_tasks.py` from this module).

A file `tinyfix/fNNN.py` holds one short function, an instance of one of the `TEMPLATES` (clamp,
sign, power, count_above, ...) with its own parameter names and constant. A task is one
single-token mutation of it, of five kinds:

  compare  a comparison operator flipped (`<` / `<=` / `>`, `==` / `!=`)
  arith    an arithmetic operator flipped (`+` / `-`, `*` -> `+`, `//` -> `/`)
  const    an integer constant off by one
  name     a name replaced by another one in scope (a parameter or a local)
  swap     the two arguments of a call swapped

kept only where some input tells the mutant from the original (`make_instance`). Files whose
number is `held_out` (every eleventh: f005, f016, ...) are the held-out tasks' only.

`transcripts(seed, ...)` is the warm start's endless teacher for this family: fresh instances in
files no held-out task uses, each played by the one-line-edit expert (`expert.edit_replies`) and
rendered as an `SWEEnv` shows the episode (its first message, the listing's output in the
observation format: `cat -n`'s, or `grep -Hn`'s with `read="grep"`), without a workspace: the
rendering is checked against episodes played in real workspaces by
tests/envs/swe/test_swe_tiny.py.
"""

from __future__ import annotations

import dataclasses
import io
import random
import tokenize

# The stream's version, in the warm start's cache key (`teacher.transcripts`): raise it with
# any change to the instances or transcripts this module makes, which
# tests/envs/swe/test_swe_tiny.py pins (so that a refactor keeps the shipped warm start, and a
# change of output cannot).
VERSION = 1
PACKAGE = "tinyfix"
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


def _function(source: str, name: str):
    """Function `name` of `source` (a task's file: one pure function), defined once for all
    the inputs it is called on (compiling the source per call took most of a stream's time)."""
    namespace = {}
    exec(compile(source, "<task>", "exec"), namespace)
    return namespace[name]


def _call(function, args):
    """`("ok", value)` or `("raises", exception name)`: `function` called on a copy of `args`."""
    try:
        return ("ok", function(*[list(a) if isinstance(a, list) else a for a in args]))
    except Exception as e:  # noqa: BLE001 - a mutant may raise anything
        return ("raises", type(e).__name__)


def _shown(result) -> str:
    status, value = result
    return f"raises {value}" if status == "raises" else f"returns {value!r}"


def make_instance(index: int, rng: random.Random) -> dict | None:
    """One task on file `f<index>` (the template `index % len(TEMPLATES)`, names and constant
    drawn from `rng`), or None when no edit of the drawn instance shows."""
    template = TEMPLATES[index % len(TEMPLATES)]
    names = rng.sample(NAMES, template.params + template.locals)
    fields = {f"p{i}": n for i, n in enumerate(names)}
    fields.update(f=template.name, k0=rng.randint(*template.constant))
    source = template.source.format(**fields)
    lines = source.splitlines()
    inputs = list(dict.fromkeys(repr(template.inputs(rng)) for _ in range(60)))
    inputs = [eval(text) for text in inputs]  # noqa: S307 - our own reprs
    function = _function(source, template.name)
    right = [_call(function, args) for args in inputs]
    edits = [e for n, line in enumerate(lines, 1) for e in one_token_edits(line, n, names)]
    by_kind = {}
    for edit in edits:
        mutant = "\n".join(lines[:edit.line - 1] + [edit.text] + lines[edit.line:]) + "\n"
        try:
            wrong_function = _function(mutant, template.name)
        except SyntaxError:
            continue
        wrong = [_call(wrong_function, args) for args in inputs]
        broken = [i for i, (a, b) in enumerate(zip(right, wrong, strict=True)) if a != b]
        if broken:
            by_kind.setdefault(edit.kind, []).append((edit, mutant, wrong_function, broken))
    if not by_kind:
        return None
    kind = KINDS[index % len(KINDS)] if KINDS[index % len(KINDS)] in by_kind else rng.choice(
        sorted(by_kind))
    edit, mutant, wrong_function, broken = rng.choice(by_kind[kind])
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
            decoy = _function(candidate, template.name)
        except SyntaxError:
            continue
        if any(_call(decoy, inputs[i]) != right[i] for i in checked):
            decoys.append(other.text)
    if not decoys:
        return None
    file = f"{PACKAGE}/f{index:03d}.py"
    call = f"{template.name}({', '.join(map(repr, inputs[shown]))})"
    problem = (f"In `{file}`, `{call}` {_shown(_call(wrong_function, inputs[shown]))},"
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



def first_instances(count: int, seed: int) -> list[dict]:
    """The first `count` instances of files f000, f001, ... in order (a file whose drawn
    instance has no edit that shows is skipped), drawn from one `random.Random(seed)`: what
    experiments/data/swe_tiny/make_tasks.py commits."""
    rng, made, index = random.Random(seed), [], 0
    while len(made) < count:
        instance = make_instance(index, rng)
        if instance is not None:
            made.append(instance)
        index += 1
    return made


def held_out(index: int) -> bool:
    """Whether file `f<index>` is a held-out task's (every eleventh, from f005): training never
    touches it."""
    return index % 11 == 5


def cat_n(text: str) -> str:
    """What `cat -n` prints for `text` (GNU coreutils: the number right-aligned in 6 columns, a
    tab, the line)."""
    return "".join(f"{n:6d}\t{line}\n" for n, line in enumerate(text.splitlines(), 1))


def grep_hn(text: str, path: str) -> str:
    """What `grep -Hn '' path` prints for `text`: each line as `path:number:line`."""
    return "".join(f"{path}:{n}:{line}\n" for n, line in enumerate(text.splitlines(), 1))


def listing(text: str, path: str, read: str) -> str:
    """The output of the edit expert's first command (`expert.READS[read]`) on `text`."""
    return grep_hn(text, path) if read == "grep" else cat_n(text)


def instances(seed: int, *, exclude=(), files: int = 1000):
    """Endless fresh instances (`make_instance`'s dicts) of random files `f<index>`, index below
    `files` and never `held_out`, none whose `(buggy, fixed)` line pair is in `exclude` (the
    held-out tasks' bugs); a seed gives one stream."""
    rng = random.Random(seed)
    exclude = set(map(tuple, exclude))
    while True:
        index = rng.randrange(files)
        if held_out(index):
            continue
        made = make_instance(index, random.Random(rng.getrandbits(64)))
        if made is not None and (made["mutation"]["buggy"],
                                 made["mutation"]["fixed"]) not in exclude:
            yield made


def transcripts(seed: int, *, config, mistakes: float = 0.0, exclude=(), files: int = 1000,
                read: str = "cat", fix: str = "sub", decoy: str = "random",
                kinds: tuple[str, ...] = ()):
    """Endless expert transcripts `(prompt, [(action, observation), ...])` of `instances(seed,
    ...)`, as an `SWEEnv` of `config` (`SWEEnvConfig`) would show them (`render`; `read` and
    `fix`: the expert's commands, `expert.READS` and `expert.FIXES`). With probability
    `mistakes` the expert writes one of the instance's decoys instead of the fix (`decoy`:
    "random", any of them, or "first", always the first) on instances of `kinds` (`KINDS`;
    empty: every kind), as the warm start's teacher does on the task rows
    (`teacher.mistake`)."""
    rng = random.Random(f"mistakes {seed}")
    for made in instances(seed, exclude=exclude, files=files):
        m = made["mutation"]
        target = m["fixed"]
        # drawn for every instance, so that `kinds` leaves the other instances' draws alone
        if rng.random() < mistakes and (not kinds or m["kind"] in kinds):
            target = rng.choice(m["decoys"]) if decoy == "random" else m["decoys"][0]
        try:
            yield render(config, made["problem"], f"swe-tiny-{made['index']}", made["mutant"], m,
                         target, read=read, fix=fix)
        except ValueError:  # no one-run sed substitution writes that line
            continue


def render(config, problem: str, instance_id: str, mutant: str, mutation: dict, target: str,
           read: str = "cat", fix: str = "sub"):
    """The transcript of the one-line-edit expert (`expert.edit_replies`, reading the file with
    `expert.READS[read]`, editing as `fix` says) turning `mutation["buggy"]` into `target` in a
    file whose text is `mutant`, as an `SWEEnv` of `config` shows it: the first message, the
    listing in the observation format, and the submission (no observation)."""
    from sao_jax.envs.swe import expert
    from sao_jax.envs.swe.env import first_message, format_observation
    from sao_jax.envs.swe.workspace import CommandResult

    replies = expert.edit_replies(mutation["file"], mutation["line"], mutation["buggy"], target,
                                  read=read, fix=fix)
    shown = CommandResult(0, listing(mutant, mutation["file"], read), False, False, 0.0)
    return (first_message(config, problem, instance_id),
            [(replies[0], format_observation(shown, config.output_chars)), (replies[1], "")])
