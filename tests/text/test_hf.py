"""HFTokenizer against transformers (the reference), on the shipped TIR tokenizer and small dirs."""

import json
import os
import re
import shutil

import hypothesis
import jinja2
import pytest
from hypothesis import strategies as st

from sao_jax.envs.python_tool import PythonToolEnv
from sao_jax.text.hf import REPLACEMENT, HFTokenizer

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "data", "tir",
                       "tokenizer")
TOK = HFTokenizer.from_dir(SHIPPED)
CHATS = [
    [{"role": "user", "content": PythonToolEnv("What is 2^10?", "1024").reset()}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
     {"role": "assistant", "content": "```python\nprint(1 + 1)\n```\n"},
     {"role": "user", "content": "<output>\n2\n</output>\n"}],
    [{"role": "user", "content": "é 中 \U0001d70b <|im_end|> tabs\tand  spaces\n\n"}],
]
TEXTS = [
    "Compute 1/6 + 1/8 + 1/21. Give the answer as a fraction in lowest terms.",
    "I will compute.\n```python\nprint(pow(83, 124, 1000))\n```\n<output>\n7\n</output>\n",
    "<|im_start|>assistant\nThe answer is \\boxed{493/1288}.<|im_end|><|endoftext|>",
    "é 中 \U0001d70b  \t\n\r\n unknown-to-training ÿ\x00",
]


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained


def test_shipped_tokenizer_vocabulary_and_special_tokens():
    assert TOK.vocab_size <= 512
    assert TOK.eos_id == TOK.id("<|im_end|>") and TOK.pad_id == TOK.id("<|endoftext|>")
    assert TOK.bos_id is None
    assert TOK.encode("<|im_start|>") == [TOK.id("<|im_start|>")]
    assert os.path.getsize(os.path.join(SHIPPED, "tokenizer.json")) < 200_000


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_and_encode_match_transformers(reference, add_generation_prompt):
    ref = reference(SHIPPED)
    for chat in CHATS:
        text = TOK.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
        assert text == ref.apply_chat_template(chat, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        assert TOK.encode(text) == ref.encode(text, add_special_tokens=False)
    for text in TEXTS:
        assert TOK.encode(text) == ref.encode(text, add_special_tokens=False)


def test_chatml_generation_prompt():
    chat = [{"role": "user", "content": "hi"}]
    assert TOK.apply_chat_template(chat) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert TOK.apply_chat_template(chat, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n")
    with pytest.raises(jinja2.TemplateError, match="roles are supported, got tool"):
        TOK.apply_chat_template([{"role": "tool", "content": "x"}])


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.text())
def test_decode_inverts_encode(text):
    assert TOK.decode(TOK.encode(text)) == text


def test_decode_marks_ids_outside_the_vocabulary():
    a, b = TOK.encode("ab")
    assert TOK.decode([a, TOK.vocab_size, b, -1, 10**12]) == f"a{REPLACEMENT}b{REPLACEMENT}" \
        f"{REPLACEMENT}"
    assert TOK.decode([]) == ""
    assert TOK.decode([TOK.eos_id]) == "<|im_end|>"  # special tokens are not skipped


def _tokenizer_dir(tmp_path, config=None, template_file=None):
    shutil.copy(os.path.join(SHIPPED, "tokenizer.json"), tmp_path / "tokenizer.json")
    with open(os.path.join(SHIPPED, "tokenizer_config.json")) as f:
        base = json.load(f)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
    if template_file is not None:
        (tmp_path / "chat_template.jinja").write_text(template_file)
    return tmp_path


def test_special_tokens_as_objects_and_bos(tmp_path):
    path = _tokenizer_dir(tmp_path, {
        "bos_token": {"content": "<|im_start|>", "lstrip": False, "special": True},
        "eos_token": {"content": "<|endoftext|>"}, "pad_token": None})
    tok = HFTokenizer.from_dir(path)
    assert tok.bos_id == TOK.id("<|im_start|>") and tok.eos_id == TOK.id("<|endoftext|>")
    assert tok.pad_id == tok.eos_id  # no pad token: eos pads


def test_template_features_match_transformers(reference, tmp_path):
    # tojson without HTML escaping, namespace, loop controls, special tokens as variables.
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}"
                "{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{{ m | tojson }}\n{% endfor %}"
                "{{ ns.n }}{{ eos_token }}{% if add_generation_prompt %}>{% endif %}")
    path = _tokenizer_dir(tmp_path, template_file=template)
    chat = [{"role": "system", "content": "s"},
            {"role": "user", "content": "<b>&'é\"", "name": None}]
    ours = HFTokenizer.from_dir(path).apply_chat_template(chat)
    assert ours == '{"role": "user", "content": "<b>&\'é\\""}\n1<|im_end|>>'
    assert ours == reference(str(path)).apply_chat_template(chat, tokenize=False,
                                                            add_generation_prompt=True)


def test_template_file_wins_and_named_templates(tmp_path):
    path = _tokenizer_dir(tmp_path, template_file="file")
    assert HFTokenizer.from_dir(path).apply_chat_template([]) == "file"
    os.remove(path / "chat_template.jinja")
    _tokenizer_dir(tmp_path, {"chat_template": [{"name": "tool_use", "template": "t"},
                                                {"name": "default", "template": "d"}]})
    assert HFTokenizer.from_dir(path).apply_chat_template([]) == "d"
    _tokenizer_dir(tmp_path, {"chat_template": [{"name": "tool_use", "template": "t"}]})
    with pytest.raises(ValueError, match="tokenizer_config.json: .*none named 'default'"):
        HFTokenizer.from_dir(path)


def test_sandbox_refuses_unsafe_templates(tmp_path):
    path = _tokenizer_dir(tmp_path, {"chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(jinja2.exceptions.SecurityError):
        HFTokenizer.from_dir(path).apply_chat_template([])
    path = _tokenizer_dir(tmp_path, {"chat_template": "{% set ns = namespace(_x=1) %}"})
    with pytest.raises(jinja2.exceptions.SecurityError, match="underscore"):
        HFTokenizer.from_dir(path).apply_chat_template([])


def test_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer\.json not found"):
        HFTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a readable"):
        HFTokenizer.from_dir(tmp_path)
    path = _tokenizer_dir(tmp_path, {"chat_template": None})
    tok = HFTokenizer.from_dir(path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match=f"{path} has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    _tokenizer_dir(tmp_path, {"eos_token": None})
    with pytest.raises(ValueError, match="tokenizer_config.json names no eos_token"):
        HFTokenizer.from_dir(path)
    _tokenizer_dir(tmp_path, {"eos_token": "<|not-a-token|>"})
    with pytest.raises(ValueError,
                       match=re.escape("eos_token '<|not-a-token|>' is not in the vocabulary")):
        HFTokenizer.from_dir(path)
    _tokenizer_dir(tmp_path, {"pad_token": 3})
    with pytest.raises(ValueError, match="pad_token must be a string"):
        HFTokenizer.from_dir(path)
    with pytest.raises(KeyError, match="is not a token of"):
        TOK.id("<|not-a-token|>")
