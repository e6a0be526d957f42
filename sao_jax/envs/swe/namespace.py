"""The namespace backend: a SWE workspace in the project's sandbox, one fresh sandbox per command.

    ws = NamespaceWorkspace.create(task, WorkspaceConfig())
    result = ws.run("git status", timeout=30)
    ws.close()

A workspace is a host directory `<tmp>/sao-ws-XXXXXXXX/repo` (the parent: made by
`tempfile.mkdtemp`, so under $TMPDIR or /tmp, which the sandbox never shows, with a tmpfs of
`config.disk_bytes` mounted on it, mode 0700, root's) holding the task's repository at its base
commit (`snapshot.prepare_snapshot`), owned by one uid drawn from
`sandbox.UID_RANGE` when the workspace is made and kept for its life: its files stay that uid's,
and git inside sees a repository of its own user (no "dubious ownership").

Each `run` is `bash -c command` through `sandbox.run_program`: fresh namespaces, that uid, no
network, the sandbox's allow-list view (system directories, /etc and the interpreter read-only;
`python` and `python3` are the worker's interpreter, with its site-packages) with the repository
bound read-write at `config.root` (/testbed) and a fresh /tmp tmpfs of `config.disk_bytes`
(HOME and TMPDIR). Files persist across commands only under `root`; /tmp, background processes,
the environment and the shell's state do not: when bash exits, everything it started dies.
Stdin is `input` (or /dev/null); stdout and stderr come back merged, in order, in `output`.

Limits of a command: wall clock `timeout` (then `timed_out`, killed); `output_bytes` of output
(then `truncated`, killed); per process RLIMIT_CPU `cpu_seconds`, RLIMIT_AS `memory_bytes`,
RLIMIT_FSIZE `disk_bytes`, RLIMIT_NOFILE `open_files`; RLIMIT_NPROC `max_processes` for the uid
(enforced: the uid is unprivileged and its own, so it counts this workspace's processes only);
niceness 10. `returncode` is bash's exit status, 128 + N when bash itself died of signal N (as a
shell reports it), and None when the workspace's limits killed it (timeout, output).

Disk: the repository (what the task brings, and what commands write under `root`) lives on the
workspace's tmpfs of `disk_bytes`, and /tmp is another of `disk_bytes`: a write past either fails
with ENOSPC ("No space left on device"), the command goes on or exits as it handles that, and
the workspace stays usable (delete the file and write again). A snapshot larger than `disk_bytes`
does not fit: `create` raises a WorkspaceError naming the field. The tmpfs holds its files in
memory (swap, where there is some), not on the host disk: a workspace costs the host up to
2 x `disk_bytes` of memory, and is gone, whatever the commands left there, at `close`. A worker
killed before `close` leaves its tmpfs mounted (named `sao-ws-<pid>`, its pid):
`remove_stale_workspaces()` unmounts and removes the ones of dead processes, and `create` calls it.

Memory: besides RLIMIT_AS per process, the workspace has a memory cgroup of its own, which every
command's sandbox joins (`SandboxConfig.cgroups`), limited to `memory_bytes` plus both tmpfs
sizes (tmpfs pages a command writes are charged to it, and full tmpfs mounts must leave the
processes their `memory_bytes`): past it the kernel's OOM killer kills a process of the workspace
(the largest: every command runs at oom_score_adj 1000), its shell sees 137, and the workspace
goes on. The cgroup is made under this process's own, in the cgroup v1 memory hierarchy or in
cgroup v2 where this process's cgroup may have children with the memory controller; where
neither works (no cgroup filesystem, v2 with processes in this cgroup) `memory_cgroup` is None and
only RLIMIT_AS holds: the commands of a workspace may then hold up to `max_processes` x
`memory_bytes` together.

Cost: one sandbox per command: `run("true")` takes about 50 ms on a 2-core machine when it is
quiet and 100 ms under load (about 35 ms of CPU), mostly the start of the interpreter that
builds the view (init); making the workspace adds the git work of `prepare_snapshot` (about 25
ms of CPU once its bundle is cloned) and a chown of the tree, and its probe is its first
command (`create_and_run`). An episode of experiments/swe_tiny.py (two commands, then the
submission) takes six sandboxes: the first command (`git rev-parse HEAD`, env.py), the agent's
two, the submission (the monitor's listing and the patch, `workspace.Steps`) and the grader's
two (the patches applied and the test module read, then the tests). Its child processes took
0.44 CPU-s on a 2-core machine busy with a training run, 0.64 CPU-s with the ten sandboxes
(a probe per workspace, a command per step) and the clone of the bundle per workspace of
before.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from typing import TYPE_CHECKING

from sao_jax.envs.sandbox import (
    UID_RANGE,
    SandboxConfig,
    SandboxUnavailable,
    check_isolation,
    exposed_paths,
    run_program,
)
from sao_jax.envs.swe.snapshot import prepare_snapshot
from sao_jax.envs.swe.workspace_base import (
    CommandResult,
    WorkspaceConfig,
    WorkspaceError,
    pid_alive,
)

if TYPE_CHECKING:
    from sao_jax.envs.swe.tasks import SWETask

NICE = 10  # niceness of every command
_MOUNT_PREFIX = "sao-ws-"  # the workspace tmpfs's source name: sao-ws-<pid of its process>


class NamespaceWorkspace:
    """One task's repository and the uid that owns it; see the module docstring."""

    def __init__(self, instance_id: str, parent: str, uid: int, root: str,
                 sandbox_config: SandboxConfig):
        self.instance_id = instance_id
        self.root = root  # the repository's path as commands see it
        self.uid = uid
        self.host_dir = os.path.join(parent, "repo")  # the repository's path on the host
        self._parent = parent
        self._sandbox = sandbox_config
        # the workspace's memory cgroup (module docstring); None where none could be made
        self.memory_cgroup = sandbox_config.cgroups[0] if sandbox_config.cgroups else None

    @classmethod
    def create(cls, task: SWETask, config: WorkspaceConfig) -> NamespaceWorkspace:
        """A new workspace holding `task`'s repository at its base commit (`create_and_run`
        with `true` as the first command).

        Raises:
          WorkspaceError: as `create_and_run`.
        """
        return cls.create_and_run(task, config, "true", timeout=60)[0]

    @classmethod
    def create_and_run(cls, task: SWETask, config: WorkspaceConfig, command: str,
                       timeout: float, input: str | None = None,
                       ) -> tuple[NamespaceWorkspace, CommandResult]:
        """A new workspace holding `task`'s repository at its base commit, and the result of
        its first command, `run(command, timeout, input)`.

        The first command is the workspace's probe: it runs after a line that prints a random
        marker, so that a view that cannot be built or a shell that does not start fails here,
        as a WorkspaceError, and is never taken for the command's own failure. The marker's
        line is taken out of the output (`_without_marker`); it counts against `output_bytes`.

        Raises:
          WorkspaceError: the sandbox cannot run here (the reason names what is missing), the
            task's snapshot is missing (`prepare_snapshot`'s message), the view cannot be built
            (`config.root` cannot be bound, the first command's shell did not start), or the
            sandbox failed while the first command ran.
          ValueError: `timeout` is not positive.
        """
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        uid = UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])
        sandbox_config = SandboxConfig(
            cpu_seconds=config.cpu_seconds, memory_bytes=config.memory_bytes,
            file_size_bytes=config.disk_bytes, disk_bytes=config.disk_bytes,
            max_processes=config.max_processes, max_open_files=config.open_files,
            output_bytes=config.output_bytes, nice=NICE, uid=uid)
        try:
            check_isolation(sandbox_config)
        except SandboxUnavailable as e:
            raise WorkspaceError(f"the namespace backend cannot run here: {e}") from e
        remove_stale_workspaces()
        parent = os.path.realpath(tempfile.mkdtemp(prefix="sao-ws-"))  # mode 0700, root's
        try:
            shown = [p for p in exposed_paths(sandbox_config) if _is_under(parent, p)]
            if shown:
                raise WorkspaceError(f"workspace directory {parent} lies under {shown[0]}, which "
                                     "the sandbox shows to every command: set TMPDIR elsewhere")
            _mount_tmpfs(parent, config.disk_bytes)
            cgroup = _memory_cgroup(f"{_MOUNT_PREFIX}{os.getpid()}-{os.path.basename(parent)}",
                                    config.memory_bytes + 2 * config.disk_bytes)
            if cgroup is not None:
                sandbox_config = dataclasses.replace(sandbox_config, cgroups=(cgroup,))
            workspace = cls(task.instance_id, parent, uid, config.root, sandbox_config)
            try:
                prepare_snapshot(task, workspace.host_dir)
            except (WorkspaceError, OSError) as e:
                if os.statvfs(parent).f_bavail > 0 and "No space left" not in str(e):
                    raise
                raise WorkspaceError(
                    f"task {task.instance_id}: its repository does not fit in "
                    f"WorkspaceConfig.disk_bytes = {config.disk_bytes} bytes (the workspace's "
                    f"tmpfs); raise disk_bytes: {e}") from e
            _chown_tree(workspace.host_dir, uid)
            marker = f"sao-ws-ready-{secrets.token_hex(8)}\n"
            try:  # the first command now, so that a view that cannot be built fails here
                first = workspace.run(f"echo {marker}{command}", timeout=timeout, input=input)
            except ValueError as e:
                raise WorkspaceError(f"WorkspaceConfig.root {config.root!r} cannot be bound: "
                                     f"{e}") from e
            output = _without_marker(first, marker)
            if output is None:
                raise WorkspaceError(f"a first command in the workspace of {task.instance_id} "
                                     f"failed: {first.output.strip()[-500:]}")
        except BaseException:
            _remove(parent, sandbox_config.cgroups)
            raise
        return workspace, dataclasses.replace(first, output=output)

    def run(self, command: str, timeout: float, input: str | None = None) -> CommandResult:
        """`bash -c command` in a fresh sandbox with cwd `root`; `input` is its stdin."""
        if self._parent is None:
            raise WorkspaceError(f"workspace of {self.instance_id} is closed")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        config = dataclasses.replace(self._sandbox, wall_seconds=timeout)
        try:
            result = run_program(["bash", "-c", command], config, input=input, cwd=self.root,
                                 writable={self.host_dir: self.root})
        except SandboxUnavailable as e:
            raise WorkspaceError(f"workspace of {self.instance_id}: {e}") from e
        if result.timed_out or result.truncated:
            returncode = None
        elif result.exit_code is not None:
            returncode = result.exit_code
        else:
            returncode = 128 + _signal_number(result.killed_by)
        return CommandResult(returncode=returncode, output=result.stdout,
                             timed_out=result.timed_out, truncated=result.truncated,
                             seconds=result.wall_seconds)

    def close(self) -> None:
        """Unmounts and removes the workspace's directory; idempotent."""
        parent, self._parent = self._parent, None
        if parent is not None:
            _remove(parent, self._sandbox.cgroups)

    def __enter__(self) -> NamespaceWorkspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_parent", None) is not None:
            try:
                self.close()
            except OSError:
                pass  # nothing to raise to at garbage collection


def _without_marker(result: CommandResult, marker: str) -> str | None:
    """`result`'s output without the line `marker` (what the shell printed before it, a
    warning of its start, stays), or None where no marker came: the shell did not start. An
    output that the output limit cut within the marker's line ends before it."""
    before, found, after = result.output.partition(marker)
    if found:
        return before + after
    for size in range(len(marker) - 1, 0, -1) if result.truncated else ():
        head = result.output[:-size]
        if result.output.endswith(marker[:size]) and (not head or head.endswith("\n")):
            return head
    return None


def _mount_tmpfs(path: str, size: int) -> None:
    """A tmpfs of `size` bytes at `path` (mode 0700, root's, nosuid, nodev), named after this
    process (`remove_stale_workspaces`)."""
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700,nosuid,nodev",
                           f"{_MOUNT_PREFIX}{os.getpid()}", path], capture_output=True, text=True,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"})
    if done.returncode != 0:
        raise WorkspaceError(f"the workspace's tmpfs (WorkspaceConfig.disk_bytes) could not be "
                             f"mounted at {path}: {done.stderr.strip()[-500:]}")


def _remove(parent: str, cgroups=()) -> None:
    """Unmounts the workspace's tmpfs (every mount stacked on `parent`) and removes it, and its
    cgroups."""
    for cgroup in cgroups:
        _remove_cgroup(cgroup)
    while os.path.ismount(parent):
        done = subprocess.run(["umount", parent], capture_output=True, text=True,
                              env={"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"})
        if done.returncode != 0:
            raise WorkspaceError(f"could not unmount the workspace at {parent}: "
                                 f"{done.stderr.strip()[-500:]}")
    if os.path.lexists(parent):
        shutil.rmtree(parent)


def _memory_cgroup(name: str, limit: int) -> str | None:
    """A new memory cgroup `name` below this process's own, limited to `limit` bytes; None where
    none can be made here (see the module docstring)."""
    found = _memory_hierarchy()
    if found is None:
        return None
    base, version = found
    path = os.path.join(base, name)
    try:
        if version == 2:
            with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")
        os.mkdir(path)
    except OSError:
        return None
    try:
        limit_file = "memory.max" if version == 2 else "memory.limit_in_bytes"
        with open(os.path.join(path, limit_file), "w") as f:
            f.write(str(limit))
    except OSError:
        _remove_cgroup(path)
        return None
    return path


def _memory_hierarchy() -> tuple[str, int] | None:
    """(this process's cgroup directory in the hierarchy with the memory controller, 1 or 2)."""
    try:
        with open("/proc/self/cgroup") as f:
            own = dict((line.split(":", 2)[1], line.split(":", 2)[2].strip()) for line in f)
        with open("/proc/self/mountinfo", "rb") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    v1 = [(m[3], m[4]) for m in mounts if m[m.index(b"-") + 1] == b"cgroup"
          and b"memory" in m[m.index(b"-") + 3].split(b",")]
    v2 = [(m[3], m[4]) for m in mounts if m[m.index(b"-") + 1] == b"cgroup2"]
    for key, version, candidates in (("memory", 1, v1), ("", 2, v2)):
        path = next((p for k, p in own.items() if key in k.split(",")), None)
        if path is None or not candidates:
            continue
        root, point = (os.fsdecode(x) for x in candidates[0])
        if root != "/" and not path.startswith(root):
            continue
        relative = path[len(root):] if root != "/" else path
        base = os.path.join(point, relative.lstrip("/"))
        if version == 2 and not os.path.exists(os.path.join(base, "cgroup.subtree_control")):
            continue
        if version == 2:
            with open(os.path.join(base, "cgroup.controllers")) as f:
                if "memory" not in f.read().split():
                    continue
        return base, version
    return None


def _remove_cgroup(path: str) -> None:
    """rmdir, retried while the last processes of a command finish dying."""
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: processes are still exiting
            time.sleep(0.02)


def remove_stale_workspaces() -> list[str]:
    """Unmounts and removes the workspace tmpfs mounts of processes that no longer run here
    (killed before they closed their workspaces), and their memory cgroups; returns the mounts'
    paths."""
    found = _memory_hierarchy()
    if found is not None and os.path.isdir(found[0]):
        for entry in os.listdir(found[0]):
            pid = entry.removeprefix(_MOUNT_PREFIX).split("-")[0]
            if entry.startswith(_MOUNT_PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
                _remove_cgroup(os.path.join(found[0], entry))
    stale = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            source = fields[fields.index(b"-") + 2].decode(errors="replace")
            pid = source.removeprefix(_MOUNT_PREFIX)
            if source.startswith(_MOUNT_PREFIX) and pid.isdigit() and not pid_alive(int(pid)):
                stale.append(os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]),
                                                    fields[4])))
    for path in stale:
        try:
            _remove(path)
        except (WorkspaceError, OSError):
            pass  # in use, or gone meanwhile: the next call tries again
    return stale




def _chown_tree(path: str, uid: int) -> None:
    """`chown -R uid:uid path`, never following a link."""
    os.lchown(path, uid, uid)
    for directory, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(directory, name), uid, uid)


def _signal_number(name: str) -> int:
    """The number of `sandbox.execute._signal_name`'s "SIGKILL" or "signal 34"."""
    if name.startswith("signal "):
        return int(name.split()[1])
    return signal.Signals[name].value


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")
