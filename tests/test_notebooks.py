"""The notebooks (experiments/notebooks, jupytext percent files) run end to end at a tiny scale:
each launches its runs (a couple of toy-sized steps, `sao_jax.lab`; the critic-depth case finds
the ablation's run finished and reuses it), saves their results and draws its figures, in a real
Jupyter kernel (nbclient), with a cell of parameters injected after the notebook's own, as
papermill does."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from sao_jax import lab
from tests import one_device_flags
from tests.train import learner_runs

NOTEBOOKS = os.path.join(lab.REPO, "experiments", "notebooks")
TINY = {"batch_size": 8, "total_steps": 2, "mode": "sync", "warm_start.enabled": False,
        "precompile_steps": False, "env.num_eval_prompts": 8, "env.num_train_prompts": 64,
        "rollout.worker_concurrency": 16, "rollout.engine_max_batch": 16,
        "rl.critic_warmup_steps": 0}
# One algorithm throughout (with a critic, so the critic's figures are drawn): the runs after
# the first reuse its compiled programs. No critic warm-up but the ablation's (a program of its
# own to compile; the ablation's run checks it). The ablation's run is also the learner's
# end-to-end check (packed rows, tags, samples, an evaluation mid-run, `make eval`), and the
# staleness study's the check of injected lag (tests/train/learner_runs.py reads them): one run
# each instead of two. The ablation's run replays the engines' expert choices (routing replay).
ABLATION = {**TINY, "total_steps": 4, "rl.critic_warmup_steps": 2, "sample_every": 2,
            "pack_rows": True, "eval_every": 2, "rl.routing_replay": True}
STALENESS = {**TINY, "total_steps": 5}
# swe_tiny's few steps through the real workspaces and grader (env.train_path: 4 training tasks
# and 2 held out, written by the test): a warm start of 2 steps on the stream of fresh tasks (its
# rows sized on 16 of them, its loss on 16 held out), 2 RL steps, an evaluation on 2 tasks at
# each end.
SWE = {"env.num_eval_prompts": 2, "warm_start.max_steps": 2, "warm_start.eval_every": 2,
       "warm_start.batch": 4, "warm_start.held_out": 16, "warm_start.sample": 16,
       "rollout.engine_max_batch": 4, "total_steps": 2, "batch_size": 2,
       "eval_every": 0, "precompile_steps": False, "rl.critic_warmup_steps": 0,
       "rollout.worker_concurrency": 2, "checkpoint_every": 2}
CASES = {
    "ablation": dict(ALGOS=["sao"], SEEDS=[0], OVERRIDES=ABLATION, SYNC_RESULTS=None),
    "staleness": dict(ALGOS=["sao"], LAGS=[2], SEEDS=[0], MORE_SEEDS={}, LONG_STEPS=0,
                      OVERRIDES=STALENESS),
    "online_switch": dict(ALGOS=["sao"], SEEDS=[0], OVERRIDES=TINY),
    # chain, not chain_deep, with the ablation's settings: the same notebook, drawn over the
    # ablation's finished run (its grid finds the cell done and launches nothing)
    "critic_depth": dict(EXPERIMENT="chain", ALGOS=["sao"], SEEDS=[0], OVERRIDES=ABLATION,
                         SHALLOW_FROM=None, ATTENTION_FROM=None),
    # one correction at lag 0, both sides in bfloat16 as the grid runs them; no MoE section
    "mismatch": dict(ALGOS=["grpo_tis"], LAGS=[0], SEEDS=[0],
                     OVERRIDES={**TINY, "model.dtype": "bfloat16"}, MOE_RESULTS=None,
                     BF16_COPY_RESULTS=None),
    # its async-against-sync runs not launched: their table is drawn from the committed ones
    "swe": dict(ALGOS=["sao"], SEEDS=[0], OVERRIDES=SWE, MODES=[]),
}
SHARED_RUNS = {"ablation", "critic_depth"}  # these cases' runs, in one folder
FIGURES = {"ablation": ["accuracy.png", "final.png", "critic.png", "vapo.png"],
           "staleness": ["lag_sweep.png", "long_runs.png"], "online_switch": ["reward.png"],
           "mismatch": ["final.png", "gap.png"],
           "critic_depth": ["critic.png", "accuracy.png"], "swe": ["resolved.png", "protocol.png"]}


def test_every_notebook_has_a_case():
    names = sorted(n[:-3] for n in os.listdir(NOTEBOOKS) if n.endswith(".py"))
    assert names == sorted(CASES)


def execute(name: str, parameters: dict, cwd: str):
    return lab.run_notebook(os.path.join(NOTEBOOKS, f"{name}.py"), parameters, cwd=cwd,
                            timeout_s=600)


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
    return tmp_path_factory.mktemp("shared") / "runs"


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_notebook_runs_end_to_end_at_a_tiny_scale(name, tmp_path, monkeypatch, cache_dir,
                                                      shared_runs, request):
    # the runs see one device, as make train
    monkeypatch.setenv("XLA_FLAGS", one_device_flags(os.environ.get("XLA_FLAGS", "")))
    monkeypatch.setenv("XDG_CACHE_HOME", cache_dir)
    runs = shared_runs if name in SHARED_RUNS else tmp_path / "runs"
    parameters = dict(CASES[name], LAUNCH=True, RUNS=str(runs),
                      RESULTS=str(tmp_path / "results"))
    if name == "swe":  # its episodes play in namespace workspaces: the sandbox must work here
        request.getfixturevalue("isolated")
        parameters["OVERRIDES"] = {**SWE, "env.train_path": swe_tasks(tmp_path)}
    notebook = execute(name, parameters, str(tmp_path))
    for figure in FIGURES[name]:
        assert (tmp_path / "results" / figure).stat().st_size > 1000, figure
    scalars, summaries = lab.load_results(str(tmp_path / "results"))
    assert len(summaries) == len(lab.run_dirs(str(runs)))
    assert set(summaries["algo"]) == set(CASES[name]["ALGOS"])
    assert not scalars.empty
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    if name == "ablation":  # the grid: run again, it launches nothing (every cell finished)
        found = lab.grid(str(runs), "chain", {"algo": ["sao"], "seed": [0]},
                         overrides=ABLATION, progress=False)
        assert [r.process for r in found] == [None]
        assert found[0].summary()["steps"] == 4 and found[0].progress() == 4
        with pytest.raises(ValueError, match="holds a run of another config"):
            lab.launch("chain", found[0].workdir, {**ABLATION, "algo": "sao", "seed": 1})
        learner_runs.the_run_went_end_to_end(found[0].workdir, cache_dir)
    if name == "mismatch":
        learner_runs.the_learner_kept_float32_and_served_bfloat16(lab.run_dirs(str(runs))[0])
    if name == "staleness":
        learner_runs.the_lag_shows(str(tmp_path / "runs" / "lag=2" / "algo=sao,seed=0"))
    if name == "swe":
        learner_runs.the_swe_run_played_and_graded(str(runs / "algo=sao,seed=0"))


def swe_tasks(folder) -> str:
    """A tasks file of swe_tiny's first 4 tasks and its last 2 (held out), their workspace the
    committed bundle by its absolute path."""
    from sao_jax.envs.swe.tasks import load_tasks

    data = os.path.join(lab.REPO, "experiments", "data", "swe_tiny")
    tasks = load_tasks(os.path.join(data, "tasks.jsonl"))
    rows = [dict(t.to_row(), workspace=os.path.join(data, "repo.bundle"))
            for t in tasks[:4] + tasks[-2:]]
    path = os.path.join(folder, "swe_tiny_tasks.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def claims(notebook) -> str:
    """The text of the notebook's last output: its claims table, with verdicts."""
    last = [c for c in notebook.cells if c.cell_type == "code" and c.get("outputs")][-1]
    return "".join(o["data"]["text/plain"] for o in last.outputs if "data" in o)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_committed_notebook_is_what_its_committed_results_draw(name, tmp_path):
    """The .ipynb beside each notebook opens with its figures drawn, and executing the notebook
    on the committed results (a copy: it redraws its figures) gives the same claims table."""
    import nbformat

    committed = nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)
    images = [o for c in committed.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) == len(FIGURES[name]), f"{name}.ipynb: run `make notebooks`"
    shutil.copytree(os.path.join(NOTEBOOKS, "results"), tmp_path / "results")
    notebook = execute(name, {}, str(tmp_path))
    assert claims(notebook) == claims(committed), f"{name}.ipynb: run `make notebooks`"
