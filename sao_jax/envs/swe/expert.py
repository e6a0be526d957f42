"""A scripted expert for SWE tasks: it solves a task through the bash protocol with the gold patch.

For warm-start transcripts and tests. `expert_actions(task)` writes the replies, each a short
thought and one ```bash block:

  1. find the function the gold patch changes (`grep -rn "def NAME" --include=*.py .`; the name
     and the file come from the patch's hunk headers, `@@ -a,b +c,d @@ def NAME(...)`),
  2. read the lines around the change (`sed -n 'A,Bp' FILE`),
  3. apply the fix (the gold patch through a quoted heredoc: `git apply <<'EOF' ... EOF`),
  4. run the visible tests (`python -m unittest -q 2>&1 | tail -n 3`, or pytest's `-q`),
  5. submit (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`).

A patch whose first hunk has no function in its header skips step 1. `compact=True` writes the
short transcripts a small model can afford: no search (step 1), two lines of context in step 2,
the patch without context lines (`git apply --unidiff-zero`; a patch that adds, deletes or
renames a file, or has a binary part, goes whole), and only the test run's last line.
`edit_actions(task)` writes the two replies of the one-line-edit protocol (swe_tiny): read the
file with line numbers (`cat -n FILE`; `read="grep"`: `grep -Hn '' FILE`, whose every line
starts with the file's path, so that the path the edit names is in the lines just read), then
substitute the wrong token on the wrong line and submit in one command (`sed -i '2s/>/</' FILE
&& echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`; `fix="line"`: write the whole line instead,
`sed -i '2c\\    if a > b:' FILE && ...`); `line=` makes it write another line instead (a
teacher's mistake). `play(env, actions)` drives
a real `SWEEnv` with given replies; `teacher_transcript(task, ...)`
plays the expert and returns the `(prompt, [(action, observation), ...])` of
`registry.Transcript`, with the observations the workspace really produced.
"""

from __future__ import annotations

import asyncio
import io
import re
import tokenize

from sao_jax.envs.swe.env import SUBMIT_MARKER, SWEEnv, SWEEnvConfig
from sao_jax.envs.swe.tasks import SWETask

# The expert's version, in the warm start's cache key (`teacher.transcripts`): raise it with
# any change to the replies this module writes, which tests/envs/swe/test_expert.py pins.
VERSION = 1
_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@ ?(.*)$", re.MULTILINE)
_NEW_START = re.compile(r"^@@ -\S+ \+(\d+)")
_DEF = re.compile(r"(?:async\s+)?(def|class)\s+(\w+)")
_CONTEXT_LINES = 3  # shown around the changed lines


def expert_actions(task: SWETask, compact: bool = False) -> list[str]:
    """The expert's replies for `task`, from its gold patch; see the module docstring."""
    path, start, length, definition = _first_hunk(task.patch)
    actions = []
    if definition is not None and not compact:
        kind, name = definition
        actions.append(_reply(f"Let me find `{name}`.",
                              f'grep -rn "{kind} {name}\\b" --include=*.py .'))
    if compact:  # the hunk's own context lines are the first and last 3 of its old lines
        context = 2
        first, last = max(1, start + 3 - context), start + max(length, 1) - 4 + context
    else:
        first, last = max(1, start - _CONTEXT_LINES), start + max(length, 1) + _CONTEXT_LINES
    actions.append(_reply("Let me read the code around it.", f"sed -n '{first},{last}p' {path}"))
    patch, apply = task.patch, "git apply"
    zero = zero_context_patch(patch) if compact else None
    if zero is not None:
        patch, apply = zero, "git apply --unidiff-zero"
    patch = patch if patch.endswith("\n") else patch + "\n"
    delimiter = "EOF"
    while delimiter in patch.splitlines():
        delimiter += "_"
    actions.append(_reply("I see the bug. Let me fix it.",
                          f"{apply} <<'{delimiter}'\n{patch}{delimiter}"))
    runner = "pytest" if task.log_parser == "pytest" else "unittest"
    actions.append(_reply("Let me run the tests.",
                          f"python -m {runner} -q 2>&1 | tail -n {1 if compact else 3}"))
    actions.append(_reply("The fix is done. Submitting.", f"echo {SUBMIT_MARKER}"))
    return actions


def single_line_fix(patch: str) -> tuple[str, int, str]:
    """(file, line number, new text) of a gold patch that replaces one line of one file.

    Raises:
      ValueError: the patch changes more than one line, or more than one file.
    """
    files = _FILE.findall(patch)
    hunks = list(_HUNK.finditer(patch))
    if len(files) != 1 or len(hunks) != 1:
        raise ValueError("not a one-line fix: the patch changes more than one file or hunk")
    line, removed, added = int(_NEW_START.match(hunks[0].group(0)).group(1)), [], []
    for text in patch[hunks[0].end() + 1:].split("\n"):
        if text.startswith("-"):
            removed.append(line)
        elif text.startswith("+"):
            added.append(text[1:])
        elif text.startswith(" ") and not removed:
            line += 1
    if len(removed) != 1 or len(added) != 1:
        raise ValueError("not a one-line fix: the patch removes or adds more than one line")
    return files[0][1], removed[0], added[0]


def sed_substitution(number: int, old: str, new: str) -> str:
    """The sed script (`Ns/PATTERN/REPLACEMENT/[K]`) that turns line `number`, `old`, into `new`,
    where the two differ in one run of Python tokens: the first differing token of `old` to the
    last, with `\\b` around a name or a number, and the occurrence K where earlier matches come
    first on the line (sed counts them as `re.finditer` does here).

    Raises:
      ValueError: the lines are equal, differ by an insertion only, or do not tokenize.
    """
    a, b = _line_tokens(old), _line_tokens(new)
    i = 0
    while i < min(len(a), len(b)) and a[i][2] == b[i][2]:
        i += 1
    j = 0
    while j < min(len(a), len(b)) - i and a[-1 - j][2] == b[-1 - j][2]:
        j += 1
    if i == len(a) - j:
        raise ValueError(f"no token of {old!r} to replace for {new!r}")
    start, end = a[i][0], a[len(a) - 1 - j][1]
    target = old[start:end]
    replacement = new[b[i][0]:b[len(b) - 1 - j][1]] if i < len(b) - j else ""
    word = re.fullmatch(r"\w+", target) is not None
    regex = rf"\b{re.escape(target)}\b" if word else re.escape(target)
    occurrence = 1 + sum(1 for m in re.finditer(regex, old) if m.start() < start)
    delimiter = "|" if "/" in target + replacement else "/"
    pattern = re.sub(r"([.*\[\]^$\\])", r"\\\1", target).replace(delimiter, "\\" + delimiter)
    if word:
        pattern = rf"\b{pattern}\b"
    replacement = replacement.replace("\\", "\\\\").replace("&", "\\&").replace(
        delimiter, "\\" + delimiter)
    return (f"{number}s{delimiter}{pattern}{delimiter}{replacement}{delimiter}"
            + (str(occurrence) if occurrence > 1 else ""))


def _line_tokens(line: str) -> list[tuple[int, int, str]]:
    """(start column, end column, text) of the operator, name, number and string tokens of one
    source line."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, SyntaxError) as e:
        raise ValueError(f"line {line!r} does not tokenize: {e}") from None
    indent = len(line) - len(line.lstrip())
    return [(t.start[1] + indent, t.end[1] + indent, t.string) for t in tokens
            if t.type in (tokenize.OP, tokenize.NAME, tokenize.NUMBER, tokenize.STRING)]


READS = {"cat": "cat -n {path}", "grep": "grep -Hn '' {path}"}  # the edit expert's first command
# how it edits: substitute the changed tokens (`sed_substitution`) or write the whole line
FIXES = ("sub", "line")


def edit_actions(task: SWETask, line: str | None = None, read: str = "cat", fix: str = "sub"
                 ) -> list[str]:
    """The replies of the one-line-edit protocol for `task` (module docstring): `cat -n FILE` (or
    `READS[read]`), then `sed -i 'Ns/OLD/NEW/' FILE` (`sed_substitution`; `fix="line"`: `sed -i
    'Nc\\NEW LINE' FILE`) turning the buggy line into the gold patch's new line (or into
    `line`), and the submission.

    Raises:
      ValueError: the gold patch is not a one-line fix (`single_line_fix`), or no one-run
        substitution makes the line.
    """
    path, number, fixed = single_line_fix(task.patch)
    return edit_replies(path, number, _removed_line(task.patch), fixed if line is None else line,
                        read=read, fix=fix)


def edit_replies(path: str, number: int, buggy: str, line: str, read: str = "cat",
                 fix: str = "sub") -> list[str]:
    """`edit_actions`'s replies for file `path` whose line `number`, `buggy`, becomes `line`."""
    if read not in READS:
        raise ValueError(f"read must be one of {sorted(READS)}, got {read!r}.")
    if fix not in FIXES:
        raise ValueError(f"fix must be one of {FIXES}, got {fix!r}.")
    if fix == "line":
        if "\\" in line or not line.strip() or line == buggy:
            raise ValueError(f"sed's c command cannot write {line!r} in place of {buggy!r}")
        script = f"{number}c\\{line}"
    else:
        script = sed_substitution(number, buggy, line)
    if "'" in script:
        raise ValueError(f"the sed script {script!r} holds a quote")
    return [_reply("Read it.", READS[read].format(path=path)),
            _reply(f"Fix line {number}.", f"sed -i '{script}' {path} && echo {SUBMIT_MARKER}")]


def _removed_line(patch: str) -> str:
    return next(line[1:] for line in patch.split("\n")
                if line.startswith("-") and not line.startswith("--- "))


def zero_context_patch(patch: str) -> str | None:
    """`patch` (git's unified diff of modified text files) without its context lines, for
    `git apply --unidiff-zero`; None for a patch that adds, deletes, renames or copies a file,
    has a binary part or a missing final newline (it is then applied whole)."""
    out: list[str] = []
    old = new = 0
    run: list[str] = []
    run_start = (0, 0)

    def flush():
        if run:
            removed = sum(line.startswith("-") for line in run)
            added = len(run) - removed
            # git's convention: a side with no lines names the line before the change
            o = run_start[0] if removed else run_start[0] - 1
            n = run_start[1] if added else run_start[1] - 1
            out.append(f"@@ -{o},{removed} +{n},{added} @@")
            out.extend(run)
            run.clear()

    for line in patch.splitlines():
        if line.startswith(("new file", "deleted file", "rename ", "copy ", "Binary files",
                            "GIT binary patch", "\\")):
            return None
        if line.startswith("diff --git "):
            flush()
            continue
        if line.startswith(("index ", "old mode", "new mode", "similarity ")):
            continue
        if line.startswith(("--- ", "+++ ")):
            out.append(line)
            continue
        hunk = _HUNK.match(line)
        if hunk:
            flush()
            old, new = int(hunk.group(1)), int(_NEW_START.match(line).group(1))
            continue
        if line.startswith("-") or line.startswith("+"):
            if not run:
                run_start = (old, new)
            run.append(line)
            old += line.startswith("-")
            new += line.startswith("+")
        else:  # a context line
            flush()
            old, new = old + 1, new + 1
    flush()
    return "\n".join(out) + "\n" if out else None


def _reply(thought: str, command: str) -> str:
    return f"{thought}\n```bash\n{command}\n```\n"


def _first_hunk(patch: str) -> tuple[str, int, int, tuple[str, str] | None]:
    """(file, first old line, old line count, ("def" | "class", name) or None) of the patch's
    first hunk. The name is that of the last `def`/`class` among the hunk's lines before its
    first change, else the one in its header (git's function context)."""
    file = _FILE.search(patch)
    hunk = _HUNK.search(patch, file.end()) if file else None
    if file is None or hunk is None:
        raise ValueError("the gold patch has no `diff --git` file with a hunk to read")
    length = 1 if hunk.group(2) is None else int(hunk.group(2))
    names = [m.groups() for m in [_DEF.search(hunk.group(3))] if m]
    for line in patch[hunk.end() + 1:].split("\n"):
        if not line.startswith(" "):
            break
        found = _DEF.match(line[1:].lstrip())
        if found:
            names.append(found.groups())
    return file.group(1), int(hunk.group(1)), length, names[-1] if names else None


async def play(env: SWEEnv, actions: list[str]
               ) -> tuple[tuple[str, list[tuple[str, str]]], float, list[dict]]:
    """Plays `actions` in `env` until it is done or they run out; closes the env either way.

    Returns:
      (transcript, total reward, the info of every step); the transcript is `(prompt,
      [(action, observation), ...])`, the observation "" where the episode ended.
    """
    async with env:
        prompt = env.reset()
        turns, infos, total = [], [], 0.0
        for action in actions:
            result = await env.step(action)
            turns.append((action, result.observation))
            infos.append(result.info)
            total += result.reward
            if result.done:
                break
    return (prompt, turns), total, infos


def play_sync(env: SWEEnv, actions: list[str]):
    """`play` for callers without an event loop."""
    return asyncio.run(play(env, actions))


def teacher_transcript(task: SWETask, config: SWEEnvConfig | None = None, grader=None
                       ) -> tuple[str, list[tuple[str, str]]]:
    """The expert's transcript of `task`, played in a real `SWEEnv` (so the observations are true).

    Args:
      config: the env's; None: `SWEEnvConfig()`.
      grader: None: a `grading.Grader` on `config.workspace`.

    Raises:
      RuntimeError: the expert did not solve the task (the env's reward_reason says why), so the
        transcript would teach a failure.
    """
    config = config or SWEEnvConfig()
    if grader is None:
        from sao_jax.envs.swe.grading import Grader

        grader = Grader(config.workspace)
    transcript, reward, infos = play_sync(SWEEnv(task, config, grader), expert_actions(task))
    if reward != 1.0:
        reason = infos[-1].get("reward_reason", "the episode did not end") if infos else ""
        raise RuntimeError(f"the expert did not solve {task.instance_id}: {reason}")
    return transcript
