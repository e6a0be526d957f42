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

# The trajectory type and the gRPC trajectory stream (learner server, worker client).
from sao_jax.rollout.stream import (  # noqa: E402
    Ack,
    LeasedPrompt,
    PromptsExhausted,
    TrajectoryClient,
    TrajectoryServer,
)
from sao_jax.rollout.trajectory import Trajectory, TrajectoryError  # noqa: E402

__all__ += [
    "Ack",
    "LeasedPrompt",
    "PromptsExhausted",
    "Trajectory",
    "TrajectoryClient",
    "TrajectoryError",
    "TrajectoryServer",
]
