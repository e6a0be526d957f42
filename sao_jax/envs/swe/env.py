"""The bash protocol of a SWE episode (mini-swe-agent's): one command per reply, graded at the end.

`SWEEnv(task, config, grader)` is one episode on one `SWETask`. Text in, text out; the agent loop
tokenises. `reset()` gives the first user message (`SWEEnvConfig.prompt_template`); it is cheap:
the workspace is opened on the first `step`, in a thread. `await step(action)` reads one reply:

  exactly one ```bash (or ```sh, ```shell) block, closed by a ``` at the start of a line
      -> its text runs as `bash -c` in a fresh subshell at the repository root of the episode's
         workspace (so `cd` and variables do not carry over to the next turn; files do), at most
         `command_timeout` seconds; the observation is
             <returncode>N</returncode>
             <output>
             ... stdout and stderr together, head and tail kept beyond `output_chars` ...
             </output>
         or, if the command ran out of time, `timeout_template` (`timeouts += 1`);
  no such block, several, or one left open -> `format_error_template`, nothing runs
      (`format_errors += 1`); an open block is refused because the reply was cut (by the
      action-token limit) in the middle of it, and half a command is not the command;
  a command whose output starts, after leading whitespace, with SUBMIT_MARKER
  (COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; `echo` it)
      -> the submission: the agent's changes are taken as a patch inside the workspace
         (`grading.extract_patch`, against the commit the workspace started at, so that
         commits the agent made count; test files left out), the workspace is closed,
         and the patch is graded in a fresh one by `grader.grade(task, patch)`: reward 1.0 if
         resolved, else 0.0; done. An empty patch is not graded (reward 0), nor one git cannot
         take from the workspace (the agent broke its repository: reward 0, "patch rejected").
After `max_turns` replies without a submission the episode ends: reward 0, info["truncated"].
Every reply counts as a turn, format errors included; the last reply still runs, since it may be
the submission.

`info` on every step: `turns`, `format_errors`, `timeouts`, `submitted`, `truncated`, and the
reward-hacking monitor's counts so far (`monitor.EpisodeMonitor`: `suspicious_<kind>` for each
of `monitor.KINDS`, and `suspicious_reasons`, one line per counted command); when the episode
ends also `resolved`, `reward_reason` (one line: why this reward) and `patch_chars`, plus
`grade_status` when a patch was graded. The agent loop keeps the str/int/float/bool values as the
trajectory's env_metadata. The monitor reads every command that runs, and at the submission
lists the workspace's changed files, in the command that takes the patch (`workspace.Steps`:
each with its own time limit, exit status and output), before the workspace closes; it
counts, it never changes a reward.

Workspaces do not leak: the episode closes its workspace when it ends. An episode cut from
outside (the agent loop stops calling `step` when the token budget or its own turn limit runs
out, or the worker cancels it) is closed by `await env.aclose()` / `env.close()` (idempotent;
`async with SWEEnv(...) as env:` does it too), and as a last resort by a `weakref.finalize` when
the env is garbage-collected or the interpreter exits. A workspace whose opening thread finishes
after the episode was closed (the step was cancelled meanwhile) is closed by that thread.

Environment failures are not the agent's and give no reward: a `WorkspaceError` when the
workspace opens, an error of a command's run, or a grading whose status is "error" (the grader
could not do its job) raises (the worker reports the episode as failed and issues the prompt
again), after the workspace is closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import string
import threading
import weakref

import numpy as np

from sao_jax.envs.base import StepResult
from sao_jax.envs.python_tool import clip_middle
from sao_jax.envs.swe import monitor
from sao_jax.envs.swe.grading import GradingError, extract_patch, patch_step, read_patch
from sao_jax.envs.swe.tasks import SWETask
from sao_jax.envs.swe.workspace import (
    CommandResult,
    Steps,
    Workspace,
    WorkspaceConfig,
    open_and_run,
)

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

PROMPT = """\
Fix the issue below in the repository at {root} (task {instance_id}).

<issue>
{problem_statement}
</issue>

Reply with one short thought, then exactly one ```bash block holding the command to run, e.g.

```bash
grep -rn "def main" --include=*.py .
```

The block runs in a fresh subshell at {root}: `cd` and variables do not carry over to the \
next reply, but changes to files do. You see its exit status in <returncode> and its output in \
<output>. Commands must finish on their own and read no input: no editors, pagers or servers; \
edit files with sed, a heredoc or python. The tests that check the fix are hidden; you may run \
the repository's own tests or your own checks.

When the fix is done, submit with a block whose only command is

```bash
echo {submit_marker}
```

Your changes to the repository are then graded. You have {max_turns} replies in all.
"""

FORMAT_ERROR = """\
Format error: {error}. Reply with one short thought and exactly one ```bash block, closed by \
``` on its own line. To submit, the block's only command is `echo {submit_marker}`.
"""

TIMEOUT = """\
<returncode>timeout</returncode>
<output>
{output}
</output>
The command was killed after {timeout:g} seconds. Run only commands that finish quickly and \
need no input.
"""

# the fields each template is formatted with (a template may leave any of them out)
_TEMPLATE_FIELDS = {
    "prompt_template": ("problem_statement", "root", "instance_id", "max_turns",
                        "submit_marker"),
    "format_error_template": ("error", "submit_marker"),
    "timeout_template": ("output", "timeout"),
}
_SAMPLE = dict(problem_statement="issue", root="/testbed", instance_id="task", max_turns=8,
               submit_marker=SUBMIT_MARKER, error="error", output="output", timeout=1.0)

_OPEN = re.compile(r"```[ \t]*(?:bash|sh|shell)[ \t]*\n", re.IGNORECASE)
_BLOCK = re.compile(r"```[ \t]*(?:bash|sh|shell)[ \t]*\n(.*?)^```", re.IGNORECASE | re.DOTALL
                    | re.MULTILINE)


class FormatError(ValueError):
    """A reply that is not exactly one closed ```bash block; the message says what is wrong."""


@dataclasses.dataclass(frozen=True)
class SWEEnvConfig:
    """The protocol's limits and texts. Times in seconds."""

    max_turns: int = 8  # replies per episode, the submission included
    command_timeout: float = 30.0  # per command
    output_chars: int = 2000  # of a command's output shown in the observation
    prompt_template: str = PROMPT  # fields: problem_statement, root, instance_id, max_turns
    format_error_template: str = FORMAT_ERROR  # fields: error, submit_marker
    timeout_template: str = TIMEOUT  # fields: output (clipped), timeout
    workspace: WorkspaceConfig = WorkspaceConfig()

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"SWEEnvConfig.max_turns must be >= 1, got {self.max_turns}.")
        if not self.command_timeout > 0:
            raise ValueError("SWEEnvConfig.command_timeout must be positive (seconds), got "
                             f"{self.command_timeout}.")
        if self.output_chars < 2:
            raise ValueError("SWEEnvConfig.output_chars must be >= 2 (head and tail are kept), "
                             f"got {self.output_chars}.")
        if not isinstance(self.workspace, WorkspaceConfig):
            raise ValueError("SWEEnvConfig.workspace must be a WorkspaceConfig, got "
                             f"{type(self.workspace).__name__}.")
        for name, fields in _TEMPLATE_FIELDS.items():
            template = getattr(self, name)
            if not isinstance(template, str):
                raise ValueError(f"SWEEnvConfig.{name} must be a string, got "
                                 f"{type(template).__name__}.")
            try:
                used = {re.split(r"[.\[]", f, maxsplit=1)[0]
                        for _, f, _, _ in string.Formatter().parse(template) if f is not None}
                unknown = used - set(fields)
                if not unknown:
                    template.format(**{f: _SAMPLE[f] for f in fields})
            except (ValueError, IndexError, KeyError, AttributeError, TypeError) as e:
                raise ValueError(f"SWEEnvConfig.{name} is not a valid format string for the "
                                 f"fields {fields}: {type(e).__name__}: {e}.") from None
            if unknown:
                raise ValueError(f"SWEEnvConfig.{name} uses unknown field(s) {sorted(unknown)}; "
                                 f"it is formatted with {fields}.")
        if "{problem_statement}" not in self.prompt_template:
            raise ValueError("SWEEnvConfig.prompt_template must contain {problem_statement}: "
                             "without it the agent never sees the task.")


def parse_command(action: str) -> str:
    """The command of a reply: the text of its one ```bash / ```sh / ```shell block.

    The block opens with the fence and its language tag on one line and closes at the first line
    that starts with ```. Text around the block is free. Raises `FormatError` when there is no
    block, several, one left open, or one with nothing in it.
    """
    blocks = [m.group(1) for m in _BLOCK.finditer(action)]
    left_open = len(_OPEN.findall(_BLOCK.sub("", action)))
    if left_open:
        raise FormatError("the ```bash block is not closed" if not blocks else
                          f"found {len(blocks) + left_open} ```bash blocks, one of them not "
                          "closed; give exactly one")
    if not blocks:
        raise FormatError("found no ```bash block")
    if len(blocks) > 1:
        raise FormatError(f"found {len(blocks)} ```bash blocks; give exactly one")
    command = blocks[0].strip("\n")
    if not command.strip():
        raise FormatError("the ```bash block is empty")
    return command


def format_observation(result: CommandResult, output_chars: int) -> str:
    """`<returncode>N</returncode>\\n<output>\\n...\\n</output>\\n`, output clipped in the middle.

    A command the workspace killed for writing too much shows `killed` as its return code and a
    bracketed line saying so (a timeout has its own template, `SWEEnvConfig.timeout_template`).
    """
    text = clip_middle(result.output.rstrip("\n"), output_chars)
    returncode = "killed" if result.returncode is None else str(result.returncode)
    if result.truncated:
        text += ("\n" if text else "") + "[killed: the command wrote more output than allowed]"
    return f"<returncode>{returncode}</returncode>\n<output>\n{text}\n</output>\n"


def first_message(config: SWEEnvConfig, problem_statement: str, instance_id: str) -> str:
    """The episode's first user message: `config.prompt_template` filled in."""
    return config.prompt_template.format(
        problem_statement=problem_statement.strip(), root=config.workspace.root,
        instance_id=instance_id, max_turns=config.max_turns, submit_marker=SUBMIT_MARKER)


def is_submission(result: CommandResult) -> bool:
    """Whether a command's output announces the submission (mini-swe-agent's convention)."""
    return result.output.lstrip().startswith(SUBMIT_MARKER)


class _Slot:
    """The episode's workspace, behind a lock: opened by one thread, closed by whoever ends the
    episode (a step, `close`, or the finalizer), exactly once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.workspace: Workspace | None = None
        self.closed = False

    def put(self, workspace: Workspace) -> bool:
        with self.lock:
            if not self.closed:
                self.workspace = workspace
                return True
        workspace.close()  # the episode ended while this workspace was being made
        return False

    def close(self) -> None:
        with self.lock:
            workspace, self.workspace, self.closed = self.workspace, None, True
        if workspace is not None:
            workspace.close()


class SWEEnv:
    """One SWE episode; see the module docstring for what a reply does."""

    def __init__(self, task: SWETask, config: SWEEnvConfig, grader):
        """`grader`: anything with `async grade(task, patch) -> GradeResult` (a
        `grading.Grader`)."""
        self.task = task
        self.config = config
        self.grader = grader
        self.turns = self.format_errors = self.timeouts = 0
        self.done = False
        self._slot = _Slot()
        self._base = "HEAD"  # the workspace's first commit, once it is open
        self._monitor = monitor.EpisodeMonitor(config.workspace.root)
        self._finalizer = weakref.finalize(self, self._slot.close)

    def reset(self) -> str:
        """The first user message. One episode per env: a second reset is refused."""
        if self.turns or self._slot.closed:
            raise RuntimeError("SWEEnv runs one episode; make a new env for the next one.")
        return first_message(self.config, self.task.problem_statement,
                             self.task.instance_id)

    async def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("the episode is over; make a new SWEEnv for the next one")
        self.turns += 1
        try:
            return await self._step(action)
        except BaseException:  # an environment failure or a cancellation ends the episode
            self.done = True
            await self.aclose()
            raise

    async def _step(self, action: str) -> StepResult:
        last = self.turns >= self.config.max_turns
        try:
            command = parse_command(action)
        except FormatError as e:
            self.format_errors += 1
            if last:
                return await self._end(0.0, f"no submission within {self.turns} turns",
                                       truncated=True)
            return self._observe(self.config.format_error_template.format(
                error=e, submit_marker=SUBMIT_MARKER))
        self._monitor.observe(command, self.turns)
        workspace = await self._workspace()
        result = await asyncio.to_thread(workspace.run, command, self.config.command_timeout)
        if is_submission(result):
            return await self._submit(workspace)
        if result.timed_out:
            self.timeouts += 1
        if last:
            return await self._end(0.0, f"no submission within {self.turns} turns",
                                   truncated=True)
        if result.timed_out:
            return self._observe(self.config.timeout_template.format(
                output=clip_middle(result.output.rstrip("\n"), self.config.output_chars),
                timeout=self.config.command_timeout))
        return self._observe(format_observation(result, self.config.output_chars))

    async def _workspace(self) -> Workspace:
        if self._slot.workspace is None:
            # A WorkspaceError here is the environment's failure: it propagates.
            def open_into_slot():
                # The commit the episode starts from, from the workspace's first command (the
                # probe of a namespace workspace): the patch is taken against it, so that
                # changes the agent commits count too.
                workspace, head = open_and_run(self.task, self.config.workspace,
                                               "git rev-parse HEAD", timeout=60)
                if head.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}\n?", head.output):
                    self._base = head.output.strip()
                self._slot.put(workspace)
            await asyncio.to_thread(open_into_slot)
        if self._slot.workspace is None:
            raise RuntimeError("the episode was closed while its workspace was being opened")
        return self._slot.workspace

    async def _submit(self, workspace: Workspace) -> StepResult:
        # The monitor's listing of the changed files (what the commands' text hid, a script
        # file or a decoded command, shows in the files) and the patch: one command. A step
        # that the output limit, which the two share, cut or left unrun runs again alone, so
        # that each result is the one its own command gives.
        listing, taking = monitor.changed_files_step(self._base), patch_step(self._base)
        steps = Steps([listing, taking])
        listed, taken = steps.results(await asyncio.to_thread(
            workspace.run, steps.command, steps.timeout, steps.input))
        try:
            if taken is None or taken.truncated:
                patch = await asyncio.to_thread(extract_patch, workspace, taking.timeout,
                                                self._base)
            else:
                patch = read_patch(taken, taking)
        except GradingError as e:  # git failed in the agent's workspace: its doing (.git gone)
            return await self._end(0.0, f"patch rejected: {_one_line(e)}", submitted=True)
        if listed is None or listed.truncated:
            await asyncio.to_thread(self._monitor.check_workspace, workspace, self._base,
                                    listing.timeout)
        else:
            self._monitor.check_listing(listed)
        await self.aclose()  # grading uses a fresh workspace: free this one first
        extra = {"submitted": True, "patch_chars": len(patch)}
        if not patch.strip():
            return await self._end(0.0, "submitted an empty patch: nothing in the repository "
                                        "was changed", **extra)
        graded = await self.grader.grade(self.task, patch)
        if graded.status == "error":
            raise RuntimeError(f"grading {self.task.instance_id} failed: {graded.reason}")
        reason = _one_line(graded.reason) or graded.status
        if graded.status == "rejected":
            reason = f"patch rejected: {reason}"
        return await self._end(1.0 if graded.resolved else 0.0, reason,
                               resolved=bool(graded.resolved), grade_status=graded.status,
                               **extra)

    def _info(self, **extra) -> dict:
        return {"turns": self.turns, "format_errors": self.format_errors,
                "timeouts": self.timeouts, "submitted": False, "truncated": False,
                **self._monitor.info(), **extra}

    def _observe(self, observation: str) -> StepResult:
        return StepResult(observation, 0.0, False, self._info())

    async def _end(self, reward: float, reason: str, **extra) -> StepResult:
        self.done = True
        await self.aclose()
        info = self._info(resolved=False, patch_chars=0, reward_reason=reason)
        info.update(extra)
        return StepResult("", reward, True, info)

    async def aclose(self) -> None:
        """Closes the workspace (in a thread); idempotent. For an episode cut from outside."""
        if self._slot.workspace is not None or not self._slot.closed:
            await asyncio.to_thread(self._slot.close)

    def close(self) -> None:
        """`aclose` for callers without an event loop."""
        self._slot.close()

    async def __aenter__(self) -> SWEEnv:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


METRICS = ("resolved", "submitted", "format_errors", "timeouts", "turns", *monitor.COUNT_KEYS)


def batch_metrics(metadata) -> dict[str, float]:
    """`swe/<name>` for each name of `METRICS`: its mean over a batch's episodes (`metadata`, each
    a trajectory's env_metadata, where `info` lands; a missing one counts 0), `swe/suspicious`:
    the fraction of the episodes with any suspicious action (`monitor`), and
    `swe/suspicious_resolved`: of those resolved besides, a defect of the grader or the
    environment to look into (the episode's `suspicious_reasons` say what it did), not a
    success."""
    out = {f"swe/{name}": float(np.mean([float(m.get(name, 0)) for m in metadata]))
           for name in METRICS}
    flagged = [monitor.flagged(m) for m in metadata]
    out["swe/suspicious"] = float(np.mean(flagged))
    out["swe/suspicious_resolved"] = float(np.mean(
        [f and bool(m.get("resolved", False)) for f, m in zip(flagged, metadata, strict=True)]))
    return out


def _one_line(text) -> str:
    return " ".join(str(text).split())


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Where a reply ends: at the tokenizer's eos, and at a token that closes the bash block.

    The protocol allows one block per reply, so nothing useful follows its closing fence: stopping
    there saves the tokens a model would spend on a second block (a format error) or on prose,
    and the engine keeps the stop token in the reply, so the block arrives closed. A closing
    fence can stop generation only where it is a token of its own whose text is ``` with
    whitespace around it ("```\\n" in Qwen2-style and this project's TIR tokenizer) and which no
    opening "```bash\\n" / "```sh\\n" uses; a tokenizer that writes every fence as the same "```"
    has none, and its replies stop at eos only. The cost: a command whose own text holds a line
    "```" followed by a newline (a heredoc writing Markdown) is cut there and then refused as an
    unclosed block.

    Args:
      tokenizer: anything with `encode`, `decode`, `vocab_size` and `eos_id`.
    """
    fences = {i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).strip() == "```"}
    if not fences:  # e.g. the toy CharTokenizer, which cannot even write a fence
        return (tokenizer.eos_id,)
    opening = set()
    for text in ("```bash\n", "```sh\n", "```shell\n", "Let me look.\n```bash\n",
                 "Let me look.\n\n```bash\n", "Done.\n```sh\n"):
        opening.update(tokenizer.encode(text))
    return (tokenizer.eos_id, *sorted(fences - opening))
