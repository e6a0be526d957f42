"""The production setting: Qwen3-30B-A3B on SWE tasks, SGLang rollouts, a TPU learner.

Hypothesis: SAO improves SWE-Bench Verified over GRPO+DIS (paper: base 23.0, GRPO+DIS 27.0,
SAO 29.8) with single rollouts of long agent trajectories (128k tokens), the coding DIS band
0.2..4.0, and the critic trained twice per policy step with its attention frozen.

Launch recipe (a TPU VM learner, GPU SGLang hosts, CPU rollout hosts with containers):

1. Tasks: a local JSONL of SWE-bench instances, e.g. SWE-Gym or SWE-smith exported unchanged
   (`load_tasks` reads the published files; FAIL_TO_PASS / PASS_TO_PASS as lists or JSON strings)
   for training and SWE-bench Verified for `env.eval_path`.
2. Images: each task runs in its SWE-bench evaluation image (the repository at /testbed), named by
   `env.swe.image_template` (default: SWE-bench's published `swebench/sweb.eval.x86_64.<id>`
   images; SWE-Gym and SWE-smith publish theirs under other names: set the template, or an
   `image` field per task). Pull them on the rollout hosts beforehand (`podman pull ...`): a host
   without registry access fails the episode with the image's name.
3. SGLang servers, one per GPU host (`pip install -e ".[sglang]"` there: SGLang 0.5.2 through
   0.5.23), with the policy's weights and a weight version the learner can overwrite; the
   environment variables make SGLang return temperature-1 log-probs, as DIS expects, at any
   sampling temperature (the name changed in 0.5.x; setting both is harmless):
       SGLANG_RETURN_ORIGINAL_LOGPROB=1 RETURN_ORIGINAL_LOGPROB=1 \\
       python -m sglang.launch_server --model-path /models/Qwen3-30B-A3B --host 0.0.0.0 \\
           --port 30000 --context-length 131072 --weight-version 0
   The learner writes each new policy to <workdir>/weights/v<N>/ and calls
   /update_weights_from_disk on every server, so <workdir> must be on storage the GPU hosts
   mount at the same path.
4. The learner, on the TPU VM (it starts the rollout workers; workers run bash in containers, so
   the host that runs them needs podman or docker):
       make train EXP=swe ARGS='--config.model.path=/models/Qwen3-30B-A3B \\
           --config.env.tokenizer=/models/Qwen3-30B-A3B \\
           --config.env.train_path=/data/swe-gym.jsonl \\
           --config.env.eval_path=/data/swe-bench-verified.jsonl \\
           --config.rollout.engine_urls=http://gpu0:30000,http://gpu1:30000'

`make plan EXP=swe` compiles this learner step for the v5p:2x4x4 slice from any host. Its figures
(Qwen3-30B-A3B from the preset, float32 master weights computing in bfloat16, AdamW's first
moments in bfloat16, 128 rows of up to 131,071 trajectory tokens bucketed to 131,072, in 8
micro-batches, remat nested, blockwise attention, MoE per shard in 32 chunks of 4,096 tokens,
fsdp 16 x expert 2), per device: 3.73 GiB of policy parameters, 5.60 GiB of policy AdamW state,
3.66 + 5.18 GiB for the critic, 58.59 GiB of temporaries; peak 77.11 GiB of 95 (81%, headroom
17.89 GiB, 18.8%); compiled in 11-17 minutes here; 1.055e19 model FLOPs per step, 23,356
tokens/s at 100% of the chips' peak, 9,342 at 40%. Its roofline per device: 1.02e18 FLOPs
executed (remat's recomputation included) take 2,221 s at the chip's peak, 1.91e16 HBM bytes
6,889 s, 3.78e13 collective bytes 32 s: HBM-bound (docs/scale.md, "Where `swe` stands", says by
what). Remat full needs 103.17 GiB with the float32 state (it fitted the bfloat16 state at
76.54 GiB).

A missing tasks file or container runtime stops the run within seconds, naming what is missing.
The same code trains on the bundled CPU set with the container backend (tested):

    make train EXP=swe_mini ARGS='--config.env.swe.backend=podman \\
        --config.env.swe.image_template=localhost/sao-jax/swe-base:bookworm'
"""

from experiments import base


def get_config():
    config = base.get_config()
    config.name = "swe"
    config.total_steps = 1000
    config.batch_size = 128
    config.rl.eps_low, config.rl.eps_high = 0.8, 3.0  # band 0.2 .. 4.0 (coding)
    # a cut episode submitted nothing: graded 0, not bootstrapped from V (or stalling pays)
    config.rl.bootstrap_truncated = False
    # 128k-token rows: accumulate over row chunks of 16 rows, one per batch shard.
    config.rl.microbatches = 8

    config.model.path = "/models/Qwen3-30B-A3B"  # a local Hugging Face directory
    config.model.preset = "qwen3-30b-a3b"  # its architecture, for `make plan` without it
    config.model.dtype = "bfloat16"
    config.model.moe_dispatch = "ragged"
    config.model.logprob_dispatch = "ragged"

    # A v5p-64 slice (32 chips, 64 TensorCores as 32 megacore devices) for the learner.
    config.plan.topology = "v5p:2x4x4"
    config.mesh.fsdp = 16
    config.mesh.expert = 2
    # float32 master weights (base's model.master_dtype) with bfloat16 compute: with remat
    # "full" the step needs 103 GiB of the chip's 95; "nested" (one more forward pass) fits
    # (docs/scale.md, "Where `swe` stands").
    config.model.remat = "nested"
    # AdamW's first moments in bfloat16 (the second and the weights stay float32; DeepSeek-V3
    # kept both moments in bfloat16), and the experts fed 4,096 tokens at a time: together
    # 8.6 GiB a device, the headroom from 9.8% to 18.8% (docs/scale.md).
    config.optim.policy.mu_dtype = config.optim.critic.mu_dtype = "bfloat16"
    config.model.moe_token_chunk = 4096
    config.model.attention = "blockwise"  # 128k-token rows: no [T, T] scores or mask

    config.env.name = "swe"
    config.env.tokenizer = "/models/Qwen3-30B-A3B"
    config.env.train_path = "/data/swe-gym.jsonl"
    config.env.eval_path = "/data/swe-bench-verified.jsonl"
    config.env.num_eval_prompts = 500
    config.env.max_turns = 100
    config.env.max_action_tokens = 8192
    config.env.max_response_tokens = 131072
    config.env.swe.backend = "podman"
    config.env.swe.command_timeout = 120.0
    config.env.swe.grade_concurrency = 8

    config.rollout.engine = "sglang"
    config.rollout.engine_urls = "http://127.0.0.1:30000"
    # 131,071, not 131,072: a batch row holds the trajectory and one slot more (make_batch), so
    # 131,072-token trajectories made 131,073-token rows, bucketed to 147,456 (16,383 tokens of
    # padding in every row of the longest batches, and 81.36 of 95 GiB per device in `make
    # plan`); one token less fits the 131,072 bucket exactly (8 x 16,384).
    config.rollout.engine_max_seq_len = 131071
    # 25 bucketed lengths up to 128k: compile each on first use, not all before step 1.
    config.precompile_steps = False
    config.rollout.num_workers = 8
    config.rollout.worker_concurrency = 64
    return config
