"""The toy run through real SGLang against the embedded engine (docs/sglang.md, "It learns
through SGLang"): training reward per step of each run, smoothed, with the raw series faint.

    python docs/figures/sglang_curves.py sglang:runs/toy_sglang_s1 embedded:runs/toy_emb_s3 ...
        # reads each LABEL:RUN's events, writes sglang_curves.csv, then draws
    python docs/figures/sglang_curves.py          # draws from the committed sglang_curves.csv

A run's seed comes from its config.json; runs of one label share a colour.
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CSV = os.path.join(HERE, "sglang_curves.csv")
PNG = os.path.join(HERE, "sglang_curves.png")
TAGS = ["reward/mean", "time/step_s", "time/learner_idle_frac", "eval/accuracy"]
SMOOTH = 15  # steps in the rolling mean


def read_runs(runs):
    from sao_jax import lab

    frames = []
    for arg in runs:
        label, run = arg.split(":", 1)
        with open(os.path.join(run, "config.json")) as f:
            config = json.load(f)
        frame = lab.load([run], TAGS)[["step", "tag", "value"]]
        frame["label"], frame["seed"] = label, config["seed"]
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def draw(frame):
    fig, ax = plt.subplots(figsize=(7, 4))
    reward = frame[frame.tag == "reward/mean"]
    palette = ["tab:red", "tab:blue", "tab:gray", "tab:green"]
    colours = {label: palette[i % len(palette)] for i, label in enumerate(reward["label"].unique())}
    for (label, seed), run in reward.groupby(["label", "seed"], sort=False):
        run = run.sort_values("step")
        ax.plot(run.step, run.value, color=colours[label], alpha=0.15, linewidth=0.8)
        ax.plot(run.step, run.value.rolling(SMOOTH, min_periods=1).mean(),
                color=colours[label], linewidth=1.5, label=f"{label}, seed {seed}")
    ax.set_xlabel("policy step")
    ax.set_ylabel(f"training reward (rolling mean of {SMOOTH} steps)")
    ax.set_title("toy_sglang: SAO through each engine")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(PNG, dpi=110)


if __name__ == "__main__":
    if sys.argv[1:]:
        read_runs(sys.argv[1:]).to_csv(CSV, index=False)
    draw(pd.read_csv(CSV))
    print(f"wrote {PNG}")
