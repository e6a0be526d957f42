"""Online learning under a moving target: the rewarded writing style switches at set steps.

The paper's online-learning experiment (docs/algorithm.md §6): the style a judge rewards changes
twice during training (around steps 150 and 300), and SAO re-aligns quickly while a running-mean
baseline lags. Here the judge is small and deterministic:

    reward = quality(response, topic) * style_match(response, style at this learner step)

quality (in [0, 1]): a sentence of 3 to 10 distinct lowercase words that mentions the topic word
and ends in a full stop; each broken rule removes a quarter. A style is a target length in
words ("terse" 3, "balanced" 5, "wordy" 7), and style_match falls off linearly with the distance
from it: `max(0, 1 - |words - target| / LENGTH_FALLOFF)`. The default schedule is terse, wordy
from step 150, terse again from step 300 (`config.env.style_schedule` sets another); the
schedule maps learner steps to styles, so the same response earns different rewards before and
after a switch.

Why graded: every length within a few words of the target earns some reward, so after a switch
a policy that had settled on the old length still gets a gradient toward the new one. Earlier
versions showed what breaks this. A style of one token (the end punctuation mark) re-learned
at most one switch: the mark's probability collapsed onto the rewarded one, and a new mark was
never sampled again. Length targets of 3, 6 and 9 words with actions cut by the response budget
(online_style's first settings) overshot the longer style into run-ons that never reached the
judge, all earning 0, and the char-level toy model's words then decayed into noise; the
experiment now gives the response budget room above the action's, so that a cut sentence is
still judged (and loses only its full stop's quarter).
"""

from __future__ import annotations

import dataclasses
import random
import re

from sao_jax.envs.base import StepResult

STYLES = {"terse": 3, "balanced": 5, "wordy": 7}  # style -> target length in words
MIN_WORDS, MAX_WORDS = 3, 10  # a well-formed sentence's length
LENGTH_FALLOFF = 6.0  # words off the target at which the style match reaches 0
TOPICS = ("cats", "rain", "bread", "ships", "stars", "music", "trees", "snow", "bees", "maps")
DEFAULT_SCHEDULE = ((0, "terse"), (150, "wordy"), (300, "terse"))
SENTENCE = re.compile(r"[a-z]+( [a-z]+)*\.")


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


def words_of(response: str) -> list[str]:
    return re.findall(r"[a-z]+", response)


def quality(response: str, topic: str) -> float:
    """1 for a well-formed sentence about `topic`; each broken rule costs a quarter."""
    text = response.strip()
    words = words_of(text)
    rules = [
        MIN_WORDS <= len(words) <= MAX_WORDS,
        topic in words,
        len(set(words)) == len(words),
        SENTENCE.fullmatch(text) is not None,
    ]
    return sum(rules) / len(rules)


def style_match(response: str, style: str) -> float:
    """1 at the style's target length in words, falling off linearly to 0 at LENGTH_FALLOFF
    words away."""
    distance = abs(len(words_of(response)) - STYLES[style])
    return max(0.0, 1.0 - distance / LENGTH_FALLOFF)


def stop_token_ids(tok) -> tuple[int, ...]:
    """An action ends at the end-of-sequence token or a sentence's full stop."""
    return tok.eos_id, tok.encode(".")[0]


@dataclasses.dataclass
class StyleShiftEnv:
    """A single-turn episode: write a sentence about `topic`, judged in the style that the
    schedule rewards at `learner_step` (the learner's step when the prompt was leased)."""

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
    """A sentence of full quality about `topic`: MIN_WORDS to MAX_WORDS distinct lowercase words,
    its length drawn uniformly, ending in a full stop. The warm-start teacher: every style's
    length starts about equally likely, and RL has to find the one in force."""
    length = rng.randint(MIN_WORDS, MAX_WORDS)
    words = [topic, *rng.sample([w for w in FILLER if w != topic], length - 1)]
    rng.shuffle(words)
    return " ".join(words) + "."


# ------------------------------------------------------------ the registry's entry (registry.py)

def parse_schedule(text: str) -> tuple[tuple[int, str], ...]:
    """`config.env.style_schedule`, e.g. "0:terse,150:wordy,300:terse" (the default, ""): the
    learner step from which each style is rewarded, the first at step 0, in increasing order."""
    if not text:
        return DEFAULT_SCHEDULE
    fix = 'write it as "step:style,..." from step 0 up, e.g. "0:terse,150:balanced,300:terse"'
    schedule = []
    for item in text.split(","):
        step, _, style = item.strip().partition(":")
        if not step.strip().isdigit() or style.strip() not in STYLES:
            raise ValueError(f"config.env.style_schedule: {item.strip()!r} is not "
                             f"step:style with a style of {sorted(STYLES)}; {fix}.")
        schedule.append((int(step), style.strip()))
    steps = [step for step, _ in schedule]
    if steps[0] != 0 or steps != sorted(set(steps)):
        raise ValueError(f"config.env.style_schedule = {text!r}: the steps must start at 0 and "
                         f"increase; {fix}.")
    return tuple(schedule)


def options(config) -> dict:
    """The workers' options: the schedule (`config.env.style_schedule`), checked here."""
    return {"schedule": [list(item) for item in parse_schedule(config.env.style_schedule)]}


def make_env(data, max_turns: int, options=None, learner_step: int = 0) -> StyleShiftEnv:
    """The episode of a prompt row: its topic, judged at `learner_step` (the step its lease
    carries, which the worker passes on: the entry's `step_in_prompt`; 0 in evaluations) in the
    schedule of `options` (`options()`; none: DEFAULT_SCHEDULE)."""
    schedule = tuple(map(tuple, (options or {}).get("schedule", DEFAULT_SCHEDULE)))
    return StyleShiftEnv(data["topic"], learner_step=int(learner_step), schedule=schedule)


def rows(config) -> tuple[list, list]:
    """`config.env.num_train_prompts` (default 512) training topics and
    `config.env.num_eval_prompts` held-out ones, drawn from seed `config.seed`."""
    rng = random.Random(config.seed)
    n = config.env.num_train_prompts or 512
    train = [{"index": i, "prompt_id": str(i), "topic": random_topic(rng)} for i in range(n)]
    evals = [{"topic": random_topic(rng)} for _ in range(config.env.num_eval_prompts)]
    return train, evals


def teacher_stream(seed: int):
    """Endless warm-start transcripts: one sentence of full quality about a random topic, its
    length in words (the style) drawn uniformly (`teacher_sentence`)."""
    rng = random.Random(seed)
    while True:
        topic = random_topic(rng)
        yield StyleShiftEnv(topic).reset(), [(teacher_sentence(topic, rng), "")]


# What the teacher writes, as a version in the warm start's cache key: 2 writes sentences of
# every length (1 wrote end punctuation). Raise it when `teacher_sentence` changes.
TEACHER_VERSION = 2


def warm_start_teacher(config, train_rows=None, eval_rows=None, options=None, *, log=None):
    """The warm start's teacher (`registry.Teacher.transcripts`): `teacher_stream`, for training
    and held out alike; nothing of the experiment changes it, so its key is its version."""
    return {"version": TEACHER_VERSION}, lambda: (teacher_stream, teacher_stream)


def sft_length(config) -> int:
    """The warm start's rows are the rows RL has."""
    return config.rollout.engine_max_seq_len + 1
