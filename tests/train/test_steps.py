"""The learner step: two steps of every algorithm, batches, safety, step-level values."""

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax import rl
from sao_jax.models import CausalLM, expert_routes
from sao_jax.models.config import preset
from sao_jax.train import critic_optimizer_config, param_path, policy_optimizer_config
from sao_jax.train.advantages import RunningMean
from sao_jax.train.advantages import advantages as step_advantages
from sao_jax.train.algorithms import ALGORITHMS, get_algorithm
from sao_jax.train.batch import (
    batch_lengths,
    batch_shapes,
    bucket_length,
    bucket_rows,
    make_batch,
    packed_mask,
    packed_row_counts,
)
from sao_jax.train.steps import (
    CPU_COMPILER_OPTIONS,
    StepConfig,
    Trainer,
    compiler_options,
)
from tests.train.trainers import CFG, ROWS, synthetic_trajectories, trainer_for


def flat(params):
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {param_path(path): np.asarray(value) for path, value in leaves}


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_two_steps_train_what_they_should_and_nothing_else(algo):
    algorithm = ALGORITHMS[algo]
    trainer = trainer_for(algo)
    state = trainer.init_state()
    policy0, critic0 = flat(state.policy), state.critic and flat(state.critic)
    keys = [np.asarray(state.rng)]
    for seed in (0, 1):
        batch = make_batch(synthetic_trajectories(seed=seed, group_size=algorithm.group_size),
                           prompt_index=[i % 4 for i in range(ROWS)])
        state, metrics = trainer.step(state, batch)
        for name, value in metrics.items():
            assert np.isfinite(np.asarray(value)).all(), (algo, name)
        assert float(metrics["skipped"]) == 0.0
        keys.append(np.asarray(state.rng))
    assert int(state.step) == 2 and int(state.version) == 2
    assert len({k.tobytes() for k in keys}) == 3  # each step draws from a new key
    policy1 = flat(state.policy)
    unchanged = [k for k in policy0 if np.array_equal(policy0[k], policy1[k])]
    assert not unchanged, f"{algo}: policy parameters not trained: {unchanged}"
    if algorithm.uses_critic:
        critic1 = flat(state.critic)
        attention = {k for k in critic0 if "/attn/" in k}
        assert attention
        for k in critic0:
            same = np.array_equal(critic0[k], critic1[k])
            if algorithm.freeze_attention and k in attention:
                assert same, f"{algo}: frozen critic parameter {k} changed"
            else:
                assert not same, f"{algo}: critic parameter {k} did not train"
        assert {"critic/loss", "critic/grad_norm", "critic/explained_variance"} <= set(metrics)
        # the attention's part of the norm, logged where it trains (the norm over all of them)
        if algorithm.freeze_attention:
            assert "critic/attention_grad_norm" not in metrics
        else:
            assert 0 < metrics["critic/attention_grad_norm"] < metrics["critic/grad_norm"]
    else:
        assert state.critic is None
    if isinstance(algorithm.advantage, RunningMean):
        assert int(np.sum(state.baseline.count)) == 2 * ROWS
    else:
        assert state.baseline is None


def test_float32_master_weights_keep_the_updates_that_a_bfloat16_policy_rounds_away():
    """A float32 policy stepped with `compute_dtype=bfloat16` computes as a bfloat16 policy does
    (the same log-probs, bit for bit) and keeps float32 parameters and moments, so an update of
    1e-6 (swe's learning rate) moves them; a policy stored in bfloat16 rounds nearly all of it
    away. The engines get the bfloat16 weights."""
    from sao_jax.train.build import in_dtype

    policy = CausalLM(CFG, nnx.Rngs(0))
    config = StepConfig(algorithm=get_algorithm("sao"), gae_impl="reference")

    def trainer(model, compute_dtype=None):
        return Trainer(model, config, policy_optimizer=policy_optimizer_config(1e-6),
                       critic_optimizer=critic_optimizer_config(1e-6), num_prompts=4,
                       compute_dtype=compute_dtype)

    master, stored = trainer(policy, jnp.bfloat16), trainer(in_dtype(policy, jnp.bfloat16))
    batch = make_batch(synthetic_trajectories(), prompt_index=[i % 4 for i in range(ROWS)])
    kept, rounded = master.init_state(), stored.init_state()
    logp = np.asarray(master.logprobs(kept.policy, batch))
    np.testing.assert_array_equal(logp, stored.logprobs(rounded.policy, batch))
    # sampled by this policy: every token in DIS's band, so every parameter has a gradient
    batch = batch._replace(rollout_logp=np.where(batch.action_mask, logp, 0).astype(np.float32))
    floats = [x.dtype for x in jax.tree.leaves((kept.policy, kept.policy_opt, kept.critic))
              if jnp.issubdtype(x.dtype, jnp.floating)]
    assert set(floats) == {jnp.dtype(jnp.float32)}
    served = master.served_params(kept.policy)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(master.policy_of(served)))} == \
        {x.dtype for x in jax.tree.leaves(nnx.state(master.policy_model(kept)))} == \
        {jnp.dtype(jnp.bfloat16)}
    assert all(a is not b for a, b in zip(jax.tree.leaves(served), jax.tree.leaves(kept.policy),
                                          strict=True))

    def moved(trainer, state):
        before = flat(state.policy)
        state, metrics = trainer.step(state, batch)
        assert float(metrics["skipped"]) == 0.0
        after = flat(state.policy)
        return sum(np.sum(before[k] != after[k]) for k in before) / sum(
            v.size for v in before.values())

    assert moved(master, kept) > 0.9
    assert moved(stored, rounded) < 0.05


def test_accumulated_gradients_are_the_float32_sums_of_the_bfloat16_ones():
    """`ModelPasses.accumulate` with float32 parameters computing in bfloat16 returns float32
    gradients that are, bit for bit, each micro-batch's gradient through the cast (a bfloat16
    gradient, widened) summed in float32 in the chunks' order: one chunk or four."""
    from sao_jax.models.params import cast_floating
    from sao_jax.train.batch import model_inputs
    from sao_jax.train.passes import ModelPasses, _row_chunks

    graph, state = nnx.split(CausalLM(CFG, nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    batch = make_batch(synthetic_trajectories(), prompt_index=[i % 4 for i in range(ROWS)])
    arrays = (model_inputs(batch), jnp.asarray(batch.action_mask, jnp.float32))
    for chunks in (1, 4):
        passes = ModelPasses(graph, None, CFG, microbatches=chunks, compute_dtype=jnp.bfloat16)

        def loss_fn(p, inputs, mask, passes=passes):
            out = passes.policy_pass(p, inputs)
            return jnp.sum(out.logp * mask) / ROWS, out.logp

        loss, logp, grads = jax.jit(passes.accumulate, static_argnums=0)(loss_fn, params, arrays)
        assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
        through_cast = jax.jit(jax.grad(
            lambda p, *chunk: loss_fn(cast_floating(p, jnp.bfloat16), *chunk)[0]))
        parts = [arrays] if chunks == 1 else [
            jax.tree.map(lambda c, k=k: c[k], _row_chunks(arrays, chunks)) for k in range(chunks)]
        expected = jax.tree.map(jnp.zeros_like, params)
        for part in parts:
            expected = jax.tree.map(jnp.add, expected, through_cast(params, *part))
        for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                     jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(got, want, err_msg=param_path(path))
        assert logp.shape == batch.action_mask.shape and np.isfinite(float(loss))


def test_the_cpu_scheduler_option_changes_no_number():
    # On CPU the step compiles with XLA's memory-optimized scheduler (speed only): the same
    # step compiled with XLA's default order must give the same state and metrics. Bit for bit
    # with XLA's default CPU passes; the suite's quick ones (tests.FAST_COMPILE) fuse by the
    # schedule, which moves an element of the state by a rounding at most.
    assert jax.default_backend() == "cpu" and compiler_options() == CPU_COMPILER_OPTIONS
    trainer = trainer_for("sao")
    batch = jax.tree.map(np.asarray, make_batch(synthetic_trajectories()))
    default_order = jax.jit(functools.partial(trainer._step, update_policy=True))
    expected = jax.device_get(default_order(trainer.init_state(), batch))
    got = jax.device_get(trainer.step(trainer.init_state(), batch))
    jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7), got,
                 expected)


def test_warmup_step_trains_only_the_critic():
    trainer = trainer_for("sao")
    state = trainer.init_state()
    policy0, critic0 = flat(state.policy), flat(state.critic)
    state, metrics = trainer.step(state, make_batch(synthetic_trajectories()),
                                  update_policy=False)
    assert int(state.step) == 1 and int(state.version) == 0
    assert all(np.array_equal(policy0[k], v) for k, v in flat(state.policy).items())
    assert any(not np.array_equal(critic0[k], v) for k, v in flat(state.critic).items())
    assert "policy/loss" not in metrics and np.isfinite(float(metrics["policy/logp_mismatch"]))


def test_the_attention_grad_norm_is_what_freezing_the_attention_removes():
    """One critic update from the same parameters on the same batch: the full critic's squared
    gradient norm is the frozen critic's plus its attention's."""
    metrics = {}
    for algo in ("sao", "sao_full_critic"):
        trainer = trainer_for(algo, algorithm=dataclasses.replace(get_algorithm(algo),
                                                                   critic_steps=1))
        state = trainer.init_state()
        head = state.critic["value_head"]  # zero at init: no gradient would reach the backbone
        kernel = jax.random.normal(jax.random.key(0), head["kernel"].shape) * 0.1
        state = state._replace(critic={**state.critic, "value_head": {**head, "kernel": kernel}})
        _, metrics[algo] = trainer.step(state, make_batch(synthetic_trajectories()),
                                        update_policy=False)
    full, frozen = metrics["sao_full_critic"], metrics["sao"]
    attention = float(full["critic/attention_grad_norm"])
    assert attention > 0.01 * float(full["critic/grad_norm"])
    np.testing.assert_allclose(float(full["critic/grad_norm"]) ** 2,
                               float(frozen["critic/grad_norm"]) ** 2 + attention ** 2, rtol=1e-4)


def test_the_critics_targets_take_the_configured_lambda():
    """`critic_lambda` reaches the critic's targets (`rl.decoupled_gae`): the reported critic
    loss is the value loss of the initial critic against GAE(lambda = critic_lambda) returns."""
    batch = make_batch(synthetic_trajectories())
    losses = []
    for lam in (1.0, 0.0):
        trainer = trainer_for("sao", critic_lambda=lam)
        state = trainer.init_state()
        values, last = trainer.passes.values(state.critic, batch.tokens, batch.last_index)
        _, returns = rl.gae(batch.rewards, values, batch.action_mask, gamma=1.0, lam=lam,
                            last_value=last, truncated=batch.truncated, impl="reference")
        want, _ = rl.value_loss(values, returns, batch.action_mask)
        _, metrics = trainer.step(state, batch, update_policy=False)
        np.testing.assert_allclose(metrics["critic/loss"], want, rtol=1e-4, err_msg=str(lam))
        losses.append(float(want))
    assert abs(losses[0] - losses[1]) > 1e-3 * abs(losses[0])  # the lambdas' targets differ


def test_truncated_rows_bootstrap_only_when_configured():
    """`bootstrap_truncated=False` (the SWE experiments): a truncated row's advantages and
    critic targets end in its rewards, as a finished row's (True, the default, bootstraps from
    `last_value`: the critic-lambda test above reads its targets that way)."""
    batch = make_batch(synthetic_trajectories())
    assert batch.truncated.any() and not batch.truncated.all()
    for bootstrap in (False,):
        trainer = trainer_for("sao", bootstrap_truncated=bootstrap)
        state = trainer.init_state()
        state = state._replace(critic=jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.1 if "value_head" in param_path(p) else x, state.critic))
        values, last = trainer.passes.values(state.critic, batch.tokens, batch.last_index)
        assert np.all(np.abs(np.asarray(last)) > 1e-3)  # a bootstrap would show
        adv = step_advantages(batch, None, config=trainer.config, sharding=None, values=values,
                              last_value=last).advantages
        want, _ = rl.decoupled_gae(
            batch.rewards, values, batch.action_mask, gamma=1.0,
            lam_policy=rl.length_adaptive_lambda(batch.action_mask,
                                                 trainer.config.algorithm.lam_alpha),
            lam_critic=1.0, last_value=last,
            truncated=batch.truncated if bootstrap else np.zeros_like(batch.truncated),
            impl="reference")
        np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6, err_msg=str(bootstrap))
        _, returns = rl.gae(batch.rewards, values, batch.action_mask, gamma=1.0, lam=1.0,
                            last_value=last, impl="reference",
                            truncated=batch.truncated if bootstrap
                            else np.zeros_like(batch.truncated))
        loss, _ = rl.value_loss(values, returns, batch.action_mask)
        _, metrics = trainer.step(state, batch, update_policy=False)
        np.testing.assert_allclose(metrics["critic/loss"], loss, rtol=1e-4, err_msg=str(bootstrap))


def test_nonfinite_step_is_skipped_and_changes_nothing():
    trainer = trainer_for("sao")
    state = trainer.init_state()
    before = jax.tree.map(np.asarray, state)
    batch = make_batch(synthetic_trajectories())
    batch = batch._replace(rewards=np.where(batch.action_mask, np.nan, 0).astype(np.float32))
    state, metrics = trainer.step(state, batch)
    assert float(metrics["skipped"]) == 1.0
    # The version counts the policy step (the host counts versions without reading them back);
    # its weights are the previous version's.
    assert int(state.step) == 1 and int(state.version) == 1
    for a, b in zip(jax.tree.leaves(before.policy) + jax.tree.leaves(before.critic),
                    jax.tree.leaves(state.policy) + jax.tree.leaves(state.critic), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_learner_logp_matches_the_engine_logp_it_was_given():
    """With rollout log-probs from the policy itself, the ratio is exactly 1: mismatch ~0."""
    trainer = trainer_for("grpo_dis")
    state = trainer.init_state()
    batch = make_batch(synthetic_trajectories(group_size=8))
    logp = np.asarray(trainer.passes.logp(state.policy, jnp.asarray(batch.tokens)))
    batch = batch._replace(rollout_logp=np.where(batch.action_mask, logp, 0).astype(np.float32))
    _, metrics = trainer.step(state, batch)
    assert float(metrics["policy/logp_mismatch"]) < 1e-5
    assert float(metrics["policy/dis_frac_below"]) == float(metrics["policy/dis_frac_above"]) == 0


@pytest.mark.parametrize("algo, microbatches, update_policy", [
    ("grpo_dis", 1, True), ("grpo_dis", 2, True), ("grpo", 1, True), ("sao", 1, False)])
def test_the_gap_metrics_are_the_start_of_step_logp_against_the_engines(algo, microbatches,
                                                                         update_policy):
    """`policy/logp_mismatch` and its `_p99` and `_max`: |learner - engine| over the action
    tokens as NumPy computes them, from the policy's log-probs at the start of the step (DIS:
    its loss pass, which micro-batches give back in row order; PPO: the old policy's pass; the
    critic warm-up: a pass of its own). Off the mask the gap is ~4 nats (0 against -log 64):
    counting one would show. The `_fresh` tags are the same over the rows of policy lag 0 only
    (every row without lags; NaN with none)."""
    trainer = trainer_for(algo, microbatches=microbatches)
    state = trainer.init_state()
    trajectories = synthetic_trajectories(group_size=ALGORITHMS[algo].group_size)
    lags = [i % 3 for i in range(len(trajectories))]
    batch = make_batch(trajectories, policy_lag=lags)
    every = np.abs(np.asarray(trainer.logprobs(state.policy, batch)) - batch.rollout_logp)
    gap = every[batch.action_mask]
    _, metrics = trainer.step(state, batch, update_policy=update_policy)
    np.testing.assert_allclose(metrics["policy/logp_mismatch"], gap.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["policy/logp_mismatch_p99"], np.quantile(gap, 0.99),
                               rtol=1e-5)
    np.testing.assert_allclose(metrics["policy/logp_mismatch_max"], gap.max(), rtol=1e-5)
    fresh_tokens = batch.action_mask & (np.asarray(lags) == 0)[:, None]
    fresh = every[fresh_tokens]
    assert 0 < fresh.size < gap.size
    np.testing.assert_allclose(metrics["policy/fresh_frac"], fresh.size / gap.size, rtol=1e-6)
    for suffix, value in (("", fresh.mean()), ("_p99", np.quantile(fresh, 0.99)),
                          ("_max", fresh.max())):
        np.testing.assert_allclose(metrics[f"policy/logp_mismatch_fresh{suffix}"], value,
                                   rtol=1e-5)
    if algo == "grpo_dis" and microbatches == 1:  # the same batch all stale, then all fresh
        stale_batch = batch._replace(policy_lag=np.full(len(lags), 8, np.int32))
        _, stale = trainer.step(trainer.init_state(), stale_batch, update_policy=update_policy)
        assert float(stale["policy/fresh_frac"]) == 0
        assert np.isnan(stale["policy/logp_mismatch_fresh"])
        _, plain = trainer.step(trainer.init_state(), make_batch(trajectories),
                                update_policy=update_policy)
        np.testing.assert_allclose(plain["policy/logp_mismatch_fresh"], gap.mean(), rtol=1e-5)


def test_microbatched_step_equals_full_batch():
    batch = make_batch(synthetic_trajectories())
    results = []
    for microbatches in (1, 2):
        trainer = trainer_for("sao", microbatches=microbatches)
        state, metrics = trainer.step(trainer.init_state(), batch)
        results.append((flat(state.policy), flat(state.critic), metrics))
    for a, b in zip(results[0][:2], results[1][:2], strict=True):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], atol=2e-6, err_msg=k)
    np.testing.assert_allclose(results[0][2]["policy/loss"], results[1][2]["policy/loss"],
                               rtol=1e-5)


def test_the_in_band_denominator_refuses_micro_batches():
    """Each micro-batch would divide by its own in-band count: their sum is not the batch's
    loss, so the combination is refused by name rather than trained on."""
    with pytest.raises(ValueError, match="in_band_tokens.*microbatches=1"):
        trainer_for("sao", microbatches=2, dis_denominator="in_band_tokens")
    trainer_for("sao", microbatches=1, dis_denominator="in_band_tokens")


def lowered_step_chars(algo, num_layers, microbatches, scan_layers=True):
    """Characters of the StableHLO of one learner step (lowered, not compiled)."""
    cfg = preset("toy", num_layers=num_layers, mlp_only_layers=(), scan_layers=scan_layers)
    config = StepConfig(algorithm=get_algorithm(algo), microbatches=microbatches,
                        ppo_minibatches=8, gae_impl="reference")
    trainer = Trainer(CausalLM(cfg, nnx.Rngs(0)), config,
                      policy_optimizer=policy_optimizer_config(1e-3),
                      critic_optimizer=critic_optimizer_config(1e-3), num_prompts=4)
    batch = make_batch(synthetic_trajectories(group_size=get_algorithm(algo).group_size),
                       prompt_index=[i % 4 for i in range(ROWS)])
    state = jax.eval_shape(trainer.init_state)
    return len(trainer._jitted_step(True).lower(state, batch).as_text())


@pytest.mark.parametrize("algo", ["sao", "grpo"])  # K = 2 critic updates; 8 PPO mini-batches
def test_the_step_does_not_grow_with_depth_or_accumulation(algo):
    """Layers run under a scan, and micro-batches, PPO mini-batches and critic updates are
    scans too, so the program is one copy of each whatever their counts (the per-layer layout,
    for contrast, grows with depth)."""
    base = lowered_step_chars(algo, 2, 1)
    deep = lowered_step_chars(algo, 8, 1)
    accumulated = lowered_step_chars(algo, 8, 8)
    print(f"{algo}: 2 layers {base}, 8 layers {deep}, 8 layers x 8 micro-batches "
          f"{accumulated} characters of StableHLO")
    assert deep <= 1.25 * base and accumulated <= 1.25 * base
    assert lowered_step_chars(algo, 8, 1, scan_layers=False) > 2 * base


def test_scanned_and_per_layer_steps_train_alike():
    """The scanned layout is the per-layer model with its parameters stacked: a step from the
    same weights gives the same weights in either (compared per layer). grpo_dis, to keep it
    short: every other step test runs the scanned layout, the critic's included."""
    from sao_jax.models import stack_layers, unstack_layers

    group = get_algorithm("grpo_dis").group_size
    batch = make_batch(synthetic_trajectories(group_size=group),
                       prompt_index=[i % 4 for i in range(ROWS)])
    per_layer = CausalLM(preset("toy", num_layers=2, mlp_only_layers=()), nnx.Rngs(0))  # 2 MoE
    results = []
    for policy in (per_layer, stack_layers(per_layer)):
        trainer = Trainer(policy, StepConfig(algorithm=get_algorithm("grpo_dis"),
                                             gae_impl="reference"),
                          policy_optimizer=policy_optimizer_config(1e-3),
                          critic_optimizer=critic_optimizer_config(1e-3), num_prompts=4)
        state, metrics = trainer.step(trainer.init_state(), batch)
        model = unstack_layers(trainer.policy_model(state))
        results.append((flat(nnx.to_pure_dict(nnx.state(model))), metrics))
    (a, ma), (b, mb) = results
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=2e-6, err_msg=k)
    np.testing.assert_allclose(ma["policy/loss"], mb["policy/loss"], rtol=1e-5)


def test_packed_step_equals_the_padded_step(algo="sao"):
    """Trajectories packed several to a model row (attention within each, positions from 0)
    train exactly as in rows of their own: same parameters, same metrics."""
    trajectories = synthetic_trajectories(rows=8)
    padded = make_batch(trajectories, prompt_index=[i % 4 for i in range(8)])
    packed = make_batch(trajectories, prompt_index=[i % 4 for i in range(8)], pack_length=64)
    assert packed.packing.tokens.shape[0] < 8  # several trajectories share a row
    results = []
    for batch in (padded, packed):
        trainer = trainer_for(algo)
        state, metrics = trainer.step(trainer.init_state(), batch)
        state, metrics = trainer.step(state, batch)  # the critic is no longer zero
        results.append((flat(state.policy), state.critic and flat(state.critic), metrics))
    (policy_a, critic_a, metrics_a), (policy_b, critic_b, metrics_b) = results
    for a, b in ((policy_a, policy_b), (critic_a or {}, critic_b or {})):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], atol=2e-6, err_msg=k)
    for key in metrics_a:
        np.testing.assert_allclose(metrics_a[key], metrics_b[key], rtol=1e-4, atol=1e-6,
                                   err_msg=key)
    assert trainer_for("grpo_dis").packs and not trainer_for("grpo").packs  # PPO mini-batches
    grpo = trainer_for("grpo")
    with pytest.raises(ValueError, match="packed batch .* needs the DIS policy loss"):
        grpo.step(grpo.init_state(), make_batch(synthetic_trajectories(group_size=8),
                                                pack_length=64))


def own_routes(trajectory):
    """`[P + T, layers, top_k]` the experts the test trainers' policy (`trainer_for`: CFG,
    seed 0) routes each token of `trajectory` to, in a pass of its own."""
    ids = np.concatenate([trajectory.prompt_ids, trajectory.response_ids])[None]
    out = CausalLM(CFG, nnx.Rngs(0)).backbone(ids)
    return np.asarray(expert_routes(CFG, out.router_logits, 1, ids.shape[1]))[0]


def test_routing_replay_puts_the_engines_experts_into_the_policys_pass():
    """Each trajectory's `routed_experts` go into the batch beside its tokens (padded or
    packed), and the policy's pass replays them: replaying its own choices changes no
    log-prob, other experts change them, and a packed batch replays as the padded one does.
    The step trains on them (DIS packed, PPO's mini-batches padded); the critic routes
    itself."""
    trainer = trainer_for("sao")
    state = trainer.init_state()
    base = synthetic_trajectories(rows=8)
    own = [dataclasses.replace(t, routed_experts=own_routes(t)) for t in base]
    other = [dataclasses.replace(t, routed_experts=(t.routed_experts + 1) % CFG.num_experts)
             for t in own]
    shape = (CFG.num_layers, CFG.num_experts_per_tok)
    batch = make_batch(other, routes=shape)
    t = other[3]
    n = len(t.prompt_ids) + t.length
    np.testing.assert_array_equal(batch.routes[3, :n], t.routed_experts)
    assert (batch.routes[3, n:] == -1).all() and batch.packing is None
    packed = make_batch(other, routes=shape, pack_length=64)
    assert packed.routes is None and packed.packing.routes.shape[-2:] == shape
    segments = packed.packing.segments
    np.testing.assert_array_equal(packed.packing.routes[segments == 3], t.routed_experts)
    assert (packed.packing.routes[segments == -1] == -1).all()
    for real, shapes in ((batch, batch_shapes(8, batch.tokens.shape[1], routes=shape)),
                         (packed, batch_shapes(8, 64, packed.packing.tokens.shape[0],
                                               routes=shape))):
        assert jax.tree.map(lambda a: (a.shape, a.dtype.type), real) == shapes  # precompiled

    def logp(batch):
        return np.asarray(trainer.logprobs(state.policy, batch))

    mask = batch.action_mask
    plain = logp(make_batch(base))
    np.testing.assert_allclose(logp(make_batch(own, routes=shape)), plain, atol=1e-5)
    replayed = logp(batch)
    assert np.abs(replayed - plain)[mask].max() > 1e-2
    np.testing.assert_allclose(logp(packed)[:, :mask.shape[1]][mask], replayed[mask], atol=1e-5)
    # without routes a trajectory routes itself; routes of another model are refused
    mixed = logp(make_batch(base[:1] + other[1:], routes=shape))
    np.testing.assert_allclose(mixed[0], plain[0], atol=1e-5)
    with pytest.raises(ValueError, match="t0-0: routed_experts hold .* the policy has"):
        make_batch(other, routes=(2, 2))
    for algo, batch in (("sao", packed), ("grpo", make_batch(
            [dataclasses.replace(t, prompt_id=f"p{i // 8}") for i, t in enumerate(other)],
            routes=shape))):
        trainer = trainer_for(algo)
        _, metrics = trainer.step(trainer.init_state(), batch)
        assert np.isfinite(metrics["policy/loss"])
        # the policy's own router chose none of the replayed experts: every token re-routed
        assert metrics["policy/routed_same"] == 0.0 and np.isnan(
            metrics["policy/logp_mismatch_same"])
        assert metrics["policy/logp_mismatch_different"] == metrics["policy/logp_mismatch"]


def test_engine_routes_without_replay_are_compared_not_replayed():
    """`routing_replay=False`: a batch carrying the engines' routes trains as one without
    them (the policy routes itself), and the step logs how often the policy chose the
    engine's experts and the gap on either side; tokens without routes do not count."""
    base = synthetic_trajectories(rows=8)
    own = [dataclasses.replace(t, routed_experts=own_routes(t)) for t in base]
    half = own[:4] + [dataclasses.replace(t, routed_experts=(t.routed_experts + 1)
                                          % CFG.num_experts) for t in own[4:]]
    half[0] = base[0]  # no routes: unreported
    shape = (CFG.num_layers, CFG.num_experts_per_tok)
    compare = trainer_for("sao", routing_replay=False)
    plain = trainer_for("sao")
    with_routes, without = make_batch(half, routes=shape), make_batch(base)
    gap = np.abs(np.asarray(compare.logprobs(compare.init_state().policy, with_routes))
                 - with_routes.rollout_logp)
    new, metrics = compare.step(compare.init_state(), with_routes)
    expected, expected_metrics = plain.step(plain.init_state(), without)
    np.testing.assert_allclose(metrics["policy/logp_mismatch"],
                               expected_metrics["policy/logp_mismatch"], rtol=1e-6)
    a, b = flat(new.policy), flat(expected.policy)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=2e-6, err_msg=k)
    tokens = with_routes.action_mask
    rerouted = tokens[4:].sum() / tokens[1:].sum()
    np.testing.assert_allclose(metrics["policy/routed_same"], 1 - rerouted, rtol=1e-6)
    np.testing.assert_allclose(metrics["policy/logp_mismatch_same"],
                               gap[1:4][tokens[1:4]].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["policy/logp_mismatch_different"],
                               gap[4:][tokens[4:]].mean(), rtol=1e-5)
    assert "policy/routed_same" not in expected_metrics


def test_packing_lays_every_trajectory_end_to_end():
    trajectories = synthetic_trajectories(rows=12, seed=3)
    batch = make_batch(trajectories, pack_length=64, row_multiple=2)
    pk = batch.packing
    rows, p = pk.tokens.shape
    assert p == 64 and rows % 2 == 0 and rows in packed_row_counts(12, 2)
    assert batch.action_mask.shape == (12, 63)
    flat_tokens, flat_targets = pk.tokens.reshape(-1), pk.targets.reshape(-1)
    flat_positions = pk.positions.reshape(-1)
    for i, t in enumerate(trajectories):
        n = len(t.prompt_ids) + t.length
        where = pk.index[i, :n]  # the trajectory's tokens, in order, in one segment
        np.testing.assert_array_equal(flat_tokens[where], batch.tokens[i, :n])
        np.testing.assert_array_equal(flat_positions[where], np.arange(n))
        np.testing.assert_array_equal(pk.segments.reshape(-1)[where], i)
        np.testing.assert_array_equal(flat_targets[where[:-1]], batch.tokens[i, 1:n])
        assert (pk.index[i, n:] == where[-1]).all()  # padding reads the segment's last token
    assert (pk.segments >= 0).sum() == sum(len(t.prompt_ids) + t.length for t in trajectories)
    mask = packed_mask(pk.segments, pk.positions)
    r, q, k = np.nonzero(mask & (pk.segments >= 0)[:, :, None])
    assert (pk.segments[r, q] == pk.segments[r, k]).all() and (k <= q).all()
    assert [bucket_rows(n) for n in (1, 2, 3, 4, 5, 7, 9, 13, 17)] == [1, 2, 3, 4, 6, 8, 12,
                                                                        16, 24]
    with pytest.raises(ValueError, match="pack_length=16 hold at most 15"):
        make_batch(trajectories, pack_length=16)


def test_batch_alignment():
    t = synthetic_trajectories(rows=2)
    batch = make_batch(t)
    assert batch.tokens.shape[1] == bucket_length(max(len(x.prompt_ids) + x.length for x in t) + 1)
    for i, traj in enumerate(t):
        p, n = len(traj.prompt_ids), traj.length
        np.testing.assert_array_equal(batch.tokens[i, p:p + n], traj.response_ids)
        # position j predicts token j + 1: the first response token is predicted at p - 1
        np.testing.assert_array_equal(batch.action_mask[i, p - 1:p - 1 + n], traj.action_mask)
        assert batch.action_mask[i].sum() == traj.action_mask.sum()
        assert batch.last_index[i] == p + n - 1
        np.testing.assert_allclose(batch.rewards[i].sum(), traj.rewards.sum())


def test_step_level_helpers():
    m = jnp.array([[0, 1, 1, 0, 0, 1, 1, 1, 0]], bool)
    first = rl.first_action_tokens(m)
    np.testing.assert_array_equal(first[0], [0, 1, 0, 0, 0, 1, 0, 0, 0])
    x = jnp.array([[0, 5.0, 0, 0, 0, 7.0, 0, 0, 0]])
    np.testing.assert_array_equal(rl.fill_actions(x, first, m)[0], [0, 5, 5, 0, 0, 7, 7, 7, 0])


def test_step_value_advantages_are_turn_level_gae():
    """sao_step_value's advantages equal GAE over turns computed by hand from its critic."""
    trainer = trainer_for("sao_step_value")
    state = trainer.init_state()
    # Give the critic a non-zero head so values differ per position.
    state = state._replace(critic=jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.1 if "value_head" in param_path(p) else x, state.critic))
    batch = make_batch(synthetic_trajectories(rows=4))
    values, last = jax.jit(trainer.passes.values)(state.critic, batch.tokens, batch.last_index)
    values, last = np.asarray(values), np.asarray(last)
    adv = np.asarray(jax.jit(lambda b, v, last: step_advantages(
        b, None, config=trainer.config, sharding=None, values=v, last_value=last).advantages)(
        batch, values, last))
    for b in range(4):
        m = batch.action_mask[b]
        starts = [j for j in range(len(m)) if m[j] and (j == 0 or not m[j - 1])]
        ends = starts[1:] + [len(m)]
        turn_r = [batch.rewards[b, s:e].sum() for s, e in zip(starts, ends, strict=True)]
        turn_v = [values[b, s] for s in starts]
        n = len(starts)
        lam = float(np.clip(1 - 1 / (1.5 * n), 0, 1))
        nxt = last[b] if batch.truncated[b] else 0.0
        a = 0.0
        expected = [0.0] * n
        for k in reversed(range(n)):
            v_next = turn_v[k + 1] if k + 1 < n else nxt
            delta = turn_r[k] + v_next - turn_v[k]
            a = delta + lam * a if k + 1 < n else delta
            expected[k] = a
        for k, s in enumerate(starts):
            run = np.flatnonzero(m[s:ends[k]])
            np.testing.assert_allclose(adv[b, s + run], expected[k], rtol=1e-5, atol=1e-6)


def test_bad_batches_are_refused():
    trainer = trainer_for("grpo")
    state = trainer.init_state()
    with pytest.raises(ValueError, match="whole groups of 8"):
        trainer.step(state, make_batch(synthetic_trajectories(rows=12)))
    with pytest.raises(ValueError, match="config.algo must be one of"):
        get_algorithm("sao2")
    with pytest.raises(ValueError, match="needs a critic"):
        dataclasses.replace(ALGORITHMS["sao"], critic_steps=0)
    assert rl  # the step is built from sao_jax.rl


def test_sharded_step_equals_single_device():
    """The same step on a {data 2, fsdp 2, tensor 2} mesh of simulated devices: parameters stay
    sharded by the rules, numbers match one device. (grpo_dis: no critic, so it compiles fast;
    the critic is the same backbone.)"""
    from sao_jax.train import sharding

    assert jax.device_count() >= 8
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices()[:8])
    batch = make_batch(synthetic_trajectories(group_size=8))
    policy = sharding.shard_model(CausalLM(CFG, nnx.Rngs(0)), mesh, sharding.DEFAULT_RULES)
    config = StepConfig(algorithm=get_algorithm("grpo_dis"), gae_impl="reference",
                        ppo_minibatches=2)
    sharded = Trainer(policy, config, policy_optimizer=policy_optimizer_config(1e-3),
                      critic_optimizer=critic_optimizer_config(1e-3), mesh=mesh)
    state, metrics = sharded.step(sharded.init_state(), batch)
    plain = trainer_for("grpo_dis")
    expected, expected_metrics = plain.step(plain.init_state(), batch)
    embedding = state.policy["backbone"]["embed"]["embedding"]
    assert embedding.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    for a, b in zip(jax.tree.leaves(state.policy), jax.tree.leaves(expected.policy),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    for key in ("policy/loss", "policy/grad_norm", "policy/logp_mismatch"):
        np.testing.assert_allclose(metrics[key], expected_metrics[key], rtol=1e-4, atol=1e-5)
    # The state leaves the step in the shardings it entered with: a second step (and a state
    # placed after a restore) reuse the first step's program instead of compiling another.
    state, _ = sharded.step(state, batch)
    state, _ = sharded.step(sharded.place(jax.device_get(state)), batch)
    assert sharded._jitted_step(True)._cache_size() == 1
    # Ahead-of-time compiled programs run in place of the jit and give the same numbers.
    rows, length = batch.tokens.shape
    # The step compiled this shape through its jit: precompiling skips it until forgotten.
    assert sharded.precompile(state, [batch_shapes(rows, length)], phases=(True,)) == 0
    sharded._compiled.clear()
    assert sharded.precompile(state, [batch_shapes(rows, length)], phases=(True,)) == 1
    host = jax.device_get(state)
    aot_state, aot_metrics = sharded.step(sharded.place(host), batch)
    assert sharded._jitted_step(True)._cache_size() == 1  # not traced again
    sharded._compiled.clear()
    jit_state, jit_metrics = sharded.step(sharded.place(host), batch)
    for a, b in zip(jax.tree.leaves(aot_state), jax.tree.leaves(jit_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(aot_metrics["policy/loss"]) == float(jit_metrics["policy/loss"])


def test_critic_warmup_and_value_pretraining_decide_when_the_policy_trains():
    from experiments import toy
    from sao_jax.train.build import algorithm_of
    from sao_jax.train.loop import policy_updates

    config = toy.get_config()
    config.rl.critic_warmup_steps = 3
    meta = {"policy_from_step": None}
    assert [policy_updates(config, ALGORITHMS["sao"], meta, s) for s in range(1, 6)] == [
        False, False, False, True, True]
    assert meta["policy_from_step"] == 4
    assert policy_updates(config, ALGORITHMS["grpo_dis"], {"policy_from_step": None}, 1)
    config.rl.value_pretraining = True  # on for sao too (vapo's own choice)
    config.rl.value_pretraining_max_steps = 5
    sao = algorithm_of(config)
    meta = {"policy_from_step": None}
    flags = [policy_updates(config, sao, meta, s) for s in range(1, 7)]
    assert flags == [False] * 6  # explained variance still rising: keep fitting the critic
    meta["value_pretraining"] = {"best": 0.5, "since_best": config.rl.value_pretraining_patience}
    assert policy_updates(config, sao, meta, 7)
    meta = {"policy_from_step": None}
    assert [policy_updates(config, sao, meta, s)
            for s in range(1, 11)].index(True) == 8  # step 9: past warm-up + 5 steps at most
    config.rl.value_pretraining = None
    config.algo = "vapo"
    meta = {"policy_from_step": None}
    assert not any(policy_updates(config, algorithm_of(config), meta, s) for s in range(1, 7))


def test_three_skipped_steps_in_a_row_stop_the_run():
    from sao_jax.train.console import SkipGuard, TrainingError

    lines = []
    guard = SkipGuard(lines.append)
    for step, skipped in enumerate([True, True, False, True, True], start=1):
        guard.record(step, skipped)
    assert len(lines) == 4 and "2 in a row" in lines[-1]
    with pytest.raises(TrainingError, match="3 steps in a row"):
        guard.record(6, True)


def test_bucketed_lengths_pad_long_rows_by_at_most_a_step():
    """Short rows bucket to powers of two and 1.5 times one; past 65,536 tokens, to multiples
    of 16,384, so a 128k-token agent row (plus its next token) pads to 147,456, not 196,608."""
    assert [bucket_length(n) for n in (1, 33, 192, 193, 65_536)] == [32, 64, 192, 256, 65_536]
    assert [bucket_length(n) for n in (65_537, 98_304, 131_073)] == [81_920, 98_304, 147_456]
    lengths = batch_lengths(131_072)
    assert lengths == sorted(set(lengths)) and lengths[-1] == 147_456
    for n in range(1, 300_000, 997):
        b = bucket_length(n)
        assert b >= n and (b - n < 16_384 if n > 65_536 else b <= 2 * n + 32)
        assert bucket_length(b) == b  # a bucket is its own bucket: one shape per bucket


def test_vapo_adds_the_positive_example_lm_loss_and_logs_the_entropy():
    """vapo's step logs its LM loss (the successful rows' NLL under the old policy, before the
    first mini-batch's update it is exactly that) and the policy's entropy; without the LM loss
    the same step lands elsewhere."""
    batch = make_batch(synthetic_trajectories(group_size=8))
    trainer = trainer_for("vapo")
    state = trainer.init_state()
    logp, entropy, _ = trainer.passes.policy_pass(state.policy, jnp.asarray(batch.tokens),
                                                  entropy=True)
    new, metrics = trainer.step(state, batch)
    m = jnp.asarray(batch.action_mask)
    outcome = jnp.asarray(batch.rewards).sum(axis=1)
    assert float(metrics["skipped"]) == 0.0
    np.testing.assert_allclose(metrics["policy/entropy"], rl.masked_mean(entropy, m), rtol=1e-5)
    whole = float(rl.positive_example_lm_loss(logp, m, outcome))
    assert 0 < float(metrics["policy/lm_loss"]) < 2 * whole  # mini-batch means, moving params
    plain = trainer_for("vapo", algorithm=get_algorithm("vapo", lm_coef=0.0))
    other, metrics = plain.step(plain.init_state(), batch)
    assert "policy/lm_loss" not in metrics
    assert any(not np.allclose(a, b) for a, b in zip(flat(new.policy).values(),
                                                     flat(other.policy).values(), strict=True))


def test_vapo_as_its_paper_defines_it_scaled_to_the_tasks_lengths():
    """The row's alpha (0.05, set for ~2000-token responses) is scaled to `rl.response_tokens`
    (the calculator tasks: 20, so alpha 5.0 and lambda 0.99 at 20 tokens); an explicit
    `rl.lam_alpha` wins; the critic learns at the experiment's critic rate (the paper's ratio,
    2x the policy's, on request); value pretraining and the LM loss are on; SAO keeps its alpha
    whatever the lengths."""
    from experiments import chain
    from sao_jax.train.build import algorithm_of, critic_learning_rate

    config = chain.get_config()
    config.algo = "vapo"
    algo = algorithm_of(config)
    assert algo.lam_alpha == pytest.approx(5.0) and algo.group_size == 8
    assert algo.value_pretraining and algo.lm_coef == 0.1
    lam = rl.length_adaptive_lambda(jnp.ones((1, 20), bool), algo.lam_alpha)
    np.testing.assert_allclose(lam, [0.99], rtol=1e-6)
    assert critic_learning_rate(config) == config.optim.critic.learning_rate == 3e-3
    config.rl.lam_alpha = 0.05
    config.rl.critic_lr_ratio = 2.0
    assert algorithm_of(config).lam_alpha == 0.05
    assert critic_learning_rate(config) == pytest.approx(2 * config.optim.policy.learning_rate)
    config.algo = "sao"
    config.rl.lam_alpha = config.rl.critic_lr_ratio = None
    assert algorithm_of(config).lam_alpha == 1.5 and not algorithm_of(config).value_pretraining
    assert critic_learning_rate(config) == config.optim.critic.learning_rate
    config.rl.response_tokens = 0
    with pytest.raises(ValueError, match="rl.response_tokens"):
        algorithm_of(config)


def test_the_running_mean_slot_is_the_rows_index_carried_as_prompt_index():
    """A prompt's slot is its row's `index` (`train_prompts` gives every row one: its own, else its
    place), which leases and trajectories carry as `prompt_index`, whatever the prompt id looks
    like; a trajectory without one, or with one that no row has, is an error."""
    import types

    from sao_jax.train.build import train_prompts
    from sao_jax.train.loop import PromptSlots
    from tests.rollout.trajectories import make_trajectory

    task = types.SimpleNamespace(train_rows=[{"index": 7, "prompt_id": "django__django-1"},
                                             {"index": 3, "prompt_id": "12"}, {"prompt_id": "x"}])
    rows = train_prompts(task)
    assert [(r["prompt_id"], r["index"]) for r in rows] == [
        ("django__django-1", 7), ("12", 3), ("x", 2)]
    slots = PromptSlots(rows)
    assert [slots.index(make_trajectory(prompt_id="12", prompt_index=i)) for i in (7, 3, 2)] == [
        7, 3, 2]
    for index in (None, 5):
        with pytest.raises(ValueError, match=f"prompt_id '12'\\) has prompt_index {index}, "):
            slots.index(make_trajectory(prompt_id="12", prompt_index=index))


def test_programs_compile_each_key_once_between_the_precompiler_and_the_step():
    """The step waits for the program the precompiling thread is compiling, compiles the one it
    asked for first itself (the thread then skips it), and after a failed compile its own."""
    import threading

    from sao_jax.train.programs import Programs

    programs = Programs()
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait()
        return "program A"

    thread = threading.Thread(target=programs.compile, args=("a", slow))
    thread.start()
    started.wait()
    taken = []
    waiter = threading.Thread(target=lambda: taken.append(programs.take("a")))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waiting for the compile under way, not compiling its own
    release.set()
    thread.join()
    waiter.join()
    assert taken == ["program A"]
    assert programs.take("b") is None  # nobody compiles b: the step's to compile
    assert not programs.compile("b", lambda: pytest.fail("b was taken by the step"))
    assert not programs.compile("a", lambda: pytest.fail("a is compiled already"))

    def broken():
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        programs.compile("c", broken)
    assert programs.take("c") is None
    assert programs.failed[0] == "c"


def test_precompiling_skips_the_critic_only_programs_once_the_policy_updates():
    """The critic-only phase's programs first (a run's first steps), then the policy update's;
    a policy step retires the critic-only ones still to come, and compiles only its own."""
    from sao_jax.train.programs import Programs

    programs = Programs()
    assert programs.compile((False, "a"), lambda: "critic a")
    assert programs.take((True, "a")) is None  # a policy step on a: the step's own compile
    programs.retire(False)
    assert not programs.compile((False, "b"), lambda: pytest.fail("the critic phase is over"))
    assert programs.compile((True, "b"), lambda: "policy b")
    assert programs.take((False, "a")) == "critic a"  # compiled programs stay usable
    assert programs.report() == ("2 compiled ahead of time, 1 of them run; 1 compiled by the "
                                 "step itself")

    trainer = trainer_for.__wrapped__("sao")  # its own: the shared one's programs have a past
    state = trainer.init_state()
    compiled = []
    trainer.lower = lambda _state, spec, flag: SimpleNamespace(  # records the order, compiles
        compile=lambda: compiled.append((flag, spec.tokens[0][0])) or "program")
    specs = [batch_shapes(rows, 64) for rows in (8, 16)]
    assert trainer.precompile(state, specs, phases=(False, True)) == 4
    assert compiled == [(False, 8), (False, 16), (True, 8), (True, 16)]
    trainer._compiled.clear()
    trainer._compiled.retire(False)
    compiled.clear()
    assert trainer.precompile(state, specs, phases=(False, True)) == 2
    assert compiled == [(True, 8), (True, 16)]


def test_a_program_that_failed_to_precompile_stops_the_next_step():
    """Precompiling runs beside the loop: a shape whose program failed stops the run at its next
    step, naming the shape, as it stopped before the loop when the loop waited for them all."""
    trainer = trainer_for.__wrapped__("grpo_dis")  # its own: it leaves a failed program behind
    state = trainer.init_state()
    batch = make_batch(synthetic_trajectories(group_size=8))
    rows, length = batch.tokens.shape

    def lower(*_args, **_kwargs):
        raise MemoryError("out of device memory")

    trainer.lower = lower
    with pytest.raises(MemoryError):
        trainer.precompile(state, [batch_shapes(2 * rows, length)], phases=(True,))
    with pytest.raises(RuntimeError, match=r"did not compile ahead of time .*policy update.*"
                                           r"MemoryError: out of device memory"):
        trainer.step(state, batch)
