"""The sandbox runs ordinary code, contains hostile code, and runs nothing without isolation.

Live tests need what the sandbox needs (Linux, root, util-linux); where that is missing they are
skipped with the reason, unless SAO_REQUIRE_SANDBOX=1 turns the skip into a failure.
"""

import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from sao_jax.envs import sandbox
from sao_jax.envs.sandbox import SandboxConfig, SandboxUnavailable, check_isolation, run_python
from tests.envs.processes import processes_of

REPO = Path(__file__).resolve().parents[2]
# Small limits that end hostile snippets quickly. The wall-clock limit sits far above the CPU
# limit (1 s soft, 2 s hard): on a busy machine (`make test` beside two busy loops) a snippet gets
# a fraction of a core, and with a wall limit of a few seconds it was the wall clock, not the CPU
# limit under test, that ended it. Passing tests never wait for it.
FAST = SandboxConfig(cpu_seconds=1, wall_seconds=60, max_processes=16, output_bytes=4096)


def assert_no_processes_left(uid: int) -> None:
    deadline = time.monotonic() + 3
    while processes_of(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_of(uid) == [], f"sandbox processes of uid {uid} outlived the run"


# ------------------------------------------------------------------------------- ordinary code

def test_runs_code_and_reports_output(isolated):
    code = ("import json, math, fractions, decimal, itertools, re, sys\n"
            "print(math.comb(10, 3), fractions.Fraction(3, 4) + fractions.Fraction(1, 4))\n"
            "print('to stderr', file=sys.stderr)\n"
            "sys.exit(3)\n")
    result = run_python(code)
    assert result.stdout == "120 1\n"
    assert result.stderr == "to stderr\n"
    assert (result.exit_code, result.killed_by, result.timed_out, result.truncated) == (
        3, None, False, False)
    assert result.describe() == "exit code 3"
    assert result.uid != 0 and result.cpu_seconds is not None


def test_traceback_points_at_the_snippet(isolated):
    result = run_python("x = 1\nraise ValueError(f'bad {x}')\n")
    assert result.exit_code == 1
    assert 'snippet.py", line 2' in result.stderr
    assert "ValueError: bad 1" in result.stderr


def test_working_directory_is_private_and_writable(isolated):
    code = ("import os\n"
            "open('notes.txt', 'w').write('kept')\n"
            "print(os.getcwd(), open('notes.txt').read(), sorted(os.listdir('.')))\n")
    result = run_python(code)
    assert result.stdout == "/tmp kept ['notes.txt', 'snippet.py']\n"
    assert not Path("/tmp/notes.txt").exists()


def test_site_packages_on_request(isolated):
    pytest.importorskip("numpy")
    code = "import numpy\nprint(int(numpy.arange(5).sum()))\n"
    assert run_python(code).exit_code == 1  # standard library only by default
    result = run_python(code, SandboxConfig(site_packages=True))
    assert result.stdout == "10\n", result.stderr


def test_concurrent_runs_are_independent(isolated):
    results = [None] * 4

    def work(i):
        results[i] = run_python(f"print({i} * {i})")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout for r in results] == ["0\n", "1\n", "4\n", "9\n"]
    assert len({r.uid for r in results}) == 4


# ------------------------------------------------------------------------------ hostile code

def test_infinite_loop_hits_the_cpu_limit(isolated):
    result = run_python("print('spinning')\nwhile True:\n    pass\n", FAST)
    assert result.killed_by == "SIGXCPU" and result.exit_code is None
    assert result.stdout == "spinning\n"  # unbuffered: output before the kill survives
    assert "CPU time limit of 1 s" in result.describe(FAST)
    assert not result.timed_out


def test_ignoring_sigxcpu_still_ends_at_the_hard_limit(isolated):
    code = ("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
            "while True:\n    pass\n")
    result = run_python(code, FAST)
    assert result.killed_by == "SIGKILL" and not result.timed_out
    assert "CPU time limit" in result.describe(FAST)


def test_sleeping_forever_hits_the_wall_clock(isolated):
    config = SandboxConfig(wall_seconds=1.0)
    result = run_python("import time\nprint('before')\ntime.sleep(1000)\n", config)
    assert result.timed_out and result.killed_by == "SIGKILL"
    assert result.stdout == "before\n"
    assert 1.0 <= result.wall_seconds < 10  # not the 1000 s of the sleep (slack for a busy box)
    assert result.describe(config) == "killed: wall-clock limit of 1 s reached"
    assert_no_processes_left(result.uid)


def test_process_limit_refuses_forks(isolated):
    code = ("import os, time\n"
            "n = 0\n"
            "while True:\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except OSError as e:\n"
            "        print('refused after', n, e.errno)\n"
            "        break\n"
            "    if pid == 0:\n"
            "        time.sleep(60)\n"
            "        os._exit(0)\n"
            "    n += 1\n")
    result = run_python(code, FAST)
    match = re.fullmatch(r"refused after (\d+) (\d+)\n", result.stdout)
    assert match, result.stdout + result.stderr
    assert int(match.group(1)) < FAST.max_processes and int(match.group(2)) == 11  # EAGAIN
    assert not result.timed_out  # the sleeping children died with the main process
    assert_no_processes_left(result.uid)


def test_daemons_die_with_the_snippet(isolated):
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        os.close(1)\n"
            "        os.close(2)\n"
            "        time.sleep(60)\n"
            "    os._exit(0)\n"
            "os.wait()\n"
            "print('main done')\n")
    result = run_python(code, FAST)
    assert result.stdout == "main done\n" and not result.timed_out  # the daemon died with it
    assert_no_processes_left(result.uid)


def test_fork_bomb_is_contained_and_the_worker_stays_responsive(isolated):
    bomb = ("import os\n"
            "while True:\n"
            "    try:\n"
            "        os.fork()\n"
            "    except OSError:\n"
            "        pass\n")
    config = SandboxConfig(cpu_seconds=3, wall_seconds=3, max_processes=16)
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", run_python(bomb, config)))
    thread.start()
    time.sleep(0.5)  # the bomb is at its process limit now
    start = time.monotonic()
    meanwhile = run_python("print('still here')")
    assert meanwhile.stdout == "still here\n"
    assert time.monotonic() - start < 2.5
    thread.join()
    result = box["result"]
    assert result.timed_out and result.killed_by == "SIGKILL"
    assert result.wall_seconds < config.wall_seconds + 10  # ended by its wall limit
    assert_no_processes_left(result.uid)


def test_memory_bomb_fails_cleanly(isolated):
    config = SandboxConfig(memory_bytes=256 << 20)
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(32 << 20))\n"
    result = run_python(hog, config)
    assert result.exit_code == 1 and "MemoryError" in result.stderr
    result = run_python("x = bytearray(1 << 40)\n", config)
    assert "MemoryError" in result.stderr


def test_writes_outside_the_working_directory_fail(isolated):
    token = secrets.token_hex(4)
    targets = [REPO / f"pwned_{token}", Path(f"/etc/pwned_{token}"), Path(f"/usr/pwned_{token}"),
               Path(f"/var/tmp/pwned_{token}"), Path(f"/root/pwned_{token}"),
               Path(f"/pwned_{token}"), Path(f"/dev/pwned_{token}")]
    code = (f"targets = {[str(t) for t in targets]!r}\n"
            "for path in targets:\n"
            "    try:\n"
            "        open(path, 'w').write('x')\n"
            "        print('WROTE', path)\n"
            "    except OSError as e:\n"
            "        print('refused', e.strerror)\n"
            f"open('/tmp/pwned_{token}', 'w').write('x')  # the sandbox's own /tmp\n"
            f"open('/dev/shm/pwned_{token}', 'w').write('x')  # a link to it\n"
            "print('own tmp ok')\n")
    result = run_python(code)
    assert "WROTE" not in result.stdout
    # Read-only everywhere; a checkout under /tmp is not even visible (the sandbox has its own).
    refusals = result.stdout.splitlines()[: len(targets)]
    assert all(line in ("refused Read-only file system", "refused No such file or directory")
               for line in refusals), refusals
    assert result.stdout.endswith("own tmp ok\n")
    for path in [*targets, Path(f"/tmp/pwned_{token}"), Path(f"/dev/shm/pwned_{token}")]:
        assert not path.exists(), path


def test_file_size_and_disk_limits(isolated):
    config = SandboxConfig(file_size_bytes=1 << 20, disk_bytes=4 << 20)
    code = ("try:\n"
            "    open('big', 'wb').write(b'x' * (2 << 20))\n"
            "except OSError as e:\n"
            "    print(e.strerror)\n"
            "try:\n"
            "    for i in range(8):\n"
            "        open(f'part{i}', 'wb').write(b'x' * (1 << 20))\n"
            "except OSError as e:\n"
            "    print(e.strerror)\n")
    assert run_python(code, config).stdout == "File too large\nNo space left on device\n"


def test_no_network_not_even_loopback(isolated):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    code = ("import socket\n"
            "for family, address in [(socket.AF_INET, ('127.0.0.1', PORT)),\n"
            "                        (socket.AF_INET, ('8.8.8.8', 53))]:\n"
            "    s = socket.socket(family)\n"
            "    s.settimeout(2)\n"
            "    try:\n"
            "        s.connect(address)\n"
            "        print('CONNECTED', address)\n"
            "    except OSError as e:\n"
            "        print('refused', e.strerror)\n"
            "print([name for _, name in socket.if_nameindex()])\n").replace("PORT", str(port))
    try:
        result = run_python(code)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert result.stdout == ("refused Network is unreachable\n" * 2) + "['lo']\n"


def test_environment_secrets_do_not_leak(isolated, monkeypatch):
    secret = f"xyz-{secrets.token_hex(8)}"
    monkeypatch.setenv("SAO_SECRET", secret)
    code = ("import glob, os\n"
            "print(dict(os.environ))\n"
            "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
            "    try:\n"
            "        print(path, open(path, 'rb').read())\n"
            "    except OSError as e:\n"
            "        print(path, e.strerror)\n")
    result = run_python(code)
    assert result.exit_code == 0
    assert "HOME': '/tmp'" in result.stdout
    assert "SAO_SECRET" not in result.stdout + result.stderr
    assert secret not in result.stdout + result.stderr


def test_runs_as_an_unprivileged_user_and_cannot_regain_root(isolated):
    code = ("import ctypes, os, subprocess\n"
            "print(subprocess.run(['id'], capture_output=True, text=True).stdout.strip())\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "print('setuid', libc.setuid(0), ctypes.get_errno(), os.getuid())\n"
            "try:\n"
            "    os.setuid(0)\n"
            "except OSError as e:\n"
            "    print('os.setuid', e.strerror)\n"
            "print('userns', libc.unshare(0x10000000), ctypes.get_errno())\n"
            "new_ns = subprocess.run(['unshare', '--user', '--map-root-user', 'id'],\n"
            "                        capture_output=True, text=True)\n"
            "print('unshare', new_ns.returncode, new_ns.stdout.strip())\n")
    result = run_python(code)
    uid = result.uid
    assert result.stdout.splitlines() == [
        f"uid={uid} gid={uid} groups={uid}",
        f"setuid -1 1 {uid}",  # EPERM
        "os.setuid Operation not permitted",
        "userns -1 1",  # no user namespaces inside the chroot: no namespaced root either
        "unshare 1 ",
    ]


def test_output_flood_is_capped_and_killed(isolated):
    result = run_python("print('x' * 10_000_000)\n", FAST)
    assert result.stdout_truncated and not result.stderr_truncated
    assert len(result.stdout) == FAST.output_bytes
    assert result.killed_by == "SIGKILL" and not result.timed_out
    assert "output limit (4096 bytes) exceeded" in result.describe(FAST)
    result = run_python("import sys\nwhile True:\n    sys.stderr.write('e' * 1000)\n", FAST)
    assert result.stderr_truncated and len(result.stderr) == FAST.output_bytes


def test_kill_tricks_do_not_reach_the_parent(isolated):
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        code = ("import os, signal\n"
                f"for pid in (-1, 1, {bystander.pid}, {os.getpid()}):\n"
                "    try:\n"
                "        os.kill(pid, signal.SIGKILL)\n"
                "        print(pid, 'sent')\n"
                "    except OSError as e:\n"
                "        print(pid, e.strerror)\n"
                "print('survived')\n")
        result = run_python(code)
        assert bystander.poll() is None, "a process outside the sandbox was killed"
        lines = result.stdout.splitlines()
        assert "1 Operation not permitted" in lines  # the namespace's init is root
        assert f"{bystander.pid} No such process" in lines or bystander.pid < 10
        assert lines[-1] == "survived"
        assert run_python("print('next run fine')").stdout == "next run fine\n"
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait()


# ------------------------------------------------------------------------- the view: allow-list

@pytest.fixture
def host_dir():
    """A fresh host directory that the sandbox does not show (not under an allow-listed path, nor
    under /tmp, which the sandbox replaces); mounts made in it are undone afterwards."""
    path = Path(tempfile.mkdtemp(prefix="sao-sandbox-test-", dir="/var/lib"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        mounts = Path("/proc/self/mountinfo").read_bytes().splitlines()
        ours = bytes(path) + b"/"
        for line in reversed(mounts):
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]),
                           line.split(b" ")[4])
            if point.startswith(ours):
                subprocess.run(["umount", "-l", point], check=True)
        shutil.rmtree(path)


def test_only_the_allow_list_is_visible(isolated):
    # Before: the whole host was bound, so a snippet could read the task data next to the
    # repository (answers, hence reward) and anything else not in a short list of hidden paths.
    data_file = next(p for p in (REPO / "experiments" / "data").rglob("*") if p.is_file())
    probes = [REPO, data_file, Path(__file__), Path("/root/.bashrc"), Path("/home"), Path("/var"),
              Path("/run"), Path("/srv"), Path("/mnt"), Path("/opt"), Path("/sys"),
              Path("/work"), Path("/boot")]
    code = (f"import os\nfor path in {[str(p) for p in probes]!r}:\n"
            "    print(path, os.path.lexists(path))\n"
            "print(sorted(os.listdir('/')))\n"
            "print(sorted(os.listdir('/dev')))\n")
    result = run_python(code)
    lines = result.stdout.splitlines()
    assert lines[:-2] == [f"{p} False" for p in probes], result.stdout + result.stderr
    prefix = Path(sandbox.SandboxConfig().python).resolve().parents[1]
    allowed = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "proc",
               "tmp", "sandbox", prefix.parts[1]}
    assert set(eval(lines[-2])) <= allowed, lines[-2]
    assert set(eval(lines[-1])) <= {"null", "zero", "full", "random", "urandom", "tty", "fd",
                                    "stdin", "stdout", "stderr", "shm"}, lines[-1]


def test_system_tools_and_interpreters_are_there(isolated):
    which = "import os, sys; print(os.path.realpath(sys.executable))"
    code = ("import subprocess, sys\n"
            "print(sys.prefix)\n"
            f"for argv in (['python', '-c', {which!r}],\n"
            "             ['python3', '-c', 'print(1)'], ['sh', '-c', 'echo sh'],\n"
            "             ['ls', '/sandbox/bin']):\n"
            "    print(subprocess.run(argv, capture_output=True, text=True).stdout.strip())\n")
    result = run_python(code, SandboxConfig(max_processes=64))
    python = SandboxConfig().python
    assert result.stdout.splitlines() == [
        str(Path(python).resolve().parents[1]), python, "1", "sh", "python", "python3"], (
        result.stdout + result.stderr)


def test_readonly_paths_are_shown_read_only(isolated, host_dir):
    (host_dir / "notes.txt").write_text("readable")
    (host_dir / "notes.txt").chmod(0o644)
    code = (f"print(open('{host_dir}/notes.txt').read())\n"
            "try:\n"
            f"    open('{host_dir}/new', 'w')\n"
            "except OSError as e:\n"
            "    print(e.strerror)\n")
    result = run_python(code, SandboxConfig(readonly_paths=(str(host_dir),)))
    assert result.stdout == "readable\nRead-only file system\n", result.stderr
    with pytest.raises(ValueError, match="absolute path"):
        SandboxConfig(readonly_paths=("relative",))
    with pytest.raises(SandboxUnavailable, match="outside /proc, /dev, /tmp"):
        check_isolation(SandboxConfig(readonly_paths=("/tmp",)))


def test_mounts_with_odd_names_are_read_only_too(isolated, host_dir):
    # Before: mountinfo was decoded with `unicode_escape` on str, which mangles non-ASCII names;
    # statvfs then failed on the mangled path and the mount was skipped, so it stayed writable.
    names = ["with space", "ünïcode", "tab\there", os.fsdecode(b"latin1-caf\xe9")]
    for name in names:
        (host_dir / name).mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0777,size=1m", "sao-test",
                        host_dir / name], check=True)
    code = (f"for name in {names!r}:\n"
            "    try:\n"
            f"        open('{host_dir}/' + name + '/pwned', 'w').write('x')\n"
            "        print('WROTE', ascii(name))\n"
            "    except OSError as e:\n"
            "        print(e.strerror)\n")
    result = run_python(code, SandboxConfig(readonly_paths=(str(host_dir),)))
    assert result.stdout == "Read-only file system\n" * len(names), result.stdout + result.stderr
    assert not any((host_dir / name / "pwned").exists() for name in names)


def test_sandbox_mounts_are_parsed_as_bytes():
    line = rb"61 58 0:70 / /tmp/root/srv/a\040b/\303\274\134x rw,nosuid - tmpfs t rw"
    escaped = sandbox.init._OCTAL_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]),
                                             line.split(b" ")[4])
    assert escaped == "/tmp/root/srv/a b/ü\\x".encode()


def _serve_unix(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    path.chmod(0o777)
    server.listen()
    server.settimeout(0.5)
    return server


_CONNECT = ("import socket\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            "    s.connect(PATH)\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print(e.strerror)\n")


def test_host_unix_sockets_are_out_of_reach(isolated, host_dir):
    # Before: a world-writable pathname socket anywhere outside the hidden paths was reachable.
    server = _serve_unix(host_dir / "daemon.sock")
    try:
        result = run_python(_CONNECT.replace("PATH", repr(str(host_dir / "daemon.sock"))))
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert result.stdout == "No such file or directory\n", result.stderr


def test_sockets_in_readonly_paths_stay_reachable(isolated, host_dir):
    # The documented limit: a read-only mount does not stop connect(2). This pins it down, so a
    # change that closes it updates the docstring too.
    server = _serve_unix(host_dir / "daemon.sock")
    try:
        result = run_python(_CONNECT.replace("PATH", repr(str(host_dir / "daemon.sock"))),
                            SandboxConfig(readonly_paths=(str(host_dir),)))
    finally:
        server.close()
    assert result.stdout == "connected\n", result.stderr
    assert "connect(2) to a listening Unix socket works on a read-only mount" in " ".join(
        sandbox.__doc__.split())


# ------------------------------------------------------------------------------------ keyrings

def _keyctl(*args) -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    number = sandbox.execute.seccomp_filter()["numbers"]["keyctl"]
    result = libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
    return result, ctypes.get_errno()


def test_keyring_calls_are_refused_and_the_session_keyring_is_private(isolated):
    # Before: the snippet held the worker's session keyring, and add_key/keyctl worked, so a run
    # could read keys, leave keys in the kernel and pass data to the next run through them.
    worker_keyring, err = _keyctl(0, -3, 0)  # KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING
    if worker_keyring < 0:
        pytest.skip(f"no session keyring to compare with here (errno {err})")
    numbers = sandbox.execute.seccomp_filter()["numbers"]
    code = ("import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.syscall.restype = ctypes.c_long\n"
            "L = ctypes.c_long\n"
            f"calls = {{'add_key': [L({numbers['add_key']}), b'user', b'sao-leak', b'data',"
            " L(4), L(-4)],\n"
            f"         'keyctl': [L({numbers['keyctl']}), L(0), L(-3), L(0)],\n"
            f"         'request_key': [L({numbers['request_key']}), b'user', b'sao-leak', None,"
            " L(0)]}\n"
            "for name, args in calls.items():\n"
            "    result = libc.syscall(*args)\n"
            "    print(name, result if result >= 0 else os.strerror(ctypes.get_errno()))\n"
            "print(open('/proc/keys').read())\n")
    result = run_python(code)
    lines = result.stdout.splitlines()
    assert lines[:3] == ["add_key Function not implemented", "keyctl Function not implemented",
                         "request_key Function not implemented"], result.stdout + result.stderr
    assert f"{worker_keyring:08x}" not in "\n".join(lines[3:])


def test_a_filter_that_does_not_load_runs_nothing(isolated, monkeypatch, tmp_path):
    bad = dict(sandbox.execute.seccomp_filter(), bpf="00" * 8)  # one invalid BPF instruction
    monkeypatch.setattr(sandbox.execute, "seccomp_filter", lambda: bad)  # _init_spec's
    with pytest.raises(SandboxUnavailable, match="PR_SET_SECCOMP"):
        run_python("print('ran')")


def test_refuses_without_pyseccomp(monkeypatch):
    monkeypatch.setattr(sandbox.isolation, "_verified", set())

    def missing():
        raise ImportError("No module named 'pyseccomp'")

    monkeypatch.setattr(sandbox.isolation, "seccomp_filter", missing)
    with pytest.raises(SandboxUnavailable, match="seccomp filter.*pyseccomp"):
        run_python("print(1)")


# ---------------------------------------------------------------------------------- run_program

def test_run_program_merges_output_feeds_stdin_and_binds_a_writable_dir(isolated, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    uid = sandbox.UID_RANGE[0] + 12345
    os.chown(work, uid, uid)
    config = SandboxConfig(uid=uid, max_processes=64)
    script = "echo out; echo err >&2; echo out2; cat; pwd; id -u; echo kept > file; ls /"
    result = sandbox.run_program(["bash", "-c", script], config, input="from stdin\n",
                                 cwd="/work", writable={str(work): "/work"})
    lines = result.stdout.splitlines()
    assert lines[:6] == ["out", "err", "out2", "from stdin", "/work", str(uid)], result.stdout
    assert "work" in lines[6:]
    assert result.exit_code == 0 and result.stderr == ""
    assert (work / "file").read_text() == "kept\n"
    big = "x" * (1 << 20)  # more than a pipe holds
    result = sandbox.run_program(["wc", "-c"], config, input=big)
    assert result.stdout.strip() == str(1 << 20)
    with pytest.raises(ValueError, match="overlaps /usr"):
        sandbox.run_program(["true"], config, writable={str(work): "/usr/x"})


# ---------------------------------------------------------------------------- fail closed

@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(sandbox.isolation, "_verified", set())


def test_refuses_without_unshare_and_setpriv(fresh_cache, monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox.isolation.shutil, "which", lambda *a, **k: None)
    marker = tmp_path / "ran"
    with pytest.raises(SandboxUnavailable, match=r"`unshare` from util-linux.*`setpriv`"):
        run_python(f"open({str(marker)!r}, 'w')")
    assert not marker.exists()


def test_refuses_without_root(fresh_cache, monkeypatch):
    monkeypatch.setattr(sandbox.isolation.os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match="root.*uid 1000"):
        run_python("print(1)")


def test_refuses_without_an_interpreter(fresh_cache):
    with pytest.raises(SandboxUnavailable, match="executable interpreter at /nonexistent/python"):
        run_python("print(1)", SandboxConfig(python="/nonexistent/python"))


def test_refuses_when_the_probe_finds_a_hole(isolated, fresh_cache, monkeypatch):
    # A probe that reports what a broken sandbox would look like: root, with the network up.
    fake = ('{"uid": 0, "euid": 0, "gid": 0, "groups": [], "pid": 2, "interfaces": ["lo", "eth0"],'
            ' "root_writable": false, "cwd": "/tmp", "cwd_writable": true, "cap_eff": 0,'
            ' "cap_bnd": 0, "no_new_privs": 1, "network": "connected", "top": ["usr", "work"],'
            ' "add_key": "added"}')
    monkeypatch.setattr(sandbox.isolation, "_PROBE", f"print({fake!r})")
    with pytest.raises(SandboxUnavailable, match="code running as uid 0.*network reachable.*"
                       r"allow-list: \['work'\].*add_key not refused"):
        run_python("print(1)")


def test_config_is_validated():
    with pytest.raises(ValueError, match="wall_seconds must be positive"):
        SandboxConfig(wall_seconds=0)
    with pytest.raises(ValueError, match="unprivileged uid"):
        SandboxConfig(uid=0)
    with pytest.raises(ValueError, match="absolute path"):
        SandboxConfig(python="python3")
