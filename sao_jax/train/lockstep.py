"""The learner's computations on global arrays, run by every process of a multi-host run in the
same order: the leader announces each (`Lockstep`, over `distributed.Cluster`'s messages) and
runs it; the others run what it announces (`follow`) until it says stop. On a single process a
`Lockstep` just computes."""

from __future__ import annotations

from sao_jax.models import save_hf
from sao_jax.train.checkpoint import Checkpointer
from sao_jax.train.console import TrainingError
from sao_jax.train.distributed import Cluster, batch_arrays, batch_of
from sao_jax.train.state import TrainState
from sao_jax.train.steps import Trainer


class Lockstep:
    """The leader's computations on the global arrays, each announced to the other processes
    first so that they run it too (`follow`); on a single process, just the computations."""

    def __init__(self, cluster: Cluster, trainer: Trainer, checkpoints: Checkpointer):
        self.cluster, self.trainer, self.checkpoints = cluster, trainer, checkpoints

    def step(self, state: TrainState, batch, update_policy: bool):
        self.cluster.send("step", update_policy=update_policy, **batch_arrays(batch))
        return self.trainer.step(state, batch, update_policy=update_policy)

    def save_weights(self, model, path: str) -> None:
        self.cluster.send("weights", path=path)
        save_hf(model, path)

    def save_checkpoint(self, state: TrainState, meta: dict) -> None:
        self.cluster.send("checkpoint")
        self.checkpoints.save(state, meta)

    def stop(self) -> None:
        """The run is over: the other processes may exit (and this one, once they know)."""
        self.cluster.send("stop")
        self.cluster.finish()


def follow(cluster: Cluster, trainer: Trainer, state: TrainState,
           checkpoints: Checkpointer) -> dict:
    """A follower's run: what the leader's `Lockstep` announces, until it says stop."""
    while True:
        kind, arrays = cluster.receive()
        if kind == "step":
            state, _ = trainer.step(state, batch_of(arrays),
                                    update_policy=bool(arrays["update_policy"]))
        elif kind == "weights":
            save_hf(trainer.policy_model(state), str(arrays["path"]))
        elif kind == "checkpoint":
            checkpoints.save(state, {})  # the leader's process writes the metadata
        elif kind == "stop":
            checkpoints.close()
            cluster.finish()
            return {}
        else:
            raise TrainingError(f"process {cluster.index}: the leader sent {kind!r}, which "
                                "this version of sao_jax does not know; run the same version "
                                "on every host.")
