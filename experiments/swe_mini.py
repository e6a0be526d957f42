"""SWE agents on a CPU: the bundled swe_mini tasks, namespace workspaces, a small model.

Hypothesis: none about the score — a 0.1M-parameter model cannot fix bugs. This runs the whole
SWE path end to end on two CPU cores, as `swe` runs it on a pod: tasks leased to a rollout
worker, one sandboxed workspace per episode where the policy's ```bash blocks run, the patch
taken in the workspace and graded by the task's hidden tests in a fresh one, token-exact chat
histories (the TIR tokenizer's ChatML template), and SAO with the coding DIS band 0.2..4.0. The
warm start imitates a scripted expert (`envs.swe.expert`: find the function, read it, apply the
fix, run the tests, submit) on every training task, so the policy knows the protocol.

    make train EXP=swe_mini
    make train EXP=swe_mini ARGS='--config.env.swe.backend=podman \\
        --config.env.swe.image_template=localhost/sao-jax/swe-base:bookworm'

The second runs every workspace in a podman container of the base image that
`python -m sao_jax.envs.swe.images` builds from Debian packages (`.ci/run` builds it).
"""

import os

from experiments import base

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
# The protocol in ~90 tokens (the env's default prompt explains it in ~500): every token of an
# episode costs the CPU learner, and the warm start teaches the rest by example.
PROMPT = """Fix this issue in the repository at {root}:

{problem_statement}

Reply with one short thought and one ```bash block; it runs in a fresh shell at {root}. When \
done, submit with `echo {submit_marker}`. Hidden tests grade the fix."""


def get_config():
    config = base.get_config()
    config.name = "swe_mini"
    config.total_steps = 20
    config.batch_size = 8
    config.max_staleness = 2
    config.checkpoint_every = 10
    config.sample_every = 10
    config.rl.eps_low, config.rl.eps_high = 0.8, 3.0  # band 0.2 .. 4.0 (coding)
    # a cut episode submitted nothing: graded 0, not bootstrapped from V (or stalling pays)
    config.rl.bootstrap_truncated = False
    config.rl.critic_warmup_steps = 3
    config.optim.policy.learning_rate = 1e-4
    config.optim.critic.learning_rate = 1e-3

    config.model.preset = "toy512"  # 512 ids: the TIR tokenizer fits

    config.warm_start.enabled = True
    config.warm_start.batch = 8
    config.warm_start.learning_rate = 3e-3
    config.warm_start.max_steps = 400
    config.warm_start.eval_every = 25

    config.env.name = "swe"
    config.env.train_path = os.path.join(DATA, "swe_mini", "tasks.jsonl")
    config.env.eval_path = ""  # the last num_eval_prompts tasks are held out
    config.env.num_eval_prompts = 8
    config.env.tokenizer = os.path.join(DATA, "tir", "tokenizer")
    config.env.max_turns = 6
    config.env.max_action_tokens = 384
    config.env.max_response_tokens = 1280  # + a prompt of <= 767 tokens: rows of <= 2048
    config.env.swe.prompt_template = PROMPT
    config.env.swe.command_timeout = 20.0
    config.env.swe.output_chars = 1000
    config.env.swe.grade_timeout = 120.0

    config.rollout.engine_max_seq_len = 2047  # learner rows of <= 2048 (toy512 positions)
    config.rollout.engine_max_batch = 16
    config.rollout.worker_concurrency = 8
    return config
