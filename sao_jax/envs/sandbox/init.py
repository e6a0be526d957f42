"""The sandbox's init (see the package docstring): PID 1 of a run's new PID namespace, root in
fresh mount, network, IPC and UTS namespaces. It joins a new session keyring, builds the code's
filesystem view, forks the child that takes the limits and the seccomp filter and execs setpriv,
and reports how the code ended on its status pipe.

Started as `python -I -S -B .../sandbox/init.py --init SPEC` by unshare (`execute.py`), by file
path, so it is not imported as part of the package: standard library only, and only the imports
at the top of this file, since every command pays for what init imports. The worker imports it
for the names both sides share (WORKDIR, BIN_DIR, `is_under`).
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
BIN_DIR = "/sandbox/bin"  # `python` and `python3`: the configured interpreter

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


def is_under(path, root) -> bool:
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
            if is_under(point, under):
                mounts.append((int(fields[0]), int(fields[1]), point, set(fields[5].split(b","))))
    return mounts


def _build_view(libc, spec: dict, payload: bytes) -> int:
    """Builds the code's root at ROOT (see the package docstring) and returns an fd for its stdin.

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
        if is_under(point, proc):
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
        if is_under(point, proc) or (mount_id, point) in stacked:
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
