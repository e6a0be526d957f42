"""A character-level tokenizer with tool tags, for the embedded toy environments.

Real runs use the model's own tokenizer; the toy model of `make train` has a 64-token vocabulary
and this is it. Tags are single tokens, so an action can stop exactly at `</calc>` and an
observation is appended as ids without ever re-tokenising the history.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

SPECIAL = ("<pad>", "<bos>", "<eos>", "<calc>", "</calc>", "<res>", "</res>", "<ans>", "</ans>")
CHARS = "0123456789+-*/()=?\n .,!abcdefghijklmnopqrstuvwxyz:"


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """Maps the special tags and `CHARS` to ids; 59 tokens, within the toy vocabulary of 64."""

    vocab: tuple[str, ...] = SPECIAL + tuple(CHARS)

    def __post_init__(self):
        object.__setattr__(self, "_ids", {tok: i for i, tok in enumerate(self.vocab)})

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def digest(self) -> str:
        """A hash of the vocabulary: equal digests, equal ids for every text."""
        return hashlib.sha256(json.dumps(self.vocab).encode()).hexdigest()[:16]

    def id(self, token: str) -> int:
        return self._ids[token]

    @property
    def pad_id(self) -> int:
        return self._ids["<pad>"]

    @property
    def bos_id(self) -> int:
        return self._ids["<bos>"]

    @property
    def eos_id(self) -> int:
        return self._ids["<eos>"]

    def encode(self, text: str) -> list[int]:
        """Tags first, then single characters; an unknown character is a ValueError naming it."""
        ids, i = [], 0
        while i < len(text):
            if text[i] == "<":
                end = text.find(">", i)
                tag = text[i:end + 1]
                if end > 0 and tag in self._ids:
                    ids.append(self._ids[tag])
                    i = end + 1
                    continue
            ch = text[i]
            if ch not in self._ids:
                raise ValueError(f"character {ch!r} at {i} of {text!r} is not in the toy "
                                 f"vocabulary {CHARS!r} (plus tags {SPECIAL}).")
            ids.append(self._ids[ch])
            i += 1
        return ids

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] if 0 <= int(i) < len(self.vocab) else "\ufffd"
                       for i in ids)
