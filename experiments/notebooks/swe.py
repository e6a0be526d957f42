# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # SWE agents at toy scale: SAO against GRPO+DIS on swe_tiny
#
# `experiments/swe_tiny.py`: one-line bug fixes in small functions, played in real workspaces
# and graded by the tasks' hidden tests as `swe` grades them (docs/swe.md). Every run starts
# from the same warm start (`warm_start.seed`), so the warm-started base is one policy; its
# held-out resolved rate is each run's first evaluation (40 held-out tasks, sampled as in
# training), and greedy once per run. The claims (the paper's SWE comparison, docs/algorithm.md
# §6): RL through this path raises held-out resolved above the base, and SAO more than
# GRPO+DIS, with the same steps and settings.
#
# With `LAUNCH = False` (the default) the figures are drawn from the committed results in
# `RESULTS`; `LAUNCH = True` runs the grid's missing cells first and saves their results there.
# The committed grid is swe_tiny as it is (since 2026-12-06 its teacher errs on the operator
# bugs only); the grid before it, whose teacher erred on every bug kind, is kept in
# `results/swe_all_kinds` (run it with `OVERRIDES = {"env.swe.expert_mistake_kinds": ""}`).

# %% tags=["parameters"]
EXPERIMENT = "swe_tiny"
ALGOS = ["sao", "grpo_dis"]
SEEDS = list(range(5))
OVERRIDES = {}  # applied to every run
LAUNCH = False
PARALLEL = 1  # runs at once (each uses every core it can)
RUNS = "../../runs/swe"  # the runs themselves (not committed)
RESULTS = "results/swe"  # their scalars and summaries as CSV, and the figures
SMOOTH = 10  # steps in the running mean of the training curves
# Async against sync: SAO in each mode (config.mode), these seeds, one run at a time (a wall
# clock is only comparable on an otherwise quiet machine). The committed pair ran on the config
# before 2026-12-06 (the teacher erring on every bug kind), which MODE_OVERRIDES pins.
MODES = ["sync", "async"]
MODE_SEEDS = [0]
MODE_OVERRIDES = {"env.swe.expert_mistake_kinds": ""}
MODE_RUNS = "../../runs/swe_modes"
MODE_RESULTS = "results/swe_modes"
THRESHOLDS = [0.15, 0.2, 0.25]  # held-out resolved rates to time

# %%
import os

import matplotlib.pyplot as plt
import pandas as pd

from sao_jax import lab

TAGS = ["eval/accuracy", "reward/mean", "swe/resolved", "swe/submitted", "swe/format_errors",
        "swe/turns", "rollout/response_tokens", "critic/explained_variance", "time/step_s",
        "swe/suspicious", "swe/suspicious_resolved"]
if LAUNCH:  # the cells whose results are saved already are not run again
    lab.grid(RUNS, EXPERIMENT, {"algo": ALGOS, "seed": SEEDS}, overrides=OVERRIDES,
             parallel=PARALLEL, skip=lab.saved_runs(RESULTS))
    lab.save_results(RUNS, RESULTS, TAGS)
scalars, summaries = lab.load_results(RESULTS)

# %% [markdown]
# ## Per run: held-out resolved before and after RL (sampled, and greedy), and the wall clock

# %%
runs = summaries[["run", "algo", "seed", "initial_eval_accuracy", "final_eval_accuracy",
                  "initial_greedy_accuracy", "final_greedy_accuracy", "wall_time_s"]]
runs = runs.assign(last_three_evals=lab.final(scalars, "eval/accuracy", last=3)
                   .set_index("run")["final"].reindex(runs["run"]).to_numpy())
runs.sort_values(["algo", "seed"]).set_index("run").round(3)

# %% [markdown]
# ## Held-out resolved: the warm-started base and each algorithm after RL (mean ± standard
# error over runs, n runs). The base's rows are every run's first evaluation, sampled, and its
# greedy evaluation (one policy, so the greedy rows are one number). After RL, sampled: the
# mean of a run's last three evaluations (steps 100, 125 and 130; one evaluation of 40 tasks
# swings by ±0.07), greedy: the final one.

# %%
def resolved(before: pd.Series, after: pd.Series) -> pd.DataFrame:
    base = summaries.assign(algo="base", resolved=before.to_numpy())
    trained = summaries.assign(resolved=after.to_numpy())
    return pd.concat([base, trained])[["run", "algo", "resolved"]]


last_three = lab.final(scalars, "eval/accuracy", last=3).set_index("run")["final"]
sampled = resolved(summaries["initial_eval_accuracy"], last_three.reindex(summaries["run"]))
greedy = resolved(summaries["initial_greedy_accuracy"], summaries["final_greedy_accuracy"])
lab.table(sampled, "resolved")[["mean ± SE (n)"]].add_suffix(" sampled").join(
    lab.table(greedy, "resolved")[["mean ± SE (n)"]].add_suffix(" greedy"))

# %% [markdown]
# ## Held-out resolved at each evaluation and the training reward (mean over seeds, one std
# band; the reward a running mean over `SMOOTH` steps, drawn over the raw mean, faint)

# %%
fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
lab.plot(scalars, "eval/accuracy", by="algo", ax=axes[0], legend=None, bounds=(0, 1))
lab.plot(scalars, "reward/mean", by="algo", ax=axes[1], smooth=SMOOTH, legend="outside",
         bounds=(0, 1))
fig.savefig(os.path.join(RESULTS, "resolved.png"), dpi=110, bbox_inches="tight")

# %% [markdown]
# ## The protocol: submitted episodes, format errors per episode and seconds per learner step

# %%
fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
lab.plot(scalars, "swe/submitted", by="algo", ax=axes[0], smooth=SMOOTH, legend=None,
         bounds=(0, 1))
lab.plot(scalars, "swe/format_errors", by="algo", ax=axes[1], smooth=SMOOTH, legend=None,
         bounds=(0, None))
lab.plot(scalars, "time/step_s", by="algo", ax=axes[2], smooth=SMOOTH, legend="outside")
fig.savefig(os.path.join(RESULTS, "protocol.png"), dpi=110, bbox_inches="tight")
lab.table(scalars, "time/step_s", by="algo", last=False)[["mean ± std (n)"]]

# %% [markdown]
# ## The reward-hacking monitor over every training episode: the fraction it flagged, and the
# fraction flagged and resolved besides (a reward paid for what the monitor caught: a defect to
# look into, not a success), means over every logged step of every run of an algorithm

# %%
monitor = scalars[scalars["tag"].isin(["swe/suspicious", "swe/suspicious_resolved"])]
monitor.pivot_table(index="algo", columns="tag", values="value", aggfunc="mean").round(4)

# %% [markdown]
# ## Async against sync: the wall clock to the same held-out rate
#
# SAO in `mode = "async"` (train on episodes as they finish, policy lag up to `max_staleness`)
# and `"sync"` (generate a batch with the current policy, then train on it), each from the same
# warm start, run one at a time on the otherwise quiet 2-core machine. Episodes differ in turns
# and tokens (a read, a fix, a malformed reply, a cut episode), and each is graded in a fresh
# workspace: a sync batch waits for its slowest episode and grading, async does not.
# Per mode (mean over its runs): the run's wall clock and steps, seconds per step, the share of
# the time the learner waited for episodes, held-out resolved at the end (sampled: the last
# three evaluations; greedy: the final one), and the minutes until an evaluation first reached
# each rate in `THRESHOLDS` (`time/elapsed_s` at the evaluation's step; "-": never).

# %%
if LAUNCH and MODES:
    lab.grid(MODE_RUNS, EXPERIMENT, {"mode": MODES, "algo": ["sao"], "seed": MODE_SEEDS},
             overrides=MODE_OVERRIDES, parallel=1, skip=lab.saved_runs(MODE_RESULTS))
    lab.save_results(MODE_RUNS, MODE_RESULTS, TAGS + ["eval/greedy_accuracy", "time/elapsed_s",
                                                      "time/learner_idle_frac"])


def minutes_to(frame: pd.DataFrame, tag: str, rate: float) -> float:
    """Minutes of the run's wall clock until `tag` first reached `rate` (NaN: never)."""
    clock = frame[frame["tag"] == "time/elapsed_s"].set_index("step")["value"]
    reached = frame[(frame["tag"] == tag) & (frame["value"] >= rate)]["step"]
    if reached.empty:
        return float("nan")
    step = int(reached.min())
    return float(clock.get(step, 0.0)) / 60  # step 0: the evaluation before the first step


if os.path.exists(os.path.join(MODE_RESULTS, lab.SUMMARIES_CSV)):
    mode_scalars, mode_summaries = lab.load_results(MODE_RESULTS)
    rows = []
    for (mode, run), frame in mode_scalars.groupby(["mode", "run"]):
        summary = mode_summaries.set_index("run").loc[run]
        evals = frame[frame["tag"] == "eval/accuracy"].sort_values("step")["value"]
        row = {"mode": mode, "wall clock (min)": summary["wall_time_s"] / 60,
               "steps": summary["steps"],
               "s a step": frame[frame["tag"] == "time/step_s"]["value"].mean(),
               "learner idle": frame[frame["tag"] == "time/learner_idle_frac"]["value"].mean(),
               "sampled, last three": evals.tail(3).mean(),
               "greedy, final": summary["final_greedy_accuracy"]}
        for rate in THRESHOLDS:
            row[f"min to {rate} sampled"] = minutes_to(frame, "eval/accuracy", rate)
            row[f"min to {rate} greedy"] = minutes_to(frame, "eval/greedy_accuracy", rate)
        rows.append(row)
    modes_table = pd.DataFrame(rows).groupby("mode").mean().round(3).T.fillna("-")
else:
    modes_table = f"no results in {MODE_RESULTS}: run with LAUNCH = True"
modes_table

# %% [markdown]
# ## The claims, with verdicts
#
# Held-out resolved after RL (sampled: the mean of the last three evaluations; greedy: the final
# one) against the base and against each other. `lab.compare` gives each claim Welch's t-test
# (two-sided p); `lab.holm` its verdict, over the claims of this table together: "reproduced" when
# the Holm-adjusted p (`p_holm`) is at most 0.05 and the difference points the claim's way, "not
# reproduced" when it points the other way, else "inconclusive" (docs/measurements.md).

# %%
CLAIMS = [("SAO > base", "sao", "base"), ("GRPO+DIS > base", "grpo_dis", "base"),
          ("SAO > GRPO+DIS", "sao", "grpo_dis")]
rows = []
for name, frame in (("sampled", sampled), ("greedy", greedy)):
    for claim, higher, lower in CLAIMS:
        if {higher, lower} <= set(frame["algo"]):
            rows.append({"claim": f"{claim} ({name})",
                         **lab.compare(frame, "resolved", higher, lower)})
rows = lab.holm(rows)
pd.DataFrame(rows).set_index("claim").round(3) if rows else "no pair of these runs to compare"
