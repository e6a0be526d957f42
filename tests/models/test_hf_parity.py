"""Parity with Hugging Face transformers' Qwen3-MoE and Qwen3, and safetensors round trips."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import CausalLM, ModelConfig, load_hf, save_hf
from sao_jax.models import hf as hf_io

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# name: (HF config fields, what the case covers)
CASES = {
    "moe_gqa2_top2_odd_untied_dense_layer": dict(
        num_experts=5, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
        mlp_only_layers=[1], tie_word_embeddings=False, norm_topk_prob=True),
    "moe_gqa4_top1_tied": dict(
        num_experts=3, num_experts_per_tok=1, num_attention_heads=8, num_key_value_heads=2,
        mlp_only_layers=[], tie_word_embeddings=True, norm_topk_prob=False),
    "moe_sparse_step2_top2_no_renorm": dict(
        num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=1,
        decoder_sparse_step=2, tie_word_embeddings=False, norm_topk_prob=False),
    "dense_qwen3": dict(dense=True, num_attention_heads=4, num_key_value_heads=2,
                        tie_word_embeddings=True),
}


def make_hf_model(case: str, seed: int = 0):
    fields = dict(CASES[case])
    dense = fields.pop("dense", False)
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                  head_dim=8, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    if dense:
        config = transformers.Qwen3Config(**common, **fields)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=24, **fields)
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # larger than the default init, so that every part matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.float().numpy()


@pytest.fixture(scope="module", params=sorted(CASES))
def case_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = make_hf_model(request.param)
    model.save_pretrained(path)
    return request.param, str(path), model


IDS = np.random.default_rng(0).integers(0, 97, size=(2, 11))


@pytest.mark.parametrize("dispatch", ["dense", "ragged", "capacity"])
def test_logits_match_transformers(case_dir, dispatch):
    _, path, hf_model = case_dir
    # A capacity large enough that nothing is dropped: then it must agree as well.
    model = load_hf(path, capacity_factor=8.0)
    ours = np.asarray(model(jnp.asarray(IDS), dispatch=dispatch))
    want = hf_logits(hf_model, IDS)
    assert np.abs(ours - want).max() <= 1e-4


def test_save_hf_loads_in_transformers_with_same_logits(case_dir, tmp_path):
    _, path, hf_model = case_dir
    model = load_hf(path)
    save_hf(model, str(tmp_path))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert np.abs(hf_logits(reloaded, IDS) - hf_logits(hf_model, IDS)).max() <= 1e-5


def test_load_save_load_is_bit_identical_also_when_sharded(case_dir, tmp_path):
    _, path, _ = case_dir
    first = load_hf(path)
    save_hf(first, str(tmp_path), max_shard_bytes=20_000)  # forces several shards and an index
    assert os.path.exists(tmp_path / hf_io.INDEX_FILE)
    second = load_hf(str(tmp_path))
    a, b = dict(hf_io.hf_tensors(first)), dict(hf_io.hf_tensors(second))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


def test_loading_into_a_copy_of_an_abstract_model_gives_the_same_weights(case_dir, tmp_path):
    """`like=`: what a server reloading weights every step uses, to skip building the model."""
    import jax
    from flax import nnx

    _, path, _ = case_dir
    plain = load_hf(path)
    like = nnx.eval_shape(lambda: CausalLM(plain.cfg, nnx.Rngs(0)))
    filled = load_hf(path, like=like)
    for (name, x), (_, y) in zip(hf_io.hf_tensors(plain), hf_io.hf_tensors(filled), strict=True):
        assert np.array_equal(x, y), name
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(nnx.state(like)))
    other = nnx.eval_shape(lambda: CausalLM(ModelConfig(**{**vars(plain.cfg), "rope_theta": 1.0}),
                                            nnx.Rngs(0)))
    with pytest.raises(ValueError, match="config differs from the model given as `like`"):
        load_hf(path, like=other)


def test_bfloat16_round_trip(case_dir, tmp_path):
    _, path, _ = case_dir
    model = load_hf(path, dtype=jnp.bfloat16)
    save_hf(model, str(tmp_path))
    again = load_hf(str(tmp_path), dtype=jnp.bfloat16)
    for (name, x), (_, y) in zip(hf_io.hf_tensors(model), hf_io.hf_tensors(again), strict=True):
        assert x.dtype == jnp.bfloat16 and np.array_equal(x, y), name


@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_host_conversion_writes_the_bytes_the_device_one_does(case_dir, tmp_path,
                                                                  monkeypatch, scan_layers):
    """A model in host memory is converted by NumPy (save.py `_host_pieces`), not by `_to_hf`:
    here in pieces of 1000 bytes (many per tensor, through the two reused buffers), each split
    between two threads. With a dtype change and without, it writes the device's bytes."""
    from sao_jax.models.hf import save

    _, path, _ = case_dir
    model = load_hf(path, scan_layers=scan_layers)
    host_pieces, pieces = save._host_pieces, []

    def counted(*args):
        for piece in host_pieces(*args):
            pieces.append(piece.nbytes)
            yield piece

    monkeypatch.setattr(save, "_host_pieces", counted)
    monkeypatch.setattr(save, "_PIECE_BYTES", 1000)
    monkeypatch.setattr(save, "_HOST_THREADS", 2)
    monkeypatch.setattr(save, "_THREAD_MIN_BYTES", 0)
    for dtype in (None, "bfloat16"):
        pieces.clear()
        save_hf(model, str(tmp_path / f"host_{dtype}"), dtype=dtype)
        assert len(pieces) > 2 * len(hf_io.hf_layout(model.cfg))
        unconverted = model.cfg.vocab_size * model.cfg.hidden_size * 4  # the embedding's view
        assert all(n <= 1000 or (dtype is None and n == unconverted) for n in pieces), pieces
        with monkeypatch.context() as device:
            device.setattr(save, "_host_view", lambda x: None)
            save_hf(model, str(tmp_path / f"device_{dtype}"), dtype=dtype)
        for name in (hf_io.SINGLE_FILE, hf_io.CONFIG_FILE):
            host = (tmp_path / f"host_{dtype}" / name).read_bytes()
            assert host == (tmp_path / f"device_{dtype}" / name).read_bytes(), (dtype, name)


def test_a_failing_write_ends_the_save_with_its_error(case_dir, tmp_path, monkeypatch):
    """A write that fails (ENOSPC, from the fourth write on) while converted pieces queue behind
    it and both buffers are taken: save_hf raises that error, without hanging on a buffer, and
    leaves the directory marked pending (not loadable)."""
    import errno
    import threading

    from sao_jax.models.hf import save

    _, path, _ = case_dir
    model = load_hf(path)
    monkeypatch.setattr(save, "_PIECE_BYTES", 1000)

    class Full:
        def __init__(self, f):
            self.f, self.writes = f, 0

        def write(self, data):
            self.writes += 1
            if self.writes > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def filling(file, mode="r", *args, **kwargs):
        f = open(file, mode, *args, **kwargs)
        return Full(f) if str(file).endswith(".safetensors") else f

    monkeypatch.setattr(save, "open", filling, raising=False)
    raised = []

    def saves():
        try:
            save_hf(model, str(tmp_path / "full"))
        except BaseException as e:  # noqa: BLE001 (read below)
            raised.append(e)

    saving = threading.Thread(target=saves)
    saving.start()
    saving.join(timeout=120)
    assert not saving.is_alive(), "save_hf hung after a failed write"
    assert len(raised) == 1 and isinstance(raised[0], OSError), raised
    assert raised[0].errno == errno.ENOSPC, raised
    assert os.path.exists(tmp_path / "full" / hf_io.PENDING_MARKER)
    with pytest.raises(ValueError, match="pending|being written|incomplete"):
        load_hf(str(tmp_path / "full"))


def test_both_config_spellings_read_the_same():
    published = dict(model_type="qwen3_moe", vocab_size=10, hidden_size=8, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                     intermediate_size=12, moe_intermediate_size=6, num_experts=3,
                     num_experts_per_tok=2, rope_theta=5e5)
    v5 = dict(published)
    v5["num_local_experts"] = v5.pop("num_experts")
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": v5.pop("rope_theta")}
    assert ModelConfig.from_hf(published) == ModelConfig.from_hf(v5)
    assert ModelConfig.from_hf(v5).num_experts == 3 and ModelConfig.from_hf(v5).rope_theta == 5e5


def test_clear_errors(tmp_path, case_dir):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "llama"}, f)
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        load_hf(str(tmp_path))
    _, path, _ = case_dir
    model = load_hf(path)
    save_hf(model, str(tmp_path))
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(tmp_path / hf_io.SINGLE_FILE))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(tmp_path / hf_io.SINGLE_FILE))
    with pytest.raises(KeyError, match="no tensor 'model.layers.1.self_attn.k_proj.weight'"):
        load_hf(str(tmp_path))


def test_random_model_runs_in_every_dispatch():
    cfg = ModelConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=8, intermediate_size=24, num_experts=3, moe_intermediate_size=8)
    from flax import nnx
    model = CausalLM(cfg, nnx.Rngs(0))
    out = [np.asarray(model(jnp.asarray(IDS % 50), dispatch=d)) for d in ("dense", "ragged")]
    np.testing.assert_allclose(out[0], out[1], atol=1e-5)
