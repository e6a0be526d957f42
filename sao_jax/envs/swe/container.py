"""Container workspaces: one podman (or docker) container per episode, driven through the CLI.

    run -d --network=none --memory M+2D --pids-limit P --ulimit nofile=N:N --ulimit nproc=U:U
        --init --security-opt no-new-privileges --cap-drop ALL --cap-add CHOWN,DAC_OVERRIDE,FOWNER
        --mount type=tmpfs,destination=ROOT,tmpfs-size=D[,tmpcopyup]
        --mount type=tmpfs,destination=/tmp,tmpfs-size=D,tmpfs-mode=1777
        [runtime_args] IMAGE sleep infinity
    exec -i --user 1000:1000 -w ROOT -e HOME=/tmp NAME sh -c WRAPPER   # once per command
    rm -f -t 0 NAME                                                    # close()

The container's own processes (the init and `sleep infinity`) run as root and only keep it alive;
every command runs as `WorkspaceConfig.container_user`, which holds no capabilities and cannot
gain any (no-new-privileges). The three capabilities left to root serve the root `exec`s that
install the repository: the task's `workspace` snapshot is prepared on the host
(`prepare_snapshot`: the base commit alone, in a shallow repository), copied in at `root` (`cp`)
and handed to the user (`chown -R`); without a snapshot, the image must hold the repository at
`root` (SWE-bench's images have /testbed, with the repository's later history, the fix among
it), and one root `exec` cuts it down to what `prepare_snapshot` leaves before handing it to the
user the same way: HEAD detached at its commit and made a shallow boundary; every other ref, the
remotes, the stash and the reflogs deleted; the objects HEAD needs repacked (out of alternates
too), the alternates and every other object removed (`_CUT_HISTORY`). So no commit, tree or blob
but the base commit's is in the workspace for the agent to read (`git log --all`, `git show`,
`git cat-file --batch-all-objects`). That needs git in the image (a WorkspaceError names it
where a repository is there and git is not); a root without .git is handed over as it is.

Disk: the repository at `root` and /tmp are tmpfs mounts of D = `WorkspaceConfig.disk_bytes`
each, so a write past either fails with ENOSPC and the workspace goes on (delete the file and
write again). Without a snapshot, podman copies the image's repository into the tmpfs when the
container starts (`tmpcopyup`); a repository (image or snapshot) larger than D fails `create`
naming `disk_bytes`. tmpfs files are memory, charged to the container's memory cgroup: its limit
is `memory_bytes` plus both tmpfs sizes, so that full tmpfs mounts leave the processes their
`memory_bytes` (with the limit at `memory_bytes` alone, filling a tmpfs past it had the OOM
killer kill every command, the files staying). Not bounded: the rest of the container's writable
layer (/var/tmp and whatever else of the image the user may write), which lies on the host's
container storage: podman's `--storage-opt size=` would bound it, but needs overlay on XFS with
project quotas (here: overlay on ext4, where podman refuses it). docker has no `tmpcopyup`: a
docker workspace without a snapshot keeps the image's repository in its writable layer
(unbounded), with a snapshot it is bounded as with podman.

A command runs in `timeout -s KILL` with stderr merged into stdout, then every process of the
user is killed (`kill -9 -1`), so nothing it started outlives it, not even `setsid` children; the
host kills the `exec` client too if the container stops answering. Commands of one workspace run
one at a time.

What the runtime needs on this host is read once per process from `podman info`: on cgroup v1
hosts (where crun 1.8 refuses hybrid hierarchies) runc is chosen when installed, and without a
running systemd the cgroupfs manager. Containers are named `sao-ws-<random>` and labelled
`sao_jax.workspace=1` and with their process's pid; `remove_stale_containers()` removes the
ones a dead process left.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import secrets
import selectors
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from typing import TYPE_CHECKING

from sao_jax.envs.swe.snapshot import prepare_snapshot
from sao_jax.envs.swe.workspace_base import (
    CommandResult,
    WorkspaceConfig,
    WorkspaceError,
)

if TYPE_CHECKING:
    from sao_jax.envs.swe.tasks import SWETask

LABEL = "sao_jax.workspace"
PID_LABEL = "sao_jax.pid"  # the process that made the container
SETUP_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER")  # root's, for the repository's copy
HOST_GRACE_SECONDS = 15.0  # beyond a command's timeout, before the host kills the exec client
CLI_TIMEOUT_SECONDS = 120.0  # run -d, cp, rm: a runtime that hangs longer is broken
INSTALL_HINTS = {"podman": "`apt-get install podman`, and runc on cgroup v1 hosts",
                 "docker": "`apt-get install docker.io`, and start the docker engine"}

# Runs as the user: $1 CPU seconds, $2 timeout, $3 the command, with stderr merged (the exec
# client's own stderr then holds only the runtime's errors). The wrapper stays outside timeout's
# process group, then kills whatever of the user's is left (kill -1 spares itself).
_WRAPPER = ('exec 2>&1\n'
            'ulimit -t "$1" 2>/dev/null\n'
            'timeout -s KILL "$2" bash -c "$3"\n'
            'rc=$?\n'
            'kill -9 -1 2>/dev/null\n'
            'exit $rc\n')


# Run as root first in every container: names the tools missing for _WRAPPER (exit 4).
_TOOLS = ('missing=""\n'
          'for tool in bash timeout; do command -v $tool >/dev/null || missing="$missing $tool"; '
          'done\n'
          'if [ -n "$missing" ]; then echo $missing; exit 4; fi\n')

# Run as root without a snapshot, in the image's repository at $1 before the user gets it: leaves
# what `prepare_snapshot` leaves, HEAD's commit alone (SWE-bench's images hold the repository's
# later history, the fix among it). HEAD is detached at its commit and made a shallow boundary;
# every ref (branches, tags, remote-tracking refs, the stash, notes), the remotes, the reflogs
# and whatever else of .git names other commits (FETCH_HEAD, ORIG_HEAD, packed-refs,
# COMMIT_EDITMSG, rr-cache, worktrees, commit-graph ...) go; `repack -a -d` packs what HEAD and
# the index need, alternates' objects included (.keep and .promisor marks, which would keep
# whole packs, removed first), then the alternates go and `prune` removes the rest. Git runs
# with --git-dir (no ownership check), hooks, fsmonitor, reflogs, automatic gc and the global
# and system configuration off. Exit 5: a .git but no git; 7: HEAD names no commit; 6: a step
# failed (its message on stderr). No .git: nothing to cut. About 0.1 s for requests' /testbed
# (11k commits, a 40 MB pack): the walk stops at HEAD's commit.
_CUT_HISTORY = r"""(
set -e
cd "$1"
[ -e .git ] || exit 0
command -v git >/dev/null || exit 5
g() {
  HOME=/nonexistent GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null \
    git --git-dir=.git --work-tree=. -c core.hooksPath=/dev/null -c core.fsmonitor=false \
    -c core.logAllRefUpdates=false -c gc.auto=0 -c maintenance.auto=false "$@"
}
head=$(g rev-parse --verify -q 'HEAD^{commit}') || exit 7
d=$(g rev-parse --absolute-git-dir)
g update-ref --no-deref HEAD "$head"
g for-each-ref --format='delete %(refname)' | g update-ref --no-deref --stdin
g remote | while IFS= read -r r; do g remote remove "$r"; done
for f in "$d"/* "$d"/info/*; do
  case "${f#"$d"/}" in
    HEAD|config|config.worktree|index|sharedindex.*|objects|refs|hooks|description) ;;
    modules|info|info/exclude|info/attributes|info/sparse-checkout) ;;
    *) rm -rf "$f" ;;
  esac
done
find "$d/refs" -mindepth 2 -depth -type d -empty -delete
rm -rf "$d/objects/info/commit-graph" "$d/objects/info/commit-graphs" \
  "$d/objects/pack/multi-pack-index" "$d"/objects/pack/*.keep "$d"/objects/pack/*.promisor
echo "$head" > "$d/shallow"
g repack -a -d -n -q
rm -rf "$d/objects/info"/*
g prune --expire=now
)
rc=$?
if [ $rc = 5 ] || [ $rc = 7 ]; then exit $rc; elif [ $rc != 0 ]; then exit 6; fi
"""


@dataclasses.dataclass(frozen=True)
class Runtime:
    """A container runtime's CLI and the global options it needs on this host."""

    name: str  # podman | docker
    binary: str
    global_args: tuple[str, ...]

    def argv(self, *args: str) -> list[str]:
        return [self.binary, *self.global_args, *args]

    def call(self, *args: str, timeout: float = CLI_TIMEOUT_SECONDS, cwd: str | None = None
             ) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(self.argv(*args), capture_output=True, timeout=timeout, cwd=cwd)
        except subprocess.TimeoutExpired:
            raise WorkspaceError(f"`{self.name} {' '.join(args[:2])}` did not answer in "
                                 f"{timeout:.0f} s.") from None


_RUNTIMES: dict[tuple[str, str], Runtime] = {}
_RUNTIMES_LOCK = threading.Lock()


def find_runtime(name: str) -> Runtime:
    """The runtime `name` (podman | docker) on PATH, with the options this host needs (cached).

    Raises:
      WorkspaceError: the binary is missing, or its engine does not answer (`info` fails).
    """
    binary = shutil.which(name)
    if binary is None:
        raise WorkspaceError(f"container backend {name!r}: `{name}` is not on PATH; install it "
                             f"({INSTALL_HINTS[name]}), or use another backend.")
    with _RUNTIMES_LOCK:
        if (name, binary) not in _RUNTIMES:
            _RUNTIMES[name, binary] = Runtime(name, binary, _host_options(name, binary))
        return _RUNTIMES[name, binary]


def _host_options(name: str, binary: str) -> tuple[str, ...]:
    try:
        done = subprocess.run([binary, "info", "--format", "{{json .}}"], capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise WorkspaceError(f"`{name} info` did not answer in 60 s.") from None
    if done.returncode != 0:
        engine = (" (the docker CLI is here but no docker engine answers: start dockerd, or "
                  "use backend 'podman')" if name == "docker" else "")
        raise WorkspaceError(f"container backend {name!r}: `{name} info` failed{engine}: "
                             f"{done.stderr.strip()[-1000:]}")
    if name != "podman":
        return ()
    host = json.loads(done.stdout).get("host", {})
    options = []
    oci = host.get("ociRuntime", {})
    # runc lives in /usr/sbin on Debian, which a non-login PATH may lack.
    runc = shutil.which("runc", path=f"{os.environ.get('PATH', '')}:/usr/local/sbin:/usr/sbin")
    default_missing = bool(oci.get("path")) and not os.path.exists(oci["path"])
    if runc and oci.get("name") != "runc" and (default_missing
                                               or host.get("cgroupVersion") == "v1"):
        options += ["--runtime", runc]
    if host.get("cgroupManager") == "systemd" and not os.path.isdir("/run/systemd/system"):
        options.append("--cgroup-manager=cgroupfs")
    return tuple(options)


def image_name(task: SWETask, config: WorkspaceConfig) -> str:
    """`task.image`, else `config.image_template` filled with the task's fields."""
    if task.image:
        return task.image
    id_docker = task.instance_id.replace("__", "_1776_").lower()
    return config.image_template.format(instance_id=task.instance_id, repo=task.repo,
                                        version=task.version, id_docker=id_docker)


def ensure_image(runtime: Runtime, image: str, pull: str) -> None:
    """Pulls `image` when it is not here and `pull` is "missing"; raises naming it otherwise."""
    exists = (["image", "exists", image] if runtime.name == "podman"
              else ["image", "inspect", image])
    if runtime.call(*exists).returncode == 0:
        return
    how = (f"pull it on a host with registry access (`{runtime.name} pull {image}`, then "
           f"`{runtime.name} save`/`load`), set the task's `image` or "
           "WorkspaceConfig.image_template, or build the local base image "
           "(`python -m sao_jax.envs.swe.images`).")
    if pull == "never":
        raise WorkspaceError(f"image {image} is not here and WorkspaceConfig.pull is 'never': "
                             f"{how}")
    done = runtime.call("pull", "-q", image, timeout=3600)
    if done.returncode != 0:
        raise WorkspaceError(f"image {image} is not here and `{runtime.name} pull` failed "
                             f"({_tail(done.stderr)}): {how}")


def remove_stale_containers(runtime: str = "podman", every: bool = False) -> list[str]:
    """Removes the workspace containers (label `sao_jax.workspace`) whose process has died (its
    pid, label `sao_jax.pid`, no longer runs here), or all of them with `every`; returns their
    names."""
    rt = find_runtime(runtime)
    listed = rt.call("ps", "-a", "--filter", f"label={LABEL}", "--format",
                     f'{{{{.Names}}}} {{{{index .Labels "{PID_LABEL}"}}}}')
    stale = [name for name, _, pid in (line.partition(" ") for line in
                                       listed.stdout.decode().splitlines())
             if every or not _alive(pid)]
    if stale:
        rt.call("rm", "-f", *stale)
    return stale


def _alive(pid: str) -> bool:
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class ContainerWorkspace:
    """A workspace in a container; make one with `create` (or `workspace.open_workspace`)."""

    def __init__(self, runtime: Runtime, name: str, image: str, config: WorkspaceConfig):
        self.runtime = runtime
        self.name = name
        self.image = image
        self.root = config.root
        self.config = config
        rm = (("rm", "-f", "-t", "0", name) if runtime.name == "podman"
              else ("rm", "-f", name))
        # Removes the container even when close() is never called (collected, or at exit).
        self._finalizer = weakref.finalize(self, _remove, runtime.argv(*rm))

    @classmethod
    def create(cls, task: SWETask, config: WorkspaceConfig) -> ContainerWorkspace:
        """A running container holding `task`'s repository at `config.root`, owned by the user.

        Raises:
          WorkspaceError: naming what is missing (runtime, image, repository, snapshot) or what
            the runtime refused (cgroups, ulimits, ...), from its own message.
        """
        if not os.path.isabs(config.root) or os.path.normpath(config.root) == "/":
            raise WorkspaceError(f"WorkspaceConfig.root must be an absolute path below /, "
                                 f"got {config.root!r}.")
        runtime = find_runtime(config.backend)
        image = image_name(task, config)
        ensure_image(runtime, image, config.pull)
        with tempfile.TemporaryDirectory(prefix="sao-ws-") as tmp:
            snapshot = None
            if task.workspace:  # first, so that a bad snapshot fails before any container
                snapshot = os.path.join(tmp, "repo")
                prepare_snapshot(task, snapshot)
            return cls._start(runtime, image, task, config, snapshot, tmp)

    @classmethod
    def create_and_run(cls, task: SWETask, config: WorkspaceConfig, command: str,
                       timeout: float, input: str | None = None,
                       ) -> tuple[ContainerWorkspace, CommandResult]:
        """`create`, then its first command, `run(command, timeout, input)` (`create`'s root
        `exec`s have probed the container already); the container is removed when the command
        raises."""
        workspace = cls.create(task, config)
        try:
            return workspace, workspace.run(command, timeout, input)
        except BaseException:
            workspace.close()
            raise

    @classmethod
    def _start(cls, runtime: Runtime, image: str, task: SWETask, config: WorkspaceConfig,
               snapshot: str | None, workdir: str) -> ContainerWorkspace:
        nofile = _host_limit(resource.RLIMIT_NOFILE, config.open_files)
        nproc = _host_limit(resource.RLIMIT_NPROC, config.user_processes)
        name = f"sao-ws-{secrets.token_hex(6)}"
        disk = config.disk_bytes
        tmpfs = [f"type=tmpfs,destination=/tmp,tmpfs-size={disk},tmpfs-mode=1777"]
        if snapshot or runtime.name == "podman":  # the image's repository is copied up
            tmpfs.append(f"type=tmpfs,destination={config.root},tmpfs-size={disk}"
                         + ("" if snapshot else ",tmpcopyup"))
        started = runtime.call(
            "run", "-d", "--name", name, "--label", f"{LABEL}=1",
            "--label", f"{PID_LABEL}={os.getpid()}",
            "--label", f"sao_jax.instance_id={task.instance_id}", "--network=none",
            "--memory", str(config.memory_bytes + len(tmpfs) * disk),
            "--pids-limit", str(config.max_processes),
            "--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}",
            "--init", "--security-opt", "no-new-privileges", "--cap-drop", "ALL",
            *(f"--cap-add={cap}" for cap in SETUP_CAPABILITIES),
            *(arg for mount in tmpfs for arg in ("--mount", mount)), *config.runtime_args,
            image, "sleep", "infinity",
            # podman's conmon keeps this cwd, and older ones (2.1.6 here; fixed upstream in 2024)
            # create a file "oom" in it when the container's OOM killer acts (it appeared in the
            # caller's directory): a directory removed once the container is made
            cwd=workdir)
        workspace = cls(runtime, name, image, config)
        if started.returncode != 0:
            workspace.close()  # `run` may have left a created container behind
            raise WorkspaceError(f"{runtime.name} could not start a container of {image}: "
                                 f"{_explain(started.stderr.decode(errors='replace'))}")
        try:
            workspace._install_repository(task, snapshot)
        except BaseException:
            workspace.close()
            raise
        return workspace

    def _install_repository(self, task: SWETask, snapshot: str | None) -> None:
        root, user = self.root, self.config.container_user
        # One root exec checks for the tools every command needs and readies root (a tmpfs, or
        # the image's directory): a snapshot replaces whatever it holds; without one, the image's
        # repository (copied up into the tmpfs) is cut down to HEAD's commit (_CUT_HISTORY),
        # then handed to the user.
        ready = ('mkdir -p "$1" && find "$1" -mindepth 1 -maxdepth 1 -exec rm -rf {} +'
                 if snapshot else
                 'test -n "$(ls -A "$1" 2>/dev/null)" || exit 3\n' + _CUT_HISTORY
                 + 'chown -R "$2" "$1"')
        done = self._exec_root(_TOOLS + ready, root, user)
        if done.returncode == 4:
            raise WorkspaceError(f"image {self.image} lacks {done.stdout.decode().strip()}, "
                                 "which every command needs (bash, coreutils' timeout).")
        if done.returncode == 3:
            raise WorkspaceError(f"task {task.instance_id}: image {self.image} has no "
                                 f"repository at {root}; give the task a `workspace` snapshot, "
                                 "or an image holding the repository there.")
        if done.returncode == 5:
            raise WorkspaceError(f"task {task.instance_id}: image {self.image} holds a git "
                                 f"repository at {root} but no git, which must cut its history "
                                 "down to HEAD before the agent gets it (later commits hold the "
                                 "fix): install git in the image, or give the task a "
                                 "`workspace` snapshot.")
        if done.returncode == 7:
            raise WorkspaceError(f"task {task.instance_id}: the repository at {root} in image "
                                 f"{self.image} has no commit at HEAD: {_tail(done.stderr)}")
        self._check(done, f"readying {root}" if snapshot or done.returncode != 6 else
                    f"cutting the history of the repository at {root} down to HEAD")
        if snapshot:
            copied = self.runtime.call("cp", f"{snapshot}/.", f"{self.name}:{root}")
            if copied.returncode != 0 and b"no space left" in copied.stderr.lower():
                raise WorkspaceError(
                    f"task {task.instance_id}: its snapshot does not fit in "
                    f"WorkspaceConfig.disk_bytes = {self.config.disk_bytes} bytes (the tmpfs at "
                    f"{root}); raise disk_bytes: {_tail(copied.stderr)}")
            self._check(copied, f"cp of the snapshot to {root}")
            self._check(self._exec_root('chown -R "$2" "$1"', root, user),
                        f"chown -R {user} {root}")

    def _exec_root(self, script: str, *args: str) -> subprocess.CompletedProcess:
        return self.runtime.call("exec", "--user", "0:0", self.name, "sh", "-c", script, "sh",
                                 *args)

    def _check(self, done: subprocess.CompletedProcess, what: str) -> None:
        if done.returncode != 0:
            raise WorkspaceError(f"container {self.name} ({self.image}): {what} failed: "
                                 f"{_explain(done.stderr.decode(errors='replace'))}")

    def run(self, command: str, timeout: float, input: str | None = None) -> CommandResult:
        """`bash -c command` as the user at `root`; `input` is its stdin. See `Workspace.run`."""
        if not self._finalizer.alive:
            raise WorkspaceError(f"container workspace {self.name} is closed.")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}.")
        limit = self.config.output_bytes
        argv = self.runtime.argv(
            "exec", "-i", "--user", self.config.container_user, "-w", self.root,
            "-e", "HOME=/tmp", self.name, "sh", "-c", _WRAPPER, "sh",
            str(self.config.cpu_seconds), f"{timeout:.3f}", command)
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else
                                subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        if input is not None:
            threading.Thread(target=_feed, args=(proc.stdin, input.encode()),
                             daemon=True).start()
        output, errors, cut = _read(proc, start + timeout + HOST_GRACE_SECONDS, limit)
        if cut:
            proc.kill()
            self._kill_user_processes()
        returncode = proc.wait()
        seconds = time.monotonic() - start
        if cut == "output":
            return CommandResult(None, _text(output[:limit]), False, True, seconds)
        if cut == "timeout":
            return CommandResult(None, _text(output), True, False, seconds)
        if returncode != 0 and errors.strip():  # the runtime's own failure, not the command's
            raise WorkspaceError(f"`{self.runtime.name} exec` in {self.name} ({self.image}) "
                                 f"failed: {_explain(errors.decode(errors='replace'))}")
        # timeout -s KILL dies with its command: 128 + 9, after the full timeout.
        if returncode == 137 and seconds >= timeout:
            return CommandResult(None, _text(output), True, False, seconds)
        return CommandResult(returncode, _text(output), False, False, seconds)

    def _kill_user_processes(self) -> None:
        self.runtime.call("exec", "--user", self.config.container_user, self.name, "sh", "-c",
                          "kill -9 -1", timeout=30)

    def close(self) -> None:
        """Removes the container and everything in it; idempotent."""
        self._finalizer()

    def __enter__(self) -> ContainerWorkspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read(proc: subprocess.Popen, deadline: float, limit: int) -> tuple[bytes, bytes, str | None]:
    """stdout and stderr of `proc` until both close, the deadline ("timeout") or more than
    `limit` bytes of stdout ("output")."""
    output, errors = bytearray(), bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, output)
        selector.register(proc.stderr, selectors.EVENT_READ, errors)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(output), bytes(errors), "timeout"
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if len(output) > limit:
                    return bytes(output), bytes(errors), "output"
    return bytes(output), bytes(errors), None


def _feed(stdin, data: bytes) -> None:
    try:
        stdin.write(data)
        stdin.close()
    except (BrokenPipeError, ValueError):
        pass  # the command exited (or was killed) without reading all of it


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _remove(argv: list[str]) -> None:
    subprocess.run(argv, capture_output=True, timeout=CLI_TIMEOUT_SECONDS)


def _host_limit(which: int, wanted: int) -> int:
    """`wanted`, cut to this process's hard limit: a rootful runtime cannot set more here."""
    hard = resource.getrlimit(which)[1]
    return wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)


def _tail(stderr: bytes | str) -> str:
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    return text.strip()[-1000:]


def _explain(stderr: str) -> str:
    """The runtime's error, led by what it means is missing."""
    text = _tail(stderr)
    lower = text.lower()
    if "tmpcopyup" in lower and "no space left" in lower:
        cause = ("the image's repository does not fit in WorkspaceConfig.disk_bytes (the tmpfs "
                 "it is copied into); raise disk_bytes")
    elif "setrlimit" in lower or "rlimit" in lower:
        cause = ("a ulimit could not be set (WorkspaceConfig.open_files / user_processes above "
                 "what the runtime may set here)")
    elif "cgroup" in lower:
        cause = ("cgroups: the OCI runtime cannot make the container's cgroup (on cgroup v1 or "
                 "hybrid hosts install runc: `apt-get install runc`; without systemd use "
                 "--cgroup-manager=cgroupfs)")
    elif "oci runtime" in lower and "not found" in lower and "executable" not in lower:
        cause = "the OCI runtime is missing (`apt-get install runc` or crun)"
    elif "executable file not found" in lower or "no such file or directory" in lower:
        cause = "a program or path the workspace needs is missing in the image"
    elif "image not known" in lower or "no such image" in lower or "manifest unknown" in lower:
        cause = "the image is missing"
    elif any(gone in lower for gone in ("no such container", "is not running",
                                        "state improper")):
        cause = "the container is gone (stopped, killed for memory, or removed)"
    else:
        return text
    return f"{cause}: {text}"
