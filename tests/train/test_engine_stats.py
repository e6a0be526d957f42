"""`engine_stats.read` over real sockets: the embedded engine's counters summed over engines,
an engine without them (SGLang) or one that does not answer skipped."""
import http.server
import json
import socket
import threading

import pytest

from sao_jax.train import engine_stats


def serve(info):
    """A loopback HTTP server answering GET /server_info with `info` (JSON); its URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the standard library's name
            body = json.dumps(info).encode()
            self.send_response(200 if self.path == "/server_info" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def servers():
    started = []

    def start(info):
        server, url = serve(info)
        started.append(server)
        return url

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_counters_are_summed_over_the_engines_that_have_them(servers):
    a = servers({"decode_batch_sizes": {"4": 5}, "prefills": 10, "decode_steps": 20,
                 "decode_tokens": 100, "finish_stop": 6, "finish_length": 1, "finish_abort": 3})
    b = servers({"decode_batch_sizes": {}, "prefills": 5, "decode_steps": 10,
                 "decode_tokens": 20, "finish_stop": 5})
    sglang = servers({"version": "0.5.23", "internal_states": [{}]})
    scalars = engine_stats.read([a, b, sglang, closed_port_url()])
    assert scalars["engine/prefills"] == 15 and scalars["engine/decode_steps"] == 30
    assert scalars["engine/decode_batch_mean"] == pytest.approx(120 / 30)
    assert scalars["engine/finish_abort"] == 3 and scalars["engine/finish_length"] == 1
    assert scalars["engine/aborted_frac"] == pytest.approx(3 / 15)
    assert set(scalars) == {f"engine/{n}" for n in engine_stats.COUNTERS} | {
        "engine/decode_batch_mean", "engine/aborted_frac"}


def test_no_scalars_without_an_engine_that_counts(servers):
    """An engine that has not decoded yet has no counters, but is an engine that counts."""
    fresh = engine_stats.read([servers({"decode_batch_sizes": {}})])
    assert fresh["engine/decode_steps"] == 0 and fresh["engine/decode_batch_mean"] == 0
    assert engine_stats.read([servers({"version": "0.5.23"}), closed_port_url()]) == {}
    assert engine_stats.read([]) == {}
