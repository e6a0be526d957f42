"""read_jsonl's rows and errors, and the shipped TIR example (experiments/data/tir)."""

import importlib.util
import os

import pytest

from sao_jax.envs.datasets import read_jsonl

TIR = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "data", "tir")


def _write(tmp_path, text):
    path = tmp_path / "rows.jsonl"
    path.write_text(text)
    return path


def test_rows_get_index_and_prompt_id(tmp_path):
    path = _write(tmp_path, '{"prompt": "a", "answer": "1"}\n\n  \n'
                            '{"prompt": "b", "answer": 2, "extra": [1]}')
    assert read_jsonl(path) == [
        {"prompt": "a", "answer": "1", "index": 0, "prompt_id": "0"},
        {"prompt": "b", "answer": 2, "extra": [1], "index": 1, "prompt_id": "1"}]
    assert read_jsonl(_write(tmp_path, '{"q": 1}\n'), required=("q",))[0]["prompt_id"] == "0"
    assert read_jsonl(_write(tmp_path, "")) == []


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", "answer": "1"', "invalid JSON"),
    ('["prompt", "answer"]', "must be a JSON object, got list"),
    ('"text"', "must be a JSON object, got str"),
    ('{"prompt": "a"}', "missing field 'answer'"),
    ('{"prompt": null, "answer": "1"}', "field 'prompt' must be a string or a number, got null"),
    ('{"prompt": "a", "answer": ["1"]}', "field 'answer' must be a string or a number"),
    ('{"prompt": "a", "answer": true}', "field 'answer' must be a string or a number, got true"),
    ('{"prompt": "a", "answer": "1", "prompt_id": "x"}', "'prompt_id' is set by read_jsonl"),
])
def test_bad_lines_name_file_line_and_field(tmp_path, line, message):
    path = _write(tmp_path, '{"prompt": "ok", "answer": "1"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=f"rows.jsonl:3: .*{message}") as info:
        read_jsonl(path)
    assert str(path) in str(info.value)


def test_shipped_example_is_small_and_disjoint():
    train = read_jsonl(os.path.join(TIR, "train.jsonl"))
    heldout = read_jsonl(os.path.join(TIR, "heldout.jsonl"))
    assert len(train) == 200 and len(heldout) == 50
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    assert len({r["prompt"] for r in train}) == len(train)
    total = sum(os.path.getsize(os.path.join(root, name))
                for root, _, names in os.walk(TIR) for name in names)
    assert total < 100_000  # everything, the tokenizer and make_data.py included


def test_make_data_reproduces_the_shipped_files(tmp_path):
    spec = importlib.util.spec_from_file_location("make_data", os.path.join(TIR, "make_data.py"))
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    make_data.main(str(tmp_path))
    for name in ("train.jsonl", "heldout.jsonl", "tokenizer/tokenizer.json",
                 "tokenizer/tokenizer_config.json"):
        with open(os.path.join(TIR, name), "rb") as shipped, open(tmp_path / name, "rb") as new:
            assert shipped.read() == new.read(), name
