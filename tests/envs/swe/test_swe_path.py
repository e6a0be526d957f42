"""The whole SWE path on bundled tasks: learner stream, rollout worker, an engine over HTTP that
replays the scripted expert's tokens, workspaces (namespace, and podman containers of the Debian
base image), the grader, and a learner step.

Every expert trajectory earns reward 1 and a do-nothing policy (submit at once) earns 0; the
trajectories arrive token-exact (the chat template's deltas between the sampled ids) and train.
"""

import asyncio
import functools
import os
import threading

import grain
import numpy as np
import pytest
from aiohttp import web
from flax import nnx

from sao_jax.envs.swe import expert
from sao_jax.envs.swe.env import SUBMIT_MARKER, SWEEnv
from sao_jax.envs.swe.options import env_config
from sao_jax.envs.swe.tasks import load_tasks
from sao_jax.models import CausalLM
from sao_jax.models.config import preset
from sao_jax.rollout.stream import TrajectoryServer
from sao_jax.rollout.worker import WorkerConfig, run_worker
from sao_jax.text import ChatDeltas, HFTokenizer, prompt_renderer
from sao_jax.train.algorithms import get_algorithm
from sao_jax.train.batch import make_batch
from sao_jax.train.optimizers import critic_optimizer_config, policy_optimizer_config
from sao_jax.train.steps import StepConfig, Trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
TASKS = os.path.join(REPO, "experiments", "data", "swe_mini", "tasks.jsonl")
TOKENIZER = os.path.join(REPO, "experiments", "data", "tir", "tokenizer")
OPTIONS = {"command_timeout": 20.0, "output_chars": 1000}
MAX_TURNS = 6


class ReplayEngine:
    """SGLang's `/generate` over HTTP, answering each episode's turn k with reply k of a script.

    The episode is found by its prompt (the first ids of the request), the turn by the
    end-of-turn tokens after it: two per finished turn (the action's own, and the one closing the
    observation's user message)."""

    def __init__(self, scripts: dict[tuple, list[list[int]]], end_of_turn: int):
        self.scripts, self.end_of_turn = scripts, end_of_turn
        self.requests = 0
        self.url = None

    async def generate(self, request):
        body = await request.json()
        ids = body["input_ids"]
        self.requests += 1
        for prompt, replies in self.scripts.items():
            if tuple(ids[:len(prompt)]) == prompt:
                turn = ids[len(prompt):].count(self.end_of_turn) // 2
                out = replies[turn]
                break
        else:
            return web.json_response({"error": "unknown prompt"}, status=400)
        return web.json_response({"output_ids": out, "meta_info": {
            "output_token_logprobs": [[-0.5, t, None] for t in out],
            "finish_reason": {"type": "stop"}, "weight_version": "0",
            "prompt_tokens": len(ids), "completion_tokens": len(out)}})

    def __enter__(self):
        started = threading.Event()

        def serve():
            self.loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_post("/generate", self.generate)
            self.runner = web.AppRunner(app)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert started.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module", params=["namespace", "podman"])
def setting(request, isolated):
    options = {**OPTIONS, "backend": request.param}
    if request.param == "podman":
        options["image_template"] = request.getfixturevalue("image")
    tasks = load_tasks(TASKS)
    tasks = [tasks[i] for i in (2, 17, 33)]  # three modules, three mutation kinds
    tok = HFTokenizer.from_dir(TOKENIZER)
    return tasks, tok, ChatDeltas(tok), options


def play(tasks, tok, chat, options, replies_of, tmp_path):
    """Runs the worker over `tasks` against a replay engine; returns the trajectories."""
    render = prompt_renderer(tok)
    config = env_config(options, MAX_TURNS)
    scripts = {}
    for task in tasks:
        prompt = tuple(render(SWEEnv(task, config, grader=None).reset()))
        scripts[prompt] = [tok.encode(text) + [chat.end_of_turn_id]
                           for text in replies_of(task)]
    rows = [{"index": i, "prompt_id": str(i), "task": t.to_row()} for i, t in enumerate(tasks)]
    vocab = preset("toy512").vocab_size
    server = TrajectoryServer(str(tmp_path / "learner"), policy_version=None, vocab_size=vocab,
                              prompts=grain.MapDataset.source(rows).to_iter_dataset())
    with server, ReplayEngine(scripts, chat.end_of_turn_id) as engine:
        worker = WorkerConfig(learner=server.address, engines=(engine.url,), env="swe",
                              concurrency=3, max_turns=MAX_TURNS, max_action_tokens=384,
                              max_response_tokens=1536, tokenizer=TOKENIZER, vocab_size=vocab,
                              env_options=options)
        counts = asyncio.run(run_worker(worker))
        received = server.get_batch(len(tasks), timeout=30)
    assert counts["submitted"] == len(tasks) and counts["env_failures"] == 0, counts
    by_prompt = {t.prompt_id: t for t in received}
    return [by_prompt[str(i)] for i in range(len(tasks))], scripts


@functools.cache  # one compilation for both backends
def sao_trainer() -> Trainer:
    return Trainer(CausalLM(preset("toy512"), nnx.Rngs(0)),
                   StepConfig(algorithm=get_algorithm("sao"), gae_impl="reference"),
                   policy_optimizer=policy_optimizer_config(1e-3),
                   critic_optimizer=critic_optimizer_config(1e-3), num_prompts=3)


def test_expert_trajectories_earn_1_and_train(setting, tmp_path):
    tasks, tok, chat, options = setting
    trajectories, scripts = play(tasks, tok, chat, options, lambda t: expert.expert_actions(
        t, compact=True), tmp_path)
    for traj, task, replies in zip(trajectories, tasks, scripts.values(), strict=True):
        traj.validate(vocab_size=512)
        assert float(traj.rewards.sum()) == 1.0, traj.env_metadata
        meta = traj.env_metadata
        assert meta["resolved"] and meta["submitted"] and meta["turns"] == len(replies)
        assert meta["format_errors"] == 0 and meta["timeouts"] == 0
        # the reward sits on the submission's last token; the actions are the replayed ids
        assert traj.rewards[np.flatnonzero(traj.action_mask)[-1]] == 1.0
        actions = traj.response_ids[traj.action_mask]
        np.testing.assert_array_equal(actions, np.concatenate(replies))
        # the prompt is the task's, in the chat template; observations are user-message deltas
        prompt = chat.render([{"role": "user", "content": SWEEnv(
            task, env_config(options, MAX_TURNS), grader=None).reset()}], True)
        assert tok.decode(traj.prompt_ids) == prompt and task.problem_statement.strip() in prompt
        assert "<|im_start|>user\n<returncode>0</returncode>" in tok.decode(traj.response_ids)

    # A learner step (SAO) on them: finite, and the policy moves.
    trainer = sao_trainer()
    state = trainer.init_state()
    batch = make_batch(trajectories, prompt_index=[0, 1, 2])
    state, metrics = trainer.step(state, batch, update_policy=True)
    for name, value in metrics.items():
        assert np.isfinite(np.asarray(value)).all(), name
    assert int(state.version) == 1


def test_a_do_nothing_policy_earns_0(setting, tmp_path):
    tasks, tok, chat, options = setting
    submit = [f"Done.\n```bash\necho {SUBMIT_MARKER}\n```\n"]
    trajectories, _ = play(tasks, tok, chat, options, lambda t: submit, tmp_path)
    for traj in trajectories:
        assert float(traj.rewards.sum()) == 0.0
        assert traj.env_metadata["submitted"] and not traj.env_metadata["resolved"]
        assert "empty patch" in traj.env_metadata["reward_reason"]
