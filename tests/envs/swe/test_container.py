"""Container workspaces run a task's commands as an unprivileged user, contain what they start,
and fail with a message naming what is missing.

Live tests need podman (root, and a base image built here from Debian packages by
`images.build_debian_image`, about a minute once, then reused); where podman is missing they are
skipped with the reason, unless SAO_REQUIRE_CONTAINER=1 (set by .ci/run) turns the skip into a
failure. Docker tests run only where a docker engine answers.
"""

import dataclasses
import os
import shutil
import subprocess
import sys
import time

import pytest

from sao_jax.envs.swe import container
from sao_jax.envs.swe.tasks import SWETask
from sao_jax.envs.swe.workspace import (
    Step,
    Steps,
    WorkspaceConfig,
    WorkspaceError,
    open_and_run,
    open_workspace,
)
from tests.envs.swe.workspace_checks import (
    a_write_past_the_disk_bound_fails_and_the_workspace_goes_on,
)

UID = 1000
FAST = WorkspaceConfig(backend="podman", pull="never", max_processes=64, output_bytes=1 << 16,
                       container_user=f"{UID}:{UID}", memory_bytes=512 << 20)
MODULE = "def add(a, b):\n    return a + b\n"
TEST = ("import unittest\n\nfrom calc import add\n\n\n"
        "class T(unittest.TestCase):\n"
        "    def test_add(self):\n"
        "        self.assertEqual(add(2, 3), 5)\n")


def make_task(tmp_path, image, **fields) -> SWETask:
    repo = tmp_path / "snapshot"
    repo.mkdir()
    (repo / "calc.py").write_text(MODULE)
    (repo / "test_calc.py").write_text(TEST)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run([*git, *args], cwd=repo, check=True, capture_output=True)
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()
    row = dict(instance_id="demo__calc-1", repo="demo/calc", base_commit=base,
               problem_statement="", patch="", test_patch="", fail_to_pass=("test_add",),
               pass_to_pass=(), version="1.0", environment_setup_commit=base, image=image,
               workspace=str(repo))
    row.update(fields)
    return SWETask(**row)


@pytest.fixture(scope="module")
def workspace(image, tmp_path_factory):
    task = make_task(tmp_path_factory.mktemp("ws"), image)
    start = time.monotonic()
    ws = open_workspace(task, FAST)
    print(f"container start (run -d, snapshot cp, chown): {time.monotonic() - start:.2f} s")
    yield ws
    ws.close()


def containers(label: str = container.LABEL) -> list[str]:
    listed = subprocess.run(["podman", "ps", "-a", "--filter", f"label={label}", "--format",
                             "{{.Names}}"], capture_output=True, text=True, check=True)
    return listed.stdout.split()


def test_runs_at_root_as_the_user_and_files_persist(workspace):
    result = workspace.run("id -u; id -g; pwd; stat -c %u calc.py; echo $HOME", timeout=10)
    assert result.returncode == 0, result.output
    assert result.output.split() == [str(UID), str(UID), "/testbed", str(UID), "/tmp"]
    assert workspace.run("echo 'print(7)' > new.py", timeout=10).returncode == 0
    assert workspace.run("python new.py", timeout=10).output == "7\n"


def test_unittest_and_git_diff(workspace):
    result = workspace.run("python -m unittest -q 2>&1 | tail -1", timeout=30)
    assert result.output.strip() == "OK", result.output
    workspace.run("sed -i 's/a + b/a - b - 1/' calc.py", timeout=10)
    assert "FAILED" in workspace.run("python -m unittest -q", timeout=30).output
    diff = workspace.run("git diff", timeout=10)
    assert diff.returncode == 0 and "-    return a + b\n+    return a - b - 1" in diff.output
    workspace.run("git checkout -q calc.py", timeout=10)
    assert workspace.run("git status --porcelain calc.py", timeout=10).output == ""


def test_stderr_merged_in_order_and_stdin(workspace):
    result = workspace.run("echo a; echo b >&2; echo c; exit 3", timeout=10)
    assert (result.returncode, result.output) == (3, "a\nb\nc\n")
    result = workspace.run("tr a-z A-Z", timeout=10, input="hello\nworld\n")
    assert (result.returncode, result.output) == (0, "HELLO\nWORLD\n")


def test_steps_run_apart_in_one_exec(workspace, monkeypatch):
    execs, popen = [], container.subprocess.Popen
    monkeypatch.setattr(container.subprocess, "Popen",
                        lambda argv, *a, **k: execs.append(argv) or popen(argv, *a, **k))
    steps = Steps([Step("cat; echo err >&2; exit 3", 10, input="añb\n"),
                   Step("echo quiet", 10, quiet=True), Step("sleep 30", 1), Step("id -u", 10)])
    results = steps.results(workspace.run(steps.command, steps.timeout, steps.input))
    assert len(execs) == 1
    assert [(r.returncode, r.output, r.timed_out) for r in results] == [
        (3, "añb\nerr\n", False), (0, "", False), (None, "", True), (0, f"{UID}\n", False)]


def test_open_and_run_gives_the_first_command_and_removes_what_it_failed_in(image, tmp_path,
                                                                            monkeypatch):
    task = make_task(tmp_path, image)
    ws, first = open_and_run(task, FAST, "cat; id -u; exit 3", timeout=30, input="in\n")
    with ws:
        assert (first.returncode, first.output) == (3, f"in\n{UID}\n")
    before = containers()

    def broken(self, *args, **kwargs):
        raise WorkspaceError("exec failed")

    monkeypatch.setattr(container.ContainerWorkspace, "run", broken)
    with pytest.raises(WorkspaceError, match="exec failed"):
        open_and_run(task, FAST, "true", timeout=30)
    assert containers() == before


def test_no_network(workspace):
    probe = ("import os, socket\n"
             "print(sorted(os.listdir('/sys/class/net')))\n"
             "try:\n"
             "    socket.create_connection(('1.1.1.1', 53), timeout=3)\n"
             "    print('connected')\n"
             "except OSError as e:\n"
             "    print('refused', e.errno)\n")
    result = workspace.run("python -", timeout=10, input=probe)
    lines = result.output.splitlines()
    assert lines[0] == "['lo']" and lines[1].startswith("refused"), result.output


def test_limits_hold(workspace):
    assert workspace.run("ulimit -n; ulimit -u", timeout=10).output.split() == ["4096", "16384"]
    forks = ("import os, time\n"
             "n = 0\n"
             "try:\n"
             "    for _ in range(500):\n"
             "        if os.fork() == 0:\n"
             "            time.sleep(60)\n"
             "            os._exit(0)\n"
             "        n += 1\n"
             "except OSError as e:\n"
             "    print('blocked after', n, e.errno)\n")
    result = workspace.run("python -", timeout=20, input=forks)
    assert result.output.startswith("blocked after"), result.output
    assert int(result.output.split()[2]) < FAST.max_processes
    start = time.monotonic()
    bomb = workspace.run("b() { b | b & }; b; sleep 1", timeout=3)
    assert "Resource temporarily unavailable" in bomb.output
    assert time.monotonic() - start < 10, bomb
    assert workspace.run("echo alive", timeout=10).output == "alive\n"
    assert user_processes(workspace) == []  # the sleepers and the bomb are gone


def test_a_write_past_disk_bytes_fails_and_the_workspace_goes_on(image, tmp_path):
    config = dataclasses.replace(FAST, disk_bytes=16 << 20)
    with open_workspace(make_task(tmp_path, image), config) as ws:
        error = a_write_past_the_disk_bound_fails_and_the_workspace_goes_on(ws)
        print(f"podman, a write past disk_bytes: {error!r}")
        # tmpfs files are memory: the container's limit leaves the processes memory_bytes
        limit = ws.run("cat /sys/fs/cgroup/memory.max 2>/dev/null || "
                       "cat /sys/fs/cgroup/memory/memory.limit_in_bytes", timeout=10)
        assert int(limit.output) == FAST.memory_bytes + 2 * config.disk_bytes, limit.output
        hog = ws.run(f"python -c 'bytearray({FAST.memory_bytes + (64 << 20)})'; echo rc=$?",
                     timeout=30)
        print(f"podman, a process past the memory limit: {hog.output!r}")
        assert hog.output.splitlines()[-1] == "rc=137", hog.output  # the OOM killer
        assert ws.run("echo alive; cat c | wc -c", timeout=10).output == "alive\n10485760\n"


def test_a_repository_larger_than_disk_bytes_is_named(image, tmp_path):
    mine = f"{container.PID_LABEL}={os.getpid()}"  # other processes make workspaces too
    before = set(containers(mine))
    big = tmp_path / "big"  # a plain directory snapshot with 1 MiB of data
    big.mkdir()
    (big / "data.bin").write_bytes(os.urandom(1 << 20))
    task = make_task(tmp_path, image, workspace=str(big))
    small = WorkspaceConfig(**{**vars(FAST), "disk_bytes": 256 << 10})
    with pytest.raises(WorkspaceError, match="snapshot does not fit in WorkspaceConfig.disk_bytes"
                                             " = 262144 bytes.*raise disk_bytes"):
        open_workspace(task, small)
    (tmp_path / "image").mkdir()
    no_snapshot = make_task(tmp_path / "image", image, workspace=None)
    with pytest.raises(WorkspaceError, match="repository does not fit in WorkspaceConfig."
                                             "disk_bytes.*raise disk_bytes"):
        open_workspace(no_snapshot, WorkspaceConfig(**{**vars(small), "root": "/usr/share"}))
    assert set(containers(mine)) <= before  # nothing left behind


LEFTOVERS = """
import os
chain, pid = set(), os.getpid()
while pid > 1:  # this probe and the shells running it
    chain.add(pid)
    with open(f"/proc/{pid}/stat") as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])
for p in os.listdir("/proc"):
    if p.isdigit() and int(p) not in chain and os.stat(f"/proc/{p}").st_uid == os.getuid():
        with open(f"/proc/{p}/cmdline") as f:
            print(f.read().replace("\\0", " "))
"""


def user_processes(workspace) -> list[str]:
    """The command lines of the user's processes left in the workspace."""
    result = workspace.run("python -", timeout=10, input=LEFTOVERS)
    assert result.returncode == 0, result.output
    return result.output.splitlines()


def test_timeout_kills_everything(workspace):
    start = time.monotonic()
    result = workspace.run("setsid sleep 100 & sleep 100", timeout=2)
    assert result.timed_out and result.returncode is None
    assert time.monotonic() - start < 6
    assert user_processes(workspace) == []


def test_background_does_not_outlive_its_command(workspace):
    assert workspace.run("sleep 100 &", timeout=10).returncode == 0
    assert user_processes(workspace) == []


def test_output_flood_is_cut(workspace):
    start = time.monotonic()
    result = workspace.run("yes", timeout=30)
    assert result.truncated and result.returncode is None and not result.timed_out
    assert len(result.output) == FAST.output_bytes
    assert time.monotonic() - start < 10
    assert user_processes(workspace) == []


def test_exec_latency(workspace):
    times = []
    for _ in range(5):
        start = time.monotonic()
        workspace.run("true", timeout=10)
        times.append(time.monotonic() - start)
    print(f"exec latency: median {sorted(times)[2] * 1e3:.0f} ms")
    assert sorted(times)[2] < 2.0


def test_close_removes_the_container(image, tmp_path):
    ws = open_workspace(make_task(tmp_path, image), FAST)
    assert ws.name in containers()
    ws.close()
    ws.close()  # idempotent
    assert ws.name not in containers()
    with pytest.raises(WorkspaceError, match="closed"):
        ws.run("true", timeout=5)


def test_stale_containers_are_removed(workspace, image):
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"sao-ws-stale-{os.getpid()}"
    subprocess.run(["podman", *container.find_runtime("podman").global_args, "create", "--name",
                    name, "--label", f"{container.LABEL}=1", "--label",
                    f"{container.PID_LABEL}={dead.pid}", image, "sleep", "infinity"],
                   check=True, capture_output=True)
    # others may go too: a run killed on this machine before leaves its containers stale
    assert name in container.remove_stale_containers("podman")
    assert name not in containers() and workspace.name in containers()


def test_image_repository_without_snapshot(image, tmp_path):
    task = make_task(tmp_path, image, workspace=None)
    with pytest.raises(WorkspaceError, match="no repository at /testbed"):
        open_workspace(task, FAST)
    # the image's /usr/local (empty directories) as the repository, copied into the tmpfs
    with open_workspace(task, WorkspaceConfig(**{**vars(FAST), "root": "/usr/local"})) as ws:
        result = ws.run("pwd; stat -c %u .; ls; stat -f -c %T .", timeout=10)
        assert result.output.split()[:3] == ["/usr/local", str(UID), "bin"], result.output
        assert result.output.split()[-1] == "tmpfs"
    assert ws.name not in containers()


def test_image_without_timeout(image, tmp_path):
    name = f"sao-jax-test-{os.getpid()}"
    subprocess.run(["podman", *container.find_runtime("podman").global_args, "run",
                    "--name", name, "--network=none", "--ulimit", "nofile=1024:1024",
                    "--ulimit", "nproc=1024:1024", image, "rm", "/usr/bin/timeout"], check=True,
                   capture_output=True)
    stripped = "localhost/sao-jax/test-no-timeout:latest"
    try:
        subprocess.run(["podman", "commit", "-q", name, stripped], check=True,
                       capture_output=True)
        with pytest.raises(WorkspaceError, match=f"image {stripped} lacks timeout"):
            open_workspace(make_task(tmp_path, stripped), FAST)
    finally:
        subprocess.run(["podman", "rm", "-f", name], capture_output=True)
        subprocess.run(["podman", "rmi", "-f", stripped], capture_output=True)


def test_missing_image_is_named(image, tmp_path):
    missing = "localhost/sao-jax/no-such-image:none"
    task = make_task(tmp_path, missing)
    with pytest.raises(WorkspaceError, match=f"image {missing} is not here.*'never'"):
        open_workspace(task, FAST)
    with pytest.raises(WorkspaceError, match=f"image {missing} is not here.*pull` failed"):
        open_workspace(task, WorkspaceConfig(**{**vars(FAST), "pull": "missing"}))


def test_image_name_from_template(tmp_path):
    task = make_task(tmp_path, None, instance_id="django__django-11099")
    assert (container.image_name(task, WorkspaceConfig(backend="podman"))
            == "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest")
    with pytest.raises(ValueError, match="pull"):
        WorkspaceConfig(backend="podman", pull="sometimes")


def test_missing_runtime_binary(tmp_path, monkeypatch):
    task = make_task(tmp_path, "any")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(WorkspaceError, match="`podman` is not on PATH.*apt-get install podman"):
        open_workspace(task, FAST)


def docker_engine() -> bool:
    return (shutil.which("docker") is not None
            and subprocess.run(["docker", "info"], capture_output=True).returncode == 0)


@pytest.mark.skipif(shutil.which("docker") is None or docker_engine(),
                    reason="needs the docker CLI without a docker engine")
def test_docker_without_engine(tmp_path):
    config = WorkspaceConfig(**{**vars(FAST), "backend": "docker"})
    with pytest.raises(WorkspaceError, match="no docker engine answers"):
        open_workspace(make_task(tmp_path, "any"), config)


@pytest.mark.skipif(not docker_engine(), reason="no docker engine answers here")
def test_docker_runs_a_command(tmp_path):
    config = WorkspaceConfig(**{**vars(FAST), "backend": "docker", "pull": "missing"})
    with open_workspace(make_task(tmp_path, "docker.io/library/python:3.11-slim"), config) as ws:
        assert ws.run("id -u; python -c 'print(1)'", timeout=30).output.split() == [str(UID),
                                                                                     "1"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
