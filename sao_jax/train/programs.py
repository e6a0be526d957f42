"""The learner step's ahead-of-time compiled programs, shared between the thread that compiles
them while the run starts and the step that runs them (`Programs`; `steps.Trainer.precompile`).
"""

from __future__ import annotations

import threading
from typing import Any


class Programs:
    """The step's ahead-of-time compiled programs by key `(update_policy, batch shapes)`, shared
    by `Trainer.precompile` (on a thread) and `Trainer.step`: no program is compiled twice.

    `compile(key, fn)` (the precompiling thread) compiles a key nobody has asked for; `take(key)`
    (the step) returns the key's program, waiting while it is being compiled, or None when it
    is not and will not be: the step then compiles through its jit, and `compile` skips the key.
    `retire(phase)` (the step, at the first policy update: the critic-only phase is over)
    makes `compile` skip that phase's keys from then on.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._programs: dict[tuple, Any] = {}
        self._compiling: dict[tuple, threading.Event] = {}
        self._taken: set[tuple] = set()  # keys the step compiles itself
        self._retired: set[bool] = set()  # phases no step will run again
        self._used: set[tuple] = set()  # keys whose ahead-of-time program a step ran
        self.failed: tuple[tuple, BaseException] | None = None  # the first key that failed

    def compile(self, key: tuple, fn) -> bool:
        """Stores `fn()` under `key` unless the key has a program, is being compiled, or was
        taken by the step; returns whether it compiled. What `fn` raises is raised, and kept
        in `failed`."""
        with self._lock:
            if (key in self._programs or key in self._compiling or key in self._taken
                    or key[0] in self._retired):
                return False
            done = self._compiling[key] = threading.Event()
        try:
            program = fn()
            with self._lock:
                self._programs[key] = program
        except BaseException as e:
            self.failed = self.failed or (key, e)
            raise
        finally:
            with self._lock:
                del self._compiling[key]
            done.set()
        return True

    def take(self, key: tuple):
        """`key`'s program (after waiting for the compile under way), or None: then the key is
        the caller's to compile (also when the compile it waited for failed)."""
        while True:
            with self._lock:
                if key in self._programs:
                    self._used.add(key)
                    return self._programs[key]
                done = self._compiling.get(key)
                if done is None:
                    self._taken.add(key)
                    return None
            done.wait()

    def retire(self, phase: bool) -> None:
        """No step of `phase` (`update_policy`) comes again: `compile` skips its keys."""
        with self._lock:
            self._retired.add(phase)

    def report(self) -> str:
        """How many programs were compiled ahead of time, how many of them a step ran, and how
        many the steps compiled themselves (shapes met before their program was begun)."""
        with self._lock:
            return (f"{len(self._programs)} compiled ahead of time, {len(self._used)} of them "
                    f"run; {len(self._taken)} compiled by the step itself")

    def clear(self) -> None:
        with self._lock:
            self._programs.clear()
            self._taken.clear()
            self._retired.clear()
            self._used.clear()
