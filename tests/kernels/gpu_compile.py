"""The kernels compiled for an NVIDIA GPU on a host without one, one compile per process.

    python -m tests.kernels.gpu_compile --target=h100 --kernel=gae --program=grad --rows=1 \
        --time=1024 --num_warps=4
    python -m tests.kernels.gpu_compile --target=h100 --step=toy

XLA's CUDA compiler (the jax-cuda12-plugin of jaxlib's version, in the virtualenv that `make
test-gpu-compile` makes) compiles for the devices of a GPU target description
(`gpu_targets/*.txtpb`, XLA's `GpuTargetConfigProto`) with no GPU present: the whole GPU pipeline,
Pallas' Triton kernels through Triton down to PTX for sm_90a, and ptxas. The kernels take their
variant from the platform of their `sharding`'s devices, here "gpu", so a compile that passes holds
the Triton kernels, not the interpreter.

`compile_in_child` runs one compile in a process of its own, so that a crash of the compiler (a
segfault, which has happened: tests/kernels/test_gpu_compile.py) ends that process only, and
returns what the compile held: its Triton custom calls, the entry points and target of each PTX
module XLA dumped, and the threads each kernel launches with.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

GPU_TARGETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")
TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRITON_CALL = 'custom_call_target="__gpu$xla.gpu.triton"'
# The kernels each program holds, by their pallas_call names (which Triton keeps as the PTX
# entry points' names).
KERNELS = {
    ("gae", "forward"): ("gae_forward",),
    ("gae", "grad"): ("gae_forward", "gae_backward"),
    ("dis", "forward"): ("dis_forward",),
    ("dis", "grad"): ("dis_forward", "dis_backward"),
}
B, T = 16, 1000  # T ragged against every block


def plugin_missing() -> str | None:
    """Why the CUDA compiler is not available in this environment, or None where it is."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError as e:
        return (f"the CUDA PJRT plugin is not importable here ({e}): `make test-gpu-compile` "
                "runs these tests in .venv-gpu, which has jax-cuda12-plugin at jaxlib's version")
    return None


def cuda_devices(target: str) -> list:
    """The compile-only devices of one GPU of `target` (a key of TARGETS)."""
    from jax.experimental import topologies

    with open(os.path.join(GPU_TARGETS, TARGETS[target])) as f:
        config = f.read()
    return list(topologies.get_topology_desc(platform="cuda", topology_name="",
                                             target_config=config, topology="1x1x1").devices)


@dataclasses.dataclass
class Compiled:
    """What one compile in a child process gave."""

    returncode: int
    seconds: float = 0.0  # lowering and compiling, in the child
    triton_calls: int = 0  # Triton custom calls in the compiled HLO
    ptx_entries: dict = dataclasses.field(default_factory=dict)  # entry point -> PTX .target
    threads: dict = dataclasses.field(default_factory=dict)  # kernel -> threads per block
    output: str = ""  # the child's stdout and stderr, the end of them

    @property
    def failure(self) -> str:
        """How the child ended, in words ("" when it exited 0)."""
        if self.returncode == 0:
            return ""
        if self.returncode < 0:
            name = signal.Signals(-self.returncode).name
            return f"the compiling process died of signal {-self.returncode} ({name})"
        return f"the compiling process exited with {self.returncode}"


def child_env(dump_dir: str, xla_flags: tuple[str, ...] = ()) -> dict:
    """The child's environment: XLA dumps what it compiles into `dump_dir`, with `xla_flags` and
    no other XLA flag (the test session's quick CPU passes and simulated devices stay out of a
    GPU compile);
    JAX_PLATFORMS=cpu, so that the CUDA plugin skips its check of the CUDA runtime, which fails
    on a host without one and would leave the plugin, and its compiler, unregistered."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join([f"--xla_dump_to={dump_dir}", *xla_flags])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def compile_in_child(args: list[str], dump_dir: str, xla_flags: tuple[str, ...] = (),
                     timeout: float = 600) -> Compiled:
    """Runs `python -m tests.kernels.gpu_compile *args` and returns what it compiled, or how it
    died."""
    os.makedirs(dump_dir, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "tests.kernels.gpu_compile", *args], cwd=REPO,
                          env=child_env(dump_dir, xla_flags), capture_output=True, text=True,
                          timeout=timeout)
    output = (done.stdout + done.stderr)[-4000:]
    if done.returncode != 0:
        return Compiled(done.returncode, output=output)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return Compiled(0, result["seconds"], result["triton_calls"], *read_dump(dump_dir),
                    output=output)


def read_dump(dump_dir: str) -> tuple[dict, dict]:
    """`({entry point: PTX target}, {kernel: threads per block})` from XLA's dump: the PTX
    modules it generated and its thunk sequence (each kernel launch with its grid and block)."""
    entries = {}
    for path in glob.glob(os.path.join(dump_dir, "*.ptx")):
        with open(path) as f:
            ptx = f.read()
        target = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE)
        for name in re.findall(r"\.entry\s+(\w+)\(", ptx):
            entries[name] = target.group(1) if target else ""
    threads = {}
    for path in glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")):
        with open(path) as f:
            for name, count in re.findall(r"(\w+) grid: \[[\d, ]+\] threads: \[(\d+)", f.read()):
                threads[name] = int(count)
    return entries, threads


def kernel_program(kernel: str, program: str, blocks, sharding):
    """`(fn, abstract args)`: one kernel's forward, or its gradient (the forward and the
    backward kernel in one program), on `[B, T]` operands split by rows as `sharding` says."""
    import jax
    import jax.numpy as jnp

    from sao_jax import kernels

    f32 = jax.ShapeDtypeStruct((B, T), jnp.float32, sharding=sharding)
    mask = jax.ShapeDtypeStruct((B, T), jnp.bool_, sharding=sharding)
    row = jax.ShapeDtypeStruct((B,), jnp.float32, sharding=sharding)
    if kernel == "gae":
        def forward(r, v, m, lv):
            return kernels.gae(r, v, m, gamma=1.0, lam=0.95, last_value=lv, truncated=lv > 0,
                               blocks=kernels.GaeBlocks(*blocks), sharding=sharding)

        def grad(r, v, m, lv):
            out, pullback = jax.vjp(lambda r, v, lv: forward(r, v, m, lv), r, v, lv)
            return pullback(out)

        return (forward if program == "forward" else grad), (f32, f32, mask, row)

    def forward(lp, rlp, a, m):
        return kernels.dis_loss(lp, rlp, a, m, eps_low=0.3, eps_high=5.0,
                                blocks=kernels.DisBlocks(*blocks), sharding=sharding)

    def grad(lp, rlp, a, m):
        return jax.grad(lambda lp: forward(lp, rlp, a, m)[0])(lp)

    return (forward if program == "forward" else grad), (f32, f32, f32, mask)


def toy_step(devices, impl: str):
    """`(trainer, abstract state, batch spec)` of the toy experiment's learner on `devices`
    (`train.plan.abstract_step`), its GAE and DIS run as `impl` ("pallas": the kernels; "auto":
    what the learner picks)."""
    from experiments import toy
    from sao_jax.train import plan

    config = toy.get_config()
    config.batch_size = 8
    config.rl.gae_impl = impl
    config.rl.dis_impl = impl
    trainer, state, spec = plan.abstract_step(config, devices)
    return trainer, state, spec


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(TARGETS), required=True)
    parser.add_argument("--kernel", choices=("gae", "dis"))
    parser.add_argument("--program", choices=("forward", "grad"), default="forward")
    parser.add_argument("--rows", type=int)
    parser.add_argument("--time", type=int)
    parser.add_argument("--num_warps", type=int)
    parser.add_argument("--step", choices=("toy",), help="the learner step instead of a kernel")
    parser.add_argument("--impl", default="pallas", help="the step's gae_impl and dis_impl")
    args = parser.parse_args(argv)

    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = cuda_devices(args.target)
    start = time.perf_counter()
    if args.step:
        trainer, state, spec = toy_step(devices, args.impl)
        compiled = trainer.lower(state, spec, update_policy=True).compile()
    else:
        sharding = NamedSharding(Mesh(devices, ("rows",)), PartitionSpec("rows"))
        fn, abstract = kernel_program(args.kernel, args.program,
                                      (args.rows, args.time, args.num_warps), sharding)
        compiled = jax.jit(fn).lower(*abstract).compile()
    seconds = time.perf_counter() - start
    print(json.dumps(dict(seconds=round(seconds, 3),
                          triton_calls=compiled.as_text().count(TRITON_CALL))))


if __name__ == "__main__":
    main()
