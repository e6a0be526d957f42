"""The calculator task: parser, teacher transcripts (guesses among them), episodes, tokenizer,
held-out split."""

import random

import pytest

from sao_jax.envs import calculator
from sao_jax.envs.calculator import (
    CalculatorEnv,
    Problem,
    evaluate,
    heldout_problems,
    problem_stream,
    random_problem,
    stop_token_ids,
    teacher_transcript,
)
from sao_jax.text import CharTokenizer


def test_evaluate_matches_python_on_generated_expressions():
    rng = random.Random(0)
    for _ in range(500):
        p = random_problem(rng, num_ops=rng.randint(1, 4), max_operand=99)
        assert evaluate(p.expression) == eval(p.expression)  # noqa: S307 - our own strings
    assert evaluate("10--5") == 15 and evaluate("-(2+3)*4") == -20
    for bad in ("2+", "(3", "2/3", "import os", "1" * 13):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_teacher_transcripts_solve_every_problem_through_the_env():
    for problem in heldout_problems(100, num_ops=3):
        env = CalculatorEnv(problem)
        env.reset()
        turns = teacher_transcript(problem)
        for action, observation in turns[:-1]:
            result = env.step(action)
            assert result.observation == observation and not result.done
        final = env.step(turns[-1][0])
        assert final.done and final.reward == 1.0


def test_episode_outcomes():
    problem = Problem("(12+7)*3", 57)
    env = CalculatorEnv(problem, max_turns=2)
    assert env.reset() == "(12+7)*3=?\n"
    assert env.step("<calc>12+7</calc>").observation == "<res>19</res>\n"
    assert env.step("<calc>19*3</calc>").done  # the turn limit
    env.reset()
    assert env.step("<calc>12+x</calc>").observation == "<res>error</res>\n"
    assert env.step("<ans>56</ans>").reward == 0.0
    for malformed in ("--57", "-", "", "5-7", "+57", "57.0", "５７"):  # wrong, never a crash
        env.reset()
        result = env.step(f"<ans>{malformed}</ans>")
        assert result.done and result.reward == 0.0, malformed
    env.reset()
    assert env.step("<ans>57</ans>").reward == 1.0
    env.reset()
    result = env.step("no idea")
    assert result.done and result.reward == 0.0


def test_tokenizer_round_trip_and_stops():
    tok = CharTokenizer()
    assert tok.vocab_size <= 64
    problem = random_problem(random.Random(3))
    text = problem.prompt + "".join(a + o for a, o in teacher_transcript(problem))
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("<calc>1+2</calc>")[0] == tok.id("<calc>")
    assert tok.id("</calc>") in stop_token_ids(tok)
    with pytest.raises(ValueError, match="not in the toy vocabulary"):
        tok.encode("A")


def test_heldout_set_is_disjoint_from_the_training_stream():
    stream = problem_stream(seed=7)
    train = {next(stream).expression for _ in range(2000)}
    heldout = heldout_problems(200, exclude_seed=7, exclude_count=2000)
    assert len(heldout) == 200 and not train & {p.expression for p in heldout}


def test_no_model_output_crashes_the_environment():
    """The worker runs env.step on whatever the policy samples: every string of the task's
    characters is scored or answered, never raised on (a "--9" answer once stopped a run)."""
    tok = CharTokenizer()
    rng = random.Random(0)
    chars = [c for c in tok.vocab if len(c) == 1]
    for i in range(2000):  # mostly digits and operators, where parsing can go wrong
        body = "".join(rng.choice("-+*()0123456789" if rng.random() < 0.8 else chars)
                       for _ in range(rng.randint(0, 6)))
        action = ("<ans>{}</ans>", "<calc>{}</calc>", "{}")[i % 3].format(body)
        env = CalculatorEnv(Problem("(12+7)*3", 57), max_turns=3)
        env.reset()
        result = env.step(action)
        assert result.reward in (0.0, 1.0)


def test_the_problem_size_comes_from_the_config_and_reaches_the_teacher():
    import itertools

    from experiments import chain
    from sao_jax.envs.calculator import Problems, problems_of, warm_start_teacher
    from sao_jax.train.tasks import make_task

    config = chain.get_config()
    assert problems_of(config) == Problems(num_ops=4, max_operand=30)
    config.env.num_train_prompts, config.env.num_eval_prompts = 16, 8
    task = make_task(config)
    for row in [*task.train_rows, *task.eval_rows]:  # four operations, so four tool calls
        assert len(teacher_transcript(Problem(row["expression"], row["answer"]))) == 5
    key, load = warm_start_teacher(config)
    assert key == {"guess_rate": 0.5, "problems": {"num_ops": 4, "max_operand": 30}}
    train, heldout = load()
    for _, turns in itertools.islice(train(0), 20):
        assert len(turns) in (5, 1)  # four tool calls and the answer, or a guess
    for _, turns in itertools.islice(calculator.teacher_stream(0, 0.0, Problems(3)), 20):
        assert len(turns) == 4
    with pytest.raises(ValueError, match="config.env.num_ops must be in"):
        Problems(num_ops=0)
    with pytest.raises(ValueError, match="config.env.max_operand"):
        Problems(max_operand=0)


def test_guess_transcripts_answer_at_once_and_wrongly():
    rng = random.Random(0)
    for problem in calculator.heldout_problems(50):
        ((action, observation),) = calculator.guess_transcript(problem, rng)
        given = int(action.removeprefix("<ans>").removesuffix("</ans>"))
        assert observation == "" and 1 <= abs(given - problem.answer) <= 9


def test_the_teacher_guesses_at_the_given_rate():
    import itertools

    tok = CharTokenizer()
    firsts = [turns[0][0] for _, turns in
              itertools.islice(calculator.teacher_stream(0, guess_rate=0.75), 2000)]
    guessed = sum(first.startswith("<ans>") for first in firsts) / len(firsts)
    assert abs(guessed - 0.75) < 0.03
    assert {tok.encode(first)[0] for first in firsts} == {tok.id("<ans>"), tok.id("<calc>")}
