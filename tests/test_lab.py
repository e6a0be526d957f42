"""The notebook API (`sao_jax.lab`): configs with the command line's rules, results of saved runs
as DataFrames, tables and plots, and a real grid that skips what is finished."""

from __future__ import annotations

import json
import os

import matplotlib
import numpy as np
import pytest

from sao_jax import lab

matplotlib.use("Agg")


def test_overrides_follow_the_command_lines_rules():
    config = lab.config("toy", {"algo": "grpo_dis", "rl.eps_low": 0.25, "seed": 3})
    assert (config.algo, config.rl.eps_low, config.seed) == ("grpo_dis", 0.25, 3)
    with pytest.raises(ValueError, match=r"'rl.eps_lo': there is no such field .*eps_low"):
        lab.config("toy", {"rl.eps_lo": 0.2})
    with pytest.raises(ValueError, match=r"'rll.eps_low': there is no field 'rll'"):
        lab.config("toy", {"rll.eps_low": 0.2})
    with pytest.raises(ValueError, match=r"'total_steps' = 'many'"):
        lab.config("toy", {"total_steps": "many"})
    with pytest.raises(ValueError, match=r"experiment 'toyy'.*'toy'"):
        lab.config("toyy")


def fake_runs(root):
    """Four finished runs as the learner leaves them: two algos x two seeds, with a scalar over
    three steps (each run resumed once: step 2 logged twice, the later value counts) and a
    summary."""
    from tensorboardX import SummaryWriter

    for algo, offset in (("sao", 0.5), ("grpo", 0.0)):
        for seed in (0, 1):
            run = root / lab.cell_name({"algo": algo, "seed": seed})
            run.mkdir(parents=True)
            (run / "config.json").write_text("{}")
            (run / lab.LAB_CONFIG).write_text(json.dumps(
                {"experiment": "toy", "overrides": {"algo": algo, "seed": seed}}))
            (run / "summary.json").write_text(json.dumps(
                {"final_accuracy": offset + 0.1 * seed, "steps": 3, "nested": {"x": 1}}))
            with SummaryWriter(str(run / "tb")) as writer:  # killed after step 2
                writer.add_scalar("eval/accuracy", offset + 0.1 * seed + 1, 1)
                writer.add_scalar("eval/accuracy", -100.0, 2)  # superseded by the resume
            # The resume from step 1's checkpoint (the learner's purge_step) logs 2 and 3 again.
            with SummaryWriter(str(run / "tb"), purge_step=2,
                               filename_suffix=".resumed") as writer:
                for step in (2, 3):
                    writer.add_scalar("eval/accuracy", offset + 0.1 * seed + step, step)


def test_saved_runs_load_into_frames_tables_and_plots(tmp_path):
    fake_runs(tmp_path)
    frame = lab.load(tmp_path)
    assert set(frame.columns) == {"run", "algo", "seed", "step", "tag", "value"}
    assert len(frame) == 4 * 3 and frame["value"].min() > 0  # the superseded -100 is gone
    sao = frame[(frame["algo"] == "sao") & (frame["step"] == 3)]
    np.testing.assert_allclose(sorted(sao["value"]), [3.5, 3.6])

    last = lab.table(frame, "eval/accuracy", by="algo")
    np.testing.assert_allclose(last.loc["sao", "mean"], 3.55, rtol=1e-6)
    np.testing.assert_allclose(last.loc["grpo", "std"], np.std([3.0, 3.1], ddof=1), rtol=1e-5)
    assert list(last["n"]) == [2, 2] and last.loc["sao", "mean ± std (n)"] == "3.550 ± 0.071 (2)"

    final = lab.table(lab.summaries(tmp_path), "final_accuracy", by="algo")
    np.testing.assert_allclose(final["mean"].to_numpy(), [0.05, 0.55], rtol=1e-6)  # grpo, sao
    with pytest.raises(ValueError, match="nothing named 'missing'"):
        lab.table(frame, "missing")

    ax = lab.plot(frame, "eval/accuracy", by="algo")
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"algo=grpo (n=2)", "algo=sao (n=2)"}
    np.testing.assert_allclose(lines["algo=sao (n=2)"].get_ydata(), [1.55, 2.55, 3.55], rtol=1e-6)
    assert len(ax.collections) == 2  # a band each
    with pytest.raises(ValueError, match=r"no scalar 'eval/nope'.*eval/accuracy"):
        lab.plot(frame, "eval/nope")


TINY = {"batch_size": 8, "total_steps": 2, "mode": "sync", "algo": "grpo_dis",
        "warm_start.enabled": False, "precompile_steps": False, "env.num_eval_prompts": 8,
        "env.num_train_prompts": 64, "rollout.worker_concurrency": 16,
        "rollout.engine_max_batch": 16}


def test_a_grid_runs_its_cells_once_and_loads_them(tmp_path, monkeypatch):
    """A real one-cell grid (two toy steps in a subprocess); run again, it launches nothing."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the runs see one device, as make train
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "grid"
    runs = lab.grid(str(root), "toy", {"seed": [0]}, overrides=TINY, progress=False)
    assert [os.path.basename(r.workdir) for r in runs] == ["seed=0"]
    assert runs[0].summary()["steps"] == 2 and runs[0].progress() == 2
    again = lab.grid(str(root), "toy", {"seed": [0]}, overrides=TINY, progress=False)
    assert again[0].process is None  # finished: skipped
    frame = lab.load(root, tags=["reward/mean"])
    assert list(frame["step"]) == [1, 2] and set(frame["seed"]) == {0}
    with pytest.raises(ValueError, match="holds a run of another config"):
        lab.launch("toy", str(root / "seed=0"), {**TINY, "seed": 1})
