"""Orbax checkpoints of the learner: `<workdir>/checkpoints/<step>/{state, meta}`.

`state` is the `TrainState` pytree (policy and critic parameters, both optimizer states, step,
weight version, RNG, running-mean baseline); `meta` is JSON: the ids of every trajectory consumed
so far, the prompt iterator's state, counters and the run's history. A checkpoint is written whole
or not at all (orbax writes `<step>.orbax-checkpoint-tmp` and commits by renaming it), so a
learner killed while saving resumes from the previous one; temporary directories left behind are
removed when the next learner opens the directory.

A save that runs out of disk space raises `DiskFullError` (an `OSError` with errno ENOSPC) saying
which checkpoint is the last good one; its partial directory is removed, and the older
checkpoints are untouched (orbax deletes beyond `keep` only after a save commits). The pages of
tracebacks orbax and tensorstore print about it are kept out of the output (`_not_about_disk_full`,
`_Stragglers`): the error says it once.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import shutil
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp

from sao_jax.train.state import TrainState

# How tensorstore reports ENOSPC: a ValueError "... No space left on device [os_error_code='28']".
_ENOSPC_TEXTS = (os.strerror(errno.ENOSPC), f"os_error_code='{errno.ENOSPC}'")


def _layer_layout(tree) -> str:
    """"scanned" if the policy's layers in a state tree (or its metadata) are stacked groups
    (`layers/<g>/block/...`), else "per-layer"."""
    layers = tree["policy"]["backbone"]["layers"]
    first = next(iter(layers.values())) if isinstance(layers, dict) else layers[0]
    return "scanned" if "block" in first else "per-layer"


class DiskFullError(OSError):
    """A checkpoint could not be written for lack of disk space; `last_step` is the newest good
    checkpoint (None: none yet)."""

    def __init__(self, message: str, *, step: int, last_step: int | None):
        super().__init__(errno.ENOSPC, message)
        self.step, self.last_step = step, last_step

    def __str__(self) -> str:
        return self.strerror


def is_disk_full(error: BaseException) -> bool:
    """Whether `error`, or an exception it was raised from, is ENOSPC (OSError, or tensorstore's
    error text)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if any(text in str(error) for text in _ENOSPC_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


def _not_about_disk_full(record: logging.LogRecord) -> bool:
    """A logging filter: drops orbax's and asyncio's reports of ENOSPC (a hundred lines of
    tracebacks from its writer threads and tasks), which `DiskFullError` says once."""
    text = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:
        text += str(record.exc_info[1])
    return not any(t in text for t in _ENOSPC_TEXTS)


class _Stragglers:
    """`sys.unraisablehook` that drops tensorstore's "Event loop is closed" callbacks while a
    save runs and after one failed: when a write fails, orbax closes its event loop with writes
    still pending, and each one that ends then reports, traceback and all, into the closed loop
    (dozens for one full disk). Everything else goes to the previous hook."""

    def __init__(self):
        self.saving = 0
        self.failed = False
        self.previous = sys.unraisablehook

    def __call__(self, unraisable) -> None:
        error = unraisable.exc_value
        if (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
                and (self.saving or self.failed)):
            return
        self.previous(unraisable)

    @classmethod
    def installed(cls) -> _Stragglers:
        if not isinstance(sys.unraisablehook, cls):
            sys.unraisablehook = cls()
        return sys.unraisablehook


class Checkpointer:
    """Saves and restores `(TrainState, meta)` under `directory`, keeping the newest `keep`."""

    def __init__(self, directory: str, *, keep: int = 3):
        for name in ("absl", "asyncio"):  # orbax logs through absl; its tasks through asyncio
            logger = logging.getLogger(name)
            if _not_about_disk_full not in logger.filters:
                logger.addFilter(_not_about_disk_full)
        self._stragglers = _Stragglers.installed()
        self.directory = os.path.abspath(directory)
        # Several processes: naming them all as `active_processes` makes orbax meet at the
        # coordinator's barriers, not in device collectives (`sync_global_devices`), while one
        # process writes the metadata or deletes old checkpoints on a disk that may be slow.
        # Orbax then leaves the directory to us.
        processes = jax.process_count()
        if processes > 1:
            os.makedirs(self.directory, exist_ok=True)
        every = ocp.options.MultiprocessingOptions(
            active_processes=set(range(processes)) if processes > 1 else None)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=processes == 1, enable_async_checkpointing=False,
            cleanup_tmp_directories=True, multiprocessing_options=every)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, state: TrainState, meta: dict[str, Any]) -> None:
        """Writes the checkpoint of `state.step`; raises `DiskFullError` if the disk fills."""
        step = int(state.step)
        self._stragglers.saving += 1
        try:
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
            self._manager.wait_until_finished()
        except Exception as e:
            self._stragglers.failed = True
            if not is_disk_full(e):
                raise
            for partial in glob.glob(os.path.join(self.directory,
                                                  f"{step}.orbax-checkpoint-tmp*")):
                shutil.rmtree(partial, ignore_errors=True)  # gives back what it took
            self._manager.reload()  # forget the failed step, should orbax have noted it
            last = self.latest_step()
            free = shutil.disk_usage(self.directory).free
            where = ("none was written before it" if last is None else f"the last good one "
                     f"is step {last} ({os.path.join(self.directory, str(last))})")
            raise DiskFullError(
                f"the disk is full: the checkpoint of step {step} could not be written under "
                f"{self.directory} ({free / 2**20:.1f} MiB free); {where}", step=step,
                last_step=last) from e
        finally:
            self._stragglers.saving -= 1

    def restore(self, abstract_state: TrainState, step: int | None = None
                ) -> tuple[TrainState, dict[str, Any]]:
        """The checkpoint at `step` (default: the latest), shaped like `abstract_state`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding",
                                                                               None)),
            abstract_state)
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except ValueError as e:
            saved = _layer_layout(self._manager.item_metadata(step)["state"].tree)
            wanted = _layer_layout(abstract_state._asdict())
            if saved == wanted:
                raise
            raise ValueError(
                f"checkpoint {os.path.join(self.directory, str(step))} holds the model in the "
                f"{saved} layout and this run builds the {wanted} one: resume it with "
                f"--config.model.scan_layers={saved == 'scanned'} (checkpoints written before "
                "the learner scanned its layers are per-layer), or start a new workdir.") from e
        return TrainState(*out.state), out.meta

    def close(self) -> None:
        self._manager.close()
