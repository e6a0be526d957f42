"""The embedded engine as an SGLang 0.5.23 server, over real sockets: streams, text and stop
strings, prompt and given-id log-probs, `n` and rid expansion, seeds, the routes SGLang's clients
call, weight updates and pauses with SGLang's semantics, and hostile input (each a named 400 or a
dropped connection, and nobody else hurt).

One engine subprocess (the toy model with a character tokenizer) serves the whole module.
"""

import asyncio
import itertools
import json
import socket
import time

import aiohttp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from sao_jax.engine.sglang_api import BadRequest, Limits, parse_generate
from sao_jax.models import save_hf
from tests.engine.engines import (
    get,
    post,
    run,
    start_engine,
    stop_engine,
    teacher_forced,
    toy_model,
    wait_for,
)

MAX_BATCH = 4  # a fifth request waits
MAX_SEQ_LEN = 64
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?;:ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:63]


def char_tokenizer() -> Tokenizer:
    """One character a token (ids 0-62) and `<eos>` (63), decoding without separators."""
    vocab = {c: i for i, c in enumerate(CHARS)} | {"<eos>": 63}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<eos>"])
    return tok


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The served model (with tokenizer.json), a second version, and two broken ones."""
    root = tmp_path_factory.mktemp("sglang_engine")
    out = {}
    for name, seed in (("v0", 0), ("v1", 1)):
        save_hf(toy_model(seed), str(root / name))
        out[name] = str(root / name)
    char_tokenizer().save(str(root / "v0" / "tokenizer.json"))
    for name, tensor, change in (
            ("nan", "model.norm.weight", lambda a: np.full_like(a, np.nan)),
            ("shape", "model.layers.0.self_attn.q_proj.weight", lambda a: a[:-1])):
        save_hf(toy_model(2), str(root / name))
        file = str(root / name / "model.safetensors")
        tensors = load_file(file)
        tensors[tensor] = np.ascontiguousarray(change(tensors[tensor]))
        save_file(tensors, file)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def engine(dirs):
    proc, url = start_engine(dirs["v0"], "--max-batch", str(MAX_BATCH), "--max-seq-len",
                             str(MAX_SEQ_LEN), "--header-timeout-s", "1", "--body-timeout-s", "1")
    yield url
    stop_engine(proc)


@pytest.fixture(scope="module")
def model():
    return toy_model(0)


def gen(url, body):
    return post(url, "/generate", body)


async def sse(url, body):
    """A streamed /generate: the decoded chunks and whether `data: [DONE]` ended it."""
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), raw
    done = events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1] if done] or [json.loads(e[6:])
                                                                for e in events], done


def current_version(url) -> str:
    return run(get(url, "/get_weight_version"))[1]["weight_version"]


# -- streaming ------------------------------------------------------------------------------------


def test_stream_sends_cumulative_chunks_then_done(engine):
    body = {"input_ids": [3, 1, 4], "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
    _, whole = run(gen(engine, body))
    chunks, done = run(sse(engine, {**body, "stream": True}))
    assert done and len(chunks) >= 2
    for a, b in itertools.pairwise(chunks):  # output_ids are cumulative (SGLang's default)
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
        assert a["meta_info"]["finish_reason"] is None
        assert len(a["meta_info"]["output_token_logprobs"]) == len(a["output_ids"])
    last = chunks[-1]
    assert last["output_ids"] == whole["output_ids"] and "text" in last
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"][
        "output_token_logprobs"]

    chunks, done = run(sse(engine, {"input_ids": [[1], [2, 3]], "stream": True,
                                    "sampling_params": {"max_new_tokens": 3}}))
    assert done and {c["index"] for c in chunks} == {0, 1}
    finals = [c for c in chunks if c["meta_info"]["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == [0, 1]


def test_stream_client_disconnect_frees_the_slot(engine):
    async def go():
        async with aiohttp.ClientSession() as s:
            r = await s.post(engine + "/generate", json={
                "input_ids": [2], "rid": "streamer", "stream": True,
                "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}})
            await r.content.readuntil(b"\n\n")  # one chunk, then hang up
            r.close()
        return await wait_for(engine, lambda info: "streamer" not in info["running"], 20)

    info = run(go())
    assert info["failure"] is None and info["finish_abort"] >= 1


# -- text, stop strings, fields -------------------------------------------------------------------


def test_text_input_stop_strings_and_text_replies(engine):
    tok = char_tokenizer()
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    status, whole = run(gen(engine, {"text": "hello", "sampling_params": params}))
    assert status == 200
    assert whole["text"] == tok.decode(whole["output_ids"])
    text = whole["text"]
    stop = next(text[i:i + 2] for i in range(len(text) - 1) if text[i:i + 2].strip())
    _, cut = run(gen(engine, {"text": "hello", "sampling_params": {**params, "stop": stop}}))
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[:text.find(stop)]  # SGLang trims the matched stop
    assert cut["output_ids"] == whole["output_ids"][:len(cut["output_ids"])]
    assert tok.decode(cut["output_ids"]).endswith(stop)
    _, kept = run(gen(engine, {"text": "hello", "sampling_params": {
        **params, "stop": [stop], "no_stop_trim": True}}))
    assert kept["text"] == text[:text.find(stop) + len(stop)]
    _, batch = run(gen(engine, {"text": ["ab", "hello"], "sampling_params": params}))
    assert [r["text"] for r in batch][1] == text and len(batch) == 2
    _, ids = run(gen(engine, {"input_ids": tok.encode("hello").ids, "sampling_params": params,
                              "return_prompt_token_ids": True}))
    assert ids["text"] == text and ids["prompt_token_ids"] == tok.encode("hello").ids


@pytest.mark.parametrize("extra, field", [
    ({"top_logprobs_num": 2}, "top_logprobs_num"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"return_routed_experts": True}, "return_routed_experts"),
    ({"return_logprobs": True}, "return_logprobs"),  # a typo of return_logprob
    ({"image_data": "x.png"}, "image_data"),
    ({"lora_path": "adapter"}, "lora_path"),
    ({"logprob_start_len": 9}, "logprob_start_len"),
    ({"sampling_params": {"min_p": 0.1}}, "sampling_params.min_p"),
    ({"sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"sampling_params": {"n": 2}, "return_logprob": [True]}, "return_logprob"),
    ({"token_ids_logprob": [1, 64]}, "token_ids_logprob"),
    ({"text": "a"}, "text"),  # both text and input_ids
])
def test_fields_the_engine_cannot_honour_are_a_named_400(engine, extra, field):
    status, reply = run(gen(engine, {"input_ids": [1, 2], **extra}))
    assert status == 400 and reply["error"]["param"] == field, reply
    assert reply["error"]["message"].startswith(field)


def test_fields_sglang_accepts_are_accepted(engine):
    status, reply = run(gen(engine, {
        "input_ids": [1, 2], "return_hidden_states": False, "log_metrics": True,
        "token_ids_logprob": [1, 2],  # read only with return_logprob, as SGLang
        "priority": 3, "custom_labels": {"a": "b"}, "routed_dp_rank": 0,
        "sampling_params": {"max_new_tokens": 2, "custom_params": {"k": 1}, "top_p": 0.9,
                            "stop_token_ids": None, "min_p": 0, "skip_special_tokens": True}}))
    assert status == 200 and len(reply["output_ids"]) == 2
    assert "output_token_ids_logprobs" not in reply["meta_info"]


def test_parse_generate_normalises_as_sglang():
    limits = Limits(vocab_size=64, max_seq_len=32)
    specs, many = parse_generate({"input_ids": [[1], [2, 3]], "rid": ["a", "b"],
                                  "sampling_params": [{"top_k": 2 ** 40}, {"top_k": 5}],
                                  "return_logprob": [True, False]}, limits)
    assert many and [s.rid for s in specs] == ["a", "b"]
    assert [s.top_k for s in specs] == [0, 5]  # past the vocabulary: no limit
    assert [s.return_logprob for s in specs] == [True, False]
    assert [s.max_new_tokens for s in specs] == [31, 30]  # 128, clamped to the context
    (one,), many = parse_generate({"input_ids": [1] * 30, "sampling_params": {
        "max_new_tokens": 100, "temperature": 1e-7}}, limits)
    assert not many and one.max_new_tokens == 2 and one.temperature == 0.0
    specs, _ = parse_generate({"input_ids": [1], "rid": "r", "sampling_params": {"n": 2}}, limits)
    assert len(specs) == 2 and "r" not in {s.rid for s in specs}  # fresh ids, as SGLang
    for body, field in (({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
                        ({"input_ids": [[1], [2]], "rid": ["x", "x"]}, "rid"),
                        ({"input_ids": [1], "return_logprob": [True]}, "return_logprob")):
        with pytest.raises(BadRequest) as e:
            parse_generate(body, limits)
        assert e.value.field == field


# -- log-probs ------------------------------------------------------------------------------------


def test_prompt_and_given_id_logprobs_equal_teacher_forced(engine, model):
    prompt = np.random.default_rng(7).integers(0, 64, 10).tolist()
    ids = [5, 9, 63]
    status, reply = run(gen(engine, {
        "input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
        "token_ids_logprob": ids, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}))
    assert status == 200
    meta, out = reply["meta_info"], reply["output_ids"]
    tf_prompt = teacher_forced(model, prompt[:1], prompt[1:])  # rows predicting prompt[1:]
    want = tf_prompt[np.arange(9), prompt[1:]]
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt and entries[0][0] is None  # as SGLang
    np.testing.assert_allclose([e[0] for e in entries[1:]], want, atol=1e-5, rtol=0)
    rows = meta["input_token_ids_logprobs"]
    assert rows[0] is None and len(rows) == 10
    np.testing.assert_allclose([[e[0] for e in r] for r in rows[1:]], tf_prompt[:, ids],
                               atol=1e-5, rtol=0)
    tf_out = teacher_forced(model, prompt, out)
    np.testing.assert_allclose([[e[0] for e in r] for r in meta["output_token_ids_logprobs"]],
                               tf_out[:, ids], atol=1e-5, rtol=0)
    assert [[e[1] for e in r] for r in meta["output_token_ids_logprobs"]] == [ids] * 5

    _, later = run(gen(engine, {"input_ids": prompt, "return_logprob": True,
                                "logprob_start_len": 3, "sampling_params": {"max_new_tokens": 0}}))
    entries = later["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt[3:] and entries[0][0] is None
    np.testing.assert_allclose([e[0] for e in entries[1:]], want[3:], atol=1e-5, rtol=0)
    assert later["output_ids"] == []
    _, default = run(gen(engine, {"input_ids": prompt, "return_logprob": True,
                                  "sampling_params": {"max_new_tokens": 1}}))
    assert default["meta_info"]["input_token_logprobs"] == []  # logprob_start_len -1


# -- n, rids, seeds, budgets ----------------------------------------------------------------------


def test_n_and_string_rids_expand_as_sglang(engine):
    _, samples = run(gen(engine, {"input_ids": [1, 2], "rid": "s",
                                  "sampling_params": {"n": 3, "max_new_tokens": 2}}))
    assert len(samples) == 3 and len({r["meta_info"]["id"] for r in samples}) == 3
    assert all(r["meta_info"]["prompt_tokens"] == 2 for r in samples)
    _, batch = run(gen(engine, {"input_ids": [[1], [2]], "rid": "grp",
                                "sampling_params": {"max_new_tokens": 1}}))
    assert [r["meta_info"]["id"] for r in batch] == ["grp_0", "grp_1"]
    _, both = run(gen(engine, {"input_ids": [[1], [2, 3]],
                               "sampling_params": {"n": 2, "max_new_tokens": 1}}))
    assert [r["meta_info"]["prompt_tokens"] for r in both] == [1, 1, 2, 2]


def test_sampling_seed_reproduces_whatever_shares_the_batch(engine):
    def body(seed, prompt=(4, 5, 6)):
        return {"input_ids": list(prompt), "sampling_params": {
            "sampling_seed": seed, "max_new_tokens": 12, "ignore_eos": True}}

    async def go():
        alone = await gen(engine, body(2 ** 63 - 1))
        crowd = await asyncio.gather(gen(engine, body(2 ** 63 - 1)),
                                     *(gen(engine, body(i, (i, 1))) for i in range(3)))
        other = await gen(engine, body(-(2 ** 63)))
        return alone, crowd[0], other

    (_, alone), (_, crowded), (_, other) = run(go())
    assert alone["output_ids"] == crowded["output_ids"]
    assert other["output_ids"] != alone["output_ids"]


def test_null_max_new_tokens_runs_to_the_context(engine):
    status, reply = run(gen(engine, {"input_ids": [1] * 56, "sampling_params": {
        "max_new_tokens": None, "ignore_eos": True}}))
    assert status == 200 and len(reply["output_ids"]) == MAX_SEQ_LEN - 56
    assert reply["meta_info"]["finish_reason"]["type"] == "length"
    status, huge = run(gen(engine, {"input_ids": [1] * 56, "sampling_params": {
        "max_new_tokens": 10 ** 30, "ignore_eos": True}}))
    assert status == 200 and len(huge["output_ids"]) == MAX_SEQ_LEN - 56


# -- routes ---------------------------------------------------------------------------------------


def test_routes_sglang_clients_call(engine, dirs):
    async def go():
        out = {p: await get(engine, p) for p in (
            "/server_info", "/get_server_info", "/model_info", "/get_model_info",
            "/get_weight_version", "/v1/models", "/v1/loads", "/ready")}
        out["missing"] = await get(engine, "/v1/models/nope")
        async with aiohttp.ClientSession() as s, s.get(engine + "/ready") as r:
            out["ready_body"] = await r.read()
        await post(engine, "/pause_generation", {"mode": "in_place"})
        out["paused_ready"] = await get(engine, "/ready")
        await post(engine, "/continue_generation")
        return out

    out = run(go())
    assert out["/server_info"][0] == 200 and out["/get_server_info"][1]["max_batch"] == MAX_BATCH
    assert out["/model_info"][1]["is_generation"] and out["/get_model_info"][0] == 200
    assert out["/model_info"][1]["tokenizer_path"] == dirs["v0"]
    models_ = out["/v1/models"][1]
    assert models_["object"] == "list" and models_["data"][0]["id"] == dirs["v0"]
    assert out["missing"][0] == 404 and out["missing"][1]["error"]["code"] == "model_not_found"
    load = out["/v1/loads"][1]["loads"][0]
    assert {"num_running_reqs", "num_waiting_reqs", "max_running_requests"} <= set(load)
    assert out["/ready"][0] == 200 and out["paused_ready"][0] == 503


def test_update_weight_version_sets_the_label(engine):
    status, reply = run(post(engine, "/update_weight_version", {"new_version": "label-7"}))
    assert (status, reply) == (200, {"success": True, "message": "Weight version updated to "
                                     "label-7", "new_version": "label-7"})
    _, out = run(gen(engine, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}))
    assert out["meta_info"]["weight_version"] == "label-7"
    status, reply = run(post(engine, "/update_weight_version", {}))
    assert status == 400 and reply["param"] == "new_version"


# -- weight updates and pauses --------------------------------------------------------------------


def long_request(url, rid, n=60):
    return asyncio.create_task(gen(url, {"input_ids": [3], "rid": rid, "sampling_params": {
        "max_new_tokens": n, "ignore_eos": True}}))


def test_update_waits_for_running_requests_by_default(engine, dirs):
    before = current_version(engine)

    async def go():
        first = long_request(engine, "before")
        await wait_for(engine, lambda info: info["running"].get("before", 0) >= 2)
        update = asyncio.create_task(post(engine, "/update_weights_from_disk", {
            "model_path": dirs["v1"], "weight_version": "v1"}))
        await wait_for(engine, lambda info: info["updating"])
        second = long_request(engine, "after", 3)  # held until the update is done
        (_, a), (_, b), (status, reply) = await asyncio.gather(first, second, update)
        _, again = await post(engine, "/update_weights_from_disk", {"model_path": dirs["v0"]})
        return a, b, status, reply, again

    a, b, status, reply, again = run(go())
    assert a["meta_info"]["finish_reason"]["type"] == "length" and len(a["output_ids"]) == 60
    assert a["meta_info"]["weight_version"] == before
    assert status == 200 and reply == {"success": True, "num_paused_requests": 0, "message":
                                       "Succeeded to update model weights. Weight version "
                                       "updated to v1."}
    assert b["meta_info"]["weight_version"] == "v1" and len(b["output_ids"]) == 3
    assert again["success"] and current_version(engine) == "v1"  # no weight_version: kept


def test_update_abort_all_requests_aborts_running_and_waiting(engine, dirs):
    async def go():
        tasks = [long_request(engine, f"x{i}") for i in range(MAX_BATCH + 1)]
        await wait_for(engine, lambda info: info["num_running"] == MAX_BATCH
                       and info["num_waiting"] == 1)
        _, reply = await post(engine, "/update_weights_from_disk", {
            "model_path": dirs["v0"], "weight_version": "v0b", "abort_all_requests": True})
        return reply, await asyncio.gather(*tasks)

    reply, results = run(go())
    assert reply["success"] and reply["num_paused_requests"] == MAX_BATCH + 1
    for _, r in results:
        assert r["meta_info"]["finish_reason"]["type"] == "abort"
        assert r["meta_info"]["weight_version"] != "v0b"


def test_a_failed_update_touches_no_request(engine, dirs):
    async def go():
        task = long_request(engine, "bystander", 50)
        await wait_for(engine, lambda info: info["running"].get("bystander", 0) >= 2)
        replies = [await post(engine, "/update_weights_from_disk", {
            "model_path": dirs[name], "abort_all_requests": True}) for name in ("nan", "shape")]
        return replies, await task, (await get(engine, "/server_info"))[1]

    (nan, shape), (_, done), info = run(go())
    assert nan[0] == 400 and not nan[1]["success"]
    assert "model.norm.weight" in nan[1]["message"] and "NaN" in nan[1]["message"]
    assert shape[0] == 400 and "model.layers.0.self_attn.q_proj.weight" in shape[1]["message"]
    assert done["meta_info"]["finish_reason"]["type"] == "length"
    assert len(done["output_ids"]) == 50 and info["failure"] is None


def test_pause_abort_aborts_running_and_waiting_in_place_keeps_them(engine):
    async def go():
        tasks = [long_request(engine, f"p{i}") for i in range(MAX_BATCH + 1)]
        await wait_for(engine, lambda info: info["num_running"] == MAX_BATCH
                       and info["num_waiting"] == 1)
        await post(engine, "/pause_generation", {"mode": "abort"})
        aborted = await asyncio.gather(*tasks)
        await post(engine, "/continue_generation")
        kept = long_request(engine, "kept", 30)
        await wait_for(engine, lambda info: info["running"].get("kept", 0) >= 2)
        await post(engine, "/pause_generation", {"mode": "retract"})
        await asyncio.sleep(0.3)
        still = not kept.done()
        await post(engine, "/continue_generation")
        return aborted, still, await kept

    aborted, still, (_, kept) = run(go())
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for _, r in aborted)
    assert still and len(kept["output_ids"]) == 30


# -- hostile input --------------------------------------------------------------------------------


def test_overflowing_numbers_are_refused_or_clamped_and_hurt_nobody(engine):
    bad = [  # raw bodies: Python's json reads 1e400 as inf and accepts NaN
        ('{"input_ids": [1], "sampling_params": {"temperature": 1e400}}',
         "sampling_params.temperature"),
        ('{"input_ids": [1], "sampling_params": {"temperature": NaN}}',
         "sampling_params.temperature"),
        ('{"input_ids": [1], "sampling_params": {"top_p": Infinity}}', "sampling_params.top_p"),
        (json.dumps({"input_ids": [1], "sampling_params": {"sampling_seed": 2 ** 64}}),
         "sampling_params.sampling_seed"),
        (json.dumps({"input_ids": [2 ** 40]}), "input_ids"),
        (json.dumps({"input_ids": [1], "logprob_start_len": 10 ** 20}), "logprob_start_len"),
        (json.dumps({"input_ids": [1], "sampling_params": {"stream_interval": 0}}),
         "sampling_params.stream_interval"),
        (json.dumps({"input_ids": [1], "token_ids_logprob": [-1]}), "token_ids_logprob"),
    ]

    async def go():
        victims = [long_request(engine, f"v{i}", 50) for i in range(2)]
        await wait_for(engine, lambda info: len(info["running"]) == 2)
        clamped = [await gen(engine, {"input_ids": [1], "sampling_params": {
            "top_k": k, "max_new_tokens": 4, "ignore_eos": True}}) for k in (2 ** 31, 2 ** 70)]
        refused = [await post(engine, "/generate", raw=raw) for raw, _ in bad]
        return clamped, refused, await asyncio.gather(*victims), (await get(
            engine, "/server_info"))[1]

    clamped, refused, victims, info = run(go())
    assert all(s == 200 and len(r["output_ids"]) == 4 for s, r in clamped)
    for (status, reply), (_, field) in zip(refused, bad, strict=True):
        assert status == 400 and reply["error"]["param"] == field, reply
    for _, r in victims:
        assert r["meta_info"]["finish_reason"]["type"] == "length" and len(r["output_ids"]) == 50
    assert info["failure"] is None


@pytest.mark.parametrize("raw", ["[" * 100_000, '{"input_ids": [' + "9" * 5000 + "]}",
                                 b'{"input_ids": [1], "rid": "\xff"}'])
def test_hostile_json_is_a_400(engine, raw):
    status, reply = run(post(engine, "/generate", raw=raw))
    assert status == 400 and reply["error"]["param"] == "body", reply


def _closed_within(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server closes `sock` within `timeout_s` (whatever it sends first)."""
    sock.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not sock.recv(4096):
                return True
    except (TimeoutError, ConnectionResetError):
        return False
    return False


@pytest.mark.parametrize("sent", [
    b"POST /generate HTTP/1.1\r\nHost: x\r\n",  # half a request head
    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"input_ids\"",  # body
    b"",  # connected, then nothing
])
def test_stalled_clients_are_dropped(engine, sent):
    port = int(engine.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(sent)
        assert _closed_within(sock, 10.0), "the engine kept a stalled connection open"
    status, _ = run(gen(engine, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}))
    assert status == 200
