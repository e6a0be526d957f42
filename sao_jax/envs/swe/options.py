"""The `swe` environment's options as an experiment gives them (`config.env.swe`, passed to rollout
workers as `--env-options` JSON, `from_config`) turned into the env's and the grader's settings,
and an episode from a prompt row and the options (`make_env`)."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Mapping

from sao_jax.envs.swe.env import SWEEnv, SWEEnvConfig
from sao_jax.envs.swe.expert import FIXES, READS
from sao_jax.envs.swe.grading import Grader
from sao_jax.envs.swe.tasks import SWETask
from sao_jax.envs.swe.tiny import KINDS
from sao_jax.envs.swe.workspace import WorkspaceConfig

# option -> (SWEEnvConfig field); the rest: WorkspaceConfig fields, grading's, or the warm
# start teacher's (`teacher.py`: which expert, how often it makes a mistake, how it reads)
_ENV_FIELDS = ("command_timeout", "output_chars", "prompt_template")
_GRADER_FIELDS = ("grade_timeout", "grade_concurrency")
TEACHER_FIELDS = ("expert", "expert_mistakes", "expert_tasks", "expert_read", "expert_fix",
                  "expert_decoy", "expert_mistake_kinds")
EXPERTS = ("patch", "edit")
EXPERT_TASKS = ("rows", "swe_tiny")
DECOYS = ("random", "first")


def mistake_kinds(options: Mapping | None) -> tuple[str, ...]:
    """The mutation kinds the edit expert errs on (`expert_mistake_kinds`, comma-separated;
    empty: every kind).

    Raises:
      ValueError naming the option and the kinds there are.
    """
    text = dict(options or {}).get("expert_mistake_kinds", "") or ""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"config.env.swe.expert_mistake_kinds names {unknown}: give a "
                         f"comma-separated list of {', '.join(KINDS)}, or '' for every kind.")
    return kinds


def env_config(options: Mapping | None, max_turns: int) -> SWEEnvConfig:
    """An `SWEEnvConfig` from the options (missing ones keep their defaults; an empty
    `prompt_template` means the env's own).

    Raises:
      ValueError naming the option that no setting takes.
    """
    options = dict(options or {})
    workspace_fields = set(WorkspaceConfig.__dataclass_fields__)
    known = {*_ENV_FIELDS, *_GRADER_FIELDS, *TEACHER_FIELDS, *workspace_fields}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"unknown swe option(s) {sorted(unknown)}; known: {sorted(known)}.")
    env = {k: options[k] for k in _ENV_FIELDS if k in options and options[k] not in ("", None)}
    workspace = {k: tuple(v) if isinstance(v, list) else v
                 for k, v in options.items() if k in workspace_fields}
    return SWEEnvConfig(max_turns=max_turns, workspace=WorkspaceConfig(**workspace), **env)


def grader(options: Mapping | None) -> Grader:
    """The process's grader for these options: one per distinct set, so that its concurrency
    limit holds across every episode of the worker."""
    return _grader(json.dumps(dict(options or {}), sort_keys=True))


@functools.lru_cache(maxsize=8)
def _grader(options_json: str) -> Grader:
    options = json.loads(options_json)
    config = env_config(options, max_turns=1).workspace
    kwargs = {}
    if "grade_timeout" in options:
        kwargs["timeout"] = options["grade_timeout"]
    return Grader(config, max_concurrent=options.get("grade_concurrency", 2), **kwargs)


def from_config(config) -> dict:
    """`config.env.swe` as the worker's `--env-options`; fails fast where the backend cannot
    run."""
    swe = config.env.swe
    if swe.get("expert", "patch") not in EXPERTS:
        raise ValueError(f"config.env.swe.expert must be one of {EXPERTS}, got {swe.expert!r}.")
    if swe.get("expert_tasks", "rows") not in EXPERT_TASKS:
        raise ValueError(f"config.env.swe.expert_tasks must be one of {EXPERT_TASKS}, got "
                         f"{swe.expert_tasks!r}.")
    if swe.get("expert_tasks", "rows") == "swe_tiny" and swe.get("expert") != "edit":
        raise ValueError("config.env.swe.expert_tasks = 'swe_tiny' plays the one-line-edit "
                         "expert: set config.env.swe.expert = 'edit'.")
    if swe.get("expert_read", "cat") not in READS:
        raise ValueError(f"config.env.swe.expert_read (the edit expert's first command) must be "
                         f"one of {sorted(READS)}, got {swe.expert_read!r}.")
    if swe.get("expert_fix", "sub") not in FIXES:
        raise ValueError(f"config.env.swe.expert_fix (the edit expert's sed command) must be one "
                         f"of {FIXES}, got {swe.expert_fix!r}.")
    if swe.get("expert_decoy", "random") not in DECOYS:
        raise ValueError(f"config.env.swe.expert_decoy (which wrong fix the edit expert writes) "
                         f"must be one of {DECOYS}, got {swe.expert_decoy!r}.")
    if not 0.0 <= swe.get("expert_mistakes", 0.0) < 1.0:
        raise ValueError("config.env.swe.expert_mistakes (the share of the warm start's "
                         "transcripts that make a wrong fix) must be in [0, 1), got "
                         f"{swe.expert_mistakes!r}.")
    mistake_kinds(swe)
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


def make_env(data: Mapping, max_turns: int, options: Mapping | None = None) -> SWEEnv:
    """An SWE episode on the task of a prompt row (`tasks.rows`), with the run's workspace
    backend and the process's one grader for these options (`grader`)."""
    return SWEEnv(SWETask.from_row(data["task"]), env_config(options, max_turns), grader(options))
