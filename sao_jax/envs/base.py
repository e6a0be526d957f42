"""What every environment speaks: the `Environment` protocol and `StepResult`.

An environment is text in, text out: `reset()` gives the episode's first text (the prompt), and
`step(action)` reads the text the model generated this turn and answers with a `StepResult`, or
with an awaitable of one (an environment that runs code steps in a thread, so that the other
episodes of a worker go on meanwhile; `ThreadedEnv`). The agent loop (`rollout/agent.py`)
tokenises (through the text layer, `sao_jax/text`); an environment never sees ids. `registry.py`
says how each environment is built and fed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: str  # text to append after the action ("" when done)
    reward: float
    done: bool
    # Facts of the episode; scalar values go into the trajectory's `env_metadata` (an environment
    # that ends early for lack of turns sets "truncated": True).
    info: dict


class Environment(Protocol):
    def reset(self) -> str: ...
    # -> StepResult, or an awaitable of it
    def step(self, action: str): ...


class ThreadedEnv:
    """`env` whose `step` runs in a thread: a sandboxed program takes up to its wall-clock limit,
    and the other episodes of the worker go on meanwhile."""

    def __init__(self, env):
        self.env = env

    def reset(self) -> str:
        return self.env.reset()

    async def step(self, action: str):
        return await asyncio.to_thread(self.env.step, action)
