"""`make plan`: the experiment's learner step compiled ahead of time for a TPU slice, from any host.

    make plan EXP=swe [TOPOLOGY=v5p:2x4x4]
    python -m sao_jax.main --config=experiments/swe.py --plan [--topology=v5p:2x4x4]

`jax.experimental.topologies` describes the slice's devices without having them, and the real
TPU compiler (libtpu, the `tpu` extra that `make plan` installs) compiles for them here: the
policy and the critic, both optimizer states, the experiment's mesh and sharding rules, its
largest batch (rows x bucketed length, packed or not, in its micro-batches) and its algorithm,
all as abstract values — no weights are read or made. The model's architecture comes from
`config.model.path`'s config.json when that directory exists here, else from
`config.model.preset` (e.g. "qwen3-30b-a3b", standing in for a checkpoint that lives on the
pod).

Reported per device: the bytes of parameters, optimizer states and the batch (from the abstract
state's shards), and the compiled program's argument, output, aliased (donated), temporary and
code bytes (`memory_analysis`); their peak against the chip's HBM; the compile time; model
FLOPs per step with the tokens per second they allow at 100% and 40% of the chip's peak; and
the step's roofline.

Publishing (`publish_plan`): the files `save_hf` writes for the policy (in `config.model.dtype`)
and the bytes each host writes, the files dealt to the slice's hosts by bytes
(`models.hf.file_owners`), and how long the most loaded host takes at DISK_BYTES_PER_S, an
assumed disk bandwidth per host stated in the report (the hosts write in parallel; each bucket
is gathered to the host that writes it, and to no other).

FLOPs are counted from the architecture (`step_flops`), not read from XLA's cost analysis: that
counts the body of a loop once, and the step's layers, micro-batches and critic updates are
loops. Model FLOPs follow the usual MFU convention: matmuls and causal attention (each token
attends to half the row on average), a backward pass twice the forward, rematerialisation not
counted.

The roofline (`roofline.Roofline`), per step and device: the FLOPs the step executes (model
FLOPs plus the forward passes remat repeats, over the devices that split the work,
`work_shards`), the HBM bytes and the collective bytes counted from the compiled program's HLO
with every loop weighted by its trips (`roofline.count`), each as the time it takes at the
chip's peak (`CHIPS`: FLOP/s, HBM and ICI bandwidth), and the longest of the three: the bound.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax import quiet_libtpu
from sao_jax.models import CausalLM, ModelConfig
from sao_jax.models.hf import read_config, save_plan
from sao_jax.train import build, roofline, sharding
from sao_jax.train.roofline import Roofline
from sao_jax.train.steps import Trainer

GiB = 1 << 30
DISK_BYTES_PER_S = 500e6  # assumed write bandwidth of each host's disk, for the publish time



@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip's published figures: HBM capacity (bytes), peak dense bf16 FLOP/s, HBM
    bandwidth and bidirectional inter-chip interconnect (ICI) bandwidth (bytes/s)."""

    hbm_bytes: int
    peak_flops: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float


# device_kind -> its figures, from Google Cloud's TPU pages (cloud.google.com/tpu/docs/v4, v5e,
# v5p, v6e: "peak compute per chip (bf16)", "HBM capacity and bandwidth", "bidirectional
# inter-chip interconnect (ICI) bandwidth per chip"). v4's page gives no per-chip ICI figure:
# its "all-reduce bandwidth per pod" (1.1 PB/s over 4096 chips) is, as on the v5e and v6e pages,
# half the bidirectional figure, so twice its share per chip.
CHIPS: dict[str, Chip] = {
    "TPU v4": Chip(32 * GiB, 275e12, 1200e9, 2 * 1.1e15 / 4096),
    "TPU v5 lite": Chip(16 * GiB, 197e12, 819e9, 400e9),  # v5e
    "TPU v5": Chip(95 * GiB, 459e12, 2765e9, 1200e9),  # v5p
    "TPU v6 lite": Chip(32 * GiB, 918e12, 1638e9, 800e9),  # v6e (Trillium)
}


@dataclasses.dataclass
class Plan:
    """What `make_plan` found; `report()` prints it, `problems` say what to change."""

    experiment: str
    topology: str
    chip: str
    devices: int
    mesh: dict[str, int]
    rows: int
    length: int
    packed_rows: int | None
    microbatches: int
    algo: str
    remat: str
    params: dict[str, int]  # {policy, critic}: parameter counts
    state_bytes: dict[str, int]  # per device, by kind
    memory: dict[str, int]  # per device, the compiled program's memory_analysis
    hbm_bytes: int
    compile_s: float
    flops: float  # per step, all devices
    tokens: int  # per step (rows x length, padding included)
    peak_flops: float  # per device
    publish: PublishPlan | None = None
    roofline: Roofline | None = None  # None: not compiled
    work_shards: int = 1  # devices that split the step's work (`work_shards`)
    compiled: bool = True  # False: the TPU compiler ran out of HBM (see problems)
    problems: list[str] = dataclasses.field(default_factory=list)
    # the dtype the state keeps the parameters in, and the one the passes compute in
    dtypes: tuple[str, str] = ("float32", "float32")
    hlo: str | None = dataclasses.field(default=None, repr=False)  # make_plan(keep_hlo=True)

    @property
    def peak_bytes(self) -> int:
        """Live at once per device: arguments, outputs not written over donated arguments,
        temporaries and the program itself."""
        m = self.memory
        return (m["argument"] + m["output"] - m["alias"] + m["temp"] + m["code"])

    @property
    def fits(self) -> bool:
        return not self.problems and self.peak_bytes <= self.hbm_bytes

    def tokens_per_s(self, utilisation: float) -> float:
        seconds = self.flops / self.devices / (self.peak_flops * utilisation)
        return self.tokens / seconds

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "hlo"}
        out.update(peak_bytes=self.peak_bytes, fits=self.fits,
                   tokens_per_s_100=self.tokens_per_s(1.0),
                   tokens_per_s_40=self.tokens_per_s(0.4),
                   publish_s=self.publish.seconds if self.publish else None)
        if self.roofline is not None:
            out["roofline"].update(seconds=self.roofline.seconds, bound=self.roofline.bound)
        return out

    def report(self) -> str:
        shape = f"{self.rows} x {self.length}"
        if self.packed_rows is not None:
            shape = f"{self.rows} trajectories packed into {self.packed_rows} x {self.length}"
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "one device"
        lines = [
            f"plan: {self.experiment} ({self.algo}) on {self.topology}: {self.devices} x "
            f"{self.chip}, {_gib(self.hbm_bytes)} HBM each; mesh {mesh}",
            f"  batch {shape} tokens in {self.microbatches} micro-batch(es); remat "
            f"{self.remat}; policy {_parameters(self.params['policy'])} parameters, critic "
            f"{_parameters(self.params['critic'])}, kept in {self.dtypes[0]}, computed in "
            f"{self.dtypes[1]}",
            "  per device:",
        ]
        for kind, value in self.state_bytes.items():
            lines.append(f"    {kind:<26}{_gib(value):>12}")
        if self.compiled:
            for kind, label in (("argument", "arguments (state + batch)"),
                                ("output", "outputs"), ("alias", "outputs donated in place"),
                                ("temp", "temporaries"), ("code", "program")):
                lines.append(f"    {label:<26}{_gib(self.memory[kind]):>12}")
            headroom = self.hbm_bytes - self.peak_bytes
            lines.append(f"    {'peak':<26}{_gib(self.peak_bytes):>12}  of "
                         f"{_gib(self.hbm_bytes)} ({100 * self.peak_bytes / self.hbm_bytes:.0f}%)"
                         f", headroom {_gib(headroom)}")
        else:
            lines.append("    (the compiler refused the program: no memory analysis)")
        lines += [
            f"  {'compiled' if self.compiled else 'compiler gave up'} in {self.compile_s:.1f} s",
            f"  model FLOPs per step {self.flops:.3e} ({self.tokens:,} tokens): "
            f"{self.tokens_per_s(1.0):,.0f} tokens/s at 100% of peak, "
            f"{self.tokens_per_s(0.4):,.0f} at 40%",
        ]
        if self.roofline is not None:
            lines += self.roofline.report()
            if self.work_shards < self.devices:
                lines.append(f"    (the step's work splits over {self.work_shards} of the "
                             f"{self.devices} devices, rows and tensor: each row's work runs on "
                             f"{self.devices // self.work_shards})")
        if self.publish is not None:
            lines += self.publish.report()
        if self.problems:
            lines += ["", "does not fit:"] + [f"  - {p}" for p in self.problems]
        elif not self.fits:
            lines += ["", f"does not fit: {_gib(self.peak_bytes)} per device of "
                          f"{_gib(self.hbm_bytes)}"]
        else:
            lines += ["", "fits"]
        return "\n".join(lines)


@dataclasses.dataclass
class PublishPlan:
    """What `save_hf` writes for the policy: `files` files of `total_bytes` in `dtype`, and the
    tensor bytes each of the `hosts` writes (`host_bytes`), the time at `disk_bytes_per_s`."""

    dtype: str
    files: int
    total_bytes: int
    host_bytes: list[int]
    disk_bytes_per_s: float

    @property
    def seconds(self) -> float:
        """The most loaded host's writes at `disk_bytes_per_s` (the hosts write in parallel)."""
        return max(self.host_bytes) / self.disk_bytes_per_s

    def report(self) -> list[str]:
        return [
            f"  publish (save_hf): {self.files} file(s), {_gib(self.total_bytes)} in "
            f"{self.dtype}, dealt to {len(self.host_bytes)} host(s) by bytes",
            f"    {'written per host':<26}{_gib(max(self.host_bytes)):>12}  at most, "
            f"{_gib(min(self.host_bytes))} at least",
            f"    {'time to write':<26}{self.seconds:>10.1f} s  at "
            f"{self.disk_bytes_per_s / 1e6:.0f} MB/s per host (plan.DISK_BYTES_PER_S, assumed)",
        ]


def publish_plan(cfg: ModelConfig, hosts: int,
                 disk_bytes_per_s: float = DISK_BYTES_PER_S) -> PublishPlan:
    """The publish of a policy of `cfg` (in `cfg.param_dtype`) from `hosts` processes."""
    plan = save_plan(cfg, jnp.dtype(cfg.param_dtype), hosts)
    return PublishPlan(dtype=cfg.param_dtype, files=len(plan.files),
                       total_bytes=sum(plan.sizes), host_bytes=plan.process_bytes(hosts),
                       disk_bytes_per_s=disk_bytes_per_s)


def _gib(n: float) -> str:
    """Bytes in GiB, or MiB / KiB below one of the larger unit."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size or unit == "KiB":
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _parameters(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def topology_devices(topology: str) -> list:
    """The devices of a TPU topology such as "v5p:2x4x4", described without having them."""
    import importlib.util

    from jax.experimental import topologies

    if importlib.util.find_spec("libtpu") is None:
        raise ValueError("planning for a TPU needs libtpu, which this environment lacks: "
                         "`make plan` installs it (pip install -e '.[tpu]').")
    quiet_libtpu()
    try:
        return list(topologies.get_topology_desc(platform="tpu",
                                                 topology_name=topology).devices)
    except Exception as e:  # XlaRuntimeError: a malformed or unknown name
        raise ValueError(f"--topology={topology!r}: not a TPU topology libtpu knows "
                         f"({str(e).splitlines()[0][:200]}); give <generation>:<chips per "
                         "axis>, e.g. v5p:2x4x4 (32 chips) or v5e:4x4.") from e


def planned_model_config(config) -> ModelConfig:
    """The architecture the run would train, in the dtype the learner keeps it in
    (`build.master_dtype`): `config.model.path`'s config.json when it is here, else
    `config.model.preset`."""
    model = config.model
    layout = dict(moe_dispatch=model.moe_dispatch, logprob_dispatch=model.logprob_dispatch,
                  scan_layers=model.scan_layers, remat=model.remat)
    if model.path and os.path.exists(os.path.join(model.path, "config.json")):
        return read_config(model.path, param_dtype=build.master_dtype(config).name, **layout)
    if not model.preset:
        raise ValueError(f"config.model.path = {model.path!r} has no config.json on this host "
                         "and config.model.preset is empty: set --config.model.preset to the "
                         "architecture (e.g. qwen3-30b-a3b) to plan without the checkpoint.")
    layout["param_dtype"] = build.master_dtype(config).name
    return build.preset_config(config, **layout)


def forward_flops_per_token(cfg: ModelConfig, length: int, *, head: bool = True) -> float:
    """Matmul FLOPs of one token's forward pass in a row of `length` tokens: projections,
    causal attention (length / 2 keys on average), the MLP or the routed experts, and with
    `head` the LM head."""
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = 2 * d * (2 * q + 2 * kv) + 2 * 2 * q * length / 2
    total = 0.0
    for layer in range(cfg.num_layers):
        if cfg.is_moe_layer(layer):
            mlp = 2 * d * cfg.num_experts + cfg.num_experts_per_tok * 2 * 3 * d * \
                cfg.moe_intermediate_size
        else:
            mlp = 2 * 3 * d * cfg.intermediate_size
        total += attention + mlp
    return total + (2 * d * cfg.vocab_size if head else 2 * d)


# Forward passes that `ModelConfig.remat` repeats in each backward pass (matmuls only: "save_dots"
# keeps the matmuls' outputs and redoes the rest).
RECOMPUTED_PASSES = {"none": 0, "save_dots": 0, "full": 1, "nested": 2}


def step_flops(cfg: ModelConfig, trainer: Trainer, tokens: int, length: int, *,
               recompute: bool = False) -> float:
    """Model FLOPs of one policy-updating step on `tokens` tokens in rows of `length`.

    Passes, in forward-pass units (a backward pass is two): the critic's values before its
    updates (1), its K updates (3 each) and, unless `reuse_values`, the values after them (1);
    the policy loss's passes before its updates (`PolicyLoss.old_policy_passes`: PPO's old
    log-probs, 1; DIS none) and its updates (3). `recompute`:
    also the forward passes `cfg.remat` repeats in each update's backward pass
    (`RECOMPUTED_PASSES`), as the step executes them."""
    c, algo = trainer.config, trainer.config.algorithm
    update = 3 + (RECOMPUTED_PASSES[cfg.remat] if recompute else 0)
    policy = forward_flops_per_token(cfg, length)
    total = (algo.policy_loss.old_policy_passes + update) * policy
    if algo.uses_critic:
        critic = forward_flops_per_token(cfg, length, head=False)
        total += (1 + update * algo.critic_steps + (0 if c.reuse_values else 1)) * critic
    return total * tokens


def work_shards(config, mesh) -> int:
    """The devices that split the step's work: along the mesh axes that split the rows (the
    batch rule) and the matmuls (`tensor`). Devices along the other axes (`expert`, `fsdp`
    where it does not split the rows) hold the same rows and repeat their work."""
    axes = set(dict(build.sharding_rules(config))["batch"]) | {"tensor"}
    return math.prod(mesh.shape[a] for a in axes if a in mesh.shape)


def make_plan(config, topology: str | None = None, *, log=print,
              keep_hlo: bool = False) -> Plan:
    """Compiles the learner step of `config` for `topology` (default `config.plan.topology`)
    and measures it; see the module docstring. `keep_hlo`: also keep the compiled program's
    text (`Plan.hlo`), e.g. to check what it communicates.

    Raises:
      ValueError: the mesh does not match the topology's device count, an unknown chip, or a
        model that cannot be built (each naming the field to change).
    """
    build.check_config(config)
    topology = topology or config.plan.topology
    devices = topology_devices(topology)
    chip = devices[0].device_kind
    if chip not in CHIPS:
        raise ValueError(f"--topology={topology!r}: no HBM and peak figures for {chip!r} "
                         f"(known: {sorted(CHIPS)}); add them to sao_jax.train.plan.CHIPS.")
    per_chip = len({getattr(d, "core_on_chip", 0) for d in devices})
    figures = CHIPS[chip]
    hbm, peak = figures.hbm_bytes / per_chip, figures.peak_flops / per_chip
    log(f"planning {config.name} ({config.algo}) for {topology}: {len(devices)} x {chip}; "
        f"compiling the learner step with abstract weights ...")
    try:
        trainer, state, spec = abstract_step(config, devices)
    except ValueError as e:
        raise ValueError(f"{topology} has {len(devices)} devices ({chip}): {e}") from None
    cfg = trainer.cfg
    mesh = trainer.mesh
    model_rows = (spec.packing or spec).tokens[0]
    rows, length = spec.tokens[0]

    problems = []
    start = time.perf_counter()
    try:
        compiled = trainer.lower(state, spec, update_policy=True).compile()
    except Exception as e:  # the TPU compiler refuses a program that cannot fit in HBM
        if "RESOURCE_EXHAUSTED" not in str(e) and "memory" not in str(e).lower():
            raise
        compiled = None
        problems.append(f"the TPU compiler ran out of HBM: "
                        f"{str(e).splitlines()[0][:300].rstrip('.')}; "
                        + _advice(config, temporaries=True))
    compile_s = time.perf_counter() - start
    memory = dict(argument=0, output=0, alias=0, temp=0, code=0)
    if compiled is not None:
        m = compiled.memory_analysis()
        memory = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
                      alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes,
                      code=m.generated_code_size_in_bytes)
    state_bytes = {
        "policy parameters": _shard_bytes(state.policy),
        "policy optimizer state": _shard_bytes(state.policy_opt),
        "critic parameters": _shard_bytes(state.critic),
        "critic optimizer state": _shard_bytes(state.critic_opt),
        "batch": _shard_bytes(trainer.abstract_batch(spec)),
    }
    params = {"policy": _count(state.policy), "critic": _count(state.critic)}
    tokens = math.prod(model_rows)
    shards = work_shards(config, mesh)
    hlo = roof = None
    if compiled is not None:
        hlo = compiled.as_text()
        counts = roofline.count(hlo)
        roof = roofline.Roofline(
            flops=step_flops(cfg, trainer, tokens, model_rows[1], recompute=True) / shards,
            hbm_bytes=counts.hbm_bytes, collective_bytes=counts.collective_bytes,
            peak_flops=peak, hbm_bytes_per_s=figures.hbm_bytes_per_s / per_chip,
            ici_bytes_per_s=figures.ici_bytes_per_s / per_chip,
            unknown_loops=counts.unknown_loops)
    plan = Plan(
        experiment=config.name, topology=topology, chip=chip, devices=len(devices),
        mesh=dict(mesh.shape), rows=rows, length=model_rows[1],
        packed_rows=model_rows[0] if spec.packing is not None else None,
        microbatches=trainer.config.microbatches, algo=config.algo, remat=cfg.remat,
        params=params, state_bytes=state_bytes, memory=memory, hbm_bytes=int(hbm),
        compile_s=compile_s, flops=step_flops(cfg, trainer, tokens, model_rows[1]),
        tokens=tokens, peak_flops=peak,
        publish=publish_plan(cfg.replace(param_dtype=config.model.dtype),
                             len({d.process_index for d in devices})),
        roofline=roof, work_shards=shards, compiled=compiled is not None, problems=problems,
        dtypes=(build.master_dtype(config).name, jnp.dtype(config.model.dtype).name),
        hlo=hlo if keep_hlo else None)
    if compiled is not None and plan.peak_bytes > plan.hbm_bytes:
        state = sum(v for k, v in plan.state_bytes.items() if k != "batch")
        plan.problems.append(
            f"{_gib(plan.peak_bytes)} per device of {_gib(plan.hbm_bytes)}: temporaries "
            f"{_gib(plan.memory['temp'])}, parameters and optimizer states {_gib(state)}; "
            + _advice(config, temporaries=plan.memory["temp"] >= state))
    return plan


def abstract_step(config, devices) -> tuple[Trainer, Any, Any]:
    """`(trainer, abstract state, batch spec)` of `config`'s learner on a mesh of `devices`
    (any platform's, e.g. a TPU topology's), with no weights anywhere; `spec` is the largest
    batch the run can meet (`build.step_shapes`). `trainer.lower(state, spec)` lowers its
    step."""
    mesh = sharding.make_mesh(build.mesh_shape(config, len(devices)), devices)
    rules = build.sharding_rules(config)
    cfg = planned_model_config(config)
    policy = sharding.abstract_model(lambda: build.training_layout(
        config, CausalLM(cfg.replace(scan_layers=False, remat="none"), nnx.Rngs(0))),
        mesh, rules)
    # The running-mean baseline's slots: one per training prompt (the task is not built here).
    trainer = build.make_trainer(config, policy, max(config.env.num_train_prompts, 1),
                                   mesh=mesh, rules=rules)
    state = trainer.abstract_state(config.seed)
    spec = max(build.step_shapes(config, trainer),
               key=lambda s: math.prod((s.packing or s).tokens[0]))
    return trainer, state, spec


def _advice(config, *, temporaries: bool) -> str:
    """What to change when the step needs more than the chip has: for activations (the
    temporaries), or for the state."""
    if temporaries:
        remat = "" if config.model.remat == "full" else (
            f" set --config.model.remat=full (now {config.model.remat!r});")
        return (f"raise --config.rl.microbatches (now {config.rl.microbatches});{remat} shorten "
                f"rows (--config.rollout.engine_max_seq_len, now "
                f"{config.rollout.engine_max_seq_len}); or add devices along data/fsdp")
    sizes = {axis: config.mesh[axis] for axis in sharding.MESH_AXES}  # not mesh.rules
    return ("shard the state over more devices (--config.mesh.fsdp, --config.mesh.expert; now "
            f"{sizes}) or plan a larger topology")


def _shard_bytes(tree) -> int:
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None \
            else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def _count(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def write_json(plan: Plan, path: str) -> None:
    with open(path, "w") as f:
        json.dump(plan.as_dict(), f, indent=2)
