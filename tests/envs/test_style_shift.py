"""The style-shift judge: quality rules, style schedule, graded length styles, the teacher."""

import random

import pytest

from sao_jax.envs.style_shift import (
    DEFAULT_SCHEDULE,
    MAX_WORDS,
    MIN_WORDS,
    STYLES,
    StyleShiftEnv,
    make_env,
    quality,
    stop_token_ids,
    style_at,
    style_match,
    teacher_sentence,
)
from sao_jax.text import CharTokenizer


def test_schedule_switches_at_the_configured_steps():
    assert [style_at(s) for s in (0, 149, 150, 299, 300, 10_000)] == [
        "terse", "terse", "wordy", "wordy", "terse", "terse"]
    with pytest.raises(ValueError, match="not one of"):
        style_at(0, ((0, "angry"),))


def test_a_configured_schedule_reaches_the_workers_episodes():
    """`config.env.style_schedule` goes to the workers as the env's options (JSON) and sets the
    style each episode is judged in; a malformed one is refused naming the field."""
    import json

    from experiments import online_style
    from sao_jax.envs import registry

    config = online_style.get_config()
    config.env.style_schedule = "0:terse, 20:balanced,40:wordy"
    options = json.loads(json.dumps(registry.REGISTRY["style_shift"].options(config)))
    styles = [make_env({"topic": "cats"}, 1, options=options, learner_step=step).step(
        "the cats sleep here today.").info["style"] for step in (0, 19, 20, 39, 40)]
    assert styles == ["terse", "terse", "balanced", "balanced", "wordy"]
    assert make_env({"topic": "cats"}, 1, learner_step=150).schedule == DEFAULT_SCHEDULE
    assert make_env({"topic": "cats"}, 1).learner_step == 0  # an evaluation's episode
    for bad, match in (("0:terse,150:angry", "'150:angry' is not step:style"),
                       ("10:terse", "must start at 0"), ("0:terse,0:wordy", "must start at 0"),
                       ("0:terse,x:wordy", "'x:wordy' is not step:style")):
        config.env.style_schedule = bad
        with pytest.raises(ValueError, match=f"config.env.style_schedule.*{match}"):
            registry.REGISTRY["style_shift"].options(config)


def test_quality_rules():
    assert quality("the cats sleep all day.", "cats") == 1.0
    assert quality("the dogs sleep all day.", "cats") == 0.75  # off topic
    assert quality("cats cats cats.", "cats") == 0.75  # repeated words
    assert quality("cats.", "cats") == 0.75  # too short
    assert quality("a b c d e f g h i j cats.", "cats") == 0.75  # too long
    assert quality("the cats sleep all day!", "cats") == 0.75  # not a full stop
    assert quality("Cats sleep a lot", "cats") == 0.5  # "Cats" is not the word "cats"; no stop


def test_the_style_match_falls_off_with_the_distance_from_the_target_length():
    three, five, seven = "cats sleep here.", "the cats sleep here today.", \
        "the old cats sleep here all day."
    assert [style_match(s, "terse") for s in (three, five, seven)] == pytest.approx(
        [1.0, 4 / 6, 2 / 6])
    assert [style_match(s, "wordy") for s in (three, five, seven)] == pytest.approx(
        [2 / 6, 4 / 6, 1.0])
    assert style_match(five, "balanced") == 1.0
    assert style_match("a b c d e f g h i j.", "terse") == 0.0  # 7 words off: nothing
    # every style has neighbours that earn something: a gradient after a switch
    for style, target in STYLES.items():
        assert style_match(" ".join(["w"] * (target + 2)) + ".", style) > 0


def test_a_sentence_cut_short_is_still_judged_without_its_full_stop():
    cut = StyleShiftEnv("cats", learner_step=160).step("the old cats sleep here all day")
    assert cut.info["quality"] == 0.75 and cut.reward == 0.75


def test_same_response_rewarded_differently_after_a_switch():
    response = "the cats sleep all day."  # five words
    before = StyleShiftEnv("cats", learner_step=10).step(response)
    after = StyleShiftEnv("cats", learner_step=160).step(response)
    assert before.reward == pytest.approx(4 / 6) == after.reward  # two words off either way
    seven = "the old cats sleep here all day."
    assert StyleShiftEnv("cats", learner_step=10).step(seven).reward == pytest.approx(2 / 6)
    wordy = StyleShiftEnv("cats", learner_step=160).step(seven)
    assert wordy.reward == 1.0 and wordy.done
    assert wordy.info == {"quality": 1.0, "style": "wordy", "style_match": 1.0}


def test_the_teacher_writes_every_length_at_full_quality():
    rng = random.Random(0)
    lengths = set()
    for _ in range(300):
        sentence = teacher_sentence("bees", rng)
        assert quality(sentence, "bees") == 1.0, sentence
        lengths.add(len(sentence[:-1].split()))
    assert lengths == set(range(MIN_WORDS, MAX_WORDS + 1))


def test_prompts_fit_the_toy_vocabulary_and_an_action_stops_at_the_full_stop():
    tok = CharTokenizer()
    env = StyleShiftEnv("bees")
    assert tok.decode(tok.encode(env.reset())) == env.reset()
    assert tok.encode(".")[0] in stop_token_ids(tok) and tok.eos_id in stop_token_ids(tok)


def test_online_style_judges_a_sentence_cut_at_its_action_budget():
    # an action cut by the response budget itself never reaches the judge (it earns 0)
    from experiments import online_style

    env = online_style.get_config().env
    assert env.max_response_tokens > env.max_action_tokens


def test_the_teacher_writes_full_quality_sentences_of_every_length():
    import itertools

    from sao_jax.envs import style_shift

    lengths = set()
    for prompt, ((action, observation),) in itertools.islice(style_shift.teacher_stream(0), 600):
        topic = prompt.removeprefix("write about ").removesuffix(":\n")
        assert topic in style_shift.TOPICS and observation == ""
        assert style_shift.quality(action, topic) == 1.0, action
        lengths.add(len(style_shift.words_of(action)))
    assert lengths == set(range(style_shift.MIN_WORDS, style_shift.MAX_WORDS + 1))
