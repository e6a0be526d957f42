"""The training-inference mismatch corrections and the weighted PPO loss as slow, obvious float64
NumPy loops (docs/algorithm.md §5, "The mismatch corrections"), and a hand-built batch with
known ratios (`mismatch_inputs`), for the tests of `sao_jax.rl` and of the policy losses."""

import numpy as np

CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # PPO clip-higher, as the learner's defaults


def mismatch_inputs():
    """`(old_logp, rollout_logp, action_mask)` `[5, 6]` float32 / bool, the engine-to-learner
    ratios `rho = exp(old - rollout)` on action tokens being:

      row 0: 1.0, 3.0, (observation), 0.4, 6.0, 1.5   TIS caps 3 and 6; IcePop masks 0.4 and 6;
                                                      geometric mean 10.8^(1/5) = 1.61: masked
      row 1: 1.0005, 0.9998, 1.0004, 1.0001, (pad x2)  geometric mean 1.0002: kept
      row 2: 0.99, 0.999, 0.998, (observation), 1.0, 0.997   geometric mean 0.9968: masked;
             its observation has ratio e^30 and would raise the mean past 1.001 if it counted
      row 3: 1.2, (engine log-prob NaN), (pad x4)     the NaN pair has weight 0 everywhere; the
                                                      geometric mask rejects the row
      row 4: observations only                        no action token: weight 0, no row counted
    """
    nan = np.nan
    rho = np.array([[1.0, 3.0, 1.0, 0.4, 6.0, 1.5],
                    [1.0005, 0.9998, 1.0004, 1.0001, 1.0, 1.0],
                    [0.99, 0.999, 0.998, 1.0, 1.0, 0.997],
                    [1.2, 1.0, 1.0, 1.0, 1.0, 1.0],
                    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    mask = np.array([[1, 1, 0, 1, 1, 1],
                     [1, 1, 1, 1, 0, 0],
                     [1, 1, 1, 0, 1, 1],
                     [1, 1, 0, 0, 0, 0],
                     [0, 0, 0, 0, 0, 0]], bool)
    rollout = np.full(rho.shape, -2.0)
    rollout[~mask] = nan  # the engine's convention off the action mask
    rollout[3, 1] = nan  # a non-finite pair on an action token
    old = np.full(rho.shape, -2.0) + np.log(rho)
    old[2, 3] = 28.0  # an observation the geometric mean must not see: log ratio 30
    rollout[2, 3] = -2.0
    return old.astype(np.float32), rollout.astype(np.float32), mask


def _log_ratios(old, rollout, mask):
    old, rollout = np.asarray(old, np.float64), np.asarray(rollout, np.float64)
    valid = mask & np.isfinite(old) & np.isfinite(rollout)
    return np.where(valid, old - np.where(valid, rollout, 0.0), 0.0), valid


def tis_reference(old, rollout, mask, cap=2.0):
    log_rho, valid = _log_ratios(old, rollout, mask)
    w = np.zeros(log_rho.shape)
    for b, t in zip(*np.nonzero(valid), strict=True):
        w[b, t] = min(np.exp(np.clip(log_rho[b, t], -20, 20)), cap)
    return w


def icepop_reference(old, rollout, mask, low=0.5, high=5.0):
    log_rho, valid = _log_ratios(old, rollout, mask)
    w = np.zeros(log_rho.shape)
    for b, t in zip(*np.nonzero(valid), strict=True):
        rho = np.exp(np.clip(log_rho[b, t], -20, 20))
        w[b, t] = rho if low <= rho <= high else 0.0
    return w


def geometric_mask_reference(old, rollout, mask, low=0.999, high=1.001):
    log_rho, valid = _log_ratios(old, rollout, mask)
    w = np.zeros(log_rho.shape)
    for b in range(mask.shape[0]):
        actions = np.flatnonzero(mask[b])
        if actions.size == 0 or not valid[b, actions].all():
            continue
        g = np.exp(np.mean(log_rho[b, actions]))
        if low <= g <= high:
            w[b, actions] = 1.0
    return w


def weighted_ppo_reference(logp, old, adv, mask, weights, clip_low=CLIP_LOW,
                           clip_high=CLIP_HIGH):
    """`(loss, d loss / d logp)` of `- sum m w min(u A, clip(u) A) / sum m`, u = exp(logp - old):
    the gradient of a token is `- w u A / N` where the unclipped term is the smaller (or they
    tie), else 0."""
    logp, old = np.asarray(logp, np.float64), np.asarray(old, np.float64)
    adv, weights = np.asarray(adv, np.float64), np.asarray(weights, np.float64)
    n = max(mask.sum(), 1)
    loss, grad = 0.0, np.zeros(logp.shape)
    for b, t in zip(*np.nonzero(mask), strict=True):
        u = np.exp(logp[b, t] - old[b, t])
        unclipped = u * adv[b, t]
        clipped = np.clip(u, 1 - clip_low, 1 + clip_high) * adv[b, t]
        loss -= weights[b, t] * min(unclipped, clipped) / n
        if unclipped <= clipped:
            grad[b, t] = -weights[b, t] * unclipped / n
    return loss, grad
