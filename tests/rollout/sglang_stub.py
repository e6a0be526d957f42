"""A stub SGLang server for the client's tests: real aiohttp on a loopback socket, no model.

    async with StubSGLang("0.5.23") as stub:        # or "0.5.2", "0.5.9"
        client = SGLangClient(stub.url)
    python -m tests.rollout.sglang_stub --version 0.5.9 --port 30000   # as a process (SIGSTOP it)

Its routes and replies follow what SGLang's own source says for the three releases the client
supports at its ends and middle: 0.5.2, 0.5.9 and 0.5.23 (facts read from the wheels on PyPI; no
code or text taken). Files, under `sglang/srt/`, and what of them it models:

  entrypoints/http_server.py (all three): the routes. `/get_weight_version` answers on 0.5.2, is
    a 404 whose `detail` says it is deprecated for `/model_info` on 0.5.9, and is gone on 0.5.23;
    `/model_info` and `/server_info` exist from 0.5.9 (0.5.2 has `/get_model_info` and
    `/get_server_info`, both with the label or the version). Error bodies: a ValueError of
    `/generate` is `{"error": {"message"}}` (400); 0.5.23's `/generate` contract check answers
    `{"error": "<text>"}`; FastAPI answers unknown routes `{"detail": "Not Found"}` and bad bodies
    422 `{"detail": [{loc, msg}]}`. Updates answer `{success, message, num_paused_requests}`,
    200 or 400; pause and continue `{"message", "status": "ok"}`; `/abort_request` an empty 200.
  server_args.py: `--weight-version` defaults to "default".
  managers/io_struct.py: `PauseGenerationReqInput.mode` in abort | retract | in_place (0.5.9
    on; 0.5.2 has no such input: its pause ignores any body); `UpdateWeightFromDiskReqInput` has
    `abort_all_requests` and `weight_version` in all three; `UpdateWeightVersionReqInput`
    (`new_version`, `abort_all_requests` default true); `AbortReq` (`rid`, `abort_all`).
  managers/tokenizer_manager.py: a pause in mode "abort" (0.5.2: any pause) aborts every
    request, which comes back with `finish_reason` `{"type": "abort", "message"}` and its tokens
    so far (from 0.5.9 the pause answers once they are gone); new requests wait while paused;
    `abort_all_requests` aborts before loading; a load waits for running requests (the
    model-update lock; from 0.5.9 not while the server is paused); the label
    changes only after a load that succeeded; a non-streaming request whose client went away is
    aborted; 0.5.23 refuses a request id that is live ("Duplicate request ID detected").
  managers/scheduler_update_weights_mixin.py (0.5.9): the cache flush after a load is asserted:
    with requests in the batch (paused in place) the scheduler dies and so does the server (here:
    every connection is dropped from then on).
  managers/scheduler_components/weight_updater.py, managers/scheduler.py,
  utils/weight_versions.py (0.5.23): the scheduler's version changes at the load, and each live
    request with output records the old one; replies of such requests, and every abort, carry
    `meta_info.weight_versions` spans `[{version, start, end}]` whose last version is
    `meta_info.weight_version`. The flush after a load fails while requests run (paused in place;
    a paused server ignores its waiting queue, so "retract" flushes): the reply is then 400
    "Weights were updated, but the cache was not flushed ..." and the tokenizer's label (replies
    without spans, `/model_info`) stays the old one until `/update_weight_version`.

Tokens are a hash of the loaded weights' name and the position (log-prob -0.5), one per `step_s`;
`truth[rid]` keeps, per token, the label the weights that made it were published under, so a test
can check the labels a client reports. `freeze()` stops answering anything, as SIGSTOP does (the
socket still accepts), until `thaw()`. `/stub/state` (not SGLang's) reports what it saw.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import zlib

from aiohttp import web
from aiohttp.test_utils import TestServer

VERSIONS = ("0.5.2", "0.5.9", "0.5.23")
BODY = web.RequestKey("body", dict)  # the request's JSON body, read once by the middleware
CACHE_NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are "
                     "still running or queued. Retract or finish them, then call /flush_cache.")


@dataclasses.dataclass
class _Req:
    rid: str
    input_ids: list[int]
    max_new: int
    stop: frozenset
    out: list[int] = dataclasses.field(default_factory=list)
    truth: list[str] = dataclasses.field(default_factory=list)
    events: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (old, n) 0.5.23
    abort: str | None = None  # the abort message, once aborted


class StubSGLang:
    """One stub server of SGLang `version`, started with weight label `weight_version`."""

    def __init__(self, version: str = "0.5.23", *, weight_version: str = "default",
                 step_s: float = 0.002, port: int | None = None):
        if version not in VERSIONS:
            raise ValueError(f"version must be one of {VERSIONS}, got {version!r}.")
        self.version = version
        self.v = tuple(int(p) for p in version.split("."))
        self.label = weight_version  # the tokenizer's label: model_info, replies without spans
        self.weights = weight_version  # the label the loaded weights were published under
        self.step_s, self.port = step_s, port
        self.paused: str | None = None  # the pause mode, while paused
        self.crashed = False
        self.live: dict[str, _Req] = {}
        self.truth: dict[str, list[str]] = {}
        self.generates: list[dict] = []  # bodies of /generate, as received
        self.aborts: list[dict] = []
        self.updates: list[dict] = []
        self.pauses: list[dict] = []
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._resumed = asyncio.Event()  # set while not paused
        self._resumed.set()
        self._changed = asyncio.Event()  # pulsed when a request ends
        self.server: TestServer | None = None

    # -- lifetime ----------------------------------------------------------------------------

    async def __aenter__(self) -> StubSGLang:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> str:
        app = web.Application(middlewares=[self._middleware])
        routes = [web.post("/generate", self.generate), web.get("/health", self.health),
                  web.get("/health_generate", self.health),
                  web.post("/abort_request", self.abort_request),
                  web.post("/pause_generation", self.pause_generation),
                  web.post("/continue_generation", self.continue_generation),
                  web.post("/update_weights_from_disk", self.update_weights_from_disk),
                  web.post("/update_weight_version", self.update_weight_version),
                  web.get("/get_model_info", self.model_info),
                  web.get("/get_server_info", self.server_info),
                  web.get("/stub/state", self.state)]
        if self.v < (0, 5, 23):
            routes.append(web.get("/get_weight_version", self.get_weight_version))
        if self.v >= (0, 5, 9):
            routes += [web.get("/model_info", self.model_info),
                       web.get("/server_info", self.server_info)]
        app.add_routes(routes)
        self.server = TestServer(app, host="127.0.0.1", port=self.port)
        await self.server.start_server()
        self.url = str(self.server.make_url("")).rstrip("/")
        return self.url

    async def close(self) -> None:
        self._thawed.set()
        self._resumed.set()
        if self.server is not None:
            await self.server.close()

    def freeze(self) -> None:
        """Stops answering (SIGSTOP): connections are accepted, nothing more happens."""
        self._thawed.clear()

    def thaw(self) -> None:
        self._thawed.set()

    @web.middleware
    async def _middleware(self, request, handler):
        await self._thawed.wait()
        if self.crashed:  # the server process is gone
            request.transport.close()
            raise ConnectionResetError("crashed")
        if request.method == "POST" and request.path != "/pause_generation" or (
                request.path == "/pause_generation" and self.v >= (0, 5, 9)):
            try:
                request[BODY] = await request.json() if await request.read() else {}
            except ValueError:
                return _detail(422, [{"loc": ["body"], "msg": "JSON decode error"}])
        else:
            request[BODY] = {}
        try:
            return await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as e:  # as FastAPI words them
            return _detail(e.status, e.reason)

    # -- generation --------------------------------------------------------------------------

    def _token(self, req: _Req) -> int:
        key = f"{self.weights}:{len(req.input_ids) + len(req.out)}:{req.input_ids[-1:]}"
        return 10 + zlib.crc32(key.encode()) % 40

    async def generate(self, request):
        body = request[BODY]
        self.generates.append(body)
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            if self.v >= (0, 5, 23):  # the contract check
                return web.json_response({"error": "input_ids: a non-empty list of token ids "
                                                   "is required"}, status=400)
            return _error(400, "The input_ids must be a non-empty list of token ids.")
        params = body.get("sampling_params") or {}
        rid = body.get("rid") or f"stub-{len(self.generates)}"
        if self.v >= (0, 5, 23) and rid in self.live:
            return _error(400, f"Duplicate request ID detected: {rid}")
        await self._resumed.wait()  # new requests wait while paused
        max_new = params.get("max_new_tokens")
        req = _Req(rid, ids, 128 if max_new is None else int(max_new),
                   frozenset(params.get("stop_token_ids") or ()))
        self.live[rid] = req
        self.truth[rid] = req.truth
        finish = {"type": "length", "length": req.max_new}
        try:
            while True:
                await self._thawed.wait()
                if self.paused == "in_place":  # the batch stands still, aborted requests too
                    await self._resumed.wait()
                    continue
                if req.abort is not None or len(req.out) >= req.max_new:
                    break
                if self.paused == "retract":  # back in the waiting queue, where aborts act
                    await asyncio.sleep(self.step_s)
                    continue
                await asyncio.sleep(self.step_s)
                if request.transport is None or request.transport.is_closing():
                    req.abort = "Request is disconnected from the client side"  # SGLang's check
                if req.abort is not None or self.paused is not None:
                    continue
                token = self._token(req)
                req.out.append(token)
                req.truth.append(self.weights)
                if token in req.stop:
                    finish = {"type": "stop", "matched": token}
                    break
            if req.abort is not None:
                finish = {"type": "abort", "message": req.abort, "status_code": None,
                          "err_type": None}
        finally:
            del self.live[rid]
            self._changed.set()
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids),
                "completion_tokens": len(req.out), "cached_tokens": 0,
                "weight_version": self.label,
                "output_token_logprobs": [[-0.5, t, None] for t in req.out]}
        if self.v >= (0, 5, 23) and (req.events or req.abort is not None):
            meta["weight_versions"] = _spans(req.events, self.weights, len(req.out))
            meta["weight_version"] = meta["weight_versions"][-1]["version"]
        return web.json_response({"output_ids": req.out, "meta_info": meta})

    async def _until_idle(self) -> None:
        while self.live:
            self._changed.clear()
            await self._changed.wait()

    def _abort_all(self, message: str) -> int:
        n = 0
        for req in self.live.values():
            if req.abort is None:
                req.abort, n = message, n + 1
        return n

    async def abort_request(self, request):
        body = request[BODY]
        self.aborts.append(body)
        if body.get("abort_all"):
            self._abort_all("Abort in waiting queue")
        elif body.get("rid") in self.live:
            self.live[body["rid"]].abort = "Abort in waiting queue"
        return web.Response()

    # -- control -----------------------------------------------------------------------------

    async def pause_generation(self, request):
        body = request[BODY]
        self.pauses.append(body)
        mode = "abort" if self.v < (0, 5, 9) else body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _detail(422, [{"loc": ["body", "mode"],
                                  "msg": "Input should be 'abort', 'retract' or 'in_place'"}])
        self.paused = mode
        self._resumed.clear()
        if mode == "abort":
            self._abort_all("Abort in waiting queue")
            if self.v >= (0, 5, 9):  # answers once the aborted requests are gone
                await self._until_idle()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request):
        self.paused = None
        self._resumed.set()
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def update_weights_from_disk(self, request):
        body = request[BODY]
        self.updates.append(body)
        path = body.get("model_path")
        if not isinstance(path, str):
            return _detail(422, [{"loc": ["body", "model_path"], "msg": "Field required"}])
        label = body.get("weight_version")
        if body.get("abort_all_requests"):
            self._abort_all("Abort in waiting queue")
            if self.paused != "in_place":  # their replies leave before the load (one queue)
                await self._until_idle()
        if self.paused is None or self.v < (0, 5, 9):  # the model-update lock (0.5.2: always)
            await self._until_idle()
        if "missing" in path:
            return web.json_response(
                {"success": False, "num_paused_requests": 0,
                 "message": f"Failed to get weights iterator: {path} (repo id: {path}) not "
                            "found."}, status=400)
        running = self.paused == "in_place" and bool(self.live)
        if self.v == (0, 5, 9) and running:  # the scheduler's flush assertion kills the server
            self.crashed = True
            request.transport.close()
            raise ConnectionResetError("scheduler died")
        old = self.weights
        self.weights = label if label is not None else path
        if self.v >= (0, 5, 23) and label is not None and label != old:
            for req in self.live.values():
                if req.out:
                    req.events.append((old, len(req.out)))
        if self.v >= (0, 5, 23) and running:  # the flush is refused: a failed update
            return web.json_response({"success": False, "message": CACHE_NOT_FLUSHED,
                                      "num_paused_requests": 0}, status=400)
        message = "Succeeded to update model weights."
        if label is not None:
            self.label = label
            message += f" Weight version updated to {label}."
        return web.json_response({"success": True, "message": message,
                                  "num_paused_requests": 0})

    async def update_weight_version(self, request):
        body = request[BODY]
        if "new_version" not in body:
            return _detail(422, [{"loc": ["body", "new_version"], "msg": "Field required"}])
        if body.get("abort_all_requests", True):
            self._abort_all("Abort in waiting queue")
        self.label = str(body["new_version"])
        if self.v >= (0, 5, 23):
            self.weights = self.label  # the scheduler's version too (a no-op after a load)
        return web.json_response({"success": True, "new_version": self.label,
                                  "message": f"Weight version updated to {self.label}"})

    async def get_weight_version(self, request):
        if self.v >= (0, 5, 9):
            return _detail(404, "Endpoint '/get_weight_version' or '/weight_version' is "
                                "deprecated. Please use '/model_info' instead.")
        return web.json_response({"weight_version": self.label})

    async def model_info(self, request):
        return web.json_response({"model_path": "stub", "is_generation": True,
                                  "weight_version": self.label})

    async def server_info(self, request):
        return web.json_response({"version": self.version, "weight_version": self.label})

    async def health(self, request):
        return web.Response(status=200)

    async def state(self, request):
        return web.json_response({"aborts": self.aborts, "live": sorted(self.live),
                                  "generates": len(self.generates)})


def _spans(events: list[tuple[str, int]], current: str, n: int) -> list[dict]:
    """Weight-version spans of a request's `n` output tokens, as SGLang 0.5.23 reports them:
    runs of one version, the last one `current`."""
    spans: list[dict] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0,
                      "end": end})
    return [s for s in spans if s["start"] < n or s["start"] == 0]


def _error(status: int, message: str):
    return web.json_response({"error": {"message": message}}, status=status)


def _detail(status: int, detail):
    return web.json_response({"detail": detail}, status=status)


async def _serve(version: str, port: int, weight_version: str) -> None:
    stub = StubSGLang(version, weight_version=weight_version, port=port)
    await stub.start()
    print(stub.url, flush=True)
    await asyncio.Event().wait()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="0.5.23", choices=VERSIONS)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--weight-version", default="default")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.version, args.port, args.weight_version))


if __name__ == "__main__":
    main()
