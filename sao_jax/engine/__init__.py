"""The embedded inference engine: a continuous-batching JAX decoder serving SGLang's native HTTP
API, and the launcher of real SGLang servers.

    python -m sao_jax.engine.server --model-path DIR --port N   # the embedded engine
    python -m sao_jax.engine.sglang_server                      # SGLang's virtualenv (make sglang)

server.py is the HTTP server; scheduler.py the `Engine` (its request queue, requests.py; the model
on the device, runner.py; its KV-cache slots, slots.py; its jitted programs, programs.py; its
model directory, model_io.py); sglang_api.py the protocol both ends read, sglang_replies.py the
shapes the engine answers in; http_json.py the reader of hostile JSON bodies; sglang_server.py,
sglang_child.py and sgl_kernel_cpu/ start real SGLang servers.

Imports run one way: the rollout plane (its client, its proxy) and the learner import this package;
it imports neither. Here are the names they use. The protocol and the HTTP reader load without JAX
(the rollout client and workers import them and run without it); `Engine` and `EngineFailure` pull
in JAX and the model, so they load on first use. The server module is not imported here: a package
that imports the module run with -m makes Python warn.
"""

from sao_jax.engine.http_json import HTTPError, bad_request, json_body
from sao_jax.engine.sglang_api import (
    CACHE_NOT_FLUSHED,
    DEFAULT_MAX_NEW_TOKENS,
    PAUSE_MODES,
    PAUSE_MODES_SINCE,
    SPANS_SINCE,
    UNKNOWN_VERSION,
    BadRequest,
    EngineError,
    Limits,
    RequestSpec,
    Segment,
    error_message,
    parse_generate,
    parse_generate_reply,
    parse_server_version,
    routed_experts,
)

__all__ = [
    "CACHE_NOT_FLUSHED",
    "DEFAULT_MAX_NEW_TOKENS",
    "PAUSE_MODES",
    "PAUSE_MODES_SINCE",
    "SPANS_SINCE",
    "UNKNOWN_VERSION",
    "BadRequest",
    "Engine",
    "EngineError",
    "EngineFailure",
    "HTTPError",
    "Limits",
    "RequestSpec",
    "Segment",
    "bad_request",
    "error_message",
    "json_body",
    "parse_generate",
    "parse_generate_reply",
    "parse_server_version",
    "routed_experts",
]

_ON_FIRST_USE = {"Engine": "sao_jax.engine.scheduler", "EngineFailure": "sao_jax.engine.scheduler"}


def __getattr__(name: str):
    if name in _ON_FIRST_USE:
        import importlib

        return getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
