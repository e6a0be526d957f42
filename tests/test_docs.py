"""Every document a file of the repository cites is in the repository, and so is the section.

The code cites its math and design as `docs/algorithm.md §2` or `docs/design.md, "Prompts"`: a
numbered section by its number (a range `§1-§4` by each), any other by its exact heading (with or
without its number). These tests fail on a citation of a file under `docs/` that does not exist, of
a section its file does not have, and on any citation of the project's working notes outside the
clone (the upper-case note files, or a path through `../shared`), which a clone does not have.
Markdown links between the docs (`[x](algorithm.md)`) must resolve too.
"""

import json
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("sao_jax", "kernels", "experiments", "tests", "benchmarks", "docs", "README.md",
           "Makefile", "setup.py", "pyproject.toml")
SUFFIXES = (".py", ".md", ".ipynb", ".proto", ".toml", ".cfg", ".yaml", ".yml", ".sh")
SKIPPED_DIRS = {".venv", "__pycache__", ".git", ".pytest_cache", ".ruff_cache", ".hypothesis",
                "node_modules"}
THIS_FILE = os.path.join("tests", "test_docs.py")  # its planted bad references are on purpose

# Written so that this file does not match itself.
OUTSIDE = re.compile(r"\b(?:ALGORITHM|DESIGN|STYLE)\.md\b|\.\./shared\b|shared/paper\b")
CITATION = re.compile(
    r"docs/(?P<file>[A-Za-z0-9_.-]+?\.md)\b"
    r"(?:,?[ \t]*(?:\n[ \t]*(?:#[ \t]*)?)?"  # the section may follow on the next (comment) line
    r"(?:§(?P<first>\d+)(?:[ \t]*[-–][ \t]*§?(?P<last>\d+))?"
    r"|\"(?P<title>[^\"\n]+(?:\n[^\"\n]+)?)\"))?")
LINK = re.compile(r"\]\((?P<target>[^)#\s]+\.md)(?:#[^)]*)?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<text>.+?)[ \t]*#*[ \t]*$")
NUMBERED = re.compile(r"^(?P<number>\d+)\.[ \t]+(?P<title>.+)$")


def scanned_files(root):
    """`(relative path, text)` of every text file the checks read under `root`."""
    for entry in SCANNED:
        path = os.path.join(root, entry)
        if os.path.isfile(path):
            yield entry, read_text(path)
            continue
        for directory, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
            for name in sorted(files):
                full = os.path.join(directory, name)
                relative = os.path.relpath(full, root)
                if name.endswith(SUFFIXES) and relative != THIS_FILE:
                    yield relative, read_text(full)


def read_text(path):
    """The file's text; a notebook's cell sources, joined (its JSON splits lines into strings)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if path.endswith(".ipynb"):
        cells = json.loads(text)["cells"]
        text = "\n".join("".join(cell["source"]) for cell in cells)
    return text


def sections(path):
    """`(numbers, titles)` of a markdown file's headings, outside code fences."""
    numbers, titles = set(), set()
    fenced = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            heading = None if fenced else HEADING.match(line.rstrip("\n"))
            if heading is None:
                continue
            text = normalise(heading["text"])
            titles.add(text)
            numbered = NUMBERED.match(text)
            if numbered:
                numbers.add(int(numbered["number"]))
                titles.add(numbered["title"])
    return numbers, titles


def normalise(title):
    """A title with line breaks, comment markers and runs of spaces made single spaces."""
    return " ".join(re.sub(r"\n[ \t]*#?", " ", title).split())


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


def outside_citations(root):
    """`path:line: text` of every citation of the notes outside the repository."""
    return [f"{path}:{line_of(text, m.start())}: {m.group(0)}"
            for path, text in scanned_files(root) for m in OUTSIDE.finditer(text)]


def broken_citations(root):
    """`path:line: what is wrong` for every `docs/...md` citation (and link between the docs)
    whose file or section does not exist."""
    problems, cache = [], {}

    def sections_of(relative):
        if relative not in cache:
            full = os.path.join(root, relative)
            cache[relative] = sections(full) if os.path.isfile(full) else None
        return cache[relative]

    for path, text in scanned_files(root):
        for m in CITATION.finditer(text):
            where = f"{path}:{line_of(text, m.start())}"
            target = f"docs/{m['file']}"
            found = sections_of(target)
            if found is None:
                problems.append(f"{where}: cites {target}, which does not exist")
                continue
            numbers, titles = found
            if m["first"]:
                first, last = int(m["first"]), int(m["last"] or m["first"])
                missing = [n for n in range(first, last + 1) if n not in numbers]
                if missing or last < first:
                    problems.append(f"{where}: cites {target} §{m['first']}"
                                    f"{'-§' + m['last'] if m['last'] else ''}; its numbered "
                                    f"sections are {sorted(numbers)}")
            elif m["title"] and normalise(m["title"]) not in titles:
                problems.append(f"{where}: cites {target}, \"{normalise(m['title'])}\", which "
                                f"is not one of its headings: {sorted(titles)}")
        if path.startswith("docs" + os.sep) and path.endswith(".md"):
            for m in LINK.finditer(text):
                if "://" in m["target"]:
                    continue
                linked = os.path.normpath(os.path.join(os.path.dirname(path), m["target"]))
                if not os.path.isfile(os.path.join(root, linked)):
                    problems.append(f"{path}:{line_of(text, m.start())}: links to {m['target']}, "
                                    "which does not exist")
    return problems


def test_nothing_cites_the_notes_outside_the_repository():
    found = outside_citations(REPO)
    assert not found, ("cite docs/algorithm.md or docs/design.md instead (a clone has no notes "
                       "outside the repository):\n" + "\n".join(found))


def test_every_cited_doc_and_section_exists():
    problems = broken_citations(REPO)
    assert not problems, "\n".join(problems)


def test_the_readme_links_every_guide():
    """A guide under docs/ that the README does not link is one a reader never finds
    (docs/environments.md was missing from its table of guides)."""
    readme = read_text(os.path.join(REPO, "README.md"))
    guides = sorted(f for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md"))
    assert guides and not [g for g in guides if f"(docs/{g})" not in readme]


def test_the_docs_have_the_sections_the_code_cites():
    numbers, titles = sections(os.path.join(REPO, "docs", "algorithm.md"))
    assert numbers == {1, 2, 3, 4, 5, 6} and "Notation" in titles
    _, titles = sections(os.path.join(REPO, "docs", "design.md"))
    assert {"Processes", "Prompts", "Rules that keep it real",
            "Numerics that DIS depends on"} <= titles
    assert sum(1 for _ in CITATION.finditer(
        "\n".join(text for _, text in scanned_files(REPO)))) >= 40  # the checks see them


def test_the_checks_catch_planted_bad_references(tmp_path):
    """Each kind of bad reference, planted in a tiny tree, is reported; good ones are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "algorithm.md").write_text(
        "# A\n\n## Notation\n\n```\n## 9. not a heading: fenced\n```\n\n## 1. DIS: the loss\n"
        "\n## 2. GAE\n\nSee [design](design.md) and [gone](gone.md).\n")
    (tmp_path / "sao_jax").mkdir()
    notes = "ALGORITHM" + ".md"  # not spelled out, so that this file passes its own check
    (tmp_path / "sao_jax" / "good.py").write_text(
        '"""docs/algorithm.md §1-§2, docs/algorithm.md, "Notation", docs/algorithm.md §2.\n'
        '# (docs/algorithm.md, "DIS: the\n# loss")\n"""\n')
    (tmp_path / "sao_jax" / "bad.py").write_text(
        f'"""{notes} §2; see ../shared/x and the shared/paper folder.\n'
        'docs/algorithm.md §7, docs/algorithm.md §1-§9, docs/algorithm.md §9 (fenced only)\n'
        'docs/algorithm.md, "Processes"; docs/design.md §1.\n"""\n')

    assert outside_citations(tmp_path) == [f"sao_jax/bad.py:1: {notes}",
                                           "sao_jax/bad.py:1: ../shared",
                                           "sao_jax/bad.py:1: shared/paper"]
    problems = broken_citations(tmp_path)
    assert not [p for p in problems if p.startswith("sao_jax/good.py")], problems
    assert [p.split(": ", 1)[1].split(";")[0].split(",")[0] for p in problems] == [
        "cites docs/algorithm.md §7",
        "cites docs/algorithm.md §1-§9",
        "cites docs/algorithm.md §9",
        "cites docs/algorithm.md",  # "Processes"
        "cites docs/design.md",  # which does not exist
        "links to design.md",
        "links to gone.md",
    ], problems
