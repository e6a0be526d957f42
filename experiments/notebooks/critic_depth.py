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
# # Frozen attention in a 4-layer critic
#
# `experiments/chain_deep.py`: the chain testbed with a 4-layer policy, so that its critic (the
# policy's copy with a value head) has four attention blocks to freeze. The claim
# (docs/algorithm.md §6; the paper's ablation): a critic that trains all its parameters has much
# larger gradient norms than one with its attention frozen, and the policy it feeds does worse.
# The 2-layer ablation (`ablation.ipynb`) could not tell the two apart; this one measures, per
# run, the mean and the spread (the standard deviation over its learner steps) of the critic's
# gradient norm and of its value loss, not only the means.
#
# `sao` freezes the critic's attention, `sao_full_critic` trains everything; all else is the
# same (the experiment's defaults, the same warm start, the same budget). With `LAUNCH = False`
# the figures are drawn from the committed results in `RESULTS`.

# %% tags=["parameters"]
EXPERIMENT = "chain_deep"
ALGOS = ["sao", "sao_full_critic"]
SEEDS = list(range(8))
OVERRIDES = {}
LAUNCH = False
PARALLEL = 1
RUNS = "../../runs/critic_depth"
RESULTS = "results/critic_depth"
SMOOTH = 10  # logged steps in the running mean of the per-step figures
SHALLOW_FROM = "results/ablation"  # chain's 2-layer runs of ALGOS, compared alike (None: not)
ATTENTION_FROM = "results/critic_attention"  # full-critic runs with the attention's norm (None)

# %%
import os

import matplotlib.pyplot as plt
import pandas as pd

from sao_jax import lab

pd.set_option("display.max_colwidth", 80)  # the claims' names whole
TAGS = ["eval/accuracy", "reward/mean", "critic/grad_norm", "critic/loss",
        "critic/explained_variance"]
if LAUNCH:  # the cells whose results are saved already are not run again
    lab.grid(RUNS, EXPERIMENT, {"algo": ALGOS, "seed": SEEDS}, overrides=OVERRIDES,
             parallel=PARALLEL, skip=lab.saved_runs(RESULTS))
    lab.save_results(RUNS, RESULTS, TAGS)
scalars, summaries = lab.load_results(RESULTS)
summaries = summaries.merge(lab.final(scalars)[["run", "final"]], on="run")

# %% [markdown]
# ## The critic over learner steps (mean over seeds, one std band; a running mean over
# `SMOOTH` steps drawn over the raw mean, faint)

# %%
fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
lab.plot(scalars, "critic/grad_norm", by="algo", ax=axes[0], smooth=SMOOTH,
         legend=None).set_yscale("log")
lab.plot(scalars, "critic/loss", by="algo", ax=axes[1], smooth=SMOOTH,
         legend=None).set_yscale("log")
lab.plot(scalars, "critic/explained_variance", by="algo", ax=axes[2], smooth=SMOOTH,
         legend="outside", bounds=(None, 1), ylim=(-1, 1))
fig.savefig(os.path.join(RESULTS, "critic.png"), dpi=110, bbox_inches="tight")

# %% [markdown]
# ## Held-out Pass@1 (every 50 steps; mean over seeds, one std band)

# %%
ax = lab.plot(scalars, "eval/accuracy", by="algo", legend="outside", bounds=(0, 1))
ax.figure.savefig(os.path.join(RESULTS, "accuracy.png"), dpi=110, bbox_inches="tight")

# %% [markdown]
# ## Per run: the critic's gradient norm and value loss, their means and spreads over the run
#
# With `SHALLOW_FROM`, the same statistics of the 2-layer ablation's runs (`chain`; it logged
# the gradient norm, not the value loss), so that depth is the one thing that differs.


# %%
def per_run_stats(frame, layers):
    """Each run's mean and std over its steps of the critic's gradient norm and value loss."""
    critic = frame[frame["tag"].isin(["critic/grad_norm", "critic/loss"])]
    stats = critic.pivot_table(index=["run", "algo"], columns="tag", values="value",
                               aggfunc=["mean", "std"])
    stats.columns = [f"{tag.split('/')[1]}_{stat}" for stat, tag in stats.columns]
    return stats.reset_index().assign(layers=layers)


layers = lab.config(EXPERIMENT, OVERRIDES).model.num_layers or "preset"
per_run = per_run_stats(scalars, layers)
if SHALLOW_FROM:
    shallow = lab.load_results(SHALLOW_FROM)[0]
    per_run = pd.concat([per_run, per_run_stats(shallow[shallow["algo"].isin(ALGOS)], 2)],
                        ignore_index=True)
columns = [c for c in per_run.columns if c not in ("run", "algo", "layers")]
pd.concat({c: lab.table(per_run.dropna(subset=[c]), c, by=["layers", "algo"])["mean ± SE (n)"]
           for c in columns}, axis=1)

# %% [markdown]
# ## Where the full critic's gradient goes
#
# With `ATTENTION_FROM`: `sao_full_critic` runs of `EXPERIMENT` that logged
# `critic/attention_grad_norm` (the attention's part of the critic's gradient norm, logged since
# 8d57365, after the runs above). Per run, over its steps: the mean gradient norm, the mean of
# the attention's, their ratio (mean and median over steps), and the attention's share of the
# summed squared norm: how much freezing the attention could lower the norm by itself.


# %%
def attention_share(frame):
    tags = ["critic/grad_norm", "critic/attention_grad_norm"]
    norms = frame[frame["tag"].isin(tags)].pivot_table(index=["run", "step"], columns="tag",
                                                       values="value").dropna()
    total, attention = norms[tags[0]], norms[tags[1]]
    ratio = (attention / total).groupby("run")
    return pd.DataFrame({
        "grad_norm_mean": total.groupby("run").mean(),
        "attention_grad_norm_mean": attention.groupby("run").mean(),
        "ratio_mean": ratio.mean(), "ratio_median": ratio.median(),
        "share_of_squared_norm": (attention**2).groupby("run").sum()
        / (total**2).groupby("run").sum()})


(attention_share(lab.load_results(ATTENTION_FROM)[0]).round(4) if ATTENTION_FROM
 else "no runs with the attention's gradient norm")

# %% [markdown]
# ## The claims, with verdicts
#
# "Frozen attention lowers X": X, per run, is the mean or the standard deviation ("spread") over
# its learner steps (the critic-only warm-up included: both algorithms have it) of the critic's
# gradient norm (before clipping, over the parameters it trains) or of its value loss, and it
# should be higher with every parameter trained (`sao_full_critic`) than with the attention frozen
# (`sao`). The last row: the final held-out Pass@1 (the mean of the last three evaluations), higher
# with the attention frozen, as in the paper. `lab.compare` gives each claim Welch's t-test
# (two-sided p); `lab.holm` its verdict, over the claims of this table together: "reproduced" when
# the Holm-adjusted p (`p_holm`) is at most 0.05 and the difference points the claim's way, "not
# reproduced" when it points the other way, else "inconclusive" (docs/measurements.md).

# %%
CLAIMS = [  # (X, value, the group that should be higher, the lower)
    ("mean gradient norm", "grad_norm_mean", "sao_full_critic", "sao"),
    ("gradient norm's spread", "grad_norm_std", "sao_full_critic", "sao"),
    ("mean value loss", "loss_mean", "sao_full_critic", "sao"),
    ("value loss's spread", "loss_std", "sao_full_critic", "sao"),
]
rows = []
for depth, runs in per_run.groupby("layers", sort=False):
    for claim, value, higher, lower in CLAIMS:
        frame = runs.dropna(subset=[value])
        if {higher, lower} <= set(frame["algo"]):
            rows.append({"claim": f"{depth} layers: frozen attention lowers the {claim}",
                         **lab.compare(frame, value, higher, lower)})
if {"sao", "sao_full_critic"} <= set(summaries["algo"]):
    rows.append({"claim": f"{layers} layers: final Pass@1, SAO > a full critic",
                 **lab.compare(summaries, "final", "sao", "sao_full_critic")})
rows = lab.holm(rows)
pd.DataFrame(rows).set_index("claim").round(3) if rows else "no pair of these runs to compare"
