"""Rollouts: trajectories, inference engines (the embedded JAX engine, the SGLang client), the
agent loop, workers and the recording OpenAI-compatible proxy. Tokenizers and chat templates are
the text layer's (`sao_jax.text`)."""

# The engine (`python -m sao_jax.rollout.engine`) is not imported here: it pulls in JAX, and a
# package that imports the module run with -m makes Python warn.
from sao_jax.rollout.client import (
    EngineError,
    EngineSession,
    EngineUnavailableError,
    GenerateResult,
    SGLangClient,
    UnknownWeightVersionError,
    VersionMap,
    WeightUpdateError,
)

__all__ = [
    "EngineError",
    "EngineSession",
    "EngineUnavailableError",
    "GenerateResult",
    "SGLangClient",
    "UnknownWeightVersionError",
    "VersionMap",
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

# The recording proxy for OpenAI-speaking agent scaffolds (its chat: `sao_jax.text.ChatDeltas`).
from sao_jax.rollout.proxy import RecordingProxy, SessionError  # noqa: E402

__all__ += [
    "RecordingProxy",
    "SessionError",
]
