"""The rollout plane: trajectories and their gRPC stream, the SGLang client, the agent loop,
workers and the recording OpenAI-compatible proxy. The engines it talks to are
`sao_jax.engine`'s (the embedded JAX engine, real SGLang servers); tokenizers and chat templates
are the text layer's (`sao_jax.text`)."""

# The client of the engines (theirs: the protocol, `sao_jax.engine.sglang_api`).
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
