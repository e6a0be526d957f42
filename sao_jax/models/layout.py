"""The two layouts of the decoder layers, and conversion between them.

Per-layer (`scan_layers=False`, what decoding with a KV cache needs): `backbone/layers/<i>/...`
holds layer i. Scanned (`scan_layers=True`, for training): `backbone/layers/<g>/block/<j>/...`
holds layers `first + r * period + j` of layer group g (`ModelConfig.layer_groups`) stacked over
r along a leading "layers" axis, and a `LayerStack` runs r under `lax.scan`, rematerialised as
`ModelConfig.remat` says (`REMAT`, or "nested").

Array names follow the dimension legend of `transformer.py`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.config import ModelConfig


def constrain(x, sharding):
    """`x` constrained to `sharding` (the hidden state's, between layers); `x` itself when None."""
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


REMAT = {"full": None, "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _stack(layers: list[nnx.Module]) -> nnx.Module:
    """One module of `layers` (alike) whose every parameter has a leading "layers" axis."""
    splits = [nnx.split(layer) for layer in layers]
    graphdef = splits[0][0]

    def stacked(*variables):
        first = variables[0]
        axes = ("layers", *(first.get_metadata().get("out_sharding") or ()))
        with nnx.use_eager_sharding(False):
            return first.replace(jnp.stack([v.get_value() for v in variables]),
                                 out_sharding=axes)

    state = jax.tree.map(stacked, *(state for _, state in splits),
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


class LayerStack(nnx.Module):
    """`repeats` scan steps over a block of `period` decoder layers (`ModelConfig.layer_groups`):
    `block[j]` holds layers `first + r * period + j` stacked along a leading "layers" axis, and
    `lax.scan` runs r, so the compiled program holds the block once whatever `repeats` is."""

    def __init__(self, layers: list[nnx.Module], period: int, remat: str):
        self.block = nnx.List([_stack(layers[j::period]) for j in range(period)])
        self.remat = remat

    def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, dispatch, hidden_sharding=None,
                 replay_RxPxBxTxA=None):
        """`replay_RxPxBxTxA`: the experts to replay at layer `first + r * period + j`
        (`transformer.stack_replay`), or None."""
        graphdef, state = nnx.split(self.block)

        def body(x_BxTxD, xs):
            state_r, replay_PxBxTxA = xs
            x_BxTxD = constrain(x_BxTxD, hidden_sharding)
            logits = []
            for j, layer in enumerate(nnx.merge(graphdef, state_r)):
                x_BxTxD, layer_logits, _ = layer(
                    x_BxTxD, positions_BxT, mask_BxTxS, dispatch, hidden_sharding=hidden_sharding,
                    replay_BxTxA=None if replay_PxBxTxA is None else replay_PxBxTxA[j])
                if layer_logits is not None:
                    logits.append(layer_logits)
            return x_BxTxD, tuple(logits)

        xs = (state, replay_RxPxBxTxA)
        if self.remat == "none":
            return jax.lax.scan(body, x_BxTxD, xs)
        body = jax.checkpoint(body, policy=REMAT.get(self.remat))
        repeats = jax.tree.leaves(state)[0].shape[0]
        group = _nested_group(repeats) if self.remat == "nested" else 1
        if group == 1:
            return jax.lax.scan(body, x_BxTxD, xs)

        # Nested: an outer scan over groups of `group` repeats, each group rematerialised as a
        # whole, keeps only the groups' inputs through the forward pass; the backward pass
        # recomputes one group at a time, keeping its repeats' inputs (about 2 sqrt(repeats)
        # saved inputs instead of repeats, for one more forward pass).
        @jax.checkpoint
        def group_body(x_BxTxD, state_g):
            return jax.lax.scan(body, x_BxTxD, state_g)

        grouped = jax.tree.map(lambda a: a.reshape(repeats // group, group, *a.shape[1:]), xs)
        x_BxTxD, logits = jax.lax.scan(group_body, x_BxTxD, grouped)
        return x_BxTxD, jax.tree.map(lambda a: a.reshape(repeats, *a.shape[2:]), logits)


def _nested_group(repeats: int) -> int:
    """The divisor of `repeats` nearest its square root (remat "nested"'s group size)."""
    return min((d for d in range(1, repeats + 1) if repeats % d == 0),
               key=lambda d: (abs(d - math.sqrt(repeats)), d))


def scanned_places(cfg: ModelConfig) -> dict[int, tuple[int, int, int]]:
    """Layer i -> `(group, repeat, position)`: its place in the scanned layout."""
    return {first + r * period + j: (g, r, j)
            for g, (first, period, repeats) in enumerate(cfg.layer_groups())
            for r in range(repeats) for j in range(period)}


def _relayout(model, cfg: ModelConfig):
    """A copy of `model` (CausalLM or ValueModel) built for `cfg`, which differs from its own
    config only in `scan_layers` / `remat`: every parameter moves to its place in the other
    layout (`backbone/layers/<i>/...` <-> `backbone/layers/<g>/block/<j>/...`, stacked over r).
    Works on concrete arrays and inside jit."""
    source = dict(nnx.to_flat_state(nnx.state(model)))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: type(model)(cfg, nnx.Rngs(0))))
    places = scanned_places(cfg)
    stacked_from = {}  # scanned (g, j) -> the layers stacked there, in repeat order
    for i in sorted(places):
        g, _, j = places[i]
        stacked_from.setdefault((g, j), []).append(i)
    flat = []
    for path, variable in nnx.to_flat_state(abstract):
        if path[:2] != ("backbone", "layers"):
            value = source[path].get_value()
        elif cfg.scan_layers:  # (backbone, layers, g, block, j, *rest) <- layers i, stacked
            g, _, j, *rest = path[2:]
            value = jnp.stack([source[("backbone", "layers", i, *rest)].get_value()
                               for i in stacked_from[(g, j)]])
        else:  # (backbone, layers, i, *rest) <- the r-th slice of its stacked parameter
            i, *rest = path[2:]
            g, r, j = places[i]
            value = source[("backbone", "layers", g, "block", j, *rest)].get_value()[r]
        flat.append((path, variable.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def reconfigure(model, cfg: ModelConfig):
    """`model` (CausalLM or ValueModel) with config `cfg`, which may differ from its own in the
    fields that hold no parameters (layout, remat, dispatch, attention): the same weights, moved
    to the other layout when `scan_layers` differs. `model` itself when nothing differs."""
    if cfg == model.cfg:
        return model
    if cfg.scan_layers != model.cfg.scan_layers:
        return _relayout(model, cfg)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: type(model)(cfg, nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


def stack_layers(model, remat: str = "none"):
    """`model` (CausalLM or ValueModel) in the scanned layout (`ModelConfig.scan_layers`), with
    `remat`: the same weights, each layer group's parameters stacked. A copy."""
    return reconfigure(model, model.cfg.replace(scan_layers=True, remat=remat))


def unstack_layers(model):
    """`model` in the per-layer layout (what decoding with a KV cache needs). A copy, or
    `model` itself if it is per-layer already."""
    if not model.cfg.scan_layers:
        return model
    return _relayout(model, model.cfg.replace(scan_layers=False, remat="none"))
