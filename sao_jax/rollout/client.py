"""An async client for SGLang's native HTTP API: a real SGLang server or the embedded engine.

    async with SGLangClient(["http://127.0.0.1:30000", "http://127.0.0.1:30001"]) as client:
        result = await client.generate(prompt_ids, {"max_new_tokens": 256, "temperature": 1.0})
        result.output_ids, result.logprobs, result.weight_versions, result.finish_reason

What it adds to plain HTTP calls:
  * Resubmission across weight updates (DESIGN.md, "Processes"): an update aborts running requests,
    which come back with `finish_reason.type == "abort"` and their partial tokens. The client sends
    each again with `input_ids = prompt + tokens so far` and `max_new_tokens` reduced by their
    number, and stitches the segments; every token keeps the `weight_version` of the reply that
    carried it. Aborts the caller asked for (`abort`), and aborts that report an error status, are
    returned as they are.
  * Retries with exponential backoff (and jitter) on connection errors and HTTP 502/503/504; an
    engine that failed is skipped for the backoff time, and a request fails over at once to an
    engine that is not in backoff.
  * Least-loaded routing over several engines: each request goes to the engine with the fewest
    requests in flight from this client (ties in turn).
  * Tolerant parsing of replies: null log-probs, missing `output_token_logprobs` or
    `weight_version`, `finish_reason` as an object, a string or null, `matched` stop token or text.

Weight updates, pause / continue, health and version queries go to every engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import random
import time
import uuid
from collections.abc import Sequence

import aiohttp

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default, used when sampling_params has none
UNKNOWN_VERSION = "unknown"  # a reply without meta_info.weight_version
RETRY_STATUSES = (502, 503, 504)


class EngineError(RuntimeError):
    """An engine answered with an error, or its reply could not be read."""

    def __init__(self, message: str, *, url: str | None = None, status: int | None = None):
        super().__init__(message if url is None else f"{url}: {message}")
        self.url, self.status = url, status


class EngineUnavailableError(EngineError, ConnectionError):
    """No engine could be reached within the retries."""


class WeightUpdateError(EngineError):
    """At least one engine failed to load new weights."""


@dataclasses.dataclass
class Segment:
    """One `/generate` reply, parsed."""

    output_ids: list[int]
    logprobs: list[float | None]
    finish_reason: str  # "stop" | "length" | "abort" | "unknown"
    weight_version: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    matched_stop: int | str | list | None = None
    finish_message: str | None = None
    status_code: int | None = None  # an abort's error status, when it has one
    rid: str | None = None


@dataclasses.dataclass
class GenerateResult:
    """A generation, stitched across the segments that weight updates cut it into."""

    output_ids: list[int]
    logprobs: list[float | None]  # temperature-1 log-prob per token; None where none came back
    finish_reason: str  # of the last segment: "stop" | "length" | "abort" | "unknown"
    weight_versions: list[str]  # per token: the weight version that generated it
    prompt_tokens: int
    completion_tokens: int
    matched_stop: int | str | list | None = None
    finish_message: str | None = None
    rid: str | None = None
    num_segments: int = 1


def _finite_or_none(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def parse_generate_reply(body) -> Segment:
    """Parses one reply of SGLang's `/generate` (non-streaming, one prompt).

    Raises EngineError if the body is not a generate reply at all.
    """
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise EngineError(f"not a /generate reply (no meta_info): {str(body)[:200]}")
    meta = body["meta_info"]
    entries = meta.get("output_token_logprobs")
    entries = entries if isinstance(entries, list) else None
    ids = body.get("output_ids")
    if not isinstance(ids, list):
        if entries is None:
            raise EngineError("reply has neither output_ids nor output_token_logprobs; send "
                              "input_ids (SGLang returns output_ids with --skip-tokenizer-init).")
        ids = [e[1] if isinstance(e, list | tuple) and len(e) > 1 else None for e in entries]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise EngineError(f"output_ids must be token ids, got {str(ids)[:200]}")
    logprobs: list[float | None] = [None] * len(ids)
    if entries is not None:
        if len(entries) != len(ids):
            log.warning("reply %s: %d log-probs for %d tokens; unmatched ones are None",
                        meta.get("id"), len(entries), len(ids))
        for i, entry in enumerate(entries[:len(ids)]):
            value = entry[0] if isinstance(entry, list | tuple) and entry else entry
            logprobs[i] = _finite_or_none(value)
    finish = meta.get("finish_reason")
    matched = message = status = None
    if isinstance(finish, dict):
        kind = finish.get("type")
        matched, message = finish.get("matched"), finish.get("message")
        status = finish.get("status_code")
    else:
        kind = finish
    if kind not in ("stop", "length", "abort"):
        kind = "unknown"
    version = meta.get("weight_version")
    return Segment(
        output_ids=list(ids), logprobs=logprobs, finish_reason=kind,
        weight_version=UNKNOWN_VERSION if version is None else str(version),
        prompt_tokens=meta.get("prompt_tokens"), completion_tokens=meta.get("completion_tokens"),
        matched_stop=matched, finish_message=message,
        status_code=status if isinstance(status, int) else None, rid=meta.get("id"))


class SGLangClient:
    """Async client over one or more SGLang (or embedded-engine) servers.

    Args:
      urls: one base URL ("http://127.0.0.1:30000") or several.
      max_retries: attempts after the first, per HTTP call, on connection errors and 502/503/504.
      backoff_s / max_backoff_s: the first retry delay, doubled per attempt up to the maximum
        (each delay is jittered by up to +50%).
      request_timeout_s: total time for one HTTP call (None: no limit; generations can be long).
      connect_timeout_s: to establish a connection.
      max_stalled_resubmits: give up resubmitting an aborted request after this many aborted
        segments in a row that brought no new token.
      max_connections: connection pool size over all engines.
    """

    def __init__(self, urls: str | Sequence[str], *, max_retries: int = 5,
                 backoff_s: float = 0.1, max_backoff_s: float = 5.0,
                 request_timeout_s: float | None = None, connect_timeout_s: float = 10.0,
                 max_stalled_resubmits: int = 8, max_connections: int = 1024):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("SGLangClient needs at least one engine URL.")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL must start with http:// or https://, got {url!r}.")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.max_stalled_resubmits = max_stalled_resubmits
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s,
                                              sock_connect=connect_timeout_s)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self.inflight = dict.fromkeys(self.urls, 0)  # requests in flight per engine
        self._down_until = dict.fromkeys(self.urls, 0.0)
        self._turn = 0
        self._rid_url: dict[str, str] = {}  # where each live request runs
        self._live_rids: set[str] = set()
        self._aborted_rids: set[str] = set()  # aborted by the caller: never resubmitted
        self.num_retries = 0
        self.num_resubmits = 0

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=self._max_connections))
        return self._session

    # -- routing and retries ---------------------------------------------------------------------

    def _pick_url(self) -> str:
        """The engine with the fewest requests in flight, among those not in backoff."""
        now = time.monotonic()
        up = [u for u in self.urls if self._down_until[u] <= now]
        if not up:  # all in backoff: the one that comes back first
            return min(self.urls, key=self._down_until.__getitem__)
        least = min(self.inflight[u] for u in up)
        ties = [u for u in up if self.inflight[u] == least]
        self._turn += 1
        return ties[self._turn % len(ties)]

    def _delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * (1 + 0.5 * random.random())

    async def _request(self, method: str, path: str, body=None, *, url: str | None = None,
                       rid: str | None = None, ok_statuses=(200,)):
        """One HTTP call with retries; routed when `url` is None. Returns `(url, status, json)`."""
        error: Exception | None = None
        for attempt in range(self.max_retries + 1):
            target = url or self._pick_url()
            self.inflight[target] += 1
            if rid is not None:
                self._rid_url[rid] = target
            try:
                async with self._http().request(method, target + path, json=body) as resp:
                    text = await resp.text()
                    if resp.status in RETRY_STATUSES:
                        raise _Retryable(f"HTTP {resp.status}: {text[:200]}")
                    data = _loads(text, target, resp.status)
                    if resp.status not in ok_statuses:
                        message = data.get("message", text) if isinstance(data, dict) else text
                        raise EngineError(f"{method} {path} -> HTTP {resp.status}: {message}",
                                          url=target, status=resp.status)
                    return target, resp.status, data
            except (aiohttp.ClientConnectionError, _Retryable) as e:
                error = e
                delay = self._delay(attempt)
                now = time.monotonic()
                self._down_until[target] = now + delay
                if attempt == self.max_retries:
                    break
                self.num_retries += 1
                if url is None and any(t <= now for t in self._down_until.values()):
                    delay = 0.0  # another engine is up: fail over at once
                log.warning("%s%s failed (%s); retry %d/%d in %.2f s", target, path, e,
                            attempt + 1, self.max_retries, delay)
                await asyncio.sleep(delay)
            finally:
                self.inflight[target] -= 1
        raise EngineUnavailableError(
            f"{method} {path}: no engine answered after {self.max_retries + 1} attempts "
            f"({', '.join(self.urls if url is None else [url])}): {error}") from error

    # -- generation ------------------------------------------------------------------------------

    async def generate(self, input_ids: Sequence[int], sampling_params: dict | None = None,
                       rid: str | None = None, *, return_logprob: bool = True) -> GenerateResult:
        """Generates after `input_ids`, resubmitting across weight updates (see the module doc).

        `sampling_params` are SGLang's (temperature, top_p, top_k, max_new_tokens,
        stop_token_ids, ...). Raises EngineError on a 4xx/500 reply or an unreadable one, and
        EngineUnavailableError when no engine can be reached.
        """
        prompt = [int(t) for t in input_ids]
        params = dict(sampling_params or {})
        budget = params.get("max_new_tokens")
        budget = DEFAULT_MAX_NEW_TOKENS if budget is None else int(budget)
        rid = rid or uuid.uuid4().hex
        if rid in self._live_rids:
            raise ValueError(f"request id {rid!r} is already being generated by this client.")
        self._live_rids.add(rid)
        self._aborted_rids.discard(rid)
        output, logprobs, versions = [], [], []
        segments, stalled = 0, 0
        try:
            while True:
                body = {"input_ids": prompt + output, "rid": rid,
                        "sampling_params": {**params, "max_new_tokens": budget - len(output)},
                        "return_logprob": return_logprob}
                _, _, data = await self._request("POST", "/generate", body, rid=rid)
                seg = parse_generate_reply(data)
                segments += 1
                output += seg.output_ids
                logprobs += seg.logprobs
                versions += [seg.weight_version] * len(seg.output_ids)
                stalled = 0 if seg.output_ids else stalled + 1
                if not (seg.finish_reason == "abort" and seg.status_code is None
                        and rid not in self._aborted_rids and len(output) < budget
                        and stalled < self.max_stalled_resubmits):
                    break
                self.num_resubmits += 1
                log.debug("request %s aborted after %d tokens (version %s): resubmitting", rid,
                          len(output), seg.weight_version)
        finally:
            self._live_rids.discard(rid)
            self._aborted_rids.discard(rid)
            self._rid_url.pop(rid, None)
        return GenerateResult(
            output_ids=output, logprobs=logprobs, finish_reason=seg.finish_reason,
            weight_versions=versions, prompt_tokens=len(prompt), completion_tokens=len(output),
            matched_stop=seg.matched_stop, finish_message=seg.finish_message, rid=rid,
            num_segments=segments)

    async def abort(self, rid: str) -> None:
        """Aborts a request of this client; it returns with its partial tokens, unresubmitted."""
        self._aborted_rids.add(rid)
        url = self._rid_url.get(rid)
        await self._each("POST", "/abort_request", {"rid": rid}, [url] if url else None)

    async def abort_all(self) -> None:
        """Aborts every request on every engine (this client's are not resubmitted)."""
        self._aborted_rids |= self._live_rids
        await self._each("POST", "/abort_request", {"abort_all": True})

    # -- control: every engine -------------------------------------------------------------------

    async def _each(self, method, path, body=None, urls=None, ok_statuses=(200,)) -> dict:
        urls = urls or self.urls
        replies = await asyncio.gather(*(self._request(method, path, body, url=u,
                                                       ok_statuses=ok_statuses) for u in urls))
        return {u: data for u, _, data in replies}

    async def update_weights_from_disk(self, model_path: str,
                                       weight_version: str | None = None) -> dict:
        """Loads new weights on every engine (running requests are aborted and resubmitted).

        Returns each engine's `{success, message, ...}`; raises WeightUpdateError if any failed.
        """
        body = {"model_path": model_path, "abort_all_requests": True}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        replies = await self._each("POST", "/update_weights_from_disk", body,
                                   ok_statuses=(200, 400))
        failed = {u: r for u, r in replies.items()
                  if not (isinstance(r, dict) and r.get("success"))}
        if failed:
            raise WeightUpdateError(f"weight update to {model_path} failed: {failed}")
        return replies

    async def get_weight_version(self) -> dict[str, str]:
        replies = await self._each("GET", "/get_weight_version")
        return {u: str(r.get("weight_version")) for u, r in replies.items()}

    async def health(self, timeout_s: float = 30.0) -> dict[str, bool]:
        """Whether each engine generates (`/health_generate`), one try each, no retries."""

        async def one(url):
            try:
                timeout = aiohttp.ClientTimeout(total=timeout_s)
                async with self._http().get(url + "/health_generate", timeout=timeout) as resp:
                    return resp.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        return dict(zip(self.urls, await asyncio.gather(*map(one, self.urls)), strict=True))

    async def pause(self, mode: str = "abort") -> dict:
        """Pauses every engine; "abort" (SGLang's default) returns running requests partial."""
        return await self._each("POST", "/pause_generation", {"mode": mode})

    async def continue_(self) -> dict:
        return await self._each("POST", "/continue_generation", {})


class _Retryable(Exception):
    pass


def _loads(text: str, url: str, status: int):
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        if status == 200:
            raise EngineError(f"reply is not JSON: {text[:200]}", url=url, status=status) from None
        return {"message": text}
