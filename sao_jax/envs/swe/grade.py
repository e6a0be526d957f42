"""Grade predictions on SWE tasks, as SWE-bench's harness does, on this project's workspaces.

    python -m sao_jax.envs.swe.grade --tasks experiments/data/swe_mini/tasks.jsonl \\
        --predictions preds.jsonl --backend namespace --out report.json [--workers 2] \\
        [--instance-ids ID ...] [--timeout 1800] [--image-template T] [--log-dir DIR] \\
        [--skipped-p2p-passes]

`--predictions gold` grades every task's gold patch (SWE-bench's harness takes `gold` so too),
`--predictions empty` the empty patch: together, a check that a task set is sound.
A prediction is one JSON object per line (or a .json file holding a list of them, or an object
of them keyed by instance_id), as SWE-bench's harness takes them:
`{"instance_id": ..., "model_name_or_path": ..., "model_patch": ...}`; a null or empty
model_patch is the empty patch. Every prediction whose instance is selected is graded by
`grading.grade` in a fresh workspace, `--workers` at a time; unlike SWE-bench's harness, empty
patches are graded too (an empty patch that resolves its task means the task is broken).

The report (`--out`, JSON) has SWE-bench's totals and id lists (`total_instances`: the selected
tasks, `submitted_instances`, `completed_instances`: graded to a verdict, `resolved_instances`,
`unresolved_instances` (rejected ones included), `empty_patch_instances`, `error_instances`) plus
`rejected_ids` (patches refused for touching tests), `instances` (per instance: status, reason,
fail_to_pass and pass_to_pass as [passed, listed], test_exit_code, seconds, empty_patch),
`backend` and `seconds_total`. Unlike SWE-bench's harness, a model patch that does not apply is
"unresolved" (the model's failure), not an error: errors are the grader's own failures (no
workspace, a test_patch that does not apply, a backend that broke). One progress line per
instance goes to stderr, and one summary line to stdout at the end.

Exit status: 0 when grading ran, whatever the verdicts; 2 on bad input (a task or prediction
file that does not parse, an unknown instance id), with the line and field named.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
from collections.abc import Sequence

from sao_jax.envs.swe import grading
from sao_jax.envs.swe.tasks import SWETask, TaskError, load_tasks
from sao_jax.envs.swe.workspace import BACKENDS, WorkspaceConfig


class InputError(ValueError):
    """Bad command-line input; the message names the file, line and field."""


def load_predictions(path: str) -> dict[str, dict]:
    """instance_id -> prediction from a JSONL file (or a .json list / dict of predictions).

    Raises:
      InputError: `path:LINE: ...` naming the bad field, or a repeated instance_id.
    """
    if not os.path.isfile(path):
        raise InputError(f"predictions file {path!r} not found")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise InputError(f"{path}:{line}: not UTF-8 (byte {e.start}: {e.reason})") from None
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise InputError(f"{path}: not JSON: {e}") from None
        rows = list(data.values()) if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise InputError(f"{path}: a .json file must hold a list or an object of "
                             "predictions")
        numbered = [(f"item {k}", row) for k, row in enumerate(rows)]
    else:
        numbered = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                numbered.append((f"line {number}", json.loads(line)))
            except (ValueError, RecursionError) as e:
                raise InputError(f"{path}:{number}: not a JSON object: {e}") from None
    predictions: dict[str, dict] = {}
    where_seen: dict[str, str] = {}
    for where, row in numbered:
        if not isinstance(row, dict):
            raise InputError(f"{path}: {where}: a prediction must be a JSON object, got "
                             f"{type(row).__name__}")
        for field in ("instance_id", "model_name_or_path"):
            if not isinstance(row.get(field), str) or not row[field].strip():
                raise InputError(f"{path}: {where}: field {field} must be a non-empty string, "
                                 f"got {row.get(field)!r}")
        patch = row.get("model_patch")
        if patch is not None and not isinstance(patch, str):
            raise InputError(f"{path}: {where}: field model_patch must be a string or null, got "
                             f"{type(patch).__name__}")
        instance_id = row["instance_id"]
        if instance_id in predictions:
            raise InputError(f"{path}: {where}: instance_id {instance_id!r} repeats "
                             f"{where_seen[instance_id]}")
        predictions[instance_id] = {**row, "model_patch": patch or ""}
        where_seen[instance_id] = where
    if not predictions:
        raise InputError(f"{path}: no predictions in the file")
    return predictions


def select(tasks: Sequence[SWETask], predictions: dict[str, dict],
           instance_ids: Sequence[str] | None) -> tuple[list[SWETask], dict[str, dict]]:
    """The tasks in scope (all, or `instance_ids`) and their predictions.

    Raises:
      InputError: an instance id (given, or of a prediction) that no task has.
    """
    by_id = {t.instance_id: t for t in tasks}
    unknown = [i for i in predictions if i not in by_id]
    if unknown:
        raise InputError(f"prediction(s) for instance(s) not in the tasks: "
                         f"{', '.join(unknown[:5])}" + (" ..." if len(unknown) > 5 else ""))
    if instance_ids:
        missing = [i for i in instance_ids if i not in by_id]
        if missing:
            raise InputError(f"--instance-ids not in the tasks: {', '.join(missing)}")
        tasks = [by_id[i] for i in dict.fromkeys(instance_ids)]
    scope = {t.instance_id for t in tasks}
    return list(tasks), {i: p for i, p in predictions.items() if i in scope}


def report(tasks: Sequence[SWETask], predictions: dict[str, dict],
           results: dict[str, grading.GradeResult], backend: str, seconds: float) -> dict:
    """SWE-bench's run report for these results, plus rejected ids and per-instance details."""
    order = [t.instance_id for t in tasks if t.instance_id in predictions]
    ids = {name: [] for name in ("completed", "resolved", "unresolved", "error", "empty_patch",
                                 "rejected")}
    instances = {}
    for instance_id in order:
        result = results[instance_id]
        empty = not predictions[instance_id]["model_patch"].strip()
        if empty:
            ids["empty_patch"].append(instance_id)
        if result.status == "error":
            ids["error"].append(instance_id)
        else:
            ids["completed"].append(instance_id)
            ids["resolved" if result.resolved else "unresolved"].append(instance_id)
            if result.status == "rejected":
                ids["rejected"].append(instance_id)
        instances[instance_id] = {
            "status": result.status, "resolved": result.resolved, "reason": result.reason,
            "fail_to_pass": list(result.fail_to_pass), "pass_to_pass": list(result.pass_to_pass),
            "test_exit_code": result.test_exit_code, "seconds": round(result.seconds, 3),
            "empty_patch": empty,
            "model_name_or_path": predictions[instance_id]["model_name_or_path"]}
    return {
        "total_instances": len(tasks), "submitted_instances": len(predictions),
        **{f"{name}_instances": len(ids[name]) for name in ("completed", "resolved",
                                                              "unresolved", "empty_patch",
                                                              "error")},
        "submitted_ids": order, **{f"{name}_ids": value for name, value in ids.items()},
        "instances": instances, "backend": backend, "seconds_total": round(seconds, 3)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sao_jax.envs.swe.grade",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", required=True, help="SWE-bench JSONL file of the tasks")
    parser.add_argument("--predictions", required=True,
                        help="JSONL (or .json) of {instance_id, model_name_or_path, "
                             "model_patch}; `gold`: every task's own patch (as SWE-bench's "
                             "harness), `empty`: the empty patch for every task")
    parser.add_argument("--backend", required=True, choices=BACKENDS)
    parser.add_argument("--out", required=True, help="where the JSON report is written")
    parser.add_argument("--workers", type=int, default=1, help="gradings at once (default 1)")
    parser.add_argument("--instance-ids", nargs="+", default=None,
                        help="grade only these instances")
    parser.add_argument("--timeout", type=float, default=grading.DEFAULT_TIMEOUT,
                        help="seconds for each test command (default %(default)s)")
    parser.add_argument("--image-template", default=None,
                        help="container image of a task (container backends), formatted with "
                             "its fields; default WorkspaceConfig's")
    parser.add_argument("--skipped-p2p-passes", action="store_true",
                        help="count a skipped PASS_TO_PASS test as passing (by default it "
                             "does not: source code can skip the tests it would fail)")
    parser.add_argument("--log-dir", default=None,
                        help="write each instance's test log to DIR/<instance_id>.log")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        parser.error(f"--out: directory {out_dir} does not exist")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        all_tasks = load_tasks(args.tasks)
        if args.predictions in ("gold", "empty"):  # SWE-bench's `gold`; `empty`: nothing
            predictions = {t.instance_id: {"instance_id": t.instance_id,
                                           "model_name_or_path": args.predictions,
                                           "model_patch": t.patch if args.predictions == "gold"
                                           else ""} for t in all_tasks}
        else:
            predictions = load_predictions(args.predictions)
        tasks, predictions = select(all_tasks, predictions, args.instance_ids)
    except (TaskError, InputError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = WorkspaceConfig(backend=args.backend,
                             **({"image_template": args.image_template}
                                if args.image_template else {}))
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    by_id = {t.instance_id: t for t in tasks}
    start = time.monotonic()
    results: dict[str, grading.GradeResult] = {}

    def one(instance_id: str) -> grading.GradeResult:
        try:
            return grading.grade(by_id[instance_id], predictions[instance_id]["model_patch"],
                                 config, timeout=args.timeout,
                                 skipped_p2p_passes=args.skipped_p2p_passes)
        except Exception as e:  # one instance's failure is its error, not the run's
            return grading.GradeResult(instance_id, False, "error",
                                       f"grading raised {type(e).__name__}: "
                                       f"{' '.join(str(e).split())}")

    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        futures = {pool.submit(one, i): i for i in predictions}
        for done in concurrent.futures.as_completed(futures):
            instance_id = futures[done]
            result = results[instance_id] = done.result()
            print(f"[{len(results)}/{len(futures)}] {instance_id}: {result.status} "
                  f"({result.seconds:.1f} s) {result.reason}", file=sys.stderr, flush=True)
            if args.log_dir:
                name = instance_id.replace(os.sep, "_") + ".log"
                with open(os.path.join(args.log_dir, name), "w", encoding="utf-8") as f:
                    f.write(f"{result.status}: {result.reason}\n\n{result.log}")
    seconds = time.monotonic() - start
    summary = report(tasks, predictions, results, args.backend, seconds)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    print(f"graded {len(results)} instances with {args.backend} in {seconds:.1f} s: "
          f"{summary['resolved_instances']} resolved, {summary['unresolved_instances']} "
          f"unresolved, {summary['error_instances']} errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
