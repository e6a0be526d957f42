"""The algorithm and engine registries are the only lists of algorithms and engines.

The worked example of docs/algorithm.md ("Adding an algorithm"), its module and its entry taken
from the file, computes the advantages it says and trains through the learner step. Entries are
checked; the supervisor starts each kind of engine from its entry. That no module of sao_jax
compares an algorithm's, a part's or an engine's name, nor asks which part an algorithm has, is
checked with the rest of the package's shape in tests/test_structure.py.
"""

import dataclasses
import os
import re
import types

import jax
import numpy as np
import pytest

from experiments import toy
from sao_jax.train import advantages, algorithms, engines, policy_losses
from sao_jax.train.advantages import advantages as step_advantages
from sao_jax.train.batch import make_batch
from sao_jax.train.build import algorithm_of, check_config
from sao_jax.train.processes import Command
from sao_jax.train.steps import StepConfig
from sao_jax.train.supervisor import Supervisor
from tests.train.trainers import ROWS, synthetic_trajectories, trainer_for

REPO = os.path.join(os.path.dirname(__file__), "..", "..")


# ------------------------------------------------------- the worked example of the documentation

def documented_example():
    """docs/algorithm.md, "Adding an algorithm": `(module, entry code)` as the file writes
    them."""
    with open(os.path.join(REPO, "docs", "algorithm.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("### Adding an algorithm"):text.index("## 6.")]
    module_code, entry_code = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    module = types.ModuleType("sao_jax.train.leave_one_out")
    exec(compile(module_code, "docs/algorithm.md (module)", "exec"), module.__dict__)
    return module, entry_code


@pytest.fixture
def registry_of_its_own(monkeypatch):
    """The registry without "rloo", so that a user who has added the example as written
    (registering "rloo" at import) still sees these tests pass; put back afterwards."""
    monkeypatch.setattr(algorithms, "ALGORITHMS", {
        name: algo for name, algo in algorithms.ALGORITHMS.items() if name != "rloo"})


def test_the_documented_example_runs_as_written(registry_of_its_own):
    module, entry_code = documented_example()
    exec(compile(entry_code, "docs/algorithm.md (entry)", "exec"),
         {"register": algorithms.register, "Algorithm": algorithms.Algorithm,
          "DIS": policy_losses.DIS, "leave_one_out": module})
    rloo = algorithms.get_algorithm("rloo")
    assert isinstance(rloo.advantage, module.LeaveOneOut) and not rloo.uses_critic

    # The config picks it by name, as `make train ARGS="--config.algo=rloo"` does.
    config = toy.get_config()
    config.algo = "rloo"
    check_config(config)
    assert algorithm_of(config) == rloo

    # Its advantages: each row's outcome less the mean of the other 7 of its group.
    batch = make_batch(synthetic_trajectories(group_size=8))
    outcome = np.asarray(batch.rewards).sum(axis=1).reshape(-1, 8)
    expected = (outcome - (outcome.sum(axis=1, keepdims=True) - outcome) / 7).reshape(-1)
    adv = step_advantages(jax.tree.map(np.asarray, batch), None,
                          config=StepConfig(algorithm=rloo), sharding=None)
    m = np.asarray(batch.action_mask)
    np.testing.assert_allclose(np.asarray(adv.advantages), np.where(m, expected[:, None], 0.0),
                               rtol=1e-6, atol=1e-6)
    assert adv.baseline is None and np.abs(expected).sum() > 0

    # The learner step trains with it: two steps, every metric finite, the policy moved.
    trainer = trainer_for("rloo")
    state = trainer.init_state()
    policy0 = jax.tree.leaves(jax.device_get(state.policy))
    for seed in (0, 1):
        state, metrics = trainer.step(state, make_batch(synthetic_trajectories(
            seed=seed, group_size=8), prompt_index=[i % 4 for i in range(ROWS)]))
        assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values())
        assert float(metrics["skipped"]) == 0.0
    assert trainer.packs and state.critic is None and state.baseline is None
    assert any(not np.array_equal(a, b) for a, b in zip(
        policy0, jax.tree.leaves(jax.device_get(state.policy)), strict=True))
    with pytest.raises(ValueError, match="leave-one-out advantages need group_size >= 2"):
        dataclasses.replace(rloo, group_size=1)


# ------------------------------------------------------------------------------ the entries

def test_entries_are_checked():
    sao = algorithms.ALGORITHMS["sao"]
    with pytest.raises(ValueError, match="registered already"):
        algorithms.register(sao)
    with pytest.raises(ValueError, match="sao: GAE needs a critic"):
        dataclasses.replace(sao, critic_steps=0)
    with pytest.raises(ValueError, match="group-normalised advantages read no critic"):
        dataclasses.replace(algorithms.ALGORITHMS["grpo_dis"], critic_steps=2)
    with pytest.raises(ValueError, match="group-normalised advantages need group_size >= 2"):
        dataclasses.replace(algorithms.ALGORITHMS["grpo_dis"], group_size=1)
    with pytest.raises(ValueError, match="only PPO adds the positive-example LM loss; got "
                                         "0.1 with 'dis'"):
        dataclasses.replace(sao, lm_coef=0.1)
    with pytest.raises(ValueError, match="advantage must be an advantages.Estimator"):
        dataclasses.replace(sao, advantage="gae")
    with pytest.raises(ValueError, match="policy_loss must be a policy_losses.PolicyLoss"):
        dataclasses.replace(sao, policy_loss="dis")
    for name, algo in algorithms.ALGORITHMS.items():
        assert name == algo.name
        assert algo.uses_critic == algo.advantage.critic
        assert isinstance(algo.advantage, advantages.Estimator)
        assert isinstance(algo.policy_loss, policy_losses.PolicyLoss)


def test_each_engine_kind_starts_from_its_entry(tmp_path):
    """The supervisor's commands, ports and timeouts come from the kind's entry."""
    assert all(name == kind.name for name, kind in engines.ENGINES.items())
    config = toy.get_config()
    config.rollout.engine = "vllm"
    with pytest.raises(ValueError, match="config.rollout.engine must be 'embedded' or "
                                         "'sglang', got 'vllm'"):
        check_config(config)
    children = types.SimpleNamespace(log_dir=str(tmp_path))
    commands = {}
    for name in engines.ENGINES:
        config.rollout.engine = name
        supervisor = Supervisor(config, str(tmp_path), children, worker_argv=list)
        supervisor._python = "/venv/bin/python"  # what `prepare` returns, without making it
        assert supervisor.kind is engines.ENGINES[name]
        commands[name] = command = supervisor._engine_command(1, "/weights", 7, 0)
        assert isinstance(command, Command) and command.port > 0
        assert command.argv[command.argv.index("--weight-version") + 1] == "7"
        if command.listen is not None:
            command.listen.close()
    embedded, sglang = commands["embedded"], commands["sglang"]
    assert embedded.argv[:2] == ("-m", "sao_jax.engine.server")
    assert "--warmup-prefills" in embedded.argv and embedded.listen is not None
    config.rollout.engine, config.precompile_steps = "embedded", False  # prefills on first use
    lazy = Supervisor(config, str(tmp_path), children, worker_argv=list)._engine_command(
        1, "/weights", 7, 0)
    lazy.listen.close()
    assert "--warmup-prefills" not in lazy.argv
    assert sglang.python == "/venv/bin/python" and sglang.listen is None
    assert sglang.env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert engines.ENGINES["embedded"].ports(2) == [0, 0]
    assert all(p > 0 for p in engines.ENGINES["sglang"].ports(2))
    assert engines.ENGINES["embedded"].startup_timeout_s(config.rollout) == 300.0
    assert (engines.ENGINES["sglang"].startup_timeout_s(config.rollout)
            == config.rollout.sglang.startup_timeout_s)
