"""Pallas kernels for SAO's hot loops, each beside its pure-jnp reference: `sao_jax.kernels`.

    from sao_jax import kernels
    adv, ret = kernels.gae(rewards, values, mask, gamma=1.0, lam=0.95)          # skip-obs GAE
    loss, metrics = kernels.dis_loss(logp, rollout_logp, adv, mask, eps_low=0.3, eps_high=5.0)

Each kernel has a TPU (Mosaic) and a GPU (Triton) variant, chosen from the devices by its wrapper,
and runs in Pallas' interpreter on a CPU. Each op is written once in plain jnp here
(`gae_reference`, `dis_loss_reference`), with one set of argument checks (`check_gae_args`,
`check_dis_args`) and, for DIS, one metrics tuple (`DisMetrics`); the tests hold the kernels to
those references, forward and gradient. The kernels import nothing else of `sao_jax`: `sao_jax.rl`
builds on them (its impl="reference" / "xla" paths are these references, impl="pallas" these
kernels, and `resolve_impl` is its "auto"), never the other way.

The kernels' modules live in the repository's top-level kernels/ folder; this module is their
package (docs/layout.md, "How the kernels are packaged"). A module with a `__path__` is a package:
Python looks for `sao_jax.kernels.gae` and the rest in the folder `__path__` names. That is kernels/
beside sao_jax/ in a checkout or an editable install, and sao_jax/kernels/ beside this file in an
installed wheel (setup.py maps kernels/ there). kernels/ has no `__init__.py` of its own, so that
`import kernels` with the repository root first on sys.path (pytest, `python -m`) still finds
Hugging Face's `kernels` package, which transformers imports.
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_FOLDERS = (os.path.join(_HERE, "kernels"),                    # an installed wheel
            os.path.join(os.path.dirname(_HERE), "kernels"))   # a checkout: the top-level kernels/
__path__ = [folder for folder in _FOLDERS if os.path.isfile(os.path.join(folder, "gae.py"))][:1]
if not __path__:
    raise ImportError(f"sao_jax.kernels: no kernels/ folder holding gae.py in {_FOLDERS}")

from sao_jax.kernels._common import platform_of, resolve_impl  # noqa: E402
from sao_jax.kernels.dis import (  # noqa: E402
    DisBlocks,
    DisMetrics,
    check_dis_args,
    dis_loss,
    dis_loss_reference,
)
from sao_jax.kernels.gae import (  # noqa: E402
    GaeBlocks,
    bootstrap_value,
    check_gae_args,
    gae,
    gae_reference,
)
from sao_jax.kernels.gae_cpu import gae_cpu  # noqa: E402

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
    "gae_cpu",
    "gae_reference",
    "platform_of",
    "resolve_impl",
]
