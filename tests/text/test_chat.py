"""Token-exact chat histories: the prompt rendered as a chat (or as bos + text), and random
multi-turn episodes through `run_episode` with the TIR tokenizer's ChatML template that decode to
the template's rendering, keep every sampled id, and differ from a naive re-encoding."""

import asyncio
import math
import os
import random

import numpy as np
import pytest

from sao_jax.envs import python_tool
from sao_jax.envs.base import StepResult
from sao_jax.rollout.agent import AgentConfig, run_episode
from sao_jax.rollout.client import GenerateResult
from sao_jax.text import (
    CharTokenizer,
    ChatDeltas,
    ChatTemplateError,
    HFTokenizer,
    chat_deltas,
    prompt_renderer,
)

TIR_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "data", "tir",
                             "tokenizer")
TOK = HFTokenizer.from_dir(TIR_TOKENIZER)
CHAT = ChatDeltas(TOK)
FENCES = python_tool.stop_token_ids(TOK)[1:]  # stop ids that do not end the turn
PIECES = ("é", "日本語", "☃", "🙂", "\u200b", "\n", "\n\n", "  ", "\t", "```python\nprint(1)\n```",
          "```\n", "<|im_end|>", "<|im_start|>assistant\n", "<|endoftext|>", "<|im_end",
          "im_start|>", "\\boxed{6}", "'s", "Traceback (most recent call last):\n", "0.5", "\r\n")


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 8)):
        if rng.random() < 0.5:
            parts.append(rng.choice(PIECES))
        else:
            parts.append("".join(chr(rng.randint(32, 126)) for _ in range(rng.randint(1, 12))))
    return "".join(parts)


class RandomGenerator:
    """Samples random ids: some actions end with the eos (finish "stop"), some at a closing fence
    (stop), some are cut (length). Records every action."""

    def __init__(self, rng: random.Random):
        self.rng, self.actions, self.calls = rng, [], []

    async def generate(self, input_ids, sampling_params, rid=None):
        self.calls.append(list(input_ids))
        rng = self.rng
        ids = [rng.choice([i for i in range(TOK.vocab_size) if i != TOK.eos_id])
               for _ in range(rng.randint(0, 12))]
        kind = rng.choice(("eos", "fence", "cut"))
        if kind == "eos":
            ids.append(TOK.eos_id)
        elif kind == "fence":
            ids.append(rng.choice(FENCES))
        ids = ids or [rng.randrange(3, TOK.vocab_size)]
        self.actions.append(ids)
        return GenerateResult(output_ids=ids, logprobs=[-0.25] * len(ids),
                              finish_reason="length" if kind == "cut" else "stop",
                              weight_versions=["2"] * len(ids), prompt_tokens=len(input_ids),
                              completion_tokens=len(ids))


class RandomEnv:
    """Random observations; done after `turns` actions (or never)."""

    def __init__(self, rng: random.Random, turns: int | None):
        self.rng, self.turns, self.observations = rng, turns, []

    def reset(self):
        self.prompt = random_text(self.rng) or "go"
        return self.prompt

    def step(self, action):
        if self.turns is not None and len(self.observations) + 1 == self.turns:
            return StepResult("", 1.0, True, {})
        self.observations.append(random_text(self.rng))
        return StepResult(self.observations[-1], 0.0, False, {})


def play(seed: int):
    rng = random.Random(seed)
    max_turns = rng.randint(1, 5)
    env = RandomEnv(rng, rng.choice([None, rng.randint(1, max_turns)]))
    gen = RandomGenerator(rng)
    config = AgentConfig(max_turns=max_turns, max_response_tokens=4096, max_action_tokens=64)
    traj = asyncio.run(run_episode(gen, env, TOK, prompt_id=str(seed), config=config, chat=CHAT))
    messages = [{"role": "user", "content": env.prompt}]
    for i, action in enumerate(gen.actions):
        messages.append({"role": "assistant", "content": CHAT.content(action)})
        if i < len(env.observations):
            messages.append({"role": "user", "content": env.observations[i]})
    return traj, gen, messages


def action_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def test_prompt_rendering():
    chat = prompt_renderer(TOK)("Problem: 1+1?")
    assert chat == TOK.encode("<|im_start|>user\nProblem: 1+1?<|im_end|>\n<|im_start|>assistant\n")
    assert chat[0] == TOK.id("<|im_start|>")  # the template's own token, and no BOS before it
    assert prompt_renderer(TOK, chat_template=False)("1+1?") == TOK.encode("1+1?")  # no BOS
    char = CharTokenizer()
    assert prompt_renderer(char)("1+1=?") == [char.bos_id] + char.encode("1+1=?")


def test_observations_go_with_the_prompt():
    """`chat_deltas` gives deltas exactly where `prompt_renderer` renders a chat."""
    assert chat_deltas(TOK).observation_ids("x") == CHAT.observation_ids("x")
    assert chat_deltas(TOK, chat_template=False) is None
    assert chat_deltas(CharTokenizer()) is None
    assert chat_deltas(HFTokenizer(TOK.tokenizer, eos_token="<|im_end|>")) is None


def test_random_episodes_are_token_exact_and_naive_reencoding_is_not():
    naive_differs, episodes = 0, 200
    for seed in range(episodes):
        traj, gen, messages = play(seed)
        traj.validate(vocab_size=TOK.vocab_size)
        history = list(traj.prompt_ids) + list(traj.response_ids)
        ends_with_observation = messages[-1]["role"] == "user"
        want = TOK.apply_chat_template(messages, add_generation_prompt=ends_with_observation)
        text = TOK.decode(history)
        if not ends_with_observation:  # the episode ended on an action, before the template's
            text += TOK.decode(CHAT.end_of_turn_ids(gen.actions[-1])) + CHAT.after_end_of_turn
        assert text == want, f"seed {seed}"  # (a) the template's rendering
        # (b) the mask-1 runs are exactly the sampled actions, in order, with their log-probs
        runs = action_runs(traj.action_mask)
        assert len(runs) == len(gen.actions), f"seed {seed}"
        for (start, end), action in zip(runs, gen.actions, strict=True):
            assert traj.response_ids[start:end].tolist() == action, f"seed {seed}"
        assert np.all(traj.rollout_logprobs[traj.action_mask] == -0.25)
        assert np.all(np.isnan(traj.rollout_logprobs[~traj.action_mask]))
        assert np.all(traj.weight_versions[~traj.action_mask] == -1)
        # Each generation saw exactly the history so far.
        for call, (start, _) in zip(gen.calls, runs, strict=True):
            assert call == history[:len(traj.prompt_ids) + start]
        naive_differs += TOK.encode(want) != history  # (c)
    fraction = naive_differs / episodes
    print(f"naive re-encoding differs from the token-exact history in {naive_differs}/{episodes} "
          f"episodes ({fraction:.0%})")
    assert fraction > 0.5


def test_cut_actions_get_a_masked_end_of_turn_and_the_newline_is_masked():
    eos, fence = TOK.eos_id, FENCES[0]
    assert CHAT.end_of_turn_ids([5, eos]) == [] and CHAT.end_of_turn_ids([5, fence]) == [eos]
    assert CHAT.end_of_turn_ids([]) == [eos]
    assert CHAT.after_end_of_turn == "\n"
    assert CHAT.delta_text([{"role": "user", "content": "out"}]) == (
        "\n<|im_start|>user\nout<|im_end|>\n<|im_start|>assistant\n")
    assert CHAT.observation_ids("out") == TOK.encode(
        "\n<|im_start|>user\nout<|im_end|>\n<|im_start|>assistant\n")
    assert CHAT.prompt_ids([{"role": "user", "content": "q"}]) == TOK.encode(
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
    assert CHAT.content([7, 8, eos]) == TOK.decode([7, 8]) and CHAT.content([7, fence]) == (
        TOK.decode([7, fence]))


def test_a_template_without_the_prefix_property_or_the_role_fails_clearly():
    with pytest.raises(ChatTemplateError, match="no prefix property|rejected"):
        CHAT.observation_ids("x", role="tool")  # the TIR template knows no tool role
    with pytest.raises(ChatTemplateError, match="no assistant message"):
        CHAT.delta_ids([{"role": "assistant", "content": "x"}])
    rewriting = HFTokenizer(TOK.tokenizer, eos_token="<|im_end|>", chat_template=(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{{ m.content if loop.last else m.content[:2] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    with pytest.raises(ChatTemplateError, match="no prefix property"):
        ChatDeltas(rewriting)
    no_template = HFTokenizer(TOK.tokenizer, eos_token="<|im_end|>")
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatDeltas(no_template)


def test_a_role_whose_message_rewrites_earlier_turns_has_no_prefix_property():
    # Shortens the earlier messages when the last one is a tool's.
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                "{{ m.content if (messages[-1].role != 'tool' or loop.last) else m.content[:1] }}"
                "<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = ChatDeltas(HFTokenizer(TOK.tokenizer, eos_token="<|im_end|>", chat_template=template))
    assert chat.observation_ids("obs") == TOK.encode(
        "\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ChatTemplateError, match=r"no prefix property for roles \['tool'\]"):
        chat.observation_ids("obs", role="tool")


# Qwen3's way, simplified: the assistant turn after the last user message shows an (empty)
# thinking block, earlier ones do not.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_template_that_renders_the_last_assistant_turn_apart_still_gives_deltas():
    tok = HFTokenizer(TOK.tokenizer, eos_token="<|im_end|>", chat_template=THINKING_TEMPLATE)
    chat = ChatDeltas(tok)
    assert chat.after_end_of_turn is None  # a finished last turn renders with its think block
    assert tok.apply_chat_template([{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a"}],
                                   add_generation_prompt=False) == (
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\na<|im_end|>\n")
    assert chat.delta_text([{"role": "user", "content": "obs"}]) == (
        "\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n")


def test_logprob_of_the_masked_end_of_turn_is_nan():
    class Cut:
        async def generate(self, input_ids, sampling_params, rid=None):
            return GenerateResult(output_ids=[50, 60], logprobs=[-1.0, -2.0],
                                  finish_reason="length", weight_versions=["0", "0"],
                                  prompt_tokens=len(input_ids), completion_tokens=2)

    class TwoTurns:
        def __init__(self):
            self.n = 0

        def reset(self):
            return "q"

        def step(self, action):
            self.n += 1
            return StepResult("o", 1.0 if self.n == 2 else 0.0, self.n == 2, {})

    traj = asyncio.run(run_episode(Cut(), TwoTurns(), TOK, prompt_id="p", chat=CHAT,
                                   config=AgentConfig(max_action_tokens=2)))
    assert traj.response_ids[2] == TOK.eos_id and not traj.action_mask[2]
    assert math.isnan(traj.rollout_logprobs[2]) and traj.weight_versions[2] == -1
    assert traj.rewards[-1] == 1.0 and traj.action_mask[-1]
