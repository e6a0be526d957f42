"""How the kernel tests run each kernel: both variants in the interpreter, and compiled on a device.

Every test that takes `mode` runs three times: the GPU (Triton) variant and the TPU (Mosaic) variant
in Pallas' interpreter, which works on any host, and the variant of the accelerator at hand compiled
(`interpret=False`), marked `kernels_device` and skipped without a GPU or TPU. Blocks are small so
that rows and tokens span several blocks, the last of them ragged.
"""

from typing import NamedTuple

import jax
import pytest

from sao_jax import kernels

_ACCELERATOR = jax.default_backend() in ("gpu", "tpu")


class Mode(NamedTuple):
    backend: str | None
    interpret: bool
    variant: str

    @property
    def gae(self) -> dict:
        blocks = (kernels.GaeBlocks(rows=self._tpu_rows, time=128) if self.variant == "tpu"
                  else kernels.GaeBlocks(rows=2, time=32))
        return dict(backend=self.backend, interpret=self.interpret, blocks=blocks)

    @property
    def dis(self) -> dict:
        blocks = (kernels.DisBlocks(rows=self._tpu_rows, time=128) if self.variant == "tpu"
                  else kernels.DisBlocks(rows=2, time=64))
        return dict(backend=self.backend, interpret=self.interpret, blocks=blocks)

    @property
    def _tpu_rows(self) -> int:
        # 8-row blocks split the test batches; a real TPU gets 32, the int8 mask's native tiling.
        return 8 if self.interpret else 32


MODES = {
    "gpu-interpret": Mode("gpu", True, "gpu"),
    "tpu-interpret": Mode("tpu", True, "tpu"),
    "device": Mode(None, False, "tpu" if jax.default_backend() == "tpu" else "gpu"),
}


@pytest.fixture(scope="session", params=[
    "gpu-interpret",
    "tpu-interpret",
    pytest.param("device", marks=[
        pytest.mark.kernels_device,
        pytest.mark.skipif(not _ACCELERATOR, reason=(
            f"compiled kernels need a GPU or TPU; jax.default_backend() is "
            f"{jax.default_backend()!r} (the interpret modes cover both variants here)")),
    ]),
])
def mode(request) -> Mode:
    return MODES[request.param]
