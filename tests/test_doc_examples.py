"""Every Python example of the README and docs/ runs as written.

Each document's ```python blocks run in order in one fresh namespace, like a notebook's cells,
from the repository root, in a child process per document (so that what an example registers,
or the JAX state it makes, stays out of this process). A failure names the document, the line
of the block and the error; the traceback's line numbers are the document's. The child inherits
the session's 8 simulated CPU devices (tests/conftest.py), which docs/models.md's mesh needs.

A block may be left out by an HTML comment on the line before it:

- `<!-- run by tests/x/test_y.py -->`: a test of its own runs it (in a registry of its own, say);
  the named file must exist and cite the document (`docs/algorithm.md`);
- `<!-- not run: <reason> -->`: it cannot run here in seconds (it trains, needs a TPU, starts
  servers); the reason is required, and `NOT_RUN` counts such blocks, so that another one is a
  choice made on purpose.

A left-out block must still compile. A snippet fenced without a language that a reader would
paste into Python (it imports something) must be fenced as ```python, so that it runs here too.
"""

import glob
import json
import os
import re
import subprocess
import sys
from typing import NamedTuple

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_RUN = 1  # docs/lab.md: its API tour launches training runs and a grid

FENCE = re.compile(r"^```(?P<lang>[\w+-]*)[ \t]*$")
MARK = re.compile(r"^<!--\s*(?:run by (?P<test>\S+?)|not run:(?P<reason>.*?))\s*-->\s*$")
PYTHON_LINE = re.compile(r"^(?:import [\w.]+|from [\w.]+ import \w)", re.MULTILINE)

# The child: runs the blocks it reads from stdin in one namespace; on the first error it prints
# the traceback and a last line `FAILED <doc>:<line>: <error>`, and exits 1.
RUNNER = r"""
import json, sys, traceback
job = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for line, code in job["blocks"]:
    try:
        exec(compile("\n" * line + code, job["doc"], "exec"), namespace)
    except BaseException as e:
        traceback.print_exc()
        print(f"FAILED {job['doc']}:{line}: the block there raised "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
"""


class Block(NamedTuple):
    line: int  # of its opening fence, 1-based
    lang: str
    code: str
    mark: str | None  # the HTML comment on the line before the fence


def docs(root=REPO):
    """The README and docs/*.md, relative to `root`."""
    found = sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    if os.path.isfile(os.path.join(root, "README.md")):
        found.insert(0, os.path.join(root, "README.md"))
    return [os.path.relpath(path, root) for path in found]


def read(root, path):
    with open(os.path.join(root, path), encoding="utf-8") as f:
        return f.read()


def blocks(text):
    """Every fenced block of a markdown text."""
    lines, found, i = text.split("\n"), [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        before = lines[i - 1].strip() if i > 0 else ""
        found.append(Block(i + 1, opening["lang"], "\n".join(lines[i + 1:end]) + "\n",
                           before if before.startswith("<!--") else None))
        i = end + 1
    return found


def python_blocks(root, doc):
    return [b for b in blocks(read(root, doc)) if b.lang == "python"]


def marked(root=REPO):
    """`(doc, block, match of its mark)` of every Python block with a mark."""
    return [(doc, b, MARK.match(b.mark)) for doc in docs(root)
            for b in python_blocks(root, doc) if b.mark is not None]


def run_doc(root, doc, tmp_path):
    """Runs `doc`'s unmarked Python blocks in a child; its exit code and stderr."""
    job = {"doc": doc, "blocks": [(b.line, b.code) for b in python_blocks(root, doc)
                                  if b.mark is None]}
    env = dict(os.environ, TMPDIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    child = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(job), cwd=root,
                           env=env, capture_output=True, text=True, timeout=300)
    return child.returncode, child.stderr


@pytest.mark.parametrize("doc", [d for d in docs() if any(
    b.mark is None for b in python_blocks(REPO, d))])
def test_the_examples_run_as_written(doc, tmp_path):
    code, stderr = run_doc(REPO, doc, tmp_path)
    failed = [line for line in stderr.splitlines() if line.startswith("FAILED ")]
    assert code == 0, (failed[-1] if failed else f"{doc}: exit code {code}") + "\n" + stderr[-6000:]


def test_every_block_left_out_is_marked_with_a_test_or_a_reason():
    problems, not_run = [], []
    for doc, block, mark in marked():
        where = f"{doc}:{block.line}"
        try:
            compile("\n" * block.line + block.code, doc, "exec")
        except SyntaxError as e:
            problems.append(f"{where}: does not compile: {e}")
        if mark is None:
            problems.append(f"{where}: {block.mark!r} is neither `<!-- run by tests/... -->` "
                            "nor `<!-- not run: <reason> -->`")
        elif mark["test"]:
            if not os.path.isfile(os.path.join(REPO, mark["test"])):
                problems.append(f"{where}: {mark['test']} does not exist")
            elif doc not in read(REPO, mark["test"]):
                problems.append(f"{where}: {mark['test']} does not mention {doc}")
        elif not mark["reason"].strip():
            problems.append(f"{where}: `not run` without a reason")
        else:
            not_run.append(f"{where}: {mark['reason'].strip()}")
    assert not problems, "\n".join(problems)
    assert len(not_run) == NOT_RUN, (f"{len(not_run)} blocks are not run, NOT_RUN says {NOT_RUN}:"
                                     "\n" + "\n".join(not_run))


def test_no_python_example_is_fenced_without_its_language():
    found = [f"{doc}:{b.line}" for doc in docs() for b in blocks(read(REPO, doc))
             if b.lang == "" and PYTHON_LINE.search(b.code)]
    assert not found, "fence these as ```python so that they run: " + ", ".join(found)


def test_the_checks_catch_a_broken_example(tmp_path):
    """A planted doc: its blocks share one namespace, a block that fails is reported by its
    document, line and error, marks are read, a Python snippet in a plain fence is found."""
    root, doc = tmp_path / "repo", os.path.join("docs", "a.md")  # (not a citation: test_docs.py)
    (root / "docs").mkdir(parents=True)
    (root / doc).write_text(
        "# A\n\n```python\nx = 1\n```\n\n<!-- not run: it trains -->\n```python\ntrain()\n```\n\n"
        "```python\nassert x == 1\nundefined_name\n```\n\n```\nimport os\n```\n")
    found = python_blocks(str(root), doc)
    assert [(b.line, b.mark) for b in found] == [
        (3, None), (8, "<!-- not run: it trains -->"), (12, None)]
    assert MARK.match(found[1].mark)["reason"].strip() == "it trains"
    assert [b.line for b in blocks((root / doc).read_text())
            if b.lang == "" and PYTHON_LINE.search(b.code)] == [17]

    code, stderr = run_doc(str(root), doc, tmp_path)
    assert code == 1
    assert (f"FAILED {doc}:12: the block there raised NameError: name 'undefined_name' is "
            "not defined") in stderr
    assert f'File "{doc}", line 14' in stderr  # the document's own line
