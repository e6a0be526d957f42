"""The one reader of hostile JSON request bodies, shared by the project's aiohttp servers: the
engine's (`server.py`) and the recording proxy's (`sao_jax.rollout.proxy`).

It lives in the engine package because imports run one way: the rollout plane (its client, its
proxy) imports the engine package, and the engine never imports the rollout plane.
"""

from __future__ import annotations

import json

from aiohttp import web


class HTTPError(Exception):
    """An error reply: its HTTP `status`, message, OpenAI error `kind` (`type`) and `code`."""

    def __init__(self, status: int, message: str, kind: str, code: str):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


def bad_request(message: str, code: str = "invalid_request") -> HTTPError:
    """A 400 `invalid_request_error`."""
    return HTTPError(400, message, "invalid_request_error", code)


async def json_body(request: web.Request) -> dict:
    """The request's body as a JSON object (`{}` when empty); a 400 `HTTPError` for bad JSON or
    UTF-8, huge integers, deep nesting or a body that is not an object."""
    raw = await request.read()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, huge integers, deep nesting
        raise bad_request(f"invalid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object.")
    return body
