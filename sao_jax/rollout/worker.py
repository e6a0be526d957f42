"""The rollout worker: leases prompts, plays many episodes at once, streams trajectories back.

    python -m sao_jax.rollout.worker --learner 127.0.0.1:PORT --engine http://127.0.0.1:N \\
        --env calculator --concurrency 32 [--parent-pid PID]

One rollout per prompt: each leased prompt becomes one episode (`agent.run_episode`) against the
engines (least-loaded routing by `SGLangClient`), and each finished trajectory is validated and
submitted as soon as it is done — the learner's backpressure holds the worker back, and its
admission (`TrajectoryServer(max_in_flight=...)`) bounds staleness. Workers hold no durable
state: a lease they never answer is issued again by the learner.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping

from sao_jax.envs import calculator
from sao_jax.envs.style_shift import StyleShiftEnv
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.rollout.agent import AgentConfig, run_episode
from sao_jax.rollout.client import SGLangClient
from sao_jax.rollout.lifetime import watch_parent
from sao_jax.rollout.stream import PromptsExhausted, TrajectoryClient
from sao_jax.rollout.trajectory import TrajectoryError

log = logging.getLogger(__name__)


def _calculator_env(data: Mapping, max_turns: int):
    return calculator.CalculatorEnv(calculator.Problem(data["expression"], int(data["answer"])),
                                    max_turns=max_turns)


def _style_shift_env(data: Mapping, max_turns: int):
    return StyleShiftEnv(data["topic"], learner_step=int(data.get("learner_step", 0)))


# name -> (env factory from a leased prompt's data, stop tokens of an action)
ENVIRONMENTS: dict[str, tuple[Callable, Callable]] = {
    "calculator": (_calculator_env, calculator.stop_token_ids),
    "style_shift": (_style_shift_env, lambda tok: (tok.eos_id, tok.encode(".")[0],
                                                   tok.encode("!")[0], tok.encode("?")[0])),
}


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    learner: str  # "host:port" of the learner's trajectory server
    engines: tuple[str, ...]  # engine base URLs
    env: str = "calculator"
    concurrency: int = 16  # episodes in flight
    max_turns: int = 8
    max_response_tokens: int = 256
    max_action_tokens: int = 32
    temperature: float = 1.0
    vocab_size: int | None = None  # the model's; set it to check trajectories before sending
    token: str | None = None
    worker_id: str = dataclasses.field(default_factory=lambda: f"worker-{os.getpid()}")

    def __post_init__(self):
        if self.env not in ENVIRONMENTS:
            raise ValueError(f"WorkerConfig.env must be one of {sorted(ENVIRONMENTS)}, "
                             f"got {self.env!r}.")
        if not self.engines:
            raise ValueError("WorkerConfig.engines is empty: give at least one engine URL.")
        if self.concurrency < 1:
            raise ValueError(f"WorkerConfig.concurrency must be >= 1, got {self.concurrency}.")


async def run_worker(config: WorkerConfig, stop: asyncio.Event | None = None) -> dict:
    """Plays episodes until the learner's prompts run out or `stop` is set; returns counts."""
    stop = stop or asyncio.Event()
    tok = CharTokenizer()
    make_env, stops = ENVIRONMENTS[config.env]
    agent = AgentConfig(max_turns=config.max_turns, max_response_tokens=config.max_response_tokens,
                        max_action_tokens=config.max_action_tokens,
                        temperature=config.temperature, stop_token_ids=tuple(stops(tok)))
    learner = TrajectoryClient(config.learner, token=config.token)
    engines = SGLangClient(list(config.engines))
    counts = {"submitted": 0, "rejected": 0, "duplicate": 0, "invalid": 0}
    running: set[asyncio.Task] = set()

    async def episode(leased):
        env = make_env(leased.data, config.max_turns)
        traj = await run_episode(engines, env, tok, prompt_id=leased.prompt_id, config=agent,
                                 lease_id=leased.lease_id, bos_id=tok.bos_id)
        if config.vocab_size:
            try:
                traj.validate(vocab_size=config.vocab_size)
            except TrajectoryError as e:  # the learner rejects it too (and re-issues the
                counts["invalid"] += 1  # prompt); sent anyway, so that it is counted there
                log.warning("trajectory for prompt %s is invalid: %s", leased.prompt_id, e)
        ack = await asyncio.to_thread(learner.submit, traj)
        counts["submitted" if ack.status == "accepted" else ack.status] += 1

    exhausted = False
    try:
        while not stop.is_set() and not (exhausted and not running):
            free = config.concurrency - len(running)
            leases = []
            if free and not exhausted:
                try:
                    leases = await asyncio.to_thread(learner.lease_prompts, free,
                                                     config.worker_id)
                except PromptsExhausted:
                    exhausted = True
            for leased in leases:
                task = asyncio.create_task(episode(leased))
                running.add(task)
                task.add_done_callback(running.discard)
            if leases:
                continue
            if not running:  # admission or other workers hold the prompts: ask again soon
                await asyncio.sleep(0.05)
                continue
            done, _ = await asyncio.wait(running, timeout=0.05,
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await engines.close()
        learner.close()
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learner", required=True, help="host:port of the trajectory server")
    parser.add_argument("--engine", action="append", required=True, help="engine URL (repeat)")
    parser.add_argument("--env", default="calculator", choices=sorted(ENVIRONMENTS))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--token", default=os.environ.get("SAO_STREAM_TOKEN"))
    parser.add_argument("--parent-pid", type=int, default=os.getppid(),
                        help="exit when this process dies (0: never)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(message)s")
    if args.parent_pid:
        watch_parent(args.parent_pid)
    config = WorkerConfig(learner=args.learner, engines=tuple(args.engine), env=args.env,
                          concurrency=args.concurrency, temperature=args.temperature,
                          token=args.token)
    counts = asyncio.run(run_worker(config))
    log.info("done: %s", counts)


if __name__ == "__main__":
    main()
