"""The text layer as a whole: the ids it gives are the ids the code gave before it was one layer,
tokenizers load by path, and it sits on the bottom floor.

The literal ids below were recorded from main at 4cc5c3d, when the tokenizers lived in
`envs/tokenizer.py` and `envs/hf_tokenizer.py`, the chat deltas in `rollout/chat.py` and the
prompt renderer in `rollout/worker.py`: moving them changed no id.
"""

import ast
import os

from sao_jax.envs import registry
from sao_jax.text import (
    CharTokenizer,
    ChatDeltas,
    HFTokenizer,
    chat_deltas,
    load_tokenizer,
    prompt_renderer,
)

REPO = os.path.join(os.path.dirname(__file__), "..", "..")
TIR_TOKENIZER = os.path.join(REPO, "experiments", "data", "tir", "tokenizer")
# A template with a "tool" role (ChatML's shape, any role).
ANY_ROLE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_char_tokenizer_gives_the_ids_it_gave():
    tok = load_tokenizer(None)
    assert isinstance(tok, CharTokenizer)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (59, 0, 1, 2)
    assert tok.encode("(2+3)*4=?\n<calc>2+3</calc><res>5</res>\n<ans>20</ans>") == [
        23, 11, 19, 12, 24, 21, 13, 25, 26, 27, 3, 11, 19, 12, 4, 5, 14, 6, 27, 7, 11, 9, 8]
    assert prompt_renderer(tok)("write about tea:\n") == [
        1, 54, 49, 40, 51, 36, 28, 32, 33, 46, 52, 51, 28, 51, 36, 32, 58, 27]
    assert chat_deltas(tok) is None
    stops = {name: registry.REGISTRY[name].stop_token_ids(tok)
             for name in ("calculator", "style_shift", "swe")}
    assert stops == {"calculator": (4, 8, 2), "style_shift": (2, 29), "swe": (2,)}


def test_the_hf_tokenizer_and_its_chat_template_give_the_ids_they_gave():
    tok = load_tokenizer(TIR_TOKENIZER)
    assert isinstance(tok, HFTokenizer)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (512, 0, None, 2)
    assert tok.encode("日本語") == [165, 248, 101, 165, 253, 108, 167, 106, 255]
    assert tok.encode("```python\nprint(1)\n```") == [281, 321, 201, 292, 10, 19, 311, 281]
    assert tok.encode("\\boxed{6}<|im_end|>") == [62, 338, 93, 24, 95, 2]
    assert tok.decode([2, 511, 512, 7]) == "<|im_end|>)))\n\ufffd%"
    assert prompt_renderer(tok)("What is 2^10?") == [
        1, 398, 201, 469, 341, 223, 20, 64, 19, 18, 33, 2, 201, 1, 458, 201]
    chat = chat_deltas(tok)
    assert chat.observation_ids("<output>\n1024\n</output>") == [
        201, 1, 398, 201, 379, 275, 19, 18, 20, 22, 201, 378, 283, 32, 2, 201, 1, 458, 201]
    assert chat.prompt_ids([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi"}]) == [
        1, 85, 91, 267, 500, 201, 36, 71, 272, 84, 75, 71, 72, 16, 2, 201, 1, 398, 201, 42, 75, 2,
        201, 1, 458, 201]
    assert (chat.end_of_turn_id, chat.after_end_of_turn) == (2, "\n")
    assert registry.REGISTRY["python_tool"].stop_token_ids(tok)[0] == 2


def test_another_template_on_the_same_vocabulary_gives_the_ids_it_gave():
    chat = ChatDeltas(HFTokenizer(HFTokenizer.from_dir(TIR_TOKENIZER).tokenizer,
                                  eos_token="<|im_end|>", chat_template=ANY_ROLE))
    assert chat.observation_ids("é", role="tool") == [
        201, 1, 86, 81, 81, 78, 201, 130, 105, 2, 201, 1, 458, 201]
    assert chat.observation_ids("é") == [201, 1, 398, 201, 130, 105, 2, 201, 1, 458, 201]


def test_the_text_layer_imports_nothing_else_of_sao_jax():
    """The bottom floor: environments import it, so it may import neither them nor anything
    above them."""
    package = os.path.join(REPO, "sao_jax", "text")
    found = []
    for name in sorted(os.listdir(package)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(package, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"sao_jax/text/{name}:{node.lineno}: {m}" for m in modules
                      if m.startswith("sao_jax") and not m.startswith("sao_jax.text")]
    assert not found, "the text layer imports a higher floor:\n" + "\n".join(found)
