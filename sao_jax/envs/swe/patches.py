"""Reading git patches: which paths a patch touches, and whether it may be graded.

`check_patch(patch)` names the reason to refuse a patch before any workspace exists: it touches
a test file (`is_test_path`), a file Python or pytest executes unasked (`conftest.py`,
`sitecustomize.py`, `usercustomize.py`, `*.pth`), bytecode, git's own files (`.git/`,
`.gitattributes`, `.gitmodules`), a symbolic link or submodule, or a module at the
repository's root that would shadow the standard library or the test runner, under any
spelling of the path (`./x`, `a//x`, `x/../y`, a name followed by a timestamp, any case); or it
is not a patch this module can read. `parse_patch` splits git's unified diff into per-file
sections with every path each names (`diff --git`, `---`/`+++`, rename/copy lines, C-quoted
names) and its mode lines, hunks and binary parts checked.
"""

from __future__ import annotations

import dataclasses
import re
import sys

TEST_DIRS = frozenset({"test", "tests", "testing"})
# Files Python or pytest execute without being asked: a patch may not add or change them.
STARTUP_FILES = frozenset({"conftest.py", "sitecustomize.py", "usercustomize.py"})
# Modules that a file at the repository's root would replace for `python -m unittest|pytest`
# (the working directory comes before the standard library on sys.path).
SHADOWED_MODULES = frozenset(sys.stdlib_module_names) | {"pytest", "_pytest", "pluggy", "py"}
# git reads these from the work tree: attributes name filters that rewrite files as git writes
# them (the task's test_patch among them), and submodules.
GIT_FILES = frozenset({".gitattributes", ".gitmodules"})
LINK_MODES = frozenset({"120000", "160000"})  # a symbolic link, a submodule (gitlink)


# ----------------------------------------------------------------------------- test paths


def is_test_path(path: str) -> bool:
    """Whether `path` (relative to the repository, or with a/ b/ prefix) is a test file.

    True for anything under (or named) `test`, `tests` or `testing`, and for files named
    `test_*.py`, `*_test.py`, `*_tests.py` or `conftest.py`; compared case-insensitively.
    """
    parts = [p.lower() for p in path.replace("\\", "/").split("/") if p]
    if not parts:
        return False
    name = parts[-1]
    return (any(p in TEST_DIRS for p in parts) or name == "conftest.py"
            or (name.startswith("test_") and name.endswith(".py"))
            or name.endswith(("_test.py", "_tests.py")))


def is_bytecode(path: str) -> bool:
    parts = path.replace("\\", "/").split("/")
    return "__pycache__" in parts or parts[-1].endswith((".pyc", ".pyo"))


def normalize(path: str) -> tuple[str, str | None]:
    """`path` (from the repository's root) as the file system reads it: backslashes as slashes,
    `.` and empty parts dropped; and why it cannot be taken as a path inside the repository
    (absolute, or going up with `..`), or None."""
    path = path.replace("\\", "/")
    if path.startswith("/"):
        return path, "an absolute path"
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        return path, "a path that goes up with `..`"
    return "/".join(parts), None


def spellings(name: str) -> list[str]:
    """The names a patch tool may read from `name`: itself, and, where it holds whitespace, the
    part before it (git and GNU patch take what follows a name as its timestamp)."""
    out = [name, name.strip()]
    if name.split():
        out.append(name.split()[0])
    return list(dict.fromkeys(n for n in out if n))


def _forbidden(path: str) -> str | None:
    """Why a patch may not touch `path` (from the repository's root), or None."""
    path, problem = normalize(path)
    if problem:
        return problem
    parts = [p.lower() for p in path.split("/")]
    name = parts[-1] if parts else ""
    if ".git" in parts:
        return "git's own directory (.git)"
    if name in GIT_FILES:
        return f"a file git reads from the work tree ({name})"
    if is_test_path(path):
        return "a test file"
    if name in STARTUP_FILES:
        return "a file Python runs at start-up"
    if name.endswith(".pth"):
        return "a .pth file (Python runs its import lines at start-up)"
    if is_bytecode(path):
        return "Python bytecode"
    return None


# ----------------------------------------------------------------------------- patch parsing


class _PatchSyntaxError(ValueError):
    pass


@dataclasses.dataclass
class _Section:
    """One file's part of a diff: lines [start, end) of the patch and every name it gives."""

    start: int
    end: int = 0
    prefixed: list[str] = dataclasses.field(default_factory=list)  # a/X, b/X (-p1 strips a/)
    bare: list[str] = dataclasses.field(default_factory=list)  # rename/copy names: X
    unified: bool = False  # has its ---/+++ pair
    modes: list[str] = dataclasses.field(default_factory=list)  # of mode lines: 100644, 120000

    @property
    def paths(self) -> list[str]:
        return [p for p in self.prefixed + self.bare if p != "/dev/null"]

    def in_repository(self) -> list[str]:
        """The names as the repository's paths: without the prefix that -p1 strips."""
        return [p.split("/", 1)[1] for p in self.prefixed if "/" in p
                and p != "/dev/null"] + self.bare


_C_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_GIT_HEADER = re.compile(r"^(old mode|new mode|deleted file mode|new file mode|index|"
                         r"similarity index|dissimilarity index) ")
_RENAME_COPY = re.compile(r"^(rename|copy) (from|to) (.+)$")
_MODE = re.compile(r"^(?:old mode|new mode|deleted file mode|new file mode) +(\d+)")
_INDEX_MODE = re.compile(r"^index [0-9a-f]+\.\.[0-9a-f]+ +(\d+)")
_BINARY_BLOCK = re.compile(r"^(literal|delta) \d+$")


def _unquote(text: str) -> tuple[str, str]:
    """A C-quoted name at the start of `text` (as git writes unusual names) and the rest."""
    out, i = bytearray(), 1
    while i < len(text):
        ch = text[i]
        if ch == '"':
            return out.decode("utf-8", errors="replace"), text[i + 1:]
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt in _C_ESCAPES:
                out.append(_C_ESCAPES[nxt])
                i += 2
                continue
            if re.match(r"[0-7]{3}", text[i + 1:i + 4]):
                out.append(int(text[i + 1:i + 4], 8))
                i += 4
                continue
            raise _PatchSyntaxError(f"bad escape in quoted name {text[:80]!r}")
        out.extend(ch.encode("utf-8"))
        i += 1
    raise _PatchSyntaxError(f"unterminated quoted name {text[:80]!r}")


def _name(text: str) -> str:
    """The name of a ---/+++/rename/copy line's rest: unquoted, without a trailing tab part."""
    if text.startswith('"'):
        return _unquote(text)[0]
    return text.split("\t", 1)[0].rstrip("\r")


def _git_line_names(rest: str) -> list[str]:
    """The names of `diff --git A B`. Unquoted names with spaces are ambiguous: then the split
    where both sides name the same file wins, or, failing that, every split counts."""
    rest = rest.rstrip("\r")
    if rest.startswith('"'):
        first, tail = _unquote(rest)
        tail = tail.lstrip(" ")
        return [first, _unquote(tail)[0] if tail.startswith('"') else tail]
    if ' "' in rest:
        first, _, second = rest.partition(' "')
        return [first, _unquote('"' + second)[0]]
    spaces = [i for i, ch in enumerate(rest) if ch == " "]
    for i in spaces:
        a, b = rest[:i], rest[i + 1:]
        if a.partition("/")[2] == b.partition("/")[2]:
            return [a, b]
    return [half for i in spaces for half in (rest[:i], rest[i + 1:])] or [rest]


def parse_patch(patch: str) -> list[_Section]:
    """The file sections of a git or plain unified diff, reading hunks by their line counts.

    Anything else is refused (context and normal diffs, mail headers, text between files), since
    `patch` would read file names from places this parser does not.
    """
    lines = patch.split("\n")
    sections: list[_Section] = []
    index_names: list[str] = []  # `Index: X` lines (svn), which GNU patch also reads
    i, n = 0, len(lines)

    def new_section(at):
        if sections:
            sections[-1].end = at
        sections.append(_Section(start=at, prefixed=list(index_names)))
        index_names.clear()
        return sections[-1]

    while i < n:
        line = lines[i]
        if line.startswith("diff --git "):
            section = new_section(i)
            section.prefixed += _git_line_names(line[len("diff --git "):])
            i += 1
            while i < n and (_GIT_HEADER.match(lines[i]) or _RENAME_COPY.match(lines[i])):
                moved = _RENAME_COPY.match(lines[i].rstrip("\r"))
                if moved:
                    section.bare.append(_name(moved.group(3)))
                mode = _MODE.match(lines[i]) or _INDEX_MODE.match(lines[i])
                if mode:
                    section.modes.append(mode.group(1))
                i += 1
        elif line.startswith("--- ") and i + 1 < n and lines[i + 1].startswith("+++ "):
            if not sections or sections[-1].unified or sections[-1].end:
                new_section(i)
            section = sections[-1]
            section.unified = True
            section.prefixed += [_name(lines[i][4:]), _name(lines[i + 1][4:])]
            i += 2
            if i >= n or not lines[i].startswith("@@"):
                raise _PatchSyntaxError(f"line {i + 1}: a ---/+++ pair without a hunk")
            while i < n and lines[i].startswith("@@"):
                i = _skip_hunk(lines, i)
        elif line.startswith("GIT binary patch") and sections and not sections[-1].unified:
            i = _skip_binary(lines, i + 1)
            sections[-1].unified = True  # the file's content is given: a new section may start
        elif line.startswith("Binary files ") and sections:
            i += 1
        elif line.startswith("Index: "):
            index_names.append(_name(line[len("Index: "):]))
            i += 1
            if i < n and re.fullmatch(r"=+\r?", lines[i]):
                i += 1
        elif line.startswith("diff ") and not line.startswith("diff --git"):
            new_section(i)  # a `diff -u a b` line; its ---/+++ pair follows
            i += 1
        elif not line.strip():
            i += 1
        else:
            raise _PatchSyntaxError(f"line {i + 1} is not part of a unified diff: {line[:80]!r}")
    if sections:
        sections[-1].end = n
    if index_names:
        raise _PatchSyntaxError(f"an `Index: {index_names[0]}` line with no diff after it")
    return sections


def _skip_hunk(lines: list[str], i: int) -> int:
    match = _HUNK.match(lines[i])
    if not match:
        raise _PatchSyntaxError(f"line {i + 1}: bad hunk header {lines[i][:80]!r}")
    old = 1 if match.group(1) is None else int(match.group(1))
    new = 1 if match.group(2) is None else int(match.group(2))
    start, i = i, i + 1
    while old > 0 or new > 0:
        if i >= len(lines):
            raise _PatchSyntaxError(f"line {start + 1}: the hunk ends early")
        line = lines[i]
        first = line[:1]
        if first in (" ", "") or line == "\r":
            old, new = old - 1, new - 1
        elif first == "-":
            old -= 1
        elif first == "+":
            new -= 1
        elif first != "\\":
            raise _PatchSyntaxError(f"line {i + 1}: the hunk of line {start + 1} ends early")
        if old < 0 or new < 0:
            raise _PatchSyntaxError(f"line {i + 1}: more lines than the hunk of line "
                                    f"{start + 1} counts")
        i += 1
    while i < len(lines) and lines[i].startswith("\\"):  # "\ No newline at end of file"
        i += 1
    return i


def _skip_binary(lines: list[str], i: int) -> int:
    for block in range(2):  # forward data, then optionally the reverse
        if i >= len(lines) or not _BINARY_BLOCK.match(lines[i].rstrip("\r")):
            if block == 0:
                raise _PatchSyntaxError(f"line {i + 1}: `GIT binary patch` without data")
            return i
        i += 1
        while i < len(lines) and lines[i].strip():
            if not re.fullmatch(r"[A-Za-z][0-9A-Za-z!#$%&()*+\-;<=>?@^_`{|}~]+\r?", lines[i]):
                raise _PatchSyntaxError(f"line {i + 1}: not base85 data of a binary patch")
            i += 1
        i += 1  # the blank line after the block
    return i


def patch_paths(patch: str) -> list[str]:
    """Every file name the patch gives (both sides, renames, copies), a/ b/ prefixes kept.

    Raises:
      ValueError: the text is not a unified diff this module can read.
    """
    return list(dict.fromkeys(p for section in parse_patch(patch) for p in section.paths))


def check_patch(patch: str) -> str | None:
    """Why the patch may not be graded, or None when it may (an empty patch may).

    Refused: a patch that names a test file (`is_test_path`), `conftest.py`, `sitecustomize.py`,
    `usercustomize.py`, a `*.pth` file or bytecode anywhere; `.git/`, `.gitattributes` or
    `.gitmodules`; a symbolic link or a submodule (mode 120000 or 160000); a path that is
    absolute or goes up with `..`; or a module or package at the repository's root named like
    one of the standard library's or the test runner's (`SHADOWED_MODULES`: `python -m
    unittest` would import the patch's `unittest.py`). Each name a diff gives (`diff --git a/X
    b/Y`, `---`/`+++`, `rename`/`copy from`/`to`, `Index:`) is checked in every spelling a
    patch tool may read (`spellings`), normalised (`./x`, `a//x`, `x/./y`) and in lower case,
    so that no name that git or GNU patch would write escapes the rules. Text that is not a
    unified diff is refused too (so that `patch` cannot find names this check did not read).
    """
    if not patch.strip():
        return None
    try:
        sections = parse_patch(patch)
    except ValueError as e:
        return f"the patch is not a unified diff this grader reads: {e}"
    names = list(dict.fromkeys(p for section in sections for p in section.paths))
    if not names:
        return "the patch names no file"
    for section in sections:
        link = next((m for m in section.modes if m in LINK_MODES), None)
        if link:
            kind = "a symbolic link" if link == "120000" else "a submodule"
            return (f"the patch adds or changes {kind} (mode {link}): "
                    f"{section.paths[-1] if section.paths else '?'}")
    for name in names:  # a/ b/ prefixes kept: every rule but the root's reads parts only
        for spelling in spellings(name):
            why = _forbidden(spelling)
            if why:
                return f"the patch touches {why}: {name}"
    for name in dict.fromkeys(p for s in sections for p in s.paths + s.in_repository()):
        for spelling in spellings(name):
            module = top_level_module(normalize(spelling.lstrip("/"))[0].lower())
            if module in SHADOWED_MODULES:
                return (f"the patch adds or changes {name}, which would shadow the module "
                        f"{module!r} for the test runner (the repository's root comes first "
                        f"on sys.path)")
    return None


def top_level_module(name: str) -> str | None:
    """The module that `name`, a path from the repository's root, defines there, if any."""
    parts = name.replace("\\", "/").split("/")
    if len(parts) == 1 and parts[0].endswith((".py", ".pyw", ".so", ".pyd")):
        return parts[0].split(".", 1)[0]
    if len(parts) >= 2 and parts[1].split(".", 1)[0] == "__init__":
        return parts[0]
    return None
