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
                    # a tag with nothing to measure at step 2 (NaN: no fresh row, say)
                    writer.add_scalar("policy/fresh", float("nan") if step == 2 else 0.5, step)


def test_saved_runs_load_into_frames_tables_and_plots(tmp_path):
    fake_runs(tmp_path)
    starting = tmp_path / "algo=sao,seed=9"  # a grid's next run, nothing logged yet
    starting.mkdir()
    (starting / "config.json").write_text("{}")
    frame = lab.load(tmp_path, ["eval/accuracy"])
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


def test_results_save_to_csv_and_load_back(tmp_path):
    fake_runs(tmp_path / "runs")
    lab.save_results(tmp_path / "runs", str(tmp_path / "results"), ["eval/accuracy"])
    scalars, summaries = lab.load_results(str(tmp_path / "results"))
    assert len(scalars) == 12 and set(scalars["algo"]) == {"sao", "grpo"}
    assert sorted(summaries["final_accuracy"]) == pytest.approx([0.0, 0.1, 0.5, 0.6])
    with pytest.raises(FileNotFoundError, match="LAUNCH = True"):
        lab.load_results(str(tmp_path / "nothing"))
    # the runs `grid` returns are taken as well as a folder
    runs = [lab.Run(d, 3) for d in lab.run_dirs(str(tmp_path / "runs"))]
    assert lab.run_dirs(runs) == lab.run_dirs(str(tmp_path / "runs"))
    lab.save_results(runs, str(tmp_path / "again"), ["eval/accuracy"])
    assert len(lab.load_results(str(tmp_path / "again"))[0]) == 12
    # a step whose value is NaN (the tag measured nothing there) is not kept
    lab.save_results(runs, str(tmp_path / "nan"), ["policy/fresh"])
    fresh = lab.load_results(str(tmp_path / "nan"))[0]
    assert len(fresh) == 4 and list(fresh["step"].unique()) == [3]


def test_saved_results_merge_across_sessions_and_name_runs_by_their_path(tmp_path):
    """A grid finished over two sessions (the first one's run directories gone): the second
    save keeps the first's runs; runs of the same cell under two roots stay apart."""
    fake_runs(tmp_path / "first" / "lag=0")
    fake_runs(tmp_path / "first" / "lag=4")
    folder = str(tmp_path / "results")
    lab.save_results(tmp_path / "first", folder, ["eval/accuracy"])
    assert "lag=4/algo=sao,seed=1" in lab.saved_runs(folder) and len(lab.saved_runs(folder)) == 8
    assert lab.saved_runs(folder, "lag=4") == {"algo=sao,seed=0", "algo=sao,seed=1",
                                               "algo=grpo,seed=0", "algo=grpo,seed=1"}
    scalars, _ = lab.load_results(folder)
    assert len(scalars) == 8 * 3  # lag=0 and lag=4's cells are not deduplicated into one
    (tmp_path / "second").mkdir()
    fake_runs(tmp_path / "second" / "lag=8")
    lab.save_results(tmp_path / "second", folder, ["eval/accuracy"])
    scalars, summaries = lab.load_results(folder)
    assert len(summaries) == 12 and len(scalars) == 12 * 3
    assert {r.split("/")[0] for r in summaries["run"]} == {"lag=0", "lag=4", "lag=8"}
    with pytest.raises(ValueError, match="no such field"):  # checked before skipping
        lab.grid(str(tmp_path / "g"), "toy", {"rl.nope": [1]})
    assert lab.grid(str(tmp_path / "g"), "toy", {"seed": [0, 1]},
                    skip={"seed=0", "seed=1"}) == []  # nothing left to launch


def test_recovery_counts_the_steps_back_to_a_fraction_of_the_level_before_a_switch():
    import pandas as pd

    def run(name, values):
        return pd.DataFrame({"run": name, "tag": "reward/mean", "step": range(len(values)),
                             "value": values})

    # level 1.0 over steps 0-9; the switch at 10 drops it to 0; back to 0.9 from step 14
    quick = run("quick", [1.0] * 10 + [0.0] * 4 + [0.9] * 10)
    never = run("never", [1.0] * 10 + [0.0] * 14)
    got = lab.recovery_steps(pd.concat([quick, never]), "reward/mean", 10, before=10, smooth=1)
    assert got["quick"] == 4 and got.isna()["never"]
    smoothed = lab.recovery_steps(quick, "reward/mean", 10, before=10, smooth=3)
    assert smoothed["quick"] == 6  # the mean of three steps reaches 0.8 at step 16
    assert lab.recovery_steps(quick, "reward/mean", 10, before=10, smooth=1, end=14).isna().all()


def test_a_comparison_is_welchs_t_test_with_a_two_sided_verdict():
    import pandas as pd
    from scipy import stats

    def runs(algo, values):
        return pd.DataFrame({"algo": algo, "final": values})

    a, b, c = [0.8, 0.7, 0.9, 0.75], [0.4, 0.5, 0.3], [0.9, 0.2, 0.6]
    frame = pd.concat([runs("a", a), runs("b", b), runs("c", c), runs("d", [0.5]),
                       runs("e", [0.6, 0.6]), runs("f", [0.3, 0.3])])
    clear = lab.compare(frame, "final", "a", "b")
    welch = stats.ttest_ind(a, b, equal_var=False)
    assert (clear["n_higher"], clear["n_lower"]) == (4, 3)
    assert clear["difference"] == pytest.approx(np.mean(a) - np.mean(b), abs=1e-12)
    assert clear["se"] == pytest.approx((np.var(a, ddof=1) / 4 + np.var(b, ddof=1) / 3) ** 0.5)
    assert clear["t"] == pytest.approx(welch.statistic, rel=1e-12)
    assert clear["df"] == pytest.approx(welch.df, rel=1e-12)  # 3.99, not n_a + n_b - 2 = 5
    assert clear["p"] == pytest.approx(welch.pvalue, rel=1e-9)
    interval = welch.confidence_interval(0.95)
    assert (clear["ci_low"], clear["ci_high"]) == pytest.approx((interval.low, interval.high))
    assert clear["verdict"] == "reproduced"
    backwards = lab.compare(frame, "final", "b", "a")  # the same test, the other way round
    assert (backwards["t"], backwards["p"]) == pytest.approx((-clear["t"], clear["p"]))
    assert backwards["verdict"] == "not reproduced"
    wide = lab.compare(frame, "final", "c", "b")
    assert wide["p"] == pytest.approx(stats.ttest_ind(c, b, equal_var=False).pvalue, rel=1e-9)
    assert wide["p"] > 0.05 and wide["verdict"] == "inconclusive"  # the spread is too wide
    for higher, lower, verdict, difference in [("a", "d", "inconclusive (n < 2)", 0.2875),
                                               ("e", "f", "inconclusive (no spread)", 0.3)]:
        got = lab.compare(frame, "final", higher, lower)
        assert got["verdict"] == verdict and got["difference"] == pytest.approx(difference)
        assert np.isnan([got["t"], got["df"], got["p"]]).all()
    with pytest.raises(ValueError, match="no runs of algo='g'"):
        lab.compare(frame, "final", "a", "g")


def test_an_inconclusive_claim_is_bounded_by_its_interval_or_its_precision():
    """lab.bound: the interval below the margin, or 0 inside it at a small enough SE; else open,
    and a called claim is decided, not bounded."""
    import pandas as pd

    def compared(higher, lower):
        frame = pd.DataFrame({"algo": ["h"] * len(higher) + ["l"] * len(lower),
                              "final": higher + lower})
        return lab.compare(frame, "final", "h", "l")

    base = [0.70, 0.72, 0.74, 0.71, 0.73, 0.69, 0.75, 0.72]
    tight = compared([v + 0.004 for v in base], base[::-1])  # d 0.004, SE 0.010, df 14
    assert tight["verdict"] == "inconclusive" and tight["ci_high"] < 0.05
    assert lab.bound(tight).startswith("bounded: gain < 0.05")
    # the margin under its interval's top (+0.025): open, unless the SE is precise enough
    assert lab.bound(tight, margin=0.02, max_se=0.009).startswith("open")
    assert lab.bound(tight, margin=0.02, max_se=0.011).startswith("bounded: no difference")
    wide = compared([0.9, 0.5, 0.7, 0.6], [0.6, 0.5, 0.7])  # d 0.075, SE 0.10
    assert wide["verdict"] == "inconclusive" and wide["ci_high"] > 0.05
    assert lab.bound(wide) == (f"open: interval {wide['ci_low']:+.3f} to {wide['ci_high']:+.3f}"
                               f" reaches 0.05, SE {wide['se']:.3f} > 0.01")
    called = compared([0.8, 0.7, 0.9, 0.75], [0.4, 0.5, 0.3])
    assert lab.bound(called) == "decided"
    # holm's verdict is the one read: called alone, inconclusive in a family of 40
    assert lab.bound(lab.holm([called] + [{**wide, "p": 0.9}] * 39)[0]).startswith("open")
    assert lab.bound(compared([0.7, 0.7], [0.7, 0.7])) == "open: no test"


def test_a_p_value_at_the_level_reproduces_and_one_above_it_does_not():
    """The rule is p <= alpha: at exactly alpha the claim is called, a hair above it is not."""
    import pandas as pd

    frame = pd.DataFrame({"algo": ["a"] * 3 + ["b"] * 3, "final": [0.5, 0.6, 0.7, 0.4, 0.5, 0.4]})
    p = lab.compare(frame, "final", "a", "b")["p"]
    assert 0.01 < p < 0.2
    assert lab.compare(frame, "final", "a", "b", alpha=p)["verdict"] == "reproduced"
    assert lab.compare(frame, "final", "b", "a", alpha=p)["verdict"] == "not reproduced"
    below = np.nextafter(p, 0.0)
    assert lab.compare(frame, "final", "a", "b", alpha=below)["verdict"] == "inconclusive"
    # Holm at the edge: 2 x 0.025 is exactly 0.05 in floating point, and is called
    edge = lab.holm([{"difference": 1.0, "p": 0.025}, {"difference": 1.0, "p": 0.05}])
    assert [c["p_holm"] for c in edge] == [0.05, 0.05]
    assert [c["verdict"] for c in edge] == ["reproduced", "reproduced"]


def test_holm_adjusts_the_p_values_of_claims_tested_together():
    """By hand, m = 4 tests (the n < 2 comparison is none): sorted 0.01, 0.03, 0.04, 0.20 times
    4, 3, 2, 1 are 0.04, 0.09, 0.08, 0.20, and each adjusted p is at least the one before it:
    0.04, 0.09, 0.09, 0.20. Alone, three are below 0.05; together, one."""
    def claim(name, difference, p, verdict):
        return {"claim": name, "difference": difference, "p": p, "verdict": verdict}

    family = [claim("w", 0.2, 0.04, "reproduced"), claim("x", -0.5, 0.01, "not reproduced"),
              claim("y", 0.1, 0.20, "inconclusive"), claim("z", 0.3, 0.03, "reproduced"),
              claim("n1", 0.4, float("nan"), "inconclusive (n < 2)")]
    got = lab.holm(family)
    assert [c["claim"] for c in got] == ["w", "x", "y", "z", "n1"]  # the order given
    assert [c["p"] for c in got[:4]] == [0.04, 0.01, 0.20, 0.03]  # the p of each test kept
    assert [c["p_holm"] for c in got[:4]] == pytest.approx([0.09, 0.04, 0.20, 0.09])
    assert [c["verdict"] for c in got] == ["inconclusive", "not reproduced", "inconclusive",
                                           "inconclusive", "inconclusive (n < 2)"]
    assert np.isnan(got[4]["p_holm"])
    assert list(got[0]) == ["claim", "difference", "p", "p_holm", "verdict"]
    assert family[0]["verdict"] == "reproduced"  # new dicts: the comparisons are not changed
    # one test alone is its own p; at a stricter level fewer are called
    assert lab.holm([family[3]])[0]["p_holm"] == 0.03
    assert lab.holm(family, alpha=0.01)[1]["verdict"] == "inconclusive"


def test_final_values_tables_with_standard_errors_and_smoothed_plots(tmp_path):
    """`final` averages each run's last evaluations; `table` states the standard error of each
    cell; `plot` smooths with the raw mean faint behind, says what its band is, and can put
    its legend off the data."""
    fake_runs(tmp_path)
    frame = lab.load(tmp_path, ["eval/accuracy"])
    finals = lab.final(frame, "eval/accuracy", last=2)
    sao = finals[finals["algo"] == "sao"].sort_values("final")
    np.testing.assert_allclose(sao["final"], [3.0, 3.1], rtol=1e-6)  # steps 2 and 3 of each
    assert list(finals["points"]) == [2, 2, 2, 2]
    stats = lab.table(finals, "final", by="algo")
    np.testing.assert_allclose(stats.loc["sao", "se"], np.std([3.0, 3.1], ddof=1) / np.sqrt(2),
                               rtol=1e-5)
    assert stats.loc["sao", "mean ± SE (n)"] == "3.050 ± 0.050 (2)"
    with pytest.raises(ValueError, match="last must be >= 1"):
        lab.final(frame, last=0)

    ax = lab.plot(frame, "eval/accuracy", by="algo", spread="se", smooth=2, legend="outside")
    labelled = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert len(ax.get_lines()) == 4 and len(labelled) == 2  # a faint raw line under each
    sao_line = next(line for line in labelled if line.get_label() == "algo=sao (n=2)")
    np.testing.assert_allclose(sao_line.get_ydata(), [1.55, 2.05, 3.05], rtol=1e-6)
    assert "standard error" in ax.get_title() and "running mean of 2" in ax.get_title()
    assert ax.get_legend().get_bbox_to_anchor() is not None
    with pytest.raises(ValueError, match="spread must be one of"):
        lab.plot(frame, "eval/accuracy", spread="iqr")


def test_plots_keep_bands_inside_bounds_cut_the_axis_and_show_finals_per_group():
    """A band of a rate stays in [0, 1] where mean -+ std leaves it; `ylim` cuts the axis and
    says so; `plot_final` draws every run and each group's mean ± SE, in order."""
    import pandas as pd
    from matplotlib.collections import LineCollection, PathCollection, PolyCollection

    frame = pd.DataFrame({"run": ["a0", "a1", "b0", "b1"] * 2, "algo": ["a", "a", "b", "b"] * 2,
                          "step": [1] * 4 + [2] * 4, "tag": "eval/accuracy",
                          "value": [0.0, 0.3, 0.9, 1.0, 0.05, 0.02, -6000.0, 0.98]})

    def band(ax, index):
        return ax.collections[index].get_paths()[0].vertices[:, 1]

    free = lab.plot(frame, "eval/accuracy")
    assert band(free, 0).min() < 0 and band(free, 1).max() > 1  # a: 0.15 -+ 0.21; b: 0.95 -+ ..
    bounded = lab.plot(frame, "eval/accuracy", bounds=(0, 1), ylim=(-1, 1))
    assert isinstance(bounded.collections[0], PolyCollection)
    assert band(bounded, 0).min() >= 0 and band(bounded, 1).max() <= 1
    assert bounded.get_ylim() == (-1, 1) and "axis cut to [-1, 1]" in bounded.get_title()

    runs = pd.DataFrame({"algo": ["a"] * 3 + ["b"] * 2, "final": [0.7, 0.72, 0.74, 0.02, 0.0]})
    ax = lab.plot_final(runs)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a\nn=3", "b\nn=2"]  # highest first
    dots = np.concatenate([c.get_offsets()[:, 1] for c in ax.collections
                           if isinstance(c, PathCollection)])
    np.testing.assert_allclose(sorted(dots), [0.0, 0.02, 0.7, 0.72, 0.74])
    bars = [segment[:, 1] for c in ax.collections if isinstance(c, LineCollection)
            for segment in c.get_segments()]
    se_a = 0.02 / 3 ** 0.5  # std 0.02 over 3 runs
    np.testing.assert_allclose(sorted(bars, key=min), [[0.0, 0.02], [0.72 - se_a, 0.72 + se_a]])
    ordered = lab.plot_final(runs, order=["b", "a"])
    assert [t.get_text() for t in ordered.get_xticklabels()] == ["b\nn=2", "a\nn=3"]
    with pytest.raises(ValueError, match="no runs of algo='c'"):
        lab.plot_final(runs, order=["a", "c"])


def test_a_run_launched_from_a_relative_folder_finds_its_config(tmp_path, monkeypatch):
    """A notebook names its runs relative to itself (`RUNS = "../../runs/ablation"`), and the
    run's process starts in the repository: every path it gets is absolute."""
    started = []

    class Started:
        def __init__(self, args, cwd, **_):
            started.append((args, cwd))

    monkeypatch.setattr(lab.subprocess, "Popen", Started)
    monkeypatch.setattr(lab, "code_version", lambda: "c0ffee")  # git also starts a Popen
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    run = lab.launch("toy", "../runs/a", {"seed": 3})
    (args, cwd), = started
    flags = dict(a.removeprefix("--").split("=", 1) for a in args if a.startswith("--"))
    assert cwd != os.getcwd() and os.path.isabs(flags["config"]) and os.path.isabs(flags["workdir"])
    assert os.path.isfile(flags["config"]) and run.workdir == str(tmp_path / "runs" / "a")


def test_the_mesh_rules_are_fields_a_resume_reads_back_and_the_old_string_is_refused(
        tmp_path, monkeypatch):
    """`mesh.rules.<logical axis>` takes a tuple of mesh axes; `lab_config.json` keeps it as a
    list, which both re-applies to the same rules and compares equal when the run is launched
    again (a resume). A record of the string form `mesh.rules` once took is refused, saying
    how to write it now."""
    from sao_jax.train import build

    class Started:
        def __init__(self, *_, **__):
            pass

    monkeypatch.setattr(lab.subprocess, "Popen", Started)
    monkeypatch.setattr(lab, "code_version", lambda: "c0ffee")  # git also starts a Popen
    overrides = {"mesh.rules.embed": ("fsdp", "tensor"), "mesh.rules.vocab": ()}
    rules = dict(build.sharding_rules(lab.config("toy", overrides)))
    assert (rules["embed"], rules["vocab"], rules["batch"]) == (("fsdp", "tensor"), (),
                                                                ("data", "fsdp"))
    run = lab.launch("toy", str(tmp_path / "run"), overrides)
    again = lab.launch("toy", str(tmp_path / "run"), overrides)  # the same config: no refusal
    record = os.path.join(run.workdir, lab.LAB_CONFIG)
    assert again.workdir == run.workdir
    assert dict(build.sharding_rules(lab.config_from_file(record))) == rules
    with pytest.raises(ValueError, match=r"'mesh.rules.embedd': there is no such field"):
        lab.config("toy", {"mesh.rules.embedd": ("fsdp",)})
    with open(record, "w") as f:
        json.dump({"experiment": "toy", "overrides": {"mesh.rules": "embed=fsdp+tensor"}}, f)
    with pytest.raises(ValueError, match=r"'mesh.rules' = 'embed=fsdp\+tensor': 'mesh.rules' is "
                                         r"a group of fields; set them one by one, as "
                                         r"'mesh.rules.<name>' \(batch, embed, expert"):
        lab.config_from_file(record)


def test_each_launch_records_the_code_it_imports_and_a_grid_warns_when_it_changes(
        tmp_path, monkeypatch):
    """A run imports the working tree when it starts: `code_version` names it (the commit, and
    a hash of uncommitted changes to sao_jax/ and experiments/), `summaries` reports it per run,
    and a grid whose code changes between two launches says so."""
    import subprocess
    import warnings

    repo = tmp_path / "repo"
    (repo / "sao_jax").mkdir(parents=True)
    (repo / "sao_jax" / "a.py").write_text("x = 1\n")
    (repo / "README.md").write_text("hello\n")

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t",
                               *args], capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "one")
    head = git("rev-parse", "--short=12", "HEAD")
    assert lab.code_version(str(repo)) == head
    (repo / "README.md").write_text("changed, but no run imports it\n")
    assert lab.code_version(str(repo)) == head
    (repo / "sao_jax" / "a.py").write_text("x = 2\n")
    edited = lab.code_version(str(repo))
    assert edited.startswith(head + "+") and len(edited) == len(head) + 9
    (repo / "sao_jax" / "a.py").write_text("x = 3\n")
    assert lab.code_version(str(repo)) not in (head, edited)
    (repo / "sao_jax" / "a.py").write_text("x = 1\n")
    (repo / "experiments").mkdir()
    (repo / "experiments" / "new.py").write_text("y = 1\n")  # a new file counts too
    assert lab.code_version(str(repo)) not in (head, edited)
    assert lab.code_version(str(tmp_path / "nowhere")) == "unknown"

    versions = iter([head, head, edited])

    class Finished:
        def wait(self, progress):
            return {}

    def launch(experiment, workdir, overrides):
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, lab.CODE_FILE), "w") as f:
            json.dump([{"code": next(versions), "time": "t"}], f)
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump({"final_eval_accuracy": 0.5}, f)
        with open(os.path.join(workdir, lab.LAB_CONFIG), "w") as f:
            json.dump({"experiment": experiment, "overrides": overrides}, f)
        with open(os.path.join(workdir, "config.json"), "w") as f:  # what a run writes
            json.dump({}, f)
        return Finished()

    monkeypatch.setattr(lab, "launch", launch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lab.grid(str(tmp_path / "runs"), "toy", {"seed": [0, 1, 2]}, progress=False)
    said = [str(w.message) for w in caught if "code changed" in str(w.message)]
    assert len(said) == 1 and f"seed=2 runs {edited}, its first run {head}" in said[0]
    frame = lab.summaries(str(tmp_path / "runs")).sort_values("seed")
    assert list(frame["code"]) == [head, head, edited]
