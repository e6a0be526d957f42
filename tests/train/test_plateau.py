"""Value pretraining's stopping rule (`train.plateau.Plateau`): when it stalls, its constants
from the config, and its state through a checkpoint's metadata."""

import json
import math

import numpy as np
import pytest

from experiments import toy
from sao_jax.train.plateau import Plateau


def test_stalls_after_patience_readings_without_real_progress():
    plateau = Plateau(patience=3, min_delta=0.01)
    readings = [0.1, 0.3, 0.305, 0.31, 0.5, 0.505, float("nan"), 0.509]
    stalled = []
    for x in readings:
        plateau.update(x)
        stalled.append(plateau.stalled)
    # 0.305 and 0.31 are within 0.01 of 0.3 (2 readings), 0.5 resets, then 0.505, NaN, 0.509: 3.
    assert stalled == [False, False, False, False, False, False, False, True]
    assert plateau.best == 0.509 and plateau.since_best == 3


def test_a_noisy_rise_is_judged_by_its_running_mean_not_its_luckiest_batch():
    """Explained variance as chain's critic gave it while learning (one batch each): single
    readings stall 5 after the lucky 0.287, the mean of 5 goes on rising past it."""
    readings = [0.0, -0.02, -0.015, 0.007, 0.039, 0.112, 0.025, 0.123, 0.063, 0.091, 0.046, 0.057,
                0.287, 0.221, -0.022, 0.072, 0.258, 0.199, 0.182, 0.23, 0.25, 0.24]
    single, mean = Plateau(patience=5, min_delta=0.01), Plateau(5, 0.01, window=5)
    stalled_at = {}
    for i, x in enumerate(readings, start=1):
        for name, plateau in (("single", single), ("mean", mean)):
            plateau.update(x)
            if plateau.stalled:
                stalled_at.setdefault(name, i)
    assert stalled_at == {"single": 18}  # 0.287 at reading 13, five below it after
    means = [np.mean(readings[i - 5:i]) for i in range(5, len(readings) + 1)]
    assert mean.best == pytest.approx(max(means)) and mean.since_best == 1
    early = Plateau(patience=1, min_delta=0.0, window=3)
    for x in (5.0, 1.0):  # fewer readings than the window: no mean judged, nothing counted
        early.update(x)
    assert (early.best, early.since_best, early.stalled) == (-math.inf, 0, False)
    early.update(float("nan"))  # a NaN counts as no progress, and is no reading of the mean
    assert early.stalled and early.recent == [5.0, 1.0]


def test_constants_come_from_the_config_and_the_state_survives_a_checkpoint():
    config = toy.get_config()
    assert config.rl.value_pretraining_window == 5
    config.rl.value_pretraining_patience, config.rl.value_pretraining_min_delta = 2, 0.5
    config.rl.value_pretraining_window = 2
    plateau = Plateau.of(config)
    assert (plateau.patience, plateau.min_delta, plateau.window) == (2, 0.5, 2)
    assert json.loads(json.dumps(plateau.state())) == {"best": None, "since_best": 0,
                                                       "recent": []}
    for x in (1.0, 1.2, 1.0):
        plateau.update(x)
    resumed = Plateau.of(config, json.loads(json.dumps(plateau.state())))
    assert (resumed.best, resumed.since_best, resumed.recent) == (1.1, 1, [1.2, 1.0])
    assert not resumed.stalled
    resumed.update(1.1)  # mean 1.05: the second reading without progress
    assert resumed.stalled
    old = Plateau.of(config, {"best": 0.3, "since_best": 1})  # a checkpoint from before windows
    assert (old.best, old.since_best, old.recent) == (0.3, 1, [])


def test_bad_constants_name_their_field():
    with pytest.raises(ValueError, match="rl.value_pretraining_patience must be >= 1"):
        Plateau(patience=0, min_delta=0.01)
    with pytest.raises(ValueError, match="rl.value_pretraining_min_delta must be >= 0"):
        Plateau(patience=1, min_delta=float("nan"))
    with pytest.raises(ValueError, match="rl.value_pretraining_window must be >= 1"):
        Plateau(patience=1, min_delta=0.0, window=0)
