"""What the embedded engine sends back, shaped as SGLang 0.5.23 shapes it: a `/generate` reply and
its `meta_info` (as the tokenizer manager builds them, cumulative), server-sent events, and the
error bodies of its routes. `sglang_api.py` parses what comes in (requests, and for the client,
these replies).
"""

from __future__ import annotations

import json
import math

from sao_jax.engine.sglang_api import RequestSpec

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
