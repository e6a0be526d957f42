"""The two layer layouts: per-layer modules (decoding) and scanned stacks (training) hold the same
model; conversion, HF I/O, sampling and remat keep every number."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import (
    CausalLM,
    ModelConfig,
    ValueModel,
    load_hf,
    save_hf,
    stack_layers,
    unstack_layers,
)
from sao_jax.models.config import preset
from sao_jax.models.hf import hf_tensors
from sao_jax.models.layout import _nested_group
from sao_jax.models.sampling import SamplingParams, generate

CONFIGS = {  # name -> (config, its layer groups)
    "toy: dense then MoE": (preset("toy", num_layers=3), ((0, 1, 1), (1, 1, 2))),
    "alternating": (preset("toy", num_layers=4, mlp_only_layers=(), decoder_sparse_step=2),
                    ((0, 2, 2),)),
    "irregular": (preset("toy", num_layers=5, mlp_only_layers=(0, 2)),
                  ((0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 2))),
    "dense Qwen3": (preset("toy", num_layers=3, num_experts=0), ((0, 1, 3),)),
}
IDS = jnp.arange(24).reshape(2, 12) % 64


def leaves(model):
    return jax.tree.leaves(nnx.state(model))


@jax.jit
def _run(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids)


def run(model, ids=IDS):
    """`model(ids)`, compiled as a whole (op-by-op, the per-layer model is the slower one)."""
    return _run(*nnx.split(model), ids)


@pytest.mark.parametrize("name", CONFIGS)
def test_scanned_layers_are_the_per_layer_model_stacked(name):
    cfg, groups = CONFIGS[name]
    assert cfg.layer_groups() == groups
    per_layer = CausalLM(cfg, nnx.Rngs(0))
    scanned = CausalLM(cfg.replace(scan_layers=True), nnx.Rngs(0))  # same seed, same weights
    for a, b in ((stack_layers(per_layer), scanned), (unstack_layers(scanned), per_layer)):
        assert all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b), strict=True))
    np.testing.assert_allclose(run(scanned), run(per_layer), atol=5e-5)
    critic, critic_scanned = ValueModel.from_policy(per_layer), ValueModel.from_policy(scanned)
    (v, logits), (vs, logits_s) = run(critic), run(critic_scanned)
    np.testing.assert_allclose(vs, v, atol=1e-6)
    assert sum(x.size for x in logits_s) == sum(x.size for x in logits)  # [R, X, E] per group


def test_gradients_agree_across_layouts_and_remat_policies():
    cfg = preset("toy", num_layers=4, mlp_only_layers=())  # one group of 4 ("nested": 2 x 2)

    def grads(model):
        graphdef, state = nnx.split(model)
        loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(IDS) ** 2)
        return unstack_layers(nnx.merge(graphdef, jax.jit(jax.grad(loss))(state)))

    reference = leaves(grads(CausalLM(cfg, nnx.Rngs(0))))
    for remat in ("none", "full", "save_dots", "nested"):
        model = CausalLM(cfg.replace(scan_layers=True, remat=remat), nnx.Rngs(0))
        for a, b in zip(leaves(grads(model)), reference, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-6, err_msg=remat)
    nested = CausalLM(cfg.replace(scan_layers=True, remat="nested"), nnx.Rngs(0))
    logits = nested.backbone(IDS).router_logits
    assert [x.shape[0] for x in logits] == [4]  # [R, X, E]: the groups' repeats put back
    assert [_nested_group(n) for n in (1, 2, 4, 6, 12, 47, 48)] == [1, 1, 2, 2, 3, 1, 6]


def test_remat_needs_scanned_layers_and_a_known_policy():
    with pytest.raises(ValueError, match="remat = 'full' needs scan_layers=True"):
        preset("toy", remat="full")
    with pytest.raises(ValueError, match="ModelConfig.remat must be one of"):
        preset("toy", scan_layers=True, remat="some")


def test_hf_files_do_not_depend_on_the_layout(tmp_path):
    cfg = CONFIGS["alternating"][0]
    per_layer = CausalLM(cfg, nnx.Rngs(1))
    scanned = stack_layers(per_layer)
    a, b = dict(hf_tensors(per_layer)), dict(hf_tensors(scanned))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    save_hf(scanned, str(tmp_path))
    loaded = load_hf(str(tmp_path), scan_layers=True, remat="full")
    assert loaded.cfg.scan_layers and loaded.cfg.remat == "full"
    assert all(np.array_equal(x, y) for x, y in zip(leaves(loaded), leaves(scanned), strict=True))
    assert not load_hf(str(tmp_path)).cfg.scan_layers  # the default: per-layer


def test_decoding_takes_the_per_layer_layout():
    """The sampler decodes a scanned model through a per-layer copy (same tokens); the backbone
    refuses a KV cache in the scanned layout, saying what to do."""
    cfg = preset("toy", num_layers=3)
    per_layer = CausalLM(cfg, nnx.Rngs(0))
    scanned = stack_layers(per_layer)
    prompts, lengths = jnp.array([[5, 6, 7, 0], [8, 9, 10, 11]]), jnp.array([3, 4])
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    a = generate(per_layer, prompts, lengths, params, jax.random.key(0))
    b = generate(scanned, prompts, lengths, params, jax.random.key(0))
    np.testing.assert_array_equal(a.tokens_BxL, b.tokens_BxL)
    from sao_jax.models.transformer import empty_caches

    with pytest.raises(ValueError, match="per-layer layout.*unstack_layers"):
        scanned.backbone(prompts, caches=empty_caches(cfg, 2, 8, jnp.float32),
                         slots_BxT=jnp.zeros((2, 4), jnp.int32))


def test_a_model_config_default_is_per_layer():
    assert not ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                           head_dim=8, intermediate_size=8).scan_layers
