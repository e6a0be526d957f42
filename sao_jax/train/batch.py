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
position always exists. `policy_lag[b]` is how many policy versions the row's oldest action token
is behind the step's weights (`collect.policy_lag`; 0: sampled with exactly the weights the step
starts from, so its log-prob gap is the numerics alone).

Packing (`make_batch(..., pack_length=P)`): most trajectories are far shorter than the longest,
so padding every row to one length makes the model mostly read padding. A packed batch also
holds `packing`: the trajectories laid end to end in R rows of P tokens (first-fit decreasing,
R bucketed by `bucket_rows`), each token with its position inside its own trajectory and a
segment id, so that attention stays within a trajectory (`packed_mask`) and RoPE sees the same
positions as in a row of its own. The model runs on those R rows; `packing.index[b, j]` is where
in the flattened `[R * P]` output the value aligned with `[b, j]` above is read, so everything
after the model passes (GAE, losses, metrics) keeps the `[B, L - 1]` layout, with L = P.

Routing replay (`make_batch(..., routes=(layers, top_k))`; docs/models.md, "Routing replay"):
`routes [B, L, layers, top_k]` int32 holds each token's `Trajectory.routed_experts` (the experts
the engine routed it to; -1 where none: padding, the last token, a trajectory without them),
aligned with `tokens`, and packed batches hold them per model row (`Packing.routes`). The
policy's passes replay them (`model_rows`); the critic routes itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from sao_jax.rollout.trajectory import Trajectory


class Packing(NamedTuple):
    """The `R x P` model rows of a packed batch (module docstring)."""

    tokens: np.ndarray  # [R, P] int32, trajectories end to end, then padding
    positions: np.ndarray  # [R, P] int32, each token's position within its trajectory
    segments: np.ndarray  # [R, P] int32, the batch row each token comes from (-1: padding)
    targets: np.ndarray  # [R, P] int32, the next token of the same trajectory (0 at its end)
    index: np.ndarray  # [B, P - 1] int32, into the flattened [R * P] outputs
    routes: np.ndarray | None = None  # [R, P, layers, top_k] int32: routing replay, -1 none


class Rows(NamedTuple):
    """The padded rows of an unpacked batch with the experts to replay (`model_inputs`)."""

    tokens: np.ndarray  # [B, L] int32
    routes: np.ndarray  # [B, L, layers, top_k] int32


class Batch(NamedTuple):
    """`B` trajectories as arrays (see the module docstring for the alignment)."""

    tokens: np.ndarray  # [B, L] int32
    action_mask: np.ndarray  # [B, L - 1] bool
    rollout_logp: np.ndarray  # [B, L - 1] float32
    rewards: np.ndarray  # [B, L - 1] float32
    truncated: np.ndarray  # [B] bool
    last_index: np.ndarray  # [B] int32
    prompt_index: np.ndarray  # [B] int32, the running-mean slot of each row's prompt
    packing: Packing | None = None  # the model's rows when packed
    routes: np.ndarray | None = None  # [B, L, layers, top_k] int32: routing replay, -1 none
    policy_lag: np.ndarray | None = None  # [B] int32, versions behind the step's weights


LONG_ROW = 65_536  # rows longer than this bucket to multiples of LONG_ROW_STEP
LONG_ROW_STEP = 16_384


def bucket_length(n: int, minimum: int = 32) -> int:
    """The smallest bucket >= max(n, minimum): a power of two or, from 192 on, 1.5 times one
    (32, 64, 128, 192, 256, 384, 512, 768, ...), so padding costs at most a third of a row while
    a run still compiles only a handful of shapes; past `LONG_ROW` a multiple of
    `LONG_ROW_STEP` (81,920, 98,304, ...), where a third would be a third of the step: a
    128k-token agent row plus its next token (131,073) gets 147,456, not 196,608."""
    n = max(int(n), minimum, 1)
    if n > LONG_ROW:
        return -(-n // LONG_ROW_STEP) * LONG_ROW_STEP
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


def bucket_rows(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5 times one)
    that is >= n: the packed row counts, so a run compiles a handful of shapes."""
    n = max(int(n), 1)
    power = 1 << (n - 1).bit_length()
    three_halves = 3 * power // 4
    return three_halves if three_halves >= n else power


def packed_row_counts(batch_size: int, multiple: int = 1) -> list[int]:
    """Every row count R a packed batch of `batch_size` trajectories can have, each rounded up
    to a multiple of `multiple` (the mesh's batch shards): the step's packed shapes."""
    return sorted({_packed_rows(n, batch_size, multiple) for n in range(1, batch_size + 1)})


def _packed_rows(bins: int, batch_size: int, multiple: int) -> int:
    rows = min(bucket_rows(bins), batch_size)
    return -(-rows // multiple) * multiple


def batch_shapes(rows: int, length: int, packed_rows: int | None = None,
                 routes: tuple[int, int] | None = None) -> Batch:
    """The shapes and dtypes of a `make_batch` batch of `rows` rows of bucketed `length`, or
    with `packed_rows`, of one packed into that many model rows of `length` tokens; with
    `routes = (layers, top_k)`, one that carries the experts to replay."""
    token, row = (rows, length - 1), (rows,)
    packing = batch_routes = None
    if packed_rows is not None:
        model = ((packed_rows, length), np.int32)
        packing = Packing(tokens=model, positions=model, segments=model, targets=model,
                          index=(token, np.int32),
                          routes=None if routes is None else ((packed_rows, length, *routes),
                                                              np.int32))
    elif routes is not None:
        batch_routes = ((rows, length, *routes), np.int32)
    return Batch(tokens=((rows, length), np.int32), action_mask=(token, np.bool_),
                 rollout_logp=(token, np.float32), rewards=(token, np.float32),
                 truncated=(row, np.bool_), last_index=(row, np.int32),
                 prompt_index=(row, np.int32), packing=packing, routes=batch_routes,
                 policy_lag=(row, np.int32))


def is_shape(x) -> bool:
    """Whether `x` is a `(shape, dtype)` leaf of `batch_shapes`."""
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], type)


def make_batch(trajectories: Sequence[Trajectory], *, pad_id: int = 0,
               prompt_index: Sequence[int] | None = None, min_length: int = 32,
               pack_length: int | None = None, row_multiple: int = 1,
               routes: tuple[int, int] | None = None,
               policy_lag: Sequence[int] | None = None) -> Batch:
    """`trajectories` as a `Batch`, rows in the given order; with `pack_length` (P), every
    per-token array is `[B, P - 1]` and `packing` lays the trajectories into model rows of P
    tokens, their count a multiple of `row_multiple`. With `routes = (layers, top_k)` (routing
    replay), each trajectory's `routed_experts` go along (module docstring); a trajectory
    without them routes itself (-1), one of another shape is refused. `policy_lag`: each
    row's (default 0: every row fresh)."""
    if not trajectories:
        raise ValueError("make_batch needs at least one trajectory.")
    if policy_lag is not None and len(policy_lag) != len(trajectories):
        raise ValueError(f"policy_lag has {len(policy_lag)} entries for {len(trajectories)} "
                         "trajectories; give one per trajectory.")
    lengths = [len(t.prompt_ids) + t.length for t in trajectories]
    b = len(trajectories)
    if pack_length is None:
        length = bucket_length(max(lengths) + 1, min_length)
    elif max(lengths) + 1 > pack_length:
        longest = int(np.argmax(lengths))
        raise ValueError(f"trajectory {trajectories[longest].trajectory_id} has "
                         f"{lengths[longest]} tokens; packed rows of pack_length={pack_length} "
                         f"hold at most {pack_length - 1} (raise the pack length to at least "
                         f"{lengths[longest] + 1}).")
    else:
        length = pack_length
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
    token_routes = None if routes is None else _routes(trajectories, length, routes)
    packing = None if pack_length is None else pack(tokens, lengths, row_multiple,
                                                    routes=token_routes)
    return Batch(tokens=tokens, action_mask=mask, rollout_logp=logp, rewards=rewards,
                 truncated=np.array([t.truncated for t in trajectories], bool),
                 last_index=np.array(lengths, np.int32) - 1,
                 prompt_index=np.asarray(prompt_index, np.int32), packing=packing,
                 routes=token_routes if packing is None else None,
                 policy_lag=np.zeros(b, np.int32) if policy_lag is None
                 else np.asarray(policy_lag, np.int32))


def _routes(trajectories: Sequence[Trajectory], length: int, shape: tuple[int, int]
            ) -> np.ndarray:
    """`[B, length, *shape]` int32: each trajectory's `routed_experts` from its first token, -1
    after them and for a trajectory without any."""
    out = np.full((len(trajectories), length, *shape), -1, np.int32)
    for i, t in enumerate(trajectories):
        routes = t.routed_experts
        if not routes.size:
            continue
        if routes.shape[1:] != tuple(shape):
            raise ValueError(f"trajectory {t.trajectory_id}: routed_experts hold [layers, top_k] "
                             f"= {list(routes.shape[1:])} per token, the policy has "
                             f"{list(shape)}: the engine serves another model.")
        out[i, :len(routes)] = routes
    return out


def pack(tokens: np.ndarray, lengths: Sequence[int], row_multiple: int = 1,
         routes: np.ndarray | None = None) -> Packing:
    """Lays the first `lengths[b]` tokens of each row of `tokens` `[B, P]` (and of `routes`
    `[B, P, layers, top_k]`, if any) end to end into model rows of P tokens (first-fit
    decreasing), for `Batch.packing`."""
    b, p = tokens.shape
    free: list[int] = []  # tokens left in each model row
    place = np.zeros((b, 2), np.int64)  # (model row, start) of each batch row
    for i in sorted(range(b), key=lambda i: -lengths[i]):
        row = next((r for r, left in enumerate(free) if left >= lengths[i]), len(free))
        if row == len(free):
            free.append(p)
        place[i] = row, p - free[row]
        free[row] -= lengths[i]
    rows = _packed_rows(len(free), b, row_multiple)
    packed = np.zeros((rows, p), np.int32)
    positions = np.broadcast_to(np.arange(p, dtype=np.int32), (rows, p)).copy()
    segments = np.full((rows, p), -1, np.int32)
    targets = np.zeros((rows, p), np.int32)
    index = np.zeros((b, p - 1), np.int32)
    packed_routes = None if routes is None else np.full((rows, *routes.shape[1:]), -1, np.int32)
    for i, n in enumerate(lengths):
        row, start = place[i]
        span = slice(start, start + n)
        packed[row, span] = tokens[i, :n]
        if routes is not None:
            packed_routes[row, span] = routes[i, :n]
        positions[row, span] = np.arange(n)
        segments[row, span] = i
        targets[row, start:start + n - 1] = tokens[i, 1:n]
        # Output j of batch row i is read at its j-th token; past its last token (padding,
        # masked everywhere) at the last token, so every index points into its own segment.
        index[i] = row * p + start + np.minimum(np.arange(p - 1), n - 1)
    return Packing(tokens=packed, positions=positions, segments=segments, targets=targets,
                   index=index, routes=packed_routes)


def packed_mask(segments, positions):
    """`[R, P, P]` attention mask of packed rows: causal within each trajectory (and among
    the padding at a row's end). Works on NumPy and JAX arrays alike."""
    same = segments[:, None, :] == segments[:, :, None]
    return same & (positions[:, None, :] <= positions[:, :, None])


def model_inputs(batch: Batch):
    """What the model passes of the learner step read: the packed rows, the padded `tokens`,
    or with routes to replay, `Rows` of both."""
    if batch.packing is not None:
        return batch.packing
    return batch.tokens if batch.routes is None else Rows(batch.tokens, batch.routes)


def model_rows(inputs):
    """`(ids, positions, segments, replay)` the model reads for `inputs` (`model_inputs`;
    defaults: None): a packed row's trajectories are its segments, each attending only to
    itself (`packed_mask`; the model forms the mask, or attends blockwise without one:
    `ModelConfig.attention`); `replay`, the experts to replay at each of its tokens (routing
    replay)."""
    if isinstance(inputs, Packing):
        return inputs.tokens, inputs.positions, inputs.segments, inputs.routes
    if isinstance(inputs, Rows):
        return inputs.tokens[:, :-1], None, None, inputs.routes[:, :-1]
    return inputs[:, :-1], None, None, None


def model_targets(inputs):
    """`[B, L - 1]` the tokens an unpacked batch's outputs predict (packed: `Packing.targets`)."""
    return (inputs.tokens if isinstance(inputs, Rows) else inputs)[:, 1:]


def batch_rows(x, inputs):
    """Per-position outputs `x` of `model_rows(inputs)` in the batch's `[B, L - 1]` layout."""
    if isinstance(inputs, Packing):
        return x.reshape(-1)[inputs.index]
    return x
