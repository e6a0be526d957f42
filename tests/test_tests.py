"""The test suite's own structure: no module of it imports a test module.

What several test modules share lives in a helper module beside them (tests/engine/engines.py,
tests/train/learner_runs.py, ...), never in a test_*.py file: importing a test module runs its
module-level code and puts its tests' names in the importer's namespace, and moving or renaming a
test file then breaks the modules that happened to import it.
"""

import ast
import os
import re

TESTS = os.path.dirname(os.path.abspath(__file__))
# An import written inside a string (a program a test runs in a child process).
IMPORT_IN_TEXT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\s+([\w, ]+)|import\s+([\w., ]+))",
                            re.MULTILINE)


def names_a_test_module(name: str) -> bool:
    """Whether `name` (dotted, or relative with leading dots) is a test module of this suite or
    a name in one (third-party `jax.test_util` is not)."""
    if not (name.startswith("tests.") or name.startswith(".")):
        return False
    return any(part.startswith("test_") for part in name.split("."))


def the_test_module(name: str) -> str:
    """`name` up to its test module: `tests.engine.test_server.start_engine` ->
    `tests.engine.test_server`."""
    parts = name.split(".")
    first = next(i for i, part in enumerate(parts) if part.startswith("test_"))
    return ".".join(parts[:first + 1])


def imported_modules(tree: ast.AST, strings: bool = True) -> list[tuple[int, str]]:
    """`(line, dotted name)` of every module an import in `tree` names, at any depth, the names
    of `from package import name` included (each may be a module); and, with `strings`, of the
    imports written in its strings."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in IMPORT_IN_TEXT.finditer(node.value):
                base, names, plain = match.groups()
                if plain:
                    found += [(node.lineno, n.split()[0]) for n in plain.split(",") if n.strip()]
                else:
                    found.append((node.lineno, base))
                    found += [(node.lineno, f"{base}.{n.split()[0]}") for n in names.split(",")
                              if n.strip()]
    return found


def python_files():
    for root, dirs, files in os.walk(TESTS):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(root, name)


def test_no_module_of_the_suite_imports_a_test_module():
    offenders = []
    for path in python_files():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        relative = os.path.relpath(path, os.path.dirname(TESTS))
        # This module's strings are examples of what the check finds.
        strings = os.path.abspath(path) != os.path.abspath(__file__)
        offenders += sorted({f"{relative}:{line} imports {the_test_module(name)}"
                             for line, name in imported_modules(tree, strings)
                             if names_a_test_module(name)})
    assert not offenders, ("move what these import into a helper module beside them:\n"
                           + "\n".join(offenders))


def test_the_check_sees_every_form_of_import():
    source = ("import tests.engine.test_server\n"
              "from tests.train import test_learner as checks\n"
              "def f():\n"
              "    from .test_steps import trainer_for\n"
              "CHILD = '''\nfrom tests.rollout.test_stream import prompt_source\n'''\n"
              "import json\nfrom jax.test_util import check_grads\n"
              "from tests.engine.engines import start_engine\n")
    names = {name for _, name in imported_modules(ast.parse(source))
             if names_a_test_module(name)}
    assert names == {"tests.engine.test_server", "tests.train.test_learner",
                     ".test_steps", ".test_steps.trainer_for", "tests.rollout.test_stream",
                     "tests.rollout.test_stream.prompt_source"}
