"""Orbax checkpoints of the learner: `<workdir>/checkpoints/<step>/{state, meta}`.

`state` is the `TrainState` pytree (policy and critic parameters, both optimizer states, step,
weight version, RNG, running-mean baseline); `meta` is JSON: the ids of every trajectory consumed
so far, the prompt iterator's state, counters and the run's history. A checkpoint is written whole
or not at all (orbax commits by renaming a finished directory), so a learner killed while saving
resumes from the previous one.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from sao_jax.train.steps import TrainState


class Checkpointer:
    """Saves and restores `(TrainState, meta)` under `directory`, keeping the newest `keep`."""

    def __init__(self, directory: str, *, keep: int = 3):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, state: TrainState, meta: dict[str, Any]) -> None:
        step = int(state.step)
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)))
        self._manager.wait_until_finished()

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
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return TrainState(*out.state), out.meta

    def close(self) -> None:
        self._manager.close()
