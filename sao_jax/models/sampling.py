"""Batched sampling with a KV cache: prompts of different lengths, temperature, top-p, top-k, stops.

Every sampled token comes with its log-prob under the temperature-1 full softmax, whatever the
sampling filters: that is the behaviour log-prob DIS compares against (docs/design.md,
"Numerics that DIS depends on"). The cache is indexed by position: a row's prompt fills slots
[0, P_b), and the token at position p is written to slot p, so rows of different lengths need no
left padding.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.layout import unstack_layers
from sao_jax.models.transformer import CausalLM, causal_mask, empty_caches

FINISH_STOP, FINISH_LENGTH = 0, 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. `temperature=0` is greedy; `top_k=0` and `top_p=1` disable filters."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}.")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


class SampleOutput(NamedTuple):
    tokens_BxL: jax.Array  # int32 generated tokens, `pad_id` after the end
    logprobs_BxL: jax.Array  # float32 temperature-1 log-probs of those tokens, 0 after the end
    lengths_B: jax.Array  # int32 tokens generated, the stop token included
    finish_reason_B: jax.Array  # FINISH_STOP or FINISH_LENGTH


def filter_logits_rows(logits_BxV, temperature_B, top_p_B, top_k_B):
    """Temperature, then top-k, then top-p (nucleus), with each row's own parameters: the one
    sampling filter, of `generate` (through `filter_logits`) and of the embedded engine.

    Per row, in this order:
      1. temperature: logits / T. A row with T <= 0 is left unscaled (it decodes greedily).
      2. top-k: keep the logits >= the k-th largest (all ties with it). k <= 0 or k >= V: no filter.
      3. top-p, over the distribution renormalised to what top-k kept: sorted by probability,
         a token is kept while the mass before it is still below p, i.e. the smallest prefix whose
         mass reaches p, the token that crosses p included (the most likely token is always
         kept), and every token tied with the last kept logit. p >= 1: no filter.

    Args:
      logits_BxV: float logits. temperature_B, top_p_B: float per row. top_k_B: int per row.

    Returns:
      `[B, V]` the scaled logits, -inf where filtered.
    """
    temperature_B = jnp.where(temperature_B > 0, temperature_B, 1.0)
    logits_BxV = logits_BxV / temperature_B[:, None]
    v = logits_BxV.shape[-1]
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    k_B = jnp.where((top_k_B > 0) & (top_k_B < v), top_k_B, v)
    kth_Bx1 = jnp.take_along_axis(sorted_BxV, k_B[:, None] - 1, axis=-1)
    logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    sorted_BxV = jnp.where(sorted_BxV < kth_Bx1, -jnp.inf, sorted_BxV)  # still sorted
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)  # renormalised over the top-k
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    kept_BxV = jnp.where(before_BxV < top_p_B[:, None], sorted_BxV, jnp.inf)
    threshold_Bx1 = jnp.min(kept_BxV, axis=-1, keepdims=True)
    threshold_Bx1 = jnp.where(top_p_B[:, None] < 1.0, threshold_Bx1, -jnp.inf)
    return jnp.where(logits_BxV < threshold_Bx1, -jnp.inf, logits_BxV)


def filter_logits(logits_BxV, params: SamplingParams):
    """`filter_logits_rows` with `params` for every row (`temperature > 0`)."""
    if params.top_k == 0 and params.top_p >= 1.0:  # nothing to filter: no sort
        return logits_BxV / params.temperature
    b = logits_BxV.shape[0]
    return filter_logits_rows(logits_BxV, jnp.full((b,), params.temperature, jnp.float32),
                              jnp.full((b,), params.top_p, jnp.float32),
                              jnp.full((b,), params.top_k, jnp.int32))


def _pick(logits_BxV, key, params: SamplingParams):
    if params.temperature == 0.0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits_BxV, params)).astype(jnp.int32)


def generate(model: CausalLM, prompt_ids_BxP, prompt_lengths_B, params: SamplingParams, key,
             *, pad_id: int = 0) -> SampleOutput:
    """Samples up to `params.max_new_tokens` tokens after each prompt.

    Args:
      model: the policy.
      prompt_ids_BxP: int prompts, right-padded to a common length P.
      prompt_lengths_B: int, the real length of each prompt (>= 1).
      params: sampling parameters (static: a new value compiles a new program).
      key: PRNG key.
      pad_id: written after a row has finished.

    Returns:
      `SampleOutput`; row b holds `lengths_B[b]` tokens.
    """
    graphdef, state = nnx.split(unstack_layers(model))  # a scanned model: a per-layer copy
    return _generate(graphdef, state, jnp.asarray(prompt_ids_BxP, jnp.int32),
                     jnp.asarray(prompt_lengths_B, jnp.int32), key, params, pad_id)


@partial(jax.jit, static_argnums=(0, 5, 6))
def _generate(graphdef, state, prompt_BxP, lengths_B, key, params: SamplingParams, pad_id: int):
    model: CausalLM = nnx.merge(graphdef, state)
    cfg = model.cfg
    b, p = prompt_BxP.shape
    slots = p + params.max_new_tokens
    dtype = jnp.dtype(cfg.param_dtype)
    caches = empty_caches(cfg, b, slots, dtype)
    slot_S = jnp.arange(slots)
    head = model.head_weight()

    def step_logits(ids_BxT, positions_BxT, caches):
        mask = causal_mask(positions_BxT, key_positions_BxS=jnp.broadcast_to(slot_S, (b, slots)))
        out = model.backbone(ids_BxT, positions_BxT, mask, dispatch=cfg.logprob_dispatch,
                             caches=caches, slots_BxT=positions_BxT)
        return out, head

    positions_BxP = jnp.broadcast_to(jnp.arange(p), (b, p))
    out, _ = step_logits(prompt_BxP, positions_BxP, caches)
    caches = out.caches
    last_BxD = out.hidden_BxTxD[jnp.arange(b), lengths_B - 1]
    stops = jnp.asarray(params.stop_token_ids or (-1,), jnp.int32)

    def sample(hidden_BxD, key):
        logits_BxV = jnp.einsum("bd,dv->bv", hidden_BxD, head, preferred_element_type=jnp.float32)
        token_B = _pick(logits_BxV, key, params)
        logp_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BxV), token_B[:, None], 1)[:, 0]
        return token_B, logp_B

    tokens = jnp.full((b, params.max_new_tokens), pad_id, jnp.int32)
    logprobs = jnp.zeros((b, params.max_new_tokens), jnp.float32)
    key, sub = jax.random.split(key)
    token_B, logp_B = sample(last_BxD, sub)
    done_B = jnp.zeros((b,), bool)

    def record(i, token_B, logp_B, tokens, logprobs, done_B, n_B):
        live = ~done_B
        tokens = tokens.at[:, i].set(jnp.where(live, token_B, pad_id))
        logprobs = logprobs.at[:, i].set(jnp.where(live, logp_B, 0.0))
        n_B = n_B + live.astype(jnp.int32)
        stopped = live & jnp.any(token_B[:, None] == stops[None, :], axis=1)
        return tokens, logprobs, done_B | stopped, n_B, stopped

    tokens, logprobs, done_B, n_B, stopped_B = record(
        0, token_B, logp_B, tokens, logprobs, done_B, jnp.zeros((b,), jnp.int32))

    def cond(carry):
        i, *_, done_B, _, _ = carry
        return (i < params.max_new_tokens) & ~jnp.all(done_B)

    def body(carry):
        i, token_B, caches, key, tokens, logprobs, done_B, n_B, stopped_B = carry
        positions_Bx1 = (lengths_B + i - 1)[:, None]  # the previous token goes to its slot
        out, _ = step_logits(token_B[:, None], positions_Bx1, caches)
        key, sub = jax.random.split(key)
        token_B, logp_B = sample(out.hidden_BxTxD[:, 0], sub)
        tokens, logprobs, done_B, n_B, new_stop = record(i, token_B, logp_B, tokens, logprobs,
                                                         done_B, n_B)
        return (i + 1, token_B, out.caches, key, tokens, logprobs, done_B, n_B,
                stopped_B | new_stop)

    carry = (jnp.int32(1), token_B, caches, key, tokens, logprobs, done_B, n_B, stopped_B)
    carry = jax.lax.while_loop(cond, body, carry)
    _, _, _, _, tokens, logprobs, _, n_B, stopped_B = carry
    finish = jnp.where(stopped_B, FINISH_STOP, FINISH_LENGTH).astype(jnp.int32)
    return SampleOutput(tokens, logprobs, n_B, finish)
