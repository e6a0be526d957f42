"""Workspaces: where a SWE agent's commands run, one per episode, behind one small protocol.

    ws = open_workspace(task, WorkspaceConfig(backend="namespace"))
    result = ws.run("python -m unittest -q", timeout=60)   # bash -c, in a fresh subshell at ws.root
    ws.close()
    ws, first = open_and_run(task, config, "git rev-parse HEAD", timeout=60)  # and a first command
    steps = Steps([Step("git status", 30), Step("git diff", 60)])  # several commands as one
    status, diff = steps.results(ws.run(steps.command, steps.timeout, steps.input))

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

Every command of the namespace backend is a sandbox of its own, the costly part of a SWE episode
on the host: `open_and_run` makes a workspace's first command the sandbox that probes it, and
`Steps` runs the commands that the environment and the grader run one after another as one.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import secrets
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
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


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of `Steps`: `bash -c command` with stdin `input` (None: /dev/null), killed
    after `timeout` seconds; `quiet`: its output comes back only where it fails."""

    command: str
    timeout: float
    input: str | None = None
    quiet: bool = False


STEPS_GRACE_SECONDS = 30.0  # the whole command's time beyond its steps' (start, stdin split)


class Steps:
    """Commands run one after another as one command of a workspace (in the namespace backend:
    one sandbox rather than one each), each with what `run` would give it alone: `bash -c` at
    the root, its own stdin (a file of its `input`), stderr merged, killed with its process
    group after its own `timeout` (coreutils' `timeout -s KILL`, as the container backend runs
    every command), and its own output and exit status, told apart by a line with a random
    marker that follows each step's output.

        steps = Steps([Step(listing, 30), Step(apply, 120, input=patch)])
        listed, applied = steps.results(ws.run(steps.command, steps.timeout, steps.input))

    With `stop_at_failure`, a step that fails (exit status not 0) ends the command. Unlike
    commands of their own, the steps share the workspace's output limit (the marker lines,
    about 40 bytes a step, count against it) and the command's life: what a step leaves in
    /tmp, or running outside its process group, the next step meets. Meant for the commands
    of the environment and the grader, not for an agent's.
    """

    def __init__(self, steps: Sequence[Step], stop_at_failure: bool = False):
        if not steps:
            raise ValueError("Steps needs at least one step")
        for step in steps:
            if not step.timeout > 0:
                raise ValueError(f"timeout must be positive, got {step.timeout}")
        self.steps = tuple(steps)
        self.stop_at_failure = stop_at_failure
        self.marker = f"SAO_STEP_{secrets.token_hex(8)}"
        lines = []
        if any(s.input is not None or s.quiet for s in self.steps):  # files of their own
            lines += ['d=$(mktemp -d) || exit 90', 'trap \'rm -rf "$d"\' EXIT']
        sizes = [None if s.input is None else len(s.input.encode("utf-8", "surrogatepass"))
                 for s in self.steps]
        lines += [f'head -c {size} >"$d/in{i}" || exit 90'
                  for i, size in enumerate(sizes) if size is not None]
        for i, step in enumerate(self.steps):
            stdin = "/dev/null" if step.input is None else f'"$d/in{i}"'
            out = f' >"$d/out{i}"' if step.quiet else ""
            # The group's 2>/dev/null takes the shell's own "Killed" line of a step that its
            # timeout killed; the step's stderr goes to its stdout.
            lines += ["SECONDS=0",
                      f"{{ timeout -s KILL {step.timeout:.3f} bash -c {shlex.quote(step.command)} "
                      f"<{stdin}{out} 2>&1; }} 2>/dev/null",
                      "rc=$?"]
            if step.quiet:
                lines.append(f'[ $rc -eq 0 ] || cat "$d/out{i}"')
            lines.append(f"printf '\\n%s %s %s %s\\n' {self.marker} {i} \"$rc\" \"$SECONDS\"")
            if stop_at_failure:
                lines.append('[ $rc -eq 0 ] || exit $rc')
        self.command = "\n".join(lines) + "\n"
        self.timeout = sum(s.timeout for s in self.steps) + STEPS_GRACE_SECONDS
        given = [s.input for s in self.steps if s.input is not None]
        self.input = "".join(given) if given else None

    def results(self, result: CommandResult) -> list[CommandResult | None]:
        """Each step's result, read from the whole command's `result`.

        A step that ended has its exit status (None when its own timeout killed it: status
        137 at its timeout, `timed_out`), its output and its duration in whole seconds. The
        first step that did not end within the command (the output limit or the command's
        timeout cut it, or the command died) has the output it printed, `truncated` and
        `timed_out` of the whole command and its exit status where it was not cut; the steps
        after it, and those after a failure with `stop_at_failure`, are None.
        """
        out: list[CommandResult | None] = []
        at = 0
        for i, step in enumerate(self.steps):
            if at is None:
                out.append(None)
                continue
            m = re.compile(rf"\n{self.marker} {i} (\d+) (\d+)\n").search(result.output, at)
            if m is None:
                cut = result.truncated or result.timed_out
                out.append(CommandResult(None if cut else result.returncode,
                                         result.output[at:], result.timed_out,
                                         result.truncated, result.seconds))
                at = None
                continue
            code, seconds = int(m[1]), float(m[2])
            timed_out = code == 128 + 9 and seconds >= step.timeout - 1
            out.append(CommandResult(None if timed_out else code, result.output[at:m.start()],
                                     timed_out, False, seconds))
            at = None if code and self.stop_at_failure else m.end()
        return out


def open_workspace(task: SWETask, config: WorkspaceConfig) -> Workspace:
    """A new workspace holding `task`'s repository at its base commit.

    Raises:
      WorkspaceError: the backend cannot run here, or the task's snapshot or image is missing.
    """
    return _backend(config).create(task, config)


def open_and_run(task: SWETask, config: WorkspaceConfig, command: str, timeout: float,
                 input: str | None = None) -> tuple[Workspace, CommandResult]:
    """`open_workspace`, and the result of its first command, `run(command, timeout, input)`.

    The namespace backend runs the first command in the sandbox that probes the new workspace
    (`NamespaceWorkspace.create_and_run`): one sandbox fewer than opening, then running. The
    workspace is closed when the command raises.

    Raises:
      WorkspaceError: as `open_workspace`, or as `run`.
    """
    return _backend(config).create_and_run(task, config, command, timeout, input)


def _backend(config: WorkspaceConfig):
    """The class of `config.backend`'s workspaces."""
    if config.backend == "namespace":
        from sao_jax.envs.swe.namespace import NamespaceWorkspace

        return NamespaceWorkspace
    from sao_jax.envs.swe.container import ContainerWorkspace

    return ContainerWorkspace


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


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this machine (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
