"""Pallas kernels for SAO's hot loops, each beside its pure-jnp reference: `sao_jax.kernels`.

    from sao_jax import kernels
    adv, ret = kernels.gae(rewards, values, mask, gamma=1.0, lam=0.95)          # skip-obs GAE
    loss, metrics = kernels.dis_loss(logp, rollout_logp, adv, mask, eps_low=0.3, eps_high=5.0)

Each kernel has a TPU (Mosaic) and a GPU (Triton) variant, chosen from the backend by its wrapper,
and runs in Pallas' interpreter on a CPU. This package imports nothing of `sao_jax`; `sao_jax.rl`
dispatches `impl="pallas"` here and shares its argument checks (`checks`), and the tests compare
both against `sao_jax.rl`'s references.
"""

from ._common import target
from .dis import DisBlocks, DisMetrics, dis_loss, dis_loss_reference
from .gae import GaeBlocks, gae, gae_reference

__all__ = [
    "DisBlocks",
    "DisMetrics",
    "GaeBlocks",
    "dis_loss",
    "dis_loss_reference",
    "gae",
    "gae_reference",
    "target",
]
