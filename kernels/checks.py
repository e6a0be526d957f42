"""Argument checks shared by the kernels and `sao_jax.rl` (which imports them from here: `rl`
reaches `kernels`, never the other way). Every failure is a ValueError naming the argument."""

from __future__ import annotations

import jax
import numpy as np

TOKENS_BxT = "[B, T]: trajectories x response tokens"


def check_rank(name: str, x, rank: int, meaning: str) -> None:
    if np.ndim(x) != rank:
        raise ValueError(
            f"{name} must have rank {rank} ({meaning}), got shape {tuple(np.shape(x))}.")


def check_same_shape(name: str, x, ref_name: str, ref) -> None:
    if np.shape(x) != np.shape(ref):
        raise ValueError(
            f"{name} must have the shape of {ref_name} {tuple(np.shape(ref))}, "
            f"got {tuple(np.shape(x))}.")


def check_row_vector(name: str, x, batch: int, what: str) -> None:
    """`x` must be a `[B]` array: one entry per row."""
    if np.shape(x) != (batch,):
        raise ValueError(
            f"{name} must have shape [B] = ({batch},) ({what}), got {tuple(np.shape(x))}.")


def concrete_value(x) -> np.ndarray | None:
    """`x` as a NumPy array when it is known at trace time, else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None


def check_in_range(name: str, x, low: float, high: float, hint: str = "") -> None:
    """Checks low <= x <= high where `x` is concrete; traced values pass unchecked."""
    value = concrete_value(x)
    if value is None:
        return
    if not np.all(np.isfinite(value)) or np.any(value < low) or np.any(value > high):
        shown = value if value.size <= 8 else f"an array with min {value.min()}, max {value.max()}"
        raise ValueError(f"{name} must lie in [{low}, {high}]{hint}, got {shown}.")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")
