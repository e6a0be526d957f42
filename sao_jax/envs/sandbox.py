"""Run model-generated Python in a sandbox: fresh namespaces, an unprivileged uid, hard limits.

`run_python(code, config)` runs one snippet and returns a `SandboxResult`; nothing the snippet does
can reach the caller. `check_isolation(config)` proves, once per process and interpreter, that the
isolation works and raises `SandboxUnavailable` naming what is missing if it does not; `run_python`
calls it first and refuses to run code without it (fail closed: there is no unsandboxed fallback).

How one run is built, and why:

  worker (root) --Popen--> unshare --net --pid --fork --mount --mount-proc --ipc --uts --kill-child
                             \\-- init (root, PID 1 of the new PID namespace; this file, `--init`)
                                   |  builds the filesystem view, then forks:
                                   \\-- chroot, rlimits, nice, oom_score_adj
                                        -> setpriv (uid drop) -> python /tmp/snippet.py

* Namespaces (`unshare`, util-linux). Network: a new network namespace holds only a loopback device
  that is down, so every connect, even to 127.0.0.1, fails with "Network is unreachable", and
  abstract Unix sockets of the host are out of reach. PID: the snippet sees only its own processes
  (a fresh /proc is mounted), so it can neither signal nor inspect the worker; `kill -9 -1` hits
  only the sandbox. Mount, IPC, UTS: private mounts (below), System V / POSIX IPC and hostname.
  No user namespace: the worker is real root, so the namespaces are made directly.
* Unprivileged uid (`setpriv --reuid --regid --clear-groups --no-new-privs --inh-caps=-all
  --bounding-set=-all`). Rlimits alone stop nothing for root (RLIMIT_NPROC is not enforced for it,
  root ignores file permissions), so the snippet runs as a uid drawn at random from
  [2_000_000_000, 2_100_000_000) for every run: it owns no file on the host, and RLIMIT_NPROC,
  which the kernel counts per uid, is not shared with any other sandbox or user. No capabilities,
  no supplementary groups, and no-new-privs (set-uid binaries and file capabilities grant
  nothing, so `sudo`, `su` or a `ctypes` call to `setuid(0)` fail).
* Filesystem view (built by init with mount(2) through ctypes, then verified). Init binds the
  whole tree recursively at a new root, covers `hidden_paths` (/root, /home, /run, /var/tmp,
  /dev/shm by default: secrets, sockets, world-writable places) with empty tmpfs mounts, binds
  the interpreter's own directories back at their path if they were hidden (a pyenv Python under
  /root keeps working), remounts every mount read-only and nosuid, and puts a fresh tmpfs of
  `disk_bytes` at /tmp, mode 0700, owned by the sandbox uid: the working directory, HOME and
  TMPDIR, and the only writable place. It lives in the mount namespace and vanishes with it, so
  there is nothing to clean up, even if the worker is killed. The repository, /usr, /etc stay
  readable. /proc is the fresh one of the PID namespace, as `unshare --mount-proc` mounts it.
  The snippet is chrooted into the new root: besides the view, that makes the kernel refuse it
  new user namespaces (`CLONE_NEWUSER` fails with EPERM inside a chroot), which closes the usual
  door to the kernel's namespaced-root attack surface. No fd of init's leads outside, and
  without CAP_SYS_CHROOT there is no way back out.
* Limits (setrlimit in the child before exec): RLIMIT_CPU (soft `cpu_seconds`: SIGXCPU, hard one
  second later: SIGKILL), RLIMIT_AS (`memory_bytes`: MemoryError), RLIMIT_FSIZE
  (`file_size_bytes`: Python ignores SIGXFSZ, so writes fail with EFBIG), RLIMIT_NPROC
  (`max_processes`, threads included: fork fails with EAGAIN), RLIMIT_NOFILE, RLIMIT_CORE = 0,
  RLIMIT_MEMLOCK = 0, RLIMIT_MSGQUEUE = 0. The snippet runs at `nice` and with oom_score_adj 1000,
  so the kernel's OOM killer picks it before the worker. Without cgroups, memory is bounded per
  process, so the total is at most `max_processes * memory_bytes + disk_bytes`.
* Wall clock and output. The worker reads stdout and stderr through pipes with a selector, keeps
  at most `output_bytes` of each, and kills the sandbox when either overflows (flag `truncated`)
  or when `wall_seconds` pass (`timed_out`). Killing is one SIGKILL to unshare's process group:
  `--kill-child` turns unshare's death into SIGKILL for init, and when a PID namespace's init dies
  the kernel kills every process in it, whatever sessions or process groups they made. Init also
  enforces the wall clock itself (plus a grace period), so a sandbox outlives a dead worker by at
  most that long. When the snippet's main process exits, init exits too, so background processes
  it leaves behind die with it.
* Environment and input. The snippet gets a scrubbed environment (PATH, HOME, TMPDIR, LANG, LC_ALL);
  the worker's environment never enters the namespace (unshare and init get the same minimal one).
  Stdin is /dev/null; the code reaches init through unshare's stdin and is written, read-only, to
  /tmp/snippet.py, so tracebacks show its lines. Init's report (exit status, signal, CPU time, or
  a set-up error) comes back on a separate pipe, never mixed with the snippet's output.
* Interpreter: `python -I -S -B -u /tmp/snippet.py`. Isolated mode ignores PYTHON* variables and
  the user site; `-S` skips site-packages (the standard library is all there is, unless
  `site_packages=True`); `-B` writes no bytecode; `-u` is unbuffered so that output printed before
  a timeout or a kill is not lost.

What this does not do: no seccomp filter, so the rest of the kernel's syscall surface is reachable;
no cgroup, so the bound on total memory is the product above; the host filesystem outside
`hidden_paths` is readable. Needs Linux, root, and util-linux's `unshare` and `setpriv`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time

WORKDIR = "/tmp"
SNIPPET = "/tmp/snippet.py"
UID_RANGE = (2_000_000_000, 2_100_000_000)
_INIT_GRACE_SECONDS = 2.0  # init's own wall-clock limit is wall_seconds plus this
_DRAIN_SECONDS = 5.0  # after a kill, how long to wait for the pipes to close
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


class SandboxUnavailable(RuntimeError):
    """Isolation cannot be set up here, so model-generated code is not run at all."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed run. Sizes in bytes, times in seconds."""

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
    hidden_paths: tuple[str, ...] = ("/root", "/home", "/run", "/var/tmp", "/dev/shm")
    nice: int = 10  # scheduling niceness added to the snippet
    uid: int | None = None  # None: a fresh uid from UID_RANGE per run (recommended)

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


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when the process was killed by a signal
    killed_by: str | None  # signal name ("SIGKILL", "SIGXCPU", ...) or None
    timed_out: bool  # wall-clock limit reached; the sandbox was killed
    stdout_truncated: bool  # more than output_bytes; the sandbox was killed
    stderr_truncated: bool
    wall_seconds: float  # start-up included
    cpu_seconds: float | None  # user + system time of the main process, when init reported it
    uid: int  # the uid the snippet ran as

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
    return _execute(code, config)


# ------------------------------------------------------------------------------------ isolation

_verified: set[tuple] = set()
_verified_lock = threading.Lock()

_PROBE = r"""
import json, os, socket
report = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
          "pid": os.getpid(), "interfaces": [name for _, name in socket.if_nameindex()],
          "root_writable": os.access("/", os.W_OK), "cwd": os.getcwd(),
          "cwd_writable": os.access(".", os.W_OK)}
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
print(json.dumps(report))
"""


def check_isolation(config: SandboxConfig | None = None) -> None:
    """Raises `SandboxUnavailable`, naming what is missing, unless sandboxing works here.

    First the prerequisites (Linux, root, `unshare`, `setpriv`, namespace support, the
    interpreter), then a live probe through the real mechanism that checks, from inside: an
    unprivileged uid with no groups and no capabilities, no-new-privs, no network, a private PID
    namespace, a read-only root and a writable working directory. Success is cached per process
    for the settings that affect start-up; failure is not.
    """
    config = config or SandboxConfig()
    key = (config.python, config.site_packages, config.hidden_paths)
    with _verified_lock:
        if key in _verified:
            return
        missing = _missing_requirements(config)
        if missing:
            raise SandboxUnavailable("refusing to run model-generated code: the sandbox needs "
                                     + "; ".join(missing))
        probe_config = dataclasses.replace(config, wall_seconds=max(config.wall_seconds, 10.0),
                                           cpu_seconds=max(config.cpu_seconds, 5))
        try:
            result = _execute(_PROBE, probe_config)
        except SandboxUnavailable as e:
            raise SandboxUnavailable(f"refusing to run model-generated code: {e}") from None
        problems = _probe_problems(result)
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
    if not os.access(config.python, os.X_OK):
        missing.append(f"an executable interpreter at {config.python}")
    return missing


def _probe_problems(result: SandboxResult) -> list[str]:
    if not result.ok:
        return [f"a probe that did not run ({result.describe()}): {result.stderr.strip()[-500:]}"]
    try:
        report = json.loads(result.stdout)
    except ValueError:
        return [f"unreadable probe output {result.stdout[:200]!r}"]
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
        (report["cwd"] == WORKDIR and report["cwd_writable"],
         f"no writable working directory at {WORKDIR} (cwd {report['cwd']})"),
    ]
    return [problem for ok, problem in checks if not ok]


# ------------------------------------------------------------------------------------- the run

def _execute(code: str, config: SandboxConfig) -> SandboxResult:
    uid = config.uid if config.uid is not None else UID_RANGE[0] + secrets.randbelow(
        UID_RANGE[1] - UID_RANGE[0])
    status_r, status_w = os.pipe()
    spec = _init_spec(config, uid, status_w)
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
    try:
        try:
            proc.stdin.write(code.encode("utf-8", errors="surrogatepass"))
        except BrokenPipeError:
            pass  # init failed before reading; its report says why
        finally:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        streams = _collect(proc, status_r, config, start)
    finally:
        _kill(proc)
        proc.wait()
        os.close(status_r)
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


def _init_spec(config: SandboxConfig, uid: int, status_fd: int) -> dict:
    flags = ["-I", "-B", "-u"] if config.site_packages else ["-I", "-S", "-B", "-u"]
    # The interpreter's own tree (and a venv's), bind-mounted back if it lies in a hidden path.
    # Paths are resolved here: init must not follow the host's symlinks out of the new root.
    exposed = {os.path.realpath(os.path.dirname(os.path.dirname(p)))
               for p in (os.path.abspath(config.python), os.path.realpath(config.python))}
    hidden = {os.path.realpath(p) for p in config.hidden_paths}
    return {
        "status_fd": status_fd, "uid": uid, "gid": uid,
        "setpriv": shutil.which("setpriv", path=_SANDBOX_PATH) or "setpriv",
        "argv": [config.python, *flags, SNIPPET],
        "env": {"PATH": _SANDBOX_PATH, "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8",
                "LC_ALL": "C.UTF-8"},
        "hidden": sorted(hidden), "exposed": sorted(exposed),
        "disk_bytes": config.disk_bytes, "nice": config.nice,
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


# ---------------------------------------------------------------- init: runs inside, as root
# Started as `python -I -S -B sandbox.py --init SPEC` by unshare: PID 1 of the new PID namespace,
# root in fresh mount/network/IPC/UTS namespaces. Standard library only.

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC = 32, 1024, 2048, 4096, 8192, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
HOLDER = "/tmp"  # init's scratch tmpfs (in init's view; the snippet never sees it)
ROOT = HOLDER + "/root"  # the snippet's root directory
# statvfs flags of a mount (ST_NOSUID, ST_NODEV, ST_NOEXEC, ST_NOATIME, ST_NODIRATIME,
# ST_RELATIME; literal, since `os` lacks some off Linux) and the mount(2) flags keeping them.
_ST_TO_MS = ((1 << 1, MS_NOSUID), (1 << 2, MS_NODEV), (1 << 3, MS_NOEXEC), (1 << 10, MS_NOATIME),
             (1 << 11, MS_NODIRATIME), (1 << 12, MS_RELATIME))


def _init_main(spec: dict) -> None:
    status_fd = spec["status_fd"]
    os.set_inheritable(status_fd, False)

    def report(**fields):
        os.write(status_fd, (json.dumps(fields) + "\n").encode())

    try:
        os.umask(0o022)
        code = _read_all(0)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        libc = _libc()
        _build_view(libc, spec)
        with open(ROOT + SNIPPET, "wb") as f:
            f.write(code)
        os.chmod(ROOT + SNIPPET, 0o444)
        if libc.sethostname(b"sandbox", 7) != 0:
            raise OSError(_errno(), "sethostname failed")
    except Exception as e:  # every set-up failure is reported
        report(setup_error=f"{type(e).__name__}: {e}")
        os._exit(1)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    pid = os.fork()
    if pid == 0:
        _exec_snippet(spec, status_fd)
    status, rusage, timed_out = _supervise(pid, time.monotonic() + spec["deadline_seconds"])
    fields = {"cpu_seconds": round(rusage.ru_utime + rusage.ru_stime, 4), "timed_out": timed_out}
    if os.WIFSIGNALED(status):
        fields["signal"] = os.WTERMSIG(status)
    else:
        fields["exit_code"] = os.WEXITSTATUS(status)
    report(**fields)
    os._exit(0)  # PID 1 exits: the kernel kills whatever the snippet left behind


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
    return libc


def _errno() -> int:
    import ctypes

    return ctypes.get_errno()


def _mount(libc, source, target, fstype, flags, data=None) -> None:
    args = [None if s is None else s.encode() for s in (source, target, fstype)]
    if libc.mount(*args, flags, None if data is None else data.encode()) != 0:
        err = _errno()
        raise OSError(err, f"mount({source}, {target}, {fstype}, {flags:#x}): {os.strerror(err)}")


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _mount_points(under: str) -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")  # octal escapes: \040
            if _is_under(point, under):
                points.append(point)
    return points


def _build_view(libc, spec: dict) -> None:
    """Builds the snippet's root at ROOT: a read-only recursive bind of `/` with hidden paths,
    the interpreter's trees bound back, and a fresh writable tmpfs at /tmp. The snippet is
    chrooted there, which also makes the kernel refuse it new user namespaces."""
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _mount(libc, "sao-holder", HOLDER, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700,size=64k")
    os.mkdir(ROOT)
    _mount(libc, "/", ROOT, None, MS_BIND | MS_REC)

    def inside(path):  # a host path, as init reaches it under ROOT
        return ROOT + path

    hidden = [p for p in spec["hidden"] if os.path.isdir(inside(p))]
    staged = []
    for i, path in enumerate(spec["exposed"]):  # park them while their parents get hidden
        if os.path.isdir(inside(path)) and any(_is_under(path, h) for h in hidden):
            stage = f"{HOLDER}/stage{i}"
            os.mkdir(stage)
            _mount(libc, inside(path), stage, None, MS_BIND | MS_REC)
            staged.append((stage, inside(path)))
    for path in hidden:
        _mount(libc, "sao-hidden", inside(path), "tmpfs", MS_NOSUID | MS_NODEV,
               "mode=0755,size=64k")
    for stage, target in staged:
        os.makedirs(target, 0o755, exist_ok=True)
        _mount(libc, stage, target, None, MS_MOVE)
    for point in _mount_points(under=ROOT):
        if _is_under(point, inside("/proc")):
            continue
        try:
            vfs_flags = os.statvfs(point).f_flag
        except OSError:
            continue  # shadowed by a hidden path
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for st, ms in _ST_TO_MS:
            if vfs_flags & st:
                flags |= ms
        _mount(libc, None, point, None, flags)
    _mount(libc, "sao-work", inside(WORKDIR), "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={spec['disk_bytes']},mode=0700,uid={spec['uid']},gid={spec['gid']}")
    for point in _mount_points(under=ROOT):  # verify: only the work dir (and /proc) is writable
        if _is_under(point, inside("/proc")) or point == inside(WORKDIR):
            continue
        try:
            vfs_flags = os.statvfs(point).f_flag
        except OSError:
            continue
        if not vfs_flags & os.ST_RDONLY:
            raise RuntimeError(f"{point} is still writable after the read-only remount")


def _exec_snippet(spec: dict, status_fd: int) -> None:
    """The forked child: limits, then setpriv drops to the sandbox uid and execs Python."""
    import resource

    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.chroot(ROOT)
        os.chdir(WORKDIR)
        os.nice(spec["nice"])
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
        for name, (soft, hard) in spec["limits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
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
    _init_main(json.loads(sys.argv[2]))
