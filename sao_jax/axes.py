"""The learner mesh's axes and the default logical-to-mesh rules, as data.

Apart from `train/sharding.py`, which applies them, so that an experiment's config
(experiments/base.py: `config.mesh.rules` starts from `DEFAULT_RULES`) loads without JAX.
"""

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# logical axis -> the mesh axes that split it, in order (none: replicated). Every experiment's
# `config.mesh.rules` starts from this table, one field per logical axis (experiments/base.py).
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("mlp", ("tensor",)),
    ("q_heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("expert", ("expert",)),
    ("norm", ()),
    ("layers", ()),  # the stacked axis of scanned layers: not split, each shard has every layer
)
