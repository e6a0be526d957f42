"""GAE speed against the memory-bandwidth floor, all measured in this run.

    make bench                       # B=128, T in {4096, 32768, 131072}
    python benchmarks/bench_gae.py --lengths 32768 --repeats 20

For each T it times, on the same float32 inputs (about 30% observation tokens, in spans):
  copy       a NumPy copy of the same bytes: read rewards, values and mask, write two [B, T]
             outputs; the floor no GAE can beat on this machine;
  reference  `rl.gae(..., impl="reference")` (`kernels.gae_reference`), a reverse `lax.scan` over
             tokens;
  xla        `rl.gae(..., impl="xla")`, the chunked closed form;
  cpu        `rl.gae(..., impl="cpu")` (`kernels.gae_cpu`), the one-pass C++ kernel (XLA FFI),
             its rows split over the host's threads;
and prints the median time of each, its ratio to the copy, the page faults per call and XLA's
temporary memory. Outputs are freed between calls, as in a training loop, so every call pays for
allocating its outputs, the copy included. On glibc, XLA's temporaries come from fresh mmap'd pages
on every call once they pass 32 MiB, and first-touch page faults then cost as much as the
arithmetic: the faults column shows it (an allocator such as tcmalloc, preloaded, avoids it).
"""

from __future__ import annotations

import argparse
import resource
import time
from functools import partial

import jax
import numpy as np
from _table import print_header

from sao_jax import rl


def spans_mask(rng: np.random.Generator, batch: int, length: int, obs_fraction: float = 0.3,
               mean_obs_span: int = 96) -> np.ndarray:
    """Actions and observations in alternating spans; geometric lengths give obs_fraction."""
    mean_act_span = mean_obs_span * (1 - obs_fraction) / obs_fraction
    mask = np.empty((batch, length), bool)
    for b in range(batch):
        spans = 2 * length // int(mean_obs_span + mean_act_span) + 8
        act = rng.geometric(1 / mean_act_span, spans)
        obs = rng.geometric(1 / mean_obs_span, spans)
        row = np.repeat(np.tile([True, False], spans), np.stack([act, obs], 1).reshape(-1))
        while row.size < length:  # rare: draw more spans
            row = np.concatenate([row, row])
        mask[b] = row[:length]
    return mask


def median_ms(fn, repeats: int) -> tuple[float, float]:
    """Median wall time in ms, and minor page faults per call."""
    jax.block_until_ready(fn())
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
        del out
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return 1e3 * float(np.median(times)), faults / repeats


def numpy_copy(rewards, values, mask):
    adv = np.empty_like(rewards)
    ret = np.empty_like(values)
    np.copyto(adv, rewards)
    np.copyto(ret, values)
    np.count_nonzero(mask)  # reads the mask
    return adv, ret


def gae_lam(rewards, values, mask, lam, impl):
    return rl.gae(rewards, values, mask, gamma=1.0, lam=lam, impl=impl)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    header = (f"{'B':>4} {'T':>7} {'obs':>5} {'impl':>10} {'ms':>9} {'x copy':>8} "
              f"{'faults':>8} {'temp MiB':>9}")
    print_header(header)
    rng = np.random.default_rng(0)
    for length in args.lengths:
        mask = spans_mask(rng, args.batch, length)
        rewards = np.zeros((args.batch, length), np.float32)
        rewards[:, -1] = rng.normal(size=args.batch)
        values = rng.normal(size=(args.batch, length)).astype(np.float32)
        lam = rl.length_adaptive_lambda(mask, 1.5)
        inputs = [jax.device_put(x) for x in (rewards, values, mask, lam)]
        results = {"copy": (*median_ms(partial(numpy_copy, rewards, values, mask), args.repeats),
                            0.0)}
        for impl in ("reference", "xla", "cpu"):
            fn = jax.jit(partial(gae_lam, impl=impl))
            temp = fn.lower(*inputs).compile().memory_analysis().temp_size_in_bytes / 2**20
            results[impl] = (*median_ms(partial(fn, *inputs), args.repeats), temp)
        copy_ms = results["copy"][0]
        for name, (ms, faults, temp) in results.items():
            print(f"{args.batch:>4} {length:>7} {1 - mask.mean():>5.2f} {name:>10} {ms:>9.2f} "
                  f"{ms / copy_ms:>8.1f} {faults:>8.0f} {temp:>9.1f}")


if __name__ == "__main__":
    main()
