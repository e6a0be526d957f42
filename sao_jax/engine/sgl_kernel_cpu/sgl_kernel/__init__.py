"""A stand-in for SGLang's `sgl_kernel` on CPU hosts only: never use it on a GPU host.

SGLang's kernel package has no CPU build (importing the real one fails for want of libcuda), yet
SGLang 0.5.23 imports these names from it even with `SGLANG_USE_CPU_ENGINE=1`, and then takes its
plain-torch paths on a CPU. `sao_jax.engine.sglang_server` puts this folder's parent first on
the server's PYTHONPATH when it launches SGLang with `device="cpu"`, so that the server imports.

Each name is a function that raises when called: a CPU server that reached one would be running
a CUDA kernel it does not have. A call is also appended to the file named by
`$SAO_SGL_KERNEL_CALLS`, so that a run can show that none happened (the server may swallow the
exception). Submodules (`sgl_kernel.scalar_type`, ...) are deliberately absent: SGLang falls back
where their import fails. The names are those SGLang 0.5.23 imports when it starts on a CPU.
"""

import os
import sys

NAMES = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rmsnorm",
    "verify_tree_greedy_cpu",
)


def _stand_in(name: str):
    def call(*args, **kwargs):
        calls = os.environ.get("SAO_SGL_KERNEL_CALLS")
        if calls:
            with open(calls, "a") as f:
                f.write(name + "\n")
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is sao_jax's CPU stand-in for sgl_kernel "
            "(sao_jax/engine/sgl_kernel_cpu): SGLang needs its real kernels here; launch it "
            "with device 'cuda' on a GPU host.")

    call.__name__ = call.__qualname__ = name
    return call


for _name in NAMES:
    globals()[_name] = _stand_in(_name)
del _name

print(f"sgl_kernel: sao_jax's CPU stand-in ({__file__})", file=sys.stderr, flush=True)
