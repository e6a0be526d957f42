"""The DIS loss's hand-checked inputs (`dis_inputs`) and band (`BAND`): the loss tests and the DIS
kernel's tests compute on the same arrays."""

import numpy as np

BAND = dict(eps_low=0.3, eps_high=5.0)  # reasoning / TIR: ratios in [0.7, 6.0]


def dis_inputs():
    # Ratios (row 0): 1.0, 0.5 (below), 2.0, 7.0 (above); row 1: 1.2, masked, -inf logp, NaN.
    log_r = np.log(np.array([[1.0, 0.5, 2.0, 7.0], [1.2, 1.0, 1.0, 1.0]]))
    rollout = np.full((2, 4), -2.0)
    logp = rollout + log_r
    logp[1, 2] = -np.inf
    logp[1, 3] = np.nan
    adv = np.array([[1.0, -1.0, 0.5, 2.0], [-2.0, 3.0, 1.0, 1.0]])
    mask = np.array([[1, 1, 1, 1], [1, 0, 1, 1]], bool)
    return (logp.astype(np.float32), rollout.astype(np.float32), adv.astype(np.float32), mask)
