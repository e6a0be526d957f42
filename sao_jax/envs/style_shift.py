"""Online learning under a moving target: the rewarded writing style switches at set steps.

The paper's online-learning experiment (ALGORITHM.md §6): the style a judge rewards changes twice
during training (around steps 150 and 300), and SAO re-aligns quickly while a running-mean
baseline lags. Here the judge is small and deterministic:

    reward = quality(response, topic) * style_match(response, style at this learner step)

quality (in [0, 1]): a sentence of 3 to 8 lowercase words that mentions the topic word, with no
word repeated, ending in punctuation; each violated rule removes a share. style: "plain" ends with
".", "excited" with "!", "curious" with "?". The schedule maps learner steps to styles, so the
same response earns different rewards before and after a switch.
"""

from __future__ import annotations

import dataclasses
import random
import re

from sao_jax.envs.calculator import StepResult

STYLES = {"plain": ".", "excited": "!", "curious": "?"}
TOPICS = ("cats", "rain", "bread", "ships", "stars", "music", "trees", "snow", "bees", "maps")
DEFAULT_SCHEDULE = ((0, "plain"), (150, "excited"), (300, "curious"))


def style_at(step: int, schedule=DEFAULT_SCHEDULE) -> str:
    """The style rewarded at learner step `step` (the last switch at or before it)."""
    current = None
    for start, style in sorted(schedule):
        if style not in STYLES:
            raise ValueError(f"schedule style {style!r} is not one of {sorted(STYLES)}.")
        if step >= start:
            current = style
    if current is None:
        raise ValueError(f"schedule {schedule} has no style for step {step}.")
    return current


def quality(response: str, topic: str) -> float:
    """1 for a well-formed sentence about `topic`; each broken rule costs a quarter."""
    text = response.strip()
    words = re.findall(r"[a-z]+", text)
    rules = [
        3 <= len(words) <= 8,
        topic in words,
        len(set(words)) == len(words),
        bool(text) and text[-1] in "".join(STYLES.values())
        and re.fullmatch(r"[a-z ]+[.!?]", text) is not None,
    ]
    return sum(rules) / len(rules)


def style_match(response: str, style: str) -> float:
    text = response.strip()
    return 1.0 if text.endswith(STYLES[style]) else 0.0


@dataclasses.dataclass
class StyleShiftEnv:
    """A single-turn episode: write a sentence about `topic`, judged in the style that the
    schedule rewards at `learner_step` (the policy version the worker generates with)."""

    topic: str
    learner_step: int = 0
    schedule: tuple = DEFAULT_SCHEDULE

    def reset(self) -> str:
        return f"write about {self.topic}:\n"

    def step(self, action: str) -> StepResult:
        style = style_at(self.learner_step, self.schedule)
        q, s = quality(action, self.topic), style_match(action, style)
        return StepResult("", q * s, True, {"quality": q, "style": style, "style_match": s})


def random_topic(rng: random.Random) -> str:
    return rng.choice(TOPICS)


FILLER = ("the", "a", "big", "small", "warm", "cold", "old", "new", "near", "under", "over",
          "sleep", "shine", "fall", "move", "sing", "grow", "stay", "quietly", "often", "today",
          "always", "here", "there", "bright", "slow")


def teacher_sentence(topic: str, rng: random.Random) -> str:
    """A sentence of full quality about `topic` (3 to 6 distinct lowercase words) ending in the
    punctuation of a random style: the warm-start teacher, so that every style starts equally
    likely and RL has to find the one in force."""
    words = [topic, *rng.sample([w for w in FILLER if w != topic], rng.randint(2, 5))]
    rng.shuffle(words)
    return " ".join(words) + rng.choice(sorted(STYLES.values()))
