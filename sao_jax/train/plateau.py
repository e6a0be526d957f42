"""Value pretraining's stopping rule: "explained variance stopped rising" as a named object.

The policy's updates wait for the critic (docs/algorithm.md §3): a fixed warm-up of
`rl.critic_warmup_steps`, then, with `rl.value_pretraining`, until the critic's explained variance
has stopped rising: its running mean over the last `rl.value_pretraining_window` batches has not
beaten its best by more than `rl.value_pretraining_min_delta` for `rl.value_pretraining_patience`
readings in a row (or `value_pretraining_max_steps` more steps have passed). The mean, because one
batch's explained variance is noisy (on chain it swings by +-0.15 from batch to batch): against
single readings the rule stops at the first lucky high one plus `patience`, while the critic is
still learning. Its state goes into every checkpoint's metadata, so a resumed run stops where an
uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class Plateau:
    """Readings that stop rising: `update(x)` after each one; `stalled` once `patience` readings
    in a row have not lifted the running mean of the last `window` readings above its best so
    far by more than `min_delta`. Until `window` readings have come, no mean is judged (nor
    counted towards `patience`)."""

    patience: int
    min_delta: float
    window: int = 1
    best: float = -math.inf
    since_best: int = 0  # readings since the best mean was last beaten by more than min_delta
    recent: list[float] = dataclasses.field(default_factory=list)  # the last `window` readings

    def __post_init__(self):
        if self.patience < 1:
            raise ValueError(f"rl.value_pretraining_patience must be >= 1, got {self.patience}.")
        if not self.min_delta >= 0:
            raise ValueError(f"rl.value_pretraining_min_delta must be >= 0, got "
                             f"{self.min_delta}.")
        if self.window < 1:
            raise ValueError(f"rl.value_pretraining_window must be >= 1, got {self.window}.")

    @classmethod
    def of(cls, config, saved: dict | None = None) -> Plateau:
        """The rule with `config.rl`'s constants and, when resuming, the checkpoint's state
        (`state()`)."""
        plateau = cls(config.rl.value_pretraining_patience, config.rl.value_pretraining_min_delta,
                      config.rl.value_pretraining_window)
        if saved:
            best = saved.get("best")
            plateau.best = -math.inf if best is None else float(best)
            plateau.since_best = int(saved.get("since_best", 0))
            plateau.recent = [float(x) for x in saved.get("recent", [])][-plateau.window:]
        return plateau

    def update(self, reading: float) -> None:
        if not math.isfinite(reading):  # a NaN reading is no progress
            self.since_best += 1
            return
        self.recent = (self.recent + [float(reading)])[-self.window:]
        if len(self.recent) < self.window:
            return
        mean = sum(self.recent) / self.window
        self.since_best = 0 if mean > self.best + self.min_delta else self.since_best + 1
        self.best = max(self.best, mean)

    @property
    def stalled(self) -> bool:
        return self.since_best >= self.patience

    def state(self) -> dict:
        """JSON for the checkpoint's metadata (no best yet: None)."""
        return {"best": None if math.isinf(self.best) else self.best,
                "since_best": self.since_best, "recent": list(self.recent)}
