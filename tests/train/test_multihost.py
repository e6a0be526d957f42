"""The learner across processes (`sao_jax.launch`, `train.distributed`): 2 processes x 4
simulated CPU devices against 1 process x 8, a follower killed, and the same command resuming.
That run (two launches, 2-3 minutes) is in the fault suite (marker `faults`, `make test-faults`,
run by CI beside `make test`): the follower's death is its fault. So is a run whose leader trains
its warm start (not cached yet) while the follower waits, with a busy loop taking a core.

Rollouts are not deterministic (random trajectory ids, sampling on engines that batch what
arrives), and a fresh toy policy earns no reward (nothing would change), so both runs start with
the same trajectories in their stream log (random tokens and 0/1 rewards), which the stream
replays in arrival order before anything their own workers send. Same data, same order: the
steps must take the same trajectories and reach the same parameters.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from sao_jax.rollout.proto import trajectory_pb2 as pb
from sao_jax.rollout.stream import LOG_NAME, TrajectoryLog
from sao_jax.train.processes import CHILDREN_FILE
from tests.train.learner_runs import REPO, TINY, environment, steps_log
from tests.train.trainers import synthetic_trajectories

STEPS = 4
RUN = [*TINY, f"--config.total_steps={STEPS}", "--config.rl.critic_warmup_steps=1",
       "--config.mode=sync", "--config.checkpoint_every=1", f"--config.keep_checkpoints={STEPS}",
       "--config.precompile_steps=False", "--config.env.num_eval_prompts=4"]


def run_config():
    """experiments/toy.py with RUN's overrides."""
    from experiments import toy

    config = toy.get_config()
    for flag in RUN:
        path, value = flag.removeprefix("--config.").split("=", 1)
        *parents, field = path.split(".")
        section = config
        for name in parents:
            section = section[name]
        old = section[field]
        section[field] = (value == "True") if isinstance(old, bool) else type(old)(value)
    return config


def one_process_steps(trajectories):
    """The policy after STEPS steps of the one-process learner on 8 devices, built and
    stepped as `learner.train` does, on batches of `trajectories` in order."""
    import jax

    from sao_jax.train import build, sharding
    from sao_jax.train.batch import make_batch
    from sao_jax.train.loop import policy_updates
    from sao_jax.train.tasks import make_task

    config = run_config()
    task = make_task(config)
    mesh = sharding.make_mesh(build.mesh_shape(config, jax.device_count()))
    rules = build.sharding_rules(config)
    policy, _ = build.placed_policy(config, task, print, mesh, rules)
    trainer = build.make_trainer(config, policy, len(task.train_rows), mesh=mesh, rules=rules)
    state = trainer.init_state(config.seed)
    meta = {"policy_from_step": None}
    algo = build.algorithm_of(config)
    n = config.batch_size
    for step in range(1, STEPS + 1):
        batch = trajectories[(step - 1) * n:step * n]
        arrays = make_batch(batch, prompt_index=[0] * n, pack_length=build.pack_length(
            config, trainer), row_multiple=trainer.row_multiple)
        state, _ = trainer.step(state, arrays,
                                update_policy=policy_updates(config, algo, meta, step))
    assert jax.device_count() == 8 and int(state.version) == STEPS - 1
    return named_leaves(state.policy)


def launch_command(workdir):
    return [sys.executable, "-m", "sao_jax.launch", "--procs=2", "--devices_per_process=4",
            "--", "--config=experiments/toy.py", f"--workdir={workdir}", *RUN]


def on_policy(trajectories):
    """`trajectories` with the engine log-probs the run's initial policy (the toy preset,
    seed 0) gives their actions, so that the DIS band keeps them and the policy learns."""
    import dataclasses

    import jax
    from flax import nnx

    from sao_jax.models import CausalLM
    from sao_jax.models.config import preset

    model = CausalLM(preset("toy"), nnx.Rngs(0))
    out = []
    for t in trajectories:
        tokens = np.concatenate([t.prompt_ids, t.response_ids])
        logits = model(tokens[None])
        logits = logits[0] if isinstance(logits, tuple) else logits
        logp = np.asarray(jax.nn.log_softmax(logits[0].astype(np.float32)))
        n = len(t.prompt_ids)
        taken = logp[np.arange(n - 1, len(tokens) - 1), t.response_ids]
        out.append(dataclasses.replace(
            t, rollout_logprobs=np.where(t.action_mask, taken, np.nan).astype(np.float32)))
    return out


def seed_stream(workdir, trajectories):
    """`workdir`'s stream log, holding `trajectories` as accepted, in this order, each with the
    prompt row (`prompt_index`) of the one that answers the k-th prompt of four."""
    import dataclasses

    os.makedirs(workdir / "stream")
    log = TrajectoryLog(os.path.join(workdir / "stream", LOG_NAME))
    log.open()
    for k, t in enumerate(trajectories):
        t = dataclasses.replace(t, prompt_index=k % 4)
        log.append(pb.LogRecord(accepted=t.to_proto()))
    log.close()


def checkpoint_policy(workdir, step):
    """`{path: array}` of the policy in the checkpoint of `step`, as numpy arrays (whatever
    devices wrote it)."""
    import jax
    import orbax.checkpoint as ocp

    path = os.path.join(workdir, "checkpoints", str(step), "state")
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(path).item_metadata.tree
    state = checkpointer.restore(path, restore_args=jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
    return named_leaves(state["policy"])


def named_leaves(tree) -> dict[str, np.ndarray]:
    import jax

    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def process_of(launcher: subprocess.Popen, index: int) -> int:
    """The pid of the launcher's child with JAX_PROCESS_ID=index."""
    with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
        pids = [int(p) for p in f.read().split()]
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"JAX_PROCESS_ID={index}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no process {index} among the launcher's children {pids}")


@pytest.mark.faults
def test_two_processes_train_as_one_and_resume_after_a_follower_is_killed(tmp_path, cache_dir):
    """The one-process reference is the learner's step on 8 devices in this process, on the
    same batches: a whole one-process run would only add engines and evaluations."""
    two = tmp_path / "two"
    # STEPS steps' worth, with rewards: a fresh toy policy earns none.
    trajectories = on_policy(synthetic_trajectories(rows=STEPS * 8, seed=7))
    seed_stream(two, trajectories)

    # Two processes, until the checkpoint of step 1; then the follower is killed, with steps
    # left to run: in CI a kill at step 2 of 3 once came after the run had ended (a loaded
    # machine delays this loop by seconds), and the leader rightly said nothing.
    with open(tmp_path / "launch.out", "w") as out:
        launcher = subprocess.Popen(launch_command(two), cwd=REPO, env=environment(cache_dir),
                                    stdout=out, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 480
        while not (two / "checkpoints" / "1").is_dir():
            assert launcher.poll() is None, (tmp_path / "launch.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint of step 1 in time"
            time.sleep(0.2)
        os.kill(process_of(launcher, 1), signal.SIGKILL)
        code = launcher.wait(timeout=120)
    said = (tmp_path / "launch.out").read_text()
    assert not (two / "summary.json").exists(), "the kill came after the run had ended"
    assert code == 128 + signal.SIGKILL, said[-3000:]
    assert "process 1 was killed by SIGKILL" in said
    assert "process 1 of this 2-process run exited" in said, said[-3000:]  # the leader said so
    assert not (two / CHILDREN_FILE).exists()  # ... and stopped its engines and workers

    again = subprocess.run(launch_command(two), cwd=REPO, env=environment(cache_dir),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming from the checkpoint of step" in again.stdout
    summary = json.loads((two / "summary.json").read_text())  # the killed run's seconds count
    assert summary["wall_time_s"] > summary["this_run_wall_time_s"] + 1, summary
    got = steps_log(two)
    assert [r["ids"] for r in got] == [[t.trajectory_id for t in trajectories[i:i + 8]]
                                       for i in range(0, STEPS * 8, 8)]
    # a critic warm-up step, then the policy steps: versions 0, 0, 1, 2, ...
    assert [r["version"] for r in got] == [0, *range(STEPS - 1)]

    ours = checkpoint_policy(two, STEPS)
    theirs = one_process_steps(trajectories)
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    initial = checkpoint_policy(two, 1)  # the policy did change over the steps compared
    assert any(not np.allclose(initial[k], v) for k, v in theirs.items())


@pytest.mark.faults
def test_the_follower_waits_out_the_leaders_warm_start_and_both_go_on(tmp_path, cache_dir):
    """`make train EXP=toy PROCS=2` with a warm start nobody has cached: the leader trains it
    (50 steps) and saves it on its own while the follower waits at the coordinator, then both
    place it, publish, step and checkpoint, each collective entered together (message barriers),
    on a machine a busy loop keeps busy. It once died of SIGABRT: the leader's save of its warm
    start entered a device barrier that the follower, waiting for that warm start, never
    reached, and gloo gave up after 30 s. (Measured on 2 shared cores: 322 s; 553 s by hand.)"""
    warm = tmp_path / "warm_starts"
    busy = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    try:
        run = subprocess.run(
            [sys.executable, "-m", "sao_jax.launch", "--procs=2", "--devices_per_process=1",
             "--", "--config=experiments/toy.py", f"--workdir={tmp_path / 'run'}",
             "--config.total_steps=2", "--config.warm_start.max_steps=50",
             "--config.env.num_eval_prompts=32", f"--config.warm_start.cache_dir={warm}"],
            cwd=REPO, env=environment(cache_dir), capture_output=True, text=True, timeout=900)
    finally:
        busy.kill()
        busy.wait()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["warm_start"]["cached"] is False
    assert summary["warm_start"]["steps"] == 50


def test_settings_come_from_flags_or_jaxs_variables_and_name_what_is_missing(monkeypatch):
    from sao_jax.train import distributed

    for name in distributed.ENV:
        monkeypatch.delenv(name, raising=False)
    assert distributed.settings().num_processes == 1
    assert distributed.settings("h:1", 2, 1) == distributed.Settings("h:1", 2, 1)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "h:2")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert distributed.settings() == distributed.Settings("h:2", 4, 3)
    assert distributed.settings(process_id=0).process_id == 0  # a flag wins
    monkeypatch.delenv("JAX_PROCESS_ID")
    with pytest.raises(ValueError, match="--process_id"):
        distributed.settings()
    with pytest.raises(ValueError, match=r"--process_id=4 must be in \[0, --num_processes=4\)"):
        distributed.settings(process_id=4)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        distributed.settings(process_id=0)


def test_a_batch_goes_through_a_message_unchanged():
    from sao_jax.train import distributed
    from sao_jax.train.batch import make_batch
    from tests.train.trainers import synthetic_trajectories

    for pack in (None, 128):
        batch = make_batch(synthetic_trajectories(), pack_length=pack)
        arrays = distributed.batch_arrays(batch)
        back = distributed.batch_of(distributed._decode(distributed._encode(arrays)))
        assert (back.packing is None) == (pack is None)
        for a, b in zip(jax_leaves(batch), jax_leaves(back), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_sharding_rules_from_the_config_override_the_defaults():
    from jax.sharding import PartitionSpec

    from experiments import toy
    from sao_jax.train import build, sharding

    config = toy.get_config()
    config.lock()
    assert build.sharding_rules(config) == sharding.DEFAULT_RULES
    config.mesh.rules.embed = ("fsdp", "tensor")
    config.mesh.rules.vocab = ()
    rules = build.sharding_rules(config)
    assert dict(rules) == {**dict(sharding.DEFAULT_RULES), "embed": ("fsdp", "tensor"),
                           "vocab": ()}
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert sharding.logical_to_mesh(("vocab", "embed"), rules, mesh) == PartitionSpec(
        None, ("fsdp", "tensor"))
    with pytest.raises(AttributeError, match="embedd"):
        config.mesh.rules.embedd = ("fsdp",)  # locked: a logical axis that does not exist
    with pytest.raises(TypeError):
        config.mesh.rules = "embed=fsdp+tensor"  # the string form is gone
    config.mesh.rules.embed = ("model",)
    with pytest.raises(ValueError, match=r"config.mesh.rules.embed = \('model',\) names mesh "
                       r"axes \['model'\]; use a tuple of \('data', 'fsdp', 'expert', 'tensor'\)"):
        build.check_config(config)  # refused before a run starts


@pytest.mark.parametrize("rules, message", [
    ({"embedd": ("fsdp",)}, r"config.mesh.rules.embedd: no such logical axis; the rules cover "
                            r"batch, vocab, embed"),
    ({"embed": ("fsdp", "fsdp")}, r"config.mesh.rules.embed = \('fsdp', 'fsdp'\) names a mesh "
                                  r"axis twice"),
    ({"embed": "fsdp"}, r"config.mesh.rules.embed = 'fsdp': give a tuple of mesh axes"),
    ({"vocab": ("",)}, r"names mesh axes \[''\].*or \(\) to replicate"),
    ("embed=fsdp+tensor,vocab=", r"config.mesh.rules = 'embed=fsdp\+tensor,vocab=': the rules "
                                 r"are no longer a string.*config.mesh.rules.embed = "
                                 r"\('fsdp', 'tensor'\)"),
])
def test_sharding_rules_that_name_what_does_not_exist_are_refused(rules, message):
    from sao_jax.train import sharding

    with pytest.raises(ValueError, match=message):
        sharding.rules_from_config(rules, field="config.mesh.rules")


def test_sharding_rules_from_the_command_line():
    """What `--config.mesh.rules.<axis>=...` gives, through the flags `sao_jax.main` defines."""
    from absl import flags
    from ml_collections import config_flags

    from experiments import toy
    from sao_jax.train import build

    def parse(*args):
        values = flags.FlagValues()
        argv = ["main", f"--config={toy.__file__}", *args]
        config_flags.DEFINE_config_file("config", flag_values=values, lock_config=True,
                                        sys_argv=argv)
        values(argv)
        return dict(build.sharding_rules(values.config))

    rules = parse("--config.mesh.rules.embed=('fsdp', 'tensor')", "--config.mesh.rules.vocab=()",
                  "--config.mesh.rules.head_dim=tensor")
    assert (rules["embed"], rules["vocab"], rules["head_dim"]) == (("fsdp", "tensor"), (),
                                                                   ("tensor",))
    with pytest.raises(ValueError, match=r"config.mesh.rules.embed = \('fsdp,tensor',\) "
                                         r"names mesh axes \['fsdp,tensor'\]"):
        parse("--config.mesh.rules.embed=fsdp,tensor")  # one string: write a tuple
    with pytest.raises(AttributeError):
        parse("--config.mesh.rules.embedd=()")
    with pytest.raises(flags.IllegalFlagValueError, match="as a ConfigDict"):
        parse("--config.mesh.rules=embed=fsdp")  # the string form is gone


def test_a_checkpoint_loads_straight_into_the_training_layout_and_mesh(tmp_path):
    """`build.placed_policy` with `model.path`: the learner's layout and shardings read from the
    files, equal to loading whole, re-laying out and placing."""
    import jax
    from flax import nnx

    from experiments import toy
    from sao_jax.models import CausalLM, load_hf, save_hf
    from sao_jax.models.config import preset
    from sao_jax.train import build, sharding

    save_hf(CausalLM(preset("toy"), nnx.Rngs(3)), str(tmp_path / "hf"))
    config = toy.get_config()
    config.model.path = str(tmp_path / "hf")
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "expert": 2})
    rules = build.sharding_rules(config)
    policy, _ = build.placed_policy(config, None, print, mesh, rules)
    whole = sharding.shard_model(build.training_layout(config, load_hf(config.model.path)),
                                 mesh, rules)
    assert policy.cfg == whole.cfg and policy.cfg.scan_layers
    ours, theirs = nnx.state(policy, nnx.Param), nnx.state(whole, nnx.Param)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _KeyValueStore:
    """The coordinator's key-value store, as `Cluster.watch` uses it, in one process."""

    def __init__(self):
        self.values, self.cond = {}, threading.Condition()

    def key_value_set(self, key, value):
        with self.cond:
            self.values[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.values, timeout_ms / 1000)
            return self.values[key]


def test_the_liveness_port_drops_strangers_and_keeps_waiting_for_its_follower(monkeypatch):
    """What connects without the run's token (garbage, silence, a wrong token, a process index
    the run does not have) is closed and the leader keeps accepting; the real follower is then
    watched, and its death is reported by name. Processes that never connect are named."""
    from sao_jax.train import distributed

    store = _KeyValueStore()
    monkeypatch.setattr(distributed, "_client", lambda: store)
    monkeypatch.setattr(distributed, "HELLO_TIMEOUT_S", 0.3)
    leader, follower = distributed.Cluster(), distributed.Cluster()
    leader.count = follower.count = 2
    follower.index = 1
    lost, accepted = [], threading.Event()

    def lead():
        leader.watch(lost.append, timeout_s=30)
        accepted.set()

    threading.Thread(target=lead, daemon=True).start()
    host, port, token = store.blocking_key_value_get(distributed.LIVENESS_KEY, 5000).rsplit(":", 2)
    assert host == "127.0.0.1" and len(token) == 32
    strangers = [b"GET / HTTP/1.1\r\n\r\n", b"", b"1 " + b"0" * 32 + b"\n", f"7 {token}\n".encode(),
                 b"x" * 5000]
    for hello in strangers:
        with socket.create_connection((host, int(port))) as s:
            s.sendall(hello)
            s.settimeout(5)
            try:  # closed by the leader (reset when it left the hello unread), silence too
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
    assert not accepted.is_set()
    follower.watch(lambda what: None, timeout_s=5)
    assert accepted.wait(5) and not lost
    follower._peers[0].shutdown(socket.SHUT_RDWR)  # as a SIGKILL of the follower would
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lost == ["process 1"]

    alone = distributed.Cluster()
    alone.count = 3
    monkeypatch.setattr(distributed, "_client", _KeyValueStore)
    with pytest.raises(TimeoutError, match=r"processes \[1, 2\] did not connect"):
        alone.watch(lost.append, timeout_s=0.5)
