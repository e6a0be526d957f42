"""The learner step's test inputs: multi-turn rollouts of random tokens (`synthetic_trajectories`)
and a trainer of the one-layer toy model for each algorithm (`trainer_for`), built once per
configuration in a process, so that the modules that step it share its compilations."""

import functools

import numpy as np
from flax import nnx

from sao_jax.models import CausalLM
from sao_jax.models.config import preset
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train import critic_optimizer_config, policy_optimizer_config
from sao_jax.train.algorithms import get_algorithm
from sao_jax.train.steps import StepConfig, Trainer

CFG = preset("toy", num_layers=1, mlp_only_layers=(), scan_layers=True)  # as the learner trains
ROWS = 16


def synthetic_trajectories(rows=ROWS, seed=0, group_size=1):
    """Multi-turn rollouts with random tokens, rewards 0/1 (varying inside every group) and
    engine log-probs near the truth (log-probs of a random policy are about -log 64)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        prompt = rng.integers(3, CFG.vocab_size, rng.integers(3, 8))
        segments, mask = [], []
        for turn in range(rng.integers(1, 4)):
            a = rng.integers(2, 8)
            segments.append(rng.integers(3, CFG.vocab_size, a))
            mask += [True] * a
            if turn < 2:
                o = rng.integers(1, 5)
                segments.append(rng.integers(3, CFG.vocab_size, o))
                mask += [False] * o
        while not mask[-1]:
            mask.pop()
        response = np.concatenate(segments)[: len(mask)]
        mask = np.array(mask)
        rewards = np.zeros(len(mask), np.float32)
        rewards[np.flatnonzero(mask)[-1]] = float((i % group_size + i // group_size) % 2)
        out.append(Trajectory(
            prompt_ids=prompt, response_ids=response, action_mask=mask,
            rollout_logprobs=np.where(mask, -np.log(64) + rng.normal(0, 0.05, len(mask)),
                                      np.nan),
            weight_versions=np.where(mask, 0, -1), rewards=rewards,
            truncated=bool(i % 5 == 0), finish_reason="stop", prompt_id=f"p{i % 4}",
            trajectory_id=f"t{seed}-{i}"))
    return out


@functools.cache  # one trainer, so one compilation, per configuration in a process
def trainer_for(algo, **step_overrides):
    policy = CausalLM(CFG, nnx.Rngs(0))
    step_overrides.setdefault("ppo_minibatches", 2)
    # The reference GAE compiles faster; tests/rl shows every impl gives the same numbers.
    step_overrides.setdefault("gae_impl", "reference")
    step_overrides.setdefault("algorithm", get_algorithm(algo))
    config = StepConfig(**step_overrides)
    return Trainer(policy, config, policy_optimizer=policy_optimizer_config(1e-3),
                   critic_optimizer=critic_optimizer_config(1e-3), num_prompts=4)
