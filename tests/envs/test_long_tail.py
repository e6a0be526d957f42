"""The long-tail task: heavy-tailed turn counts, fixed-length episodes, rows from the config."""

import numpy as np
import pytest

from experiments import toy
from sao_jax.envs.long_tail import OBSERVATION, LongTailEnv, max_turns_within, turn_counts
from sao_jax.text import CharTokenizer
from sao_jax.train.tasks import make_task


def test_turn_counts_are_heavy_tailed_seeded_and_clamped():
    turns = turn_counts(4096, seed=0, max_turns=24)
    p50, p99 = np.percentile(turns, [50, 99])
    assert p50 == 2 and p99 >= 8 * p50
    assert turns.min() == 1 and turns.max() == 24
    np.testing.assert_array_equal(turns, turn_counts(4096, seed=0, max_turns=24))
    assert not np.array_equal(turns, turn_counts(4096, seed=1, max_turns=24))
    assert turn_counts(100, seed=0, max_turns=3).max() == 3
    with pytest.raises(ValueError, match="max_turns"):
        turn_counts(1, seed=0, max_turns=0)


def test_max_turns_within_counts_actions_and_observations():
    observation = len(CharTokenizer().encode(OBSERVATION))
    assert observation == 5
    assert max_turns_within(16, 16) == 1
    assert max_turns_within(16 + 5 + 16, 16) == 2  # two actions, one observation between
    assert max_turns_within(16 + 5 + 15, 16) == 1
    assert max_turns_within(4, 16) == 1


def test_episode_takes_exactly_its_turns_and_rewards_digits():
    env = LongTailEnv(3)
    tok = CharTokenizer()
    assert tok.decode(tok.encode(env.reset())) == "talk for 3 turns:\n"
    first = env.step("a1")
    assert (first.observation, first.reward, first.done) == (OBSERVATION, 0.0, False)
    assert env.step("bc").done is False
    last = env.step("<calc>7</calc>")
    assert last.done and last.observation == ""
    assert last.reward == pytest.approx(2 / 3)
    assert last.info == {"turns": 3, "truncated": False}
    env.reset()
    assert env.step("x").reward == 0.0 and env.step("y").reward == 0.0
    assert LongTailEnv(1).step("9").reward == 1.0
    with pytest.raises(ValueError, match="turns"):
        LongTailEnv(0)


def test_rows_fit_the_response_budget():
    config = toy.get_config()
    config.env.name = "long_tail"
    config.env.num_train_prompts = 512
    config.env.num_eval_prompts = 24
    config.env.max_turns = 100
    config.env.max_response_tokens = 96  # at most 4 actions of 16 and 3 observations of 5
    task = make_task(config)
    assert len(task.train_rows) == 512 and len(task.eval_rows) == 24
    assert {"index", "prompt_id", "turns"} == set(task.train_rows[0])
    assert max(r["turns"] for r in task.train_rows) == 4
    assert min(r["turns"] for r in task.train_rows) == 1
    env = task.make_env(task.train_rows[0], config.env.max_turns)
    assert isinstance(env, LongTailEnv) and env.turns == task.train_rows[0]["turns"]
