"""SGLang's native HTTP protocol, both ends, as read: what the engine accepts, and what the
client reads back; what the engine sends is built in `sglang_replies.py`.

The home of the protocol (facts from SGLang 0.5.23: `GenerateReqInput` and its
`normalize_batch_and_arguments`, `SamplingParams.verify`, the `/generate` JSON contract, the
tokenizer manager's replies and stream chunks). Nothing here touches JAX or the scheduler:

  * `parse_generate(body, limits)` turns a `/generate` body into one `RequestSpec` per sequence to
    generate (a batch, `n` > 1 and a string `rid` expanded as SGLang expands them) or raises
    `BadRequest` naming the field. A field SGLang knows is implemented, or accepted only at its
    neutral value (a 400 that names it otherwise: never a silent drop); a field SGLang does not
    know is a 400 too (SGLang ignores unknown top-level keys, so a typo such as `return_logprobs`
    would be lost).
  * `sglang_replies.py`'s `build_meta_info`, `build_reply`, `sse_chunk`, `SSE_DONE`,
    `stream_error`, `error_body`, `openai_error_body`: what goes back, shaped as SGLang shapes it.
  * `parse_generate_reply`, `error_message`, `parse_server_version` and the feature constants
    (`PAUSE_MODES_SINCE`, `SPANS_SINCE`, `CACHE_NOT_FLUSHED`): what `client.SGLangClient` reads
    back from a real SGLang server (0.5.2 to 0.5.23) or the engine.

Numbers never reach the device unchecked: token ids lie in [0, vocab), `top_k` >= vocab means
"no limit" (stored as 0), `sampling_seed` is an int64, `max_new_tokens` is clamped by the context
(`limits.max_seq_len`), temperatures are finite.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import math
import re
import uuid

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default (SamplingParams.max_new_tokens)
GREEDY_BELOW = 1e-6  # temperatures below this decode greedily (SGLang's _SAMPLING_EPS)
MAX_STOP_STRINGS = 32  # SGLang's MAX_STOP_COUNT
MAX_TOKEN_IDS_LOGPROB = 128  # ours: the ids whose log-probs a request may ask for
MAX_SEQUENCES_PER_CALL = 4096  # ours: a batch times n; SGLang has no bound
UNKNOWN_VERSION = "unknown"  # a reply without meta_info.weight_version
PAUSE_MODES = ("abort", "retract", "in_place")
# First SGLang releases with a feature, as far as this module knows them (0.5.2, 0.5.9, 0.5.23
# were read): pause modes (0.5.2 has none, 0.5.9 has them) and per-token weight_versions spans.
PAUSE_MODES_SINCE = (0, 5, 9)
SPANS_SINCE = (0, 5, 19)
CACHE_NOT_FLUSHED = "cache was not flushed"  # 0.5.23's 400 after a load that did happen
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
INT32_MAX = 2 ** 31 - 1  # token ids travel as int32 (the trajectory stream, the model)


class EngineError(RuntimeError):
    """An engine answered with an error, or its reply could not be read."""

    def __init__(self, message: str, *, url: str | None = None, status: int | None = None):
        super().__init__(message if url is None else f"{url}: {message}")
        self.url, self.status = url, status


class BadRequest(ValueError):
    """Invalid request input (HTTP 400); `field` names what is wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served model allows: the vocabulary, the positions per slot, the tokenizer,
    whether it keeps routed experts."""

    vocab_size: int
    max_seq_len: int
    tokenizer: object | None = None  # a `tokenizers.Tokenizer`, when the model dir holds one
    routed_experts: bool = False  # --enable-return-routed-experts


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One validated sequence to generate."""

    prompt: tuple[int, ...]
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # already clamped to the context
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()  # stop strings (needs a tokenizer)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    stream_interval: int = 1
    sampling_seed: int | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output log-probs only (SGLang's default)
    token_ids_logprob: tuple[int, ...] | None = None
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    return_routed_experts: bool = False  # the experts of positions [start, seqlen - 1)
    routed_experts_start_len: int = 0
    rid: str | None = None
    stream: bool = False

    @property
    def input_logprob_start(self) -> int:
        """The first prompt position with an input log-prob entry (len(prompt): none)."""
        return len(self.prompt) if self.logprob_start_len < 0 else self.logprob_start_len

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.input_logprob_start < len(self.prompt)


# ------------------------------------------------------------------------------------------------
# Field tables: every field of SGLang 0.5.23's GenerateReqInput and SamplingParams, and what the
# engine does with it.

# Top-level /generate fields the parser implements.
GENERATE_FIELDS = ("text", "input_ids", "rid", "sampling_params", "stream", "return_logprob",
                   "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                   "return_text_in_logprobs", "return_prompt_token_ids", "routed_dp_rank",
                   "data_parallel_rank", "return_routed_experts", "routed_experts_start_len")
# Accepted and without effect here, as in SGLang with one data-parallel rank and no prefix cache:
# routing, priority, cache namespaces, logging and tracing.
GENERATE_IGNORED = ("log_metrics", "priority", "routing_key", "conversation_id", "extra_key",
                    "cache_salt", "custom_labels", "no_logs", "received_time",
                    "external_trace_header", "disagg_prefill_dp_rank", "http_worker_ipc")
# Accepted only at their neutral value (null, false, 0, "", [], {}): the engine cannot do them.
GENERATE_UNSUPPORTED = {
    "input_embeds": "embeddings as input are not supported: send input_ids or text",
    "image_data": "multimodal input is not supported", "video_data": "multimodal input is not "
    "supported", "audio_data": "multimodal input is not supported",
    "mm_hashes": "multimodal input is not supported",
    "mm_content_hashes": "multimodal input is not supported",
    "use_audio_in_video": "multimodal input is not supported",
    "video_config": "multimodal input is not supported",
    "modalities": "multimodal input is not supported",
    "images_config": "multimodal input is not supported",
    "mm_processor_kwargs": "multimodal input is not supported",
    "max_dynamic_patch": "multimodal input is not supported",
    "min_dynamic_patch": "multimodal input is not supported",
    "image_max_dynamic_patch": "multimodal input is not supported",
    "video_max_dynamic_patch": "multimodal input is not supported",
    "return_hidden_states": "the engine cannot return hidden states",
    "return_indexer_topk": "the engine cannot return indexer top-k",
    "return_entropy": "the engine cannot return entropies",
    "return_sampling_mask": "the engine cannot return sampling masks",
    "sampling_logprobs_mode": "the engine cannot return sampling masks",
    "return_flat_raw_top_logprobs": "top log-probs are not supported",
    "return_flat_raw_output_top_logprobs": "top log-probs are not supported",
    "return_flat_raw_top_logprobs_b64": "top log-probs are not supported",
    "return_bytes": "only generation models are served",
    "lora_path": "LoRA adapters are not supported", "lora_id": "LoRA adapters are not supported",
    "custom_logit_processor": "custom logit processors are not supported",
    "positional_embed_overrides": "embedding overrides are not supported",
    "session_params": "sessions are not supported", "session_id": "sessions are not supported",
    "bootstrap_host": "disaggregated serving is not supported",
    "bootstrap_port": "disaggregated serving is not supported",
    "bootstrap_room": "disaggregated serving is not supported",
    "bootstrap_pair_key": "disaggregated serving is not supported",
    "decode_tp_size": "disaggregated serving is not supported",
    "need_wait_for_mm_inputs": "disaggregated serving is not supported",
    "num_items_assigned": "disaggregated serving is not supported",
    "encoder_urls": "disaggregated serving is not supported",
    "background": "background requests are not supported",
    "require_reasoning": "reasoning controls are not supported",
    "max_thinking_tokens": "thinking budgets need --enable-strict-thinking, which the engine "
                           "does not have",
    "multi_item_delimiter_indices": "multi-item scoring is not supported",
    "token_indices_to_pool": "pooling readouts are not supported",
    "kv_hints": "KV hints are not supported", "watermark": "watermarks are not supported",
}

# sampling_params: implemented, and accepted only at their neutral value (SGLang refuses any key
# outside its SamplingParams, as here).
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
                   "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                   "no_stop_trim", "stream_interval", "sampling_seed", "custom_params", "n")
SAMPLING_NEUTRAL = {"stop_regex": (None, "", ()), "min_p": (0,), "frequency_penalty": (0,),
                    "presence_penalty": (0,), "repetition_penalty": (1,),
                    "min_new_tokens": (0,), "json_schema": (None, ""), "regex": (None, ""),
                    "ebnf": (None, ""), "structural_tag": (None, ""), "logit_bias": (None, {}),
                    "beam_width": (None, 1), "watermark": (None,), "choice": (None, ())}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _neutral(value) -> bool:
    return value is None or value is False or value == 0 or value in ("", [], {})


# ------------------------------------------------------------------------------------------------
# sampling_params.


def parse_sampling_params(params, limits: Limits, field: str = "sampling_params") -> dict:
    """One SGLang `sampling_params` object -> RequestSpec fields (plus "n"); BadRequest naming
    the field otherwise. Values are checked as SGLang's `SamplingParams.verify` checks them."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise BadRequest(field, f"must be a JSON object, got {type(params).__name__}.")
    out: dict = {}
    for key, value in params.items():
        name = f"{field}.{key}"
        if key in SAMPLING_NEUTRAL:
            allowed = SAMPLING_NEUTRAL[key]
            if not any(value == a or (a == () and value == []) for a in allowed):
                raise BadRequest(name, f"is not supported by the embedded engine (only its "
                                       f"neutral value {allowed[0]!r}).")
            continue
        if key not in SAMPLING_FIELDS:
            raise BadRequest(name, "unknown sampling parameter (SGLang refuses it too); known: "
                                   f"{', '.join(SAMPLING_FIELDS + tuple(SAMPLING_NEUTRAL))}.")
        if value is None and key != "max_new_tokens":
            continue  # null: SGLang's default
        if key == "temperature":
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise BadRequest(name, f"must be a finite number >= 0, got {value!r}.")
            out["temperature"] = float(value) if value >= GREEDY_BELOW else 0.0
        elif key == "top_p":
            if not _is_number(value) or not 0 < value <= 1:
                raise BadRequest(name, f"must lie in (0, 1], got {value!r}.")
            out["top_p"] = float(value)
        elif key == "top_k":
            if not _is_int(value) or (value < 1 and value != -1):
                raise BadRequest(name, f"must be -1 (no limit) or an integer >= 1, got "
                                       f"{value!r}.")
            out["top_k"] = 0 if value == -1 or value >= limits.vocab_size else value
        elif key == "max_new_tokens":
            if value is not None and (not _is_int(value) or value < 0):
                raise BadRequest(name, f"must be an integer >= 0 or null, got {value!r}.")
            out["max_new_tokens"] = value  # None: up to the context limit
        elif key == "stop_token_ids":
            if not isinstance(value, list) or not all(_is_int(t) for t in value):
                raise BadRequest(name, f"must be a list of token ids, got {value!r}.")
            out["stop_token_ids"] = frozenset(value)  # ids outside the vocabulary never match
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise BadRequest(name, f"must be a string or a list of strings, got {value!r}.")
            stops = [s for s in stops if s]
            if len(stops) > MAX_STOP_STRINGS:
                raise BadRequest(name, f"at most {MAX_STOP_STRINGS} stop strings are allowed, "
                                       f"got {len(stops)}.")
            if stops and limits.tokenizer is None:
                raise BadRequest(name, "stop strings need a tokenizer (tokenizer.json in the "
                                       "model directory), as SGLang with --skip-tokenizer-init; "
                                       "use stop_token_ids.")
            out["stop"] = tuple(stops)
        elif key in ("ignore_eos", "no_stop_trim", "skip_special_tokens"):
            if not isinstance(value, bool):
                raise BadRequest(name, f"must be true or false, got {value!r}.")
            out[key] = value
        elif key == "spaces_between_special_tokens":
            if value is not True:
                raise BadRequest(name, "only true (the default) is supported: the tokenizer "
                                       "decodes special tokens as it is configured to.")
        elif key == "stream_interval":
            if not _is_int(value) or value < 1:
                raise BadRequest(name, f"must be an integer >= 1, got {value!r}.")
            out["stream_interval"] = value
        elif key == "sampling_seed":
            if not _is_int(value) or not INT64_MIN <= value <= INT64_MAX:
                raise BadRequest(name, f"must be an integer in [-2**63, 2**63 - 1], got "
                                       f"{value!r}.")
            out["sampling_seed"] = value
        elif key == "custom_params":
            # SGLang hands them to a custom logit processor; without one (there is none here)
            # they have no effect. slime sends them.
            if not isinstance(value, dict):
                raise BadRequest(name, f"must be a JSON object, got {type(value).__name__}.")
        elif key == "n":
            if not _is_int(value) or value < 1:
                raise BadRequest(name, f"must be an integer >= 1, got {value!r}.")
            out["n"] = value
    return out


# ------------------------------------------------------------------------------------------------
# /generate.


def _prompts(body, limits: Limits) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether the body is a batch."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise BadRequest("text", "give either text or input_ids, not both.")
    if text is not None:
        if limits.tokenizer is None:
            raise BadRequest("text", "this engine has no tokenizer (no tokenizer.json in the "
                                     "model directory, as SGLang's --skip-tokenizer-init): send "
                                     "input_ids.")
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text", "must be a string, or a non-empty list of strings for a "
                                     "batch.")
        prompts = [limits.tokenizer.encode(t).ids for t in texts]
        field = "text"
    else:
        if ids is None:
            raise BadRequest("input_ids", "required: a list of token ids (or a list of such "
                                          "lists for a batch), or text.")
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids", "must be a non-empty list of token ids (or of lists).")
        batch = isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        field = "input_ids"
    for i, prompt in enumerate(prompts):
        name = f"{field}[{i}]" if batch else field
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest(name, "must be a non-empty list of token ids" if field == "input_ids"
                             else "encodes to no tokens.")
        bad = next((t for t in prompt if not _is_int(t) or not 0 <= t < limits.vocab_size), None)
        if bad is not None or not all(_is_int(t) for t in prompt):
            raise BadRequest(name, f"token ids must be integers in [0, {limits.vocab_size}), "
                                   f"got {bad!r}.")
        if len(prompt) >= limits.max_seq_len:
            raise BadRequest(name, f"the prompt of {len(prompt)} tokens leaves no room for a new "
                                   f"token in --max-seq-len {limits.max_seq_len}.")
    return prompts, batch


def _per_item(body, key: str, default, n: int, batch: bool, samples: int, nested=False):
    """A field given once for all prompts, or (in a batch) as a list with one entry each."""
    value = body.get(key)
    if value is None:
        return [default] * n
    listed = isinstance(value, list) and (not nested or (value and isinstance(value[0], list)))
    if not listed:
        return [value] * n
    if not batch:
        raise BadRequest(key, "a list is for a batch; this request has one prompt.")
    if samples > 1:
        raise BadRequest(key, f"cannot use a list {key} with n > 1 (as SGLang).")
    if len(value) != n:
        raise BadRequest(key, f"has {len(value)} entries for {n} prompts.")
    return value


def _check_top_level(body) -> bool:
    """Every top-level field known (an unsupported one at its neutral value only), the flags
    booleans, one data-parallel rank; returns `stream`."""
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object.")
    for key, value in body.items():
        if key in GENERATE_FIELDS or key in GENERATE_IGNORED:
            continue
        if key in GENERATE_UNSUPPORTED:
            if not _neutral(value):
                raise BadRequest(key, GENERATE_UNSUPPORTED[key] + " by the embedded engine.")
            continue
        raise BadRequest(key, "unknown field; SGLang's /generate takes " +
                         ", ".join(GENERATE_FIELDS) + " (and ignores the rest, which would "
                         "hide a typo).")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream", f"must be true or false, got {stream!r}.")
    for key in ("routed_dp_rank", "data_parallel_rank"):
        if body.get(key) not in (None, 0):
            raise BadRequest(key, f"must be 0: the engine is one data-parallel rank, got "
                                  f"{body.get(key)!r}.")
    for key in ("return_text_in_logprobs", "return_prompt_token_ids"):
        if not isinstance(body.get(key, False), bool):
            raise BadRequest(key, f"must be true or false, got {body.get(key)!r}.")
    return bool(stream)


def _sampling_per_prompt(body, limits: Limits, batch: bool, n_prompts: int
                         ) -> tuple[list[dict], int]:
    """Each prompt's parsed sampling parameters, and `n` (the samples of each prompt)."""
    params = body.get("sampling_params")
    if isinstance(params, list):
        if not batch:
            raise BadRequest("sampling_params", "a list is for a batch; this request has one "
                                                "prompt.")
        if len(params) != n_prompts:
            raise BadRequest("sampling_params", f"has {len(params)} entries for {n_prompts} "
                                                "prompts.")
        fields = [parse_sampling_params(p, limits, f"sampling_params[{i}]")
                  for i, p in enumerate(params)]
    else:
        fields = [parse_sampling_params(params, limits)] * n_prompts
    samples = fields[0].get("n", 1)
    if any(f.get("n", 1) != samples for f in fields):
        raise BadRequest("sampling_params", "n must be the same for every prompt (as SGLang).")
    total = n_prompts * samples
    if total > MAX_SEQUENCES_PER_CALL:
        raise BadRequest("sampling_params.n", f"{n_prompts} prompts x n={samples} is {total} "
                                              f"sequences; at most {MAX_SEQUENCES_PER_CALL}.")
    return fields, samples


def _rid_field(body, batch: bool, n_prompts: int):
    """`rid`: None, a string, or (in a batch) one distinct string per prompt."""
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str | list):
        raise BadRequest("rid", f"must be a string or a list of strings, got {rid!r}.")
    if isinstance(rid, list):
        if not batch or len(rid) != n_prompts or not all(isinstance(r, str) for r in rid):
            raise BadRequest("rid", f"a list of rids needs one string per prompt of a batch "
                                    f"({n_prompts} prompts).")
        if len(set(rid)) != len(rid):
            raise BadRequest("rid", f"duplicate request ids within the request: {rid}.")
    return rid


def _token_ids_per_prompt(body, batch: bool, n_prompts: int, samples: int) -> list:
    """`token_ids_logprob` for each prompt (None: none asked for)."""
    token_ids = body.get("token_ids_logprob")
    if not token_ids:
        return [None] * n_prompts
    if isinstance(token_ids, list) and isinstance(token_ids[0], list):
        if not batch or len(token_ids) != n_prompts:
            raise BadRequest("token_ids_logprob", "a list of lists needs one list per prompt "
                                                  "of a batch.")
        if samples > 1:
            raise BadRequest("token_ids_logprob", "cannot use a list of lists with n > 1 (as "
                                                  "SGLang).")
        return token_ids
    return [token_ids] * n_prompts


def _logprob_request(prompt: list[int], logprob, start, top, ids, limits: Limits
                     ) -> tuple[int, tuple[int, ...] | None]:
    """One prompt's log-prob fields checked: `(logprob_start_len, token_ids_logprob)`."""
    if not isinstance(logprob, bool):
        raise BadRequest("return_logprob", f"must be true or false, got {logprob!r}.")
    if not _is_int(start) or not -1 <= start <= len(prompt):
        raise BadRequest("logprob_start_len", f"must be -1 (output log-probs only) or a "
                                              f"prompt position in [0, {len(prompt)}], got "
                                              f"{start!r}.")
    if not _is_int(top) or top < 0:
        raise BadRequest("top_logprobs_num", f"must be an integer >= 0, got {top!r}.")
    if top > 0:
        raise BadRequest("top_logprobs_num", "top log-probs are not supported by the "
                                             "embedded engine; ask for given ids with "
                                             "token_ids_logprob.")
    if ids is not None:
        if (not isinstance(ids, list) or not ids or
                not all(_is_int(t) and 0 <= t < limits.vocab_size for t in ids)):
            raise BadRequest("token_ids_logprob", f"must be a list of token ids in [0, "
                                                  f"{limits.vocab_size}), got {ids!r}.")
        if len(ids) > MAX_TOKEN_IDS_LOGPROB:
            raise BadRequest("token_ids_logprob", f"at most {MAX_TOKEN_IDS_LOGPROB} ids, "
                                                  f"got {len(ids)}.")
        ids = tuple(ids) if logprob else None  # SGLang reads them with log-probs only
    return start, ids


def _sample_rid(rid, i: int, j: int, samples: int, many: bool) -> str | None:
    """The id of prompt `i`'s sample `j`, as SGLang expands `rid`."""
    if samples > 1:
        return uuid.uuid4().hex  # SGLang gives each sample a fresh id
    if isinstance(rid, list):
        return rid[i]
    if isinstance(rid, str) and many:
        return f"{rid}_{i * samples + j}"
    return rid


def parse_generate(body, limits: Limits) -> tuple[list[RequestSpec], bool]:
    """A `/generate` body -> one RequestSpec per sequence, and whether the reply is a list.

    As SGLang's `normalize_batch_and_arguments`: `n` > 1 turns even one prompt into a batch of
    its samples, ordered prompt by prompt, each with a fresh id; a string `rid` on a batch
    becomes `rid_0, rid_1, ...`; per-prompt lists must match the batch.
    """
    stream = _check_top_level(body)
    prompts, batch = _prompts(body, limits)
    n_prompts = len(prompts)
    fields, samples = _sampling_per_prompt(body, limits, batch, n_prompts)
    many = batch or samples > 1
    rid = _rid_field(body, batch, n_prompts)
    logprob = _per_item(body, "return_logprob", False, n_prompts, batch, samples)
    start = _per_item(body, "logprob_start_len", -1, n_prompts, batch, samples)
    top = _per_item(body, "top_logprobs_num", 0, n_prompts, batch, samples)
    token_ids = _token_ids_per_prompt(body, batch, n_prompts, samples)
    routed = _per_item(body, "return_routed_experts", False, n_prompts, batch, samples)
    routed_start = _per_item(body, "routed_experts_start_len", 0, n_prompts, batch, samples)

    specs = []
    for i, prompt in enumerate(prompts):
        s, ids = _logprob_request(prompt, logprob[i], start[i], top[i], token_ids[i], limits)
        _check_routed(routed[i], routed_start[i], len(prompt), limits)
        f = dict(fields[i])
        f.pop("n", None)
        room = limits.max_seq_len - len(prompt)
        budget = f.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        budget = room if budget is None else min(budget, room)
        for j in range(samples):
            specs.append(RequestSpec(
                prompt=tuple(prompt), max_new_tokens=budget, return_logprob=logprob[i],
                logprob_start_len=s, token_ids_logprob=ids,
                rid=_sample_rid(rid, i, j, samples, many), stream=stream,
                return_text_in_logprobs=body.get("return_text_in_logprobs", False),
                return_prompt_token_ids=body.get("return_prompt_token_ids", False),
                return_routed_experts=routed[i], routed_experts_start_len=routed_start[i], **f))
    return specs, many


def _check_routed(wanted, start, prompt_tokens: int, limits: Limits) -> None:
    """`return_routed_experts` a boolean, and true only where the engine keeps routes;
    `routed_experts_start_len` an int in [0, prompt tokens], as SGLang requires."""
    if not isinstance(wanted, bool):
        raise BadRequest("return_routed_experts",
                         f"must be true or false, got {repr(wanted)[:100]}.")
    if wanted and not limits.routed_experts:
        raise BadRequest("return_routed_experts", "this engine keeps no routed experts: start "
                         "it with --enable-return-routed-experts (a model with experts).")
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= prompt_tokens:
        raise BadRequest("routed_experts_start_len",
                         f"must be an int in [0, {prompt_tokens}] (the prompt's tokens), got "
                         f"{repr(start)[:100]}.")


# ------------------------------------------------------------------------------------------------
# Replies as the client reads them (a real SGLang server's or the engine's).


@dataclasses.dataclass
class Segment:
    """One `/generate` reply, parsed."""

    output_ids: list[int]
    logprobs: list[float | None]
    finish_reason: str  # "stop" | "length" | "abort" | "unknown"
    weight_version: str  # the reply's label (of its last tokens)
    weight_versions: list[str] = dataclasses.field(default_factory=list)  # per token
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    matched_stop: int | str | list | None = None
    finish_message: str | None = None
    status_code: int | None = None  # an abort's error status, when it has one
    rid: str | None = None
    # `return_routed_experts`: the experts of each token the engine ran, flat int32 (reshape to
    # [tokens, layers, top-k]); None when the reply has none
    routed_experts: np.ndarray | None = None


def routed_experts(meta) -> np.ndarray | None:
    """meta_info's `routed_experts` (SGLang's base64 of little-endian int32), flat; None when
    absent. Raises EngineError when it is not that."""
    value = meta.get("routed_experts")
    if value is None:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (TypeError, ValueError):
        raise EngineError(f"meta_info.routed_experts is not base64: {str(value)[:100]}") from None
    if len(raw) % 4:
        raise EngineError(f"meta_info.routed_experts holds {len(raw)} bytes, not int32s.")
    return np.frombuffer(raw, "<i4").astype(np.int32)


def _finite_or_none(x) -> float | None:
    return float(x) if _is_number(x) and math.isfinite(x) else None


def _token_labels(meta: dict, n: int, label: str) -> list[str]:
    """Per-token weight labels: from `meta_info.weight_versions` spans (`[{version, start,
    end}]`, contiguous from token 0, SGLang >= 0.5.19), tokens past the last span taking the
    reply's label; without spans, the reply's label for all `n` tokens."""
    spans = meta.get("weight_versions")
    if spans is None:
        return [label] * n
    if not isinstance(spans, list) or not all(isinstance(s, dict) for s in spans):
        raise EngineError(f"meta_info.weight_versions must be a list of spans, got "
                          f"{str(spans)[:200]}")
    labels: list[str] = []
    covered = 0
    for span in spans:
        version, start, end = span.get("version"), span.get("start"), span.get("end")
        if (version is None or not _is_int(start) or not _is_int(end) or start != covered
                or end < start):
            raise EngineError("meta_info.weight_versions spans must be {version, start, end} "
                              f"covering the output tokens in order, got {str(spans)[:300]}")
        covered = end
        labels += [str(version)] * (min(end, n) - min(start, n))
    return labels + [label] * (n - len(labels))


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
    if not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
        raise EngineError(f"output_ids must be token ids (ints in [0, 2^31)), got "
                          f"{str(ids)[:200]}")
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
    label = UNKNOWN_VERSION if version is None else str(version)
    return Segment(
        output_ids=list(ids), logprobs=logprobs, finish_reason=kind, weight_version=label,
        weight_versions=_token_labels(meta, len(ids), label),
        prompt_tokens=meta.get("prompt_tokens"), completion_tokens=meta.get("completion_tokens"),
        matched_stop=matched, finish_message=message,
        status_code=status if isinstance(status, int) else None, rid=meta.get("id"),
        routed_experts=routed_experts(meta))


def error_message(data, text: str = "") -> str:
    """The message of an error reply: SGLang's `{"error": {"message"}}` or `{"error": "..."}`,
    OpenAI's `{"message"}`, FastAPI's `{"detail": "..."}` or `{"detail": [{loc, msg}]}`; else
    the text."""
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message") is not None:
            return str(error["message"])
        if isinstance(error, str | list) and error:
            return error if isinstance(error, str) else "; ".join(map(str, error))
        if isinstance(data.get("message"), str):
            return data["message"]
        detail = data.get("detail")
        if isinstance(detail, str):
            return detail
        if isinstance(detail, list) and detail:
            return "; ".join(
                f"{'.'.join(map(str, _listed(d.get('loc'))))}: {d.get('msg')}"
                if isinstance(d, dict) else str(d) for d in detail)
    return text.strip()[:500] or "(empty body)"


def _listed(x) -> list:
    return list(x) if isinstance(x, list | tuple) else [] if x is None else [x]


def parse_server_version(text) -> tuple[int, ...] | None:
    """(0, 5, 23) from "0.5.23" (or "0.5.23.post1", "0.5.23rc0"); None if it has no number."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text)) if text is not None else None
    return tuple(int(p) for p in match.group(1).split(".")) if match else None
