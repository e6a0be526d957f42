"""`make plan`: the learner step compiled by the real TPU compiler (libtpu) for a TPU topology
this CPU host does not have, with abstract weights."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from experiments import toy
from sao_jax.models import CausalLM
from sao_jax.models.config import preset
from sao_jax.train import plan as planning

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("libtpu") is None,
    reason="libtpu (the tpu extra) is not installed")


def small_toy(**overrides):
    config = toy.get_config()
    config.batch_size = 8
    config.rollout.engine_max_seq_len = 255  # rows of 256 tokens
    for key, value in overrides.items():
        target = config
        *path, last = key.split(".")
        for name in path:
            target = target[name]
        target[last] = value
    return config


@pytest.fixture(scope="module")
def toy_plan():
    """The toy SAO step on 4 v5p chips, fsdp 4, with the GAE and DIS kernels (one compile for
    the tests that read it)."""
    config = small_toy(**{"mesh.fsdp": 4, "rl.gae_impl": "pallas", "pack_rows": False})
    return planning.make_plan(config, "v5p:2x2x1", log=lambda _: None, keep_hlo=True)


def test_the_toy_sao_step_compiles_for_a_v5p_slice_and_fits(toy_plan):
    """With the GAE and DIS kernels in the sharded step: they are Mosaic custom calls, which
    XLA cannot partition (only shard_map lets the step compile), and the step gathers no
    [B, T] array at all (before the hidden states were constrained to rows over the batch
    axes, the embedding lookup of the fsdp-split table and the value head gathered six)."""
    plan = toy_plan
    assert plan.hlo.count("tpu_custom_call") >= 4  # GAE and DIS, forward and backward
    assert gathered_batch_arrays(plan.hlo, 8, 256) == []
    assert (plan.chip, plan.devices, plan.mesh["fsdp"]) == ("TPU v5", 4, 4)
    assert plan.fits and not plan.problems, plan.report()
    assert plan.hbm_bytes == 95 * planning.GiB
    # The state's bytes per device are its shards': fsdp splits every "embed" axis 4 ways.
    whole = plan.params["policy"] * 4  # float32
    assert whole / 4 <= plan.state_bytes["policy parameters"] < whole
    # AdamW: two moments per trainable parameter, each sharded like its parameter.
    assert plan.state_bytes["policy optimizer state"] == pytest.approx(
        2 * plan.state_bytes["policy parameters"], rel=0.01)
    # The critic's attention is frozen (sao): no moments for it.
    assert plan.state_bytes["critic optimizer state"] < 2 * plan.state_bytes["critic parameters"]
    m = plan.memory
    assert m["argument"] >= sum(plan.state_bytes.values()) * 0.99
    assert m["alias"] > 0  # the donated state is written in place
    assert m["temp"] > 0 and m["code"] > 0
    assert plan.peak_bytes < plan.hbm_bytes
    assert plan.tokens == 8 * 256 and plan.flops > 0
    assert plan.tokens_per_s(0.4) == pytest.approx(0.4 * plan.tokens_per_s(1.0))
    report = plan.report()
    for text in ("TPU v5", "policy optimizer state", "temporaries", "peak", "headroom",
                 "tokens/s at 100% of peak", "publish (save_hf): 1 file(s)", "1 host(s)",
                 "MB/s per host", "fits", "kept in float32, computed in float32"):
        assert text in report
    # Four chips, one host: it writes the whole policy, its parameters' bytes.
    assert plan.publish.host_bytes == [plan.params["policy"] * 4]


def test_the_roofline_names_the_resource_the_step_waits_on_longest(toy_plan):
    """Per device: the step's FLOPs (remat "none": nothing recomputed) over the 4 devices that
    split its rows, at least the state's bytes read from HBM, at least the fsdp-split policy
    gathered whole; each time at the v5p's peaks, and the bound the longest of the three."""
    plan, roof = toy_plan, toy_plan.roofline
    assert plan.work_shards == 4 and plan.remat == "none"
    assert roof.flops == pytest.approx(plan.flops / 4)
    assert roof.hbm_bytes >= plan.memory["argument"]
    assert roof.collective_bytes >= plan.params["policy"] * 4  # float32, gathered from 4 shards
    assert (roof.peak_flops, roof.hbm_bytes_per_s, roof.ici_bytes_per_s) == \
        (459e12, 2765e9, 1200e9)
    seconds = roof.seconds
    assert seconds == pytest.approx({"compute": roof.flops / 459e12,
                                     "HBM": roof.hbm_bytes / 2765e9,
                                     "ICI": roof.collective_bytes / 1200e9})
    assert seconds[roof.bound] == max(seconds.values())
    assert roof.unknown_loops == 0  # unpacked rows: every loop's trips are in the program
    report = plan.report().splitlines()
    at = next(i for i, x in enumerate(report) if "roofline" in x)
    assert report[at].endswith(f"{roof.bound}-bound")
    for line, name, amount in zip(report[at + 1:at + 4], ("compute", "HBM", "ICI"),
                                  (roof.flops, roof.hbm_bytes, roof.collective_bytes),
                                  strict=True):
        assert line.split()[:2] == [name, f"{amount:.3e}"], line
    figures = json.loads(json.dumps(plan.as_dict()))
    assert figures["roofline"]["bound"] == roof.bound
    assert figures["roofline"]["seconds"] == pytest.approx(seconds)


def test_a_bfloat16_run_is_planned_with_float32_master_weights():
    """`model.dtype = bfloat16`: the planned state keeps the parameters and the moments in
    float32 (the master weights, `model.master_dtype`), the step computes in bfloat16; with
    `optim.*.mu_dtype = bfloat16` the first moments are planned in bfloat16."""
    import jax
    import jax.numpy as jnp
    import optax

    config = small_toy(**{"mesh.fsdp": 4, "model.dtype": "bfloat16"})
    trainer, state, _ = planning.abstract_step(config, planning.topology_devices("v5p:2x2x1"))
    floats = {x.dtype for x in jax.tree.leaves((state.policy, state.policy_opt, state.critic,
                                                 state.critic_opt))
              if jnp.issubdtype(x.dtype, jnp.floating)}
    assert floats == {jnp.dtype(jnp.float32)} and trainer.compute_dtype == jnp.bfloat16
    # swe's recipe: AdamW's first moments in bfloat16, the second ones and the weights float32
    config = small_toy(**{"mesh.fsdp": 4, "model.dtype": "bfloat16",
                          "optim.policy.mu_dtype": "bfloat16",
                          "optim.critic.mu_dtype": "bfloat16"})
    _, state, _ = planning.abstract_step(config, planning.topology_devices("v5p:2x2x1"))
    for opt, params in ((state.policy_opt, state.policy), (state.critic_opt, state.critic)):
        # optax.tree.get: the one `mu` / `nu` field of the state (it raises for none or two)
        mu, nu = optax.tree.get(opt, "mu"), optax.tree.get(opt, "nu")
        assert {x.dtype for x in jax.tree.leaves(mu)} == {jnp.dtype(jnp.bfloat16)}
        assert {x.dtype for x in jax.tree.leaves(nu)} == {jnp.dtype(jnp.float32)}
        assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}


def test_the_publish_plan_deals_the_files_to_the_hosts_by_bytes():
    """Qwen3-30B-A3B in bfloat16 from the 8 hosts of a v5p:2x4x4 slice: 15 files of at most
    4 GiB, the policy's bytes in all; no host writes more than its share plus one file, and the
    time is the most loaded host's at the stated disk bandwidth."""
    cfg = preset("qwen3-30b-a3b", param_dtype="bfloat16")
    shapes = nnx.state(nnx.eval_shape(lambda: CausalLM(cfg, nnx.Rngs(0))), nnx.Param)
    total = sum(math.prod(x.shape) * 2 for x in jax.tree.leaves(shapes))
    publish = planning.publish_plan(cfg, 8)
    assert publish.total_bytes == total == sum(publish.host_bytes)
    assert publish.files == 15 and len(publish.host_bytes) == 8
    assert max(publish.host_bytes) <= total / 8 + 4 * planning.GiB
    assert publish.seconds == max(publish.host_bytes) / planning.DISK_BYTES_PER_S
    report = "\n".join(publish.report())
    assert f"at {planning.DISK_BYTES_PER_S / 1e6:.0f} MB/s per host" in report
    assert "8 host(s)" in report and "56.87 GiB in bfloat16" in report


def test_a_mesh_that_does_not_match_the_topology_names_the_fix():
    config = small_toy(**{"mesh.fsdp": 8})
    with pytest.raises(ValueError, match=r"v5p:2x2x1 has 4 devices \(TPU v5\): config.mesh = "
                                         r".*'fsdp': 8.*does not divide the 4 devices: set "
                                         r"e.g. --config.mesh.fsdp=4"):
        planning.make_plan(config, "v5p:2x2x1", log=lambda _: None)
    with pytest.raises(ValueError, match="--topology='v5p:banana'"):
        planning.make_plan(config, "v5p:banana", log=lambda _: None)


def test_an_oversized_step_exits_1_naming_what_to_change(tmp_path):
    """`make plan` as a user runs it: 64 rows of 8k tokens on 4 v5e chips (16 GiB each) hold
    [rows, heads, 8k, 8k] attention scores that they cannot."""
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "sao_jax.main", "--config=experiments/toy.py", "--plan",
         "--topology=v5e:2x2", "--config.batch_size=64",
         "--config.rollout.engine_max_seq_len=8191", f"--plan_json={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "does not fit" in proc.stdout, proc.stdout
    assert "--config.rl.microbatches" in proc.stdout and "remat" in proc.stdout
    figures = json.loads(out.read_text())
    assert not figures["fits"]
    # The TPU compiler itself refuses a program past the chip's HBM (else the peak says it).
    assert (not figures["compiled"] and "ran out of HBM" in proc.stdout) or \
        figures["peak_bytes"] > 16 * planning.GiB, proc.stdout


def test_forward_flops_match_xlas_count_of_a_per_layer_forward():
    """The FLOP formula against XLA's own count of a forward pass with no loops in it (layers
    per-layer; a dense Qwen3, since every MoE dispatch on a CPU computes more than the routed
    experts that the formula counts)."""
    cfg = preset("small", num_experts=0)
    model = CausalLM(cfg, nnx.Rngs(0))
    rows, length = 2, 256
    ids = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    graph, params = nnx.split(model)
    counted = jax.jit(lambda p, x: nnx.merge(graph, p)(x)).lower(params, ids).compile()
    xla = counted.cost_analysis()["flops"]
    # Causal attention computed in full: the formula's half-row average, doubled.
    d = cfg.num_heads * cfg.head_dim
    full_attention = cfg.num_layers * 2 * 2 * d * length / 2
    formula = (planning.forward_flops_per_token(cfg, length) + full_attention) * rows * length
    assert formula == pytest.approx(xla, rel=0.1), (formula, xla)
    assert math.isfinite(formula)


def gathered_batch_arrays(hlo: str, rows: int, length: int) -> list[str]:
    """The all-gathers in `hlo` whose operands or results are `[rows, length]` or
    `[rows, length - 1]` (the step's token arrays)."""
    shapes = (f"[{rows},{length}]", f"[{rows},{length - 1}]")
    return [line.strip() for line in hlo.splitlines()
            if "all-gather" in line and any(s in line for s in shapes)]


def test_the_pallas_kernels_run_per_shard_on_simulated_cpu_devices():
    """The GAE and DIS kernels in the step on a 4-way fsdp mesh of CPU devices, interpreted:
    the step with them gathers no [B, T] array that the same step without them does not (it
    does when they are not under shard_map)."""
    gathered = {}
    for impl in ("pallas", "xla"):
        config = small_toy(**{"mesh.fsdp": 4, "rl.gae_impl": impl, "rl.dis_impl": impl,
                              "pack_rows": False})
        trainer, state, spec = planning.abstract_step(config, jax.devices()[:4])
        hlo = trainer.lower(state, spec).compile().as_text()
        gathered[impl] = gathered_batch_arrays(hlo, *spec.tokens[0])
    assert len(gathered["pallas"]) <= len(gathered["xla"]), gathered["pallas"]
    # The check sees a gather of a token array when there is one.
    assert gathered_batch_arrays(
        "%all-gather.1 = f32[8,255]{1,0} all-gather(f32[2,255]{1,0} %x)", 8, 256)


@pytest.mark.parametrize("name", ["toy", "tir", "online_style", "swe", "swe_mini"])
def test_every_experiments_mesh_matches_its_plan_topology(name):
    import importlib

    from sao_jax.train import build

    config = importlib.import_module(f"experiments.{name}").get_config()
    devices = planning.topology_devices(config.plan.topology)
    shape = build.mesh_shape(config, len(devices))
    assert math.prod(shape.values()) == len(devices)
