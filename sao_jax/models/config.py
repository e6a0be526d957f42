"""Model configuration of the Qwen3-MoE / Qwen3 family, and its Hugging Face spellings."""

from __future__ import annotations

import dataclasses
from typing import Any

MOE_DISPATCHES = ("dense", "ragged", "capacity")
REMAT_POLICIES = ("none", "full", "save_dots", "nested")
ATTENTIONS = ("dense", "blockwise")
DROP_FREE_DISPATCHES = ("dense", "ragged")
HF_MODEL_TYPES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Qwen3-MoE (num_experts > 0) or dense Qwen3 (num_experts = 0) decoder.

    Field names follow the Hugging Face config where one exists. `moe_dispatch` chooses how tokens
    reach experts in training forward passes: "dense" (every expert sees every token, weighted by
    the router: drop-free, simple, fine for tiny models), "ragged" (tokens sorted by expert and
    `lax.ragged_dot`: drop-free, the accelerator path) or "capacity" (at most
    `ceil(capacity_factor * tokens * top_k / num_experts)` tokens per expert; overflow is dropped).
    Anything that produces or compares log-probs uses `logprob_dispatch`, which must be drop-free:
    a dropped token makes the learner's log-prob depend on batch composition (docs/design.md,
    "Numerics that DIS depends on").

    `scan_layers` stores the decoder layers stacked (each parameter with a leading layer axis,
    `layer_groups`) and runs them under `lax.scan`, so that a compiled training step holds one
    layer, not `num_layers`; the per-layer layout (False) is what decoding with a KV cache uses
    (the engine, the sampler), since slicing stacked weights every decode step costs memory
    traffic there. `remat` (scanned layers only) recomputes a layer's activations in the
    backward pass: "full" keeps only each layer's input, "save_dots" also keeps the outputs of
    its weight matmuls (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`), "nested"
    keeps only the inputs of groups of about sqrt(layers) layers through the forward pass and
    recomputes one group at a time (one more forward pass; for long rows, where even one saved
    input per layer is too much).

    `attention` is how passes without a KV cache (training, teacher forcing) attend: "dense"
    forms the `[B, heads, T, T]` scores and the `[B, T, T]` mask; "blockwise"
    (`models.attention`) goes through `attention_block`-token blocks with an online softmax and
    a recomputing backward pass, never holding more than a block pair's scores, for long rows.
    Decoding with a KV cache is always dense.

    `moe_token_chunk`: a training pass sends tokens through the experts this many at a time per
    device (a rematerialised loop; 0: all at once), so that one MoE layer's dispatch buffers stay
    bounded on 128k-token rows (`MoE.__call__`).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers
    num_experts: int = 0  # 0: a dense Qwen3
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.001
    param_dtype: str = "float32"
    moe_dispatch: str = "dense"
    logprob_dispatch: str = "dense"
    capacity_factor: float = 1.25
    moe_token_chunk: int = 8192
    scan_layers: bool = False
    remat: str = "none"
    attention: str = "dense"
    attention_block: int = 512

    def __post_init__(self):
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "intermediate_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention.")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}.")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"ModelConfig.num_experts_per_tok must lie in [1, num_experts="
                    f"{self.num_experts}], got {self.num_experts_per_tok}.")
            if self.moe_intermediate_size < 1:
                raise ValueError("ModelConfig.moe_intermediate_size must be >= 1 when "
                                 f"num_experts > 0, got {self.moe_intermediate_size}.")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(f"ModelConfig.moe_dispatch must be one of {MOE_DISPATCHES}, got "
                             f"{self.moe_dispatch!r}.")
        if self.logprob_dispatch not in DROP_FREE_DISPATCHES:
            raise ValueError(
                f"ModelConfig.logprob_dispatch must be drop-free, one of {DROP_FREE_DISPATCHES}, "
                f"got {self.logprob_dispatch!r}.")
        if self.decoder_sparse_step < 1:
            raise ValueError(
                f"ModelConfig.decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}.")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat must be one of {REMAT_POLICIES}, got "
                             f"{self.remat!r}.")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"ModelConfig.attention must be one of {ATTENTIONS}, got "
                             f"{self.attention!r}.")
        if self.moe_token_chunk < 0:
            raise ValueError(f"ModelConfig.moe_token_chunk must be >= 0 (0: all tokens at once), "
                             f"got {self.moe_token_chunk}.")
        if self.attention_block < 1:
            raise ValueError(f"ModelConfig.attention_block must be >= 1, got "
                             f"{self.attention_block}.")
        if self.remat != "none" and not self.scan_layers:
            raise ValueError(f"ModelConfig.remat = {self.remat!r} needs scan_layers=True (it "
                             "wraps the scanned layer).")

    def is_moe_layer(self, layer: int) -> bool:
        """As Hugging Face's Qwen3-MoE: experts unless listed in mlp_only_layers or off-step."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def layer_groups(self) -> tuple[tuple[int, int, int], ...]:
        """`(first, period, repeats)` per group of the scanned layout: group layers `first + r *
        period + j` (r < repeats, j < period) run as `repeats` scan steps over a block of
        `period` layers. One group when the dense/MoE pattern repeats (all alike: period 1; a
        `decoder_sparse_step` of k: period k), else one group per run of like layers (e.g.
        `mlp_only_layers` = (3,) in 8 layers: (0, 1, 3), (3, 1, 1), (4, 1, 4))."""
        kinds = [self.is_moe_layer(i) for i in range(self.num_layers)]
        n = self.num_layers
        for period in range(1, n // 2 + 1):
            if n % period == 0 and all(kinds[i] == kinds[i % period] for i in range(n)):
                return ((0, period, n // period),)
        groups, first = [], 0
        for i in range(1, n + 1):
            if i == n or kinds[i] != kinds[first]:
                groups.append((first, 1, i - first))
                first = i
        return tuple(groups)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **overrides) -> ModelConfig:
        """Reads a Hugging Face `config.json` dict of a Qwen3-MoE or Qwen3 model.

        Both spellings in the wild are accepted: `num_experts` / `rope_theta` (the published Qwen3
        checkpoints) and `num_local_experts` / `rope_parameters` (as transformers 5 writes them).
        """
        model_type = hf.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(
                f"config.json: model_type {model_type!r} is not supported; sao_jax reads "
                f"{sorted(HF_MODEL_TYPES)} (architectures {sorted(HF_MODEL_TYPES.values())}).")
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type != "default":
            raise ValueError(f"config.json: rope type {rope_type!r} is not supported (only "
                             "'default' RoPE); remove the scaling or convert the checkpoint.")
        if hf.get("attention_bias"):
            raise ValueError("config.json: attention_bias=true is not supported by Qwen3 models.")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported "
                             "(Qwen3 uses 'silu').")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        num_experts = hf.get("num_experts", hf.get("num_local_experts", 0)) or 0
        if model_type == "qwen3":
            num_experts = 0
        heads = hf["num_attention_heads"]
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            num_experts=num_experts,
            num_experts_per_tok=hf.get("num_experts_per_tok", 2),
            moe_intermediate_size=hf.get("moe_intermediate_size", 0) or 0,
            norm_topk_prob=hf.get("norm_topk_prob", True),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=hf.get("max_position_embeddings", 40960),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """The `config.json` dict in the spelling of the published Qwen3 checkpoints."""
        model_type = "qwen3_moe" if self.num_experts else "qwen3"
        hf = dict(
            architectures=[HF_MODEL_TYPES[model_type]],
            model_type=model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            torch_dtype=dtype,
        )
        if self.num_experts:
            hf.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
                output_router_logits=False,
            )
        return hf


def preset(name: str, **overrides) -> ModelConfig:
    """Named sizes: "toy" (~0.1M parameters: the CPU default of `make train` and the tests),
    "toy_moe" (the toy in the shape SGLang serves: every layer MoE, an untied LM head),
    "toy512" (the toy with a 512-id vocabulary and 2048 positions, for the TIR tokenizer's
    long SWE episodes: 0.85 s per SFT step at 8 x 832 tokens here, against 2.6 s for "small"),
    "mini512" (~0.43M: toy512 twice as wide, its LM head untied; the swe_tiny policy: 0.42 s
    per SFT step at 16 x 384 tokens here, against 0.32 s for toy512 and 1.25 s for "small"),
    "small" (~1.5M), "100m" (~110M, 8 experts, for throughput benchmarks) and "qwen3-30b-a3b"
    (30.5B, 3.3B active: the architecture of `experiments/swe.py`, for `make plan`)."""
    presets = {
        "toy": dict(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=64, mlp_only_layers=(0,), tie_word_embeddings=True,
                    max_position_embeddings=1024),
        # The toy as SGLang's Qwen3-MoE can serve it (rollout.engine = "sglang"): every layer
        # MoE and an untied LM head (SGLang 0.5.23 ignores mlp_only_layers and
        # tie_word_embeddings for qwen3_moe).
        "toy_moe": dict(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=16, intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=64, max_position_embeddings=1024),
        "toy512": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, intermediate_size=128, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=(0,),
                       tie_word_embeddings=True, max_position_embeddings=2048),
        "mini512": dict(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=32, intermediate_size=256, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=(0,),
                        max_position_embeddings=2048),
        "small": dict(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                      head_dim=32, intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=128, max_position_embeddings=4096),
        # Qwen3-30B-A3B's config.json (Hugging Face, Qwen/Qwen3-30B-A3B): the architecture
        # `make plan EXP=swe` compiles for when the checkpoint itself is not on the host.
        "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                              num_kv_heads=4, head_dim=128, intermediate_size=6144,
                              num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                              norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                              max_position_embeddings=40960, tie_word_embeddings=False),
        "100m": dict(vocab_size=32000, hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4,
                     head_dim=64, intermediate_size=2048, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=1024, max_position_embeddings=8192),
    }
    if name not in presets:
        raise ValueError(f"unknown model preset {name!r}; presets are {sorted(presets)}.")
    return ModelConfig(**{**presets[name], **overrides})
