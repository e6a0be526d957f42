"""The environment registry is the only list of environments.

A toy environment added in the test itself, with one registry entry and nothing else, runs through
the task (`train.tasks.make_task`), the agent loop, the worker's config and command line, the
warm start's teacher and the learner's batch metrics. No module of sao_jax outside `envs/` writes
a registered name as a string, and `envs/` imports nothing from the floors above it.
"""

import ast
import asyncio
import os
import re
import types

import pytest

from experiments import toy
from sao_jax.envs import registry
from sao_jax.envs.base import StepResult
from sao_jax.rollout.agent import run_episode
from sao_jax.rollout.worker import WorkerConfig, parse_args
from sao_jax.text import CharTokenizer
from sao_jax.train.tasks import make_task
from sao_jax.train.warm_start import task_teacher
from tests.rollout.scripted_generator import ScriptedGenerator

REPO = os.path.join(os.path.dirname(__file__), "..", "..")
PACKAGE = os.path.join(REPO, "sao_jax")
# (file under sao_jax/, name) -> why that file may write the name as a string literal. Empty: none
# may. An entry that no longer matches anything fails the test, so the list cannot go stale.
EXCEPTIONS: dict[tuple[str, str], str] = {}
ABOVE_ENVS = ("sao_jax.rollout", "sao_jax.train", "sao_jax.models", "sao_jax.kernels",
              "sao_jax.rl")


# ------------------------------------------------------------------- a toy environment, added here

class EchoEnv:
    """Repeat the number: reward 1 for an action that is exactly it, in one turn."""

    def __init__(self, number: int):
        self.number = number

    def reset(self) -> str:
        return f"say {self.number}:\n"

    def step(self, action: str) -> StepResult:
        right = action.strip() == str(self.number)
        return StepResult("", 1.0 if right else 0.0, True, {"right": right})


def echo_rows(config):
    n = config.env.num_train_prompts
    train = [{"index": i, "prompt_id": str(i), "number": 10 + i} for i in range(n)]
    return train, [{"number": 99 - i} for i in range(config.env.num_eval_prompts)]


def echo_stream(seed):
    number = seed
    while True:
        yield f"say {number}:\n", [(str(number), "")]
        number += 1


def echo_teacher(config, train_rows, eval_rows, options, *, log=None):
    return {"version": 1}, lambda: (echo_stream, echo_stream)


ECHO = registry.EnvSpec(
    name="echo",
    make_env=lambda data, max_turns, options=None, learner_step=0: EchoEnv(int(data["number"])),
    stop_token_ids=lambda tok: (tok.eos_id,),
    rows=echo_rows,
    step_in_prompt=True,
    teacher=registry.Teacher(transcripts=echo_teacher),
    batch_metrics=lambda metadata: {"echo/right": sum(m["right"] for m in metadata)
                                    / len(metadata)},
)


@pytest.fixture
def echo():
    registry.register(ECHO)
    try:
        yield ECHO
    finally:
        registry.REGISTRY.pop(ECHO.name)


def test_an_environment_added_by_its_registry_entry_alone_runs_everywhere(echo):
    config = toy.get_config()
    config.env.name = "echo"
    config.env.num_train_prompts, config.env.num_eval_prompts = 3, 2
    task = make_task(config)
    assert task.spec is echo and task.env_options == {}
    assert [r["number"] for r in task.train_rows] == [10, 11, 12]
    assert task.eval_rows == [{"number": 99}, {"number": 98}]
    tok = CharTokenizer()
    assert task.agent.stop_token_ids == (tok.eos_id,)

    # The agent loop plays the task's environment of a leased row.
    env = task.make_env(task.train_rows[1], config.env.max_turns, learner_step=4)
    generator = ScriptedGenerator(tok, ["11"])
    traj = asyncio.run(run_episode(generator, env, tok, prompt_id="1", config=task.agent,
                                   render_prompt=task.render_prompt))
    assert generator.calls[0][0] == [tok.bos_id] + tok.encode("say 11:\n")
    assert generator.calls[0][1]["stop_token_ids"] == [tok.eos_id]
    assert traj.rewards.sum() == 1.0 and traj.env_metadata["right"] is True
    assert task.spec.batch_metrics([traj.env_metadata, {"right": False}]) == {"echo/right": 0.5}

    # The worker takes it by name, from its config and its command line.
    assert WorkerConfig(learner="x:1", engines=("http://e",), env="echo").env == "echo"
    worker, _ = parse_args(["--learner", "x:1", "--engine", "http://e", "--env", "echo"])
    assert worker.env == "echo"

    # The warm start reads its teacher, in the task's tokenizer.
    teacher = task_teacher(task, config, log=None)
    assert teacher.name == "echo" and teacher.key == {"version": 1} and teacher.tokenizer == tok
    train, _ = teacher.load()
    assert next(train(5)) == ("say 5:\n", [("5", "")])


def test_a_removed_entry_is_unknown_everywhere():
    assert "echo" not in registry.REGISTRY  # the fixture took it out again
    config = toy.get_config()
    config.env.name = "echo"
    with pytest.raises(ValueError, match="config.env.name = 'echo': choose one of"):
        make_task(config)
    with pytest.raises(ValueError, match="env must be one of"):
        WorkerConfig(learner="x:1", engines=("http://e",), env="echo")
    with pytest.raises(SystemExit):
        parse_args(["--learner", "x:1", "--engine", "http://e", "--env", "echo"])


def test_entries_are_checked():
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.REGISTRY[registry.DEFAULT])
    with pytest.raises(ValueError, match="unknown environment 'chess'"):
        registry.get("chess")
    assert registry.DEFAULT in registry.REGISTRY
    assert all(name == spec.name for name, spec in registry.REGISTRY.items())


# ------------------------------------------------------- the worked example of the documentation

def test_the_documented_example_runs_as_written(monkeypatch):
    """docs/environments.md, "Adding an environment": its module and its entry, as the file
    writes them, make a task whose episodes reward the reversed word. In a registry of its own,
    so that a user who has added the example as written (registering "reverse" at import) still
    sees this test pass."""
    monkeypatch.setattr(registry, "REGISTRY", {name: spec for name, spec in
                                               registry.REGISTRY.items() if name != "reverse"})
    with open(os.path.join(REPO, "docs", "environments.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.DOTALL)
    module_code, entry_code = blocks
    module = types.ModuleType("sao_jax.envs.reverse")
    exec(compile(module_code, "docs/environments.md (module)", "exec"), module.__dict__)
    exec(compile(entry_code, "docs/environments.md (entry)", "exec"),
         {"register": registry.register, "EnvSpec": registry.EnvSpec, "reverse": module})
    config = toy.get_config()
    config.env.name = "reverse"
    config.env.num_train_prompts, config.env.num_eval_prompts = 4, 2
    task = make_task(config)
    tok = CharTokenizer()
    assert task.agent.stop_token_ids == (tok.eos_id, tok.encode("\n")[0])
    assert len(task.train_rows) == 4 and len(task.eval_rows) == 2
    row = task.train_rows[0]
    for action, reward in ((row["word"][::-1] + "\n", 1.0), ("no\n", 0.0)):
        env = task.make_env(row, config.env.max_turns)
        traj = asyncio.run(run_episode(ScriptedGenerator(tok, [action]), env, tok,
                                       prompt_id=row["prompt_id"], config=task.agent,
                                       render_prompt=task.render_prompt))
        assert traj.rewards.sum() == reward


# ------------------------------------------------------------- the registry is the only list

def _python_files(root):
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                yield os.path.relpath(path, root).replace(os.sep, "/"), path


def test_no_module_outside_envs_names_an_environment():
    names = set(registry.REGISTRY)
    found, used = [], set()
    for relative, path in _python_files(PACKAGE):
        if relative.startswith("envs/"):  # the environments and their registry
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names:
                if (relative, node.value) in EXCEPTIONS:
                    used.add((relative, node.value))
                else:
                    found.append(f"sao_jax/{relative}:{node.lineno}: {node.value!r}")
    assert not found, ("an environment named outside its registry entry (read the entry "
                       "instead, `envs.registry.get(name)`):\n" + "\n".join(found))
    assert used == set(EXCEPTIONS), f"stale exceptions: {sorted(set(EXCEPTIONS) - used)}"


def test_envs_import_nothing_from_the_floors_above():
    found = []
    for relative, path in _python_files(os.path.join(PACKAGE, "envs")):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"sao_jax/envs/{relative}:{node.lineno}: {m}" for m in modules
                      if m.startswith(ABOVE_ENVS)]
    assert not found, "envs/ imports a higher floor:\n" + "\n".join(found)
