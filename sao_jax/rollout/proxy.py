"""A recording OpenAI-compatible proxy: agent scaffolds talk chat, the learner gets token-exact
trajectories.

    proxy = RecordingProxy(["http://127.0.0.1:30000"], ChatDeltas(tokenizer), AgentConfig(...))
    proxy.start()
    client = OpenAI(base_url=proxy.base_url("episode-7"), api_key="unused")
    client.chat.completions.create(model="policy", messages=[...])      # as many turns as it likes
    trajectory = proxy.close_session("episode-7", reward=1.0)
    proxy.stop()

Routes (on 127.0.0.1 unless `host` says otherwise):
  POST /sessions/{id}/v1/chat/completions   OpenAI's chat completion (no streaming, n=1)
  GET  /sessions/{id}/v1/models             the one model, `model_name`
  POST /sessions/{id}/close                 {"reward": r, "truncated": false}: closes the session;
                                            the Trajectory goes to `on_close`;
                                            the reply sums it up (reward, reward_reason, ...)

A session is one episode. Its first request's messages are the prompt, rendered with the generation
prompt (`ChatDeltas.prompt_ids`; `ChatDeltas` is the text layer's, `sao_jax.text`). Every later
request must repeat exactly the messages already served — the earlier system/user messages and
each assistant message as the proxy returned it — followed by new non-assistant messages; their
chat-template delta (`ChatDeltas.delta_ids`, after the masked end-of-turn token of a cut action)
is appended with action mask 0, and the engine generates after the whole history as ids. Sampled
ids are never decoded and encoded again. With several engines, a session's turns all go to one
of them while it answers (`SGLangClient.session`), so its prefix cache serves the growing history
again.

A rewritten history ends the session; it does not fail it. A request that rewrites, drops or
reorders served messages, or invents an assistant message, cannot be recorded: its tokens would no
longer be what the engine saw. mini-swe-agent v2 does exactly this with a reply it cannot parse (a
weak policy's format error): it drops the assistant message and sends its format-error message in
its place. The session then ends where the policy's own history ends: its trajectory is the tokens
served so far (actions with their log-probs and versions, observations masked), with reward
`SessionConfig.rewritten_reward` (0 by default: a failure to train on) whatever reward the caller
closes it with, finish_reason "history_rewritten", not truncated, and env_metadata
`reward_reason` "history_rewritten: message N ... differs ...". The scaffold's request, and every
later one, gets what a session past its budget gets: an empty reply with finish_reason "length"
(and the header `X-SAO-Session-Ended: history_rewritten`), so that the scaffold stops by its own
rules (mini-swe-agent: the empty reply is another format error, and it exits after
`max_consecutive_format_errors` in a row, 3 by default) rather than retry an error (its client
retries a 409 ten times, waiting up to a minute between). Nothing more is recorded, and the
scaffold does not get a fresh continuation: a second trajectory of one episode would need a reward
of its own that nobody computes.

Sessions left open are closed after `SessionConfig.idle_timeout_s` without a request (a scaffold
that crashed, a harness that never closed): their trajectory is dropped, not handed over, since
nobody graded the episode and an invented reward would teach the policy on the harness's failure;
`counters()["sessions_idle_closed"]` counts them for the learner to log, and a later request or
close names the session as closed for idleness (404, code "session_idle_closed").

Sampling is the run's, not the request's: temperature, top_p, top_k, stop ids and the per-turn
token limit come from `config` (an `AgentConfig`); a request's `max_tokens` /
`max_completion_tokens` can only lower the limit, and its other sampling fields (temperature,
top_p, stop, seed, ...) are ignored — the reply header `X-SAO-Ignored-Params` lists those it
ignored. `config.max_response_tokens` (and `config.max_context_tokens` after the prompt, when
given: the engines' context) bounds the session's response (actions and observation
deltas together) and `config.max_turns` its completions: past either the reply is empty with
finish_reason "length", nothing more is recorded, and the trajectory is truncated.

Errors are OpenAI's `{"error": {"message", "type", "code"}}`: 400 for a malformed request, 404 for
an unknown or closed session, 409 for a failed session (its messages cannot be rendered by the chat
template), 502 when the engines fail. Error replies
carry `x-should-retry: false`, so that OpenAI's client does not repeat them.

A session's record, the Trajectory it becomes and the book of sessions (open, closed, idle-closed,
counted) are in proxy_session.py; `ChatCompletions` below serves one request of a session.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

from aiohttp import web

from sao_jax.engine import HTTPError, bad_request, json_body
from sao_jax.rollout.agent import AgentConfig
from sao_jax.rollout.client import EngineError, SGLangClient
from sao_jax.rollout.proxy_session import (  # noqa: F401 - COUNTERS: the names of counters()
    COUNTERS,
    SESSION_ID,
    Session,
    SessionConfig,
    SessionError,
    Sessions,
    check_id,
)
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.text import ChatDeltas, ChatTemplateError

log = logging.getLogger(__name__)

# Request fields that change sampling; the run's config decides them instead.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "stop", "seed", "presence_penalty",
                    "frequency_penalty", "logit_bias", "min_p", "repetition_penalty")
_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")


class _Rewritten(Exception):
    """The request's history is not the one served; the message says where."""


def _message(m, index: int) -> dict:
    """A request message as the template sees it: role and text content."""
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise bad_request(f"messages[{index}] must be an object with a string 'role'.")
    if m.get("tool_calls") or m.get("function_call"):
        raise bad_request(f"messages[{index}] has tool calls; the proxy serves and records "
                          "plain text turns only.")
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{index}] has a content part that is not text.")
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise bad_request(f"messages[{index}].content must be a string or text parts.")
    return {"role": m["role"], "content": content}


def _error_response(e: HTTPError) -> web.Response:
    return web.json_response({"error": {"message": str(e), "type": e.kind, "code": e.code}},
                             status=e.status, headers={"x-should-retry": "false"})


class RecordingProxy:
    """The OpenAI-compatible proxy in a background thread with its own event loop.

    Args:
      engines: engine base URLs (an `SGLangClient` is made for them on the proxy's loop), or a
        generator object with `SGLangClient.generate`'s signature (used on the proxy's loop).
      chat: the model's chat template deltas.
      config: the run's sampling and limits (see the module docstring).
      host / port: where to listen; loopback and a free port by default.
      model_name: the id `/v1/models` lists and replies carry.
      auto_open: a request for an unseen session id opens it; False: only `open_session` does.
      on_close: called on the proxy's loop with each Trajectory closed over HTTP; None: it is
        not kept (a proxy whose sessions are closed from Python, `close`, needs none).
      sessions: how rewritten histories and idle sessions end (`SessionConfig`).
    """

    def __init__(self, engines: str | Sequence[str] | object, chat: ChatDeltas,
                 config: AgentConfig, *, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "sao-policy", auto_open: bool = True,
                 on_close: Callable[[str, Trajectory], None] | None = None,
                 sessions: SessionConfig = SessionConfig()):  # noqa: B008 - frozen
        if not isinstance(sessions, SessionConfig):
            raise ValueError("RecordingProxy(sessions=...) must be a SessionConfig, got "
                             f"{type(sessions).__name__}.")
        self._engines = engines
        self.chat, self.config, self.host, self.model_name = chat, config, host, model_name
        self.sessions = sessions
        self.auto_open, self.on_close = auto_open, on_close
        self.port = port
        self._book = Sessions(sessions)
        self._generator = None
        self._owns_generator = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None

    # -- lifetime ---------------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> RecordingProxy:
        """Starts serving; returns once the port is bound."""
        if self._thread is not None:
            raise RuntimeError("RecordingProxy already started.")
        ready, failed = threading.Event(), []

        def main():
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve(ready))
            except BaseException as e:  # reported to start() when it happens before ready
                failed.append(e)
                ready.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=main, name="recording-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise TimeoutError(f"the proxy did not start within {timeout_s} s")
        if failed:
            self._thread = None
            raise failed[0]
        return self

    async def _serve(self, ready: threading.Event):
        if isinstance(self._engines, str) or (isinstance(self._engines, Sequence)):
            self._generator, self._owns_generator = SGLangClient(self._engines), True
        else:
            self._generator = self._engines
        self._stopping = asyncio.Event()
        runner = web.AppRunner(self._app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        reaper = None
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            self.port = runner.addresses[0][1]
            log.info("recording proxy on %s", self.url)
            if self.sessions.idle_timeout_s is not None:
                reaper = asyncio.create_task(self._book.close_idle(self.sessions.idle_timeout_s))
            ready.set()
            await self._stopping.wait()
        finally:
            if reaper is not None:
                reaper.cancel()
            await runner.cleanup()
            if self._owns_generator:
                await self._generator.close()

    def stop(self) -> None:
        """Stops serving (open sessions are dropped)."""
        if self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(30)
        self._thread = None

    def __enter__(self) -> RecordingProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def base_url(self, session_id: str) -> str:
        """The OpenAI `base_url` of a session (`.../sessions/<id>/v1`)."""
        check_id(session_id)
        return f"{self.url}/sessions/{session_id}/v1"

    # -- sessions (Python API; thread-safe, not to be called on the proxy's own loop) -------------

    def _call(self, coro):
        if self._loop is None or self._thread is None:
            coro.close()
            raise RuntimeError("the proxy is not running; call start() first.")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking proxy call on the proxy's own loop would deadlock.")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def open_session(self, session_id: str, metadata: Mapping | None = None) -> str:
        """Opens a session (`metadata`: str/int/float/bool values for the trajectory's
        env_metadata; "prompt_id", "lease_id", "group_id" and "prompt_index" are the
        trajectory's, from its `LeasedPrompt`). Returns its base URL."""
        self._call(self._open(session_id, dict(metadata or {})))
        return self.base_url(session_id)

    async def _open(self, session_id: str, metadata: dict) -> Session:
        return self._book.open_new(session_id, metadata, self._generator)

    def close_session(self, session_id: str, reward: float, *, truncated: bool = False,
                      metadata: Mapping | None = None) -> Trajectory:
        """Ends a session and returns its Trajectory, `reward` on the last action token.

        `truncated`: the agent was cut (its step limit, say) rather than finished; a session the
        proxy cut is truncated anyway. A session ended by a rewritten history gets
        `SessionConfig.rewritten_reward` instead of `reward`, is not truncated, and its
        env_metadata "reward_reason" says where the history differed. Timings: "generate" (in
        the engines), "env" (the rest: the scaffold and its environment) and "total", from the
        session's opening. Raises KeyError for an unknown, closed or idle-closed session and
        SessionError for a failed one or one without an action (it is closed either way).
        """
        return self._call(self._book.close(session_id, reward, truncated, dict(metadata or {})))

    def counters(self) -> dict[str, int]:
        """Running totals since start, for the learner to log: `COUNTERS`' names."""
        return self._call(self._read_counters())

    async def _read_counters(self):
        return dict(self._book.counters)

    # -- HTTP -------------------------------------------------------------------------------------

    def _session(self, request: web.Request, create: bool) -> Session:
        session_id = request.match_info["sid"]
        session = self._book.open.get(session_id)
        if session is not None:
            session.last_seen = time.monotonic()  # any request is a sign of life
            return session
        if session_id in self._book.closed:
            raise _gone(self._book, session_id)
        if not (self.auto_open and SESSION_ID.fullmatch(session_id)):
            raise HTTPError(404, f"no session {session_id!r}.", "not_found_error",
                            "session_not_found")
        if not create:
            return None
        return self._book.new(session_id, {}, self._generator)

    def _app(self) -> web.Application:
        completions = ChatCompletions(self._book, self._generator, self.chat, self.config,
                                      self.model_name)

        @web.middleware
        async def errors(request, handler):
            try:
                return await handler(request)
            except HTTPError as e:
                return _error_response(e)
            except web.HTTPException:  # aiohttp's own (an unknown route, say)
                raise
            except Exception as e:  # a bug here must not look like a dropped connection
                log.exception("proxy request %s failed", request.path)
                return _error_response(HTTPError(500, f"{type(e).__name__}: {e}", "api_error",
                                                 "internal_error"))

        async def models(request):
            self._session(request, create=False)
            return web.json_response({"object": "list", "data": [
                {"id": self.model_name, "object": "model", "created": 0, "owned_by": "sao_jax"}]})

        async def complete(request):
            body = await json_body(request)
            return await completions.complete(self._session(request, create=True), body)

        app = web.Application(client_max_size=64 << 20, middlewares=[errors])
        app.add_routes([
            web.post("/sessions/{sid}/v1/chat/completions", complete),
            web.get("/sessions/{sid}/v1/models", models),
            web.post("/sessions/{sid}/close", self._close_over_http),
        ])
        return app

    async def _close_over_http(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise bad_request("close needs a numeric 'reward'.")
        session_id = request.match_info["sid"]
        if self._session(request, create=False) is None:
            raise HTTPError(404, f"no session {session_id!r}.", "not_found_error",
                            "session_not_found")
        try:
            traj = await self._book.close(session_id, float(reward),
                                          bool(body.get("truncated", False)),
                                          _mapping(body.get("metadata")))
        except SessionError as e:
            raise HTTPError(409, str(e), "conflict_error", "session_failed") from e
        if self.on_close is not None:
            self.on_close(session_id, traj)
        return web.json_response({"trajectory_id": traj.trajectory_id,
                                  "prompt_tokens": int(traj.prompt_ids.size),
                                  "response_tokens": traj.length,
                                  "action_tokens": traj.num_action_tokens,
                                  "truncated": traj.truncated,
                                  "finish_reason": traj.finish_reason,
                                  "reward": float(traj.rewards.sum()),
                                  "reward_reason": traj.env_metadata.get("reward_reason")})


class ChatCompletions:
    """One session's chat completion requests: the history checked against what was served, the
    turn generated on the session's engine and recorded, the reply in OpenAI's shape (the module
    docstring says what each request may hold and how a session ends)."""

    def __init__(self, book: Sessions, generator, chat: ChatDeltas, config: AgentConfig,
                 model_name: str):
        self.book, self.generator, self.chat, self.config = book, generator, chat, config
        self.model_name = model_name
        self.stop_token_ids = sorted({*config.stop_token_ids, chat.end_of_turn_id})

    async def complete(self, session: Session, body: dict) -> web.Response:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise bad_request("'messages' must be a non-empty list.")
        if body.get("stream"):
            raise bad_request("streaming is not supported; send stream=false.", "unsupported")
        if body.get("n", 1) != 1:
            raise bad_request("only n=1 is supported.", "unsupported")
        if body.get("tools"):
            raise bad_request("tools are not supported; the proxy serves plain text turns.",
                              "unsupported")
        limit = None
        for name in _LIMIT_FIELDS:
            value = body.get(name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise bad_request(f"'{name}' must be a positive integer.")
                limit = value if limit is None else min(limit, value)
        ignored = [name for name in _SAMPLING_FIELDS if body.get(name) is not None]
        messages = [_message(m, i) for i, m in enumerate(raw)]
        async with session.lock:
            try:
                return await self._complete_locked(session, messages, limit, ignored)
            finally:
                session.last_seen = time.monotonic()

    async def _complete_locked(self, session: Session, messages: list[dict], limit: int | None,
                               ignored: list[str]) -> web.Response:
        if self.book.open.get(session.id) is not session:
            raise _gone(self.book, session.id)
        if session.failure is not None:
            raise HTTPError(409, f"session {session.id!r} failed: {session.failure}",
                            "conflict_error", "session_failed")
        if session.ended is not None:
            return self._ended_reply(session, ignored)
        try:
            prompt, delta = self.extend(session, messages)
        except ChatTemplateError as e:
            session.failure = str(e)
            raise HTTPError(409, f"session {session.id!r} failed: {e}", "conflict_error",
                            "session_failed") from e
        except _Rewritten as e:  # the session ends where the policy's history ends
            session.ended, session.rewritten = "history_rewritten", f"history_rewritten: {e}"
            self.book.counters["sessions_rewritten"] += 1
            log.warning("session %s ends: %s", session.id, session.rewritten)
            return self._ended_reply(session, ignored)
        config = self.config
        response_limit = config.max_response_tokens  # and the engines' context, if given
        if config.max_context_tokens is not None:
            response_limit = min(response_limit, config.max_context_tokens - len(prompt))
        budget = min(config.max_action_tokens, response_limit - len(session.ids) - len(delta))
        if limit is not None:
            budget = min(budget, limit)
        if session.turns >= config.max_turns:
            session.ended = "turn_limit"
        elif len(session.ids) + len(delta) >= response_limit:
            session.ended = "length"  # the observation does not fit: it is not recorded
        if session.ended is not None:
            if session.prompt is None:
                session.prompt, session.served = prompt, messages
            return self._ended_reply(session, ignored)
        params = dict(config.sampling_params(budget), stop_token_ids=self.stop_token_ids)
        history = prompt + session.ids + delta
        t0 = time.perf_counter()
        try:
            result = await (session.engine or self.generator).generate(
                history, params, rid=f"{session.id}-{session.turns}-{uuid.uuid4().hex[:8]}")
            versions = list(result.versions)  # numbers, mapped from labels by the client
        except (EngineError, ValueError) as e:
            raise HTTPError(502, f"the engine failed: {e}", "api_error",
                            "engine_error") from e
        session.generate_s += time.perf_counter() - t0
        # Commit: the prompt or the observation delta (masked), then the action.
        session.prompt, session.served = prompt, messages
        session.append(delta, False)
        action = [int(i) for i in result.output_ids]
        session.append(action, True, result.logprobs, versions)
        session.last_action = action
        session.served.append({"role": "assistant", "content": self.chat.content(action)})
        session.turns += 1
        if result.finish_reason == "abort":
            session.ended = "abort"
        elif result.finish_reason == "length" and len(session.ids) >= response_limit:
            session.ended = "length"
        finish = "stop" if result.finish_reason == "stop" else "length"
        return self._reply(action, finish, ignored, len(history))

    def extend(self, session: Session, messages: list[dict]) -> tuple[list[int], list[int]]:
        """`(prompt, delta)`: the prompt (rendered on the first request) and the masked ids the
        request adds before generation. Changes nothing: the history must match what was
        served, or `_Rewritten` says where it does not."""
        if session.prompt is None:
            if messages[-1]["role"] == "assistant":
                raise bad_request("the last message is the assistant's; nothing to answer.")
            return self.chat.prompt_ids(messages), []
        served = session.served
        for i, (got, want) in enumerate(zip(messages, served, strict=False)):
            if got != want:
                raise _Rewritten(f"message {i} ({got['role']}) differs from the one served "
                                 f"before (role {want['role']!r}, content "
                                 f"{want['content'][:80]!r}...); got content "
                                 f"{got['content'][:80]!r}...: the history was rewritten.")
        if len(messages) <= len(served):
            raise _Rewritten(f"the request has {len(messages)} messages, but {len(served)} were "
                             "served already: the history was cut or repeated.")
        new = messages[len(served):]
        for i, m in enumerate(new, len(served)):
            if m["role"] == "assistant":
                raise _Rewritten(f"message {i} is an assistant message the proxy did not "
                                 "generate.")
        return session.prompt, (self.chat.end_of_turn_ids(session.last_action)
                                + self.chat.delta_ids(new))

    def _ended_reply(self, session: Session, ignored: list[str]) -> web.Response:
        """What every request of an ended session gets: an empty reply, finish_reason "length",
        and the header `X-SAO-Session-Ended` naming why it ended."""
        return self._reply([], "length", ignored, self._length(session),
                           {"X-SAO-Session-Ended": session.ended})

    @staticmethod
    def _length(session: Session) -> int:
        return len(session.prompt or []) + len(session.ids)

    def _reply(self, action: list[int], finish: str, ignored: list[str],
               prompt_tokens: int, headers: dict | None = None) -> web.Response:
        headers = dict(headers or {})
        if ignored:
            headers["X-SAO-Ignored-Params"] = ",".join(ignored)
        return web.json_response({
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                         "message": {"role": "assistant",
                                     "content": self.chat.content(action) if action else ""}}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(action),
                      "total_tokens": prompt_tokens + len(action)},
        }, headers=headers)


def _mapping(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise bad_request("'metadata' must be a JSON object.")
    return dict(value)


def _gone(book: Sessions, session_id: str) -> HTTPError:
    """The 404 of a request to a session no longer open: closed, or closed for idleness."""
    if book.closed.get(session_id) == "idle":
        return HTTPError(404, f"session {session_id!r} was closed after "
                         f"{book.config.idle_timeout_s:g} s without a request.",
                         "not_found_error", "session_idle_closed")
    return HTTPError(404, f"session {session_id!r} is closed.", "not_found_error",
                     "session_closed")
