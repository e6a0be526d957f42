"""Where and how the trajectory stream listens (`Listener`): the gRPC server, its address, the
token every call must carry off loopback, and the limits on connections (`sao_jax.rollout.stream`,
"Hostile input"). `TrajectoryServer` (server.py) serves its RPCs through one.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Callable
from concurrent import futures

import grpc

from sao_jax.rollout.proto import trajectory_pb2_grpc as pb_grpc
from sao_jax.rollout.stream.client import DEFAULT_MAX_MESSAGE_BYTES

log = logging.getLogger("sao_jax.rollout.stream.server")  # the server's logger: its messages


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _TokenCheck(grpc.ServerInterceptor):
    def __init__(self, token: str, on_reject):
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            on_reject()
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong token (send 'authorization: Bearer <token>')")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and hmac.compare_digest(value.encode(), self._expected):
                return continuation(handler_call_details)
        return self._deny


class Listener:
    """A threaded gRPC server for a `TrajectoryServiceServicer`, not started until `start`.

    Args:
      host, port: where to listen; port 0 picks a free one (see `port`, `address`).
      token: required on every call when set; binding a non-loopback host requires one.
      max_workers: server threads. A Submit waiting for room holds one; further calls queue.
      max_message_bytes: gRPC message limit, both directions.
      handshake_timeout_s: a connection that has not completed its HTTP/2 handshake (the
        client's preface and SETTINGS, and its acknowledgement of the server's SETTINGS) this
        long after it opened is closed (gRPC's defaults: 120 s, and 60 s for the
        acknowledgement).
      idle_timeout_s: a connection with no call in progress for this long is closed (gRPC
        sends GOAWAY; a worker's client reconnects at its next call). None: never.
      max_connections: open connections allowed at once (each rollout worker holds one); more
        are closed as they open, and their clients retry.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                 max_workers: int = 64, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 handshake_timeout_s: float = 10.0, idle_timeout_s: float | None = 120.0,
                 max_connections: int = 256):
        if not handshake_timeout_s > 0:
            raise ValueError(f"handshake_timeout_s must be positive, got {handshake_timeout_s}")
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be positive (or None), got {idle_timeout_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        if not is_loopback(host) and not token:
            raise ValueError(f"binding {host!r} would expose the trajectory stream beyond this "
                             "machine: pass token=... (workers send it as metadata)")
        self._host, self._port = host, port
        self._token = token
        self._max_workers = max_workers
        self._max_message_bytes = max_message_bytes
        self._handshake_timeout_s = handshake_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._max_connections = max_connections
        self._server: grpc.Server | None = None

    def start(self, servicer: pb_grpc.TrajectoryServiceServicer,
              on_unauthenticated: Callable[[], None]) -> None:
        """Binds and starts serving `servicer`'s RPCs; a call without the token is refused and
        `on_unauthenticated()` told."""
        interceptors = []
        if self._token:
            interceptors.append(_TokenCheck(self._token, on_unauthenticated))
        handshake_ms = max(1, round(self._handshake_timeout_s * 1000))
        options = [("grpc.max_receive_message_length", self._max_message_bytes),
                   ("grpc.max_send_message_length", self._max_message_bytes),
                   ("grpc.so_reuseport", 0),  # never share a port with a stale server
                   # A connection that never finishes its handshake is closed (default: 120 s),
                   ("grpc.server_handshake_timeout_ms", handshake_ms),
                   # and so is one that never acknowledges the server's SETTINGS (default: 60 s):
                   # a client that sent its preface and stopped.
                   ("grpc.http2.settings_timeout", handshake_ms),
                   ("grpc.max_allowed_incoming_connections", self._max_connections)]
        if self._idle_timeout_s is not None:  # a connection open with no call in progress
            options.append(("grpc.max_connection_idle_ms",
                            max(1, round(self._idle_timeout_s * 1000))))
        self._server = grpc.server(
            futures.ThreadPoolExecutor(self._max_workers, thread_name_prefix="trajectory-stream"),
            interceptors=interceptors, options=options)
        pb_grpc.add_TrajectoryServiceServicer_to_server(servicer, self._server)
        host = f"[{self._host}]" if ":" in self._host else self._host
        self._port = self._server.add_insecure_port(f"{host}:{self._port}")
        self._server.start()
        log.info("trajectory stream listening on %s", self.address)

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._port}"

    def stop(self, grace: float) -> None:
        """Stops serving (if started), waiting up to `grace` seconds for calls in progress."""
        if self._server is not None:
            self._server.stop(grace).wait()
