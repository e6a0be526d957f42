"""What the fault tests share: a learner run in a subprocess, its children, and the exactly-once
accounting of its data (`steps.jsonl` against the stream's log)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from sao_jax.engine import sglang_server
from sao_jax.rollout import stream

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCH = 8

# The tiny toy run of tests/train/learner_runs.py (TINY), with two engines and two workers.
TWO_BY_TWO = [
    f"--config.batch_size={BATCH}", "--config.warm_start.enabled=False",
    "--config.env.num_eval_prompts=8", "--config.env.num_train_prompts=64",
    "--config.rollout.worker_concurrency=8", "--config.rollout.engine_max_batch=16",
    "--config.rollout.num_engines=2", "--config.rollout.num_workers=2",
    "--config.rl.critic_warmup_steps=2", "--config.sample_every=4",
]


def environment(cache_dir: str) -> dict:
    """One CPU device, as `make train` sees it; caches (compiled programs) in `cache_dir`, but
    SGLang's virtualenv where it is."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", XDG_CACHE_HOME=cache_dir,
               SAO_SGLANG_VENV=sglang_server.venv_dir())
    env.pop("XLA_FLAGS", None)
    return env


_STARTED: list[LearnerRun] = []  # every run of this process, for `stop_leftover_runs`


def stop_leftover_runs() -> None:
    """Kills the runs a test left running (it failed before `finish`), and waits for their
    children to follow: a leftover run goes on to the end and slows every test after it."""
    while _STARTED:
        run = _STARTED.pop()
        if run.proc.poll() is None:
            children = list(run.children().values())
            run.kill()
            wait_gone(children)


class LearnerRun:
    """`python -m sao_jax.main` on `experiment` (toy) in `workdir`, its output in a file; a test
    that fails before `finish` leaves it to `stop_leftover_runs` (tests/faults/conftest.py)."""

    def __init__(self, workdir, cache_dir: str, *overrides: str, name: str = "learner",
                 experiment: str = "toy"):
        self.workdir = str(workdir)
        self.argv = [sys.executable, "-m", "sao_jax.main",
                     f"--config=experiments/{experiment}.py",
                     f"--workdir={self.workdir}", *TWO_BY_TWO, *overrides]
        self.out_path = os.path.join(os.path.dirname(self.workdir), f"{name}.out")
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, env=environment(cache_dir),
                                         stdout=out, stderr=subprocess.STDOUT)
        _STARTED.append(self)

    def output(self) -> str:
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def steps(self) -> list[dict]:
        return steps_log(self.workdir)

    def last_step(self) -> int:
        return max((r["step"] for r in self.steps()), default=0)

    def wait_for(self, predicate, what: str, timeout_s: float = 300.0):
        """Polls `predicate()` until it returns something true; fails if the learner exits or
        `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = predicate()
            if found:
                return found
            assert self.proc.poll() is None, (f"the learner exited ({self.proc.returncode}) "
                                              f"before {what}:\n{self.output()[-4000:]}")
            assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s"
            time.sleep(0.05)

    def wait_step(self, step: int, timeout_s: float = 300.0) -> None:
        self.wait_for(lambda: self.last_step() >= step, f"step {step}", timeout_s)

    def finish(self, timeout_s: float = 600.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def children(self) -> dict[str, int]:
        """`{name: pid}` of the learner's live engines (`engine<i>`, by seed) and workers
        (`worker<k>`, in pid order)."""
        return children_of(self.proc.pid)


def children_of(pid: int) -> dict[str, int]:
    engines, workers = {}, []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                argv = [a.decode() for a in f.read().split(b"\0")]
            with open(path.replace("cmdline", "stat")) as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if "--parent-pid" not in argv or argv[argv.index("--parent-pid") + 1] != str(pid):
            continue
        child = int(path.split("/")[2])
        if "sao_jax.engine.server" in argv:
            engines[f"engine{argv[argv.index('--seed') + 1]}"] = child  # config.seed = 0
        elif argv[1:2] == [sglang_server.CHILD_SCRIPT]:  # an SGLang server's wrapper
            engines[f"engine{argv[argv.index('--random-seed') + 1]}"] = child
        elif "sao_jax.rollout.worker" in argv:
            workers.append(child)
    return {**engines, **{f"worker{k}": p for k, p in enumerate(sorted(workers))}}


def engine_port(pid: int) -> int:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [a.decode() for a in f.read().split(b"\0")]
    return int(argv[argv.index("--port") + 1])


def weight_version(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/model_info", timeout=30) as r:
        return int(json.loads(r.read())["weight_version"])


def server_of(wrapper: int) -> int:
    """The `sglang.launch_server` process an SGLang wrapper (`sglang_child.py`) started."""
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == wrapper and fields[0] != "Z":
            return int(path.split("/")[2])
    raise LookupError(f"no server under wrapper {wrapper}")


def steps_log(workdir) -> list[dict]:
    path = os.path.join(str(workdir), "steps.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary_of(workdir) -> dict:
    with open(os.path.join(str(workdir), "summary.json")) as f:
        return json.load(f)


def stream_ledger(workdir) -> stream.Ledger:
    """The stream log's view of every trajectory and lease (`stream.Ledger`)."""
    return stream.Ledger.read(os.path.join(str(workdir), "stream", stream.LOG_NAME))


def leases_of(workdir, worker_id: str) -> set[str]:
    """The fresh leases the stream log shows handed to `worker_id`."""
    return {lease for lease, worker in stream_ledger(workdir).leased_to.items()
            if worker == worker_id}


def leases_came_back(workdir, worker_id: str) -> set[str]:
    """The fresh leases handed to a (dead) worker `worker_id` that it never answered and another
    worker did: they expired and were issued again (a dead worker gives nothing back)."""
    ledger = stream_ledger(workdir)
    return {lease for lease, worker in ledger.leased_to.items() if worker == worker_id
            and worker_id not in ledger.answered_by.get(lease, {worker_id})}


def check_exactly_once(workdir, total_steps: int, *, single_run: bool) -> list[dict]:
    """The finished run trained steps 1..total_steps on whole batches, no trajectory twice, each
    one durably accepted and then retired in the log; every other accepted trajectory was
    discarded as stale (`single_run`: exactly the learner's count of them) or is still pending.
    Returns the steps."""
    records = steps_log(workdir)
    assert [r["step"] for r in records] == list(range(1, total_steps + 1))
    trained = [i for r in records for i in r["ids"]]
    assert all(len(r["ids"]) == BATCH for r in records)
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    ledger = stream_ledger(workdir)
    trained = set(trained)
    assert trained <= ledger.accepted, "trained on a trajectory the log never accepted"
    assert trained <= ledger.retired, "a trained trajectory is not marked consumed"
    summary = summary_of(workdir)
    assert summary["steps"] == total_steps
    assert summary["trajectories"] == total_steps * BATCH
    discarded = ledger.retired - trained
    if single_run:  # every retired trajectory that was not trained is a counted stale discard
        assert len(discarded) == summary["stale_discarded"], (len(discarded), summary)
    else:  # discards after a killed run's last checkpoint are in the log, not in its meta
        assert len(discarded) >= summary["stale_discarded"], (len(discarded), summary)
    return records


def scalar_max(workdir, tag: str) -> float:
    """The largest value the run logged for the scalar `tag` (0 if never)."""
    from sao_jax.train.events import read_events

    values = [v.simple_value for e in read_events(os.path.join(str(workdir), "tb"))
              for v in e.summary.value if v.tag == tag]
    return max(values, default=0.0)


def wait_gone(pids, timeout_s: float = 60.0) -> None:
    """Waits for `pids` to exit (children of a killed learner watch it and exit)."""
    deadline = time.monotonic() + timeout_s
    while any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids):
        assert time.monotonic() < deadline, f"children {pids} outlived the killed learner"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
