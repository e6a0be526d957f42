"""What a sandboxed run is given and what it returns (`SandboxConfig`, `SandboxResult`,
`SandboxUnavailable`), and the fixed layout of the view that the worker plans for init."""

from __future__ import annotations

import dataclasses
import os
import sys

from sao_jax.envs.sandbox.init import BIN_DIR, WORKDIR

SNIPPET = "/tmp/snippet.py"
UID_RANGE = (2_000_000_000, 2_100_000_000)
# The host's system directories shown inside: bound read-only, or recreated where they are links.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = (("/dev/fd", "/proc/self/fd"), ("/dev/stdin", "/proc/self/fd/0"),
             ("/dev/stdout", "/proc/self/fd/1"), ("/dev/stderr", "/proc/self/fd/2"),
             ("/dev/shm", WORKDIR))
DENIED_SYSCALLS = ("add_key", "keyctl", "request_key")  # fail with ENOSYS inside
# Made by init; nothing of the host is bound in or above them.
RESERVED_PATHS = ("/proc", "/dev", WORKDIR, os.path.dirname(BIN_DIR))
TOOL_PATH = "/usr/local/bin:/usr/bin:/bin"  # where the worker finds unshare and setpriv


class SandboxUnavailable(RuntimeError):
    """Isolation cannot be set up here, so model-generated code is not run at all."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits and view of one sandboxed run. Sizes in bytes, times in seconds."""

    cpu_seconds: int = 5  # RLIMIT_CPU of each process (SIGXCPU, then SIGKILL a second later)
    memory_bytes: int = 512 << 20  # RLIMIT_AS of each process
    file_size_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file it may write
    disk_bytes: int = 64 << 20  # size of the private tmpfs at /tmp (all its files together)
    max_processes: int = 16  # RLIMIT_NPROC for the sandbox uid, threads included
    max_open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 64 << 10  # kept of stdout and of stderr each; more kills the run
    wall_seconds: float = 10.0  # wall-clock limit, start-up included
    # Interpreter inside the sandbox: the real one behind a virtualenv's symlink. A venv may live
    # under /tmp (a CI checkout), which the sandbox replaces by its own tmpfs, and with `-S` the
    # venv's packages would not be imported anyway.
    python: str = os.path.realpath(sys.executable)
    site_packages: bool = False  # True: drop `-S`, so the interpreter's site-packages import
    # Host paths shown read-only at the same path, besides the system directories and the
    # interpreter's tree. Never one holding Unix sockets: connect(2) ignores read-only mounts.
    readonly_paths: tuple[str, ...] = ()
    nice: int = 10  # scheduling niceness added to the code
    uid: int | None = None  # None: a fresh uid from UID_RANGE per run (recommended)
    # cgroup directories (made and limited by the caller) that init joins before anything else,
    # so that every process of the run counts in them: e.g. a memory limit across processes.
    cgroups: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("cpu_seconds", "memory_bytes", "file_size_bytes", "disk_bytes",
                     "max_processes", "max_open_files", "output_bytes", "wall_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be positive, "
                                 f"got {getattr(self, name)}")
        if self.uid is not None and not 0 < self.uid < 2**32 - 1:
            raise ValueError(f"SandboxConfig.uid must be an unprivileged uid, got {self.uid}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"SandboxConfig.nice must be in [0, 19], got {self.nice}")
        if not os.path.isabs(self.python):
            raise ValueError(f"SandboxConfig.python must be an absolute path, got {self.python!r}")
        if isinstance(self.cgroups, str) or not all(os.path.isabs(c) for c in self.cgroups):
            raise ValueError("SandboxConfig.cgroups must be a tuple of absolute cgroup "
                             f"directories, got {self.cgroups!r}")
        if isinstance(self.readonly_paths, str):
            raise ValueError("SandboxConfig.readonly_paths must be a tuple of paths, not a str")
        for path in self.readonly_paths:
            if not os.path.isabs(path) or os.path.normpath(path) == "/":
                raise ValueError(f"SandboxConfig.readonly_paths: {path!r} must be an absolute "
                                 "path other than /")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    stdout: str  # with `run_program(merge_stderr=True)`: stdout and stderr, in order
    stderr: str
    exit_code: int | None  # None when the process was killed by a signal
    killed_by: str | None  # signal name ("SIGKILL", "SIGXCPU", ...) or None
    timed_out: bool  # wall-clock limit reached; the sandbox was killed
    stdout_truncated: bool  # more than output_bytes; the sandbox was killed
    stderr_truncated: bool
    wall_seconds: float  # start-up included
    cpu_seconds: float | None  # user + system time of the main process, when init reported it
    uid: int  # the uid the code ran as

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.truncated

    def describe(self, config: SandboxConfig | None = None) -> str:
        """One line on how the run ended, for a log or a model's observation."""
        if self.timed_out:
            limit = f" of {config.wall_seconds:g} s" if config else ""
            return f"killed: wall-clock limit{limit} reached"
        if self.truncated:
            limit = f" ({config.output_bytes} bytes)" if config else ""
            return f"killed: output limit{limit} exceeded; output truncated"
        if self.killed_by == "SIGXCPU" or (
                self.killed_by == "SIGKILL" and config and self.cpu_seconds is not None
                and self.cpu_seconds >= config.cpu_seconds):  # SIGXCPU ignored: the hard limit
            limit = f" of {config.cpu_seconds} s" if config else ""
            return f"killed: CPU time limit{limit} exceeded"
        if self.killed_by:
            return f"killed by {self.killed_by}"
        return f"exit code {self.exit_code}"
