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
                             \\-- init (root, PID 1 of the new PID namespace; this file, `--init`)
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
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import sys
import time

WORKDIR = "/tmp"
SNIPPET = "/tmp/snippet.py"
BIN_DIR = "/sandbox/bin"  # `python` and `python3`: the configured interpreter
UID_RANGE = (2_000_000_000, 2_100_000_000)
# The host's system directories shown inside: bound read-only, or recreated where they are links.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = (("/dev/fd", "/proc/self/fd"), ("/dev/stdin", "/proc/self/fd/0"),
             ("/dev/stdout", "/proc/self/fd/1"), ("/dev/stderr", "/proc/self/fd/2"),
             ("/dev/shm", WORKDIR))
DENIED_SYSCALLS = ("add_key", "keyctl", "request_key")  # fail with ENOSYS inside
_RESERVED = ("/proc", "/dev", WORKDIR, os.path.dirname(BIN_DIR))  # made by init, nothing bound
_INIT_GRACE_SECONDS = 2.0  # init's own wall-clock limit is wall_seconds plus this
_DRAIN_SECONDS = 5.0  # after a kill, how long to wait for the pipes to close
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"  # where the worker finds unshare and setpriv
_INSIDE_PATH = f"{BIN_DIR}:/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


# ---------------------------------------------------------------- init: runs inside, as root
# Started as `python -I -S -B sandbox.py --init SPEC` by unshare: PID 1 of the new PID namespace,
# root in fresh mount/network/IPC/UTS namespaces. Standard library only, and only the imports at
# the top of the file: init comes before the worker's code, and the module stops after it.

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
HOLDER = "/tmp"  # init's scratch tmpfs (in init's view; the code never sees it)
ROOT = HOLDER + "/root"  # the code's root directory
# Per-mount options of /proc/self/mountinfo and the mount(2) flags that keep them on a remount.
_OPTION_TO_MS = {b"nosuid": MS_NOSUID, b"nodev": MS_NODEV, b"noexec": MS_NOEXEC,
                 b"noatime": MS_NOATIME, b"nodiratime": MS_NODIRATIME, b"relatime": MS_RELATIME}
_OCTAL_ESCAPE = re.compile(rb"\\([0-7]{3})")  # mountinfo writes space, tab, \n, \ as \040 ...
KEYCTL_JOIN_SESSION_KEYRING = 1
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


def _init_main(spec: dict) -> None:
    status_fd = spec["status_fd"]
    os.set_inheritable(status_fd, False)

    def report(**fields):
        os.write(status_fd, (json.dumps(fields) + "\n").encode())

    try:
        for cgroup in spec["cgroups"]:  # first, so that every process of the run is in them
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write("0")
        os.umask(0o022)
        payload = _read_all(0)
        libc = _libc()
        _join_new_session_keyring(libc, spec["keyctl"])
        stdin = _build_view(libc, spec, payload)
        os.dup2(stdin, 0)
        os.close(stdin)
        if libc.sethostname(b"sandbox", 7) != 0:
            raise OSError(_errno(), "sethostname failed")
    except Exception as e:  # every set-up failure is reported
        report(setup_error=f"{type(e).__name__}: {e}")
        os._exit(1)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    pid = os.fork()
    if pid == 0:
        _exec_child(libc, spec, status_fd)
    status, rusage, timed_out = _supervise(pid, time.monotonic() + spec["deadline_seconds"])
    fields = {"cpu_seconds": round(rusage.ru_utime + rusage.ru_stime, 4), "timed_out": timed_out}
    if os.WIFSIGNALED(status):
        fields["signal"] = os.WTERMSIG(status)
    else:
        fields["exit_code"] = os.WEXITSTATUS(status)
    report(**fields)
    os._exit(0)  # PID 1 exits: the kernel kills whatever the code left behind


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _libc():
    import ctypes  # only init needs it

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p]
    libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    libc.syscall.restype = ctypes.c_long
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong]
    return libc


def _errno() -> int:
    import ctypes

    return ctypes.get_errno()


def _join_new_session_keyring(libc, keyctl_number: int) -> None:
    """A new anonymous session keyring for this run, so the code does not hold the worker's."""
    import ctypes

    if libc.syscall(ctypes.c_long(keyctl_number), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING),
                    ctypes.c_void_p(None)) < 0:
        err = _errno()
        if err != 38:  # ENOSYS: a kernel without keyrings has nothing to share
            raise OSError(err, f"keyctl(KEYCTL_JOIN_SESSION_KEYRING): {os.strerror(err)}")


def _load_seccomp(libc, bpf: bytes) -> None:
    import ctypes

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    program = SockFprog(len(bpf) // 8, bpf)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(program), 0, 0) != 0:
        err = _errno()
        raise OSError(err, f"prctl(PR_SET_SECCOMP): {os.strerror(err)}")


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    args = [None if s is None else os.fsencode(s) for s in (source, target, fstype)]
    if libc.mount(*args, flags, None if data is None else data.encode()) != 0:
        err = _errno()
        raise OSError(err, f"mount({os.fsdecode(source) if source else source}, "
                           f"{os.fsdecode(target)}, {fstype}, {flags:#x}): {os.strerror(err)}")


def _is_under(path, root) -> bool:
    """`path` is `root` or lies below it (both str, or both bytes)."""
    sep = "/" if isinstance(path, str) else b"/"
    return path == root or path.startswith(root.rstrip(sep) + sep)


def _mounts(under: bytes) -> list[tuple[int, int, bytes, set[bytes]]]:
    """(mount id, parent id, mount point, per-mount options) of every mount at or below `under`,
    from /proc/self/mountinfo read as bytes: mount points are byte strings with the kernel's
    octal escapes undone, whatever their encoding."""
    mounts = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split(b" ")
            point = _OCTAL_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), fields[4])
            if _is_under(point, under):
                mounts.append((int(fields[0]), int(fields[1]), point, set(fields[5].split(b","))))
    return mounts


def _build_view(libc, spec: dict, payload: bytes) -> int:
    """Builds the code's root at ROOT (see the module docstring) and returns an fd for its stdin.

    The host sources are opened first and bound through /proc/self/fd, since HOLDER covers the
    host's /tmp in init's view. Then every mount under ROOT but /tmp, /proc and the writable
    binds is remounted read-only, and all of them are checked: any that cannot be is an error.
    """
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    sources = [os.open(source, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)
               for source, _, _ in spec["binds"]]
    stdin_bytes = spec["stdin_bytes"] or 0
    _mount(libc, "sao-holder", HOLDER, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
           f"mode=0700,size={(1 << 16) + stdin_bytes}")
    os.mkdir(ROOT)
    _mount(libc, "sao-root", ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for name, target in spec["links"]:
        os.makedirs(os.path.dirname(ROOT + name), 0o755, exist_ok=True)
        os.symlink(target, ROOT + name)
    writable = {ROOT.encode() + os.fsencode(inside)
                for _, inside, mode in spec["binds"] if mode == "rw"}
    for fd, (_, inside, mode) in zip(sources, spec["binds"], strict=True):
        target = ROOT + inside
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.mkdir(target, 0o755)
        else:
            os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o444))
        _mount(libc, f"/proc/self/fd/{fd}", target, None,
               MS_BIND | (MS_REC if mode == "ro" else 0))
        os.close(fd)
    os.mkdir(ROOT + "/proc")
    _mount(libc, "proc", ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(ROOT + BIN_DIR, 0o755)
    for name in ("python", "python3"):
        os.symlink(spec["python"], f"{ROOT}{BIN_DIR}/{name}")
    os.mkdir(ROOT + WORKDIR)
    _mount(libc, "sao-work", ROOT + WORKDIR, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={spec['disk_bytes']},mode=0700,uid={spec['uid']},gid={spec['gid']}")
    offset = 0
    for path, size in spec["files"].items():
        with open(ROOT + path, "wb") as f:
            f.write(payload[offset:offset + size])
        os.chmod(ROOT + path, 0o444)
        offset += size
    if spec["stdin_bytes"] is None:
        stdin = os.open("/dev/null", os.O_RDONLY)
    else:
        with open(HOLDER + "/stdin", "wb") as f:
            f.write(payload[offset:])
        stdin = os.open(HOLDER + "/stdin", os.O_RDONLY)
        os.unlink(HOLDER + "/stdin")

    root, proc, work = ROOT.encode(), (ROOT + "/proc").encode(), (ROOT + WORKDIR).encode()
    mounts = _mounts(under=root)
    for _, _, point, options in mounts:  # parents first, as mountinfo lists them
        if _is_under(point, proc):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID
        if point == work or point in writable:
            flags |= MS_NODEV
        else:
            flags |= MS_RDONLY
        for option in options & _OPTION_TO_MS.keys():
            flags |= _OPTION_TO_MS[option]
        _mount(libc, None, point, None, flags)
    stacked = {(parent, point) for _, parent, point, _ in mounts}
    for mount_id, _, point, options in _mounts(under=root):  # verify
        if _is_under(point, proc) or (mount_id, point) in stacked:
            continue  # /proc is the namespace's own; one covered by another one is unreachable
        if b"nosuid" not in options:
            raise RuntimeError(f"{os.fsdecode(point)} is not nosuid after the remount")
        if b"ro" not in options and point != work and point not in writable:
            raise RuntimeError(f"{os.fsdecode(point)} is still writable after the read-only "
                               "remount")
    return stdin


def _exec_child(libc, spec: dict, status_fd: int) -> None:
    """The forked child: limits and the seccomp filter, then setpriv drops to the sandbox uid and
    execs the program."""
    import resource

    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        if spec["merge_stderr"]:
            os.dup2(1, 2)
        os.chroot(ROOT)
        os.chdir(spec["cwd"])
        os.nice(spec["nice"])
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
        for name, (soft, hard) in spec["limits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        _load_seccomp(libc, bytes.fromhex(spec["seccomp_bpf"]))
        os.execve(spec["setpriv"], [
            spec["setpriv"], f"--reuid={spec['uid']}", f"--regid={spec['gid']}", "--clear-groups",
            "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--", *spec["argv"]],
            spec["env"])
    except BaseException as e:  # report; never return into init
        try:
            os.write(status_fd, (json.dumps({"setup_error": f"exec: {e}"}) + "\n").encode())
        finally:
            os._exit(127)


def _supervise(pid: int, deadline: float):
    """Reaps children until `pid` exits; SIGKILLs it at `deadline`. Returns its status."""
    timed_out = False
    while True:
        while True:
            try:
                child, status, rusage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                raise RuntimeError("the snippet's process vanished") from None
            if child == 0:
                break
            if child == pid:
                return status, rusage, timed_out
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if not timed_out:
                os.kill(pid, signal.SIGKILL)
                timed_out = True
            remaining = 1.0
        signal.sigtimedwait({signal.SIGCHLD}, remaining)


if __name__ == "__main__" and sys.argv[1:2] == ["--init"]:
    _init_main(json.loads(sys.argv[2]))  # never returns: init ends in os._exit

# The worker's side. Its imports come after init's, which stops the module above when it runs as
# `--init`: every command pays for what init imports, so init imports only what it needs.
import dataclasses  # noqa: E402
import functools  # noqa: E402
import secrets  # noqa: E402
import selectors  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402


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


def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Runs `code` as a Python program in a fresh sandbox (see the module docstring).

    Raises `SandboxUnavailable` (and runs nothing) when isolation cannot be established. Whatever
    the code does (loops, forks, allocates, floods output, kills), the result comes back here.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    config = config or SandboxConfig()
    check_isolation(config)
    flags = ["-I", "-B", "-u"] if config.site_packages else ["-I", "-S", "-B", "-u"]
    return _execute(config, argv=[config.python, *flags, SNIPPET],
                    files={SNIPPET: code.encode("utf-8", errors="surrogatepass")})


def run_program(argv: Sequence[str], config: SandboxConfig | None = None, *,
                input: str | bytes | None = None, cwd: str = WORKDIR,
                writable: Mapping[str, str] | None = None,
                merge_stderr: bool = True) -> SandboxResult:
    """Runs `argv` (found on the sandbox's PATH) in a fresh sandbox (see the module docstring).

    Args:
      argv: the program and its arguments, e.g. ["bash", "-c", "ls"].
      config: limits and view; `config.uid` fixed keeps files a caller binds owned by one uid.
      input: the program's stdin (None: /dev/null).
      cwd: working directory inside.
      writable: {host directory: inside path}, bound read-write (nosuid, nodev). An inside path
        must not lie in or above anything else of the view (/usr, /tmp, /proc, ...).
      merge_stderr: stderr goes into the stdout pipe, so `stdout` holds both in order and
        `output_bytes` caps them together; `stderr` then only holds init's own complaints.

    Raises `SandboxUnavailable` (and runs nothing) when isolation cannot be established, and
    `ValueError` for a `writable` entry that cannot be bound.
    """
    argv = list(argv)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise TypeError(f"argv must be a non-empty sequence of str, got {argv!r}")
    if isinstance(input, str):
        input = input.encode("utf-8", errors="surrogatepass")
    config = config or SandboxConfig()
    check_isolation(config)
    return _execute(config, argv=argv, stdin=input, cwd=cwd, writable=dict(writable or {}),
                    merge_stderr=merge_stderr)


def exposed_paths(config: SandboxConfig | None = None) -> list[str]:
    """The host paths (resolved) that the sandbox shows read-only, system ones included."""
    plan = _view_plan(config or SandboxConfig(), {})
    return [source for source, _, mode in plan["binds"] if mode == "ro"]


# ------------------------------------------------------------------------------------ isolation

_verified: set[tuple] = set()
_verified_lock = threading.Lock()

_PROBE = r"""
import ctypes, json, os, socket
report = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
          "pid": os.getpid(), "interfaces": [name for _, name in socket.if_nameindex()],
          "root_writable": os.access("/", os.W_OK), "cwd": os.getcwd(),
          "cwd_writable": os.access(".", os.W_OK), "top": sorted(os.listdir("/"))}
with open("/proc/self/status") as f:
    fields = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
report["cap_eff"] = int(fields["CapEff"], 16)
report["cap_bnd"] = int(fields["CapBnd"], 16)
report["no_new_privs"] = int(fields["NoNewPrivs"])
try:
    socket.create_connection(("127.0.0.1", 9), timeout=2).close()
    report["network"] = "connected"
except OSError as e:
    report["network"] = e.strerror
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
key = libc.syscall(ADD_KEY, b"user", b"sao-probe", b"x", ctypes.c_size_t(1), ctypes.c_long(-3))
report["add_key"] = "added" if key >= 0 else os.strerror(ctypes.get_errno())
print(json.dumps(report))
"""


def check_isolation(config: SandboxConfig | None = None) -> None:
    """Raises `SandboxUnavailable`, naming what is missing, unless sandboxing works here.

    First the prerequisites (Linux, root, `unshare`, `setpriv`, namespace support, pyseccomp and
    libseccomp, the interpreter, the read-only paths), then a live probe through the real
    mechanism that checks, from inside: an unprivileged uid with no groups and no capabilities,
    no-new-privs, no network, a private PID namespace, a read-only root holding only the
    allow-listed names, a writable working directory, and `add_key` refused by the seccomp
    filter. Success is cached per process for the settings that affect start-up; failure is not.
    """
    config = config or SandboxConfig()
    key = (config.python, config.site_packages, config.readonly_paths)
    with _verified_lock:
        if key in _verified:
            return
        missing = _missing_requirements(config)
        if missing:
            raise SandboxUnavailable("refusing to run model-generated code: the sandbox needs "
                                     + "; ".join(missing))
        probe_config = dataclasses.replace(config, wall_seconds=max(config.wall_seconds, 10.0),
                                           cpu_seconds=max(config.cpu_seconds, 5),
                                           max_open_files=max(config.max_open_files, 64))
        flags = ["-I", "-B", "-u"] if config.site_packages else ["-I", "-S", "-B", "-u"]
        probe = _PROBE.replace("ADD_KEY", str(_seccomp()["numbers"]["add_key"]))
        try:
            result = _execute(probe_config, argv=[config.python, *flags, SNIPPET],
                              files={SNIPPET: probe.encode()})
        except SandboxUnavailable as e:
            raise SandboxUnavailable(f"refusing to run model-generated code: {e}") from None
        problems = _probe_problems(result, _top_names(_view_plan(config, {})))
        if problems:
            raise SandboxUnavailable("refusing to run model-generated code: the isolation probe "
                                     "found " + "; ".join(problems))
        _verified.add(key)


def _missing_requirements(config: SandboxConfig) -> list[str]:
    missing = []
    if not sys.platform.startswith("linux"):
        return [f"Linux namespaces (this platform is {sys.platform})"]
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool, path=_SANDBOX_PATH) is None:
            missing.append(f"`{tool}` from util-linux (not found on {_SANDBOX_PATH})")
    if os.geteuid() != 0:
        missing.append(f"root, to create mount/PID/network namespaces and switch to an "
                       f"unprivileged uid (this process runs as uid {os.geteuid()})")
    for ns in ("mnt", "pid", "net", "ipc", "uts"):
        if not os.path.exists(f"/proc/self/ns/{ns}"):
            missing.append(f"kernel support for {ns} namespaces (/proc/self/ns/{ns} is missing)")
    try:
        _seccomp()
    except (ImportError, OSError, RuntimeError, ValueError) as e:
        missing.append(f"a seccomp filter for the keyring calls, built by pyseccomp (`pip "
                       f"install pyseccomp`) on the system's libseccomp2: {e}")
    if not os.access(config.python, os.X_OK):
        missing.append(f"an executable interpreter at {config.python}")
    for path in config.readonly_paths:
        if not os.path.exists(path):
            missing.append(f"the read-only path {path} (it does not exist)")
        elif any(_is_under(os.path.realpath(path), r) for r in _RESERVED):
            missing.append(f"a read-only path outside {', '.join(_RESERVED)} ({path} resolves "
                           f"to {os.path.realpath(path)}, which the sandbox makes its own)")
    return missing


def _probe_problems(result: SandboxResult, allowed_top: set[str]) -> list[str]:
    if not result.ok:
        return [f"a probe that did not run ({result.describe()}): {result.stderr.strip()[-500:]}"]
    try:
        report = json.loads(result.stdout)
    except ValueError:
        return [f"unreadable probe output {result.stdout[:200]!r}"]
    unexpected = sorted(set(report["top"]) - allowed_top)
    checks = [
        (report["uid"] != 0 and report["euid"] != 0, f"code running as uid {report['uid']}"),
        (report["gid"] != 0 and report["groups"] in ([], [report["gid"]]),
         f"gid {report['gid']} and groups {report['groups']}"),
        (report["cap_eff"] == 0 and report["cap_bnd"] == 0,
         f"capabilities left (effective {report['cap_eff']:#x}, bounding {report['cap_bnd']:#x})"),
        (report["no_new_privs"] == 1, "no-new-privs not set"),
        (report["network"] != "connected" and report["interfaces"] == ["lo"],
         f"network reachable (interfaces {report['interfaces']}, connect: {report['network']})"),
        (report["pid"] <= 3, f"no private PID namespace (pid {report['pid']})"),
        (not report["root_writable"], "a writable root filesystem"),
        (not unexpected, f"host paths outside the allow-list: {unexpected}"),
        (report["cwd"] == WORKDIR and report["cwd_writable"],
         f"no writable working directory at {WORKDIR} (cwd {report['cwd']})"),
        (report["add_key"] == os.strerror(38),  # ENOSYS, from the seccomp filter
         f"add_key not refused by the seccomp filter ({report['add_key']})"),
    ]
    return [problem for ok, problem in checks if not ok]


@functools.lru_cache(maxsize=1)
def _seccomp() -> dict:
    """The filter's BPF program (hex) and the native numbers of the denied calls.

    Built once here by libseccomp: init loads the program itself with prctl, so it needs neither
    the binding nor libseccomp (and does not pay their import on every run). Exceptions are not
    cached: a missing library is reported again on the next check.
    """
    import errno
    import tempfile

    import pyseccomp

    arch = pyseccomp.system_arch()
    program = pyseccomp.SyscallFilter(pyseccomp.ALLOW)  # other architectures: KILL (its default)
    for name in DENIED_SYSCALLS:
        program.add_rule(pyseccomp.ERRNO(errno.ENOSYS), name)
    with tempfile.TemporaryFile() as f:
        program.export_bpf(f)
        f.seek(0)
        bpf = f.read()
    if not bpf or len(bpf) % 8:
        raise ValueError(f"libseccomp exported a malformed BPF program ({len(bpf)} bytes)")
    return {"bpf": bpf.hex(),
            "numbers": {name: pyseccomp.resolve_syscall(arch, name) for name in DENIED_SYSCALLS}}


# ------------------------------------------------------------------------------ the view, planned

def _interpreter_trees(python: str) -> set[str]:
    # Resolved here: init must not follow the host's symlinks out of the new root.
    return {os.path.realpath(os.path.dirname(os.path.dirname(p)))
            for p in (os.path.abspath(python), os.path.realpath(python))}


def _view_plan(config: SandboxConfig, writable: Mapping[str, str]) -> dict:
    """What init puts into the new root: links to recreate, and binds [host source, inside path,
    "ro" | "rw" | "dev"] in mount order. Raises ValueError for a `writable` entry that would land
    in or above another part of the view."""
    links, readonly = [], set()
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            links.append([path, os.readlink(path)])
        elif os.path.isdir(path):
            readonly.add(os.path.realpath(path))
    readonly |= {p for p in _interpreter_trees(config.python) if p != "/"}
    readonly |= {os.path.realpath(p) for p in config.readonly_paths}
    readonly = {p for p in readonly if os.path.exists(p)
                and not any(_is_under(p, r) for r in _RESERVED)}
    kept: list[str] = []
    for path in sorted(readonly):  # a path inside another one is already there
        if not any(_is_under(path, k) for k in kept):
            kept.append(path)
    binds = [[p, p, "ro"] for p in kept]
    binds += [[f"/dev/{d}", f"/dev/{d}", "dev"] for d in DEVICES if os.path.exists(f"/dev/{d}")]
    taken = [*kept, *(name for name, _ in links), *_RESERVED]
    for source, inside in writable.items():
        if not os.path.isdir(source):
            raise ValueError(f"writable source {source!r} is not a directory")
        if not os.path.isabs(inside) or os.path.normpath(inside) != inside or inside == "/":
            raise ValueError(f"writable inside path {inside!r} must be absolute and normalised")
        clash = [t for t in taken if _is_under(inside, t) or _is_under(t, inside)]
        if clash:
            raise ValueError(f"writable inside path {inside!r} overlaps {clash[0]} of the view")
        taken.append(inside)
        binds.append([os.path.realpath(source), inside, "rw"])
    return {"links": links + [list(pair) for pair in DEV_LINKS], "binds": binds}


def _top_names(plan: dict) -> set[str]:
    names = {p.split("/")[1] for p in (*_RESERVED, *(b[1] for b in plan["binds"]))}
    return names | {name.split("/")[1] for name, _ in plan["links"]}


# ------------------------------------------------------------------------------------- the run

def _execute(config: SandboxConfig, *, argv: list[str], files: Mapping[str, bytes] | None = None,
             stdin: bytes | None = None, cwd: str = WORKDIR,
             writable: Mapping[str, str] | None = None,
             merge_stderr: bool = False) -> SandboxResult:
    uid = config.uid if config.uid is not None else UID_RANGE[0] + secrets.randbelow(
        UID_RANGE[1] - UID_RANGE[0])
    files = dict(files or {})
    plan = _view_plan(config, writable or {})
    status_r, status_w = os.pipe()
    spec = _init_spec(config, uid, status_w, plan=plan, argv=argv, cwd=cwd,
                      files={path: len(data) for path, data in files.items()},
                      stdin_bytes=None if stdin is None else len(stdin),
                      merge_stderr=merge_stderr)
    payload = b"".join([*files.values(), stdin or b""])
    command = [shutil.which("unshare", path=_SANDBOX_PATH) or "unshare", "--net", "--pid",
               "--fork", "--mount", "--mount-proc", "--ipc", "--uts", "--propagation=private",
               "--kill-child", "--", sys.executable, "-I", "-S", "-B", os.path.abspath(__file__),
               "--init", json.dumps(spec)]
    start = time.monotonic()
    try:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=(status_w,), close_fds=True,
                                start_new_session=True, env={"PATH": _SANDBOX_PATH,
                                                             "LANG": "C.UTF-8"})
    except OSError as e:
        os.close(status_r)
        raise SandboxUnavailable(f"cannot start unshare: {e}") from e
    finally:
        os.close(status_w)
    feeder = None
    try:
        if len(payload) <= 1 << 16:  # fits into the empty pipe: never blocks
            _feed(proc.stdin, payload)
        else:  # a thread, so that reading the output goes on meanwhile
            feeder = threading.Thread(target=_feed, args=(proc.stdin, payload), daemon=True)
            feeder.start()
        streams = _collect(proc, status_r, config, start)
    finally:
        _kill(proc)
        proc.wait()
        os.close(status_r)
        if feeder is not None:
            feeder.join()
    out, err, status, stdout_truncated, stderr_truncated, timed_out = streams
    wall = time.monotonic() - start
    report = _parse_report(status)
    if "setup_error" in report:
        raise SandboxUnavailable(f"sandbox set-up failed: {report['setup_error']}")
    killed_by_us = timed_out or stdout_truncated or stderr_truncated
    if "exit_code" in report or "signal" in report:
        exit_code, signum = report.get("exit_code"), report.get("signal")
    elif killed_by_us:
        exit_code, signum = None, signal.SIGKILL
    elif proc.returncode < 0:  # init killed from outside, e.g. by the OOM killer
        exit_code, signum = None, -proc.returncode
    else:
        raise SandboxUnavailable(f"sandbox did not start (unshare exit code {proc.returncode}): "
                                 f"{err.decode(errors='replace').strip()[-1000:]}")
    return SandboxResult(
        stdout=out.decode("utf-8", errors="replace"),
        stderr=err.decode("utf-8", errors="replace"),
        exit_code=exit_code, killed_by=_signal_name(signum) if signum else None,
        timed_out=timed_out or bool(report.get("timed_out")),
        stdout_truncated=stdout_truncated, stderr_truncated=stderr_truncated,
        wall_seconds=wall, cpu_seconds=report.get("cpu_seconds"), uid=uid)


def _feed(pipe, payload: bytes) -> None:
    try:
        pipe.write(payload)
    except (BrokenPipeError, ValueError):
        pass  # init failed before reading, or was killed; its report says why
    finally:
        try:
            pipe.close()
        except BrokenPipeError:
            pass


def _init_spec(config: SandboxConfig, uid: int, status_fd: int, *, plan: dict, argv: list[str],
               cwd: str, files: dict[str, int], stdin_bytes: int | None,
               merge_stderr: bool) -> dict:
    seccomp = _seccomp()
    return {
        "status_fd": status_fd, "uid": uid, "gid": uid,
        "setpriv": shutil.which("setpriv", path=_SANDBOX_PATH) or "setpriv",
        "argv": argv, "cwd": cwd, "files": files, "stdin_bytes": stdin_bytes,
        "merge_stderr": merge_stderr, "python": config.python,
        "env": {"PATH": _INSIDE_PATH, "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8",
                "LC_ALL": "C.UTF-8"},
        "links": plan["links"], "binds": plan["binds"],
        "seccomp_bpf": seccomp["bpf"], "keyctl": seccomp["numbers"]["keyctl"],
        "disk_bytes": config.disk_bytes, "nice": config.nice, "cgroups": list(config.cgroups),
        "deadline_seconds": config.wall_seconds + _INIT_GRACE_SECONDS,
        "limits": {"RLIMIT_CPU": [config.cpu_seconds, config.cpu_seconds + 1],
                   "RLIMIT_AS": [config.memory_bytes] * 2,
                   "RLIMIT_FSIZE": [config.file_size_bytes] * 2,
                   "RLIMIT_NPROC": [config.max_processes] * 2,
                   "RLIMIT_NOFILE": [config.max_open_files] * 2,
                   "RLIMIT_CORE": [0, 0], "RLIMIT_MEMLOCK": [0, 0], "RLIMIT_MSGQUEUE": [0, 0]},
    }


def _collect(proc, status_r, config, start):
    """Reads stdout, stderr and init's report until all close; kills on timeout or overflow."""
    buffers = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
    overflow = {"stdout": False, "stderr": False}
    caps = {"stdout": config.output_bytes, "stderr": config.output_bytes, "status": 1 << 16}
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout.fileno(), selectors.EVENT_READ, "stdout")
    selector.register(proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
    selector.register(status_r, selectors.EVENT_READ, "status")
    deadline = start + config.wall_seconds
    timed_out = killed = False
    try:
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if killed:
                    break  # pipes still open long after the kill: give up on them
                timed_out = killed = True
                _kill(proc)
                deadline = time.monotonic() + _DRAIN_SECONDS
                continue
            for key, _ in selector.select(timeout=remaining):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                name = key.data
                room = caps[name] - len(buffers[name])
                buffers[name] += chunk[:max(room, 0)]
                if len(chunk) > room and name in overflow:
                    overflow[name] = True
                    if not killed:
                        killed = True
                        _kill(proc)
                        deadline = time.monotonic() + _DRAIN_SECONDS
    finally:
        selector.close()
    return (bytes(buffers["stdout"]), bytes(buffers["stderr"]), bytes(buffers["status"]),
            overflow["stdout"], overflow["stderr"], timed_out)


def _kill(proc) -> None:
    """SIGKILL to unshare's process group; --kill-child takes init, and init the namespace."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _parse_report(status: bytes) -> dict:
    line = status.split(b"\n", 1)[0]
    if not line:
        return {}
    try:
        return json.loads(line)
    except ValueError:
        return {"setup_error": f"unreadable report from init: {line[:200]!r}"}


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
