"""Tool-integrated reasoning: math problems solved with a sandboxed Python tool
(docs/algorithm.md §4).

Hypothesis: on TIR, SAO with single rollouts matches or beats GRPO+DIS at the same number of
trajectories (paper: AIME25 93.5 -> 97.3), with the paper's hyperparameters: batch 128, group size
1, policy lr 1e-6, critic lr 5e-6, K = 2, alpha = 1.5, DIS band 0.7..6.0, temperature 1.

Prompts come from JSONL files (`{"prompt": ..., "answer": ...}` per line), the tokenizer and its
chat template from a local Hugging Face directory; model-written code runs in the namespace
sandbox (`sao_jax.envs.sandbox`). The shipped example (experiments/data/tir: 200 training and 50
held-out problems, a 512-id tokenizer) runs end to end on a CPU with a small random model — the
plumbing, not a result:

    make train EXP=tir ARGS='--config.total_steps=4 --config.batch_size=8'

A real run points at a model and its tokenizer (and, usually, an SGLang fleet and a TPU mesh):

    make train EXP=tir ARGS='--config.model.path=/models/Qwen3-30B-A3B \\
        --config.env.tokenizer=/models/Qwen3-30B-A3B --config.env.train_path=/data/tir.jsonl \\
        --config.env.eval_path=/data/aime25.jsonl --config.rollout.engine=sglang \\
        --config.rollout.engine_urls=http://gpu0:30000,http://gpu1:30000 \\
        --config.mesh.fsdp=16 --config.model.dtype=bfloat16 --workdir=runs/tir_qwen3'
"""

import os

from experiments import base

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tir")


def get_config():
    config = base.get_config()
    config.name = "tir"
    config.total_steps = 1000
    config.batch_size = 128
    config.rl.eps_low, config.rl.eps_high = 0.3, 5.0  # band 0.7 .. 6.0

    config.model.preset = "small"  # 512 ids: the example tokenizer fits

    config.env.name = "python_tool"
    config.env.train_path = os.path.join(DATA, "train.jsonl")
    config.env.eval_path = os.path.join(DATA, "heldout.jsonl")
    config.env.tokenizer = os.path.join(DATA, "tokenizer")
    config.env.max_turns = 4
    config.env.max_action_tokens = 256
    config.env.max_response_tokens = 1024
    config.env.num_eval_prompts = 50
    # A cut episode (turn or token limit) has no answer and is graded 0: its return is that,
    # not the critic's value, which would pay for stalling (docs/algorithm.md, on truncation).
    config.rl.bootstrap_truncated = False

    config.rollout.engine_max_seq_len = 2047  # learner rows of <= 2048 tokens
    config.rollout.engine_max_batch = 32
    config.rollout.worker_concurrency = 32
    return config
