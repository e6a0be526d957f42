"""Pallas kernels for SAO's hot loops, each beside its pure-jnp reference: `sao_jax.kernels`.

    from sao_jax import kernels
    adv, ret = kernels.gae(rewards, values, mask, gamma=1.0, lam=0.95)          # skip-obs GAE
    loss, metrics = kernels.dis_loss(logp, rollout_logp, adv, mask, eps_low=0.3, eps_high=5.0)

Each kernel has a TPU (Mosaic) and a GPU (Triton) variant, chosen from the devices by its wrapper,
and runs in Pallas' interpreter on a CPU. Each op is written once in plain jnp here
(`gae_reference`, `dis_loss_reference`), with one set of argument checks (`check_gae_args`,
`check_dis_args`) and, for DIS, one metrics tuple (`DisMetrics`); the tests hold the kernels to
those references, forward and gradient. This package imports nothing of `sao_jax`: `sao_jax.rl`
builds on it (its impl="reference" / "xla" paths are these references, impl="pallas" these
kernels, and `resolve_impl` is its "auto"), never the other way.
"""

from ._common import platform_of, resolve_impl
from .dis import DisBlocks, DisMetrics, check_dis_args, dis_loss, dis_loss_reference
from .gae import GaeBlocks, bootstrap_value, check_gae_args, gae, gae_reference

__all__ = [
    "DisBlocks",
    "DisMetrics",
    "GaeBlocks",
    "bootstrap_value",
    "check_dis_args",
    "check_gae_args",
    "dis_loss",
    "dis_loss_reference",
    "gae",
    "gae_reference",
    "platform_of",
    "resolve_impl",
]
