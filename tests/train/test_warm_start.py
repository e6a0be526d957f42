"""Warm start: transcripts mask the right tokens, teachers write what their task rewards,
training caches, evaluation runs."""

import itertools
import json
import os
import random

import numpy as np
import pytest

from sao_jax.envs import calculator, style_shift
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models.config import preset
from sao_jax.train.warm_start import (
    evaluate_calculator,
    pack,
    sft_batch,
    teacher_transcripts,
    transcript_tokens,
    warm_start,
)


def test_transcript_tokens_mask_only_actions():
    tok = CharTokenizer()
    problem = calculator.Problem("(2+3)*4", 20)
    ids, mask = transcript_tokens(problem, tok)
    text = tok.decode(ids)
    assert text == "<bos>(2+3)*4=?\n<calc>2+3</calc><res>5</res>\n<calc>5*4</calc><res>20</res>\n" \
                   "<ans>20</ans>"
    actions = tok.decode(np.asarray(ids)[np.asarray(mask)])
    assert actions == "<calc>2+3</calc><calc>5*4</calc><ans>20</ans>"


def test_guess_transcripts_answer_at_once_and_wrongly():
    rng = random.Random(0)
    for problem in calculator.heldout_problems(50):
        ((action, observation),) = calculator.guess_transcript(problem, rng)
        given = int(action.removeprefix("<ans>").removesuffix("</ans>"))
        assert observation == "" and 1 <= abs(given - problem.answer) <= 9


def test_sft_batch_mixes_in_guesses_at_the_given_rate():
    tok = CharTokenizer()
    stream = calculator.problem_stream(0)
    ids, mask = sft_batch([next(stream) for _ in range(2000)], tok, 64, guess_rate=0.75,
                          rng=random.Random(0))
    first = np.array([ids[i][np.flatnonzero(mask[i])[0]] for i in range(len(ids))])
    assert abs(np.mean(first == tok.id("<ans>")) - 0.75) < 0.03
    assert set(first) == {tok.id("<ans>"), tok.id("<calc>")}


def test_style_teacher_writes_full_quality_sentences_of_every_length():
    transcripts = list(itertools.islice(teacher_transcripts("style_shift", seed=0), 600))
    lengths = set()
    for prompt, ((action, observation),) in transcripts:
        topic = prompt.removeprefix("write about ").removesuffix(":\n")
        assert topic in style_shift.TOPICS and observation == ""
        assert style_shift.quality(action, topic) == 1.0, action
        lengths.add(len(style_shift.words_of(action)))
    assert lengths == set(range(style_shift.MIN_WORDS, style_shift.MAX_WORDS + 1))
    with pytest.raises(ValueError, match="no warm-start teacher"):
        warm_start(preset("toy"), task="python_tool", log=None)


def test_calculator_transcripts_are_the_sft_batches():
    tok = CharTokenizer()
    stream = calculator.problem_stream(3)
    want = sft_batch([next(stream) for _ in range(64)], tok, 64, guess_rate=0.5,
                     rng=random.Random(3))
    got = pack(list(itertools.islice(teacher_transcripts("calculator", 3, 0.5), 64)), tok, 64)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_warm_start_stops_at_a_plateau_caches_and_the_evaluator_scores(tmp_path):
    cfg = preset("toy")
    lines = []
    # min_delta is huge: no evaluation improves on the first one by it, so after `patience`
    # more evaluations training stops, long before max_steps.
    model, info = warm_start(cfg, max_steps=1000, batch=16, eval_every=5, patience=2,
                             min_delta=100.0, cache_dir=str(tmp_path), log=lines.append)
    assert info["steps"] == 15 and info["plateaued"] and not info["cached"]
    assert len(lines) == 3 and "held-out loss" in lines[-1]
    again, info2 = warm_start(cfg, max_steps=1000, batch=16, eval_every=5, patience=2,
                              min_delta=100.0, cache_dir=str(tmp_path), log=None)
    assert info2["cached"] and info2["path"] == info["path"]
    ids = np.arange(12).reshape(1, 12)
    np.testing.assert_array_equal(model(ids), again(ids))
    other, info3 = warm_start(cfg, max_steps=5, batch=16, eval_every=5, cache_dir=str(tmp_path),
                              log=None)  # other settings: another cache entry
    assert not info3["cached"] and info3["path"] != info["path"]
    _, info4 = warm_start(cfg, task="style_shift", max_steps=5, batch=16, eval_every=5,
                          length=128, cache_dir=str(tmp_path), log=None)  # another teacher
    assert not info4["cached"] and info4["path"] not in (info["path"], info3["path"])
    accuracy = evaluate_calculator(model, calculator.heldout_problems(8), max_turns=3)
    assert 0.0 <= accuracy <= 1.0


@pytest.mark.slow
def test_warm_start_plateaus_clearly_imperfect_on_heldout():
    # The toy experiment's warm start (guess rate 0.75), trained to its plateau (~3 min here).
    model, info = warm_start(preset("toy"), guess_rate=0.75, log=None)
    assert info["plateaued"]
    heldout = calculator.heldout_problems(200, exclude_seed=0, exclude_count=100_000)
    assert 0.1 <= evaluate_calculator(model, heldout, temperature=1.0) <= 0.6


def test_chat_transcripts_are_the_agent_loops_histories():
    """What a warm start trains on with a chat tokenizer (the SWE teacher's) is token for token
    what the agent loop builds when the policy replays the transcript."""
    import asyncio
    import os

    from sao_jax.envs.base import StepResult
    from sao_jax.envs.hf_tokenizer import HFTokenizer
    from sao_jax.rollout.agent import AgentConfig, run_episode
    from sao_jax.rollout.chat import ChatDeltas
    from sao_jax.rollout.client import GenerateResult
    from sao_jax.rollout.worker import prompt_renderer
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
    there (its warm start takes ~25 min on 2 cores), and online_style's (~12 min), so a change
    to their settings or to the model config (part of the key) must ship a new one: this test
    then fails."""
    from experiments import chain, online_style
    from sao_jax.train import warm_start as ws
    from sao_jax.train.build import initial_policy
    from sao_jax.train.tasks import make_task

    _, built = warm_start(preset("toy"), max_steps=5, batch=16, eval_every=5,
                          cache_dir=str(tmp_path / "a"), log=None)
    monkeypatch.setattr(ws, "SHIPPED_DIR", str(tmp_path / "a" / "warm_start"))
    _, found = warm_start(preset("toy"), max_steps=5, batch=16, eval_every=5,
                          cache_dir=str(tmp_path / "b"), log=None)
    assert found["cached"] and found["path"] == built["path"]
    monkeypatch.undo()

    for experiment in (chain, online_style):
        config = experiment.get_config()
        config.warm_start.cache_dir = str(tmp_path / "empty")
        config.env.num_train_prompts, config.env.num_eval_prompts = 8, 8
        _, info = initial_policy(config, make_task(config), log=lambda *_: None)
        assert info["cached"] and info["path"].startswith(ws.SHIPPED_DIR), (experiment, info)


def test_the_key_holds_the_architecture_not_the_layout(tmp_path):
    """A warm start's key is its settings and the model's architecture: how a pass computes
    (dispatch, scanned layers, remat, attention blocks) is not in it, so adding or changing such
    a field finds the warm starts built already; capacity dispatch (it drops tokens) is. One
    cached under the key before (repr of the whole config) is still found."""
    import shutil

    from sao_jax.train import warm_start as ws

    cfg = preset("toy")
    same = cfg.replace(scan_layers=True, remat="full", attention="blockwise",
                       logprob_dispatch="ragged", moe_token_chunk=16)
    assert ws.architecture(same) == ws.architecture(cfg)
    assert ws.architecture(cfg.replace(moe_dispatch="capacity")) != ws.architecture(cfg)
    assert ws.architecture(cfg.replace(num_layers=3)) != ws.architecture(cfg)

    _, built = warm_start(cfg, max_steps=5, batch=16, eval_every=5,
                          cache_dir=str(tmp_path / "a"), log=None)
    settings = json.loads(open(os.path.join(built["path"], "info.json")).read())["settings"]
    legacy = ws._key({**settings, "config": repr(cfg), "version": 2})
    shutil.move(built["path"], tmp_path / "a" / "warm_start" / legacy)
    _, found = warm_start(cfg, max_steps=5, batch=16, eval_every=5,
                          cache_dir=str(tmp_path / "a"), log=None)
    assert found["cached"] and found["path"].endswith(legacy)


def test_a_teacher_stream_trains_and_long_actions_are_refused(tmp_path):
    """A `Teacher` whose `train` is an endless stream (swe_tiny's) is read in order, each
    transcript once; a transcript whose action the agent would cut (`max_action_tokens`) is
    refused with the field to raise, not learnt."""
    from sao_jax.train.warm_start import Teacher

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
    _, info = warm_start(preset("toy"), teacher=teacher, max_steps=3, batch=4, eval_every=3,
                         log=None)
    assert info["steps"] == 3 and len(drawn) == 3 * 4  # three batches of four, in order
    short = Teacher(name="calculator", key="sum-stream", tokenizer=tok,
                    load=lambda: (stream, heldout), max_action_tokens=3)
    with pytest.raises(ValueError, match="config.env.max_action_tokens = 3"):
        warm_start(preset("toy"), teacher=short, max_steps=3, batch=4, log=None)
