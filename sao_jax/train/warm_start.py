"""Supervised warm start from an environment's teacher (its registry entry's `Teacher`,
`envs/registry.py`), and a calculator evaluator.

The toy policy learns the format from teacher transcripts: cross-entropy on the action tokens only
(prompt and tool results are context, as in RL). A fraction `guess_rate` of the transcripts come
from a weak teacher that answers at once without the tool (`calculator.guess_transcript`), so the
warm-started policy imitates that mix: it is trained until its held-out loss plateaus and is still
clearly imperfect, which is the room RL has to show itself in. `evaluate_calculator` measures
held-out accuracy with the multi-turn protocol of the agent loop (actions stop at `</calc>` or
`</ans>`, tool results are appended as tokens). For style_shift the teacher writes one
well-formed sentence in a style drawn at random, so RL has to find the style in force. The result
is cached as a Hugging Face checkpoint in a directory keyed by every setting and the model's
architecture (`architecture`: not how passes compute, `LAYOUT_FIELDS`), so runs with the same
settings share it, and a new layout field leaves the built ones found.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sao_jax.envs import calculator, registry
from sao_jax.envs.registry import Transcript
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models import CausalLM, load_hf, save_hf
from sao_jax.models.config import ModelConfig
from sao_jax.models.sampling import SamplingParams, generate

# Warm starts committed with the repository, by settings hash, read when the cache has none of
# its own: experiments whose warm start takes long (chain's ~25 min on 2 cores, online_style's
# ~12) and whose runs, across sessions and machines, must all start from the same policy.
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "experiments", "data", "warm_starts")


@dataclasses.dataclass(frozen=True)
class Teacher:
    """A fixed set of transcripts a warm start imitates, and how they become tokens.

    `load()` gives `(train, heldout)` lists of transcripts, made only when the warm start is not
    cached (an SWE expert plays every task in a sandbox for them); training samples `train`
    uniformly, the plateau is measured on `heldout`, rows are as long as the longest transcript
    (rounded up to 64 tokens). `train` may instead be an endless stream, `seed -> iterator of
    transcripts` (swe_tiny's fresh tasks, `envs.swe.teacher`): training reads it in order, and
    rows fit `heldout` and 256 of the stream's transcripts (a longer one is left out). With
    `chat` (a `rollout.chat.ChatDeltas` of `tokenizer`), a transcript is encoded as the agent
    loop builds an episode: the prompt rendered as the chat's first user message, each action's
    text encoded and closed by the end-of-turn token, each observation as the template's
    delta. A transcript with an action longer than
    `max_action_tokens` (its end-of-turn token included) is refused: the agent loop would cut
    it there, so the policy would learn replies it can never finish. `key` identifies the
    transcripts in the cache key;
    `name` is the environment's (its registry entry's: `task_teacher` makes one from it).
    """

    name: str
    key: str
    tokenizer: object
    load: Callable[[], tuple[list[Transcript], list[Transcript]]]
    chat: object = None
    max_action_tokens: int | None = None  # the agent's: a longer action would be cut there


def encode_transcript(prompt: str, turns: list[tuple[str, str]], tok, chat=None
                      ) -> tuple[list, list]:
    """`(ids, action_mask)` of one SFT example.

    Without `chat`: `<bos> prompt (action observation)*`. With `chat` (`rollout.chat.ChatDeltas`):
    the chat rendering of the agent loop (`Teacher`); an empty observation after the last action
    adds nothing.
    """
    if chat is None:
        ids = [tok.bos_id] + tok.encode(prompt)
    else:
        ids = chat.prompt_ids([{"role": "user", "content": prompt}])
    mask = [False] * len(ids)
    for i, (action, observation) in enumerate(turns):
        a = tok.encode(action) + ([] if chat is None else [chat.end_of_turn_id])
        if chat is None:
            o = tok.encode(observation)
        else:
            o = chat.observation_ids(observation) if i + 1 < len(turns) else []
        ids += a + o
        mask += [True] * len(a) + [False] * len(o)
    return ids, mask


def transcript_tokens(problem: calculator.Problem, tok: CharTokenizer,
                      turns: list[tuple[str, str]] | None = None) -> tuple[list, list]:
    """A calculator problem's SFT example; `turns` defaults to the teacher's
    (`calculator.teacher_transcript`)."""
    return encode_transcript(problem.prompt, turns or calculator.teacher_transcript(problem), tok)


def teacher_transcripts(task: str, seed: int, guess_rate: float = 0.0,
                        problems: calculator.Problems = calculator.DEFAULT_PROBLEMS
                        ) -> Iterator[Transcript]:
    """Endless transcripts of the `transcripts` teacher of environment `task` (its registry
    entry's `Teacher`), e.g. calculator: the tool-using teacher on `problems`, or with
    probability `guess_rate` an answer guessed at once (`calculator.teacher_stream`)."""
    spec = registry.get(task)
    if spec.teacher is None or spec.teacher.transcripts is None:
        raise ValueError(f"no warm-start teacher of endless transcripts for task {task!r}; "
                         f"teachers: {registry.with_teacher()}.")
    return spec.teacher.transcripts(seed, guess_rate, problems)


def pack(transcripts: list[Transcript], tok, length: int, chat=None):
    """`[N, length]` ids and action mask of `transcripts`, right-padded."""
    ids = np.full((len(transcripts), length), tok.pad_id, np.int32)
    mask = np.zeros((len(transcripts), length), bool)
    for i, (prompt, turns) in enumerate(transcripts):
        x, m = encode_transcript(prompt, turns, tok, chat)
        if len(x) > length:
            raise ValueError(f"transcript of {prompt!r} has {len(x)} tokens > {length}")
        ids[i, : len(x)], mask[i, : len(m)] = x, m
    return ids, mask


def sft_batch(problems, tok: CharTokenizer, length: int, *, guess_rate: float = 0.0,
              rng: random.Random | None = None):
    """`[N, length]` ids and action mask; each transcript is a guess with prob. `guess_rate`."""
    transcripts = []
    for p in problems:
        turns = calculator.teacher_transcript(p)
        if guess_rate and rng.random() < guess_rate:
            turns = calculator.guess_transcript(p, rng)
        transcripts.append((p.prompt, turns))
    return pack(transcripts, tok, length)


def task_teacher(task, *, max_turns: int, max_action_tokens: int | None = None,
                 log: Callable[[str], None] | None = print) -> Teacher | None:
    """The `fixed` teacher of a `train.tasks.Task`'s environment on its rows (e.g. the SWE
    expert, `envs.swe.teacher`), in the task's tokenizer; None when the environment's teacher
    makes endless transcripts instead (`warm_start(task=...)` makes them). `max_action_tokens`:
    the agent's (`Teacher`).

    Its transcripts are made on a cache miss only. Raises ValueError when the environment has no
    teacher.
    """
    spec = task.spec
    if spec.teacher is None:
        raise ValueError(f"no warm-start teacher for task {task.env!r}; teachers: "
                         f"{registry.with_teacher()}.")
    if spec.teacher.fixed is None:
        return None
    from sao_jax.rollout.chat import ChatDeltas

    key, load = spec.teacher.fixed(task.train_rows, task.eval_rows, task.env_options,
                                   max_turns=max_turns, log=log)
    return Teacher(name=task.env, key=key, tokenizer=task.tokenizer, load=load,
                   chat=ChatDeltas(task.tokenizer) if spec.teacher.chat else None,
                   max_action_tokens=max_action_tokens)


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/sao_jax` (or `~/.cache/sao_jax`)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "sao_jax")


# ModelConfig fields that decide how a pass computes, not what it computes: they are not part of
# a warm start's key (the weights it trains are the same, to float rounding), so adding such a
# field, or changing one of them, finds the warm starts already built. Capacity dispatch drops
# tokens, so it is part of the key when chosen.
LAYOUT_FIELDS = ("moe_dispatch", "logprob_dispatch", "capacity_factor", "moe_token_chunk",
                 "scan_layers", "remat", "attention", "attention_block")


def architecture(cfg) -> dict:
    """What a warm start's weights depend on in `cfg`: every field but `LAYOUT_FIELDS` (with
    `moe_dispatch` and `capacity_factor` when tokens can be dropped), as JSON values."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if f.name not in LAYOUT_FIELDS}
    if cfg.moe_dispatch == "capacity":
        fields.update(moe_dispatch=cfg.moe_dispatch, capacity_factor=cfg.capacity_factor)
    return json.loads(json.dumps(fields))  # tuples as lists


def _key(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def warm_start(cfg: ModelConfig, *, task: str = registry.DEFAULT, max_steps: int = 4000,
               batch: int = 64,
               learning_rate: float = 3e-3, seed: int = 0, length: int = 64,
               guess_rate: float = 0.0, eval_every: int = 100, patience: int = 4,
               min_delta: float = 2e-3, cache_dir: str | None = None,
               log: Callable[[str], None] | None = print,
               teacher: Teacher | None = None,
               problems: calculator.Problems = calculator.DEFAULT_PROBLEMS
               ) -> tuple[CausalLM, dict]:
    """Trains a fresh `CausalLM` on teacher transcripts until the held-out loss plateaus.

    Every `eval_every` steps the loss on 512 held-out transcripts (same guess rate, problems from
    another seed) is measured; training stops once it has not improved on its best by `min_delta`
    nats per action token for `patience` evaluations in a row, or after `max_steps`. The model of
    the last step is returned (the loss has plateaued, so last and best agree to `min_delta`).

    Args:
      cfg: the model.
      task: the environment whose teacher (its registry entry's `Teacher`) writes the
        transcripts (`teacher_transcripts`); ignored with `teacher`.
      teacher: a fixed set of transcripts, with their tokenizer (`task_teacher`); rows are then
        as long as its longest transcript, not `length`.
      problems: the calculator's problem size (for its teacher and the cache key); transcripts
        longer than `length` are left out.
      cache_dir: with it, the checkpoint lives in `cache_dir/warm_start/<hash of the settings>`
        and is reused when present there or in `SHIPPED_DIR/<hash>`.
      log: progress lines go here (None: silent).

    Returns:
      `(model, info)`: info has "steps", "loss" (held-out), "seconds", "path" (the cache
      directory or None) and "cached" (whether it was reused).
    """
    if teacher is not None:
        task, length, tok, chat = teacher.name, None, teacher.tokenizer, teacher.chat
    else:
        tok, chat = CharTokenizer(), None
    spec = registry.REGISTRY.get(task)
    if spec is None or spec.teacher is None:
        raise ValueError(f"no warm-start teacher for task {task!r}; teachers: "
                         f"{registry.with_teacher()}.")
    if teacher is None and spec.teacher.transcripts is None:
        raise ValueError(f"the {task!r} teacher plays the task's rows: pass "
                         "teacher=task_teacher(task, ...).")
    settings = dict(max_steps=max_steps, batch=batch, learning_rate=learning_rate, seed=seed,
                    length=length, guess_rate=guess_rate, eval_every=eval_every,
                    patience=patience, min_delta=min_delta, config=architecture(cfg), version=3)
    if spec.teacher.names_task:
        settings["task"] = task
    settings.update(spec.teacher.settings(problems))
    if teacher is not None:
        settings["teacher"] = teacher.key
    path = None
    if cache_dir:
        key = _key(settings)
        path = os.path.join(cache_dir, "warm_start", key)
        # Where else it may be: built once and committed with the repository (SHIPPED_DIR), or
        # cached before the key held the architecture instead of repr(cfg) (version 2).
        legacy = os.path.join(cache_dir, "warm_start",
                              _key({**settings, "config": repr(cfg), "version": 2}))
        for other in (os.path.join(SHIPPED_DIR, key), legacy):
            if not os.path.exists(os.path.join(path, "info.json")) and os.path.exists(
                    os.path.join(other, "info.json")):
                path = other
        if os.path.exists(os.path.join(path, "info.json")):
            with open(os.path.join(path, "info.json")) as f:
                info = json.load(f)
            if log:
                log(f"warm start: reusing {path} ({info['steps']} steps, held-out loss "
                    f"{info['loss']:.4f})")
            model = load_hf(path, moe_dispatch=cfg.moe_dispatch,
                            logprob_dispatch=cfg.logprob_dispatch)
            return model, {**info, "path": path, "cached": True}

    model = CausalLM(cfg, nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(learning_rate, weight_decay=0.0), wrt=nnx.Param)

    def loss_fn(m, ids, mask):
        logp = jax.nn.log_softmax(m(ids[:, :-1]), axis=-1)
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(nll * mask[:, 1:]) / jnp.maximum(jnp.sum(mask[:, 1:]), 1)

    @nnx.jit
    def step(model, optimizer, ids, mask):
        loss, grads = nnx.value_and_grad(loss_fn)(model, ids, mask)
        optimizer.update(model, grads)
        return loss

    if teacher is not None:
        train_list, heldout_list = teacher.load()
        if callable(train_list):  # an endless stream: rows fit the held-out ones and a sample
            sample = heldout_list + list(itertools.islice(train_list(seed + 1), 256))
            _check_actions(sample, teacher)
            length = _row_length(sample, tok, chat)
            transcripts = (t for t in train_list(seed)
                           if len(encode_transcript(*t, tok, chat)[0]) <= length
                           and _longest_action(t, teacher) <= (teacher.max_action_tokens
                                                               or length))
        else:
            _check_actions(train_list + heldout_list, teacher)
            length = _row_length(train_list + heldout_list, tok, chat)
            rng = random.Random(seed)
            transcripts = (rng.choice(train_list) for _ in itertools.count())
        held_out = iter(heldout_list)
    else:
        def fitting(seed):
            return (t for t in teacher_transcripts(task, seed, guess_rate, problems)
                    if len(encode_transcript(*t, tok)[0]) <= length)

        held_out, transcripts = fitting(seed + 1), fitting(seed)
    eval_ids, eval_mask = pack(list(itertools.islice(held_out, 512)), tok, length, chat)
    eval_loss = nnx.jit(loss_fn)
    start, best, stale, loss, steps = time.time(), float("inf"), 0, float("nan"), 0
    for steps in range(1, max_steps + 1):
        ids, mask = pack(list(itertools.islice(transcripts, batch)), tok, length, chat)
        step(model, optimizer, jnp.asarray(ids), jnp.asarray(mask))
        if steps % eval_every == 0 or steps == max_steps:
            loss = float(eval_loss(model, jnp.asarray(eval_ids), jnp.asarray(eval_mask)))
            stale = 0 if loss < best - min_delta else stale + 1
            best = min(best, loss)
            if log:
                log(f"warm start step {steps}: held-out loss {loss:.4f} "
                    f"({time.time() - start:.0f} s)")
            if stale >= patience:
                break
    info = {"steps": steps, "loss": loss, "seconds": time.time() - start,
            "plateaued": stale >= patience}
    if path:
        tmp = f"{path}.tmp{os.getpid()}"
        save_hf(model, tmp)
        with open(os.path.join(tmp, "info.json"), "w") as f:
            json.dump({**info, "settings": settings}, f)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)  # whole or absent: a killed run never leaves half a cache
    return model, {**info, "path": path, "cached": False}


def _longest_action(transcript: Transcript, teacher: Teacher) -> int:
    """The tokens of `transcript`'s longest action, with its end-of-turn token if chat."""
    return max(len(teacher.tokenizer.encode(action)) + (teacher.chat is not None)
               for action, _ in transcript[1])


def _check_actions(transcripts, teacher: Teacher) -> None:
    if teacher.max_action_tokens is None:
        return
    for transcript in transcripts:
        longest = _longest_action(transcript, teacher)
        if longest > teacher.max_action_tokens:
            raise ValueError(
                f"the {teacher.name} teacher writes an action of {longest} tokens, more than "
                f"config.env.max_action_tokens = {teacher.max_action_tokens} (the agent would "
                f"cut it there), in the transcript of {transcript[0][:80]!r}: raise "
                "config.env.max_action_tokens.")


def _row_length(transcripts, tok, chat) -> int:
    """The longest of `transcripts` in tokens, rounded up to 64."""
    return -(-max(len(encode_transcript(p, t, tok, chat)[0]) for p, t in transcripts) // 64) * 64


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
