"""A task's workspace holds its base commit alone: nothing of the repository's later history (the
gold patch, the test patch), other branches, tags, remotes, the stash or the reflogs, whichever
way the repository arrives (`snapshot.prepare_snapshot` from a git directory or a bundle, or an
image's repository cut down by `container._CUT_HISTORY`) and on either backend.

The checks are by object id (tests/envs/swe/history_checks.py): every object of the task's
source repository beyond the base commit's own, and every blob that the gold patch or the test
patch writes (computed here, on a full clone), is missing from the workspace's object store, and
what an agent would try (`git log --all`, `git branch -a`, `git cat-file --batch-all-objects`,
...) sees the base commit alone. Every bundled swe_mini task is checked from `prepare_snapshot`
on the host (about 5 s); live workspaces check a few of them (all 50 on the namespace backend
under the `slow` marker: about 0.25 s each) and a SWE-bench-style repository
(`make_history_task`) as a git directory, as a bundle and, on podman, as an image's /testbed.
Namespace tests need the sandbox (`isolated`), podman tests the base image (`image`): each is
skipped with the reason where it is missing.
"""

import dataclasses
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from sao_jax.envs.swe import container, snapshot
from sao_jax.envs.swe.grading import extract_patch, grade
from sao_jax.envs.swe.tasks import load_tasks
from sao_jax.envs.swe.workspace import (
    WorkspaceConfig,
    WorkspaceError,
    open_workspace,
    prepare_snapshot,
)
from tests.envs.swe.history_checks import (
    GIT_ENV,
    assert_only_the_base,
    forbidden_objects,
    git,
    host_runner,
    make_history_task,
    workspace_runner,
)

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "experiments", "data",
                    "swe_mini")
NAMESPACE = WorkspaceConfig(max_processes=64, cpu_seconds=30)
# live swe_mini checks in `make test`; the other tasks' run under `make test-slow`
LIVE = (0, 24, 49)
PODMAN_LIVE = (0, 49)


def podman_config(image: str) -> WorkspaceConfig:
    return WorkspaceConfig(backend="podman", pull="never", image_template=image,
                           max_processes=64, memory_bytes=512 << 20)


@pytest.fixture(scope="module")
def swe_mini(tmp_path_factory):
    """The 50 swe_mini tasks and `forbidden(task)`: the objects its workspace must not hold
    (the bundle's, less the base commit's, and the patches' post-images), from one full clone of
    the bundle."""
    tasks = load_tasks(os.path.join(DATA, "tasks.jsonl"))
    assert len(tasks) == 50
    clone = str(tmp_path_factory.mktemp("swe_mini") / "clone")
    git(".", "clone", "-q", "--no-checkout", os.path.abspath(tasks[0].workspace), clone)
    known = {}

    def forbidden(task):
        if task.instance_id not in known:
            known[task.instance_id] = forbidden_objects(task, clone, clone)
            # the fix: the base commit's parent, the pristine library (branch main)
            assert task.environment_setup_commit in known[task.instance_id]
        return known[task.instance_id]

    return tasks, forbidden


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """The SWE-bench-style task (`make_history_task`), its named objects, the objects its
    workspace must not hold, and a bundle of its repository with every ref."""
    root = tmp_path_factory.mktemp("history")
    task, ids = make_history_task(root)
    checkout = str(root / "checkout")
    git(".", "clone", "-q", task.workspace, checkout)
    forbidden = forbidden_objects(task, task.workspace, checkout)
    assert set(ids.values()) <= forbidden
    bundle = str(root / "repo.bundle")
    git(task.workspace, "bundle", "create", "-q", bundle, "--all")
    return task, ids, forbidden, bundle


def test_every_swe_mini_snapshot_holds_its_base_commit_alone(swe_mini, tmp_path):
    tasks, forbidden = swe_mini
    start = time.monotonic()
    for task in tasks:
        dest = str(tmp_path / task.instance_id)
        prepare_snapshot(task, dest)
        assert_only_the_base(host_runner(dest), task.base_commit, forbidden(task))
    print(f"50 swe_mini snapshots prepared and checked in {time.monotonic() - start:.1f} s")


@pytest.mark.parametrize("kind", ["directory", "bundle"])
def test_a_snapshot_with_history_holds_its_base_commit_alone(history, kind, tmp_path):
    task, _, forbidden, bundle = history
    if kind == "bundle":
        task = dataclasses.replace(task, workspace=bundle)
    dest = str(tmp_path / "repo")
    prepare_snapshot(task, dest)
    assert_only_the_base(host_runner(dest), task.base_commit, forbidden)
    assert git(dest, "status", "--porcelain") == ""
    git(dest, "apply", input=task.patch)
    assert git(dest, "diff", task.base_commit) == task.patch  # the base commit keeps its id
    no_base = dataclasses.replace(task, base_commit="")  # the snapshot's HEAD: main, the base
    prepare_snapshot(no_base, str(tmp_path / "head"))
    assert_only_the_base(host_runner(str(tmp_path / "head")), task.base_commit, forbidden)


def test_a_bundle_is_cloned_once_per_process_and_version(history, tmp_path, monkeypatch):
    task, _, forbidden, bundle = history
    copy = tmp_path / "repo.bundle"
    shutil.copy(bundle, copy)
    task = dataclasses.replace(task, workspace=str(copy))
    clones, run = [], subprocess.run

    def recording(argv, *args, **kwargs):
        clones.extend([argv] if "clone" in argv else [])
        return run(argv, *args, **kwargs)

    monkeypatch.setattr(snapshot.subprocess, "run", recording)
    for i in range(3):
        prepare_snapshot(task, str(tmp_path / f"s{i}"))
        assert_only_the_base(host_runner(str(tmp_path / f"s{i}")), task.base_commit, forbidden)
        assert not os.path.exists(tmp_path / f"s{i}" / ".git" / "objects" / "info" / "alternates")
    assert len(clones) == 1
    clone = clones[0][-1]
    assert os.stat(os.path.dirname(clone)).st_mode & 0o777 == 0o700
    assert os.path.basename(os.path.dirname(clone)).startswith(f"sao-bundle-{os.getpid()}-")
    # a new version of the file (another mtime) is cloned again, the old clone stays in use
    os.utime(copy, ns=(os.stat(copy).st_atime_ns, os.stat(copy).st_mtime_ns + 10**9))
    prepare_snapshot(task, str(tmp_path / "s3"))
    assert_only_the_base(host_runner(str(tmp_path / "s3")), task.base_commit, forbidden)
    assert len(clones) == 2 and os.path.isdir(clone)
    # a dead process's clones go when the next clone is made
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tempfile.mkdtemp(prefix=f"sao-bundle-{dead.pid}-")
    os.utime(copy, ns=(os.stat(copy).st_atime_ns, os.stat(copy).st_mtime_ns + 10**9))
    prepare_snapshot(task, str(tmp_path / "s4"))
    assert len(clones) == 3 and not os.path.exists(stale)
    snapshot._remove_bundle_clones()  # what runs at exit
    assert not os.path.exists(clone) and not os.path.exists(os.path.dirname(clones[2][-1]))


def cut(repo, path=GIT_ENV["PATH"]) -> subprocess.CompletedProcess:
    """Runs `_CUT_HISTORY`, the root exec's cut of an image's repository, on `repo` here."""
    return subprocess.run(["/bin/sh", "-c", container._CUT_HISTORY, "sh", str(repo)],
                          env={**GIT_ENV, "PATH": path}, capture_output=True, text=True)


def test_the_cut_of_an_image_repository_leaves_its_head_alone(history, tmp_path):
    """The history repository, with a linked worktree on the fix, a commit-graph and its objects
    borrowed from a mirror (alternates), cut as a container's root exec would cut /testbed."""
    task, ids, forbidden, _ = history
    testbed = tmp_path / "testbed"
    shutil.copytree(task.workspace, testbed, symlinks=True)
    git(testbed, "clone", "-q", "--mirror", str(testbed), str(tmp_path / "borrowed.git"))
    (testbed / ".git" / "objects" / "info" / "alternates").write_text(
        str(tmp_path / "borrowed.git" / "objects") + "\n")
    for loose in (testbed / ".git" / "objects").glob("??"):  # every object is the mirror's
        shutil.rmtree(loose)
    git(testbed, "repack", "-a", "-d", "-l", "-q")
    assert "count: 0\nsize: 0\nin-pack: 0\n" in git(testbed, "count-objects", "-v")
    git(testbed, "fsck", "--no-dangling")
    git(testbed, "worktree", "add", "-q", str(tmp_path / "worktree"), ids["fix"])
    git(testbed, "commit-graph", "write", "--reachable")
    done = cut(testbed)
    assert done.returncode == 0, done.stderr
    assert_only_the_base(host_runner(testbed), task.base_commit, forbidden)
    assert git(testbed, "status", "--porcelain") == ""
    assert git(testbed, "rev-parse", "--abbrev-ref", "HEAD") == "HEAD\n"  # detached
    git(testbed, "fsck", "--no-dangling")


def test_the_cut_names_a_missing_git_and_skips_a_root_without_one(history, tmp_path):
    task, _, _, _ = history
    testbed = tmp_path / "testbed"
    shutil.copytree(task.workspace, testbed, symlinks=True)
    assert cut(testbed, path="/nonexistent").returncode == 5  # .git, but no git
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("a\n")
    assert cut(plain).returncode == 0 and os.listdir(plain) == ["a.txt"]
    unborn = tmp_path / "unborn"
    git(".", "init", "-q", str(unborn))
    assert cut(unborn).returncode == 7  # no commit at HEAD


# ----------------------------------------------------------------------------- namespace


@pytest.mark.parametrize("index", [i if i in LIVE else pytest.param(i, marks=pytest.mark.slow)
                                   for i in range(50)])
def test_a_swe_mini_namespace_workspace_holds_its_base_commit_alone(isolated, swe_mini, index):
    tasks, forbidden = swe_mini
    task = tasks[index]
    with open_workspace(task, NAMESPACE) as ws:
        assert_only_the_base(workspace_runner(ws), task.base_commit, forbidden(task))


@pytest.mark.parametrize("kind", ["directory", "bundle"])
def test_a_namespace_workspace_with_history_holds_its_base_commit_alone(isolated, history,
                                                                        kind):
    task, _, forbidden, bundle = history
    if kind == "bundle":
        task = dataclasses.replace(task, workspace=bundle)
    with open_workspace(task, NAMESPACE) as ws:
        assert_only_the_base(workspace_runner(ws), task.base_commit, forbidden)
        ws.run("sed -i 's/a - b/a + b/' calc.py && "
               "git -c user.name=a -c user.email=a@a commit -qam mine", timeout=10)
        assert "+    return a + b" in extract_patch(ws, base=task.base_commit)
    graded = grade(task, task.patch, NAMESPACE)
    assert graded.resolved, graded.reason


# ----------------------------------------------------------------------------- podman


@pytest.mark.parametrize("index", PODMAN_LIVE)
def test_a_swe_mini_podman_workspace_holds_its_base_commit_alone(image, swe_mini, index):
    tasks, forbidden = swe_mini
    task = tasks[index]
    with open_workspace(task, podman_config(image)) as ws:
        assert_only_the_base(workspace_runner(ws), task.base_commit, forbidden(task))


def podman(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *container.find_runtime("podman").global_args, *args],
                          capture_output=True, text=True, check=True)


@pytest.fixture(scope="module")
def history_images(image, history):
    """Two images FROM the base image with the history repository at /testbed, as SWE-bench's
    hold theirs: with git, and without (/usr/bin/git removed)."""
    task = history[0]
    tags = (f"localhost/sao-jax/test-history:{os.getpid()}",
            f"localhost/sao-jax/test-history-no-git:{os.getpid()}")
    name = f"sao-jax-test-history-{os.getpid()}"
    try:
        podman("create", "--name", name, image, "true")
        podman("cp", task.workspace, f"{name}:/testbed")
        podman("commit", "-q", name, tags[0])
        podman("rm", "-f", name)
        podman("run", "--name", name, "--network=none", "--ulimit", "nofile=1024:1024",
               "--ulimit", "nproc=1024:1024", tags[0], "rm", "/usr/bin/git")
        podman("commit", "-q", name, tags[1])
        yield tags
    finally:
        subprocess.run(["podman", "rm", "-f", name], capture_output=True)
        subprocess.run(["podman", "rmi", "-f", *tags], capture_output=True)


def test_a_podman_workspace_of_a_snapshot_with_history_holds_its_base_commit_alone(image,
                                                                                   history):
    task, _, forbidden, _ = history
    with open_workspace(task, podman_config(image)) as ws:
        assert_only_the_base(workspace_runner(ws), task.base_commit, forbidden)


def test_an_image_repository_is_cut_to_its_base_commit(history, history_images):
    task, _, forbidden, _ = history
    in_image = dataclasses.replace(task, workspace=None, image=history_images[0])
    config = podman_config(history_images[0])
    start = time.monotonic()
    with open_workspace(in_image, config) as ws:
        print(f"podman workspace of an image repository, cut: {time.monotonic() - start:.2f} s")
        assert_only_the_base(workspace_runner(ws), task.base_commit, forbidden)
        status = ws.run("git status --porcelain; stat -c %u .git/objects", timeout=10)
        assert status.output == "1000\n", status.output
    graded = grade(in_image, task.patch, config)
    assert graded.resolved, graded.reason
    assert not grade(in_image, "", config).resolved


def test_an_image_repository_without_git_is_named(history, history_images):
    task = dataclasses.replace(history[0], workspace=None, image=history_images[1])
    with pytest.raises(WorkspaceError, match="holds a git repository at /testbed but no git"):
        open_workspace(task, podman_config(history_images[1]))
