"""A tiny live SWE task (`make_tiny_task`): a git repository of a two-function module whose `add`
subtracts, with its fix and the test that shows it as patches. The grading and grading-CLI tests
grade patches of it."""

import os
import subprocess
import textwrap

from sao_jax.envs.swe.tasks import SWETask

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TEST_MUL = textwrap.dedent("""\
    import unittest

    from calc import mul


    class TestMul(unittest.TestCase):
        def test_mul(self):
            self.assertEqual(mul(2, 3), 6)

        @unittest.skip("not this one")
        def test_skip(self):
            pass
    """)
TEST_ADD = textwrap.dedent("""\
    import unittest

    from calc import add


    class TestAdd(unittest.TestCase):
        def test_add(self):
            '''Adds.

            Two numbers.'''
            self.assertEqual(add(2, 3), 5)
    """)
GIT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


def git(repo, *args, input=None):
    return subprocess.run(["git", *args], cwd=repo, env=GIT_ENV, input=input, text=True,
                          capture_output=True, check=True).stdout


def change_as_patch(repo, files: dict) -> str:
    """The patch that writes `files` (path -> text) over the repository's HEAD; the work tree
    is left at HEAD."""
    for path, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(repo, path)) or repo, exist_ok=True)
        with open(os.path.join(repo, path), "w") as f:
            f.write(text)
    git(repo, "add", "-A")
    patch = git(repo, "diff", "--cached", "--binary", "HEAD")
    git(repo, "reset", "-q", "--hard", "HEAD")
    return patch


def make_tiny_task(root, instance_id="tiny__calc-1") -> SWETask:
    """A task on a two-function module: `add` subtracts; tests.test_add (in test_patch) shows it,
    tests.test_mul passes (one of its tests is skipped)."""
    repo = os.path.join(str(root), "repo")
    os.makedirs(os.path.join(repo, "tests"))
    for path, text in {"calc.py": CALC, "tests/__init__.py": "", "tests/test_mul.py": TEST_MUL,
                       ".gitignore": "__pycache__/\n"}.items():
        with open(os.path.join(repo, path), "w") as f:
            f.write(text)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    return SWETask(
        instance_id=instance_id, repo="tiny/calc", base_commit=base,
        problem_statement="add(2, 3) returns -1", version="1", environment_setup_commit=base,
        patch=change_as_patch(repo, {"calc.py": CALC.replace("a - b", "a + b")}),
        test_patch=change_as_patch(repo, {"tests/test_add.py": TEST_ADD}),
        fail_to_pass=("tests.test_add.TestAdd.test_add",),
        pass_to_pass=("tests.test_mul.TestMul.test_mul",),  # test_skip: skipped, not listed
        workspace=repo, test_cmd="python -m unittest -v", log_parser="unittest")
