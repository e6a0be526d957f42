"""Multi-turn environments: text in, text out; the agent loop tokenises (`tokenizer.py` for the toy
vocabulary). `envs/` knows nothing of models."""

from sao_jax.envs.python_tool import PythonToolEnv, math_answer_equal
from sao_jax.envs.sandbox import (
    SandboxConfig,
    SandboxResult,
    SandboxUnavailable,
    check_isolation,
    run_python,
)

__all__ = [
    "PythonToolEnv",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailable",
    "check_isolation",
    "math_answer_equal",
    "run_python",
]
