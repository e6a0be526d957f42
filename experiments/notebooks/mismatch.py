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
# # The training-inference mismatch: DIS against the corrections other frameworks ship
#
# The engine samples with its own numerics and the learner scores the same tokens with its own,
# so their log-probs differ (the gap, docs/algorithm.md §5, "The training-inference gap"), and
# in bfloat16 by far more than in float32. Frameworks correct PPO's update for it in several
# ways; this notebook runs them side by side on `chain` (four dependent calculator calls), learner
# and embedded engine both computing in bfloat16 (`model.dtype`; the learner keeps float32 master
# weights, `model.master_dtype`), with the same budget and settings:
#
# | algo | correction of PPO's terms (docs/algorithm.md, "The mismatch corrections") |
# |---|---|
# | `grpo` | none |
# | `grpo_tis` | truncated importance sampling: each token's term weighted by its ratio, capped |
# | `grpo_icepop` | IcePop: tokens whose ratio leaves a band are masked |
# | `grpo_geomask` | a row is masked when its tokens' geometric mean ratio leaves a band |
# | `grpo_dis` | DIS, ours: the ratio to the engine's log-probs, masked on both sides |
#
# Each at lag 0 (chain's own asynchrony, about one version) and lag 8 (`rollout.lag_versions`,
# injected staleness, as in the staleness notebook), `SEEDS` seeds a cell. The figures: final
# held-out Pass@1 (the mean of the last three evaluations, docs/measurements.md), the gap's course
# over the runs (the whole batch's, and the numerics alone: the rows of policy lag 0), and what
# each correction did. The MoE section reads the three bfloat16 `toy_moe` runs of `MOE_RESULTS`
# (the embedded engine with its routes reported, with routing replay, and real SGLang). The
# cells of `BF16_COPY_RESULTS` ran before the learner had master weights: it kept its copy in
# bfloat16 and lost updates (docs/results.md,
# "The mismatch corrections, in bfloat16 (in progress)"); a table sets them beside these.

# %% tags=["parameters"]
EXPERIMENT = "chain"
ALGOS = ["grpo", "grpo_tis", "grpo_icepop", "grpo_geomask", "grpo_dis"]
LAGS = [0, 8]
SEEDS = list(range(8))  # docs/measurements.md: 8 per cell
OVERRIDES = {"model.dtype": "bfloat16"}  # applied to every run
LAUNCH = False
PARALLEL = 1
RUNS = "../../runs/mismatch"
RESULTS = "results/mismatch"
MOE_RESULTS = "results/mismatch_moe"  # None: no MoE section
# The cells run before the learner had float32 master weights (None: no such section)
BF16_COPY_RESULTS = "results/mismatch_bf16_copy"
SMOOTH = 10  # logged steps in the running mean of the per-step figures

# %%
import os

import matplotlib.pyplot as plt
import pandas as pd

from sao_jax import lab

GAP = ["policy/logp_mismatch", "policy/logp_mismatch_p99", "policy/logp_mismatch_max"]
FRESH = ["policy/logp_mismatch_fresh", "policy/logp_mismatch_fresh_p99",
         "policy/logp_mismatch_fresh_max", "policy/fresh_frac"]
CORRECTED = {"grpo_tis": "tis", "grpo_icepop": "icepop", "grpo_geomask": "geomask",
             "grpo_dis": "dis"}  # algo: the prefix of its correction's tags
ACTIVITY = [f"policy/{n}_{m}" for n in ("tis", "icepop", "geomask")
            for m in ("frac_below", "frac_above", "weight_mean", "rows_masked")] + [
            "policy/dis_frac_below", "policy/dis_frac_above"]
TAGS = ["eval/accuracy", "reward/mean", "rollout/policy_lag_mean", *GAP, *FRESH, *ACTIVITY]
# (The committed CSV keeps the DIS band's shares of the grpo_dis runs only: the tables read each
# correction's own tags.)


def lagged(n):
    return {**OVERRIDES, "rollout.lag_versions": n, "max_staleness": n + 2}


if LAUNCH:  # runs are named lag=<N>/<cell>; saved ones are not run again
    for n in LAGS:
        lab.grid(os.path.join(RUNS, f"lag={n}"), EXPERIMENT, {"algo": ALGOS, "seed": SEEDS},
                 overrides=lagged(n), parallel=PARALLEL,
                 skip=lab.saved_runs(RESULTS, f"lag={n}"))
    lab.save_results(RUNS, RESULTS, TAGS)
scalars, summaries = lab.load_results(RESULTS)
summaries = summaries[summaries["algo"].isin(ALGOS)].copy()
summaries["lag"] = summaries["rollout.lag_versions"]
scalars["lag"] = scalars["rollout.lag_versions"]
summaries = summaries.merge(lab.final(scalars)[["run", "final"]], on="run")

# %% [markdown]
# ## Final held-out Pass@1 per correction, at each lag (every run a dot; mean ± SE)

# %%
fig, axes = plt.subplots(1, len(LAGS), figsize=(6.5 * len(LAGS), 4.2), squeeze=False)
for ax, n in zip(axes[0], LAGS, strict=True):
    at = summaries[summaries["lag"] == n]
    if not at.empty:
        lab.plot_final(at, "final", ax=ax, order=[a for a in ALGOS if a in set(at["algo"])])
    ax.set_title(f"lag {n}: mean ± 1 SE over seeds; dots: runs", fontsize="small")
fig.savefig(os.path.join(RESULTS, "final.png"), dpi=110, bbox_inches="tight")
lab.table(summaries, "final", by=["algo", "lag"])[["mean ± SE (n)"]].unstack("lag")

# %% [markdown]
# ## Against the learner that kept its copy of the policy in bfloat16
#
# The same cells, run before the learner had float32 master weights: it added AdamW's update to
# a bfloat16 copy and lost most of it (docs/algorithm.md, "The training-inference gap"). Final
# held-out Pass@1 per cell, mean ± SE (n), beside this grid's.

# %%
beside_copy = None
if BF16_COPY_RESULTS:
    copy_scalars, copy = lab.load_results(BF16_COPY_RESULTS)
    copy["lag"] = copy["rollout.lag_versions"]
    copy = copy.merge(lab.final(copy_scalars)[["run", "final"]], on="run")
    both = pd.concat([summaries.assign(learner="float32 master weights"),
                      copy[copy["algo"].isin(ALGOS)].assign(learner="bfloat16 copy")])
    beside_copy = lab.table(both, "final", by=["algo", "lag", "learner"])[["mean ± SE (n)"]]
beside_copy if beside_copy is None else beside_copy.unstack("learner")

# %% [markdown]
# ## The gap over the runs (mean over seeds, one std band; a running mean over `SMOOTH` steps)
#
# Left, the numerics alone: the rows sampled with exactly the weights the step starts from
# (`policy/logp_mismatch_fresh`, over the steps that have any: at lag 0 about 1% of the tokens,
# and at lag 8 none, so only lag 0 draws it). Right, the whole batch's gap
# (`policy/logp_mismatch`): the numerics and the policy's movement over the rows' lag.

# %%
fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
fresh = scalars[(scalars["lag"] == min(LAGS)) & scalars["value"].notna()]  # steps with fresh rows
lab.plot(fresh, "policy/logp_mismatch_fresh", by="algo", ax=axes[0], smooth=SMOOTH, legend=None,
         bounds=(0, None))
axes[0].set_ylabel(f"fresh rows' gap, lag {min(LAGS)} (nats a token)")
lab.plot(scalars, "policy/logp_mismatch", by=["algo", "lag"], ax=axes[1], smooth=SMOOTH,
         legend="outside", bounds=(0, None))
axes[1].set_ylabel("whole batch's gap (nats a token)")
fig.savefig(os.path.join(RESULTS, "gap.png"), dpi=110, bbox_inches="tight")

# %% [markdown]
# The gap's distribution per cell: each tag's mean over a run's steps, then the mean over seeds
# (per token: mean, 0.99 quantile, max; `fresh_frac` is the share of action tokens in fresh
# rows).

# %%
per_run = (scalars[scalars["tag"].isin(GAP + FRESH)].groupby(["run", "tag"])["value"].mean()
           .unstack("tag").join(summaries.set_index("run")[["algo", "lag"]], how="inner"))
(per_run.groupby(["algo", "lag"]).mean()
 .rename(columns=lambda t: t.removeprefix("policy/logp_mismatch").removeprefix("policy/")
         or "mean").round(4))

# %% [markdown]
# ## What each correction did: the share of action tokens its band masked or capped below and
# above, its mean weight, and the rows it left without a token (means over steps and seeds)

# %%
activity = []
for algo, name in CORRECTED.items():
    runs = summaries[summaries["algo"] == algo]
    tags = [t for t in ACTIVITY if t.startswith(f"policy/{name}_")]
    rows = scalars[scalars["run"].isin(runs["run"]) & scalars["tag"].isin(tags)]
    if rows.empty:
        continue
    means = rows.groupby(["lag", "tag"])["value"].mean().unstack("tag")
    activity.append(means.rename(columns=lambda t, p=f"policy/{name}_": t.removeprefix(p))
                    .assign(algo=algo).reset_index().set_index(["algo", "lag"]))
pd.concat(activity).round(4) if activity else "no corrected runs saved"

# %% [markdown]
# ## The MoE: routing and replay over a run
#
# `toy_sglang` on `toy_moe` (every layer MoE), SAO, 150 steps, learner and engine in bfloat16,
# one warm start: the embedded engine reporting its experts (`rl.engine_routes`), the same
# replaying them in the learner (`rl.routing_replay`), and real SGLang 0.5.23 (which cannot
# report routes on a CPU host). Per engine, the mean over seeds of each run's means over steps:
# held-out Pass@1 at the start and the end, the gap's tags, and the routing split (`routed_same`:
# the share of action tokens the learner routed as the engine did; `_same`, `_different`: the gap
# on either side).

# %%
MOE_TAGS = ["logp_mismatch", "logp_mismatch_p99", "logp_mismatch_max", "logp_mismatch_fresh",
            "logp_mismatch_fresh_max", "routed_same", "logp_mismatch_same",
            "logp_mismatch_different"]


def moe_engine(row):
    """How a MoE run's engine ran: its name, and what it did with the experts it chose."""
    if row["rollout.engine"] != "embedded":
        return row["rollout.engine"]
    replayed = str(row.get("rl.routing_replay")) == "True"
    return "embedded, routing replay" if replayed else "embedded, routes reported"


if MOE_RESULTS and os.path.exists(os.path.join(MOE_RESULTS, "summaries.csv")):
    moe_scalars, moe_summaries = lab.load_results(MOE_RESULTS)
    moe_summaries["engine"] = moe_summaries.apply(moe_engine, axis=1)
    per_moe_run = (moe_scalars[moe_scalars["tag"].str.startswith("policy/")]
                   .groupby(["run", "tag"])["value"].mean().unstack("tag")
                   .rename(columns=lambda t: t.removeprefix("policy/")))
    per_moe_run = moe_summaries.set_index("run")[
        ["engine", "seed", "initial_eval_accuracy", "final_eval_accuracy"]].join(
        per_moe_run[[t for t in MOE_TAGS if t in per_moe_run]])
    moe_table = per_moe_run.groupby("engine").agg(
        seeds=("seed", "count"), **{c: (c, "mean") for c in per_moe_run.columns
                                    if c not in ("engine", "seed")}).round(4)
else:
    moe_table = "no MoE runs saved"
moe_table

# %% [markdown]
# ## The claims, with verdicts
#
# Final held-out Pass@1. At each lag: each correction against none (`grpo`), and DIS against
# each of the others. `lab.compare` gives each claim Welch's t-test (two-sided p); `lab.holm` its
# verdict over this table's claims together (docs/measurements.md); an inconclusive claim's
# `bound` says whether its 95% interval rules out a gain of 0.05 ("bounded"), or more seeds are
# needed ("open").

# %%
rows = []
for n in LAGS:
    at = summaries[summaries["lag"] == n]
    pairs = [(a, "grpo") for a in ALGOS if a != "grpo"] + [
        ("grpo_dis", a) for a in ALGOS if a not in ("grpo", "grpo_dis")]
    for higher, lower in pairs:
        if {higher, lower} <= set(at["algo"]):
            rows.append({"claim": f"{higher} > {lower} at lag {n}",
                         **lab.compare(at, "final", higher, lower)})
rows = lab.holm(rows)
for row in rows:
    row["bound"] = lab.bound(row)
pd.DataFrame(rows).set_index("claim").round(3) if rows else "no pair of these runs to compare"
