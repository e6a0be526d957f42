"""Run model-generated code in a sandbox: fresh namespaces, an unprivileged uid, hard limits.

`run_python(code, config)` runs one Python snippet and returns a `SandboxResult`; nothing the
snippet does can reach the caller. `run_program(argv, config, ...)` runs any program the same way
(bash for the SWE workspaces, `swe/namespace.py`), with stdin from a string, stderr merged into
stdout, a working directory, and host directories bound writable into the view. `check_isolation
(config)` proves, once per process and view, that the isolation works and raises
`SandboxUnavailable` naming what is missing if it does not; both run functions call it first and
refuse to run code without it (fail closed: there is no unsandboxed fallback).

How one run is built, and why:

  worker (root) --Popen--> unshare --net --pid --fork --mount --mount-proc --ipc --uts --kill-child
                             \\-- init (root, PID 1 of the new PID namespace; `init.py`, `--init`)
                                   |  joins a new anonymous session keyring, builds the
                                   |  filesystem view, then forks:
                                   \\-- chroot, rlimits, nice, oom_score_adj, seccomp filter
                                        -> setpriv (uid drop) -> the program

* Namespaces (`unshare`, util-linux). Network: a new network namespace holds only a loopback device
  that is down, so every connect, even to 127.0.0.1, fails with "Network is unreachable", and
  abstract Unix sockets of the host are out of reach. PID: the code sees only its own processes
  (a fresh /proc is mounted), so it can neither signal nor inspect the worker; `kill -9 -1` hits
  only the sandbox. Mount, IPC, UTS: private mounts (below), System V / POSIX IPC and hostname.
  No user namespace: the worker is real root, so the namespaces are made directly.
* Unprivileged uid (`setpriv --reuid --regid --clear-groups --no-new-privs --inh-caps=-all
  --bounding-set=-all`). Rlimits alone stop nothing for root (RLIMIT_NPROC is not enforced for it,
  root ignores file permissions), so the code runs as a uid drawn at random from UID_RANGE
  = [2_000_000_000, 2_100_000_000) for every run, or as the fixed `SandboxConfig.uid` a caller
  keeps for a workspace's life: it owns no file on the host besides such a workspace, and
  RLIMIT_NPROC, which the kernel counts per uid, is not shared with any other sandbox or user. No
  capabilities, no supplementary groups, and no-new-privs (set-uid binaries and file capabilities
  grant nothing, so `sudo`, `su` or a `ctypes` call to `setuid(0)` fail).
* Filesystem view: an allow-list. Init mounts an empty tmpfs as the new root and puts into it only
  - /usr, /etc, and /bin, /sbin, /lib, /lib32, /lib64, /libx32 where they exist: the ones that
    are symlinks on the host (Debian's merged /usr) are recreated as the same symlinks, the
    others are bound read-only;
  - the interpreter's tree: the real prefix of `SandboxConfig.python` (and of the path as given,
    a venv's), e.g. /root/.pyenv/versions/3.11.7 -- its site-packages included, so
    `site_packages=True` works; /root itself stays an empty directory apart from that path;
  - `SandboxConfig.readonly_paths`, read-only;
  - /dev with only null, zero, full, random, urandom and tty (bind mounts of the host's nodes;
    the mounts are read-only, which does not stop writes to a device) and the links fd, stdin,
    stdout, stderr into /proc/self/fd, and shm -> /tmp;
  - /proc: a fresh procfs of the new PID namespace;
  - /tmp: a fresh tmpfs of `disk_bytes`, mode 0700, owned by the sandbox uid: HOME, TMPDIR,
    the working directory of `run_python`, and writable;
  - /sandbox/bin, first on PATH, with `python` and `python3` pointing at the configured
    interpreter (Debian's /usr/bin/python3 is still there under its full path);
  - for `run_program`, the host directories given as `writable`, bound read-write (nosuid,
    nodev) at their inside paths (a workspace's repository at /testbed).
  Every other path of the host -- the repository and its data, /root, /home, /var, /run, /srv,
  /mnt, /opt, /sys, the host's /tmp -- does not exist inside. Sources are opened before anything
  is mounted over them and bound through /proc/self/fd, so a host path under /tmp (a workspace)
  binds as well as any other. Every mount under the new root except /tmp, /proc and the writable
  binds is then remounted read-only and nosuid, walking /proc/self/mountinfo as bytes (mount
  points with spaces or non-ASCII names included); a mount that cannot be remounted, or that is
  still writable afterwards, is a set-up error (fail closed). The view lives in the mount
  namespace and vanishes with it, so there is nothing to clean up, even if the worker is killed.
  The code is chrooted into the new root: besides the view, that makes the kernel refuse it new
  user namespaces (`CLONE_NEWUSER` fails with EPERM inside a chroot), which closes the usual door
  to the kernel's namespaced-root attack surface. No fd of init's leads outside, and without
  CAP_SYS_CHROOT there is no way back out.
* Kernel keyrings, which no namespace here separates. Init joins a new anonymous session keyring
  (`keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)`, as root, before the fork), so the code does not
  inherit the worker's session keyring, and a seccomp filter, installed just before the exec,
  makes `add_key`, `keyctl` and `request_key` fail with ENOSYS: the code can neither read keys
  nor leave keys in the kernel nor pass data to a later run through them. ENOSYS rather than
  EPERM because it is what a kernel built without keys answers, which programs that probe for
  keyrings (libkeyutils callers, Kerberos, git credential helpers) already treat as "no keyring
  here" and go on; EPERM reads as an error to report. The filter is built once in the worker by
  libseccomp (through `pyseccomp`, the ctypes binding; pip install pyseccomp, with the system's
  libseccomp2) and loaded by init with prctl(PR_SET_SECCOMP); calls of any other architecture
  (i386 `int 0x80`, x32) kill the caller. Without pyseccomp and libseccomp nothing runs, and a
  filter that does not load is a set-up error, never an unfiltered run.
* Limits (setrlimit in the child before exec): RLIMIT_CPU (soft `cpu_seconds`: SIGXCPU, hard one
  second later: SIGKILL), RLIMIT_AS (`memory_bytes`: MemoryError), RLIMIT_FSIZE
  (`file_size_bytes`: Python ignores SIGXFSZ, so writes fail with EFBIG), RLIMIT_NPROC
  (`max_processes`, threads included: fork fails with EAGAIN), RLIMIT_NOFILE, RLIMIT_CORE = 0,
  RLIMIT_MEMLOCK = 0, RLIMIT_MSGQUEUE = 0. The code runs at `nice` and with oom_score_adj 1000,
  so the kernel's OOM killer picks it before the worker.
* Wall clock and output. The worker reads stdout and stderr through pipes with a selector, keeps
  at most `output_bytes` of each, and kills the sandbox when either overflows (flag `truncated`)
  or when `wall_seconds` pass (`timed_out`). Killing is one SIGKILL to unshare's process group:
  `--kill-child` turns unshare's death into SIGKILL for init, and when a PID namespace's init dies
  the kernel kills every process in it, whatever sessions or process groups they made. Init also
  enforces the wall clock itself (plus a grace period), so a sandbox outlives a dead worker by at
  most that long. When the main process exits, init exits too, so background processes it leaves
  behind die with it.
* Environment and input. The code gets a scrubbed environment (PATH, HOME, TMPDIR, LANG, LC_ALL);
  the worker's environment never enters the namespace (unshare and init get the same minimal one).
  The snippet and any stdin reach init through unshare's stdin. The snippet is written,
  read-only, to /tmp/snippet.py, so tracebacks show its lines; stdin is /dev/null, or the given
  input as a read-only, already unlinked file outside the view. Init's report (exit status,
  signal, CPU time, or a set-up error) comes back on a separate pipe, never mixed with output.
* Interpreter of `run_python`: `python -I -S -B -u /tmp/snippet.py`. Isolated mode ignores
  PYTHON* variables and the user site; `-S` skips site-packages (the standard library is all there
  is, unless `site_packages=True`); `-B` writes no bytecode; `-u` is unbuffered so that output
  printed before a timeout or a kill is not lost.

What this does not guarantee:
* Memory is bounded per process (RLIMIT_AS), not in total, unless the caller gives cgroups
  (`SandboxConfig.cgroups`, which `swe/namespace.py` does where it can): without one the code can
  hold up to `max_processes * memory_bytes + disk_bytes`; CPU time is per process too.
* The seccomp filter denies only the three keyring calls; the rest of the kernel's syscall
  surface is reachable as for any unprivileged process.
* Read-only is not "unreachable" for sockets and devices: connect(2) to a listening Unix socket
  works on a read-only mount. Do not put a directory holding sockets (a daemon's run directory)
  into `readonly_paths`: a server listening there is reachable from inside. /etc is exposed
  whole; files that only root may read (/etc/shadow) stay unreadable, world-readable ones do not.
* A writable bind is the host's directory: the code may fill the disk under it up to
  RLIMIT_FSIZE per file, with no total quota unless the caller bounds it (`swe/namespace.py`
  binds a tmpfs of `disk_bytes`), and whatever it leaves there (symlinks, set-gid
  directories, fifos) is there for the next host process that walks it -- the caller owns it
  (`swe/namespace.py` only copies, chowns and removes it, as root, without following links).
* Timing, CPU-cache and /proc-wide information (load, uptime, kernel version) are shared.
Needs Linux, root, util-linux's `unshare` and `setpriv`, and pyseccomp with libseccomp2.

The package: `init.py` is init, the program that runs inside (standard library only, started by
file path; the worker imports its WORKDIR, BIN_DIR and `is_under`); `config.py` holds
`SandboxConfig`, `SandboxResult`, `SandboxUnavailable` and the fixed layout of the view
(`RESERVED_PATHS`, `TOOL_PATH`, ...); `execute.py` plans the view (`view_plan`), builds the seccomp
filter (`seccomp_filter`) and runs one sandbox (`run_sandbox`: unshare, init's spec, the pipes,
the kill) without checking anything; `isolation.py` holds `check_isolation` and the public
`run_python`, `run_program` and `exposed_paths`, which call it before anything runs. Outside code
imports what this module exports.
"""

from sao_jax.envs.sandbox.config import (
    BIN_DIR,
    SNIPPET,
    UID_RANGE,
    WORKDIR,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailable,
)
from sao_jax.envs.sandbox.isolation import (
    check_isolation,
    exposed_paths,
    run_program,
    run_python,
)

__all__ = [
    "BIN_DIR",
    "SNIPPET",
    "UID_RANGE",
    "WORKDIR",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailable",
    "check_isolation",
    "exposed_paths",
    "run_program",
    "run_python",
]
