"""The embedded default task: multi-step arithmetic with a calculator tool.

A problem is an expression such as `(12+7)*3-5=?`. The model works in turns; each action either
calls the tool, `<calc>12+7</calc>` (the action stops at `</calc>`), and the environment answers
with the observation `<res>19</res>`, or gives the final answer `<ans>52</ans>`. Reward 1 for the
right final answer, 0 otherwise; a turn limit truncates the episode.

The numbers are beyond what a 0.1M-parameter model computes in its head, so it must decompose the
expression and copy operands and results exactly: a short supervised warm start on teacher
transcripts (`teacher_transcript`) leaves it clearly imperfect, and RL on the outcome reward has
a lot to gain. Problems come from a seeded generator; `heldout_problems` never overlaps the
training stream.
"""

from __future__ import annotations

import dataclasses
import random
import re

from sao_jax.envs.base import StepResult
from sao_jax.text import CharTokenizer

_INTEGER = re.compile(r"-?[0-9]+")

OPS = "+-*"


@dataclasses.dataclass(frozen=True)
class Problem:
    expression: str  # e.g. "(12+7)*3-5"
    answer: int

    @property
    def prompt(self) -> str:
        return f"{self.expression}=?\n"


def evaluate(expression: str) -> int:
    """Integer value of `+ - *` and parentheses; ValueError on anything else (no `eval`)."""
    tokens = _lex(expression)
    value, pos = _sum(tokens, 0)
    if pos != len(tokens):
        raise ValueError(f"unexpected {tokens[pos]!r} in {expression!r}")
    return value


def _lex(text: str) -> list[str]:
    tokens, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch.isdigit():
            j = i
            while j < len(text) and text[j].isdigit():
                j += 1
            if j - i > 12:
                raise ValueError(f"number too long in {text!r}")
            tokens.append(text[i:j])
            i = j
        elif ch in "+-*()":
            tokens.append(ch)
            i += 1
        elif ch == " ":
            i += 1
        else:
            raise ValueError(f"unexpected character {ch!r} in {text!r}")
    return tokens


def _sum(tokens, pos):
    value, pos = _product(tokens, pos)
    while pos < len(tokens) and tokens[pos] in "+-":
        op = tokens[pos]
        rhs, pos = _product(tokens, pos + 1)
        value = value + rhs if op == "+" else value - rhs
    return value, pos


def _product(tokens, pos):
    value, pos = _atom(tokens, pos)
    while pos < len(tokens) and tokens[pos] == "*":
        rhs, pos = _atom(tokens, pos + 1)
        value *= rhs
    return value, pos


def _atom(tokens, pos):
    if pos >= len(tokens):
        raise ValueError("expression ends early")
    tok = tokens[pos]
    if tok == "(":
        value, pos = _sum(tokens, pos + 1)
        if pos >= len(tokens) or tokens[pos] != ")":
            raise ValueError("missing )")
        return value, pos + 1
    if tok == "-":
        value, pos = _atom(tokens, pos + 1)
        return -value, pos
    if tok.isdigit():
        return int(tok), pos + 1
    raise ValueError(f"unexpected {tok!r}")


@dataclasses.dataclass(frozen=True)
class Problems:
    """The problem size: `num_ops` binary operations (so as many dependent tool calls in the
    teacher's solution) on operands in [1, `max_operand`]."""

    num_ops: int = 2
    max_operand: int = 30

    def __post_init__(self):
        if not 1 <= self.num_ops <= 8:
            raise ValueError(f"config.env.num_ops must be in [1, 8], got {self.num_ops}.")
        if not 1 <= self.max_operand <= 10**6:
            raise ValueError(f"config.env.max_operand must be in [1, 1e6], got "
                             f"{self.max_operand}.")


DEFAULT_PROBLEMS = Problems()


def random_problem(rng: random.Random, num_ops: int = 2, max_operand: int = 30) -> Problem:
    """`num_ops` binary operations on operands in [1, max_operand], maybe one pair of brackets."""
    operands = [rng.randint(1, max_operand) for _ in range(num_ops + 1)]
    ops = [rng.choice(OPS) for _ in range(num_ops)]
    parts = [str(operands[0])]
    for op, x in zip(ops, operands[1:], strict=True):
        parts += [op, str(x)]
    if num_ops >= 2 and rng.random() < 0.5:
        start = 2 * rng.randrange(num_ops)  # bracket one binary operation
        parts[start] = "(" + parts[start]
        parts[start + 2] = parts[start + 2] + ")"
    expression = "".join(parts)
    return Problem(expression, evaluate(expression))


def problem_stream(seed: int, num_ops: int = 2, max_operand: int = 30):
    """An endless seeded stream of training problems."""
    rng = random.Random(seed)
    while True:
        yield random_problem(rng, num_ops, max_operand)


def heldout_problems(count: int = 200, num_ops: int = 2, max_operand: int = 30,
                     exclude_seed: int | None = None, exclude_count: int = 0) -> list[Problem]:
    """A fixed evaluation set (its own seed), minus any problem of the first `exclude_count` of
    the training stream `exclude_seed`."""
    excluded = set()
    if exclude_seed is not None:
        stream = problem_stream(exclude_seed, num_ops, max_operand)
        excluded = {next(stream).expression for _ in range(exclude_count)}
    rng = random.Random(1_000_003)
    out, seen = [], set()
    while len(out) < count:
        p = random_problem(rng, num_ops, max_operand)
        if p.expression not in excluded and p.expression not in seen:
            out.append(p)
            seen.add(p.expression)
    return out


def teacher_transcript(problem: Problem) -> list[tuple[str, str]]:
    """The reference solution as (action, observation) turns: one tool call per operation, in
    evaluation order, then the answer. The last observation is ""."""
    tokens = _lex(problem.expression)
    turns: list[tuple[str, str]] = []

    def reduce(tokens):
        # Innermost brackets first, then * before + and -, left to right.
        while "(" in tokens:
            close = tokens.index(")")
            open_ = max(i for i in range(close) if tokens[i] == "(")
            inner = reduce(tokens[open_ + 1:close])
            tokens = tokens[:open_] + inner + tokens[close + 1:]
        for ops in ("*", "+-"):
            i = 1
            while i < len(tokens):
                if tokens[i] in ops:
                    a, op, b = tokens[i - 1], tokens[i], tokens[i + 1]
                    value = evaluate(f"{a}{op}{b}")
                    turns.append((f"<calc>{a}{op}{b}</calc>", f"<res>{value}</res>\n"))
                    tokens = tokens[:i - 1] + [str(value)] + tokens[i + 2:]
                else:
                    i += 2
        return tokens

    (result,) = reduce(tokens)
    assert int(result) == problem.answer
    turns.append((f"<ans>{problem.answer}</ans>", ""))
    return turns


def guess_transcript(problem: Problem, rng: random.Random) -> list[tuple[str, str]]:
    """A weak teacher's transcript: the answer given at once, without the tool, and off by 1-9.

    Mixed into the warm-start data (`config.warm_start.guess_rate`, `warm_start_teacher`), it
    stands for imperfect demonstrations: supervised learning imitates the mix, so a warm-started
    policy skips the tool about as often as the teacher did, while RL on the outcome reward can
    learn to always use it.
    """
    offset = rng.choice([-1, 1]) * rng.randint(1, 9)
    return [(f"<ans>{problem.answer + offset}</ans>", "")]


class CalculatorEnv:
    """One episode on one problem. Text in, text out; the agent loop tokenises.

    `step(action)` reads the action the model generated this turn:
      ends with `</calc>`       -> the tool's result `<res>v</res>` and a newline
                                   (`<res>error</res>` if it does not parse), reward 0, not done;
      contains `<ans>x</ans>`     -> done, reward 1 if x is the answer;
      anything else (EOS, limit)  -> done, reward 0.
    After `max_turns` actions the episode ends (info["truncated"] = True).
    """

    def __init__(self, problem: Problem, max_turns: int = 8):
        self.problem = problem
        self.max_turns = max_turns
        self.turns = 0

    def reset(self) -> str:
        self.turns = 0
        return self.problem.prompt

    def step(self, action: str) -> StepResult:
        self.turns += 1
        info = {"turns": self.turns, "truncated": False}
        if "<ans>" in action:
            given = action.split("<ans>", 1)[1].split("</ans>", 1)[0].strip()
            # A model writes anything here ("--9", "1-2", "-"): only a plain integer can count.
            correct = _INTEGER.fullmatch(given) is not None and int(given) == self.problem.answer
            info["answer"] = given
            return StepResult("", 1.0 if correct else 0.0, True, info)
        if action.endswith("</calc>") and "<calc>" in action:
            expression = action.rsplit("<calc>", 1)[1][: -len("</calc>")]
            try:
                observation = f"<res>{evaluate(expression)}</res>\n"
            except ValueError:
                observation = "<res>error</res>\n"
            if self.turns >= self.max_turns:
                info["truncated"] = True
                return StepResult("", 0.0, True, info)
            return StepResult(observation, 0.0, False, info)
        return StepResult("", 0.0, True, info)


def stop_token_ids(tokenizer: CharTokenizer) -> tuple[int, ...]:
    """Where an action ends: after a tool call, after the answer, or at EOS."""
    return tokenizer.id("</calc>"), tokenizer.id("</ans>"), tokenizer.eos_id


# ------------------------------------------------------------ the registry's entry (registry.py)

def make_env(data, max_turns: int, options=None) -> CalculatorEnv:
    """The episode of a prompt row (`{"expression", "answer"}`, from `rows`)."""
    return CalculatorEnv(Problem(data["expression"], int(data["answer"])), max_turns=max_turns)


def problems_of(config) -> Problems:
    """The problem size of an experiment (`config.env.num_ops`, `config.env.max_operand`)."""
    return Problems(config.env.num_ops, config.env.max_operand)


def rows(config) -> tuple[list, list]:
    """`config.env.num_train_prompts` training rows from the stream of seed `config.seed`, and
    `config.env.num_eval_prompts` held-out rows that none of them equals."""
    n = config.env.num_train_prompts
    if n < 1:
        raise ValueError("config.env.num_train_prompts must be >= 1 for the calculator task.")
    size = problems_of(config)
    stream = problem_stream(config.seed, size.num_ops, size.max_operand)
    train = [{"index": i, "prompt_id": str(i), "expression": p.expression, "answer": p.answer}
             for i, p in ((i, next(stream)) for i in range(n))]
    held = heldout_problems(config.env.num_eval_prompts, size.num_ops, size.max_operand,
                            exclude_seed=config.seed, exclude_count=n)
    evals = [{"expression": p.expression, "answer": p.answer} for p in held]
    return train, evals


def teacher_stream(seed: int, guess_rate: float = 0.0, problems: Problems = DEFAULT_PROBLEMS):
    """Endless warm-start transcripts `(prompt, turns)`: the tool-using teacher on `problems`
    (`teacher_transcript`), or with probability `guess_rate` an answer guessed at once
    (`guess_transcript`)."""
    rng = random.Random(seed)
    for problem in problem_stream(seed, problems.num_ops, problems.max_operand):
        turns = teacher_transcript(problem)
        if guess_rate and rng.random() < guess_rate:
            turns = guess_transcript(problem, rng)
        yield problem.prompt, turns


def warm_start_teacher(config, train_rows=None, eval_rows=None, options=None, *, log=None):
    """The warm start's teacher of an experiment (`registry.Teacher.transcripts`): an endless
    stream of `teacher_stream` transcripts on the experiment's problem size, guessing at once
    on `config.warm_start.guess_rate` of them, for training and held out alike. Its key is the
    two; the rows are not read (the stream draws its own problems)."""
    problems, guess_rate = problems_of(config), config.warm_start.guess_rate

    def stream(seed: int):
        return teacher_stream(seed, guess_rate, problems)

    key = {"guess_rate": guess_rate, "problems": dataclasses.asdict(problems)}
    return key, lambda: (stream, stream)


def sft_length(config) -> int:
    """The warm start's row length: 64 tokens hold every transcript of the default problems
    (two operations; half the work of the rows RL has), larger problems get the rows RL has."""
    if problems_of(config) == DEFAULT_PROBLEMS:
        return 64
    return config.rollout.engine_max_seq_len + 1
