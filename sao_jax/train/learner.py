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

Faults (docs/faults.md, "Faults and the soak test"): an engine or worker that dies is restarted
(`Supervisor`: an embedded engine on its port, from the newest published weights; a worker's
leases come back after `rollout.lease_timeout_s`), at most `rollout.max_restarts` times each; an
engine that cannot be reached misses weight updates without failing them and catches up when it
answers (`Publisher`); a checkpoint that fills the disk stops the run at the previous, intact
checkpoint, and the same command resumes from it (`checkpoint.DiskFullError`).
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from sao_jax.models import save_hf
from sao_jax.rollout.stream import TrajectoryServer
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train import engine_stats, sharding
from sao_jax.train.algorithms import Algorithm
from sao_jax.train.batch import make_batch
from sao_jax.train.build import (
    admission_limit,
    algorithm_of,
    check_config,
    compilation_cache_dir,
    make_trainer,
    mesh_shape,
    pack_length,
    placed_policy,
    policy_skeleton,
    prompt_dataset,
    sharding_rules,
    step_shapes,
    train_prompts,
)
from sao_jax.train.checkpoint import Checkpointer, DiskFullError
from sao_jax.train.collect import BatchCollector, grant_one_batch, policy_lag
from sao_jax.train.console import Progress, SkipGuard, StopRequests, TrainingError, trajectory_text
from sao_jax.train.distributed import LOST_EXIT_CODE, Cluster
from sao_jax.train.evaluate import EvalResult, evaluate, write_episodes
from sao_jax.train.events import EventWriter
from sao_jax.train.lockstep import Lockstep, follow
from sao_jax.train.plateau import Plateau
from sao_jax.train.processes import Children, reap_previous
from sao_jax.train.publish import Publisher
from sao_jax.train.steps import Trainer, TrainState
from sao_jax.train.supervisor import BackgroundThread, Supervisor, worker_argv
from sao_jax.train.tasks import Task, make_task

BUILD_TIMEOUT_S = 7200  # the followers wait this long for the leader's policy (a warm start)


HELD_OUT_DIR = "held_out"  # <workdir>/held_out/step_<N>.jsonl: each evaluation's episodes


def _eval(config, task: Task, urls: list[str], workdir: str, step: int) -> dict[str, float]:
    """The held-out scores; the episodes go to `<workdir>/held_out/step_<step>.jsonl`
    (`evaluate.write_episodes`)."""
    runs = _eval_runs(config, task, urls)
    os.makedirs(os.path.join(workdir, HELD_OUT_DIR), exist_ok=True)
    write_episodes(os.path.join(workdir, HELD_OUT_DIR, f"step_{step}.jsonl"), runs)
    return _scores(runs)


def _eval_runs(config, task: Task, urls: list[str]) -> dict[str, EvalResult]:
    """The held-out episodes, sampled ("accuracy", temperature 1) and greedy."""
    return {key: evaluate(urls, task.eval_rows, make_env=task.make_env,
                          tokenizer=task.tokenizer, agent=task.eval_agent(temperature),
                          render_prompt=task.render_prompt, chat=task.chat,
                          concurrency=config.rollout.worker_concurrency)
            for key, temperature in (("accuracy", 1.0), ("greedy_accuracy", 0.0))}


def _scores(runs: dict[str, EvalResult]) -> dict[str, float]:
    return {"accuracy": runs["accuracy"].accuracy,
            "greedy_accuracy": runs["greedy_accuracy"].accuracy,
            "response_tokens": runs["accuracy"].response_tokens}


def train(config, workdir: str, *, log=print, cluster: Cluster | None = None
          ) -> dict[str, Any]:
    """Runs (or resumes) the experiment `config` in `workdir`; returns the summary (on the
    leader; `{}` on the other processes of a multi-process run, which `follow` it)."""
    started = time.time()
    check_config(config)
    cluster = cluster or Cluster()
    workdir = os.path.abspath(workdir)
    stopping: list[Callable[[], None]] = []  # what a lost process stops, newest first
    cluster.watch(lambda what: _lost(what, cluster, stopping, log))
    if cluster.leader:
        os.makedirs(workdir, exist_ok=True)
        reap_previous(workdir, log=log)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
    else:
        log = _quiet
    task = make_task(config)
    algo = algorithm_of(config)
    trainer, state, meta, warm_info, checkpoints = _learner(config, workdir, task, cluster, log)
    resumed = checkpoints.latest_step() is not None
    # wall_time_s: the earlier runs' seconds up to their last checkpoint, plus this run's
    meta["_wall_time_before"], meta["_started"] = meta["wall_time_s"], started
    stop_compiling = threading.Event()
    precompiling = _precompile_in_background(config, trainer, state, meta, log, stop_compiling)
    if not cluster.leader:
        precompiling.join()
        try:
            return follow(cluster, trainer, state, checkpoints)
        except Exception:
            if cluster.lost.wait(LOST_GRACE_S):  # a collective noticed the leader's end first
                _lost(cluster.lost_what, cluster, stopping, log)
            raise
    step0 = int(state.step)
    _cut_step_log(workdir, step0)
    lockstep = Lockstep(cluster, trainer, checkpoints)

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
        iterator_state=meta.get("iterator_state") or None,
        # The checkpoint's version, before anything is accepted: trajectories from weights it
        # has not published are refused. The log's trajectories from weights published after
        # the checkpoint are kept: the steps after it are redone on the same data, in the same
        # order, so each is taken at the version it was taken at before (no negative lag).
        policy_version=int(state.version), discard_newer=False).start()
    try:
        server.consumed(meta["consumed_ids"])
    except KeyError as e:  # the stream directory was replaced: nothing of it to skip
        log(f"warning: checkpointed trajectory ids unknown to the stream log ({e})")
    children = Children(workdir, log=log, priority=config.rollout.priority,
                        max_restarts=config.rollout.max_restarts)
    supervisor = Supervisor(config, workdir, children,
                            lambda urls: worker_argv(config, task, server, urls, vocab), log=log,
                            save=lockstep.save_weights, write_in_background=not cluster.multi,
                            lag=config.rollout.lag_versions,
                            drain_s=config.rollout.update_drain_s)
    # What a lost process stops (`_lost`), at once: JAX's collectives may abort this process
    # (gloo's SIGABRT) moments after a peer vanished, so the children get no grace period.
    stopping += [lambda: server.stop(grace=0), lambda: children.stop(timeout_s=0),
                 supervisor.close]
    writer = None
    with StopRequests() as stops:
        try:
            with stops.interruptible():
                publisher = supervisor.start(trainer, state)
                if meta["initial_eval"] is None:
                    log(f"evaluating the initial policy on {len(task.eval_rows)} held-out "
                        "prompts ...")
                    meta["initial_eval"] = _eval(config, task, publisher.urls, workdir, 0)
                    log(f"initial held-out accuracy {meta['initial_eval']['accuracy']:.3f} "
                        f"(greedy {meta['initial_eval']['greedy_accuracy']:.3f})")
                supervisor.start_workers()
                precompiling.join()
            writer = EventWriter(os.path.join(workdir, "tb"),
                                 purge_step=step0 + 1 if resumed else None)
            if not resumed:
                for key, value in meta["initial_eval"].items():
                    writer.add_scalar(f"eval/{key}", value, 0)
            state, meta = _loop(config, workdir, task, lockstep, state, meta, server,
                                supervisor, publisher, writer, stops, log)
            children.stop([n for n, _ in children.procs if n.startswith("worker")])
            with stops.interruptible():
                supervisor.finish()
                final_version = int(state.version)
                publisher.wait()
                if publisher.version != final_version or publisher.behind:
                    publisher.publish(trainer.policy_model(state), final_version)
                log(f"evaluating the final policy (version {final_version}) ...")
                with publisher.newest():
                    final = _eval(config, task, publisher.urls, workdir, int(state.step))
            writer.add_scalar("eval/accuracy", final["accuracy"], int(state.step))
            writer.add_scalar("eval/greedy_accuracy", final["greedy_accuracy"],
                              int(state.step))
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                log("\ninterrupted: stopping the engines and workers")
            elif cluster.multi and cluster.lost.wait(LOST_GRACE_S):  # gloo noticed it first
                _lost(cluster.lost_what, cluster, stopping, log)
            supervisor.close()
            children.stop()
            server.stop(grace=0)
            checkpoints.close()
            if writer is not None:
                writer.close()
            # A thread still inside XLA's compiler when Python exits aborts the process
            # ("terminate called ..."): let it finish the program it is on, then stop.
            stop_compiling.set()
            precompiling.wait()
            raise
    children.stop()
    stream = server.metrics()
    server.stop(grace=1)
    writer.close()
    wall = meta["_wall_time_before"] + time.time() - started
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
    lockstep.stop()
    return summary


def _learner(config, workdir: str, task: Task, cluster: Cluster, log):
    """`(trainer, state, meta, warm-start info, checkpointer)`: the policy built and placed
    on the mesh, the critic and optimizers, restored from the newest checkpoint if there is one;
    the same on every process."""
    if not cluster.leader:  # after the leader: its warm start is then in the cache
        cluster.barrier("initial_policy", BUILD_TIMEOUT_S)

    def built() -> None:
        """Placing the policy is collective: every process enters it once all have built theirs
        (at the coordinator, not in a device collective; the followers build after the
        leader)."""
        if cluster.leader:
            cluster.barrier("initial_policy", BUILD_TIMEOUT_S)
        cluster.barrier("policy_built", BUILD_TIMEOUT_S)

    mesh = sharding.make_mesh(mesh_shape(config, jax.device_count()))
    rules = sharding_rules(config)
    policy, warm_info = placed_policy(config, task, log, mesh, rules, built=built)
    trainer = make_trainer(config, policy, len(task.train_rows), mesh=mesh, rules=rules)
    state = trainer.init_state(config.seed)
    checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"),
                               keep=config.keep_checkpoints)
    meta: dict[str, Any] = {"consumed_ids": [], "trajectories": 0, "stale_discarded": 0,
                            "skipped_steps": 0, "policy_from_step": None,
                            "initial_eval": None, "wall_time_s": 0.0, "iterator_state": ""}
    if checkpoints.latest_step() is not None:
        state, meta = checkpoints.restore(state)
        state = trainer.place(state)
        log(f"resuming from the checkpoint of step {int(state.step)} "
            f"(policy version {int(state.version)})")
    return trainer, state, meta, warm_info, checkpoints


_LOST_ONCE = threading.Lock()
LOST_GRACE_S = 10.0  # a collective that failed waits this long for the liveness news


def _lost(what: str, cluster: Cluster, stopping: list, log) -> None:
    """Another process of the run died: say which, stop this one's children, and exit (the
    main thread may be blocked in a collective that would wait for it until JAX's heartbeat
    timeout). Called by the liveness thread, or by the main thread when a collective failed
    because of it (`train`); whichever comes second waits for the first to exit."""
    if not _LOST_ONCE.acquire(blocking=False):
        threading.Event().wait()
    print(f"\nsao_jax: {what} of this {cluster.count}-process run exited; process "
          f"{cluster.index} stops too. Run the same command on every host to resume from the "
          "last checkpoint.", file=sys.stderr, flush=True)
    for stop in reversed(stopping):
        with contextlib.suppress(BaseException):
            stop()
    os._exit(LOST_EXIT_CODE)


def _quiet(*_args, **_kwargs) -> None:
    """The followers' log: the leader says what there is to say."""


def _precompile_in_background(config, trainer: Trainer, state: TrainState, meta, log,
                              stop: threading.Event):
    """Compiles the learner step for every batch shape the run can meet (`step_shapes`, the
    phases still ahead) on a thread, while the engines start and the initial evaluation runs;
    `join()` raises what compiling raised. Setting `stop` ends it after the current program."""
    algo = algorithm_of(config)
    critic_phase = algo.uses_critic and meta["policy_from_step"] is None and (
        config.rl.critic_warmup_steps > 0 or algo.value_pretraining)
    phases = (False, True) if critic_phase else (True,)
    shapes = step_shapes(config, trainer) if config.precompile_steps else []
    return BackgroundThread(lambda: trainer.precompile(state, shapes, phases, stop=stop),
                            name="precompile")


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


def _loop(config, workdir, task, lockstep: Lockstep, state: TrainState, meta, server,
          supervisor: Supervisor, publisher: Publisher, writer: EventWriter,
          stops: StopRequests, log):
    trainer = lockstep.trainer
    algo = trainer.config.algorithm
    collector = BatchCollector(server, config.batch_size, algo.group_size, config.max_staleness)
    progress = Progress(config.total_steps)
    steps_log = open(os.path.join(workdir, "steps.jsonl"), "a")  # noqa: SIM115
    consumed = list(meta["consumed_ids"])
    marked = len(consumed)  # consumed[:marked] are marked consumed in the stream's log
    pending: tuple | None = None  # (step, device metrics, host metrics): fetched one step late
    guard = SkipGuard(log)
    recent_rewards: collections.deque[float] = collections.deque(maxlen=4 * config.batch_size)
    plateau = Plateau.of(config, meta.get("value_pretraining"))
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

    # The host's own counters: reading `state.step` / `state.version` would wait for the step
    # just dispatched, so the next batch could not be collected and built while it runs. They
    # equal the device's (a skipped step still counts its version: `steps.py`), which the
    # checkpoints, where the host waits for the state anyway, check.
    step, version = int(state.step), int(state.version)
    slots = PromptSlots(train_prompts(task))
    try:
        while step < config.total_steps:
            step += 1
            if task.spec.step_in_prompt:  # prompts leased from now on are judged at this step
                server.set_prompt_extra(learner_step=step)
            poll()  # (sync: grants this step's prompts)
            batch, waited = collector.collect(version, poll)
            lags = [policy_lag(t, version) for t in batch]
            update_policy = _policy_updates(config, algo, meta, step)
            prompt_index = [slots.index(t) for t in batch]
            arrays = make_batch(batch, prompt_index=prompt_index, pack_length=packed_to,
                                row_multiple=trainer.row_multiple)
            state, device_metrics = lockstep.step(state, arrays, update_policy)
            new_version = version + update_policy
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
            if task.spec.batch_metrics is not None:  # the environment's own
                host.update(task.spec.batch_metrics([t.env_metadata for t in batch]))
            if pending is not None:
                scalars = flush(pending)
                if "critic/explained_variance" in scalars and meta["policy_from_step"] is None:
                    plateau.update(scalars["critic/explained_variance"])
                    meta["value_pretraining"] = plateau.state()
            pending = (step, device_metrics, host)

            version = new_version
            # Before any engine can sample with it (the publishes below): the stream refuses
            # trajectories that claim a newer version than this.
            server.set_policy_version(version)
            if (update_policy and step < config.total_steps  # the last one: after the loop
                    and version % config.publish_every == 0):
                if config.mode == "async":  # overlaps the next step
                    publisher.submit(trainer, state, version)
                else:  # before the next leases
                    publisher.publish(trainer.policy_model(state), version)
            if step % config.sample_every == 0:
                writer.add_text("samples", "\n\n---\n\n".join(
                    trajectory_text(t, task.tokenizer) for t in batch[:3]), step)
            if config.eval_every and step % config.eval_every == 0 and step < config.total_steps:
                with stops.interruptible():
                    publisher.wait()
                    with publisher.newest():
                        last_eval = _eval(config, task, publisher.urls, workdir,
                                          step)["accuracy"]
                writer.add_scalar("eval/accuracy", last_eval, step)
            for key, value in server.metrics().items():
                writer.add_scalar(key, value, step)
            if step % engine_stats.EVERY == 0 or step == config.total_steps:
                for key, value in engine_stats.read(publisher.urls).items():
                    writer.add_scalar(key, value, step)
            if step % config.checkpoint_every == 0 or step == config.total_steps:
                flush(pending)
                pending = None
                writer.flush()  # before the checkpoint: a resume purges only later steps
                _check_counters(state, step, version)
                meta["consumed_ids"] = consumed
                meta["iterator_state"] = server.iterator_state()
                meta["wall_time_s"] = meta["_wall_time_before"] + time.time() - meta["_started"]
                try:
                    lockstep.save_checkpoint(state, {k: v for k, v in meta.items()
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


def _check_counters(state: TrainState, step: int, version: int) -> None:
    device = int(state.step), int(state.version)
    if device != (step, version):
        raise AssertionError(f"the learner's counters (step {step}, version {version}) differ "
                             f"from its state's (step {device[0]}, version {device[1]})")


def _policy_updates(config, algo: Algorithm, meta, step: int) -> bool:
    """Whether step `step` updates the policy (after the critic warm-up / value pretraining)."""
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


def evaluate_checkpoint(config, checkpoint: str, *, log=print) -> dict[str, Any]:
    """Held-out accuracy of a checkpoint: a run directory (its latest checkpoint), one of its
    `checkpoints/<step>` directories, or a Hugging Face model directory.

    Returns `accuracy` (Pass@1, temperature 1), `greedy_accuracy` and `response_tokens`; where
    the environment has them, its `batch_metrics` of the sampled episodes (e.g. `swe/resolved`,
    `swe/suspicious_*`) and its `eval_notes` of them as `notes` (a list of lines: what the SWE
    monitor saw). The episodes themselves go to `eval/episodes.jsonl` beside the checkpoints
    (`evaluate.write_episodes`), as a training run's evaluations go to `held_out/step_<N>.jsonl`.
    """
    check_config(config)
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
            abstract = trainer.abstract_state(config.seed)
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
        runs = _eval_runs(config, task, [url])
    finally:
        children.stop()
    write_episodes(os.path.join(scratch, "episodes.jsonl"), runs)
    log(f"the held-out episodes: {os.path.join(scratch, 'episodes.jsonl')}")
    out: dict[str, Any] = _scores(runs)
    sampled = runs["accuracy"].env_metadata
    if task.spec.batch_metrics is not None:
        out.update(task.spec.batch_metrics(sampled))
    if task.spec.eval_notes is not None:
        out["notes"] = task.spec.eval_notes(sampled)
    return out
