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
# # Online learning: the rewarded style switches twice
#
# `experiments/online_style.py`: the style a judge rewards changes at set learner steps
# (`config.env.style_schedule`). The claim (docs/algorithm.md §6): SAO re-aligns
# quickly after each switch, while a running-mean baseline (one global window of recent rewards)
# lags and plateaus lower. Measured per run and switch: the learner steps until the training
# reward (a rolling mean) first reaches 80% of its level just before the switch.

# %% tags=["parameters"]
EXPERIMENT = "online_style"
ALGOS = ["sao", "running_mean"]
SEEDS = list(range(8))
OVERRIDES = {}
LAUNCH = False
PARALLEL = 1
RUNS = "../../runs/online_switch"
RESULTS = "results/online_switch"
BEFORE = 50  # steps before a switch that set the level to recover
SMOOTH = 10  # steps in the rolling mean (the recovery test and the figure)

# %%
import os

import pandas as pd

from sao_jax import lab
from sao_jax.envs.style_shift import parse_schedule

TAGS = ["reward/mean", "eval/accuracy"]
if LAUNCH:  # the cells whose results are saved already are not run again
    lab.grid(RUNS, EXPERIMENT, {"algo": ALGOS, "seed": SEEDS}, overrides=OVERRIDES,
             parallel=PARALLEL, skip=lab.saved_runs(RESULTS))
    lab.save_results(RUNS, RESULTS, TAGS)
scalars, summaries = lab.load_results(RESULTS)
schedule = parse_schedule(lab.config(EXPERIMENT, OVERRIDES).env.style_schedule)
switches = [start for start, _ in schedule if start > 0]

# %% [markdown]
# ## Training reward over steps (mean over seeds, one std band; a running mean over `SMOOTH`
# steps drawn over the raw mean, faint); the switches dashed

# %%
ax = lab.plot(scalars, "reward/mean", by="algo", smooth=SMOOTH, legend="outside",
              bounds=(0, 1))
for step in switches:
    ax.axvline(step, color="grey", linestyle="--", linewidth=1)
ax.figure.set_size_inches(9, 4.5)
ax.figure.savefig(os.path.join(RESULTS, "reward.png"), dpi=110, bbox_inches="tight")

# %% [markdown]
# ## Steps to recover 80% of the pre-switch reward, per run and switch (NaN: never)

# %%
algos = scalars.drop_duplicates("run").set_index("run")["algo"]
ends = switches[1:] + [None]
recovery = pd.DataFrame({
    f"switch at {s}": lab.recovery_steps(scalars, "reward/mean", s, before=BEFORE,
                                         smooth=SMOOTH, end=e)
    for s, e in zip(switches, ends, strict=True)})
recovery.insert(0, "algo", algos.reindex(recovery.index))
recovery

# %%
recovery.groupby("algo").agg(["mean", "std", "count"])

# %% [markdown]
# ## The claims, with verdicts
#
# Re-alignment: the steps to recover after each switch, a run that never recovers counted as the
# whole span to the next switch (or the end): a lower bound, so the test is conservative for the
# faster algorithm. Plateau: the mean training reward over the `BEFORE` steps before each switch
# and before the end. `lab.compare` gives each claim Welch's t-test (two-sided p); `lab.holm` its
# verdict, over the claims of this table together: "reproduced" when the Holm-adjusted p (`p_holm`)
# is at most 0.05 and the difference points the claim's way, "not reproduced" when it points the
# other way, else "inconclusive" (docs/measurements.md).

# %%
last_step = int(scalars["step"].max())
spans = [(e or last_step + 1) - s for s, e in zip(switches, ends, strict=True)]
censored = recovery.copy()
for column, span in zip([c for c in recovery.columns if c != "algo"], spans, strict=True):
    censored[column] = censored[column].fillna(span)
rewards = scalars[scalars["tag"] == "reward/mean"]
rows = []
for column in [c for c in recovery.columns if c != "algo"]:
    frame = censored[["algo", column]].rename(columns={column: "steps"})
    if {"sao", "running_mean"} <= set(frame["algo"]):
        rows.append({"claim": f"SAO re-aligns faster after the {column}",
                     **lab.compare(frame, "steps", "running_mean", "sao")})
for end in [*switches, last_step + 1]:
    window = rewards[(rewards["step"] >= end - BEFORE) & (rewards["step"] < end)]
    level = window.groupby(["run", "algo"])["value"].mean().rename("reward").reset_index()
    if {"sao", "running_mean"} <= set(level["algo"]):
        rows.append({"claim": f"SAO's plateau is higher before step {end}",
                     **lab.compare(level, "reward", "sao", "running_mean")})
rows = lab.holm(rows)
pd.DataFrame(rows).set_index("claim").round(3) if rows else "no pair of these runs to compare"
