"""Hugging Face I/O at scale: loading shard by shard into a sharded layout, streaming saves split
across processes (each file written by one process, each bucket gathered to that process only),
the completion marker, and the host memory both take.

The memory tests run `tests/models/hf_processes.py` in subprocesses, on a 216 MB float32
checkpoint written once per module: one process with one CPU device, and two processes of two CPU
devices each joined by `jax.distributed`, the model split over all four (simulated devices of one
process share its memory, so only separate processes can show that no host holds the model).
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from sao_jax.models import CausalLM, ModelConfig, load_hf, save_hf
from sao_jax.models import hf as hf_io
from sao_jax.models.hf import save as hf_save
from sao_jax.train import sharding
from sao_jax.train.processes import free_port
from tests import one_device_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ModelConfig(vocab_size=96, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                    head_dim=8, intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=16, mlp_only_layers=(1,), tie_word_embeddings=False)
# Wide layers, ~216 MB of float32: the largest tensors are the embedding and the LM head.
LARGE = ModelConfig(vocab_size=4096, hidden_size=1024, num_layers=3, num_heads=8, num_kv_heads=2,
                    head_dim=128, intermediate_size=1024, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=1024, tie_word_embeddings=False)
MESHES = {"fsdp4 x expert2": {"fsdp": 4, "expert": 2},
          "fsdp2 x expert2 x tensor2": {"fsdp": 2, "expert": 2, "tensor": 2}}
MiB = 1 << 20


def files_of(path) -> dict[str, bytes]:
    return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


def write_random_checkpoint(path, cfg: ModelConfig) -> tuple[int, int]:
    """`cfg` with normal(0, 1) weights as a plain Hugging Face directory (safetensors' own
    writer, one file, no markers); returns its tensors' total and largest size in bytes."""
    rng = np.random.default_rng(0)
    tensors = {t.name: rng.standard_normal(t.shape, np.float32) for t in hf_io.hf_layout(cfg)}
    save_file(tensors, os.path.join(path, hf_io.SINGLE_FILE))
    with open(os.path.join(path, hf_io.CONFIG_FILE), "w") as f:
        json.dump(cfg.to_hf(dtype="float32"), f)
    return sum(a.nbytes for a in tensors.values()), max(a.nbytes for a in tensors.values())


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("plain"))
    write_random_checkpoint(path, SMALL)
    return path


@pytest.fixture(scope="module")
def small_dir(plain_dir, tmp_path_factory):
    """`plain_dir` as save_hf writes it, in several files."""
    path = str(tmp_path_factory.mktemp("small"))
    save_hf(load_hf(plain_dir), path, max_shard_bytes=40_000)
    return path


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("scan_layers", [False, True], ids=["per-layer", "stacked"])
def test_sharded_load_and_save_are_bit_identical(small_dir, tmp_path, mesh_name, scan_layers):
    """Each shard read from the files is the one-device model's, in the abstract model's
    sharding; saved again from the shards (stacked: a layer at a time), the files are the same
    bytes."""
    cfg = SMALL.replace(scan_layers=scan_layers)
    mesh = sharding.make_mesh(MESHES[mesh_name])
    abstract = sharding.abstract_model(lambda: CausalLM(cfg, nnx.Rngs(0)), mesh,
                                       sharding.DEFAULT_RULES)
    model = load_hf(small_dir, like=abstract, scan_layers=scan_layers)
    want = dict(nnx.to_flat_state(nnx.state(load_hf(small_dir, scan_layers=scan_layers))))
    placed = dict(nnx.to_flat_state(nnx.state(abstract)))
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        value = variable.get_value()
        assert value.sharding == placed[path].get_value().sharding, path
        assert np.array_equal(np.asarray(value), np.asarray(want[path].get_value())), path
    save_hf(model, str(tmp_path), max_shard_bytes=40_000)
    assert files_of(tmp_path) == files_of(small_dir)


def test_the_files_are_plain_safetensors(plain_dir, small_dir):
    """What safetensors' own reader makes of them: every tensor, with its values."""
    reference = load_file(os.path.join(plain_dir, hf_io.SINGLE_FILE))
    with open(os.path.join(small_dir, hf_io.INDEX_FILE)) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    assert len(files) > 1
    found = {}
    for name in files:
        found.update(load_file(os.path.join(small_dir, name)))
    assert found.keys() == reference.keys()
    assert all(np.array_equal(found[k], reference[k]) for k in reference)


def test_an_unfinished_directory_is_refused_a_downloaded_one_is_not(small_dir, tmp_path):
    assert os.path.exists(os.path.join(small_dir, hf_io.COMPLETE_MARKER))
    assert not os.path.exists(os.path.join(small_dir, hf_io.PENDING_MARKER))
    for name, content in files_of(small_dir).items():
        (tmp_path / name).write_bytes(content)
    os.remove(tmp_path / hf_io.COMPLETE_MARKER)
    load_hf(str(tmp_path))  # neither marker: a checkpoint from elsewhere
    (tmp_path / hf_io.PENDING_MARKER).write_text("")
    with pytest.raises(ValueError, match=f"incomplete.*{hf_io.COMPLETE_MARKER}"):
        load_hf(str(tmp_path))
    (tmp_path / hf_io.COMPLETE_MARKER).write_text("{}")  # its writer died after the marker
    load_hf(str(tmp_path))


def test_a_wrong_shape_or_a_truncated_file_names_it(small_dir, tmp_path):
    small = load_hf(small_dir)
    save_hf(small, str(tmp_path))
    file = str(tmp_path / hf_io.SINGLE_FILE)
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.o_proj.weight"] = tensors[
        "model.layers.0.self_attn.o_proj.weight"][:, :-1].copy()
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"o_proj.weight has shape \(32, 31\).*expects "
                                         r"\(32, 32\)"):
        load_hf(str(tmp_path))
    save_hf(small, str(tmp_path))
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 4)
    with pytest.raises(ValueError, match="truncated"):
        load_hf(str(tmp_path))


# -- memory and processes, on the large checkpoint ------------------------------------------------


def run_processes(args_per_process: list[list[str]], timeout: float = 120.0) -> list[dict]:
    """Runs `hf_processes` once per argument list, concurrently; their JSON results."""
    env = dict(os.environ, XLA_FLAGS=one_device_flags(os.environ.get("XLA_FLAGS", "")))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.models.hf_processes", *args],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for args in args_per_process]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.fixture(scope="module")
def large_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("large")
    return path, *write_random_checkpoint(path, LARGE)


@pytest.fixture(scope="module")
def lone(large_dir, tmp_path_factory):
    """One process, one device, per-layer: load, save, save again."""
    out = tmp_path_factory.mktemp("lone")
    (result,) = run_processes([["--checkpoint", str(large_dir[0]), "--devices", "1",
                                "--mesh", "fsdp=1", "--out", str(out), "--saves", "2",
                                "--max-shard-bytes", str(64 * MiB)]])
    return result, out


@pytest.fixture(scope="module")
def pair(large_dir, tmp_path_factory):
    """Two processes of two devices, the stacked layout over fsdp=4: load, save twice, then
    process 0 saves a model of its own (into `alone`) while process 1 waits."""
    out, alone = tmp_path_factory.mktemp("pair"), tmp_path_factory.mktemp("alone")
    port = str(free_port())
    return run_processes([["--checkpoint", str(large_dir[0]), "--devices", "2", "--mesh",
                           "fsdp=4", "--scan-layers", "--out", str(out), "--max-shard-bytes",
                           str(64 * MiB), "--saves", "2", "--alone", str(alone), "--processes",
                           "2", "--process-id", str(i), "--port", port]
                          for i in range(2)]), out, alone


def test_each_process_holds_only_its_shards_while_loading(large_dir, pair):
    """Peak resident growth during the load (measured: 112 MiB of the 206 MiB checkpoint, 0.54x:
    its half of the weights plus one read chunk)."""
    _, size, _ = large_dir
    results, _, _ = pair
    for r in results:
        growth = (r["peak_kib"] - r["rss_before_kib"]) * 1024
        print(f"process {r['process']}: peak growth {growth / MiB:.0f} MiB of a "
              f"{size / MiB:.0f} MiB checkpoint ({growth / size:.2f}x), load {r['load_s']:.2f} s")
        assert growth <= 0.6 * size, r


def test_a_lone_load_takes_the_model_and_about_a_tensor_more(large_dir, lone):
    """One process holds the model, and in passing little more than the largest tensor
    (measured: 8 MiB, the read chunk; the largest tensor is 16 MiB)."""
    _, size, largest = large_dir
    r, _ = lone
    kept = (r["rss_after_kib"] - r["rss_before_kib"]) * 1024
    passing = (r["peak_kib"] - r["rss_after_kib"]) * 1024
    print(f"kept {kept / MiB:.0f} MiB for a {size / MiB:.0f} MiB model, {passing / MiB:.0f} MiB "
          f"more at the peak; largest tensor {largest / MiB:.0f} MiB")
    assert kept <= 1.1 * size and passing <= largest, r


def test_a_save_holds_a_piece_at_a_time(large_dir, lone):
    """A model in host memory (one CPU device) is converted by NumPy into two reused buffers of
    `_PIECE_BYTES` (save.py `_Buffers`), and the unconverted tensors are written from the
    parameters themselves: a save's peak growth is those buffers, not the model nor a bucket
    (measured: 0-8 MiB, the buffers of 4 MiB; converted by XLA, whole buckets into fresh
    memory, it was 16-80 MiB, the largest bucket 16 MiB). The bound is three pieces."""
    from sao_jax.models.hf import save

    _, size, largest = large_dir
    r, _ = lone
    growth = (r["save_peak_kib"] - r["save_rss_before_kib"]) * 1024
    print(f"second save: peak growth {growth / MiB:.0f} MiB, {r['save_s']:.2f} s")
    assert growth <= 3 * save._PIECE_BYTES < largest, r


def test_a_split_save_writes_the_same_bytes_as_a_lone_one(large_dir, lone, pair):
    """Two processes, the stacked layout, each writing its own files, give the very files one
    process writes from the per-layer layout; and they hold the checkpoint's tensors."""
    (_, lone_out), (_, pair_out, _) = lone, pair
    names = sorted(os.listdir(lone_out))
    assert names == sorted(os.listdir(pair_out)) and hf_io.COMPLETE_MARKER in names
    assert hf_io.PENDING_MARKER not in names and len(names) > 4  # several files, an index
    for name in names:
        with open(lone_out / name, "rb") as a, open(pair_out / name, "rb") as b:
            assert a.read() == b.read(), name
    with hf_io.Checkpoint(str(large_dir[0])) as want, hf_io.Checkpoint(str(pair_out)) as got:
        assert got.tensors.keys() == want.tensors.keys()
        for name in want.tensors:
            assert np.array_equal(got.read(name), want.read(name)), name


def test_a_split_save_fetches_each_bucket_to_its_writer_only(large_dir, pair):
    """Each process gets on its host the buckets of the files it writes, and no other: together
    they fetch the model once (the gather-everywhere save before fetched all of it to each).
    Measured by what each sends over gloo's sockets (its written bytes less its files): 154-160
    MiB each, against 309 MiB each before (the conversion to rows moves half of each bucket
    across processes in both)."""
    _, size, _ = large_dir
    results, _, _ = pair
    plan = hf_io.save_plan(LARGE, np.dtype(np.float32), 2, 64 * MiB)
    assert [r["saves"][-1]["fetched_bytes"] for r in results] == plan.process_bytes(2)
    assert sum(plan.process_bytes(2)) == size and max(plan.process_bytes(2)) < 0.6 * size


def test_a_split_save_holds_a_few_buckets_not_the_model(large_dir, pair):
    """Each of two processes, once the programs are compiled (the second save), grows while
    saving by a few buckets at most: the one it is writing, the one being fetched (which a
    process that does not write it holds as zeros for the moment of the gather: on CPU the
    devices' memory is the host's) and its conversion's half, plus buckets the allocator keeps
    after they are freed (glibc keeps each thread's frees in that thread's arena). Measured:
    4-65 MiB of growth over 10 runs, the largest bucket being 16 MiB (the gather-everywhere save
    before: 16-80 MiB); the first save, compiling, grows by 170-220 MiB with either. The bound,
    six buckets, is under half the model."""
    _, size, largest = large_dir
    results, _, _ = pair
    for r in results:
        growth = (r["save_peak_kib"] - r["save_rss_before_kib"]) * 1024
        first = r["saves"][0]
        print(f"process {r['process']}: second save {r['save_s']:.2f} s, peak growth "
              f"{growth / MiB:.0f} MiB (the first: {first['s']:.2f} s, "
              f"{(first['peak_kib'] - first['rss_before_kib']) / 1024:.0f} MiB); model "
              f"{size / MiB:.0f} MiB, largest bucket {largest / MiB:.0f} MiB")
        assert growth <= 6 * largest < size / 2, r


def test_a_model_on_one_process_is_saved_by_it_alone(pair, tmp_path):
    """A leader saving its warm start (on its own device) while the follower waits at the
    coordinator: no collective, no barrier; the very files a lone process writes. (Before, such a
    save entered a device barrier that the follower never reached: gloo gave up after 30 s.)"""
    results, _, alone = pair
    assert all(r["alone_s"] < 30 for r in results), results
    with jax.default_device(jax.devices()[0]):
        own = CausalLM(LARGE.replace(num_layers=1), nnx.Rngs(0))
    save_hf(own, str(tmp_path))
    assert files_of(alone) == files_of(tmp_path)


@pytest.mark.parametrize("max_shard_bytes", [40_000, 1 << 30])
def test_files_are_dealt_by_bytes_and_hold_the_same_bytes_whatever_the_processes(
        max_shard_bytes):
    """Every process count gives the same files (names, headers, tensors in model order; an
    expert group never split); each file has one writer, the largest first to the least loaded,
    so no process writes more than the fairest share plus one file; and the fetches go in
    rounds, each process's buckets in its files' order, one per round."""
    cfg, dtype = SMALL, np.dtype(np.float32)
    one = hf_io.save_plan(cfg, dtype, 1, max_shard_bytes)
    for processes in (2, 3, 8):
        plan = hf_io.save_plan(cfg, dtype, processes, max_shard_bytes)
        assert plan.files == one.files and plan.headers() == one.headers()
        loads, files = plan.process_bytes(processes), plan.file_bytes()
        assert sum(loads) == sum(one.sizes)
        assert max(loads) <= sum(loads) / processes + max(files)
        assert max(loads) - min(loads) <= max(files)
        rounds = hf_save._fetch_order(plan, processes)
        fetched = [b for fetches in rounds for _, b in fetches]
        assert sorted(fetched) == list(range(len(plan.buckets)))
        for fetches in rounds:
            owners = [plan.owners[k] for k, _ in fetches]
            assert len(set(owners)) == len(owners)
        for p in range(processes):
            mine = [(k, b) for fetches in rounds for k, b in fetches if plan.owners[k] == p]
            assert mine == sorted(mine)
    for _, members in one.files:  # an expert group whole in one file
        for b in members:
            tensors = one.tensors[one.buckets[b].first:one.buckets[b].last]
            assert len({(t.path, t.layer) for t in tensors}) == 1
    assert hf_io.file_owners([5, 3, 3, 2, 1], 2) == [0, 1, 1, 0, 1]  # 7 bytes each
