"""The SWE warm start's teacher: the scripted expert (`expert.py`) on every task of a run.

`warm_start_teacher(config, train_rows, eval_rows, options)` is the teacher of the `swe`
registry entry (`envs/registry.py`, `Teacher.transcripts`; its transcripts are in the chat
template and their actions must fit the agent's): it returns the key that identifies the
transcripts in the warm start's cache and a `load()` that makes them, playing the expert in real
workspaces, which `train/warm_start.py` calls on a cache miss only. The options choose the expert
(`expert`: "patch", `expert.expert_actions`, or "edit", the one-line-edit protocol of
`expert.edit_actions`) and, for "edit", how often it makes a mistake (`expert_mistakes`: that
share of the tasks, drawn by a hash of the task's id, get one of the task's `mutation.decoys`
instead of the fix, a transcript that ends unresolved; `expert_decoy`: "random", any decoy, or
"first", always the task's first, a habit rather than noise; `expert_mistake_kinds`: the
comma-separated mutation kinds it errs on, "" for every kind), so that a warm start can leave a
policy room to learn, how it reads the file (`expert_read`: "cat", `cat -n FILE`, or "grep",
`grep -Hn '' FILE`: `expert.READS`) and how it edits (`expert_fix`: "sub", `sed -i
'Ns/OLD/NEW/'`, or "line", `sed -i 'Nc\\LINE'`: `expert.FIXES`).

With `expert_tasks = "swe_tiny"` the expert plays no rows: the training transcripts are an
endless stream of fresh swe_tiny tasks (`tiny.transcripts`: new files, names and constants
every time, never a held-out file or a held-out task's bug), rendered as the env shows them, and
the plateau is measured on more of them (another seed). A model that sees each transcript once
cannot learn the task rows by heart; the ~440 rows of experiments/data/swe_tiny could be (the
warm-started policy then copied remembered paths into held-out episodes and resolved none).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import time
from collections.abc import Callable

from sao_jax.envs.swe import expert, tiny
from sao_jax.envs.swe import options as swe_options
from sao_jax.envs.swe.env import SWEEnv
from sao_jax.envs.swe.grading import Grader
from sao_jax.envs.swe.tasks import SWETask


def warm_start_teacher(config, train_rows, eval_rows, options, *,
                       log: Callable[[str], None] | None = print
                       ) -> tuple[str, Callable[[], tuple[list, list]]]:
    """`transcripts` of an experiment's rows, options and turn limit (`config.env.max_turns`)."""
    return transcripts(train_rows, eval_rows, options, max_turns=config.env.max_turns, log=log)


def transcripts(train_rows, eval_rows, options, *, max_turns: int, compact: bool = True,
                concurrency: int = 4, log: Callable[[str], None] | None = print
                ) -> tuple[str, Callable[[], tuple[list, list]]]:
    """`(key, load)` of the expert's transcripts on every training and held-out task of an `swe`
    task's rows (`compact` replies by default: the short transcripts a CPU-sized model can
    afford), played in workspaces of the run's backend (`options`: `env.swe`).

    `load()` gives `(train, heldout)` lists of `(prompt, [(action, observation), ...])`, about a
    second per task in namespace workspaces. An expert that fails a task raises: its transcript
    would teach a failure. `key` changes with the tasks, the expert's replies
    (`expert.VERSION`), `max_turns`, `compact` and the options that shape an episode; with
    `expert_tasks = "swe_tiny"`, with the stream's tasks (`tiny.VERSION`) too.
    """
    train = [SWETask.from_row(r["task"]) for r in train_rows]
    evals = [SWETask.from_row(r["task"]) for r in eval_rows]
    env_config = swe_options.env_config(options, max_turns)
    style = dict(options or {}).get("expert", "patch")
    mistakes = float(dict(options or {}).get("expert_mistakes", 0.0))
    read = dict(options or {}).get("expert_read", "cat")
    fix = dict(options or {}).get("expert_fix", "sub")
    decoy = dict(options or {}).get("expert_decoy", "random")
    kinds = swe_options.mistake_kinds(options)
    identity = [[t.instance_id, t.base_commit, t.patch, t.test_patch, t.problem_statement]
                for t in train + evals]  # not the snapshot's path: the cache survives a move
    key = hashlib.sha256(json.dumps([identity, [expert.VERSION, max_turns, compact],
                                     {k: v for k, v in dict(options or {}).items()
                                      if k not in ("grade_concurrency",)
                                      # empty, it errs on every kind, as before the option:
                                      # the shipped warm starts' keys hold
                                      and not (k == "expert_mistake_kinds" and not v)}],
                                    sort_keys=True).encode()).hexdigest()[:16]

    if dict(options or {}).get("expert_tasks", "rows") == "swe_tiny":
        return f"{key}-tiny-{tiny.VERSION}", lambda: _tiny_stream(
            evals, env_config, mistakes, log, read, fix, decoy, kinds)

    def load():
        started = time.time()
        if log:
            log(f"warm start: the SWE expert plays {len(train)} training and {len(evals)} "
                f"held-out tasks ({env_config.workspace.backend} workspaces) ...")
        grader = Grader(env_config.workspace, max_concurrent=concurrency)
        gate = asyncio.Semaphore(concurrency)

        async def one(task):
            wrong = mistake(task, mistakes, decoy, kinds) if style == "edit" else None
            if style == "edit":
                actions = expert.edit_actions(task, line=wrong, read=read, fix=fix)
            else:
                actions = expert.expert_actions(task, compact=compact)
            async with gate:
                env = SWEEnv(task, env_config, grader)
                transcript, reward, infos = await expert.play(env, actions)
            if reward != (0.0 if wrong is not None else 1.0):
                reason = infos[-1].get("reward_reason", "") if infos else ""
                raise RuntimeError(f"the SWE expert {'solved' if wrong else 'did not solve'} "
                                   f"{task.instance_id}{' with its mistake' if wrong else ''}: "
                                   f"{reason}")
            return transcript

        async def every():
            return await asyncio.gather(*(one(t) for t in train + evals))

        try:
            made = asyncio.run(every())
        finally:
            grader.close()
        if log:
            log(f"warm start: {len(made)} expert transcripts in {time.time() - started:.0f} s")
        return made[: len(train)], made[len(train):]

    return key, load


def mistake(task: SWETask, rate: float, decoy: str = "random", kinds: tuple[str, ...] = ()
            ) -> str | None:
    """The wrong line the "edit" expert writes for `task` (one of its `mutation.decoys`: drawn,
    or the first with `decoy="first"`) on a share `rate` of the tasks whose mutation is of one
    of `kinds` (empty: any), drawn by a hash of the task's id; None: it fixes the task."""
    mutation = task.extra.get("mutation") or {}
    decoys = mutation.get("decoys") or []
    draw = int(hashlib.sha256(task.instance_id.encode()).hexdigest(), 16)
    if kinds and mutation.get("kind") not in kinds:
        return None
    if not decoys or (draw % 10_000) / 10_000 >= rate:
        return None
    return decoys[0] if decoy == "first" else decoys[(draw // 10_000) % len(decoys)]


def _tiny_stream(evals, env_config, mistakes, log, read="cat", fix="sub", decoy="random",
                 kinds: tuple[str, ...] = (), heldout: int = 256):
    """`(train, heldout)` of the swe_tiny stream: `train(seed)` endless transcripts, `heldout`
    `heldout` of them from a seed of their own; no held-out task's bug (`evals`) in either."""
    exclude = [(t.extra["mutation"]["buggy"], t.extra["mutation"]["fixed"])
               for t in evals if "mutation" in t.extra]

    def stream(seed):
        return tiny.transcripts(seed, config=env_config, mistakes=mistakes, exclude=exclude,
                                read=read, fix=fix, decoy=decoy, kinds=kinds)

    if log:
        log("warm start: the SWE expert plays endless fresh swe_tiny tasks (no workspace: "
            "rendered as the env shows them)")
    return stream, list(itertools.islice(stream(2**31 - 1), heldout))
