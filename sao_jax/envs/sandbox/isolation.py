"""`check_isolation`, which proves with a live probe that the sandbox holds before any code runs,
and the public entry points `run_python`, `run_program` and `exposed_paths`; the two run
functions call it first (fail closed: there is no unsandboxed fallback)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import threading
from collections.abc import Mapping, Sequence

from sao_jax.envs.sandbox.config import (
    RESERVED_PATHS,
    SNIPPET,
    TOOL_PATH,
    WORKDIR,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailable,
)
from sao_jax.envs.sandbox.execute import run_sandbox, seccomp_filter, view_plan
from sao_jax.envs.sandbox.init import is_under


def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Runs `code` as a Python program in a fresh sandbox (see the package docstring).

    Raises `SandboxUnavailable` (and runs nothing) when isolation cannot be established. Whatever
    the code does (loops, forks, allocates, floods output, kills), the result comes back here.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    config = config or SandboxConfig()
    check_isolation(config)
    flags = ["-I", "-B", "-u"] if config.site_packages else ["-I", "-S", "-B", "-u"]
    return run_sandbox(config, argv=[config.python, *flags, SNIPPET],
                    files={SNIPPET: code.encode("utf-8", errors="surrogatepass")})


def run_program(argv: Sequence[str], config: SandboxConfig | None = None, *,
                input: str | bytes | None = None, cwd: str = WORKDIR,
                writable: Mapping[str, str] | None = None,
                merge_stderr: bool = True) -> SandboxResult:
    """Runs `argv` (found on the sandbox's PATH) in a fresh sandbox (see the package docstring).

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
    return run_sandbox(config, argv=argv, stdin=input, cwd=cwd, writable=dict(writable or {}),
                    merge_stderr=merge_stderr)


def exposed_paths(config: SandboxConfig | None = None) -> list[str]:
    """The host paths (resolved) that the sandbox shows read-only, system ones included."""
    plan = view_plan(config or SandboxConfig(), {})
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
        probe = _PROBE.replace("ADD_KEY", str(seccomp_filter()["numbers"]["add_key"]))
        try:
            result = run_sandbox(probe_config, argv=[config.python, *flags, SNIPPET],
                              files={SNIPPET: probe.encode()})
        except SandboxUnavailable as e:
            raise SandboxUnavailable(f"refusing to run model-generated code: {e}") from None
        problems = _probe_problems(result, _top_names(view_plan(config, {})))
        if problems:
            raise SandboxUnavailable("refusing to run model-generated code: the isolation probe "
                                     "found " + "; ".join(problems))
        _verified.add(key)


def _missing_requirements(config: SandboxConfig) -> list[str]:
    missing = []
    if not sys.platform.startswith("linux"):
        return [f"Linux namespaces (this platform is {sys.platform})"]
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool, path=TOOL_PATH) is None:
            missing.append(f"`{tool}` from util-linux (not found on {TOOL_PATH})")
    if os.geteuid() != 0:
        missing.append(f"root, to create mount/PID/network namespaces and switch to an "
                       f"unprivileged uid (this process runs as uid {os.geteuid()})")
    for ns in ("mnt", "pid", "net", "ipc", "uts"):
        if not os.path.exists(f"/proc/self/ns/{ns}"):
            missing.append(f"kernel support for {ns} namespaces (/proc/self/ns/{ns} is missing)")
    try:
        seccomp_filter()
    except (ImportError, OSError, RuntimeError, ValueError) as e:
        missing.append(f"a seccomp filter for the keyring calls, built by pyseccomp (`pip "
                       f"install pyseccomp`) on the system's libseccomp2: {e}")
    if not os.access(config.python, os.X_OK):
        missing.append(f"an executable interpreter at {config.python}")
    for path in config.readonly_paths:
        if not os.path.exists(path):
            missing.append(f"the read-only path {path} (it does not exist)")
        elif any(is_under(os.path.realpath(path), r) for r in RESERVED_PATHS):
            missing.append(f"a read-only path outside {', '.join(RESERVED_PATHS)} ({path} resolves "
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


def _top_names(plan: dict) -> set[str]:
    """The names at the root of the view `plan` makes: all that the probe may find there."""
    names = {p.split("/")[1] for p in (*RESERVED_PATHS, *(b[1] for b in plan["binds"]))}
    return names | {name.split("/")[1] for name, _ in plan["links"]}
