"""The rollout worker end to end: learner stream, engine over HTTP, calculator episodes."""

import asyncio
import threading

import grain
import pytest

from sao_jax.envs import calculator
from sao_jax.models import save_hf
from sao_jax.models.config import preset
from sao_jax.rollout.stream import TrajectoryServer
from sao_jax.rollout.worker import WorkerConfig, run_worker
from tests.rollout.test_engine import start_engine, stop_engine, toy_model


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    path = tmp_path_factory.mktemp("worker_model")
    save_hf(toy_model(seed=9), str(path))
    proc, url = start_engine(path)
    yield url
    stop_engine(proc)


def test_worker_plays_every_leased_prompt_once_under_admission(engine_url, tmp_path):
    problems = calculator.heldout_problems(12)
    rows = [{"prompt_id": f"q{i}", "expression": p.expression, "answer": p.answer}
            for i, p in enumerate(problems)]
    prompts = grain.MapDataset.source(rows).to_iter_dataset()
    vocab = preset("toy").vocab_size  # the model's ids, some beyond the tokenizer's 59
    server = TrajectoryServer(str(tmp_path / "learner"), vocab_size=vocab, prompts=prompts,
                              max_in_flight=3)
    received = []

    def learner():  # takes one trajectory at a time, as a slow learner would
        while len(received) < len(rows):
            batch = server.get_batch(1, timeout=60)
            assert batch, "no trajectory within 60 s"
            received.extend(batch)
            server.consumed([t.trajectory_id for t in batch])

    with server:
        consumer = threading.Thread(target=learner)
        consumer.start()
        config = WorkerConfig(learner=server.address, engines=(engine_url,), concurrency=8,
                              max_turns=3, max_action_tokens=8, vocab_size=vocab)
        counts = asyncio.run(run_worker(config))
        consumer.join(60)
        metrics = server.metrics()
    assert counts["submitted"] == 12 and counts["rejected"] == 0
    assert sorted(t.prompt_id for t in received) == sorted(r["prompt_id"] for r in rows)
    for traj in received:
        traj.validate(vocab_size=vocab)
        assert traj.num_action_tokens > 0 and traj.lease_id
    # Admission held the worker to 3 episodes in flight although it asked for 8.
    assert metrics["stream/leases_held_back"] > 0


def test_worker_config_errors():
    with pytest.raises(ValueError, match="env must be one of"):
        WorkerConfig(learner="x:1", engines=("http://e",), env="chess")
    with pytest.raises(ValueError, match="engines is empty"):
        WorkerConfig(learner="x:1", engines=())
