"""The recording proxy over real HTTP: the `openai` client drives multi-turn sessions against the
embedded engine (a toy model over the TIR tokenizer's 512 ids), and each session's Trajectory is
the one `run_episode` builds from the same sampled ids; a rewritten history ends the session as a
trajectory of what the policy produced; idle sessions are closed; mini-swe-agent runs against it
unmodified, and its dropped format errors become such trajectories."""

import asyncio
import concurrent.futures
import math
import os
import re
import socket
import subprocess
import threading
import time

import aiohttp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.envs.base import StepResult
from sao_jax.models import CausalLM, save_hf
from sao_jax.models.config import preset
from sao_jax.rollout.agent import AgentConfig, run_episode
from sao_jax.rollout.client import GenerateResult
from sao_jax.rollout.proxy import RecordingProxy, SessionConfig, SessionError
from sao_jax.text import ChatDeltas, HFTokenizer
from tests.engine.engines import start_engine, stop_engine

openai = pytest.importorskip("openai", reason="the proxy tests drive it with the openai client")

TIR_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "data", "tir",
                             "tokenizer")
TOK = HFTokenizer.from_dir(TIR_TOKENIZER)
CHAT = ChatDeltas(TOK)
CONFIG = AgentConfig(max_turns=8, max_response_tokens=256, max_action_tokens=8)
SYSTEM = "You are a careful assistant. Answer in one line."
OBSERVATIONS = ["<output>\n42\n</output>", "Traceback:\n  ValueError: é ☃", "```\nok\n```\ndone?"]


def tiny_model(seed: int) -> CausalLM:
    """The toy preset over the TIR tokenizer's 512 ids, with a small embedding (spread-out
    next-token distributions)."""
    model = CausalLM(preset("toy", vocab_size=TOK.vocab_size), nnx.Rngs(seed))
    emb = model.backbone.embed.embedding
    emb.set_value(emb[...] * 0.2)
    return model


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = tiny_model(seed=3)
    path = tmp_path_factory.mktemp("proxy_model")
    save_hf(model, str(path))
    proc, url = start_engine(path)
    yield model, url
    stop_engine(proc)


@pytest.fixture(scope="module")
def proxy(served):
    with RecordingProxy([served[1]], CHAT, CONFIG) as p:
        yield p


def client(proxy, session_id):
    return openai.OpenAI(base_url=proxy.base_url(session_id), api_key="unused", max_retries=0)


def chat_turns(proxy, session_id, observations=OBSERVATIONS):
    """Plays a session like an agent scaffold: the reply goes back verbatim, then an observation."""
    c = client(proxy, session_id)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 6*7?"}]
    replies = []
    for i in range(len(observations) + 1):
        reply = c.chat.completions.create(model="anything", messages=messages, temperature=0.3)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if i < len(observations):
            messages.append({"role": "user", "content": observations[i]})
    return messages, replies


def action_runs(mask):
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask, np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


class Replay:
    """Replays recorded actions (a generator for `run_episode`), recording what it was sent."""

    def __init__(self, actions, logprobs):
        self.actions, self.logprobs, self.calls = list(actions), list(logprobs), []

    async def generate(self, input_ids, sampling_params, rid=None):
        self.calls.append(list(input_ids))
        ids, lps = self.actions.pop(0), self.logprobs.pop(0)
        finish = "stop" if ids[-1] == TOK.eos_id else "length"
        return GenerateResult(output_ids=ids, logprobs=lps, finish_reason=finish,
                              weight_versions=["0"] * len(ids), prompt_tokens=len(input_ids),
                              completion_tokens=len(ids))


class ScriptedEnv:
    def __init__(self, observations):
        self.observations, self.turns = list(observations), 0

    def reset(self):
        return "What is 6*7?"

    def step(self, action):
        self.turns += 1
        if self.turns > len(self.observations):
            return StepResult("", 0.0, True, {})
        return StepResult(self.observations[self.turns - 1], 0.0, False, {})


def assert_is_run_episodes(traj, messages, observations) -> list[list[int]]:
    """`traj` is what `run_episode` builds when its generator replays the proxy's sampled ids and
    its environment the observations, and it decodes to the template's rendering of `messages`
    (the conversation the client held). Returns the actions."""
    runs = action_runs(traj.action_mask)
    actions = [traj.response_ids[a:b].tolist() for a, b in runs]
    replay = Replay(actions, [traj.rollout_logprobs[a:b].tolist() for a, b in runs])
    first = messages[:2]
    local = asyncio.run(run_episode(replay, ScriptedEnv(observations), TOK, prompt_id="p",
                                    config=CONFIG, chat=CHAT,
                                    render_prompt=lambda text: CHAT.prompt_ids(first)))
    np.testing.assert_array_equal(local.prompt_ids, traj.prompt_ids)
    np.testing.assert_array_equal(local.response_ids, traj.response_ids)
    np.testing.assert_array_equal(local.action_mask, traj.action_mask)
    np.testing.assert_array_equal(local.rollout_logprobs, traj.rollout_logprobs)
    history = list(traj.prompt_ids) + list(traj.response_ids)
    text = TOK.decode(history) + TOK.decode(CHAT.end_of_turn_ids(actions[-1]))
    assert text + CHAT.after_end_of_turn == TOK.apply_chat_template(
        messages, add_generation_prompt=False)
    return actions


def test_a_session_over_http_is_the_trajectory_run_episode_builds(proxy, served):
    model, _ = served
    messages, replies = chat_turns(proxy, "s-multi")
    assert all(r.object == "chat.completion" and r.model == proxy.model_name for r in replies)
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)
    traj = proxy.close_session("s-multi", reward=1.0)
    traj.validate(vocab_size=TOK.vocab_size)
    assert traj.env_metadata["turns"] == 4 and traj.finish_reason == "stop"
    assert not traj.truncated and traj.rewards.sum() == 1.0
    assert traj.rewards[np.flatnonzero(traj.action_mask)[-1]] == 1.0
    actions = assert_is_run_episodes(traj, messages, OBSERVATIONS)
    assert [r.usage.completion_tokens for r in replies] == [len(a) for a in actions]
    assert [r.choices[0].message.content for r in replies] == [CHAT.content(a) for a in actions]
    history = list(traj.prompt_ids) + list(traj.response_ids)
    # The engine's log-probs are the model's on exactly these tokens (nothing was re-encoded).
    seq = np.zeros((1, 256), np.int32)
    seq[0, :len(history)] = history
    logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(seq)), axis=-1))[0]
    p = len(traj.prompt_ids)
    want = logp[np.arange(p - 1, len(history) - 1), traj.response_ids]
    np.testing.assert_allclose(traj.rollout_logprobs[traj.action_mask], want[traj.action_mask],
                               atol=1e-5)


def test_concurrent_sessions_keep_their_own_histories(proxy):
    observations = {f"s-par{i}": OBSERVATIONS[i:] + OBSERVATIONS[:i] for i in range(4)}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        played = dict(zip(observations, pool.map(lambda kv: chat_turns(proxy, *kv),
                                                 observations.items()), strict=True))
    for session_id, (messages, _) in played.items():
        traj = proxy.close_session(session_id, reward=0.0)
        traj.validate(vocab_size=TOK.vocab_size)
        assert_is_run_episodes(traj, messages, observations[session_id])


def test_models_route_unknown_sessions_and_error_shape(proxy):
    listed = client(proxy, "s-models").models.list()
    assert [m.id for m in listed.data] == [proxy.model_name]
    with RecordingProxy(proxy._engines, CHAT, CONFIG, auto_open=False) as strict:
        with pytest.raises(openai.NotFoundError) as e:
            client(strict, "nobody").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}])
        assert e.value.body["code"] == "session_not_found" and e.value.status_code == 404
        assert e.value.response.headers["x-should-retry"] == "false"
        with pytest.raises(openai.NotFoundError):
            client(strict, "nobody").models.list()
        with pytest.raises(KeyError):
            strict.close_session("nobody", reward=0.0)
        strict.open_session("known", {"prompt_id": "q7", "difficulty": 3})
        client(strict, "known").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}])
        traj = strict.close_session("known", reward=0.5, truncated=True)
        assert traj.prompt_id == "q7" and traj.env_metadata["difficulty"] == 3
        assert traj.truncated and traj.finish_reason == "turn_limit"
    with pytest.raises(openai.BadRequestError, match="streaming"):
        client(proxy, "s-stream").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], stream=True)


def test_binds_loopback_only(proxy):
    assert proxy.host == "127.0.0.1" and proxy.url.startswith("http://127.0.0.1:")
    with socket.create_connection(("127.0.0.1", proxy.port), 2):
        pass
    others = {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    for address in others - {"127.0.0.1"} - {a for a in others if a.startswith("127.")}:
        with pytest.raises(OSError):
            socket.create_connection((address, proxy.port), 2).close()


class Scripted:
    """Returns scripted replies, encoded (eos appended when `eos`), with log-prob -0.5."""

    def __init__(self, replies, eos=True):
        self.replies, self.eos, self.calls = list(replies), eos, []

    async def generate(self, input_ids, sampling_params, rid=None):
        self.calls.append((list(input_ids), dict(sampling_params)))
        ids = TOK.encode(self.replies.pop(0)) + ([TOK.eos_id] if self.eos else [])
        budget = sampling_params["max_new_tokens"]
        finish = "stop" if len(ids) <= budget else "length"
        ids = ids[:budget]
        return GenerateResult(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=finish,
                              weight_versions=["4"] * len(ids), prompt_tokens=len(input_ids),
                              completion_tokens=len(ids))


def test_sampling_is_the_runs_and_the_budget_truncates():
    gen = Scripted(["a b c d e f g h i j k l"] * 5)
    config = AgentConfig(max_response_tokens=40, max_action_tokens=30, temperature=0.7,
                         stop_token_ids=(7,))
    with RecordingProxy(gen, CHAT, config) as p:
        c = client(p, "s-budget")
        messages = [{"role": "user", "content": "go"}]
        finishes = []
        for _ in range(4):
            raw = c.chat.completions.with_raw_response.create(
                model="m", messages=messages, temperature=2.0, max_tokens=12, stop=["x"])
            reply = raw.parse()
            finishes.append(reply.choices[0].finish_reason)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "more"}]
        assert raw.headers["X-SAO-Ignored-Params"] == "temperature,stop"
        params = gen.calls[0][1]
        assert params["temperature"] == 0.7 and params["max_new_tokens"] == 12
        assert params["stop_token_ids"] == sorted({7, TOK.eos_id})
        assert finishes[0] == "length" and finishes[-1] == "length"
        assert reply.choices[0].message.content == ""
        traj = p.close_session("s-budget", reward=1.0)
    traj.validate(vocab_size=TOK.vocab_size)
    assert traj.truncated and traj.finish_reason == "length" and traj.length <= 40
    assert np.all(traj.weight_versions[traj.action_mask] == 4)


def test_the_engines_context_bounds_prompt_and_response_together():
    gen = Scripted(["a b c d e f g h i j k l"] * 5)
    config = AgentConfig(max_response_tokens=500, max_action_tokens=30, max_context_tokens=60)
    with RecordingProxy(gen, CHAT, config) as p:
        c = client(p, "s-context")
        messages = [{"role": "user", "content": "go"}]
        for _ in range(4):
            reply = c.chat.completions.create(model="m", messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "more"}]
        traj = p.close_session("s-context", reward=0.0)
    assert all(len(ids) + params["max_new_tokens"] <= 60 for ids, params in gen.calls)
    assert traj.truncated and traj.finish_reason == "length"
    assert len(traj.prompt_ids) + traj.length <= 60


def test_hostile_bodies_get_400_and_hurt_nothing_else(proxy):
    async def post(body: bytes):
        async with aiohttp.ClientSession() as s:
            async with s.post(proxy.base_url("s-hostile") + "/chat/completions", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.json()

    for body in (b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # deep nesting
                 b'{"max_tokens":' + b"9" * 5000 + b',"messages":[]}',  # a 5000-digit integer
                 b'{"messages":[{"role":"user","content":"\xff\xfe"}]}',  # not UTF-8
                 b"[1, 2]"):
        status, reply = asyncio.run(post(body))
        assert status == 400 and reply["error"]["type"] == "invalid_request_error", reply
    reply = client(proxy, "s-after-hostile").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_close_over_http_hands_the_trajectory_over():
    closed = {}
    with RecordingProxy(Scripted(["hi"]), CHAT, CONFIG,
                        on_close=lambda sid, t: closed.setdefault(sid, t)) as p:
        client(p, "s-http").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "go"}])
        async def close():
            async with aiohttp.ClientSession() as s:
                async with s.post(p.url + "/sessions/s-http/close", json={"reward": 2.0}) as r:
                    return r.status, await r.json()

        status, body = asyncio.run(close())
    assert status == 200 and body["action_tokens"] == len(TOK.encode("hi")) + 1
    traj = closed["s-http"]
    assert traj.trajectory_id == body["trajectory_id"] and traj.rewards.sum() == 2.0


def played(p, session_id, turns=2, reply_to=None):
    """`turns` honest turns of a session; returns the messages (ending with an observation)."""
    c = client(p, session_id)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "go"}]
    for i in range(turns):
        reply = c.chat.completions.create(model="m", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"observation {i}"}]
    return messages


def assert_ends_at_the_served_history(p, gen, session_id, reason, reward=0.0):
    """The session's trajectory holds the two served actions, `reward` on the last, and says why."""
    traj = p.close_session(session_id, reward=1.0)  # the caller's reward does not count
    traj.validate(vocab_size=TOK.vocab_size)
    runs = action_runs(traj.action_mask)
    assert len(runs) == 2 and traj.env_metadata["turns"] == 2 and len(gen.calls) == 2
    for (start, end), text in zip(runs, ["one", "two"], strict=True):
        assert traj.response_ids[start:end].tolist() == TOK.encode(text) + [TOK.eos_id]
        assert np.all(traj.rollout_logprobs[start:end] == -0.5)
        assert np.all(traj.weight_versions[start:end] == 4)
    # the observation between them is masked; nothing after the last action is recorded
    assert runs[0][1] < runs[1][0] and runs[1][1] == traj.length
    assert traj.rewards[runs[1][1] - 1] == reward and float(traj.rewards.sum()) == reward
    assert not traj.truncated and traj.finish_reason == "history_rewritten"
    assert traj.env_metadata["reward_reason"].startswith("history_rewritten: ")
    assert reason in traj.env_metadata["reward_reason"], traj.env_metadata["reward_reason"]
    return traj


@pytest.mark.parametrize("how, reason", [
    ("edited", "message 2 (assistant) differs"),
    ("dropped", "message 4 (user) differs"),  # mini-swe-agent's format-error path
    ("invented", "message 6 is an assistant message the proxy did not generate"),
    ("cut", "the history was cut or repeated"),
])
def test_a_rewritten_history_ends_the_session_as_what_was_served(how, reason):
    gen = Scripted(["one", "two", "three"])
    with RecordingProxy(gen, CHAT, CONFIG, sessions=SessionConfig(rewritten_reward=-0.5)) as p:
        messages = played(p, "s-" + how)
        if how == "edited":
            messages[2] = {"role": "assistant", "content": messages[2]["content"] + " (edited)"}
        elif how == "dropped":  # the second reply dropped, a format error in its place
            messages = messages[:4] + [{"role": "user", "content": "format error"}]
        elif how == "invented":
            messages += [{"role": "assistant", "content": "more"},
                         {"role": "user", "content": "x"}]
        else:
            messages = messages[:3]
        raw = client(p, "s-" + how).chat.completions.with_raw_response.create(
            model="m", messages=messages)
        reply = raw.parse()
        # the scaffold gets an empty reply, as past a budget, and the session is not failed
        assert reply.choices[0].message.content == ""
        assert reply.choices[0].finish_reason == "length"
        assert raw.headers["X-SAO-Session-Ended"] == "history_rewritten"
        again = client(p, "s-" + how).chat.completions.create(model="m", messages=messages)
        assert again.choices[0].message.content == "" and len(gen.calls) == 2
        assert_ends_at_the_served_history(p, gen, "s-" + how, reason, reward=-0.5)
        assert p.counters() == {"sessions_opened": 1, "sessions_closed": 1,
                                "sessions_failed": 0, "sessions_rewritten": 1,
                                "sessions_idle_closed": 0}
        with pytest.raises(openai.NotFoundError, match="closed"):
            client(p, "s-" + how).chat.completions.create(model="m", messages=messages)


def test_a_rewritten_session_closed_over_http_reports_its_reward_reason():
    closed = {}
    gen = Scripted(["one", "two"])
    with RecordingProxy(gen, CHAT, CONFIG, on_close=closed.__setitem__) as p:
        messages = played(p, "s-http-rw")
        client(p, "s-http-rw").chat.completions.create(model="m", messages=messages[:4] + [
            {"role": "user", "content": "format error"}])

        async def close():
            async with aiohttp.ClientSession() as s:
                async with s.post(p.url + "/sessions/s-http-rw/close", json={"reward": 1.0}) as r:
                    return r.status, await r.json()

        status, body = asyncio.run(close())
    assert status == 200 and body["reward"] == 0.0
    assert body["finish_reason"] == "history_rewritten" and not body["truncated"]
    assert body["reward_reason"].startswith("history_rewritten: message 4 (user) differs")
    assert closed["s-http-rw"].trajectory_id == body["trajectory_id"]


def test_idle_sessions_are_closed_dropped_and_counted():
    closed = {}
    # Long enough that a request every 50 ms keeps a session open on a loaded 2-core machine
    # (0.3 s once closed the busy one there: a client made per request took longer).
    config = SessionConfig(idle_timeout_s=2.0)
    with RecordingProxy(Scripted(["one"]), CHAT, CONFIG, sessions=config,
                        on_close=closed.__setitem__) as p:
        played(p, "s-idle", turns=1)
        p.open_session("s-never-used")
        p.open_session("s-busy")
        busy = client(p, "s-busy")
        start = time.monotonic()
        while time.monotonic() - start < 6.0:  # a session that keeps asking stays open
            busy.models.list()
            time.sleep(0.05)
        counters = p.counters()  # s-idle and s-never-used closed, s-busy still open
        assert counters["sessions_opened"] == 3
        assert counters["sessions_idle_closed"] == 2 and counters["sessions_closed"] == 0
        with pytest.raises(SessionError):  # open (an unknown one is a KeyError), with no action
            p.close_session("s-busy", reward=1.0)
        with pytest.raises(KeyError, match="closed after 2 s without a request"):
            p.close_session("s-idle", reward=1.0)
        with pytest.raises(openai.NotFoundError) as e:
            client(p, "s-idle").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "go"}])
        assert e.value.body["code"] == "session_idle_closed"
    assert closed == {}  # dropped, never handed over


@pytest.mark.parametrize("fields, message", [
    ({"rewritten_reward": math.nan}, "SessionConfig.rewritten_reward must be a finite number"),
    ({"rewritten_reward": "0"}, "SessionConfig.rewritten_reward must be a finite number"),
    ({"idle_timeout_s": 0}, "SessionConfig.idle_timeout_s must be a positive number of seconds, "
                            "or None to never close idle sessions, got 0"),
    ({"idle_timeout_s": math.inf}, "SessionConfig.idle_timeout_s must be a positive"),
])
def test_session_config_errors_name_the_field_and_the_fix(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SessionConfig(**fields)
    with pytest.raises(ValueError, match="must be a SessionConfig"):
        RecordingProxy(Scripted([]), CHAT, CONFIG, sessions={"idle_timeout_s": 1})


def test_mini_swe_agent_runs_unmodified_against_the_proxy(tmp_path, monkeypatch, request):
    """mini-swe-agent (its text-based model through litellm, its local environment) solves a
    bundled swe_mini task through the proxy, replaying the scripted expert's commands; the
    session graded by the SWE grader becomes a trajectory with reward 1."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    pytest.importorskip("minisweagent", reason="mini-swe-agent is not installed")
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import builtin_config_dir
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    from sao_jax.envs.swe import expert
    from sao_jax.envs.swe.env import parse_command
    from sao_jax.envs.swe.grading import grade
    from sao_jax.envs.swe.tasks import load_tasks
    from sao_jax.envs.swe.workspace import WorkspaceConfig, prepare_snapshot

    request.getfixturevalue("isolated")  # grading runs in the namespace sandbox
    task = load_tasks(os.path.join(os.path.dirname(TIR_TOKENIZER), "..", "swe_mini",
                                   "tasks.jsonl"))[5]
    checkout = tmp_path / "testbed"
    prepare_snapshot(task, str(checkout))
    # The expert's commands in mini-swe-agent's reply format (its local environment runs them
    # in the checkout: scripted commands of ours, not a model's).
    commands = [parse_command(a) for a in expert.expert_actions(task, compact=True)]
    gen = Scripted([f"THOUGHT: step {i}.\n\n```mswea_bash_command\n{c}\n```"
                    for i, c in enumerate(commands)])
    config = yaml.safe_load((builtin_config_dir / "mini_textbased.yaml").read_text())
    with RecordingProxy(gen, CHAT, AgentConfig(max_response_tokens=8192,
                                               max_action_tokens=512)) as p:
        model = LitellmTextbasedModel(
            model_name="openai/sao-policy", cost_tracking="ignore_errors",
            model_kwargs={"api_base": p.base_url("swe-1"), "api_key": "unused"})
        agent = DefaultAgent(model, LocalEnvironment(cwd=str(checkout)),
                             **{**config["agent"], "step_limit": 8})
        result = agent.run(task.problem_statement)
        patch = subprocess.run(["git", "diff"], cwd=checkout, capture_output=True, text=True,
                               check=True).stdout
        graded = grade(task, patch, WorkspaceConfig(backend="namespace"), timeout=120)
        traj = p.close_session("swe-1", reward=1.0 if graded.resolved else 0.0)
    assert result["exit_status"] == "Submitted"
    assert graded.resolved, graded.reason
    traj.validate(vocab_size=TOK.vocab_size)
    assert traj.env_metadata["turns"] == len(commands)
    assert len(action_runs(traj.action_mask)) == len(commands)
    assert float(traj.rewards.sum()) == 1.0
    text = TOK.decode(list(traj.prompt_ids) + list(traj.response_ids))
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant")
    assert task.problem_statement.strip()[:60] in text and "<returncode>0</returncode>" in text
    assert text.endswith("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```<|im_end|>")


def test_each_session_keeps_its_turns_on_one_engine():
    """Sticky routing through the proxy: every turn of a session goes to the engine its first turn
    went to (prefix-cache reuse), and new sessions spread over the engines."""
    from tests.rollout.sglang_stub import StubSGLang

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stubs = [StubSGLang("0.5.23", weight_version="0") for _ in range(2)]
    try:
        urls = [asyncio.run_coroutine_threadsafe(s.start(), loop).result(30) for s in stubs]
        sessions = [f"s-sticky{i}" for i in range(4)]
        with RecordingProxy(urls, CHAT, CONFIG) as p:
            for sid in sessions:
                chat_turns(p, sid, observations=OBSERVATIONS[:2])  # 3 turns
                p.close_session(sid, reward=0.0)
        engines = {sid: {i for i, stub in enumerate(stubs) for body in stub.generates
                         if body["rid"].startswith(sid + "-")} for sid in sessions}
        assert all(len(e) == 1 for e in engines.values()), engines
        assert set().union(*engines.values()) == {0, 1}, engines  # both engines served
        assert sum(len(s.generates) for s in stubs) == 3 * len(sessions)
    finally:
        for stub in stubs:
            asyncio.run_coroutine_threadsafe(stub.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.mark.parametrize("closed_by", ["caller", "idle"])
def test_mini_swe_agent_format_error_becomes_a_failed_trajectory(tmp_path, monkeypatch,
                                                                 closed_by):
    """A policy whose second reply mini-swe-agent cannot parse: mini-swe-agent drops that reply
    from its history, the proxy ends the session there (no 409, no retries), the scaffold stops by
    its own rule (repeated format errors) and the session closes as a trajectory of the two
    replies served, reward 0, with the reason. Left open by its harness (`closed_by="idle"`),
    the same session is closed after the idle timeout, dropped and counted."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    pytest.importorskip("minisweagent", reason="mini-swe-agent is not installed")
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import builtin_config_dir
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    (tmp_path / "notes.txt").write_text("hello\n")
    replies = ["THOUGHT: look.\n\n```mswea_bash_command\ncat notes.txt\n```",
               "I am not sure what to do here."]  # no action: mini-swe-agent's format error
    gen = Scripted(replies)
    config = yaml.safe_load((builtin_config_dir / "mini_textbased.yaml").read_text())
    sessions = SessionConfig(idle_timeout_s=1.0 if closed_by == "idle" else 1800.0)
    with RecordingProxy(gen, CHAT, AgentConfig(max_response_tokens=8192, max_action_tokens=512),
                        sessions=sessions) as p:
        model = LitellmTextbasedModel(
            model_name="openai/sao-policy", cost_tracking="ignore_errors",
            model_kwargs={"api_base": p.base_url("swe-fmt"), "api_key": "unused"})
        agent = DefaultAgent(model, LocalEnvironment(cwd=str(tmp_path)),
                             **{**config["agent"], "step_limit": 10})
        start = time.monotonic()
        result = agent.run("Read notes.txt.")
        seconds = time.monotonic() - start
        if closed_by == "idle":
            deadline = time.monotonic() + 30
            while (not p.counters()["sessions_idle_closed"]
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            counters = p.counters()
            with pytest.raises(KeyError, match="without a request"):
                p.close_session("swe-fmt", reward=1.0)
        else:
            traj = p.close_session("swe-fmt", reward=1.0)
            counters = p.counters()
    # mini-swe-agent stops on its own: the empty replies are format errors too
    assert result["exit_status"] == "RepeatedFormatError", result
    if closed_by == "idle":
        assert counters["sessions_idle_closed"] == 1 and counters["sessions_closed"] == 0
        return
    assert agent.n_calls == config["agent"].get("max_consecutive_format_errors", 3) + 1
    assert seconds < 30 and len(gen.calls) == 2  # no retries, one engine call per reply
    traj.validate(vocab_size=TOK.vocab_size)
    runs = action_runs(traj.action_mask)
    assert [TOK.decode(traj.response_ids[a:b]) for a, b in runs] == [
        r + "<|im_end|>" for r in replies]
    assert float(traj.rewards.sum()) == 0.0 and traj.rewards[runs[-1][1] - 1] == 0.0
    assert traj.finish_reason == "history_rewritten" and not traj.truncated
    assert traj.env_metadata["reward_reason"].startswith(
        "history_rewritten: message 4 (user) differs from the one served before (role "
        "'assistant'")
    text = TOK.decode(list(traj.response_ids))
    assert "hello" in text  # the first command's observation, masked
    assert not traj.action_mask[runs[0][1]:runs[1][0]].any()
    assert counters["sessions_rewritten"] == 1 and counters["sessions_failed"] == 0
