"""A scripted expert for SWE tasks: it solves a task through the bash protocol with the gold patch.

For warm-start transcripts and tests. `expert_actions(task)` writes the replies, each a short
thought and one ```bash block:

  1. find the function the gold patch changes (`grep -rn "def NAME" --include=*.py .`; the name
     and the file come from the patch's hunk headers, `@@ -a,b +c,d @@ def NAME(...)`),
  2. read the lines around the change (`sed -n 'A,Bp' FILE`),
  3. apply the fix (the gold patch through a quoted heredoc: `git apply <<'EOF' ... EOF`),
  4. run the visible tests (`python -m unittest -q 2>&1 | tail -n 3`, or pytest's `-q`),
  5. submit (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`).

A patch whose first hunk has no function in its header skips step 1. `play(env, actions)` drives
a real `SWEEnv` with given replies; `teacher_transcript(task, ...)` plays the expert and returns
the `(prompt, [(action, observation), ...])` of `train.warm_start.Transcript`, with the
observations the workspace really produced.
"""

from __future__ import annotations

import asyncio
import re

from sao_jax.envs.swe.env import SUBMIT_MARKER, SWEEnv, SWEEnvConfig
from sao_jax.envs.swe.tasks import SWETask

_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@ ?(.*)$", re.MULTILINE)
_DEF = re.compile(r"(?:async\s+)?(def|class)\s+(\w+)")
_CONTEXT_LINES = 3  # shown around the changed lines


def expert_actions(task: SWETask) -> list[str]:
    """The expert's replies for `task`, from its gold patch; see the module docstring."""
    path, start, length, definition = _first_hunk(task.patch)
    actions = []
    if definition is not None:
        kind, name = definition
        actions.append(_reply(f"Let me find `{name}`.",
                              f'grep -rn "{kind} {name}\\b" --include=*.py .'))
    first, last = max(1, start - _CONTEXT_LINES), start + max(length, 1) + _CONTEXT_LINES
    actions.append(_reply("Let me read the code around it.", f"sed -n '{first},{last}p' {path}"))
    patch = task.patch if task.patch.endswith("\n") else task.patch + "\n"
    delimiter = "EOF"
    while delimiter in patch.splitlines():
        delimiter += "_"
    actions.append(_reply("I see the bug. Let me fix it.",
                          f"git apply <<'{delimiter}'\n{patch}{delimiter}"))
    runner = "pytest" if task.log_parser == "pytest" else "unittest"
    actions.append(_reply("Let me run the tests.", f"python -m {runner} -q 2>&1 | tail -n 3"))
    actions.append(_reply("The fix is done. Submitting.", f"echo {SUBMIT_MARKER}"))
    return actions


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
