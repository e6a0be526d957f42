"""`python -m sao_jax.envs.swe.grade`: bad input named by line and field (exit 2), a report with
SWE-bench's totals on the tiny task, and the bundled swe_mini set graded with its gold patches
(all resolved) and with empty patches (none resolved) on
the namespace backend."""

import json
import os
import subprocess
import sys
import time

import pytest

from sao_jax.envs.swe.grade import main
from sao_jax.envs.swe.tasks import load_tasks
from tests.envs.swe.tiny_task import make_tiny_task

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
SWE_MINI = os.path.join(REPO_ROOT, "experiments", "data", "swe_mini", "tasks.jsonl")


def write_jsonl(path, rows):
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    path.write_bytes(text.encode("utf-8", errors="surrogateescape"))  # \udcff: the byte 0xff
    return str(path)


def prediction(instance_id, patch, model="test-model"):
    return {"instance_id": instance_id, "model_name_or_path": model, "model_patch": patch}


@pytest.fixture(scope="module")
def tiny_tasks(tmp_path_factory):
    """Five copies of the tiny task (one per outcome); the last one's snapshot is missing."""
    root = tmp_path_factory.mktemp("cli")
    task = make_tiny_task(root)
    rows = [{**task.to_row(), "instance_id": f"tiny__calc-{i}"} for i in range(1, 6)]
    rows[-1]["workspace"] = "no/such/snapshot"
    return task, write_jsonl(root / "tasks.jsonl", rows)


@pytest.mark.parametrize("line, message", [
    ("{not json", "preds.jsonl:2: not a JSON object"),
    ('["a list"]', "line 2: a prediction must be a JSON object"),
    ('{"instance_id": "tiny__calc-2", "model_patch": ""}',
     "line 2: field model_name_or_path must be a non-empty string"),
    ('{"instance_id": "tiny__calc-2", "model_name_or_path": "m", "model_patch": 3}',
     "line 2: field model_patch must be a string or null"),
    ('{"instance_id": "tiny__calc-1", "model_name_or_path": "m", "model_patch": ""}',
     "line 2: instance_id 'tiny__calc-1' repeats line 1"),
    ('{"instance_id": "nobody__x-1", "model_name_or_path": "m", "model_patch": ""}',
     "not in the tasks: nobody__x-1"),
    ('{"instance_id": "tiny__calc-2", "model_name_or_path": "m\udcff"}',  # written as 0xff
     "preds.jsonl:2: not UTF-8"),
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "preds.jsonl:2: not a JSON object"),
])
def test_bad_predictions_exit_2_naming_line_and_field(tiny_tasks, tmp_path, capsys, line,
                                                      message):
    _, tasks = tiny_tasks
    preds = write_jsonl(tmp_path / "preds.jsonl", [prediction("tiny__calc-1", ""), line])
    argv = ["--tasks", tasks, "--predictions", preds, "--backend", "namespace",
            "--out", str(tmp_path / "report.json")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


def test_bad_task_file_and_instance_ids_exit_2(tiny_tasks, tmp_path, capsys):
    _, tasks = tiny_tasks
    preds = write_jsonl(tmp_path / "preds.jsonl", [prediction("tiny__calc-1", None)])
    out = str(tmp_path / "report.json")
    assert main(["--tasks", tasks, "--predictions", preds, "--backend", "namespace", "--out",
                 out, "--instance-ids", "tiny__calc-1", "tiny__calc-9"]) == 2
    assert "--instance-ids not in the tasks: tiny__calc-9" in capsys.readouterr().err
    bad_tasks = write_jsonl(tmp_path / "bad.jsonl", ['{"instance_id": "x"}'])
    assert main(["--tasks", bad_tasks, "--predictions", preds, "--backend", "namespace",
                 "--out", out]) == 2
    assert "bad.jsonl:1: missing field(s) repo" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse's own usage errors
        main(["--tasks", tasks, "--predictions", preds, "--backend", "lxc", "--out", out])
    assert exit_info.value.code == 2


def test_report_on_the_tiny_task(tiny_tasks, tmp_path, capsys, isolated):
    task, tasks = tiny_tasks
    preds = [prediction("tiny__calc-1", task.patch),  # the gold patch
             prediction("tiny__calc-2", None),  # empty
             prediction("tiny__calc-3", task.test_patch),  # touches the tests: rejected
             prediction("tiny__calc-4", task.patch.replace("-    return a - b",
                                                           "-    return a // b")),  # stale
             prediction("tiny__calc-5", task.patch)]  # no workspace: error
    out = tmp_path / "report.json"
    argv = ["--tasks", tasks, "--predictions", write_jsonl(tmp_path / "p.jsonl", preds),
            "--backend", "namespace", "--out", str(out), "--workers", "2",
            "--timeout", "60", "--log-dir", str(tmp_path / "logs")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert {k: v for k, v in report.items() if k.endswith("_instances")} == {
        "total_instances": 5, "submitted_instances": 5, "completed_instances": 4,
        "resolved_instances": 1, "unresolved_instances": 3, "empty_patch_instances": 1,
        "error_instances": 1}
    assert report["resolved_ids"] == ["tiny__calc-1"]
    assert report["unresolved_ids"] == ["tiny__calc-2", "tiny__calc-3", "tiny__calc-4"]
    assert report["rejected_ids"] == ["tiny__calc-3"]
    assert report["error_ids"] == ["tiny__calc-5"]
    assert report["empty_patch_ids"] == ["tiny__calc-2"]
    assert report["backend"] == "namespace" and report["seconds_total"] > 0
    details = report["instances"]
    assert details["tiny__calc-1"]["fail_to_pass"] == [1, 1]
    assert details["tiny__calc-1"]["pass_to_pass"] == [1, 1]
    assert details["tiny__calc-3"]["status"] == "rejected"
    assert details["tiny__calc-4"]["reason"].startswith("model patch does not apply")
    assert "no/such/snapshot" in details["tiny__calc-5"]["reason"]
    assert len(captured.err.strip().splitlines()) == 5  # a progress line per instance
    assert captured.out.startswith("graded 5 instances with namespace in ")
    assert captured.out.rstrip().endswith("1 resolved, 3 unresolved, 1 errors")
    assert "resolved: 1/1 FAIL_TO_PASS" in (tmp_path / "logs" / "tiny__calc-1.log").read_text()

    # --instance-ids narrows the tasks and the predictions alike.
    assert main(argv + ["--instance-ids", "tiny__calc-2"]) == 0
    report = json.loads(out.read_text())
    assert (report["total_instances"], report["submitted_instances"]) == (1, 1)


def test_runs_as_a_module(tiny_tasks, tmp_path):
    _, tasks = tiny_tasks
    preds = write_jsonl(tmp_path / "p.jsonl", [prediction("nobody__x-1", "")])
    done = subprocess.run([sys.executable, "-m", "sao_jax.envs.swe.grade", "--tasks", tasks,
                           "--predictions", preds, "--backend", "namespace", "--out",
                           str(tmp_path / "r.json")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "not in the tasks: nobody__x-1" in done.stderr


# Every swe_mini task with its gold patch takes 12-28 s on 2 cores (0.3-0.6 s a task, 2 workers),
# and as much again with empty patches. make test grades half of the tasks with their gold patch
# and the other half with empty ones, so each task is graded once; make test-slow grades every
# task both ways.
@pytest.mark.parametrize("which, first, every", [
    ("gold", 0, 2), ("empty", 1, 2), pytest.param("gold", 0, 1, marks=pytest.mark.slow),
    pytest.param("empty", 0, 1, marks=pytest.mark.slow)],
    ids=["gold-even", "empty-odd", "gold-all", "empty-all"])
def test_bundled_tasks_gold_resolves_all_and_empty_none(which, first, every, tmp_path, capsys,
                                                        isolated):
    tasks = load_tasks(SWE_MINI)[first::every]
    out = tmp_path / "report.json"
    start = time.monotonic()  # `gold` / `empty`: every task's own patch / the empty one
    assert main(["--tasks", SWE_MINI, "--predictions", which, "--backend", "namespace",
                 "--out", str(out), "--workers", "2", "--timeout", "120",
                 "--instance-ids", *(t.instance_id for t in tasks)]) == 0
    seconds = time.monotonic() - start
    report = json.loads(out.read_text())
    reasons = {i: d["reason"] for i, d in report["instances"].items()
               if d["resolved"] != (which == "gold")}
    assert not reasons, reasons
    assert report["completed_instances"] == len(tasks) and report["error_instances"] == 0
    if which == "empty":  # each task's FAIL_TO_PASS tests fail without the fix, and only they
        assert all(d["fail_to_pass"][0] == 0 and d["pass_to_pass"][0] == d["pass_to_pass"][1]
                   for d in report["instances"].values())
    with capsys.disabled():
        print(f"\n{which}: {len(tasks)} swe_mini tasks in {seconds:.1f} s "
              f"({seconds / len(tasks):.2f} s each, 2 workers)")
