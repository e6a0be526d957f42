"""The learner's loop: one explicit state (`LoopState`), a short step (`Loop.step`), and hooks
that run after it, each at its own period (`Hook`).

    loop = Loop(config, task, lockstep, server, supervisor, stops, writer, workdir, hooks)
    s = loop.run(LoopState.start(config, state, meta, started=time.time()))

A step takes a batch of whole groups of fresh trajectories from the stream (`BatchCollector`),
dispatches the jitted step on it, records what it trained on (`steps.jsonl`), writes the previous
step's metrics (fetched one step late, so that the host never waits for the step it has just
dispatched) and tells the stream the new policy version. Then the hooks due at that step run, in
the order given. `learner.train` gives these, each from a factory here, with its period:

    publish       every `publish_every` policy versions; not at the last step, whose policy the
                  run's end publishes
    samples       every `sample_every` steps: a few transcripts as TensorBoard text
    evaluate      every `eval_every` steps (0: none); not at the last step, whose policy the
                  run's end evaluates
    stream        every step: the stream's counters (`stream/*`)
    engines       every `engine_stats.EVERY` steps and at the last: the engines' counters
    checkpoint    every `checkpoint_every` steps and at the last
    progress      every step: the console's progress line

Everything the loop carries from one step to the next is in `LoopState`, built before it starts:
the device state, the host's counters, the checkpoint's record (`meta`) and what the hooks read
(this step's batch, its host-side scalars, the latest held-out accuracy). A hook is a function of
that state; the objects it works through (the publisher, the event writer, ...) are given to its
factory, and nothing sets a field of the loop from outside.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

import jax
import numpy as np

from sao_jax.rollout.stream import TrajectoryServer
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train import engine_stats
from sao_jax.train.algorithms import Algorithm
from sao_jax.train.batch import make_batch
from sao_jax.train.build import (
    admission_limit,
    algorithm_of,
    pack_length,
    route_shape,
    train_prompts,
)
from sao_jax.train.checkpoint import DiskFullError
from sao_jax.train.collect import BatchCollector, grant_one_batch, policy_lag
from sao_jax.train.console import (
    Progress,
    SkipGuard,
    StallWatch,
    StopRequests,
    TrainingError,
    trajectory_text,
)
from sao_jax.train.evaluate import held_out
from sao_jax.train.events import EventWriter
from sao_jax.train.lockstep import Lockstep
from sao_jax.train.plateau import Plateau
from sao_jax.train.publish import Publisher
from sao_jax.train.state import TrainState
from sao_jax.train.steps import Trainer
from sao_jax.train.supervisor import Supervisor
from sao_jax.train.tasks import Task

STEPS_LOG = "steps.jsonl"  # <workdir>/steps.jsonl: the trajectory ids each step trained on


def episode_scalars(batch: Sequence[Trajectory]) -> dict[str, float]:
    """The batch's episodes, averaged: response tokens, turns, and the share cut by a limit
    (turns, tokens, context, time): where a cut is graded 0, a rising share is a policy stalling
    for the critic's bootstrap (docs/algorithm.md, on truncated episodes)."""
    return {"rollout/response_tokens": float(np.mean([t.length for t in batch])),
            "rollout/turns": float(np.mean([t.env_metadata.get("turns", 0) for t in batch])),
            "rollout/truncated_frac": float(np.mean([t.truncated for t in batch]))}


@dataclasses.dataclass
class LoopState:
    """What the learner loop carries from step to step, and what its hooks read.

    `step` and `version` are the host's own counters: reading `state.step` / `state.version`
    would wait for the step just dispatched, so the next batch could not be collected and built
    while it runs. They equal the device's (a skipped step still counts its version: steps.py),
    which the checkpoints check, where the host waits for the state anyway.
    """

    state: TrainState  # donated to each step: the newest is always here
    # What a checkpoint keeps beside `state` (checkpoint.py): the ids of every trajectory
    # consumed, the counters of the summary, the policy phase, the initial evaluation, ...
    meta: dict[str, Any]
    step: int
    version: int
    wall_time_before: float  # the earlier runs' seconds, up to their last checkpoint
    started: float  # `time.time()` when this run started
    marked: int  # meta["consumed_ids"][:marked] are marked consumed in the stream's log
    last_eval: float  # the latest held-out accuracy (sampled), for the progress line
    recent_rewards: collections.deque[float]  # the progress line's reward
    plateau: Plateau  # value pretraining: whether explained variance still rises
    guard: SkipGuard  # non-finite steps in a row stop the run
    stall: StallWatch  # most episodes cut while their returns bootstrap: says so, once
    last_time: float  # `time.monotonic()` when the last step ended
    pending: tuple | None = None  # (step, device metrics, host scalars): written a step late
    # This step's, for the hooks:
    batch: list[Trajectory] = dataclasses.field(default_factory=list)
    updated: bool = False  # it updated the policy: `version` is new
    host: dict[str, float] = dataclasses.field(default_factory=dict)  # its host-side scalars

    @classmethod
    def start(cls, config, state: TrainState, meta: dict[str, Any], *, started: float,
              log=print) -> LoopState:
        """The state of a run at `state` (fresh, or restored with its checkpoint's `meta`)."""
        return cls(state=state, meta=meta, step=int(state.step), version=int(state.version),
                   wall_time_before=meta["wall_time_s"], started=started,
                   marked=len(meta["consumed_ids"]), last_eval=meta["initial_eval"]["accuracy"],
                   recent_rewards=collections.deque(maxlen=4 * config.batch_size),
                   plateau=Plateau.of(config, meta.get("value_pretraining")),
                   guard=SkipGuard(log), last_time=time.monotonic(),
                   stall=StallWatch(config.rl.bootstrap_truncated
                                    and algorithm_of(config).uses_critic, log))

    def wall_time_s(self) -> float:
        """The run's seconds so far, the earlier runs' up to their last checkpoint included."""
        return self.wall_time_before + time.time() - self.started


@dataclasses.dataclass(frozen=True)
class Hook:
    """`run(state)` after each step it is due at: every `every` steps (0: never), or with
    `versions`, at each step that makes a policy version that is a multiple of `every`. At the
    last step `last` decides instead, when given: True, always; False, never (the run's end does
    it). `close()` runs once the loop ends, however it ends."""

    run: Callable[[LoopState], None]
    every: int = 1
    versions: bool = False
    last: bool | None = None
    close: Callable[[], None] = lambda: None

    def due(self, s: LoopState, last: bool) -> bool:
        if last and self.last is not None:
            return self.last
        if self.every <= 0:
            return False
        if self.versions:
            return s.updated and s.version % self.every == 0
        return s.step % self.every == 0


class Loop:
    """The learner's steps, each followed by the hooks due at it (module doc)."""

    def __init__(self, config, task: Task, lockstep: Lockstep, server: TrajectoryServer,
                 supervisor: Supervisor, stops: StopRequests, writer: EventWriter,
                 workdir: str, hooks: list[Hook], *, log=print):
        self.config, self.task, self.lockstep, self.server = config, task, lockstep, server
        self.supervisor, self.stops, self.writer = supervisor, stops, writer
        self.workdir, self.hooks, self.log = workdir, hooks, log
        self.trainer = lockstep.trainer
        self.algo = self.trainer.config.algorithm
        self.collector = BatchCollector(server, config.batch_size, self.algo.group_size,
                                        config.max_staleness)
        self.slots = PromptSlots(train_prompts(task))
        self.packed_to = pack_length(config, self.trainer)
        self.routes = route_shape(config, self.trainer.cfg)  # the engines' routes: their shape

    def run(self, s: LoopState) -> LoopState:
        """Steps until `config.total_steps`; returns the state after the last."""
        self._say_how_it_batches()
        total = self.config.total_steps
        try:
            with open(os.path.join(self.workdir, STEPS_LOG), "a") as steps_log:
                while s.step < total:
                    self.step(s, steps_log)
                    for hook in self.hooks:
                        if hook.due(s, last=s.step == total):
                            hook.run(s)
            write_metrics(s, self.writer)  # none pending when the last step checkpointed
        finally:
            for hook in self.hooks:
                hook.close()
        return s

    def step(self, s: LoopState, steps_log: IO[str]) -> None:
        """One learner step on the next batch; `s` is the state after it."""
        s.step += 1
        self.server.set_learner_step(s.step)  # the prompts leased from now on carry it
        self.poll()  # (sync: grants this step's prompts)
        batch, waited = self.collector.collect(s.version, self.poll)
        lags = [policy_lag(t, s.version) for t in batch]
        updated = policy_updates(self.config, self.algo, s.meta, s.step)
        arrays = make_batch(batch, prompt_index=[self.slots.index(t) for t in batch],
                            pack_length=self.packed_to, row_multiple=self.trainer.row_multiple,
                            routes=self.routes, policy_lag=lags)
        s.state, device_metrics = self.lockstep.step(s.state, arrays, updated)
        ids = [t.trajectory_id for t in batch]
        s.meta["consumed_ids"] += ids
        s.meta["trajectories"] += len(batch)
        s.meta["stale_discarded"] = s.meta.get("stale_discarded", 0) + self.collector.stale
        steps_log.write(json.dumps({"step": s.step, "version": s.version, "ids": ids}) + "\n")
        steps_log.flush()

        rewards = [float(t.rewards.sum()) for t in batch]
        s.recent_rewards.extend(rewards)
        now = time.monotonic()
        elapsed, s.last_time = now - s.last_time, now
        s.batch, s.updated = batch, updated
        s.host = self._host_scalars(s, rewards, lags, waited, elapsed)
        scalars = write_metrics(s, self.writer)
        if (scalars is not None and "critic/explained_variance" in scalars
                and s.meta["policy_from_step"] is None):
            s.plateau.update(scalars["critic/explained_variance"])
            s.meta["value_pretraining"] = s.plateau.state()
        s.pending = (s.step, device_metrics, s.host)
        s.version += updated
        # Before any engine can sample with it (the publish hook): the stream refuses
        # trajectories that claim a newer version than this.
        self.server.set_policy_version(s.version)

    def poll(self) -> None:
        """What runs while the loop waits for rollouts: restarts children that died, stops on
        Ctrl-C, and in sync mode grants the prompts of one batch."""
        self.supervisor.check()
        self.stops.check()
        if self.config.mode == "sync":
            grant_one_batch(self.server, self.collector.batch_size, self.collector.held())

    def _host_scalars(self, s: LoopState, rewards: list[float], lags: list[int],
                      waited: float, elapsed: float) -> dict[str, float]:
        batch = s.batch
        host = {
            "reward/mean": float(np.mean(rewards)),
            "reward/success_rate": float(np.mean([r > 0 for r in rewards])),
            "rollout/policy_lag_mean": float(np.mean(lags)),
            "rollout/policy_lag_max": float(np.max(lags)),
            **episode_scalars(batch),
            "time/learner_idle_frac": min(1.0, waited / max(elapsed, 1e-9)),
            "time/step_s": elapsed,
            "time/elapsed_s": s.wall_time_s(),  # the run's wall clock (resumes included)
            "throughput/tokens_per_s": sum(len(t.prompt_ids) + t.length
                                           for t in batch) / max(elapsed, 1e-9),
            "policy/version": float(s.version),
            "policy/updated": float(s.updated),
            "stream/stale_discarded_total": float(s.meta["stale_discarded"]),
        }
        if self.task.spec.batch_metrics is not None:  # the environment's own
            host.update(self.task.spec.batch_metrics([t.env_metadata for t in batch]))
        return host

    def _say_how_it_batches(self) -> None:
        config, log = self.config, self.log
        if config.mode == "async":
            log(f"admission: at most {admission_limit(config)} prompts in flight (leased or "
                f"queued); trajectories more than {config.max_staleness} versions old are "
                "dropped")
        if self.packed_to:
            log(f"batches: trajectories packed into model rows of {self.packed_to} tokens")
        else:
            log("batches: one padded row per trajectory" + (
                "" if self.trainer.packs or not config.pack_rows
                else " (PPO mini-batches or microbatches split rows, so no packing)"))


def write_metrics(s: LoopState, writer: EventWriter) -> dict[str, float] | None:
    """Writes the pending step's scalars, its device metrics fetched now (a step late), and
    counts a skipped step (`SkipGuard`: three in a row stop the run); returns them, None when
    nothing was pending."""
    if s.pending is None:
        return None
    (step, device, host), s.pending = s.pending, None
    scalars = {k: float(v) for k, v in jax.device_get(device).items()}
    scalars.update(host)
    for key, value in scalars.items():
        writer.add_scalar(key, value, step)
    if scalars["skipped"]:
        s.meta["skipped_steps"] += 1
        writer.flush()
    s.guard.record(step, bool(scalars["skipped"]))
    s.stall.record(step, scalars.get("rollout/truncated_frac", 0.0))
    return scalars


# ------------------------------------------------------------------------------------ hooks

def publish(config, trainer: Trainer, publisher: Publisher) -> Callable[[LoopState], None]:
    """The new policy to the engines: in async mode in the background, overlapping the next
    step (`Publisher.submit`); in sync mode before the next prompts are leased."""

    def run(s: LoopState) -> None:
        if config.mode == "async":
            publisher.submit(trainer, s.state, s.version)
        else:
            publisher.publish(trainer.policy_model(s.state), s.version)

    return run


def write_samples(writer: EventWriter, tokenizer) -> Callable[[LoopState], None]:
    """The step's first three trajectories as TensorBoard text (`samples`)."""

    def run(s: LoopState) -> None:
        writer.add_text("samples", "\n\n---\n\n".join(
            trajectory_text(t, tokenizer) for t in s.batch[:3]), s.step)

    return run


def evaluate(config, task: Task, workdir: str, publisher: Publisher, writer: EventWriter,
             stops: StopRequests) -> Callable[[LoopState], None]:
    """The held-out scores of the newest policy (`evaluate.held_out`), once every version
    submitted is on the engines; the engines serve the newest weights meanwhile, lag or not."""

    def run(s: LoopState) -> None:
        with stops.interruptible():
            publisher.wait()
            with publisher.newest():
                scores = held_out(config, task, publisher.urls, workdir, s.step)
        s.last_eval = scores["accuracy"]
        writer.add_scalar("eval/accuracy", s.last_eval, s.step)
        writer.add_scalar("eval/greedy_accuracy", scores["greedy_accuracy"], s.step)

    return run


def write_stream_metrics(server: TrajectoryServer,
                         writer: EventWriter) -> Callable[[LoopState], None]:
    """The stream's counters (`stream/*`)."""

    def run(s: LoopState) -> None:
        for key, value in server.metrics().items():
            writer.add_scalar(key, value, s.step)

    return run


def write_engine_metrics(publisher: Publisher,
                         writer: EventWriter) -> Callable[[LoopState], None]:
    """The engines' own counters (`engine/*`, `engine_stats.read`), of the engines serving
    now."""

    def run(s: LoopState) -> None:
        for key, value in engine_stats.read(publisher.urls).items():
            writer.add_scalar(key, value, s.step)

    return run


def save_checkpoint(lockstep: Lockstep, server: TrajectoryServer,
                    writer: EventWriter) -> Callable[[LoopState], None]:
    """The step's checkpoint (checkpoint.py), its metrics written first; then its trajectories
    are marked consumed in the stream's log."""

    def run(s: LoopState) -> None:
        write_metrics(s, writer)
        writer.flush()  # before the checkpoint: a resume purges only later steps
        check_counters(s)
        s.meta["iterator_state"] = server.iterator_state()
        s.meta["wall_time_s"] = s.wall_time_s()
        try:
            lockstep.save_checkpoint(s.state, dict(s.meta))
        except DiskFullError as e:
            raise TrainingError(
                f"{e}. The run stops here; free some space and run the same command again: it "
                "resumes from that checkpoint, and the trajectories of the steps after it are "
                "trained on again, none lost or used twice.") from e
        consumed = s.meta["consumed_ids"]
        server.consumed(consumed[s.marked:])  # after the save: a crash in between is mended
        s.marked = len(consumed)  # at restart from the checkpoint's ids

    return run


class ProgressLine:
    """The console's progress line (`console.Progress`): the step, the recent training reward,
    the latest held-out accuracy, this step's policy lag and idle time, the phase."""

    def __init__(self, total_steps: int):
        self.progress = Progress(total_steps)

    def __call__(self, s: LoopState) -> None:
        self.progress.update(s.step, {
            "reward": f"{np.mean(s.recent_rewards):.3f}",
            "held-out": f"{s.last_eval:.3f}",
            "lag": f"{s.host['rollout/policy_lag_mean']:.1f}",
            "idle": f"{s.host['time/learner_idle_frac']:.0%}",
            "phase": "policy" if s.updated else "critic warm-up",
        })

    def close(self) -> None:
        self.progress.close()


# ------------------------------------------------------------------ what a step decides on

class PromptSlots:
    """The running-mean baseline's slot of each training prompt: its row's `"index"`
    (`train_prompts`), which the stream's leases carry and a trajectory answers with as its
    `prompt_index`. A trajectory without one, or with one that no row has, is an error, not a
    shared slot."""

    def __init__(self, rows):
        self._slots = frozenset(int(row["index"]) for row in rows)

    def index(self, trajectory: Trajectory) -> int:
        index = trajectory.prompt_index
        if index is None or index not in self._slots:
            raise ValueError(f"trajectory {trajectory.trajectory_id!r} (prompt_id "
                             f"{trajectory.prompt_id!r}) has prompt_index {index}, which no "
                             "training row has: the stream's prompts and the task's rows differ")
        return index


def policy_updates(config, algo: Algorithm, meta, step: int) -> bool:
    """Whether step `step` updates the policy (after the critic warm-up / value pretraining);
    the first that does is kept as `meta["policy_from_step"]`."""
    if not algo.uses_critic:
        return True
    if meta["policy_from_step"] is not None:
        return step >= meta["policy_from_step"]
    warm = config.rl.critic_warmup_steps
    done = step > warm
    if algo.value_pretraining and done:
        stalled = Plateau.of(config, meta.get("value_pretraining")).stalled
        done = stalled or step > warm + config.rl.value_pretraining_max_steps
    if done:
        meta["policy_from_step"] = step
    return done


def check_counters(s: LoopState) -> None:
    """The host's counters equal the device state's (the host waits for the state here)."""
    device = int(s.state.step), int(s.state.version)
    if device != (s.step, s.version):
        raise AssertionError(f"the learner's counters (step {s.step}, version {s.version}) "
                             f"differ from its state's (step {device[0]}, version {device[1]})")
