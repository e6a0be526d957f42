"""Calculator warm start: transcripts mask the right tokens, training caches, evaluation runs."""

import numpy as np
import pytest

from sao_jax.envs import calculator
from sao_jax.envs.tokenizer import CharTokenizer
from sao_jax.models.config import preset
from sao_jax.train.warm_start import evaluate_calculator, transcript_tokens, warm_start


def test_transcript_tokens_mask_only_actions():
    tok = CharTokenizer()
    problem = calculator.Problem("(2+3)*4", 20)
    ids, mask = transcript_tokens(problem, tok)
    text = tok.decode(ids)
    assert text == "<bos>(2+3)*4=?\n<calc>2+3</calc><res>5</res>\n<calc>5*4</calc><res>20</res>\n" \
                   "<ans>20</ans>"
    actions = tok.decode(np.asarray(ids)[np.asarray(mask)])
    assert actions == "<calc>2+3</calc><calc>5*4</calc><ans>20</ans>"


def test_warm_start_caches_and_the_evaluator_scores(tmp_path):
    cfg = preset("toy")
    model = warm_start(cfg, steps=20, batch=16, workdir=str(tmp_path), log_every=0)
    again = warm_start(cfg, steps=20, batch=16, workdir=str(tmp_path), log_every=0)  # cached
    ids = np.arange(12).reshape(1, 12)
    np.testing.assert_array_equal(model(ids), again(ids))
    accuracy = evaluate_calculator(model, calculator.heldout_problems(8), max_turns=3)
    assert 0.0 <= accuracy <= 1.0


@pytest.mark.slow
def test_warm_start_is_clearly_imperfect_on_heldout():
    # 600 steps of 64 transcripts (~40 s here): measured 0.60 greedy, 0.37 sampled at T=1.
    model = warm_start(preset("toy"), steps=600, log_every=0)
    heldout = calculator.heldout_problems(200, exclude_seed=0, exclude_count=100_000)
    assert 0.2 <= evaluate_calculator(model, heldout, temperature=1.0) <= 0.5
