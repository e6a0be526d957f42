"""RL math for SAO as pure jittable functions of arrays: no models, no optimizers, no configs.

    from sao_jax import rl
    adv, ret = rl.gae(rewards, values, action_mask, gamma=1.0, lam=0.95)
    loss, metrics = rl.dis_loss(logp, rollout_logp, adv, action_mask, eps_low=0.3, eps_high=5.0)
"""

from sao_jax.rl.advantages import (
    GAE_IMPLS,
    RunningMeanState,
    decoupled_gae,
    fill_actions,
    first_action_tokens,
    gae,
    grpo_advantages,
    length_adaptive_lambda,
    running_mean_advantages,
    running_mean_init,
    step_gae,
)
from sao_jax.rl.corrections import (
    CorrectionMetrics,
    geometric_mask_weights,
    icepop_weights,
    tis_weights,
)
from sao_jax.rl.losses import (
    DisMetrics,
    PpoMetrics,
    ValueMetrics,
    dis_loss,
    positive_example_lm_loss,
    ppo_clip_loss,
    value_loss,
)
from sao_jax.rl.metrics import (
    LogpGap,
    RoutingSplit,
    aggregate_loss,
    explained_variance,
    logp_gap,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    routing_split,
)

__all__ = [
    "GAE_IMPLS",
    "CorrectionMetrics",
    "DisMetrics",
    "LogpGap",
    "PpoMetrics",
    "RoutingSplit",
    "RunningMeanState",
    "ValueMetrics",
    "aggregate_loss",
    "decoupled_gae",
    "dis_loss",
    "explained_variance",
    "fill_actions",
    "first_action_tokens",
    "gae",
    "geometric_mask_weights",
    "grpo_advantages",
    "icepop_weights",
    "length_adaptive_lambda",
    "logp_gap",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "positive_example_lm_loss",
    "ppo_clip_loss",
    "routing_split",
    "running_mean_advantages",
    "running_mean_init",
    "step_gae",
    "tis_weights",
    "value_loss",
]
