"""What an experiment trains on: prompt rows for training and evaluation, environment, tokenizer.

A task turns `config.env` into rows (mappings leased to workers as prompt data), an environment
factory and stop tokens (`rollout.worker.ENVIRONMENTS`), the environment's options (the same
mapping workers get as `--env-options`), and a tokenizer. Training rows carry `index` (the
running-mean slot) and `prompt_id`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from collections.abc import Callable, Mapping, Sequence

from sao_jax.envs import calculator, long_tail, style_shift
from sao_jax.envs.datasets import read_jsonl
from sao_jax.rollout.agent import AgentConfig
from sao_jax.rollout.chat import ChatDeltas
from sao_jax.rollout.worker import ENVIRONMENTS, load_tokenizer, prompt_renderer


@dataclasses.dataclass(frozen=True)
class Task:
    env: str
    train_rows: Sequence[Mapping]
    eval_rows: Sequence[Mapping]
    tokenizer_path: str | None  # None: the toy CharTokenizer
    tokenizer: object
    make_env: Callable
    render_prompt: Callable[[str], list[int]]
    agent: AgentConfig  # training episodes (temperature of config.rollout)
    step_in_prompts: bool = False  # the reward depends on the learner step (style_shift)
    env_options: Mapping = dataclasses.field(default_factory=dict)  # JSON-able, for workers
    chat: ChatDeltas | None = None  # observations as chat-template deltas (as the workers do)

    def eval_agent(self, temperature: float) -> AgentConfig:
        return dataclasses.replace(self.agent, temperature=temperature)


def calculator_problems(config) -> calculator.Problems:
    """The calculator's problem size (`config.env.num_ops`, `config.env.max_operand`)."""
    return calculator.Problems(config.env.num_ops, config.env.max_operand)


def _calculator_rows(config) -> tuple[list, list]:
    n = config.env.num_train_prompts
    if n < 1:
        raise ValueError("config.env.num_train_prompts must be >= 1 for the calculator task.")
    size = calculator_problems(config)
    stream = calculator.problem_stream(config.seed, size.num_ops, size.max_operand)
    train = [{"index": i, "prompt_id": str(i), "expression": p.expression, "answer": p.answer}
             for i, p in ((i, next(stream)) for i in range(n))]
    held = calculator.heldout_problems(config.env.num_eval_prompts, size.num_ops,
                                       size.max_operand, exclude_seed=config.seed,
                                       exclude_count=n)
    evals = [{"expression": p.expression, "answer": p.answer} for p in held]
    return train, evals


def _jsonl_rows(config) -> tuple[list, list]:
    for field in ("train_path", "eval_path"):
        path = config.env[field]
        if not path or not os.path.exists(path):
            raise ValueError(f"config.env.{field} = {path!r}: give a JSONL file of "
                             "{\"prompt\": ..., \"answer\": ...} rows.")
    evals = read_jsonl(config.env.eval_path)[: config.env.num_eval_prompts or None]
    return read_jsonl(config.env.train_path), evals


def _style_rows(config) -> tuple[list, list]:
    import random

    rng = random.Random(config.seed)
    n = config.env.num_train_prompts or 512
    train = [{"index": i, "prompt_id": str(i), "topic": style_shift.random_topic(rng)}
             for i in range(n)]
    evals = [{"topic": style_shift.random_topic(rng)}
             for _ in range(config.env.num_eval_prompts)]
    return train, evals


def _long_tail_rows(config) -> tuple[list, list]:
    """Turn counts drawn log-normal (`long_tail.turn_counts`), clamped to `env.max_turns` and to
    what fits in `env.max_response_tokens`; eval rows from their own seed."""
    env = config.env
    max_turns = min(env.max_turns, long_tail.max_turns_within(env.max_response_tokens,
                                                              env.max_action_tokens))
    n = env.num_train_prompts or 1024
    train = [{"index": i, "prompt_id": str(i), "turns": int(t)}
             for i, t in enumerate(long_tail.turn_counts(n, seed=config.seed,
                                                         max_turns=max_turns))]
    evals = [{"turns": int(t)} for t in long_tail.turn_counts(
        env.num_eval_prompts, seed=config.seed + 1_000_003, max_turns=max_turns)]
    return train, evals


def _swe_rows(config) -> tuple[list, list]:
    """SWE-bench instances from `env.train_path` (and `env.eval_path`; when that is empty, the
    last `env.num_eval_prompts` tasks of the training file are held out). Each row carries the
    whole task: the worker that leases it builds the workspace and grades it."""
    from sao_jax.envs.swe.tasks import TaskError, load_tasks

    env = config.env
    if not env.train_path:
        raise ValueError("config.env.train_path is empty: give a JSONL file of SWE-bench "
                         "instances (the bundled set: experiments/data/swe_mini/tasks.jsonl).")
    try:
        train = load_tasks(env.train_path)
        if env.eval_path:
            evals = load_tasks(env.eval_path)[: env.num_eval_prompts or None]
        else:
            held = min(env.num_eval_prompts, len(train) - 1)
            train, evals = train[: len(train) - held], train[len(train) - held:]
    except (FileNotFoundError, TaskError) as e:
        raise ValueError(f"config.env.train_path / eval_path: {e}") from None
    if not evals:
        raise ValueError("config.env.num_eval_prompts must be >= 1 for the swe task.")
    rows = [{"index": i, "prompt_id": str(i), "task": t.to_row()} for i, t in enumerate(train)]
    return rows, [{"task": t.to_row()} for t in evals]


def _swe_options(config) -> dict:
    """`env.swe` as the worker's `--env-options`; fails fast where the backend cannot run."""
    swe = config.env.swe
    backend = swe.backend
    if backend in ("podman", "docker") and shutil.which(backend) is None:
        package = {"podman": "podman", "docker": "docker.io"}[backend]
        raise ValueError(f"config.env.swe.backend = {backend!r}, but `{backend}` is not on PATH: "
                         f"install it (Debian: apt-get install {package}) or use "
                         "--config.env.swe.backend=namespace.")
    if backend == "namespace":
        from sao_jax.envs.sandbox import SandboxUnavailable, check_isolation

        try:
            check_isolation()
        except SandboxUnavailable as e:
            raise ValueError(f"config.env.swe.backend = 'namespace': {e}") from None
    elif backend not in ("podman", "docker"):
        raise ValueError(f"config.env.swe.backend must be namespace, podman or docker, "
                         f"got {backend!r}.")
    return swe.to_dict()


_ROWS = {"calculator": _calculator_rows, "long_tail": _long_tail_rows,
         "python_tool": _jsonl_rows, "style_shift": _style_rows, "swe": _swe_rows}
_OPTIONS = {"swe": _swe_options}


def make_task(config) -> Task:
    """The task of `config.env`; errors name the field to fix."""
    name = config.env.name
    if name not in _ROWS:
        raise ValueError(f"config.env.name = {name!r}: choose one of {sorted(_ROWS)}.")
    train, evals = _ROWS[name](config)
    options = _OPTIONS[name](config) if name in _OPTIONS else {}
    tokenizer_path = config.env.tokenizer or None
    tokenizer = load_tokenizer(tokenizer_path)
    make_env, stops = ENVIRONMENTS[name]
    agent = AgentConfig(max_turns=config.env.max_turns,
                        max_response_tokens=config.env.max_response_tokens,
                        max_action_tokens=config.env.max_action_tokens,
                        max_context_tokens=config.rollout.engine_max_seq_len,
                        temperature=config.rollout.temperature,
                        stop_token_ids=tuple(stops(tokenizer)))
    return Task(env=name, train_rows=train, eval_rows=evals, tokenizer_path=tokenizer_path,
                tokenizer=tokenizer, make_env=functools.partial(make_env, options=options),
                render_prompt=prompt_renderer(tokenizer), agent=agent,
                step_in_prompts=name == "style_shift", env_options=options,
                chat=ChatDeltas(tokenizer) if getattr(tokenizer, "chat_template", None) else None)
