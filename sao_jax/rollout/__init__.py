"""Rollouts: trajectories, inference engines (the embedded JAX engine, the SGLang client)."""

# The engine (`python -m sao_jax.rollout.engine`) is not imported here: it pulls in JAX, and a
# package that imports the module run with -m makes Python warn.
from sao_jax.rollout.client import (
    EngineError,
    EngineUnavailableError,
    GenerateResult,
    SGLangClient,
    WeightUpdateError,
)

__all__ = [
    "EngineError",
    "EngineUnavailableError",
    "GenerateResult",
    "SGLangClient",
    "WeightUpdateError",
]
