"""A short `make train` through real SGLang (marker `sglang`, `make test-sglang`):
`experiments/toy_sglang.py` as a subprocess, synchronous, 4 steps from a random policy. The run
makes (or finds) SGLang's virtualenv, starts its server under `sglang_child.py`, publishes every
policy through `/update_weights_from_disk`, evaluates through it and stops it; every trajectory
is trained on exactly once, every TensorBoard tag is there, `make eval` scores its checkpoint,
and none of the CPU stand-in kernels ran."""

import json
import os
import subprocess
import sys

import pytest

from sao_jax.train.events import read_events
from sao_jax.train.processes import CHILDREN_FILE
from tests.train.learner_runs import (
    REPO,
    REQUIRED_TAGS,
    TINY,
    environment,
    scalars_as_shown,
    steps_log,
)

pytestmark = pytest.mark.sglang


def test_make_train_through_sglang(tmp_path, sglang_venv):
    workdir, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    env = dict(environment(cache), SAO_SGLANG_VENV=sglang_venv)  # the cache moved; not SGLang
    config = os.path.join(REPO, "experiments", "toy_sglang.py")
    done = subprocess.run(
        [sys.executable, "-m", "sao_jax.main", f"--config={config}", f"--workdir={workdir}",
         "--config.mode=sync", "--config.total_steps=4", *TINY],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 4 and summary["trajectories"] == 32
    assert summary["policy_version"] == 2  # two critic warm-up steps, then two policy steps
    assert summary["this_run_stream"] == {"rejected": 0, "episodes_failed": 0,
                                          "prompts_given_up": 0}
    records = steps_log(workdir)
    ids = [i for r in records for i in r["ids"]]
    assert len(ids) == len(set(ids)) == 32  # exactly once
    assert [r["version"] for r in records] == [0, 0, 0, 1]  # synchronous: no lag
    scalars, _ = scalars_as_shown(os.path.join(workdir, "tb"))
    assert REQUIRED_TAGS <= set(scalars), REQUIRED_TAGS - set(scalars)
    assert not os.path.exists(os.path.join(workdir, CHILDREN_FILE))  # the server was stopped

    logs = os.path.join(workdir, "logs")
    with open(os.path.join(logs, "engine0.log")) as f:
        assert "sao_jax's CPU stand-in" in f.read()  # SGLang served, on the CPU stand-in
    assert not [n for n in os.listdir(logs) if n.endswith(".sgl_kernel_calls")]

    # The log-probs SGLang reported are the learner's: the mismatch DIS sees is numerical.
    mismatch = [value.simple_value for event in read_events(os.path.join(workdir, "tb"))
                for value in event.summary.value if value.tag == "policy/logp_mismatch"]
    assert mismatch and max(mismatch) < 1e-4, mismatch

    scored = subprocess.run([sys.executable, "-m", "sao_jax.main", f"--config={config}",
                             f"--eval={workdir}", *TINY],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert scored.returncode == 0, scored.stderr[-3000:]
    result = json.loads(scored.stdout[scored.stdout.index("{"):])
    assert set(result) >= {"accuracy", "greedy_accuracy"}
