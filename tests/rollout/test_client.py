"""SGLangClient: SGLang-format parsing, resubmission, retries, routing; and a weight update
mid-generation against the embedded engine."""

import asyncio
import copy

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from sao_jax.engine.sglang_api import parse_generate_reply
from sao_jax.models import save_hf
from sao_jax.rollout.client import (
    EngineError,
    EngineUnavailableError,
    SGLangClient,
    VersionMap,
    WeightUpdateError,
)
from sao_jax.train.processes import free_port
from tests.engine.engines import (
    post,
    start_engine,
    stop_engine,
    teacher_forced,
    toy_model,
    wait_for,
)

TF_LEN = 256

# Replies as SGLang writes them (python/sglang/srt/managers: FINISH_* .to_json(), meta_info of
# tokenizer_manager with return_logprob and --skip-tokenizer-init).
ABORT_PARTIAL = {
    "output_ids": [5, 6, 7],
    "meta_info": {
        "id": "r", "finish_reason": {"type": "abort", "message": "Abort in waiting queue",
                                     "status_code": None, "err_type": None},
        "prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 0, "e2e_latency": 0.1,
        "weight_version": "1",
        "output_token_logprobs": [[-0.5, 5, None], [None, 6, None], [-0.25, 7, None]]}}
STOP = {
    "output_ids": [8, 2],
    "meta_info": {
        "id": "r", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 6,
        "completion_tokens": 2, "cached_tokens": 0, "weight_version": "2",
        "output_token_logprobs": [[-1.0, 8, None], [-0.125, 2, None]]}}
LENGTH = {
    "output_ids": [9, 9, 9, 9],
    "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": 4}, "prompt_tokens": 3,
        "completion_tokens": 4, "weight_version": "1",
        "output_token_logprobs": [[-1.5, 9, None], [-1.5, 9, None], [None, 9, None],
                                  [-1.5, 9, None]]}}
ERROR_ABORT = {
    "output_ids": [],
    "meta_info": {
        "id": "r", "finish_reason": {"type": "abort", "message": "input too long",
                                     "status_code": 400, "err_type": "BadRequestError"},
        "prompt_tokens": 3, "completion_tokens": 0, "weight_version": "1"}}


class FakeEngine:
    """An aiohttp server answering /generate from a queue of canned replies, recording requests."""

    def __init__(self, replies=(), delay_s=0.0, release: asyncio.Event | None = None,
                 statuses=()):
        self.replies, self.statuses = list(replies), list(statuses)
        self.delay_s, self.release = delay_s, release
        self.requests, self.aborts, self.updates = [], [], []
        self.admin = []  # the admin routes called, in order
        app = web.Application()
        app.add_routes([web.post("/generate", self.generate),
                        web.post("/abort_request", self.abort),
                        web.post("/update_weights_from_disk", self.update),
                        web.post("/pause_generation", self.pause),
                        web.post("/continue_generation", self.continue_)])
        self.server = TestServer(app, host="127.0.0.1")

    async def __aenter__(self):
        await self.server.start_server()
        self.url = str(self.server.make_url("")).rstrip("/")
        return self

    async def __aexit__(self, *exc):
        await self.server.close()

    async def generate(self, request):
        self.requests.append(await request.json())
        if self.statuses:
            return web.json_response({"message": "busy"}, status=self.statuses.pop(0))
        if self.release is not None:
            await self.release.wait()
        await asyncio.sleep(self.delay_s)
        reply = copy.deepcopy(self.replies.pop(0) if self.replies else LENGTH)
        reply["meta_info"]["id"] = self.requests[-1].get("rid")
        return web.json_response(reply)

    async def abort(self, request):
        self.aborts.append(await request.json())
        if self.release is not None:
            self.release.set()
        return web.Response()  # SGLang answers an empty 200

    async def pause(self, request):
        self.admin.append(("pause", (await request.json())["mode"]))
        return web.json_response({"success": True})

    async def continue_(self, request):
        self.admin.append(("continue", None))
        return web.json_response({"success": True})

    async def update(self, request):
        body = await request.json()
        self.updates.append(body)
        self.admin.append(("update", body["model_path"]))
        ok = "bad" not in body["model_path"]
        return web.json_response({"success": ok, "message": "m", "num_paused_requests": 0},
                                 status=200 if ok else 400)


def run(coro):
    return asyncio.run(coro)


async def _answer_length(request):
    return web.json_response(copy.deepcopy(LENGTH))


async def _answer_400(request):
    return web.json_response({"object": "error", "message": "input_ids: required", "code": 400},
                             status=400)


# -- parsing --------------------------------------------------------------------------------------


def test_parse_sglang_replies():
    seg = parse_generate_reply(ABORT_PARTIAL)
    assert seg.output_ids == [5, 6, 7] and seg.logprobs == [-0.5, None, -0.25]
    assert seg.finish_reason == "abort" and seg.status_code is None
    assert seg.finish_message == "Abort in waiting queue" and seg.weight_version == "1"
    seg = parse_generate_reply(STOP)
    assert seg.finish_reason == "stop" and seg.matched_stop == 2 and seg.weight_version == "2"
    seg = parse_generate_reply(LENGTH)
    assert seg.finish_reason == "length" and seg.logprobs[2] is None
    assert parse_generate_reply(ERROR_ABORT).status_code == 400

    older = {"output_ids": [1, 2], "meta_info": {"finish_reason": "stop"}}  # no logprobs/version
    seg = parse_generate_reply(older)
    assert seg.logprobs == [None, None] and seg.finish_reason == "stop"
    assert seg.weight_version == "unknown"
    text_mode = {"text": "hi", "meta_info": {"finish_reason": None,
                                             "output_token_logprobs": [[-0.5, 4, "h"],
                                                                       [-0.5, 5, "i"]]}}
    seg = parse_generate_reply(text_mode)
    assert seg.output_ids == [4, 5] and seg.finish_reason == "unknown"
    short = {"output_ids": [1, 2, 3], "meta_info": {"output_token_logprobs": [[-1.0, 1, None]]}}
    assert parse_generate_reply(short).logprobs == [-1.0, None, None]
    with pytest.raises(EngineError, match="meta_info"):
        parse_generate_reply({"object": "error", "message": "x"})
    with pytest.raises(EngineError, match="token ids"):
        parse_generate_reply({"output_ids": [1, "2"], "meta_info": {}})


def test_client_resubmits_an_aborted_request_with_its_partial_tokens():
    async def go():
        async with FakeEngine([ABORT_PARTIAL, STOP]) as fake, SGLangClient(fake.url) as client:
            result = await client.generate([1, 2, 3], {"max_new_tokens": 10, "top_p": 0.9},
                                           rid="r1")
            return result, fake.requests

    result, requests = run(go())
    assert result.output_ids == [5, 6, 7, 8, 2]
    assert result.logprobs == [-0.5, None, -0.25, -1.0, -0.125]
    assert result.weight_versions == ["1"] * 3 + ["2"] * 2
    assert result.versions == [1] * 3 + [2] * 2
    assert result.finish_reason == "stop" and result.matched_stop == 2
    assert result.num_segments == 2 and result.completion_tokens == 5
    assert result.prompt_tokens == 3
    assert requests[0] == {"input_ids": [1, 2, 3], "rid": "r1", "return_logprob": True,
                           "sampling_params": {"max_new_tokens": 10, "top_p": 0.9}}
    # a fresh id per attempt: the aborted request may not be gone from the engine yet
    assert requests[1] == {"input_ids": [1, 2, 3, 5, 6, 7], "rid": "r1.1", "return_logprob": True,
                           "sampling_params": {"max_new_tokens": 7, "top_p": 0.9}}


def test_a_request_cut_just_after_a_stop_token_is_finished_not_resubmitted():
    """SGLang checks a request's stop after an abort reaches it, so a request cut by a weight
    update right after it sampled a stop token comes back aborted with that token last.
    Resubmitted, it would generate past its stop (found in a run through SGLang: 22% of the
    trajectories had a stop token inside an action, and earned 0.28 against 0.81)."""
    cut = copy.deepcopy(ABORT_PARTIAL)  # [5, 6, 7]: 7 is a stop token below
    at_budget = copy.deepcopy(ABORT_PARTIAL)

    async def go():
        async with FakeEngine([cut, at_budget, copy.deepcopy(ABORT_PARTIAL), STOP]) as fake, \
                SGLangClient(fake.url) as client:
            stopped = await client.generate([1], {"max_new_tokens": 10,
                                                  "stop_token_ids": [7, 2]})
            full = await client.generate([1], {"max_new_tokens": 3})
            ignored = await client.generate([1], {"max_new_tokens": 10, "stop_token_ids": [7],
                                                  "ignore_eos": True})
            return stopped, full, ignored, len(fake.requests), client.stats()

    stopped, full, ignored, n, stats = run(go())
    assert stopped.finish_reason == "stop" and stopped.matched_stop == 7
    assert stopped.output_ids == [5, 6, 7] and stopped.num_segments == 1
    assert full.finish_reason == "length" and full.output_ids == [5, 6, 7]  # cut at its budget
    assert ignored.output_ids == [5, 6, 7, 8, 2]  # SGLang applies no stop with ignore_eos
    assert n == 4 and stats["engine_stops_at_abort"] == 1 and stats["engine_resubmits"] == 1


def test_client_returns_length_and_error_aborts_as_they_are():
    async def go():
        async with FakeEngine([LENGTH, ERROR_ABORT]) as fake, SGLangClient(fake.url) as client:
            return (await client.generate([1], {"max_new_tokens": 4}),
                    await client.generate([1]), len(fake.requests))

    length, error, n = run(go())
    assert length.finish_reason == "length" and length.output_ids == [9] * 4
    assert length.logprobs == [-1.5, -1.5, None, -1.5] and length.weight_versions == ["1"] * 4
    assert error.finish_reason == "abort" and error.finish_message == "input too long"
    assert error.output_ids == [] and n == 2  # not resubmitted


def test_client_abort_is_not_resubmitted():
    async def go():
        release = asyncio.Event()
        async with (FakeEngine([ABORT_PARTIAL], release=release) as fake,
                    SGLangClient(fake.url) as client):
            task = asyncio.create_task(client.generate([1, 2, 3], {"max_new_tokens": 10},
                                                       rid="mine"))
            while not fake.requests:
                await asyncio.sleep(0.01)
            await client.abort("mine")
            return await task, fake

    result, fake = run(go())
    assert fake.aborts == [{"rid": "mine"}] and len(fake.requests) == 1
    assert result.finish_reason == "abort" and result.output_ids == [5, 6, 7]


def test_http_errors_raise_with_the_message():
    async def go():
        app = web.Application()
        app.add_routes([web.post("/generate", _answer_400)])
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            async with SGLangClient(str(server.make_url("")), max_retries=0) as client:
                await client.generate([1])
        finally:
            await server.close()

    with pytest.raises(EngineError, match="HTTP 400: input_ids: required") as info:
        run(go())
    assert info.value.status == 400


# -- retries and routing --------------------------------------------------------------------------


def test_retries_with_backoff_until_the_engine_comes_up():
    port = free_port()

    async def go():
        async with SGLangClient(f"http://127.0.0.1:{port}", backoff_s=0.05) as client:
            task = asyncio.create_task(client.generate([1], {"max_new_tokens": 4}))
            await asyncio.sleep(0.3)  # the first attempts are refused
            app = web.Application()
            app.add_routes([web.post("/generate", _answer_length)])
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            try:
                return await task, client.num_retries
            finally:
                await runner.cleanup()

    result, retries = run(go())
    assert result.output_ids == [9] * 4 and retries >= 2


def test_a_refusing_engine_is_skipped_and_503_is_retried():
    dead = f"http://127.0.0.1:{free_port()}"

    async def go():
        async with (FakeEngine(statuses=[503]) as fake,
                    SGLangClient([dead, fake.url], backoff_s=0.05) as client):
            results = [await client.generate([1], {"max_new_tokens": 4}) for _ in range(4)]
            return results, len(fake.requests), client.num_retries

    results, served, retries = run(go())
    assert all(r.output_ids == [9] * 4 for r in results)
    assert served == 5 and retries >= 2  # one 503, then four answers; >= 1 refused connection


def test_gives_up_after_the_retries():
    async def go():
        async with SGLangClient(f"http://127.0.0.1:{free_port()}", max_retries=2,
                                backoff_s=0.01) as client:
            await client.generate([1])

    with pytest.raises(EngineUnavailableError, match="3 attempts"):
        run(go())


def test_least_loaded_routing():
    async def go():
        async with (FakeEngine(delay_s=0.2) as a, FakeEngine(delay_s=0.2) as b,
                    SGLangClient([a.url, b.url]) as client):
            await asyncio.gather(*(client.generate([1]) for _ in range(10)))
            even = (len(a.requests), len(b.requests))
            assert client.inflight == {a.url: 0, b.url: 0}
        # One engine holds its requests, the other answers at once: a round robin would send
        # half of them to the busy one, least-loaded routing only the first.
        release = asyncio.Event()
        async with (FakeEngine(release=release) as busy, FakeEngine() as free,
                    SGLangClient([busy.url, free.url]) as client):
            held = []
            for _ in range(12):
                held.append(asyncio.create_task(client.generate([1])))
                await asyncio.sleep(0.03)
            release.set()
            await asyncio.gather(*held)
            uneven = (len(busy.requests), len(free.requests))
        return even, uneven

    even, uneven = run(go())
    assert even == (5, 5)
    assert uneven == (1, 11)


def test_weight_update_reaches_every_engine_and_failures_raise():
    async def go():
        async with FakeEngine() as a, FakeEngine() as b, SGLangClient([a.url, b.url]) as client:
            replies = await client.update_weights_from_disk("/w/v3", weight_version="3")
            with pytest.raises(WeightUpdateError, match="bad"):
                await client.update_weights_from_disk("/w/bad")
            return replies, a, b

    replies, a, b = run(go())
    assert all(r["success"] for r in replies.values())
    want = {"model_path": "/w/v3", "weight_version": "3", "abort_all_requests": True}
    assert a.updates[0] == want and b.updates[0] == want
    # Each load between a pause that ends the running requests and a continue, a failed one too
    # (the engine must not stay paused), so that the engine can flush its prefix cache.
    assert a.admin == b.admin == [("pause", "abort"), ("update", "/w/v3"), ("continue", None),
                                  ("pause", "abort"), ("update", "/w/bad"), ("continue", None)]


def test_a_draining_update_asks_the_engine_to_drain_and_does_not_pause_it():
    """`drain_s`: the embedded engine drains and cuts by itself (its batch is empty at the
    load), so the client sends `drain_timeout_s` and no pause."""
    async def go():
        async with FakeEngine() as a, SGLangClient([a.url]) as client:
            await client.update_weights_from_disk("/w/v4", weight_version="4", drain_s=0.25)
            with pytest.raises(ValueError, match="abort_running"):
                await client.update_weights_from_disk("/w/v5", abort_running=False, drain_s=1)
            return a

    a = run(go())
    assert a.updates == [{"model_path": "/w/v4", "weight_version": "4",
                          "abort_all_requests": True, "drain_timeout_s": 0.25}]
    assert a.admin == [("update", "/w/v4")]


# -- against the embedded engine ------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two toy models with different weights, saved as v0 and v1."""
    root = tmp_path_factory.mktemp("client_models")
    out = {}
    for seed, name in ((0, "v0"), (1, "v1")):
        model = toy_model(seed)
        save_hf(model, str(root / name))
        out[name] = (model, str(root / name))
    return out


@pytest.fixture(scope="module")
def engine(models):
    proc, url = start_engine(models["v0"][1], "--weight-version", "v0")
    yield url
    stop_engine(proc)


def test_weight_update_mid_generation_resubmits_and_tags_versions(engine, models):
    prompts = [np.random.default_rng(i).integers(0, 64, 3 + i).tolist() for i in range(4)]
    new_tokens = 200

    async def go():
        # The engine was started with the label "v0": the learner's version 0.
        async with SGLangClient(engine, version_map=VersionMap(0, "v0")) as client:
            tasks = [asyncio.create_task(client.generate(
                p, {"max_new_tokens": new_tokens, "temperature": 1.0}, rid=f"g{i}"))
                for i, p in enumerate(prompts)]
            await wait_for(engine, lambda info: len(info["running"]) == 4
                           and min(info["running"].values()) >= 3)
            _, reply = await post(engine, "/update_weights_from_disk",
                                  {"model_path": models["v1"][1], "weight_version": "1",
                                   "abort_all_requests": True})
            results = await asyncio.gather(*tasks)
            return reply, results, await client.get_weight_version(), client.num_resubmits

    reply, results, versions, resubmits = run(go())
    assert reply["success"] and reply["num_paused_requests"] == 4, reply
    assert versions == {engine: "1"} and resubmits == 4
    for prompt, result in zip(prompts, results, strict=True):
        assert result.finish_reason == "length" and len(result.output_ids) == new_tokens
        assert result.num_segments == 2
        k = result.weight_versions.count("v0")
        assert 3 <= k < new_tokens
        assert result.weight_versions == ["v0"] * k + ["1"] * (new_tokens - k)
        assert result.versions == [0] * k + [1] * (new_tokens - k)
        tokens = np.asarray(result.output_ids)
        for name, part in (("v0", slice(0, k)), ("v1", slice(k, new_tokens))):
            logp = teacher_forced(models[name][0], prompt, tokens, TF_LEN)[part]
            np.testing.assert_allclose(result.logprobs[part],
                                       logp[np.arange(len(logp)), tokens[part]], atol=1e-5,
                                       rtol=0, err_msg=f"tokens of {name}")
        # The tokens after the switch are not what the old weights give them.
        old = teacher_forced(models["v0"][0], prompt, tokens, TF_LEN)[k:]
        assert np.max(np.abs(old[np.arange(len(old)), tokens[k:]]
                             - np.asarray(result.logprobs[k:]))) > 1e-2
