"""Asynchronous vs synchronous RL on heavy-tailed episodes: wall clock for the same trajectories.

    python benchmarks/bench_async.py                       # ~1 minute of training per mode
    python benchmarks/bench_async.py --steps 20            # a quick look

Both runs train the toy policy (`experiments/toy.py`, random init: this measures the system, not
learning) for the same number of steps of the same batch size, same seed, on the `long_tail`
task: episodes of a log-normal number of turns (median 2, p99 about 10x that; `envs/long_tail.py`),
one embedded engine and one worker. Everything shares this machine's CPUs, so what async can win
is bounded by the CPU that sync leaves idle while it waits for stragglers.
  sync   grants one batch of prompts, waits for every episode of it, trains, publishes, repeats:
         each step waits for the slowest episode of its batch while the engine's batch drains;
  async  keeps every worker slot busy plus one batch waiting (`build.admission_limit`: 64 +
         16 prompts in flight here) and trains on whole batches as trajectories arrive, so the
         learner works while stragglers finish and the engine's batch stays full.
         max_staleness defaults to 24: a version takes ~0.13 s and the longest episodes span
         more than 16 of them, so at 16 (150 steps) 44-54 were dropped and re-issued, the
         learner waited 13-18% of the time and trained on a lighter tail (p99 139-148 tokens
         against sync's 157); at 24 none are (lag max 18-24), the learner waits 1-5%, and async
         trains on the same tail as sync. Compare the `tok` and `stale` columns.
Both modes let a weight update wait up to 12 ms (`--drain`, `config.rollout.update_drain_s`) for
the engine's running turns, at most 4 tokens each, to finish before it cuts the rest: a cut turn
is resubmitted and prefilled again, its whole history, under the new weights. Async publishes
while turns run (a version every ~0.13 s), so without the drain 27-29% of its requests were cut;
sync publishes between batches, when nothing runs.
The learner's step is compiled first for every batch shape a run can meet, into a fresh JAX
compilation cache that both runs share; each run then loads those programs on a thread while
it starts and through its first steps (`config.precompile_steps`; a step waits only for its
own), so neither timed loop compiles, though both pay the loading's CPU. An untimed run of 2 steps
(`--warmup-steps`) then puts the engines' programs in that cache too and pays this process's
one-time start-up, which the first timed run (async) used to pay alone.

Printed per mode, from the run's TensorBoard events and stream log:
  loop s    from the first step's start (the initial-eval event, written just before the loop)
            to the last step's stream metrics;
  jit s     of that, the time this process spent tracing, lowering, compiling or loading
            compiled programs, on any thread (the step's programs load beside the loop);
  setup s   before the loop: engine start-up, loading the compiled programs, the initial
            evaluation;
  train s   the whole `train()` call, the final evaluation and checkpoint included;
  traj/s    trajectories trained on per second of the loop;
  idle      the learner's `time/learner_idle_frac` (waiting for trajectories), mean over steps;
  lag       `rollout/policy_lag_mean` averaged over steps, and the largest `policy_lag_max`;
  stale     trajectories discarded as more than max_staleness versions old (prompt re-issued);
  tok       percentiles of the response tokens of the trajectories trained on, and their turns;
  cpu L, R  CPU seconds (user + system) of the whole train() call: the learner's process, and
            the rollout processes (engine and worker) it started.
Then the ratios sync / async of the loop times (also less each run's jit s) and of train().
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_config(args, mode: str, cache_dir: str, steps: int):
    if REPO not in sys.path:
        sys.path.insert(0, REPO)  # experiments/ is not an installed package
    from experiments import toy

    config = toy.get_config().unlock()
    config.name = f"bench_async_{mode}"
    config.mode = mode
    config.seed = args.seed
    config.total_steps = steps
    config.batch_size = args.batch
    config.max_staleness = args.max_staleness
    config.pack_rows = not args.no_pack
    config.rollout.priority = args.priority
    config.rollout.update_drain_s = args.drain
    config.checkpoint_every = 10**6  # one checkpoint, at the end
    config.sample_every = 10**6
    config.compilation_cache = True
    config.warm_start.enabled = False
    config.warm_start.cache_dir = cache_dir  # holds the JAX compilation cache
    config.env.name = "long_tail"
    config.env.max_turns = args.max_turns
    config.env.max_action_tokens = args.max_action_tokens
    config.env.max_response_tokens = args.max_response_tokens
    config.env.num_train_prompts = 4096
    config.env.num_eval_prompts = args.eval_prompts
    config.rollout.engine_max_seq_len = args.max_response_tokens + 31  # + the prompt: rows
    # of at most 255 tokens, learner batches of at most 256
    config.rollout.engine_max_batch = args.engine_batch
    config.rollout.worker_concurrency = args.engine_batch
    return config


def precompile(config) -> int:
    """Fills the persistent compilation cache with the learner step programs a run compiles while
    it starts (`config.precompile_steps`: every batch shape, both phases), so neither timed run
    pays a cold compile; returns how many programs it compiled."""
    import jax

    from sao_jax.train import build, sharding
    from sao_jax.train.tasks import make_task

    build.setup_compilation_cache(config)
    task = make_task(config)
    policy, _ = build.initial_policy(config, task, print)
    policy = build.training_layout(config, policy)  # the layout the run trains
    mesh = sharding.make_mesh(build.mesh_shape(config, jax.device_count()))
    rules = build.sharding_rules(config)
    trainer = build.make_trainer(config, sharding.shard_model(policy, mesh, rules),
                                   len(task.train_rows), mesh=mesh, rules=rules)
    return trainer.precompile(trainer.init_state(config.seed),
                              build.step_shapes(config, trainer), (False, True))


class CompileTimer:
    """When and for how long this process traces, lowers and compiles (or loads from the
    persistent cache) a jitted program: time the learner's loop stands still for JAX."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        import jax

        self.events: list[tuple[float, float]] = []  # (time it ended, seconds)
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _record(self, event: str, duration: float, **_) -> None:
        if event in self.EVENTS:
            self.events.append((time.time(), duration))

    def seconds(self, start: float, end: float) -> float:
        return sum(d for t, d in self.events if start <= t <= end)


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float, float]]]:
    """`{tag: [(step, wall_time, value), ...]}` of every scalar in the run's event files."""
    from sao_jax.train.events import read_events

    scalars = collections.defaultdict(list)
    for event in read_events(logdir):
        for value in event.summary.value:
            if value.HasField("simple_value"):
                scalars[value.tag].append((event.step, event.wall_time, value.simple_value))
    return scalars


def trained_lengths(workdir: str) -> tuple[np.ndarray, np.ndarray]:
    """(response tokens, turns) of every trajectory a step trained on, from the stream's log."""
    from sao_jax.rollout.stream import LOG_NAME, TrajectoryLog
    from sao_jax.rollout.trajectory import Trajectory

    with open(os.path.join(workdir, "steps.jsonl")) as f:
        used = {i for line in f if line.strip() for i in json.loads(line)["ids"]}
    tokens, turns = [], []
    for record in TrajectoryLog(os.path.join(workdir, "stream", LOG_NAME)).records():
        if record.WhichOneof("kind") == "accepted" and record.accepted.trajectory_id in used:
            t = Trajectory.from_proto(record.accepted)
            tokens.append(t.length)
            turns.append(t.env_metadata["turns"])
    if len(tokens) != len(used):
        raise RuntimeError(f"{workdir}: found {len(tokens)} of the {len(used)} trained "
                           "trajectories in the stream's log")
    return np.array(tokens), np.array(turns)


@contextlib.contextmanager
def stdout_to(path: str):
    """Sends file descriptor 1 (the learner's progress bar and log lines) to `path`."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run(config, workdir: str, timer: CompileTimer) -> dict:
    from sao_jax.train import learner

    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run, not a resumed one
    os.makedirs(workdir)
    out = os.path.join(workdir, "train.out")
    cpu_start = cpu_seconds()
    start, wall_start = time.perf_counter(), time.time()
    try:
        with stdout_to(out):
            summary = learner.train(config, workdir)
    except BaseException:
        with open(out, errors="replace") as f:
            print(f.read()[-3000:])
        raise
    total = time.perf_counter() - start
    cpu = [b - a for a, b in zip(cpu_start, cpu_seconds(), strict=True)]
    scalars = read_scalars(os.path.join(workdir, "tb"))
    loop_start = min(t for s, t, _ in scalars["eval/accuracy"] if s == 0)
    loop_end = max(t for s, t, _ in scalars["stream/accepted"] if s == config.total_steps)
    tokens, turns = trained_lengths(workdir)
    errors = []
    for path in sorted(glob.glob(os.path.join(workdir, "logs", "*.log"))):
        with open(path, errors="replace") as f:
            errors += [f"{os.path.basename(path)}: {line.strip()}" for line in f
                       if "Traceback" in line or "ERROR" in line]
    return {
        "summary": summary, "train_s": total, "loop_s": loop_end - loop_start,
        "jit_s": timer.seconds(loop_start, loop_end), "setup_s": loop_start - wall_start,
        "idle": np.mean([v for _, _, v in scalars["time/learner_idle_frac"]]),
        "lag": np.mean([v for _, _, v in scalars["rollout/policy_lag_mean"]]),
        "lag_max": max(v for _, _, v in scalars["rollout/policy_lag_max"]),
        "tokens": tokens, "turns": turns, "errors": errors, "cpu": cpu,
        "engine": {tag.removeprefix("engine/"): values[-1][2] for tag, values in scalars.items()
                   if tag.startswith("engine/")},
    }


def cpu_seconds() -> tuple[float, float]:
    """(this process, its reaped children): user + system CPU seconds so far."""
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                         resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def main() -> None:
    from sao_jax.train.processes import Children

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="learner steps per mode")
    parser.add_argument("--batch", type=int, default=16, help="trajectories per step")
    parser.add_argument("--max-staleness", type=int, default=24,
                        help="async: policy versions a trajectory may lag; lower, long "
                             "episodes outlive it and are dropped, so async trains on a "
                             "lighter tail than sync and regenerates what it drops")
    parser.add_argument("--max-turns", type=int, default=24)
    parser.add_argument("--max-action-tokens", type=int, default=4,
                        help="short actions: many turns (each a round trip) per token")
    parser.add_argument("--max-response-tokens", type=int, default=224,
                        help="24 turns of 4-token actions and 5-token observations fit")
    parser.add_argument("--engine-batch", type=int, default=64,
                        help="engine KV slots = worker concurrency")
    parser.add_argument("--eval-prompts", type=int, default=8)
    parser.add_argument("--drain", type=float, default=0.012,
                        help="config.rollout.update_drain_s: how long a weight update lets "
                             "running requests finish before it cuts them (0.012 s: about five "
                             "decode steps of this engine here, more than a turn's 4 tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="an untimed run of this many steps first (0: none), so that the "
                             "engines' programs are in the compilation cache and this "
                             "process's one-time start-up is paid before either timed run, "
                             "not by the first")
    parser.add_argument("--priority", default="low", choices=Children.PRIORITIES,
                        help="config.rollout.priority: the engine's and worker's CPU priority")
    parser.add_argument("--no-pack", action="store_true",
                        help="one padded row per trajectory (config.pack_rows=False) instead of "
                             "several trajectories per model row")
    parser.add_argument("--keep", default="",
                        help="work (and keep the runs and compilation cache) in this directory")
    args = parser.parse_args()

    if args.keep:
        compare(args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="bench_async_") as root:
            compare(args, root)


def compare(args, root: str) -> None:
    from _table import print_header

    from sao_jax.train.tasks import make_task

    cache = os.path.join(root, "cache")
    probe = make_task(make_config(args, "async", cache, args.steps))
    turns = np.array([r["turns"] for r in probe.train_rows])
    p50, p90, p99 = np.percentile(turns, [50, 90, 99])
    print(f"long_tail prompts: {len(turns)}, turns p50 {p50:g} p90 {p90:g} p99 {p99:g} "
          f"max {turns.max()} mean {turns.mean():.2f} (p99/p50 {p99 / p50:.1f}); "
          f"batch {args.batch} x {args.steps} steps = {args.batch * args.steps} trajectories "
          f"per mode, max_staleness {args.max_staleness}")
    timer = CompileTimer()
    start = time.perf_counter()
    count = precompile(make_config(args, "async", cache, args.steps))
    print(f"compiled {count} learner step programs (batch shapes x phases) in "
          f"{time.perf_counter() - start:.0f} s (cached for both runs)")
    if args.warmup_steps:
        start = time.perf_counter()
        run(make_config(args, "async", cache, args.warmup_steps), os.path.join(root, "warmup"),
            timer)
        print(f"warm-up run of {args.warmup_steps} steps, untimed: "
              f"{time.perf_counter() - start:.1f} s")

    results, loads = {}, []
    for mode in ("async", "sync"):
        loads.append(os.getloadavg()[0])
        results[mode] = run(make_config(args, mode, cache, args.steps), os.path.join(root, mode),
                            timer)
    loads.append(os.getloadavg()[0])

    print_header(f"{'mode':>5} {'loop s':>7} {'jit s':>6} {'setup s':>7} {'train s':>7} "
                 f"{'traj/s':>7} {'idle':>5} {'lag':>5} {'lag max':>7} {'stale':>5} "
                 f"{'tok p50':>7} {'p90':>5} {'p99':>5} {'p99/p50':>7} {'turns':>5} "
                 f"{'cpu L':>6} {'cpu R':>6}")
    for mode, r in results.items():
        s = r["summary"]
        t50, t90, t99 = np.percentile(r["tokens"], [50, 90, 99])
        print(f"{mode:>5} {r['loop_s']:>7.1f} {r['jit_s']:>6.1f} {r['setup_s']:>7.1f} "
              f"{r['train_s']:>7.1f} {s['trajectories'] / r['loop_s']:>7.1f} {r['idle']:>5.0%} "
              f"{r['lag']:>5.2f} {r['lag_max']:>7.0f} {s['stale_discarded']:>5} {t50:>7.0f} "
              f"{t90:>5.0f} {t99:>5.0f} {t99 / t50:>7.1f} {r['turns'].mean():>5.2f} "
              f"{r['cpu'][0]:>6.1f} {r['cpu'][1]:>6.1f}")
    # Where generation's CPU goes (sao_jax/train/engine_stats.py, the engines' counters): an
    # aborted request is resubmitted and prefilled again; emptier decode batches cost more steps.
    print_header(f"{'mode':>5} {'requests':>8} {'prefills':>8} {'aborted':>7} "
                 f"{'decode steps':>12} {'tokens/step':>11} {'steps/traj':>10} "
                 f"{'prefill s':>9} {'decode s':>8} {'cached':>6}")
    for mode, r in results.items():
        e = r["engine"]
        cached = e.get("cached_tokens", 0)  # prompt tokens found in the prefix cache
        requests = e.get("finish_stop", 0) + e.get("finish_length", 0) + e.get("finish_abort", 0)
        print(f"{mode:>5} {requests:>8.0f} {e.get('prefills', 0):>8.0f} "
              f"{e.get('aborted_frac', 0):>7.1%} {e.get('decode_steps', 0):>12.0f} "
              f"{e.get('decode_batch_mean', 0):>11.2f} "
              f"{e.get('decode_steps', 0) / max(r['summary']['trajectories'], 1):>10.2f} "
              f"{e.get('prefill_s', 0):>9.1f} {e.get('decode_s', 0):>8.1f} "
              f"{cached / max(cached + e.get('prefill_tokens', 0), 1):>6.0%}")
    a, b = results["async"], results["sync"]
    print(f"sync / async wall clock: loop {b['loop_s'] / a['loop_s']:.2f}x, loop less jit "
          f"{(b['loop_s'] - b['jit_s']) / (a['loop_s'] - a['jit_s']):.2f}x, whole train() "
          f"{b['train_s'] / a['train_s']:.2f}x")
    print(f"1-min load average before async {loads[0]:.1f}, before sync {loads[1]:.1f}, after "
          f"{loads[2]:.1f} on {os.cpu_count()} CPUs (this benchmark adds about 2; more means "
          "other work shared the CPUs)")
    for mode, r in results.items():
        for line in r["errors"][:5]:
            print(f"{mode} child log: {line}")

if __name__ == "__main__":
    main()
