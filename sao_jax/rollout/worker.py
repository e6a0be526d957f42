"""The rollout worker: leases prompts, plays many episodes at once, streams trajectories back.

    python -m sao_jax.rollout.worker --learner 127.0.0.1:PORT --engine http://127.0.0.1:N \\
        --env calculator --concurrency 32 [--parent-pid PID]
    python -m sao_jax.rollout.worker ... --env python_tool \\
        --tokenizer experiments/data/tir/tokenizer --max-turns 4 --max-action-tokens 256 \\
        --max-response-tokens 1024

`--env` names an entry of `envs.registry.REGISTRY`: how a leased prompt row becomes an environment,
where its actions stop, whether it needs a real tokenizer.

One rollout per prompt: each leased prompt becomes one episode (`agent.run_episode`) against the
engines (`SGLangClient`: a new episode goes to the least-loaded engine and stays there while it
answers, so the engine's prefix cache holds its history), and each finished trajectory is
validated and submitted as soon as it is done — the learner's backpressure holds the worker back,
and its admission (`TrajectoryServer(max_in_flight=...)`) bounds staleness. Workers hold no durable
state: a lease they never answer is issued again by the learner. An episode whose environment
raises is logged with its traceback and reported (`report_failure`): the learner issues the
prompt again, up to 3 attempts; `--max-env-failures-in-a-row` failures with no episode finishing
in between stop the worker (and so the run), as a broken environment should.

Text becomes ids through the text layer (`sao_jax.text`): the toy `CharTokenizer`, or with
`--tokenizer DIR` a Hugging Face tokenizer directory (`load_tokenizer`). When that has a chat
template, the prompt is the environment's first text as a user message, rendered with the
generation prompt; otherwise it is `bos + encode(text)` (`prompt_renderer`). Later observations
are the chat template's token deltas when the tokenizer has one, plain encoded text otherwise
(`chat_deltas`).

Weight versions: engines label their weights; the learner publishes version N as "N", and an
engine not yet updated answers with its start-up label (SGLang's default is "default"), which is
`--initial-weight-version` (`--initial-weight-label` if it was started with another label;
`client.VersionMap`). A `/generate` call that gets no answer within `--request-timeout-s` (a
frozen engine) fails over to another engine, its episode with it.

The counts `run_worker` returns (and logs every `STATS_EVERY_S` seconds, and `main` at the end)
include the client's: `engine_moves` (episodes
moved to another engine because theirs stopped answering), `engine_retries`,
`engine_resubmits` (requests resumed after a weight update aborted them),
`engine_stops_at_abort` (requests aborted right after a stop token: finished, not resumed) and
`engine_timeouts`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping

from sao_jax.envs import registry
from sao_jax.lifetime import watch_parent
from sao_jax.rollout.agent import AgentConfig, EnvironmentFailure, close_env, run_episode
from sao_jax.rollout.client import SGLangClient, VersionMap
from sao_jax.rollout.stream import LeasedPrompt, PromptsExhausted, TrajectoryClient
from sao_jax.rollout.trajectory import TrajectoryError
from sao_jax.text import Tokenizer, chat_deltas, load_tokenizer, prompt_renderer

log = logging.getLogger(__name__)

STATS_EVERY_S = 60.0  # how often a running worker logs its counts


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    learner: str  # "host:port" of the learner's trajectory server
    engines: tuple[str, ...]  # engine base URLs
    env: str = registry.DEFAULT  # a name of `envs.registry.REGISTRY`
    concurrency: int = 16  # episodes in flight
    max_turns: int = 8
    max_response_tokens: int = 256
    max_action_tokens: int = 32
    max_context_tokens: int | None = None  # the engines' context (prompt + response); None: any
    temperature: float = 1.0
    vocab_size: int | None = None  # the model's; set it to check trajectories before sending
    env_options: Mapping | None = None  # the environment's options (JSON), e.g. swe's backend
    token: str | None = None
    tokenizer: str | None = None  # a local HF tokenizer directory; None: the toy CharTokenizer
    chat_template: bool = True  # render the prompt in the tokenizer's chat template, if it has one
    # An episode whose environment raises is reported and its prompt issued again; this many
    # failures in a row (no episode finishing in between) mean a broken environment: stop.
    max_env_failures_in_a_row: int = 16
    # The learner's version of the weights engines answer with before their first update, and
    # the label they were started with (SGLang's --weight-version default).
    initial_weight_version: int = 0
    initial_weight_label: str = "default"
    request_timeout_s: float | None = 600.0  # a /generate call with no answer this long fails over
    # routing replay: (layers, top_k) of the experts each turn asks the engines for, or None
    routed_experts: tuple[int, int] | None = None
    worker_id: str = dataclasses.field(default_factory=lambda: f"worker-{os.getpid()}")

    def __post_init__(self):
        if self.env not in registry.REGISTRY:
            raise ValueError(f"WorkerConfig.env must be one of {sorted(registry.REGISTRY)}, "
                             f"got {self.env!r}.")
        if not self.engines:
            raise ValueError("WorkerConfig.engines is empty: give at least one engine URL.")
        if self.concurrency < 1:
            raise ValueError(f"WorkerConfig.concurrency must be >= 1, got {self.concurrency}.")
        if self.max_env_failures_in_a_row < 1:
            raise ValueError("WorkerConfig.max_env_failures_in_a_row must be >= 1, got "
                             f"{self.max_env_failures_in_a_row}.")
        try:
            VersionMap(self.initial_weight_version, self.initial_weight_label)
        except ValueError as e:
            raise ValueError(f"WorkerConfig.initial_weight_version / initial_weight_label "
                             f"(--initial-weight-version, --initial-weight-label): {e}") from None
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("WorkerConfig.request_timeout_s must be > 0 or None, got "
                             f"{self.request_timeout_s}.")
        example = registry.get(self.env).needs_tokenizer
        if example is not None and self.tokenizer is None:
            raise ValueError(f"WorkerConfig.env {self.env!r} needs a tokenizer directory "
                             f"(--tokenizer, e.g. {example}): the toy CharTokenizer cannot "
                             "write its prompt.")


async def run_worker(config: WorkerConfig, stop: asyncio.Event | None = None) -> dict:
    """Plays episodes until the learner's prompts run out or `stop` is set; returns counts."""
    stop = stop or asyncio.Event()
    tok = load_tokenizer(config.tokenizer)
    if config.vocab_size and tok.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids, more than the model's "
                         f"vocab_size {config.vocab_size}.")
    episodes = _Episodes(config, tok)
    running: set[asyncio.Task] = set()
    exhausted = False
    stats_due = time.monotonic() + STATS_EVERY_S
    try:
        while not stop.is_set() and not (exhausted and not running):
            if episodes.broken is not None:
                raise episodes.broken
            if time.monotonic() >= stats_due:
                stats_due = time.monotonic() + STATS_EVERY_S
                log.info("stats: %s, %d episodes running",
                         {**episodes.counts, **episodes.engines.stats()}, len(running))
            free = config.concurrency - len(running)
            leases = []
            if free > 0 and not exhausted:  # a group lease can overshoot the request
                try:
                    leases = await asyncio.to_thread(episodes.learner.lease_prompts, free)
                except PromptsExhausted:
                    exhausted = True
            for leased in leases:
                task = asyncio.create_task(episodes.play(leased))
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
        if episodes.broken is not None:  # the last episodes ended the loop before it looked
            raise episodes.broken
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        episodes.counts.update(episodes.engines.stats())
        await episodes.engines.close()
        episodes.learner.close()
    return episodes.counts


class _Episodes:
    """A worker's episodes: each leased prompt played against the engines and its trajectory
    submitted to the learner, or its failure reported; the counts of what became of them, and
    the breaker that `max_env_failures_in_a_row` failures in a row trip (`broken`: the error the
    worker stops with)."""

    def __init__(self, config: WorkerConfig, tok: Tokenizer):
        self.config = config
        self.tok = tok
        self.render_prompt = prompt_renderer(tok, config.chat_template)
        # observations: the template's deltas, or text
        self.chat = chat_deltas(tok, config.chat_template)
        self.spec = registry.get(config.env)
        self.agent = AgentConfig(max_turns=config.max_turns,
                                 max_response_tokens=config.max_response_tokens,
                                 max_action_tokens=config.max_action_tokens,
                                 max_context_tokens=config.max_context_tokens,
                                 temperature=config.temperature,
                                 stop_token_ids=tuple(self.spec.stop_token_ids(tok)),
                                 routed_experts=config.routed_experts)
        self.learner = TrajectoryClient(config.learner, worker_id=config.worker_id,
                                        token=config.token)
        self.engines = SGLangClient(list(config.engines),
                                    request_timeout_s=config.request_timeout_s,
                                    version_map=VersionMap(config.initial_weight_version,
                                                           config.initial_weight_label))
        self.counts = {"submitted": 0, "rejected": 0, "duplicate": 0, "invalid": 0,
                       "env_failures": 0}
        self.failures_in_a_row = 0
        self.broken: RuntimeError | None = None  # set once, by the failure that trips the breaker

    async def play(self, leased: LeasedPrompt) -> None:
        """One episode of `leased`, its trajectory validated (with the config's `vocab_size`)
        and submitted, or its environment's failure reported."""
        config = self.config
        try:
            try:
                env = self.spec.make_env(leased.data, config.max_turns,
                                         options=config.env_options,
                                         **_learner_step(self.spec, leased))
            except Exception as e:
                raise EnvironmentFailure(f"making the {config.env} environment raised "
                                         f"{type(e).__name__}: {e}") from e
            try:
                traj = await run_episode(self.engines, env, self.tok, prompt_id=leased.prompt_id,
                                         config=self.agent, lease_id=leased.lease_id,
                                         group_id=leased.group_id,
                                         prompt_index=leased.prompt_index,
                                         render_prompt=self.render_prompt, chat=self.chat)
            finally:  # an episode the loop cut (budget, turn limit) frees its workspace now
                await close_env(env)
        except EnvironmentFailure as e:  # one bad sample must not stop the run
            await self._failed(leased, e)
            return
        self.failures_in_a_row = 0
        if config.vocab_size:
            try:
                traj.validate(vocab_size=config.vocab_size)
            except TrajectoryError as e:  # the learner rejects it too (and re-issues the
                self.counts["invalid"] += 1  # prompt); sent anyway, so that it is counted there
                log.warning("trajectory for prompt %s is invalid: %s", leased.prompt_id, e)
        ack = await asyncio.to_thread(self.learner.submit, traj)
        self.counts["submitted" if ack.status == "accepted" else ack.status] += 1

    async def _failed(self, leased: LeasedPrompt, error: EnvironmentFailure) -> None:
        self.counts["env_failures"] += 1
        self.failures_in_a_row += 1  # counted before the await below: concurrent episodes fail too
        if (self.failures_in_a_row == self.config.max_env_failures_in_a_row
                and self.broken is None):
            self.broken = RuntimeError(
                f"the environment failed {self.failures_in_a_row} episodes in a row (the last: "
                f"{error}): it looks broken, not unlucky; see the tracebacks above "
                "(WorkerConfig.max_env_failures_in_a_row).")
            self.broken.__cause__ = error
        log.warning("the episode of prompt %s failed: %s", leased.prompt_id, error,
                    exc_info=error)
        await asyncio.to_thread(self.learner.report_failure, leased.lease_id, leased.prompt_id,
                                str(error))


def _learner_step(spec: registry.EnvSpec, leased: LeasedPrompt) -> dict[str, int]:
    """`make_env`'s `learner_step` keyword: the learner's step that the lease carries, for an
    environment whose reward moves with training (`step_in_prompt`); none for the others, nor
    when the learner set none (the environment's own default)."""
    if spec.step_in_prompt and leased.learner_step is not None:
        return {"learner_step": leased.learner_step}
    return {}


def parse_args(argv=None) -> tuple[WorkerConfig, int]:
    """The worker's config and the parent pid to watch (0: none) from the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learner", required=True, help="host:port of the trajectory server")
    parser.add_argument("--engine", action="append", required=True, help="engine URL (repeat)")
    parser.add_argument("--env", default=registry.DEFAULT, choices=sorted(registry.REGISTRY))
    parser.add_argument("--env-options", type=json.loads, default=None,
                        help="the environment's options as a JSON object (e.g. swe's backend)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--tokenizer", default=None,
                        help="HF tokenizer directory (tokenizer.json, tokenizer_config.json); "
                             "default: the toy character tokenizer")
    parser.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                        help="prompt with bos + the encoded text even if the tokenizer has a "
                             "chat template")
    parser.add_argument("--max-turns", type=int, default=WorkerConfig.max_turns)
    parser.add_argument("--max-action-tokens", type=int, default=WorkerConfig.max_action_tokens)
    parser.add_argument("--max-response-tokens", type=int,
                        default=WorkerConfig.max_response_tokens,
                        help="actions and observations of an episode together")
    parser.add_argument("--max-context-tokens", type=int, default=None,
                        help="prompt + response the engines hold (--max-seq-len): an episode "
                             "ends where its next request would not fit")
    parser.add_argument("--max-env-failures-in-a-row", type=int,
                        default=WorkerConfig.max_env_failures_in_a_row,
                        help="stop after this many failed episodes with none finishing between")
    parser.add_argument("--initial-weight-version", type=int, default=0,
                        help="the learner's version of the engines' weights before their first "
                             "update")
    parser.add_argument("--initial-weight-label", default="default",
                        help="the weight label the engines were started with (SGLang's "
                             "--weight-version; default 'default')")
    parser.add_argument("--request-timeout-s", type=float,
                        default=WorkerConfig.request_timeout_s,
                        help="a /generate call with no answer this long fails over to another "
                             "engine (a frozen engine)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="the model's vocabulary: trajectories are checked before sending")
    parser.add_argument("--routed-experts", type=_layers_top_k, default=None,
                        metavar="LAYERS,TOP_K",
                        help="routing replay: ask the engines (started with "
                             "--enable-return-routed-experts) for the experts of every token")
    parser.add_argument("--token", default=os.environ.get("SAO_STREAM_TOKEN"))
    parser.add_argument("--parent-pid", type=int, default=os.getppid(),
                        help="exit when this process dies (0: never)")
    args = parser.parse_args(argv)
    config = WorkerConfig(learner=args.learner, engines=tuple(args.engine), env=args.env,
                          concurrency=args.concurrency, temperature=args.temperature,
                          token=args.token, tokenizer=args.tokenizer,
                          chat_template=args.chat_template, max_turns=args.max_turns,
                          max_action_tokens=args.max_action_tokens,
                          max_response_tokens=args.max_response_tokens,
                          max_context_tokens=args.max_context_tokens,
                          max_env_failures_in_a_row=args.max_env_failures_in_a_row,
                          vocab_size=args.vocab_size, env_options=args.env_options,
                          initial_weight_version=args.initial_weight_version,
                          initial_weight_label=args.initial_weight_label,
                          request_timeout_s=args.request_timeout_s,
                          routed_experts=args.routed_experts)
    return config, args.parent_pid


def _layers_top_k(text: str) -> tuple[int, int]:
    try:
        layers, top_k = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give LAYERS,TOP_K, e.g. 48,8") from None
    return layers, top_k


def main(argv=None) -> None:
    config, parent_pid = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(message)s")
    if parent_pid:
        watch_parent(parent_pid)
    counts = asyncio.run(run_worker(config))
    log.info("done: %s", counts)


if __name__ == "__main__":
    main()
