"""Trajectory: construction, validation messages naming the field, and the wire form."""

import numpy as np
import pytest

from sao_jax.rollout.proto import trajectory_pb2 as pb
from sao_jax.rollout.trajectory import Trajectory, TrajectoryError, clip
from tests.rollout.trajectories import VOCAB, assert_same, make_trajectory


def test_valid_trajectory_passes_and_has_canonical_dtypes():
    t = make_trajectory()
    t.validate(VOCAB, max_length=17)
    assert t.response_ids.dtype == np.int32 and t.prompt_ids.dtype == np.int32
    assert t.action_mask.dtype == np.bool_
    assert t.rollout_logprobs.dtype == np.float32 and t.rewards.dtype == np.float32
    assert t.weight_versions.dtype == np.int32
    assert t.length == 12 and t.num_action_tokens == 9
    assert len(t.trajectory_id) == 32 and t.trajectory_id != make_trajectory().trajectory_id


def test_arrays_are_read_only_copies():
    ids = np.arange(12, dtype=np.int32)
    t = make_trajectory(response_ids=ids)
    ids[0] = 999  # the caller's buffer is not the trajectory's
    assert t.response_ids[0] == 0
    with pytest.raises(ValueError):
        t.response_ids[0] = 5


def test_proto_round_trip_keeps_every_field():
    t = make_trajectory(truncated=True, finish_reason="turn_limit", lease_id="lease-1")
    back = Trajectory.from_bytes(t.to_bytes())
    assert_same(t, back)
    assert back.env_metadata == {"env": "calculator", "turns": 2, "score": 0.5, "solved": True}
    assert isinstance(back.env_metadata["solved"], bool)
    # The wire layout is the documented raw little-endian one.
    msg = pb.Trajectory.FromString(t.to_bytes())
    np.testing.assert_array_equal(np.frombuffer(msg.response_ids, "<i4"), t.response_ids)
    assert msg.action_mask == t.action_mask.astype(np.uint8).tobytes()


@pytest.mark.parametrize("group_id,prompt_index", [(None, None), (0, 0), (2**64 - 1, 41)])
def test_group_and_prompt_row_are_typed_fields_on_the_wire(group_id, prompt_index):
    """None is absent on the wire, and 0 is not None: no sentinel stands for "no group"."""
    t = make_trajectory(group_id=group_id, prompt_index=prompt_index)
    back = Trajectory.from_bytes(t.to_bytes())
    assert (back.group_id, back.prompt_index) == (group_id, prompt_index)
    msg = pb.Trajectory.FromString(t.to_bytes())
    assert msg.HasField("group_id") == (group_id is not None)
    assert msg.HasField("prompt_index") == (prompt_index is not None)


def test_invalid_trajectories_still_round_trip():
    """The wire carries a malformed trajectory faithfully, so the learner can reject it."""
    t = make_trajectory(rewards=np.full(7, np.nan), response_ids=np.full(12, VOCAB + 5))
    back = Trajectory.from_bytes(t.to_bytes())
    assert_same(t, back)
    with pytest.raises(TrajectoryError):
        back.validate(VOCAB)


def _broken(**changes):
    t = make_trajectory()
    arrays = {k: np.array(getattr(t, k)) for k in ("response_ids", "action_mask",
                                                    "rollout_logprobs", "weight_versions",
                                                    "rewards", "prompt_ids")}
    for key, change in changes.items():
        arrays[key] = change(arrays[key])
    return make_trajectory(**arrays)


def _set(pos, value):
    def change(a):
        a[pos] = value
        return a
    return change


# (case, the trajectory, the field named, words the message must contain)
INVALID = [
    ("mask too short", _broken(action_mask=lambda a: a[:-1]), "action_mask",
     "has length 11, but response_ids has length 12"),
    ("logprobs too long", _broken(rollout_logprobs=lambda a: np.append(a, -1.0)),
     "rollout_logprobs", "has length 13"),
    ("versions too short", _broken(weight_versions=lambda a: a[:3]), "weight_versions",
     "has length 3"),
    ("rewards too short", _broken(rewards=lambda a: a[:11]), "rewards", "has length 11"),
    ("missing log-prob", _broken(rollout_logprobs=_set(9, np.nan)), "rollout_logprobs",
     "missing (NaN) on action token at position 9"),
    ("infinite log-prob", _broken(rollout_logprobs=_set(0, -np.inf)), "rollout_logprobs",
     "non-finite (-inf) on action token at position 0"),
    ("positive log-prob", _broken(rollout_logprobs=_set(1, 0.5)), "rollout_logprobs",
     "positive log-prob 0.5 on action token at position 1"),
    ("NaN reward", _broken(rewards=_set(11, np.nan)), "rewards",
     "non-finite reward nan at position 11"),
    ("inf reward", _broken(rewards=_set(5, np.inf)), "rewards",
     "non-finite reward inf at position 5"),
    ("reward before the first action",
     _broken(action_mask=_set(slice(0, 2), False), rewards=_set(1, 0.25)), "rewards",
     "reward 0.25 at position 1, before the first action token (position 2)"),
    ("id above the vocabulary", _broken(response_ids=_set(3, VOCAB)), "response_ids",
     f"token id {VOCAB} at position 3 is outside the vocabulary [0, {VOCAB})"),
    ("negative id", _broken(response_ids=_set(2, -1)), "response_ids",
     "token id -1 at position 2"),
    ("prompt id out of vocabulary", _broken(prompt_ids=_set(0, 10**6)), "prompt_ids",
     "outside the vocabulary"),
    ("empty response", make_trajectory(0), "response_ids", "empty response"),
    ("empty prompt", make_trajectory(prompt_ids=[]), "prompt_ids", "empty prompt"),
    ("no action tokens", _broken(action_mask=lambda a: np.zeros_like(a),
                                 rewards=lambda a: np.zeros_like(a)), "action_mask",
     "no action tokens"),
    ("negative version on an action", _broken(weight_versions=_set(0, -1)), "weight_versions",
     "negative version -1 on action token at position 0"),
    ("empty trajectory id", make_trajectory(trajectory_id=""), "trajectory_id", "is empty"),
    ("empty prompt id", make_trajectory(prompt_id=""), "prompt_id", "is empty"),
    ("empty finish reason", make_trajectory(finish_reason=""), "finish_reason", "is empty"),
    ("NaN timing", make_trajectory(timings={"generate_s": float("nan")}), "timings",
     "'generate_s' is nan"),
    ("NaN metadata float", make_trajectory(env_metadata={"score": float("nan")}),
     "env_metadata", "'score' is nan"),
    # Size limits: the message names the length and the limit, never the text.
    ("over-long trajectory id", make_trajectory(trajectory_id="t" * 257), "trajectory_id",
     "is 257 characters long, more than the limit of 256"),
    ("over-long prompt id", make_trajectory(prompt_id="p" * 2_000_000), "prompt_id",
     "is 2000000 characters long, more than the limit of 256"),
    ("over-long lease id", make_trajectory(lease_id="l" * 257), "lease_id",
     "is 257 characters long, more than the limit of 256"),
    ("over-long finish reason", make_trajectory(finish_reason="f" * 300), "finish_reason",
     "is 300 characters long"),
    ("over-long metadata value",
     make_trajectory(env_metadata={"answer": "a" * (64 * 1024 + 1)}), "env_metadata",
     "the value of 'answer' is 65537 characters long, more than the limit of 65536"),
    ("over-long metadata key", make_trajectory(env_metadata={"k" * 257: 1}), "env_metadata",
     "a key is 257 characters long, more than the limit of 256"),
    ("over-long timings key", make_trajectory(timings={"k" * 257: 1.0}), "timings",
     "a key is 257 characters long"),
    ("too many metadata entries", make_trajectory(env_metadata={f"k{i}": i for i in range(257)}),
     "env_metadata", "has 257 entries, more than the limit of 256"),
    ("too many timings", make_trajectory(timings={f"k{i}": 1.0 for i in range(300)}), "timings",
     "has 300 entries"),
]


@pytest.mark.parametrize("case,trajectory,field,words", INVALID, ids=[c[0] for c in INVALID])
def test_validate_names_the_field(case, trajectory, field, words):
    with pytest.raises(TrajectoryError) as info:
        trajectory.validate(VOCAB)
    assert info.value.field == field
    assert words in info.value.message
    assert len(str(info.value)) < 300  # never the offending text itself
    assert str(info.value).startswith(f"{field}: ")
    assert isinstance(info.value, ValueError)


def test_max_length_counts_prompt_and_response():
    t = make_trajectory()  # 5 + 12 tokens
    t.validate(VOCAB, max_length=17)
    with pytest.raises(TrajectoryError, match=r"response_ids: prompt \(5\) \+ response \(12\) "
                                              r"tokens exceed max_length 16"):
        t.validate(VOCAB, max_length=16)


def test_what_validation_allows():
    # NaN log-probs and any version off the mask; rewards on observation tokens after the first
    # action (they belong to the action before); a zero reward before the first action.
    mask = np.array([False, True, True, False, False, True])
    t = make_trajectory(
        6, action_mask=mask, rollout_logprobs=[np.nan, -1, -2, np.nan, np.inf, -0.0],
        weight_versions=[-7, 0, 0, -1, 99, 1], rewards=[0, 0, 0, 0.5, 0, 1.0])
    t.validate(VOCAB)
    # Log-probs a float rounding above zero pass.
    make_trajectory(rollout_logprobs=np.full(12, 1e-6)).validate(VOCAB)
    # Strings and metadata right at their limits pass; a lease id may be empty.
    make_trajectory(trajectory_id="t" * 256, prompt_id="p" * 256, lease_id="l" * 256,
                    finish_reason="f" * 256,
                    env_metadata={"k" * 256: "v" * (64 * 1024),
                                  **{f"k{i}": i for i in range(255)}},
                    timings={f"t{i}": 1.0 for i in range(256)}).validate(VOCAB)
    make_trajectory(lease_id="").validate(VOCAB)


def test_clip_shortens_text_for_logs():
    assert clip("short") == "short"
    assert clip("x" * 10_000_000, 40) == "x" * 40 + "...(+9999960 characters)"


@pytest.mark.parametrize("overrides,field,words", [
    (dict(response_ids=np.full(12, 1.5)), "response_ids", "expected integers"),
    (dict(response_ids=np.zeros((3, 4), np.int32)), "response_ids", "expected a 1-D array"),
    (dict(response_ids=np.full(12, 2**40)), "response_ids", "do not fit in int32"),
    (dict(action_mask=np.full(12, 2)), "action_mask", "value 2 at position 0 is not 0/1"),
    (dict(action_mask=np.full(12, 0.5)), "action_mask", "expected bool"),
    (dict(rewards=np.array(["a"] * 12)), "rewards", "expected floats"),
    (dict(prompt_id=7), "prompt_id", "expected a str"),
    (dict(env_metadata={"x": [1, 2]}), "env_metadata", "value of 'x' is a list"),
    (dict(timings={"t": "slow"}), "timings", "not a number of seconds"),
    (dict(group_id="3"), "group_id", "expected an int or None, got str"),
    (dict(group_id=True), "group_id", "expected an int or None, got bool"),
    (dict(prompt_index=-1), "prompt_index", "-1 is outside [0, 2**64)"),
    (dict(prompt_index=2**64), "prompt_index", "is outside [0, 2**64)"),
    (dict(routed_experts=np.zeros((17, 2), np.int16)), "routed_experts",
     "expected [tokens, layers, top_k], got shape (17, 2)"),
    (dict(routed_experts=np.full((17, 2, 2), 0.5)), "routed_experts", "expected integers"),
    (dict(routed_experts=np.full((17, 2, 2), -2)), "routed_experts", "-1 (no route) .. 32767"),
    (dict(routed_experts=np.full((17, 2, 2), 2**15)), "routed_experts", "-1 (no route)"),
])
def test_construction_refuses_lossy_conversions(overrides, field, words):
    with pytest.raises(TrajectoryError) as info:
        make_trajectory(**overrides)
    assert info.value.field == field and words in info.value.message


def test_integer_mask_and_numpy_metadata_are_converted():
    t = make_trajectory(action_mask=np.ones(12, np.int64), rollout_logprobs=np.full(12, -1.0),
                        weight_versions=np.zeros(12, np.int64), rewards=np.zeros(12),
                        env_metadata={"turns": np.int64(3), "score": np.float32(0.5)})
    assert t.action_mask.dtype == np.bool_ and t.action_mask.all()
    assert t.env_metadata == {"turns": 3, "score": 0.5}
    assert type(t.env_metadata["turns"]) is int


def test_routed_experts_round_trip_and_are_checked_against_the_tokens():
    """Routing replay's expert ids: [P + T, layers, top_k] int16 on the wire; -1 is a token
    without a route; absent, an empty [0, 0, 0] that sends no bytes."""
    assert make_trajectory().routed_experts.shape == (0, 0, 0)
    assert not make_trajectory().to_proto().routed_experts
    routes = np.random.default_rng(0).integers(-1, 8, (17, 3, 2))
    t = make_trajectory(routed_experts=routes)
    t.validate(VOCAB)
    back = Trajectory.from_bytes(t.to_bytes())
    assert_same(t, back)
    assert back.routed_experts.dtype == np.int16 and not back.routed_experts.flags.writeable
    np.testing.assert_array_equal(back.routed_experts, routes)
    with pytest.raises(TrajectoryError, match="has 16 tokens, but prompt and response have 17"):
        make_trajectory(routed_experts=routes[:16]).validate(VOCAB)
    # a learner that replays them refuses routes of another model, named, before any batch
    t.validate(VOCAB, routes=(3, 2, 8))
    for model, words in (((2, 2, 8), r"\[layers, top_k\] = \[3, 2\] per token, the policy has "
                                      r"\[2, 2\]"), ((3, 2, 4), "expert id 7, the policy has 4")):
        with pytest.raises(TrajectoryError, match=words) as info:
            t.validate(VOCAB, routes=model)
        assert info.value.field == "routed_experts"
    msg = t.to_proto()
    msg.routed_experts = msg.routed_experts[:-2]
    with pytest.raises(TrajectoryError, match=r"not a whole number of \[3, 2\] int16 rows"):
        Trajectory.from_proto(msg)


def test_ragged_bytes_on_the_wire_name_the_field():
    msg = make_trajectory().to_proto()
    msg.rollout_logprobs = msg.rollout_logprobs[:-1]
    with pytest.raises(TrajectoryError) as info:
        Trajectory.from_proto(msg)
    assert info.value.field == "rollout_logprobs"
    assert "47 bytes is not a whole number of float32 values" in info.value.message
