"""The embedded engine over HTTP: decode tokens/s at concurrency 1, 8 and 64 (toy model).

    python benchmarks/bench_engine.py                      # toy preset, 128 new tokens a request
    python benchmarks/bench_engine.py --preset small --new-tokens 64 --concurrency 1 16
    python benchmarks/bench_engine.py --seeded             # each request its own sampling_seed
    python benchmarks/bench_engine.py --baseline 7a2b41a   # against that commit's engine + client

Writes a model of the preset with `save_hf` into a temporary directory, starts
`python -m sao_jax.engine.server` on it (`--max-batch` = the largest concurrency), warms it up,
then for each concurrency C sends C requests at once through `SGLangClient` (16-token prompts,
temperature 1, `--new-tokens` each, no stop tokens; with `--seeded`, each with its own
`sampling_seed`), `--rounds` times, and prints the generated tokens per second of wall time, its
ratio to concurrency 1, and the mean decode batch size the engine reports (`/server_info`).
Engine and client share this machine's cores.

With `--baseline REV`, the engine and client of git revision REV (its `sao_jax/`, taken with
`git archive`) run beside this tree's, on the same model: two engines, and one client process
per side (this script with `--drive`, each importing its own `sao_jax`). For each concurrency
the two sides take turns, one wave each, `--pairs` times (alternating which goes first), and the
table gives each side's median tokens/s and the median over pairs of the baseline's wave time
over this tree's (> 1: this tree is faster). Waves in turn on one machine see the same load, so
the paired ratio is steadier than two runs' rates, which move by 2x here when the machine is busy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from sao_jax.train.processes import free_port


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


async def wave(client: SGLangClient, rng, concurrency: int, new_tokens: int, vocab: int,
               seeded: bool, first_seed: int = 0) -> int:
    """Sends `concurrency` requests at once (16-token prompts); returns the tokens generated."""
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    prompts = rng.integers(0, vocab, size=(concurrency, 16)).tolist()
    results = await asyncio.gather(*(client.generate(
        p, {**params, "sampling_seed": first_seed + i} if seeded else params)
        for i, p in enumerate(prompts)))
    return sum(r.completion_tokens for r in results)


async def measure(url: str, concurrency: int, new_tokens: int, rounds: int, vocab: int,
                  seeded: bool = False):
    """`(tokens, seconds, mean decode batch)` of `rounds` waves of `concurrency` requests."""
    rng = np.random.default_rng(concurrency)
    before = (await server_info(url))
    async with SGLangClient(url) as client:
        start = time.perf_counter()
        tokens = 0
        for _ in range(rounds):
            tokens += await wave(client, rng, concurrency, new_tokens, vocab, seeded, tokens)
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


async def drive(url: str, vocab: int) -> None:
    """`--drive`: one wave per stdin line `[concurrency, new_tokens, seeded]`, answered on stdout
    with `[tokens, seconds]` (a client process of `--baseline`'s, importing its own sao_jax)."""
    rng = np.random.default_rng(0)
    loop = asyncio.get_running_loop()
    async with SGLangClient(url) as client:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            concurrency, new_tokens, seeded = json.loads(line)
            start = time.perf_counter()
            tokens = await wave(client, rng, concurrency, new_tokens, vocab, seeded)
            print(json.dumps([tokens, time.perf_counter() - start]), flush=True)


def engine_module(root: str) -> str:
    """The embedded engine's module in the tree at `root`: a `--baseline` from before
    sao_jax/rollout/engine.py became sao_jax/engine/server.py has the old one."""
    moved = os.path.exists(os.path.join(root, "sao_jax", "engine", "server.py"))
    return "sao_jax.engine.server" if moved else "sao_jax.rollout.engine"


class Side:
    """One revision's engine and client process (`--baseline`)."""

    def __init__(self, name: str, pythonpath: str, model_dir: str, args):
        self.name, self.env = name, {**os.environ, "PYTHONPATH": pythonpath}
        self.url = f"http://127.0.0.1:{free_port()}"
        self.engine = subprocess.Popen(
            [sys.executable, "-m", engine_module(pythonpath), "--model-path", model_dir,
             "--port", self.url.rsplit(":", 1)[1], "--max-batch", str(max(args.concurrency)),
             "--max-seq-len", str(args.max_seq_len), "--log-level", "WARNING"], env=self.env)
        self.client = None
        self.drive_argv = [sys.executable, os.path.abspath(__file__), "--drive", self.url,
                           "--preset", args.preset]

    def start_client(self):
        self.client = subprocess.Popen(self.drive_argv, env=self.env, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)

    def wave(self, concurrency: int, new_tokens: int, seeded: bool) -> tuple[int, float]:
        self.client.stdin.write(json.dumps([concurrency, new_tokens, seeded]) + "\n")
        self.client.stdin.flush()
        line = self.client.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} client exited with {self.client.wait()}")
        tokens, seconds = json.loads(line)
        return tokens, seconds

    def close(self):
        for proc in (self.client, self.engine):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait()


def checkout(rev: str, into: str) -> None:
    """`sao_jax/` of git revision `rev` under `into` (ValueError naming `rev` if git has none)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    archive = subprocess.run(["git", "-C", repo, "archive", "--format=tar", rev, "sao_jax"],
                             capture_output=True)
    if archive.returncode:
        raise ValueError(f"--baseline {rev}: git archive failed: "
                         f"{archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)


def compare(args, cfg) -> None:
    """`--baseline`: this tree against `args.baseline`, in paired waves."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        base_dir, model_dir = os.path.join(tmp, "baseline"), os.path.join(tmp, "model")
        os.makedirs(base_dir)
        checkout(args.baseline, base_dir)
        save_hf(CausalLM(cfg, nnx.Rngs(0)), model_dir)
        sides = [Side("this tree", repo, model_dir, args),
                 Side(f"baseline {args.baseline}", base_dir, model_dir, args)]
        try:
            for side in sides:
                asyncio.run(wait_up(side.url, side.engine))
                side.start_client()
                side.wave(1, 8, False)  # warm-up: the prefill bucket, the client's session
                for c in args.concurrency:
                    side.wave(c, args.new_tokens, args.seeded)
            print(f"engine: {args.preset} preset, {max(args.concurrency)} slots x "
                  f"{args.max_seq_len} positions, {args.new_tokens} new tokens a request, "
                  f"{args.pairs} paired waves" + (", seeded" if args.seeded else ""))
            header = (f"{'concurrency':>11} {'this tok/s':>10} {'baseline tok/s':>14} "
                      f"{'x baseline':>10}")
            print_header(header)
            for c in args.concurrency:
                seconds = {side.name: [] for side in sides}
                tokens = {}
                for i in range(args.pairs):
                    for side in (sides if i % 2 == 0 else sides[::-1]):
                        tokens[side.name], t = side.wave(c, args.new_tokens, args.seeded)
                        seconds[side.name].append(t)
                this, base = (seconds[side.name] for side in sides)
                ratio = float(np.median(np.asarray(base) / np.asarray(this)))
                rate = [tokens[side.name] / float(np.median(seconds[side.name]))
                        for side in sides]
                print(f"{c:>11} {rate[0]:>10.0f} {rate[1]:>14.0f} {ratio:>10.3f}", flush=True)
        finally:
            for side in sides:
                side.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="toy")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--seeded", action="store_true",
                        help="give each request its own sampling_seed")
    parser.add_argument("--baseline", metavar="REV",
                        help="compare with the engine and client of this git revision")
    parser.add_argument("--pairs", type=int, default=20,
                        help="with --baseline: paired waves per concurrency")
    parser.add_argument("--drive", metavar="URL", help=argparse.SUPPRESS)  # a --baseline client
    args = parser.parse_args()

    cfg = preset(args.preset)
    if args.drive:
        asyncio.run(drive(args.drive, cfg.vocab_size))
        return
    if args.baseline:
        compare(args, cfg)
        return
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(CausalLM(cfg, nnx.Rngs(0)), tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "sao_jax.engine.server", "--model-path", tmp, "--port",
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
