"""The toy run through real SGLang: the calculator task and SAO of `toy.py`, rollouts from an SGLang
0.5.23 server started on this host (its own virtualenv, made on first use: `make sglang`).

Hypothesis: SAO learns as well through SGLang as through the embedded engine: the same run (steps,
seed, model) with either engine ends within the embedded engine's seed-to-seed spread, because the
engines' log-probs of a sampled token agree to 1e-5 and the trajectories carry the same fields.
The model is `toy_moe`, the toy in the shape SGLang's Qwen3-MoE serves (every layer MoE, an
untied LM head: SGLang ignores `mlp_only_layers` and `tie_word_embeddings`); with `engine =
embedded` the same file is the baseline.

    make sglang                                              # SGLang's virtualenv (~5 min, once)
    make train EXP=toy_sglang                                # runs/toy_sglang
    make train EXP=toy_sglang ARGS='--config.rollout.engine=embedded --workdir=runs/toy_embedded'
"""

from experiments import toy


def get_config():
    config = toy.get_config()
    config.name = "toy_sglang"
    config.model.preset = "toy_moe"
    config.rollout.engine = "sglang"
    config.rollout.sglang.device = "cpu"
    return config
