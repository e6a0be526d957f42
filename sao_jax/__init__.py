"""sao_jax: Single-rollout Asynchronous Optimization (SAO) for LLM agents, in JAX.

`sao_jax.rl` holds the RL math as pure jittable functions of arrays: skip-observation GAE, direct
double-sided importance sampling (DIS), PPO and value losses, GRPO and running-mean baselines, and
masked statistics.
"""

import glob
import os

__version__ = "0.1.0"


def on_tpu_vm() -> bool:
    """Whether this host has TPU chips (a TPU VM)."""
    return bool(glob.glob("/dev/accel*")) or os.path.exists("/dev/vfio")


def quiet_libtpu() -> None:
    """Off a TPU VM, keeps libtpu (installed with the `tpu` extra, e.g. for `make plan`) from
    asking the metadata server for the VM's workers and host bounds and logging errors when
    nobody answers, and lets several processes compile at once (libtpu locks
    /tmp/libtpu_lockfile for chips that are not here). A TPU VM is left alone; so is any
    variable already set. Runs when `sao_jax` is imported, so that a notebook or a user's script
    that imports it before JAX starts its backends sees none of that noise."""
    if on_tpu_vm():
        return
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


quiet_libtpu()
