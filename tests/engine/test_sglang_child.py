"""`sglang_child.py`, the wrapper that makes an SGLang server die with the learner, around a fake
`sglang.launch_server` (a process that starts a grandchild and sleeps): told to stop, orphaned,
or killed itself, it leaves no server process behind. No SGLang needed."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sao_jax.engine import sglang_server

FAKE_SERVER = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_PIDS"], "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
""")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture
def fake_sglang(tmp_path):
    package = tmp_path / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(FAKE_SERVER)
    return dict(os.environ, PYTHONPATH=str(tmp_path), FAKE_PIDS=str(tmp_path / "pids"))


def fake_pids(env) -> tuple[int, int]:
    """The fake server's pid and its child's, once it has started."""
    wait_until(lambda: os.path.exists(env["FAKE_PIDS"]) and open(env["FAKE_PIDS"]).read())
    server, grandchild = map(int, open(env["FAKE_PIDS"]).read().split())
    return server, grandchild


def start(env):
    """The wrapper, a child of this process."""
    proc = subprocess.Popen([sys.executable, sglang_server.CHILD_SCRIPT, "--port", "1",
                             "--parent-pid", str(os.getpid())], env=env)
    return (proc, *fake_pids(env))


def test_sigterm_stops_the_server_and_its_children(fake_sglang):
    wrapper, server, grandchild = start(fake_sglang)
    wrapper.terminate()
    assert wrapper.wait(20) == 0
    wait_until(lambda: not alive(server) and not alive(grandchild))


def test_the_server_goes_when_the_learner_dies(fake_sglang):
    """The learner (here a process that started the wrapper as its child) is SIGKILLed: the
    wrapper notices its parent is gone and stops the group."""
    learner = subprocess.Popen([sys.executable, "-c",
                                "import os, subprocess, sys, time; "
                                "subprocess.Popen(sys.argv[1:] + ['--parent-pid', "
                                "str(os.getpid())]); time.sleep(600)",
                                sys.executable, sglang_server.CHILD_SCRIPT, "--port", "1"],
                               env=fake_sglang)
    server, grandchild = fake_pids(fake_sglang)
    learner.kill()
    learner.wait()
    wait_until(lambda: not alive(server) and not alive(grandchild))


def test_the_server_goes_when_the_wrapper_is_killed(fake_sglang):
    wrapper, server, grandchild = start(fake_sglang)
    wrapper.send_signal(signal.SIGKILL)
    wrapper.wait()
    wait_until(lambda: not alive(server))  # PR_SET_PDEATHSIG
    os.kill(grandchild, signal.SIGKILL)  # the fake's own child has no watch of its own


def test_usage_without_a_parent_pid():
    done = subprocess.run([sys.executable, sglang_server.CHILD_SCRIPT, "--port", "1"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--parent-pid" in done.stderr
