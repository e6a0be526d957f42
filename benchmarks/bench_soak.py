"""Soak: a long toy run, watching every process's memory and the stream's accounting.

    python benchmarks/bench_soak.py               # = make bench-soak: 1000 steps, ~4 min on 2 cores
    python benchmarks/bench_soak.py --steps 200      # a quick look
    python benchmarks/bench_soak.py --args='--config.rollout.num_engines=2'

Runs `python -m sao_jax.main --config=experiments/toy.py` (the embedded default: one engine, one
worker, batches of 32; no warm start, which measures nothing here, and its own JAX cache) in a
fresh directory, and samples the resident memory (`VmRSS` in /proc/<pid>/status) of the learner
and of every engine and worker it started, every `--every` seconds, with the learner's step.

PASS when both hold:
  memory      after the warm-up (the first 10% of the steps: compilation, caches, allocator
              pools filling), no process grows by 10% or more: the median of its samples in the
              last 10% of the steps against the median of those in the 10% after the warm-up;
  accounting  the stream balances: every trajectory the log accepted was trained on once
              (`steps.jsonl`), discarded as stale (as many as the learner counted), or is still
              pending (accepted, neither); none was trained twice or trained and not retired.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from sao_jax.rollout import stream  # noqa: E402

WARMUP = 0.10  # of the steps
GROWTH_LIMIT = 0.10


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def children_of(pid: int) -> dict[str, int]:
    """`{name: pid}` of the engines and workers the learner `pid` started (they carry
    `--parent-pid`), named by module and pid."""
    found = {}
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                argv = [a.decode() for a in f.read().split(b"\0")]
        except OSError:
            continue
        if "--parent-pid" in argv and argv[argv.index("--parent-pid") + 1] == str(pid):
            child = int(path.split("/")[2])
            kind = "engine" if "sao_jax.engine.server" in argv else "worker"
            found[f"{kind}[{child}]"] = child
    return found


def step_of(workdir: str) -> int:
    path = os.path.join(workdir, "steps.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def growth(samples: list[tuple[float, int, float]], steps: int) -> tuple[float, float, float]:
    """`(MiB after the warm-up, MiB at the end, growth)` of one process's `(time, step, MiB)`
    samples; nan when a window has no sample."""
    lo, hi = WARMUP * steps, 2 * WARMUP * steps
    base = [m for _, s, m in samples if lo < s <= hi]
    end = [m for _, s, m in samples if s > (1 - WARMUP) * steps]
    if not base or not end:
        return float("nan"), float("nan"), float("nan")
    b, e = statistics.median(base), statistics.median(end)
    return b, e, e / b - 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=float, default=3.0, help="seconds between samples")
    parser.add_argument("--args", default="", help="more --config overrides")
    parser.add_argument("--workdir", default=None, help="default: a fresh temporary directory")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="sao_soak_")
    os.makedirs(workdir, exist_ok=True)
    cache = os.path.join(workdir, "cache")
    argv = [sys.executable, "-m", "sao_jax.main", "--config=experiments/toy.py",
            f"--workdir={os.path.join(workdir, 'run')}", f"--config.total_steps={args.steps}",
            "--config.warm_start.enabled=False", *shlex.split(args.args)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", XDG_CACHE_HOME=cache)
    env.pop("XLA_FLAGS", None)
    run = os.path.join(workdir, "run")
    print(f"soak: {' '.join(argv[1:])}\n  output in {workdir}/learner.out", flush=True)
    samples: dict[str, list[tuple[float, int, float]]] = {}
    start = time.monotonic()
    with open(os.path.join(workdir, "learner.out"), "w") as out:
        learner = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
        last_print = 0.0
        while learner.poll() is None:
            now, step = time.monotonic() - start, step_of(run)
            for name, pid in {"learner": learner.pid, **children_of(learner.pid)}.items():
                mib = rss_mib(pid)
                if mib is not None:
                    samples.setdefault(name, []).append((now, step, mib))
            if now - last_print > 60:
                last_print = now
                total = sum(s[-1][2] for s in samples.values() if s[-1][0] == now)
                print(f"  {now:6.0f} s  step {step:5d}  RSS {total:7.0f} MiB in "
                      f"{len(samples)} processes", flush=True)
            time.sleep(args.every)
    wall = time.monotonic() - start
    if learner.returncode:
        with open(os.path.join(workdir, "learner.out")) as f:
            print(f.read()[-3000:])
        print(f"FAIL: the learner exited with code {learner.returncode}")
        return 1

    print(f"\n{args.steps} steps in {wall / 60:.1f} min; memory (VmRSS, MiB): after the warm-up "
          f"(steps {WARMUP * args.steps:.0f}-{2 * WARMUP * args.steps:.0f}) -> the last "
          f"{WARMUP:.0%} of the steps")
    header = f"{'process':<22}{'samples':>8}{'peak':>9}{'after':>9}{'end':>9}{'growth':>9}"
    print(header + "\n" + "-" * len(header))
    memory_ok = True
    for name, rows in samples.items():
        base, end, g = growth(rows, args.steps)
        ok = g < GROWTH_LIMIT  # nan (a process that did not live through both windows): fails
        memory_ok &= ok
        print(f"{name:<22}{len(rows):>8}{max(m for *_, m in rows):>9.0f}{base:>9.0f}{end:>9.0f}"
              f"{g:>+9.1%}{'' if ok else '  <-'}")

    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run, "steps.jsonl")) as f:
        trained_list = [i for line in f if line.strip() for i in json.loads(line)["ids"]]
    trained = set(trained_list)
    book = stream.Ledger.read(os.path.join(run, "stream", stream.LOG_NAME))
    discarded = book.retired - trained
    pending = book.pending
    checks = {
        "no trajectory trained twice": len(trained_list) == len(trained),
        "every trained one accepted and retired": trained <= book.retired <= book.accepted,
        "retired, not trained = the learner's stale count":
            len(discarded) == summary["stale_discarded"],
        f"{args.steps} steps, all in steps.jsonl": summary["steps"] == args.steps
            and len(trained_list) == summary["trajectories"],
    }
    print(f"\nstream: accepted {len(book.accepted)} = trained {len(trained)} + discarded as "
          f"stale {len(discarded)} + pending {len(pending)} (the learner counted "
          f"{summary['stale_discarded']} stale)")
    for check, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {check}")
    passed = memory_ok and all(checks.values())
    print(f"\n{'PASS' if passed else 'FAIL'}: memory growth after warm-up "
          f"{'<' if memory_ok else '>='} {GROWTH_LIMIT:.0%} in every process; accounting "
          f"{'balances' if all(checks.values()) else 'does not balance'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
