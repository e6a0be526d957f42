"""The one list of environments: `REGISTRY`, a name's `EnvSpec`.

An entry carries everything the rest of the code needs to know about an environment: how an
episode is made from a leased prompt row (`make_env`), where an action stops (`stop_token_ids`),
the experiment's rows and options (`rows`, `options`, from the config), whether the toy
`CharTokenizer` can write its prompts (`needs_tokenizer`), whether its reward depends on the
learner's step (`step_in_prompt`), its warm-start teacher (`teacher`), its own batch metrics
(`batch_metrics`) and what `make eval` prints about its episodes (`eval_notes`). The worker
(`rollout/worker.py`), the task (`train/tasks.py`), the warm start (`train/warm_start.py`,
`train/build.py`) and the learner (`train/loop.py`) read the entry; none of them names an
environment (`tests/envs/test_registry.py` checks that). Adding an
environment is one module and one `register(EnvSpec(...))` below: docs/environments.md.

Floors: `envs/` sits below `rollout/` and `train/` and imports neither, and so does this module;
it uses the text layer (`sao_jax/text`), which sits below it.
Two fields serve code of a higher floor, and hold only what is environment code:
  - `teacher`: the warm start (train/) trains on the teacher's transcripts; making them is
    environment code (a calculator teacher, the SWE expert playing real workspaces), and so is
    everything task-specific about them: what identifies them in the warm start's cache, how
    long their rows are, whether they are written in the chat template, whether their actions
    must fit the agent's. The entry holds those as data and callables (`Teacher`); the warm
    start knows no environment.
  - `batch_metrics` and `eval_notes` read the trajectories' `env_metadata` mappings, not
    `Trajectory` objects (rollout/).
Callables, not names looked up elsewhere, so that an entry is whole where it is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from sao_jax.envs import calculator, datasets, long_tail, python_tool, style_shift
from sao_jax.envs.base import Environment
from sao_jax.envs.swe import env as swe_env
from sao_jax.envs.swe import monitor as swe_monitor
from sao_jax.envs.swe import options as swe_options
from sao_jax.envs.swe import tasks as swe_tasks
from sao_jax.envs.swe import teacher as swe_teacher
from sao_jax.text import Tokenizer

Transcript = tuple[str, list[tuple[str, str]]]  # prompt text, [(action, observation), ...]


def _fit_the_transcripts(config) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Teacher:
    """What the supervised warm start (`train/warm_start.py`) imitates for an environment.

    Args:
      transcripts: `(config, train_rows, eval_rows, options, *, log) -> (key, load)`, the teacher
        of one experiment (`config`, its task's rows and options). `key` (JSON values)
        identifies its transcripts: it holds everything of the config that changes one of them
        (the calculator's problem size and guess rate, the SWE tasks and expert), and the warm
        start's cache key holds it; a teacher whose code changes what it writes changes its key
        (a version in it). `load()`, called on a cache miss only, gives `(train, heldout)`: each
        a list of `(prompt, [(action, observation), ...])` transcripts, or an endless stream of
        them, `seed -> Iterator` (a training stream is read from the warm start's seed, a
        held-out one from seed + 1, so that one stream can serve as both).
      length: `(config) -> int | None`, the tokens of the training rows (a stream's longer
        transcripts are left out); None: as long as the longest transcript, rounded up to 64
        (of a sample: every listed one, 256 of a stream's).
      chat: encode the transcripts in the run's tokenizer's chat template, as the agent loop
        builds an episode; False: `bos prompt (action observation)*` as plain text.
      fit_actions: the agent cuts an action at `config.env.max_action_tokens`, and the teacher's
        must fit: the warm start refuses a transcript with a longer action (leaves it out of a
        stream), since the policy would learn a reply it can never finish. False: the
        environment takes a cut action (style_shift judges a cut sentence).
    """

    transcripts: Callable[..., tuple[object, Callable[[], tuple]]]
    length: Callable[..., int | None] = _fit_the_transcripts
    chat: bool = False
    fit_actions: bool = False


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """One environment, as the worker, the task, the warm start and the learner need it.

    Args:
      name: `config.env.name` and the worker's `--env`.
      make_env: `(data, max_turns, options=...) -> Environment`: the episode of one leased
        prompt row (`data`, a row of `rows`), with the episode's turn limit and, by keyword, the
        environment's `options` (None or `{}` when it has none) and, for an entry with
        `step_in_prompt`, the `learner_step` its lease carries.
      stop_token_ids: `(tokenizer) -> tuple[int, ...]`: where an action ends.
      rows: `(config) -> (train_rows, eval_rows)`: the prompt rows of an experiment; a training
        row carries `index` (the running-mean slot) and `prompt_id`. Errors name the config
        field to fix.
      options: `(config) -> dict`, the environment's options (JSON-able: workers get them as
        `--env-options`); None: it has none (`{}`).
      needs_tokenizer: the toy `CharTokenizer` cannot write its prompts: an example directory of
        a tokenizer that can; the worker refuses to start without `--tokenizer`. None: any
        tokenizer will do.
      step_in_prompt: the reward depends on the learner's step: the worker passes `make_env`
        the step the lease carries (`LeasedPrompt.learner_step`, a typed field of the lease) as
        `learner_step=`; evaluations pass none (the environment's default).
      teacher: the warm start's teacher (`Teacher`); None: no warm start.
      batch_metrics: `(env_metadata of each trajectory) -> {name: value}`, logged with every
        learner step, and printed by `make eval` for the sampled held-out episodes; None: none.
      eval_notes: `(env_metadata of each held-out episode, in order) -> [line, ...]`, lines
        `make eval` prints about them (`notes`); None: none.
    """

    name: str
    make_env: Callable[[Mapping, int, Mapping | None], Environment]
    stop_token_ids: Callable[[Tokenizer], tuple[int, ...]]
    rows: Callable[..., tuple[list, list]]
    options: Callable[..., dict] | None = None
    needs_tokenizer: str | None = None
    step_in_prompt: bool = False
    teacher: Teacher | None = None
    batch_metrics: Callable[[Sequence[Mapping]], dict[str, float]] | None = None
    eval_notes: Callable[[Sequence[Mapping]], list[str]] | None = None


REGISTRY: dict[str, EnvSpec] = {}


def register(spec: EnvSpec) -> EnvSpec:
    """Adds `spec` to `REGISTRY`; a name registered twice is a ValueError."""
    if spec.name in REGISTRY:
        raise ValueError(f"environment {spec.name!r} is registered already.")
    REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> EnvSpec:
    """The entry of `name`; a ValueError listing the registered names if there is none."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown environment {name!r}; registered: {sorted(REGISTRY)}.") from None


def with_teacher() -> list[str]:
    """The names of the environments that have a warm-start teacher, sorted."""
    return sorted(name for name, spec in REGISTRY.items() if spec.teacher is not None)


register(EnvSpec(
    name="calculator",
    make_env=calculator.make_env,
    stop_token_ids=calculator.stop_token_ids,
    rows=calculator.rows,
    teacher=Teacher(transcripts=calculator.warm_start_teacher, length=calculator.sft_length),
))
register(EnvSpec(
    name="long_tail",
    make_env=long_tail.make_env,
    stop_token_ids=calculator.stop_token_ids,  # its observations are the calculator's
    rows=long_tail.rows,
))
register(EnvSpec(
    name="python_tool",
    make_env=python_tool.make_env,
    stop_token_ids=python_tool.stop_token_ids,
    rows=datasets.jsonl_rows,
    needs_tokenizer="experiments/data/tir/tokenizer",
))
register(EnvSpec(
    name="style_shift",
    make_env=style_shift.make_env,
    stop_token_ids=style_shift.stop_token_ids,
    rows=style_shift.rows,
    options=style_shift.options,
    step_in_prompt=True,
    teacher=Teacher(transcripts=style_shift.warm_start_teacher, length=style_shift.sft_length),
))
register(EnvSpec(
    name="swe",
    make_env=swe_options.make_env,
    stop_token_ids=swe_env.stop_token_ids,
    rows=swe_tasks.rows,
    options=swe_options.from_config,
    teacher=Teacher(transcripts=swe_teacher.warm_start_teacher, chat=True, fit_actions=True),
    batch_metrics=swe_env.batch_metrics,
    eval_notes=swe_monitor.eval_notes,  # the reward-hacking monitor's reasons
))

DEFAULT = "calculator"  # a worker's --env and a warm start's task when none is given
