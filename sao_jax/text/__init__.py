"""The text layer: tokenizers and chat templates, the one place text becomes token ids.

    char.py      `CharTokenizer`, the toy models' 59-token vocabulary (tool tags are tokens)
    hf.py        `HFTokenizer`, a Hugging Face tokenizer directory (tokenizer.json, its config,
                 its chat template) read without transformers
    template.py  `render_chat_template`: Jinja chat templates rendered as transformers does
    chat.py      the prompt rendered as a chat (`prompt_renderer`) and the template's token-exact
                 deltas for later observations (`ChatDeltas`, `chat_deltas`)

Every tokenizer speaks `Tokenizer`; `load_tokenizer(path)` gives the one an experiment names
(`config.env.tokenizer`, a worker's `--tokenizer`). The rollout worker, the recording proxy, the
agent loop, the learner's task, the warm start and the environments (their stop tokens) import
from here. One reader of text stays apart: the embedded engine, which takes SGLang's `text`
input as SGLang does, with the `tokenizers` file of its model directory
(`engine/model_io.py`).

Floor: the bottom one, beside `models/`. It imports nothing else of sao_jax, so that
environments (`envs/`, below `rollout/` and `train/`) can use it as freely as the worker and the
learner do (`tests/text/test_text.py` checks this).
"""

from __future__ import annotations

from typing import Protocol

from sao_jax.text.char import CharTokenizer
from sao_jax.text.chat import (
    ChatDeltas,
    ChatTemplateError,
    chat_deltas,
    has_chat_template,
    prompt_renderer,
)
from sao_jax.text.hf import HFTokenizer
from sao_jax.text.template import render_chat_template


class Tokenizer(Protocol):
    """What the agent loop, the environments and the warm start ask of a tokenizer.

    `encode` adds no special tokens (a tag or special token written in the text becomes its id);
    `decode` never raises on an id of the model's vocabulary. `bos_id` is None when the tokenizer
    has none; `pad_id` is always an id. `digest` identifies the ids: two tokenizers with the same
    digest give the same ids for every text (and chat), so a cache of token ids can be keyed by it
    (the warm start's is).
    """

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int
    digest: str

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids) -> str: ...
    def id(self, token: str) -> int: ...


def load_tokenizer(path: str | None) -> Tokenizer:
    """The HF tokenizer in directory `path`, or the toy `CharTokenizer` when `path` is None."""
    return CharTokenizer() if path is None else HFTokenizer.from_dir(path)


__all__ = [
    "CharTokenizer",
    "ChatDeltas",
    "ChatTemplateError",
    "HFTokenizer",
    "Tokenizer",
    "chat_deltas",
    "has_chat_template",
    "load_tokenizer",
    "prompt_renderer",
    "render_chat_template",
]
