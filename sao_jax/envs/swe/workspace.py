"""Workspaces: where a SWE agent's commands run, one per episode, behind one small protocol.

    ws = open_workspace(task, WorkspaceConfig(backend="namespace"))
    result = ws.run("python -m unittest -q", timeout=60)   # bash -c, in a fresh subshell at ws.root
    patch = ws.diff()                                        # the agent's changes as a git patch
    ws.close()

Backends (`WorkspaceConfig.backend`):
  namespace  the project's sandbox (`envs/sandbox/`): fresh namespaces per command, a fixed
             unprivileged uid per workspace, no network, resource limits, an allow-list filesystem
             view in which the workspace directory is the only writable place besides /tmp
             (`namespace.NamespaceWorkspace`).
  podman, docker
             a container per workspace through the runtime's CLI (`run -d --network=none ... IMAGE
             sleep infinity`, `exec` per command, `rm -f -t 0` at the end); the image name comes
             from `WorkspaceConfig.image_template` (`container.ContainerWorkspace`).

Every backend runs each command as an unprivileged user with stdout and stderr merged, in the
repository at `root`, and never lets a command outlive `timeout`. Both keep the repository and /tmp
on tmpfs mounts of `disk_bytes` each: a write past one fails with ENOSPC ("No space left on
device") and the episode goes on; the files are memory of the host (see each backend's docstring
for what that costs and what stays unbounded).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sao_jax.envs.swe.tasks import SWETask

BACKENDS = ("namespace", "podman", "docker")
PULL_POLICIES = ("missing", "never")


class WorkspaceError(RuntimeError):
    """A workspace could not be built or used (missing runtime, image, snapshot ...); the message
    names what is missing and how to get it."""


@dataclasses.dataclass(frozen=True)
class CommandResult:
    returncode: int | None  # None when the command was killed (timeout, output limit)
    output: str  # stdout and stderr together, in order (2>&1), cut to the output limit
    timed_out: bool
    truncated: bool  # more output than the limit; the command was killed
    seconds: float


@dataclasses.dataclass(frozen=True)
class WorkspaceConfig:
    """How workspaces are made. Sizes in bytes, times in seconds."""

    backend: str = "namespace"
    # container backends: the image of a task, formatted with the task's fields
    # ({instance_id}, {repo}, {version}, {id_docker}: instance_id with "__" -> "_1776_", lower
    # case, as SWE-bench's published images name them); a task's own `image` field wins.
    image_template: str = "docker.io/swebench/sweb.eval.x86_64.{id_docker}:latest"
    root: str = "/testbed"  # where the repository lives inside the workspace
    memory_bytes: int = 2 << 30
    max_processes: int = 256
    cpu_seconds: int = 600  # per command (namespace: RLIMIT_CPU)
    output_bytes: int = 1 << 20  # kept per command; more kills the command
    # the repository's tmpfs and /tmp's, each: a write past it fails with ENOSPC (both backends)
    disk_bytes: int = 1 << 30
    runtime_args: tuple[str, ...] = ()  # extra `podman run` / `docker run` arguments
    # container backends: "missing" pulls an image that is not here (rollout hosts with registry
    # access), "never" fails naming it instead.
    pull: str = "missing"
    container_user: str = "1000:1000"  # uid:gid that commands run as inside a container
    open_files: int = 4096  # RLIMIT_NOFILE (containers: `--ulimit nofile`, cut to the host's)
    # containers: RLIMIT_NPROC (`--ulimit nproc`, cut to the host's). It counts every process of
    # container_user on the host, across workspaces; max_processes (the container's pids cgroup)
    # is the per-workspace limit.
    user_processes: int = 16384

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"WorkspaceConfig.backend must be one of {BACKENDS}, "
                             f"got {self.backend!r}.")
        if self.pull not in PULL_POLICIES:
            raise ValueError(f"WorkspaceConfig.pull must be one of {PULL_POLICIES}, "
                             f"got {self.pull!r}.")
        for name in ("memory_bytes", "max_processes", "cpu_seconds", "output_bytes",
                     "disk_bytes", "open_files", "user_processes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"WorkspaceConfig.{name} must be positive, "
                                 f"got {getattr(self, name)}.")


class Workspace(Protocol):
    root: str  # the repository's path as commands see it

    def run(self, command: str, timeout: float, input: str | None = None) -> CommandResult:
        """`bash -c command` in a fresh subshell with cwd `root`; `input` is its stdin."""
        ...

    def close(self) -> None:
        """Removes the workspace and everything in it; idempotent."""
        ...


def open_workspace(task: SWETask, config: WorkspaceConfig) -> Workspace:
    """A new workspace holding `task`'s repository at its base commit.

    Raises:
      WorkspaceError: the backend cannot run here, or the task's snapshot or image is missing.
    """
    if config.backend == "namespace":
        from sao_jax.envs.swe.namespace import NamespaceWorkspace

        return NamespaceWorkspace.create(task, config)
    from sao_jax.envs.swe.container import ContainerWorkspace

    return ContainerWorkspace.create(task, config)


def prepare_snapshot(task: SWETask, dest: str) -> None:
    """Writes `task`'s repository, checked out at `task.base_commit`, into the new directory `dest`,
    holding that commit and nothing else.

    `task.workspace` is a directory holding a git repository, a git bundle file (`*.bundle`), or a
    plain directory without `.git` (copied, then made a git repository with one commit, so that
    patches can be taken against it). From a repository or a bundle, `dest` gets the base commit
    (the snapshot's HEAD where `base_commit` is empty: SWE-smith rows) under its own id, so that
    `git diff <base_commit>` works, in a shallow repository of depth 1 (`git init`,
    `git fetch --depth=1` of that commit, `checkout --detach`; a bundle, which cannot be fetched
    shallow, is first cloned whole into a temporary directory): `.git/shallow` names the commit,
    the object store holds it, its tree and their blobs, HEAD is detached at it, and there is no
    branch, tag, remote, stash, reflog, FETCH_HEAD or alternate. So the snapshot's other commits
    (the fix, the tests' commit, other branches, the history before the base) are not there for
    an agent to read (`git log --all`, `git show main:FILE`, `git cat-file --batch-all-objects`).
    Git runs here with hooks, fsmonitor, templates, reflogs, automatic gc and the global and
    system configuration off.

    Raises:
      WorkspaceError naming the task when the snapshot is missing or the commit is not in it.
    """
    import os
    import shutil
    import subprocess
    import tempfile

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
    with tempfile.TemporaryDirectory(prefix="sao-snapshot-") as tmp:
        origin = os.path.abspath(source)
        if source.endswith(".bundle"):
            origin = os.path.join(tmp, "bundle.git")
            git("clone", "-q", "--bare", os.path.abspath(source), origin)
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
