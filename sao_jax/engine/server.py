"""The embedded inference engine: SGLang's native HTTP API over a continuous-batching JAX decoder.

    python -m sao_jax.engine.server --model-path DIR [--host 127.0.0.1] [--port 30000]
        [--max-batch 32] [--max-seq-len 2048] [--weight-version 0] [--dtype auto]
        [--header-timeout-s 30] [--body-timeout-s 30] [--compilation-cache-dir DIR]

`DIR` is a Hugging Face directory as `sao_jax.models.save_hf` writes it (one it has not finished
writing is refused, at start-up and in weight updates: `models.hf.check_complete`). Requests carry
token ids (`input_ids`); when `DIR` holds a `tokenizer.json`, they may carry `text` and `stop`
strings too, and replies carry `text` (as SGLang with its tokenizer; without one, as its
`--skip-tokenizer-init`).

This module is the HTTP server (routes, timeouts, streaming, the process); `sglang_api.py` is the
protocol (parsing, validation), `sglang_replies.py` its reply and chunk shapes; `scheduler.py` is
the `Engine` (the scheduler; `slots.py` its KV-cache slots), `programs.py` its jitted programs
(prefill, decode step, sampling) and `model_io.py` its model directory (tokenizer, EOS ids,
weight-update validation).
The routes, each as SGLang 0.5.23 serves it unless
docs/rollout.md, "The embedded engine's HTTP API", says otherwise:

  POST /generate (PUT too)        one prompt or a batch (`input_ids` or `text`), `n` samples,
                                  `stream` (server-sent events), log-probs of the output, of the
                                  prompt (`logprob_start_len`) and of given ids
                                  (`token_ids_logprob`), `sampling_seed`; unknown fields -> 400
  POST /update_weights_from_disk  `model_path`, `weight_version`, `abort_all_requests`,
                                  `keep_pause`, `drain_timeout_s` (ours: running requests may
                                  finish this long before an aborting load cuts them)
                                  -> {success, message, num_paused_requests}
  POST /update_weight_version     `new_version`, `abort_all_requests` (default true)
  POST /abort_request             `rid` (or `abort_all`) -> 200, empty body
  POST /pause_generation          `mode`: "abort" (default), "in_place", "retract"
  POST /continue_generation
  GET  /health, /health_generate  200 when a token can be generated, 503 while paused
  GET  /ready                     200 unless paused or the last health check failed
  GET  /model_info, /server_info (and 0.5.2's /get_model_info, /get_server_info,
       /get_weight_version), /v1/models, /v1/models/{id}, /v1/loads
  GET/POST /flush_cache           forgets the prefix cache (what free slots still hold)

Errors: `/generate` answers 400 with SGLang's `{"error": {"message"}}` (plus `param`, the field),
other routes with SGLang's `{"object": "error", "message", "type", "param", "code"}`. A streamed
request that fails after its stream began gets SGLang's error chunk, then `data: [DONE]`.

Hostile clients: bodies that are not JSON, nest too deep or hold huge integers are 400 (the
reader the proxy uses too, `http_json.json_body`); a connection that has not sent a complete
request head within `--header-timeout-s` (or sits idle between requests that long) is closed by a
watchdog, and a body that does not arrive within `--body-timeout-s` closes its connection; nothing
a request holds reaches the device unchecked (`sglang_api`).

Lifetime: the engine exits when its parent process dies (it polls its parent pid; `--parent-pid 0`
turns that off), so a learner killed even by SIGKILL leaves no engine behind.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import time
import uuid

import jax
from aiohttp import web

from sao_jax.engine import sglang_api as api
from sao_jax.engine import sglang_replies as replies
from sao_jax.engine.http_json import HTTPError, json_body  # the one reader of hostile JSON
from sao_jax.engine.scheduler import Engine, EngineFailure
from sao_jax.engine.sglang_api import BadRequest, RequestSpec
from sao_jax.lifetime import watch_parent

log = logging.getLogger("sao_jax.engine")

HEALTH_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
DEFAULT_HEADER_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 30.0
SGLANG_VERSION = "0.5.23"  # the API this engine follows


class _Timeout(Exception):
    """A client stalled; its connection is closed."""


# ------------------------------------------------------------------------------------------------
# Connections: the header/idle watchdog and the body timeout.


class ConnectionWatchdog:
    """Closes connections that hold no request in a handler for `timeout_s`: a request head sent
    half (aiohttp has no header timeout) or a keep-alive connection left idle. Handlers mark
    themselves busy (`enter`/`leave`); a task sweeps `server.connections` every `timeout_s / 4`.
    """

    def __init__(self, server: web.Server, timeout_s: float):
        self.server, self.timeout_s = server, timeout_s
        self._since: dict = {}  # handler -> when it last had no request in a handler
        self._busy: dict = {}
        self.closed = 0

    def enter(self, protocol):
        self._busy[protocol] = self._busy.get(protocol, 0) + 1

    def leave(self, protocol):
        self._busy[protocol] -= 1
        if not self._busy[protocol]:
            del self._busy[protocol]
            self._since[protocol] = time.monotonic()

    async def run(self):
        while True:
            await asyncio.sleep(self.timeout_s / 4)
            now = time.monotonic()
            live = set(self.server.connections)
            for handler in list(self._since):
                if handler not in live:
                    del self._since[handler]
            for handler in live:
                if handler in self._busy:
                    continue
                since = self._since.setdefault(handler, now)
                if now - since > self.timeout_s and handler.transport is not None:
                    log.info("closing a connection that sent no complete request in %.0f s",
                             self.timeout_s)
                    handler.transport.close()
                    self._since.pop(handler, None)
                    self.closed += 1


async def read_json(request: web.Request, timeout_s: float, *, required: bool = True) -> dict:
    """The request's JSON object body within `timeout_s` (else the connection is closed)."""
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        if request.transport is not None:
            request.transport.close()
        raise _Timeout(f"the body did not arrive within {timeout_s:.0f} s") from None
    if required and not raw.strip():
        raise BadRequest("body", "empty request body; send a JSON object.")
    try:
        return await json_body(request)  # reads the cached body
    except HTTPError as e:
        raise BadRequest("body", str(e)) from None


# ------------------------------------------------------------------------------------------------
# HTTP.


def _generate_error(status: int, message: str, field: str | None = None) -> web.Response:
    return web.json_response(replies.error_body(message, field), status=status)


def _error(status: int, message: str, field: str | None = None) -> web.Response:
    return web.json_response(replies.openai_error_body(status, message, field), status=status)


def error_middleware(watchdog: ConnectionWatchdog | None):
    """Errors answered as SGLang answers them (`/generate`'s shape, or the other routes'): a bad
    request 400, an engine failure 500, a stalled body 408; each request marked busy for the
    `watchdog` while its handler runs."""

    @web.middleware
    async def errors(request, handler):
        protocol = request.protocol
        if watchdog is not None:
            watchdog.enter(protocol)
        error = _generate_error if request.path == "/generate" else _error
        try:
            return await handler(request)
        except BadRequest as e:
            return error(400, str(e), e.field)
        except EngineFailure as e:
            return error(500, str(e))
        except _Timeout as e:
            return error(408, str(e))
        finally:
            if watchdog is not None:
                watchdog.leave(protocol)

    return errors


class Handlers:
    """The routes' handlers over one `Engine` (`build_app` routes them): generation, weights and
    control, health and information."""

    def __init__(self, engine: Engine, body_timeout_s: float):
        self.engine, self.body_timeout_s = engine, body_timeout_s
        self.limits = api.Limits(engine.cfg.vocab_size, engine.max_seq_len, engine.tokenizer,
                                 engine.runner.routed_experts)
        self.healthy = True  # SGLang's server_status: each health check sets it, /ready reads it

    async def body(self, request, required=True):
        return await read_json(request, self.body_timeout_s, required=required)

    # -- generation --------------------------------------------------------------------------------

    async def generate(self, request):
        engine = self.engine
        specs, many = api.parse_generate(await self.body(request), self.limits)
        taken = [s.rid for s in specs if s.rid in engine.requests.by_rid]
        if taken:
            raise BadRequest("rid", f"duplicate request id {taken[0]!r}: a request with this id "
                                    "is still running.")
        reqs = [engine.submit(spec) for spec in specs]
        if specs[0].stream:
            return await self.stream(request, reqs, many)
        try:
            replies = await asyncio.gather(*(r.future for r in reqs))
        except asyncio.CancelledError:  # the client went away: free the slots
            for r in reqs:
                engine.cancel(r, "Aborted: the client disconnected.")
            raise
        return web.json_response(replies if many else replies[0])

    async def stream(self, request, reqs, many):
        """SGLang's server-sent events: each chunk the request's cumulative reply so far
        (`finish_reason` null until the last), `index` in a batch, then `data: [DONE]`."""
        engine = self.engine
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        sent = {id(r): 0 for r in reqs}
        pending = set(reqs)
        try:
            while pending:
                waits = {asyncio.ensure_future(r.changed.wait()): r for r in pending}
                done, rest = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in rest:
                    task.cancel()
                for index, req in enumerate(reqs):
                    if req not in pending or not req.changed.is_set():
                        continue
                    req.changed.clear()
                    if req.future.done():
                        pending.discard(req)
                        if req.future.exception() is not None:
                            chunk = replies.stream_error(str(req.future.exception()), 500)
                        else:
                            chunk = req.future.result()
                    elif len(req.output) - sent[id(req)] >= req.spec.stream_interval:
                        chunk = engine.reply(req)
                    else:
                        continue
                    sent[id(req)] = len(req.output)
                    if many:
                        chunk = {**chunk, "index": index}
                    await response.write(replies.sse_chunk(chunk))
            await response.write(replies.SSE_DONE)
        except (asyncio.CancelledError, ConnectionError):  # the client went away
            for r in reqs:
                engine.cancel(r, "Aborted: the client disconnected.")
            raise
        return response

    # -- weights and control -----------------------------------------------------------------------

    async def update_weights_from_disk(self, request):
        b = await self.body(request)
        path = b.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path", "required: the directory of the new weights.")
        version = b.get("weight_version")
        if version is not None and not isinstance(version, str | int):
            raise BadRequest("weight_version", f"must be a string, got {version!r}.")
        for key in ("abort_all_requests", "keep_pause", "flush_cache", "is_async",
                    "torch_empty_cache", "recapture_cuda_graph"):
            if b.get(key) is not None and not isinstance(b.get(key), bool):
                raise BadRequest(key, f"must be true or false, got {b.get(key)!r}.")
        if b.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest("load_format", "only safetensors directories are supported.")
        if b.get("manifest") is not None:
            raise BadRequest("manifest", "tensor manifests are not supported.")
        drain = b.get("drain_timeout_s", 0)
        if isinstance(drain, bool) or not isinstance(drain, int | float) or not 0 <= drain <= 60:
            raise BadRequest("drain_timeout_s", f"must be seconds in [0, 60] (not SGLang's: how "
                             f"long running requests may finish before an aborting load cuts "
                             f"them), got {drain!r}.")
        # Shielded: a client that hangs up must not leave the engine half-updated.
        ok, message, aborted = await asyncio.shield(self.engine.update_weights(
            path, None if version is None else str(version),
            abort_all=bool(b.get("abort_all_requests")), keep_pause=bool(b.get("keep_pause")),
            drain_s=float(drain)))
        return web.json_response({"success": ok, "message": message,
                                  "num_paused_requests": aborted}, status=200 if ok else 400)

    async def update_weight_version(self, request):
        b = await self.body(request)
        version = b.get("new_version")
        if not isinstance(version, str) or not version:
            raise BadRequest("new_version", "required: the new weight version (a string).")
        abort_all = b.get("abort_all_requests", True)
        if not isinstance(abort_all, bool):
            raise BadRequest("abort_all_requests", f"must be true or false, got {abort_all!r}.")
        if abort_all:
            await asyncio.shield(self.engine.requests.command("abort_all",
                                                     "Aborted by /update_weight_version."))
        self.engine.weight_version = version
        return web.json_response({"success": True, "message": f"Weight version updated to "
                                  f"{version}", "new_version": version})

    async def abort_request(self, request):
        b = await self.body(request, required=False)
        rid = b.get("rid")
        if b.get("abort_all"):
            await asyncio.shield(self.engine.requests.abort(None, "Aborted by /abort_request."))
        elif isinstance(rid, str) and rid:
            await asyncio.shield(self.engine.requests.abort([rid], "Aborted by /abort_request."))
        else:
            raise BadRequest("rid", "required: the request id to abort (or abort_all=true).")
        return web.Response(status=200)

    async def pause_generation(self, request):
        b = await self.body(request, required=False)
        mode = b.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest("mode", f"must be abort, in_place or retract, got {mode!r}.")
        await asyncio.shield(self.engine.requests.command("pause", mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request):
        await self.body(request, required=False)
        await asyncio.shield(self.engine.requests.command("continue"))
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def flush_cache(self, request):
        self.engine.flush_cache()
        return web.Response(text="Cache flushed.\n")

    # -- health and information --------------------------------------------------------------------

    async def health_generate(self, request):
        """SGLang: 200 once one token is generated (or the engine is visibly generating), 503
        otherwise; while paused SGLang's check waits its timeout and answers 503, here at once."""
        engine = self.engine
        if engine.requests.paused:
            return web.Response(status=503)
        if engine.num_running and time.monotonic() - engine.last_step_time < HEALTH_TIMEOUT_S:
            self.healthy = True
            return web.Response(status=200)
        req = engine.submit(RequestSpec(prompt=(0,), max_new_tokens=1, temperature=0.0,
                                        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}"))
        try:
            await asyncio.wait_for(asyncio.shield(req.future), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineFailure):
            engine.cancel(req, "health check timed out")
            self.healthy = False
            return web.Response(status=503)
        self.healthy = True
        return web.Response(status=200)

    async def ready(self, request):
        return web.Response(status=200 if self.healthy and not self.engine.requests.paused
                            else 503)

    async def get_weight_version(self, request):
        return web.json_response({"weight_version": self.engine.weight_version})

    async def model_info(self, request):
        engine = self.engine
        hf = engine.cfg.to_hf()
        return web.json_response({
            "model_path": engine.model_path, "served_model_name": engine.served_model_name,
            "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": engine.weight_version, "load_format": "safetensors",
            "model_type": hf["model_type"], "architectures": hf["architectures"]})

    async def server_info(self, request):
        return web.json_response({**self.engine.server_info(), "version": SGLANG_VERSION,
                                  "frontend": "sao_jax", "startup_time": self.engine.started})

    def model_card(self):
        engine = self.engine
        return {"id": engine.served_model_name, "object": "model", "created": int(engine.started),
                "owned_by": "sglang", "root": engine.served_model_name, "parent": None,
                "max_model_len": engine.max_seq_len}

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self.model_card()]})

    async def retrieve_model(self, request):
        name = request.match_info["model"]
        if name != self.engine.served_model_name:
            return web.json_response({"error": {
                "message": f"The model '{name}' does not exist", "type": "invalid_request_error",
                "param": "model", "code": "model_not_found"}}, status=404)
        return web.json_response(self.model_card())

    async def loads(self, request):
        """SGLang's `/v1/loads`: one load snapshot (this engine is one data-parallel rank)."""
        engine, queue = self.engine, self.engine.requests
        running, waiting = engine.num_running, len(queue.waiting) + len(queue.held)
        used = sum(len(r.spec.prompt) + len(r.output) for r in engine.slots.active())
        total = engine.max_batch * engine.max_seq_len
        load = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": running,
                "num_waiting_reqs": waiting, "num_used_tokens": used, "num_total_tokens": used,
                "max_total_num_tokens": total, "max_running_requests": engine.max_batch,
                "token_usage": used / total, "utilization": running / engine.max_batch,
                "queues": {"waiting": len(queue.waiting), "grammar": 0,
                           "paused": len(queue.held), "retracted": 0, "prealloc_ready": 0}}
        return web.json_response({"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                              time.gmtime()),
                                  "version": SGLANG_VERSION, "accelerator": None,
                                  "num_accelerators": 1, "loads": [load]})


def build_app(engine: Engine, *, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
              watchdog: ConnectionWatchdog | None = None) -> web.Application:
    """The aiohttp application serving `engine` (run `engine.run()` beside it)."""
    h = Handlers(engine, body_timeout_s)
    app = web.Application(client_max_size=64 << 20, middlewares=[error_middleware(watchdog)])
    app.add_routes([
        web.post("/generate", h.generate),
        web.put("/generate", h.generate),
        web.post("/update_weights_from_disk", h.update_weights_from_disk),
        web.post("/update_weight_version", h.update_weight_version),
        web.post("/abort_request", h.abort_request),
        web.post("/pause_generation", h.pause_generation),
        web.post("/continue_generation", h.continue_generation),
        web.get("/health", h.health_generate),
        web.get("/health_generate", h.health_generate),
        web.get("/ready", h.ready),
        web.get("/get_weight_version", h.get_weight_version),
        web.get("/model_info", h.model_info),
        web.get("/get_model_info", h.model_info),
        web.get("/server_info", h.server_info),
        web.get("/get_server_info", h.server_info),
        web.get("/v1/models", h.models),
        web.get("/v1/models/{model:.+}", h.retrieve_model),
        web.get("/v1/loads", h.loads),
        web.post("/flush_cache", h.flush_cache),
        web.get("/flush_cache", h.flush_cache),
    ])
    return app


# ------------------------------------------------------------------------------------------------
# Process.


async def serve(args) -> None:
    engine = Engine(args.model_path, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                    dtype=args.dtype, weight_version=args.weight_version, seed=args.seed,
                    dispatch=args.dispatch, routed_experts=args.enable_return_routed_experts)
    engine.warmup(prefills=args.warmup_prefills)
    watchdog: ConnectionWatchdog | None = None
    app = build_app(engine, body_timeout_s=args.body_timeout_s,
                    watchdog=_Deferred(lambda: watchdog))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    watchdog = ConnectionWatchdog(runner.server, args.header_timeout_s)
    if args.listen_fd is None:
        site = web.TCPSite(runner, args.host, args.port)
    else:  # bound by the parent, which holds the port from before this process started
        site = web.SockSite(runner, socket.socket(fileno=args.listen_fd))
    await site.start()
    tasks = [asyncio.create_task(engine.run()), asyncio.create_task(watchdog.run())]
    stop = asyncio.Event()

    def task_ended(task: asyncio.Task):
        if not task.cancelled():
            log.critical("a server task stopped (%r): exiting", task.exception())
            stop.set()

    for task in tasks:
        task.add_done_callback(task_ended)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("serving %s (version %s, %d slots x %d positions) on http://%s:%d",
             args.model_path, engine.weight_version, engine.max_batch, engine.max_seq_len,
             args.host, args.port)
    await stop.wait()
    log.info("shutting down")
    for task in tasks:
        task.remove_done_callback(task_ended)
        task.cancel()
    engine.close()
    await runner.cleanup()


class _Deferred:
    """The watchdog, which needs the runner's server, which needs the app: bound once built."""

    def __init__(self, get):
        self._get = get

    def enter(self, protocol):
        if (w := self._get()) is not None:
            w.enter(protocol)

    def leave(self, protocol):
        if (w := self._get()) is not None:
            w.leave(protocol)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="HF directory written by save_hf")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--listen-fd", type=int, default=None,
                        help="serve on this inherited listening socket instead of binding "
                             "--host:--port (processes.listening_socket)")
    parser.add_argument("--max-batch", type=int, default=32, help="KV-cache slots")
    parser.add_argument("--max-seq-len", type=int, default=2048,
                        help="positions per slot (prompt + output), capped by the config")
    parser.add_argument("--dtype", default="auto", help="auto (config.json), float32, bfloat16")
    parser.add_argument("--dispatch", default=None, choices=("dense", "ragged"),
                        help="MoE dispatch (drop-free); default: the config's logprob_dispatch")
    parser.add_argument("--weight-version", default="0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compilation-cache-dir", default=None,
                        help="keep compiled programs here (JAX's persistent cache): a restart "
                             "skips the warm-up compiles")
    parser.add_argument("--warmup-prefills", action="store_true",
                        help="compile every prefill bucket at start, not on first use: no "
                             "request waits for a compile mid-run (the learner's engines)")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="keep the experts each token was routed to, for requests that ask "
                             "(return_routed_experts, as SGLang's flag of this name): routing "
                             "replay in the learner")
    parser.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                        help="close a connection without a complete request head (or idle) "
                             "this long")
    parser.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                        help="close a connection whose request body takes longer")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process dies (default: the parent; 0: never)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    for flag in ("header_timeout_s", "body_timeout_s"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
    parent = os.getppid() if args.parent_pid is None else args.parent_pid
    if parent:
        watch_parent(parent)  # first, so that even a slow start cannot outlive the parent
    if args.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
