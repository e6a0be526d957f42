"""The rollout worker end to end: learner stream, engine over HTTP, calculator episodes; and the
TIR set-up (HF tokenizer, chat-template prompt, fence stops) with a scripted generator."""

import asyncio
import collections
import os
import threading

import grain
import pytest

from sao_jax.envs import calculator, python_tool, registry
from sao_jax.envs.base import StepResult, ThreadedEnv
from sao_jax.models import save_hf
from sao_jax.models.config import preset
from sao_jax.rollout.agent import AgentConfig, EnvironmentFailure, run_episode
from sao_jax.rollout.stream import TrajectoryServer
from sao_jax.rollout.worker import WorkerConfig, parse_args, run_worker
from sao_jax.text import CharTokenizer, HFTokenizer, prompt_renderer
from tests.engine.engines import start_engine, stop_engine, toy_model
from tests.rollout.scripted_generator import ScriptedGenerator
from tests.rollout.sglang_stub import StubSGLang

TIR_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "data", "tir",
                             "tokenizer")


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    path = tmp_path_factory.mktemp("worker_model")
    save_hf(toy_model(seed=9), str(path))
    proc, url = start_engine(path)
    yield url
    stop_engine(proc)


def test_worker_plays_every_leased_prompt_once_under_admission(engine_url, tmp_path):
    problems = calculator.heldout_problems(12)
    rows = [{"prompt_id": f"q{i}", "expression": p.expression, "answer": p.answer}
            for i, p in enumerate(problems)]
    prompts = grain.MapDataset.source(rows).to_iter_dataset()
    vocab = preset("toy").vocab_size  # the model's ids, some beyond the tokenizer's 59
    server = TrajectoryServer(str(tmp_path / "learner"), policy_version=None,
                              vocab_size=vocab, prompts=prompts,
                              max_in_flight=3)
    received = []

    def learner():  # takes one trajectory at a time, as a slow learner would
        while len(received) < len(rows):
            batch = server.get_batch(1, timeout=60)
            assert batch, "no trajectory within 60 s"
            received.extend(batch)
            server.consumed([t.trajectory_id for t in batch])

    with server:
        consumer = threading.Thread(target=learner)
        consumer.start()
        config = WorkerConfig(learner=server.address, engines=(engine_url,), concurrency=8,
                              max_turns=3, max_action_tokens=8, vocab_size=vocab)
        counts = asyncio.run(run_worker(config))
        consumer.join(60)
        metrics = server.metrics()
    assert counts["submitted"] == 12 and counts["rejected"] == 0
    assert counts["engine_moves"] == 0 and counts["engine_timeouts"] == 0
    assert sorted(t.prompt_id for t in received) == sorted(r["prompt_id"] for r in rows)
    for traj in received:
        traj.validate(vocab_size=vocab)
        assert traj.num_action_tokens > 0 and traj.lease_id
    # Admission held the worker to 3 episodes in flight although it asked for 8.
    assert metrics["stream/leases_held_back"] > 0


def test_worker_plays_whole_groups_even_when_a_group_exceeds_its_free_slots(engine_url, tmp_path):
    """GRPO leases: each prompt comes as a group of 3 while the worker has 2 slots."""
    problems = calculator.heldout_problems(4)
    rows = [{"prompt_id": f"q{i}", "expression": p.expression, "answer": p.answer}
            for i, p in enumerate(problems)]
    prompts = grain.MapDataset.source(rows).to_iter_dataset()
    vocab = preset("toy").vocab_size
    server = TrajectoryServer(str(tmp_path / "learner"), policy_version=None,
                              vocab_size=vocab, prompts=prompts,
                              maxsize=16, group_size=3)
    with server:
        config = WorkerConfig(learner=server.address, engines=(engine_url,), concurrency=2,
                              max_turns=2, max_action_tokens=4, vocab_size=vocab)
        counts = asyncio.run(run_worker(config))
        received = server.get_batch(12, timeout=10)
    assert counts["submitted"] == 12
    groups = collections.Counter(t.group_id for t in received)
    assert sorted(groups.values()) == [3, 3, 3, 3]
    assert {t.prompt_id for t in received} == {r["prompt_id"] for r in rows}


FLAKY_TRIED: set[str] = set()


class FlakyEnv:
    """One step; by `data["mode"]`: "ok" ends the episode, "once" raises on the prompt's first
    attempt only, "always" raises every time."""

    def __init__(self, data):
        self.data = data

    def reset(self) -> str:
        return "say hi:\n"

    def step(self, action: str) -> StepResult:
        prompt_id, mode = self.data["prompt_id"], self.data["mode"]
        first = prompt_id not in FLAKY_TRIED
        FLAKY_TRIED.add(prompt_id)
        if mode == "always" or (mode == "once" and first):
            raise ValueError(f"bad sample {prompt_id}")
        return StepResult("", 1.0, True, {})


def flaky_env(data, max_turns, options=None):
    return FlakyEnv(data) if data["mode"] != "nobuild" else FlakyEnv(data["missing"])


def run_flaky(engine_url, tmp_path, monkeypatch, modes, **worker_kwargs):
    monkeypatch.setitem(registry.REGISTRY, "flaky", registry.EnvSpec(
        name="flaky", make_env=flaky_env, stop_token_ids=calculator.stop_token_ids,
        rows=lambda config: ([], [])))
    FLAKY_TRIED.clear()
    rows = [{"prompt_id": f"q{i}", "mode": mode} for i, mode in enumerate(modes)]
    vocab = preset("toy").vocab_size
    server = TrajectoryServer(str(tmp_path / "learner"), policy_version=None, vocab_size=vocab,
                              prompts=grain.MapDataset.source(rows).to_iter_dataset())
    with server:
        config = WorkerConfig(learner=server.address, engines=(engine_url,), env="flaky",
                              max_turns=2, max_action_tokens=4, vocab_size=vocab,
                              **{"concurrency": 2, **worker_kwargs})
        try:
            counts = asyncio.run(run_worker(config))
        finally:
            received = server.get_batch(len(rows), timeout=1)
            metrics = server.metrics()
    return counts, received, metrics


def test_a_failing_environment_costs_its_episode_not_the_worker(engine_url, tmp_path,
                                                                monkeypatch):
    counts, received, metrics = run_flaky(engine_url, tmp_path, monkeypatch,
                                          ["ok", "once", "always", "nobuild", "ok"])
    # q1 failed once and was played again; q2 and q3 failed their 3 attempts and were given up.
    assert sorted(t.prompt_id for t in received) == ["q0", "q1", "q4"]
    assert counts["submitted"] == 3 and counts["env_failures"] == 1 + 3 + 3
    assert metrics["stream/episodes_failed"] == 7 and metrics["stream/prompts_given_up"] == 2


def test_a_broken_environment_stops_the_worker(engine_url, tmp_path, monkeypatch):
    # Episodes fail concurrently: the failure that reaches 4 trips the breaker, once, even when
    # others fail while its report is in flight.
    with pytest.raises(RuntimeError, match="failed 4 episodes in a row") as info:
        run_flaky(engine_url, tmp_path, monkeypatch, ["always"] * 8,
                  max_env_failures_in_a_row=4, concurrency=6)
    assert "bad sample" in str(info.value)


def test_the_learner_step_of_a_lease_reaches_an_environment_whose_reward_moves(
        engine_url, tmp_path, monkeypatch):
    """An entry with `step_in_prompt` gets the step its lease carries (`Prompt.learner_step`) as
    `make_env(..., learner_step=)`; any other entry is called without it (`flaky_env` takes no
    such keyword), though the lease carries it too."""
    seen = []

    def stepped_env(data, max_turns, options=None, learner_step=0):
        seen.append((data["prompt_id"], learner_step))
        return FlakyEnv(data)

    monkeypatch.setitem(registry.REGISTRY, "stepped", registry.EnvSpec(
        name="stepped", make_env=stepped_env, stop_token_ids=calculator.stop_token_ids,
        rows=lambda config: ([], []), step_in_prompt=True))
    monkeypatch.setitem(registry.REGISTRY, "flaky", registry.EnvSpec(
        name="flaky", make_env=flaky_env, stop_token_ids=calculator.stop_token_ids,
        rows=lambda config: ([], [])))
    vocab = preset("toy").vocab_size
    for env in ("stepped", "flaky"):
        rows = [{"prompt_id": f"{env}{i}", "mode": "ok"} for i in range(2)]
        server = TrajectoryServer(str(tmp_path / env), policy_version=None, vocab_size=vocab,
                                  prompts=grain.MapDataset.source(rows).to_iter_dataset())
        server.set_learner_step(5)
        with server:
            config = WorkerConfig(learner=server.address, engines=(engine_url,), env=env,
                                  concurrency=2, max_turns=2, max_action_tokens=4,
                                  vocab_size=vocab)
            counts = asyncio.run(run_worker(config))
        assert counts["submitted"] == 2 and counts["env_failures"] == 0, (env, counts)
    assert sorted(seen) == [("stepped0", 5), ("stepped1", 5)]


def test_environment_errors_end_the_episode_as_environment_failures():
    class Broken:
        def reset(self):
            return "x"

        def step(self, action):
            return {}["missing"]

    tok = CharTokenizer()
    generator = ScriptedGenerator(tok, ["hi"])
    with pytest.raises(EnvironmentFailure, match="step 0 raised KeyError") as info:
        asyncio.run(run_episode(generator, Broken(), tok, prompt_id="p",
                                config=AgentConfig(max_turns=2)))
    assert isinstance(info.value.__cause__, KeyError)


def test_worker_config_errors():
    with pytest.raises(ValueError, match="env must be one of"):
        WorkerConfig(learner="x:1", engines=("http://e",), env="chess")
    with pytest.raises(ValueError, match="engines is empty"):
        WorkerConfig(learner="x:1", engines=())
    with pytest.raises(ValueError, match="'python_tool' needs a tokenizer directory"):
        WorkerConfig(learner="x:1", engines=("http://e",), env="python_tool")
    with pytest.raises(ValueError, match="max_env_failures_in_a_row must be >= 1"):
        WorkerConfig(learner="x:1", engines=("http://e",), max_env_failures_in_a_row=0)
    with pytest.raises(ValueError, match="--initial-weight-version.*must be an int >= 0"):
        WorkerConfig(learner="x:1", engines=("http://e",), initial_weight_version=-1)
    with pytest.raises(ValueError, match="--initial-weight-label.*integer label"):
        WorkerConfig(learner="x:1", engines=("http://e",), initial_weight_label="3")
    with pytest.raises(ValueError, match="request_timeout_s must be > 0"):
        WorkerConfig(learner="x:1", engines=("http://e",), request_timeout_s=0)


def test_a_frozen_engine_moves_its_episodes_and_the_worker_counts_the_moves(tmp_path):
    """Two SGLang engines (stubs), one frozen from the start: its episodes time out, move to
    the other and complete; the weight label "default" is the initial version 5."""
    rows = [{"prompt_id": f"q{i}", "expression": "1+1", "answer": 2} for i in range(4)]
    prompts = grain.MapDataset.source(rows).to_iter_dataset()
    server = TrajectoryServer(str(tmp_path / "learner"), policy_version=None,
                              vocab_size=64, prompts=prompts)

    async def play():
        async with StubSGLang() as a, StubSGLang() as b:
            a.freeze()
            config = WorkerConfig(learner=server.address, engines=(a.url, b.url),
                                  concurrency=4, max_turns=2, max_action_tokens=4,
                                  vocab_size=64, request_timeout_s=1.5,  # nothing else times out
                                  initial_weight_version=5)
            try:
                return await run_worker(config), b
            finally:
                a.thaw()

    with server:
        counts, b = asyncio.run(play())
        received = server.get_batch(4, timeout=10)
    assert counts["submitted"] == 4 and counts["engine_moves"] >= 1
    assert counts["engine_timeouts"] >= 1
    assert {body["rid"].split("-")[0] for body in b.generates} == {
        t.trajectory_id for t in received}  # every episode finished on the engine that answers
    for traj in received:
        assert set(traj.weight_versions[traj.action_mask].tolist()) == {5}


# ------------------------------------------------------------------------- TIR: python_tool

def test_python_tool_episode_from_a_leased_row_with_the_chat_prompt():
    tok = HFTokenizer.from_dir(TIR_TOKENIZER)
    spec = registry.get("python_tool")
    env = spec.make_env({"prompt": "How many positive divisors does 12 have?", "answer": "6",
                         "index": 0, "prompt_id": "0"}, 4)
    config = AgentConfig(max_action_tokens=64, stop_token_ids=tuple(spec.stop_token_ids(tok)))
    gen = ScriptedGenerator(tok, ["Six.\nThe answer is \\boxed{6}.<|im_end|>"])
    traj = asyncio.run(run_episode(gen, env, tok, prompt_id="0", config=config,
                                   render_prompt=prompt_renderer(tok)))
    traj.validate(vocab_size=tok.vocab_size)
    text = tok.decode(traj.prompt_ids)
    assert text.startswith("<|im_start|>user\nSolve the problem below.")
    assert text.endswith("Problem: How many positive divisors does 12 have?\n<|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert gen.calls[0][0] == list(traj.prompt_ids)
    assert gen.calls[0][1]["stop_token_ids"] == list(config.stop_token_ids)
    assert traj.rewards.sum() == 1.0 and traj.finish_reason == "stop"
    assert traj.env_metadata["correct"] and traj.env_metadata["answer"] == "6"
    with pytest.raises(ValueError, match="render_prompt or bos_id, not both"):
        asyncio.run(run_episode(gen, env, tok, prompt_id="0", config=config, bos_id=1,
                                render_prompt=prompt_renderer(tok)))


class BarrierEnv:
    """Its step waits until `barrier.parties` episodes step at once; done, reward 1."""

    def __init__(self, barrier):
        self.barrier = barrier

    def reset(self):
        return "go"

    def step(self, action):
        self.barrier.wait()  # BrokenBarrierError after its timeout if the steps run one by one
        return StepResult("", 1.0, True, {})


def test_threaded_env_steps_while_other_episodes_run():
    tok = HFTokenizer.from_dir(TIR_TOKENIZER)
    barrier = threading.Barrier(2, timeout=10)

    async def episodes():
        return await asyncio.gather(*[
            run_episode(ScriptedGenerator(tok, ["x"]), ThreadedEnv(BarrierEnv(barrier)), tok,
                        prompt_id=str(i), config=AgentConfig()) for i in range(2)])

    assert [t.rewards.sum() for t in asyncio.run(episodes())] == [1.0, 1.0]


def test_actions_stop_at_eos_and_a_closing_fence():
    tok = HFTokenizer.from_dir(TIR_TOKENIZER)
    stops = python_tool.stop_token_ids(tok)
    assert stops[0] == tok.eos_id and len(stops) > 1
    assert all(tok.decode([i]).strip() == "```" for i in stops[1:])
    opening, code = "Let me check.\n```python\n", "print(2 ** 10)\n```\n"
    assert not set(tok.encode(opening)) & set(stops)
    assert tok.encode(opening + code)[-1] in stops  # the block's last token ends the action


class FenceTokenizer:
    """Longest match over printable ASCII, "python" and `fences`: a GPT-2-like vocabulary where
    the fence that opens a block is the token that closes it."""

    def __init__(self, fences=("```",)):
        self.vocab = ("<eos>", "python", *fences) + tuple(chr(c) for c in range(32, 127)) + ("\n",)
        self.eos_id, self.vocab_size = 0, len(self.vocab)

    def encode(self, text):
        ids = []
        while text:
            i = max((i for i, t in enumerate(self.vocab) if text.startswith(t)),
                    key=lambda i: len(self.vocab[i]))
            ids.append(i)
            text = text[len(self.vocab[i]):]
        return ids

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)


def test_fence_stop_only_where_the_closing_fence_is_its_own_token():
    assert python_tool.stop_token_ids(FenceTokenizer()) == (0,)  # eos only
    tok = FenceTokenizer(fences=("```", "```\n"))
    assert python_tool.stop_token_ids(tok) == (0, tok.vocab.index("```\n"))


def test_cli_flags_reach_the_config():
    config, parent = parse_args(["--learner", "h:1", "--engine", "http://e", "--env",
                                 "python_tool", "--tokenizer", TIR_TOKENIZER, "--max-turns", "3",
                                 "--max-action-tokens", "200", "--max-response-tokens", "900",
                                 "--parent-pid", "0"])
    assert (config.env, config.tokenizer, config.chat_template) == (
        "python_tool", TIR_TOKENIZER, True)
    assert (config.max_turns, config.max_action_tokens, config.max_response_tokens) == (
        3, 200, 900)
    assert parent == 0
    config, _ = parse_args(["--learner", "h:1", "--engine", "http://e", "--initial-weight-version",
                            "4", "--initial-weight-label", "v4", "--request-timeout-s", "30"])
    assert (config.initial_weight_version, config.initial_weight_label) == (4, "v4")
    assert config.request_timeout_s == 30
    config, _ = parse_args(["--learner", "h:1", "--engine", "http://e", "--no-chat-template"])
    defaults = WorkerConfig(learner="h:1", engines=("http://e",))
    assert not config.chat_template and config.tokenizer is None
    assert config.max_turns == defaults.max_turns
    assert config.max_response_tokens == defaults.max_response_tokens
    assert (config.initial_weight_version, config.initial_weight_label) == (0, "default")
    assert config.request_timeout_s == defaults.request_timeout_s == 600


def test_worker_refuses_a_tokenizer_larger_than_the_model():
    config = WorkerConfig(learner="127.0.0.1:1", engines=("http://e",), env="python_tool",
                          tokenizer=TIR_TOKENIZER, vocab_size=64)
    with pytest.raises(ValueError, match="512 ids, more than the model's vocab_size 64"):
        asyncio.run(run_worker(config))
