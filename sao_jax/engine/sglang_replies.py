"""What the embedded engine sends back, shaped as SGLang 0.5.23 shapes it: a `/generate` reply and
its `meta_info` (as the tokenizer manager builds them, cumulative), server-sent events, and the
error bodies of its routes. `sglang_api.py` parses what comes in (requests, and for the client,
these replies).
"""

from __future__ import annotations

import base64
import json
import math
import time

from sao_jax.engine.sglang_api import RequestSpec
from sao_jax.engine.slots import Request

# ------------------------------------------------------------------------------------------------
# Replies (`sglang_api.parse_generate_reply` reads them).


def _triples(values, ids, texts=None) -> list:
    """SGLang's `[logprob, token_id, text]` entries; a non-finite log-prob is null."""
    texts = texts or [None] * len(ids)
    return [[None if v is None or not math.isfinite(v) else v, t, s]
            for v, t, s in zip(values, ids, texts, strict=True)]


def build_meta_info(spec: RequestSpec, rid: str, output: list[int], logprobs: list[float], *,
                    finish_reason: dict | None, weight_version: str, latency: float,
                    decode_batch_size_max: int, cached_tokens: int = 0, input_logprobs=None,
                    output_ids_logprobs=None, input_ids_logprobs=None, decode=None) -> dict:
    """A reply's `meta_info`, as SGLang's tokenizer manager builds it (cumulative)."""
    meta = {"id": rid, "finish_reason": finish_reason, "prompt_tokens": len(spec.prompt),
            "weight_version": weight_version, "completion_tokens": len(output),
            "cached_tokens": cached_tokens, "e2e_latency": latency,
            "decode_batch_size_max": decode_batch_size_max}
    if not spec.return_logprob:
        return meta
    texts = None
    if spec.return_text_in_logprobs and decode is not None:
        def texts(ids):
            return [decode([t]) for t in ids]
    else:
        def texts(ids):
            return None
    start = spec.input_logprob_start
    prompt_part = list(spec.prompt[start:])
    if spec.wants_input_logprobs and input_logprobs is not None:
        # SGLang: the first entry has no log-prob (null), even when start > 0.
        values = [None, *input_logprobs[start:len(spec.prompt) - 1]]
        meta["input_token_logprobs"] = _triples(values, prompt_part, texts(prompt_part))
    else:
        meta["input_token_logprobs"] = []
    meta["output_token_logprobs"] = _triples(logprobs, output, texts(output))
    meta["output_token_logprobs_length"] = len(output)
    if spec.token_ids_logprob is not None:
        ids = list(spec.token_ids_logprob)
        if spec.wants_input_logprobs and input_ids_logprobs is not None:
            rows = input_ids_logprobs[start:len(spec.prompt) - 1]
            meta["input_token_ids_logprobs"] = [None, *(_triples(r, ids, texts(ids))
                                                        for r in rows)]
        else:
            meta["input_token_ids_logprobs"] = []
        meta["output_token_ids_logprobs"] = [_triples(r, ids, texts(ids))
                                             for r in (output_ids_logprobs or [])]
    return meta


def build_reply(spec: RequestSpec, output: list[int], meta: dict, text: str | None) -> dict:
    """One sequence's reply: `text` (when the engine has a tokenizer), `output_ids`, `meta_info`
    (and `prompt_token_ids` when asked)."""
    reply = {} if text is None else {"text": text}
    reply["output_ids"] = list(output)
    reply["meta_info"] = meta
    if spec.return_prompt_token_ids:
        reply["prompt_token_ids"] = list(spec.prompt)
    return reply


class Replies:
    """A request's tokens as SGLang reports them, with the served model's tokenizer (None: ids
    only): when its output finishes it, its text, and its reply so far."""

    def __init__(self, tokenizer, max_seq_len: int):
        self.tokenizer, self.max_seq_len = tokenizer, max_seq_len

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def finish_reason(self, req: Request, token: int) -> dict | None:
        """Whether the newest output `token` finishes `req`, and why (SGLang's order: the length
        limit first, then stop tokens, then stop strings; then a full cache row)."""
        n = len(req.output)
        if n >= req.spec.max_new_tokens:
            return {"type": "length", "length": req.spec.max_new_tokens}
        if token in req.stop_ids:
            return {"type": "stop", "matched": token}
        if req.spec.stop and (matched := self._stop_string(req)) is not None:
            return {"type": "stop", "matched": matched}
        if len(req.spec.prompt) + n >= self.max_seq_len:  # the cache row is full
            return {"type": "length", "length": n}
        return None

    def _stop_string(self, req: Request) -> str | None:
        """The stop string the output's tail now holds, if any (tokens are >= 1 character, so
        the last `longest + 1` tokens hold any stop string that the newest token completed)."""
        window = max(map(len, req.spec.stop)) + 1
        tail = self.decode(req.output[-window:], req.spec.skip_special_tokens)
        return next((s for s in req.spec.stop if s in tail), None)

    def text(self, req: Request) -> str | None:
        """The output as text (with a tokenizer): SGLang trims a matched stop (string or token)
        unless `no_stop_trim`."""
        if self.tokenizer is None:
            return None
        ids, finish = req.output, req.finish_reason or {}
        trim = finish.get("type") == "stop" and not req.spec.no_stop_trim
        if trim and isinstance(finish.get("matched"), int):
            ids = ids[:-1]
        text = self.decode(ids, req.spec.skip_special_tokens)
        if trim and isinstance(finish.get("matched"), str):
            text = text[:text.find(finish["matched"])] if finish["matched"] in text else text
        return text

    def reply(self, req: Request, weight_version: str) -> dict:
        """The request's reply so far (cumulative, as SGLang streams it); final once finished.
        `weight_version`: the engine's, for a request not admitted yet."""
        decode = None if self.tokenizer is None else self.decode
        meta = build_meta_info(
            req.spec, req.rid, req.output, req.logprobs, finish_reason=req.finish_reason,
            weight_version=req.version or weight_version,
            latency=time.perf_counter() - req.created, decode_batch_size_max=req.max_batch,
            cached_tokens=req.cached,
            input_logprobs=req.input_logprobs, output_ids_logprobs=req.ids_logprobs,
            input_ids_logprobs=req.input_ids_logprobs, decode=decode)
        if req.routed_experts is not None:  # as SGLang: int32 bytes, base64, once finished
            meta["routed_experts"] = base64.b64encode(
                req.routed_experts.astype("<i4").tobytes()).decode("ascii")
        return build_reply(req.spec, req.output, meta, self.text(req))


# ------------------------------------------------------------------------------------------------
# Streams and errors.

SSE_DONE = b"data: [DONE]\n\n"


def sse_chunk(payload) -> bytes:
    """One server-sent event, as SGLang writes them: `data: {json}` and a blank line."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def stream_error(message: str, code: int = 400) -> dict:
    """The chunk SGLang sends when a streamed request fails after the stream began."""
    return {"error": {"message": message, "type": "invalid_request_error", "code": code,
                      "retryable": False}}


def error_body(message: str, field: str | None = None) -> dict:
    """`/generate`'s error body in SGLang (`{"error": {"message"}}`), plus the field's name."""
    return {"error": {"message": message, "param": field}}


def openai_error_body(status: int, message: str, field: str | None = None) -> dict:
    """SGLang's `ErrorResponse` (its other routes' validation errors), `param` naming the field."""
    phrase = {400: "Bad Request", 404: "Not Found", 408: "Request Timeout",
              500: "Internal Server Error", 503: "Service Unavailable"}.get(status, "Error")
    return {"object": "error", "message": message, "type": phrase, "param": field,
            "code": status}
