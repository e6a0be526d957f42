"""`rl.advantages`: `rl.gae` (its chunked form and the reference it runs as impl="reference"),
`rl.step_gae` and friends against hand-computed cases and float64 loops; the GRPO and
running-mean baselines."""

from functools import partial

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_jax import rl
from sao_jax.kernels import resolve_impl
from tests import cpu_gae_runs
from tests.rl.gae_reference import gae_float64, random_spans_mask, textbook_gae

# "auto" only where it runs something else than "xla" (the Pallas kernel on a TPU): on a CPU it is
# "xla", the same program compiled again. "cpu" (the one-pass C++ kernel) where the devices are
# CPUs and a compiler builds it (`cpu_gae_runs`).
IMPLS = (("reference", "xla") + (("auto",) if resolve_impl("auto") != "xla" else ())
         + (("cpu",) if cpu_gae_runs() else ()))


def assert_close(actual, expected, tol):
    """|actual - expected| <= tol * (1 + |expected|): absolute plus relative."""
    actual = np.asarray(actual, np.float64)
    err = np.abs(actual - expected) / (1.0 + np.abs(expected))
    worst = np.unravel_index(err.argmax(), err.shape)
    assert err.max() <= tol, f"max scaled error {err.max():.3g} > {tol} at {worst}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("jit", [False, True])
def test_observation_is_skipped_and_its_reward_moves(impl, jit):
    # tokens:  a0   a1   o    o    a2   o(pad)
    mask = np.array([[1, 1, 0, 0, 1, 0]], bool)
    rewards = np.array([[0.0, 0.0, 0.5, 0.25, 1.0, 0.0]], np.float32)
    values = np.array([[0.1, 0.2, 9.0, 9.0, 0.4, 9.0]], np.float32)
    gamma, lam = 0.9, 0.8
    fn = lambda r, v, m: rl.gae(r, v, m, gamma=gamma, lam=lam, impl=impl)
    adv, ret = (jax.jit(fn) if jit else fn)(rewards, values, mask)
    d2 = 1.0 - 0.4
    d1 = (0.5 + 0.25) + gamma * 0.4 - 0.2  # rewards on the observation belong to a1
    d0 = 0.0 + gamma * 0.2 - 0.1
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    np.testing.assert_allclose(adv, [[a0, a1, 0, 0, a2, 0]], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ret, [[a0 + 0.1, a1 + 0.2, 0, 0, a2 + 0.4, 0]], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
def test_truncated_row_bootstraps_from_last_value(impl):
    mask = np.array([[1, 1, 0], [1, 1, 0]], bool)
    rewards = np.zeros((2, 3), np.float32)
    values = np.array([[0.0, 0.5, 7.0], [0.0, 0.5, 7.0]], np.float32)
    adv, _ = rl.gae(rewards, values, mask, gamma=1.0, lam=1.0, last_value=np.array([2.0, 2.0]),
                    truncated=np.array([True, False]), impl=impl)
    # Truncated: delta_1 = 2 - 0.5; terminated: delta_1 = -0.5. delta_0 = 0.5 in both.
    np.testing.assert_allclose(adv, [[2.0, 1.5, 0.0], [0.0, -0.5, 0.0]], atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_row_without_actions_and_leading_reward_give_zeros(impl):
    mask = np.array([[0, 0, 0, 0], [0, 1, 1, 0]], bool)
    rewards = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 0.0, 1.0, 0.0]], np.float32)
    values = np.ones((2, 4), np.float32)
    adv, ret = rl.gae(rewards, values, mask, gamma=1.0, lam=1.0, impl=impl)
    np.testing.assert_array_equal(np.asarray(adv[0]), 0.0)
    np.testing.assert_array_equal(np.asarray(ret[0]), 0.0)
    # The reward 5 before the first action is ignored; a1: 0 + 1 - 1, a2: 1 - 1.
    np.testing.assert_allclose(adv[1], [0.0, 0.0, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(ret[1], [0.0, 1.0, 1.0, 0.0], atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.3)])
def test_all_ones_mask_is_textbook_gae(impl, gamma, lam):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(3, 50)).astype(np.float32)
    values = rng.normal(size=(3, 50)).astype(np.float32)
    last_value = rng.normal(size=3).astype(np.float32)
    truncated = np.array([True, False, True])
    adv, ret = rl.gae(rewards, values, np.ones((3, 50), bool), gamma=gamma, lam=lam,
                      last_value=last_value, truncated=truncated, impl=impl)
    want_adv, want_ret = textbook_gae(rewards, values, gamma, lam,
                                      np.where(truncated, last_value, 0.0))
    assert_close(adv, want_adv, 1e-5)
    assert_close(ret, want_ret, 1e-5)


@st.composite
def gae_inputs(draw):
    """Rows of spans: actions, observations, padding; every awkward shape the tests name."""
    batch, length = 5, 37  # 37 is not a multiple of the chunk: the padding path runs too
    mask = np.zeros((batch, length), bool)
    for b in range(batch):
        kind = draw(st.sampled_from(["spans", "empty", "single", "leading_obs", "long_gap"]))
        if kind == "spans":
            mask[b] = draw(hnp.arrays(bool, length))
        elif kind == "single":
            mask[b, draw(st.integers(0, length - 1))] = True
        elif kind == "leading_obs":
            mask[b, draw(st.integers(1, length - 1)):] = True
            mask[b, -draw(st.integers(0, 5)):] = False  # trailing observations or padding
        elif kind == "long_gap":
            mask[b, :3] = True
            mask[b, -3:] = True
    floats = st.floats(-10, 10, width=32)
    rewards = draw(hnp.arrays(np.float32, (batch, length), elements=floats))
    values = draw(hnp.arrays(np.float32, (batch, length), elements=floats))
    last_value = draw(hnp.arrays(np.float32, batch, elements=floats))
    truncated = draw(hnp.arrays(bool, batch))
    gamma = draw(st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.0]))
    per_row = draw(st.booleans())
    if per_row:
        lam = draw(hnp.arrays(np.float32, batch, elements=st.floats(0, 1, width=32)))
    else:
        lam = draw(st.sampled_from([1.0, 0.95, 0.5, 0.0]))
    return rewards, values, mask, gamma, lam, last_value, truncated


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=60, deadline=None)
@given(inputs=gae_inputs())
def test_matches_float64_reference_on_random_masks(impl, inputs):
    rewards, values, mask, gamma, lam, last_value, truncated = inputs
    adv, ret = rl.gae(rewards, values, mask, gamma=gamma, lam=lam, last_value=last_value,
                      truncated=truncated, impl=impl)
    want_adv, want_ret = gae_float64(rewards, values, mask, gamma, lam, last_value, truncated)
    assert_close(adv, want_adv, 1e-5)
    assert_close(ret, want_ret, 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=25, deadline=None)
@given(inputs=gae_inputs())
def test_jit_with_traced_lambda_matches_reference(impl, inputs):
    # Traced gamma and lam: the chunked form chooses its branch at run time (lam = 0 must work).
    rewards, values, mask, gamma, lam, last_value, truncated = inputs
    adv, ret = _traced_gae(rewards, values, mask, jnp.float32(gamma), jnp.asarray(lam, jnp.float32),
                           last_value, truncated, impl=impl)
    want_adv, want_ret = gae_float64(rewards, values, mask, gamma, lam, last_value, truncated)
    assert_close(adv, want_adv, 1e-5)
    assert_close(ret, want_ret, 1e-5)


@partial(jax.jit, static_argnames="impl")
def _traced_gae(rewards, values, mask, gamma, lam, last_value, truncated, impl):
    return rl.gae(rewards, values, mask, gamma=gamma, lam=lam, last_value=last_value,
                  truncated=truncated, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("length", [16, 1000, 4096])
def test_long_rows_match_float64_within_1e5(impl, length):
    rng = np.random.default_rng(length)
    batch = 4
    mask = random_spans_mask(rng, batch, length)
    rewards = (rng.random((batch, length)) < 0.02) * rng.normal(size=(batch, length))
    values = rng.normal(size=(batch, length))
    last_value = rng.normal(size=batch)
    truncated = np.array([True, False, True, False])
    lam = rl.length_adaptive_lambda(mask, 1.5)
    args = (rewards.astype(np.float32), values.astype(np.float32), mask)
    adv, ret = rl.gae(*args, gamma=1.0, lam=lam, last_value=last_value.astype(np.float32),
                      truncated=truncated, impl=impl)
    want_adv, want_ret = gae_float64(*args, 1.0, np.asarray(lam), last_value, truncated)
    assert_close(adv, want_adv, 1e-5)
    assert_close(ret, want_ret, 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("length", [32768, 131072])
def test_very_long_rows_within_2e4_absolute(impl, length):
    rng = np.random.default_rng(7)
    batch = 2
    mask = random_spans_mask(rng, batch, length, mean_span=256)
    rewards = np.zeros((batch, length), np.float32)
    rewards[:, -1] = rng.normal(size=batch)  # outcome reward, moved to the last action
    values = rng.normal(size=(batch, length)).astype(np.float32)
    adv, ret = rl.gae(rewards, values, mask, gamma=1.0, lam=0.999, impl=impl)
    want_adv, want_ret = gae_float64(rewards, values, mask, 1.0, 0.999)
    assert np.abs(np.asarray(adv) - want_adv).max() <= 2e-4
    assert np.abs(np.asarray(ret) - want_ret).max() <= 2e-4


def test_impls_agree_and_do_not_retrace():
    rng = np.random.default_rng(3)
    mask = random_spans_mask(rng, 8, 300)
    rewards = rng.normal(size=(8, 300)).astype(np.float32)
    values = rng.normal(size=(8, 300)).astype(np.float32)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def xla(r, v, lam):
        return rl.gae(r, v, mask, gamma=1.0, lam=lam, impl="xla")

    for lam in (0.9, 0.95, 0.0):
        got = xla(rewards, values, jnp.float32(lam))
        want = rl.gae(rewards, values, mask, gamma=1.0, lam=lam, impl="reference")
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)


def test_the_chunked_forms_products_ask_for_full_float32():
    """On an accelerator a float32 product's default precision is TF32 (GPU) or bfloat16 passes
    (TPU): about 1e-3 off (docs/kernels.md, "On a GPU"). A CPU computes in full
    float32 whatever is asked, so the lowered program is what can tell: every product of the
    chunked form (both chunk sizes) asks for HIGHEST."""
    r = np.zeros((2, 64), np.float32)
    mask = np.ones((2, 64), bool)
    text = jax.jit(lambda r, v, gamma: rl.gae(r, v, mask, gamma=gamma, lam=0.95, impl="xla")
                   ).lower(r, r, 0.99).as_text()
    products = [line for line in text.splitlines() if "dot_general" in line]
    assert len(products) == 2  # chunks of 16, and of 4 for tiny discounts (`_CHUNK`)
    assert all("precision = [HIGHEST, HIGHEST]" in line for line in products), products


def test_gradient_flows_through_values():
    # GAE is linear in V: d sum(A) / dV matches finite differences in float64 terms.
    rng = np.random.default_rng(4)
    mask = random_spans_mask(rng, 2, 40, mean_span=4)
    rewards = rng.normal(size=(2, 40)).astype(np.float32)
    values = rng.normal(size=(2, 40)).astype(np.float32)
    for impl in IMPLS:
        fn = lambda v, impl=impl: rl.gae(rewards, v, mask, gamma=0.9, lam=0.8, impl=impl)[0].sum()
        jax.test_util.check_grads(fn, (values,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


class TestArguments:

    def test_shape_errors_name_the_argument(self):
        r = np.zeros((2, 5), np.float32)
        with pytest.raises(ValueError, match=r"values must have the shape of rewards \(2, 5\)"):
            rl.gae(r, np.zeros((2, 4)), r > 0, gamma=1.0, lam=1.0)
        with pytest.raises(ValueError, match=r"rewards must have rank 2"):
            rl.gae(np.zeros(5), np.zeros(5), np.zeros(5), gamma=1.0, lam=1.0)
        with pytest.raises(ValueError, match=r"lam must have shape \[B\] = \(2,\)"):
            rl.gae(r, r, r > 0, gamma=1.0, lam=np.ones(3))
        with pytest.raises(ValueError, match=r"action_mask must have the shape of rewards"):
            rl.gae(r, r, np.zeros((5, 2)), gamma=1.0, lam=1.0)
        with pytest.raises(ValueError, match=r"truncated must have shape \[B\]"):
            rl.gae(r, r, r > 0, gamma=1.0, lam=1.0, last_value=np.zeros(2), truncated=np.zeros(3))

    def test_value_errors_name_the_argument(self):
        r = np.zeros((2, 5), np.float32)
        with pytest.raises(ValueError, match=r"gamma must lie in \[0.0, 1.0\], got 1.5"):
            rl.gae(r, r, r > 0, gamma=1.5, lam=1.0)
        with pytest.raises(ValueError, match=r"lam must lie in \[0.0, 1.0\]"):
            rl.gae(r, r, r > 0, gamma=1.0, lam=np.array([0.5, -0.1]))
        with pytest.raises(ValueError, match=r"impl must be one of"):
            rl.gae(r, r, r > 0, gamma=1.0, lam=1.0, impl="fast")
        with pytest.raises(ValueError, match=r"last_value and truncated go together"):
            rl.gae(r, r, r > 0, gamma=1.0, lam=1.0, last_value=np.zeros(2))


def test_length_adaptive_lambda():
    mask = np.zeros((3, 10), bool)
    mask[0, :4] = True  # n = 4: 1 - 1 / 6
    mask[1, :] = True  # n = 10: 1 - 1 / 15
    lam = rl.length_adaptive_lambda(mask, 1.5)
    np.testing.assert_allclose(lam, [1 - 1 / 6, 1 - 1 / 15, 0.0], rtol=1e-6)
    np.testing.assert_allclose(rl.length_adaptive_lambda(mask[:1, :1], 1.5), [1 / 3], rtol=1e-6)
    np.testing.assert_allclose(rl.length_adaptive_lambda(mask[:1, :1], 0.5), [0.0])  # 1 - 2 < 0
    with pytest.raises(ValueError, match="alpha"):
        rl.length_adaptive_lambda(mask, 0.0)


def test_decoupled_gae_uses_each_lambda():
    rng = np.random.default_rng(5)
    mask = random_spans_mask(rng, 3, 64, mean_span=8)
    rewards = rng.normal(size=(3, 64)).astype(np.float32)
    values = rng.normal(size=(3, 64)).astype(np.float32)
    lam_policy = rl.length_adaptive_lambda(mask, 1.5)
    adv, ret = rl.decoupled_gae(rewards, values, mask, gamma=1.0, lam_policy=lam_policy)
    want_adv, _ = gae_float64(rewards, values, mask, 1.0, np.asarray(lam_policy))
    _, want_ret = gae_float64(rewards, values, mask, 1.0, 1.0)
    assert_close(adv, want_adv, 1e-5)
    assert_close(ret, want_ret, 1e-5)
    # lam_critic = 1, terminated rows: returns are Monte-Carlo, independent of V.
    _, ret_other_v = rl.decoupled_gae(rewards, values * 3 + 1, mask, gamma=1.0,
                                      lam_policy=lam_policy)
    np.testing.assert_allclose(ret, ret_other_v, atol=1e-4)


@pytest.mark.parametrize("jit", [False, True])
def test_tiny_discount_rows_on_long_rows(jit):
    # lam = 0 rows (TD(0), or a length-adaptive lambda of 0) send the batch to 4-token chunks.
    rng = np.random.default_rng(11)
    mask = random_spans_mask(rng, 4, 4096)
    rewards = (rng.random((4, 4096)) < 0.05) * rng.normal(size=(4, 4096))
    values = rng.normal(size=(4, 4096))
    lam = np.array([0.0, 0.999, 1e-12, 0.5], np.float32)
    args = (rewards.astype(np.float32), values.astype(np.float32), mask)
    fn = lambda lam: rl.gae(*args, gamma=0.99, lam=lam, impl="xla")
    adv, ret = (jax.jit(fn) if jit else fn)(lam)
    want_adv, want_ret = gae_float64(*args, np.float32(0.99), lam.astype(np.float64))
    assert_close(adv, want_adv, 1e-5)
    assert_close(ret, want_ret, 1e-5)


def test_rows_without_actions_do_not_choose_the_small_discount_path(monkeypatch):
    from sao_jax.rl import advantages

    def refuse(*args):
        raise AssertionError("4-token path chosen for a tiny lambda on an empty row")

    monkeypatch.setattr(advantages, "_gae_chunked_small", refuse)
    mask = np.ones((3, 40), bool)
    mask[2] = False  # a padding row, whose length-adaptive lambda is 0
    rewards = np.ones((3, 40), np.float32)
    lam = rl.length_adaptive_lambda(mask, 1.5)
    assert float(lam[2]) == 0.0
    adv, _ = rl.gae(rewards, rewards, mask, gamma=1.0, lam=lam, impl="xla")
    want, _ = gae_float64(rewards, rewards, mask, 1.0, np.asarray(lam))
    assert_close(adv, want, 1e-5)


def step_gae_loop(rewards, values, mask, gamma, lam, last_value, truncated):
    """GAE over turns in plain float64 loops: a turn is a run of action tokens and what follows it
    up to the next run; its value is read at its first token."""
    batch, length = rewards.shape
    adv = np.zeros((batch, length))
    ret = np.zeros((batch, length))
    for b in range(batch):
        starts = [t for t in range(length) if mask[b, t] and (t == 0 or not mask[b, t - 1])]
        ends = starts[1:] + [length] if starts else []
        r = [float(np.sum(rewards[b, s:e], dtype=np.float64)) for s, e in zip(starts, ends,
                                                                             strict=True)]
        v = [float(values[b, s]) for s in starts]
        a = 0.0
        for k in reversed(range(len(starts))):
            v_next = v[k + 1] if k + 1 < len(starts) else (last_value[b] if truncated[b] else 0.0)
            a = r[k] + gamma * v_next - v[k] + gamma * lam[b] * a
            ret[b, starts[k]] = a + v[k]
            for t in range(starts[k], ends[k]):
                if mask[b, t]:
                    adv[b, t] = a
    return adv, ret


@pytest.mark.parametrize("impl", IMPLS)
def test_step_gae_is_gae_over_turns(impl):
    rng = np.random.default_rng(12)
    batch, length = 4, 90
    mask = random_spans_mask(rng, batch, length, mean_span=6)
    mask[1, :] = False  # no turns: zeros
    mask[2, :] = True  # one turn: the whole row
    rewards = (rng.random((batch, length)) < 0.2) * rng.normal(size=(batch, length))
    values = rng.normal(size=(batch, length))
    last_value = rng.normal(size=batch)
    truncated = np.array([True, False, True, False])
    lam = np.asarray(rl.length_adaptive_lambda(rl.first_action_tokens(mask), 1.5))
    args = (rewards.astype(np.float32), values.astype(np.float32), mask)
    adv, ret = rl.step_gae(*args, gamma=0.95, lam=lam, last_value=last_value.astype(np.float32),
                           truncated=truncated, impl=impl)
    want_adv, want_ret = step_gae_loop(*args, 0.95, lam.astype(np.float64), last_value, truncated)
    assert_close(adv, want_adv, 1e-5)
    assert_close(ret, want_ret, 1e-5)
    # decoupled_gae(turns=True): the advantages with lam_policy, the targets with lam_critic = 1.
    adv_d, ret_d = rl.decoupled_gae(*args, gamma=0.95, lam_policy=lam, turns=True,
                                    last_value=last_value.astype(np.float32), truncated=truncated,
                                    impl=impl)
    _, want_ret_1 = step_gae_loop(*args, 0.95, np.ones(batch), last_value, truncated)
    assert_close(adv_d, want_adv, 1e-5)
    assert_close(ret_d, want_ret_1, 1e-5)


def test_step_gae_hand_computed():
    # a0 a1 o a2 o: turns start at 0 (reward 0.5 on its observation) and 3 (reward 1 on a2).
    mask = np.array([[1, 1, 0, 1, 0]], bool)
    rewards = np.array([[0.0, 0.0, 0.5, 1.0, 0.0]], np.float32)
    values = np.array([[0.2, 9.0, 9.0, 0.4, 9.0]], np.float32)
    adv, ret = rl.step_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    a2 = 1.0 - 0.4
    a1 = 0.5 + 0.9 * 0.4 - 0.2 + 0.9 * 0.5 * a2
    np.testing.assert_allclose(adv, [[a1, a1, 0, a2, 0]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[a1 + 0.2, 0, 0, a2 + 0.4, 0]], rtol=1e-6)
    with pytest.raises(ValueError, match=r"values must have the shape of rewards"):
        rl.step_gae(rewards, values[:, :3], mask, gamma=0.9, lam=0.5)


# ----------------------------------------------------------------------------------- baselines

def test_grpo_advantages():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
    adv = rl.grpo_advantages(rewards)
    std = np.std([1, 0, 0, 1], ddof=1)
    np.testing.assert_allclose(adv[0], np.array([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(adv[1], 0.0)
    with pytest.raises(ValueError, match=r"G >= 2 rollouts per prompt"):
        rl.grpo_advantages(rewards[:, :1])
    with pytest.raises(ValueError, match=r"rewards must have rank 2"):
        rl.grpo_advantages(rewards[0])


def test_running_mean_per_prompt_window():
    state = rl.running_mean_init(num_prompts=3, window=2)
    adv, state = rl.running_mean_advantages(state, jnp.array([1.0, 0.0]), jnp.array([0, 1]))
    np.testing.assert_allclose(adv, [1.0, 0.0])  # empty windows: baseline 0
    adv, state = rl.running_mean_advantages(state, jnp.array([0.0, 1.0]), jnp.array([0, 0]))
    np.testing.assert_allclose(adv, [-1.0, 0.0])  # both see the window [1.0]
    # Slot 0 saw 1, 0, 1: its window of 2 holds the last two, 0 and 1.
    adv, state = rl.running_mean_advantages(state, jnp.array([1.0]), jnp.array([0]))
    np.testing.assert_allclose(adv, [0.5])


def test_running_mean_many_rewards_of_one_slot_in_a_batch_keep_the_last():
    state = rl.running_mean_init(num_prompts=2, window=3)
    rewards = jnp.arange(7, dtype=jnp.float32)
    _, state = rl.running_mean_advantages(state, rewards, jnp.zeros(7, jnp.int32))
    assert int(state.count[0]) == 7
    assert sorted(np.asarray(state.rewards[0]).tolist()) == [4.0, 5.0, 6.0]
    adv, _ = rl.running_mean_advantages(state, jnp.array([5.0]), jnp.array([0]))
    np.testing.assert_allclose(adv, [0.0])


def test_running_mean_state_round_trips_through_numpy_and_jit():
    state = rl.running_mean_init(num_prompts=4, window=8)
    rng = np.random.default_rng(1)
    step = jax.jit(rl.running_mean_advantages)
    for _ in range(5):
        _, state = step(state, jnp.asarray(rng.normal(size=6), jnp.float32),
                        jnp.asarray(rng.integers(0, 4, size=6), jnp.int32))
    saved = {k: np.asarray(v) for k, v in state._asdict().items()}
    restored = rl.RunningMeanState(**{k: jnp.asarray(v) for k, v in saved.items()})
    rewards, slots = jnp.array([0.3, -0.2]), jnp.array([1, 3])
    np.testing.assert_array_equal(step(state, rewards, slots)[0], step(restored, rewards, slots)[0])


def test_running_mean_global_window():
    state = rl.running_mean_init(num_prompts=1, window=128)
    _, state = rl.running_mean_advantages(state, jnp.array([1.0, 3.0]))
    adv, _ = rl.running_mean_advantages(state, jnp.array([2.0]))
    np.testing.assert_allclose(adv, [0.0])


def test_running_mean_bad_slot():
    state = rl.running_mean_init(num_prompts=2)
    with pytest.raises(ValueError, match=r"prompt_index must lie in \[0, 1\]"):
        rl.running_mean_advantages(state, jnp.array([1.0]), jnp.array([2]))
