r"""Tool-integrated reasoning (TIR): the model writes Python, a sandbox runs it, it sees the output.

`PythonToolEnv` is one episode on one math problem. Text in, text out; the agent loop tokenises.
`step(action)` reads the text the model generated this turn:
  a final answer outside code blocks, `\boxed{...}` (the last one) or a line `Answer: ...`
      -> done; reward 1.0 if `math_answer_equal(answer, reference)`, else 0.0;
  ```python ... ``` blocks (a last block left open, as when generation stops at a fence, counts)
      -> the blocks run, joined, as one program in a fresh sandbox (`sandbox.run_python`; nothing
         carries over between turns) and the observation is `<output>\n...\n</output>\n`: stdout
         then stderr, cut to `max_output_chars` (head and tail kept), plus a bracketed line when
         the run did not end normally (`[killed: wall-clock limit of 10 s reached]`); reward 0;
  anything else -> done, reward 0 (as in `calculator`).
After `max_turns` actions the episode ends (info["truncated"] = True). If isolation is unavailable,
`step` raises `sandbox.SandboxUnavailable`: code is never run outside the sandbox.

`math_answer_equal` compares answers without evaluating them: integers, decimals, fractions
(`3/4` == `0.75` == `\frac{3}{4}`), thousands separators, signs, `$`, `\boxed{}`, `\text{}`,
trailing periods, `x = ...`, and tuples element by element; otherwise the normalised strings.
`random_problem` / `problem_stream` give deterministic problems whose answers are known exactly and
which are easy with a few lines of Python and tedious without.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Iterator
from fractions import Fraction

from sao_jax.envs.base import StepResult, ThreadedEnv
from sao_jax.envs.sandbox import SandboxConfig, SandboxResult, run_python

PROMPT = """Solve the problem below. You may run Python: write a code block

```python
print(2 ** 10)
```

and you will see what it prints between <output> and </output>. Each block runs on its own in a \
fresh interpreter ({libraries}), with no network, for at most {seconds:g} seconds. Give the final \
answer as \\boxed{{...}}.

Problem: {problem}
"""

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_ANY_FENCE = re.compile(r"```.*?(?:```|\Z)", re.DOTALL)
_ANSWER_LINE = re.compile(r"^[ \t*]*(?:final )?answer[ \t*]*[:：][ \t*]*(.+?)[ \t*]*$",
                          re.IGNORECASE | re.MULTILINE)


class PythonToolEnv:
    """One TIR episode; see the module docstring for what an action does."""

    def __init__(self, problem: str, answer: str, sandbox_config: SandboxConfig | None = None,
                 max_turns: int = 4, max_output_chars: int = 2000):
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.problem = problem
        self.answer = str(answer)
        self.sandbox_config = sandbox_config or SandboxConfig()
        self.max_turns = max_turns
        self.max_output_chars = max_output_chars
        self.turns = 0
        self.done = False

    def reset(self) -> str:
        self.turns = 0
        self.done = False
        config = self.sandbox_config
        libraries = ("its installed packages available" if config.site_packages
                     else "standard library only")
        return PROMPT.format(libraries=libraries, seconds=config.wall_seconds,
                             problem=self.problem)

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("the episode is over; call reset() first")
        self.turns += 1
        info = {"turns": self.turns, "truncated": False}
        given = extract_answer(action)
        if given is not None:
            correct = math_answer_equal(given, self.answer)
            info.update(answer=given, correct=correct)
            return self._end(1.0 if correct else 0.0, info)
        code = extract_code(action)
        if code is None:
            return self._end(0.0, info)
        if self.turns >= self.max_turns:
            info["truncated"] = True
            return self._end(0.0, info)
        result = run_python(code, self.sandbox_config)
        info.update(exit_code=result.exit_code, killed_by=result.killed_by,
                    timed_out=result.timed_out, output_truncated=result.truncated,
                    sandbox_seconds=result.wall_seconds)
        return StepResult(self.format_output(result), 0.0, False, info)

    def format_output(self, result: SandboxResult) -> str:
        text = result.stdout
        if result.stderr:
            text += ("" if not text or text.endswith("\n") else "\n") + result.stderr
        text = clip_middle(text.rstrip("\n"), self.max_output_chars)
        if not result.ok:
            text += ("\n" if text else "") + f"[{result.describe(self.sandbox_config)}]"
        elif not text:
            text = "[no output]"
        return f"<output>\n{text}\n</output>\n"

    def _end(self, reward: float, info: dict) -> StepResult:
        self.done = True
        return StepResult("", reward, True, info)


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Where an action ends: at the tokenizer's eos, and at a token that closes a code block.

    A closing fence can stop generation only where it is a token of its own: one whose text is
    ``` with whitespace around it (Qwen2's pre-tokenizer makes "```\\n" one) and which the
    opening "```python\\n" never uses. A tokenizer that writes every fence as the same "```"
    has none, and its actions stop at eos only: the code of a turn runs when the model ends
    the turn. A bare ``` opening a block would stop the action too; the prompt asks for
    ```python.

    Args:
      tokenizer: anything with `encode`, `decode`, `vocab_size` and `eos_id` (a
        `text.HFTokenizer`; the toy `CharTokenizer` cannot write the prompt).
    """
    fences = {i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).strip() == "```"}
    opening = {*tokenizer.encode("```python\n"),
               *tokenizer.encode("Let me compute it.\n```python\n")}
    return (tokenizer.eos_id, *sorted(fences - opening))


def make_env(data, max_turns: int, options=None) -> ThreadedEnv:
    """The episode of a prompt row (`{"prompt", "answer"}`, `datasets.jsonl_rows`), stepping in
    a thread (`base.ThreadedEnv`): a program runs up to its wall-clock limit."""
    return ThreadedEnv(PythonToolEnv(problem=data["prompt"], answer=data["answer"],
                                     max_turns=max_turns))


# ----------------------------------------------------------------------------- parsing actions

def extract_code(action: str) -> str | None:
    """The Python of all ```python / ```py / bare ``` blocks, joined; None if there is none."""
    blocks = [m.group(2) for m in _FENCE.finditer(action)]
    blocks = [b for b in blocks if b.strip()]
    return "\n".join(blocks) if blocks else None


def extract_answer(action: str) -> str | None:
    """The final answer outside code blocks: the last `\\boxed{...}`, else the last `Answer:`."""
    prose = _ANY_FENCE.sub("\n", action)
    boxed = _boxed_contents(prose)
    if boxed:
        return boxed[-1].strip()
    lines = _ANSWER_LINE.findall(prose)
    return lines[-1] if lines else None


def _boxed_contents(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` / `\\fbox{...}`, braces balanced."""
    found = []
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found.append(text[start:i])
                break
    return found


def clip_middle(text: str, max_chars: int) -> str:
    """`text` if short enough, else its head and tail around a note of what was cut."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"


# ---------------------------------------------------------------------------- answer checking

_MAX_ANSWER_CHARS = 500
_NUMBER = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d{1,3})?"
_LATEX_NOISE = re.compile(r"\\(?:left|right|displaystyle|[,;:! ])|\^\s*\{?\\circ\}?|°|\\%|%")


def math_answer_equal(pred: str, ref: str) -> bool:
    """Whether two final answers denote the same value. Never evaluates its input.

    Numbers (integers, decimals, `a/b`, `\\frac{a}{b}`, signs, thousands separators) compare as
    exact fractions, so `3/4` == `0.75`; a decimal also matches within a relative 1e-6 (printed
    floats; zero only exactly). Tuples and lists compare element by element; anything else
    compares as normalised text (whitespace, `$`, `\\boxed{}`, `\\text{}`, `\\left`/`\\right`, a
    trailing period and a leading `x =` removed).
    """
    pred, ref = normalize_answer(str(pred)), normalize_answer(str(ref))
    if len(pred) > _MAX_ANSWER_CHARS or len(ref) > _MAX_ANSWER_CHARS:
        return pred == ref
    return _equal(pred, ref)


def normalize_answer(text: str) -> str:
    text = text.strip().replace("$", "").replace("\u2212", "-")
    boxed = _boxed_contents(text)
    if boxed:
        text = boxed[-1]
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}", r"\1", text)
    text = _LATEX_NOISE.sub("", text)
    text = re.sub(r"\s+", " ", text).strip().rstrip(".").strip()
    text = re.sub(r"^[A-Za-z]\w*\s*=\s*(?=\S)", "", text)  # "x = 5" -> "5"
    return text


def _equal(pred: str, ref: str) -> bool:
    p, r = _number(pred), _number(ref)
    if p is not None and r is not None:
        if p == r:
            return True
        inexact = any(c in s for s in (pred, ref) for c in ".eE")
        return inexact and abs(p - r) <= Fraction(1, 10**6) * abs(r)
    p_items, r_items = _items(pred), _items(ref)
    if p_items is not None and r_items is not None:
        return len(p_items) == len(r_items) and all(
            _equal(a, b) for a, b in zip(p_items, r_items, strict=True))
    return pred.replace(" ", "") == ref.replace(" ", "")


def _number(text: str) -> Fraction | None:
    s = text.replace(" ", "")
    if re.fullmatch(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(_NUMBER, s):
        return Fraction(s)
    frac = (re.fullmatch(r"([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}", s)
            or re.fullmatch(r"([+-]?)\\frac(\d)(\d)", s)
            or re.fullmatch(rf"()({_NUMBER})/({_NUMBER})", s))
    if frac:
        sign, num, den = frac.groups()
        num, den = _number(num), _number(den)
        if num is None or den is None or den == 0:
            return None
        return -num / den if sign == "-" else num / den
    return None


def _items(text: str) -> list[str] | None:
    """Top-level comma-separated items of `(a, b)`, `[a, b]`, `\\{a, b\\}` or `a, b`."""
    s = text.strip()
    for left, right in (("(", ")"), ("[", "]"), ("\\{", "\\}"), ("{", "}")):
        if s.startswith(left) and s.endswith(right):
            s = s[len(left):len(s) - len(right)]
            break
    items, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(s[start:i].strip())
            start = i + 1
    items.append(s[start:].strip())
    return items if len(items) > 1 else None


# ------------------------------------------------------------------------------------ problems

@dataclasses.dataclass(frozen=True)
class MathProblem:
    question: str
    answer: str  # exact, as math_answer_equal reads it


def random_problem(rng: random.Random) -> MathProblem:
    """One of five problem kinds, each with an exactly computed answer."""
    kind = rng.randrange(5)
    if kind == 0:
        a, b, m = rng.randint(2, 99), rng.randint(10**3, 10**6), rng.randint(10**3, 10**6)
        return MathProblem(f"What is the remainder when {a}^{b} is divided by {m}?",
                           str(pow(a, b, m)))
    if kind == 1:
        n = rng.randint(10**3, 10**6)
        p, q = rng.sample([2, 3, 5, 7, 11, 13], 2)

        def multiples_sum(d):  # d + 2d + ... below n
            k = (n - 1) // d
            return d * k * (k + 1) // 2

        total = multiples_sum(p) + multiples_sum(q) - multiples_sum(math.lcm(p, q))
        return MathProblem(f"What is the sum of all positive integers less than {n} that are "
                           f"divisible by {p} or by {q}?", str(total))
    if kind == 2:
        denominators = sorted(rng.sample(range(2, 40), rng.randint(3, 6)))
        total = sum(Fraction(1, d) for d in denominators)
        terms = " + ".join(f"1/{d}" for d in denominators)
        return MathProblem(f"Compute {terms}. Give the answer as a fraction in lowest terms.",
                           str(total))
    if kind == 3:
        exponents = {p: rng.randint(0, 4) for p in (2, 3, 5, 7, 11)}
        n = math.prod(p**e for p, e in exponents.items())
        divisors = math.prod(e + 1 for e in exponents.values())
        return MathProblem(f"How many positive divisors does {n} have?", str(divisors))
    a, b = rng.randint(2, 99), rng.randint(20, 300)
    return MathProblem(f"What is the sum of the digits of {a}^{b}?",
                       str(sum(int(c) for c in str(a**b))))


def problem_stream(seed: int) -> Iterator[MathProblem]:
    rng = random.Random(seed)
    while True:
        yield random_problem(rng)
