"""The training-inference gap at step 0: the embedded engine's log-probs against the learner's, on
identical weights, for each pair of dtypes.

    make logp-gap                                  # toy's initial policy (its warm start)
    make logp-gap EXP=chain                        # chain's warm start, shipped: no training
    make logp-gap ARGS='--fresh --config.model.preset=toy_moe'   # every layer MoE, fresh
    python benchmarks/logp_gap.py --exp chain --responses 512 --json gap.json

For the experiment `--exp` (a file of experiments/; `--config.<field>=<value>` overrides any of
its fields, as `make train` takes them):
  1. the weights: the policy its RL starts from (`build.initial_policy`: `config.model.path`,
     else its warm start, cached or shipped, trained first where there is none), or with
     `--fresh` its preset initialised with its seed; written once in float32 (`save_hf`);
  2. for each engine dtype: the embedded engine's scheduler (`engine.scheduler.Engine`, in this
     process, without HTTP) on that directory with `dtype=` it samples one action for each of
     the first `--responses` training prompts (temperature 1, the task's stop tokens,
     `env.max_action_tokens` at most);
  3. for each learner dtype: the directory loaded as the learner loads `config.model.path` with
     `config.model.dtype` set to it, in its training layout, and the log-probs of those actions
     as the learner step computes them (`Trainer.logprobs`);
  4. `rl.logp_gap` over the action tokens: the mean, p99 and max of |learner - engine| per token,
     what `policy/logp_mismatch`, `_p99` and `_max` log for a batch sampled at the learner's own
     weights (lag 0; the figures: docs/algorithm.md, "The training-inference gap").

A pair is `learner/engine`; the pairs naming one engine dtype score the same samples. At lag 0
the gap is numerics alone: one model, the same weights in one dtype, two programs (the engine's
KV-cache decode, the learner's teacher-forced pass with chunked log-probs). The engine does not
report which experts it routed a token to, so the gap is not split by routing here.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import inspect
import json
import tempfile
import time
from collections.abc import Mapping

import numpy as np
from _table import print_header
from flax import nnx

from sao_jax import lab, rl
from sao_jax.engine import Engine, RequestSpec
from sao_jax.models import CausalLM, save_hf
from sao_jax.rollout.agent import close_env
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train import build
from sao_jax.train.batch import make_batch
from sao_jax.train.tasks import make_task

PAIRS = ("float32/float32", "bfloat16/bfloat16", "float32/bfloat16")
DTYPES = ("float32", "bfloat16")


def parse_pair(text: str) -> tuple[str, str]:
    """`learner/engine`, each a name in DTYPES."""
    learner, _, engine = text.partition("/")
    if learner not in DTYPES or engine not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r}: a pair is learner/engine, each one of "
                                         f"{DTYPES}")
    return learner, engine


async def task_prompts(task, config, n: int) -> list[list[int]]:
    """The prompt ids of the first `n` training rows, as a worker renders an episode's first
    prompt."""
    if len(task.train_rows) < n:
        raise ValueError(f"--responses {n}: the task has {len(task.train_rows)} training rows.")
    prompts = []
    for row in task.train_rows[:n]:
        env = task.make_env(row, config.env.max_turns)
        try:
            text = env.reset()
            if inspect.isawaitable(text):
                text = await text
        finally:
            await close_env(env)
        prompts.append(list(task.render_prompt(text)))
    return prompts


async def sample(engine: Engine, prompts, *, max_new_tokens: int, stop_token_ids) -> list[dict]:
    """The engine's replies to `prompts`, submitted in order: one action each, at temperature
    1 (the engine's seed makes them reproducible)."""
    running = asyncio.create_task(engine.run())
    try:
        requests = [engine.submit(RequestSpec(
            prompt=tuple(p), max_new_tokens=min(max_new_tokens, engine.max_seq_len - len(p)),
            temperature=1.0, stop_token_ids=frozenset(stop_token_ids), return_logprob=True))
            for p in prompts]
        return list(await asyncio.gather(*(r.future for r in requests)))
    finally:
        running.cancel()


def trajectories(prompts, replies) -> list[Trajectory]:
    """Each reply as a one-action trajectory carrying the engine's log-probs."""
    out = []
    for i, (prompt, reply) in enumerate(zip(prompts, replies, strict=True)):
        n = len(reply["output_ids"])
        out.append(Trajectory(
            prompt_ids=prompt, response_ids=reply["output_ids"], action_mask=np.ones(n, bool),
            rollout_logprobs=[lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]],
            weight_versions=np.zeros(n, np.int32), rewards=np.zeros(n, np.float32),
            truncated=False, finish_reason=reply["meta_info"]["finish_reason"]["type"],
            prompt_id=str(i), trajectory_id=str(i)))
    return out


def engine_batch(config, path: str, dtype: str, prompts, task):
    """The learner's batch of the engine's (dtype `dtype`) actions for `prompts`."""
    engine = Engine(path, max_batch=min(len(prompts), config.rollout.engine_max_batch),
                    max_seq_len=config.rollout.engine_max_seq_len, dtype=dtype,
                    seed=config.seed)
    try:
        replies = asyncio.run(sample(engine, prompts, max_new_tokens=config.env.max_action_tokens,
                                     stop_token_ids=task.agent.stop_token_ids))
    finally:
        engine.close()
    return make_batch(trajectories(prompts, replies))


def learner_logprobs(config, path: str, dtype: str, task, batches: dict) -> dict:
    """`[B, L - 1]` log-probs of each batch of `batches` under the learner's policy loaded from
    `path` in `dtype`."""
    config = config.copy_and_resolve_references()
    config.model.path, config.model.dtype = path, dtype
    policy, _ = build.initial_policy(config, task, log=print)
    policy = build.training_layout(config, policy)
    trainer = build.make_trainer(config, policy, 1)
    params = nnx.to_pure_dict(nnx.split(policy)[1])  # as `TrainState.policy` holds them
    return {key: np.asarray(trainer.logprobs(params, batch)) for key, batch in batches.items()}


def measure(exp: str = "toy", overrides: Mapping | None = None, *, fresh: bool = False,
            responses: int = 256, pairs=PAIRS, log=print) -> list[dict]:
    """The gap of each `learner/engine` pair for `experiments/<exp>.py` with `overrides`
    (`{"model.preset": "toy_moe"}`): `{"learner", "engine", "responses", "tokens", "mean",
    "p99", "max"}` (see the module docstring)."""
    pairs = [parse_pair(p) if isinstance(p, str) else tuple(p) for p in pairs]
    config = lab.config(exp, overrides).unlock()
    task = make_task(config)
    prompts = asyncio.run(task_prompts(task, config, responses))
    with tempfile.TemporaryDirectory() as path:
        if fresh:
            policy = CausalLM(build.preset_config(config), nnx.Rngs(config.seed))
        else:
            policy, _ = build.initial_policy(config, task, log=log)
        save_hf(policy, path)
        start = time.perf_counter()
        batches = {engine: engine_batch(config, path, engine, prompts, task)
                   for engine in dict.fromkeys(e for _, e in pairs)}
        logp = {learner: learner_logprobs(config, path, learner, task, batches)
                for learner in dict.fromkeys(lr for lr, _ in pairs)}
        log(f"sampled and scored in {time.perf_counter() - start:.1f} s")
    rows = []
    for learner, engine in pairs:
        batch = batches[engine]
        gap = rl.logp_gap(logp[learner][engine], batch.rollout_logp, batch.action_mask)
        rows.append({"learner": learner, "engine": engine, "responses": responses,
                     "tokens": int(batch.action_mask.sum()),
                     **{k: float(v) for k, v in gap._asdict().items()}})
    return rows


def config_overrides(args: list[str]) -> dict:
    """`--config.<field>=<value>` arguments as `{field: value}`, each value a Python literal
    where it parses as one (`1`, `True`, `0.5`), else the string."""
    overrides = {}
    for arg in args:
        field, eq, text = arg.removeprefix("--config.").partition("=")
        if not arg.startswith("--config.") or not eq:
            raise SystemExit(f"unknown argument {arg!r}: overrides are --config.<field>=<value>")
        try:
            overrides[field] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            overrides[field] = text
    return overrides


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="--config.<field>=<value> overrides any field of "
                                            "the experiment (e.g. --config.model.preset=toy_moe)")
    parser.add_argument("--exp", default="toy", help="an experiment of experiments/")
    parser.add_argument("--fresh", action="store_true",
                        help="the preset freshly initialised with the experiment's seed, not "
                             "the policy its RL starts from")
    parser.add_argument("--responses", type=int, default=256)
    parser.add_argument("--pairs", nargs="+", type=parse_pair, default=list(PAIRS),
                        help="learner/engine dtype pairs")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args, rest = parser.parse_known_args(argv)
    overrides = config_overrides(rest)
    rows = measure(args.exp, overrides, fresh=args.fresh, responses=args.responses,
                   pairs=args.pairs)
    settings = "".join(f", {k}={v}" for k, v in overrides.items())
    print(f"experiment {args.exp}{settings}, "
          f"{'fresh weights' if args.fresh else 'its initial policy'}")
    print_header(f"{'learner':>9} {'engine':>9} {'responses':>9} {'tokens':>7} "
                 f"{'mean':>10} {'p99':>10} {'max':>10}")
    for r in rows:
        print(f"{r['learner']:>9} {r['engine']:>9} {r['responses']:>9} {r['tokens']:>7} "
              f"{r['mean']:>10.3g} {r['p99']:>10.3g} {r['max']:>10.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
