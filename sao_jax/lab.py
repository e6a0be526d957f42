"""Ablations from a notebook: configs in Python, runs in subprocesses, grids, results as tables.

    from sao_jax import lab
    config = lab.config("toy", {"algo": "grpo_dis", "rl.eps_low": 0.2})   # as --config.x=y
    run = lab.launch("toy", "runs/lab/grpo_dis", {"algo": "grpo_dis"})   # a subprocess:
                                                     # run.poll(), run.progress(), run.stop()
    run.wait()                                       # a progress bar (notebook or terminal)
    lab.grid("runs/grid", "toy", {"algo": ["sao", "grpo_dis"], "seed": [0, 1, 2]},
             overrides={"total_steps": 100})         # skips finished runs, resumes the others
    frame = lab.load("runs/grid")                    # run, <grid fields>, step, tag, value
    lab.plot(frame, "eval/accuracy", by="algo", spread="se", smooth=5)  # mean and band, per algo
    lab.table(lab.final(frame, "eval/accuracy"), "final", by="algo")  # last 3 evaluations:
                                                     # mean, std, SE and n per algo
    lab.compare(summaries, "final_eval_accuracy", "sao", "grpo_dis")   # Welch's t, p, verdict
    lab.holm([lab.compare(...), lab.compare(...)])  # claims tested together: Holm's verdicts
    lab.save_results("runs/grid", "results/grid", ["eval/accuracy"])    # small CSVs to commit
    scalars, summaries = lab.load_results("results/grid")               # ... read back
    lab.run_notebook("experiments/notebooks/ablation.py", {"LAUNCH": True})  # headless

A run is `python -m sao_jax.main` in its own process, exactly what `make train` runs: its config
is the experiment file with the overrides applied (`lab.config`), written into the run's
directory as `lab_config.json` with a small config file that re-applies it, so the run, its
resume and its record are the same config. Overrides obey the command line's rules: the config is
locked (a field that does not exist is an error naming it) and typed (a value of another type is
refused). Results come from what every run writes: `config.json`, `summary.json` and its
TensorBoard events (read with tensorboard's own `EventAccumulator`); tables and plots are pandas
and matplotlib.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAB_CONFIG = "lab_config.json"  # in a run's directory: the experiment and its overrides
CODE_FILE = "lab_code.json"  # in a run's directory: the code each launch of it imported
CODE_PATHS = ("sao_jax", "experiments")  # what a run imports from the repository
_CONFIG_FILE = "lab_config.py"
_CONFIG_SOURCE = '''"""Written by sao_jax.lab: lab_config.json's experiment and overrides."""
import os

from sao_jax import lab


def get_config():
    return lab.config_from_file(os.path.join(os.path.dirname(__file__), "{name}"))
'''


def code_version(repo: str = REPO) -> str:
    """The code a run launched now imports: the repository's commit (12 hex digits), with
    `+<hash of the uncommitted changes>` when `CODE_PATHS` differ from it (edited or new files);
    "unknown" outside a git checkout. A run's process imports the working tree when it starts,
    so a grid whose code is edited while it runs mixes versions: `launch` records this in each
    run's `lab_code.json`, `summaries` reports it (`code`), and `grid` warns when it changes."""
    def git(*args) -> bytes:
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, check=True,
                              timeout=60).stdout

    try:
        head = git("rev-parse", "--short=12", "HEAD").decode().strip()
        changed = git("diff", "HEAD", "--", *CODE_PATHS)
        new = git("ls-files", "--others", "--exclude-standard", "-z", "--", *CODE_PATHS)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not changed and not new:
        return head
    digest = hashlib.sha256(changed)
    for name in sorted(n for n in new.split(b"\0") if n):
        digest.update(name)
        with open(os.path.join(repo, os.fsdecode(name)), "rb") as f:
            digest.update(f.read())
    return f"{head}+{digest.hexdigest()[:8]}"


def config(experiment: str, overrides: Mapping[str, Any] | None = None):
    """`experiments/<experiment>.py`'s config with `overrides` (`{"rl.eps_low": 0.2, ...}`,
    dotted paths as on the command line) applied to the locked config.

    Raises:
      ValueError: an unknown experiment, a field that does not exist, or a value of the wrong
        type, naming the field.
    """
    path = os.path.join(REPO, "experiments", f"{experiment}.py")
    if not os.path.exists(path):
        names = sorted(n[:-3] for n in os.listdir(os.path.join(REPO, "experiments"))
                       if n.endswith(".py") and not n.startswith("_"))
        raise ValueError(f"experiment {experiment!r}: no {path}; one of {names}.")
    if REPO not in sys.path:  # experiment files import `experiments.base`
        sys.path.insert(0, REPO)
    spec = importlib.util.spec_from_file_location(f"experiments.{experiment}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    cfg.lock()
    for field, value in (overrides or {}).items():
        _override(cfg, field, value)
    return cfg


def _override(cfg, field: str, value) -> None:
    *parents, leaf = field.split(".")
    node = cfg
    for i, name in enumerate(parents):
        if name not in node:
            raise ValueError(f"config override {field!r}: there is no field "
                             f"{'.'.join(parents[:i + 1])!r} (the config is locked).")
        node = node[name]
    if leaf not in node:
        raise ValueError(f"config override {field!r}: there is no such field (the config is "
                         "locked); fields here: " + ", ".join(sorted(node.keys())) + ".")
    group = node[leaf]
    if hasattr(group, "keys") and not hasattr(value, "keys"):  # e.g. a string for mesh.rules
        raise ValueError(f"config override {field!r} = {value!r}: {field!r} is a group of "
                         f"fields; set them one by one, as '{field}.<name>' ("
                         + ", ".join(group.keys()) + ").")
    try:
        node[leaf] = value
    except TypeError as e:
        raise ValueError(f"config override {field!r} = {value!r}: {e}") from None


def config_from_file(path: str):
    """The config a `lab_config.json` names (what a launched run's config file returns)."""
    with open(path) as f:
        record = json.load(f)
    return config(record["experiment"], record["overrides"])


@dataclasses.dataclass
class Run:
    """A launched run: its directory and process. `poll()` is its exit code or None while it
    runs; `progress()` the steps its learner has finished, of `total`."""

    workdir: str
    total: int
    process: subprocess.Popen | None = None  # None: it had finished before (`grid`)

    def poll(self) -> int | None:
        return 0 if self.process is None else self.process.poll()

    def progress(self) -> int:
        try:
            with open(os.path.join(self.workdir, "steps.jsonl")) as f:
                return sum(1 for line in f if line.strip())
        except FileNotFoundError:
            return 0

    def summary(self) -> dict | None:
        return _read_json(os.path.join(self.workdir, "summary.json"))

    def wait(self, progress: bool = True, poll_s: float = 1.0) -> dict:
        """Blocks until the run ends (with a progress bar); returns its summary.

        Raises:
          RuntimeError: the run failed, with the end of its output (`output.log`).
        """
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.total, desc=os.path.basename(self.workdir), unit="step")
        try:
            while self.poll() is None:
                if bar is not None:
                    bar.update(self.progress() - bar.n)
                time.sleep(poll_s)
            if bar is not None:
                bar.update(self.progress() - bar.n)
        finally:
            if bar is not None:
                bar.close()
        code = self.poll()
        if code != 0:
            raise RuntimeError(f"the run in {self.workdir} exited with {code}:\n"
                               + _tail(os.path.join(self.workdir, "output.log")))
        return self.summary()

    def stop(self) -> None:
        """Stops the run as Ctrl-C would (it resumes from its last checkpoint when launched
        again)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(2)  # SIGINT: the learner's safe stop


def launch(experiment: str, workdir: str, overrides: Mapping[str, Any] | None = None) -> Run:
    """Starts `python -m sao_jax.main` on `config(experiment, overrides)` in `workdir`, in the
    background (output in `<workdir>/output.log`). A `workdir` holding a checkpoint resumes it;
    one whose recorded config differs is refused rather than mixed."""
    overrides = dict(overrides or {})
    cfg = config(experiment, overrides)  # the errors here, not in the child
    workdir = os.path.abspath(workdir)  # the child runs in the repository, not here
    os.makedirs(workdir, exist_ok=True)
    # As the file reads back (tuples as lists), so that a resume compares equal.
    record = json.loads(json.dumps({"experiment": experiment, "overrides": overrides}))
    path = os.path.join(workdir, LAB_CONFIG)
    previous = _read_json(path)
    if previous is not None and previous != record:
        raise ValueError(f"{workdir} holds a run of another config ({previous}); use another "
                         "directory, or delete it to start over.")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    with open(os.path.join(workdir, _CONFIG_FILE), "w") as f:
        f.write(_CONFIG_SOURCE.format(name=LAB_CONFIG))
    launches = _read_json(os.path.join(workdir, CODE_FILE)) or []
    launches.append({"code": code_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    with open(os.path.join(workdir, CODE_FILE), "w") as f:
        json.dump(launches, f, indent=2)
    log = open(os.path.join(workdir, "output.log"), "a")  # noqa: SIM115 - the child holds it
    process = subprocess.Popen(
        [sys.executable, "-m", "sao_jax.main", f"--config={os.path.join(workdir, _CONFIG_FILE)}",
         f"--workdir={workdir}"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    return Run(workdir, cfg.total_steps, process)


def run(experiment: str, workdir: str, overrides: Mapping[str, Any] | None = None, *,
        progress: bool = True) -> dict:
    """`launch` and `wait`: trains `experiment` with `overrides` in `workdir`; its summary."""
    return launch(experiment, workdir, overrides).wait(progress)


def cell_name(cell: Mapping[str, Any]) -> str:
    """A grid cell's directory name: `algo=sao,seed=0`."""
    return ",".join(f"{k}={v}" for k, v in cell.items())


def grid(root: str, experiment: str, axes: Mapping[str, Sequence[Any]],
         overrides: Mapping[str, Any] | None = None, *, parallel: int = 1,
         progress: bool = True, skip: Iterable[str] = ()) -> list[Run]:
    """Every combination of `axes` (`{"algo": [...], "seed": [...]}`, fields as in `config`) of
    `experiment` with `overrides`, each in `<root>/<cell_name>`, `parallel` at a time, blocking
    until all end. A cell with a `summary.json` is skipped, and so is one named in `skip` (e.g.
    `saved_runs(folder)`: finished elsewhere, its results saved); one interrupted resumes from
    its checkpoint. Returns the runs launched or found finished (raises `RuntimeError` naming
    the cells that failed)."""
    skip = set(skip)
    cells = [dict(zip(axes, values, strict=True))
             for values in itertools.product(*axes.values())]
    cells = [c for c in cells if cell_name(c) not in skip]
    cells = [(cell, {**(overrides or {}), **cell}) for cell in cells]
    for _, merged in cells:
        config(experiment, merged)  # every cell's errors before any run starts
    runs, waiting, failed = [], list(cells), []
    active: list[Run] = []
    first_code = None
    while waiting or active:
        while waiting and len(active) < max(1, parallel):
            cell, merged = waiting.pop(0)
            workdir = os.path.join(root, cell_name(cell))
            if _read_json(os.path.join(workdir, "summary.json")) is not None:
                runs.append(Run(os.path.abspath(workdir), config(experiment, merged).total_steps))
                continue
            active.append(launch(experiment, workdir, merged))
            code = _read_json(os.path.join(workdir, CODE_FILE))[-1]["code"]
            first_code = first_code or code
            if code != first_code:
                warnings.warn(f"the code changed during this grid: {cell_name(cell)} runs "
                              f"{code}, its first run {first_code} (lab.code_version); runs of "
                              "one grid should run one version", stacklevel=2)
        if not active:
            break
        if parallel == 1:
            done = active.pop()
            try:
                done.wait(progress)
            except RuntimeError as e:
                failed.append(str(e))
            runs.append(done)
            continue
        time.sleep(1.0)
        for done in [r for r in active if r.poll() is not None]:
            active.remove(done)
            runs.append(done)
            if done.poll() != 0:
                failed.append(f"{done.workdir} exited with {done.poll()}")
    if failed:
        raise RuntimeError("grid cells failed:\n" + "\n".join(failed))
    return runs


# ------------------------------------------------------------------------------------------------
# Results.


def run_dirs(root_or_runs: str | os.PathLike | Iterable[str | Run]) -> list[str]:
    """The run directories (holding `config.json`) under `root_or_runs`, or those given (paths,
    or the `Run`s that `grid` returns)."""
    if isinstance(root_or_runs, str | os.PathLike):
        found = []
        for directory, subdirs, files in os.walk(root_or_runs):
            if "config.json" in files:
                found.append(directory)
                subdirs.clear()  # a run's own folders hold no runs
        return sorted(found)
    return sorted(r.workdir if isinstance(r, Run) else str(r) for r in root_or_runs)


def _named_runs(root_or_runs) -> list[tuple[str, str]]:
    """`(directory, name)` of each run: its path under the root given (`lag=4/algo=sao,seed=0`:
    grids under one root keep their cells apart), or as given in a list."""
    if isinstance(root_or_runs, str | os.PathLike):
        return [(d, os.path.relpath(d, root_or_runs)) for d in run_dirs(root_or_runs)]
    return [(d, str(d)) for d in run_dirs(root_or_runs)]


def _run_fields(directory: str, name: str) -> dict:
    """The run's name and its lab overrides (grid fields), else its experiment name."""
    record = _read_json(os.path.join(directory, LAB_CONFIG)) or {}
    fields = {"run": name}
    fields.update({k: v for k, v in (record.get("overrides") or {}).items()})
    return fields


def load(root_or_runs: str | os.PathLike | Iterable[str], tags: Sequence[str] | None = None):
    """Every scalar of the runs' TensorBoard events as one DataFrame: `run`, the runs' lab
    overrides (one column each: `algo`, `seed`, ...), `step`, `tag`, `value` (only `tags` when
    given). A step logged twice (a resumed run) keeps its last value."""
    import pandas as pd
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = []
    for directory, name in _named_runs(root_or_runs):
        if not os.path.isdir(os.path.join(directory, "tb")):
            continue  # just started: nothing logged yet
        fields = _run_fields(directory, name)
        events = EventAccumulator(os.path.join(directory, "tb"), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags().get("scalars", []):
            if tags is not None and tag not in tags:
                continue
            rows.extend({**fields, "step": e.step, "tag": tag, "value": e.value}
                        for e in events.Scalars(tag))
    frame = pd.DataFrame(rows)
    if frame.empty:
        return pd.DataFrame(columns=["run", "step", "tag", "value"])
    return frame.drop_duplicates(["run", "tag", "step"], keep="last").reset_index(drop=True)


def summaries(root_or_runs: str | os.PathLike | Iterable[str]):
    """Each finished run's `summary.json` as a row (with `run`, its lab overrides and, for a run
    `launch` started, `code`: the `code_version` of each launch, joined by "," when a resume
    ran other code)."""
    import pandas as pd

    rows = []
    for directory, name in _named_runs(root_or_runs):
        summary = _read_json(os.path.join(directory, "summary.json"))
        if summary is not None:
            code = {}
            launches = _read_json(os.path.join(directory, CODE_FILE))
            if launches:
                code = {"code": ",".join(dict.fromkeys(x["code"] for x in launches))}
            rows.append({**_run_fields(directory, name), **code,
                         **{k: v for k, v in summary.items() if not isinstance(v, dict | list)}})
    return pd.DataFrame(rows)


def _groups(by: str | Sequence[str] | None) -> list[str]:
    return [] if by is None else [by] if isinstance(by, str) else list(by)


SPREADS = {"std": "±1 std over runs", "se": "±1 standard error of the mean",
           "range": "min to max over runs"}


def plot(frame, tag: str, by: str | Sequence[str] | None = "algo", ax=None, spread: str = "std",
         smooth: int = 1, legend: str | None = "inside", bounds: tuple[float, float] | None = None,
         ylim: tuple[float, float] | None = None):
    """`tag` over steps: per group of `by`, the mean over its runs (seeds) and a band
    (`spread`: one standard deviation "std", one standard error of the mean "se", or min to max
    "range"; the axis title says which). With `smooth` > 1 the mean and the band are running
    means over that many logged points, drawn over the raw mean (faint). `legend`: "inside"
    (matplotlib's best place), "outside" (right of the axes, covering no curve: save the figure
    with `bbox_inches="tight"`) or None. `bounds`: the values `tag` can take, (0, 1) for a rate
    or Pass@1; the bands are cut to them (a mean -+ std can leave them where no run does).
    `ylim`: the part of the axis shown, when a few runs' values would flatten the rest (an
    explained variance of -6000 beside ones near 0); the title says so. Returns the Axes."""
    import matplotlib.pyplot as plt

    if spread not in SPREADS:
        raise ValueError(f"spread must be one of {sorted(SPREADS)}, got {spread!r}.")
    if smooth < 1:
        raise ValueError(f"smooth must be >= 1 (logged points per running mean), got {smooth}.")
    data = frame[frame["tag"] == tag]
    if data.empty:
        raise ValueError(f"no scalar {tag!r} in these runs; tags: "
                         f"{sorted(frame['tag'].unique())}.")
    groups = _groups(by)
    ax = ax or plt.subplots(figsize=(7, 4))[1]
    for key, group in (data.groupby(groups) if groups else [((), data)]):
        stats = group.groupby("step")["value"].agg(["mean", "std", "min", "max", "count"])
        label = ", ".join(f"{g}={k}" for g, k in zip(groups, key if isinstance(key, tuple)
                                                      else (key,), strict=True)) or tag
        n = int(group["run"].nunique())
        std = stats["std"].fillna(0)  # one run: no band
        half = std / stats["count"] ** 0.5 if spread == "se" else std
        low, high = ((stats["mean"] - half, stats["mean"] + half) if spread != "range"
                     else (stats["min"], stats["max"]))
        if bounds is not None:
            low, high = low.clip(*bounds), high.clip(*bounds)
        mean = stats["mean"]
        if smooth > 1:
            raw, = ax.plot(stats.index, mean, alpha=0.25, linewidth=0.8)
            window = dict(window=smooth, min_periods=1)
            mean, low, high = (x.rolling(**window).mean() for x in (mean, low, high))
            line, = ax.plot(stats.index, mean, color=raw.get_color(), label=f"{label} (n={n})")
        else:
            line, = ax.plot(stats.index, mean, label=f"{label} (n={n})")
        ax.fill_between(stats.index, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel(tag)
    title = f"band: {SPREADS[spread]}" + (f"; running mean of {smooth} points"
                                          if smooth > 1 else "")
    if ylim is not None:
        ax.set_ylim(*ylim)
        title += f"; axis cut to [{ylim[0]:g}, {ylim[1]:g}]"
    ax.set_title(title, fontsize="small")
    if legend == "outside":
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
                  borderaxespad=0.0)
    elif legend == "inside":
        ax.legend()
    elif legend is not None:
        raise ValueError(f"legend must be 'inside', 'outside' or None, got {legend!r}.")
    return ax


def plot_final(frame, value: str = "final", by: str = "algo", ax=None, order=None):
    """Each group of `by`'s `value` (`frame` one row per run, as for `table`): every run a dot,
    the mean and its standard error as a bar, "n" under each group's name, so that gaps of a few
    hundredths between groups stay visible where curves over steps hide them. `order`: the
    groups, left to right (default: by mean, highest first). (A bar stays inside the values'
    range by itself: for values >= 0, std <= sqrt(n) mean, so mean - SE >= 0.) Returns the
    matplotlib Axes."""
    import matplotlib.pyplot as plt
    import numpy as np

    stats = table(frame, value, by=by)
    groups = list(order) if order is not None else list(stats.sort_values(
        "mean", ascending=False).index)
    missing = [g for g in groups if g not in stats.index]
    if missing:
        raise ValueError(f"no runs of {by}={missing[0]!r}; there are {list(stats.index)}.")
    ax = ax or plt.subplots(figsize=(max(4.0, 1.1 * len(groups) + 1), 4))[1]
    rng = np.random.default_rng(0)  # the dots' jitter: the same figure on every draw
    for x, group in enumerate(groups):
        runs = frame.loc[frame[by] == group, value].to_numpy(dtype=float)
        ax.scatter(x + rng.uniform(-0.12, 0.12, len(runs)), runs, s=12, color="0.55", zorder=2)
        ax.errorbar(x, stats.loc[group, "mean"], yerr=np.nan_to_num(stats.loc[group, "se"]),
                    fmt="o", color="C0", capsize=5, markersize=6, zorder=3)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{g}\nn={int(stats.loc[g, 'n'])}" for g in groups], fontsize="small")
    ax.set_ylabel(value)
    ax.set_title("mean ± 1 standard error over runs; dots: runs", fontsize="small")
    return ax


def final(frame, tag: str = "eval/accuracy", last: int = 3):
    """Each run's final `tag`: the mean of its last `last` logged points (`frame` from `load` or
    `load_results`), one row per run with its lab overrides, `final` and `points` (how many
    were averaged). With evaluations every 50 steps of a 300-step run, the default reads steps
    200, 250 and 300: where a run ends on a swing, one evaluation says more about when it
    stopped than about where it got to."""
    import pandas as pd

    if last < 1:
        raise ValueError(f"last must be >= 1 (logged points to average), got {last}.")
    data = frame[frame["tag"] == tag].sort_values("step")
    if data.empty:
        raise ValueError(f"no scalar {tag!r} in these runs.")
    fields = [c for c in data.columns if c not in ("step", "tag", "value")]
    tail = data.groupby("run", as_index=False).tail(last)
    out = tail.groupby(fields, dropna=False)["value"].agg(["mean", "count"]).reset_index()
    return pd.DataFrame(out).rename(columns={"mean": "final", "count": "points"})


def table(frame, value: str, by: str | Sequence[str] = "algo", *, last: bool = True):
    """Mean, std, standard error of the mean (`se` = std / sqrt(n)) and n per group of `by`,
    plus `mean ± std (n)` and `mean ± SE (n)` columns. `frame`: `summaries` or `final`
    (`value` a column) or `load` (`value` a tag, read at each run's last step when `last`, else
    over all steps)."""
    groups = _groups(by)
    if "tag" in frame.columns and "value" in frame.columns and value not in frame.columns:
        data = frame[frame["tag"] == value]
        if last:
            data = data.sort_values("step").groupby("run", as_index=False).tail(1)
        column = "value"
    else:
        data, column = frame, value
    if data.empty or column not in data.columns:
        raise ValueError(f"nothing named {value!r} in these runs.")
    stats = data.groupby(groups)[column].agg(["mean", "std", "count"]).rename(
        columns={"count": "n"})
    stats["se"] = stats["std"] / stats["n"] ** 0.5
    for name, spread in (("mean ± std (n)", "std"), ("mean ± SE (n)", "se")):
        stats[name] = [f"{m:.3f} ± {0 if s != s else s:.3f} ({n})"
                       for m, s, n in zip(stats["mean"], stats[spread], stats["n"], strict=True)]
    return stats


ALPHA = 0.05  # the level of every verdict: a two-sided test, Holm's over a notebook's claims
MARGIN, BOUND_SE = 0.05, 0.01  # an inconclusive difference of Pass@1 is bounded (`bound`)


def compare(frame, value: str, higher: str, lower: str, by: str = "algo", *,
            last: bool = True, alpha: float = ALPHA) -> dict:
    """Does group `higher` of `by` beat group `lower` on `value` (as in `table`)? Welch's t-test.

    Returns the groups' means, stds and n, the difference of the means d = m_higher - m_lower,
    its standard error se = sqrt(s_h^2/n_h + s_l^2/n_l), t = d / se, the Welch-Satterthwaite
    degrees of freedom df = se^4 / ((s_h^2/n_h)^2/(n_h-1) + (s_l^2/n_l)^2/(n_l-1)), and the
    two-sided p-value P(|T_df| >= |t|) (scipy.stats.ttest_ind(equal_var=False)'s t, df, p), and
    the difference's 1 - alpha interval d -+ t_(1 - alpha/2, df) se (`ci_low`, `ci_high`).

    The verdict, at level `alpha`: "reproduced" when p <= alpha and d > 0, "not reproduced" when
    p <= alpha and d < 0 (the ordering is reversed), else "inconclusive". The test is two-sided
    because the verdict can go either way: each direction is called at alpha/2, so when the two
    groups do not differ a claim comes out "reproduced" alpha/2 of the time. (The rule this
    replaces, |d| > 2 se, ignored df: between equal groups of 8 runs, df about 14, it called a
    difference 6.5% of the time, where the normal law it assumed says 4.6%.) Claims tested
    together take `holm`'s verdicts instead of these. With fewer than 2 runs in a group there is
    no spread to judge by: "inconclusive (n < 2)"; with no spread in either group (se = 0) the
    test is undefined: "inconclusive (no spread)". Both leave t, df and p NaN."""
    from scipy import stats as scipy_stats

    stats = table(frame, value, by=by, last=last)
    for group in (higher, lower):
        if group not in stats.index:
            raise ValueError(f"no runs of {by}={group!r}; there are {list(stats.index)}.")
    a, b = stats.loc[higher], stats.loc[lower]
    diff = float(a["mean"] - b["mean"])
    nan = float("nan")
    out = {"higher": higher, "lower": lower, "mean_higher": float(a["mean"]),
           "mean_lower": float(b["mean"]), "std_higher": float(a["std"]),
           "std_lower": float(b["std"]), "n_higher": int(a["n"]), "n_lower": int(b["n"]),
           "difference": diff, "se": nan, "t": nan, "df": nan, "p": nan, "ci_low": nan,
           "ci_high": nan}
    if min(a["n"], b["n"]) < 2:
        return {**out, "verdict": "inconclusive (n < 2)"}
    var_a, var_b = a["std"] ** 2 / a["n"], b["std"] ** 2 / b["n"]
    se = float((var_a + var_b) ** 0.5)
    if se == 0:
        return {**out, "se": se, "verdict": "inconclusive (no spread)"}
    t = diff / se
    df = float((var_a + var_b) ** 2 / (var_a ** 2 / (a["n"] - 1) + var_b ** 2 / (b["n"] - 1)))
    p = float(2 * scipy_stats.t.sf(abs(t), df))
    half = float(scipy_stats.t.ppf(1 - alpha / 2, df)) * se
    return {**out, "se": se, "t": t, "df": df, "p": p, "ci_low": diff - half,
            "ci_high": diff + half, "verdict": _verdict(diff, p, alpha)}


def _verdict(difference: float, p: float, alpha: float) -> str:
    if p <= alpha:
        return "reproduced" if difference > 0 else "not reproduced"
    return "inconclusive"


def holm(comparisons: Sequence[Mapping[str, Any]], alpha: float = ALPHA) -> list[dict]:
    """The verdicts of claims tested together, by Holm's step-down procedure.

    `comparisons`: `compare`'s results (with any other keys, a claim's name say), the family whose
    chance of any wrong call is to be held to `alpha`. The m of them that have a p-value, sorted
    p_(1) <= ... <= p_(m), get the adjusted p_holm_(i) = max over j <= i of
    min(1, (m - j + 1) p_(j)), and their verdicts are `compare`'s rule applied to p_holm instead
    of p (p_holm <= alpha); each keeps its own p. Comparisons without a p (n < 2, no spread) are
    not tests: they keep their verdict, p_holm NaN, and do not count in m. Returns new dicts, in
    the order given, with `p_holm` added and `verdict` replaced.

    Holm calls every difference that Bonferroni (p <= alpha / m) calls, and possibly more, and
    holds for any dependence between the tests (a notebook's claims share runs)."""
    tested = sorted((c["p"], i) for i, c in enumerate(comparisons) if not math.isnan(c["p"]))
    m = len(tested)
    adjusted, running = {}, 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    out = []
    for i, c in enumerate(comparisons):
        if i in adjusted:
            kept = {k: v for k, v in c.items() if k != "verdict"}  # verdict last, after p_holm
            out.append({**kept, "p_holm": adjusted[i],
                        "verdict": _verdict(c["difference"], adjusted[i], alpha)})
        else:
            kept = {k: v for k, v in c.items() if k != "verdict"}
            out.append({**kept, "p_holm": float("nan"), "verdict": c["verdict"]})
    return out


def bound(comparison: Mapping[str, Any], margin: float = MARGIN, max_se: float = BOUND_SE) -> str:
    """What an inconclusive claim "higher > lower" still says: whether seeds enough have bounded it.

    `comparison`: `compare`'s (or `holm`'s) result. "bounded: gain < margin" when the difference's
    interval (`ci_high`) lies below `margin`, so any advantage of `higher` is smaller than that;
    "bounded: no difference, SE <= max_se" when the interval holds 0 and the difference's standard
    error is at most `max_se`, so more seeds would only narrow a gap that is not seen; otherwise
    "open: ..." with the interval and the standard error as they stand. A called claim (p_holm,
    or p, at most the level) is not bounded but decided: "decided" (read its verdict). The
    defaults are for final Pass@1 (docs/measurements.md, "Bounded claims"); the interval is the
    test's own (1 - alpha, not adjusted for the other claims of its family)."""
    if math.isnan(comparison.get("se", math.nan)) or math.isnan(comparison["ci_high"]):
        return "open: no test"
    if not comparison["verdict"].startswith("inconclusive"):
        return "decided"
    low, high, se = comparison["ci_low"], comparison["ci_high"], comparison["se"]
    if high < margin:
        return f"bounded: gain < {margin:g} (interval {low:+.3f} to {high:+.3f})"
    if low <= 0 <= high and se <= max_se:
        return f"bounded: no difference, SE {se:.3f} <= {max_se:g}"
    return (f"open: interval {low:+.3f} to {high:+.3f} reaches {margin:g}, SE {se:.3f} > "
            f"{max_se:g}")


SCALARS_CSV, SUMMARIES_CSV = "scalars.csv", "summaries.csv"


def save_results(root_or_runs, folder: str, tags: Sequence[str]) -> tuple[str, str]:
    """Writes the finished runs' `tags` (`load`) and summaries (`summaries`) as two small CSV
    files in `folder`, to commit in place of event files, keeping the runs saved there before
    that are not among these (a grid finished over several sessions); returns their paths. A
    step at which a tag measured nothing (NaN: the fresh rows' gap of a step without one) is
    not kept."""
    import pandas as pd

    os.makedirs(folder, exist_ok=True)
    paths = os.path.join(folder, SCALARS_CSV), os.path.join(folder, SUMMARIES_CSV)
    new_summaries = summaries(root_or_runs)
    finished = set(new_summaries["run"]) if "run" in new_summaries else set()
    new_scalars = load(root_or_runs, tags)
    new_scalars = new_scalars[new_scalars["run"].isin(finished) & new_scalars["value"].notna()]
    for path, frame in zip(paths, (new_scalars, new_summaries), strict=True):
        if os.path.exists(path):
            old = pd.read_csv(path)
            frame = pd.concat([old[~old["run"].isin(finished)], frame], ignore_index=True)
        frame.to_csv(path, index=False, float_format="%.6g")  # float32 scalars: 6 digits
    return paths


def saved_runs(folder: str, group: str | None = None) -> set[str]:
    """The names of the runs whose results `save_results` keeps in `folder` (none: empty);
    with `group`, those of the runs under `<root>/<group>/` only, named as that folder's grid
    names them (`saved_runs(RESULTS, "lag=8")` for `grid(os.path.join(RUNS, "lag=8"), ...)`'s
    `skip`)."""
    import pandas as pd

    path = os.path.join(folder, SUMMARIES_CSV)
    runs = set(pd.read_csv(path)["run"]) if os.path.exists(path) else set()
    if group is None:
        return runs
    return {run.removeprefix(f"{group}/") for run in runs if run.startswith(f"{group}/")}


def load_results(folder: str):
    """`(scalars, summaries)`: the frames `save_results` wrote in `folder`."""
    import pandas as pd

    paths = os.path.join(folder, SCALARS_CSV), os.path.join(folder, SUMMARIES_CSV)
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no saved results here; run the notebook with "
                                    "LAUNCH = True (or lab.save_results) first.")
    return pd.read_csv(paths[0]), pd.read_csv(paths[1])


def recovery_steps(frame, tag: str, switch: int, *, before: int, fraction: float = 0.8,
                   smooth: int = 10, end: int | None = None):
    """Per run: the learner steps after `switch` until `tag` (a rolling mean over `smooth`
    steps) first reaches `fraction` of its mean over the `before` steps before the switch;
    NaN where it never does before `end` (the next switch, say). A Series indexed by run."""
    import numpy as np
    import pandas as pd

    out = {}
    for run, group in frame[frame["tag"] == tag].groupby("run"):
        series = group.set_index("step")["value"].sort_index()
        level = series[(series.index >= switch - before) & (series.index < switch)].mean()
        after = series[(series.index >= switch) & (series.index < (end or np.inf))]
        reached = after.rolling(smooth, min_periods=smooth).mean() >= fraction * level
        out[run] = (reached.idxmax() - switch) if reached.any() else np.nan
    return pd.Series(out, name=f"steps to {fraction:.0%} of the pre-switch {tag}")


def run_notebook(path: str, parameters: Mapping[str, Any] | None = None, *,
                 cwd: str | None = None, output: str | None = None, timeout_s: float = 3600):
    """Executes the jupytext notebook `path` (a percent `.py` file) in a fresh Jupyter kernel
    (nbclient), with `parameters` as a cell of its own right after the cell tagged `parameters`
    (as papermill does), in `cwd` (default: the notebook's folder, where its relative paths
    point). With `output`, the executed notebook, figures and tables included, is written there
    (`.ipynb`). Returns the executed notebook; a cell that fails raises nbclient's
    `CellExecutionError` with its traceback."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    notebook = jupytext.read(path)
    tagged = [i for i, c in enumerate(notebook.cells)
              if "parameters" in c.metadata.get("tags", [])]
    if len(tagged) != 1:
        raise ValueError(f"{path}: needs one cell tagged 'parameters', found {len(tagged)}")
    if parameters:
        source = "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
        notebook.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(
            source, metadata={"tags": ["injected-parameters"]}))
    NotebookClient(notebook, timeout=timeout_s, kernel_name="python3", resources={
        "metadata": {"path": cwd or os.path.dirname(os.path.abspath(path))}}).execute()
    if output:
        nbformat.write(notebook, output)
    return notebook


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except FileNotFoundError:
        return "(no output)"
