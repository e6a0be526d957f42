"""The shape of sao_jax, read from its source with `ast` (docs/layout.md):

- imports run one way: no circle among sao_jax's modules, counting every import of a file
  (function-level and `if TYPE_CHECKING:` ones too, relative ones resolved);
- no function over 100 lines, no class over 300;
- at most 5 private names (`_name`) imported from one module of sao_jax into another: a split
  package gives what its files share public names, or a face (its `__init__`);
- the registries are the only lists: no module compares an algorithm's, a part's or an engine's
  name (`==`, `in`, `match`), compares a registry field (`config.algo`, `algo.policy_loss`,
  `config.rollout.engine`, ...) with a string, or asks which part an algorithm holds
  (`isinstance` outside the parts' modules); it calls the entry's parts or reads its fields.

Generated modules (`*_pb2.py`, `*_pb2_grpc.py`) are left out.
"""

import ast
import dataclasses
import os
import textwrap

import pytest

from sao_jax.train import advantages, algorithms, engines, policy_losses

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PACKAGE = os.path.join(REPO, "sao_jax")
MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 300
MAX_PRIVATE_IMPORTS = 5
# The registries, which name their entries; and the modules that define the parts, the only ones
# that may ask which part they hold.
REGISTRY_MODULES = ("train/algorithms.py", "train/engines.py")
PART_MODULES = ("train/algorithms.py", "train/advantages.py", "train/policy_losses.py")
# Fields that hold a registry's name or an entry's part: compared with a string, they branch on it.
REGISTRY_FIELDS = frozenset({"algo", "engine", "policy_loss", "advantage", "correction"})


@dataclasses.dataclass(frozen=True)
class Module:
    name: str  # sao_jax.a.b (a package: its __init__'s name is the package's)
    relative: str  # a/b.py, under sao_jax/
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.relative.endswith("__init__.py")


def python_files(root):
    """(path relative to `root`, path) of each source file under `root`, generated ones left out."""
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py") and not name.endswith(("_pb2.py", "_pb2_grpc.py")):
                path = os.path.join(directory, name)
                yield os.path.relpath(path, root).replace(os.sep, "/"), path


def load_modules(root, package="sao_jax") -> dict[str, Module]:
    modules = {}
    for relative, path in python_files(root):
        parts = relative[:-len(".py")].split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join([package, *parts])
        with open(path, encoding="utf-8") as f:
            modules[name] = Module(name, relative, ast.parse(f.read(), path))
    return modules


def imported_from(module: Module, node: ast.ImportFrom) -> str:
    """The absolute name of the module that `from ... import` reads, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    base = base[:len(base) - node.level + (1 if module.is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: Module, modules) -> list[tuple[str, str, int]]:
    """(module imported, name imported or "", line) for every import of a sao_jax module anywhere
    in `module`: `import a.b.c` reads the longest of a.b.c, a.b, a that is a module; `from a.b
    import c` reads a.b.c where that is a module, and a.b otherwise."""
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts:
                    found.append((".".join(parts), "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            source = imported_from(module, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    found.append((f"{source}.{alias.name}", "", node.lineno))
                elif source in modules:
                    found.append((source, alias.name, node.lineno))
    return found


def import_circles(modules) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)
    of the import graph (Tarjan's algorithm, iterative)."""
    edges = {name: sorted({target for target, _, _ in imports(module, modules)})
             for name, module in modules.items()}
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(edges[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    circles.append(sorted(component))
    return sorted(circles)


def private_imports(modules) -> list[str]:
    """`module: from source import _name` for each private name one module imports from another."""
    return sorted(f"{name}:{line}: from {source} import {imported}"
                  for name, module in modules.items()
                  for source, imported, line in imports(module, modules)
                  if imported.startswith("_") and not imported.startswith("__")
                  and source != name)


def oversized(modules) -> list[str]:
    """`[class ]module.qualname (N lines)` for each function over MAX_FUNCTION_LINES and each class
    over MAX_CLASS_LINES."""
    found = []

    def visit(node, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                lines = child.end_lineno - child.lineno + 1
                name = f"{prefix}{child.name}"
                if isinstance(child, ast.ClassDef) and lines > MAX_CLASS_LINES:
                    found.append((f"class {name}", lines))
                elif not isinstance(child, ast.ClassDef) and lines > MAX_FUNCTION_LINES:
                    found.append((name, lines))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    for name, module in modules.items():
        within = name.partition(".")[2]  # the module's name under its top-level package
        visit(module.tree, f"{within}." if within else "")
    return sorted(found)


def _strings(node) -> set[str]:
    """The string constants `node` is, or holds as a tuple, list or set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def _registry_field(node) -> str | None:
    """The registry field that `node` reads (`config.algo`, `algo.policy_loss.name`,
    `config.rollout.engine`, `engine`), or None."""
    while isinstance(node, ast.Attribute):
        if node.attr in REGISTRY_FIELDS:
            return node.attr
        node = node.value
    return node.id if isinstance(node, ast.Name) and node.id in REGISTRY_FIELDS else None


def comparisons(root) -> list[str]:
    """Where a module under `root` compares an algorithm's, a part's or an engine's name (`==`,
    `in`, `match`) or a registry field with a string, or asks which part it holds (`isinstance`
    outside the parts' modules). The registries themselves are left out."""
    parts = {part.name for algo in algorithms.ALGORITHMS.values()
             for part in (algo.advantage, algo.policy_loss)}
    classes = [cls for module in (advantages, policy_losses) for cls in vars(module).values()
               if isinstance(cls, type) and issubclass(
                   cls, advantages.Estimator | policy_losses.PolicyLoss
                   | policy_losses.Correction)]
    corrections = {cls.name for cls in classes
                   if issubclass(cls, policy_losses.Correction) and hasattr(cls, "name")}
    names = set(algorithms.ALGORITHMS) | parts | corrections | set(engines.ENGINES)
    part_classes = {cls.__name__ for cls in classes}
    found = []
    for relative, path in python_files(root):
        if relative in REGISTRY_MODULES:
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            compared, fields = set(), set()
            if isinstance(node, ast.Compare):
                operands = (node.left, *node.comparators)
                compared = set().union(*(_strings(n) for n in operands))
                if compared:
                    fields = {f for f in map(_registry_field, operands) if f}
            elif isinstance(node, ast.MatchValue):  # a `case "name":`
                compared = _strings(node.value)
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
                  and relative not in PART_MODULES and len(node.args) == 2):
                asked = {n.id if isinstance(n, ast.Name) else n.attr
                         for n in ast.walk(node.args[1]) if isinstance(n, ast.Name | ast.Attribute)}
                found += [(relative, node.lineno, f"isinstance(..., {c})")
                          for c in sorted(asked & part_classes)]
            found += [(relative, node.lineno, repr(name)) for name in sorted(compared & names)]
            if not compared & names:
                found += [(relative, node.lineno, f"{field} compared with a string")
                          for field in sorted(fields)]
    return [f"{relative}:{line}: {what}" for relative, line, what in sorted(found)]


# ----------------------------------------------------------------------------------- the tests

@pytest.fixture(scope="module")
def modules():
    return load_modules(PACKAGE)


def test_imports_run_one_way(modules):
    circles = import_circles(modules)
    assert not circles, ("import circles among sao_jax's modules (move what both sides need into "
                         "a module below them):\n" + "\n".join(" <-> ".join(c) for c in circles))


def test_few_private_names_cross_modules(modules):
    crossing = private_imports(modules)
    assert len(crossing) <= MAX_PRIVATE_IMPORTS, (
        f"{len(crossing)} private names imported across modules (at most "
        f"{MAX_PRIVATE_IMPORTS}); make what modules share public, or give the package a face:\n"
        + "\n".join(crossing))


def test_functions_and_classes_are_small(modules):
    found = oversized(modules)
    assert not found, ("over 100 lines (a function) or 300 (a class): split by units and "
                       "interfaces:\n" + "\n".join(f"{unit} ({n} lines)" for unit, n in found))


def test_no_module_compares_an_algorithm_or_engine_name():
    found = comparisons(PACKAGE)
    assert not found, ("a name or a registry field compared, or a part asked for, in sao_jax "
                       "outside the registries (call the entry's parts, or read its attributes, "
                       "instead):\n" + "\n".join(found))


# ------------------------------------------------------- the checks find what they look for

def _package(tmp_path, files: dict[str, str]):
    for relative, text in files.items():
        path = tmp_path / "pkg" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return load_modules(str(tmp_path / "pkg"), package="pkg")


def test_the_checks_find_circles_private_names_and_sizes(tmp_path):
    body = "\n".join(f"    x = {i}" for i in range(100))  # a function of 101 lines
    methods = "".join(f"    def m{i}(self):\n" + "\n".join(f"        x = {j}" for j in range(99))
                      + "\n" for i in range(3))  # 100 lines each: a class of 301
    modules = _package(tmp_path, {
        "__init__.py": "from .a import f\n",
        "a.py": "def f():\n    from pkg.sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from ..a import _g\nfrom pkg import sub\n",
        "d.py": "import pkg.sub.c\nfrom pkg.sub.c import _h, __all__\n",
        "big.py": f"def small():\n    pass\n\n\ndef large():\n{body}\n\n\nclass C:\n{methods}"
                  f"\n\nclass D:\n    def outer(self):\n        def inner():\n"
                  + textwrap.indent(body, "        ") + "\n",
    })
    assert import_circles(modules) == [["pkg.a", "pkg.sub.c"]]
    assert private_imports(modules) == ["pkg.d:2: from pkg.sub.c import _h",
                                        "pkg.sub.c:3: from pkg.a import _g"]
    assert oversized(modules) == [("big.D.outer", 102), ("big.D.outer.inner", 101),
                                  ("big.large", 101), ("class big.C", 301)]


def test_the_check_finds_the_comparisons_there_were(tmp_path):
    (tmp_path / "steps.py").write_text(
        'if algo.policy_loss == "dis" or config.rollout.engine in ("sglang", "x"):\n'
        '    pass\n'
        'match config.algo:\n'
        '    case "vapo":\n'
        '        pass\n'
        'if isinstance(algo.advantage, advantages.RunningMean):\n'
        '    pass\n'
        'if loss.correction.name == "icepop" or isinstance(loss.correction, TIS):\n'
        '    pass\n'
        'if config.algo == "not_registered_yet" or self.policy_loss.name != "":\n'
        '    pass\n'
        'if status == "running" or mode in ("a", "b"):\n'
        '    pass\n')
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "algorithms.py").write_text('if name == "sao":\n    pass\n')
    assert comparisons(tmp_path) == [
        "steps.py:1: 'dis'", "steps.py:1: 'sglang'", "steps.py:4: 'vapo'",
        "steps.py:6: isinstance(..., RunningMean)",
        "steps.py:8: 'icepop'", "steps.py:8: isinstance(..., TIS)",
        "steps.py:10: algo compared with a string",
        "steps.py:10: policy_loss compared with a string"]
