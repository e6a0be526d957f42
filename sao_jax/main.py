"""Entry point: `python -m sao_jax.main --exp=toy` (what `make train` runs).

The asynchronous learner, the embedded engine and the rollout workers have not landed yet; until
they do, this says so plainly and points at what works today.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sao_jax.main", description=__doc__)
    parser.add_argument("--exp", default="toy", help="experiment name: experiments/<exp>.py")
    args, _ = parser.parse_known_args(argv)
    print(
        f"sao_jax: training (EXP={args.exp}) is not available yet: the learner, the embedded "
        "inference engine and the rollout workers arrive in later releases.\n"
        "What works today: `from sao_jax import rl` (GAE, DIS, PPO/value losses, baselines), "
        "`make test`, and `make bench` (GAE speed against a memory-copy floor).",
        file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
