"""The training-inference gap at step 0: the engine's log-probs against the learner's, on
identical weights, for each pair of dtypes, the embedded engine's or SGLang's.

    make logp-gap                                  # toy's initial policy (its warm start)
    make logp-gap EXP=chain                        # chain's warm start, shipped: no training
    make logp-gap ARGS='--fresh --config.model.preset=toy_moe'   # every layer MoE, fresh
    make logp-gap ARGS='--pairs bfloat16/sglang-bfloat16 float32/sglang-float32'  # SGLang
    python benchmarks/logp_gap.py --exp chain --responses 512 --json gap.json

For the experiment `--exp` (a file of experiments/; `--config.<field>=<value>` overrides any of
its fields, as `make train` takes them):
  1. the weights: the policy its RL starts from (`build.initial_policy`: `config.model.path`,
     else its warm start, cached or shipped, trained first where there is none), or with
     `--fresh` its preset initialised with its seed; written once in float32 (`save_hf`);
  2. for each engine dtype: the embedded engine's scheduler (`engine.scheduler.Engine`, in this
     process, without HTTP) on that directory with `dtype=` it samples one action for each of
     the first `--responses` training prompts (temperature 1, the task's stop tokens,
     `env.max_action_tokens` at most); an engine `sglang-<dtype>` is a real SGLang 0.5.23
     server (its virtualenv made on first use, as `make sglang`) started on this host's CPU
     with `--dtype <dtype>`, sent the same prompts in one request over HTTP (without routes:
     SGLang 0.5.23 keeps them in CUDA-registered host memory, which a CPU-only host has not,
     so steps 5 and 6 are the embedded engine's only);
  3. for each learner dtype: the directory loaded as the learner loads `config.model.path` with
     `config.model.dtype` set to it, in its training layout, and the log-probs of those actions
     as the learner step computes them (`Trainer.logprobs`);
  4. `rl.logp_gap` over the action tokens: the mean, p99 and max of |learner - engine| per token,
     what `policy/logp_mismatch`, `_p99` and `_max` log for a batch sampled at the learner's own
     weights (lag 0; the figures: docs/algorithm.md, "The training-inference gap").

A pair is `learner/engine`; the pairs naming one engine dtype score the same samples. At lag 0
the gap is numerics alone: one model, the same weights in one dtype, two programs (the engine's
KV-cache decode, the learner's teacher-forced pass with chunked log-probs).

For a model with experts the engine also reports where it routed every token (as SGLang's
`return_routed_experts`; the embedded engine with `routed_experts=True`), and each pair gets:
  5. `routed_same`: the share of action tokens the learner, in its own forward pass, routed to
     the engine's experts at every layer (top-A sets equal), and the mean gap over those
     (`mean_same`) and over the others (`mean_different`; NaN where there are none):
     `rl.routing_split` of `models.route_agreement`, as the learner logs it every step
     (`policy/routed_same`);
  6. routing replay: the learner's log-probs with the engine's experts replayed at every layer
     (`CausalLM(..., replay_BxTxLxA=)`; docs/models.md, "Routing replay"), and their gap
     (`replay_mean`, `replay_p99`, `replay_max`).
Steps 5 and 6 run the model directly (one pass each, in the learner's layout and dtype), not
the learner step; without replay their log-probs are those of step 3 to float rounding.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import inspect
import json
import os
import tempfile
import time
import urllib.request
from collections.abc import Mapping

import numpy as np
from _table import print_header
from flax import nnx

from sao_jax import lab, rl
from sao_jax.engine import Engine, RequestSpec, routed_experts, sglang_server
from sao_jax.models import CausalLM, route_agreement, save_hf, token_logprobs
from sao_jax.rollout.agent import close_env
from sao_jax.rollout.trajectory import Trajectory
from sao_jax.train import build
from sao_jax.train.batch import make_batch
from sao_jax.train.processes import ChildExited, Children, Command, free_ports
from sao_jax.train.tasks import make_task

PAIRS = ("float32/float32", "bfloat16/bfloat16", "float32/bfloat16")
DTYPES = ("float32", "bfloat16")
SGLANG = "sglang-"  # an engine named sglang-<dtype>: a real SGLang server (make sglang)
ENGINES = DTYPES + tuple(SGLANG + d for d in DTYPES)


def parse_pair(text: str) -> tuple[str, str]:
    """`learner/engine`: the learner's dtype, one of DTYPES, and the engine's, one of
    ENGINES (the embedded engine in that dtype, or with `sglang-` SGLang)."""
    learner, _, engine = text.partition("/")
    if learner not in DTYPES or engine not in ENGINES:
        raise argparse.ArgumentTypeError(f"{text!r}: a pair is learner/engine, the learner one "
                                         f"of {DTYPES}, the engine one of {ENGINES}")
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


async def sample(engine: Engine, prompts, *, max_new_tokens: int, stop_token_ids,
                 routes: bool = False) -> list[dict]:
    """The engine's replies to `prompts`, submitted in order: one action each, at temperature
    1 (the engine's seed makes them reproducible); with `routes`, each with the experts of
    every token it ran (`meta_info["routed_experts"]`)."""
    running = asyncio.create_task(engine.run())
    try:
        requests = [engine.submit(RequestSpec(
            prompt=tuple(p), max_new_tokens=min(max_new_tokens, engine.max_seq_len - len(p)),
            temperature=1.0, stop_token_ids=frozenset(stop_token_ids), return_logprob=True,
            return_routed_experts=routes))
            for p in prompts]
        return list(await asyncio.gather(*(r.future for r in requests)))
    finally:
        running.cancel()


def trajectories(prompts, replies, experts=None) -> list[Trajectory]:
    """Each reply as a one-action trajectory carrying the engine's log-probs and, for a model
    with `experts = (layers, top_k)`, its `routed_experts` (-1 for the last token, never run)."""
    out = []
    for i, (prompt, reply) in enumerate(zip(prompts, replies, strict=True)):
        n = len(reply["output_ids"])
        routes = np.zeros((0, 0, 0), np.int16)
        if experts is not None:
            ran = routed_experts(reply["meta_info"]).reshape(-1, *experts)
            routes = np.concatenate([ran, np.full((1, *experts), -1, ran.dtype)])
        out.append(Trajectory(routed_experts=routes,
            prompt_ids=prompt, response_ids=reply["output_ids"], action_mask=np.ones(n, bool),
            rollout_logprobs=[lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]],
            weight_versions=np.zeros(n, np.int32), rewards=np.zeros(n, np.float32),
            truncated=False, finish_reason=reply["meta_info"]["finish_reason"]["type"],
            prompt_id=str(i), trajectory_id=str(i)))
    return out


def sglang_sample(config, path: str, dtype: str, prompts, *, stop_token_ids) -> list[dict]:
    """`sample`'s replies from a real SGLang server (its virtualenv made on first use, `make
    sglang`) serving `path` in `dtype` on this host's CPU, started as a run starts its
    engines and stopped after: one request of every prompt, each with its own budget."""
    rollout = config.rollout
    with open(os.path.join(path, "config.json")) as f:
        sglang_server.check_servable(json.load(f))  # e.g. the toy's dense first layer: refused
    python = sglang_server.ensure_venv(log=print)  # its interpreter
    with tempfile.TemporaryDirectory() as workdir:
        children = Children(workdir)
        (port,) = free_ports(1)
        command = Command(tuple(sglang_server.server_argv(
            path, port=port, weight_version=0, dtype=dtype, seed=config.seed,
            max_running_requests=min(len(prompts), rollout.engine_max_batch),
            context_length=rollout.engine_max_seq_len)),
            python=python, env=sglang_server.server_env("cpu"))
        try:
            try:
                (url,) = children.start_servers(["sglang"], [command], timeout_s=600)
            except ChildExited as e:  # its log goes with the folder: say what it said
                with open(os.path.join(children.log_dir, "sglang.log")) as log:
                    raise ChildExited(f"{e}:\n{log.read()[-3000:]}") from None
            body = {"input_ids": [list(p) for p in prompts], "return_logprob": True,
                    "sampling_params": [{
                        "temperature": 1.0, "stop_token_ids": sorted(stop_token_ids),
                        "max_new_tokens": min(config.env.max_action_tokens,
                                              rollout.engine_max_seq_len - len(p))}
                        for p in prompts]}
            request = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=1800) as reply:
                return json.loads(reply.read())
        finally:
            children.stop()


def engine_batch(config, path: str, engine: str, prompts, task, experts=None):
    """`(batch, routes)`: the learner's batch of the engine's actions for `prompts` (`engine`
    one of ENGINES) and, for a model with `experts = (layers, top_k)`, the engine's experts of
    each of the batch's model positions (`[B, L - 1, layers, top_k]`, -1 past a row's; else
    None)."""
    routes, stops = experts is not None, task.agent.stop_token_ids
    if engine.startswith(SGLANG):  # its routes need CUDA: see the module docstring
        replies = sglang_sample(config, path, engine.removeprefix(SGLANG), prompts,
                                stop_token_ids=stops)
        experts = None
    else:
        embedded = Engine(path, max_batch=min(len(prompts), config.rollout.engine_max_batch),
                          max_seq_len=config.rollout.engine_max_seq_len, dtype=engine,
                          seed=config.seed, routed_experts=routes)
        try:
            replies = asyncio.run(sample(embedded, prompts,
                                         max_new_tokens=config.env.max_action_tokens,
                                         stop_token_ids=stops, routes=routes))
        finally:
            embedded.close()
    batch = make_batch(trajectories(prompts, replies, experts), routes=experts)
    # the learner's own routing for step 3: the routes go to the split and replay only
    return batch._replace(routes=None), None if experts is None else batch.routes[:, :-1]


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


def routing_split(config, path: str, dtype: str, task, batch, engine_routes) -> dict:
    """Steps 5 and 6 of the module docstring for the learner in `dtype` on one engine's
    `batch` and its `engine_routes` (`engine_batch`)."""
    config = config.copy_and_resolve_references()
    config.model.path, config.model.dtype = path, dtype
    policy, _ = build.initial_policy(config, task, log=None)  # the master weights: cast them
    policy = build.training_layout(config, build.in_dtype(policy, dtype))
    ids, targets = batch.tokens[:, :-1], batch.tokens[:, 1:]

    @nnx.jit
    def passes(model, ids, targets, replay, engine):
        out = model.backbone(ids, dispatch=model.cfg.logprob_dispatch, replay_BxTxLxA=replay)
        logp = token_logprobs(out.hidden_BxTxD, model.head_weight(), targets)
        return logp, route_agreement(model.cfg, out.router_logits, engine)

    own_logp, same = passes(policy, ids, targets, None, engine_routes)
    replay_logp, _ = passes(policy, ids, targets, engine_routes, engine_routes)
    split = rl.routing_split(own_logp, batch.rollout_logp, batch.action_mask, same)
    replay = rl.logp_gap(replay_logp, batch.rollout_logp, batch.action_mask)
    return {"routed_same": float(split.same_frac), "mean_same": float(split.mean_same),
            "mean_different": float(split.mean_different),
            "replay_mean": float(replay.mean), "replay_p99": float(replay.p99),
            "replay_max": float(replay.max)}


def measure(exp: str = "toy", overrides: Mapping | None = None, *, fresh: bool = False,
            responses: int = 256, pairs=PAIRS, log=print) -> list[dict]:
    """The gap of each `learner/engine` pair for `experiments/<exp>.py` with `overrides`
    (`{"model.preset": "toy_moe"}`): `{"learner", "engine", "responses", "tokens", "mean",
    "p99", "max"}`, and for a model with experts the routing split's keys (`routing_split`;
    see the module docstring)."""
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
        cfg = policy.cfg
        experts = (cfg.num_layers, cfg.num_experts_per_tok) if cfg.num_experts else None
        start = time.perf_counter()
        sampled = {engine: engine_batch(config, path, engine, prompts, task, experts)
                   for engine in dict.fromkeys(e for _, e in pairs)}
        batches = {engine: batch for engine, (batch, _) in sampled.items()}
        logp = {learner: learner_logprobs(config, path, learner, task, batches)
                for learner in dict.fromkeys(lr for lr, _ in pairs)}
        split = {(learner, engine): routing_split(config, path, learner, task,
                                                  *sampled[engine])
                 for learner, engine in pairs if sampled[engine][1] is not None}
        log(f"sampled and scored in {time.perf_counter() - start:.1f} s")
    rows = []
    for learner, engine in pairs:
        batch = batches[engine]
        gap = rl.logp_gap(logp[learner][engine], batch.rollout_logp, batch.action_mask)
        rows.append({"learner": learner, "engine": engine, "responses": responses,
                     "tokens": int(batch.action_mask.sum()),
                     **{k: float(v) for k, v in gap._asdict().items()},
                     **split.get((learner, engine), {})})
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
                        help="learner/engine pairs: the learner's dtype, the engine's (the "
                             "embedded engine) or sglang-<dtype> (SGLang, made on first use)")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args, rest = parser.parse_known_args(argv)
    overrides = config_overrides(rest)
    rows = measure(args.exp, overrides, fresh=args.fresh, responses=args.responses,
                   pairs=args.pairs)
    settings = "".join(f", {k}={v}" for k, v in overrides.items())
    print(f"experiment {args.exp}{settings}, "
          f"{'fresh weights' if args.fresh else 'its initial policy'}")
    print_header(f"{'learner':>9} {'engine':>15} {'responses':>9} {'tokens':>7} "
                 f"{'mean':>10} {'p99':>10} {'max':>10}")
    for r in rows:
        print(f"{r['learner']:>9} {r['engine']:>15} {r['responses']:>9} {r['tokens']:>7} "
              f"{r['mean']:>10.3g} {r['p99']:>10.3g} {r['max']:>10.3g}")
    routed = [r for r in rows if "routed_same" in r]
    if routed:
        print("\nby routing (same: the learner chose the engine's experts at every layer) and "
              "with the engine's experts replayed")
        print_header(f"{'learner':>9} {'engine':>15} {'same':>7} {'mean same':>10} "
                     f"{'mean diff':>10} {'replay mean':>12} {'replay p99':>11} "
                     f"{'replay max':>11}")
        for r in routed:
            print(f"{r['learner']:>9} {r['engine']:>15} {r['routed_same']:>7.3f} "
                  f"{r['mean_same']:>10.3g} {r['mean_different']:>10.3g} "
                  f"{r['replay_mean']:>12.3g} {r['replay_p99']:>11.3g} {r['replay_max']:>11.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
