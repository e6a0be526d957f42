"""benchmarks/logp_gap.py at a tiny size: the embedded engine (and, with `-m sglang`, a real SGLang
server) and the learner on identical weights agree to float32 rounding in float32, and bfloat16
opens a gap orders of magnitude wider (the figures at full size: docs/algorithm.md, "The
training-inference gap")."""

import importlib.util
import math
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")


@pytest.fixture(scope="module")
def logp_gap():
    """The script as a module (it imports `_table` from beside it, as when run as a file)."""
    sys.path.insert(0, BENCHMARKS)
    try:
        spec = importlib.util.spec_from_file_location(
            "logp_gap", os.path.join(BENCHMARKS, "logp_gap.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(BENCHMARKS)
    return module


def test_bfloat16_opens_a_gap_that_float32_does_not(logp_gap):
    # Every layer MoE (toy_moe, one layer here): its untied head gives a spread distribution,
    # where the fresh toy's tied embeddings give probability 1 to every sampled token (log-prob
    # 0 on both sides, gap 0 whatever the dtype).
    f32, bf16 = logp_gap.measure(
        "toy", {"model.preset": "toy_moe", "model.num_layers": 1}, fresh=True, responses=8,
        pairs=("float32/float32", "bfloat16/bfloat16"), log=lambda *_: None)
    assert (f32["learner"], f32["engine"], bf16["learner"], bf16["engine"]) == (
        "float32", "float32", "bfloat16", "bfloat16")
    assert f32["tokens"] >= 8 and bf16["tokens"] >= 8
    assert f32["mean"] <= f32["p99"] <= f32["max"] < 1e-5  # float32 rounding of two programs
    # bfloat16 keeps 8 bits of mantissa: the same weights in two programs differ by ~1e-3 nats
    assert bf16["max"] > 1e-3 and bf16["mean"] > 100 * f32["mean"]
    # the engine's experts line up with the learner's tokens: in float32 the learner routes
    # every action token as the engine did, and replaying the engine's choices changes nothing
    assert f32["routed_same"] == 1.0 and f32["mean_same"] == f32["mean"]
    assert math.isnan(f32["mean_different"])
    assert f32["replay_mean"] == pytest.approx(f32["mean"], abs=1e-7)
    assert 0.0 <= bf16["routed_same"] <= 1.0 and bf16["replay_max"] < 1e-1


@pytest.mark.sglang
def test_a_real_sglang_server_agrees_in_float32_and_not_in_bfloat16(logp_gap, sglang_venv):
    """`sglang-<dtype>` engines: a real SGLang server on this CPU samples the actions. In
    float32 its log-probs are the learner's to rounding; in bfloat16 they are not. Its routes
    are not asked (CUDA only), so no routing split."""
    f32, bf16 = logp_gap.measure(
        "toy", {"model.preset": "toy_moe", "model.num_layers": 1}, fresh=True, responses=8,
        pairs=("float32/sglang-float32", "bfloat16/sglang-bfloat16"), log=lambda *_: None)
    assert f32["engine"] == "sglang-float32" and f32["tokens"] >= 8
    assert f32["max"] < 1e-4 and bf16["max"] > 1e-3
    assert "routed_same" not in f32 and "routed_same" not in bf16


def test_overrides_read_as_on_the_command_line(logp_gap):
    assert logp_gap.config_overrides(["--config.model.preset=toy_moe",
                                      "--config.model.num_layers=1", "--config.seed=3"]) == {
        "model.preset": "toy_moe", "model.num_layers": 1, "seed": 3}
    with pytest.raises(SystemExit, match="--config.<field>=<value>"):
        logp_gap.config_overrides(["--preset=toy_moe"])
    assert logp_gap.parse_pair("float32/bfloat16") == ("float32", "bfloat16")
    assert logp_gap.parse_pair("bfloat16/sglang-bfloat16") == ("bfloat16", "sglang-bfloat16")
    for bad in ("float16/float32", "sglang-float32/float32"):
        with pytest.raises(Exception, match="learner/engine"):
            logp_gap.parse_pair(bad)
