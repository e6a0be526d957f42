"""sao_jax: Single-rollout Asynchronous Optimization (SAO) for LLM agents, in JAX.

`sao_jax.rl` holds the RL math as pure jittable functions of arrays: skip-observation GAE, direct
double-sided importance sampling (DIS), PPO and value losses, GRPO and running-mean baselines, and
masked statistics.
"""

__version__ = "0.1.0"
