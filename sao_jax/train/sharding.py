"""Meshes and logical-axis sharding: modules name logical axes, the config maps them to a mesh.

Parameters carry logical axis names (`out_sharding` metadata, e.g. `("expert", "embed", "mlp")`);
a rule table maps each logical name to the mesh axes that split it (none: replicated; the config's
`mesh.rules`, read by `rules_from_config`). State is built abstractly first, its shardings
derived, then materialised directly in place:

    mesh = make_mesh({"data": 2, "fsdp": 2, "expert": 2})
    model = create_sharded(lambda: CausalLM(cfg, nnx.Rngs(0)), mesh, DEFAULT_RULES)

The same code runs on one CPU device (a 1x1 mesh), on simulated CPU devices in tests, on a GPU and
on a TPU pod (after `jax.distributed.initialize()`, `jax.devices()` spans every host).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from sao_jax.axes import DEFAULT_RULES, MESH_AXES  # data: configs read them without JAX


def rules_from_config(rules, *, field: str = "rules") -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The rule table that `rules` sets: a ConfigDict (or mapping) of logical axis -> tuple of mesh
    axis names (an empty tuple: replicated), such as `config.mesh.rules`. A logical axis that
    `rules` leaves out keeps its `DEFAULT_RULES` entry; the order is `DEFAULT_RULES`'.

    Raises:
      ValueError: naming `<field>.<logical axis>`, for a logical axis not in `DEFAULT_RULES`, a
        value that is not a tuple of names, a name not in `MESH_AXES`, or a name given twice;
        and for a string (the "embed=fsdp+tensor,..." form `config.mesh.rules` once took), saying
        how to write it now.
    """
    table = dict(DEFAULT_RULES)
    if isinstance(rules, str):
        raise ValueError(f"{field} = {rules!r}: the rules are no longer a string; set one field "
                         f"per logical axis to a tuple of mesh axes, e.g. {field}.embed = "
                         f"('fsdp', 'tensor') or {field}.vocab = () to replicate "
                         f"(fields: {', '.join(table)}).")
    for logical, axes in dict(rules).items():
        name = f"{field}.{logical}"
        if logical not in table:
            raise ValueError(f"{name}: no such logical axis; the rules cover "
                             f"{', '.join(table)}.")
        if isinstance(axes, str) or not isinstance(axes, tuple | list) or not all(
                isinstance(axis, str) for axis in axes):
            raise ValueError(f"{name} = {axes!r}: give a tuple of mesh axes among {MESH_AXES}, "
                             "e.g. ('fsdp', 'tensor'), or () to replicate.")
        unknown = [axis for axis in axes if axis not in MESH_AXES]
        if unknown:
            raise ValueError(f"{name} = {tuple(axes)!r} names mesh axes {unknown}; use a tuple "
                             f"of {MESH_AXES}, e.g. ('fsdp', 'tensor'), or () to replicate.")
        if len(set(axes)) < len(axes):
            raise ValueError(f"{name} = {tuple(axes)!r} names a mesh axis twice.")
        table[logical] = tuple(axes)
    return tuple(table.items())


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with the named axes of `shape` (others of MESH_AXES get size 1).

    Axis types are Auto on purpose: shardings are fixed at jit boundaries (`in_shardings`,
    `out_shardings`) and XLA propagates them inside, so model code stays free of sharding types.

    Raises:
      ValueError: an unknown axis name, or sizes whose product differs from the device count.
    """
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh axes must be among {MESH_AXES}, got {unknown}.")
    devices = list(jax.devices() if devices is None else devices)
    sizes = tuple(int(shape.get(name, 1)) for name in MESH_AXES)
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh shape {dict(zip(MESH_AXES, sizes, strict=True))} needs "
                         f"{int(np.prod(sizes))} devices, but {len(devices)} are available.")
    return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def logical_to_mesh(logical: Sequence[str | None], rules, mesh: Mesh) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec of `mesh` axes.

    Each mesh axis shards at most one dimension (the first that asks for it); mesh axes of size 1
    are dropped. A logical name without a rule is an error, so a typo cannot silently replicate.
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name in logical:
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no sharding rule; rules cover "
                             f"{sorted(table)}.")
        target = table[name]
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*spec)


def state_shardings(abstract_state, mesh: Mesh, rules):
    """NamedShardings for every variable of an (abstract) `nnx.State`, from its logical names."""

    def sharding(variable):
        logical = variable.get_metadata().get("out_sharding") or ()
        value = variable.get_value()
        logical = tuple(logical) + (None,) * (np.ndim(value) - len(logical))
        return variable.replace(NamedSharding(mesh, logical_to_mesh(logical, rules, mesh)))

    return jax.tree.map(sharding, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_sharded(factory: Callable[[], nnx.Module], mesh: Mesh, rules) -> nnx.Module:
    """Builds `factory()` with every parameter created directly in its sharding.

    `eval_shape` gives the structure without memory, the rules give shardings, and `jit` with
    `out_shardings` initialises each shard on its own device: no host ever holds the full model.
    """
    abstract = nnx.eval_shape(factory)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh, rules)

    @jax.jit
    def init():
        return nnx.split(factory())[1]

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def abstract_model(factory: Callable[[], nnx.Module], mesh: Mesh, rules) -> nnx.Module:
    """`factory()`'s structure with a `jax.ShapeDtypeStruct`, carrying its rule-given sharding,
    in place of every array: no memory anywhere, for compiling ahead of time for `mesh` (whose
    devices need not be this host's, e.g. a TPU topology's: `train.plan`)."""
    graphdef, abstract_state = nnx.split(nnx.eval_shape(factory))
    shardings = state_shardings(abstract_state, mesh, rules)
    placed = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype,
                                                    sharding=s.get_value())),
        abstract_state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, placed)


def shard_model(model: nnx.Module, mesh: Mesh, rules) -> nnx.Module:
    """Places an existing model's state on `mesh` by the rules (e.g. after `load_hf`).

    On a mesh over several processes, every process must call it with the same values; each
    places its own shards from host copies (JAX moves no array committed to one process's device
    to another's, at least on CPU), after `jax.device_put` checks that the values agree."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh, rules)
    if not all(s.is_fully_addressable for s in jax.tree.leaves(shardings)):
        state = jax.device_get(state)
    return nnx.merge(graphdef, jax.device_put(state, shardings))


def batch_sharding(mesh: Mesh, rules, ndim: int = 2) -> NamedSharding:
    """Sharding of a `[B, ...]` batch: B over the rule for "batch", the rest replicated."""
    return NamedSharding(mesh, logical_to_mesh(("batch",) + (None,) * (ndim - 1), rules, mesh))
