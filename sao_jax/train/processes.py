"""The learner's child processes: inference engines (embedded, or SGLang servers started on this
host) and rollout workers.

Children get `--parent-pid` and exit on their own when the learner dies, even by SIGKILL. Their pids
are written to `<workdir>/children.json`; a learner starting in the same workdir first waits for
(and if need be kills) the children of a previous run, so it never meets stale servers.

A child that dies on its own can be started again with the command line it was started with
(`exited`, `respawn`), at most `max_restarts` times per name and run; then `respawn` raises
`ChildExited` naming its log. What a restart must also do (an engine loading the current
weights, a worker's leases coming back) is the learner's business (`supervisor.Supervisor`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence

CHILDREN_FILE = "children.json"


class ChildExited(RuntimeError):
    """An engine or worker died on its own; the message names its log file."""


EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10_000  # below: ports that well-known services may claim


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux: `EPHEMERAL_PORTS`; elsewhere Linux's default):
    the ports it hands out to sockets bound to port 0 and to outgoing connections."""
    try:
        with open(EPHEMERAL_PORTS) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free on 127.0.0.1 now, for another process to listen on: below the ephemeral range
    where there is room, since a port the kernel hands out (`bind(("", 0))`) can be handed out
    again, as an outgoing connection's or a port-0 socket's (SGLang's own), during a server's
    start-up, and the server then fails to bind it. A server we start ourselves gets a held
    socket instead (`listening_socket`)."""
    low, _ = ephemeral_ports()
    if low - LOWEST_PORT >= 1000:
        rng = random.SystemRandom()
        for _ in range(100):
            port = rng.randrange(LOWEST_PORT, low)
            if port_is_free(port):
                return port
    with socket.socket() as s:  # no room below the range, or nothing free there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (`free_port`)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def listening_socket(port: int = 0) -> socket.socket:
    """A socket listening on 127.0.0.1:`port` (0: a free one) for an engine to serve on
    (`embedded_engine_command`). The port is held from this moment: a port that was merely found
    free can be taken by another process during an engine's seconds of start-up, and the
    learner would then talk to that process."""
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def port_is_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:`port` now (as aiohttp binds: SO_REUSEADDR,
    so connections of a dead server left in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _alive(pid: int) -> bool:
    """Whether `pid` runs a sao_jax process (pids get reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return b"sao_jax" in cmdline and state != "Z"


def reap_previous(workdir: str, timeout_s: float = 15.0, log=print) -> None:
    """Waits for the children recorded by a previous run to exit; kills those that do not."""
    path = os.path.join(workdir, CHILDREN_FILE)
    if not os.path.exists(path):
        return
    with open(path) as f:
        pids = [int(p) for p in json.load(f).get("pids", [])]
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            log(f"killing process {pid} left over from a previous run")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    os.remove(path)


def engine_argv(model_path: str, *, port: int, weight_version: int, max_batch: int,
                max_seq_len: int, seed: int, compilation_cache_dir: str | None = None,
                listen_fd: int | None = None, warmup_prefills: bool = False,
                routed_experts: bool = False) -> list[str]:
    """The embedded engine's command line (after the interpreter); `warmup_prefills`: it
    compiles every prefill bucket before it answers (`Engine.warmup`); `routed_experts`: it
    reports the experts of every token on request (routing replay)."""
    argv = ["-m", "sao_jax.engine.server", "--model-path", model_path, "--port", str(port),
            "--max-batch", str(max_batch), "--max-seq-len", str(max_seq_len),
            "--weight-version", str(weight_version), "--seed", str(seed),
            "--log-level", "WARNING"]
    if listen_fd is not None:
        argv += ["--listen-fd", str(listen_fd)]
    if compilation_cache_dir:
        argv += ["--compilation-cache-dir", compilation_cache_dir]
    if warmup_prefills:
        argv.append("--warmup-prefills")
    if routed_experts:
        argv.append("--enable-return-routed-experts")
    return argv


@dataclasses.dataclass(frozen=True)
class Command:
    """How a child is started: `python argv... --parent-pid <learner>` in `env` (None: this
    process's environment). Engines other than the embedded one run another interpreter (an
    SGLang server: SGLang's virtualenv, `engine.sglang_server`)."""

    argv: tuple[str, ...]
    python: str = sys.executable
    env: dict[str, str] | None = None
    # A listening socket the child inherits and serves on (its fd is in `argv`); the learner's
    # copy is closed once the child has started, so a command with one starts one child only.
    listen: socket.socket | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def port(self) -> int:
        """The port the child serves on (an engine's `--port`)."""
        return int(self.argv[self.argv.index("--port") + 1])


def embedded_engine_command(model_path: str, *, port: int = 0, **options) -> Command:
    """The embedded engine's command, serving on a socket bound here on `port` (0: a free one;
    `listening_socket`); `options` are `engine_argv`'s."""
    sock = listening_socket(port)
    return Command(tuple(engine_argv(model_path, port=sock.getsockname()[1],
                                     listen_fd=sock.fileno(), **options)), listen=sock)


def worker_command(argv: Sequence[str]) -> list[str]:
    """A rollout worker's command line (after the interpreter) from its own arguments."""
    return ["-m", "sao_jax.rollout.worker", *argv]


class Children:
    """Starts and stops the engines and workers of one run.

    `priority` is their CPU scheduling class: "normal"; "low" (niceness 10); or "idle"
    (SCHED_IDLE: they run only on CPU time no normal process wants, and yield the moment the
    learner's step needs a core). On a shared host a learner step slowed by rollouts delays
    every trajectory after it; when rollouts are the bottleneck instead, "normal" can be faster.
    """

    PRIORITIES = ("normal", "low", "idle")

    @classmethod
    def check_priority(cls, priority: str) -> None:
        if priority not in cls.PRIORITIES:
            raise ValueError(f"config.rollout.priority must be one of {cls.PRIORITIES}, got "
                             f"{priority!r}.")

    def __init__(self, workdir: str, log=print, priority: str = "normal", max_restarts: int = 0):
        self.check_priority(priority)
        if max_restarts < 0:
            raise ValueError(f"config.rollout.max_restarts must be >= 0, got {max_restarts}.")
        self.workdir = workdir
        self.log = log
        self.priority = priority
        self.max_restarts = max_restarts
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.commands: dict[str, Command] = {}  # name -> the command it was last started with
        self.restarts: collections.Counter[str] = collections.Counter()
        self.log_dir = os.path.join(workdir, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self._lock = threading.Lock()  # procs and children.json: restarts run on threads too

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def _spawn(self, name: str, command: Sequence[str] | Command) -> subprocess.Popen:
        if not isinstance(command, Command):
            command = Command(tuple(command))
        if command.listen is not None and command.listen.fileno() < 0:
            raise ValueError(f"{name}'s command served on a socket that its first child took: "
                             "start it again with a new command (embedded_engine_command)")
        out = open(self.log_path(name), "ab")  # noqa: SIM115 - the child owns it
        try:
            proc = subprocess.Popen(
                [command.python, *command.argv, "--parent-pid", str(os.getpid())],
                stdout=out, stderr=subprocess.STDOUT, env=command.env,
                pass_fds=() if command.listen is None else (command.listen.fileno(),),
                start_new_session=True)  # Ctrl-C reaches the learner only
        finally:
            out.close()
            if command.listen is not None:
                command.listen.close()  # the child's now: a dead child frees the port
        # Set from here (threads the child starts later inherit it): a pre-exec hook would fork
        # this multithreaded process.
        if self.priority == "low":
            os.setpriority(os.PRIO_PROCESS, proc.pid, 10)
        elif self.priority == "idle":
            os.sched_setscheduler(proc.pid, os.SCHED_IDLE, os.sched_param(0))
        with self._lock:
            self.procs = [(n, p) for n, p in self.procs if n != name]  # a restart replaces it
            self.procs.append((name, proc))
            self.commands[name] = command
            self._record()
        return proc

    def _record(self) -> None:
        tmp = os.path.join(self.workdir, CHILDREN_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"learner": os.getpid(), "pids": [p.pid for _, p in self.procs]}, f)
        os.replace(tmp, os.path.join(self.workdir, CHILDREN_FILE))

    def start_engine(self, name: str, model_path: str, *, weight_version: int, max_batch: int,
                     max_seq_len: int, seed: int, timeout_s: float = 300.0,
                     port: int | None = None, compilation_cache_dir: str | None = None) -> str:
        """Starts an embedded engine (on `port`, default a free one; compiled programs in
        `compilation_cache_dir` when given) and returns its URL once it generates."""
        command = embedded_engine_command(model_path, port=port or 0,
                                          weight_version=weight_version, max_batch=max_batch,
                                          max_seq_len=max_seq_len, seed=seed,
                                          compilation_cache_dir=compilation_cache_dir)
        return self.wait_ready(name, self._spawn(name, command), command.port, timeout_s)

    def start_engines(self, names: Sequence[str], model_path: str, *, weight_version: int,
                      options: Sequence[dict], timeout_s: float = 300.0) -> list[str]:
        """Starts several embedded engines at once (`options`: each one's `max_batch`,
        `max_seq_len`, `seed`, optional `compilation_cache_dir`) and returns their URLs once all
        generate."""
        return self.start_servers(names, [
            embedded_engine_command(model_path, weight_version=weight_version, **opts)
            for opts in options], timeout_s)

    def start_servers(self, names: Sequence[str], commands: Sequence[Command],
                      timeout_s: float = 300.0) -> list[str]:
        """Starts engines of any kind at once, each serving on its command's port, and returns
        their URLs once all generate."""
        if len(names) != len(commands):
            raise ValueError(f"{len(names)} names for {len(commands)} commands")
        procs = [self._spawn(name, command)
                 for name, command in zip(names, commands, strict=True)]
        return [self.wait_ready(name, proc, command.port, timeout_s)
                for name, proc, command in zip(names, procs, commands, strict=True)]

    def wait_ready(self, name: str, proc: subprocess.Popen, port: int,
                   timeout_s: float = 300.0) -> str:
        """The engine's URL once `/health_generate` answers 200; raises `ChildExited` if it
        exits first, TimeoutError after `timeout_s`."""
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise ChildExited(f"engine {name} exited with code {proc.returncode} during "
                                   f"start-up; see {self.log_path(name)}")
            try:
                with urllib.request.urlopen(url + "/health_generate", timeout=5) as reply:
                    if reply.status == 200:
                        return url
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {name} not ready after {timeout_s:.0f} s; see "
                                   f"{self.log_path(name)}")
            time.sleep(0.2)

    def start_worker(self, name: str, argv: Sequence[str]) -> None:
        self._spawn(name, worker_command(argv))

    def check(self) -> None:
        """Raises if a child died on its own."""
        for name, code in self.exited():
            raise ChildExited(f"{name} exited with code {code}; see {self.log_path(name)}")

    def exited(self) -> list[tuple[str, int]]:
        """`(name, exit code)` of every child that died on its own (negative: by that signal)."""
        with self._lock:
            procs = list(self.procs)
        return [(name, proc.returncode) for name, proc in procs if proc.poll() is not None]

    def respawn(self, name: str, command: Sequence[str] | Command | None = None
                ) -> subprocess.Popen:
        """Starts `name` again, with `command` or the one it had; counts the restart.

        Raises `ChildExited`, naming its log, once `name` has been restarted `max_restarts`
        times in this run.
        """
        with self._lock:
            code = dict((n, p.returncode) for n, p in self.procs).get(name)
            if self.restarts[name] >= self.max_restarts:
                if isinstance(command, Command) and command.listen is not None:
                    command.listen.close()
                raise ChildExited(
                    f"{name} exited (code {code}) after {self.restarts[name]} restarts in this "
                    f"run (config.rollout.max_restarts = {self.max_restarts}); see "
                    f"{self.log_path(name)}")
            self.restarts[name] += 1
            command = self.commands[name] if command is None else command
        return self._spawn(name, command)

    def stop(self, names: Sequence[str] | None = None, timeout_s: float = 10.0) -> None:
        """Terminates the named children (all by default) and waits for them."""
        with self._lock:
            chosen = [(n, p) for n, p in self.procs if names is None or n in names]
        for _, proc in chosen:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for _, proc in chosen:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with self._lock:
            self.procs = [(n, p) for n, p in self.procs if (n, p) not in chosen]
            self._record()
            if not self.procs:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.workdir, CHILDREN_FILE))
