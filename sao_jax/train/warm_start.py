"""Supervised warm start for the calculator task, and a batched in-process evaluator.

The toy policy learns the format from teacher transcripts (`envs.calculator.teacher_transcript`):
cross-entropy on the action tokens only (prompt and tool results are context, as in RL). A short
warm start leaves it clearly imperfect; `evaluate_calculator` measures held-out accuracy with the
same multi-turn protocol the agent loop uses (actions stop at `</calc>` or `</ans>`, tool results
are appended as tokens). The result is cached under the run directory as a Hugging Face checkpoint.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sao_jax.envs import calculator
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import CausalLM, load_hf, save_hf
from sao_jax.models.config import ModelConfig
from sao_jax.models.sampling import SamplingParams, generate


def transcript_tokens(problem: calculator.Problem, tok: CharTokenizer) -> tuple[list, list]:
    """`(ids, action_mask)` of `<bos> prompt (action observation)*`: the SFT example."""
    ids, mask = [tok.bos_id] + tok.encode(problem.prompt), []
    mask = [False] * len(ids)
    for action, observation in calculator.teacher_transcript(problem):
        a, o = tok.encode(action), tok.encode(observation)
        ids += a + o
        mask += [True] * len(a) + [False] * len(o)
    return ids, mask


def sft_batch(problems, tok: CharTokenizer, length: int):
    ids = np.full((len(problems), length), tok.pad_id, np.int32)
    mask = np.zeros((len(problems), length), bool)
    for i, p in enumerate(problems):
        x, m = transcript_tokens(p, tok)
        if len(x) > length:
            raise ValueError(f"transcript of {p.expression!r} has {len(x)} tokens > {length}")
        ids[i, : len(x)], mask[i, : len(m)] = x, m
    return ids, mask


def warm_start(cfg: ModelConfig, *, steps: int, batch: int = 64, learning_rate: float = 3e-3,
               seed: int = 0, length: int = 64, workdir: str | None = None,
               log_every: int = 50) -> CausalLM:
    """Trains a fresh `CausalLM` on teacher transcripts; reuses `workdir/warm_start` if present."""
    tok = CharTokenizer()
    settings = dict(steps=steps, batch=batch, learning_rate=learning_rate, seed=seed,
                    length=length, config=repr(cfg))
    cache = os.path.join(workdir, "warm_start") if workdir else None
    if cache and os.path.exists(os.path.join(cache, "settings.json")):
        with open(os.path.join(cache, "settings.json")) as f:
            if json.load(f) == settings:
                return load_hf(cache, moe_dispatch=cfg.moe_dispatch,
                               logprob_dispatch=cfg.logprob_dispatch)
    model = CausalLM(cfg, nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(learning_rate, weight_decay=0.0), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, ids, mask):
        def loss_fn(m):
            logp = jax.nn.log_softmax(m(ids[:, :-1]), axis=-1)
            nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
            return jnp.sum(nll * mask[:, 1:]) / jnp.maximum(jnp.sum(mask[:, 1:]), 1)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    stream = calculator.problem_stream(seed)
    start = time.time()
    for i in range(steps):
        ids, mask = sft_batch([next(stream) for _ in range(batch)], tok, length)
        loss = step(model, optimizer, jnp.asarray(ids), jnp.asarray(mask))
        if log_every and (i + 1) % log_every == 0:
            print(f"warm start {i + 1}/{steps}: loss {float(loss):.3f} "
                  f"({time.time() - start:.0f} s)", flush=True)
    if cache:
        save_hf(model, cache)
        with open(os.path.join(cache, "settings.json"), "w") as f:
            json.dump(settings, f)
    return model


def evaluate_calculator(model: CausalLM, problems, *, temperature: float = 0.0, seed: int = 0,
                        max_turns: int = 6, max_action_tokens: int = 16,
                        context: int = 96) -> float:
    """Fraction of `problems` answered correctly, all episodes stepped together turn by turn."""
    tok = CharTokenizer()
    envs = [calculator.CalculatorEnv(p, max_turns=max_turns) for p in problems]
    histories = [[tok.bos_id] + tok.encode(env.reset()) for env in envs]
    rewards = np.zeros(len(envs))
    live = list(range(len(envs)))
    params = SamplingParams(max_new_tokens=max_action_tokens, temperature=temperature,
                            stop_token_ids=calculator.stop_token_ids(tok))
    key = jax.random.key(seed)
    while live:
        prompts = np.full((len(envs), context), tok.pad_id, np.int32)  # one shape, one compile
        lengths = np.ones(len(envs), np.int32)
        for i in live:
            prompts[i, : len(histories[i])] = histories[i]
            lengths[i] = len(histories[i])
        key, sub = jax.random.split(key)
        out = generate(model, prompts, lengths, params, sub, pad_id=tok.pad_id)
        tokens, counts = np.asarray(out.tokens_BxL), np.asarray(out.lengths_B)
        still = []
        for i in live:
            action = list(tokens[i, : counts[i]])
            result = envs[i].step(tok.decode(action))
            histories[i] += action + tok.encode(result.observation)
            rewards[i] = result.reward
            if not result.done and len(histories[i]) + max_action_tokens < context:
                still.append(i)
        live = still
    return float(rewards.mean())
