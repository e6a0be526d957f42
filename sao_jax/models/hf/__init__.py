"""Hugging Face interop: Qwen3-MoE / Qwen3 safetensors directories in and out, at any scale.

`format.py` names the directory's files and holds the layout table between the HF tensors and our
parameters; `load.py` reads a directory into a model, each process only its shards (`load_hf`);
`save.py` writes one, every file by one process, with bounded host memory, and marks it complete
last (`save_hf`). Both directions read the one table, so load -> save -> load is bit-identical.
The package's names are these modules' public ones:

    from sao_jax.models.hf import load_hf, read_config, save_hf
"""

from sao_jax.models.hf.format import (
    COMPLETE_MARKER,
    CONFIG_FILE,
    INDEX_FILE,
    PENDING_MARKER,
    SINGLE_FILE,
    HfTensor,
    hf_layout,
)
from sao_jax.models.hf.load import (
    Checkpoint,
    TensorInfo,
    check_complete,
    load_hf,
    read_config,
    read_header,
)
from sao_jax.models.hf.save import SavePlan, file_owners, hf_tensors, save_hf, save_plan

__all__ = [
    "COMPLETE_MARKER",
    "CONFIG_FILE",
    "INDEX_FILE",
    "PENDING_MARKER",
    "SINGLE_FILE",
    "Checkpoint",
    "HfTensor",
    "SavePlan",
    "TensorInfo",
    "check_complete",
    "file_owners",
    "hf_layout",
    "hf_tensors",
    "load_hf",
    "read_config",
    "read_header",
    "save_hf",
    "save_plan",
]
