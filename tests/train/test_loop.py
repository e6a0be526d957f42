"""The learner loop's hooks (`train.loop.Hook`) run at their periods: hand-written schedules of a
short run, and the periods `train` gives its hooks, read from the config. The loop end to end is
the toy run's (tests/train/learner_runs.py: its tags at their steps); the batch's episode
statistics (`episode_scalars`) on hand-made trajectories, and the warning of a stall for the
critic's bootstrap (`console.StallWatch`) and where it is armed."""

import types

from experiments import toy
from sao_jax.train import engine_stats
from sao_jax.train.learner import _hooks
from sao_jax.train.loop import Hook, LoopState, episode_scalars
from tests.rollout.trajectories import make_trajectory


def schedule(hook, versions):
    """The steps at which `hook` runs in a run whose step i (1-based) leaves the policy at
    `versions[i - 1]`, the last step being `len(versions)`."""
    s = types.SimpleNamespace(step=0, version=0, updated=False)
    due = []
    for version in versions:
        s.step, s.updated, s.version = s.step + 1, version != s.version, version
        if hook.due(s, last=s.step == len(versions)):
            due.append(s.step)
    return due


def maker(run) -> str:
    """The factory (or class) a hook's function comes from."""
    return getattr(run, "__qualname__", type(run).__qualname__).split(".")[0]


def noop(s: LoopState) -> None:
    pass


# 7 steps: 2 of critic warm-up (the version stays 0), then a new version every step.
VERSIONS = [0, 0, 1, 2, 3, 4, 5]


def test_hooks_run_every_n_steps_or_versions_and_the_last_step_as_they_say():
    assert schedule(Hook(noop), VERSIONS) == [1, 2, 3, 4, 5, 6, 7]
    assert schedule(Hook(noop, every=3), VERSIONS) == [3, 6]  # samples: as the period says
    assert schedule(Hook(noop, every=3, last=True), VERSIONS) == [3, 6, 7]  # checkpoints
    assert schedule(Hook(noop, every=7, last=False), VERSIONS) == []  # evaluations: the run's
    assert schedule(Hook(noop, every=0, last=False), VERSIONS) == []  # end does the last
    assert schedule(Hook(noop, every=0, last=True), VERSIONS) == [7]
    # Publishing: every 2 policy versions, at the step that makes it; not at the last step.
    assert schedule(Hook(noop, every=2, versions=True, last=False), VERSIONS) == [4, 6]
    assert schedule(Hook(noop, every=1, versions=True, last=False), VERSIONS) == [3, 4, 5, 6]
    # A step that updates nothing makes no version, though the old one is a multiple.
    assert schedule(Hook(noop, every=1, versions=True), [0, 1, 1, 2]) == [2, 4]


def test_train_gives_each_hook_its_period_from_the_config():
    config = toy.get_config()
    config.publish_every, config.sample_every, config.eval_every = 2, 5, 7
    config.checkpoint_every = 11
    lockstep = types.SimpleNamespace(trainer=None)
    hooks = _hooks(config, types.SimpleNamespace(tokenizer=None), "/nowhere", lockstep, None,
                   None, None, None)
    assert [(maker(h.run), h.every, h.versions, h.last) for h in hooks] == [
        ("publish", 2, True, False),
        ("write_samples", 5, False, None),
        ("evaluate", 7, False, False),
        ("write_stream_metrics", 1, False, None),
        ("write_engine_metrics", engine_stats.EVERY, False, True),
        ("save_checkpoint", 11, False, True),
        ("ProgressLine", 1, False, None),
    ]
    hooks[-1].close()


def test_episode_scalars_count_the_cut_episodes():
    batch = [make_trajectory(12, seed=0),
             make_trajectory(20, seed=1, truncated=True, finish_reason="turn_limit",
                             env_metadata={"turns": 6}),
             make_trajectory(8, seed=2, truncated=True, finish_reason="length",
                             env_metadata={"turns": 1}),
             make_trajectory(4, seed=3, env_metadata={})]
    assert episode_scalars(batch) == {"rollout/response_tokens": 11.0,
                                      "rollout/turns": 2.25,  # (2 + 6 + 1 + 0) / 4
                                      "rollout/truncated_frac": 0.5}


def test_a_stall_for_the_bootstrap_is_said_once():
    from sao_jax.train.console import StallWatch

    lines = []
    watch = StallWatch(True, lines.append)
    for step, share in enumerate([0.0, 0.1, 0.9, 0.9, 0.5, 0.4], start=1):
        watch.record(step, share)  # window of 5: 0.48 at step 5, 0.56 at step 6
    assert len(lines) == 1 and lines[0].startswith("\nstep 6: 56% of the last 5 steps")
    assert "--config.rl.bootstrap_truncated=False" in lines[0]
    for step in range(7, 20):
        watch.record(step, 1.0)
    assert len(lines) == 1  # once a run
    quiet = StallWatch(False, lines.append)
    for step in range(1, 20):
        quiet.record(step, 1.0)
    assert len(lines) == 1


def test_the_stall_watch_is_armed_where_a_critic_bootstraps_cut_episodes():
    from experiments import chain

    state = types.SimpleNamespace(step=0, version=0)
    meta = {"wall_time_s": 0.0, "consumed_ids": [], "initial_eval": {"accuracy": 0.0}}

    def armed(config):
        return LoopState.start(config, state, meta, started=0.0, log=print).stall.armed

    assert not armed(toy.get_config())  # ends a cut episode at its reward
    config = chain.get_config()  # keeps the bootstrap
    assert armed(config)
    config.algo = "grpo_dis"  # no critic: nothing to bootstrap from
    assert not armed(config)
