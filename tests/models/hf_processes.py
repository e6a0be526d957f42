"""One process of a multi-process (or a lone) load and save, for tests/models/test_hf_scale.py.

    python -m tests.models.hf_processes --checkpoint DIR [--out DIR] [--process-id I
        --processes N --port P] [--devices 2] [--mesh fsdp=4] [--scan-layers]
        [--max-shard-bytes N] [--saves 1] [--alone DIR]

Loads DIR with `load_hf` into an abstract model sharded over every process's devices, measuring
this process's resident memory (VmRSS before, VmRSS after, and the peak VmHWM in between, the
peak reset first through /proc/self/clear_refs), then, with `--out`, saves it there with
`save_hf`, `--saves` times (`saves`: each one's figures, with the bytes of the buckets fetched
to this process; the `save_*` keys: the last one's, the first also compiles). With `--alone`,
process 0 then saves a model on its own first device (the checkpoint's architecture with one
layer, seed 0) there, as a leader saves its warm start, while the other processes wait for it at
the coordinator's barrier. Prints one JSON line. Runs on CPU devices (`--devices` per process);
several processes join through `jax.distributed` (gloo for the CPU collectives).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def memory_kib() -> dict[str, int]:
    """This process's VmRSS and VmHWM (peak) in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS


def counting_fetches() -> list[int]:
    """From now on, the bytes of each bucket `save_hf` fetches to this process, in a list."""
    from sao_jax.models.hf import save as hf

    fetched: list[int] = []
    pieces = hf._Fetcher.pieces

    def counted(self, b: int, owner: int):
        total = 0
        for piece in pieces(self, b, owner):
            total += piece.nbytes
            yield piece
        if total:
            fetched.append(total)

    hf._Fetcher.pieces = counted
    return fetched


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", default=None)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--mesh", default="fsdp=4", help="axis=size,... over all devices")
    parser.add_argument("--scan-layers", action="store_true")
    parser.add_argument("--max-shard-bytes", type=int, default=4 << 30)
    parser.add_argument("--saves", type=int, default=1, help="times to save (into --out)")
    parser.add_argument("--alone", default=None, help="process 0 saves a model of its own here")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                               f"--xla_force_host_platform_device_count={args.devices}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    from flax import nnx

    from sao_jax.models import CausalLM, load_hf, save_hf
    from sao_jax.models.hf import read_config
    from sao_jax.train import sharding

    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                                   num_processes=args.processes, process_id=args.process_id)
    mesh = sharding.make_mesh({axis: int(size) for axis, size in
                               (item.split("=") for item in args.mesh.split(","))})
    cfg = read_config(args.checkpoint, scan_layers=args.scan_layers)
    abstract = sharding.abstract_model(lambda: CausalLM(cfg, nnx.Rngs(0)), mesh,
                                       sharding.DEFAULT_RULES)
    before = memory_kib()
    reset_peak()
    start = time.perf_counter()
    model = load_hf(args.checkpoint, like=abstract, scan_layers=args.scan_layers)
    jax.block_until_ready(nnx.state(model))
    load_s = time.perf_counter() - start
    after = memory_kib()
    local_bytes = sum(shard.data.nbytes for leaf in jax.tree.leaves(nnx.state(model))
                      for shard in leaf.addressable_shards)
    result = {"process": args.process_id, "rss_before_kib": before["VmRSS"],
              "rss_after_kib": after["VmRSS"], "peak_kib": after["VmHWM"], "load_s": load_s,
              "local_shard_bytes": local_bytes}
    fetched = counting_fetches()
    result["saves"] = []
    for _ in range(args.saves if args.out else 0):
        rss = memory_kib()["VmRSS"]
        fetched.clear()
        reset_peak()
        start = time.perf_counter()
        save_hf(model, args.out, max_shard_bytes=args.max_shard_bytes)
        result["saves"].append({"rss_before_kib": rss, "s": time.perf_counter() - start,
                                "peak_kib": memory_kib()["VmHWM"],
                                "fetched_bytes": sum(fetched)})
    if result["saves"]:
        last = result["saves"][-1]
        result.update(save_rss_before_kib=last["rss_before_kib"], save_s=last["s"],
                      save_peak_kib=last["peak_kib"])
    if args.alone:
        start = time.perf_counter()
        if args.process_id == 0:
            with jax.default_device(jax.local_devices()[0]):
                own = CausalLM(cfg.replace(num_layers=1, scan_layers=False), nnx.Rngs(0))
            save_hf(own, args.alone)
        if args.processes > 1:
            from jax._src import distributed

            distributed.global_state.client.wait_at_barrier("alone", 60_000)
        result["alone_s"] = time.perf_counter() - start
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
