"""The namespace workspace: a task's repository that bash commands change, one sandbox per command.

Live tests need what the sandbox needs (the `isolated` fixture of tests/conftest.py: skipped
with the reason where it is missing, unless SAO_REQUIRE_SANDBOX=1 turns the skip into a failure).
"""

import dataclasses
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from sao_jax.envs import sandbox
from sao_jax.envs.swe import namespace
from sao_jax.envs.swe.namespace import NamespaceWorkspace
from sao_jax.envs.swe.tasks import SWETask
from sao_jax.envs.swe.workspace import (
    CommandResult,
    Step,
    Steps,
    WorkspaceConfig,
    WorkspaceError,
    open_workspace,
)
from tests.envs.processes import processes_of
from tests.envs.swe.workspace_checks import (
    a_write_past_the_disk_bound_fails_and_the_workspace_goes_on,
)

REPO = Path(__file__).resolve().parents[3]
CONFIG = WorkspaceConfig(output_bytes=4096, max_processes=64, cpu_seconds=10)
GIT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/nonexistent",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"}


def git(*args, cwd):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          env=GIT_ENV, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A tiny task whose snapshot is a two-commit git repository; base_commit is the first."""
    source = tmp_path_factory.mktemp("snapshot")
    git("init", "-q", cwd=source)
    (source / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    git("add", "-A", cwd=source)
    git("commit", "-q", "-m", "base", cwd=source)
    base = git("rev-parse", "HEAD", cwd=source).strip()
    (source / "later.txt").write_text("not at the base commit\n")
    git("add", "-A", cwd=source)
    git("commit", "-q", "-m", "later", cwd=source)
    return SWETask(instance_id="tiny__calc-1", repo="tiny/calc", base_commit=base,
                   problem_statement="add subtracts", patch="", test_patch="",
                   fail_to_pass=("test_add",), pass_to_pass=(), version="0",
                   environment_setup_commit=base, workspace=str(source))


@pytest.fixture
def ws(isolated, task):
    workspace = open_workspace(task, CONFIG)
    yield workspace
    workspace.close()


def test_the_repository_is_at_root_at_the_base_commit_and_changes_persist(ws):
    assert isinstance(ws, NamespaceWorkspace) and ws.root == "/testbed"
    result = ws.run("pwd; ls; sed -i 's/a - b/a + b/' calc.py; echo note > notes.txt", timeout=10)
    assert result.output == "/testbed\ncalc.py\n" and result.returncode == 0, result.output
    assert not result.timed_out and not result.truncated and result.seconds < 5
    result = ws.run("cat calc.py notes.txt; python -c 'import calc; print(calc.add(2, 3))'",
                    timeout=10)
    assert result.output == "def add(a, b):\n    return a + b\nnote\n5\n", result.output
    assert (Path(ws.host_dir) / "notes.txt").read_text() == "note\n"


def test_commands_run_as_the_workspace_uid(ws):
    first, second = ws.run("id -u; id -g; id -G", timeout=10), ws.run("id -u", timeout=10)
    uid = ws.uid
    assert first.output == f"{uid}\n{uid}\n{uid}\n" and second.output == f"{uid}\n"
    assert sandbox.UID_RANGE[0] <= uid < sandbox.UID_RANGE[1]
    ws.run("touch made_inside", timeout=10)
    assert all(p.stat().st_uid == uid for p in [Path(ws.host_dir), *Path(ws.host_dir).rglob("*")])
    assert os.stat(os.path.dirname(ws.host_dir)).st_mode & 0o777 == 0o700


def test_git_works_inside_as_the_workspace_user(ws):
    result = ws.run("echo '# more' >> calc.py && git status --short && git diff --stat && "
                    "git log --format=%s", timeout=10)
    assert result.returncode == 0, result.output
    assert "dubious ownership" not in result.output
    assert result.output == " M calc.py\n calc.py | 1 +\n 1 file changed, 1 insertion(+)\nbase\n"


def test_the_repository_holds_the_base_commit_alone(ws, task):
    later = git("rev-parse", "HEAD", "HEAD:later.txt", cwd=task.workspace).split()
    result = ws.run("git log --all --format=%s; cat .git/shallow; "
                    "git cat-file --batch-check='%(objectname) %(objecttype)'", timeout=10,
                    input="".join(f"{oid}\n" for oid in later))
    assert result.output == (f"base\n{task.base_commit}\n"
                             f"{later[0]} missing\n{later[1]} missing\n"), result.output


def test_stdin_reaches_the_command_and_stderr_is_merged_in_order(ws):
    result = ws.run("echo one; echo two >&2; cat; echo three >&2; exit 3", timeout=10,
                    input="from stdin\n")
    assert result.output == "one\ntwo\nfrom stdin\nthree\n" and result.returncode == 3
    assert ws.run("cat", timeout=10).output == ""  # no input: /dev/null, nothing waits
    patch = "".join(f"line {i}\n" for i in range(20_000))  # larger than a pipe
    assert ws.run("wc -l", timeout=10, input=patch).output.strip() == "20000"


def test_no_network(ws):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        result = ws.run(f"echo hi > /dev/tcp/127.0.0.1/{port} && echo CONNECTED", timeout=10)
    finally:
        listener.close()
    assert "CONNECTED" not in result.output and "Network is unreachable" in result.output


def test_nothing_of_the_host_outside_the_view(ws, tmp_path):
    (tmp_path / "secret").write_text("s")
    paths = [REPO, tmp_path, Path(ws.host_dir), Path(ws.host_dir).parent, Path("/home"),
             Path("/var"), Path("/root/.bashrc")]
    result = ws.run("; ".join(f"test -e {p} && echo VISIBLE {p}" for p in paths) + "; ls /",
                    timeout=10)
    assert "VISIBLE" not in result.output, result.output
    assert "testbed" in result.output.split()


def test_writes_only_to_root_and_tmp_and_tmp_does_not_persist(ws):
    targets = ["/usr/x", "/etc/x", "/x", "/sandbox/bin/x", "/dev/x", "/root/x"]
    script = "; ".join(f"touch {t} 2>/dev/null && echo WROTE {t}" for t in targets)
    result = ws.run(script + "; touch /tmp/t /testbed/t && echo ok; ls /tmp", timeout=10)
    assert result.output == "ok\nt\n", result.output
    assert ws.run("ls -A /tmp", timeout=10).output == ""


def test_timeout_kills_the_command_and_what_it_left_behind(ws):
    start = time.monotonic()
    result = ws.run("sleep 100 & setsid sleep 100 & echo started; sleep 100", timeout=1)
    assert result.timed_out and result.returncode is None
    assert result.output == "started\n"
    # Far from the 100 s of the sleeps, yet not a tight bound: a busy machine's slack.
    assert time.monotonic() - start < 30
    result = ws.run("(setsid sleep 100 &); echo detached", timeout=10)
    assert result.output == "detached\n" and not result.timed_out and result.seconds < 30
    deadline = time.monotonic() + 30
    while processes_of(ws.uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_of(ws.uid) == []


def test_output_flood_is_truncated(ws):
    result = ws.run("yes", timeout=10)
    assert result.truncated and result.returncode is None and not result.timed_out
    assert len(result.output) == CONFIG.output_bytes and result.seconds < 5


def test_a_signal_is_a_shell_exit_status(ws):
    assert ws.run("kill -SEGV $$", timeout=10).returncode == 128 + 11


def test_close_removes_the_directory_and_is_idempotent(isolated, task):
    with NamespaceWorkspace.create(task, CONFIG) as ws:
        parent = Path(ws.host_dir).parent
        ws.run("mkdir -p deep/er && chmod 000 deep", timeout=10)
        assert parent.is_dir()
    assert not parent.exists()
    ws.close()
    with pytest.raises(WorkspaceError, match="closed"):
        ws.run("true", timeout=10)


def test_a_plain_directory_snapshot(isolated, tmp_path, task):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.txt").write_text("a\n")
    plain = SWETask(**{**task.__dict__, "workspace": str(tmp_path / "plain")})
    with NamespaceWorkspace.create(plain, CONFIG) as ws:
        result = ws.run("cat a.txt && echo b >> a.txt && git diff --stat", timeout=10)
    assert result.output == "a\n a.txt | 1 +\n 1 file changed, 1 insertion(+)\n", result.output


def test_missing_snapshot_and_missing_sandbox_are_workspace_errors(isolated, task, monkeypatch):
    gone = SWETask(**{**task.__dict__, "workspace": "/nonexistent/snapshot"})
    with pytest.raises(WorkspaceError, match="not found"):
        NamespaceWorkspace.create(gone, CONFIG)
    with pytest.raises(WorkspaceError, match="root '/usr/src' cannot be bound.*overlaps /usr"):
        NamespaceWorkspace.create(task, WorkspaceConfig(root="/usr/src"))
    monkeypatch.setattr(sandbox.isolation, "_verified", set())
    monkeypatch.setattr(sandbox.isolation.shutil, "which", lambda *a, **k: None)
    with pytest.raises(WorkspaceError, match="cannot run here.*`unshare`"):
        NamespaceWorkspace.create(task, CONFIG)


def test_the_first_command_is_the_probe_and_comes_back_as_run_gives_it(isolated, task):
    ws, first = NamespaceWorkspace.create_and_run(task, CONFIG, "cat; git rev-parse HEAD; exit 3",
                                                  timeout=30, input="from stdin\n")
    with ws:
        assert (first.returncode, first.output) == (3, f"from stdin\n{task.base_commit}\n")
        assert not first.timed_out and not first.truncated
        assert ws.run("git rev-parse HEAD", timeout=10).output == f"{task.base_commit}\n"
    tiny = dataclasses.replace(CONFIG, output_bytes=8)  # cut within the marker's line
    ws, first = NamespaceWorkspace.create_and_run(task, tiny, "echo hello", timeout=30)
    ws.close()
    assert (first.returncode, first.output, first.truncated) == (None, "", True)


def test_a_first_command_cannot_hide_a_broken_workspace(isolated, task):
    mounts = Path("/proc/self/mounts").read_text().count(" sao-ws-")
    with pytest.raises(WorkspaceError, match="root '/usr/src' cannot be bound.*overlaps /usr"):
        NamespaceWorkspace.create_and_run(task, WorkspaceConfig(root="/usr/src"), "exit 0",
                                          timeout=30)
    # 1 MiB of address space: setpriv cannot load its libraries, no shell starts (exit 127,
    # which a command may return too)
    starved = dataclasses.replace(CONFIG, memory_bytes=1 << 20)
    with pytest.raises(WorkspaceError, match="a first command in the workspace of tiny__calc-1 "
                                             "failed: .*setpriv"):
        NamespaceWorkspace.create_and_run(task, starved, "exit 127", timeout=30)
    assert Path("/proc/self/mounts").read_text().count(" sao-ws-") == mounts  # unmounted


@pytest.mark.parametrize("output, truncated, kept", [
    ("{marker}out\n", False, "out\n"),
    ("bash: warning: setlocale\n{marker}out\n", False, "bash: warning: setlocale\nout\n"),
    ("bash: warning\n{cut}", True, "bash: warning\n"),  # cut within the marker's line
    ("{cut}", True, ""),
    ("setpriv: error", False, None),
    ("setpriv: error", True, None),
    ("", False, None),
    ("bash: warning {cut}", True, None),  # cut in a line that is not the marker's
    ("bash: warning\n{cut}", False, None),  # not cut: the shell died in the marker's line
])
def test_the_marker_of_the_first_command(output, truncated, kept):
    marker = "sao-ws-ready-0123456789abcdef\n"
    output = output.format(marker=marker, cut=marker[:9])
    result = CommandResult(0, output, False, truncated, 0.1)
    assert namespace._without_marker(result, marker) == kept


def test_steps_run_apart_in_one_sandbox(ws, monkeypatch):
    spawned, run_program = [], namespace.run_program
    monkeypatch.setattr(namespace, "run_program",
                        lambda *args, **kwargs: spawned.append(args) or run_program(*args,
                                                                                    **kwargs))
    large = "é\n" * 40_000  # larger than a pipe, and not ASCII
    steps = Steps([
        Step("cat; echo to stderr >&2; printf 'no newline'; exit 3", 10, input="añb\n"),
        Step("wc -c; touch /tmp/left", 10, input=large),
        Step("echo quiet; ls /tmp/left", 10, quiet=True),
        Step("echo quiet but failed; exit 4", 10, quiet=True),
        Step("echo started; sleep 30", 1),
        Step("cat; pwd", 10),
    ])
    results = steps.results(ws.run(steps.command, steps.timeout, steps.input))
    assert len(spawned) == 1
    assert [(r.returncode, r.output, r.timed_out, r.truncated) for r in results] == [
        (3, "añb\nto stderr\nno newline", False, False),
        (0, f"{len(large.encode())}\n", False, False),
        (0, "", False, False),
        (4, "quiet but failed\n", False, False),
        (None, "started\n", True, False),  # its own timeout; the next step has its own
        (0, "/testbed\n", False, False),  # no input: /dev/null
    ]
    assert results[4].seconds >= 1
    stopping = Steps([Step("echo one; exit 2", 10), Step("touch two", 10)], stop_at_failure=True)
    first, second = stopping.results(ws.run(stopping.command, stopping.timeout))
    assert (first.returncode, first.output, second) == (2, "one\n", None)
    assert ws.run("ls two", timeout=10).returncode != 0
    # The output limit (4096 bytes) is the steps' together: the one it cuts is truncated, those
    # after it never ran.
    flood = Steps([Step("echo a", 10), Step("seq 1 2000", 10), Step("touch three", 10)])
    a, cut, never = flood.results(ws.run(flood.command, flood.timeout))
    assert (a.returncode, a.output) == (0, "a\n") and never is None
    assert (cut.returncode, cut.truncated) == (None, True) and cut.output.startswith("1\n2\n")
    assert ws.run("ls three", timeout=10).returncode != 0


SMALL_DISK = dataclasses.replace(CONFIG, disk_bytes=16 << 20)


def test_a_write_past_disk_bytes_fails_and_the_workspace_goes_on(isolated, task):
    with NamespaceWorkspace.create(task, SMALL_DISK) as ws:
        fs = os.statvfs(ws.host_dir)  # the repository sits on the workspace's own tmpfs
        assert fs.f_blocks * fs.f_frsize == SMALL_DISK.disk_bytes
        error = a_write_past_the_disk_bound_fails_and_the_workspace_goes_on(ws)
        print(f"namespace, a write past disk_bytes: {error!r}")


def test_a_snapshot_larger_than_disk_bytes_is_named(isolated, task, tmp_path):
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "data.bin").write_bytes(os.urandom(1 << 20))
    big = SWETask(**{**task.__dict__, "workspace": str(tmp_path / "big")})
    mounts = Path("/proc/self/mounts").read_text().count(" sao-ws-")
    with pytest.raises(WorkspaceError, match="does not fit in WorkspaceConfig.disk_bytes = "
                                             "262144 bytes.*raise disk_bytes"):
        NamespaceWorkspace.create(big, dataclasses.replace(CONFIG, disk_bytes=256 << 10))
    assert Path("/proc/self/mounts").read_text().count(" sao-ws-") == mounts  # unmounted


def test_the_tmpfs_of_a_dead_worker_is_removed(isolated, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / "stale-ws"
    stale.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", f"sao-ws-{dead.pid}", str(stale)],
                   check=True)
    (stale / "left").write_text("x")
    assert str(stale) in namespace.remove_stale_workspaces()  # (and any other dead one)
    assert not os.path.ismount(stale) and not stale.exists()


def test_process_and_memory_bounds_hold(ws):
    forks = ("import os, time\n"
             "n = 0\n"
             "try:\n"
             "    for _ in range(500):\n"
             "        if os.fork() == 0:\n"
             "            time.sleep(30)\n"
             "            os._exit(0)\n"
             "        n += 1\n"
             "except OSError as e:\n"
             "    print('blocked after', n, e.errno)\n")
    result = ws.run("python -", timeout=20, input=forks)
    assert result.output.startswith("blocked after"), result.output
    assert int(result.output.split()[2]) < CONFIG.max_processes
    assert ws.run("echo alive", timeout=10).output == "alive\n"
    hog = f"python -c 'bytearray({CONFIG.memory_bytes})' 2>&1 | tail -1; echo next"
    assert ws.run(hog, timeout=20).output == "MemoryError\nnext\n"


def test_the_memory_of_all_commands_together_is_bounded(isolated, task):
    config = dataclasses.replace(CONFIG, memory_bytes=256 << 20, disk_bytes=16 << 20)
    with NamespaceWorkspace.create(task, config) as ws:
        if ws.memory_cgroup is None:
            pytest.skip("no memory cgroup can be made here: only RLIMIT_AS bounds memory")
        limit = ws.run("cat /proc/self/cgroup", timeout=10)
        assert os.path.basename(ws.memory_cgroup) in limit.output, limit.output
        # three processes of 150 MiB each: each within RLIMIT_AS, together past the cgroup's
        # 256 + 2 x 16 MiB
        hold = "python -c 'import time; b = b\"x\" * (150 << 20); time.sleep(1.5)'"
        result = ws.run(f"for i in 1 2 3; do ({hold}; echo rc=$?) & done; wait", timeout=60)
        codes = sorted(line for line in result.output.splitlines() if line.startswith("rc="))
        print(f"namespace, three processes past the memory cgroup: {codes}")
        assert len(codes) == 3 and "rc=137" in codes, result.output
        assert ws.run("echo alive", timeout=10).output == "alive\n"
        cgroup = ws.memory_cgroup
    assert not os.path.exists(cgroup)  # removed at close


def test_per_command_cost(ws):
    ws.run("true", timeout=10)
    start = time.monotonic()
    for _ in range(10):
        assert ws.run("true", timeout=10).returncode == 0
    per_command = (time.monotonic() - start) / 10
    print(f"namespace workspace: {per_command * 1000:.0f} ms per run('true')")
    assert per_command < 1.0
