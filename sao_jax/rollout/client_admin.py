"""`SGLangClient`'s admin calls (its generate path is in client.py).

Weight updates, pause / continue, health and version queries go to every engine, following each
server's version (`server_version`, from `/server_info` or, before 0.5.9, `/get_server_info`):
  * the weight label is read from `/model_info` (0.5.9 on), falling back to
    `/get_weight_version` where `/model_info` is missing (0.5.2);
  * `update_weights_from_disk` sends `abort_all_requests` (every version has it). Keeping running
    requests (`abort_running=False`) needs per-token spans (0.5.19 on); so does loading while
    paused in place (0.5.9's scheduler asserts the cache flush, which fails with requests in the
    batch). A 400 "Weights were updated, but the cache was not flushed" (0.5.23, a load while
    paused in place with requests in the batch) is a load that happened: counted as success with
    a warning, and the label, which SGLang then leaves at the old one, is set by
    `/update_weight_version`;
  * `pause` modes other than "abort" exist from 0.5.9 (0.5.2's pause aborts whatever it is sent).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from sao_jax.engine import (  # the protocol: constants and reply parsing
    CACHE_NOT_FLUSHED,
    PAUSE_MODES,
    PAUSE_MODES_SINCE,
    SPANS_SINCE,
    EngineError,
    error_message,
    parse_server_version,
)

log = logging.getLogger("sao_jax.rollout.client")  # the client's logger: its messages


class WeightUpdateError(EngineError):
    """At least one engine failed to load new weights."""


class EngineAdmin:
    """The calls that go to every engine, mixed into `SGLangClient`: they use its `urls`,
    `version_map`, `_request`, `_each` and `_http`, and keep what they learn about each server
    (its version, whether it has `/model_info`, how this client paused it) here."""

    def __init__(self):
        self._server_versions: dict[str, tuple[int, ...] | None] = {}
        self._no_model_info: set[str] = set()  # engines without /model_info (before 0.5.9)
        self._paused: dict[str, str] = {}  # engine -> the mode this client paused it with

    async def server_version(self, url: str) -> tuple[int, ...] | None:
        """The SGLang version `url` runs, e.g. (0, 5, 23), from `/server_info` (0.5.9 on) or
        `/get_server_info`; None for a server that does not say (then nothing is refused on its
        account: the server decides)."""
        if url not in self._server_versions:
            _, status, info = await self._request("GET", "/server_info", url=url,
                                                  ok_statuses=(200, 404))
            if status == 404:
                _, status, info = await self._request("GET", "/get_server_info", url=url,
                                                      ok_statuses=(200, 404))
            version = info.get("version") if status == 200 and isinstance(info, dict) else None
            self._server_versions[url] = parse_server_version(version)
        return self._server_versions[url]

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       *, abort_running: bool = True,
                                       drain_s: float = 0.0) -> dict:
        """Loads new weights on every engine.

        `abort_running` (SGLang's `abort_all_requests`): running requests come back partial and
        are resubmitted. An engine this client has not paused is paused (mode "abort") for the
        load and continued after it: the running requests end before the load, so that the
        engine can flush its prefix cache, and their resubmissions wait until the new weights
        are in. (Without the pause SGLang 0.5.23, its requests still running, loads but keeps its
        cache, and a resubmitted request's prefix then comes from the old weights: its first
        log-probs after the load were off by up to 4 nats in a loaded test run.) False keeps
        them running across the load, their tokens labelled by per-token spans: only on
        servers that send them (SGLang >= 0.5.19). A 400 "cache not flushed" counts as success
        (see the module doc; its reply gets `"cache_flushed": False`). Returns each engine's
        `{success, message, ...}`. Once all have answered, raises the error of the one engine
        that failed (WeightUpdateError if it refused, EngineUnavailableError if it could not be
        reached), or a WeightUpdateError naming all of them if several did.

        `drain_s` (embedded engines only: SGLang's load has no such field):
        with `abort_running`, the engine lets running requests finish for up to `drain_s`
        seconds, holding the waiting and new ones for the new weights, then aborts those still
        running and loads (`drain_timeout_s`; no pause is needed, its batch is empty at the load).
        """
        if drain_s and not abort_running:
            raise ValueError("drain_s bounds how long an aborting load waits; without "
                             "abort_running the load waits for every running request anyway.")
        label = None if weight_version is None else str(weight_version)
        body = {"model_path": model_path, "abort_all_requests": abort_running}
        if drain_s:
            body["drain_timeout_s"] = drain_s
        if label is not None:
            body["weight_version"] = label

        async def one(url):
            in_place = self._paused.get(url) == "in_place"
            version = None
            if in_place or not abort_running:  # the server's version matters only then
                version = await self.server_version(url)
            spans = version is not None and version >= SPANS_SINCE
            if not abort_running and not spans:
                raise WeightUpdateError(
                    f"keeping running requests across a load (abort_running=False) needs "
                    f"per-token weight spans (SGLang >= 0.5.19); this server is "
                    f"{_version_text(version)}: their tokens would all get the new label.",
                    url=url)
            if in_place and version is not None and not spans:
                raise WeightUpdateError(
                    f"SGLang {_version_text(version)} cannot load weights while paused in "
                    "place: its scheduler asserts that the cache flushes, which fails with "
                    "requests in the batch; pause with mode 'abort' or 'retract'.", url=url)
            if abort_running and not drain_s and url not in self._paused:
                await self._request("POST", "/pause_generation", {"mode": "abort"}, url=url)
                try:
                    return await load(url)
                finally:
                    await self._request("POST", "/continue_generation", {}, url=url)
            return await load(url)

        async def load(url):
            _, status, reply = await self._request("POST", "/update_weights_from_disk", body,
                                                   url=url, ok_statuses=(200, 400))
            if isinstance(reply, dict) and reply.get("success") and status == 200:
                return reply
            message = error_message(reply)
            if status == 400 and CACHE_NOT_FLUSHED in message:
                log.warning("%s loaded %s but kept its prefix cache (%s): counted as loaded; "
                            "cached prefixes of the old weights may be reused until it is "
                            "flushed", url, model_path, message)
                if label is not None:  # SGLang left its reply label at the old version
                    await self._request("POST", "/update_weight_version",
                                        {"new_version": label, "abort_all_requests": False},
                                        url=url)
                return {**reply, "success": True, "cache_flushed": False}
            raise WeightUpdateError(f"loading {model_path} failed: {message}", url=url,
                                    status=status)

        results = await asyncio.gather(*map(one, self.urls), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        for r in failed:
            if not isinstance(r, EngineError):
                raise r
        if len(failed) == 1:  # as it is: unreachable (EngineUnavailableError) or refused
            raise failed[0]
        if failed:
            raise WeightUpdateError(f"weight update to {model_path} failed on {len(failed)} of "
                                    f"{len(self.urls)} engines: "
                                    + "; ".join(map(str, failed))) from failed[0]
        return dict(zip(self.urls, results, strict=True))

    async def get_weight_version(self) -> dict[str, str]:
        """Each engine's weight label: `/model_info`'s `weight_version` (SGLang 0.5.9 on, where
        `/get_weight_version` is 404 or gone), else `/get_weight_version`."""

        async def one(url):
            if url not in self._no_model_info:
                _, status, info = await self._request("GET", "/model_info", url=url,
                                                      ok_statuses=(200, 404))
                if status == 200:
                    return str(info.get("weight_version"))
                self._no_model_info.add(url)
            _, _, reply = await self._request("GET", "/get_weight_version", url=url)
            return str(reply.get("weight_version"))

        return dict(zip(self.urls, await asyncio.gather(*map(one, self.urls)), strict=True))

    async def get_versions(self) -> dict[str, int]:
        """Each engine's weight version as the learner numbers it (`version_map`)."""
        labels = await self.get_weight_version()
        return {u: self.version_map.number(label, u) for u, label in labels.items()}

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
        """Pauses every engine. "abort" (SGLang's default) returns running requests partial (this
        client resubmits them once generation continues); "retract" and "in_place" (SGLang 0.5.9
        on) keep them, to go on after `continue_`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}.")

        async def one(url):
            version = None if mode == "abort" else await self.server_version(url)
            if version is not None and version < PAUSE_MODES_SINCE:
                raise EngineError(f"SGLang {_version_text(version)} has no pause modes: its "
                                  f"pause aborts running requests; {mode!r} needs >= 0.5.9.",
                                  url=url)
            _, _, reply = await self._request("POST", "/pause_generation", {"mode": mode},
                                              url=url)
            self._paused[url] = mode
            return reply

        return dict(zip(self.urls, await asyncio.gather(*map(one, self.urls)), strict=True))

    async def continue_(self) -> dict:
        replies = await self._each("POST", "/continue_generation", {})
        self._paused.clear()
        return replies


def _version_text(version: tuple[int, ...] | None) -> str:
    return "of unknown version" if version is None else ".".join(map(str, version))

