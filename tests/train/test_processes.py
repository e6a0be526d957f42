"""Children of the learner: priority, publishing and stopping (end-to-end kill tests:
tests/faults)."""

import os
import socket
import threading
import time

import pytest

from sao_jax.train.processes import Children


@pytest.mark.parametrize("priority", ["low", "idle"])
def test_children_run_at_the_configured_lower_priority(tmp_path, priority):
    children = Children(str(tmp_path), log=lambda *_: None, priority=priority)
    proc = children._spawn("sleeper", ["-c", "import time; time.sleep(30)"])
    try:
        if priority == "low":
            assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, os.getpriority(
                os.PRIO_PROCESS, 0) + 10)
        else:
            assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        assert children.procs == [("sleeper", proc)]
    finally:
        start = time.monotonic()
        children.stop()
        assert proc.poll() is not None and time.monotonic() - start < 10
    with pytest.raises(ValueError, match="rollout.priority"):
        Children(str(tmp_path), priority="nice")


def test_children_are_restarted_a_bounded_number_of_times(tmp_path):
    """`exited` lists children that died on their own; `respawn` starts one again with its
    command line, `max_restarts` times, then raises naming its log."""
    from sao_jax.train.processes import ChildExited

    children = Children(str(tmp_path), log=lambda *_: None, max_restarts=2)
    proc = children._spawn("quitter", ["-c", "import sys; sys.exit(3)"])
    try:
        proc.wait(30)
        assert children.exited() == [("quitter", 3)]
        for restart in (1, 2):
            again = children.respawn("quitter")
            assert again.pid != proc.pid and children.restarts["quitter"] == restart
            assert [p for _, p in children.procs] == [again]  # it replaces the dead one
            again.wait(30)
        with pytest.raises(ChildExited, match=r"quitter exited \(code 3\) after 2 restarts.*"
                                              r"max_restarts = 2.*quitter\.log"):
            children.respawn("quitter")
    finally:
        children.stop()
    with pytest.raises(ValueError, match="rollout.max_restarts"):
        Children(str(tmp_path), max_restarts=-1)


@pytest.fixture
def refusing_engine():
    """An HTTP server that refuses every weight update (400, success false) and knows no other
    route: an engine that is up but cannot load the weights."""
    import http.server
    import json

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._reply(404, {"detail": "Not Found"})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/update_weights_from_disk":
                self._reply(400, {"success": False, "message": "corrupt safetensors"})
            elif self.path in ("/pause_generation", "/continue_generation"):
                self._reply(200, {})  # the client pauses around an aborting load
            else:
                self._reply(404, {"detail": "Not Found"})

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_background_publish_leaves_a_dead_engine_behind_and_fails_on_a_refusal(
        tmp_path, refusing_engine):
    """`Publisher.submit` returns at once; the thread writes `weights/v<N>` for a new version
    (not for one already published). An engine that cannot be reached
    is left `behind` with a warning, the version counts as published; an engine that refuses
    the weights is a TrainingError from `wait`."""

    from sao_jax.train.console import TrainingError
    from sao_jax.train.publish import Publisher
    from tests.train.trainers import trainer_for

    trainer = trainer_for("grpo_dis")
    state = trainer.init_state()
    dead = "http://127.0.0.1:9"  # nothing listens there
    said = []
    publisher = Publisher(str(tmp_path), [dead], started=0, log=said.append)
    publisher.submit(trainer, state, 0)  # version 0: the engines started with it, nothing to do
    publisher.wait()
    assert not os.listdir(os.path.join(str(tmp_path), "weights"))
    publisher.submit(trainer, state, 2)
    publisher.wait()  # no error: the run goes on without that engine
    assert os.path.exists(os.path.join(publisher.path(2), "config.json"))
    assert publisher.version == 2 and publisher.behind == {dead}
    assert len(said) == 1 and f"weights v2 not loaded on {dead}" in said[0]
    publisher.catch_up()  # still down: still behind, not warned again
    assert publisher.behind == {dead} and len(said) == 1
    publisher.close()  # else its thread retries the dead engine, logging after the test ends

    publisher = Publisher(str(tmp_path), [refusing_engine], started=2, log=said.append)
    publisher.submit(trainer, state, 4)
    with pytest.raises(TrainingError, match="publishing weights.*corrupt safetensors"):
        publisher.wait()
    assert publisher.version == 2  # the engine never took it
    publisher.close()


def test_closing_the_publisher_cancels_an_engine_update_under_way(tmp_path, caplog):
    """Stopping a run mid-publish: `close` cancels the update the background thread is waiting
    on (the engine is about to be stopped) instead of letting the client retry it against a dead
    engine, with a warning per attempt, as it did on Ctrl-C."""
    import http.server
    import logging

    from sao_jax.train.publish import Publisher
    from tests.train.trainers import trainer_for

    arrived, release, calls = threading.Event(), threading.Event(), []

    class Holding(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            calls.append(self.path)
            if self.path == "/update_weights_from_disk":
                arrived.set()
                release.wait(30)  # an engine busy loading; the client gives up on it first
            data = b"{}"  # pause and continue (around the load) answer at once
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Holding)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    trainer = trainer_for("grpo_dis")
    said = []
    publisher = Publisher(str(tmp_path), [url], log=said.append)
    try:
        publisher.submit(trainer, trainer.init_state(), 0)
        assert arrived.wait(60), "the update never reached the engine"
        caplog.set_level(logging.WARNING)
        start = time.monotonic()
        publisher.close()
        assert time.monotonic() - start < 2.0
        assert publisher._updating is None
        publisher.wait()  # the cancelled publish is no error
        assert publisher.behind == {url} and not said
        # not retried, and the engine paused for the load is continued
        assert calls == ["/pause_generation", "/update_weights_from_disk",
                         "/continue_generation"]
        assert not [r for r in caplog.records if "retry" in r.getMessage()]
    finally:
        release.set()
        server.shutdown()


def _deliver(sig):
    """Sends `sig` to this process and gives the main thread bytecodes to run its handler on."""
    import signal

    signal.pthread_kill(threading.main_thread().ident, sig)
    for _ in range(100):
        time.sleep(0.001)


def test_stop_requests_defer_signals_to_safe_points_and_restore_the_handlers():
    import signal

    from sao_jax.train.console import StopRequests

    before = {s: signal.getsignal(s) for s in StopRequests.SIGNALS}
    with StopRequests() as stops:
        _deliver(signal.SIGINT)  # outside interruptible(): only the flag
        assert stops.requested
        with pytest.raises(KeyboardInterrupt):
            stops.check()
    assert {s: signal.getsignal(s) for s in StopRequests.SIGNALS} == before

    with StopRequests() as stops:
        stops.check()  # nothing requested: no-op
        with pytest.raises(KeyboardInterrupt), stops.interruptible():
            _deliver(signal.SIGTERM)  # raises here, at once
            raise AssertionError("the signal did not interrupt the wait")
    assert {s: signal.getsignal(s) for s in StopRequests.SIGNALS} == before


def test_engines_share_the_learners_compilation_cache():
    """The learner's engines keep their programs in its JAX cache (off with the cache)."""
    from experiments import toy
    from sao_jax.train.build import compilation_cache_dir
    from sao_jax.train.processes import engine_argv

    config = toy.get_config()
    config.warm_start.cache_dir = "/cache"
    path = compilation_cache_dir(config)
    assert path == "/cache/jax"
    argv = engine_argv("/m", port=1, weight_version=0, max_batch=2, max_seq_len=8, seed=0,
                       compilation_cache_dir=path)
    assert argv[argv.index("--compilation-cache-dir") + 1] == "/cache/jax"
    config.compilation_cache = False
    assert compilation_cache_dir(config) is None
    assert "--compilation-cache-dir" not in engine_argv("/m", port=1, weight_version=0,
                                                        max_batch=2, max_seq_len=8, seed=0)
    assert "--warmup-prefills" not in argv
    assert "--warmup-prefills" in engine_argv("/m", port=1, weight_version=0, max_batch=2,
                                              max_seq_len=8, seed=0, warmup_prefills=True)


def test_injected_staleness_serves_the_weights_lag_publishes_back(tmp_path):
    """`rollout.lag_versions` = 2: after each publish the engine holds the version two
    publishes older (the newest while the lag builds up from the start), `newest()` gives it the
    newest for an evaluation and then the lagged one back, and the served version stays on
    disk. A lag that `max_staleness` would drop whole is refused, naming both fields."""
    import asyncio
    import json
    import urllib.request

    from experiments import toy
    from sao_jax.models.hf import COMPLETE_MARKER
    from sao_jax.train.build import check_config
    from sao_jax.train.publish import Publisher
    from tests.rollout.sglang_stub import StubSGLang

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    stub = StubSGLang("0.5.23")
    url = asyncio.run_coroutine_threadsafe(stub.start(), loop).result(30)

    def label():
        with urllib.request.urlopen(url + "/model_info", timeout=10) as r:
            return json.load(r)["weight_version"]

    def save(model, path):  # the weights themselves do not matter to the stub
        os.makedirs(path)
        open(os.path.join(path, COMPLETE_MARKER), "w").close()

    try:
        publisher = Publisher(str(tmp_path), [url], lag=2, save=save, log=print)
        publisher.publish(None, 0)
        served = []
        for version in range(1, 6):
            publisher.publish(None, version)
            served.append(label())
        assert served == ["0", "0", "1", "2", "3"]
        assert (publisher.version, publisher.served) == (5, 3)
        with publisher.newest():
            assert label() == "5"
        assert label() == "3" and publisher.served == 3
        assert sorted(os.listdir(tmp_path / "weights")) == ["v3", "v4", "v5"]
    finally:
        asyncio.run_coroutine_threadsafe(stub.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
    with pytest.raises(ValueError, match="rollout.lag_versions must be >= 0"):
        Publisher(str(tmp_path), [], lag=-1)
    config = toy.get_config()
    config.rollout.lag_versions, config.max_staleness = 3, 2
    with pytest.raises(ValueError, match=r"lag_versions = 3 .*max_staleness = 2"):
        check_config(config)
    config.max_staleness = 7
    check_config(config)


SERVE_ON_FD = "import socket, sys; c, _ = socket.socket(fileno=int(sys.argv[1])).accept(); " \
              "c.sendall(b'engine')"


def test_an_engines_port_is_held_from_before_the_engine_starts(tmp_path):
    """An embedded engine serves on a socket the learner bound: no other process can take the
    port while the engine starts (CI once saw a test's server take a port found free, and an
    engine's client talk to it), and the learner's copy closes once the child has it."""
    from sao_jax.train.processes import Command, embedded_engine_command, listening_socket

    command = embedded_engine_command("/m", weight_version=0, max_batch=1, max_seq_len=8, seed=0)
    argv = command.argv
    assert argv[argv.index("--listen-fd") + 1] == str(command.listen.fileno())
    with pytest.raises(OSError):
        listening_socket(command.port)
    child = Command(("-c", SERVE_ON_FD, str(command.listen.fileno()), "--port",
                     str(command.port)), listen=command.listen)
    children = Children(str(tmp_path), max_restarts=1)
    proc = children._spawn("engine0", child)
    assert command.listen.fileno() == -1
    with socket.create_connection(("127.0.0.1", command.port), timeout=10) as conn:
        assert conn.recv(16) == b"engine"
    assert proc.wait(10) == 0
    listening_socket(command.port).close()  # the child is gone: so is its hold on the port
    with pytest.raises(ValueError, match="new command"):
        children.respawn("engine0")


def test_ports_for_servers_that_bind_their_own_lie_below_the_ephemeral_range(monkeypatch):
    """SGLang binds the port it is given some seconds after we chose it; a port the kernel handed
    out for bind(0) can meanwhile go to one of its own port-0 sockets (CI once saw SGLang fail
    to bind its HTTP port so). So free ports come from below the ephemeral range, free now."""
    from sao_jax.train import processes

    low, _ = processes.ephemeral_ports()
    ports = processes.free_ports(20)
    assert len(set(ports)) == 20
    if low - processes.LOWEST_PORT >= 1000:
        assert all(processes.LOWEST_PORT <= p < low for p in ports)
    for port in ports[:3]:
        processes.listening_socket(port).close()  # free indeed
    with processes.listening_socket(0) as held:  # a taken port is never given
        taken = held.getsockname()[1]
        monkeypatch.setattr(processes.random, "SystemRandom", lambda: _Always(taken))
        monkeypatch.setattr(processes, "ephemeral_ports", lambda: (taken + 1, 60999))
        monkeypatch.setattr(processes, "LOWEST_PORT", taken - 2000)
        assert processes.free_port() != taken  # nothing free below: the kernel's choice
    monkeypatch.setattr(processes, "ephemeral_ports", lambda: (1024, 65535))  # no room
    assert processes.free_port() >= 1024


class _Always:
    def __init__(self, port):
        self.port = port

    def randrange(self, low, high):
        return self.port
