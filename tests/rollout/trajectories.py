"""A valid trajectory to start from (`make_trajectory`) and a field-by-field comparison of two
(`assert_same`): the trajectory, stream and collector tests build theirs from these."""

import numpy as np

from sao_jax.rollout.trajectory import Trajectory

VOCAB = 1000


def make_trajectory(length: int = 12, *, seed: int = 0, **overrides) -> Trajectory:
    """A valid trajectory: action spans with observation spans between them, the outcome reward on
    the last action token, log-probs NaN and versions -1 off the mask."""
    rng = np.random.default_rng(seed)
    mask = np.ones(length, bool)
    for start in range(4, length - 3, 8):  # observations at 4..6, 12..14, ...
        mask[start:start + 3] = False
    rewards = np.zeros(length, np.float32)
    if length:
        rewards[np.flatnonzero(mask)[-1]] = 1.0
    fields = dict(
        prompt_ids=rng.integers(0, VOCAB, 5),
        response_ids=rng.integers(0, VOCAB, length),
        action_mask=mask,
        rollout_logprobs=np.where(mask, -rng.exponential(1.0, length), np.nan),
        weight_versions=np.where(mask, 3, -1),
        rewards=rewards,
        truncated=False,
        finish_reason="stop",
        prompt_id="prompt-7",
        env_metadata={"env": "calculator", "turns": 2, "score": 0.5, "solved": True},
        timings={"generate_s": 1.25, "env_s": 0.5},
    )
    fields.update(overrides)
    return Trajectory(**fields)


def assert_same(a: Trajectory, b: Trajectory) -> None:
    for name in ("prompt_ids", "response_ids", "action_mask", "rollout_logprobs",
                 "weight_versions", "rewards", "routed_experts"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)  # NaN == NaN here
    for name in ("truncated", "finish_reason", "prompt_id", "trajectory_id", "lease_id",
                 "group_id", "prompt_index", "env_metadata", "timings"):
        assert getattr(a, name) == getattr(b, name), name
    assert {k: type(v) for k, v in a.env_metadata.items()} == \
        {k: type(v) for k, v in b.env_metadata.items()}
