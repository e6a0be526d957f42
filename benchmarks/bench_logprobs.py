"""Chunked token log-probs against the full log-softmax: time and memory, all measured in this run.

    make bench                                  # runs every benchmark
    python benchmarks/bench_logprobs.py         # X=2048 tokens, D=512, V=32768; float32 and bf16
    python benchmarks/bench_logprobs.py --chunk-sizes 1024 4096 --token-chunk-sizes 512 2048

Times, on the same inputs, one jitted training-style call: the log-probs of X target tokens
under `hidden @ lm_head`, their sum, and its gradient with respect to both `hidden` and `lm_head`
(`jax.value_and_grad`):
  naive    `token_logprobs_reference`: the [X, V] float32 logits and `jax.nn.log_softmax`;
  chunked  `token_logprobs` with the given vocabulary chunk C and token block R;
and prints the median time of each (calls interleaved, so background load hits all alike), its
ratio to the naive one, and XLA's temporary memory. A second table compiles, without running or
allocating anything, the gradient at the size of the issue (T=8192, D=2048, V=151936, bfloat16)
and prints the temporary memory of both and their ratio.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from _table import print_header

from sao_jax.models.logprobs import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_TOKEN_CHUNK_SIZE,
    token_logprobs,
    token_logprobs_reference,
)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def summed(logprobs_fn):
    """The loss sum_{b,t} logp[b, t] as a function of (hidden, lm_head, targets)."""

    def loss(hidden, lm_head, targets):
        return jnp.sum(logprobs_fn(hidden, lm_head, targets))

    return loss


def chunked(chunk_size: int, token_chunk_size: int):
    return partial(token_logprobs, chunk_size=chunk_size, token_chunk_size=token_chunk_size)


def temp_mib(fn, *args) -> float:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def interleaved_median_ms(fns: dict, args, repeats: int) -> dict:
    """Median wall time in ms of each function, calling them in turn `repeats` times."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * float(np.median(t)) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="X = B * T")
    parser.add_argument("--width", type=int, default=512, help="D")
    parser.add_argument("--vocab", type=int, default=32768, help="V")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[DEFAULT_CHUNK_SIZE])
    parser.add_argument("--token-chunk-sizes", type=int, nargs="+",
                        default=[DEFAULT_TOKEN_CHUNK_SIZE])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--large", type=int, nargs=3, default=[8192, 2048, 151936],
                        metavar=("T", "D", "V"), help="size of the compile-only memory table")
    args = parser.parse_args()

    header = (f"{'dtype':>8} {'X':>6} {'D':>5} {'V':>6} {'impl':>8} {'C':>6} {'R':>6} {'ms':>8} "
              f"{'x naive':>8} {'temp MiB':>9}")
    print_header(header)
    rng = np.random.default_rng(0)
    x, d, v = args.tokens, args.width, args.vocab
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        inputs = (jnp.asarray(rng.normal(size=(1, x, d)), dtype),
                  jnp.asarray(rng.normal(size=(d, v)) / np.sqrt(d), dtype),
                  jnp.asarray(rng.integers(0, v, size=(1, x)), jnp.int32))
        fns = {("naive", "", ""): summed(token_logprobs_reference)}
        fns.update({("chunked", c, r): summed(chunked(c, r))
                    for c in args.chunk_sizes for r in args.token_chunk_sizes})
        fns = {key: jax.jit(jax.value_and_grad(fn, argnums=(0, 1))) for key, fn in fns.items()}
        ms = interleaved_median_ms(fns, inputs, args.repeats)
        naive_ms = ms[("naive", "", "")]
        for key, fn in fns.items():
            impl, c, r = key
            print(f"{dtype_name:>8} {x:>6} {d:>5} {v:>6} {impl:>8} {c:>6} {r:>6} {ms[key]:>8.1f} "
                  f"{ms[key] / naive_ms:>8.2f} {temp_mib(fn, *inputs):>9.1f}")

    t, d, v = args.large
    print(f"\ncompiled gradient of sum(logp), T={t} D={d} V={v} bfloat16, B=1 "
          f"(C={args.chunk_sizes[0]}, R={args.token_chunk_sizes[0]})")
    header = f"{'grad w.r.t.':>16} {'naive MiB':>10} {'chunked MiB':>12} {'naive/chunked':>14}"
    print_header(header)
    shapes = (jax.ShapeDtypeStruct((1, t, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
              jax.ShapeDtypeStruct((1, t), jnp.int32))
    losses = (summed(token_logprobs_reference),
              summed(chunked(args.chunk_sizes[0], args.token_chunk_sizes[0])))
    for name, argnums in (("hidden", 0), ("hidden, lm_head", (0, 1))):
        naive, chunk = (temp_mib(jax.jit(jax.grad(loss, argnums=argnums)), *shapes)
                        for loss in losses)
        print(f"{name:>16} {naive:>10.0f} {chunk:>12.0f} {naive / chunk:>14.1f}")


if __name__ == "__main__":
    main()
