"""The Triton kernels compiled for NVIDIA H100 and H200 GPUs on a host without one (`make
test-gpu-compile`; tests/kernels/gpu_compile.py says how).

Each compile runs in a process of its own: a compiler that crashes fails the one test, which names
the kernel, the target, the block and the signal. A compile that passes must hold the Triton
kernels themselves (the `__gpu$xla.gpu.triton` custom calls, and each kernel as an entry point of
the PTX XLA generated for sm_90a, launched with `num_warps` warps), so that neither the
interpreter nor an XLA fallback can pass.

What this found: Triton (jaxlib 0.10.2's CUDA plugin) segfaulted on every one-row GAE block of
two or more tokens, the default (1 x 1024) included, forward and backward, on both targets, in
the join of two one-element tensors at the bottom of the kernel's split scan; `kernels.gae` now
scans the last two lanes by selects (`_pair_scan`). What this cannot find: whether the kernels
run correctly on the GPU, or how fast (the `kernels_device` tests and benchmarks/bench_kernels.py,
on a GPU).
"""

import pytest

from sao_jax import kernels
from tests.kernels import gpu_compile

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(gpu_compile.plugin_missing() is not None,
                       reason=str(gpu_compile.plugin_missing())),
]

BLOCKS = {"gae": kernels.GaeBlocks, "dis": kernels.DisBlocks}


def compile_kernel(tmp_path, target, kernel, program, blocks):
    """Compiles one program in a child process; fails naming the block and how the child died,
    or returns what it compiled after checking that it holds the kernels."""
    args = [f"--target={target}", f"--kernel={kernel}", f"--program={program}",
            f"--rows={blocks.rows}", f"--time={blocks.time}", f"--num_warps={blocks.num_warps}"]
    got = gpu_compile.compile_in_child(args, str(tmp_path / "dump"))
    what = (f"{kernel} {program} for {target} at rows={blocks.rows}, time={blocks.time}, "
            f"num_warps={blocks.num_warps}")
    assert not got.failure, f"compiling {what}: {got.failure}\n{got.output}"
    names = gpu_compile.KERNELS[kernel, program]
    assert got.triton_calls == len(names), (what, got.triton_calls)
    for name in names:
        assert got.ptx_entries.get(name) == "sm_90a", (what, name, got.ptx_entries)
        assert got.threads.get(name) == 32 * blocks.num_warps, (what, name, got.threads)
    return got


@pytest.mark.parametrize("target", sorted(gpu_compile.TARGETS))
@pytest.mark.parametrize("program", ["forward", "grad"])
@pytest.mark.parametrize("kernel", ["gae", "dis"])
def test_kernels_compile_at_their_default_gpu_blocks(tmp_path, target, kernel, program):
    compile_kernel(tmp_path, target, kernel, program, BLOCKS[kernel].default("gpu"))


# Rows 1, 2, 4 against tokens 32 to 1024 per block, each program holding the forward and the
# backward kernel (a gradient); and num_warps from 1 to 8 at one and four rows. On the H100
# only: the two targets differ in memory sizes, not in the code (both sm_90a), and the sweep of
# both took half of this suite's 4.5 minutes; the defaults above compile for both.
SWEEP = ([(rows, time, 4) for rows in (1, 2, 4) for time in (32, 64, 128, 256, 512, 1024)]
         + [(rows, 1024, warps) for rows in (1, 4) for warps in (1, 2, 8)])


@pytest.mark.parametrize("target", ["h100"])
@pytest.mark.parametrize("rows,time,num_warps", SWEEP)
@pytest.mark.parametrize("kernel", ["gae", "dis"])
def test_kernels_compile_over_a_sweep_of_blocks(tmp_path, target, kernel, rows, time,
                                                num_warps):
    compile_kernel(tmp_path, target, kernel, "grad", BLOCKS[kernel](rows, time, num_warps))


@pytest.mark.parametrize("time", [1, 2, 4])
def test_gae_compiles_one_row_blocks_of_a_few_tokens(tmp_path, time):
    """The smallest blocks: a 1-token scan (no split) and the 2-lane scan alone."""
    compile_kernel(tmp_path, "h100", "gae", "grad", kernels.GaeBlocks(1, time))


def test_the_toy_learner_step_compiles_with_the_kernels(tmp_path):
    """The toy's whole learner step (critic, GAE, DIS, both updates) for one H100, GAE and DIS as
    the Triton kernels: the program the one GPU run crashed compiling. The step differentiates
    DIS, not GAE (the advantages and value targets are data to the losses): GAE's forward kernel
    (twice: value targets and advantages) and DIS's two.

    XLA's own Triton GEMM fusions are off here: without a GPU to autotune them on, this compile
    failed in XLA's GEMM emitter, on the dot of an attention projection in the backward pass
    ("Couldn't find output tile sizes that satisfy hlo: %dot.439 = f32[1016,64] ..."), none of
    the kernels; with them off, XLA calls cuBLAS for its matrix products."""
    got = gpu_compile.compile_in_child(["--target=h100", "--step=toy", "--impl=pallas"],
                                       str(tmp_path / "dump"),
                                       xla_flags=("--xla_gpu_enable_triton_gemm=false",))
    assert not got.failure, f"compiling the toy step: {got.failure}\n{got.output}"
    assert got.triton_calls == 4, got.triton_calls
    for name in ("gae_forward", "dis_forward", "dis_backward"):
        assert got.ptx_entries.get(name) == "sm_90a", (name, got.ptx_entries)
