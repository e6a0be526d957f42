"""SGLangClient against stubs of SGLang 0.5.2, 0.5.9 and 0.5.23 (`sglang_stub`): weight labels
and where each version keeps them, per-token spans, loads while paused, error bodies; episode-
sticky routing; a frozen engine. No model: tokens are hashes."""

import asyncio
import base64
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from sao_jax.engine.sglang_api import error_message, parse_generate_reply
from sao_jax.envs.base import StepResult
from sao_jax.rollout.agent import AgentConfig, run_episode
from sao_jax.rollout.client import (
    EngineError,
    GenerateResult,
    SGLangClient,
    UnknownWeightVersionError,
    VersionMap,
    WeightUpdateError,
)
from sao_jax.text import CharTokenizer
from sao_jax.train.processes import free_port
from tests.rollout.sglang_stub import VERSIONS, StubSGLang

TOK = CharTokenizer()
FROZEN_S = 1.5  # request_timeout_s where an engine freezes: well above any answer of a stub
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def run(coro):
    return asyncio.run(coro)


async def until(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


class TurnsEnv:
    """Three actions, then done with reward 1; `on_step(turn)` runs before each answer."""

    def __init__(self, on_step=None):
        self.turns, self.on_step = 0, on_step

    def reset(self):
        return "go"

    async def step(self, action):
        self.turns += 1
        if self.on_step is not None:
            await self.on_step(self.turns)
        done = self.turns == 3
        return StepResult("" if done else "ok", 1.0 if done else 0.0, done, {})


def served_rids(stub):
    return [body["rid"] for body in stub.generates]


# -- weight labels --------------------------------------------------------------------------------


def test_version_map():
    m = VersionMap()
    assert m.number("0") == 0 and m.number("17") == 17 and m.number("default") == 0
    assert VersionMap(4).number("default") == 4 and VersionMap(2, "v0").number("v0") == 2
    for label in ("v1", "-1", "01", " 3", "3.0"):
        with pytest.raises(UnknownWeightVersionError, match="--weight-version"):
            m.number(label, "http://e")
    with pytest.raises(UnknownWeightVersionError, match="without meta_info.weight_version"):
        m.number("unknown")  # what the client records for a reply without a label
    with pytest.raises(ValueError, match="initial_version must be an int >= 0"):
        VersionMap(-1)
    with pytest.raises(ValueError, match="integer label"):
        VersionMap(0, "5")
    with pytest.raises(ValueError, match="non-empty"):
        VersionMap(0, "")
    # generators that give labels only (test fakes) get the default map
    assert GenerateResult([1, 2], [None] * 2, "stop", ["default", "3"], 1, 2).versions == [0, 3]


@pytest.mark.parametrize("version", VERSIONS)
def test_weight_label_from_the_route_each_version_has(version):
    async def go():
        async with StubSGLang(version) as stub, SGLangClient(
                stub.url, version_map=VersionMap(initial_version=3)) as client:
            first = await client.get_weight_version(), await client.get_versions()
            await client.update_weights_from_disk("/w/v5", weight_version="5")
            return (await client.server_version(stub.url), first, await client.get_versions(),
                    stub.url)

    server, (labels, numbers), after, url = run(go())
    assert server == tuple(int(p) for p in version.split("."))
    assert labels == {url: "default"} and numbers == {url: 3} and after == {url: 5}


@pytest.mark.parametrize("version", VERSIONS)
def test_an_episode_before_the_first_update_gets_the_initial_version(version):
    """SGLang answers "default" until the learner's first update: no int() of it."""

    async def go():
        async with StubSGLang(version) as stub, SGLangClient(
                stub.url, version_map=VersionMap(initial_version=2)) as client:
            return await run_episode(client, TurnsEnv(), TOK, prompt_id="p",
                                     config=AgentConfig(max_action_tokens=4), bos_id=TOK.bos_id)

    traj = run(go())
    traj.validate(vocab_size=TOK.vocab_size)
    assert traj.weight_versions.dtype == np.int32
    assert np.all(traj.weight_versions[traj.action_mask] == 2)
    assert np.all(traj.weight_versions[~traj.action_mask] == -1)


def test_an_unknown_label_is_an_error_naming_it():
    async def go():
        async with StubSGLang(weight_version="exp-7") as stub, SGLangClient(stub.url) as client:
            await client.generate([1, 2], {"max_new_tokens": 2})

    with pytest.raises(UnknownWeightVersionError, match="'exp-7'.*--weight-version"):
        run(go())


@pytest.mark.parametrize("version", VERSIONS)
def test_a_load_mid_generation_aborts_resubmits_and_labels_every_token(version):
    async def go():
        async with StubSGLang(version) as stub, SGLangClient(stub.url) as client:
            task = asyncio.create_task(client.generate([1, 2, 3], {"max_new_tokens": 300},
                                                       rid="r"))
            await until(lambda: "r" in stub.live and len(stub.live["r"].out) >= 5)
            replies = await client.update_weights_from_disk("/w/v1", weight_version="1")
            return await task, stub, replies, client.num_resubmits

    result, stub, replies, resubmits = run(go())
    assert all(r["success"] for r in replies.values())
    assert stub.updates[0]["abort_all_requests"] is True
    assert result.finish_reason == "length" and len(result.output_ids) == 300
    assert resubmits == 1 and result.num_segments == 2
    assert result.weight_versions == stub.truth["r"] + stub.truth["r.1"]  # what made each token
    k = result.versions.count(0)
    assert k >= 5 and result.versions == [0] * k + [1] * (300 - k)


def test_spans_label_the_tokens_of_a_request_that_ran_across_a_load():
    """0.5.23, paused in place: the load happens, its flush is refused (400 "cache not flushed",
    a success for the client, which then sets the label), the request goes on after continue
    and its reply's spans say which tokens came from which weights."""

    async def go():
        async with StubSGLang("0.5.23") as stub, SGLangClient(stub.url) as client:
            task = asyncio.create_task(client.generate([1, 2, 3], {"max_new_tokens": 200},
                                                       rid="r"))
            await until(lambda: "r" in stub.live and len(stub.live["r"].out) >= 5)
            await client.pause("in_place")
            replies = await client.update_weights_from_disk("/w/v1", weight_version="1",
                                                            abort_running=False)
            label = await client.get_weight_version()
            await client.continue_()
            return await task, stub, replies, label

    result, stub, replies, label = run(go())
    (reply,) = replies.values()
    assert reply["success"] and reply["cache_flushed"] is False
    assert label == {stub.url: "1"}  # set by /update_weight_version, as SGLang left it "default"
    assert result.num_segments == 1 and len(result.output_ids) == 200
    assert result.weight_versions == stub.truth["r"]
    k = result.versions.count(0)
    assert 5 <= k < 200 and result.versions == [0] * k + [1] * (200 - k)


@pytest.mark.parametrize("version", VERSIONS)
def test_pause_modes_and_loads_while_paused_follow_each_version(version):
    async def go():
        async with StubSGLang(version) as stub, SGLangClient(stub.url) as client:
            task = asyncio.create_task(client.generate([4, 5], {"max_new_tokens": 200},
                                                       rid="r"))
            await until(lambda: "r" in stub.live and len(stub.live["r"].out) >= 3)
            outcome = {}
            if version == "0.5.2":  # no modes: the pause aborts whatever it is told
                with pytest.raises(EngineError, match="no pause modes"):
                    await client.pause("in_place")
                await client.pause()
                outcome["keep"] = None
            else:
                await client.pause("retract")
                try:
                    await client.update_weights_from_disk("/w/v1", "1", abort_running=False)
                    outcome["keep"] = True
                except WeightUpdateError as e:
                    outcome["keep"] = str(e)
            await client.update_weights_from_disk("/w/v1", "1")
            await client.continue_()
            result = await task
            if version != "0.5.2":  # in place, a load needs spans (0.5.9's scheduler dies)
                task = asyncio.create_task(client.generate([6], {"max_new_tokens": 200},
                                                           rid="s"))
                await until(lambda: "s" in stub.live and len(stub.live["s"].out) >= 3)
                await client.pause("in_place")
                try:
                    await client.update_weights_from_disk("/w/v2", "2")
                    outcome["in_place"] = True
                except WeightUpdateError as e:
                    outcome["in_place"] = str(e)
                await client.continue_()
                outcome["s"] = await task
            return result, stub, outcome

    result, stub, outcome = run(go())
    assert result.weight_versions == [label for rid in ("r", "r.1", "r.2") if rid in stub.truth
                                      for label in stub.truth[rid]]
    assert result.versions[0] == 0 and result.versions[-1] == 1
    assert not stub.crashed
    if version == "0.5.9":
        assert "needs per-token weight spans" in outcome["keep"]
        assert "cannot load weights while paused in place" in outcome["in_place"]
        assert set(outcome["s"].versions) == {1}
    if version == "0.5.23":
        assert outcome["keep"] is True and outcome["in_place"] is True
        assert outcome["s"].weight_versions == [label for rid in ("s", "s.1")
                                                if rid in stub.truth for label in stub.truth[rid]]
        assert outcome["s"].versions[-1] == 2


# -- error bodies ---------------------------------------------------------------------------------


def test_error_messages_of_every_shape():
    assert error_message({"error": {"message": "too long", "code": 400}}) == "too long"
    assert error_message({"error": "input_ids: required"}) == "input_ids: required"
    assert error_message({"object": "error", "message": "bad", "code": 400}) == "bad"
    assert error_message({"detail": "Not Found"}) == "Not Found"
    assert error_message({"detail": [{"loc": ["body", "mode"], "msg": "bad mode"}]}) == (
        "body.mode: bad mode")
    assert error_message({}, "Internal Server Error\n") == "Internal Server Error"
    assert error_message(None, "") == "(empty body)"
    assert error_message({"detail": [{"loc": None, "msg": "m"}, {"loc": 3}]}) == ": m; 3: None"


@pytest.mark.parametrize("version", VERSIONS)
def test_error_replies_raise_with_their_message(version):
    async def go():
        async with StubSGLang(version) as stub, SGLangClient(stub.url, max_retries=0) as client:
            errors = []
            for call in (lambda: client.generate([], {"max_new_tokens": 2}),
                         lambda: client.update_weights_from_disk("/w/missing", "1")):
                with pytest.raises(EngineError) as info:
                    await call()
                errors.append(info.value)
            return errors

    generate, update = run(go())
    assert generate.status == 400 and "input_ids" in str(generate)
    assert isinstance(update, WeightUpdateError) and "/w/missing" in str(update)
    assert "not found" in str(update)


def test_spans_are_checked():
    reply = {"output_ids": [1, 2, 3], "meta_info": {
        "weight_version": "2", "weight_versions": [{"version": "1", "start": 0, "end": 2},
                                                   {"version": "2", "start": 2, "end": 3}]}}
    assert parse_generate_reply(reply).weight_versions == ["1", "1", "2"]
    reply["meta_info"]["weight_versions"][1]["start"] = 1
    with pytest.raises(EngineError, match="spans"):
        parse_generate_reply(reply)


def test_routed_experts_are_read_as_sglang_writes_them():
    """meta_info's `routed_experts`: base64 of little-endian int32 (SGLang's encoding), read
    flat; absent: None; anything else: an engine error."""
    routes = np.arange(-1, 11, dtype="<i4")
    reply = {"output_ids": [1], "meta_info": {
        "routed_experts": base64.b64encode(routes.tobytes()).decode("ascii")}}
    np.testing.assert_array_equal(parse_generate_reply(reply).routed_experts, routes)
    assert parse_generate_reply({"output_ids": [1], "meta_info": {}}).routed_experts is None
    for bad, match in (("not base64!", "not base64"), (base64.b64encode(b"abc").decode(),
                                                       "3 bytes")):
        with pytest.raises(EngineError, match=match):
            parse_generate_reply({"output_ids": [1], "meta_info": {"routed_experts": bad}})


def test_routed_experts_are_asked_per_segment_and_stitched():
    """`routed_experts_from`: each request asks from the first position not yet routed (a
    resubmission after an abort from the last token it did not run), and the result holds
    every position from there to the last but one token; a reply without them is an engine
    error."""
    def reply(output, routes, finish="stop"):
        meta = {"finish_reason": {"type": finish}, "weight_version": "0"}
        if routes is not None:
            flat = np.asarray(routes, "<i4").reshape(-1)
            meta["routed_experts"] = base64.b64encode(flat.tobytes()).decode("ascii")
        return {"output_ids": output, "meta_info": meta}

    bodies = []

    def scripted(replies):
        async def request(method, path, body=None, **_):
            bodies.append(body)
            return "http://engine", 200, replies.pop(0)
        return request

    # prompt of 5 tokens, routes asked from 2; 3 tokens, aborted; 2 more, stopped. 2 ids each.
    client = SGLangClient(["http://engine"])
    client._request = scripted([reply([7, 8, 9], np.arange(10).reshape(5, 2), "abort"),
                                reply([10, 11], 100 + np.arange(4).reshape(2, 2))])
    result = run(client.generate([1, 2, 3, 4, 5], {"max_new_tokens": 8},
                                 routed_experts_from=2))
    assert [(b["return_routed_experts"], b["routed_experts_start_len"]) for b in bodies] == [
        (True, 2), (True, 7)]  # 7: the first request's last token (its 8th) never ran
    assert result.output_ids == [7, 8, 9, 10, 11] and result.num_segments == 2
    np.testing.assert_array_equal(result.routed_experts,
                                  [*range(10), *range(100, 104)])  # positions 2 .. 8
    # A request aborted while it waited (a weight update held it) ran nothing and has no
    # routes: its resubmission asks from the same position.
    bodies.clear()
    client._request = scripted([reply([], None, "abort"),
                                reply([10, 11], 100 + np.arange(10).reshape(5, 2))])
    result = run(client.generate([1, 2, 3, 4, 5], {"max_new_tokens": 8},
                                 routed_experts_from=1))
    assert [b["routed_experts_start_len"] for b in bodies] == [1, 1]
    np.testing.assert_array_equal(result.routed_experts, 100 + np.arange(10))
    bodies.clear()
    client._request = scripted([reply([7], None)])
    with pytest.raises(EngineError, match="--enable-return-routed-experts"):
        run(client.generate([1, 2], {"max_new_tokens": 1}, routed_experts_from=0))
    client._request = scripted([reply([7], [1, 2, 3])])
    with pytest.raises(EngineError, match="3 ids for 2 positions"):
        run(client.generate([1, 2], {"max_new_tokens": 1}, routed_experts_from=0))
    with pytest.raises(ValueError, match=r"routed_experts_from=3 is outside \[0, 2\]"):
        run(client.generate([1, 2], {"max_new_tokens": 1}, routed_experts_from=3))
    bodies.clear()
    client._request = scripted([reply([7], None)])
    assert run(client.generate([1, 2], {"max_new_tokens": 1})).routed_experts is None
    assert "return_routed_experts" not in bodies[0]  # not asked for: nothing sent
    run(client.close())


@pytest.mark.parametrize("ids", [[-1], [2 ** 31], [2 ** 70], [1.0], [True]])
def test_a_reply_that_lies_about_its_tokens_is_an_engine_error(ids):
    with pytest.raises(EngineError, match="output_ids must be token ids"):
        parse_generate_reply({"output_ids": ids, "meta_info": {}})


# -- routing --------------------------------------------------------------------------------------


def test_episode_turns_stay_on_one_engine_and_new_episodes_spread():
    async def go():
        async with (StubSGLang() as a, StubSGLang() as b,
                    SGLangClient([a.url, b.url]) as client):
            trajs = await asyncio.gather(*(
                run_episode(client, TurnsEnv(), TOK, prompt_id=f"p{i}", trajectory_id=f"t{i}",
                            config=AgentConfig(max_action_tokens=4)) for i in range(6)))
            return trajs, a, b, client

    trajs, a, b, client = run(go())
    assert all(t.finish_reason == "stop" for t in trajs)
    on_a = {rid.split("-")[0] for rid in served_rids(a)}
    on_b = {rid.split("-")[0] for rid in served_rids(b)}
    assert not on_a & on_b and len(on_a) == len(on_b) == 3  # each episode on one engine
    assert len(served_rids(a)) == len(served_rids(b)) == 9
    assert client.num_moves == 0 and not client._router.sessions  # sessions end with their episode


def test_a_dead_engines_sessions_move_and_are_counted():
    async def go():
        async with StubSGLang() as a, StubSGLang() as b, SGLangClient(
                [a.url, b.url], backoff_s=0.05) as client:
            with client.session("x") as sx, client.session("y") as sy:
                await sx.generate([1], {"max_new_tokens": 2})
                await sy.generate([1], {"max_new_tokens": 2})
                first = {sx.url, sy.url}
                dead = sx.url
                stubs = {a.url: a, b.url: b}
                await stubs[dead].close()  # refuses connections from now on
                await sx.generate([1, 2], {"max_new_tokens": 2})
                moved = sx.url
                await sx.generate([1, 2, 3], {"max_new_tokens": 2})
                return first, dead, moved, sx.url, client.num_moves, client.stats()

    first, dead, moved, stayed, moves, stats = run(go())
    assert first == {dead, moved} and moved != dead and stayed == moved
    assert moves == 1 and stats["engine_moves"] == 1 and stats["engine_retries"] >= 1


# -- a frozen engine ------------------------------------------------------------------------------


def test_a_frozen_engine_times_out_its_episode_moves_and_the_request_is_aborted_there():
    """The engine of an episode stops answering between turns (SIGSTOP, modelled): the next turn
    times out, goes to the other engine under a fresh id, and the episode completes; once the
    frozen engine answers again it gets the abort of what it holds and is routed to again."""
    stubs = {}

    async def go():
        async with StubSGLang() as a, StubSGLang() as b, SGLangClient(
                [a.url, b.url], request_timeout_s=FROZEN_S, backoff_s=0.05) as client:
            stubs.update({a.url: a, b.url: b})
            frozen = []

            async def freeze_my_engine(turn):
                if turn == 1:
                    stub = next(s for s in (a, b) if "t-0" in served_rids(s))
                    stub.freeze()
                    frozen.append(stub)

            traj = await run_episode(client, TurnsEnv(freeze_my_engine), TOK, prompt_id="p",
                                     trajectory_id="t", config=AgentConfig(max_action_tokens=4))
            (stub,) = frozen
            other = b if stub is a else a
            stub.thaw()
            await until(lambda: {"rid": "t-1"} in stub.aborts)
            await until(lambda: not stub.live)
            with client.session("later") as later:  # answering again: routed to again
                await later.generate([1], {"max_new_tokens": 2})
                return traj, stub, other, later.url, client.stats()

    traj, stub, other, later_url, stats = run(go())
    assert traj.finish_reason == "stop" and traj.env_metadata["turns"] == 3
    # t-1 reached the frozen engine but never ran there: its client had gone when it woke
    assert served_rids(stub)[0] == "t-0" and "t-1" not in stub.truth
    assert served_rids(other) == ["t-1.1", "t-2"]  # a fresh id for the retry
    assert stats["engine_timeouts"] == 1 and stats["engine_moves"] == 1
    assert later_url == stub.url  # the fewest sessions, and no longer skipped


def test_abort_reaches_a_request_where_its_retry_runs():
    async def go():
        async with StubSGLang() as a, StubSGLang() as b, SGLangClient(
                [a.url, b.url], request_timeout_s=FROZEN_S, backoff_s=0.05) as client:
            stubs = {a.url: a, b.url: b}
            with client.session("e") as session:
                await session.generate([1], {"max_new_tokens": 2})
                frozen = stubs[session.url]
                other = b if frozen is a else a
                frozen.freeze()
                task = asyncio.create_task(session.generate([1, 2], {"max_new_tokens": 10 ** 4},
                                                            rid="r"))
                await until(lambda: "r.1" in other.live and other.live["r.1"].out)
                await client.abort("r")
                result = await task
                frozen.thaw()
                return result, other.aborts

    result, aborts = run(go())
    assert aborts == [{"rid": "r.1"}]
    assert result.finish_reason == "abort" and 0 < len(result.output_ids) < 10 ** 4


def start_stub_process(version: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.rollout.sglang_stub", "--version",
                             version, "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == f"http://127.0.0.1:{port}"
    return proc, f"http://127.0.0.1:{port}"


def test_a_sigstopped_engine_does_not_hang_a_request():
    """A real SIGSTOP: the kernel still accepts the connection, nothing answers."""
    procs = [start_stub_process("0.5.23") for _ in range(2)]
    try:
        async def go():
            async with SGLangClient([u for _, u in procs], request_timeout_s=FROZEN_S,
                                    backoff_s=0.05) as client:
                with client.session("e") as session:
                    await session.generate([1], {"max_new_tokens": 2}, rid="e-0")
                    (proc,) = [p for p, u in procs if u == session.url]
                    proc.send_signal(signal.SIGSTOP)
                    try:
                        t0 = time.monotonic()
                        result = await session.generate([1, 2], {"max_new_tokens": 2},
                                                        rid="e-1")
                        took = time.monotonic() - t0
                    finally:
                        proc.send_signal(signal.SIGCONT)
                    return result, took, client.stats()

        result, took, stats = run(go())
        assert len(result.output_ids) == 2 and result.versions == [0, 0]
        assert took < 30 and stats["engine_timeouts"] == 1 and stats["engine_moves"] == 1
    finally:
        for proc, _ in procs:
            proc.kill()
            proc.wait()
