"""The learner's objects from the config: one builder each, shared by `train`,
`evaluate_checkpoint`, `make plan` and the benchmarks, so they cannot drift apart.

    config -> check_config -> algorithm_of / step_config_of -> make_trainer(config, policy, ...)
           -> mesh_shape, sharding_rules -> the mesh and the parameters' placement
           -> initial_policy / policy_skeleton -> the model, in training_layout
           -> step_shapes -> every batch shape the run can meet (precompiled, planned)
"""

from __future__ import annotations

import dataclasses
import math
import os

import grain
import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.engine import sglang_server
from sao_jax.envs import registry
from sao_jax.models import CausalLM, load_hf, reconfigure, stack_layers, unstack_layers
from sao_jax.models.config import ATTENTIONS, REMAT_POLICIES, ModelConfig, preset
from sao_jax.models.hf import read_config
from sao_jax.models.params import cast_floating
from sao_jax.train import sharding
from sao_jax.train.algorithms import Algorithm, get_algorithm
from sao_jax.train.batch import batch_lengths, batch_shapes, bucket_length, packed_row_counts
from sao_jax.train.engines import ENGINES, engine_of, reports_routes
from sao_jax.train.optimizers import OptimizerConfig
from sao_jax.train.processes import Children
from sao_jax.train.steps import StepConfig, Trainer
from sao_jax.train.tasks import Task
from sao_jax.train.warm_start import Recipe, default_cache_dir, task_teacher, warm_start


def algorithm_of(config) -> Algorithm:
    """`config.algo`'s row with the `rl.*` overrides that are set (None: the row's own). An
    alpha the row states for another response length (`Algorithm.lam_reference_tokens`) is
    scaled to `rl.response_tokens` when that is set: `alpha * reference / response_tokens`."""
    rl = config.rl
    algo = get_algorithm(config.algo, critic_steps=rl.critic_steps, group_size=rl.group_size,
                         lam_alpha=rl.lam_alpha, lm_coef=rl.lm_coef,
                         value_pretraining=rl.value_pretraining,
                         critic_lr_ratio=rl.critic_lr_ratio)
    if rl.response_tokens is not None and not rl.response_tokens > 0:
        raise ValueError(f"config.rl.response_tokens must be > 0 (a typical response's action "
                         f"tokens) or None, got {rl.response_tokens}.")
    if rl.lam_alpha is None and algo.lam_reference_tokens and rl.response_tokens:
        algo = dataclasses.replace(
            algo, lam_alpha=algo.lam_alpha * algo.lam_reference_tokens / rl.response_tokens,
            lam_reference_tokens=None)
    return algo


def step_config_of(config) -> StepConfig:
    rl = config.rl
    return StepConfig(
        algorithm=algorithm_of(config), gamma=rl.gamma, critic_lambda=rl.critic_lambda,
        eps_low=rl.eps_low, eps_high=rl.eps_high,
        dis_denominator=rl.dis_denominator, ppo_clip_low=rl.ppo_clip_low,
        ppo_clip_high=rl.ppo_clip_high, ppo_minibatches=rl.ppo_minibatches,
        whiten_advantages=rl.whiten_advantages, reuse_values=rl.reuse_values,
        value_clip=rl.value_clip, microbatches=rl.microbatches, gae_impl=rl.gae_impl,
        dis_impl=rl.dis_impl, bootstrap_truncated=rl.bootstrap_truncated,
        routing_replay=rl.get("routing_replay", False))


def optimizer_config_of(section, learning_rate: float | None = None) -> OptimizerConfig:
    fields = {k: section[k] for k in section}
    if learning_rate is not None:
        fields["learning_rate"] = learning_rate
    return OptimizerConfig(**fields)


def critic_learning_rate(config) -> float:
    """The critic's learning rate: `optim.critic.learning_rate`, or the policy's times the
    algorithm's `critic_lr_ratio` when it has one (`rl.critic_lr_ratio`)."""
    ratio = algorithm_of(config).critic_lr_ratio
    if ratio is None:
        return config.optim.critic.learning_rate
    return ratio * config.optim.policy.learning_rate


def check_config(config) -> None:
    """Cross-field checks that name the field to fix."""
    algo = algorithm_of(config)
    if config.batch_size % algo.group_size:
        raise ValueError(f"config.batch_size = {config.batch_size} must be a multiple of the "
                         f"group size {algo.group_size} of algo {algo.name!r}.")
    if config.mode not in ("async", "sync"):
        raise ValueError(f"config.mode must be 'async' or 'sync', got {config.mode!r}.")
    if config.total_steps < 1:
        raise ValueError(f"config.total_steps must be >= 1, got {config.total_steps}.")
    engine = engine_of(config)
    if config.rollout.engine_urls and not engine.takes_urls:
        takers = " or ".join(f"config.rollout.engine = {name!r}"
                             for name, kind in ENGINES.items() if kind.takes_urls)
        raise ValueError(f"config.rollout.engine_urls names servers, which only {takers} "
                         "uses: set it, or clear the URLs.")
    if config.rollout.sglang.device not in sglang_server.DEVICES:
        raise ValueError(f"config.rollout.sglang.device must be one of {sglang_server.DEVICES}, "
                         f"got {config.rollout.sglang.device!r}.")
    if engine.check_model is not None and config.model.preset and not config.model.path:
        engine.check_model(preset_config(config).to_hf())  # before a warm start
    if not (config.model.path or config.model.preset):
        raise ValueError("set config.model.path (a Hugging Face directory; it wins over the "
                         "preset) or config.model.preset (e.g. 'toy').")
    _check_dtypes(config)
    if config.model.remat not in REMAT_POLICIES:
        raise ValueError(f"config.model.remat = {config.model.remat!r}: use one of "
                         f"{REMAT_POLICIES}.")
    if config.model.attention not in ATTENTIONS:
        raise ValueError(f"config.model.attention = {config.model.attention!r}: use one of "
                         f"{ATTENTIONS}.")
    if config.model.remat != "none" and not config.model.scan_layers:
        raise ValueError(f"config.model.remat = {config.model.remat!r} needs "
                         "config.model.scan_layers = True (it wraps the scanned layer).")
    Children.check_priority(config.rollout.priority)
    sharding_rules(config)  # a bad rule stops the run here, before anything starts
    for field in ("max_staleness", "publish_every", "checkpoint_every"):
        if config[field] < (0 if field == "max_staleness" else 1):
            raise ValueError(f"config.{field} = {config[field]} is out of range.")
    lag = config.rollout.lag_versions
    if lag < 0:
        raise ValueError(f"config.rollout.lag_versions = {lag} must be >= 0 (0: the engines "
                         "serve the newest weights).")
    if lag * config.publish_every > config.max_staleness:
        raise ValueError(f"config.rollout.lag_versions = {lag} makes every rollout at least "
                         f"{lag * config.publish_every} policy versions old (x publish_every = "
                         f"{config.publish_every}), more than config.max_staleness = "
                         f"{config.max_staleness}, so all would be dropped: raise max_staleness "
                         f"(to {lag * config.publish_every + 4}, say, for async's own lag).")
    drain = config.rollout.update_drain_s
    if not 0 <= drain <= 60:
        raise ValueError(f"config.rollout.update_drain_s = {drain} must be seconds in [0, 60] "
                         "(0: a weight update cuts running requests at once).")
    if drain and not engine.drains:
        raise ValueError(f"config.rollout.update_drain_s = {drain}: {engine.title} have no "
                         "drain (it is the embedded engine's); set it to 0 with "
                         f"config.rollout.engine = {engine.name!r}.")
    if config.rollout.request_timeout_s < 0:
        raise ValueError(f"config.rollout.request_timeout_s = {config.rollout.request_timeout_s} "
                         "must be > 0 seconds, or 0 for the workers' default.")
    for field in ("lease_timeout_s", "weight_update_timeout_s"):
        if not config.rollout[field] > 0:
            raise ValueError(f"config.rollout.{field} = {config.rollout[field]} must be > 0 "
                             "seconds.")
    if config.rollout.max_restarts < 0:
        raise ValueError(f"config.rollout.max_restarts = {config.rollout.max_restarts} must be "
                         ">= 0 (0: a child that dies stops the run).")
    in_flight = config.rollout.max_in_flight
    if in_flight < 0:
        raise ValueError(f"config.rollout.max_in_flight = {in_flight} must be >= 0 (0: the "
                         "default).")
    if in_flight and in_flight < config.batch_size:
        raise ValueError(f"config.rollout.max_in_flight = {in_flight} is below "
                         f"config.batch_size = {config.batch_size}: no batch could ever gather. "
                         "Raise it, or set 0 for the default.")


def admission_limit(config) -> int | None:
    """Prompts the async learner keeps in flight: leased to a worker, or answered and waiting in
    its queue (`TrajectoryServer(max_in_flight=...)`); None in sync mode, which grants one batch
    at a time.

    `rollout.max_in_flight`, or by default one per rollout slot (`num_workers *
    worker_concurrency`) plus one batch waiting for the learner, capped at
    `max(1, max_staleness) * batch_size`. So rollouts run at full concurrency while the learner
    keeps up, and when it does not, they pause rather than queue results that only grow stale:
    every queued batch adds a version of lag, and the long episodes, which lag most already,
    are the ones pushed past `max_staleness` and dropped.
    """
    if config.mode != "async":
        return None
    if config.rollout.max_in_flight:
        return config.rollout.max_in_flight
    slots = config.rollout.num_workers * config.rollout.worker_concurrency
    return min(max(1, config.max_staleness) * config.batch_size, slots + config.batch_size)


def mesh_shape(config, devices: int) -> dict[str, int]:
    """`config.mesh` for `devices` devices, `data` = 0 filled in with what the other axes
    leave.

    Raises:
      ValueError: the axes do not divide, or do not multiply to, the device count."""
    shape = {axis: int(config.mesh.get(axis, 1)) for axis in sharding.MESH_AXES}
    others = math.prod(v for k, v in shape.items() if k != "data")
    if shape["data"] == 0 and devices % others == 0:
        return {**shape, "data": devices // others}
    if math.prod(shape.values()) == devices:
        return shape
    rest = others // shape["fsdp"] * max(shape["data"], 1)  # every axis but fsdp
    fix = (f"e.g. --config.mesh.fsdp={devices // rest}" if devices % rest == 0
           else "other axis sizes")
    spans = (f"fsdp x expert x tensor = {others} does not divide the {devices} devices"
             if shape["data"] == 0 else
             f"its axes span {math.prod(shape.values())} devices, not the {devices} there are")
    raise ValueError(f"config.mesh = {shape}: {spans}: set {fix}, or config.mesh.data=0 (the "
                     "devices the other axes leave).")


def sharding_rules(config) -> tuple:
    """The logical-to-mesh axis rules of `config.mesh.rules` (one field per logical axis of
    `sharding.DEFAULT_RULES`, its defaults: a tuple of mesh axes, () to replicate), checked by
    `sharding.rules_from_config`."""
    return sharding.rules_from_config(config.mesh.rules, field="config.mesh.rules")


def make_trainer(config, policy: CausalLM, num_train_prompts: int, *, mesh=None,
                 rules=None) -> Trainer:
    """The learner step of `config` for `policy` (in its training layout): what `train`,
    `evaluate_checkpoint` and `make plan` all build. `num_train_prompts` sizes the running-mean
    baseline (one window of `rl.baseline_window` rewards per prompt, or with `rl.global_baseline`
    one of `rl.global_baseline_window` over all prompts)."""
    return Trainer(policy, step_config_of(config),
                   policy_optimizer=optimizer_config_of(config.optim.policy),
                   critic_optimizer=optimizer_config_of(config.optim.critic,
                                                        critic_learning_rate(config)),
                   num_prompts=1 if config.rl.global_baseline else num_train_prompts,
                   baseline_window=config.rl.global_baseline_window if config.rl.global_baseline
                   else config.rl.baseline_window,
                   mesh=mesh, rules=rules, compute_dtype=jnp.dtype(config.model.dtype))


DTYPES = ("float32", "bfloat16", "float16")  # of config.model.dtype and master_dtype


def master_dtype(config) -> jnp.dtype:
    """The dtype the learner keeps the policy and the critic in, and updates them in
    (`config.model.master_dtype`); its passes compute in `config.model.dtype`, cast from it."""
    return jnp.dtype(config.model.master_dtype)


def _check_dtypes(config) -> None:
    m = config.model
    for field in ("dtype", "master_dtype"):
        if m[field] not in DTYPES:
            raise ValueError(f"config.model.{field} = {m[field]!r}: use one of {DTYPES}.")
    if jnp.dtype(m.master_dtype).itemsize < jnp.dtype(m.dtype).itemsize:
        raise ValueError(f"config.model.master_dtype = {m.master_dtype!r} is narrower than "
                         f"config.model.dtype = {m.dtype!r}, the dtype the learner computes in: "
                         "set master_dtype to float32 (or to dtype).")


def training_layout(config, model: CausalLM) -> CausalLM:
    """`model` in the layer layout the learner trains (`config.model.scan_layers`, `remat`)
    and with its attention (`config.model.attention`, `attention_block`) and MoE token chunks
    (`config.model.moe_token_chunk`)."""
    model = (stack_layers(model, config.model.remat) if config.model.scan_layers
             else unstack_layers(model))
    return reconfigure(model, model.cfg.replace(
        attention=config.model.attention, attention_block=config.model.attention_block,
        moe_token_chunk=config.model.moe_token_chunk))


def placed_policy(config, task: Task, log, mesh, rules, *, built=lambda: None
                  ) -> tuple[CausalLM, dict]:
    """`initial_policy` in the learner's layout (`training_layout`), placed on `mesh`;
    `built()` runs between building it and placing it (placing is collective across processes;
    building, a warm start say, is not). A Hugging Face checkpoint is read straight into that
    layout and sharding, each process reading only its shards (`load_hf(like=...)`): no host
    holds the whole model. In `master_dtype`, as the learner keeps it."""
    if not config.model.path:
        policy, info = initial_policy(config, task, log)
        built()
        return sharding.shard_model(training_layout(config, policy), mesh, rules), info
    built()
    _check_model_path(config)
    m = config.model
    layout = dict(moe_dispatch=m.moe_dispatch, logprob_dispatch=m.logprob_dispatch,
                  scan_layers=m.scan_layers, remat=m.remat if m.scan_layers else "none",
                  attention=m.attention, attention_block=m.attention_block,
                  moe_token_chunk=m.moe_token_chunk)
    dtype = master_dtype(config)
    cfg = read_config(m.path, param_dtype=dtype.name, **layout)
    like = sharding.abstract_model(lambda: CausalLM(cfg, nnx.Rngs(0)), mesh, rules)
    return load_hf(m.path, dtype, like=like, **layout), {}


def _check_model_path(config) -> None:
    if not os.path.exists(os.path.join(config.model.path, "config.json")):
        raise ValueError(f"config.model.path = {config.model.path!r} has no config.json: "
                         "give a local Hugging Face model directory.")


def preset_config(config, **layout) -> ModelConfig:
    """`config.model.preset`'s architecture, `config.model.num_layers` deep when that is set."""
    if config.model.num_layers < 0:
        raise ValueError(f"config.model.num_layers = {config.model.num_layers} must be >= 0 "
                         "(0: the preset's own depth).")
    if config.model.num_layers:
        layout["num_layers"] = config.model.num_layers
    return preset(config.model.preset, **layout)


def initial_policy(config, task: Task, log) -> tuple[CausalLM, dict]:
    """The policy RL starts from, its parameters in the learner's `master_dtype`: a HF
    checkpoint, a (cached) warm start, or a fresh preset (in the layout the engines use;
    `training_layout` gives the learner's). A warm start trains in float32 whatever the run's
    dtypes (its cache is shared by runs of any), and the run casts it, as `load_hf` casts a
    checkpoint."""
    dtype = master_dtype(config)
    dispatch = dict(moe_dispatch=config.model.moe_dispatch,
                    logprob_dispatch=config.model.logprob_dispatch)
    if config.model.path:
        _check_model_path(config)
        return load_hf(config.model.path, dtype, **dispatch), {}
    cfg = preset_config(config, **dispatch)
    ws = config.warm_start
    if not ws.enabled:
        return in_dtype(CausalLM(cfg, nnx.Rngs(config.seed)), dtype), {}
    if task.spec.teacher is None:
        raise ValueError(f"config.warm_start.enabled needs a task with a teacher "
                         f"{registry.with_teacher()}, not {task.env!r}; use config.model.path "
                         "instead.")
    recipe = Recipe(seed=ws.seed, max_steps=ws.max_steps, batch=ws.batch,
                    learning_rate=ws.learning_rate, eval_every=ws.eval_every,
                    patience=ws.patience, min_delta=ws.min_delta, held_out=ws.held_out,
                    sample=ws.sample)
    policy, info = warm_start(cfg, task_teacher(task, config, log=log), recipe,
                              cache_dir=ws.cache_dir or default_cache_dir(), log=log)
    return in_dtype(policy, dtype), info


def in_dtype(policy: CausalLM, dtype) -> CausalLM:
    """`policy` with its floating-point parameters cast to `dtype` (its config's `param_dtype`
    with them); `policy` itself when they are in it already."""
    dtype = jnp.dtype(dtype)
    if jnp.dtype(policy.cfg.param_dtype) == dtype:
        return policy
    cfg = policy.cfg.replace(param_dtype=dtype.name)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, nnx.Rngs(0))))
    return nnx.merge(graphdef, cast_floating(nnx.state(policy), dtype))


def train_prompts(task: Task) -> list[dict]:
    """The training rows as the stream leases them: each with its `"index"` (the running-mean
    baseline's slot, which leases carry as `prompt_index`): its own, or its place in
    `task.train_rows` if it has none."""
    return [{**row, "index": int(row.get("index", i))} for i, row in enumerate(task.train_rows)]


def prompt_dataset(task: Task, seed: int):
    """The training prompts (`train_prompts`), shuffled once per epoch, endless; checkpointable
    (grain)."""
    return (grain.MapDataset.source(train_prompts(task)).shuffle(seed=seed).repeat()
            .to_iter_dataset())


def policy_skeleton(config) -> CausalLM:
    """The configured policy's structure in the training layout, abstract (shapes and dtypes,
    no weights read or made: a checkpoint's replace them), in `master_dtype`:
    `config.model.path`'s config.json, or the preset."""
    dispatch = dict(moe_dispatch=config.model.moe_dispatch,
                    logprob_dispatch=config.model.logprob_dispatch,
                    param_dtype=master_dtype(config).name)
    if config.model.path:
        cfg = read_config(config.model.path, **dispatch)
    else:
        cfg = preset_config(config, **dispatch)
    return nnx.eval_shape(lambda: training_layout(config, CausalLM(cfg, nnx.Rngs(0))))


def route_shape(config, cfg: ModelConfig) -> tuple[int, int] | None:
    """`(layers, top_k)` of the experts each token of a trajectory carries
    (`reports_routes`), or None without them."""
    if not reports_routes(config):
        return None
    if not any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        field = "routing_replay" if config.rl.get("routing_replay", False) else "engine_routes"
        raise ValueError(f"config.rl.{field} asks the engines for their expert choices, but "
                         f"the model ({config.model.preset or config.model.path}) has no "
                         "experts: turn it off, or train a model with experts.")
    return cfg.num_layers, cfg.num_experts_per_tok


def pack_length(config, trainer: Trainer) -> int | None:
    """The model-row length batches are packed to (`batch.pack`), or None: unpacked, either by
    `config.pack_rows` or because the step cannot take packed rows (`Trainer.packs`)."""
    if not (config.pack_rows and trainer.packs):
        return None
    return bucket_length(config.rollout.engine_max_seq_len + 1)


def step_shapes(config, trainer: Trainer) -> list:
    """`batch_shapes` of every batch the run can make: one per packed row count, or one per
    bucketed length up to `rollout.engine_max_seq_len`."""
    length = pack_length(config, trainer)
    routes = route_shape(config, trainer.cfg)
    if length is not None:
        return [batch_shapes(config.batch_size, length, rows, routes=routes)
                for rows in packed_row_counts(config.batch_size, trainer.row_multiple)]
    return [batch_shapes(config.batch_size, n, routes=routes)
            for n in batch_lengths(config.rollout.engine_max_seq_len)]


def compilation_cache_dir(config) -> str | None:
    """Where compiled programs are kept (`config.compilation_cache`): the learner's and its
    embedded engines', which then skip most of their start-up compiles. None: off."""
    if not config.compilation_cache:
        return None
    return os.path.join(config.warm_start.cache_dir or default_cache_dir(), "jax")


def setup_compilation_cache(config) -> None:
    """Turns on JAX's persistent compilation cache at `compilation_cache_dir` (the entry point
    calls it once, before anything compiles)."""
    if (path := compilation_cache_dir(config)) is not None:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
