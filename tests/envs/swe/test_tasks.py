"""SWE-bench instances load as published (test lists as lists or JSON strings); a bad row fails
with its line number and field."""

import json

import pytest

from sao_jax.envs.swe.tasks import SWETask, TaskError, load_tasks

ROW = {"instance_id": "owner__repo-1", "repo": "owner/repo", "base_commit": "abc123",
       "problem_statement": "it breaks", "patch": "diff --git a/x.py b/x.py\n",
       "test_patch": "diff --git a/tests/t.py b/tests/t.py\n",
       "FAIL_TO_PASS": ["tests/t.py::test_a"], "PASS_TO_PASS": [], "version": "1.0",
       "environment_setup_commit": "def456"}


def write(tmp_path, rows, name="tasks.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_published_forms_load_alike(tmp_path):
    as_strings = {**ROW, "instance_id": "owner__repo-2",
                  "FAIL_TO_PASS": json.dumps(ROW["FAIL_TO_PASS"]),
                  "PASS_TO_PASS": json.dumps(["tests/t.py::test_b"]),
                  "hints_text": "", "created_at": "2023-01-01"}  # SWE-bench's extra fields
    tasks = load_tasks(write(tmp_path, [ROW, "", as_strings]))
    assert [t.instance_id for t in tasks] == ["owner__repo-1", "owner__repo-2"]
    assert tasks[0].fail_to_pass == tasks[1].fail_to_pass == ("tests/t.py::test_a",)
    assert tasks[1].pass_to_pass == ("tests/t.py::test_b",)
    assert tasks[1].extra == {"hints_text": "", "created_at": "2023-01-01"}
    assert tasks[0].log_parser == "pytest" and tasks[0].workspace is None


def test_optional_fields_and_round_trip(tmp_path):
    row = {**ROW, "workspace": "snap/repo.bundle", "log_parser": "unittest",
           "test_cmd": "python -m unittest -v", "image": "localhost/x:1", "version": 0.12}
    task = load_tasks(write(tmp_path, [row]))[0]
    assert task.workspace == str(tmp_path / "snap" / "repo.bundle")  # relative to the file
    assert (task.log_parser, task.test_cmd, task.image, task.version) == (
        "unittest", "python -m unittest -v", "localhost/x:1", "0.12")
    assert SWETask.from_row(task.to_row()) == task


@pytest.mark.parametrize("change, message", [
    ({"FAIL_TO_PASS": "not json"}, "field FAIL_TO_PASS is a string but not a JSON list"),
    ({"FAIL_TO_PASS": [1]}, "field FAIL_TO_PASS must be a list of test names"),
    ({"FAIL_TO_PASS": []}, "field FAIL_TO_PASS is empty"),
    ({"base_commit": None}, "field base_commit must be a string"),
    ({"log_parser": "nose"}, "field log_parser must be one of"),
    ({"image": 3}, "field image must be a string"),
])
def test_a_bad_row_names_its_line_and_field(tmp_path, change, message):
    path = write(tmp_path, [ROW, {**ROW, "instance_id": "owner__repo-2", **change}])
    with pytest.raises(TaskError, match=rf"tasks.jsonl:2: {message}"):
        load_tasks(path)


def test_missing_fields_bad_json_repeats_and_missing_file(tmp_path):
    row = dict(ROW)
    del row["patch"], row["problem_statement"]
    with pytest.raises(TaskError, match=r":1: missing field\(s\) problem_statement, patch"):
        load_tasks(write(tmp_path, [row]))
    with pytest.raises(TaskError, match=r":2: not a JSON object"):
        load_tasks(write(tmp_path, [ROW, "{oops"]))
    with pytest.raises(TaskError, match=r":2: instance_id 'owner__repo-1' repeats line 1"):
        load_tasks(write(tmp_path, [ROW, ROW]))
    with pytest.raises(TaskError, match="no tasks"):
        load_tasks(write(tmp_path, [""]))
    with pytest.raises(FileNotFoundError, match="swe_mini/tasks.jsonl is the bundled set"):
        load_tasks(str(tmp_path / "absent.jsonl"))


def test_swe_smith_exports_load_unchanged(tmp_path):
    # SWE-smith's published columns: no base_commit, test_patch, version or
    # environment_setup_commit; its image is `image_name`
    row = {"instance_id": "pylint-dev__astroid.b114f6b5.2496",
           "repo": "swesmith/pylint-dev__astroid.b114f6b5", "patch": "diff --git a/x b/x\n",
           "FAIL_TO_PASS": ["tests/test_inference.py::test_formatted_fstring_inference"],
           "PASS_TO_PASS": ["tests/test_inference.py::test_fstring_inference"],
           "image_name": "jyangballin/swesmith.x86_64.pylint-dev_1776_astroid.b114f6b5",
           "problem_statement": "f-strings infer wrongly"}
    task = load_tasks(write(tmp_path, [row]))[0]
    assert task.image == row["image_name"] and "image_name" not in task.extra
    assert (task.base_commit, task.test_patch, task.version,
            task.environment_setup_commit) == ("", "", "", "")
    assert task.fail_to_pass == tuple(row["FAIL_TO_PASS"])
    with pytest.raises(TaskError, match=r":1: missing field\(s\) patch"):
        load_tasks(write(tmp_path, [{k: v for k, v in row.items() if k != "patch"}]))


def test_hostile_rows_fail_with_their_line(tmp_path):
    path = tmp_path / "tasks.jsonl"
    for line, message in ((b'{"instance_id": "a\xff"}', "not UTF-8"),
                          (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "RecursionError"),
                          (b'{"version": ' + b"9" * 5000 + b"}", "not a JSON object")):
        path.write_bytes(json.dumps(ROW).encode() + b"\n" + line + b"\n")
        with pytest.raises(TaskError, match=rf"tasks.jsonl:2: .*{message}"):
            load_tasks(str(path))
