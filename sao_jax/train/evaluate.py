"""Held-out evaluation through the inference engines, with the training agent loop.

Pass@1 as the paper evaluates it: one episode per held-out prompt, sampled at temperature 1, the
fraction that earns reward > 0. Greedy accuracy (temperature 0) is measured beside it. Episodes run
through the same `agent.run_episode` and environments as training, so what is evaluated is what is
trained. `write_episodes` keeps an evaluation's episodes (transcripts, rewards, env metadata);
`held_out` is a training run's evaluation (both scores, the episodes under `<workdir>/held_out/`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from sao_jax.rollout.agent import AgentConfig, close_env, run_episode
from sao_jax.rollout.client import SGLangClient
from sao_jax.train.console import trajectory_text

if TYPE_CHECKING:
    from sao_jax.train.tasks import Task

HELD_OUT_DIR = "held_out"  # <workdir>/held_out/step_<N>.jsonl: each evaluation's episodes


@dataclasses.dataclass(frozen=True)
class EvalResult:
    accuracy: float  # fraction of episodes with a positive total reward
    mean_reward: float
    episodes: int
    response_tokens: float  # mean per episode
    env_metadata: tuple[Mapping, ...] = ()  # each episode's, in the order of the rows
    rewards: tuple[float, ...] = ()  # each episode's total reward, in the order of the rows
    transcripts: tuple[str, ...] = ()  # each episode as Markdown (console.trajectory_text)


async def evaluate_async(client: SGLangClient, rows: Sequence[Mapping], *,
                         make_env: Callable, tokenizer, agent: AgentConfig,
                         render_prompt: Callable | None = None, chat=None,
                         concurrency: int = 64) -> EvalResult:
    """Plays one episode per row of `rows` (prompt data, as leased to workers); `chat`: the
    observations' chat deltas, as the workers build them (`text.chat_deltas`)."""
    if not rows:
        raise ValueError("evaluation needs at least one held-out prompt")
    gate = asyncio.Semaphore(concurrency)

    async def one(i, row):
        async with gate:
            env = make_env(row, agent.max_turns)
            prompt = ({"render_prompt": render_prompt} if render_prompt
                      else {"bos_id": getattr(tokenizer, "bos_id", None)})
            try:
                traj = await run_episode(client, env, tokenizer, prompt_id=str(i),
                                         config=agent, trajectory_id=f"eval-{i}", chat=chat,
                                         **prompt)
            finally:
                await close_env(env)
            return (float(traj.rewards.sum()), traj.length, traj.env_metadata,
                    trajectory_text(traj, tokenizer))

    results = await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))
    rewards = [r for r, _, _, _ in results]
    return EvalResult(accuracy=sum(r > 0 for r in rewards) / len(rewards),
                      mean_reward=sum(rewards) / len(rewards), episodes=len(rewards),
                      response_tokens=sum(n for _, n, _, _ in results) / len(results),
                      env_metadata=tuple(m for _, _, m, _ in results), rewards=tuple(rewards),
                      transcripts=tuple(t for _, _, _, t in results))


def evaluate(urls: Sequence[str], rows: Sequence[Mapping], **kwargs) -> EvalResult:
    """`evaluate_async` on a fresh client (blocking)."""

    async def go():
        async with SGLangClient(list(urls)) as client:
            return await evaluate_async(client, rows, **kwargs)

    return asyncio.run(go())


def write_episodes(path: str, runs: Mapping[str, EvalResult]) -> None:
    """Writes the held-out episodes of an evaluation to `path` (JSON lines, replaced whole): one
    line per episode, `{"mode", "index", "reward", "env_metadata", "text"}`, `mode` a key of
    `runs` ("accuracy": sampled, "greedy_accuracy": greedy) and `index` the held-out row's. What
    a policy did on the held-out tasks, to read (`text`: console.trajectory_text) and to check
    (`env_metadata`: e.g. the SWE grader's `reward_reason` and the monitor's counts)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for mode, result in runs.items():
            for i, (reward, metadata, text) in enumerate(zip(
                    result.rewards, result.env_metadata, result.transcripts, strict=True)):
                f.write(json.dumps({"mode": mode, "index": i, "reward": reward,
                                    "env_metadata": dict(metadata), "text": text}) + "\n")
    os.replace(tmp, path)


def held_out_runs(config, task: Task, urls: Sequence[str]) -> dict[str, EvalResult]:
    """The held-out episodes of `task` on the engines at `urls`: sampled ("accuracy",
    temperature 1) and greedy ("greedy_accuracy"), `config.rollout.worker_concurrency` at once."""
    return {key: evaluate(urls, task.eval_rows, make_env=task.make_env,
                          tokenizer=task.tokenizer, agent=task.eval_agent(temperature),
                          render_prompt=task.render_prompt, chat=task.chat,
                          concurrency=config.rollout.worker_concurrency)
            for key, temperature in (("accuracy", 1.0), ("greedy_accuracy", 0.0))}


def scores(runs: Mapping[str, EvalResult]) -> dict[str, float]:
    """`accuracy`, `greedy_accuracy` and `response_tokens` (sampled) of `held_out_runs`."""
    return {"accuracy": runs["accuracy"].accuracy,
            "greedy_accuracy": runs["greedy_accuracy"].accuracy,
            "response_tokens": runs["accuracy"].response_tokens}


def held_out(config, task: Task, urls: Sequence[str], workdir: str, step: int
             ) -> dict[str, float]:
    """A training run's evaluation at `step`: the `scores`; the episodes go to
    `<workdir>/held_out/step_<step>.jsonl` (`write_episodes`)."""
    runs = held_out_runs(config, task, urls)
    os.makedirs(os.path.join(workdir, HELD_OUT_DIR), exist_ok=True)
    write_episodes(os.path.join(workdir, HELD_OUT_DIR, f"step_{step}.jsonl"), runs)
    return scores(runs)
