"""A learner spanning processes: start-up, the leader's messages to the others, and liveness.

One process, the leader (process 0), owns everything that is not the step: the trajectory
server and its leases, the engines and workers, the initial and final evaluations, weight
publishing's engine updates, TensorBoard, the progress line and `summary.json`. Every process
runs every computation on the global arrays (the step, writing the weights, saving the
checkpoint), in the same order, as multi-controller JAX requires. The followers learn what to
run from the leader's messages (`Cluster.send` / `receive`, `learner.follow`): one per
computation, with the batch's arrays in it.

How the batch reaches every process, and why: the leader builds the batch's host arrays
(`make_batch`) from the trajectories only it receives, and broadcasts them to the followers over
the devices' own collectives (`multihost_utils.broadcast_one_to_all`: the arrays as one byte
array; the message saying what to run, and how long that array is, goes first through the
coordinator's key-value store); every process then places the same full batch
(`jax.device_put` keeps only its devices' shards). One owner keeps the stream's exactly-once
accounting (leases, consumed ids, the log) in one place, and a batch is small next to the step
(about 20 bytes per token against the step's gigaflops per token), so sending all of it to every
process costs little and needs no second data path.

Start-up (`initialize`): with `--coordinator`/`--num_processes`/`--process_id` (main's flags)
or JAX's variables `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` (what
`sao_jax.launch`, i.e. `make train PROCS=N`, sets), or on a TPU VM (where JAX asks the VM's metadata
for the slice's hosts, one process each; a single-host VM is a slice of one),
`jax.distributed.initialize` runs before anything else touches JAX; otherwise the run is one
process and nothing here does anything.

Liveness (`Cluster.watch`): every follower holds a TCP connection to the leader (its port, and a
token the follower must send first, are published through the coordinator's key-value store;
anything else that connects is dropped). A process that dies, even by SIGKILL,
closes it at once, and the other side stops: the leader stops its engines and workers and exits
naming the process; a follower exits naming the leader. Without this, the survivors block in
their next collective until JAX's heartbeat timeout kills them, leaving the leader's children
running.
"""

from __future__ import annotations

import dataclasses
import hmac
import io
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from sao_jax import on_tpu_vm

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
LIVENESS_KEY = "sao_jax/liveness"
MESSAGE_KEY = "sao_jax/message"
LOST_EXIT_CODE = 3  # a process that stops because another one died
FINISH_TIMEOUT_S = 600  # a follower's last checkpoint, say
MESSAGE_TIMEOUT_S = 7200  # a follower still compiling the step when the first message comes
HEARTBEAT_TIMEOUT_S = 100  # JAX's default: how long a hung (not dead) process is waited for
HANDSHAKE_TIMEOUT_S = 300  # every follower connects to the leader's liveness port by then
HELLO_TIMEOUT_S = 10  # a connection names itself this fast, or is dropped
HELLO_MAX_BYTES = 256


@dataclasses.dataclass(frozen=True)
class Settings:
    """Where the processes meet; `num_processes` 1: a single-process run."""

    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    tpu_pod: bool = False  # JAX detects the slice's processes itself


def settings(coordinator: str | None = None, num_processes: int | None = None,
             process_id: int | None = None) -> Settings:
    """The explicit values, else JAX's environment variables, else a TPU VM slice's.

    Raises:
      ValueError: an incomplete or inconsistent set, naming what to give.
    """
    env = {name: os.environ.get(name) for name in ENV}
    coordinator = coordinator or env["JAX_COORDINATOR_ADDRESS"]
    num = num_processes if num_processes is not None else _int(env["JAX_NUM_PROCESSES"],
                                                               "JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else _int(env["JAX_PROCESS_ID"],
                                                         "JAX_PROCESS_ID")
    if coordinator is None and num is None and pid is None:
        return Settings(tpu_pod=on_tpu_vm())
    if coordinator is None or num is None or pid is None:
        raise ValueError("a multi-process run needs all of --coordinator (host:port of process "
                         "0), --num_processes and --process_id (or JAX_COORDINATOR_ADDRESS, "
                         "JAX_NUM_PROCESSES and JAX_PROCESS_ID); got "
                         f"coordinator={coordinator!r}, num_processes={num}, process_id={pid}.")
    if num < 1 or not 0 <= pid < num:
        raise ValueError(f"--process_id={pid} must be in [0, --num_processes={num}).")
    return Settings(coordinator, num, pid)


def _int(text: str | None, name: str) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer.") from None


def initialize(s: Settings) -> None:
    """`jax.distributed.initialize` for a multi-process run; nothing for a single process."""
    if s.num_processes == 1 and not s.tpu_pod:
        return
    import jax

    if s.tpu_pod:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(s.coordinator, s.num_processes, s.process_id,
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)


class Cluster:
    """This process's place in the run, and the leader's channel to the others."""

    def __init__(self, s: Settings | None = None):
        import jax

        self.settings = s or Settings()
        self.index, self.count = jax.process_index(), jax.process_count()
        self._sent = 0  # messages sent (leader) or received (follower)
        self._finished = False
        self._listener: socket.socket | None = None
        self._peers: list[socket.socket] = []
        self.lost = threading.Event()  # set when another process's connection dropped
        self.lost_what: str | None = None  # which one ("process 1")

    @property
    def leader(self) -> bool:
        return self.index == 0

    @property
    def multi(self) -> bool:
        return self.count > 1

    def finish(self) -> None:
        """The run is over: from here on a process exiting is no loss. Returns when every
        process got here."""
        self._finished = True
        self.barrier("finished", FINISH_TIMEOUT_S)

    def barrier(self, name: str, timeout_s: float) -> None:
        """Waits until every process reaches the barrier `name` (once per name and run)."""
        if self.multi:
            _client().wait_at_barrier(f"sao_jax/{name}", int(timeout_s * 1000))

    # Messages: the leader sends, every follower receives the same, in order. The message
    # itself goes through the coordinator's key-value store, where a follower may wait for
    # hours (the leader evaluating, say); then every process meets at the coordinator's barrier
    # for that message, so that none enters the collectives that follow (the arrays' broadcast,
    # the computation the message names) while another is still busy (a follower compiling the
    # step at start-up, say): gloo gives a collective's first use 30 s for every process to
    # arrive, and no process should sit in a device collective for what another does on its
    # host.

    def send(self, kind: str, **arrays) -> None:
        """The leader tells the followers to run `kind` with `arrays` (numpy, or scalars)."""
        if not self.multi:
            return
        blob = _encode(arrays) if arrays else b""
        self._sent += 1
        _client().key_value_set(f"{MESSAGE_KEY}/{self._sent}", f"{kind} {len(blob)}")
        self.barrier(f"message/{self._sent}", MESSAGE_TIMEOUT_S)
        if blob:
            self._broadcast(blob, len(blob))

    def receive(self) -> tuple[str, dict[str, np.ndarray]]:
        """A follower's next message from the leader: `(kind, arrays)`."""
        self._sent += 1
        key = f"{MESSAGE_KEY}/{self._sent}"
        while True:
            try:
                kind, size = _client().blocking_key_value_get(key, 60_000).split()
                break
            except Exception as e:  # noqa: BLE001 - the client raises its own error types
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self.barrier(f"message/{self._sent}", MESSAGE_TIMEOUT_S)
        size = int(size)
        return kind, (_decode(self._broadcast(None, size)) if size else {})

    def _broadcast(self, blob: bytes | None, size: int) -> bytes:
        from jax.experimental import multihost_utils

        padded = 1 << max(10, (size - 1).bit_length())  # a few sizes: a few compiles
        buffer = np.zeros(padded, np.uint8)
        if blob is not None:
            buffer[:size] = np.frombuffer(blob, np.uint8)
        return np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:size].tobytes()

    # Liveness.

    def _dropped(self, what: str, on_lost: Callable[[str], None]) -> None:
        if self._finished:  # the run ended: exits are no losses
            return
        self.lost_what = self.lost_what or what
        self.lost.set()
        on_lost(what)

    def watch(self, on_lost: Callable[[str], None], timeout_s: float = HANDSHAKE_TIMEOUT_S
              ) -> None:
        """Calls `on_lost(what)` (on a thread) as soon as another process's connection drops:
        on the leader any follower, on a follower the leader. `on_lost` should not return.

        A follower proves it belongs to the run with a token that only the coordinator's
        key-value store holds; a connection that does not say `<index> <token>` for an index not
        yet seen within `HELLO_TIMEOUT_S` (a port scanner, a stray client, a half-open socket)
        is closed and the leader keeps accepting. Raises `TimeoutError` naming the processes that
        did not connect within `timeout_s`."""
        if not self.multi:
            return
        client = _client()
        if self.leader:
            token = secrets.token_hex(16)
            self._listener = socket.create_server((_leader_host(self.settings), 0))
            host, port = self._listener.getsockname()[:2]
            client.key_value_set(LIVENESS_KEY, f"{host}:{port}:{token}")
            missing = set(range(1, self.count))
            deadline = time.monotonic() + timeout_s
            while missing:
                self._listener.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    raise TimeoutError(
                        f"processes {sorted(missing)} did not connect to the leader's liveness "
                        f"port {host}:{port} within {timeout_s:.0f} s") from None
                index = _hello(conn, token, missing)
                if index is None:
                    conn.close()
                    continue
                missing.discard(index)
                conn.settimeout(None)
                self._peers.append(conn)
                _watch(conn, lambda i=index: self._dropped(f"process {i}", on_lost))
        else:
            address = client.blocking_key_value_get(LIVENESS_KEY, int(timeout_s * 1000))
            host, port, token = address.rsplit(":", 2)
            conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
            conn.sendall(f"{self.index} {token}\n".encode())
            conn.settimeout(None)
            self._peers.append(conn)
            _watch(conn, lambda: self._dropped("process 0, the leader", on_lost))


def _hello(conn: socket.socket, token: str, expected: set[int]) -> int | None:
    """The index a connecting follower names with the run's token, or None (a wrong token, an
    index not expected, or nothing sensible within `HELLO_TIMEOUT_S`)."""
    conn.settimeout(HELLO_TIMEOUT_S)
    line = b""
    try:
        while not line.endswith(b"\n") and len(line) < HELLO_MAX_BYTES:
            chunk = conn.recv(HELLO_MAX_BYTES - len(line))
            if not chunk:
                return None
            line += chunk
    except OSError:  # the timeout included
        return None
    index, _, given = line.decode("ascii", "replace").strip().partition(" ")
    if not (index.isdigit() and hmac.compare_digest(given.encode(), token.encode())):
        return None
    return int(index) if int(index) in expected else None


def _leader_host(s: Settings) -> str:
    """Where the leader listens for the followers: the coordinator's host as configured
    (127.0.0.1 for `sao_jax.launch`), or on a TPU slice this host's own address."""
    if s.coordinator:
        return s.coordinator.rsplit(":", 1)[0].strip("[]")
    return socket.gethostbyname(socket.gethostname())


def _watch(conn: socket.socket, lost: Callable[[], None]) -> None:
    def wait():
        try:
            while conn.recv(1024):
                pass
        except OSError:
            pass
        lost()

    threading.Thread(target=wait, name="liveness", daemon=True).start()


def batch_arrays(batch) -> dict[str, np.ndarray]:
    """A `train.batch.Batch` as flat named arrays, for `Cluster.send` (fields that are None,
    such as `routes` without routing replay, left out)."""
    arrays = {k: v for k, v in batch._asdict().items() if k != "packing" and v is not None}
    if batch.packing is not None:
        arrays.update({f"packing.{k}": v for k, v in batch.packing._asdict().items()
                       if v is not None})
    return arrays


def batch_of(arrays: dict[str, np.ndarray]):
    """The `Batch` `batch_arrays` flattened (other keys are ignored)."""
    from sao_jax.train.batch import Batch, Packing

    packing = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith("packing.")}
    return Batch(**{k: arrays.get(k) for k in Batch._fields if k != "packing"},
                 packing=Packing(**packing) if packing else None)


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def _encode(arrays: dict) -> bytes:
    out = io.BytesIO()
    np.savez(out, **{k: np.asarray(v) for k, v in arrays.items()})
    return out.getvalue()


def _decode(blob: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(blob), allow_pickle=False) as data:
        return {k: data[k] for k in data.files}
