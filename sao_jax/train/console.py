"""What the person at the terminal sees and does: the progress line, Ctrl-C / SIGTERM as a stop
at the next safe point (`StopRequests`), the guard that stops a run of non-finite steps
(`SkipGuard`), the warning of a policy stalling for the critic's bootstrap (`StallWatch`), and
the errors that end a run with a message (`TrainingError`)."""

from __future__ import annotations

import collections
import contextlib
import signal
import sys
import time

from sao_jax.rollout.trajectory import Trajectory

MAX_SKIPPED_IN_A_ROW = 3


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite steps in a row, the disk full, an engine refusing the
    weights, ...)."""


class SkipGuard:
    """Counts skipped (non-finite) steps; `MAX_SKIPPED_IN_A_ROW` in a row stop the run."""

    def __init__(self, log=print):
        self.log = log
        self.in_a_row = 0

    def record(self, step: int, skipped: bool) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.log(f"\nstep {step}: non-finite loss or gradients; the update was skipped "
                 f"({self.in_a_row} in a row)")
        if self.in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise TrainingError(
                f"{MAX_SKIPPED_IN_A_ROW} steps in a row had non-finite losses or gradients (last: "
                f"step {step}); the tensorboard logs show which. Lower the learning rates or "
                "check the rewards and the engine's log-probs.")


class Progress:
    """One status line: a bar, the step, reward, held-out accuracy, speed."""

    def __init__(self, total: int, stream=sys.stdout):
        self.total, self.stream = total, stream
        self.tty = stream.isatty()
        self.last_print = 0.0

    def update(self, step: int, fields: dict[str, str]) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last_print < 5 and step < self.total:
            return
        self.last_print = now
        width = 24
        done = int(width * step / self.total)
        text = " ".join(f"{k} {v}" for k, v in fields.items())
        line = f"[{'#' * done}{'.' * (width - done)}] step {step}/{self.total} {text}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


class StallWatch:
    """Warns, once a run, when most episodes end cut by a limit while the learner bootstraps
    their returns from the critic's value (`rl.bootstrap_truncated` with a critic): where a cut
    episode fails the task, that value is what a policy collects by stalling until the cut, as
    the toy's once did (docs/algorithm.md, on truncated episodes). `armed` False: it says
    nothing."""

    WINDOW = 5  # steps
    SHARE = 0.5  # of their episodes cut, on average

    def __init__(self, armed: bool, log=print):
        self.armed, self.log = armed, log
        self.recent: collections.deque[float] = collections.deque(maxlen=self.WINDOW)

    def record(self, step: int, truncated_frac: float) -> None:
        if not self.armed:
            return
        self.recent.append(truncated_frac)
        share = sum(self.recent) / len(self.recent)
        if len(self.recent) == self.WINDOW and share >= self.SHARE:
            self.armed = False
            self.log(f"\nstep {step}: {share:.0%} of the last {self.WINDOW} steps' episodes were "
                     "cut by a limit, and their returns end in the critic's value "
                     "(rl.bootstrap_truncated): where a cut episode fails the task, a policy "
                     "earns that value by stalling until the cut. There, set "
                     "--config.rl.bootstrap_truncated=False (docs/algorithm.md, on truncated "
                     "episodes); rollout/truncated_frac shows the share.")


def trajectory_text(t: Trajectory, tokenizer) -> str:
    """A trajectory as Markdown: prompt, actions in bold, observations as code, reward."""
    parts = [f"**prompt** `{tokenizer.decode(t.prompt_ids)!r}`  "]
    ids, mask = t.response_ids, t.action_mask
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode(ids[start:i])
            parts.append(f"{'**action**' if mask[start] else 'observation'} `{text!r}`  ")
            start = i
    parts.append(f"reward {float(t.rewards.sum()):g}, finish {t.finish_reason}, "
                 f"versions {sorted(set(t.weight_versions[t.action_mask].tolist()))}")
    return "\n".join(parts)


class StopRequests:
    """SIGINT and SIGTERM while training, turned into a `KeyboardInterrupt` at a safe point.

    A signal sets a flag; `check()` raises once it is set, and the loop calls it between steps
    and while it waits for rollouts. Raising straight from the handler lands the exception
    wherever the main thread happens to be: inside a gc callback it is swallowed (seen: the run
    ignored Ctrl-C and finished), inside a library's lock it can leave the lock held. Only
    within `interruptible()`, around waits on the engines, does the handler raise at once (a
    swallowed one is still caught by the next `check()`). Installed with `with`; the previous
    handlers come back on exit.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self._raise_now = False
        self._previous = {}

    def __enter__(self) -> StopRequests:
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *_) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, *_) -> None:
        self.requested = True
        if self._raise_now:
            raise KeyboardInterrupt

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def interruptible(self):
        self.check()
        self._raise_now = True
        try:
            yield
        finally:
            self._raise_now = False
        self.check()
