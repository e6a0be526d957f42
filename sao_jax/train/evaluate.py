"""Held-out evaluation through the inference engines, with the training agent loop.

Pass@1 as the paper evaluates it: one episode per held-out prompt, sampled at temperature 1, the
fraction that earns reward > 0. Greedy accuracy (temperature 0) is measured beside it. Episodes run
through the same `agent.run_episode` and environments as training, so what is evaluated is what is
trained. `write_episodes` keeps an evaluation's episodes (transcripts, rewards, env metadata).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence

from sao_jax.rollout.agent import AgentConfig, close_env, run_episode
from sao_jax.rollout.client import SGLangClient
from sao_jax.train.console import trajectory_text


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
    observations' chat deltas, as the workers build them (`rollout.chat.ChatDeltas`)."""
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
