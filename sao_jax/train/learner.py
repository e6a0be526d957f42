"""The SAO learner end to end: `train(config, workdir)` is what `make train` runs.

    prompts (grain, in the stream log) ──lease──▶ worker(s) ──HTTP──▶ engine(s)
          ▲                                          │ trajectories (gRPC, fsynced log)
          │                                          ▼
      learner: take batch (whole groups, drop stale) ─▶ jitted step ─▶ publish v+1 ─▶ checkpoint

`train` builds the run (the policy, restored or warm-started; the trajectory stream; the engines
and workers under a `Supervisor`, whose `Publisher` keeps the engines' weights current),
evaluates the initial policy, runs the loop (`loop.Loop`: one explicit `LoopState`, a short step,
and hooks, each at its period: publishing every `publish_every` policy versions, samples every
`sample_every` steps, evaluations every `eval_every`, the stream's and the engines' counters,
checkpoints every `checkpoint_every` and at the end, the progress line), then publishes and
evaluates the final policy and writes `summary.json`.

Asynchronous mode trains on single rollouts as they arrive; admission keeps a bounded number of
prompts in flight (leased or queued; `admission_limit`: by default every rollout slot busy and
one batch waiting, at most `max(1, max_staleness) * batch_size`), so a trajectory usually lags
fewer than `max_staleness` versions behind, and one more than `max_staleness` versions old (a
straggler) is dropped and its prompt issued again; new weights are written and loaded on a
background thread while the next step runs. Synchronous mode grants exactly one batch of
prompts, waits for all of it, trains, publishes, and grants the next: the baseline the async
benchmark compares against. Every lease carries the learner's step when it was handed out
(`Prompt.learner_step`), for an environment whose reward moves with training.

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

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from sao_jax.models import save_hf
from sao_jax.rollout.stream import TrajectoryServer
from sao_jax.train import engine_stats, sharding
from sao_jax.train.build import (
    admission_limit,
    algorithm_of,
    check_config,
    compilation_cache_dir,
    make_trainer,
    master_dtype,
    mesh_shape,
    placed_policy,
    policy_skeleton,
    prompt_dataset,
    route_shape,
    sharding_rules,
    step_shapes,
)
from sao_jax.train.checkpoint import Checkpointer
from sao_jax.train.collect import grant_one_batch
from sao_jax.train.console import StopRequests
from sao_jax.train.distributed import LOST_EXIT_CODE, Cluster
from sao_jax.train.evaluate import held_out, held_out_runs, scores, write_episodes
from sao_jax.train.events import EventWriter
from sao_jax.train.lockstep import Lockstep, follow
from sao_jax.train.loop import (
    STEPS_LOG,
    Hook,
    Loop,
    LoopState,
    ProgressLine,
    evaluate,
    publish,
    save_checkpoint,
    write_engine_metrics,
    write_samples,
    write_stream_metrics,
)
from sao_jax.train.optimizers import rounded_away_share
from sao_jax.train.processes import Children, reap_previous
from sao_jax.train.publish import Publisher
from sao_jax.train.state import TrainState
from sao_jax.train.steps import Trainer
from sao_jax.train.supervisor import BackgroundThread, Supervisor, worker_argv
from sao_jax.train.tasks import Task, make_task

BUILD_TIMEOUT_S = 7200  # the followers wait this long for the leader's policy (a warm start)


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
    log = _open_workdir(config, workdir, cluster, log)
    task = make_task(config)
    trainer, state, meta, warm_info, checkpoints = _learner(config, workdir, task, cluster, log)
    resumed = checkpoints.latest_step() is not None
    stop_compiling = threading.Event()
    precompiling = _precompile_in_background(config, trainer, state, meta, log, stop_compiling)
    if not cluster.leader:
        return _follow(cluster, trainer, state, checkpoints, precompiling, stopping, log)
    _cut_step_log(workdir, int(state.step))
    lockstep = Lockstep(cluster, trainer, checkpoints)
    server = _stream(config, task, workdir, trainer, state, meta, log)
    children, supervisor = _children(config, task, workdir, server, lockstep, cluster, log)
    # What a lost process stops (`_lost`), at once: JAX's collectives may abort this process
    # (gloo's SIGABRT) moments after a peer vanished, so the children get no grace period.
    stopping += [lambda: server.stop(grace=0), lambda: children.stop(timeout_s=0),
                 supervisor.close]
    writer = None
    with StopRequests() as stops:
        try:
            with stops.interruptible():
                publisher = supervisor.start(trainer, state)
                # The workers play the initial weights' episodes while the initial evaluation
                # runs (sync: its first batch), so the loop starts with them on their way. The
                # step's programs go on compiling through the first steps: a step waits only
                # for its own (`programs.Programs`).
                if config.mode == "sync":
                    grant_one_batch(server, config.batch_size)
                supervisor.start_workers()
                _evaluate_initial(config, task, workdir, publisher, meta, log)
            writer = _event_writer(workdir, int(state.step), meta, resumed)
            hooks = _hooks(config, task, workdir, lockstep, server, publisher, writer, stops)
            s = Loop(config, task, lockstep, server, supervisor, stops, writer, workdir, hooks,
                     log=log).run(LoopState.start(config, state, meta, started=started, log=log))
            stop_compiling.set()  # programs for shapes the run did not meet
            precompiling.join()
            if config.precompile_steps:
                log(f"learner step programs: {trainer.programs.report()}")
            children.stop([n for n, _ in children.procs if n.startswith("worker")])
            final = _evaluate_final(config, task, workdir, trainer, supervisor, publisher,
                                    writer, s, stops, log)
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
    summary = _write_summary(config, task, workdir, s, final, stream, warm_info, started)
    checkpoints.close()
    lockstep.stop()
    return summary


def _hooks(config, task: Task, workdir: str, lockstep: Lockstep, server: TrajectoryServer,
           publisher: Publisher, writer: EventWriter, stops: StopRequests) -> list[Hook]:
    """What runs after a step (`loop.Hook`), in this order, each at its period."""
    progress = ProgressLine(config.total_steps)
    return [
        Hook(publish(config, lockstep.trainer, publisher), every=config.publish_every,
             versions=True, last=False),  # the last: the run's end publishes it
        Hook(write_samples(writer, task.tokenizer), every=config.sample_every),
        Hook(evaluate(config, task, workdir, publisher, writer, stops),
             every=config.eval_every, last=False),  # the last: the run's end evaluates it
        Hook(write_stream_metrics(server, writer)),
        Hook(write_engine_metrics(publisher, writer), every=engine_stats.EVERY, last=True),
        Hook(save_checkpoint(lockstep, server, writer), every=config.checkpoint_every,
             last=True),
        Hook(progress, close=progress.close),
    ]


def _open_workdir(config, workdir: str, cluster: Cluster, log):
    """The leader makes `workdir`, stops what a previous run there left running and writes
    `config.json`; returns the log this process writes to (the followers keep quiet)."""
    if not cluster.leader:
        return _quiet
    os.makedirs(workdir, exist_ok=True)
    reap_previous(workdir, log=log)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))
    return log


def _follow(cluster: Cluster, trainer: Trainer, state: TrainState, checkpoints: Checkpointer,
            precompiling: BackgroundThread, stopping: list, log) -> dict:
    """A follower's run: the leader's computations (`lockstep.follow`) once compiled."""
    precompiling.join()
    try:
        return follow(cluster, trainer, state, checkpoints)
    except Exception:
        if cluster.lost.wait(LOST_GRACE_S):  # a collective noticed the leader's end first
            _lost(cluster.lost_what, cluster, stopping, log)
        raise


def _children(config, task: Task, workdir: str, server: TrajectoryServer, lockstep: Lockstep,
              cluster: Cluster, log) -> tuple[Children, Supervisor]:
    """The run's engines and workers (`Children`, none started yet) and their `Supervisor`,
    whose publisher writes the weights through `lockstep` (every process its share)."""
    children = Children(workdir, log=log, priority=config.rollout.priority,
                        max_restarts=config.rollout.max_restarts)
    vocab = lockstep.trainer.cfg.vocab_size
    routes = route_shape(config, lockstep.trainer.cfg)
    supervisor = Supervisor(config, workdir, children,
                            lambda urls: worker_argv(config, task, server, urls, vocab, routes),
                            log=log,
                            save=lockstep.save_weights, write_in_background=not cluster.multi,
                            lag=config.rollout.lag_versions,
                            drain_s=config.rollout.update_drain_s)
    return children, supervisor


def _stream(config, task: Task, workdir: str, trainer: Trainer, state: TrainState, meta,
            log) -> TrajectoryServer:
    """The trajectory stream, started, with the checkpoint's trajectories marked consumed."""
    routes = route_shape(config, trainer.cfg)  # the routes a trajectory must fit, if any
    server = TrajectoryServer(
        os.path.join(workdir, "stream"), vocab_size=trainer.cfg.vocab_size,
        prompts=prompt_dataset(task, config.seed),
        routes=None if routes is None else (*routes, trainer.cfg.num_experts),
        max_length=config.rollout.engine_max_seq_len, maxsize=max(config.rollout.queue_size,
                                                                  2 * config.batch_size),
        max_in_flight=admission_limit(config),
        lease_budget=0 if config.mode == "sync" else None,
        group_size=algorithm_of(config).group_size,
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
    return server


def _evaluate_initial(config, task: Task, workdir: str, publisher: Publisher, meta,
                      log) -> None:
    """The initial policy's held-out scores, into `meta` (a resumed run has them already)."""
    if meta["initial_eval"] is None:
        log(f"evaluating the initial policy on {len(task.eval_rows)} held-out prompts ...")
        meta["initial_eval"] = held_out(config, task, publisher.urls, workdir, 0)
        log(f"initial held-out accuracy {meta['initial_eval']['accuracy']:.3f} "
            f"(greedy {meta['initial_eval']['greedy_accuracy']:.3f})")


def _event_writer(workdir: str, step: int, meta, resumed: bool) -> EventWriter:
    """The TensorBoard log from `step` on: a resumed run's hides the killed run's events after
    its checkpoint (`purge_step`); a fresh run's starts with the initial evaluation."""
    writer = EventWriter(os.path.join(workdir, "tb"), purge_step=step + 1 if resumed else None)
    if not resumed:
        for key, value in meta["initial_eval"].items():
            writer.add_scalar(f"eval/{key}", value, 0)
    return writer


def _evaluate_final(config, task: Task, workdir: str, trainer: Trainer,
                    supervisor: Supervisor, publisher: Publisher, writer: EventWriter,
                    s: LoopState, stops: StopRequests, log) -> dict[str, float]:
    """The final policy's held-out scores, once the engines serve it (published here if the
    loop's last step left it out), logged at the last step. The workers have stopped."""
    with stops.interruptible():
        supervisor.finish()
        publisher.wait()
        if publisher.version != s.version or publisher.behind:
            publisher.publish(trainer.policy_model(s.state), s.version)
        log(f"evaluating the final policy (version {s.version}) ...")
        with publisher.newest():
            final = held_out(config, task, publisher.urls, workdir, s.step)
    writer.add_scalar("eval/accuracy", final["accuracy"], s.step)
    writer.add_scalar("eval/greedy_accuracy", final["greedy_accuracy"], s.step)
    return final


def _write_summary(config, task: Task, workdir: str, s: LoopState, final: dict[str, float],
                   stream: dict, warm_info: dict, started: float) -> dict[str, Any]:
    """Writes and returns `summary.json`: the run's scores, counts and times."""
    meta = s.meta
    summary = {
        "experiment": config.name, "algo": config.algo, "mode": config.mode,
        "initial_eval_accuracy": meta["initial_eval"]["accuracy"],
        "final_eval_accuracy": final["accuracy"],
        "initial_greedy_accuracy": meta["initial_eval"]["greedy_accuracy"],
        "final_greedy_accuracy": final["greedy_accuracy"],
        "steps": s.step, "policy_version": s.version,
        "trajectories": meta["trajectories"], "stale_discarded": meta["stale_discarded"],
        "skipped_steps": meta["skipped_steps"], "wall_time_s": round(s.wall_time_s(), 1),
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
    # every process counts (the count is collective over the sharded parameters); one says it
    if (warning := rounding_warning(config, state.policy)) and cluster.leader:
        log(warning)
    return trainer, state, meta, warm_info, checkpoints


ROUNDED_AWAY_LIMIT = 0.05  # of the policy's parameters: more, and the run says so


def rounding_warning(config, policy_params) -> str | None:
    """What to say when the learner keeps the policy in a 16-bit float
    (`config.model.master_dtype`), where AdamW adds its update, and an update of the policy's
    learning rate would leave more than `ROUNDED_AWAY_LIMIT` of its parameters as they are
    (`rounded_away_share`)."""
    dtype = master_dtype(config)
    if dtype.itemsize > 2:
        return None
    lr = config.optim.policy.learning_rate
    share = rounded_away_share(policy_params, lr)
    if share <= ROUNDED_AWAY_LIMIT:
        return None
    return (f"warning: the learner keeps the policy in {dtype.name} and updates it there: an "
            f"update of the policy's learning rate ({lr:g}) leaves {share:.0%} of its "
            "parameters as they are. Where the updates must count, keep float32 master weights "
            "(--config.model.master_dtype=float32; docs/algorithm.md, \"The training-inference "
            "gap\").")


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
    phases still ahead) on a thread, while the engines start, the initial evaluation and the
    first steps run; `join()` raises what compiling raised. Setting `stop` ends it after the
    current program."""
    algo = algorithm_of(config)
    critic_phase = algo.uses_critic and meta["policy_from_step"] is None and (
        config.rl.critic_warmup_steps > 0 or algo.value_pretraining)
    phases = (False, True) if critic_phase else (True,)
    shapes = step_shapes(config, trainer) if config.precompile_steps else []
    return BackgroundThread(lambda: trainer.precompile(state, shapes, phases, stop=stop),
                            name="precompile")


def _cut_step_log(workdir: str, step: int) -> None:
    """Drops `steps.jsonl` records after `step` (they belong to a run that did not checkpoint)."""
    path = os.path.join(workdir, STEPS_LOG)
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


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
        runs = held_out_runs(config, task, [url])
    finally:
        children.stop()
    write_episodes(os.path.join(scratch, "episodes.jsonl"), runs)
    log(f"the held-out episodes: {os.path.join(scratch, 'episodes.jsonl')}")
    out: dict[str, Any] = scores(runs)
    sampled = runs["accuracy"].env_metadata
    if task.spec.batch_metrics is not None:
        out.update(task.spec.batch_metrics(sampled))
    if task.spec.eval_notes is not None:
        out["notes"] = task.spec.eval_notes(sampled)
    return out
