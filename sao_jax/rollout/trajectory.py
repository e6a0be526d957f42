"""One rollout as the learner receives it, its validation, and its wire form.

Per-token arrays run over the response (everything after the prompt); position t is token t of the
response (docs/algorithm.md, "Notation"):

  response_ids      [T] int32    actions and observations interleaved
  action_mask       [T] bool     True where the policy sampled the token (action)
  rollout_logprobs  [T] float32  the engine's temperature-1 log-prob of each action token;
                                 ignored off the mask (NaN there by convention)
  weight_versions   [T] int32    the weight version that sampled each action token; ignored off the
                                 mask (-1 there by convention). A trajectory may span versions.
  rewards           [T] float32  the outcome reward on the last action token, optional per-turn
                                 rewards on the last token of the action that earned them; a reward
                                 on an observation token belongs to the action before it

and `prompt_ids [P] int32` holds the prompt. For routing replay (optional; docs/models.md,
"Routing replay"), `routed_experts [P + T, L, A] int16` holds the experts the engine routed each
token of prompt and response to at each of the model's L layers (its top A), -1 where it reported
none (the last token, which the engine never fed; dense layers); empty `[0, 0, 0]` without them.
Arrays are stored read-only in their canonical dtypes;
the constructor converts inputs and refuses conversions that would change a value.

`validate` checks everything a learner relies on and raises `TrajectoryError` naming the field.

Size limits on the strings, so that a hostile or broken sender cannot fill the learner's memory,
its on-disk log or its logs (counted in characters; real use stays far below them):
  - ids: `trajectory_id`, `prompt_id`, `finish_reason` (required) and `lease_id` (may be empty),
    at most `MAX_ID_CHARS` (256) each (trajectory and lease ids are 32 characters, prompt ids
    the prompt source's names, e.g. a SWE-bench instance id); the lease's group and the prompt's
    row are typed fields (`group_id`, `prompt_index`: ints, or None), never parsed from an id;
  - `env_metadata` and `timings`: at most `MAX_METADATA_ENTRIES` (256) entries each, keys of at
    most `MAX_ID_CHARS`, string values of at most `MAX_METADATA_VALUE_CHARS` (64 Ki): metadata
    holds small facts (turns, a grade's one-line reason), not transcripts; float values finite.
An over-long string is refused, never cut: cutting an id would change its meaning. Messages name
the field, the length and the limit, never the text; `clip` shortens a text for a log line.

On the wire (`to_proto` / `from_proto`) arrays are raw little-endian bytes — no pickle.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from sao_jax.rollout.proto import trajectory_pb2 as pb

MetadataValue = str | int | float | bool

_INT32 = np.iinfo(np.int32)
# Float rounding in a log-softmax can land a hair above 0 for a near-certain token.
_LOGPROB_SLACK = 1e-4
MAX_ID_CHARS = 256
MAX_METADATA_VALUE_CHARS = 64 * 1024
MAX_METADATA_ENTRIES = 256

# (field, canonical dtype, wire dtype) for every array, in wire order.
_ARRAYS = (
    ("prompt_ids", np.int32, "<i4"),
    ("response_ids", np.int32, "<i4"),
    ("action_mask", np.bool_, "u1"),
    ("rollout_logprobs", np.float32, "<f4"),
    ("weight_versions", np.int32, "<i4"),
    ("rewards", np.float32, "<f4"),
)
_PER_TOKEN = ("action_mask", "rollout_logprobs", "weight_versions", "rewards")


class TrajectoryError(ValueError):
    """A malformed trajectory: `field` names the offending field, `message` says what is wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_length(field: str, value: str, limit: int, what: str = "") -> None:
    """Raises `TrajectoryError` naming `field` (and `what` in it) and `limit` if `value` has more
    than `limit` characters; the message never holds the text itself."""
    if len(value) > limit:
        raise TrajectoryError(field, f"{what}is {len(value)} characters long, more than the "
                                     f"limit of {limit}")


def clip(text: str, limit: int = 120) -> str:
    """`text` shortened for a log line: its first `limit` characters and how many were cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...(+{len(text) - limit} characters)"


def new_trajectory_id() -> str:
    """A fresh unique trajectory id (random 128 bits, hex)."""
    return uuid.uuid4().hex


def _as_array(field: str, value: Any, dtype: type) -> np.ndarray:
    """`value` as a read-only 1-D array of `dtype`, refusing conversions that change values."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise TrajectoryError(field, f"expected a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        arr = np.zeros(0, dtype)
    elif dtype is np.bool_:
        if arr.dtype.kind in "iu":
            if arr.min() < 0 or arr.max() > 1:
                bad = int(np.flatnonzero((arr < 0) | (arr > 1))[0])
                raise TrajectoryError(field, f"value {arr[bad]} at position {bad} is not 0/1")
        elif arr.dtype.kind != "b":
            raise TrajectoryError(field, f"expected bool (or 0/1 integers), got {arr.dtype}")
    elif dtype is np.int32:
        if arr.dtype.kind not in "iu":
            raise TrajectoryError(field, f"expected integers, got {arr.dtype}")
        if arr.min() < _INT32.min or arr.max() > _INT32.max:
            raise TrajectoryError(field, "values do not fit in int32")
    elif arr.dtype.kind not in "fiu":  # float32 fields
        raise TrajectoryError(field, f"expected floats, got {arr.dtype}")
    out = arr.astype(dtype, copy=False)
    if out.flags.writeable:
        if out is arr:  # no conversion happened: never alias the caller's buffer
            out = out.copy()
        out.flags.writeable = False
    return out


def _routes_array(value: Any) -> np.ndarray:
    """`routed_experts` as a read-only `[tokens, layers, top_k]` int16 array (empty: `[0, 0,
    0]`), refusing other shapes and values int16 cannot hold."""
    arr = np.asarray(value)
    if arr.size == 0:
        return np.zeros((0, 0, 0), np.int16)
    if arr.ndim != 3:
        raise TrajectoryError("routed_experts", f"expected [tokens, layers, top_k], got shape "
                                                f"{arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TrajectoryError("routed_experts", f"expected integers, got {arr.dtype}")
    if arr.min() < -1 or arr.max() > np.iinfo(np.int16).max:
        raise TrajectoryError("routed_experts", "expert ids are -1 (no route) .. 32767")
    out = arr.astype(np.int16)  # always a copy: never alias the caller's buffer
    out.flags.writeable = False
    return out


def _metadata_value(field: str, key: Any, value: Any) -> MetadataValue:
    if not isinstance(key, str) or not key:
        raise TrajectoryError(field, f"keys must be non-empty strings, got {key!r}")
    if isinstance(value, np.generic):
        value = value.item()
    if not isinstance(value, (str, int, float, bool)):
        raise TrajectoryError(field, f"value of {key!r} is a {type(value).__name__}; "
                                     "expected str, int, float or bool")
    if field == "timings":
        if isinstance(value, (str, bool)):
            raise TrajectoryError(field, f"value of {key!r} is not a number of seconds")
        value = float(value)
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class Trajectory:
    """One rollout of one prompt; see the module docstring for the arrays and their shapes.

    Attributes:
      prompt_ids: [P] int32, the prompt's tokens.
      response_ids: [T] int32, everything after the prompt.
      action_mask: [T] bool, True on tokens the policy sampled.
      rollout_logprobs: [T] float32, the engine's log-prob of each action token.
      weight_versions: [T] int32, the weight version that sampled each action token.
      rewards: [T] float32.
      truncated: the episode was cut (token, turn or time limit) rather than finished.
      finish_reason: why it ended: "stop", "length", "abort", "turn_limit", ...
      prompt_id: identifies the prompt's content (the same across epochs and rollouts).
      trajectory_id: unique; resending the same id is never counted twice.
      lease_id: the prompt lease this answers (`TrajectoryClient.lease_prompts`); "" if none.
      group_id: the lease's group (`LeasedPrompt.group_id`: the prompt draw it came from); None
        if none, and then the trajectory is a group of its own.
      prompt_index: the prompt's row in the learner's prompt source (`LeasedPrompt.prompt_index`,
        the running-mean baseline's slot); None if the source gave none.
      env_metadata: small facts from the environment (str, int, float or bool values).
      timings: named durations in seconds.
      routed_experts: [P + T, L, A] int16, the engine's expert choices per token and layer (-1:
        none reported), or empty `[0, 0, 0]` (the default): no routing replay.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    action_mask: np.ndarray
    rollout_logprobs: np.ndarray
    weight_versions: np.ndarray
    rewards: np.ndarray
    truncated: bool
    finish_reason: str
    prompt_id: str
    trajectory_id: str = dataclasses.field(default_factory=new_trajectory_id)
    lease_id: str = ""
    group_id: int | None = None
    prompt_index: int | None = None
    env_metadata: Mapping[str, MetadataValue] = dataclasses.field(default_factory=dict)
    timings: Mapping[str, float] = dataclasses.field(default_factory=dict)
    routed_experts: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros((0, 0, 0), np.int16))

    def __post_init__(self):
        for name, dtype, _ in _ARRAYS:
            object.__setattr__(self, name, _as_array(name, getattr(self, name), dtype))
        object.__setattr__(self, "routed_experts", _routes_array(self.routed_experts))
        for name in ("finish_reason", "prompt_id", "trajectory_id", "lease_id"):
            if not isinstance(getattr(self, name), str):
                raise TrajectoryError(name, f"expected a str, got {type(getattr(self, name))}")
        for name in ("group_id", "prompt_index"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                    raise TrajectoryError(name, f"expected an int or None, got "
                                                f"{type(value).__name__}")
                if not 0 <= value < 2**64:
                    raise TrajectoryError(name, f"{value} is outside [0, 2**64)")
                object.__setattr__(self, name, int(value))
        object.__setattr__(self, "truncated", bool(self.truncated))
        for name in ("env_metadata", "timings"):
            raw = getattr(self, name)
            if not isinstance(raw, Mapping):
                raise TrajectoryError(name, f"expected a mapping, got {type(raw).__name__}")
            object.__setattr__(
                self, name, {k: _metadata_value(name, k, v) for k, v in raw.items()})

    @property
    def length(self) -> int:
        """T, the number of response tokens."""
        return int(self.response_ids.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(np.count_nonzero(self.action_mask))

    def validate(self, vocab_size: int, max_length: int | None = None,
                 routes: tuple[int, int, int] | None = None) -> None:
        """Raises `TrajectoryError` naming the first field that a learner could not use.

        Checks: ids present; string sizes and metadata entries within the limits (module
        docstring); a non-empty prompt and response; every per-token array as long as
        `response_ids`; `len(prompt) + len(response) <= max_length`; token ids in
        `[0, vocab_size)`; at least one action token; a finite, non-positive log-prob and a
        non-negative weight version on every action token; finite rewards, none (non-zero) before
        the first action token; finite timings and metadata floats; with `routes = (layers,
        top_k, num_experts)` (a learner that replays them), `routed_experts` of that shape with
        ids below `num_experts`.
        """
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        for name in ("trajectory_id", "prompt_id", "finish_reason", "lease_id"):
            value = getattr(self, name)
            check_length(name, value, MAX_ID_CHARS)
            if not value and name != "lease_id":
                raise TrajectoryError(name, "is empty")
        for name in ("env_metadata", "timings"):
            entries = getattr(self, name)
            if len(entries) > MAX_METADATA_ENTRIES:
                raise TrajectoryError(name, f"has {len(entries)} entries, more than the limit of "
                                            f"{MAX_METADATA_ENTRIES}")
            for key, value in entries.items():
                check_length(name, key, MAX_ID_CHARS, "a key ")
                if isinstance(value, str):
                    check_length(name, value, MAX_METADATA_VALUE_CHARS, f"the value of {key!r} ")
                elif isinstance(value, float) and not math.isfinite(value):
                    raise TrajectoryError(name, f"{key!r} is {value}")
        if self.prompt_ids.size == 0:
            raise TrajectoryError("prompt_ids", "empty prompt")
        t = self.length
        if t == 0:
            raise TrajectoryError("response_ids", "empty response")
        for name in _PER_TOKEN:
            n = getattr(self, name).shape[0]
            if n != t:
                raise TrajectoryError(name, f"has length {n}, but response_ids has length {t}")
        if max_length is not None and self.prompt_ids.size + t > max_length:
            raise TrajectoryError(
                "response_ids", f"prompt ({self.prompt_ids.size}) + response ({t}) tokens exceed "
                                f"max_length {max_length}")
        for name in ("prompt_ids", "response_ids"):
            ids = getattr(self, name)
            bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
            if bad.size:
                raise TrajectoryError(
                    name, f"token id {ids[bad[0]]} at position {bad[0]} is outside the vocabulary "
                          f"[0, {vocab_size}) ({bad.size} such tokens)")
        actions = np.flatnonzero(self.action_mask)
        if actions.size == 0:
            raise TrajectoryError("action_mask", "no action tokens: the policy sampled nothing")
        logp = self.rollout_logprobs[actions]
        bad = np.flatnonzero(~np.isfinite(logp))
        if bad.size:
            pos, value = actions[bad[0]], logp[bad[0]]
            what = "missing (NaN)" if np.isnan(value) else f"non-finite ({value})"
            raise TrajectoryError(
                "rollout_logprobs", f"log-prob {what} on action token at position {pos} "
                                    f"({bad.size} such tokens)")
        bad = np.flatnonzero(logp > _LOGPROB_SLACK)
        if bad.size:
            raise TrajectoryError(
                "rollout_logprobs", f"positive log-prob {logp[bad[0]]} on action token at "
                                    f"position {actions[bad[0]]}")
        versions = self.weight_versions[actions]
        bad = np.flatnonzero(versions < 0)
        if bad.size:
            raise TrajectoryError(
                "weight_versions", f"negative version {versions[bad[0]]} on action token at "
                                   f"position {actions[bad[0]]}")
        bad = np.flatnonzero(~np.isfinite(self.rewards))
        if bad.size:
            raise TrajectoryError(
                "rewards", f"non-finite reward {self.rewards[bad[0]]} at position {bad[0]}")
        self._check_routes(routes)
        early = np.flatnonzero(self.rewards[: actions[0]])
        if early.size:
            raise TrajectoryError(
                "rewards", f"reward {self.rewards[early[0]]} at position {early[0]}, before the "
                           f"first action token (position {actions[0]})")

    def _check_routes(self, model: tuple[int, int, int] | None) -> None:
        routes, tokens = self.routed_experts, self.prompt_ids.size + self.length
        if routes.size and routes.shape[0] != tokens:
            raise TrajectoryError("routed_experts", f"has {routes.shape[0]} tokens, but prompt and "
                                                    f"response have {tokens}")
        if routes.size and model is not None:
            if routes.shape[1:] != tuple(model[:2]):
                raise TrajectoryError("routed_experts", f"holds [layers, top_k] = "
                                      f"{list(routes.shape[1:])} per token, the policy has "
                                      f"{list(model[:2])}: the engine serves another model")
            if routes.max() >= model[2]:
                raise TrajectoryError("routed_experts", f"expert id {routes.max()}, the policy "
                                                        f"has {model[2]} experts")

    def to_proto(self) -> pb.Trajectory:
        """The wire form; faithful for any constructible trajectory, valid or not."""
        msg = pb.Trajectory(
            trajectory_id=self.trajectory_id, prompt_id=self.prompt_id, lease_id=self.lease_id,
            truncated=self.truncated, finish_reason=self.finish_reason, timings=self.timings,
            group_id=self.group_id, prompt_index=self.prompt_index)
        for name, _, wire in _ARRAYS:
            setattr(msg, name, getattr(self, name).astype(wire, copy=False).tobytes())
        if self.routed_experts.size:
            msg.routed_experts = self.routed_experts.astype("<i2", copy=False).tobytes()
            msg.routed_layers, msg.routed_top_k = self.routed_experts.shape[1:]
        for key, value in self.env_metadata.items():
            entry = msg.env_metadata[key]
            if isinstance(value, bool):
                entry.b = value
            elif isinstance(value, int):
                entry.i = value
            elif isinstance(value, float):
                entry.f = value
            else:
                entry.s = value
        return msg

    @classmethod
    def from_proto(cls, msg: pb.Trajectory) -> Trajectory:
        """Decodes the wire form; raises `TrajectoryError` if an array's bytes are ragged."""
        arrays = {}
        for name, _, wire in _ARRAYS:
            raw = getattr(msg, name)
            itemsize = np.dtype(wire).itemsize
            if len(raw) % itemsize:
                raise TrajectoryError(name, f"{len(raw)} bytes is not a whole number of "
                                            f"{np.dtype(wire).name} values")
            arrays[name] = np.frombuffer(raw, wire)
        routes = np.zeros((0, 0, 0), np.int16)
        if msg.routed_experts:
            row = 2 * msg.routed_layers * msg.routed_top_k
            if not row or len(msg.routed_experts) % row:
                raise TrajectoryError("routed_experts", f"{len(msg.routed_experts)} bytes is not "
                                      f"a whole number of [{msg.routed_layers}, "
                                      f"{msg.routed_top_k}] int16 rows")
            routes = np.frombuffer(msg.routed_experts, "<i2").reshape(
                -1, msg.routed_layers, msg.routed_top_k)
        metadata = {key: getattr(value, value.WhichOneof("kind") or "s")
                    for key, value in msg.env_metadata.items()}
        return cls(**arrays, truncated=msg.truncated, finish_reason=msg.finish_reason,
                   prompt_id=msg.prompt_id, trajectory_id=msg.trajectory_id,
                   lease_id=msg.lease_id,
                   group_id=msg.group_id if msg.HasField("group_id") else None,
                   prompt_index=msg.prompt_index if msg.HasField("prompt_index") else None,
                   env_metadata=metadata, timings=dict(msg.timings), routed_experts=routes)

    def to_bytes(self) -> bytes:
        return self.to_proto().SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes) -> Trajectory:
        return cls.from_proto(pb.Trajectory.FromString(data))
