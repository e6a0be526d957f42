"""Held-out evaluation through the inference engines, with the training agent loop.

Pass@1 as the paper evaluates it: one episode per held-out prompt, sampled at temperature 1, the
fraction that earns reward > 0. Greedy accuracy (temperature 0) is measured beside it. Episodes run
through the same `agent.run_episode` and environments as training, so what is evaluated is what is
trained.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence

from sao_jax.rollout.agent import AgentConfig, close_env, run_episode
from sao_jax.rollout.client import SGLangClient


@dataclasses.dataclass(frozen=True)
class EvalResult:
    accuracy: float  # fraction of episodes with a positive total reward
    mean_reward: float
    episodes: int
    response_tokens: float  # mean per episode
    env_metadata: tuple[Mapping, ...] = ()  # each episode's, in the order of the rows


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
            return float(traj.rewards.sum()), traj.length, traj.env_metadata

    results = await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))
    rewards = [r for r, _, _ in results]
    return EvalResult(accuracy=sum(r > 0 for r in rewards) / len(rewards),
                      mean_reward=sum(rewards) / len(rewards), episodes=len(rewards),
                      response_tokens=sum(n for _, n, _ in results) / len(results),
                      env_metadata=tuple(m for _, _, m in results))


def evaluate(urls: Sequence[str], rows: Sequence[Mapping], **kwargs) -> EvalResult:
    """`evaluate_async` on a fresh client (blocking)."""

    async def go():
        async with SGLangClient(list(urls)) as client:
            return await evaluate_async(client, rows, **kwargs)

    return asyncio.run(go())
