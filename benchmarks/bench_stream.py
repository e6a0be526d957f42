"""Trajectory stream throughput over loopback, against the cost of the bytes alone.

    make bench                        # 1k- and 32k-token trajectories
    python benchmarks/bench_stream.py --lengths 1024 --count 4000 --producers 4

For each length T it times, on the same trajectories (30% observation tokens, in spans):
  codec   one process encoding, decoding and validating each trajectory in turn: the work the
          stream cannot avoid, and the floor the ratios are taken against;
  +log    the same, plus appending each one to the log and fsyncing before the next, as the
          server does before an ack (a lone producer: no fsync is shared);
  stream  producer processes submitting over gRPC on loopback to a `TrajectoryServer` that
          validates, appends and fsyncs every trajectory before acking, while a consumer thread
          drains batches and marks them consumed (the queue never fills: no backpressure waits);
and prints trajectories/s, MB/s of serialized trajectories, and each time over the codec's.
Producers are separate processes, as rollout workers are; on few cores they, the server and the
consumer share the CPUs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import threading
import time

import numpy as np

from sao_jax.rollout.proto import trajectory_pb2 as pb
from sao_jax.rollout.stream import TrajectoryClient, TrajectoryLog, TrajectoryServer
from sao_jax.rollout.trajectory import Trajectory

VOCAB = 151_936


def make(length: int, seed: int) -> Trajectory:
    rng = np.random.default_rng(seed)
    mask = np.ones(length, bool)
    for start in range(200, length - 100, 320):  # ~30% observations, in spans of 96
        mask[start:start + 96] = False
    rewards = np.zeros(length, np.float32)
    rewards[np.flatnonzero(mask)[-1]] = 1.0
    return Trajectory(
        prompt_ids=rng.integers(0, VOCAB, 256), response_ids=rng.integers(0, VOCAB, length),
        action_mask=mask, rollout_logprobs=np.where(mask, -rng.exponential(size=length), np.nan),
        weight_versions=np.where(mask, 7, -1), rewards=rewards, truncated=False,
        finish_reason="stop", prompt_id=f"p{seed}", env_metadata={"env": "bench"},
        timings={"generate_s": 1.0})


def produce(address: str, length: int, seeds: list[int], ready, start) -> None:
    trajectories = [make(length, seed) for seed in seeds]
    with TrajectoryClient(address) as client:
        client.submit(make(length, 10**9 + seeds[0]))  # warm the connection
        ready.release()
        start.wait()
        for t in trajectories:
            assert client.submit(t).status == "accepted"


def time_local(length: int, count: int, durable: bool) -> float:
    """One process: encode, decode, validate (and, if durable, append to the log and fsync)."""
    trajectories = [make(length, seed) for seed in range(count)]
    with tempfile.TemporaryDirectory() as workdir:
        log = TrajectoryLog(os.path.join(workdir, "log"))
        log.open()
        start = time.perf_counter()
        for t in trajectories:
            msg = pb.Trajectory.FromString(t.to_bytes())
            Trajectory.from_proto(msg).validate(VOCAB)
            if durable:
                *_, end = log.append(pb.LogRecord(accepted=msg))
                log.sync(end)
        elapsed = time.perf_counter() - start
        log.close()
    return elapsed


def time_stream(length: int, count: int, producers: int) -> tuple[float, int]:
    ctx = mp.get_context("spawn")
    nbytes = len(make(length, 0).to_bytes()) * count
    with tempfile.TemporaryDirectory() as workdir, \
            TrajectoryServer(workdir, policy_version=None,
                             vocab_size=VOCAB, maxsize=max(256, count)) as server:
        ready, start = ctx.Semaphore(0), ctx.Event()
        seeds = np.array_split(np.arange(count), producers)
        procs = [ctx.Process(target=produce, args=(server.address, length, s.tolist(), ready,
                                                   start)) for s in seeds]
        for p in procs:
            p.start()
        for _ in procs:
            if not ready.acquire(timeout=120):
                raise RuntimeError("a producer failed to start")
        server.consumed(t.trajectory_id for t in server.get_batch(producers))  # warm-ups
        received = 0

        def consume():
            nonlocal received
            while received < count:
                batch = server.get_batch(min(128, count - received), timeout=0.05)
                received += len(batch)
                server.consumed(t.trajectory_id for t in batch)

        consumer = threading.Thread(target=consume)
        consumer.start()
        begin = time.perf_counter()
        start.set()
        for p in procs:
            p.join()
        consumer.join()
        elapsed = time.perf_counter() - begin
        if any(p.exitcode for p in procs) or received != count:
            raise RuntimeError(f"a producer failed or trajectories went missing ({received})")
    return elapsed, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 32768])
    parser.add_argument("--count", type=int, nargs="+", default=[2000, 400],
                        help="trajectories per length (one number for all, or one per length)")
    parser.add_argument("--producers", type=int, default=2)
    args = parser.parse_args()
    counts = args.count * len(args.lengths) if len(args.count) == 1 else args.count

    from _table import print_header

    print_header(f"{'T':>7} {'count':>6} {'what':>7} {'traj/s':>9} {'MB/s':>8} {'KB/traj':>8} "
                 f"{'x floor':>8}")
    for length, count in zip(args.lengths, counts, strict=True):
        codec_s = time_local(length, count, durable=False)
        logged_s = time_local(length, count, durable=True)
        stream_s, nbytes = time_stream(length, count, args.producers)
        for what, seconds in (("codec", codec_s), ("+log", logged_s), ("stream", stream_s)):
            print(f"{length:>7} {count:>6} {what:>7} {count / seconds:>9.0f} "
                  f"{nbytes / seconds / 1e6:>8.1f} {nbytes / count / 1e3:>8.1f} "
                  f"{seconds / codec_s:>8.2f}")


if __name__ == "__main__":
    main()
