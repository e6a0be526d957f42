"""KV-cache sampling: its log-probs equal teacher-forced ones, cached equals uncached, filters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import CausalLM, ModelConfig
from sao_jax.models.sampling import (
    FINISH_LENGTH,
    FINISH_STOP,
    SamplingParams,
    filter_logits,
    generate,
)

CFG = ModelConfig(vocab_size=37, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, mlp_only_layers=(0,))


_forward = nnx.jit(lambda m, x: m(x))


@pytest.fixture(scope="module")
def model():
    return CausalLM(CFG, nnx.Rngs(0))


def prompts():
    lengths = np.array([3, 7, 1, 5])
    ids = np.zeros((4, 7), np.int32)
    rng = np.random.default_rng(0)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(1, CFG.vocab_size, size=n)
    return ids, lengths


def teacher_forced_logprobs(model, prompt, n_prompt, tokens):
    seq = np.zeros((1, 16), np.int32)  # one shape: one compilation
    seq[0, : n_prompt + len(tokens)] = np.concatenate([prompt[:n_prompt], tokens])
    logp = jax.nn.log_softmax(_forward(model, jnp.asarray(seq)), axis=-1)[0]
    steps = np.arange(len(tokens))
    return np.asarray(logp[n_prompt - 1 + steps, tokens])


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=9, temperature=1.0),
    SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.8, top_k=6),
    SamplingParams(max_new_tokens=9, temperature=0.0),
])
def test_sampler_logprobs_equal_teacher_forced(model, params):
    ids, lengths = prompts()
    out = generate(model, ids, lengths, params, jax.random.key(1))
    for b in range(4):
        n = int(out.lengths_B[b])
        tokens = np.asarray(out.tokens_BxL[b, :n])
        want = teacher_forced_logprobs(model, ids[b], lengths[b], tokens)
        np.testing.assert_allclose(out.logprobs_BxL[b, :n], want, atol=1e-5)
        assert np.all(np.asarray(out.logprobs_BxL[b, n:]) == 0.0)


def test_cached_greedy_equals_uncached_greedy(model):
    ids, lengths = prompts()
    out = generate(model, ids, lengths, SamplingParams(max_new_tokens=8, temperature=0.0),
                   jax.random.key(0))
    # No cache: the whole (right-padded) sequence again for every token; causality makes the
    # padding after a row's end irrelevant.
    seq = np.zeros((4, ids.shape[1] + 8), np.int32)
    seq[:, : ids.shape[1]] = ids
    rows = np.arange(4)
    for i in range(8):
        logits = _forward(model, jnp.asarray(seq))
        seq[rows, lengths + i] = np.asarray(jnp.argmax(logits[rows, lengths + i - 1], axis=-1))
    for b in range(4):
        np.testing.assert_array_equal(out.tokens_BxL[b], seq[b, lengths[b]:lengths[b] + 8])


def test_stop_tokens_and_finish_reasons(model):
    ids, lengths = prompts()
    greedy = generate(model, ids, lengths, SamplingParams(max_new_tokens=6, temperature=0.0),
                      jax.random.key(0))
    stop = int(greedy.tokens_BxL[1, 2])  # row 1's third token
    out = generate(model, ids, lengths,
                   SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop,)),
                   jax.random.key(0), pad_id=-1)
    for b in range(4):
        row = list(np.asarray(greedy.tokens_BxL[b]))
        n = row.index(stop) + 1 if stop in row else 6
        assert int(out.lengths_B[b]) == n
        assert int(out.finish_reason_B[b]) == (FINISH_STOP if stop in row else FINISH_LENGTH)
        np.testing.assert_array_equal(out.tokens_BxL[b, :n], row[:n])
        assert np.all(np.asarray(out.tokens_BxL[b, n:]) == -1)


def test_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda **kw: np.isfinite(filter_logits(logits, SamplingParams(**kw)))[0].tolist()
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.5) == [True, False, False, False]
    assert kept(top_p=0.81) == [True, True, True, False]
    assert kept(top_p=1.0) == [True] * 4
    with pytest.raises(ValueError, match="top_p must lie in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
