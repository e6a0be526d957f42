"""The learner as `make train` runs it, in a subprocess: its environment (`environment`), a tiny
run's flags (`TINY`), what it logs (`steps_log`, `scalars_as_shown`), and the checks of the tiny
runs that tests/test_notebooks.py launches (`the_run_went_end_to_end`, `the_lag_shows`,
`the_swe_run_played_and_graded`)."""

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sao_jax.rollout.stream.log import TrajectoryLog
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train.events import read_events
from sao_jax.train.processes import CHILDREN_FILE
from tests import one_device_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REQUIRED_TAGS = {
    "reward/mean", "eval/accuracy", "critic/explained_variance", "critic/grad_norm",
    "critic/loss", "policy/grad_norm", "policy/dis_frac_below", "policy/dis_frac_above",
    "policy/logp_mismatch", "policy/logp_mismatch_p99", "policy/logp_mismatch_max",
    "policy/logp_mismatch_fresh", "policy/fresh_frac",
    "rollout/policy_lag_mean", "rollout/policy_lag_max",
    "rollout/response_tokens", "rollout/truncated_frac", "time/learner_idle_frac",
    "time/elapsed_s",
    "throughput/tokens_per_s",
}

TINY = [
    "--config.batch_size=8", "--config.warm_start.enabled=False",
    "--config.env.num_eval_prompts=8", "--config.env.num_train_prompts=64",
    "--config.rollout.worker_concurrency=16", "--config.rollout.engine_max_batch=16",
    "--config.rl.critic_warmup_steps=2", "--config.sample_every=2",
]


def environment(cache_dir=None):
    """The learner's environment: one CPU device, as `make train` sees it; with `cache_dir`, its
    caches (compiled programs, warm start) there instead of the user's."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cache_dir is not None:
        env["XDG_CACHE_HOME"] = cache_dir
    env["XLA_FLAGS"] = one_device_flags(env.get("XLA_FLAGS", ""))
    return env


def scalars_as_shown(logdir):
    """`{tag: [step, ...]}` of the scalars as TensorBoard shows them: a SessionLog.START event
    at step s (tensorboardX's purge_step) drops earlier events at steps >= s."""
    scalars, texts = collections.defaultdict(list), []
    for event in read_events(logdir):
        if event.HasField("session_log") and event.session_log.status == 1:
            for tag in scalars:
                scalars[tag] = [s for s in scalars[tag] if s < event.step]
        for value in event.summary.value:
            if value.HasField("simple_value"):
                scalars[value.tag].append(event.step)
            elif value.tag.startswith("samples"):
                texts.append(event.step)
    return scalars, texts


def steps_log(workdir):
    with open(os.path.join(workdir, "steps.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def the_lag_shows(workdir):
    """`rollout.lag_versions=2` in a synchronous run of 5 steps without critic warm-up (run by
    tests/test_notebooks.py, the staleness study's tiny run): the engines serve the weights two
    publishes back, so from step 3 on every trajectory is exactly two versions older than the
    learner (the lag builds up from the start), and TensorBoard's lag tags say so."""
    assert [r["version"] for r in steps_log(workdir)] == [0, 1, 2, 3, 4]  # the learner's
    lag = {}
    for event in read_events(os.path.join(workdir, "tb")):
        for value in event.summary.value:
            if value.tag in ("rollout/policy_lag_mean", "rollout/policy_lag_max"):
                lag.setdefault(value.tag, {})[event.step] = value.simple_value
    assert [lag["rollout/policy_lag_mean"][s] for s in range(1, 6)] == [0, 1, 2, 2, 2]
    assert [lag["rollout/policy_lag_max"][s] for s in range(1, 6)] == [0, 1, 2, 2, 2]


def the_learner_kept_float32_and_served_bfloat16(workdir):
    """A run with `model.dtype = bfloat16` and the default float32 `model.master_dtype` (the
    mismatch notebook's tiny run): every weight version the engines were served is bfloat16,
    and the checkpoint holds the float32 master copy: the parameters and the optimizer's
    moments."""
    import jax
    import orbax.checkpoint as ocp

    from sao_jax.engine.model_io import tensor_specs

    versions = os.listdir(os.path.join(workdir, "weights"))
    assert versions
    for version in versions:
        path = os.path.join(workdir, "weights", version)
        with open(os.path.join(path, "config.json")) as f:
            assert json.load(f)["torch_dtype"] == "bfloat16", version
        assert {dtype for _, dtype in tensor_specs(path).values()} == {"BF16"}, version
    checkpoints = os.path.join(workdir, "checkpoints")
    step = max(os.listdir(checkpoints), key=int)
    state = ocp.StandardCheckpointer().metadata(
        os.path.join(checkpoints, step, "state")).item_metadata
    floats = {str(x.dtype) for part in ("policy", "policy_opt", "critic", "critic_opt")
              for x in jax.tree.leaves(state[part]) if "float" in str(x.dtype)}
    assert floats == {"float32"}, floats


def the_run_went_end_to_end(workdir, cache_dir):
    """A tiny synchronous run of 4 steps (2 of critic warm-up), packed rows, samples and
    held-out evaluations every 2 steps, launched by `sao_jax.lab` (tests/test_notebooks.py, the
    ablation's tiny run): what it wrote, and `make eval` of its checkpoint. Resuming:
    tests/train/test_multihost.py (a run killed after a checkpoint) and tests/faults (test_e:
    killed five times, exactly-once data)."""
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    for key in ("initial_eval_accuracy", "final_eval_accuracy", "initial_greedy_accuracy",
                "final_greedy_accuracy", "steps", "trajectories", "wall_time_s"):
        assert key in summary, key
    assert summary["steps"] == 4 and summary["trajectories"] == 32
    assert summary["policy_version"] == 2  # two critic warm-up steps, then two policy steps
    assert summary["this_run_stream"] == {"rejected": 0, "episodes_failed": 0,
                                          "prompts_given_up": 0}
    scalars, texts = scalars_as_shown(os.path.join(workdir, "tb"))
    assert REQUIRED_TAGS <= set(scalars), REQUIRED_TAGS - set(scalars)
    assert scalars["reward/mean"] == scalars["time/elapsed_s"] == [1, 2, 3, 4]
    elapsed = [v.simple_value for e in read_events(os.path.join(workdir, "tb"))
               for v in e.summary.value if v.tag == "time/elapsed_s"]
    assert elapsed == sorted(elapsed) and 0 < elapsed[-1] <= summary["wall_time_s"], elapsed
    # at the start, every `eval_every` = 2 steps and at the end, sampled and greedy
    assert scalars["eval/accuracy"] == scalars["eval/greedy_accuracy"] == [0, 2, 4]
    assert texts == [2, 4]
    assert scalars["engine/decode_batch_mean"] == [4]  # every 10 steps, and at the last
    records = steps_log(workdir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    ids = [i for r in records for i in r["ids"]]
    assert len(ids) == len(set(ids)) == 32
    # Synchronous: every trajectory comes from the policy of its step (no lag).
    assert [r["version"] for r in records] == [0, 0, 0, 1]
    assert "4" in os.listdir(os.path.join(workdir, "checkpoints"))
    assert not os.path.exists(os.path.join(workdir, CHILDREN_FILE))
    with open(os.path.join(workdir, "output.log")) as f:
        output = f.read()
    assert "final policy" in output
    assert "packed into model rows of 128 tokens" in output
    # routing replay: every trajectory carries the engine's experts of all its tokens but the
    # last (-1 at the toy's dense first layer), which the learner's policy passes replayed
    log = TrajectoryLog(os.path.join(workdir, "stream", "trajectories.log"))
    accepted = [Trajectory.from_proto(r.accepted) for r in log.records()
                if r.WhichOneof("kind") == "accepted"]
    assert len(accepted) >= 32
    for t in accepted:
        routes = t.routed_experts
        assert routes.shape == (len(t.prompt_ids) + t.length, 2, 2)
        assert (routes[:-1, 0] == -1).all() and (routes[:-1, 1] >= 0).all()
        assert (routes[-1] == -1).all()
    assert scalars["policy/routed_same"] == [1, 2, 3, 4]  # and the learner compared its own
    # each step's share of cut episodes, from the trajectories it trained on
    cut = {t.trajectory_id: t.truncated for t in accepted}
    shown = [v.simple_value for e in read_events(os.path.join(workdir, "tb"))
             for v in e.summary.value if v.tag == "rollout/truncated_frac"]
    assert shown == pytest.approx([np.mean([cut[i] for i in r["ids"]]) for r in records])

    # `make eval`: the latest checkpoint's held-out accuracy, as the run measured it at the end.
    scored = subprocess.run([sys.executable, "-m", "sao_jax.main",
                             f"--config={os.path.join(workdir, 'lab_config.py')}",
                             f"--eval={workdir}"], cwd=REPO, env=environment(cache_dir),
                            capture_output=True, text=True, timeout=300)
    assert scored.returncode == 0, scored.stderr[-3000:]
    result = json.loads(scored.stdout[scored.stdout.index("{"):])
    assert set(result) >= {"accuracy", "greedy_accuracy"}
    assert result["greedy_accuracy"] == summary["final_greedy_accuracy"]  # greedy: deterministic
    # The episodes behind the scores: every evaluation's in the run, make eval's beside it.
    for name, (sampled, greedy) in {
            "held_out/step_0.jsonl": (summary["initial_eval_accuracy"],
                                      summary["initial_greedy_accuracy"]),
            "held_out/step_2.jsonl": (None, None),
            "held_out/step_4.jsonl": (summary["final_eval_accuracy"],
                                      summary["final_greedy_accuracy"]),
            "eval/episodes.jsonl": (result["accuracy"], result["greedy_accuracy"])}.items():
        scores = held_out_accuracy(os.path.join(workdir, name))
        if sampled is not None:
            assert scores == {"accuracy": sampled, "greedy_accuracy": greedy}, name


def held_out_episodes(path):
    """The lines of a `held_out/step_<N>.jsonl` (or make eval's `eval/episodes.jsonl`)."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def held_out_accuracy(path):
    """`{mode: fraction of its episodes with reward > 0}` of an episodes file, checking that
    each mode holds every held-out row once, each with its transcript."""
    episodes = held_out_episodes(path)
    out = {}
    for mode in ("accuracy", "greedy_accuracy"):
        mine = [e for e in episodes if e["mode"] == mode]
        assert [e["index"] for e in mine] == list(range(len(mine))) and mine, (path, mode)
        assert all(e["text"].startswith("**prompt**") for e in mine), (path, mode)
        out[mode] = sum(e["reward"] > 0 for e in mine) / len(mine)
    return out


def the_swe_run_played_and_graded(workdir):
    """A few steps of swe_tiny (tests/test_notebooks.py): the warm start learnt from the stream of
    fresh tasks, every episode played in a workspace to its end, and the SWE tags at each step."""
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 2 and summary["trajectories"] == 4, summary
    assert summary["this_run_stream"]["episodes_failed"] == 0, summary
    assert summary["warm_start"]["steps"] == 2, summary["warm_start"]
    with open(os.path.join(workdir, "output.log")) as f:
        assert "plays endless fresh swe_tiny tasks" in f.read()
    scalars, _ = scalars_as_shown(os.path.join(workdir, "tb"))
    for tag in ["swe/resolved", "swe/submitted", "swe/format_errors", "swe/turns",
                "swe/suspicious", "swe/suspicious_resolved"]:
        assert scalars[tag] == [1, 2], tag
    # the held-out episodes as the grader and the monitor saw them, at the start and the end
    for step, key in ((0, "initial"), (2, "final")):
        path = os.path.join(workdir, "held_out", f"step_{step}.jsonl")
        assert held_out_accuracy(path) == {"accuracy": summary[f"{key}_eval_accuracy"],
                                           "greedy_accuracy": summary[f"{key}_greedy_accuracy"]}
        for episode in held_out_episodes(path):  # the monitor's lines on every one, and the
            meta = episode["env_metadata"]  # grader's reason where the env ended it
            assert "suspicious_reasons" in meta, episode
            if meta["submitted"] or meta["truncated"]:
                assert "reward_reason" in meta and "resolved" in meta, episode
