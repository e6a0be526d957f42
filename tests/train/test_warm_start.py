"""Warm start: transcripts mask the right tokens and are the agent loop's histories, training
plateaus and caches under a key of what changes the weights, shipped warm starts are found,
teacher streams are read in order and long actions refused."""

import ast
import dataclasses
import json
import os
import random

import jax
import numpy as np
import pytest

from experiments import chain, chain_deep, online_style, swe_tiny, toy
from sao_jax import lab
from sao_jax.envs import calculator
from sao_jax.models import CausalLM
from sao_jax.models.config import ModelConfig, preset
from sao_jax.models.sampling import SamplingParams, generate
from sao_jax.text import CharTokenizer
from sao_jax.train import warm_start as ws
from sao_jax.train.tasks import make_task
from sao_jax.train.warm_start import Recipe, Teacher, encode_transcript, task_teacher, warm_start

SHORT = Recipe(max_steps=5, batch=16, eval_every=5, held_out=64)


def teacher_of(experiment, **warm_start_fields) -> Teacher:
    """The warm-start teacher of an experiment's config (with `config.warm_start` fields)."""
    config = experiment.get_config()
    config.warm_start.update(warm_start_fields)
    config.env.num_train_prompts, config.env.num_eval_prompts = 8, 8
    return task_teacher(make_task(config), config, log=None)


def calculator_accuracy(model: CausalLM, problems, *, temperature: float = 0.0, seed: int = 0,
                        max_turns: int = 6, max_action_tokens: int = 16,
                        context: int = 96) -> float:
    """Fraction of `problems` a toy model answers correctly, all episodes stepped together turn
    by turn with the agent loop's protocol (actions stop at `</calc>` or `</ans>`, tool results
    appended as tokens)."""
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


def test_transcripts_mask_only_actions():
    tok = CharTokenizer()
    problem = calculator.Problem("(2+3)*4", 20)
    ids, mask = encode_transcript(problem.prompt, calculator.teacher_transcript(problem), tok)
    text = tok.decode(ids)
    assert text == "<bos>(2+3)*4=?\n<calc>2+3</calc><res>5</res>\n<calc>5*4</calc><res>20</res>\n" \
                   "<ans>20</ans>"
    actions = tok.decode(np.asarray(ids)[np.asarray(mask)])
    assert actions == "<calc>2+3</calc><calc>5*4</calc><ans>20</ans>"


def test_the_teacher_comes_from_the_registry_entry():
    """What is task-specific (the transcripts' key, the rows' length, chat, the action check)
    is the environment's teacher's, read through `task_teacher`."""
    toy_teacher = teacher_of(toy, guess_rate=0.75)
    assert (toy_teacher.name, toy_teacher.length, toy_teacher.chat) == ("calculator", 64, None)
    assert toy_teacher.key == {"guess_rate": 0.75, "problems": {"num_ops": 2, "max_operand": 30}}
    assert toy_teacher.max_action_tokens is None and toy_teacher.tokenizer == CharTokenizer()
    assert teacher_of(chain).length == 128  # larger problems: the rows RL has
    style = teacher_of(online_style)
    assert (style.name, style.key, style.length) == ("style_shift", {"version": 2}, 128)
    train, heldout = style.load()
    assert train is heldout  # one stream: training from the seed, held out from seed + 1
    with pytest.raises(ValueError, match="no warm-start teacher"):
        config = toy.get_config()
        config.env.name = "long_tail"
        task_teacher(make_task(config), config, log=None)


def test_warm_start_stops_at_a_plateau_caches_and_the_evaluator_scores(tmp_path):
    cfg = preset("toy")
    teacher = teacher_of(toy)
    lines = []
    # min_delta is huge: no evaluation improves on the first one by it, so after `patience`
    # more evaluations training stops, long before max_steps.
    plateau = Recipe(max_steps=1000, batch=16, eval_every=5, patience=2, min_delta=100.0,
                     held_out=64)
    model, info = warm_start(cfg, teacher, plateau, cache_dir=str(tmp_path), log=lines.append)
    assert info["steps"] == 15 and info["plateaued"] and not info["cached"]
    assert len(lines) == 3 and "held-out loss" in lines[-1]
    again, info2 = warm_start(cfg, teacher, plateau, cache_dir=str(tmp_path), log=None)
    assert info2["cached"] and info2["path"] == info["path"]
    assert info2["settings"] == ws.cache_key(cfg, teacher, plateau)
    ids = np.arange(12).reshape(1, 12)
    np.testing.assert_array_equal(model(ids), again(ids))
    _, info3 = warm_start(cfg, teacher, SHORT, cache_dir=str(tmp_path), log=None)
    assert not info3["cached"] and info3["path"] != info["path"]  # another recipe, another entry
    _, info4 = warm_start(cfg, teacher_of(online_style), SHORT, cache_dir=str(tmp_path),
                          log=None)  # another teacher
    assert not info4["cached"] and info4["path"] not in (info["path"], info3["path"])
    accuracy = calculator_accuracy(model, calculator.heldout_problems(8), max_turns=3)
    assert 0.0 <= accuracy <= 1.0


@pytest.mark.slow
def test_warm_start_plateaus_clearly_imperfect_on_heldout():
    # The toy experiment's warm start (guess rate 0.75), trained to its plateau (~3 min here).
    model, info = warm_start(preset("toy"), teacher_of(toy, guess_rate=0.75), Recipe(), log=None)
    assert info["plateaued"]
    heldout = calculator.heldout_problems(200, exclude_seed=0, exclude_count=100_000)
    assert 0.1 <= calculator_accuracy(model, heldout, temperature=1.0) <= 0.6


def test_chat_transcripts_are_the_agent_loops_histories():
    """What a warm start trains on with a chat tokenizer (the SWE teacher's) is token for token
    what the agent loop builds when the policy replays the transcript."""
    import asyncio
    import os

    from sao_jax.envs.base import StepResult
    from sao_jax.rollout.agent import AgentConfig, run_episode
    from sao_jax.rollout.client import GenerateResult
    from sao_jax.text import ChatDeltas, HFTokenizer, prompt_renderer
    from sao_jax.train.warm_start import encode_transcript

    tok = HFTokenizer.from_dir(os.path.join(os.path.dirname(__file__), "..", "..", "experiments",
                                            "data", "tir", "tokenizer"))
    chat = ChatDeltas(tok)
    prompt = "Fix the bug.\n```bash\nls\n```"
    turns = [("Look.\n```bash\nsed -n '1,3p' a.py\n```\n", "<returncode>0</returncode>\nx = 1"),
             ("Fix.\n```bash\ngit apply <<'EOF'\n-a\n+b\nEOF\n```\n", "<output>\n\n</output>"),
             ("Done.\n```bash\necho COMPLETE\n```\n", "")]

    class Replay:
        def __init__(self):
            self.turn = 0

        async def generate(self, ids, params, rid=None):
            out = tok.encode(turns[self.turn][0]) + [chat.end_of_turn_id]
            self.turn += 1
            return GenerateResult(output_ids=out, logprobs=[-1.0] * len(out),
                                  finish_reason="stop", weight_versions=["0"] * len(out),
                                  prompt_tokens=len(ids), completion_tokens=len(out))

    class Scripted:
        def __init__(self):
            self.turn = 0

        def reset(self):
            return prompt

        def step(self, action):
            observation = turns[self.turn][1]
            self.turn += 1
            return StepResult(observation, 1.0 if not observation else 0.0, not observation, {})

    traj = asyncio.run(run_episode(Replay(), Scripted(), tok, prompt_id="0",
                                   config=AgentConfig(max_turns=5, max_action_tokens=200,
                                                      max_response_tokens=1000),
                                   render_prompt=prompt_renderer(tok), chat=chat))
    ids, mask = encode_transcript(prompt, turns, tok, chat)
    np.testing.assert_array_equal(np.concatenate([traj.prompt_ids, traj.response_ids]), ids)
    np.testing.assert_array_equal(traj.action_mask, mask[len(traj.prompt_ids):])


def test_a_shipped_warm_start_is_found_by_its_settings(tmp_path, monkeypatch):
    """A warm start committed under SHIPPED_DIR is reused when the cache has none; chain's is
    there (its warm start takes ~25 min on 2 cores), chain_deep's, online_style's (~12 min),
    swe_tiny's (~11 min) and that of the config the swe notebook's committed async/sync pair ran
    (its MODE_OVERRIDES pin it, so that its runs on every machine start from one policy; the
    earlier grid, results/swe_all_kinds, ran it too), so a change to
    their settings, their teacher or the model's architecture (the key) must ship a new one, or
    move the shipped one to its new key when its weights are what the new settings make: this
    test then fails. Every shipped one is some experiment's."""
    from sao_jax.train.build import initial_policy

    _, built = warm_start(preset("toy"), teacher_of(toy), SHORT, cache_dir=str(tmp_path / "a"),
                          log=None)
    monkeypatch.setattr(ws, "SHIPPED_DIR", str(tmp_path / "a" / "warm_start"))
    _, found = warm_start(preset("toy"), teacher_of(toy), SHORT, cache_dir=str(tmp_path / "b"),
                          log=None)
    assert found["cached"] and found["path"] == built["path"]
    monkeypatch.undo()

    used = set()
    # the swe notebook's committed async/sync pair ran swe_tiny's config before, which its
    # MODE_OVERRIDES pin; its grid runs swe_tiny as it is (OVERRIDES), whose warm start is
    # swe_tiny's own
    grid = lab.config("swe_tiny", notebook_overrides("swe", "MODE_OVERRIDES"))
    for config in (*(e.get_config() for e in (chain, chain_deep, online_style, swe_tiny)), grid):
        config.warm_start.cache_dir = str(tmp_path / "empty")
        config.env.num_train_prompts, config.env.num_eval_prompts = 8, 8
        _, info = initial_policy(config, make_task(config), log=lambda *_: None)
        assert info["cached"] and info["path"].startswith(ws.SHIPPED_DIR), (config.name, info)
        used.add(os.path.basename(info["path"]))
    assert used == set(os.listdir(ws.SHIPPED_DIR))


def notebook_overrides(name: str, variable: str = "OVERRIDES") -> dict:
    """The overrides (`OVERRIDES`, or `variable`) a notebook of experiments/notebooks sets (a
    literal)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "notebooks",
                        f"{name}.py")
    with open(path) as f:
        for node in ast.parse(f.read()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == variable:
                return ast.literal_eval(node.value)
    raise AssertionError(f"{path} sets no {variable}")


def test_a_shipped_warm_start_lives_under_the_key_it_records():
    """Each shipped directory is named by the hash of the settings its info.json records, and
    those are a key's fields: what a key change has to move is visible from the files."""
    fields = set(ws.cache_key(preset("toy"), teacher_of(toy), Recipe()))
    for name in os.listdir(ws.SHIPPED_DIR):
        with open(os.path.join(ws.SHIPPED_DIR, name, "info.json")) as f:
            settings = json.load(f)["settings"]
        assert set(settings) == fields and ws.key_hash(settings) == name, name


def test_the_key_holds_the_architecture_not_the_layout():
    """The model's part of a warm start's key is its architecture: how a pass computes
    (dispatch, scanned layers, remat, attention blocks) is not in it, so changing such a field
    finds the warm starts built already; capacity dispatch (it drops tokens) is. Every model
    field is on one side, on purpose."""
    cfg = preset("toy")
    same = cfg.replace(scan_layers=True, remat="full", attention="blockwise",
                       logprob_dispatch="ragged", moe_token_chunk=16, moe_dispatch="ragged",
                       capacity_factor=2.0)
    assert ws.architecture(same) == ws.architecture(cfg)
    assert ws.architecture(cfg.replace(moe_dispatch="capacity")) != ws.architecture(cfg)
    assert ws.architecture(cfg.replace(num_layers=3)) != ws.architecture(cfg)
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    assert sorted(fields) == sorted(ws.ARCHITECTURE_FIELDS + ws.LAYOUT_FIELDS)
    assert not set(ws.ARCHITECTURE_FIELDS) & set(ws.LAYOUT_FIELDS)


def test_the_key_holds_the_tokenizer_and_the_rendering():
    """The same transcripts in another tokenizer, or in the chat template, are other token ids:
    another warm start."""
    from sao_jax.text import HFTokenizer, chat_deltas

    cfg, teacher = preset("toy"), teacher_of(toy)
    tir = HFTokenizer.from_dir(os.path.join(os.path.dirname(__file__), "..", "..", "experiments",
                                            "data", "tir", "tokenizer"))
    keys = {ws.key_hash(ws.cache_key(cfg, t, Recipe())) for t in (
        teacher,
        dataclasses.replace(teacher, tokenizer=tir),
        dataclasses.replace(teacher, tokenizer=tir, chat=chat_deltas(tir)),
        dataclasses.replace(teacher, max_action_tokens=16))}
    assert len(keys) == 4


def test_a_teacher_stream_trains_and_long_actions_are_refused(tmp_path):
    """A `Teacher` whose `train` is an endless stream (swe_tiny's) is read in order, each
    transcript once; a transcript whose action the agent would cut (`max_action_tokens`) is
    refused with the field to raise, not learnt."""
    tok = CharTokenizer()
    drawn = []

    def stream(seed):
        rng = random.Random(seed)
        while True:
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            if seed == 0:
                drawn.append((a, b))
            yield f"{a}+{b}=", [(f"<ans>{a + b}</ans>", "")]

    heldout = [(f"{a}+{b}=", [(f"<ans>{a + b}</ans>", "")]) for a, b in [(1, 2), (3, 4)]]
    teacher = Teacher(name="calculator", key="sum-stream", tokenizer=tok,
                      load=lambda: (stream, heldout), max_action_tokens=16)
    _, info = warm_start(preset("toy"), teacher, Recipe(max_steps=3, batch=4, eval_every=3),
                         log=None)
    assert info["steps"] == 3 and len(drawn) == 3 * 4  # three batches of four, in order
    short = Teacher(name="calculator", key="sum-stream", tokenizer=tok,
                    load=lambda: (stream, heldout), max_action_tokens=3)
    with pytest.raises(ValueError, match="config.env.max_action_tokens = 3"):
        warm_start(preset("toy"), short, Recipe(max_steps=3, batch=4), log=None)


def test_every_recipe_field_is_in_the_key_and_a_bad_one_is_named():
    """Each of `Recipe`'s fields changes what the warm start trains or when it stops (the
    held-out set decides the plateau, the sample the row length): each is in its key."""
    key = ws.cache_key(preset("toy"), teacher_of(toy), Recipe())
    assert {f.name for f in dataclasses.fields(Recipe)} <= set(key)
    with pytest.raises(ValueError, match=r"config.warm_start.held_out must be at least 1"):
        Recipe(held_out=0)
