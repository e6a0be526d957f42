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
    filter_logits_rows,
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
    assert kept(top_k=0) == [True] * 4
    assert kept(top_k=4) == kept(top_k=99) == [True] * 4  # k >= V: no filter
    # Top-k first, then top-p over the renormalised top 2 (0.625, 0.375): the first token alone
    # reaches 0.6 (of the full distribution, 0.5, it would not).
    assert kept(top_k=2, top_p=0.6) == [True, False, False, False]
    assert kept(top_p=0.6) == [True, True, False, False]
    with pytest.raises(ValueError, match="top_p must lie in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def filter_loop(logits, temperature, top_p, top_k):
    """The sampling filter written as plain Python over one row: temperature, top-k (ties with the
    k-th kept), then top-p over the renormalised survivors (the token crossing p kept, and ties
    with the last kept)."""
    x = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
    v = x.size
    if 0 < top_k < v:
        x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
    if top_p < 1.0:
        order = sorted(range(v), key=lambda i: -x[i])
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        mass, last = 0.0, None
        for i in order:
            if mass >= top_p:
                break
            last = x[i]
            mass += probs[i]
        x = np.where(x < last, -np.inf, x)
    return np.isfinite(x)


@pytest.mark.parametrize("seed", range(4))
def test_filter_matches_a_plain_loop(seed):
    rng = np.random.default_rng(seed)
    rows, vocab = 64, 23
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 2
    logits[:8] = np.round(logits[:8])  # ties, at the k-th logit and at the nucleus' edge
    temperature = rng.choice([0.0, 0.5, 1.0, 1.7], rows).astype(np.float32)
    top_p = rng.choice([0.05, 0.3, 0.9, 0.999, 1.0], rows).astype(np.float32)
    top_k = rng.choice([-1, 0, 1, 3, 10, vocab, vocab + 5], rows).astype(np.int32)
    got = np.isfinite(filter_logits_rows(jnp.asarray(logits), temperature, top_p, top_k))
    for b in range(rows):
        want = filter_loop(logits[b], temperature[b], top_p[b], top_k[b])
        np.testing.assert_array_equal(got[b], want, err_msg=f"row {b}: T={temperature[b]}, "
                                      f"p={top_p[b]}, k={top_k[b]}")
        assert got[b].any()  # the most likely token always survives
