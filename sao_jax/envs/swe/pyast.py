"""`ast.parse` and `ast.literal_eval`, one at a time across threads.

CPython 3.11 keeps the AST constructor's recursion depth in state its threads share, so two
parses at once can fail with "SystemError: AST constructor recursion depth mismatch" (cpython
gh-106905). Seen here: a gold patch graded "error" while two grading threads planted canaries.
The grader (`canaries.py`, on its threads) and the reward-hacking monitor (`monitor.py`, on the
env's) parse through these.
"""

from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()


def parse(source: str, **kwargs) -> ast.AST:
    with _LOCK:
        return ast.parse(source, **kwargs)


def literal_eval(source: str):
    with _LOCK:
        return ast.literal_eval(source)
