"""The one list of environments: `REGISTRY`, a name's `EnvSpec`.

An entry carries everything the rest of the code needs to know about an environment: how an
episode is made from a leased prompt row (`make_env`), where an action stops (`stop_token_ids`),
the experiment's rows and options (`rows`, `options`, from the config), whether the toy
`CharTokenizer` can write its prompts (`needs_tokenizer`), whether its reward depends on the
learner's step (`step_in_prompt`), its warm-start teacher (`teacher`), its own batch metrics
(`batch_metrics`) and what `make eval` prints about its episodes (`eval_notes`). The worker
(`rollout/worker.py`), the task (`train/tasks.py`), the warm start (`train/warm_start.py`,
`train/build.py`) and the learner (`train/learner.py`) read the entry; none of them names an
environment (`tests/envs/test_registry.py` checks that). Adding an
environment is one module and one `register(EnvSpec(...))` below: docs/environments.md.

Floors: `envs/` sits below `rollout/` and `train/` and imports neither, and so does this module.
Two fields serve code of a higher floor, and hold only what is environment code:
  - `teacher`: the warm start (train/) trains on the teacher's transcripts; making them is
    environment code (a calculator teacher, the SWE expert playing real workspaces), so the
    entry holds those callables (`Teacher`). The one object of a higher floor a teacher wants,
    the chat template's deltas (`rollout.chat.ChatDeltas`) to encode its transcripts as the agent
    loop builds an episode, is a flag (`Teacher.chat`) that train/ turns into the object.
  - `batch_metrics` and `eval_notes` read the trajectories' `env_metadata` mappings, not
    `Trajectory` objects (rollout/).
Callables, not names looked up elsewhere, so that an entry is whole where it is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence

from sao_jax.envs import calculator, datasets, long_tail, python_tool, style_shift
from sao_jax.envs.base import Environment, Tokenizer
from sao_jax.envs.swe import env as swe_env
from sao_jax.envs.swe import monitor as swe_monitor
from sao_jax.envs.swe import options as swe_options
from sao_jax.envs.swe import tasks as swe_tasks
from sao_jax.envs.swe import teacher as swe_teacher

Transcript = tuple[str, list[tuple[str, str]]]  # prompt text, [(action, observation), ...]


def _no_settings(problems) -> dict:
    return {}


def _rl_rows(problems) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Teacher:
    """What the supervised warm start (`train/warm_start.py`) imitates for an environment.

    Exactly one of:
      transcripts: `(seed, guess_rate, problems) -> Iterator[Transcript]`, endless transcripts in
        the toy vocabulary (`CharTokenizer`), made as the warm start trains. `problems` is the
        calculator's problem size (`calculator.problems_of(config)`); a teacher that has no use
        for it or for `guess_rate` ignores them.
      fixed: `(train_rows, eval_rows, options, *, max_turns, log) -> (key, load)`, a fixed set
        made from the task's rows in the run's tokenizer: `key` identifies it in the warm start's
        cache, `load()` gives the `(train, heldout)` transcript lists, called on a cache miss
        only.

    Args:
      chat: encode the transcripts in the tokenizer's chat template, as the agent loop builds an
        episode (`fixed` teachers only).
      names_task: the warm start's cache key holds the environment's name (False for the
        calculator, whose cached warm starts predate other teachers).
      settings: `(problems) -> dict`, what else the teacher adds to the cache key.
      sft_length: `(problems) -> int | None`, the length of a `transcripts` teacher's training
        rows; None: the rows RL has (`rollout.engine_max_seq_len + 1`).
    """

    transcripts: Callable[..., Iterator[Transcript]] | None = None
    fixed: Callable[..., tuple[str, Callable[[], tuple[list, list]]]] | None = None
    chat: bool = False
    names_task: bool = True
    settings: Callable[..., dict] = _no_settings
    sft_length: Callable[..., int | None] = _rl_rows

    def __post_init__(self):
        if (self.transcripts is None) == (self.fixed is None):
            raise ValueError("Teacher: give exactly one of transcripts and fixed.")
        if self.chat and self.fixed is None:
            raise ValueError("Teacher.chat applies to a fixed teacher (in the run's tokenizer); "
                             "transcripts are in the toy vocabulary.")


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """One environment, as the worker, the task, the warm start and the learner need it.

    Args:
      name: `config.env.name` and the worker's `--env`.
      make_env: `(data, max_turns, options=...) -> Environment`: the episode of one leased
        prompt row (`data`, a row of `rows`, plus what the learner adds, e.g. `learner_step`),
        with the episode's turn limit and, by keyword, the environment's `options` (None or `{}`
        when it has none).
      stop_token_ids: `(tokenizer) -> tuple[int, ...]`: where an action ends.
      rows: `(config) -> (train_rows, eval_rows)`: the prompt rows of an experiment; a training
        row carries `index` (the running-mean slot) and `prompt_id`. Errors name the config
        field to fix.
      options: `(config) -> dict`, the environment's options (JSON-able: workers get them as
        `--env-options`); None: it has none (`{}`).
      needs_tokenizer: the toy `CharTokenizer` cannot write its prompts: an example directory of
        a tokenizer that can; the worker refuses to start without `--tokenizer`. None: any
        tokenizer will do.
      step_in_prompt: the reward depends on the learner's step, so the learner writes
        `learner_step` into every row it leases.
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
    teacher=Teacher(transcripts=calculator.teacher_stream, names_task=False,
                    settings=calculator.teacher_settings, sft_length=calculator.sft_length),
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
    teacher=Teacher(transcripts=style_shift.teacher_stream,
                    settings=style_shift.teacher_settings),
))
register(EnvSpec(
    name="swe",
    make_env=swe_options.make_env,
    stop_token_ids=swe_env.stop_token_ids,
    rows=swe_tasks.rows,
    options=swe_options.from_config,
    # The calculator's problem size is in the key when it is not the default, as it was before
    # this registry (it does not change the transcripts; kept so that built warm starts are found).
    teacher=Teacher(fixed=swe_teacher.transcripts, chat=True,
                    settings=calculator.teacher_settings),
    batch_metrics=swe_env.batch_metrics,
    eval_notes=swe_monitor.eval_notes,  # the reward-hacking monitor's reasons
))

DEFAULT = "calculator"  # a worker's --env and a warm start's task when none is given
