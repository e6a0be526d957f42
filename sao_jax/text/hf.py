"""A Hugging Face tokenizer directory without transformers: `tokenizer.json` and the chat template.

`HFTokenizer.from_dir(path)` loads `tokenizer.json` with the `tokenizers` library and the special
tokens and chat template from `tokenizer_config.json` (a `chat_template.jinja` beside it wins, as
in transformers). It speaks the text layer's `Tokenizer` protocol (`sao_jax/text/__init__.py`),
as `char.CharTokenizer` does, so the agent loop takes either, and renders chats as
`transformers`' `apply_chat_template(..., tokenize=False)` does (`template.py`), with the special
tokens (`bos_token`, `eos_token`, ...) as template variables.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping, Sequence

import tokenizers

from sao_jax.text.template import render_chat_template

# The named special tokens transformers passes to a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
REPLACEMENT = "\ufffd"  # what `decode` writes for an id the tokenizer does not know


class HFTokenizer:
    """A `tokenizers.Tokenizer` with its special tokens and (optional) chat template.

    `encode` adds no special tokens, but special tokens written in the text (`<|im_start|>`)
    become their ids, as the rendered chat needs. `decode` skips nothing, and writes U+FFFD for
    each id outside the vocabulary (a model's embedding table is often larger than its
    tokenizer, and a sampled padding id must not crash the episode). `pad_id` is the eos id when
    the tokenizer names no pad token; `bos_id` is None when it names no bos token.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_token: str,
                 bos_token: str | None = None, pad_token: str | None = None,
                 chat_template: str | None = None,
                 special_tokens: Mapping[str, str] | None = None, source: str = "<memory>"):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.source = source
        self.special_tokens = {"eos_token": eos_token, **(special_tokens or {})}
        if bos_token is not None:
            self.special_tokens["bos_token"] = bos_token
        if pad_token is not None:
            self.special_tokens["pad_token"] = pad_token
        self.eos_id = self._special_id(eos_token, "eos_token")
        self.bos_id = None if bos_token is None else self._special_id(bos_token, "bos_token")
        self.pad_id = self.eos_id if pad_token is None else self._special_id(pad_token, "pad_token")
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> HFTokenizer:
        """Reads `path/tokenizer.json`, `path/tokenizer_config.json` and `path/chat_template.jinja`.

        Raises:
          ValueError naming the file when `tokenizer.json` is missing or unreadable, or the config
          names no eos token.
        """
        path = os.fspath(path)
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ValueError(f"{tokenizer_file} not found: an HF tokenizer directory needs the "
                             "`tokenizers` file tokenizer.json (slow-tokenizer files such as "
                             "vocab.txt or tokenizer.model alone are not read).")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(tokenizer_file)
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"{tokenizer_file} is not a readable tokenizers file: {e}") from e
        config_file = os.path.join(path, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        special = {name: _token_content(config.get(name), name, config_file)
                   for name in SPECIAL_TOKEN_NAMES}
        if special["eos_token"] is None:
            missing = "" if os.path.isfile(config_file) else " (the file is missing)"
            raise ValueError(f"{config_file} names no eos_token{missing}; an episode's actions "
                             "stop at it.")
        template_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(template_file):
            with open(template_file, encoding="utf-8") as f:
                chat_template = f.read()
        else:
            chat_template = _default_template(config.get("chat_template"), config_file)
        return cls(tokenizer, eos_token=special["eos_token"], bos_token=special["bos_token"],
                   pad_token=special["pad_token"], chat_template=chat_template,
                   special_tokens={k: v for k, v in special.items() if v is not None},
                   source=path)

    @functools.cached_property
    def digest(self) -> str:
        """A hash of the tokenizer (its model, normaliser and pre-tokeniser, as `tokenizers`
        serialises them), its special tokens and its chat template: equal digests, equal ids for
        every text and chat."""
        whole = [self.tokenizer.to_str(), sorted(self.special_tokens.items()), self.chat_template]
        return hashlib.sha256(json.dumps(whole).encode()).hexdigest()[:16]

    def _special_id(self, token: str, name: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise ValueError(f"{self.source}: {name} {token!r} is not in the vocabulary of "
                             "tokenizer.json.")
        return i

    def id(self, token: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise KeyError(f"{token!r} is not a token of {self.source}")
        return i

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """The text of `ids`, special tokens included; U+FFFD for each id outside the vocabulary."""
        pieces, run = [], []
        for i in (int(i) for i in ids):
            if 0 <= i < self.vocab_size and self.tokenizer.id_to_token(i) is not None:
                run.append(i)
                continue
            pieces += [self.tokenizer.decode(run, skip_special_tokens=False), REPLACEMENT]
            run = []
        pieces.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return "".join(pieces)

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """The chat rendered as text, as `transformers`' `apply_chat_template(tokenize=False)`.

        Raises:
          ValueError when the tokenizer has no chat template; `jinja2.TemplateError` when the
          template rejects the chat (its `raise_exception`).
        """
        if self.chat_template is None:
            raise ValueError(f"{self.source} has no chat template (neither chat_template.jinja "
                             "nor a chat_template in tokenizer_config.json).")
        return render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    **{**self.special_tokens, **kwargs})


def _token_content(value, name: str, config_file: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, {"content": ...} or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{config_file}: {name} must be a string or an object with a string "
                     f"'content', got {value!r}.")


def _default_template(value, config_file: str) -> str | None:
    """`chat_template` of tokenizer_config.json: a string, or a list of {"name", "template"} of
    which the one named "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{config_file}: chat_template lists templates {sorted(map(str, named))} "
                         "but none named 'default'.")
    raise ValueError(f"{config_file}: chat_template must be a string or a list of named "
                     f"templates, got {type(value).__name__}.")
