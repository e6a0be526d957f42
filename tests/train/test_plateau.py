"""Value pretraining's stopping rule (`train.plateau.Plateau`): when it stalls, its constants
from the config, and its state through a checkpoint's metadata."""

import json
import math

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


def test_constants_come_from_the_config_and_the_state_survives_a_checkpoint():
    config = toy.get_config()
    config.rl.value_pretraining_patience, config.rl.value_pretraining_min_delta = 2, 0.5
    plateau = Plateau.of(config)
    assert (plateau.patience, plateau.min_delta, plateau.best) == (2, 0.5, -math.inf)
    assert json.loads(json.dumps(plateau.state())) == {"best": None, "since_best": 0}
    plateau.update(1.0)
    plateau.update(1.2)
    resumed = Plateau.of(config, json.loads(json.dumps(plateau.state())))
    assert (resumed.best, resumed.since_best, resumed.stalled) == (1.2, 1, False)
    resumed.update(1.1)
    assert resumed.stalled


def test_bad_constants_name_their_field():
    with pytest.raises(ValueError, match="rl.value_pretraining_patience must be >= 1"):
        Plateau(patience=0, min_delta=0.01)
    with pytest.raises(ValueError, match="rl.value_pretraining_min_delta must be >= 0"):
        Plateau(patience=1, min_delta=float("nan"))
