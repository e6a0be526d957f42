"""The embedded engine over HTTP: decode tokens/s at concurrency 1, 8 and 64 (toy model).

    python benchmarks/bench_engine.py                      # toy preset, 128 new tokens a request
    python benchmarks/bench_engine.py --preset small --new-tokens 64 --concurrency 1 16
    python benchmarks/bench_engine.py --seeded             # each request its own sampling_seed

Writes a model of the preset with `save_hf` into a temporary directory, starts
`python -m sao_jax.rollout.engine` on it (`--max-batch` = the largest concurrency), warms it up,
then for each concurrency C sends C requests at once through `SGLangClient` (16-token prompts,
temperature 1, `--new-tokens` each, no stop tokens; with `--seeded`, each with its own
`sampling_seed`), `--rounds` times, and prints the generated tokens per second of wall time, its
ratio to concurrency 1, and the mean decode batch size the engine reports (`/server_info`).
Engine and client share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp
import numpy as np
from _table import print_header
from flax import nnx

from sao_jax.models import CausalLM, save_hf
from sao_jax.models.config import preset
from sao_jax.rollout.client import SGLangClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def server_info(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url + "/server_info") as r:
        return await r.json()


async def wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the engine exited with {proc.returncode}")
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"the engine at {url} did not come up in {timeout_s} s")


async def measure(url: str, concurrency: int, new_tokens: int, rounds: int, vocab: int,
                  seeded: bool = False):
    """`(tokens, seconds, mean decode batch)` of `rounds` waves of `concurrency` requests."""
    rng = np.random.default_rng(concurrency)
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    before = (await server_info(url))
    async with SGLangClient(url) as client:
        start = time.perf_counter()
        tokens = 0
        for _ in range(rounds):
            prompts = rng.integers(0, vocab, size=(concurrency, 16)).tolist()
            results = await asyncio.gather(*(client.generate(
                p, {**params, "sampling_seed": tokens + i} if seeded else params)
                for i, p in enumerate(prompts)))
            tokens += sum(r.completion_tokens for r in results)
        seconds = time.perf_counter() - start
    after = await server_info(url)
    steps = after.get("decode_steps", 0) - before.get("decode_steps", 0)
    decoded = after.get("decode_tokens", 0) - before.get("decode_tokens", 0)
    return tokens, seconds, decoded / max(steps, 1)


async def bench(url: str, proc: subprocess.Popen, args, vocab: int) -> None:
    await wait_up(url, proc)
    await measure(url, 1, 8, 1, vocab)  # warm-up: the prefill bucket of 16-token prompts
    header = (f"{'concurrency':>11} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>8} "
              f"{'x c=1':>6} {'mean batch':>10}")
    print_header(header)
    base = None
    for c in args.concurrency:
        tokens, seconds, batch = await measure(url, c, args.new_tokens, args.rounds, vocab,
                                               args.seeded)
        rate = tokens / seconds
        base = base or rate
        print(f"{c:>11} {c * args.rounds:>8} {tokens:>7} {seconds:>8.2f} {rate:>8.0f} "
              f"{rate / base:>6.1f} {batch:>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="toy")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--seeded", action="store_true",
                        help="give each request its own sampling_seed")
    args = parser.parse_args()

    cfg = preset(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(CausalLM(cfg, nnx.Rngs(0)), tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "sao_jax.rollout.engine", "--model-path", tmp, "--port",
             str(port), "--max-batch", str(max(args.concurrency)), "--max-seq-len",
             str(args.max_seq_len), "--log-level", "WARNING"], env=env)
        try:
            print(f"engine: {args.preset} preset, {max(args.concurrency)} slots x "
                  f"{args.max_seq_len} positions, {args.new_tokens} new tokens a request"
                  + (", seeded" if args.seeded else ""))
            asyncio.run(bench(url, proc, args, cfg.vocab_size))
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
