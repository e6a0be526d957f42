"""The production setting: Qwen3-30B-A3B on SWE tasks, SGLang rollouts, a TPU learner.

Hypothesis: SAO improves SWE-Bench Verified over GRPO+DIS (paper: base 23.0, GRPO+DIS 27.0,
SAO 29.8) with single rollouts of long agent trajectories (128k tokens), the coding DIS band
0.2..4.0, and the critic trained twice per policy step with its attention frozen.

    make train EXP=swe ARGS='--config.model.path=/models/Qwen3-30B-A3B \\
        --config.rollout.engine_urls=http://gpu0:30000,http://gpu1:30000'

It needs what this repository does not provide yet: the SWE environment (external agent
scaffolds running in containers, with their own task images). Until it lands, `make train EXP=swe`
stops with a message saying so; the config itself loads and validates everywhere.
"""

from experiments import base


def get_config():
    config = base.get_config()
    config.name = "swe"
    config.unavailable = ("the SWE environment (agent scaffolds in containers) is not part of "
                          "this repository yet; this config records the production settings.")
    config.total_steps = 1000
    config.batch_size = 128
    config.rl.eps_low, config.rl.eps_high = 0.8, 3.0  # band 0.2 .. 4.0 (coding)
    config.rl.microbatches = 16  # 128k-token rows: accumulate over row chunks

    config.model.preset = ""
    config.model.path = "/models/Qwen3-30B-A3B"  # a local Hugging Face directory
    config.model.dtype = "bfloat16"
    config.model.moe_dispatch = "ragged"
    config.model.logprob_dispatch = "ragged"

    config.mesh.fsdp = 32  # a v5p-64 slice: 32 chips for the learner
    config.mesh.expert = 2

    config.env.name = "swe"
    config.env.tokenizer = "/models/Qwen3-30B-A3B"
    config.env.max_turns = 100
    config.env.max_action_tokens = 8192
    config.env.max_response_tokens = 131072

    config.rollout.engine = "sglang"
    config.rollout.engine_urls = "http://127.0.0.1:30000"
    config.rollout.engine_max_seq_len = 131072
    # 17 bucketed lengths up to 128k: compile each on first use, not all before step 1.
    config.precompile_steps = False
    config.rollout.num_workers = 8
    config.rollout.worker_concurrency = 64
    return config
