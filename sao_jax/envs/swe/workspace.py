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

This module is the public face of the workspaces: what a workspace is (`WorkspaceConfig`,
`CommandResult`, `WorkspaceError`, the `Workspace` protocol) lives in `workspace_base.py`, the
repository's copy in `snapshot.py` (`prepare_snapshot`); both backends import those, and this
module imports the backends. Users import all of it from here.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sao_jax.envs.swe.container import ContainerWorkspace
from sao_jax.envs.swe.namespace import NamespaceWorkspace
from sao_jax.envs.swe.snapshot import prepare_snapshot
from sao_jax.envs.swe.workspace_base import (
    BACKENDS,
    CommandResult,
    Workspace,
    WorkspaceConfig,
    WorkspaceError,
)

if TYPE_CHECKING:
    from sao_jax.envs.swe.tasks import SWETask

__all__ = [
    "BACKENDS",
    "STEPS_GRACE_SECONDS",
    "CommandResult",
    "Step",
    "Steps",
    "Workspace",
    "WorkspaceConfig",
    "WorkspaceError",
    "open_and_run",
    "open_workspace",
    "prepare_snapshot",
]


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
    return NamespaceWorkspace if config.backend == "namespace" else ContainerWorkspace
