"""Every experiment file loads, validates, and builds its task; swe without its tasks file or
container runtime stops before it starts anything, naming what is missing."""

import glob
import importlib
import os
import shutil
import subprocess
import sys

import pytest

from sao_jax.train.build import check_config, step_config_of
from sao_jax.train.tasks import make_task

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "experiments",
                                                                         "*.py"))
               if not os.path.basename(p).startswith("_"))


def test_the_expected_experiments_exist():
    assert {"base", "toy", "chain", "tir", "online_style", "swe", "swe_mini"} <= set(NAMES)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "base"])
def test_experiment_loads_and_validates(name):
    module = importlib.import_module(f"experiments.{name}")
    assert "make train" in module.__doc__  # the docstring gives the launch command
    config = module.get_config()
    config.lock()
    with pytest.raises(AttributeError):
        config.totl_steps = 3  # a typo fails loudly
    config.total_steps = 3  # a real field can be overridden
    check_config(config)
    step_config_of(config)
    if name == "swe":  # production paths (/data, /models) that this machine does not have
        with pytest.raises(ValueError, match="config.env.train_path"):
            make_task(config)
        return
    task = make_task(config)
    assert task.train_rows and task.eval_rows


# Hang guard for the `python -m sao_jax.main` runs below, not a speed bound: they take ~5 s of
# CPU, which a busy machine (`make test` beside two busy loops on two cores) stretches past a
# minute of wall time. That they stop early is shown by what they leave behind instead.
MAIN_TIMEOUT_S = 600


def _run_swe(tmp_path, *args, env=None):
    return subprocess.run([sys.executable, "-m", "sao_jax.main", "--config=experiments/swe.py",
                           f"--workdir={tmp_path}", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=MAIN_TIMEOUT_S, env=env)


def test_swe_without_its_tasks_file_stops_before_starting_anything(tmp_path):
    proc = _run_swe(tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "/data/swe-gym.jsonl" in proc.stderr and "not found" in proc.stderr
    assert "experiments/data/swe_mini/tasks.jsonl" in proc.stderr  # where to get one
    assert os.listdir(tmp_path) == ["config.json"]  # no stream, checkpoint, engine or worker


def test_swe_without_a_container_runtime_stops_before_starting_anything(tmp_path):
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("git",):  # a PATH with no podman on it
        os.symlink(shutil.which(tool), bare / tool)
    env = {**os.environ, "PATH": str(bare)}
    proc = _run_swe(tmp_path, "--config.env.train_path=experiments/data/swe_mini/tasks.jsonl",
                    "--config.env.eval_path=", env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "`podman` is not on PATH" in proc.stderr and "apt-get install podman" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["bin", "config.json"]  # bin: the bare PATH above


def test_experiment_configs_load_without_jax():
    """A config is data (ml_collections), as big_vision's are: loading every experiment's
    `get_config()` imports neither JAX nor Flax (it took 8 s when experiments/base.py imported
    the trainer's sharding module for its default rules)."""
    code = ("import importlib, sys\n"
            f"for name in {NAMES!r}:\n"
            "    importlib.import_module('experiments.' + name).get_config()\n"
            "print(sorted(m for m in ('jax', 'flax', 'optax', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, check=True)
    assert done.stdout.split("\n")[-2] == "[]", done.stdout + done.stderr


def test_a_presets_depth_can_be_set():
    """`config.model.num_layers` (chain_deep: 4) deepens the preset for the policy, its critic,
    the warm start and `make plan` alike; a negative depth is refused by name."""
    from experiments import chain_deep
    from sao_jax.train.build import policy_skeleton, preset_config
    from sao_jax.train.plan import planned_model_config

    config = chain_deep.get_config()
    assert preset_config(config).num_layers == planned_model_config(config).num_layers == 4
    assert policy_skeleton(config).cfg.num_layers == 4
    config.model.num_layers = 0
    assert preset_config(config).num_layers == 2  # the toy preset's own
    config.model.num_layers = -1
    with pytest.raises(ValueError, match="config.model.num_layers = -1 must be >= 0"):
        preset_config(config)


def test_a_bad_override_fails_loudly():
    proc = subprocess.run([sys.executable, "-m", "sao_jax.main", "--config=experiments/toy.py",
                           "--config.algo=sao2", "--config.total_steps=1"],
                          cwd=REPO, capture_output=True, text=True, timeout=MAIN_TIMEOUT_S)
    assert proc.returncode == 1 and "config.algo must be one of" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "sao_jax.main", "--config=experiments/toy.py",
                           "--config.total_stepz=1"], cwd=REPO, capture_output=True, text=True,
                          timeout=MAIN_TIMEOUT_S)
    assert proc.returncode != 0 and "total_stepz" in proc.stderr


def test_admission_limit():
    from experiments import base, toy
    from sao_jax.train.build import admission_limit

    config = toy.get_config()  # 64 rollout slots, batch 32, max_staleness 2: the cap, 64
    assert admission_limit(config) == 64
    config.max_staleness = 16  # every slot busy plus one batch waiting
    assert admission_limit(config) == 64 + 32
    config.rollout.num_workers = 2
    assert admission_limit(config) == 2 * 64 + 32
    config.rollout.max_in_flight = 40
    assert admission_limit(config) == 40
    config.mode = "sync"
    assert admission_limit(config) is None  # it grants one batch at a time
    config = base.get_config()
    config.model.preset = "toy"
    config.rollout.max_in_flight = config.batch_size - 1
    with pytest.raises(ValueError, match="rollout.max_in_flight = 127 is below"):
        check_config(config)
    config.rollout.max_in_flight = -1
    with pytest.raises(ValueError, match="must be >= 0"):
        check_config(config)


def test_a_weight_update_drain_is_checked_and_only_for_embedded_engines():
    from experiments import base

    config = base.get_config()
    config.model.preset = "toy"
    config.rollout.update_drain_s = 0.01
    check_config(config)
    config.rollout.update_drain_s = -1.0
    with pytest.raises(ValueError, match=r"rollout.update_drain_s = -1.0 must be seconds"):
        check_config(config)
    config.rollout.update_drain_s = 0.01
    config.rollout.engine = "sglang"
    config.model.preset = "toy_moe"  # servable by SGLang
    with pytest.raises(ValueError, match="SGLang servers have no drain"):
        check_config(config)


def test_engine_routes_need_a_model_with_experts_and_start_the_engines_reporting():
    """`rl.engine_routes` (compare) and `rl.routing_replay` (replay) both have the engines
    report their experts and trajectories carry `(layers, top_k)` of them; only the replay
    reaches the step; a model without experts is refused, naming the field set."""
    from experiments import base
    from sao_jax.models.config import preset
    from sao_jax.train.build import route_shape
    from sao_jax.train.engines import reports_routes

    config = base.get_config()
    moe, dense = preset("toy_moe"), preset("toy", mlp_only_layers=(0, 1))
    assert not reports_routes(config) and route_shape(config, moe) is None
    for field, replay in (("engine_routes", False), ("routing_replay", True)):
        config = base.get_config()
        config.model.preset = "toy"
        config.rl[field] = True
        assert reports_routes(config) and step_config_of(config).routing_replay == replay
        assert route_shape(config, moe) == (moe.num_layers, moe.num_experts_per_tok)
        with pytest.raises(ValueError, match=f"config.rl.{field} asks the engines .* no experts"):
            route_shape(config, dense)


def test_the_learner_keeps_the_policy_in_its_master_dtype_whatever_it_starts_from(tmp_path):
    """`config.model.master_dtype` holds for a preset as for a checkpoint: a fresh policy and a
    warm start (trained in float32, cached so) come out in it, and the checkpoint skeleton and
    `make plan` have it; `config.model.dtype` (bfloat16, say) is what the passes compute in and
    the engines serve, not what the learner stores. Dtypes that cannot be are refused."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from experiments import chain
    from sao_jax.train.build import initial_policy, policy_skeleton
    from sao_jax.train.plan import planned_model_config

    def dtypes(model):
        return {x.dtype for x in jax.tree.leaves(nnx.state(model))
                if jnp.issubdtype(x.dtype, jnp.floating)}

    config = chain.get_config()
    config.model.dtype = "bfloat16"
    config.warm_start.enabled = False
    task = make_task(config)
    fresh, _ = initial_policy(config, task, log=lambda *_: None)
    assert dtypes(fresh) == {jnp.dtype(jnp.float32)} and fresh.cfg.param_dtype == "float32"
    assert dtypes(policy_skeleton(config)) == {jnp.dtype(jnp.float32)}
    assert planned_model_config(config).param_dtype == "float32"
    config.model.master_dtype = "bfloat16"  # no master copy: stored as computed
    fresh, _ = initial_policy(config, task, log=lambda *_: None)
    assert dtypes(fresh) == {jnp.dtype(jnp.bfloat16)} and fresh.cfg.param_dtype == "bfloat16"
    config.warm_start.enabled = True  # chain's shipped warm start: float32 on disk
    warm, _ = initial_policy(config, task, log=lambda *_: None)
    assert dtypes(warm) == {jnp.dtype(jnp.bfloat16)}
    config.model.master_dtype = "float32"
    warm32, _ = initial_policy(config, task, log=lambda *_: None)
    assert dtypes(warm32) == {jnp.dtype(jnp.float32)}
    for a, b in zip(jax.tree.leaves(nnx.state(warm)), jax.tree.leaves(nnx.state(warm32)),
                    strict=True):  # the same weights, rounded
        assert jnp.array_equal(a, b.astype(a.dtype))
    config.model.master_dtype = "bfloat16"
    assert dtypes(policy_skeleton(config)) == {jnp.dtype(jnp.bfloat16)}
    assert planned_model_config(config).param_dtype == "bfloat16"
    config.model.dtype = "float32"  # computing wider than it stores: no
    with pytest.raises(ValueError, match="master_dtype = 'bfloat16' is narrower"):
        check_config(config)
    config.model.master_dtype = "fp32"
    with pytest.raises(ValueError, match=r"config.model.master_dtype = 'fp32': use one of"):
        check_config(config)


def test_importing_sao_jax_keeps_libtpu_quiet_off_a_tpu_vm():
    """A notebook's `from sao_jax import rl` then `jax.devices()` on a CPU host with libtpu
    installed prints none of libtpu's complaints about the TPU workers it cannot find."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    code = "from sao_jax import rl; import jax; print(jax.devices()[0].platform)"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "cpu", run.stderr
    for noise in ("host bounds", "TPU_WORKER_HOSTNAMES", "Source Location Trace"):
        assert noise not in run.stderr, run.stderr


# Where a cut episode is graded 0 its bootstrapped return is a reward for stalling until the cut
# (docs/algorithm.md, "Skip-observation GAE"): the toy's policy learned it. These keep the
# bootstrap their committed notebook results were made with; every other experiment ends a cut
# episode at its rewards.
BOOTSTRAPS_CUT_EPISODES = {"chain", "chain_deep", "online_style"}


@pytest.mark.parametrize("name", [n for n in NAMES if n != "base"])
def test_cut_episodes_are_bootstrapped_only_where_the_docs_say(name):
    config = importlib.import_module(f"experiments.{name}").get_config()
    assert config.rl.bootstrap_truncated == (name in BOOTSTRAPS_CUT_EPISODES)
