"""Trajectories -> one padded array batch for the learner's jitted step.

A row holds one trajectory: `tokens = prompt + response`, right-padded to a bucketed length L
(`bucket_length`: powers of two and, from 192 on, 1.5 times one, so a run compiles a handful of
shapes). The model reads `tokens[:, :-1]`; output position j predicts token j + 1, so every
per-token array of the step is `[B, L - 1]` and indexed like `tokens[:, 1:]`:

    action_mask[b, j]   token j + 1 is an action (prompt, observations and padding: False)
    rollout_logp[b, j]  the engine's log-prob of token j + 1 (0 off the mask)
    rewards[b, j]       reward on token j + 1
    values[b, j]        V(state before token j + 1), read from the hidden state at token j

`last_index[b]` is the position of the row's final real token, whose output is V(state after the
trajectory): the `last_value` of truncated rows. L is at least one longer than every row, so that
position always exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from sao_jax.rollout.trajectory import Trajectory


class Batch(NamedTuple):
    """`B` trajectories as arrays (see the module docstring for the alignment)."""

    tokens: np.ndarray  # [B, L] int32
    action_mask: np.ndarray  # [B, L - 1] bool
    rollout_logp: np.ndarray  # [B, L - 1] float32
    rewards: np.ndarray  # [B, L - 1] float32
    truncated: np.ndarray  # [B] bool
    last_index: np.ndarray  # [B] int32
    prompt_index: np.ndarray  # [B] int32, the running-mean slot of each row's prompt


def bucket_length(n: int, minimum: int = 32) -> int:
    """The smallest bucket >= max(n, minimum): a power of two or, from 192 on, 1.5 times one
    (32, 64, 128, 192, 256, 384, 512, 768, ...), so padding costs at most a third of a long row
    while a run still compiles only a handful of shapes."""
    n = max(int(n), minimum, 1)
    power = 1 << (n - 1).bit_length()
    three_halves = 3 * power // 4  # 1.5 times the power of two below
    return three_halves if three_halves >= max(n, 192) else power


def batch_lengths(longest_row: int, minimum: int = 32) -> list[int]:
    """Every bucketed length `make_batch` gives batches whose rows hold at most `longest_row`
    tokens (prompt + response): the learner step's shapes, for compiling them ahead of time."""
    lengths = [bucket_length(1, minimum)]
    while lengths[-1] < bucket_length(longest_row + 1, minimum):
        lengths.append(bucket_length(lengths[-1] + 1, minimum))
    return lengths


def batch_shapes(rows: int, length: int) -> Batch:
    """The shapes and dtypes of a `make_batch` batch of `rows` rows of bucketed `length`."""
    token, row = (rows, length - 1), (rows,)
    return Batch(tokens=((rows, length), np.int32), action_mask=(token, np.bool_),
                 rollout_logp=(token, np.float32), rewards=(token, np.float32),
                 truncated=(row, np.bool_), last_index=(row, np.int32),
                 prompt_index=(row, np.int32))


def make_batch(trajectories: Sequence[Trajectory], *, pad_id: int = 0,
               prompt_index: Sequence[int] | None = None, min_length: int = 32) -> Batch:
    """Packs `trajectories` into a `Batch`, rows in the given order."""
    if not trajectories:
        raise ValueError("make_batch needs at least one trajectory.")
    lengths = [len(t.prompt_ids) + t.length for t in trajectories]
    b, length = len(trajectories), bucket_length(max(lengths) + 1, min_length)
    tokens = np.full((b, length), pad_id, np.int32)
    mask = np.zeros((b, length - 1), bool)
    logp = np.zeros((b, length - 1), np.float32)
    rewards = np.zeros((b, length - 1), np.float32)
    for i, t in enumerate(trajectories):
        p, n = len(t.prompt_ids), t.length
        if p < 1:
            raise ValueError(f"trajectory {t.trajectory_id}: an empty prompt leaves nothing to "
                             "condition the first token on.")
        tokens[i, :p] = t.prompt_ids
        tokens[i, p:p + n] = t.response_ids
        response = slice(p - 1, p - 1 + n)  # position j predicts token j + 1
        mask[i, response] = t.action_mask
        logp[i, response] = np.where(t.action_mask, t.rollout_logprobs, 0.0)
        rewards[i, response] = t.rewards
    if prompt_index is None:
        prompt_index = np.zeros(b, np.int32)
    return Batch(tokens=tokens, action_mask=mask, rollout_logp=logp, rewards=rewards,
                 truncated=np.array([t.truncated for t in trajectories], bool),
                 last_index=np.array(lengths, np.int32) - 1,
                 prompt_index=np.asarray(prompt_index, np.int32))


def outcome_rewards(trajectories: Sequence[Trajectory]) -> np.ndarray:
    """`[B]` total reward of each trajectory."""
    return np.array([float(np.sum(t.rewards)) for t in trajectories], np.float32)
