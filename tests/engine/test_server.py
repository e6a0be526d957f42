"""The embedded engine over real sockets: log-probs, batching, stops, abort, pause, errors, exit.

SGLang protocol details (streams, text, prompt log-probs, updates, routes) and hostile input are
in test_server_sglang.py.

One engine subprocess (toy model written by save_hf) serves the whole module, so it compiles once.
"""

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import aiohttp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import hf as hf_io
from sao_jax.models import save_hf
from sao_jax.models.sampling import SamplingParams, filter_logits, filter_logits_rows
from sao_jax.train.processes import free_port
from tests.engine.engines import (
    MAX_BATCH,
    engine_command,
    engine_env,
    get,
    post,
    run,
    start_engine,
    stop_engine,
    teacher_forced,
    toy_model,
    wait_for,
    wait_ready,
)


def prompt_ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 64, size=n).tolist()


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine_model")
    save_hf(toy_model(0), str(path))
    return path


@pytest.fixture(scope="module")
def engine_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("engine_cache")


@pytest.fixture(scope="module")
def engine(model_dir, engine_cache):
    proc, url = start_engine(model_dir, "--compilation-cache-dir", str(engine_cache),
                             "--enable-return-routed-experts")
    yield url
    stop_engine(proc)


def test_the_warm_up_compiles_go_to_the_compilation_cache(engine, engine_cache):
    """`--compilation-cache-dir` (the learner passes its own): a restarted engine reads its
    decode and prefill programs back instead of compiling them (8.2 -> 2.8 s to ready here)."""
    assert len(os.listdir(engine_cache)) >= 2, os.listdir(engine_cache)


def test_the_learners_warm_up_compiles_every_prefill_bucket(model_dir):
    """`--warmup-prefills` (the learner's engines): every prefill bucket of the hot path is
    compiled before the engine answers, so that no request of a run waits for a compile; by
    default only the smallest is, larger ones on first use."""
    from sao_jax.engine.scheduler import Engine

    hot = {(b, 0, False) for b in (16, 32, 40)}
    for prefills, compiled in ((False, {(16, 0, False)}), (True, hot)):
        engine = Engine(str(model_dir), max_batch=2, max_seq_len=40)
        try:
            assert engine.runner.buckets == [16, 32, 40]
            engine.warmup(prefills=prefills)
            assert {w[1:] for w in engine.runner.compiled if w[0] == "prefill"} == compiled
        finally:
            engine.close()


@pytest.fixture(scope="module")
def model():
    return toy_model(0)


# -- sampling -------------------------------------------------------------------------------------


def test_each_row_is_filtered_by_its_own_parameters():
    """The engine's batch mixes requests: row b of one call equals row b filtered alone with
    its own `SamplingParams` (the one filter, `sampling.filter_logits_rows`)."""
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8, top_k=6),
              SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=0.5, top_p=0.3),
              SamplingParams(temperature=1.0, top_k=37)]
    logits = jax.random.normal(jax.random.key(0), (len(params), 37)) * 3
    got = filter_logits_rows(logits, jnp.array([p.temperature for p in params]),
                             jnp.array([p.top_p for p in params]),
                             jnp.array([p.top_k for p in params], jnp.int32))
    for b, p in enumerate(params):
        np.testing.assert_array_equal(got[b], filter_logits(logits[b:b + 1], p)[0])


# -- the engine -----------------------------------------------------------------------------------


def test_logprobs_equal_teacher_forced(engine, model):
    params = [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 10},
              {"temperature": 0.0}, {"temperature": 1.3, "top_k": 5}, {"temperature": 1.0},
              {"temperature": 0.8, "top_p": 0.95}]
    prompts = [prompt_ids(i, n) for i, n in enumerate([3, 9, 1, 17, 30, 5])]

    def request(i):
        return post(engine, "/generate", {"input_ids": prompts[i], "return_logprob": True,
                                          "sampling_params": {**params[i], "max_new_tokens": 24}})

    async def go():
        alone = await request(0)  # decodes a 1-slot bucket of the 8-slot cache
        return [alone, *await asyncio.gather(*map(request, range(1, len(prompts))))]

    for prompt, sp, (status, reply) in zip(prompts, params, run(go()), strict=True):
        assert status == 200, reply
        tokens = reply["output_ids"]
        meta = reply["meta_info"]
        assert len(tokens) == 24 and meta["finish_reason"] == {"type": "length", "length": 24}
        assert meta["completion_tokens"] == 24 and meta["prompt_tokens"] == len(prompt)
        assert meta["weight_version"] == "0"
        triples = meta["output_token_logprobs"]
        assert [t[1] for t in triples] == tokens and all(t[2] is None for t in triples)
        logp = teacher_forced(model, prompt, tokens)
        want = logp[np.arange(len(tokens)), tokens]
        np.testing.assert_allclose([t[0] for t in triples], want, atol=1e-5, rtol=0)
        if sp["temperature"] == 0.0:
            np.testing.assert_array_equal(tokens, logp.argmax(-1))


def test_routed_experts_are_the_experts_each_token_went_to(engine, model):
    """`return_routed_experts` (SGLang's field, on an engine started with
    `--enable-return-routed-experts`): meta_info's `routed_experts` is base64 of int32
    `[tokens, layers, top-k]` for positions [routed_experts_start_len, seqlen - 1), the experts
    a teacher-forced pass of the same weights routes those tokens to (-1 at the dense layer 0),
    the prefix a next turn takes from the cache included. Without the flag it is refused."""
    from sao_jax.engine.sglang_api import BadRequest, Limits, parse_generate, parse_generate_reply
    from sao_jax.models import expert_routes

    def body(prompt, **extra):
        return {"input_ids": prompt, "return_routed_experts": True, **extra,
                "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}

    async def go():
        _, first = await post(engine, "/generate", body(prompt_ids(40, 12)))
        turn2 = prompt_ids(40, 12) + first["output_ids"] + [3, 4]
        _, second = await post(engine, "/generate", body(turn2, routed_experts_start_len=5))
        _, plain = await post(engine, "/generate", {"input_ids": [1, 2, 3]})
        return first, turn2, second, plain

    first, turn2, second, plain = run(go())
    assert second["meta_info"]["cached_tokens"] == 12 + 6 - 1  # its prefix: turn 1's slot
    assert "routed_experts" not in plain["meta_info"]
    cfg = model.cfg
    for prompt, reply, start in ((prompt_ids(40, 12), first, 0), (turn2, second, 5)):
        run_tokens = np.asarray([*prompt, *reply["output_ids"]][:-1], np.int32)
        got = parse_generate_reply(reply).routed_experts.reshape(-1, cfg.num_layers,
                                                                 cfg.num_experts_per_tok)
        out = model.backbone(jnp.asarray(run_tokens[None]))
        want = np.asarray(expert_routes(cfg, out.router_logits, 1, len(run_tokens)))[0]
        assert (want[:, 0] == -1).all() and (want[:, 1] >= 0).all()
        np.testing.assert_array_equal(got, want[start:])
    plain = Limits(vocab_size=64, max_seq_len=40)  # an engine started without the flag
    with pytest.raises(BadRequest, match="--enable-return-routed-experts") as refused:
        parse_generate({"input_ids": [1, 2], "return_routed_experts": True}, plain)
    assert refused.value.field == "return_routed_experts"


def test_concurrent_requests_share_decode_batches(engine):
    async def go():
        await post(engine, "/pause_generation", {"mode": "in_place"})
        tasks = [asyncio.create_task(post(engine, "/generate", {
            "input_ids": prompt_ids(i, 4 + i), "sampling_params": {"max_new_tokens": 12}}))
            for i in range(MAX_BATCH)]
        await wait_for(engine, lambda info: info["num_waiting"] == MAX_BATCH)
        before = (await get(engine, "/get_server_info"))[1]
        await post(engine, "/continue_generation")
        replies = await asyncio.gather(*tasks)
        after = (await get(engine, "/get_server_info"))[1]
        return replies, before, after

    replies, info_before, info_after = run(go())
    before, after = info_before["decode_batch_sizes"], info_after["decode_batch_sizes"]
    key = str(MAX_BATCH)
    assert after.get(key, 0) >= before.get(key, 0) + 11  # 11 decode steps after the prefills
    # The counters engine_stats logs, with the seconds the compute calls took.
    assert info_after["prefills"] - info_before.get("prefills", 0) == MAX_BATCH
    assert info_after["decode_steps"] - info_before.get("decode_steps", 0) >= 11
    for seconds in ("prefill_s", "decode_s"):
        assert info_after[seconds] > info_before.get(seconds, 0.0)
    for status, reply in replies:
        assert status == 200 and len(reply["output_ids"]) == 12
        assert reply["meta_info"]["decode_batch_size_max"] == MAX_BATCH


def test_a_next_turn_reuses_its_previous_turns_keys_and_values(engine, model, model_dir):
    """The prefix cache: a request whose prompt extends the previous request's prompt and
    output (a multi-turn episode's next turn) is prefilled from where that slot's keys and
    values end (SGLang's `cached_tokens`), with the log-probs of a whole prefill; after a
    weight load, after `/flush_cache`, and for a request that wants its prompt's log-probs,
    nothing is reused."""
    def body(prompt, **extra):
        return {"input_ids": prompt, "return_logprob": True, **extra, "sampling_params": {
            "max_new_tokens": 8, "ignore_eos": True}}

    async def go():
        info = (await get(engine, "/get_server_info"))[1]
        # The first turn in slot 0, a long request beside it in slot 1 (admitted in order).
        await post(engine, "/pause_generation", {"mode": "in_place"})
        first = asyncio.create_task(post(engine, "/generate", body(prompt_ids(30, 20))))
        await wait_for(engine, lambda i: i["num_waiting"] == 1)
        other = asyncio.create_task(post(engine, "/generate", {
            "input_ids": [9, 9], "rid": "beside", "sampling_params": {"max_new_tokens": 300,
                                                                      "ignore_eos": True}}))
        await wait_for(engine, lambda i: i["num_waiting"] == 2)
        await post(engine, "/continue_generation")
        _, first = await first
        # Decode steps over the slot the first turn left (a free row inside their batch).
        done = (await get(engine, "/get_server_info"))[1]["running"]["beside"]
        await wait_for(engine, lambda i: i["running"].get("beside", 0) >= done + 3)
        turn2 = prompt_ids(30, 20) + first["output_ids"] + [5, 6, 7]
        _, second = await post(engine, "/generate", body(turn2))
        after = (await get(engine, "/get_server_info"))[1]
        turn3 = turn2 + second["output_ids"] + [8]
        _, whole = await post(engine, "/generate", body(turn3, logprob_start_len=0))
        status, _ = await post(engine, "/update_weights_from_disk",
                               {"model_path": str(model_dir)})  # the same weights, reloaded
        assert status == 200
        _, reloaded = await post(engine, "/generate", body(turn3))
        turn4 = turn3 + reloaded["output_ids"]
        _, cached = await post(engine, "/generate", body(turn4))
        async with aiohttp.ClientSession() as s, s.post(engine + "/flush_cache") as r:
            assert r.status == 200  # a text reply, as SGLang's
        _, flushed = await post(engine, "/generate", body(turn4))
        await post(engine, "/abort_request", {"rid": "beside"})
        await other
        return info, first, turn2, second, after, turn3, whole, reloaded, cached, flushed

    info, first, turn2, second, after, turn3, whole, reloaded, cached, flushed = run(go())
    assert cached["meta_info"]["cached_tokens"] == len(turn3) + 8 - 1
    assert flushed["meta_info"]["cached_tokens"] == 0
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == 20 + 8 - 1  # the last output token: not fed
    assert after["cached_tokens"] - info.get("cached_tokens", 0) == 27
    assert after["prefill_tokens"] - info.get("prefill_tokens", 0) == 2 + 20 + len(turn2) - 27
    assert whole["meta_info"]["cached_tokens"] == 0  # its prompt's log-probs: prefilled whole
    assert reloaded["meta_info"]["cached_tokens"] == 0  # the held keys were the old weights'
    for prompt, reply in ((turn2, second), (turn3, whole), (turn3, reloaded)):
        out = reply["output_ids"]
        logp = teacher_forced(model, prompt, out, length=128)
        np.testing.assert_allclose([t[0] for t in reply["meta_info"]["output_token_logprobs"]],
                                   logp[np.arange(len(out)), out], atol=1e-5, rtol=0)


def test_a_draining_update_lets_running_requests_finish_then_cuts_the_rest(engine, model_dir):
    """`drain_timeout_s` (ours, not SGLang's): an aborting load first gives running requests
    that long to finish under the old weights, holding new ones for the new weights, then cuts
    those still running. The drain is sized from the measured decode speed: a request with 5
    tokens to go finishes inside it, one with about 450 does not (9.5x margins each way, the
    drain at their geometric mean, for a machine whose speed changes between the measurement
    and the drain: with 4x margins a test run beside others once saw the long one finish)."""
    async def go():
        long = asyncio.create_task(post(engine, "/generate", {
            "input_ids": [3, 4], "rid": "drain-long", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}))
        await wait_for(engine, lambda info: info["running"].get("drain-long", 0) >= 5)
        start = time.monotonic()
        await wait_for(engine, lambda info: info["running"].get("drain-long", 0) >= 45)
        per_token = (time.monotonic() - start) / 40
        short = asyncio.create_task(post(engine, "/generate", {
            "input_ids": [5, 6], "rid": "drain-short", "sampling_params": {
                "max_new_tokens": 5, "ignore_eos": True}}))
        await wait_for(engine, lambda info: "drain-short" in info["running"])
        update = asyncio.create_task(post(engine, "/update_weights_from_disk", {
            "model_path": str(model_dir), "weight_version": "drained",
            "abort_all_requests": True, "drain_timeout_s": round(47 * per_token, 3)}))
        await wait_for(engine, lambda info: info["updating"], timeout_s=10)
        late = await post(engine, "/generate", {"input_ids": [1, 2], "sampling_params": {
            "max_new_tokens": 2}})  # held: it starts under the new weights
        replies = await short, await long, await update, late
        await post(engine, "/update_weights_from_disk", {  # the module's engine: version 0
            "model_path": str(model_dir), "weight_version": "0"})
        return replies

    (_, short), (_, long), (status, update), (_, late) = run(go())
    assert status == 200 and update["num_paused_requests"] == 1, update
    assert short["meta_info"]["finish_reason"]["type"] == "length"
    assert len(short["output_ids"]) == 5 and short["meta_info"]["weight_version"] == "0"
    assert long["meta_info"]["finish_reason"]["type"] == "abort"
    assert 45 < len(long["output_ids"]) < 500 and long["meta_info"]["weight_version"] == "0"
    assert late["meta_info"]["finish_reason"]["type"] == "length"
    assert late["meta_info"]["weight_version"] == "drained"


def test_request_joins_a_running_batch_and_leaves_early(engine):
    async def go():
        long = asyncio.create_task(post(engine, "/generate", {
            "input_ids": [1, 2, 3], "rid": "long", "sampling_params": {"max_new_tokens": 300}}))
        await wait_for(engine, lambda info: info["running"].get("long", 0) >= 2)
        short = await post(engine, "/generate", {"input_ids": [4, 5],
                                                 "sampling_params": {"max_new_tokens": 5}})
        running = (await get(engine, "/get_server_info"))[1]["running"]
        return short, running, await long

    (_, short), running, (_, long) = run(go())
    assert short["meta_info"]["decode_batch_size_max"] == 2
    assert "long" in running  # the short one finished while the long one ran on
    assert long["meta_info"]["decode_batch_size_max"] == 2 and len(long["output_ids"]) == 300


def test_stop_tokens_length_and_batch_input(engine):
    async def go():
        base = {"input_ids": [7, 8, 9], "sampling_params": {"temperature": 0,
                                                              "max_new_tokens": 10}}
        _, greedy = await post(engine, "/generate", base)
        stop = greedy["output_ids"][3]
        _, stopped = await post(engine, "/generate", {
            **base, "sampling_params": {**base["sampling_params"], "stop_token_ids": [stop]}})
        _, empty = await post(engine, "/generate", {"input_ids": [1],
                                                    "sampling_params": {"max_new_tokens": 0}})
        _, batch = await post(engine, "/generate", {
            "input_ids": [[7, 8, 9], [1, 2]], "rid": ["b0", "b1"], "return_logprob": True,
            "sampling_params": [{"temperature": 0, "max_new_tokens": 10},
                                {"max_new_tokens": 3}]})
        return greedy, stopped, empty, batch

    greedy, stopped, empty, batch = run(go())
    tokens = greedy["output_ids"]
    assert greedy["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert "output_token_logprobs" not in greedy["meta_info"]  # return_logprob defaults false
    first = tokens.index(tokens[3])
    assert stopped["output_ids"] == tokens[:first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": tokens[3]}
    assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"]["type"] == "length"
    assert [r["meta_info"]["id"] for r in batch] == ["b0", "b1"]
    assert batch[0]["output_ids"] == tokens and len(batch[1]["output_ids"]) == 3


def test_abort_by_rid_returns_partial_tokens(engine):
    async def go():
        task = asyncio.create_task(post(engine, "/generate", {
            "input_ids": [3, 4], "rid": "victim", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 400}}))
        await wait_for(engine, lambda info: info["running"].get("victim", 0) >= 3)
        duplicate = await post(engine, "/generate", {"input_ids": [1], "rid": "victim"})
        assert duplicate[0] == 400 and duplicate[1]["error"]["param"] == "rid"
        aborted = await post(engine, "/abort_request", {"rid": "victim"})
        unknown = await post(engine, "/abort_request", {"rid": "nobody"})
        everything = await post(engine, "/abort_request", {"abort_all": True})
        return await task, aborted, unknown, everything

    (status, reply), aborted, unknown, everything = run(go())
    assert aborted == unknown == everything == (200, None)  # SGLang: 200, an empty body
    assert status == 200
    meta = reply["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 3 <= len(reply["output_ids"]) < 400
    assert len(meta["output_token_logprobs"]) == len(reply["output_ids"])


def test_pause_abort_mode_then_queue_until_continue(engine):
    """SGLang's abort mode returns what runs; requests sent while paused wait for continue, and
    /health_generate is 503 meanwhile (SGLang's after its timeout, here at once)."""
    async def go():
        running = asyncio.create_task(post(engine, "/generate", {
            "input_ids": [5], "rid": "paused", "sampling_params": {"max_new_tokens": 400}}))
        await wait_for(engine, lambda info: info["running"].get("paused", 0) >= 2)
        _, pause = await post(engine, "/pause_generation", {})  # SGLang's default mode: abort
        _, partial = await running
        waiting = asyncio.create_task(post(engine, "/generate", {
            "input_ids": [6], "sampling_params": {"max_new_tokens": 4}}))
        info = await wait_for(engine, lambda info: info["num_waiting"] == 1)
        await asyncio.sleep(0.2)
        assert not waiting.done()
        health = await get(engine, "/health_generate")
        await post(engine, "/continue_generation")
        return pause, partial, info, health, await waiting

    pause, partial, info, health, (status, done) = run(go())
    assert pause == {"message": "Generation paused successfully.", "status": "ok"}
    assert info["paused"] and info["num_held"] == 1
    assert partial["meta_info"]["finish_reason"]["type"] == "abort"
    assert 2 <= len(partial["output_ids"]) < 400
    assert health == (503, None)
    assert status == 200 and len(done["output_ids"]) == 4


def test_client_disconnect_frees_the_slot(engine):
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as s:
            task = asyncio.create_task(s.post(engine + "/generate", json={
                "input_ids": [2], "rid": "gone", "sampling_params": {"max_new_tokens": 500}}))
            await wait_for(engine, lambda info: info["running"].get("gone", 0) >= 2)
            await post(engine, "/pause_generation", {"mode": "in_place"})  # hold it in its slot
            with pytest.raises(asyncio.TimeoutError):
                await task
        info = await wait_for(engine, lambda info: "gone" not in info["running"], 10)
        await post(engine, "/continue_generation")
        return info

    info = run(go())
    assert info["num_running"] == 0 and info["paused"]
    status, _ = run(post(engine, "/generate", {"input_ids": [1], "rid": "gone",
                                               "sampling_params": {"max_new_tokens": 1}}))
    assert status == 200  # the id is free again


def test_health_version_and_info(engine):
    async def go():
        return (await get(engine, "/health_generate"), await get(engine, "/health"),
                await get(engine, "/get_weight_version"), await get(engine, "/get_model_info"))

    health, live, version, info = run(go())
    assert health == live == (200, None)  # SGLang: an empty body
    assert version == (200, {"weight_version": "0"})
    assert info[1]["is_generation"] and info[1]["weight_version"] == "0"


@pytest.mark.parametrize("path, body, field", [
    ("/generate", "{not json", "body"),
    ("/generate", {}, "input_ids"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"input_ids": [1, 64]}, "input_ids"),
    ("/generate", {"input_ids": [1, "a"]}, "input_ids"),
    ("/generate", {"input_ids": list(range(8)) * 64}, "input_ids"),
    ("/generate", {"text": "hello"}, "text"),
    ("/generate", {"input_ids": [1], "stream": 1}, "stream"),
    ("/generate", {"input_ids": [1], "return_logprobs": True}, "return_logprobs"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": -1}},
     "sampling_params.temperature"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1.5}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}},
     "sampling_params.frequency_penalty"),
    ("/generate", {"input_ids": [1], "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ("/generate", {"input_ids": [[1], [2]], "rid": ["a"]}, "rid"),
    ("/generate", {"input_ids": [1], "return_routed_experts": 1}, "return_routed_experts"),
    ("/generate", {"input_ids": [1, 2], "return_routed_experts": True,
                   "routed_experts_start_len": 3}, "routed_experts_start_len"),
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/x", "abort_all_requests": "yes"},
     "abort_all_requests"),
    ("/update_weights_from_disk", {"model_path": "/x", "drain_timeout_s": "soon"},
     "drain_timeout_s"),
    ("/update_weights_from_disk", {"model_path": "/x", "drain_timeout_s": -1}, "drain_timeout_s"),
    ("/update_weights_from_disk", {"model_path": "/x", "drain_timeout_s": 1e308},
     "drain_timeout_s"),
    ("/update_weights_from_disk", {"model_path": "/x", "drain_timeout_s": True},
     "drain_timeout_s"),
    ("/abort_request", {}, "rid"),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
])
def test_bad_requests_get_400_naming_the_field(engine, path, body, field):
    raw = body if isinstance(body, str) else None
    status, reply = run(post(engine, path, body if raw is None else None, raw=raw))
    assert status == 400
    if path == "/generate":  # SGLang's /generate error body; the other routes' ErrorResponse
        reply = reply["error"]
    else:
        assert reply["object"] == "error" and reply["code"] == 400
    assert reply["param"] == field and reply["message"].startswith(field), reply


def test_failed_weight_update_keeps_serving(engine, tmp_path):
    status, reply = run(post(engine, "/update_weights_from_disk",
                             {"model_path": str(tmp_path / "missing"), "weight_version": "9"}))
    assert status == 400 and reply["success"] is False and "missing" in reply["message"]
    status, reply = run(post(engine, "/generate", {"input_ids": [1],
                                                   "sampling_params": {"max_new_tokens": 2}}))
    assert status == 200 and reply["meta_info"]["weight_version"] == "0"


def unfinished_copy(model_dir, path):
    """`model_dir` as save_hf leaves it while still writing: PENDING_MARKER, no COMPLETE_MARKER."""
    shutil.copytree(model_dir, path)
    os.remove(os.path.join(path, hf_io.COMPLETE_MARKER))
    with open(os.path.join(path, hf_io.PENDING_MARKER), "w"):
        pass
    return str(path)


def test_an_unfinished_weight_directory_is_refused(engine, model_dir, tmp_path):
    path = unfinished_copy(model_dir, tmp_path / "v9")
    status, reply = run(post(engine, "/update_weights_from_disk",
                             {"model_path": path, "weight_version": "9"}))
    assert status == 400 and reply["success"] is False
    assert "incomplete" in reply["message"] and hf_io.COMPLETE_MARKER in reply["message"]
    status, reply = run(post(engine, "/generate", {"input_ids": [1],
                                                   "sampling_params": {"max_new_tokens": 2}}))
    assert status == 200 and reply["meta_info"]["weight_version"] == "0"


def test_an_engine_does_not_start_from_an_unfinished_directory(model_dir, tmp_path):
    from sao_jax.engine.scheduler import Engine

    with pytest.raises(ValueError, match=f"incomplete.*{hf_io.COMPLETE_MARKER}"):
        Engine(unfinished_copy(model_dir, tmp_path / "v0"))


PARENT = textwrap.dedent("""
    import subprocess, sys, time
    engine = subprocess.Popen(sys.argv[1:])
    print(engine.pid, flush=True)
    time.sleep(600)
""")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # zombie: exited
    except FileNotFoundError:
        return True


def test_engine_exits_when_its_parent_is_killed(model_dir):
    port = free_port()
    command = engine_command(model_dir, port, "--max-batch", "1")  # one decode bucket to compile
    parent = subprocess.Popen([sys.executable, "-c", PARENT, *command],
                              stdout=subprocess.PIPE, text=True, env=engine_env())
    pid = int(parent.stdout.readline())
    try:
        wait_ready(f"http://127.0.0.1:{port}")
        assert not _gone(pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 15
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid), "the engine outlived its parent"
    finally:
        parent.kill()
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
