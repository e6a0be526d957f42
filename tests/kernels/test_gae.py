"""The Pallas GAE kernel and its VJP against float64 GAE, the one pure-jnp reference
(`kernels.gae_reference`, which `rl.gae(impl="reference")` runs) and `rl.gae`'s chunked form."""

from functools import partial

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_jax import kernels, rl
from tests.rl.gae_reference import gae_float64, random_spans_mask


def assert_close(actual, expected, tol=1e-5):
    """|actual - expected| <= tol * (1 + |expected|): absolute plus relative."""
    actual = np.asarray(actual, np.float64)
    err = np.abs(actual - expected) / (1.0 + np.abs(expected))
    worst = np.unravel_index(err.argmax(), err.shape)
    assert err.max() <= tol, f"max scaled error {err.max():.3g} > {tol} at {worst}"


@partial(jax.jit, static_argnames="kwargs")
def _gae(rewards, values, mask, gamma, lam, last_value, truncated, kwargs):
    return kernels.gae(rewards, values, mask, gamma=gamma, lam=lam, last_value=last_value,
                       truncated=truncated, **dict(kwargs))


def run_gae(mode, rewards, values, mask, gamma, lam, last_value, truncated):
    """The kernel under jit, gamma and lam traced: one compilation per mode and shape."""
    return _gae(rewards, values, mask, jnp.float32(gamma), jnp.asarray(lam, jnp.float32),
                last_value, truncated, tuple(mode.gae.items()))


BATCH, LENGTH = 5, 300  # ragged against every block: rows 2 / 8, tokens 32 / 128


@st.composite
def gae_inputs(draw):
    """Rows of every awkward kind: spans, no action, one action, leading observations, long gaps."""
    mask = np.zeros((BATCH, LENGTH), bool)
    for b in range(BATCH):
        kind = draw(st.sampled_from(["spans", "empty", "single", "leading_obs", "long_gap"]))
        if kind == "spans":
            mask[b] = random_spans_mask(np.random.default_rng(draw(st.integers(0, 99))), 1,
                                        LENGTH, mean_span=draw(st.sampled_from([2, 8, 40])))[0]
        elif kind == "single":
            mask[b, draw(st.integers(0, LENGTH - 1))] = True
        elif kind == "leading_obs":
            mask[b, draw(st.integers(1, LENGTH - 1)):] = True
            mask[b, LENGTH - draw(st.integers(0, 40)):] = False
        elif kind == "long_gap":
            mask[b, :3] = True
            mask[b, -3:] = True
    floats = st.floats(-10, 10, width=32)
    # Rewards anywhere, observation tokens included: they must move to the preceding action.
    rewards = draw(hnp.arrays(np.float32, (BATCH, LENGTH), elements=floats))
    values = draw(hnp.arrays(np.float32, (BATCH, LENGTH), elements=floats))
    last_value = draw(hnp.arrays(np.float32, BATCH, elements=floats))
    truncated = draw(hnp.arrays(bool, BATCH))
    gamma = draw(st.sampled_from([1.0, 0.99, 0.5, 0.0]))
    if draw(st.booleans()):
        lam = draw(hnp.arrays(np.float32, BATCH, elements=st.floats(0, 1, width=32)))
    else:
        lam = np.full(BATCH, draw(st.sampled_from([1.0, 0.95, 0.0])), np.float32)
    return rewards, values, mask, gamma, lam, last_value, truncated


@settings(max_examples=25, deadline=None)
@given(inputs=gae_inputs())
def test_forward_matches_float64_on_random_masks(mode, inputs):
    rewards, values, mask, gamma, lam, last_value, truncated = inputs
    adv, ret = run_gae(mode, rewards, values, mask, gamma, lam, last_value, truncated)
    want_adv, want_ret = gae_float64(rewards, values, mask, gamma, lam, last_value, truncated)
    assert_close(adv, want_adv)
    assert_close(ret, want_ret)


def assert_vjp_matches_the_reference(gae, rng, batch, length, truncated=None):
    """`gae`'s forward and VJP against `kernels.gae_reference` on random data of `[batch,
    length]` (`truncated`: drawn when None), to 1e-5."""
    mask = rng.random((batch, length)) < 0.7
    rewards, values = (rng.normal(size=(batch, length)).astype(np.float32) for _ in range(2))
    last_value = rng.normal(size=batch).astype(np.float32)
    if truncated is None:
        truncated = rng.random(batch) < 0.5
    lam = rng.random(batch).astype(np.float32)
    cotangents = tuple(rng.normal(size=(batch, length)).astype(np.float32) for _ in range(2))

    def vjp(fn):
        f = lambda r, v, lv: fn(r, v, mask, gamma=0.95, lam=lam, last_value=lv,
                                truncated=truncated)
        out, pullback = jax.vjp(f, rewards, values, last_value)
        return out, pullback(cotangents)

    got, want = vjp(gae), vjp(kernels.gae_reference)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


@settings(max_examples=4, deadline=None)  # every shape compiles anew
@given(batch=st.integers(1, 9), length=st.integers(1, 700), seed=st.integers(0, 2**32 - 1))
def test_random_shapes_forward_and_vjp(mode, batch, length, seed):
    assert_vjp_matches_the_reference(partial(kernels.gae, **mode.gae),
                                     np.random.default_rng(seed), batch, length)


@pytest.mark.parametrize("rows,time", [(1, 1), (1, 2), (1, 4), (1, 1024)])
def test_gpu_variant_at_one_row_and_tiny_blocks(rows, time):
    """The GPU variant at the blocks whose compiles crashed Triton (one row: the default is 1 x
    1024) and at the smallest, interpreted: a 1-token block needs no scan and a 2-token block is
    the two-lane scan alone (`_pair_scan`, by selects), which ends the split scan of every longer
    block. Forward and VJP against the reference, on two blocks and a ragged third."""
    gae = partial(kernels.gae, backend="gpu", interpret=True,
                  blocks=kernels.GaeBlocks(rows, time))
    assert_vjp_matches_the_reference(gae, np.random.default_rng(rows * 10_000 + time), 3,
                                     2 * time + 300, truncated=np.array([True, False, True]))


def test_hand_computed_skip_observation_case(mode):
    # tokens: a0 a1 o o a2 o(pad); the rewards 0.5 and 0.25 on observations belong to a1.
    mask = np.array([[1, 1, 0, 0, 1, 0]], bool)
    rewards = np.array([[0.0, 0.0, 0.5, 0.25, 1.0, 0.0]], np.float32)
    values = np.array([[0.1, 0.2, 9.0, 9.0, 0.4, 9.0]], np.float32)
    gamma, lam = 0.9, 0.8
    adv, ret = kernels.gae(rewards, values, mask, gamma=gamma, lam=lam, **mode.gae)
    a2 = 1.0 - 0.4
    a1 = (0.5 + 0.25) + gamma * 0.4 - 0.2 + gamma * lam * a2
    a0 = gamma * 0.2 - 0.1 + gamma * lam * a1
    np.testing.assert_allclose(adv, [[a0, a1, 0, 0, a2, 0]], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ret, [[a0 + 0.1, a1 + 0.2, 0, 0, a2 + 0.4, 0]], rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("action", [True, False])
def test_single_token_row(mode, action):
    # B = 1, T = 1: one action (r + gamma * last_value - V) or one observation (zeros).
    mask = np.array([[action]])
    adv, ret = kernels.gae(np.array([[2.0]], np.float32), np.array([[0.5]], np.float32), mask,
                           gamma=0.5, lam=0.7, last_value=np.array([4.0], np.float32),
                           truncated=np.array([True]), **mode.gae)
    np.testing.assert_allclose(adv, [[2.0 + 0.5 * 4.0 - 0.5 if action else 0.0]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[2.0 + 0.5 * 4.0 if action else 0.0]], rtol=1e-6)


def test_long_rows_many_blocks(mode):
    # 5000 tokens: 157 blocks of 32 (GPU) or 40 of 128 (TPU), the last one ragged.
    rng = np.random.default_rng(0)
    length = 5000
    mask = random_spans_mask(rng, 3, length)
    rewards = ((rng.random((3, length)) < 0.02) * rng.normal(size=(3, length))).astype(np.float32)
    values = rng.normal(size=(3, length)).astype(np.float32)
    last_value = rng.normal(size=3).astype(np.float32)
    truncated = np.array([True, False, True])
    lam = np.asarray(rl.length_adaptive_lambda(mask, 1.5))
    adv, ret = run_gae(mode, rewards, values, mask, 1.0, lam, last_value, truncated)
    want_adv, want_ret = gae_float64(rewards, values, mask, 1.0, lam, last_value, truncated)
    assert_close(adv, want_adv)
    assert_close(ret, want_ret)


def test_matches_the_reference_and_the_chunked_form(mode):
    rng = np.random.default_rng(1)
    mask = random_spans_mask(rng, BATCH, LENGTH, mean_span=8)
    rewards = rng.normal(size=(BATCH, LENGTH)).astype(np.float32)
    values = rng.normal(size=(BATCH, LENGTH)).astype(np.float32)
    args = dict(gamma=0.99, lam=0.95)  # a scalar lam, given as a Python float
    got = kernels.gae(rewards, values, mask, **args, **mode.gae)
    for want in (kernels.gae_reference(rewards, values, mask, **args),
                 rl.gae(rewards, values, mask, **args, impl="xla")):
        for x, y in zip(got, want, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_vjp_matches_autodiff_of_the_reference(mode):
    rng = np.random.default_rng(2)
    mask = random_spans_mask(rng, BATCH, LENGTH, mean_span=8)
    mask[1] = False  # a row without actions
    rewards = rng.normal(size=(BATCH, LENGTH)).astype(np.float32)
    values = rng.normal(size=(BATCH, LENGTH)).astype(np.float32)
    last_value = rng.normal(size=BATCH).astype(np.float32)
    truncated = np.array([True, True, False, True, False])
    lam = np.array([0.9, 0.0, 1.0, 0.5, 0.95], np.float32)
    cotangents = tuple(rng.normal(size=(BATCH, LENGTH)).astype(np.float32) for _ in range(2))

    def vjp(fn):
        f = lambda r, v, lv: fn(r, v, mask, gamma=0.9, lam=lam, last_value=lv,
                                truncated=truncated)
        _, pullback = jax.vjp(f, rewards, values, last_value)
        return pullback(cotangents)

    got = jax.jit(lambda: vjp(partial(kernels.gae, **mode.gae)))()
    want = vjp(kernels.gae_reference)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    # And through rl.gae, as the learner would call it.
    v_grad = jax.grad(lambda v: rl.gae(rewards, v, mask, gamma=0.9, lam=lam,
                                       impl="pallas")[0].sum())(values)
    want = jax.grad(lambda v: rl.gae(rewards, v, mask, gamma=0.9, lam=lam,
                                     impl="reference")[0].sum())(values)
    np.testing.assert_allclose(v_grad, want, rtol=1e-5, atol=1e-5)


class TestArguments:

    def test_shape_errors_name_the_argument(self):
        r = np.zeros((2, 5), np.float32)
        with pytest.raises(ValueError, match=r"values must have the shape of rewards \(2, 5\)"):
            kernels.gae(r, np.zeros((2, 4)), r > 0, gamma=1.0, lam=1.0)
        with pytest.raises(ValueError, match=r"rewards must have rank 2"):
            kernels.gae(np.zeros(5), np.zeros(5), np.zeros(5), gamma=1.0, lam=1.0)
        with pytest.raises(ValueError, match=r"action_mask must have the shape of rewards"):
            kernels.gae(r, r, np.zeros((5, 2)), gamma=1.0, lam=1.0)
        with pytest.raises(ValueError, match=r"lam must have shape \[B\] = \(2,\)"):
            kernels.gae(r, r, r > 0, gamma=1.0, lam=np.ones(3))
        with pytest.raises(ValueError, match=r"last_value must have shape \[B\] = \(2,\)"):
            kernels.gae(r, r, r > 0, gamma=1.0, lam=1.0, last_value=np.zeros(3),
                        truncated=np.zeros(2, bool))
        with pytest.raises(ValueError, match=r"gamma must be a scalar"):
            kernels.gae(r, r, r > 0, gamma=np.ones(2), lam=1.0)

    def test_value_errors_name_the_argument(self):
        r = np.zeros((2, 5), np.float32)
        with pytest.raises(ValueError, match=r"gamma must lie in \[0.0, 1.0\], got 1.5"):
            kernels.gae(r, r, r > 0, gamma=1.5, lam=1.0)
        with pytest.raises(ValueError, match=r"lam must lie in \[0.0, 1.0\]"):
            kernels.gae(r, r, r > 0, gamma=1.0, lam=np.array([0.5, -0.1]))
        with pytest.raises(ValueError, match=r"last_value and truncated go together"):
            kernels.gae(r, r, r > 0, gamma=1.0, lam=1.0, truncated=np.zeros(2, bool))
        with pytest.raises(ValueError, match=r"backend must be one of"):
            kernels.gae(r, r, r > 0, gamma=1.0, lam=1.0, backend="metal")

    def test_blocks_are_validated(self):
        r = np.zeros((2, 5), np.float32)
        with pytest.raises(ValueError, match=r"GaeBlocks.rows must be a positive int, got 0"):
            kernels.GaeBlocks(rows=0, time=128)
        with pytest.raises(ValueError, match=r"GaeBlocks.time must be a positive int"):
            kernels.GaeBlocks(rows=8, time=12.5)
        with pytest.raises(ValueError, match=r"GaeBlocks.time must be a power of two for the GPU"):
            kernels.gae(r, r, r > 0, gamma=1.0, lam=1.0, backend="gpu",
                        blocks=kernels.GaeBlocks(rows=1, time=100))
        with pytest.raises(ValueError, match=r"GaeBlocks.time must be a multiple of 128 for the "
                                             r"TPU"):
            kernels.gae(r, r, r > 0, gamma=1.0, lam=1.0, backend="tpu",
                        blocks=kernels.GaeBlocks(rows=8, time=64))
        with pytest.raises(ValueError, match=r"GaeBlocks.rows must be a multiple of 8 for the TPU"):
            kernels.gae(r, r, r > 0, gamma=1.0, lam=1.0, backend="tpu",
                        blocks=kernels.GaeBlocks(rows=4, time=128))
        with pytest.raises(ValueError, match=r"blocks must be a GaeBlocks, got DisBlocks"):
            kernels.gae(r, r, r > 0, gamma=1.0, lam=1.0, blocks=kernels.DisBlocks(8, 128))
        with pytest.raises(AttributeError):  # frozen
            kernels.GaeBlocks(8, 128).rows = 16


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_empty_batch_gives_empty_results(shape):
    x = np.zeros(shape, np.float32)
    adv, ret = kernels.gae(x, x, x > 0, gamma=1.0, lam=0.9)
    assert adv.shape == ret.shape == shape
