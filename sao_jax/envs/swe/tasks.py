"""SWE-bench task instances, as the published dataset files write them.

One JSON object per line with SWE-bench's fields: `instance_id, repo, base_commit,
problem_statement, patch, test_patch, FAIL_TO_PASS, PASS_TO_PASS, version,
environment_setup_commit`. FAIL_TO_PASS / PASS_TO_PASS are lists of test names, or JSON strings of
such lists (as in SWE-bench's own files). SWE-smith's exports have only `instance_id, repo, patch,
FAIL_TO_PASS, PASS_TO_PASS, image_name, problem_statement`: a missing `base_commit`, `test_patch`,
`version` or `environment_setup_commit` is "" (no checkout: the workspace starts as its image or
snapshot holds the repository; no test patch), and `image_name` is read as `image`. (SWE-smith
keeps each task's buggy code on a branch named after the instance: give it as `base_commit` in a
`workspace` snapshot, or bake it into the image.) Optional fields: `image` (a container image of
the task), `workspace` (a local snapshot of the repository: a directory, a git repository or a
`.bundle`; a relative path is read from the JSONL file's folder), `test_cmd` (the command that
runs the tests, in the repository's root), `log_parser` (`pytest` | `unittest`, how its output is
read). Other fields (SWE-Gym's, SWE-smith's, `hints_text`, `created_at`, ...) are kept in `extra`.
`load_tasks(path)` reads a file and fails on the first bad row with its line number and field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

LOG_PARSERS = ("pytest", "unittest")
REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch",
            "FAIL_TO_PASS", "PASS_TO_PASS", "version", "environment_setup_commit")
DEFAULT_EMPTY = ("base_commit", "test_patch", "version", "environment_setup_commit")  # SWE-smith
OPTIONAL = ("image", "workspace", "test_cmd", "log_parser")
ALIASES = {"image_name": "image"}  # SWE-smith's name


class TaskError(ValueError):
    """A task row that does not follow the schema; the message names the line and the field."""


@dataclasses.dataclass(frozen=True)
class SWETask:
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str  # the gold patch (source files only)
    test_patch: str  # the tests that check it, applied before grading
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    version: str
    environment_setup_commit: str
    image: str | None = None
    workspace: str | None = None
    test_cmd: str | None = None
    log_parser: str = "pytest"
    extra: Mapping = dataclasses.field(default_factory=dict)

    @classmethod
    def from_row(cls, row: Mapping, base_dir: str = ".") -> SWETask:
        """A task from one decoded JSON row; raises `TaskError` naming the bad field."""
        if not isinstance(row, Mapping):
            raise TaskError(f"a task must be a JSON object, got {type(row).__name__}")
        row = {**{f: "" for f in DEFAULT_EMPTY}, **row}
        for alias, name in ALIASES.items():
            if alias in row and name not in row:
                row[name] = row.pop(alias)
        missing = [f for f in REQUIRED if f not in row]
        if missing:
            raise TaskError(f"missing field(s) {', '.join(missing)}")
        for name in REQUIRED:
            if name in ("FAIL_TO_PASS", "PASS_TO_PASS"):
                continue
            value = row[name]
            if name == "version" and isinstance(value, int | float) and not isinstance(value,
                                                                                       bool):
                continue  # some exports write 0.12 as a number
            if not isinstance(value, str):
                raise TaskError(f"field {name} must be a string, got {type(value).__name__}")
        if not row["instance_id"].strip():
            raise TaskError("field instance_id is empty")
        tests = {name: _test_list(row[name], name) for name in ("FAIL_TO_PASS", "PASS_TO_PASS")}
        if not tests["FAIL_TO_PASS"]:
            raise TaskError("field FAIL_TO_PASS is empty: nothing would show the fix")
        optional = {}
        for name in OPTIONAL:
            value = row.get(name)
            if value is None or value == "":
                continue
            if not isinstance(value, str):
                raise TaskError(f"field {name} must be a string, got {type(value).__name__}")
            optional[name] = value
        if optional.get("log_parser", "pytest") not in LOG_PARSERS:
            raise TaskError(f"field log_parser must be one of {LOG_PARSERS}, "
                            f"got {optional['log_parser']!r}")
        if "workspace" in optional and not os.path.isabs(optional["workspace"]):
            optional["workspace"] = os.path.normpath(os.path.join(base_dir,
                                                                  optional["workspace"]))
        extra = {k: v for k, v in row.items() if k not in REQUIRED and k not in OPTIONAL}
        return cls(instance_id=row["instance_id"], repo=row["repo"],
                   base_commit=row["base_commit"], problem_statement=row["problem_statement"],
                   patch=row["patch"], test_patch=row["test_patch"],
                   fail_to_pass=tests["FAIL_TO_PASS"], pass_to_pass=tests["PASS_TO_PASS"],
                   version=str(row["version"]),
                   environment_setup_commit=row["environment_setup_commit"], extra=extra,
                   **optional)

    def to_row(self) -> dict:
        """The task as a JSON row that `from_row` reads back (test lists as lists)."""
        row = {name: getattr(self, name) for name in ("instance_id", "repo", "base_commit",
                                                      "problem_statement", "patch",
                                                      "test_patch", "version",
                                                      "environment_setup_commit")}
        row["FAIL_TO_PASS"], row["PASS_TO_PASS"] = list(self.fail_to_pass), list(self.pass_to_pass)
        for name in OPTIONAL:
            if getattr(self, name) is not None:
                row[name] = getattr(self, name)
        return {**self.extra, **row}


def _test_list(value, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise TaskError(f"field {name} is a string but not a JSON list of test names: "
                            f"{e}") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise TaskError(f"field {name} must be a list of test names (or a JSON string of one)")
    return tuple(value)


def load_tasks(path: str) -> list[SWETask]:
    """Every task of the JSONL file `path` (blank lines skipped).

    Raises:
      TaskError: `path:LINE: ...` for the first row that is not JSON or not a valid task, or a
        repeated instance_id; `FileNotFoundError` when the file is missing.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SWE task file {path!r} not found: give a JSONL file of "
                                "SWE-bench instances (experiments/data/swe_mini/tasks.jsonl is "
                                "the bundled set).")
    base_dir = os.path.dirname(os.path.abspath(path))
    tasks, seen = [], {}
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskError(f"{path}:{number}: not UTF-8 (byte {e.start} of the line: "
                                f"{e.reason})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as e:  # bad JSON, huge integers, deep nesting
                raise TaskError(f"{path}:{number}: not a JSON object: "
                                f"{type(e).__name__}: {str(e)[:200]}") from None
            try:
                task = SWETask.from_row(row, base_dir)
            except TaskError as e:
                raise TaskError(f"{path}:{number}: {e}") from None
            if task.instance_id in seen:
                raise TaskError(f"{path}:{number}: instance_id {task.instance_id!r} repeats "
                                f"line {seen[task.instance_id]}")
            seen[task.instance_id] = number
            tasks.append(task)
    if not tasks:
        raise TaskError(f"{path}: no tasks in the file")
    return tasks


def rows(config) -> tuple[list, list]:
    """SWE-bench instances from `config.env.train_path` (and `env.eval_path`; when that is empty,
    the last `env.num_eval_prompts` tasks of the training file are held out). Each row carries
    the whole task: the worker that leases it builds the workspace and grades it."""
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
    train_rows = [{"index": i, "prompt_id": str(i), "task": t.to_row()}
                  for i, t in enumerate(train)]
    return train_rows, [{"task": t.to_row()} for t in evals]
