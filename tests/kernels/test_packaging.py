"""`sao_jax.kernels` is the repository's top-level kernels/ folder, and that folder never passes for
Hugging Face's `kernels`, which transformers imports (docs/layout.md, "How the kernels are
packaged")."""

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import sao_jax
from sao_jax import kernels

REPO = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", ".."))
FOLDER = os.path.join(REPO, "kernels")
MODULES = ("_common", "checks", "dis", "gae", "gae_cpu")


def test_sao_jax_kernels_is_the_top_level_folder_of_this_checkout():
    assert os.path.realpath(os.path.dirname(sao_jax.__file__)) == os.path.join(REPO, "sao_jax")
    assert [os.path.realpath(p) for p in kernels.__path__] == [FOLDER]
    for name in MODULES:
        module = importlib.import_module(f"sao_jax.kernels.{name}")
        assert os.path.realpath(module.__file__) == os.path.join(FOLDER, f"{name}.py")
    assert kernels.gae is sys.modules["sao_jax.kernels.gae"].gae


def test_a_child_with_this_checkout_on_its_path_runs_its_kernels(tmp_path):
    """How the tests' and helpers' children run (PYTHONPATH, another directory): they load this
    checkout's kernels, not those of a checkout that the virtualenv has in editable mode."""
    code = ("import sys, sao_jax.kernels; "
            "print(*(sys.modules[f'sao_jax.kernels.{m}'].__file__ for m in sys.argv[1:]))")
    child = subprocess.run([sys.executable, "-c", code, *MODULES], cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr
    assert [os.path.realpath(f) for f in child.stdout.split()] == [
        os.path.join(FOLDER, f"{name}.py") for name in MODULES]


def test_import_kernels_never_finds_the_folder_as_a_package():
    assert not os.path.exists(os.path.join(FOLDER, "__init__.py"))
    # Found alone, the folder is a namespace package: it has no __file__, which transformers'
    # check (`_is_package_available`) takes for no `kernels` installed, and any regular package
    # named `kernels` later on sys.path (Hugging Face's) comes before it.
    alone = importlib.machinery.PathFinder.find_spec("kernels", [REPO])
    assert alone.origin is None and alone.loader is None
    assert [os.path.realpath(p) for p in alone.submodule_search_locations] == [FOLDER]
    # From the repository root, first on sys.path as under `make test` and `make train`.
    code = ("import importlib.util; spec = importlib.util.find_spec('kernels'); "
            "print(spec and spec.origin)")
    child = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    origin = child.stdout.strip()
    assert origin == "None" or not os.path.realpath(origin).startswith(FOLDER + os.sep), origin
    try:
        installed = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed is not None:  # Hugging Face's (the dev extra): the one `import kernels` finds
        assert os.path.realpath(origin) == os.path.realpath(
            installed.locate_file(os.path.join("kernels", "__init__.py")))
