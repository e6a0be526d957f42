"""An async client for SGLang's native HTTP API: a real SGLang server (0.5.2 to 0.5.23) or the
embedded engine.

    async with SGLangClient(["http://127.0.0.1:30000", "http://127.0.0.1:30001"]) as client:
        with client.session(episode_id) as engine:  # the episode's turns stay on one engine
            result = await engine.generate(prompt_ids, {"max_new_tokens": 256})
        result.output_ids, result.logprobs, result.versions, result.finish_reason

What it adds to plain HTTP calls:
  * Weight versions as the learner numbers them (`VersionMap`): every token carries the label of
    the weights that sampled it (`weight_versions`, as the server spells it) and that label's
    version number (`versions`, int). The learner publishes version N as the label "N"; the label
    an engine was started with (SGLang's `--weight-version` default is "default") is the initial
    version; any other label is an error. Per-token labels come from the reply's
    `meta_info.weight_versions` spans when the server sends them (SGLang >= 0.5.19, when weights
    changed while the request ran), else from its `meta_info.weight_version`.
  * Resubmission across weight updates (docs/design.md, "Processes"): an update that aborts running
    requests returns them with `finish_reason.type == "abort"` and their partial tokens. The
    client sends each again with `input_ids = prompt + tokens so far` and `max_new_tokens` reduced
    by their number, and stitches the segments. Aborts the caller asked for (`abort`), and aborts
    that report an error status, are returned as they are.
  * Retries with exponential backoff (and jitter) on connection errors, HTTP 502/503/504 and
    timeouts; an engine that failed is skipped for the backoff time, and a request fails over at
    once to an engine that is not in backoff. Each attempt after the first is sent under a fresh
    request id (`<rid>.<n>`), so that a request still alive on the engine it left never collides
    with its retry (SGLang 0.5.23 refuses a duplicate id).
  * A frozen engine (SIGSTOP: the kernel accepts connections, nobody answers) cannot hang a
    generation: a `/generate` call that gets no answer within `request_timeout_s` fails over; the
    engine is skipped until it answers again, and the request it holds is aborted there
    (`/abort_request` by its id, retried in the background until the engine answers; SGLang also
    aborts a non-streaming request whose client has gone).
  * Routing: a request of a session (`session()`, one agent episode) goes to the engine its
    session used before while that engine is up, so SGLang's prefix cache serves the history; a
    new session goes to the engine with the fewest sessions (then requests in flight), and the
    session of an engine in backoff moves to another (`num_moves`; it re-prefills there). A
    request outside sessions goes to the engine with the fewest requests in flight.
  * Error replies give their message: SGLang's `{"error": {"message"}}` and `{"error": "..."}`,
    OpenAI's `{"object": "error", "message"}`, FastAPI's `{"detail"}`, or the text.
  * Tolerant parsing of replies: null log-probs, missing `output_token_logprobs`, `finish_reason`
    as an object, a string or null, `matched` stop token or text.

Weight updates, pause / continue, health and version queries go to every engine: client_admin.py
(`EngineAdmin`, which `SGLangClient` mixes in). Which engine a request goes to is decided by a
`routing.Router`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import random
import re
import time
import uuid
from collections.abc import Sequence

import aiohttp
import numpy as np

from sao_jax.engine import (  # the protocol: constants and reply parsing
    DEFAULT_MAX_NEW_TOKENS,
    UNKNOWN_VERSION,
    EngineError,
    error_message,
    parse_generate_reply,
)
from sao_jax.rollout.client_admin import (
    EngineAdmin,
    WeightUpdateError,  # noqa: F401 - re-exported: every error of the client imports from here
)
from sao_jax.rollout.routing import Router

log = logging.getLogger(__name__)

RETRY_STATUSES = (502, 503, 504)
_INTEGER_LABEL = re.compile(r"0|[1-9][0-9]*")


class EngineUnavailableError(EngineError, ConnectionError):
    """No engine could be reached within the retries."""


class UnknownWeightVersionError(EngineError):
    """A reply's weight label is neither a version the learner published nor the engines'
    start-up label (see `VersionMap`)."""


@dataclasses.dataclass
class VersionMap:
    """How the engines' weight-version labels map to the learner's version numbers.

    The learner publishes version N as the label "N" (`update_weights_from_disk(weight_version=
    str(N))`): a label that is a non-negative integer in canonical decimal is that version. An
    engine that has not been updated yet answers with the label it was started with: SGLang's
    `--weight-version` defaults to "default". That label (`initial_label`) is `initial_version`,
    the version the learner says the initial weights have; its first use is logged as a warning.

    Any other label is an `UnknownWeightVersionError`: such an engine serves weights this run did
    not publish under that name, and mapping it to some number (the oldest, say) would hand the
    learner a wrong staleness for every token, silently.
    """

    initial_version: int = 0
    initial_label: str = "default"
    _warned: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        if (isinstance(self.initial_version, bool) or not isinstance(self.initial_version, int)
                or self.initial_version < 0):
            raise ValueError("VersionMap.initial_version must be an int >= 0, got "
                             f"{self.initial_version!r}.")
        if not isinstance(self.initial_label, str) or not self.initial_label:
            raise ValueError("VersionMap.initial_label must be a non-empty string, got "
                             f"{self.initial_label!r}.")
        if (_INTEGER_LABEL.fullmatch(self.initial_label)
                and int(self.initial_label) != self.initial_version):
            raise ValueError(f"VersionMap.initial_label {self.initial_label!r} is an integer "
                             f"label, which means version {self.initial_label}, not "
                             f"initial_version {self.initial_version}: give a non-integer label "
                             "or the matching version.")

    def number(self, label: str, url: str | None = None) -> int:
        """The version number of `label` (from `url`, named in errors)."""
        if _INTEGER_LABEL.fullmatch(label):
            return int(label)
        if label == self.initial_label:
            if not self._warned:
                self._warned = True
                log.warning("engine %s answers with its start-up weight label %r: taken as "
                            "version %d (the initial weights, as the learner says)",
                            url or "?", label, self.initial_version)
            return self.initial_version
        where = f"engine {url}" if url else "an engine"
        if label == UNKNOWN_VERSION:
            raise UnknownWeightVersionError(
                f"{where} sent a reply without meta_info.weight_version: the version of its "
                "tokens is unknown. Use an SGLang that reports it (0.5.2 and later do).")
        raise UnknownWeightVersionError(
            f"{where} answered with weight version label {label!r}, which is neither a version "
            f"the learner published (its labels are integers) nor the engines' start-up label "
            f"{self.initial_label!r}. Start the engine with --weight-version <the learner's "
            "initial version>, or tell this client its start-up label (VersionMap(initial_label="
            "..., initial_version=...); the worker's --initial-weight-label and "
            "--initial-weight-version).")

    def numbers(self, labels: Sequence[str], url: str | None = None) -> list[int]:
        cache: dict[str, int] = {}
        out = []
        for label in labels:
            if label not in cache:
                cache[label] = self.number(label, url)
            out.append(cache[label])
        return out


@dataclasses.dataclass
class GenerateResult:
    """A generation, stitched across the segments that weight updates cut it into."""

    output_ids: list[int]
    logprobs: list[float | None]  # temperature-1 log-prob per token; None where none came back
    finish_reason: str  # of the last segment: "stop" | "length" | "abort" | "unknown"
    weight_versions: list[str]  # per token: the label of the weights that generated it
    prompt_tokens: int
    completion_tokens: int
    matched_stop: int | str | list | None = None
    finish_message: str | None = None
    rid: str | None = None
    num_segments: int = 1
    # per token: the learner's version number of that label; None: mapped by a default
    # `VersionMap` (integer labels, "default" as 0), for generators that give labels only
    versions: list[int] | None = None
    url: str | None = None  # the engine of the last segment
    # asked for (`routed_experts_from`): the experts of every position from there to the last
    # but one token of prompt + output, flat int32, across the segments; None: not asked for
    routed_experts: np.ndarray | None = None

    def __post_init__(self):
        if self.versions is None:
            self.versions = VersionMap().numbers(self.weight_versions)
        if len(self.versions) != len(self.output_ids):
            raise ValueError(f"GenerateResult.versions has {len(self.versions)} entries for "
                             f"{len(self.output_ids)} tokens.")


def _cut(seg) -> bool:
    """Whether a reply was cut by an abort (a weight update, `abort_request`), not an error."""
    return seg.finish_reason == "abort" and seg.status_code is None


def _segment_routes(seg, start: int, request_tokens: int) -> np.ndarray:
    """`[positions, layers * top_k]` the experts a reply routed positions `start` .. the last
    but one of its request's `request_tokens` and its output to (the last token never ran).
    A request cut before it ran (aborted while it waited: no token, no routes) routed nothing;
    its resubmission asks from the same position."""
    positions = max(request_tokens + len(seg.output_ids) - 1 - start, 0)
    if seg.routed_experts is None and _cut(seg) and not seg.output_ids:
        return np.zeros((0, 1), np.int32)
    if seg.routed_experts is None:
        raise EngineError("the engine sent no routed_experts, though the request asked for them "
                          "(start SGLang, or the embedded engine, with "
                          "--enable-return-routed-experts).")
    flat = np.asarray(seg.routed_experts, np.int32)
    if (flat.size % positions if positions else flat.size):
        raise EngineError(f"routed_experts holds {flat.size} ids for {positions} positions.")
    return flat.reshape(positions, -1) if positions else flat.reshape(0, 1)


@dataclasses.dataclass
class _Live:
    """A generation in progress: where it runs, under which request id."""

    rid: str
    server_rid: str
    url: str | None = None
    attempts: int = 0


class EngineSession:
    """One episode's requests, kept on one engine while it answers (`SGLangClient.session`).

    Has `generate` with the client's signature, so `agent.run_episode` takes it as a generator.
    """

    def __init__(self, client: SGLangClient, key: str):
        self.client, self.key = client, key

    @property
    def url(self) -> str | None:
        """The engine this session's requests go to; None before its first request."""
        return self.client._router.sessions.get(self.key)

    async def generate(self, input_ids: Sequence[int], sampling_params: dict | None = None,
                       rid: str | None = None, *, return_logprob: bool = True,
                       routed_experts_from: int | None = None) -> GenerateResult:
        return await self.client.generate(input_ids, sampling_params, rid,
                                          return_logprob=return_logprob, session=self.key,
                                          routed_experts_from=routed_experts_from)

    def close(self) -> None:
        self.client._router.close(self.key)

    def __enter__(self) -> EngineSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SGLangClient(EngineAdmin):
    """Async client over one or more SGLang (or embedded-engine) servers.

    Args:
      urls: one base URL ("http://127.0.0.1:30000") or several.
      max_retries: attempts after the first, per HTTP call, on connection errors, 502/503/504
        and timeouts.
      backoff_s / max_backoff_s: the first retry delay, doubled per attempt up to the maximum
        (each delay is jittered by up to +50%).
      request_timeout_s: the longest a `/generate` call may go without an answer (a read
        timeout; replies come whole, so it bounds one generation segment). Past it the engine
        counts as frozen: the request fails over, the engine is skipped until it answers again
        and the request is aborted there. None: no limit.
      control_timeout_s: total time of a weight update, pause, continue or version query (None:
        no limit; loading weights can take long).
      connect_timeout_s: to establish a connection.
      max_stalled_resubmits: give up resubmitting an aborted request after this many aborted
        segments in a row that brought no new token.
      max_connections: connection pool size over all engines.
      version_map: weight label -> the learner's version number (default: integer labels, and
        SGLang's start-up label "default" as version 0).
    """

    def __init__(self, urls: str | Sequence[str], *, max_retries: int = 5,
                 backoff_s: float = 0.1, max_backoff_s: float = 5.0,
                 request_timeout_s: float | None = 600.0,
                 control_timeout_s: float | None = None, connect_timeout_s: float = 10.0,
                 max_stalled_resubmits: int = 8, max_connections: int = 1024,
                 version_map: VersionMap | None = None):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("SGLangClient needs at least one engine URL.")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL must start with http:// or https://, got {url!r}.")
        if request_timeout_s is not None and request_timeout_s <= 0:
            raise ValueError("SGLangClient.request_timeout_s must be > 0 or None, got "
                             f"{request_timeout_s}.")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.max_stalled_resubmits = max_stalled_resubmits
        self.connect_timeout_s = connect_timeout_s
        self.version_map = version_map or VersionMap()
        self._generate_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=request_timeout_s)
        self._control_timeout = aiohttp.ClientTimeout(total=control_timeout_s,
                                                      sock_connect=connect_timeout_s)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._router = Router(self.urls)
        self._live: dict[str, _Live] = {}  # caller's rid -> where it runs
        self._aborted_rids: set[str] = set()  # aborted by the caller: never resubmitted
        super().__init__()  # EngineAdmin's record of each server
        self._background: set[asyncio.Task] = set()
        self.num_retries = 0
        self.num_resubmits = 0
        self.num_stopped_at_abort = 0  # aborted right after a stop token: finished there
        self.num_timeouts = 0  # /generate calls that got no answer within request_timeout_s

    @property
    def inflight(self) -> dict[str, int]:
        """Requests in flight per engine."""
        return self._router.inflight

    @property
    def num_moves(self) -> int:
        """Sessions moved to another engine."""
        return self._router.num_moves

    def stats(self) -> dict[str, int]:
        """Counters for the worker's stats."""
        return {"engine_retries": self.num_retries, "engine_resubmits": self.num_resubmits,
                "engine_stops_at_abort": self.num_stopped_at_abort,
                "engine_moves": self.num_moves, "engine_timeouts": self.num_timeouts}

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._control_timeout,
                connector=aiohttp.TCPConnector(limit=self._max_connections))
        return self._session

    # -- sessions and retries (routing: `routing.Router`) ----------------------------------------

    def session(self, key: str | None = None) -> EngineSession:
        """A session (one agent episode): its requests stay on one engine while it answers.

        Close it (or use it as a context manager) when the episode ends."""
        key = key or uuid.uuid4().hex
        self._router.open(key)
        return EngineSession(self, key)

    def _delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * (1 + 0.5 * random.random())

    async def _request(self, method: str, path: str, body=None, *, url: str | None = None,
                       session: str | None = None, live: _Live | None = None,
                       ok_statuses=(200,)):
        """One HTTP call with retries; routed (kept on `session`'s engine) when `url` is None.

        `live`: the generation this `/generate` call belongs to; it is sent under
        `live.server_rid`, a fresh one per attempt after the first. Returns
        `(url, status, json)`."""
        error: Exception | None = None
        timeout = self._generate_timeout if live is not None else self._control_timeout
        for attempt in range(self.max_retries + 1):
            target = url or self._router.route(session)
            self.inflight[target] += 1
            if live is not None:
                live.url = target
                if live.attempts:
                    live.server_rid = f"{live.rid}.{live.attempts}"
                live.attempts += 1
                body = {**body, "rid": live.server_rid}
            try:
                async with self._http().request(method, target + path, json=body,
                                                timeout=timeout) as resp:
                    text = await resp.text()
                    if resp.status in RETRY_STATUSES:
                        raise _Retryable(f"HTTP {resp.status}: {error_message(None, text)}")
                    data = _loads(text, target, resp.status)
                    if resp.status not in ok_statuses:
                        raise EngineError(f"{method} {path} -> HTTP {resp.status}: "
                                          f"{error_message(data, text)}",
                                          url=target, status=resp.status)
                    return target, resp.status, data
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError, _Retryable) as e:
                error, why = e, str(e) or type(e).__name__
                delay = self._delay(attempt)
                now = time.monotonic()
                if isinstance(e, asyncio.TimeoutError) and live is not None:
                    # Frozen, or far slower than request_timeout_s: skipped until it answers
                    # the abort of what it holds.
                    self.num_timeouts += 1
                    self._router.skip(target, math.inf)
                    self._spawn(self._abort_abandoned(target, live.server_rid))
                    why = f"no answer within {timeout.sock_read} s"
                else:
                    self._router.skip(target, now + delay)
                if attempt == self.max_retries:
                    break
                self.num_retries += 1
                if url is None and self._router.any_up(now):
                    delay = 0.0  # another engine is up: fail over at once
                log.warning("%s%s failed (%s); retry %d/%d in %.2f s", target, path, why,
                            attempt + 1, self.max_retries, delay)
                await asyncio.sleep(delay)
            finally:
                self.inflight[target] -= 1
        raise EngineUnavailableError(
            f"{method} {path}: no engine answered after {self.max_retries + 1} attempts "
            f"({', '.join(self.urls if url is None else [url])}): {error!r}") from error

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_abandoned(self, url: str, server_rid: str) -> None:
        """Aborts request `server_rid` on `url`, which did not answer in time: tries until the
        engine answers (then it is routed to again), so that a resumed engine does not keep
        generating it."""
        delay = self.backoff_s
        timeout = aiohttp.ClientTimeout(total=self.connect_timeout_s)
        while True:
            try:
                async with self._http().post(url + "/abort_request", json={"rid": server_rid},
                                             timeout=timeout) as resp:
                    await resp.read()
                log.info("%s answers again; aborted request %s there (HTTP %d)", url,
                         server_rid, resp.status)
                self._router.restore(url)
                return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                await asyncio.sleep(delay)
                delay = min(self.max_backoff_s, 2 * delay)

    async def _each(self, method, path, body=None, urls=None, ok_statuses=(200,)) -> dict:
        """One call to each of `urls` (default: every engine) at once; each engine's reply."""
        urls = urls or self.urls
        replies = await asyncio.gather(*(self._request(method, path, body, url=u,
                                                       ok_statuses=ok_statuses) for u in urls))
        return {u: data for u, _, data in replies}

    # -- generation ------------------------------------------------------------------------------

    async def generate(self, input_ids: Sequence[int], sampling_params: dict | None = None,
                       rid: str | None = None, *, return_logprob: bool = True,
                       session: str | None = None,
                       routed_experts_from: int | None = None) -> GenerateResult:
        """Generates after `input_ids`, resubmitting across weight updates (see the module doc).

        `sampling_params` are SGLang's (temperature, top_p, top_k, max_new_tokens,
        stop_token_ids, ...). `session`: keep the request on the engine of the session's earlier
        requests (see `session()`). `routed_experts_from` (routing replay; at most
        `len(input_ids)`): the result's `routed_experts` are the experts of the positions from
        there on (SGLang's `return_routed_experts` and `routed_experts_start_len`; each
        resubmission asks from where the last one's stopped). Raises EngineError on a 4xx/500
        reply or an unreadable one (one without the routes asked for, too),
        UnknownWeightVersionError on a weight label `version_map` does not know, and
        EngineUnavailableError when no engine can be reached.
        """
        prompt = [int(t) for t in input_ids]
        params = dict(sampling_params or {})
        budget = params.get("max_new_tokens")
        budget = DEFAULT_MAX_NEW_TOKENS if budget is None else int(budget)
        rid = rid or uuid.uuid4().hex
        if rid in self._live:
            raise ValueError(f"request id {rid!r} is already being generated by this client.")
        live = self._live[rid] = _Live(rid, server_rid=rid)
        self._aborted_rids.discard(rid)
        # A request cut just after it sampled a stop token comes back aborted with that token
        # last (SGLang checks the stop after the abort); it is finished, not resubmitted (which
        # would generate past the stop). SGLang applies stop_token_ids unless ignore_eos.
        stops = (frozenset() if params.get("ignore_eos")
                 else frozenset(int(t) for t in params.get("stop_token_ids") or ()))
        min_new = int(params.get("min_new_tokens") or 0)
        output, logprobs, labels = [], [], []
        versions: list[int] = []
        routes: list[np.ndarray] = []  # [positions, layers * top_k] of each segment
        if routed_experts_from is not None and not 0 <= routed_experts_from <= len(prompt):
            raise ValueError(f"routed_experts_from={routed_experts_from} is outside [0, "
                             f"{len(prompt)}], the prompt's tokens.")
        segments, stalled = 0, 0
        try:
            while True:
                body = {"input_ids": prompt + output,
                        "sampling_params": {**params, "max_new_tokens": budget - len(output)},
                        "return_logprob": return_logprob}
                if routed_experts_from is not None:  # from the first position not yet routed
                    start = routed_experts_from + sum(len(r) for r in routes)
                    body.update(return_routed_experts=True, routed_experts_start_len=start)
                url, _, data = await self._request("POST", "/generate", body, session=session,
                                                   live=live)
                seg = parse_generate_reply(data)
                if routed_experts_from is not None:
                    routes.append(_segment_routes(seg, start, len(prompt) + len(output)))
                segments += 1
                output += seg.output_ids
                logprobs += seg.logprobs
                labels += seg.weight_versions
                versions += self.version_map.numbers(seg.weight_versions, url)
                stalled = 0 if seg.output_ids else stalled + 1
                finish_reason, matched_stop = seg.finish_reason, seg.matched_stop
                cut = _cut(seg)
                last = seg.output_ids[-1] if seg.output_ids else None
                if cut and last in stops and len(output) >= min_new:
                    finish_reason, matched_stop = "stop", last
                    self.num_stopped_at_abort += 1
                    break
                if not cut or rid in self._aborted_rids or stalled >= self.max_stalled_resubmits:
                    break
                if len(output) >= budget:
                    finish_reason = "length"  # cut after its last token: nothing to add
                    break
                self.num_resubmits += 1
                log.debug("request %s aborted after %d tokens (version %s): resubmitting", rid,
                          len(output), seg.weight_version)
        finally:
            self._live.pop(rid, None)
            self._aborted_rids.discard(rid)
        return GenerateResult(
            output_ids=output, logprobs=logprobs, finish_reason=finish_reason,
            weight_versions=labels, prompt_tokens=len(prompt), completion_tokens=len(output),
            matched_stop=matched_stop, finish_message=seg.finish_message, rid=rid,
            num_segments=segments, versions=versions, url=url,
            routed_experts=None if routed_experts_from is None else np.concatenate(
                [r.reshape(-1) for r in routes]).astype(np.int32))

    async def abort(self, rid: str) -> None:
        """Aborts a request of this client; it returns with its partial tokens, unresubmitted."""
        self._aborted_rids.add(rid)
        live = self._live.get(rid)
        if live is None or live.url is None:
            await self._each("POST", "/abort_request", {"rid": rid})
        else:
            await self._each("POST", "/abort_request", {"rid": live.server_rid}, [live.url])

    async def abort_all(self) -> None:
        """Aborts every request on every engine (this client's are not resubmitted)."""
        self._aborted_rids |= set(self._live)
        await self._each("POST", "/abort_request", {"abort_all": True})


class _Retryable(Exception):
    pass


def _loads(text: str, url: str, status: int):
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        if status == 200:
            raise EngineError(f"reply is not JSON: {text[:200]}", url=url, status=status) from None
        return {"message": text}
