"""The algorithms of docs/algorithm.md §5, each a small frozen record of choices.

    name              advantage                    policy loss   critic
    sao               skip-obs GAE, adaptive lam   DIS           K=2, frozen attention
    grpo              group-normalised, G=8        PPO (clip-higher, recomputed old policy)
    grpo_dis          group-normalised, G=8        DIS           none
    vapo              adaptive-lam GAE (a=0.05,    PPO + positive-  K=1, all parameters, 2x
                      scaled by length), G=8       example LM loss  the policy's LR, pretrained
    running_mean      R - mean(last 8 of prompt)   DIS           none
    sao_k1            as sao                       DIS           K=1, frozen attention
    sao_full_critic   as sao                       DIS           K=2, all parameters
    sao_step_value    GAE over turns               DIS           K=2, frozen attention

`ALGORITHMS` is the one table of names; `--config.algo=NAME` picks a row.
"""

from __future__ import annotations

import dataclasses

ADVANTAGES = ("gae", "step_gae", "grpo", "running_mean")
POLICY_LOSSES = ("dis", "ppo")


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """What one learner step computes.

    Attributes:
      name: the row of docs/algorithm.md §5.
      advantage: "gae" (skip-observation token GAE), "step_gae" (GAE over turns: one value per
        action, read at its first token), "grpo" (group-normalised outcome reward) or
        "running_mean" (outcome reward minus the prompt's recent mean).
      policy_loss: "dis" (direct double-sided importance sampling against the engine's
        log-probs) or "ppo" (clip-higher against the policy recomputed at the start of the step).
      critic_steps: K critic gradient steps per learner step; 0 means no critic.
      freeze_attention: the critic's attention gets no updates.
      lam_alpha: alpha of the length-adaptive lambda `1 - 1 / (alpha n)` (GAE advantages only).
      lam_reference_tokens: the response length `lam_alpha` was chosen for (None: any). With
        `rl.response_tokens` set, the alpha used is `lam_alpha * lam_reference_tokens /
        rl.response_tokens`, so that lambda at this task's lengths sits where the paper's does
        at its own (`build.algorithm_of`).
      group_size: rollouts per prompt (G); batches hold whole groups.
      lm_coef: weight of the positive-example LM loss added to the policy loss
        (`rl.positive_example_lm_loss`; PPO only); 0: none.
      value_pretraining: the critic-only warm-up goes on until the critic's explained variance
        stalls (`rl.value_pretraining`, which overrides this when set).
      critic_lr_ratio: the critic's learning rate as a multiple of the policy's (None: the
        critic's own `optim.critic.learning_rate`; `rl.critic_lr_ratio` overrides this).
    """

    name: str
    advantage: str
    policy_loss: str
    critic_steps: int = 0
    freeze_attention: bool = True
    lam_alpha: float = 1.5
    lam_reference_tokens: int | None = None
    group_size: int = 1
    lm_coef: float = 0.0
    value_pretraining: bool = False
    critic_lr_ratio: float | None = None

    def __post_init__(self):
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage must be one of {ADVANTAGES}, got {self.advantage!r}.")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}, "
                             f"got {self.policy_loss!r}.")
        if self.advantage in ("gae", "step_gae") and self.critic_steps < 1:
            raise ValueError(f"{self.name}: GAE needs a critic (critic_steps >= 1).")
        if self.advantage == "grpo" and self.group_size < 2:
            raise ValueError(f"{self.name}: group-normalised advantages need group_size >= 2.")
        if self.lm_coef < 0 or (self.lm_coef and self.policy_loss != "ppo"):
            raise ValueError(f"{self.name}: lm_coef must be >= 0, and only PPO adds the "
                             f"positive-example LM loss; got {self.lm_coef} with "
                             f"{self.policy_loss!r}.")
        if self.critic_lr_ratio is not None and not self.critic_lr_ratio > 0:
            raise ValueError(f"{self.name}: critic_lr_ratio must be > 0, got "
                             f"{self.critic_lr_ratio}.")

    @property
    def uses_critic(self) -> bool:
        return self.critic_steps > 0


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("sao", "gae", "dis", critic_steps=2),
    Algorithm("grpo", "grpo", "ppo", group_size=8),
    Algorithm("grpo_dis", "grpo", "dis", group_size=8),
    # VAPO (Yue et al., 2025, arXiv:2504.05118) as its paper defines it: value pretraining,
    # decoupled GAE (critic lambda 1.0), the length-adaptive policy lambda with alpha 0.05 set
    # for responses of ~2000 tokens, group sampling, the positive-example LM loss (mu 0.1), a
    # critic learning rate twice the policy's, PPO with clip-higher (docs/algorithm.md §5).
    Algorithm("vapo", "gae", "ppo", critic_steps=1, freeze_attention=False, lam_alpha=0.05,
              lam_reference_tokens=2000, group_size=8, lm_coef=0.1, value_pretraining=True,
              critic_lr_ratio=2.0),
    Algorithm("running_mean", "running_mean", "dis"),
    Algorithm("sao_k1", "gae", "dis", critic_steps=1),
    Algorithm("sao_full_critic", "gae", "dis", critic_steps=2, freeze_attention=False),
    Algorithm("sao_step_value", "step_gae", "dis", critic_steps=2),
)}


def get_algorithm(name: str, **overrides) -> Algorithm:
    """The row `name` of ALGORITHMS, with fields replaced by `overrides` (None values ignored)."""
    if name not in ALGORITHMS:
        raise ValueError(f"config.algo must be one of {sorted(ALGORITHMS)}, got {name!r}.")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(ALGORITHMS[name], **overrides)
