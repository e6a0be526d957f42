"""Value pretraining's stopping rule: "explained variance stopped rising" as a named object.

The policy's updates wait for the critic (docs/algorithm.md §3): a fixed warm-up of
`rl.critic_warmup_steps`, then, with `rl.value_pretraining`, until the critic's explained variance
on each new batch has not beaten its best by more than `rl.value_pretraining_min_delta` for
`rl.value_pretraining_patience` readings in a row (or `value_pretraining_max_steps` more steps
have passed). Its state goes into every checkpoint's metadata, so a resumed run stops where an
uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class Plateau:
    """Readings that stop rising: `update(x)` after each one; `stalled` once `patience` readings
    in a row have not exceeded the best so far by more than `min_delta`."""

    patience: int
    min_delta: float
    best: float = -math.inf
    since_best: int = 0  # readings since the best was last beaten by more than min_delta

    def __post_init__(self):
        if self.patience < 1:
            raise ValueError(f"rl.value_pretraining_patience must be >= 1, got {self.patience}.")
        if not self.min_delta >= 0:
            raise ValueError(f"rl.value_pretraining_min_delta must be >= 0, got "
                             f"{self.min_delta}.")

    @classmethod
    def of(cls, config, saved: dict | None = None) -> Plateau:
        """The rule with `config.rl`'s constants and, when resuming, the checkpoint's state
        (`state()`)."""
        plateau = cls(config.rl.value_pretraining_patience, config.rl.value_pretraining_min_delta)
        if saved:
            best = saved.get("best")
            plateau.best = -math.inf if best is None else float(best)
            plateau.since_best = int(saved.get("since_best", 0))
        return plateau

    def update(self, reading: float) -> None:
        if not math.isfinite(reading):  # a NaN reading is no progress
            self.since_best += 1
            return
        self.since_best = 0 if reading > self.best + self.min_delta else self.since_best + 1
        self.best = max(self.best, reading)

    @property
    def stalled(self) -> bool:
        return self.since_best >= self.patience

    def state(self) -> dict:
        """JSON for the checkpoint's metadata (no best yet: None)."""
        return {"best": None if math.isinf(self.best) else self.best,
                "since_best": self.since_best}
