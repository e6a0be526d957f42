"""The SAO learner end to end: `train(config, workdir)` is what `make train` runs.

    prompts (grain, in the stream log) ──lease──▶ worker(s) ──HTTP──▶ engine(s)
          ▲                                          │ trajectories (gRPC, fsynced log)
          │                                          ▼
      learner: take batch (whole groups, drop stale) ─▶ jitted step ─▶ publish v+1 ─▶ checkpoint

Asynchronous mode trains on single rollouts as they arrive; admission keeps a bounded number of
prompts in flight (leased or queued; `admission_limit`: by default every rollout slot busy and
one batch waiting, at most `max(1, max_staleness) * batch_size`), so a trajectory usually lags
fewer than `max_staleness` versions behind, and one more than `max_staleness` versions old (a
straggler) is dropped and its prompt issued again; new weights are written and loaded on a
background thread while the next step runs. Synchronous mode grants exactly one batch of
prompts, waits for all of it, trains, publishes, and grants the next: the baseline the async
benchmark compares against.

Restarts: the orbax checkpoint (`checkpoint.py`) holds the train state and the ids of every
consumed trajectory; the stream's log holds every accepted trajectory and the prompt iterator. A
re-run with the same workdir restores the checkpoint, marks its trajectories consumed, and the log
replays the rest in arrival order: the same data order, the step count continued, no trajectory
used twice. Log events after the checkpointed step are purged (tensorboardX `purge_step`), and
`steps.jsonl` (the trajectory ids of every step) is cut back to it. Ctrl-C or SIGTERM stops the
run at the next safe point (`StopRequests`), and the children with it.

Faults (README, "Faults and the soak test"): an engine or worker that dies is restarted
(`Supervisor`: an embedded engine on its port, from the newest published weights; a worker's
leases come back after `rollout.lease_timeout_s`), at most `rollout.max_restarts` times each; an
engine that cannot be reached misses weight updates without failing them and catches up when it
answers (`Publisher`); a checkpoint that fills the disk stops the run at the previous, intact
checkpoint, and the same command resumes from it (`checkpoint.DiskFullError`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models import (
    CausalLM,
    load_hf,
    reconfigure,
    save_hf,
    stack_layers,
    unstack_layers,
)
from sao_jax.models.config import ATTENTIONS, REMAT_POLICIES, preset
from sao_jax.rollout.client import EngineUnavailableError, SGLangClient
from sao_jax.rollout.stream import TrajectoryServer, lease_group
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train import sharding
from sao_jax.train.algorithms import Algorithm, get_algorithm
from sao_jax.train.batch import (
    batch_lengths,
    batch_shapes,
    bucket_length,
    make_batch,
    packed_row_counts,
)
from sao_jax.train.checkpoint import Checkpointer, DiskFullError
from sao_jax.train.evaluate import evaluate
from sao_jax.train.events import EventWriter
from sao_jax.train.optimizers import OptimizerConfig
from sao_jax.train.processes import (
    ChildExited,
    Children,
    engine_argv,
    free_port,
    port_is_free,
    reap_previous,
    worker_command,
)
from sao_jax.train.steps import StepConfig, Trainer, TrainState
from sao_jax.train.tasks import Task, make_task
from sao_jax.train.warm_start import (
    TEACHER_TASKS,
    default_cache_dir,
    swe_teacher,
    warm_start,
)

MAX_SKIPPED_IN_A_ROW = 3
KEEP_WEIGHT_VERSIONS = 2


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite steps in a row, the disk full, an engine refusing the
    weights, ...)."""


# ---------------------------------------------------------------------------------------------
# Building blocks from the config.


def algorithm_of(config) -> Algorithm:
    return get_algorithm(config.algo, critic_steps=config.rl.critic_steps,
                         group_size=config.rl.group_size, lam_alpha=config.rl.lam_alpha)


def step_config_of(config) -> StepConfig:
    rl = config.rl
    return StepConfig(
        algorithm=algorithm_of(config), gamma=rl.gamma, eps_low=rl.eps_low, eps_high=rl.eps_high,
        dis_denominator=rl.dis_denominator, ppo_clip_low=rl.ppo_clip_low,
        ppo_clip_high=rl.ppo_clip_high, ppo_minibatches=rl.ppo_minibatches,
        whiten_advantages=rl.whiten_advantages, reuse_values=rl.reuse_values,
        value_clip=rl.value_clip, microbatches=rl.microbatches, gae_impl=rl.gae_impl,
        dis_impl=rl.dis_impl)


def optimizer_config_of(section) -> OptimizerConfig:
    return OptimizerConfig(**{k: section[k] for k in section})


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
    if config.rollout.engine not in ("embedded", "sglang"):
        raise ValueError(f"config.rollout.engine must be 'embedded' or 'sglang', got "
                         f"{config.rollout.engine!r}.")
    if config.rollout.engine == "sglang" and not config.rollout.engine_urls:
        raise ValueError("config.rollout.engine = 'sglang' needs config.rollout.engine_urls "
                         "(comma-separated base URLs of running SGLang servers).")
    if not (config.model.path or config.model.preset):
        raise ValueError("set config.model.path (a Hugging Face directory; it wins over the "
                         "preset) or config.model.preset (e.g. 'toy').")
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
    for field in ("max_staleness", "publish_every", "checkpoint_every"):
        if config[field] < (0 if field == "max_staleness" else 1):
            raise ValueError(f"config.{field} = {config[field]} is out of range.")
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


def make_trainer(config, policy: CausalLM, num_train_prompts: int, *, mesh=None,
                 rules=None) -> Trainer:
    """The learner step of `config` for `policy` (in its training layout): what `train`,
    `evaluate_checkpoint` and `make plan` all build. `num_train_prompts` sizes the running-mean
    baseline (one window per prompt, or one of 128 with `rl.global_baseline`)."""
    return Trainer(policy, step_config_of(config),
                   policy_optimizer=optimizer_config_of(config.optim.policy),
                   critic_optimizer=optimizer_config_of(config.optim.critic),
                   num_prompts=1 if config.rl.global_baseline else num_train_prompts,
                   baseline_window=128 if config.rl.global_baseline
                   else config.rl.baseline_window,
                   mesh=mesh, rules=rules)


def training_layout(config, model: CausalLM) -> CausalLM:
    """`model` in the layer layout the learner trains (`config.model.scan_layers`, `remat`)
    and with its attention (`config.model.attention`, `attention_block`)."""
    model = (stack_layers(model, config.model.remat) if config.model.scan_layers
             else unstack_layers(model))
    return reconfigure(model, model.cfg.replace(attention=config.model.attention,
                                                attention_block=config.model.attention_block))


def initial_policy(config, task: Task, log) -> tuple[CausalLM, dict]:
    """The policy RL starts from: a HF checkpoint, a (cached) warm start, or a fresh preset
    (in the layout the engines use; `training_layout` gives the learner's)."""
    dtype = jnp.dtype(config.model.dtype)
    dispatch = dict(moe_dispatch=config.model.moe_dispatch,
                    logprob_dispatch=config.model.logprob_dispatch)
    if config.model.path:
        if not os.path.exists(os.path.join(config.model.path, "config.json")):
            raise ValueError(f"config.model.path = {config.model.path!r} has no config.json: "
                             "give a local Hugging Face model directory.")
        return load_hf(config.model.path, dtype, **dispatch), {}
    cfg = preset(config.model.preset, **dispatch)
    ws = config.warm_start
    if not ws.enabled:
        return CausalLM(cfg, nnx.Rngs(config.seed)), {}
    if task.env not in TEACHER_TASKS:
        raise ValueError(f"config.warm_start.enabled needs a task with a teacher "
                         f"{TEACHER_TASKS}, not {task.env!r}; use config.model.path instead.")
    teacher = None
    if task.env == "swe":
        teacher = swe_teacher(task.train_rows, task.eval_rows, task.tokenizer, task.env_options,
                              max_turns=config.env.max_turns, log=log)
    model, info = warm_start(
        cfg, task=task.env, max_steps=ws.max_steps, batch=ws.batch, learning_rate=ws.learning_rate,
        seed=config.seed, guess_rate=ws.guess_rate, eval_every=ws.eval_every,
        patience=ws.patience, min_delta=ws.min_delta,
        cache_dir=ws.cache_dir or default_cache_dir(), log=log, teacher=teacher)
    return model, info


def prompt_dataset(task: Task, seed: int):
    """The training prompts, shuffled once per epoch, endless; checkpointable (grain)."""
    return (grain.MapDataset.source(list(task.train_rows)).shuffle(seed=seed).repeat()
            .to_iter_dataset())


# ---------------------------------------------------------------------------------------------
# Batches.


SWE_METRICS = ("resolved", "submitted", "format_errors", "timeouts", "turns")


def swe_metrics(batch: Sequence[Trajectory]) -> dict[str, float]:
    """`swe/<name>`: the batch mean of each SWE episode fact (`envs.swe.env` writes them into the
    trajectory's metadata; a missing one counts 0)."""
    return {f"swe/{name}": float(np.mean([float(t.env_metadata.get(name, 0)) for t in batch]))
            for name in SWE_METRICS}


def policy_lag(trajectory: Trajectory, version: int) -> int:
    """Policy versions between the trajectory's oldest action token and `version`."""
    versions = trajectory.weight_versions[trajectory.action_mask]
    return int(version - versions.min()) if versions.size else 0


class BatchCollector:
    """Takes trajectories in arrival order and forms batches of whole groups of fresh ones.

    Trajectories of incomplete groups wait here (they are not consumed, so a restart queues them
    again). A trajectory more than `max_staleness` versions old is discarded and its prompt is
    issued again (in the same group).
    """

    def __init__(self, server: TrajectoryServer, batch_size: int, group_size: int,
                 max_staleness: int):
        self.server = server
        self.batch_size, self.group_size = batch_size, group_size
        self.max_staleness = max_staleness
        self.groups: dict[str, list[Trajectory]] = collections.OrderedDict()
        self.complete: list[list[Trajectory]] = []
        self.stale = 0

    def collect(self, version: int, poll) -> tuple[list[Trajectory], float]:
        """`(batch, seconds waited)`; `poll()` runs while it waits, and aborts it by raising."""
        waited = 0.0
        need = self.batch_size // self.group_size
        while len(self.complete) < need:
            poll()
            missing = (need - len(self.complete)) * self.group_size - sum(
                len(g) for g in self.groups.values())
            take = max(1, min(missing, self.batch_size)) if self.group_size == 1 else 1
            start = time.monotonic()
            got = self.server.get_batch(take, timeout=0.5 if take > 1 else 0.2)
            waited += time.monotonic() - start
            stale = [t for t in got if policy_lag(t, version) > self.max_staleness]
            if stale:
                self.server.discard([t.trajectory_id for t in stale])
                self.stale += len(stale)
            for t in got:
                if t in stale:
                    continue
                group = self.groups.setdefault(lease_group(t.lease_id) or t.trajectory_id, [])
                group.append(t)
                if len(group) == self.group_size:
                    self.complete.append(self.groups.pop(lease_group(t.lease_id)
                                                         or t.trajectory_id))
        batch = [t for group in self.complete[:need] for t in group]
        self.complete = self.complete[need:]
        return batch, waited

    def held(self) -> int:
        """Trajectories taken from the server and not yet in a batch."""
        return sum(map(len, self.groups.values())) + sum(map(len, self.complete))


def grant_one_batch(server: TrajectoryServer, collector: BatchCollector) -> int:
    """Sync mode: grants prompts until one batch is on its way (granted, leased, queued or
    collected), also after a prompt is given up mid-step; returns how many it granted."""
    missing = collector.batch_size - collector.held() - server.unanswered()
    if missing > 0:
        server.grant_leases(missing)
    return max(0, missing)


# ---------------------------------------------------------------------------------------------
# Weights to the engines.


class Publisher:
    """Writes the policy as `<workdir>/weights/v<N>/` and loads it on every engine.

    `publish` does both before it returns (sync mode, the final weights). `submit` hands a copy of
    the parameters to a background thread and returns at once, so the learner's next step runs
    while the weights are written and the engines reload (async mode); when updates come faster
    than the engines take them, only the newest waiting one is published. `check` re-raises a
    failed background publish; `wait` blocks until every submitted version is handled.

    An engine that cannot be reached (connection refused or reset, or no answer within
    `update_timeout_s`: dead, restarting, frozen) does not fail a publish: it is left `behind`,
    with a warning, and the version counts as published (`version`) once written. Behind engines
    get the newest version with every later publish and, in async mode, from the background
    thread every `CATCH_UP_S` seconds (`catch_up`); an embedded engine that died is restarted
    with the newest version by the `Supervisor` (`suspend`, `pinned`, `resume`). An engine that
    answers but refuses the weights fails the publish (`TrainingError`): that is no outage.
    """

    CATCH_UP_S = 5.0

    def __init__(self, workdir: str, urls: list[str], *, update_timeout_s: float = 600.0,
                 log=print):
        self.root = os.path.join(workdir, "weights")
        os.makedirs(self.root, exist_ok=True)
        self.urls = urls
        self.update_timeout_s = update_timeout_s
        self.log = log
        self.version: int | None = None
        self.behind: set[str] = set()  # engines that missed `version`
        self._suspended: set[str] = set()  # engines being restarted: not sent anything
        self._pins: collections.Counter[int] = collections.Counter()  # versions kept on disk
        # One weight change at a time: publishes, catch-ups and a restarted engine's first sync.
        self.lock = threading.RLock()
        self._pending: tuple | None = None  # (trainer, policy params, version array, every)
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._updating: tuple | None = None  # (loop, task) of the engine updates under way
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def path(self, version: int) -> str:
        return os.path.join(self.root, f"v{version}")

    def write(self, model: CausalLM, version: int) -> str:
        path = self.path(version)
        if not os.path.exists(os.path.join(path, "config.json")):
            tmp = f"{path}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            save_hf(model, tmp)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        return path

    def publish(self, model: CausalLM, version: int) -> None:
        self.wait()
        self._publish(model, version)

    def _publish(self, model: CausalLM, version: int) -> None:
        with self.lock:
            self.write(model, version)
            targets = [u for u in self.urls if u not in self._suspended]
            missed = self._update(targets, version)
            back = self.behind & set(targets) - missed
            self.version = version
            self.behind = missed | (set(self.urls) - set(targets))
            self._say_back(back)
            for name in os.listdir(self.root):  # keep the newest few, and the pinned ones
                if name.startswith("v") and name[1:].isdigit():
                    v = int(name[1:])
                    if v <= version - KEEP_WEIGHT_VERSIONS and not self._pins[v]:
                        shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def _update(self, urls: Sequence[str], version: int) -> set[str]:
        """Loads `weights/v<version>` on `urls`; returns those that could not be reached (and
        warns); raises `WeightUpdateError` if one refused the weights."""
        path = os.path.abspath(self.path(version))

        async def one(url):
            async with SGLangClient([url], max_retries=3) as client:
                try:
                    await asyncio.wait_for(client.update_weights_from_disk(path, str(version)),
                                           self.update_timeout_s)
                except Exception as e:
                    if not _unreachable(e):
                        raise
                    return url, f"{type(e).__name__}: {e}".strip(": ")
            return url, None

        async def each():
            with self._cond:
                if self._closed:
                    return [(url, "the run is stopping") for url in urls]
                self._updating = (asyncio.get_running_loop(), asyncio.current_task())
            try:
                return await asyncio.gather(*map(one, urls))
            except asyncio.CancelledError:  # close(): the engines are being stopped
                return [(url, "the run is stopping") for url in urls]
            finally:
                with self._cond:
                    self._updating = None
                    self._cond.notify_all()

        missed = {url: why for url, why in (asyncio.run(each()) if urls else []) if why}
        for url, why in missed.items():
            if url not in self.behind and not self._closed:
                self.log(f"\nwarning: weights v{version} not loaded on {url}, which cannot be "
                         f"reached ({why[:200]}); it gets the newest weights once it answers")
        return set(missed)

    def catch_up(self) -> None:
        """Sends the newest version to the engines left behind that answer again."""
        with self.lock:
            targets = sorted(self.behind - self._suspended)
            if self.version is None or not targets:
                return
            caught = set(targets) - self._update(targets, self.version)
            self.behind -= caught
            self._say_back(caught)

    def _say_back(self, urls) -> None:
        if not self._closed:
            for url in sorted(urls):
                self.log(f"\n{url} is back: it loaded weights v{self.version}")

    def suspend(self, url: str) -> None:
        """Sends `url` nothing until `resume` (its engine is being restarted)."""
        with self.lock:
            self._suspended.add(url)
            self.behind.add(url)

    @contextlib.contextmanager
    def pinned(self):
        """`(path, version)` of the newest weights, kept on disk while the block runs."""
        with self.lock:
            version = self.version
            self._pins[version] += 1
        try:
            yield self.path(version), version
        finally:
            with self.lock:
                self._pins[version] -= 1

    def resume(self, url: str, version: int, new_url: str | None = None) -> int:
        """`url`'s engine is up again (at `new_url` if it moved) with `version` loaded: it gets
        the newest version if one was published meanwhile. Returns the version it holds."""
        with self.lock:
            self._suspended.discard(url)
            self.behind.discard(url)
            if new_url is not None and new_url != url:
                self.urls = [new_url if u == url else u for u in self.urls]
                url = new_url
            if self.version != version and self._update([url], self.version):
                self.behind.add(url)
                return version
            return self.version

    def submit(self, trainer: Trainer, state: TrainState, every: int = 1) -> None:
        """Publishes `state`'s policy in the background if its version (read there, so this
        does not wait for the step computing it) is new and a multiple of `every`."""
        self.check()
        params = jax.tree.map(jnp.copy, state.policy)  # the state is donated to the next step
        with self._cond:
            self._pending = (trainer, params, jnp.copy(state.version), every)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    if not self._cond.wait(self.CATCH_UP_S) and self.behind:
                        break
                job, self._pending = self._pending, None
                self._busy = True
            try:
                if job is None:
                    self.catch_up()
                    continue
                trainer, params, version, every = job
                v = int(version)
                if v != self.version and v % every == 0:
                    self._publish(trainer.policy_of(params), v)
            except BaseException as e:  # noqa: BLE001 - re-raised by check()
                self._error = e
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def check(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise TrainingError(f"publishing weights to the engines failed: {error}") from error

    def close(self, timeout_s: float = 2.0) -> None:
        """Drops what waits to be published and stays quiet about engines that go away (the
        run is stopping, its engines with it): engine updates under way are cancelled (waiting
        up to `timeout_s` for that), so that stopping the engines does not make them retry."""
        with self._cond:
            self._pending = None
            self._closed = True
            updating = self._updating
        if updating is not None:
            loop, task = updating
            with contextlib.suppress(RuntimeError):  # its loop has just ended
                loop.call_soon_threadsafe(task.cancel)
            with self._cond:
                self._cond.wait_for(lambda: self._updating is None, timeout_s)

    def wait(self) -> None:
        with self._cond:
            while self._pending is not None or self._busy:
                self._cond.wait()
        self.check()


def _unreachable(error: BaseException) -> bool:
    """Whether `error`, or one it was raised from, says the engine could not be reached (no
    connection, or no answer in time), rather than that it refused."""
    while error is not None:
        if isinstance(error, EngineUnavailableError | aiohttp.ClientConnectionError
                      | TimeoutError):
            return True
        error = error.__cause__
    return False


class SkipGuard:
    """Counts skipped (non-finite) steps; `MAX_SKIPPED_IN_A_ROW` in a row stop the run."""

    def __init__(self, log=print):
        self.log = log
        self.in_a_row = 0

    def record(self, step: int, skipped: bool) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.log(f"\nstep {step}: non-finite loss or gradients; the update was skipped "
                 f"({self.in_a_row} in a row)")
        if self.in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise TrainingError(
                f"{MAX_SKIPPED_IN_A_ROW} steps in a row had non-finite losses or gradients (last: "
                f"step {step}); the tensorboard logs show which. Lower the learning rates or "
                "check the rewards and the engine's log-probs.")


# ---------------------------------------------------------------------------------------------
# Progress and logs.


class Progress:
    """One status line: a bar, the step, reward, held-out accuracy, speed."""

    def __init__(self, total: int, stream=sys.stdout):
        self.total, self.stream = total, stream
        self.tty = stream.isatty()
        self.last_print = 0.0

    def update(self, step: int, fields: dict[str, str]) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last_print < 5 and step < self.total:
            return
        self.last_print = now
        width = 24
        done = int(width * step / self.total)
        text = " ".join(f"{k} {v}" for k, v in fields.items())
        line = f"[{'#' * done}{'.' * (width - done)}] step {step}/{self.total} {text}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def trajectory_text(t: Trajectory, tokenizer) -> str:
    """A trajectory as Markdown: prompt, actions in bold, observations as code, reward."""
    parts = [f"**prompt** `{tokenizer.decode(t.prompt_ids)!r}`  "]
    ids, mask = t.response_ids, t.action_mask
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode(ids[start:i])
            parts.append(f"{'**action**' if mask[start] else 'observation'} `{text!r}`  ")
            start = i
    parts.append(f"reward {float(t.rewards.sum()):g}, finish {t.finish_reason}, "
                 f"versions {sorted(set(t.weight_versions[t.action_mask].tolist()))}")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# The run.


def _eval(config, task: Task, urls: list[str]) -> dict[str, float]:
    out = {}
    for key, temperature in (("accuracy", 1.0), ("greedy_accuracy", 0.0)):
        result = evaluate(urls, task.eval_rows, make_env=task.make_env,
                          tokenizer=task.tokenizer, agent=task.eval_agent(temperature),
                          render_prompt=task.render_prompt, chat=task.chat,
                          concurrency=config.rollout.worker_concurrency)
        out[key] = result.accuracy
        if temperature:
            out["response_tokens"] = result.response_tokens
    return out


def compilation_cache_dir(config) -> str | None:
    """Where compiled programs are kept (`config.compilation_cache`): the learner's and its
    embedded engines', which then skip most of their start-up compiles. None: off."""
    if not config.compilation_cache:
        return None
    return os.path.join(config.warm_start.cache_dir or default_cache_dir(), "jax")


def _setup_compilation_cache(config) -> None:
    if (path := compilation_cache_dir(config)) is not None:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def train(config, workdir: str, *, log=print) -> dict[str, Any]:
    """Runs (or resumes) the experiment `config` in `workdir`; returns the summary."""
    started = time.time()
    check_config(config)
    _setup_compilation_cache(config)
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    reap_previous(workdir, log=log)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))
    task = make_task(config)
    algo = algorithm_of(config)

    policy, warm_info = initial_policy(config, task, log)
    policy = training_layout(config, policy)
    mesh = sharding.make_mesh(mesh_shape(config, jax.device_count()))
    rules = sharding.DEFAULT_RULES
    policy = sharding.shard_model(policy, mesh, rules)
    trainer = make_trainer(config, policy, len(task.train_rows), mesh=mesh, rules=rules)
    state = trainer.init_state(config.seed)
    checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"),
                               keep=config.keep_checkpoints)
    meta: dict[str, Any] = {"consumed_ids": [], "trajectories": 0, "stale_discarded": 0,
                            "skipped_steps": 0, "policy_from_step": None,
                            "initial_eval": None, "wall_time_s": 0.0, "iterator_state": ""}
    resumed = checkpoints.latest_step() is not None
    if resumed:
        state, meta = checkpoints.restore(state)
        state = trainer.place(state)
        log(f"resuming from the checkpoint of step {int(state.step)} "
            f"(policy version {int(state.version)})")
    step0 = int(state.step)
    _cut_step_log(workdir, step0)
    precompiling = _precompile_in_background(config, trainer, state, meta, log)

    vocab = trainer.cfg.vocab_size
    group_size = algo.group_size
    server = TrajectoryServer(
        os.path.join(workdir, "stream"), vocab_size=vocab,
        prompts=prompt_dataset(task, config.seed),
        max_length=config.rollout.engine_max_seq_len, maxsize=max(config.rollout.queue_size,
                                                                  2 * config.batch_size),
        max_in_flight=admission_limit(config),
        lease_budget=0 if config.mode == "sync" else None, group_size=group_size,
        lease_timeout_s=config.rollout.lease_timeout_s,
        iterator_state=meta.get("iterator_state") or None).start()
    try:
        server.consumed(meta["consumed_ids"])
    except KeyError as e:  # the stream directory was replaced: nothing of it to skip
        log(f"warning: checkpointed trajectory ids unknown to the stream log ({e})")
    children = Children(workdir, log=log, priority=config.rollout.priority,
                        max_restarts=config.rollout.max_restarts)
    supervisor = Supervisor(config, workdir, children,
                            lambda urls: _worker_argv(config, task, server, urls, vocab), log=log)
    writer = None
    with StopRequests() as stops:
        try:
            with stops.interruptible():
                publisher = supervisor.start(trainer, state)
                if meta["initial_eval"] is None:
                    log(f"evaluating the initial policy on {len(task.eval_rows)} held-out "
                        "prompts ...")
                    meta["initial_eval"] = _eval(config, task, publisher.urls)
                    log(f"initial held-out accuracy {meta['initial_eval']['accuracy']:.3f} "
                        f"(greedy {meta['initial_eval']['greedy_accuracy']:.3f})")
                supervisor.start_workers()
                precompiling.join()
            writer = EventWriter(os.path.join(workdir, "tb"),
                                 purge_step=step0 + 1 if resumed else None)
            if not resumed:
                for key, value in meta["initial_eval"].items():
                    writer.add_scalar(f"eval/{key}", value, 0)
            state, meta = _loop(config, workdir, task, trainer, state, meta, server, supervisor,
                                publisher, checkpoints, writer, stops, log)
            children.stop([n for n, _ in children.procs if n.startswith("worker")])
            with stops.interruptible():
                supervisor.finish()
                final_version = int(state.version)
                publisher.wait()
                if publisher.version != final_version or publisher.behind:
                    publisher.publish(trainer.policy_model(state), final_version)
                log(f"evaluating the final policy (version {final_version}) ...")
                final = _eval(config, task, publisher.urls)
            writer.add_scalar("eval/accuracy", final["accuracy"], int(state.step))
            writer.add_scalar("eval/greedy_accuracy", final["greedy_accuracy"],
                              int(state.step))
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                log("\ninterrupted: stopping the engines and workers")
            supervisor.close()
            children.stop()
            server.stop(grace=0)
            checkpoints.close()
            if writer is not None:
                writer.close()
            raise
    children.stop()
    stream = server.metrics()
    server.stop(grace=1)
    writer.close()
    wall = meta["wall_time_s"] + time.time() - started
    summary = {
        "experiment": config.name, "algo": config.algo, "mode": config.mode,
        "initial_eval_accuracy": meta["initial_eval"]["accuracy"],
        "final_eval_accuracy": final["accuracy"],
        "initial_greedy_accuracy": meta["initial_eval"]["greedy_accuracy"],
        "final_greedy_accuracy": final["greedy_accuracy"],
        "steps": int(state.step), "policy_version": int(state.version),
        "trajectories": meta["trajectories"], "stale_discarded": meta["stale_discarded"],
        "skipped_steps": meta["skipped_steps"], "wall_time_s": round(wall, 1),
        "this_run_wall_time_s": round(time.time() - started, 1),
        # Since this run (re)started: trajectories the stream rejected as malformed, episodes
        # whose environment raised, and prompts given up after 3 such attempts.
        "this_run_stream": {key: int(stream[f"stream/{key}"]) for key in
                            ("rejected", "episodes_failed", "prompts_given_up")},
        "warm_start": {k: v for k, v in warm_info.items() if k != "settings"},
        "eval_prompts": len(task.eval_rows),
    }
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    checkpoints.close()
    return summary


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
    if length is not None:
        return [batch_shapes(config.batch_size, length, rows)
                for rows in packed_row_counts(config.batch_size, trainer.row_multiple)]
    return [batch_shapes(config.batch_size, n)
            for n in batch_lengths(config.rollout.engine_max_seq_len)]


def _precompile_in_background(config, trainer: Trainer, state: TrainState, meta, log):
    """Compiles the learner step for every batch shape the run can meet (`step_shapes`, the
    phases still ahead) on a thread, while the engines start and the initial evaluation runs;
    `join()` raises what compiling raised."""
    algo = algorithm_of(config)
    critic_phase = algo.uses_critic and meta["policy_from_step"] is None and (
        config.rl.critic_warmup_steps > 0 or config.rl.value_pretraining)
    phases = (False, True) if critic_phase else (True,)
    shapes = step_shapes(config, trainer) if config.precompile_steps else []
    return _Thread(lambda: trainer.precompile(state, shapes, phases), name="precompile")


class _Thread(threading.Thread):
    """A daemon thread whose `join()` re-raises the exception its target raised."""

    def __init__(self, target, name: str):
        super().__init__(name=name, daemon=True)
        self._target_fn, self._error = target, None
        self.start()

    def run(self):
        try:
            self._target_fn()
        except BaseException as e:  # noqa: BLE001 - handed to join()
            self._error = e

    def join(self, timeout=None):
        super().join(timeout)
        if self._error is not None:
            raise self._error


class StopRequests:
    """SIGINT and SIGTERM while training, turned into a `KeyboardInterrupt` at a safe point.

    A signal sets a flag; `check()` raises once it is set, and the loop calls it between steps
    and while it waits for rollouts. Raising straight from the handler lands the exception
    wherever the main thread happens to be: inside a gc callback it is swallowed (seen: the run
    ignored Ctrl-C and finished), inside a library's lock it can leave the lock held. Only
    within `interruptible()`, around waits on the engines, does the handler raise at once (a
    swallowed one is still caught by the next `check()`). Installed with `with`; the previous
    handlers come back on exit.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self._raise_now = False
        self._previous = {}

    def __enter__(self) -> StopRequests:
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *_) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, *_) -> None:
        self.requested = True
        if self._raise_now:
            raise KeyboardInterrupt

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def interruptible(self):
        self.check()
        self._raise_now = True
        try:
            yield
        finally:
            self._raise_now = False
        self.check()


def _worker_argv(config, task: Task, server: TrajectoryServer, urls: list[str],
                 vocab_size: int) -> list[str]:
    argv = ["--learner", server.address, "--env", task.env,
            "--concurrency", str(config.rollout.worker_concurrency),
            "--temperature", str(config.rollout.temperature),
            "--max-turns", str(config.env.max_turns),
            "--max-action-tokens", str(config.env.max_action_tokens),
            "--max-response-tokens", str(config.env.max_response_tokens),
            "--max-context-tokens", str(config.rollout.engine_max_seq_len),
            "--vocab-size", str(vocab_size)]
    for url in urls:
        argv += ["--engine", url]
    if config.rollout.request_timeout_s:  # 0: the worker's own default
        argv += ["--request-timeout-s", str(config.rollout.request_timeout_s)]
    if task.tokenizer_path:
        argv += ["--tokenizer", task.tokenizer_path]
    if task.env_options:
        argv += ["--env-options", json.dumps(dict(task.env_options))]
    return argv


class Supervisor:
    """Starts the engines and workers of a run, and restarts those that die while it trains.

    - A worker that dies is started again with the same command line. The leases it held come
      back after `config.rollout.lease_timeout_s` (the stream issues them again), so no prompt is
      lost; until then they count against admission.
    - An embedded engine that dies is started again from the newest published weights
      (`Publisher.pinned`), which it loads before it listens, on the same port when that is free
      (the workers' URLs stay valid) or else on a new one (then the workers are restarted with the
      new URLs). A version published while it started is loaded as soon as it answers
      (`Publisher.resume`). Until then the publisher leaves it alone and the workers' clients fail
      over to the other engines. The restart runs on a thread: the learner keeps training.
    - External engines (`rollout.engine = "sglang"`) are not restarted: the workers' clients retry
      them with backoff, and the publisher catches them up with the newest weights once they
      answer again (`Publisher.catch_up`).

    Each child is restarted at most `config.rollout.max_restarts` times per run; one more death
    makes `check` raise `ChildExited` naming its log, which stops the run.
    """

    def __init__(self, config, workdir: str, children: Children,
                 worker_argv: Callable[[list[str]], list[str]], log=print):
        self.config, self.workdir, self.children = config, workdir, children
        self.worker_argv = worker_argv
        self.log = log
        self.publisher: Publisher | None = None
        self.engines: list[str] = []  # names of the embedded engines, in the order of the URLs
        self._restarting: dict[str, _Thread] = {}
        self._workers_moved = False  # an engine came back on a new port: restart the workers
        self._closed = False
        self._lock = threading.Lock()  # no respawn once closed

    def start(self, trainer: Trainer, state: TrainState) -> Publisher:
        """Starts the engines (or publishes to the configured ones) with `state`'s weights."""
        version, rollout = int(state.version), self.config.rollout
        if rollout.engine == "sglang":
            urls = [u.strip() for u in rollout.engine_urls.split(",") if u.strip()]
            self.publisher = Publisher(self.workdir, urls, log=self.log,
                                       update_timeout_s=rollout.weight_update_timeout_s)
            self.publisher.publish(trainer.policy_model(state), version)
            return self.publisher
        self.publisher = Publisher(self.workdir, [], log=self.log,
                                   update_timeout_s=rollout.weight_update_timeout_s)
        path = self.publisher.write(trainer.policy_model(state), version)
        self.engines = [f"engine{i}" for i in range(rollout.num_engines)]
        self.publisher.urls = self.children.start_engines(
            self.engines, path, weight_version=version,
            options=[self._engine_options(i) for i in range(len(self.engines))])
        self.publisher.version = version
        return self.publisher

    def _engine_options(self, i: int) -> dict:
        rollout = self.config.rollout
        return dict(max_batch=rollout.engine_max_batch, max_seq_len=rollout.engine_max_seq_len,
                    seed=self.config.seed + i,
                    compilation_cache_dir=compilation_cache_dir(self.config))

    def start_workers(self) -> None:
        for i in range(self.config.rollout.num_workers):
            self.children.start_worker(f"worker{i}", self.worker_argv(self.publisher.urls))

    def check(self) -> None:
        """Restarts the children that died (raises `ChildExited` for one out of restarts, and
        what an engine restart raised)."""
        for name, thread in list(self._restarting.items()):
            if not thread.is_alive():
                del self._restarting[name]
                thread.join()  # re-raises
        if self._workers_moved:
            self._workers_moved = False
            workers = [n for n, _ in self.children.procs if n.startswith("worker")]
            self.children.stop(workers)
            for name in workers:
                self.children.start_worker(name, self.worker_argv(self.publisher.urls))
            self.log(f"\nrestarted the workers with the engines {self.publisher.urls}; the "
                     f"leases they held come back after {self._lease_timeout_s():g} s")
        for name, code in self.children.exited():
            if name in self._restarting:
                continue
            if name in self.engines:
                self.publisher.suspend(self.publisher.urls[self.engines.index(name)])
                self._restarting[name] = _Thread(lambda n=name, c=code: self._restart_engine(n, c),
                                                 name=f"restart-{name}")
                continue
            self.children.respawn(name, worker_command(self.worker_argv(self.publisher.urls)))
            self.log(f"\n{name} exited with code {code}: restarted it ({self._count(name)}); "
                     f"the leases it held come back after {self._lease_timeout_s():g} s; see "
                     f"{self.children.log_path(name)}")

    def _lease_timeout_s(self) -> float:
        return self.config.rollout.lease_timeout_s

    def _count(self, name: str) -> str:
        return f"restart {self.children.restarts[name]} of {self.children.max_restarts}"

    def _restart_engine(self, name: str, code: int) -> None:
        i = self.engines.index(name)
        url = self.publisher.urls[i]
        port = int(url.rsplit(":", 1)[1])
        while True:
            with self.publisher.pinned() as (path, version):
                new_port = port if port_is_free(port) else free_port()
                with self._lock:
                    if self._closed:
                        return
                    proc = self.children.respawn(name, engine_argv(
                        path, port=new_port, weight_version=version, **self._engine_options(i)))
                self.log(f"\n{name} exited with code {code}: restarting it ({self._count(name)}) "
                         f"on port {new_port} from weights v{version}, the newest published; "
                         "the other engines serve meanwhile")
                try:
                    new_url = self.children.wait_ready(name, proc, new_port)
                except ChildExited as e:
                    code = proc.returncode
                    self.log(f"\n{e}")
                    continue  # respawn raises once the restarts are used up
            held = self.publisher.resume(url, version, new_url)
            self.log(f"\n{name} is back on {new_url} with weights v{held}")
            if new_url != url:
                self._workers_moved = True
            return

    def finish(self) -> None:
        """Waits for engine restarts under way (raising what they raised), then restarts
        nothing more: the training loop is done."""
        for name, thread in list(self._restarting.items()):
            del self._restarting[name]
            thread.join()
        with self._lock:
            self._closed = True

    def close(self) -> None:
        """Restarts nothing more and publishes nothing more: the run is stopping."""
        with self._lock:
            self._closed = True
        if self.publisher is not None:
            self.publisher.close()


def _cut_step_log(workdir: str, step: int) -> None:
    """Drops `steps.jsonl` records after `step` (they belong to a run that did not checkpoint)."""
    path = os.path.join(workdir, "steps.jsonl")
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def _loop(config, workdir, task, trainer: Trainer, state: TrainState, meta, server,
          supervisor: Supervisor, publisher: Publisher, checkpoints: Checkpointer,
          writer: EventWriter, stops: StopRequests, log):
    algo = trainer.config.algorithm
    collector = BatchCollector(server, config.batch_size, algo.group_size, config.max_staleness)
    progress = Progress(config.total_steps)
    steps_log = open(os.path.join(workdir, "steps.jsonl"), "a")  # noqa: SIM115
    consumed = list(meta["consumed_ids"])
    marked = len(consumed)  # consumed[:marked] are marked consumed in the stream's log
    pending: tuple | None = None  # (step, device metrics, host metrics): fetched one step late
    guard = SkipGuard(log)
    recent_rewards: collections.deque[float] = collections.deque(maxlen=4 * config.batch_size)
    best_ev, stale_ev = -np.inf, 0
    last_eval = meta["initial_eval"]["accuracy"]
    last_time = time.monotonic()
    packed_to = pack_length(config, trainer)
    if config.mode == "async":
        log(f"admission: at most {admission_limit(config)} prompts in flight (leased or queued); "
            f"trajectories more than {config.max_staleness} versions old are dropped")
    if packed_to:
        log(f"batches: trajectories packed into model rows of {packed_to} tokens")
    else:
        log("batches: one padded row per trajectory" + (
            "" if trainer.packs or not config.pack_rows
            else " (PPO mini-batches or microbatches split rows, so no packing)"))

    def poll():
        supervisor.check()
        stops.check()
        if config.mode == "sync":
            grant_one_batch(server, collector)

    def flush(pending):
        step, device, host = pending
        scalars = {k: float(v) for k, v in jax.device_get(device).items()}
        scalars.update(host)
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)
        if scalars["skipped"]:
            meta["skipped_steps"] += 1
            writer.flush()
        guard.record(step, bool(scalars["skipped"]))
        return scalars

    try:
        while int(state.step) < config.total_steps:
            step = int(state.step) + 1
            version = int(state.version)
            if task.step_in_prompts:  # prompts leased from now on are judged at this step
                server.set_prompt_extra(learner_step=step)
            poll()  # (sync: grants this step's prompts)
            batch, waited = collector.collect(version, poll)
            lags = [policy_lag(t, version) for t in batch]
            update_policy = _policy_updates(config, algo, meta, step)
            prompt_index = [int(t.prompt_id) if t.prompt_id.isdigit() else 0 for t in batch]
            arrays = make_batch(batch, prompt_index=prompt_index, pack_length=packed_to,
                                row_multiple=trainer.row_multiple)
            state, device_metrics = trainer.step(state, arrays, update_policy=update_policy)
            ids = [t.trajectory_id for t in batch]
            consumed += ids
            meta["trajectories"] += len(batch)
            meta["stale_discarded"] = meta.get("stale_discarded", 0) + collector.stale
            collector.stale = 0
            steps_log.write(json.dumps({"step": step, "version": version, "ids": ids}) + "\n")
            steps_log.flush()

            rewards = [float(t.rewards.sum()) for t in batch]
            recent_rewards.extend(rewards)
            now = time.monotonic()
            elapsed, last_time = now - last_time, now
            host = {
                "reward/mean": float(np.mean(rewards)),
                "reward/success_rate": float(np.mean([r > 0 for r in rewards])),
                "rollout/policy_lag_mean": float(np.mean(lags)),
                "rollout/policy_lag_max": float(np.max(lags)),
                "rollout/response_tokens": float(np.mean([t.length for t in batch])),
                "rollout/turns": float(np.mean([t.env_metadata.get("turns", 0)
                                                 for t in batch])),
                "time/learner_idle_frac": min(1.0, waited / max(elapsed, 1e-9)),
                "time/step_s": elapsed,
                "throughput/tokens_per_s": sum(len(t.prompt_ids) + t.length
                                               for t in batch) / max(elapsed, 1e-9),
                "policy/version": float(version),
                "policy/updated": float(update_policy),
                "stream/stale_discarded_total": float(meta["stale_discarded"]),
            }
            if task.env == "swe":
                host.update(swe_metrics(batch))
            if pending is not None:
                scalars = flush(pending)
                if "critic/explained_variance" in scalars and meta["policy_from_step"] is None:
                    ev = scalars["critic/explained_variance"]
                    stale_ev = 0 if ev > best_ev + 0.01 else stale_ev + 1
                    best_ev = max(best_ev, ev)
                    meta["_ev_stalled"] = stale_ev >= 5
            pending = (step, device_metrics, host)

            if update_policy and step < config.total_steps:  # the last one: after the loop
                if config.mode == "async":  # overlaps the next step
                    publisher.submit(trainer, state, config.publish_every)
                elif (int(state.version) != publisher.version  # not a skipped step
                      and int(state.version) % config.publish_every == 0):  # before next leases
                    publisher.publish(trainer.policy_model(state), int(state.version))
            if step % config.sample_every == 0:
                writer.add_text("samples", "\n\n---\n\n".join(
                    trajectory_text(t, task.tokenizer) for t in batch[:3]), step)
            if config.eval_every and step % config.eval_every == 0 and step < config.total_steps:
                with stops.interruptible():
                    publisher.wait()
                    last_eval = _eval(config, task, publisher.urls)["accuracy"]
                writer.add_scalar("eval/accuracy", last_eval, step)
            for key, value in server.metrics().items():
                writer.add_scalar(key, value, step)
            if step % config.checkpoint_every == 0 or step == config.total_steps:
                flush(pending)
                pending = None
                writer.flush()  # before the checkpoint: a resume purges only later steps
                meta["consumed_ids"] = consumed
                meta["iterator_state"] = server.iterator_state()
                try:
                    checkpoints.save(state, {k: v for k, v in meta.items()
                                             if not k.startswith("_")})
                except DiskFullError as e:
                    raise TrainingError(
                        f"{e}. The run stops here; free some space and run the same command "
                        "again: it resumes from that checkpoint, and the trajectories of the "
                        "steps after it are trained on again, none lost or used twice.") from e
                server.consumed(consumed[marked:])  # after the save: a crash in between
                marked = len(consumed)  # is mended at restart from the checkpoint's ids
            progress.update(step, {
                "reward": f"{np.mean(recent_rewards):.3f}",
                "held-out": f"{last_eval:.3f}",
                "lag": f"{np.mean(lags):.1f}",
                "idle": f"{host['time/learner_idle_frac']:.0%}",
                "phase": "policy" if update_policy else "critic warm-up",
            })
        if pending is not None:
            flush(pending)
    finally:
        progress.close()
        steps_log.close()
    return state, meta


def _policy_updates(config, algo: Algorithm, meta, step: int) -> bool:
    """Whether step `step` updates the policy (after the critic warm-up / value pretraining)."""
    if not algo.uses_critic:
        return True
    if meta["policy_from_step"] is not None:
        return step >= meta["policy_from_step"]
    warm = config.rl.critic_warmup_steps
    done = step > warm
    if config.rl.value_pretraining and done:
        done = meta.get("_ev_stalled", False) or step > warm + config.rl.value_pretraining_max_steps
    if done:
        meta["policy_from_step"] = step
    return done


def policy_skeleton(config) -> CausalLM:
    """A policy of the configured architecture and training layout (weights to be replaced by
    a checkpoint's)."""
    return training_layout(config, _configured_policy(config))


def _configured_policy(config) -> CausalLM:
    dispatch = dict(moe_dispatch=config.model.moe_dispatch,
                    logprob_dispatch=config.model.logprob_dispatch)
    if config.model.path:
        return load_hf(config.model.path, jnp.dtype(config.model.dtype), **dispatch)
    return CausalLM(preset(config.model.preset, **dispatch), nnx.Rngs(0))


def evaluate_checkpoint(config, checkpoint: str, *, log=print) -> dict[str, float]:
    """Held-out accuracy of a checkpoint: a run directory (its latest checkpoint), one of its
    `checkpoints/<step>` directories, or a Hugging Face model directory."""
    check_config(config)
    _setup_compilation_cache(config)
    task = make_task(config)
    target = os.path.abspath(os.path.expanduser(checkpoint))
    if os.path.isdir(os.path.join(target, "checkpoints")):
        directory, step = os.path.join(target, "checkpoints"), None
    elif os.path.basename(target).isdigit() and os.path.isdir(target):
        directory, step = os.path.dirname(target), int(os.path.basename(target))
    elif os.path.exists(os.path.join(target, "config.json")):
        directory, step = None, None  # a Hugging Face directory
    else:
        raise ValueError(f"CKPT={checkpoint!r}: give a run directory, one of its "
                         "checkpoints/<step> directories, or a Hugging Face model directory.")
    scratch = os.path.join(target if directory is None else os.path.dirname(directory),
                           "eval")
    os.makedirs(scratch, exist_ok=True)
    children = Children(scratch, log=log)
    try:
        path = target
        if directory is not None:
            trainer = make_trainer(config, policy_skeleton(config), len(task.train_rows))
            abstract = jax.eval_shape(lambda: trainer.init_state(config.seed))
            checkpoints = Checkpointer(directory)
            state, _ = checkpoints.restore(abstract, step)
            checkpoints.close()
            path = os.path.join(scratch, f"v{int(state.version)}")
            save_hf(trainer.policy_model(state), path)
            log(f"evaluating the checkpoint of step {int(state.step)} "
                f"(policy version {int(state.version)})")
        url = children.start_engine("eval_engine", path, weight_version=0,
                                    max_batch=config.rollout.engine_max_batch,
                                    max_seq_len=config.rollout.engine_max_seq_len,
                                    seed=config.seed,
                                    compilation_cache_dir=compilation_cache_dir(config))
        return _eval(config, task, [url])
    finally:
        children.stop()
