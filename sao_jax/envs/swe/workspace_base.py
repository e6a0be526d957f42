"""What a workspace is, for `workspace.py` and its backends (`namespace.py`, `container.py`): its
configuration (`WorkspaceConfig`), the protocol every backend implements (`Workspace`), a
command's result (`CommandResult`), `WorkspaceError`, and `pid_alive`, which both the backends and
`snapshot.py` use to clean up after dead processes. Users import these from `workspace.py`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Protocol

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


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this machine (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
