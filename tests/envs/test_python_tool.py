"""The TIR environment: action parsing, the answer checker, problems, and whole episodes."""

import itertools
import random
from fractions import Fraction

import pytest

from sao_jax.envs import sandbox
from sao_jax.envs.python_tool import (
    PythonToolEnv,
    clip_middle,
    extract_answer,
    extract_code,
    math_answer_equal,
    problem_stream,
    random_problem,
)
from sao_jax.envs.sandbox import SandboxConfig, SandboxUnavailable

FAST = SandboxConfig(cpu_seconds=1, wall_seconds=4)




# ----------------------------------------------------------------------------- the checker

@pytest.mark.parametrize("pred, ref", [
    ("42", "42"), (" 42 ", "42"), ("42.", "42"), ("$42$", "42"), (r"\boxed{42}", "42"),
    ("042", "42"), ("42.0", "42"), ("-7", "-7"), ("\u22127", "-7"), ("- 7", "-7"),
    ("3/4", "0.75"), ("0.75", "3/4"), (r"\frac{3}{4}", "0.75"), (r"\dfrac{3}{4}", "3/4"),
    (r"-\frac{3}{4}", "-0.75"), (r"\frac{-3}{4}", "-3/4"), (r"\frac12", "0.5"), ("6/8", "3/4"),
    ("1,000,000", "1000000"), ("1,234.5", "1234.5"), ("x = 5", "5"), ("n=12", "12"),
    (r"5 \text{ apples}", "5 apples"), (r"\boxed{\frac{493}{1288}}", "493/1288"),
    ("0.3333333333333333", "1/3"), ("1e3", "1000"), (".5", "1/2"), ("50\\%", "50"),
    ("(1, 2)", "(1,2)"), ("[1/2, 3]", "(0.5, 3)"), (r"\left( 1, -2 \right)", "(1, -2)"),
    (r"\sqrt{2}", r"\sqrt{2}"), (r"\pi / 2", r"\pi/2"),
])
def test_equal_answers(pred, ref):
    assert math_answer_equal(pred, ref)


@pytest.mark.parametrize("pred, ref", [
    ("41", "42"), ("-42", "42"), ("0.33", "1/3"), ("3/5", "0.75"), ("1/0", "0"), ("", "0"),
    ("1e-9", "0"), ("(1, 2)", "(2, 1)"), ("(1, 2)", "(1, 2, 3)"), ("12", "1,2"),
    (r"\sqrt{2}", r"\sqrt{3}"), ("__import__('os').system('id')", "0"), ("1e999999", "1"),
])
def test_unequal_answers(pred, ref):
    assert not math_answer_equal(pred, ref)


def test_checker_never_evaluates(tmp_path):
    marker = tmp_path / "evaluated"
    assert not math_answer_equal(f"open({str(marker)!r}, 'w') and 1", "1")
    assert not marker.exists()
    assert not math_answer_equal("9" * 10_000, "1")  # huge input: no quadratic blow-up


# ---------------------------------------------------------------------------- parsing actions

def test_extract_code_blocks():
    action = "Let me compute.\n```python\nx = 2\n```\nand\n```py\nprint(x ** 10)\n```\n"
    assert extract_code(action) == "x = 2\n\nprint(x ** 10)\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("Compute:\n```python\nprint(3)\n") == "print(3)\n"  # stopped at a fence
    assert extract_code("```text\nnot code\n```") is None
    assert extract_code("no code here") is None


def test_extract_answer_ignores_code():
    assert extract_answer(r"so the result is \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_answer(r"\boxed{1} then, correcting myself, \boxed{2}") == "2"
    assert extract_answer("Work...\nFinal Answer: 17\n") == "17"
    assert extract_answer("**Answer:** 17") == "17"
    code_only = "```python\nprint(f'\\\\boxed{{{x}}}')\nprint('Answer: 3')\n```"
    assert extract_answer(code_only) is None
    assert extract_answer("The answer follows from the code.") is None


def test_clip_middle():
    assert clip_middle("short", 10) == "short"
    clipped = clip_middle("a" * 50 + "b" * 50, 20)
    assert clipped.startswith("a" * 10) and clipped.endswith("b" * 10)
    assert "[80 characters cut]" in clipped


# ----------------------------------------------------------------------------------- problems

def test_problem_stream_is_deterministic():
    take = lambda seed: list(itertools.islice(problem_stream(seed), 20))
    assert take(0) == take(0)
    assert take(0) != take(1)
    assert len({p.question for p in take(0)}) == 20


def divisor_count(n):
    """Trial division into prime powers; the count is the product of (exponent + 1)."""
    count, d = 1, 2
    while d * d <= n:
        e = 0
        while n % d == 0:
            n //= d
            e += 1
        count *= e + 1
        d += 1
    return count * (2 if n > 1 else 1)


def test_problem_answers_are_right():
    """Each kind's answer, recomputed the slow, obvious way."""
    rng = random.Random(7)
    for _ in range(40):
        problem = random_problem(rng)
        numbers = [int(t) for t in "".join(c if c.isdigit() else " "
                                           for c in problem.question).split()]
        q = problem.question
        if q.startswith("What is the remainder"):
            a, b, m = numbers
            expected = pow(a, b, m)
        elif q.startswith("What is the sum of all"):
            n, p, r = numbers
            expected = sum(k for k in range(1, n) if k % p == 0 or k % r == 0)
        elif q.startswith("Compute"):
            expected = sum(Fraction(1, d) for d in numbers[1::2])
        elif q.startswith("How many"):
            (n,) = numbers
            expected = divisor_count(n)
        else:
            a, b = numbers
            expected = sum(map(int, str(a**b)))
        assert math_answer_equal(problem.answer, str(expected)), (q, problem.answer, expected)


# ----------------------------------------------------------------------------------- episodes

def test_episode_with_code_then_answer(isolated):
    env = PythonToolEnv("What is 7^222 mod 1000?", str(pow(7, 222, 1000)), FAST, max_turns=3)
    prompt = env.reset()
    assert "What is 7^222 mod 1000?" in prompt and "\\boxed{...}" in prompt
    step = env.step("I'll compute it.\n```python\nprint(pow(7, 222, 1000))\n```\n")
    assert step.observation == f"<output>\n{pow(7, 222, 1000)}\n</output>\n"
    assert (step.reward, step.done) == (0.0, False)
    assert step.info["exit_code"] == 0 and step.info["turns"] == 1
    step = env.step(f"The remainder is \\boxed{{{pow(7, 222, 1000)}}}.")
    assert (step.reward, step.done, step.observation) == (1.0, True, "")
    assert step.info["correct"] and step.info["turns"] == 2
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("\\boxed{1}")


def test_wrong_answer_and_no_action(isolated):
    env = PythonToolEnv("1+1?", "2", FAST)
    env.reset()
    step = env.step("Answer: 3")
    assert (step.reward, step.done, step.info["answer"]) == (0.0, True, "3")
    env.reset()
    step = env.step("I am not sure.")
    assert (step.reward, step.done) == (0.0, True)


def test_errors_and_hostile_code_become_observations(isolated):
    env = PythonToolEnv("1+1?", "2", FAST, max_turns=5, max_output_chars=200)
    env.reset()
    step = env.step("```python\n1 / 0\n```")
    assert "ZeroDivisionError: division by zero" in step.observation
    assert step.observation.rstrip().endswith("[exit code 1]\n</output>")
    step = env.step("```python\nwhile True:\n    pass\n```")
    assert "[killed: CPU time limit of 1 s exceeded]" in step.observation
    assert step.info["killed_by"] == "SIGXCPU" and not step.done
    step = env.step("```python\nprint('y' * 100_000)\n```")
    assert "characters cut" in step.observation and "[killed: output limit" in step.observation
    assert len(step.observation) < 400
    step = env.step("```python\nx = 1\n```")
    assert step.observation == "<output>\n[no output]\n</output>\n"
    step = env.step("\\boxed{2}")
    assert step.reward == 1.0


def test_turn_limit_truncates(isolated):
    env = PythonToolEnv("1+1?", "2", FAST, max_turns=2)
    env.reset()
    assert not env.step("```python\nprint(1)\n```").done
    step = env.step("```python\nprint(2)\n```")
    assert (step.reward, step.done, step.info["truncated"]) == (0.0, True, True)


def test_env_fails_closed(monkeypatch):
    monkeypatch.setattr(sandbox.isolation, "_verified", set())
    monkeypatch.setattr(sandbox.isolation.shutil, "which", lambda *a, **k: None)
    env = PythonToolEnv("1+1?", "2", FAST)
    env.reset()
    with pytest.raises(SandboxUnavailable, match="refusing to run model-generated code"):
        env.step("```python\nprint(1 + 1)\n```")
    assert env.step("\\boxed{2}").reward == 1.0  # answering needs no sandbox
