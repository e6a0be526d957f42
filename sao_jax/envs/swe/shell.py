"""Bash's tokens, as far as the reward-hacking monitor (`monitor.py`) needs them.

`lex(text)` splits a command line the way `bash -c` would at the level a monitor reads: simple
commands at `; && || | & ( )` and newlines, with their words (quotes removed, expansions left as
written), their redirections and heredoc bodies, and the text of every command substitution
(`$(...)`, backticks, `<(...)`) for the caller to lex on its own. It never raises: text it
cannot make sense of ends a word or a command. It is not a shell: nothing is expanded or run.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


@dataclasses.dataclass
class SimpleCommand:
    """A simple command: its words (quotes removed, expansions left as written), its redirections
    `[op, target, body]` (body: a heredoc's or here-string's text) and its source text."""

    words: list[str]
    redirects: list[list]
    text: str


class Lexed(NamedTuple):
    """`lex`'s result: the simple commands in order, and the text inside each command
    substitution (not lexed)."""

    commands: list[SimpleCommand]
    nested: list[str]


def lex(text: str) -> Lexed:
    """The simple commands of the bash `text` and its command substitutions' texts."""
    lexer = _Lexer(text).lex()
    return Lexed(lexer.commands, lexer.nested)


_SEPARATORS = ("&&", "||", ";;", "|&", ";", "|", "&", "(", ")")
_REDIRECTS = ("<<<", "<<-", "&>>", "<<", ">>", ">|", "&>", ">&", "<&", "<>", ">", "<")
_META = set(" \t\n;&|()<>")
_ANSI_C = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a",
           "b": "\b", "e": "\x1b", "f": "\f", "v": "\v"}


class _Lexer:
    """`lex`'s state: one pass over the text, left to right (the module docstring says what it
    reads)."""

    def __init__(self, text: str):
        self.text, self.i = text, 0
        self.commands: list[SimpleCommand] = []
        self.nested: list[str] = []
        self._pending: list[tuple[list, str, bool]] = []  # heredocs waiting for their bodies

    def lex(self) -> _Lexer:
        text, n = self.text, len(self.text)
        words: list[str] = []
        redirects: list[list] = []
        start = None

        def flush(end):
            nonlocal words, redirects, start
            if words or redirects:
                self.commands.append(SimpleCommand(words, redirects, text[start:end]))
            words, redirects, start = [], [], None

        while self.i < n:
            c = text[self.i]
            if c in " \t":
                self.i += 1
            elif text.startswith("\\\n", self.i):
                self.i += 2
            elif c == "\n":
                flush(self.i)
                self.i += 1
                self._heredoc_bodies()
            elif c == "#":  # a comment: only where a word would start
                end = text.find("\n", self.i)
                self.i = n if end < 0 else end
            else:
                if start is None:
                    start = self.i
                if c in "<>" and text.startswith("(", self.i + 1):  # <(cmd), >(cmd)
                    self.i += 1
                    words.append("/dev/fd/63")
                    self.nested.append(self._balanced("(", ")"))
                    continue
                separator = next((s for s in _SEPARATORS if text.startswith(s, self.i)), None)
                redirect = next((r for r in _REDIRECTS if text.startswith(r, self.i)), None)
                if redirect is not None:
                    self.i += len(redirect)
                    self._redirect(redirect, redirects)
                elif separator is not None:
                    self.i += len(separator)
                    flush(self.i - len(separator))
                else:
                    word = self._word()
                    if word.isdigit() and self.i < n and text[self.i] in "<>":
                        continue  # a file descriptor: 2>file
                    words.append(word)
        flush(n)
        return self

    def _redirect(self, op: str, redirects: list) -> None:
        while self.i < len(self.text) and self.text[self.i] in " \t":
            self.i += 1
        target = self._word() if self.i < len(self.text) and self.text[self.i] not in _META \
            else ""
        entry = [op, target, None]
        if op in ("<<", "<<-"):
            self._pending.append((entry, target, op == "<<-"))
        elif op == "<<<":
            entry[2] = target
        redirects.append(entry)

    def _heredoc_bodies(self) -> None:
        for entry, delimiter, strip_tabs in self._pending:
            lines = []
            while self.i < len(self.text):
                end = self.text.find("\n", self.i)
                end = len(self.text) if end < 0 else end
                line = self.text[self.i:end]
                self.i = end + 1
                if (line.lstrip("\t") if strip_tabs else line) == delimiter:
                    break
                lines.append(line)
            entry[2] = "\n".join(lines) + "\n"
        self._pending = []

    def _balanced(self, open_: str, close: str) -> str:
        """The text inside a bracket that starts at `self.i` (quotes respected); moves past it."""
        text, depth, j = self.text, 0, self.i
        while j < len(text):
            c = text[j]
            if c == "\\":
                j += 2
                continue
            if c in "'\"":
                end = text.find(c, j + 1)
                j = len(text) if end < 0 else end + 1
                continue
            if c == open_:
                depth += 1
            elif c == close:
                depth -= 1
                if depth == 0:
                    inner = text[self.i + 1:j]
                    self.i = j + 1
                    return inner
            j += 1
        inner, self.i = text[self.i + 1:], len(text)
        return inner

    def _word(self) -> str:
        text, n, out = self.text, len(self.text), []
        while self.i < n and text[self.i] not in _META:
            c = text[self.i]
            if c == "\\":
                if self.i + 1 < n and text[self.i + 1] != "\n":
                    out.append(text[self.i + 1])
                self.i += 2
            elif c == "'":
                end = text.find("'", self.i + 1)
                end = n if end < 0 else end
                out.append(text[self.i + 1:end])
                self.i = end + 1
            elif c == '"':
                self.i += 1
                while self.i < n and text[self.i] != '"':
                    if text[self.i] == "\\" and self.i + 1 < n and text[self.i + 1] in '"\\$`\n':
                        if text[self.i + 1] != "\n":
                            out.append(text[self.i + 1])
                        self.i += 2
                    elif text.startswith("$(", self.i) or text[self.i] == "`":
                        out.append(self._substitution())
                    else:
                        out.append(text[self.i])
                        self.i += 1
                self.i += 1
            elif text.startswith("$'", self.i):
                self.i += 2
                while self.i < n and text[self.i] != "'":
                    if text[self.i] == "\\" and self.i + 1 < n:
                        out.append(_ANSI_C.get(text[self.i + 1], text[self.i + 1]))
                        self.i += 2
                    else:
                        out.append(text[self.i])
                        self.i += 1
                self.i += 1
            elif text.startswith("$(", self.i) or c == "`":
                out.append(self._substitution())
            elif text.startswith("${", self.i):
                begin = self.i
                self.i += 1
                self._balanced("{", "}")
                out.append(text[begin:self.i])
            else:
                out.append(c)
                self.i += 1
        return "".join(out)

    def _substitution(self) -> str:
        """`$(...)`, `$((...))` or a backtick command at `self.i`: its text, as written; the
        command's inside is kept to scan (arithmetic's is not a command)."""
        begin, text = self.i, self.text
        if text[self.i] == "`":
            end = text.find("`", self.i + 1)
            end = len(text) if end < 0 else end
            self.nested.append(text[self.i + 1:end])
            self.i = end + 1
        else:
            self.i += 1
            inner = self._balanced("(", ")")
            if not inner.startswith("("):
                self.nested.append(inner)
        return text[begin:self.i]
