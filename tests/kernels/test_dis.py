"""The Pallas DIS loss and its VJP against the one pure-jnp reference, `kernels.dis_loss_reference`
(which `rl.dis_loss(impl="xla")` runs)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_jax import kernels, rl
from tests.rl.loss_inputs import BAND, dis_inputs

BATCH, LENGTH = 5, 300  # ragged against every block: rows 2 / 8, tokens 64 / 128
CONFIGS = [("action_tokens", False), ("in_band_tokens", False), ("action_tokens", True)]


@partial(jax.jit, static_argnames=("kwargs", "denominator", "use_normalizer"))
def _loss_metrics_and_grads(logp, rollout_logp, advantages, mask, eps_low, eps_high, normalizer,
                            kwargs, denominator, use_normalizer):
    """Loss, metrics, d loss / d logp and d logp_mismatch / d logp, for a kernel or a reference."""
    fn = kernels.dis_loss if kwargs else kernels.dis_loss_reference

    def loss_fn(lp):
        return fn(lp, rollout_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high,
                  denominator=denominator, normalizer=normalizer if use_normalizer else None,
                  **dict(kwargs))

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logp)
    mismatch_grad = jax.grad(lambda lp: loss_fn(lp)[1].logp_mismatch)(logp)
    return loss, metrics, grad, mismatch_grad


def assert_same(got, want):
    loss, metrics, grad, mismatch_grad = got
    want_loss, want_metrics, want_grad, want_mismatch_grad = want
    # Summed in another order: the error scales with sum |w| / N (= sum |grad|), not with the loss.
    np.testing.assert_allclose(loss, want_loss, rtol=0, atol=1e-6 * np.abs(want_grad).sum() + 1e-7)
    for name, x, y in zip(want_metrics._fields, metrics, want_metrics, strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-6, atol=1e-7, err_msg=name)
    np.testing.assert_array_equal(grad, want_grad)  # elementwise: the same float32 operations
    np.testing.assert_array_equal(mismatch_grad, want_mismatch_grad)
    assert np.all(np.isfinite(grad)) and np.isfinite(loss)


@st.composite
def dis_batch(draw):
    """Ratios across and beyond the band, non-finite log-probs, sparse masks, extreme advantages."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.05, 0.5, 3.0, 40.0]))  # 40: log-ratios past the +-20 clamp
    logp = rng.normal(-2.0, 1.0, (BATCH, LENGTH)).astype(np.float32)
    rollout = (logp + rng.normal(0.0, spread, (BATCH, LENGTH))).astype(np.float32)
    for x in (logp, rollout):
        bad = rng.random((BATCH, LENGTH)) < draw(st.sampled_from([0.0, 0.02]))
        x[bad] = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), bad.sum())
    advantages = (rng.normal(size=(BATCH, LENGTH)) * draw(st.sampled_from([1.0, 1e6]))
                  ).astype(np.float32)
    mask = rng.random((BATCH, LENGTH)) < draw(st.sampled_from([0.0, 0.05, 0.7, 1.0]))
    mask[rng.integers(BATCH)] = False  # a row without action tokens
    eps_low = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    eps_high = draw(st.sampled_from([0.0, 3.0, 5.0, 1e12]))
    config = draw(st.sampled_from(CONFIGS))
    normalizer = draw(st.sampled_from([1.0, 7.0, 5000.0]))
    return (logp, rollout, advantages, mask, eps_low, eps_high, normalizer), config


@settings(max_examples=20, deadline=None)
@given(batch=dis_batch())
def test_forward_and_vjp_match_the_reference(mode, batch):
    args, (denominator, use_normalizer) = batch
    static = dict(denominator=denominator, use_normalizer=use_normalizer)
    got = _loss_metrics_and_grads(*args, kwargs=tuple(mode.dis.items()), **static)
    want = _loss_metrics_and_grads(*args, kwargs=(), **static)
    assert_same(got, want)


@settings(max_examples=4, deadline=None)  # every shape compiles anew
@given(batch=st.integers(1, 9), length=st.integers(1, 700), seed=st.integers(0, 2**32 - 1))
def test_random_shapes_forward_and_vjp(mode, batch, length, seed):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-2.0, 1.0, (batch, length)).astype(np.float32)
    rollout = (logp + rng.normal(0.0, 0.5, (batch, length))).astype(np.float32)
    logp[rng.random((batch, length)) < 0.01] = np.nan
    advantages = rng.normal(size=(batch, length)).astype(np.float32)
    mask = rng.random((batch, length)) < 0.7
    args = (logp, rollout, advantages, mask, 0.3, 5.0, 1.0)
    static = dict(denominator="action_tokens", use_normalizer=False)
    assert_same(_loss_metrics_and_grads(*args, kwargs=tuple(mode.dis.items()), **static),
                _loss_metrics_and_grads(*args, kwargs=(), **static))


def test_hand_computed_value_metrics_and_gradient(mode):
    logp, rollout, adv, mask = dis_inputs()  # from tests/rl: below, above, masked, -inf and NaN
    fn = lambda lp: kernels.dis_loss(lp, rollout, adv, mask, **BAND, **mode.dis)
    (loss, m), grad = jax.value_and_grad(fn, has_aux=True)(logp)
    want = -(1.0 * 1.0 + 2.0 * 0.5 + 1.2 * -2.0) / 7
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose([m.below_band_frac, m.above_band_frac, m.nonfinite_frac],
                               [1 / 7, 1 / 7, 2 / 7], rtol=1e-6)
    ratios = np.array([1.0, 0.5, 2.0, 7.0, 1.2])
    np.testing.assert_allclose(m.ratio_mean, ratios.mean(), rtol=1e-5)
    np.testing.assert_allclose(m.logp_mismatch, np.abs(np.log(ratios)).mean(), rtol=1e-5)
    ratio = np.exp(np.nan_to_num(logp.astype(np.float64) - rollout, nan=0.0, neginf=0.0))
    band = (ratio >= 0.7) & (ratio <= 6.0) & np.isfinite(logp) & mask
    np.testing.assert_allclose(grad, np.where(band, -ratio * adv / 7, 0.0), rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(grad)[~band] == 0.0)


def test_extreme_inputs_never_give_nan(mode):
    logp = np.array([[0.0, -1e30, 1e30, -np.inf, np.inf, np.nan, -80.0, 50.0]], np.float32)
    rollout = np.array([[-1e30, 0.0, -1e30, -np.inf, 0.0, 0.0, -120.0, -1.0]], np.float32)
    adv = np.full((1, 8), 1e6, np.float32)
    mask = np.ones((1, 8), bool)
    for eps_low, eps_high in ((0.3, 5.0), (1.0, 1e12)):
        fn = lambda lp, lo=eps_low, hi=eps_high: kernels.dis_loss(
            lp, rollout, adv, mask, eps_low=lo, eps_high=hi, **mode.dis)
        (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(logp)
        want = jax.value_and_grad(lambda lp, lo=eps_low, hi=eps_high: rl.dis_loss(
            lp, rollout, adv, mask, eps_low=lo, eps_high=hi, impl="xla"), has_aux=True)(logp)
        assert np.isfinite(loss) and np.all(np.isfinite(grad))
        assert all(np.isfinite(x) for x in metrics)
        np.testing.assert_allclose(loss, want[0][0], rtol=1e-6)
        np.testing.assert_array_equal(grad, want[1])


def test_micro_batches_with_batch_normalizer_sum_to_full_batch_gradient():
    rng = np.random.default_rng(0)
    logp = rng.normal(-2, 0.3, size=(6, 20)).astype(np.float32)
    rollout = (logp + rng.normal(0, 0.3, size=(6, 20))).astype(np.float32)
    adv = rng.normal(size=(6, 20)).astype(np.float32)
    mask = rng.random((6, 20)) < 0.7
    loss_fn = lambda lp, sl, n=None: rl.dis_loss(lp, rollout[sl], adv[sl], mask[sl], normalizer=n,
                                                 impl="pallas", **BAND)[0]
    full = jax.grad(loss_fn)(logp, slice(None))
    parts = [jax.grad(loss_fn)(logp[sl], sl, mask.sum()) for sl in (slice(0, 2), slice(2, 6))]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-6, atol=1e-8)


class TestArguments:

    def test_errors_name_the_argument(self):
        logp, rollout, adv, mask = dis_inputs()
        with pytest.raises(ValueError, match=r"rollout_logp must have the shape of logp \(2, 4\)"):
            kernels.dis_loss(logp, rollout[:, :3], adv, mask, **BAND)
        with pytest.raises(ValueError, match=r"action_mask must have the shape of logp"):
            kernels.dis_loss(logp, rollout, adv, mask[:1], **BAND)
        with pytest.raises(ValueError, match=r"logp must have rank 2"):
            kernels.dis_loss(logp[0], rollout[0], adv[0], mask[0], **BAND)
        with pytest.raises(ValueError, match=r"eps_low must lie in \[0.0, 1.0\].*got 1.5"):
            kernels.dis_loss(logp, rollout, adv, mask, eps_low=1.5, eps_high=1.0)
        with pytest.raises(ValueError, match=r"eps_high must lie in \[0.0, inf\], got -0.1"):
            kernels.dis_loss(logp, rollout, adv, mask, eps_low=0.2, eps_high=-0.1)
        with pytest.raises(ValueError, match=r"denominator must be one of"):
            kernels.dis_loss(logp, rollout, adv, mask, denominator="tokens", **BAND)
        with pytest.raises(ValueError, match=r"normalizer replaces the action-token count"):
            kernels.dis_loss(logp, rollout, adv, mask, denominator="in_band_tokens",
                             normalizer=3.0, **BAND)
        with pytest.raises(ValueError, match=r"normalizer must be a scalar"):
            kernels.dis_loss(logp, rollout, adv, mask, normalizer=jnp.ones(2), **BAND)

    def test_blocks_are_validated(self):
        logp, rollout, adv, mask = dis_inputs()
        with pytest.raises(ValueError, match=r"DisBlocks.num_warps must be a positive int"):
            kernels.DisBlocks(rows=8, time=128, num_warps=0)
        with pytest.raises(ValueError, match=r"DisBlocks.rows must be a power of two for the GPU"):
            kernels.dis_loss(logp, rollout, adv, mask, backend="gpu",
                             blocks=kernels.DisBlocks(rows=3, time=128), **BAND)
        with pytest.raises(ValueError, match=r"DisBlocks.time must be a multiple of 128 for the "
                                             r"TPU"):
            kernels.dis_loss(logp, rollout, adv, mask, backend="tpu",
                             blocks=kernels.DisBlocks(rows=8, time=100), **BAND)
        with pytest.raises(ValueError, match=r"blocks must be a DisBlocks, got GaeBlocks"):
            kernels.dis_loss(logp, rollout, adv, mask, blocks=kernels.GaeBlocks(8, 128), **BAND)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_empty_batch_gives_zero_loss(shape):
    x = np.zeros(shape, np.float32)
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: kernels.dis_loss(lp, x, x, x > 0, **BAND), has_aux=True)(x)
    assert float(loss) == 0.0 and all(float(m) == 0.0 for m in metrics)
    assert grad.shape == shape
