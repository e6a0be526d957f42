"""A task's repository for a workspace: `prepare_snapshot` writes its base commit, and nothing else
of its history, into a new directory, which each backend then puts at the workspace's root."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
import threading
from typing import TYPE_CHECKING

from sao_jax.envs.swe.workspace_base import WorkspaceError, pid_alive

if TYPE_CHECKING:
    from sao_jax.envs.swe.tasks import SWETask


def prepare_snapshot(task: SWETask, dest: str) -> None:
    """Writes `task`'s repository, checked out at `task.base_commit`, into the new directory `dest`,
    holding that commit and nothing else.

    `task.workspace` is a directory holding a git repository, a git bundle file (`*.bundle`), or a
    plain directory without `.git` (copied, then made a git repository with one commit, so that
    patches can be taken against it). From a repository or a bundle, `dest` gets the base commit
    (the snapshot's HEAD where `base_commit` is empty: SWE-smith rows) under its own id, so that
    `git diff <base_commit>` works, in a shallow repository of depth 1 (`git init`,
    `git fetch --depth=1` of that commit, `checkout --detach`; a bundle, which cannot be fetched
    shallow, is first cloned whole, once per process and version of the file, into a directory
    no workspace sees, `_bundle_clone`): `.git/shallow` names the commit,
    the object store holds it, its tree and their blobs, HEAD is detached at it, and there is no
    branch, tag, remote, stash, reflog, FETCH_HEAD or alternate. So the snapshot's other commits
    (the fix, the tests' commit, other branches, the history before the base) are not there for
    an agent to read (`git log --all`, `git show main:FILE`, `git cat-file --batch-all-objects`).
    Git runs here with hooks, fsmonitor, templates, reflogs, automatic gc and the global and
    system configuration off.

    Raises:
      WorkspaceError naming the task when the snapshot is missing or the commit is not in it.
    """
    source = task.workspace
    if not source:
        raise WorkspaceError(f"task {task.instance_id}: no `workspace` snapshot to copy (a "
                             "container image with the repository at its root is needed instead).")
    if not os.path.exists(source):
        raise WorkspaceError(f"task {task.instance_id}: workspace snapshot {source!r} not found.")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "GIT_TERMINAL_PROMPT": "0"}
    safe = ["-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false",
            "-c", "protocol.file.allow=always", "-c", "init.templateDir=",
            "-c", "core.logAllRefUpdates=false", "-c", "gc.auto=0",
            "-c", "maintenance.auto=false"]

    def git(*args, cwd=None):
        done = subprocess.run(["git", *safe, *args], cwd=cwd, env=env, capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise WorkspaceError(f"task {task.instance_id}: `git {' '.join(args)}` failed: "
                                 f"{done.stderr.strip()[-500:]}")
        return done.stdout

    is_repo = source.endswith(".bundle") or os.path.isdir(os.path.join(source, ".git"))
    if not is_repo:
        shutil.copytree(source, dest, symlinks=True)
        git("init", "-q", cwd=dest)
        git("add", "-A", cwd=dest)
        git("-c", "user.name=sao_jax", "-c", "user.email=sao_jax@localhost", "commit", "-q",
            "--no-verify", "-m", "snapshot", cwd=dest)
        return
    origin = os.path.abspath(source)
    if source.endswith(".bundle"):
        origin = _bundle_clone(origin, git)
    try:  # no base_commit (SWE-smith rows): the snapshot's own HEAD
        commit = git("rev-parse", "--verify", "--end-of-options",
                     f"{task.base_commit or 'HEAD'}^{{commit}}", cwd=origin).strip()
    except WorkspaceError as e:
        raise WorkspaceError(f"task {task.instance_id}: base_commit {task.base_commit} is "
                             f"not in {source}: {e}") from None
    git("init", "-q", dest)
    # The commit by its id, which protocol v0 serves only with allowAnySHA1InWant (passed on
    # to the upload-pack in origin through GIT_CONFIG_PARAMETERS); v2 serves any.
    git("-c", "uploadpack.allowAnySHA1InWant=true", "fetch", "-q", "--depth=1", "--no-tags",
        "--no-write-fetch-head", origin, commit, cwd=dest)
    git("checkout", "-q", "--detach", commit, cwd=dest)


_bundle_clones: dict[tuple, str] = {}  # a bundle's (path, device, inode, size, mtime) -> clone
_bundle_lock = threading.Lock()
_BUNDLE_PREFIX = "sao-bundle-"  # the clones' directories: sao-bundle-<pid>-XXXXXXXX


def _bundle_clone(bundle: str, git) -> str:
    """A bare clone of the bundle file at `bundle` (absolute), made by `git` once per process
    and version of the file (its device, inode, size and mtime) into a directory of its own
    (`tempfile.mkdtemp`: root's, mode 0700, under $TMPDIR, which no workspace sees). Snapshots
    fetch their commit from it, so they get copies of its objects; nothing writes to it after
    the clone. The clones are removed at exit, and those of processes that no longer run when
    a new one is made."""
    st = os.stat(bundle)
    key = (bundle, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _bundle_lock:
        if key not in _bundle_clones:
            _remove_stale_bundle_clones()
            parent = tempfile.mkdtemp(prefix=f"{_BUNDLE_PREFIX}{os.getpid()}-")
            try:
                git("clone", "-q", "--bare", bundle, os.path.join(parent, "bundle.git"))
            except BaseException:
                shutil.rmtree(parent, ignore_errors=True)
                raise
            if not _bundle_clones:
                atexit.register(_remove_bundle_clones)
            _bundle_clones[key] = parent
        return os.path.join(_bundle_clones[key], "bundle.git")


def _remove_bundle_clones() -> None:
    with _bundle_lock:
        for parent in _bundle_clones.values():
            shutil.rmtree(parent, ignore_errors=True)
        _bundle_clones.clear()


def _remove_stale_bundle_clones() -> None:
    """Removes the bundle clones that processes which no longer run left in $TMPDIR."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        pid = name.removeprefix(_BUNDLE_PREFIX).split("-")[0]
        if name.startswith(_BUNDLE_PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
