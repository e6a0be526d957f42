"""Pallas kernels against the pure-JAX paths and a device copy of the same bytes, on this backend.

    python benchmarks/bench_kernels.py                        # B=128, T=32768: GAE fwd, DIS fwd+bwd
    python benchmarks/bench_kernels.py --batch 8 --length 4096 --repeats 5
    python benchmarks/bench_kernels.py --gae-blocks 1,2048,8  # tune: rows,time,num_warps

For each workload it times, on the same float32 inputs (bool mask, about 30% observation tokens in
spans), the median per-call time of:
  copy       a device-to-device copy moving the same bytes (read N/2, write N/2): the floor;
  reference  GAE only: `rl.gae(impl="reference")`, i.e. `kernels.gae_reference` (reverse lax.scan);
  xla        `rl.gae(impl="xla")` (chunked closed form) / `rl.dis_loss(impl="xla")`, which for DIS
             is its one jnp form, `kernels.dis_loss_reference` (DIS has no separate reference row);
  pallas     `sao_jax.kernels.gae` / `.dis_loss` (what impl="pallas" runs), compiled.
Bytes per token: GAE forward reads rewards, values (4 + 4) and the mask (1), writes advantages and
returns (4 + 4): 17. DIS forward reads logp, rollout_logp, advantages (12) and the mask (1); its
backward reads them again and writes the gradient (4): 30 for forward + backward.
Columns: GB/s achieved (those bytes / time), "of copy" = that over the copy's GB/s (1.0 = as fast as
a copy), "x xla" = time over the xla time (< 1 is faster).

On a CPU, Pallas runs in its interpreter, which checks correctness and says nothing about speed:
the pallas rows are then timed only at `--interpret-batch x --interpret-length` (beside xla) and
marked.
Targets on an H200 at B=128, T=32768: GAE forward and DIS forward + backward at >= 0.5 of copy;
GAE faster than xla, DIS within 1.1x of xla or faster. The last lines check them on a GPU.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import jax
import numpy as np
from _table import print_header
from bench_gae import spans_mask

from sao_jax import kernels, rl

GAE_BYTES_PER_TOKEN = 17
DIS_BYTES_PER_TOKEN = 30
BAND = dict(eps_low=0.3, eps_high=5.0)


def time_ms(fn, args, repeats: int, rounds: int = 3) -> float:
    """Median over rounds of (repeats calls dispatched back to back) / repeats, in ms."""
    jax.block_until_ready(fn(*args))
    results = []
    for _ in range(rounds):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(repeats)]
        jax.block_until_ready(outs)
        results.append((time.perf_counter() - start) / repeats)
        del outs
    return 1e3 * float(np.median(results))


def copy_ms(total_bytes: int, repeats: int) -> float:
    """A device copy reading and writing total_bytes / 2 each (an elementwise pass over float32)."""
    x = jax.device_put(np.zeros(max(total_bytes // 8, 1), np.float32))
    return time_ms(jax.jit(lambda x: x + 1.0), (x,), repeats)


def gae_inputs(rng, batch: int, length: int):
    mask = spans_mask(rng, batch, length)
    rewards = np.zeros((batch, length), np.float32)
    rewards[:, -1] = rng.normal(size=batch)
    values = rng.normal(size=(batch, length)).astype(np.float32)
    lam = np.asarray(rl.length_adaptive_lambda(mask, 1.5))
    return [jax.device_put(x) for x in (rewards, values, mask, lam)]


def dis_inputs(rng, batch: int, length: int):
    mask = spans_mask(rng, batch, length)
    logp = rng.normal(-1.0, 0.5, (batch, length)).astype(np.float32)
    rollout = (logp + rng.normal(0.0, 0.2, (batch, length))).astype(np.float32)
    advantages = rng.normal(size=(batch, length)).astype(np.float32)
    return [jax.device_put(x) for x in (logp, rollout, advantages, mask)]


def gae_fns(blocks):
    def rl_gae(r, v, m, lam, impl):
        return rl.gae(r, v, m, gamma=1.0, lam=lam, impl=impl)

    def pallas(r, v, m, lam):
        return kernels.gae(r, v, m, gamma=1.0, lam=lam, blocks=blocks)

    return {"reference": partial(rl_gae, impl="reference"), "xla": partial(rl_gae, impl="xla"),
            "pallas": pallas}


def dis_fns(blocks):
    def fwd_bwd(loss_fn):
        def run(logp, rollout, adv, mask):
            return jax.value_and_grad(lambda lp: loss_fn(lp, rollout, adv, mask, **BAND)[0])(logp)
        return run

    return {"xla": fwd_bwd(partial(rl.dis_loss, impl="xla")),
            "pallas": fwd_bwd(partial(kernels.dis_loss, blocks=blocks))}


def parse_blocks(text: str | None, cls):
    if text is None:
        return None
    rows, time_, *warps = (int(x) for x in text.split(","))
    return cls(rows=rows, time=time_, num_warps=warps[0] if warps else 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--interpret-batch", type=int, default=8,
                        help="CPU only: the size at which the interpreted kernels are timed")
    parser.add_argument("--interpret-length", type=int, default=2048)
    parser.add_argument("--impls", nargs="+", default=["reference", "xla", "pallas"])
    parser.add_argument("--gae-blocks", help="rows,time[,num_warps]; default GaeBlocks.default")
    parser.add_argument("--dis-blocks", help="rows,time[,num_warps]; default DisBlocks.default")
    args = parser.parse_args()

    backend = jax.default_backend()
    interpreted = backend == "cpu"
    header = (f"{'kernel':>12} {'impl':>10} {'B':>4} {'T':>6} {'ms':>9} {'GB/s':>8} "
              f"{'of copy':>8} {'x xla':>7}")
    print_header(header)
    if interpreted:
        print("NOTE: on a CPU the Pallas kernels run in the interpreter: correctness only, not "
              "speed; pallas rows are timed at the small interpret size (marked *).")
    rng = np.random.default_rng(0)
    workloads = [
        ("gae_fwd", GAE_BYTES_PER_TOKEN, gae_inputs,
         gae_fns(parse_blocks(args.gae_blocks, kernels.GaeBlocks))),
        ("dis_fwd_bwd", DIS_BYTES_PER_TOKEN, dis_inputs,
         dis_fns(parse_blocks(args.dis_blocks, kernels.DisBlocks))),
    ]
    summary = {}
    for name, bytes_per_token, make_inputs, fns in workloads:
        sizes = {(args.batch, args.length)}
        if interpreted and "pallas" in args.impls:
            sizes.add((args.interpret_batch, args.interpret_length))
        for batch, length in sorted(sizes, reverse=True):
            total = bytes_per_token * batch * length
            inputs = make_inputs(rng, batch, length)
            copy = copy_ms(total, args.repeats)
            rows = {"copy": copy}
            for impl in (impl for impl in args.impls if impl in fns):
                small = (batch, length) == (args.interpret_batch, args.interpret_length)
                if interpreted and {"pallas": not small, "reference": small}.get(impl, False):
                    continue  # interpreted kernels at the small size only, beside xla
                rows[impl] = time_ms(jax.jit(fns[impl]), inputs,
                                     1 if interpreted and impl == "pallas" else args.repeats)
            for impl, ms in rows.items():
                gbs = total / ms / 1e6
                ratio = f"{ms / rows['xla']:>7.2f}" if "xla" in rows else f"{'-':>7}"
                mark = "*" if interpreted and impl == "pallas" else " "
                print(f"{name:>12} {impl + mark:>10} {batch:>4} {length:>6} {ms:>9.3f} "
                      f"{gbs:>8.1f} {copy / ms:>8.2f} {ratio}")
                summary[name, impl, batch, length] = ms
    if backend == "gpu" and all(impl in args.impls for impl in ("xla", "pallas")):
        check_targets(summary, args.batch, args.length)


def check_targets(summary, batch: int, length: int) -> None:
    """The H200 targets of the kernels, checked on whatever GPU this is."""
    print()
    for name, faster in (("gae_fwd", 1.0), ("dis_fwd_bwd", 1.1)):
        ms = summary[name, "pallas", batch, length]
        copy = summary[name, "copy", batch, length]
        xla = summary[name, "xla", batch, length]
        ok_bw, ok_xla = copy / ms >= 0.5, ms <= faster * xla
        print(f"target {name}: {copy / ms:.2f} of copy (>= 0.50: {'ok' if ok_bw else 'MISSED'}), "
              f"{ms / xla:.2f}x xla (<= {faster:.2f}: {'ok' if ok_xla else 'MISSED'})")


if __name__ == "__main__":
    main()
