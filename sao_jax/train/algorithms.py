"""The algorithms of docs/algorithm.md §5, each a small frozen record of choices.

    name              advantage                    policy loss   critic
    sao               skip-obs GAE, adaptive lam   DIS           K=2, frozen attention
    grpo              group-normalised, G=8        PPO (clip-higher, recomputed old policy)
    grpo_dis          group-normalised, G=8        DIS           none
    vapo              adaptive-lam GAE (a=0.05)    PPO           K=1, all parameters
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
      group_size: rollouts per prompt (G); batches hold whole groups.
    """

    name: str
    advantage: str
    policy_loss: str
    critic_steps: int = 0
    freeze_attention: bool = True
    lam_alpha: float = 1.5
    group_size: int = 1

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

    @property
    def uses_critic(self) -> bool:
        return self.critic_steps > 0


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("sao", "gae", "dis", critic_steps=2),
    Algorithm("grpo", "grpo", "ppo", group_size=8),
    Algorithm("grpo_dis", "grpo", "dis", group_size=8),
    Algorithm("vapo", "gae", "ppo", critic_steps=1, freeze_attention=False, lam_alpha=0.05),
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
