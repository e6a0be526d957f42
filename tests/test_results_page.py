"""The numbers docs/results.md and the README state are the committed CSVs' (recomputed here with
`sao_jax.lab` as the notebooks compute them): a grid that gains seeds, or a rerun cell, fails
this test until the prose says what the results now say."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from sao_jax import lab

RESULTS = os.path.join(lab.REPO, "experiments", "notebooks", "results")


def read(*path: str) -> str:
    """The page's text with each run of whitespace one space: prose wraps where it likes."""
    with open(os.path.join(lab.REPO, *path)) as f:
        return " ".join(f.read().split())


def finals(folder: str) -> pd.DataFrame:
    """One row per run with its `final` (the mean of its last three evaluations), as the
    notebooks have it."""
    scalars, summaries = lab.load_results(os.path.join(RESULTS, folder))
    return summaries.merge(lab.final(scalars)[["run", "final"]], on="run")


def cell(frame: pd.DataFrame, n: bool = True) -> dict[str, str]:
    stats = lab.table(frame, "final", by="algo")
    return {algo: f"{row['mean']:.3f} ± {row['se']:.3f}" + (f" ({int(row['n'])})" if n else "")
            for algo, row in stats.iterrows()}


def difference(frame: pd.DataFrame, higher: str, lower: str) -> tuple[str, str]:
    """`+d, SE s` and the 95% interval `lo to hi`, as the prose writes them."""
    c = lab.compare(frame, "final", higher, lower)
    return (f"{c['difference']:+.3f}, SE {c['se']:.3f}",
            f"{c['ci_low']:+.3f} to {c['ci_high']:+.3f}".replace("+-", "-"))


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return {"results": read("docs", "results.md"), "readme": read("README.md")}


def test_the_ablations_cells_and_differences_are_the_committed_runs(pages):
    ablation = finals("ablation")
    cells = cell(ablation)
    for algo in ("sao", "grpo_dis", "grpo", "running_mean", "sao_k1", "sao_step_value", "vapo"):
        assert cells[algo] in pages["results"], (algo, cells[algo])
    for higher, lower, where in [("sao", "grpo_dis", ("results", "readme")),
                                 ("sao", "running_mean", ("results", "readme")),
                                 ("sao", "sao_k1", ("results",)),
                                 ("sao", "sao_step_value", ("results",))]:
        stated, _ = difference(ablation, higher, lower)
        for page in where:
            assert stated in pages[page], (higher, lower, page, stated)
    for lower in ("running_mean", "sao_k1", "sao_step_value"):  # the bounded claims' intervals
        _, interval = difference(ablation, "sao", lower)
        assert f"95% interval {interval}" in pages["results"], (lower, interval)
    for lower in ("sao_k1", "sao_step_value"):
        _, interval = difference(ablation, "sao", lower)
        assert interval in pages["readme"], (lower, interval)


def test_the_staleness_cells_at_lag_8_and_the_long_runs_are_the_committed_runs(pages):
    staleness = finals("staleness")
    lag8 = staleness[staleness["run"].str.startswith("lag=8/")]
    cells = cell(lag8, n=False)
    text = pages["results"]
    assert f"{cells['grpo']} ({lag8['algo'].eq('grpo').sum()}, lag 8)" in text
    assert f"{cells['vapo']} ({lag8['algo'].eq('vapo').sum()})" in text
    n_sao, n_dis = lag8["algo"].eq("sao").sum(), lag8["algo"].eq("grpo_dis").sum()
    each = f" ({n_sao} each)" if n_sao == n_dis else f" ({n_sao} and {n_dis})"
    assert f"{cells['sao']} vs {cells['grpo_dis']}{each}" in text, (cells["sao"],
                                                                    cells["grpo_dis"])
    stated, interval = difference(lag8, "sao", "grpo_dis")
    assert stated in text, stated
    assert f"95% interval {interval}" in text and interval in pages["readme"], interval
    long = staleness[staleness["run"].str.startswith("long/")]
    assert cell(long, n=False)["sao"] in text


def test_the_swe_cells_and_verdicts_are_the_committed_runs(pages):
    """The SWE paragraph's cells (sampled: the last three evaluations; greedy: the final one;
    the base: every run's first evaluation) and its table's differences, as the swe notebook
    computes them."""
    scalars, summaries = lab.load_results(os.path.join(RESULTS, "swe"))
    last_three = lab.final(scalars, "eval/accuracy", last=3).set_index("run")["final"]

    def resolved(before: pd.Series, after: pd.Series) -> pd.DataFrame:
        base = summaries.assign(algo="base", final=before.to_numpy())
        return pd.concat([base, summaries.assign(final=after.to_numpy())])

    sampled = resolved(summaries["initial_eval_accuracy"], last_three.reindex(summaries["run"]))
    greedy = resolved(summaries["initial_greedy_accuracy"], summaries["final_greedy_accuracy"])
    text = pages["results"]
    plain, greedy_cells = cell(sampled, n=False), cell(greedy)
    for algo in ("sao", "grpo_dis"):
        assert f"{plain[algo]} / {greedy_cells[algo]}" in text, algo
    assert f"gave {plain['base']} over the {sampled['algo'].eq('base').sum()}" in text
    for higher, lower in [("sao", "base"), ("grpo_dis", "base"), ("sao", "grpo_dis")]:
        for frame in (sampled, greedy):
            c = lab.compare(frame, "final", higher, lower)
            stated = f"{c['difference']:+.2f}, SE {c['se']:.3f}"
            assert stated in text, (higher, lower, stated)
