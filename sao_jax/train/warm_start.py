"""Supervised warm start on an environment's teacher transcripts, cached by what changes its
weights.

A policy learns the task's format from a teacher (`Teacher`, made from the environment's registry
entry by `task_teacher`, `envs/registry.py`): cross-entropy on the action tokens only (prompt and
observations are context, as in RL), on rows encoded as the agent loop builds an episode
(`encode_transcript`), until the held-out loss plateaus (`warm_start`). The teacher decides what
the transcripts are and everything task-specific about them (how long the rows are, whether they
are in the chat template, whether their actions must fit the agent's); this module knows no
environment. A teacher that is imperfect on purpose leaves the warm-started policy room for RL
to show itself in.

The result is cached as a Hugging Face checkpoint under `<cache_dir>/warm_start/<key>`, or found
in `SHIPPED_DIR/<key>` (committed with the repository), where `<key>` hashes `cache_key`: the
explicit list of what the weights depend on, the transcripts as token ids, the model's
architecture and the training recipe. A setting outside it (how passes compute:
`LAYOUT_FIELDS`) finds the warm starts built already; a setting in it builds a new one.
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

from sao_jax.envs import registry
from sao_jax.envs.registry import Transcript
from sao_jax.models import CausalLM, load_hf, save_hf
from sao_jax.models.config import ModelConfig
from sao_jax.text import ChatDeltas, prompt_renderer

# Warm starts committed with the repository, by cache key, read when the cache has none of its
# own: of experiments whose warm start takes long (tens of minutes on 2 cores) and whose runs,
# across sessions and machines, must all start from the same policy.
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "experiments", "data", "warm_starts")

# A teacher's transcripts: a list, or an endless stream of them from a seed.
Transcripts = list[Transcript] | Callable[[int], Iterator[Transcript]]


@dataclasses.dataclass(frozen=True)
class Teacher:
    """The transcripts one warm start imitates, and how they become tokens.

    `task_teacher` makes one from an environment's registry entry (`registry.Teacher`, whose
    docstring says what each field means to an environment). `load()` gives `(train, heldout)`,
    each a list of transcripts or an endless stream (`seed -> iterator`), made only when the warm
    start is not cached (a teacher may play every task in a workspace for them). Training
    samples a list uniformly and reads a stream in order from the warm start's seed; the plateau
    is measured on at most `Recipe.held_out` held-out transcripts (a stream's from seed + 1).
    Rows are `length` tokens, or as long as the longest transcript of the lists and
    `Recipe.sample` of each stream's (from seed + 1), rounded up to 64; a stream's transcripts
    that do not fit are left out. With `chat` (a `text.ChatDeltas` of `tokenizer`) a transcript
    is encoded as the agent loop builds an episode in the chat template; without, as
    `bos prompt (action observation)*`.
    With `max_action_tokens` (the agent's), a transcript with a longer action (its end-of-turn
    token included) is refused, in the lists and the sample, naming the setting to raise, and
    left out of a stream: the agent loop would cut it, so the policy would learn replies it can
    never finish.

    Args:
      name: the environment's (in the cache key and in messages).
      key: JSON values that identify the transcripts (the environment's teacher gives it).
    """

    name: str
    key: object
    tokenizer: object
    load: Callable[[], tuple[Transcripts, Transcripts]]
    length: int | None = None
    chat: ChatDeltas | None = None
    max_action_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a warm start trains (`config.warm_start`); every field is in its cache key."""

    seed: int = 0  # the model's initialisation and the order of the transcripts
    max_steps: int = 4000  # training stops here if the loss has not plateaued before
    batch: int = 64  # transcripts per step
    learning_rate: float = 3e-3  # AdamW, no weight decay
    eval_every: int = 100  # steps between held-out losses: where the plateau can be seen
    patience: int = 4  # evaluations in a row without an improvement of min_delta: a plateau
    min_delta: float = 2e-3  # nats per action token
    held_out: int = 512  # held-out transcripts (at most) the plateau is measured on
    sample: int = 256  # a stream's transcripts that size the rows and check the actions

    def __post_init__(self):
        for name in ("max_steps", "batch", "eval_every", "patience", "held_out", "sample"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.warm_start.{name} must be at least 1, got "
                                 f"{getattr(self, name)}.")


def task_teacher(task, config, *, log: Callable[[str], None] | None = print) -> Teacher:
    """The warm-start teacher of a `train.tasks.Task` in experiment `config`: its environment's
    (`task.spec.teacher`, a `registry.Teacher`) on the task's rows and options, in the task's
    tokenizer. Its transcripts are made on a cache miss only. Raises ValueError when the
    environment has no teacher."""
    spec = task.spec.teacher
    if spec is None:
        raise ValueError(f"no warm-start teacher for task {task.env!r}; teachers: "
                         f"{registry.with_teacher()}.")
    key, load = spec.transcripts(config, task.train_rows, task.eval_rows, task.env_options,
                                 log=log)
    return Teacher(name=task.env, key=key, tokenizer=task.tokenizer, load=load,
                   length=spec.length(config),
                   chat=ChatDeltas(task.tokenizer) if spec.chat else None,
                   max_action_tokens=config.env.max_action_tokens if spec.fit_actions else None)


def encode_transcript(prompt: str, turns: list[tuple[str, str]], tok, chat=None
                      ) -> tuple[list, list]:
    """`(ids, action_mask)` of one SFT example, as the agent loop builds the episode.

    Without `chat`: `<bos> prompt (action observation)*` (no bos if the tokenizer has none).
    With `chat` (`text.ChatDeltas`): the prompt rendered as the chat's first user message, each
    action's text encoded and closed by the end-of-turn token, each observation as the
    template's delta; an empty observation after the last action adds nothing.
    """
    ids = prompt_renderer(tok, chat_template=chat is not None)(prompt)
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


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/sao_jax` (or `~/.cache/sao_jax`)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "sao_jax")


# ModelConfig fields that shape the model or decide what a pass computes: the warm start's key
# holds them (`architecture`). Every field is here or in LAYOUT_FIELDS (tests/train/
# test_warm_start.py checks), so that a new field is put on one side on purpose.
ARCHITECTURE_FIELDS = (
    # the shapes of the weights
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "decoder_sparse_step", "mlp_only_layers", "tie_word_embeddings",
    # what a pass computes with them
    "norm_topk_prob", "rms_norm_eps", "rope_theta", "max_position_embeddings", "param_dtype",
    # what the loss adds to the training
    "router_aux_loss_coef",
)
# ModelConfig fields that decide how a pass computes, not what: the weights a warm start trains
# are the same under any of them (to float rounding), so they are not in its key and a change
# finds the warm starts built already. Except that capacity dispatch drops tokens: with it,
# `capacity_factor` is in the key (`architecture`).
LAYOUT_FIELDS = ("moe_dispatch", "logprob_dispatch", "capacity_factor", "moe_token_chunk",
                 "scan_layers", "remat", "attention", "attention_block")


def architecture(cfg: ModelConfig) -> dict:
    """The model in a warm start's key: `ARCHITECTURE_FIELDS`, and `capacity_factor`, the share
    of tokens each expert takes, under capacity dispatch (None: no token is dropped), as JSON
    values."""
    fields = {name: getattr(cfg, name) for name in ARCHITECTURE_FIELDS}
    fields["capacity_factor"] = cfg.capacity_factor if cfg.moe_dispatch == "capacity" else None
    return json.loads(json.dumps(fields))  # tuples as lists


def cache_key(cfg: ModelConfig, teacher: Teacher, recipe: Recipe) -> dict:
    """Everything a warm start's weights depend on, field by field (its cache directory is
    `key_hash` of it, and info.json records it as "settings")."""
    return {
        # The transcripts, as the token ids trained on:
        "teacher": teacher.name,  # whose transcripts
        "transcripts": teacher.key,  # which ones: what of the experiment changes them
        "tokenizer": teacher.tokenizer.digest,  # their ids (vocabulary, merges, chat template)
        "chat": teacher.chat is not None,  # rendered in the chat template, or as plain text
        "length": teacher.length,  # the rows: a stream's longer transcripts are left out
        "max_action_tokens": teacher.max_action_tokens,  # so are those with a longer action
        # The model:
        "model": architecture(cfg),
        # The training (`Recipe`):
        "seed": recipe.seed,
        "max_steps": recipe.max_steps,
        "batch": recipe.batch,
        "learning_rate": recipe.learning_rate,
        "eval_every": recipe.eval_every,
        "patience": recipe.patience,
        "min_delta": recipe.min_delta,
        "held_out": recipe.held_out,
        "sample": recipe.sample,
    }


def key_hash(key: dict) -> str:
    """The directory name of a warm start with `cache_key` `key`."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def warm_start(cfg: ModelConfig, teacher: Teacher, recipe: Recipe, *,
               cache_dir: str | None = None, log: Callable[[str], None] | None = print
               ) -> tuple[CausalLM, dict]:
    """Trains a fresh `CausalLM` on `teacher`'s transcripts until the held-out loss plateaus.

    Every `recipe.eval_every` steps the loss on the held-out transcripts is measured; training
    stops once it has not improved on its best by `recipe.min_delta` nats per action token for
    `recipe.patience` evaluations in a row, or after `recipe.max_steps`. The model of the last
    step is returned (the loss has plateaued, so last and best agree to `min_delta`).

    Args:
      cfg: the model.
      teacher: the transcripts and their tokenizer (`task_teacher`).
      recipe: how it trains (`Recipe()`: the defaults).
      cache_dir: with it, the checkpoint lives in `cache_dir/warm_start/<key_hash>` and is
        reused when present there or in `SHIPPED_DIR/<key_hash>`.
      log: progress lines go here (None: silent).

    Returns:
      `(model, info)`: info has "steps", "loss" (held-out), "seconds", "plateaued", "path" (the
      cache directory or None), "cached" (whether it was reused) and, when read from the cache,
      "settings" (the `cache_key` it was built with).
    """
    settings = cache_key(cfg, teacher, recipe)
    path = None
    if cache_dir:
        key = key_hash(settings)
        path = os.path.join(cache_dir, "warm_start", key)
        shipped = os.path.join(SHIPPED_DIR, key)
        if not os.path.exists(os.path.join(path, "info.json")) and os.path.exists(
                os.path.join(shipped, "info.json")):
            path = shipped
        if os.path.exists(os.path.join(path, "info.json")):
            with open(os.path.join(path, "info.json")) as f:
                info = json.load(f)
            if log:
                log(f"warm start: reusing {path} ({info['steps']} steps, held-out loss "
                    f"{info['loss']:.4f})")
            model = load_hf(path, moe_dispatch=cfg.moe_dispatch,
                            logprob_dispatch=cfg.logprob_dispatch)
            return model, {**info, "path": path, "cached": True}

    model = CausalLM(cfg, nnx.Rngs(recipe.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(recipe.learning_rate, weight_decay=0.0),
                              wrt=nnx.Param)

    def loss_fn(m, ids, mask):
        logp = jax.nn.log_softmax(m(ids[:, :-1]), axis=-1)
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(nll * mask[:, 1:]) / jnp.maximum(jnp.sum(mask[:, 1:]), 1)

    @nnx.jit
    def step(model, optimizer, ids, mask):
        loss, grads = nnx.value_and_grad(loss_fn)(model, ids, mask)
        optimizer.update(model, grads)
        return loss

    tok, chat = teacher.tokenizer, teacher.chat
    length, transcripts, held_out = _rows(teacher, recipe.seed, recipe.sample)
    eval_ids, eval_mask = pack(list(itertools.islice(held_out, recipe.held_out)), tok, length,
                               chat)
    eval_loss = nnx.jit(loss_fn)
    start, best, stale, loss, steps = time.time(), float("inf"), 0, float("nan"), 0
    for steps in range(1, recipe.max_steps + 1):
        ids, mask = pack(list(itertools.islice(transcripts, recipe.batch)), tok, length, chat)
        step(model, optimizer, jnp.asarray(ids), jnp.asarray(mask))
        if steps % recipe.eval_every == 0 or steps == recipe.max_steps:
            loss = float(eval_loss(model, jnp.asarray(eval_ids), jnp.asarray(eval_mask)))
            stale = 0 if loss < best - recipe.min_delta else stale + 1
            best = min(best, loss)
            if log:
                log(f"warm start step {steps}: held-out loss {loss:.4f} "
                    f"({time.time() - start:.0f} s)")
            if stale >= recipe.patience:
                break
    info = {"steps": steps, "loss": loss, "seconds": time.time() - start,
            "plateaued": stale >= recipe.patience}
    if path:
        tmp = f"{path}.tmp{os.getpid()}"
        save_hf(model, tmp)
        with open(os.path.join(tmp, "info.json"), "w") as f:
            json.dump({**info, "settings": settings}, f)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)  # whole or absent: a killed run never leaves half a cache
    return model, {**info, "path": path, "cached": False}


def _rows(teacher: Teacher, seed: int, sample: int
          ) -> tuple[int, Iterator[Transcript], Iterator[Transcript]]:
    """`(length, training transcripts, held-out transcripts)` of a warm start (`Teacher`), its
    length from `sample` transcripts of each stream."""
    train, heldout = teacher.load()
    some = None
    if teacher.length is None or teacher.max_action_tokens is not None:
        some = [*_some(heldout, seed + 1, sample), *_some(train, seed + 1, sample)]
        _check_actions(some, teacher)
    length = teacher.length or _row_length(some, teacher.tokenizer, teacher.chat)

    def fits(transcript: Transcript) -> bool:
        return (len(encode_transcript(*transcript, teacher.tokenizer, teacher.chat)[0]) <= length
                and _longest_action(transcript, teacher) <= (teacher.max_action_tokens or length))

    if isinstance(train, list):
        rng = random.Random(seed)
        transcripts = (rng.choice(train) for _ in itertools.count())
    else:
        transcripts = (t for t in train(seed) if fits(t))
    held_out = iter(heldout) if isinstance(heldout, list) else (
        t for t in heldout(seed + 1) if fits(t))
    return length, transcripts, held_out


def _some(transcripts: Transcripts, seed: int, count: int) -> list[Transcript]:
    """A list's transcripts, or `count` of a stream's from `seed`."""
    if isinstance(transcripts, list):
        return transcripts
    return list(itertools.islice(transcripts(seed), count))


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
