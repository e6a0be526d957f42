"""Policy and critic optimizers: AdamW on the trainable parameters, nothing on the frozen ones.

The critic of SAO trains with *frozen attention* (docs/algorithm.md §3): everything under a block's
`attn/` (the q/k/v/o projections and the per-head q/k RMSNorms) gets no update, while the block
norms, MLP/MoE experts, router, embeddings and value head train. The split is an Optax partition
driven by regexes on parameter paths:

    labels:     backbone/layers/0/attn/q_proj/kernel  -> "frozen"
                backbone/layers/0/moe/router/kernel   -> "trainable"
    trainable:  clip_by_global_norm(grad_clip_norm) -> adamw(warm-up schedule)
    frozen:     set_to_zero()

so the clip (and the logged `critic/grad_norm`) covers the trainable parameters only, frozen
parameters get an exact zero update, and they hold no optimizer state (no Adam moments). Under `jit`
XLA also drops the frozen weight gradients, which nothing reads.

A parameter's path is the "/"-joined key path of its leaf in `nnx.state(model, nnx.Param)` (or in
any pytree of parameters), e.g. `backbone/layers/3/attn/k_norm/scale`.

    config = critic_optimizer_config(learning_rate=5e-6)
    tx = make_optimizer(config, nnx.state(critic, nnx.Param))
    optimizer = nnx.Optimizer(critic, tx, wrt=nnx.Param)            # graph API, or
    opt_state = tx.init(params); updates, opt_state = tx.update(grads, opt_state, params)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

TRAINABLE = "trainable"
FROZEN = "frozen"
LABELS = (TRAINABLE, FROZEN)

MU_DTYPES = ("float32", "bfloat16")
"""What `OptimizerConfig.mu_dtype` may name."""

FROZEN_ATTENTION = (r"(^|/)attn/",)
"""Frozen-attention patterns: every parameter inside a block's attention module."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warm-up, global-norm clipping and frozen parameters.

    Attributes:
      learning_rate: peak learning rate, reached after `warmup_steps` updates.
      b1: AdamW decay of the first moment.
      b2: AdamW decay of the second moment.
      eps: AdamW epsilon, added to the root of the second moment.
      weight_decay: decoupled weight decay (scaled by the learning rate, as `optax.adamw`).
      grad_clip_norm: clip the gradient to this global norm, computed over the trainable
        parameters only; None disables clipping.
      warmup_steps: linear warm-up length W. Update n (counting from 0) uses
        `learning_rate * min(1, (n + 1) / W)`, so the first update is not wasted; 0 disables.
      frozen_patterns: regexes; a parameter whose "/"-joined path matches any of them under
        `re.search` is frozen (zero update, no optimizer state). Each must match some parameter.
      mu_dtype: the dtype AdamW keeps its first moment in (`optax.adamw`'s `mu_dtype`), e.g.
        "bfloat16" to halve it; None or "": the parameters' own. The second moment stays in
        the parameters' dtype (its square root divides the update).
    """

    learning_rate: float
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip_norm: float | None = 1.0
    warmup_steps: int = 0
    frozen_patterns: tuple[str, ...] = ()
    mu_dtype: str | None = None

    def __post_init__(self):
        _check_finite_at_least("learning_rate", self.learning_rate, 0.0, strict=True)
        _check_unit_interval("b1", self.b1)
        _check_unit_interval("b2", self.b2)
        _check_finite_at_least("eps", self.eps, 0.0, strict=True)
        _check_finite_at_least("weight_decay", self.weight_decay, 0.0, strict=False)
        if self.grad_clip_norm is not None:
            _check_finite_at_least("grad_clip_norm", self.grad_clip_norm, 0.0, strict=True)
        if (isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int)
                or self.warmup_steps < 0):
            raise ValueError(
                f"OptimizerConfig.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}.")
        if self.mu_dtype == "":
            object.__setattr__(self, "mu_dtype", None)
        if self.mu_dtype is not None and self.mu_dtype not in MU_DTYPES:
            raise ValueError(f"OptimizerConfig.mu_dtype must be one of {MU_DTYPES} or empty (the "
                             f"parameters' dtype), got {self.mu_dtype!r}.")
        # Coerce a list to a tuple so that the config stays hashable (usable as a static argument).
        object.__setattr__(self, "frozen_patterns", _check_patterns(self.frozen_patterns))


def policy_optimizer_config(learning_rate: float = 1e-6, **kwargs: Any) -> OptimizerConfig:
    """The policy's optimizer: every parameter trains.

    Args:
      learning_rate: peak learning rate.
      **kwargs: any other `OptimizerConfig` field.

    Returns:
      An `OptimizerConfig`.
    """
    return OptimizerConfig(learning_rate=learning_rate, **kwargs)


def critic_optimizer_config(learning_rate: float = 5e-6, freeze_attention: bool = True,
                            **kwargs: Any) -> OptimizerConfig:
    """The critic's optimizer, with frozen attention (docs/algorithm.md §3) unless told otherwise.

    Args:
      learning_rate: peak learning rate.
      freeze_attention: freeze everything under `attn/` (`FROZEN_ATTENTION`); False gives the
        "full-parameter critic" ablation, in which every parameter trains.
      **kwargs: any other `OptimizerConfig` field except `frozen_patterns`.

    Returns:
      An `OptimizerConfig`.
    """
    if "frozen_patterns" in kwargs:
        raise ValueError(
            "critic_optimizer_config sets frozen_patterns from freeze_attention; build an "
            "OptimizerConfig directly for other patterns.")
    patterns = FROZEN_ATTENTION if freeze_attention else ()
    return OptimizerConfig(learning_rate=learning_rate, frozen_patterns=patterns, **kwargs)


def param_path(key_path: Sequence[Any]) -> str:
    """The "/"-joined path of a parameter, e.g. `backbone/layers/0/attn/q_proj/kernel`.

    Args:
      key_path: a JAX key path (`DictKey`, `GetAttrKey`, `SequenceKey`, `FlattenedIndexKey`
        entries, as from `jax.tree_util.tree_flatten_with_path`) or an NNX flat-state path (a
        tuple of str / int).

    Returns:
      The path string.
    """
    parts = []
    for key in key_path:
        if isinstance(key, jax.tree_util.DictKey | jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, str | int):
            parts.append(str(key))
        else:
            raise TypeError(f"Unsupported key path entry {key!r} of type {type(key).__name__}.")
    return "/".join(parts)


def param_labels(params: Any, frozen_patterns: Sequence[str]) -> Any:
    """Labels each parameter `"trainable"` or `"frozen"` by matching its path.

    Args:
      params: an `nnx.State` (leaves `nnx.Variable`s or arrays), or any pytree of parameters;
        abstract leaves (`jax.ShapeDtypeStruct`) work too, only paths are read.
      frozen_patterns: regexes; a parameter is frozen when `re.search` finds any of them in its
        path.

    Returns:
      A pytree like `params` with a label string in place of each parameter (each
      `nnx.Variable` is one parameter). It is a prefix of both `params` and `nnx.as_pure(params)`.

    Raises:
      ValueError: a pattern matches no parameter (a typo would otherwise silently train what was
        meant to be frozen), or a pattern is not a valid regex.
    """
    compiled = [re.compile(p) for p in _check_patterns(frozen_patterns)]
    hits = [0] * len(compiled)

    def label(key_path, _):
        path = param_path(key_path)
        matched = [c.search(path) is not None for c in compiled]
        for i, m in enumerate(matched):
            hits[i] += m
        return FROZEN if any(matched) else TRAINABLE

    labels = jax.tree_util.tree_map_with_path(label, params, is_leaf=_is_variable)
    unmatched = [p for p, n in zip(frozen_patterns, hits, strict=True) if n == 0]
    if unmatched:
        some = [param_path(k) for k, _ in
                jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0][:4]]
        raise ValueError(
            f"frozen_patterns {unmatched} match no parameter path (paths look like {some}).")
    return labels


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    """`learning_rate * min(1, (n + 1) / warmup_steps)` at update n = 0, 1, ...; flat if W = 0."""
    if config.warmup_steps == 0:
        return optax.constant_schedule(config.learning_rate)

    def schedule(count):
        frac = (jnp.asarray(count, jnp.float32) + 1.0) / config.warmup_steps
        return config.learning_rate * jnp.minimum(frac, 1.0)

    return schedule


def make_optimizer(config: OptimizerConfig,
                   params: Any) -> optax.GradientTransformationExtraArgs:
    """The partitioned AdamW of `config`.

    Trainable parameters: `clip_by_global_norm(grad_clip_norm)` (over the trainable gradients
    only), then `adamw` with `learning_rate_schedule(config)`. Frozen parameters:
    `set_to_zero()`, which keeps them exactly where they are and holds no state.

    Args:
      config: the optimizer config.
      params: the parameters it will optimise (`nnx.state(model, nnx.Param)`, a pytree of arrays,
        or its `jax.eval_shape`), used here to check that every frozen pattern matches.

    Returns:
      An Optax transformation for `nnx.Optimizer(model, tx, wrt=nnx.Param)`, or for
      `tx.init(params)` / `tx.update(grads, state, params)` on any pytree of parameters whose
      paths follow the same convention (labels are recomputed from each tree's paths, so
      `nnx.State`s with or without `nnx.Variable` leaves and plain dicts all work).

    Raises:
      ValueError: a frozen pattern matches no parameter of `params`.
    """
    param_labels(params, config.frozen_patterns)  # Fail here, not at the first update.
    trainable = [optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2,
                             eps=config.eps, weight_decay=config.weight_decay,
                             mu_dtype=config.mu_dtype)]
    if config.grad_clip_norm is not None:
        trainable.insert(0, optax.clip_by_global_norm(config.grad_clip_norm))
    return optax.partition(
        {TRAINABLE: optax.chain(*trainable), FROZEN: optax.set_to_zero()},
        lambda tree: param_labels(tree, config.frozen_patterns))


def trainable_global_norm(grads: Any, labels: Any, *, label: str = TRAINABLE) -> jax.Array:
    """The global L2 norm of the gradients labelled `label`, the trainable ones by default:
    `sqrt(sum_trainable sum(g^2))`.

    This is the norm the optimizer clips and the learner logs as `critic/grad_norm`.

    Args:
      grads: gradients, structured as the parameters.
      labels: `param_labels(params, frozen_patterns)`, a prefix of `grads`.
      label: whose norm: `TRAINABLE` (the default), or `FROZEN` for the gradients of the
        parameters matched by the patterns (say, the attention's, where it trains after all:
        the learner's `critic/attention_grad_norm`).

    Returns:
      A float32 scalar; 0 when no parameter has `label`.
    """
    if label not in LABELS:
        raise ValueError(f"label must be one of {LABELS}, got {label!r}.")

    def keep(tag, g):
        if tag not in LABELS:
            raise ValueError(f"labels must be {LABELS}, got {tag!r}.")
        return g if tag == label else None

    trainable = jax.tree.map(keep, labels, grads)
    leaves = jax.tree.leaves(trainable)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(sum(jnp.sum(jnp.square(jnp.asarray(g, jnp.float32))) for g in leaves))


def rounded_away_share(params: Any, step: float) -> float:
    """The share of `params`' floating-point elements that an update of `step`, added or
    subtracted, leaves as they are: rounded away in their own dtype.

    The learner adds AdamW's update to the policy in `config.model.master_dtype`: in bfloat16
    (8 significant bits) a weight of 0.1 moves only by steps of about 5e-4, and an update, at
    most about the learning rate, below half of that is lost (float32 master weights keep it).
    One program over the whole tree, so sharded parameters are counted where they live and one
    number comes back."""
    leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    total = sum(x.size for x in leaves)
    if not total:
        return 0.0
    return float(_rounded_away(leaves, step)) / total


@jax.jit
def _rounded_away(leaves: list[jax.Array], step: float) -> jax.Array:
    def frozen(x):  # counted in float32: a 30B model's leaves pass int32's 2^31
        wide = x.astype(jnp.float32)
        same = ((wide + step).astype(x.dtype) == x) & ((wide - step).astype(x.dtype) == x)
        return jnp.sum(same, dtype=jnp.float32)

    return sum(frozen(x) for x in leaves)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _check_finite_at_least(name: str, value: Any, low: float, *, strict: bool) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if strict else value >= low)
    if not ok:
        op = ">" if strict else ">="
        raise ValueError(f"OptimizerConfig.{name} must be a finite number {op} {low}, "
                         f"got {value!r}.")


def _check_unit_interval(name: str, value: Any) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not (ok and 0.0 <= value < 1.0):
        raise ValueError(f"OptimizerConfig.{name} must be in [0, 1), got {value!r}.")


def _check_patterns(patterns: Any) -> tuple[str, ...]:
    if isinstance(patterns, str | bytes) or not isinstance(patterns, Sequence):
        raise ValueError(
            f"frozen_patterns must be a tuple of regex strings, got {patterns!r} "
            f"(write ({patterns!r},) for a single pattern).")
    for p in patterns:
        if not isinstance(p, str):
            raise ValueError(f"frozen_patterns entries must be strings, got {p!r}.")
        try:
            re.compile(p)
        except re.error as e:
            raise ValueError(f"frozen_patterns entry {p!r} is not a valid regex: {e}.") from e
    return tuple(patterns)
