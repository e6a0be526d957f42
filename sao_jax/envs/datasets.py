"""Prompt datasets on disk: one JSON object per line.

`read_jsonl` is strict, because a dataset error found mid-run costs a run: every non-blank line
must be a JSON object with the required fields, and any that is not is a ValueError naming the
file, the line and the field. Rows get their position as `"index"` and `"prompt_id"` (the same
number as a string), the id under which the learner leases the prompt and a trajectory names it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence


def read_jsonl(path: str | os.PathLike,
               required: Sequence[str] = ("prompt", "answer")) -> list[dict]:
    """The rows of a JSONL file, blank lines skipped.

    Args:
      path: the file.
      required: fields every row must have, each a string or a number (not null, not a list or
        object).

    Returns:
      One dict per row, in file order, with `"index"` (0, 1, ... over the rows, blank lines not
      counted) and `"prompt_id"` (`str(index)`) added.

    Raises:
      ValueError naming the file and line number: invalid JSON, a line that is not an object, a
      missing or invalid required field, or a row that already has "index" / "prompt_id".
    """
    path = os.fspath(path)
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno}).") from e
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a row must be a JSON object, got "
                                 f"{type(row).__name__}.")
            for field in required:
                if field not in row:
                    raise ValueError(f"{where}: missing field {field!r} (required: "
                                     f"{list(required)}).")
                value = row[field]
                if isinstance(value, bool) or not isinstance(value, str | int | float):
                    raise ValueError(f"{where}: field {field!r} must be a string or a number, "
                                     f"got {json.dumps(value)}.")
            for field in ("index", "prompt_id"):
                if field in row:
                    raise ValueError(f"{where}: field {field!r} is set by read_jsonl; rename it.")
            index = len(rows)
            rows.append({**row, "index": index, "prompt_id": str(index)})
    return rows


def jsonl_rows(config) -> tuple[list, list]:
    """The training rows of `config.env.train_path` and the first `config.env.num_eval_prompts`
    (0: all) of `config.env.eval_path`, each file `{"prompt": ..., "answer": ...}` rows (an
    environment's `rows` in its registry entry, `registry.py`)."""
    for field in ("train_path", "eval_path"):
        path = config.env[field]
        if not path or not os.path.exists(path):
            raise ValueError(f"config.env.{field} = {path!r}: give a JSONL file of "
                             "{\"prompt\": ..., \"answer\": ...} rows.")
    evals = read_jsonl(config.env.eval_path)[: config.env.num_eval_prompts or None]
    return read_jsonl(config.env.train_path), evals
