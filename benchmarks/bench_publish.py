"""Publishing and loading weights: `save_hf` / `load_hf` against plain I/O of the same bytes.

    make bench                                    # a 310 MB float32 model, in /tmp
    python benchmarks/bench_publish.py --dir /mnt/disk --dtype bfloat16 --layers 8 --fsync

The model (MoE, wide layers, random weights: `--layers`, `--dtype`) is built on the devices, in
the per-layer layout (what engines serve) and in the stacked one (what the learner trains and
publishes from). Each row is the median of `--repeats` runs (into a fresh directory under
`--dir` for the writes), each run paired with one of the plain row above it:
  write     one file of the model's byte count from a host buffer, in one `write` call: the
            floor for the disk;
  save_hf   `save_hf(model, dir)` (4 GiB files), the publish: headers, the conversions to the
            HF layout (here in host memory: NumPy's, a piece at a time, each written on a thread
            while the next converts), the writes, config.json and the markers;
  read      that one file back whole (from the page cache when it fits: the floor for a read);
  load_hf   `load_hf(dir)` of the saved directory onto the devices, in the model's layout.
With `--fsync` every file written is fsynced before the clock stops, in both write rows; else
neither is (the page cache absorbs what fits in memory). Columns: MB/s of model bytes, and the
median over the pairs of the time over the plain row's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import jax
import numpy as np
from _table import print_header
from flax import nnx

from sao_jax.models import CausalLM, ModelConfig, load_hf, save_hf
from sao_jax.train import sharding


def model_config(layers: int, dtype: str) -> ModelConfig:
    """77.6M parameters at 4 layers (15.2M a layer, 8.4M each for embedding and LM head)."""
    return ModelConfig(vocab_size=8192, hidden_size=1024, num_layers=layers, num_heads=8,
                       num_kv_heads=2, head_dim=128, intermediate_size=2048, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=1024,
                       tie_word_embeddings=False, param_dtype=dtype)


def fsync_tree(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_plain(buf: np.ndarray, path: str) -> None:
    os.makedirs(path)
    with open(os.path.join(path, "plain.bin"), "wb") as f:
        f.write(buf)


def read_plain(file: str, nbytes: int) -> None:
    buf = np.empty(nbytes, np.uint8)
    with open(file, "rb") as f:
        f.readinto(buf)


def paired(plain, ours, repeats: int, after=lambda: None) -> tuple[float, float, float]:
    """Medians of `plain()`'s and `ours()`'s times and of their ratio, run in pairs (in turn
    first, so that neither always meets the other's writeback), `after()` untimed after each:
    on a shared machine the speed drifts between runs more than within a pair."""
    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        after()
        return seconds

    times = []
    for i in range(repeats):
        if i % 2 == 0:
            times.append((timed(plain), timed(ours)))
        else:
            ours_s = timed(ours)
            times.append((timed(plain), ours_s))
    a, b = np.asarray(times).T
    return float(np.median(a)), float(np.median(b)), float(np.median(b / a))


def bench_layout(cfg: ModelConfig, mesh, root: str, repeats: int, fsync: bool) -> None:
    model = sharding.create_sharded(lambda: CausalLM(cfg, nnx.Rngs(0)), mesh,
                                    sharding.DEFAULT_RULES)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    buf = np.ones(nbytes, np.uint8)
    save_hf(model, os.path.join(root, "warm"))  # compiles the per-bucket conversions
    shutil.rmtree(os.path.join(root, "warm"))

    out = os.path.join(root, "out")

    def written(write):  # into `out`, fsynced with `fsync`
        def run():
            write(out)
            if fsync:
                fsync_tree(out)
        return run

    write_s, save_s, save_x = paired(written(lambda p: write_plain(buf, p)),
                                     written(lambda p: save_hf(model, p)), repeats,
                                     after=lambda: shutil.rmtree(out))
    saved, plain = os.path.join(root, "saved"), os.path.join(root, "plain")
    save_hf(model, saved)
    write_plain(buf, plain)
    like = nnx.eval_shape(lambda: CausalLM(cfg, nnx.Rngs(0)))
    read_s, load_s, load_x = paired(
        lambda: read_plain(os.path.join(plain, "plain.bin"), nbytes),
        lambda: jax.block_until_ready(nnx.state(load_hf(saved, cfg.param_dtype, like=like,
                                                        scan_layers=cfg.scan_layers))),
        repeats)
    shutil.rmtree(saved)
    shutil.rmtree(plain)
    layout = "stacked" if cfg.scan_layers else "per-layer"
    for what, seconds, ratio in (("write", write_s, 1.0), ("save_hf", save_s, save_x),
                                 ("read", read_s, 1.0), ("load_hf", load_s, load_x)):
        print(f"{layout:>9} {what:>8} {nbytes / 1e6:>7.0f} {seconds:>8.3f} "
              f"{nbytes / 1e6 / seconds:>8.0f} {ratio:>8.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs per row")
    parser.add_argument("--fsync", action="store_true", help="fsync every file written")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="bench_publish_", dir=args.dir)
    mesh = sharding.make_mesh({"fsdp": jax.device_count()})
    print_header(f"{'layout':>9} {'what':>8} {'MB':>7} {'seconds':>8} {'MB/s':>8} "
                 f"{'x plain':>8}")
    try:
        for scan_layers in (False, True):
            cfg = model_config(args.layers, args.dtype).replace(scan_layers=scan_layers)
            bench_layout(cfg, mesh, root, args.repeats, args.fsync)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
