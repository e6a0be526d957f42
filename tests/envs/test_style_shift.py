"""The style-shift judge: quality rules, style schedule, reward = quality x style match."""

import pytest

from sao_jax.envs.style_shift import StyleShiftEnv, quality, style_at
from sao_jax.envs.tokenizer import CharTokenizer


def test_schedule_switches_at_the_configured_steps():
    assert [style_at(s) for s in (0, 149, 150, 299, 300, 10_000)] == [
        "plain", "plain", "excited", "excited", "curious", "curious"]
    with pytest.raises(ValueError, match="not one of"):
        style_at(0, ((0, "angry"),))


def test_quality_rules():
    assert quality("the cats sleep all day.", "cats") == 1.0
    assert quality("the dogs sleep all day.", "cats") == 0.75  # off topic
    assert quality("cats cats cats.", "cats") == 0.75  # repeated words
    assert quality("cats.", "cats") == 0.75  # too short
    assert quality("Cats sleep a lot", "cats") == 0.5  # "Cats" is not the word "cats"; no stop


def test_same_response_rewarded_differently_after_a_switch():
    response = "the cats sleep all day!"
    before = StyleShiftEnv("cats", learner_step=10).step(response)
    after = StyleShiftEnv("cats", learner_step=160).step(response)
    assert before.reward == 0.0 and after.reward == 1.0 and after.done
    assert after.info == {"quality": 1.0, "style": "excited", "style_match": 1.0}


def test_prompts_fit_the_toy_vocabulary():
    tok = CharTokenizer()
    env = StyleShiftEnv("bees")
    assert tok.decode(tok.encode(env.reset())) == env.reset()
