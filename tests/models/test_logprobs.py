"""`token_logprobs`: forward, entropy and gradients against the full log-softmax, and its memory."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from sao_jax.models.logprobs import token_logprobs, token_logprobs_reference

# B, T, D, V, chunk_size, token_chunk_size: V and B * T multiples of the tiles or not, tiles larger
# than the array, one column per chunk, one token per block.
SHAPES = [
    (2, 5, 8, 37, 8, 3),
    (3, 4, 16, 64, 16, 12),
    (1, 7, 4, 10, 100, 100),
    (2, 3, 6, 11, 1, 2),
    (1, 6, 5, 9, 4, 1),
    (2, 2, 3, 1, 1, 4),
]
# The target: one 8192-token sequence of a Qwen3-class model (D = 2048, V = 151936).
LARGE = dict(length=8192, width=2048, vocab=151936)


def make_inputs(batch, length, width, vocab, dtype=jnp.float32, seed=0, scale=1.0):
    """Logits of order `scale`: lm_head columns of norm about 1, unit-variance hidden states."""
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(scale * rng.normal(size=(batch, length, width)), dtype)
    lm_head = jnp.asarray(rng.normal(size=(width, vocab)) / np.sqrt(width), dtype)
    targets = jnp.asarray(rng.integers(0, vocab, size=(batch, length)), jnp.int32)
    return hidden, lm_head, targets


def float64_truth(hidden, lm_head, targets):
    """(logp, entropy) in float64 NumPy from the same (possibly rounded) inputs."""
    logits = np.einsum("btd,dv->btv", np.asarray(hidden, np.float64),
                       np.asarray(lm_head, np.float64))
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    entropy = -(np.exp(logp) * logp).sum(-1)
    return np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0], entropy


def weighted_loss(fn, targets, w_logp, w_entropy):
    """sum(w_logp * logp + w_entropy * entropy): random cotangents for both outputs."""

    def loss(hidden, lm_head):
        logp, entropy = fn(hidden, lm_head, targets)
        return jnp.sum(w_logp * logp) + jnp.sum(w_entropy * entropy)

    return loss


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_full_log_softmax(shape, jit):
    *dims, chunk, block = shape
    hidden, lm_head, targets = make_inputs(*dims, scale=2.0)
    fn = lambda h, w, y: token_logprobs(h, w, y, chunk_size=chunk, token_chunk_size=block,
                                        return_entropy=True)
    logp, entropy = (jax.jit(fn) if jit else fn)(hidden, lm_head, targets)
    want_logp, want_entropy = token_logprobs_reference(hidden, lm_head, targets,
                                                       return_entropy=True)
    assert logp.shape == entropy.shape == targets.shape
    assert logp.dtype == entropy.dtype == jnp.float32
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-5)
    only_logp = token_logprobs(hidden, lm_head, targets, chunk_size=chunk, token_chunk_size=block)
    np.testing.assert_array_equal(only_logp, logp)


def test_hand_computed_two_token_vocabulary():
    # logits = [0, log 3] in every chunking: p = [1/4, 3/4].
    hidden = jnp.ones((1, 2, 1), jnp.float32)
    lm_head = jnp.array([[0.0, np.log(3.0)]], jnp.float32)
    targets = jnp.array([[0, 1]])
    want_entropy = -(0.25 * np.log(0.25) + 0.75 * np.log(0.75))
    for chunk in (1, 2, 5):
        logp, entropy = token_logprobs(hidden, lm_head, targets, chunk_size=chunk,
                                       return_entropy=True)
        np.testing.assert_allclose(logp, [[np.log(0.25), np.log(0.75)]], rtol=1e-6)
        np.testing.assert_allclose(entropy, [[want_entropy] * 2], rtol=1e-6)


def test_single_token_vocabulary_is_certain():
    hidden, lm_head, targets = make_inputs(2, 3, 4, 1)
    logp, entropy = token_logprobs(hidden, lm_head, targets, return_entropy=True)
    np.testing.assert_array_equal(logp, np.zeros((2, 3)))
    np.testing.assert_array_equal(entropy, np.zeros((2, 3)))


def test_large_logits_with_the_maximum_in_the_last_chunk():
    # Logits of order 1e4 whose running max jumps in the last chunk: exp never overflows.
    hidden, lm_head, targets = make_inputs(2, 8, 16, 50, scale=3e4 / 4)
    lm_head = lm_head.at[:, -1].multiply(3.0)
    logp, entropy = token_logprobs(hidden, lm_head, targets, chunk_size=7, return_entropy=True)
    want_logp, want_entropy = float64_truth(hidden, lm_head, targets)
    assert np.all(np.isfinite(logp)) and np.all(np.isfinite(entropy))
    # float32 logits of magnitude ~1e4 carry absolute rounding ~1e-3 into each log-prob.
    np.testing.assert_allclose(logp, want_logp, rtol=1e-6, atol=1e-2)
    np.testing.assert_allclose(entropy, want_entropy, atol=1e-2)


def test_near_certain_token_keeps_precision_under_large_logits():
    # One logit dominates by 12 nats, all shifted by +100: log p(top) ~ -4e-5 and H ~ 5e-4. Taking
    # either as a difference of two numbers ~100 (l - lse, lse - E[l]) would leave an error of a
    # float32 step at 100, ~8e-6. Computed next to the max, what is left is the rounding of the
    # sum of exp(l - max) ~ 1: one float32 step at 1.
    vocab = 8
    logits = np.r_[np.full(vocab - 1, 88.0), 100.0]
    lm_head = jnp.asarray(logits[None, :], jnp.float32)
    hidden = jnp.ones((1, 1, 1), jnp.float32)
    targets = jnp.array([[vocab - 1]])
    want_logp, want_entropy = float64_truth(hidden, lm_head, targets)
    p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    want_d_logits = np.eye(vocab)[-1] - p  # d log p(top) / d logits, here d / d lm_head
    step = np.finfo(np.float32).eps
    for chunk in (1, 3, vocab):
        fn = partial(token_logprobs, targets=targets, chunk_size=chunk, return_entropy=True)
        logp, entropy = fn(hidden, lm_head)
        np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=step)
        np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=step)
        d_lm_head = jax.grad(lambda w, fn=fn: jnp.sum(fn(hidden, w)[0]))(lm_head)
        np.testing.assert_allclose(d_lm_head[0], want_d_logits, rtol=1e-5, atol=step)


def test_bfloat16_inputs_match_the_reference_with_float32_accumulation():
    # bf16 x bf16 products are exact in float32: only the summation order differs from the naive
    # einsum with preferred_element_type=float32, so the forward keeps float32 tolerances.
    hidden, lm_head, targets = make_inputs(4, 32, 64, 1000, jnp.bfloat16, scale=2.0)
    tiles = dict(chunk_size=128, token_chunk_size=48)
    logp, entropy = token_logprobs(hidden, lm_head, targets, return_entropy=True, **tiles)
    want_logp, want_entropy = token_logprobs_reference(hidden, lm_head, targets,
                                                       return_entropy=True)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-5)

    # Gradients come back in bfloat16, each rounded from a float32 sum; two float32 sums that
    # differ in the last bits can round one bf16 step apart: allow one step at the array's scale.
    rng = np.random.default_rng(1)
    w_logp, w_entropy = rng.normal(size=(2, 4, 32)).astype(np.float32)
    fn = lambda h, w, y: token_logprobs(h, w, y, return_entropy=True, **tiles)
    ref = lambda h, w, y: token_logprobs_reference(h, w, y, return_entropy=True)
    got = jax.jit(jax.grad(weighted_loss(fn, targets, w_logp, w_entropy), argnums=(0, 1)))(
        hidden, lm_head)
    want = jax.grad(weighted_loss(ref, targets, w_logp, w_entropy), argnums=(0, 1))(
        hidden, lm_head)
    for g, r in zip(got, want, strict=True):
        assert g.dtype == jnp.bfloat16
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.abs(g - r).max() <= 2.0**-7 * np.abs(r).max()


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_gradients_match_autodiff_of_the_reference(shape, jit):
    *dims, chunk, block = shape
    hidden, lm_head, targets = make_inputs(*dims, scale=2.0)
    rng = np.random.default_rng(1)
    w_logp, w_entropy = rng.normal(size=(2, *targets.shape)).astype(np.float32)
    fn = lambda h, w, y: token_logprobs(h, w, y, chunk_size=chunk, token_chunk_size=block,
                                        return_entropy=True)
    ref = lambda h, w, y: token_logprobs_reference(h, w, y, return_entropy=True)
    # Both outputs together; under jit (cheaper to run) also the log-prob and the entropy alone.
    weights = [(w_logp, w_entropy)]
    if jit:
        weights += [(w_logp, 0 * w_entropy), (0 * w_logp, w_entropy)]
    for wl, we in weights:
        grad = jax.grad(weighted_loss(fn, targets, wl, we), argnums=(0, 1))
        got = (jax.jit(grad) if jit else grad)(hidden, lm_head)
        want = jax.grad(weighted_loss(ref, targets, wl, we), argnums=(0, 1))(hidden, lm_head)
        for g, r in zip(got, want, strict=True):
            assert g.dtype == r.dtype == jnp.float32
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_logp_only_gradient_and_finite_differences():
    hidden, lm_head, targets = make_inputs(2, 5, 8, 37, scale=2.0)
    fn = lambda h, w: token_logprobs(h, w, targets, chunk_size=8, token_chunk_size=3)
    got = jax.grad(lambda h, w: jnp.sum(fn(h, w)), argnums=(0, 1))(hidden, lm_head)
    want = jax.grad(lambda h, w: jnp.sum(token_logprobs_reference(h, w, targets)),
                    argnums=(0, 1))(hidden, lm_head)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    # custom_vjp has no forward mode: check the VJP against finite differences.
    check_grads(lambda h, w: token_logprobs(h, w, targets, chunk_size=8, return_entropy=True),
                (hidden, lm_head), order=1, modes=("rev",))


def test_targets_get_a_float0_cotangent():
    hidden, lm_head, targets = make_inputs(2, 3, 4, 9)
    logp, vjp = jax.vjp(lambda h, w, y: token_logprobs(h, w, y, chunk_size=4), hidden, lm_head,
                        targets)
    _, _, d_targets = vjp(jnp.ones_like(logp))
    assert d_targets.dtype == jax.dtypes.float0 and d_targets.shape == targets.shape


@settings(max_examples=8, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 6), width=st.integers(1, 9),
       vocab=st.integers(1, 40), chunk=st.integers(1, 45), block=st.integers(1, 20),
       seed=st.integers(0, 2**16))
def test_property_any_tiling_gives_the_reference(batch, length, width, vocab, chunk, block, seed):
    hidden, lm_head, targets = make_inputs(batch, length, width, vocab, seed=seed, scale=3.0)
    logp, entropy = token_logprobs(hidden, lm_head, targets, chunk_size=chunk,
                                   token_chunk_size=block, return_entropy=True)
    want_logp, want_entropy = token_logprobs_reference(hidden, lm_head, targets,
                                                       return_entropy=True)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-5)


def compiled_temp_bytes(fn, argnums, *args):
    return jax.jit(jax.grad(fn, argnums=argnums)).lower(*args).compile().memory_analysis(
        ).temp_size_in_bytes


@pytest.mark.parametrize("argnums", [0, (0, 1)], ids=["d_hidden", "d_hidden_and_lm_head"])
def test_gradient_temp_memory_is_an_eighth_of_the_full_log_softmax(argnums):
    # Compiled only, from abstract shapes: nothing of this size is allocated.
    length, width, vocab = LARGE["length"], LARGE["width"], LARGE["vocab"]
    args = (jax.ShapeDtypeStruct((1, length, width), jnp.bfloat16),
            jax.ShapeDtypeStruct((width, vocab), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, length), jnp.int32))
    chunked = compiled_temp_bytes(lambda h, w, y: jnp.sum(token_logprobs(h, w, y)), argnums, *args)
    naive = compiled_temp_bytes(lambda h, w, y: jnp.sum(token_logprobs_reference(h, w, y)),
                                argnums, *args)
    # The naive gradient holds at least the [T, V] float32 logits.
    assert naive >= length * vocab * 4
    assert chunked * 8 <= naive, f"chunked {chunked / 2**20:.0f} MiB, naive {naive / 2**20:.0f} MiB"


def test_empty_batch():
    hidden, lm_head, _ = make_inputs(1, 1, 4, 9)
    logp, entropy = token_logprobs(hidden[:0], lm_head, jnp.zeros((0, 1), jnp.int32),
                                   return_entropy=True)
    assert logp.shape == entropy.shape == (0, 1)


def test_out_of_range_targets_under_jit_give_nan_not_a_neighbour():
    hidden, lm_head, _ = make_inputs(1, 3, 4, 9)
    targets = jnp.array([[-1, 9, 4]])
    logp, entropy = jax.jit(lambda y: token_logprobs(hidden, lm_head, y, chunk_size=4,
                                                     return_entropy=True))(targets)
    assert np.all(np.isnan(logp[0, :2])) and np.isfinite(logp[0, 2])
    _, want_entropy = token_logprobs_reference(hidden, lm_head, targets.clip(0, 8),
                                               return_entropy=True)
    np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise_value_errors_that_name_them():
    hidden, lm_head, targets = make_inputs(2, 3, 4, 9)
    cases = [
        ((hidden[0], lm_head, targets), {}, r"hidden must have rank 3 \[B, T, D\], got shape "
                                            r"\(3, 4\)"),
        ((hidden, lm_head[None], targets), {}, r"lm_head must have rank 2 \[D, V\]"),
        ((hidden, lm_head.T, targets), {}, r"lm_head must have shape \[D, V\] with D = "
                                           r"hidden.shape\[-1\] = 4, got shape \(9, 4\)"),
        ((hidden, lm_head[:, :0], targets), {}, "at least one vocabulary column"),
        ((hidden, lm_head, targets[:, :2]), {}, r"targets must have shape \[B, T\] = \(2, 3\)"),
        ((hidden, lm_head, targets.astype(jnp.float32)), {}, "targets must have an integer"),
        ((hidden.astype(jnp.int32), lm_head, targets), {}, "hidden must have a floating"),
        ((hidden, lm_head, targets), dict(chunk_size=0), "chunk_size must be an int >= 1"),
        ((hidden, lm_head, targets), dict(chunk_size=2.5), "chunk_size must be an int >= 1"),
        ((hidden, lm_head, targets), dict(token_chunk_size=-1), "token_chunk_size must be"),
        ((hidden, lm_head, targets.at[0, 0].set(9)), {},
         r"targets must lie in \[0, V\) = \[0, 9\), got values in \[\d+, 9\]"),
        ((hidden, lm_head, targets.at[1, 2].set(-1)), {}, r"targets must lie in \[0, V\)"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            token_logprobs(*args, **kwargs)
