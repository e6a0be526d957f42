"""N learner processes on this machine, each with simulated CPU devices: a multi-host run
without the hosts, for tests and CPU users (`make train PROCS=N`).

    python -m sao_jax.launch --procs=2 [--devices_per_process=4] -- --config=experiments/toy.py ...

Each process runs `python -m sao_jax.main <the arguments after -->` with JAX's multi-process
variables set (`JAX_COORDINATOR_ADDRESS` on a free loopback port, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID`), `JAX_PLATFORMS=cpu` unless set, and `--devices_per_process` CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count`). Process 0's output is this command's;
the others' lines come prefixed with `[process i]`. Ctrl-C goes to process 0, which stops the
run; the others follow it.

When a process exits with an error (or is killed), the others stop by themselves within a
second (`train.distributed`: liveness; they exit with `LOST_EXIT_CODE`); any still running after
`--grace_s` are killed. The exit status is the cause's: the first process to fail other than by
losing another (128 + the signal for a killed one); the same command resumes from the last
checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from sao_jax.train.distributed import LOST_EXIT_CODE
from sao_jax.train.processes import free_port


def child_env(index: int, procs: int, port: int, devices: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(procs),
               JAX_PROCESS_ID=str(index),
               XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _relay(stream, prefix: str) -> None:
    for line in iter(stream.readline, b""):
        sys.stderr.buffer.write(prefix.encode() + line)
        sys.stderr.buffer.flush()


def describe(index: int, code: int) -> str:
    if code < 0:
        return f"process {index} was killed by {signal.Signals(-code).name}"
    return f"process {index} exited with code {code}"


def launch(procs: int, devices: int, argv: list[str], grace_s: float = 30.0) -> int:
    """Runs the processes to the end; returns the exit status (module docstring)."""
    port = free_port()
    children = []
    for i in range(procs):
        child = subprocess.Popen(
            [sys.executable, "-m", "sao_jax.main", *argv], env=child_env(i, procs, port, devices),
            stdout=None if i == 0 else subprocess.PIPE,
            stderr=None if i == 0 else subprocess.STDOUT,
            start_new_session=True)  # a terminal's Ctrl-C reaches this process only
        if i:
            threading.Thread(target=_relay, args=(child.stdout, f"[process {i}] "),
                             daemon=True).start()
        children.append(child)
    forward = {s: signal.signal(s, lambda sig, _: children[0].send_signal(sig))
               for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _wait(children, grace_s)
    finally:
        for sig, handler in forward.items():
            signal.signal(sig, handler)
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def _wait(children: list[subprocess.Popen], grace_s: float) -> int:
    ended: dict[int, int] = {}  # index -> exit status, in the order they ended
    deadline = None
    while len(ended) < len(children):
        # Those seen ending in the same poll: a consequence last (a process that says it lost
        # another, or one its collectives library aborted because a peer vanished: SIGABRT).
        now = [(i, c.returncode) for i, c in enumerate(children)
               if i not in ended and c.poll() is not None]
        for i, code in sorted(now, key=lambda f: (f[1] in (LOST_EXIT_CODE, -signal.SIGABRT))):
            ended[i] = code
        if deadline is None and any(ended.values()):
            deadline = time.monotonic() + grace_s
        elif deadline is not None and time.monotonic() > deadline:
            for i, c in enumerate(children):
                if c.poll() is None:
                    print(f"sao_jax.launch: process {i} still runs {grace_s:g} s after the "
                          "failure: killing it", file=sys.stderr, flush=True)
                    c.kill()
        time.sleep(0.02)
    failed = [(i, code) for i, code in ended.items() if code]
    if not failed:
        return 0
    # The cause: not a process that stopped because it lost another (it says so itself).
    index, code = next((f for f in failed if f[1] != LOST_EXIT_CODE), failed[0])
    print(f"sao_jax.launch: the run stopped because {describe(index, code)}; run the same "
          "command again to resume from the last checkpoint", file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2, help="learner processes")
    parser.add_argument("--devices_per_process", type=int, default=1,
                        help="simulated CPU devices of each")
    parser.add_argument("--grace_s", type=float, default=30.0,
                        help="after a failure, how long the others get to stop by themselves")
    parser.add_argument("argv", nargs=argparse.REMAINDER,
                        help="-- then the arguments of python -m sao_jax.main")
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if args.procs < 1 or args.devices_per_process < 1:
        parser.error("--procs and --devices_per_process must be >= 1")
    sys.exit(launch(args.procs, args.devices_per_process, argv, args.grace_s))


if __name__ == "__main__":
    main()
