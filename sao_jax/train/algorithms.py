"""The algorithms of docs/algorithm.md §5, each a small frozen record of choices.

    name              advantage                    policy loss   critic
    sao               skip-obs GAE, adaptive lam   DIS           K=2, frozen attention
    grpo              group-normalised, G=8        PPO (clip-higher, recomputed old policy)
    grpo_dis          group-normalised, G=8        DIS           none
    grpo_tis          group-normalised, G=8        PPO + TIS     none
                                                   (cap 2)
    grpo_icepop       group-normalised, G=8        PPO + IcePop  none
                                                   (0.5 .. 5)
    grpo_geomask      group-normalised, G=8        PPO + geo-    none
                                                   metric mask
                                                   (0.999 ..
                                                   1.001)
    vapo              adaptive-lam GAE (a=0.05,    PPO + positive-  K=1, all parameters,
                      scaled by length), G=8       example LM loss  pretrained
    running_mean      R - mean(last 8 of prompt)   DIS           none
    sao_k1            as sao                       DIS           K=1, frozen attention
    sao_full_critic   as sao                       DIS           K=2, all parameters
    sao_step_value    GAE over turns               DIS           K=2, frozen attention

`grpo` is PPO with no training-inference mismatch correction, `grpo_dis` DIS; `grpo_tis`,
`grpo_icepop` and `grpo_geomask` differ from `grpo` only in the correction of its PPO terms
(`policy_losses.Correction`), so that the five compare the corrections on one task and budget.

`ALGORITHMS` is the one table of names; `--config.algo=NAME` picks a row. A row is a record of
the parts the learner step calls: its advantage estimator (`advantages.Estimator`: `GAE`,
`GroupNormalised`, `RunningMean`), its policy loss (`policy_losses.PolicyLoss`: `DIS`, `PPO`,
`PPO(correction=...)`), and
the settings of its critic updates and its groups. No module outside this one names an algorithm
or asks which part a row has (`tests/test_structure.py` checks that). Adding an algorithm
is one module for a new part and one `register(Algorithm(...))` below: docs/algorithm.md,
"Adding an algorithm".
"""

from __future__ import annotations

import dataclasses

from sao_jax.train.advantages import GAE, Estimator, GroupNormalised, RunningMean
from sao_jax.train.policy_losses import DIS, PPO, TIS, GeometricMask, IcePop, PolicyLoss


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """What one learner step computes: its parts, and their settings.

    Attributes:
      name: the row of docs/algorithm.md §5.
      advantage: the advantage estimator (`advantages.Estimator`): `GAE()` (skip-observation
        token GAE), `GAE(turns=True)` (GAE over turns: one value per action, read at its first
        token), `GroupNormalised()` (group-normalised outcome reward) or `RunningMean()`
        (outcome reward minus the prompt's recent mean).
      policy_loss: the policy update (`policy_losses.PolicyLoss`): `DIS()` (direct
        double-sided importance sampling against the engine's log-probs) or `PPO()`
        (clip-higher against the policy recomputed at the start of the step), with a
        training-inference mismatch correction of its terms or none
        (`PPO(correction=TIS())`, `IcePop()`, `GeometricMask()`).
      critic_steps: K critic gradient steps per learner step on the value loss, towards the
        estimator's targets; 0 means no critic (an estimator reads a critic or has none:
        `Estimator.critic`).
      freeze_attention: the critic's attention gets no updates.
      lam_alpha: alpha of the length-adaptive lambda `1 - 1 / (alpha n)` (GAE advantages only).
      lam_reference_tokens: the response length `lam_alpha` was chosen for (None: any). With
        `rl.response_tokens` set, the alpha used is `lam_alpha * lam_reference_tokens /
        rl.response_tokens`, so that lambda at this task's lengths sits where the paper's does
        at its own (`build.algorithm_of`).
      group_size: rollouts per prompt (G); batches hold whole groups of G consecutive rows, the
        G leases of one prompt draw, and the estimator reads them so.
      lm_coef: weight of the positive-example LM loss added to the policy loss
        (`rl.positive_example_lm_loss`; a loss with `lm_loss`, PPO); 0: none.
      value_pretraining: the critic-only warm-up goes on until the critic's explained variance
        stalls (`rl.value_pretraining`, which overrides this when set).
      critic_lr_ratio: the critic's learning rate as a multiple of the policy's (None: the
        critic's own `optim.critic.learning_rate`; `rl.critic_lr_ratio` overrides this).
    """

    name: str
    advantage: Estimator
    policy_loss: PolicyLoss
    critic_steps: int = 0
    freeze_attention: bool = True
    lam_alpha: float = 1.5
    lam_reference_tokens: int | None = None
    group_size: int = 1
    lm_coef: float = 0.0
    value_pretraining: bool = False
    critic_lr_ratio: float | None = None

    def __post_init__(self):
        if not isinstance(self.advantage, Estimator):
            raise ValueError(f"{self.name}: advantage must be an advantages.Estimator (e.g. "
                             f"GAE()), got {self.advantage!r}.")
        if not isinstance(self.policy_loss, PolicyLoss):
            raise ValueError(f"{self.name}: policy_loss must be a policy_losses.PolicyLoss "
                             f"(e.g. DIS()), got {self.policy_loss!r}.")
        if self.advantage.critic and self.critic_steps < 1:
            raise ValueError(f"{self.name}: {self.advantage.title} needs a critic "
                             "(critic_steps >= 1).")
        if not self.advantage.critic and self.critic_steps:
            raise ValueError(f"{self.name}: {self.advantage.title} read no critic: "
                             f"critic_steps must be 0, got {self.critic_steps}.")
        if self.group_size < self.advantage.min_group_size:
            raise ValueError(f"{self.name}: {self.advantage.title} need group_size >= "
                             f"{self.advantage.min_group_size}.")
        if self.lm_coef < 0 or (self.lm_coef and not self.policy_loss.lm_loss):
            raise ValueError(f"{self.name}: lm_coef must be >= 0, and only PPO adds the "
                             f"positive-example LM loss; got {self.lm_coef} with "
                             f"{self.policy_loss.name!r}.")
        if self.critic_lr_ratio is not None and not self.critic_lr_ratio > 0:
            raise ValueError(f"{self.name}: critic_lr_ratio must be > 0, got "
                             f"{self.critic_lr_ratio}.")

    @property
    def uses_critic(self) -> bool:
        return self.critic_steps > 0


ALGORITHMS: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Adds `algorithm` to `ALGORITHMS`; a name registered twice is a ValueError."""
    if algorithm.name in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm.name!r} is registered already.")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


register(Algorithm("sao", GAE(), DIS(), critic_steps=2))
register(Algorithm("grpo", GroupNormalised(), PPO(), group_size=8))
register(Algorithm("grpo_dis", GroupNormalised(), DIS(), group_size=8))
# Training-inference mismatch corrections of grpo's PPO, each with its source's defaults
# (docs/algorithm.md §5, "The mismatch corrections"): Yao et al. 2025's TIS, Ring-1T's IcePop, and
# the geometric sequence mask of Liu, Li et al. 2025 as verl's rollout correction presets it.
register(Algorithm("grpo_tis", GroupNormalised(), PPO(correction=TIS()), group_size=8))
register(Algorithm("grpo_icepop", GroupNormalised(), PPO(correction=IcePop()), group_size=8))
register(Algorithm("grpo_geomask", GroupNormalised(), PPO(correction=GeometricMask()),
                   group_size=8))
# VAPO (Yue et al., 2025, arXiv:2504.05118) as its paper defines it: value pretraining, decoupled
# GAE (critic lambda 1.0), the length-adaptive policy lambda with alpha 0.05 set for responses of
# ~2000 tokens, group sampling, the positive-example LM loss (mu 0.1), PPO with clip-higher
# (docs/algorithm.md §5). Its critic learns at the rate every critic here does
# (`optim.critic.learning_rate`): the paper's "twice the policy's" left this testbed's critic at
# an explained variance of 0 +- 0.05 through pretraining;
# `rl.critic_lr_ratio=2.0` restores it.
register(Algorithm("vapo", GAE(), PPO(), critic_steps=1, freeze_attention=False, lam_alpha=0.05,
                   lam_reference_tokens=2000, group_size=8, lm_coef=0.1, value_pretraining=True))
register(Algorithm("running_mean", RunningMean(), DIS()))
register(Algorithm("sao_k1", GAE(), DIS(), critic_steps=1))
register(Algorithm("sao_full_critic", GAE(), DIS(), critic_steps=2, freeze_attention=False))
register(Algorithm("sao_step_value", GAE(turns=True), DIS(), critic_steps=2))


def get_algorithm(name: str, **overrides) -> Algorithm:
    """The row `name` of ALGORITHMS, with fields replaced by `overrides` (None values ignored)."""
    if name not in ALGORITHMS:
        raise ValueError(f"config.algo must be one of {sorted(ALGORITHMS)}, got {name!r}.")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(ALGORITHMS[name], **overrides)
