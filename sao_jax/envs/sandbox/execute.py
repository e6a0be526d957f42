"""One sandboxed run, from the worker's side: the view planned, init's spec (with the seccomp
filter that libseccomp builds here), unshare started on `init.py`, the pipes read under the wall
clock and the output caps, the sandbox killed, and init's report turned into a `SandboxResult`.
Callers go through `isolation.py`, which proves the isolation before anything runs."""

from __future__ import annotations

import functools
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
from collections.abc import Mapping

from sao_jax.envs.sandbox import init
from sao_jax.envs.sandbox.config import (
    BIN_DIR,
    DENIED_SYSCALLS,
    DEV_LINKS,
    DEVICES,
    RESERVED_PATHS,
    SYSTEM_PATHS,
    TOOL_PATH,
    UID_RANGE,
    WORKDIR,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailable,
)
from sao_jax.envs.sandbox.init import is_under

_INIT_GRACE_SECONDS = 2.0  # init's own wall-clock limit is wall_seconds plus this
_DRAIN_SECONDS = 5.0  # after a kill, how long to wait for the pipes to close
_INSIDE_PATH = f"{BIN_DIR}:/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


@functools.lru_cache(maxsize=1)
def seccomp_filter() -> dict:
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


def view_plan(config: SandboxConfig, writable: Mapping[str, str]) -> dict:
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
                and not any(is_under(p, r) for r in RESERVED_PATHS)}
    kept: list[str] = []
    for path in sorted(readonly):  # a path inside another one is already there
        if not any(is_under(path, k) for k in kept):
            kept.append(path)
    binds = [[p, p, "ro"] for p in kept]
    binds += [[f"/dev/{d}", f"/dev/{d}", "dev"] for d in DEVICES if os.path.exists(f"/dev/{d}")]
    taken = [*kept, *(name for name, _ in links), *RESERVED_PATHS]
    for source, inside in writable.items():
        if not os.path.isdir(source):
            raise ValueError(f"writable source {source!r} is not a directory")
        if not os.path.isabs(inside) or os.path.normpath(inside) != inside or inside == "/":
            raise ValueError(f"writable inside path {inside!r} must be absolute and normalised")
        clash = [t for t in taken if is_under(inside, t) or is_under(t, inside)]
        if clash:
            raise ValueError(f"writable inside path {inside!r} overlaps {clash[0]} of the view")
        taken.append(inside)
        binds.append([os.path.realpath(source), inside, "rw"])
    return {"links": links + [list(pair) for pair in DEV_LINKS], "binds": binds}


# ------------------------------------------------------------------------------------- the run

def run_sandbox(config: SandboxConfig, *, argv: list[str],
                files: Mapping[str, bytes] | None = None, stdin: bytes | None = None,
                cwd: str = WORKDIR, writable: Mapping[str, str] | None = None,
                merge_stderr: bool = False) -> SandboxResult:
    """Runs `argv` in one fresh sandbox with `files` ({inside path: bytes}) written into its /tmp,
    without proving the isolation first: callers go through `isolation.py`, which does."""
    uid = config.uid if config.uid is not None else UID_RANGE[0] + secrets.randbelow(
        UID_RANGE[1] - UID_RANGE[0])
    files = dict(files or {})
    plan = view_plan(config, writable or {})
    status_r, status_w = os.pipe()
    spec = _init_spec(config, uid, status_w, plan=plan, argv=argv, cwd=cwd,
                      files={path: len(data) for path, data in files.items()},
                      stdin_bytes=None if stdin is None else len(stdin),
                      merge_stderr=merge_stderr)
    payload = b"".join([*files.values(), stdin or b""])
    command = [shutil.which("unshare", path=TOOL_PATH) or "unshare", "--net", "--pid",
               "--fork", "--mount", "--mount-proc", "--ipc", "--uts", "--propagation=private",
               "--kill-child", "--", sys.executable, "-I", "-S", "-B",
               os.path.abspath(init.__file__), "--init", json.dumps(spec)]
    start = time.monotonic()
    try:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=(status_w,), close_fds=True,
                                start_new_session=True, env={"PATH": TOOL_PATH,
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
    seccomp = seccomp_filter()
    return {
        "status_fd": status_fd, "uid": uid, "gid": uid,
        "setpriv": shutil.which("setpriv", path=TOOL_PATH) or "setpriv",
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
