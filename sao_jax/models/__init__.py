"""The Qwen3-MoE / Qwen3 model family in Flax NNX: policy and critic, HF interop, log-probs.

See `transformer.py` for the dimension legend used in array names.
"""

from sao_jax.models.config import ModelConfig
from sao_jax.models.hf import load_hf, save_hf
from sao_jax.models.layout import reconfigure, stack_layers, unstack_layers
from sao_jax.models.logprobs import token_logprobs, token_logprobs_reference
from sao_jax.models.transformer import (
    CausalLM,
    Transformer,
    ValueModel,
    causal_mask,
    expert_routes,
    route_agreement,
)

__all__ = [
    "CausalLM",
    "ModelConfig",
    "Transformer",
    "ValueModel",
    "causal_mask",
    "expert_routes",
    "route_agreement",
    "load_hf",
    "reconfigure",
    "save_hf",
    "stack_layers",
    "token_logprobs",
    "token_logprobs_reference",
    "unstack_layers",
]
