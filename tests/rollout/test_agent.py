"""The agent loop: token bookkeeping with a scripted engine (plain and chat-template histories),
and log-prob alignment over HTTP."""

import asyncio
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.envs import calculator, python_tool
from sao_jax.envs.base import StepResult
from sao_jax.models import expert_routes, save_hf
from sao_jax.rollout.agent import AgentConfig, EnvironmentFailure, run_episode
from sao_jax.rollout.client import GenerateResult, SGLangClient
from sao_jax.text import CharTokenizer, ChatDeltas, HFTokenizer
from tests.engine.engines import start_engine, stop_engine, toy_model

TOK = CharTokenizer()
TIR_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "data", "tir",
                             "tokenizer")
CONFIG = AgentConfig(stop_token_ids=calculator.stop_token_ids(TOK))


class ScriptedGenerator:
    """Returns the next scripted action, with log-prob -0.5 and weight version 3."""

    def __init__(self, actions):
        self.actions = list(actions)
        self.calls = []

    async def generate(self, input_ids, sampling_params, rid=None):
        self.calls.append((list(input_ids), dict(sampling_params)))
        full = TOK.encode(self.actions.pop(0))
        ids = full[: sampling_params["max_new_tokens"]]
        finish = "stop" if len(ids) == len(full) else "length"
        return GenerateResult(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=finish,
                              weight_versions=["3"] * len(ids), prompt_tokens=len(input_ids),
                              completion_tokens=len(ids))


def test_calculator_episode_bookkeeping():
    problem = calculator.Problem("(2+3)*4", 20)
    turns = calculator.teacher_transcript(problem)
    gen = ScriptedGenerator(a for a, _ in turns)
    traj = asyncio.run(run_episode(gen, calculator.CalculatorEnv(problem), TOK, prompt_id="p1",
                                   config=CONFIG, bos_id=TOK.bos_id))
    traj.validate(vocab_size=TOK.vocab_size)
    assert TOK.decode(traj.prompt_ids) == "<bos>(2+3)*4=?\n"
    assert TOK.decode(traj.response_ids) == "".join(a + o for a, o in turns)
    assert TOK.decode(traj.response_ids[traj.action_mask]) == "".join(a for a, _ in turns)
    assert np.all(traj.rollout_logprobs[traj.action_mask] == -0.5)
    assert np.all(np.isnan(traj.rollout_logprobs[~traj.action_mask]))
    assert np.all(traj.weight_versions[traj.action_mask] == 3)
    assert traj.rewards.sum() == 1.0 and traj.rewards[-1] == 1.0  # on the answer's last token
    assert traj.finish_reason == "stop" and not traj.truncated
    # Each call sees the history as ids, extended, never re-tokenised.
    assert gen.calls[1][0] == list(traj.prompt_ids) + TOK.encode(turns[0][0] + turns[0][1])


def test_turn_limit_and_token_budget_truncate():
    problem = calculator.Problem("1+1", 2)
    loop = ScriptedGenerator(["<calc>1+1</calc>"] * 10)
    traj = asyncio.run(run_episode(loop, calculator.CalculatorEnv(problem, max_turns=100), TOK,
                                   prompt_id="p", config=AgentConfig(max_turns=3)))
    assert traj.truncated and traj.finish_reason == "turn_limit"
    assert traj.env_metadata["turns"] == 3
    short = AgentConfig(max_response_tokens=12)
    traj = asyncio.run(run_episode(ScriptedGenerator(["<calc>1+1</calc>"] * 10),
                                   calculator.CalculatorEnv(problem), TOK, prompt_id="p",
                                   config=short))
    assert traj.truncated and traj.finish_reason == "length" and traj.length <= 12


def test_the_engines_context_bounds_prompt_and_response_together():
    """A long prompt leaves the response less room: no request ever asks the engine for more
    than its context, and the episode ends "length" where the next one would not fit."""
    problem = calculator.Problem("1+1", 2)
    gen = ScriptedGenerator(["<calc>1+1</calc>"] * 10)
    config = AgentConfig(max_response_tokens=500, max_action_tokens=16, max_context_tokens=40)
    traj = asyncio.run(run_episode(gen, calculator.CalculatorEnv(problem, max_turns=100), TOK,
                                   prompt_id="p", config=config, bos_id=TOK.bos_id))
    assert traj.truncated and traj.finish_reason == "length"
    assert all(len(ids) + params["max_new_tokens"] <= 40 for ids, params in gen.calls)
    assert len(traj.prompt_ids) + traj.length <= 40 and len(gen.calls) >= 2
    with pytest.raises(ValueError, match="max_context_tokens must be >= 2"):
        AgentConfig(max_context_tokens=1)


class FixedObservationEnv:
    """Answers every action with the same observation; done after three actions, reward 1."""

    def __init__(self):
        self.turns = 0

    def reset(self):
        return "1+2=?\n"

    def step(self, action):
        self.turns += 1
        done = self.turns == 3
        return StepResult("" if done else "<res>7</res>\n", 1.0 if done else 0.0, done, {})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = toy_model(seed=5)
    path = tmp_path_factory.mktemp("agent_model")
    save_hf(model, str(path))
    proc, url = start_engine(path, "--enable-return-routed-experts")
    yield model, url
    stop_engine(proc)


def test_rollout_logprobs_line_up_with_teacher_forcing_over_http(served):
    """Three turns over HTTP: the engine's log-probs are the teacher-forced ones of the
    history; with `routed_experts` (routing replay) each turn asks for the experts of the
    tokens it adds, and the trajectory holds those of every token but the last, as a
    teacher-forced pass routes them."""
    model, url = served
    cfg = model.cfg
    plain = AgentConfig(max_action_tokens=6, temperature=1.0)
    routed = AgentConfig(max_action_tokens=6, temperature=1.0,
                         routed_experts=(cfg.num_layers, cfg.num_experts_per_tok))

    async def episodes():
        client = SGLangClient([url])
        try:
            return await asyncio.gather(*[
                run_episode(client, FixedObservationEnv(), TOK, prompt_id=f"p{i}",
                            config=routed if i % 2 else plain, bos_id=TOK.bos_id)
                for i in range(4)])
        finally:
            await client.close()

    forward = nnx.jit(lambda m, x: jax.nn.log_softmax(m(x), axis=-1))
    trajectories = asyncio.run(episodes())
    for i, traj in enumerate(trajectories):
        if i % 2 == 0:
            assert traj.routed_experts.shape == (0, 0, 0)
            continue
        full = np.concatenate([traj.prompt_ids, traj.response_ids])
        out = model.backbone(jnp.asarray(full[None, :-1]))
        want = np.asarray(expert_routes(cfg, out.router_logits, 1, len(full) - 1))[0]
        assert traj.routed_experts.shape == (len(full), *want.shape[1:])
        np.testing.assert_array_equal(traj.routed_experts[:-1], want)
        assert (traj.routed_experts[-1] == -1).all() and (want[:, -1] >= 0).all()
    for traj in trajectories:
        assert traj.env_metadata["turns"] == 3 and traj.rewards.sum() == 1.0
        assert np.count_nonzero(~traj.action_mask) == 2 * len(TOK.encode("<res>7</res>\n"))
        seq = np.zeros((1, 48), np.int32)
        full = np.concatenate([traj.prompt_ids, traj.response_ids])
        seq[0, : len(full)] = full
        logp = np.asarray(forward(model, jnp.asarray(seq)))[0]
        p = len(traj.prompt_ids)
        want = logp[np.arange(p - 1, len(full) - 1), traj.response_ids]
        np.testing.assert_allclose(traj.rollout_logprobs[traj.action_mask],
                                   want[traj.action_mask], atol=1e-5)
        assert math.isnan(float(traj.rollout_logprobs[~traj.action_mask][0]))


class IdsGenerator:
    """Returns fixed action ids (finish "stop"), log-prob -0.5, version 1; records its inputs."""

    def __init__(self, actions):
        self.actions, self.calls = list(actions), []

    async def generate(self, input_ids, sampling_params, rid=None):
        self.calls.append(list(input_ids))
        ids = self.actions.pop(0)
        return GenerateResult(output_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                              weight_versions=["1"] * len(ids), prompt_tokens=len(input_ids),
                              completion_tokens=len(ids))


class CodeEnv:
    """Runs nothing: answers the first action with an output, ends after the second."""

    def __init__(self):
        self.actions = []

    def reset(self):
        return "What is 6*7?"

    def step(self, action):
        self.actions.append(action)
        if len(self.actions) == 2:
            return StepResult("", 1.0, True, {})
        return StepResult("<output>\n42\n</output>", 0.0, False, {})


def test_chat_episode_appends_template_deltas_and_keeps_sampled_ids():
    tok = HFTokenizer.from_dir(TIR_TOKENIZER)
    fence = python_tool.stop_token_ids(tok)[1]
    # Sampled ids that BPE would not produce from their text: one character per token.
    first = [tok.encode(c)[0] for c in "Let me run it.\n```python\nprint(6*7)\n"] + [fence]
    second = tok.encode("The answer is ") + tok.encode("4") + tok.encode("2.") + [tok.eos_id]
    gen = IdsGenerator([first, second])
    env = CodeEnv()
    traj = asyncio.run(run_episode(gen, env, tok, prompt_id="p", config=AgentConfig(),
                                   chat=ChatDeltas(tok)))
    traj.validate(vocab_size=tok.vocab_size)
    assert tok.decode(traj.prompt_ids) == (
        "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n")
    n = len(first)
    delta = tok.encode("\n<|im_start|>user\n<output>\n42\n</output><|im_end|>\n"
                       "<|im_start|>assistant\n")
    assert traj.response_ids.tolist() == first + [tok.eos_id] + delta + second
    assert traj.action_mask.tolist() == [True] * n + [False] * (1 + len(delta)) + [True] * len(
        second)  # the closing <|im_end|> of the fenced action and the newline are masked
    messages = [{"role": "user", "content": "What is 6*7?"},
                {"role": "assistant", "content": tok.decode(first)},
                {"role": "user", "content": "<output>\n42\n</output>"},
                {"role": "assistant", "content": tok.decode(second[:-1])}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=False)
    history = traj.prompt_ids.tolist() + traj.response_ids.tolist()
    assert tok.decode(history) + "\n" == rendered
    assert tok.encode(rendered)[:-1] != history  # what re-encoding would have trained on
    assert gen.calls[1] == history[:len(traj.prompt_ids) + n + 1 + len(delta)]
    assert env.actions[0] == tok.decode(first)  # the environment reads the action's text
    assert traj.rewards[-1] == 1.0 and traj.finish_reason == "stop"
    with pytest.raises(ValueError, match="not both"):
        asyncio.run(run_episode(IdsGenerator([second]), CodeEnv(), tok, prompt_id="p",
                                config=AgentConfig(), chat=ChatDeltas(tok), bos_id=0))


class SessionGenerator(IdsGenerator):
    """An `IdsGenerator` with `session(key)`, as `SGLangClient` has: records the sessions opened,
    which turns went through them, and which were closed."""

    def __init__(self, actions):
        super().__init__(actions)
        self.opened, self.closed, self.via = [], [], []

    def session(self, key):
        self.opened.append(key)
        outer = self

        class Session:
            async def generate(self, input_ids, sampling_params, rid=None):
                outer.via.append((key, rid))
                return await outer.generate(input_ids, sampling_params, rid)

            def close(self):
                outer.closed.append(key)

        return Session()


def test_an_episode_plays_in_one_session_closed_however_it_ends():
    gen = SessionGenerator([[5, 6]] * 3)
    traj = asyncio.run(run_episode(gen, FixedObservationEnv(), TOK, prompt_id="p", config=CONFIG,
                                   trajectory_id="t7"))
    assert gen.opened == gen.closed == ["t7"] and traj.env_metadata["turns"] == 3
    assert gen.via == [("t7", "t7-0"), ("t7", "t7-1"), ("t7", "t7-2")]
    assert np.all(traj.weight_versions[traj.action_mask] == 1)

    class Broken(FixedObservationEnv):
        def step(self, action):
            raise OSError("sandbox gone")

    gen = SessionGenerator([[5, 6]])
    with pytest.raises(EnvironmentFailure):
        asyncio.run(run_episode(gen, Broken(), TOK, prompt_id="p", config=CONFIG,
                                trajectory_id="t8"))
    assert gen.opened == gen.closed == ["t8"]
