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
`play(env, actions)` drives a real `SWEEnv` with given replies; `teacher_transcript(task, ...)`
plays the expert and returns the `(prompt, [(action, observation), ...])` of
`train.warm_start.Transcript`, with the observations the workspace really produced.
"""

from __future__ import annotations

import asyncio
import re

from sao_jax.envs.swe.env import SUBMIT_MARKER, SWEEnv, SWEEnvConfig
from sao_jax.envs.swe.tasks import SWETask

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
