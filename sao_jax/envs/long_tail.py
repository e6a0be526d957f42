"""A synthetic multi-turn task whose episode lengths are heavy-tailed: the async benchmark's load.

Each prompt fixes how many actions its episode takes (`turns`); the environment answers every
action but the last with the same short observation and ends the episode after `turns` actions.
Turn counts are drawn log-normal, so most episodes are short and a few are many times longer,
as agentic rollouts are: a synchronous learner waits for the slowest episode of every batch,
an asynchronous one trains on the short ones meanwhile (`benchmarks/bench_async.py`).

Reward: the fraction of the actions that contain a digit; deterministic, and it varies with what
the policy writes, so advantages are not all zero.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from sao_jax.envs.base import StepResult
from sao_jax.text import CharTokenizer

OBSERVATION = "<res>ok</res>\n"
MEDIAN_TURNS = 2.0
SIGMA = 1.0  # of log(turns): p99 / median = exp(2.326 * SIGMA) ~ 10 before clamping


def turn_counts(count: int, *, seed: int, max_turns: int, median: float = MEDIAN_TURNS,
                sigma: float = SIGMA) -> np.ndarray:
    """`count` turn counts, log-normal with the given median and log-space sigma, rounded and
    clamped to [1, max_turns]; int64 of shape (count,)."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}.")
    draws = np.random.default_rng(seed).lognormal(math.log(median), sigma, size=count)
    return np.clip(np.rint(draws), 1, max_turns).astype(np.int64)


def max_turns_within(max_response_tokens: int, max_action_tokens: int,
                     tokenizer: CharTokenizer | None = None) -> int:
    """The most turns whose actions (each up to `max_action_tokens`) and observations fit in a
    response of `max_response_tokens` tokens (at least 1)."""
    observation = len((tokenizer or CharTokenizer()).encode(OBSERVATION))
    return max(1, (max_response_tokens + observation) // (max_action_tokens + observation))


@dataclasses.dataclass
class LongTailEnv:
    """An episode of exactly `turns` actions; reward = fraction of actions with a digit."""

    turns: int

    def __post_init__(self):
        if self.turns < 1:
            raise ValueError(f"LongTailEnv.turns must be >= 1, got {self.turns}.")
        self.actions: list[str] = []

    def reset(self) -> str:
        self.actions = []
        return f"talk for {self.turns} turns:\n"

    def step(self, action: str) -> StepResult:
        self.actions.append(action)
        info = {"turns": len(self.actions), "truncated": False}
        if len(self.actions) < self.turns:
            return StepResult(OBSERVATION, 0.0, False, info)
        reward = sum(any(c.isdigit() for c in a) for a in self.actions) / self.turns
        return StepResult("", reward, True, info)


# ------------------------------------------------------------ the registry's entry (registry.py)

def make_env(data, max_turns: int, options=None) -> LongTailEnv:
    return LongTailEnv(int(data["turns"]))


def rows(config) -> tuple[list, list]:
    """Turn counts drawn log-normal (`turn_counts`), clamped to `env.max_turns` and to what fits
    in `env.max_response_tokens`; eval rows from their own seed."""
    env = config.env
    max_turns = min(env.max_turns, max_turns_within(env.max_response_tokens,
                                                    env.max_action_tokens))
    n = env.num_train_prompts or 1024
    train = [{"index": i, "prompt_id": str(i), "turns": int(t)}
             for i, t in enumerate(turn_counts(n, seed=config.seed, max_turns=max_turns))]
    evals = [{"turns": int(t)} for t in turn_counts(
        env.num_eval_prompts, seed=config.seed + 1_000_003, max_turns=max_turns)]
    return train, evals
