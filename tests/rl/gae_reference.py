"""A slow, obvious float64 statement of skip-observation GAE (docs/algorithm.md §2), for the
tests."""

import numpy as np


def gae_float64(rewards, values, action_mask, gamma, lam, last_value=None, truncated=None):
    rewards = np.asarray(rewards, np.float64)
    values = np.asarray(values, np.float64)
    mask = np.asarray(action_mask, bool)
    batch, length = rewards.shape
    lam = np.broadcast_to(np.asarray(lam, np.float64), (batch,))
    adv = np.zeros((batch, length))
    ret = np.zeros((batch, length))
    for b in range(batch):
        positions = np.flatnonzero(mask[b])
        if positions.size == 0:
            continue
        # Each action collects the rewards from its own position up to the next action.
        ends = np.append(positions[1:], length)
        moved = np.array([rewards[b, p:e].sum() for p, e in zip(positions, ends, strict=True)])
        v = values[b, positions]
        final = last_value[b] if truncated is not None and truncated[b] else 0.0
        next_v = np.append(v[1:], final)
        delta = moved + gamma * next_v - v
        running = 0.0
        for k in range(positions.size - 1, -1, -1):
            running = delta[k] + gamma * lam[b] * running
            adv[b, positions[k]] = running
            ret[b, positions[k]] = running + v[k]
    return adv, ret


def textbook_gae(rewards, values, gamma, lam, bootstrap):
    """Standard GAE on fully observed rows (Schulman et al. 2016), bootstrap value at the end."""
    rewards = np.asarray(rewards, np.float64)
    values = np.asarray(values, np.float64)
    batch, length = rewards.shape
    adv = np.zeros((batch, length))
    for b in range(batch):
        running = 0.0
        for t in range(length - 1, -1, -1):
            next_v = values[b, t + 1] if t + 1 < length else bootstrap[b]
            running = rewards[b, t] + gamma * next_v - values[b, t] + gamma * lam * running
            adv[b, t] = running
    return adv, adv + values


def random_spans_mask(rng, batch, length, obs_fraction=0.3, mean_span=64):
    """Action and observation spans alternating, about `obs_fraction` observation tokens."""
    mask = np.ones((batch, length), bool)
    for b in range(batch):
        t = int(rng.integers(0, mean_span))
        while t < length:
            span = int(rng.integers(1, 2 * mean_span))
            mask[b, t:t + span] = False
            t += span + int(rng.integers(1, 2 * mean_span * (1 - obs_fraction) / obs_fraction))
    return mask
