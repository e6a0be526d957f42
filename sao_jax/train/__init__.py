"""Training: optimizers (frozen-attention critic), and the learner built on them.

    from sao_jax import train
    tx = train.make_optimizer(train.critic_optimizer_config(), nnx.state(critic, nnx.Param))
"""

from sao_jax.train.optimizers import (
    FROZEN,
    FROZEN_ATTENTION,
    TRAINABLE,
    OptimizerConfig,
    critic_optimizer_config,
    learning_rate_schedule,
    make_optimizer,
    param_labels,
    param_path,
    policy_optimizer_config,
    trainable_global_norm,
)

__all__ = [
    "FROZEN",
    "FROZEN_ATTENTION",
    "TRAINABLE",
    "OptimizerConfig",
    "critic_optimizer_config",
    "learning_rate_schedule",
    "make_optimizer",
    "param_labels",
    "param_path",
    "policy_optimizer_config",
    "trainable_global_norm",
]
