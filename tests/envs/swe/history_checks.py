"""What a task's workspace may hold of its repository: the base commit alone (the checks of
tests/envs/swe/test_workspace_contents.py).

An agent that could reach the task's later history could read the answer: the gold patch is a
later commit of the repository (swe_mini: the parent of every base commit, branch `main`;
SWE-bench: the upstream history that its images' /testbed was cloned with). So the checks are
by object id: every object of the task's source repository that is not the base commit's own,
and every blob that the gold patch or the test patch writes (`post_image_blobs`, computed here on
a full clone), must be missing from the workspace's object store; and what an agent would try
(`git log --all`, `git branch -a`, `git tag`, `git stash list`, `git reflog`,
`git cat-file --batch-all-objects`) must show the base commit alone (`assert_only_the_base`).

`make_history_task` builds a SWE-bench-style repository with everything that would leak: history
before the base, the fix on another branch with a tag, a remote-tracking ref, the test patch's
files on a branch, a stash, reflogs, FETCH_HEAD, ORIG_HEAD and a note.
"""

import os
import subprocess
import textwrap

from sao_jax.envs.swe.tasks import SWETask

GIT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


def git(repo, *args, input=None) -> str:
    return subprocess.run(["git", "-c", "init.defaultBranch=main", *args], cwd=repo,
                          env=GIT_ENV, input=input, text=True, capture_output=True,
                          check=True).stdout


def object_store(repo) -> set[str]:
    """The id of every object in `repo`'s object store (packed, loose, unreachable)."""
    return set(git(repo, "cat-file", "--batch-all-objects",
                   "--batch-check=%(objectname)").split())


def commit_objects(repo, commit: str) -> set[str]:
    """`commit`, its tree and every tree and blob under it."""
    listed = git(repo, "ls-tree", "-r", "-t", commit).splitlines()
    return {commit, git(repo, "rev-parse", f"{commit}^{{tree}}").strip(),
            *(line.split("\t")[0].split()[2] for line in listed)}


def post_image_blobs(checkout, base: str, patch: str) -> set[str]:
    """The ids of the blobs that `patch` writes over `base`: applied in `checkout` (a clone with
    `base`), each file it changes or adds `git hash-object`ed; the checkout is left clean."""
    git(checkout, "checkout", "-q", "-f", "--detach", base)
    git(checkout, "clean", "-q", "-f", "-d", "-x")
    git(checkout, "apply", input=patch)
    written = [entry[3:] for entry in git(checkout, "status", "--porcelain", "-z", "-uall")
               .split("\0") if entry and entry[1] != "D" and entry[0] != "D"]
    assert written, f"the patch writes no file over {base}"
    blobs = set(git(checkout, "hash-object", "--stdin-paths",
                    input="".join(p + "\n" for p in written)).split())
    git(checkout, "checkout", "-q", "-f", "--detach", base)
    git(checkout, "clean", "-q", "-f", "-d", "-x")
    return blobs


def forbidden_objects(task: SWETask, source, checkout) -> set[str]:
    """Every object the workspace of `task` must not hold: those of `source` (its snapshot
    repository, or a full clone of its bundle) and the post-images of its gold and test patches
    (`post_image_blobs` in `checkout`, a clone that may be `source` itself), less the base
    commit's own. Asserts that each patch writes a blob the base commit lacks (else checking it
    could not fail)."""
    base = commit_objects(source, task.base_commit)
    answers = set()
    for name, patch in (("gold patch", task.patch), ("test patch", task.test_patch)):
        new = post_image_blobs(checkout, task.base_commit, patch) - base
        assert new, f"{task.instance_id}: the {name} writes no blob that the base lacks"
        answers |= new
    return (object_store(source) | answers) - base


# What an agent would try, as the workspace's user, each answer after a marker line; `asked`
# reads the ids to look up from stdin.
PROBE = textwrap.dedent("""\
    echo '== asked'; git cat-file --batch-check='%(objectname) %(objecttype)'
    echo '== log'; git log --all --format=%H
    echo '== branch'; git branch -a
    echo '== tag'; git tag
    echo '== stash'; git stash list
    echo '== reflog'; git reflog
    echo '== remote'; git remote
    echo '== refs'; git for-each-ref --format='%(refname)'
    echo '== objects'; git cat-file --batch-all-objects --batch-check='%(objectname)'
    echo '== tree'; git ls-tree -r -t HEAD | cut -f1 | cut -d' ' -f3; git rev-parse 'HEAD^{tree}'
    echo '== shallow'; cat .git/shallow
    echo '== git dir'; ls -A .git
    echo '== end'
    """)
GIT_DIR_ENTRIES = {"HEAD", "config", "index", "objects", "refs", "shallow", "hooks", "info",
                   "description"}  # what a prepared or cut repository may keep in .git


def probe(output: str) -> dict[str, list[str]]:
    """PROBE's output as {section: lines}."""
    sections, name = {}, None
    for line in output.splitlines():
        if line.startswith("== "):
            name = line[3:]
            sections[name] = []
        elif name is not None:
            sections[name].append(line)
    assert "end" in sections, f"the probe did not finish: {output[-2000:]}"
    return sections


def assert_only_the_base(run, base: str, forbidden: set[str]) -> None:
    """Runs PROBE through `run(script, input) -> output` in the workspace's repository and
    asserts that it holds `base` alone: no object of `forbidden` (`cat-file --batch-check`:
    missing), its object store exactly the base commit's objects, one commit in `log --all`, no
    ref, branch, tag, stash, reflog or remote, `.git/shallow` naming `base`, and nothing in .git
    that names other commits (FETCH_HEAD, ORIG_HEAD, logs/, packed-refs ...)."""
    asked = sorted(forbidden)
    answer = probe(run(PROBE, "".join(f"{oid}\n" for oid in asked)))
    assert answer["asked"] == [f"{oid} missing" for oid in asked], [
        line for line in answer["asked"] if not line.endswith(" missing")]
    assert set(answer["objects"]) == {base} | set(answer["tree"]), answer["objects"]
    assert answer["log"] == [base]
    assert all(line.startswith("* (") for line in answer["branch"]), answer["branch"]
    for empty in ("tag", "stash", "reflog", "remote", "refs"):
        assert answer[empty] == [], (empty, answer[empty])
    assert answer["shallow"] == [base]
    assert set(answer["git dir"]) <= GIT_DIR_ENTRIES, answer["git dir"]


def host_runner(repo):
    """`run` for `assert_only_the_base` in a repository on this host."""
    def run(script: str, input: str) -> str:
        done = subprocess.run(["bash", "-c", script], cwd=repo, env=GIT_ENV, input=input,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return done.stdout
    return run


def workspace_runner(ws):
    """`run` for `assert_only_the_base` in a workspace."""
    def run(script: str, input: str) -> str:
        return ws.run(script, timeout=60, input=input).output
    return run


CALC = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
TEST_MUL = textwrap.dedent("""\
    import unittest

    from calc import mul


    class TestMul(unittest.TestCase):
        def test_mul(self):
            self.assertEqual(mul(2, 3), 6)
    """)
TEST_ADD = textwrap.dedent("""\
    import unittest

    from calc import add


    class TestAdd(unittest.TestCase):
        def test_add(self):
            self.assertEqual(add(2, 3), 5)
    """)


def _commit(repo, files: dict, message: str) -> str:
    for path, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(repo, path)) or repo, exist_ok=True)
        with open(os.path.join(repo, path), "w") as f:
            f.write(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


def make_history_task(root, instance_id="demo__calc-7") -> tuple[SWETask, dict[str, str]]:
    """A SWE-bench-style task whose repository (`root`/repo, HEAD on `main` at the base commit,
    its work tree clean) holds everything an agent could read the answer from, and those
    objects' ids by name: `first` (history before the base: the library without the bug),
    `tests` (the test patch's files, committed on branch `tests`), `fix` (the gold patch as a
    later commit on branch `fix`, where `main` was too before a reset: reflogs, ORIG_HEAD), `tag`
    (an annotated tag `v1.1` on the fix), `stash` (a stash holding the fix), `note` (a note on
    the base naming the fix). `refs/remotes/origin/main` and FETCH_HEAD name the fix too."""
    repo = os.path.join(str(root), "repo")
    os.makedirs(repo)
    git(repo, "init", "-q")
    ids = {"first": _commit(repo, {"calc.py": CALC, "tests/__init__.py": "",
                                   "tests/test_mul.py": TEST_MUL}, "calc")}
    base = _commit(repo, {"calc.py": CALC.replace("a + b", "a - b")}, "refactor add")
    git(repo, "checkout", "-q", "-b", "tests")
    ids["tests"] = _commit(repo, {"tests/test_add.py": TEST_ADD}, "test add")
    git(repo, "checkout", "-q", "-b", "fix", base)
    ids["fix"] = _commit(repo, {"calc.py": CALC.replace("a + b", "b + a")}, "fix add")
    git(repo, "tag", "-a", "v1.1", "-m", "release with the fix")
    ids["tag"] = git(repo, "rev-parse", "v1.1").strip()
    git(repo, "checkout", "-q", "main")
    git(repo, "merge", "-q", "--ff-only", "fix")
    git(repo, "reset", "-q", "--hard", base)
    git(repo, "remote", "add", "origin", "https://example.invalid/demo/calc.git")
    git(repo, "update-ref", "refs/remotes/origin/main", ids["fix"])
    git(repo, "symbolic-ref", "refs/remotes/origin/HEAD", "refs/remotes/origin/main")
    git(repo, "fetch", "-q", ".", "fix")  # FETCH_HEAD
    git(repo, "notes", "add", "-m", f"fixed in {ids['fix']}", base)
    ids["note"] = git(repo, "rev-parse", "refs/notes/commits").strip()
    with open(os.path.join(repo, "calc.py"), "w") as f:
        f.write(CALC.replace("a + b", "b + a"))
    git(repo, "stash", "-q")
    ids["stash"] = git(repo, "rev-parse", "refs/stash").strip()
    task = SWETask(
        instance_id=instance_id, repo="demo/calc", base_commit=base,
        problem_statement="add(2, 3) returns -1", version="1", environment_setup_commit=base,
        patch=git(repo, "diff", base, ids["fix"]),
        test_patch=git(repo, "diff", base, ids["tests"]),
        fail_to_pass=("tests.test_add.TestAdd.test_add",),
        pass_to_pass=("tests.test_mul.TestMul.test_mul",),
        workspace=repo, test_cmd="python -m unittest -v", log_parser="unittest")
    return task, ids
