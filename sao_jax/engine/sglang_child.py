"""One SGLang server as a child of the learner that dies with it, even when the learner is
SIGKILLed. Run by SGLang's own interpreter (its virtualenv has no sao_jax), so it uses the
standard library only:

    <sglang venv>/bin/python sao_jax/engine/sglang_child.py <launch_server arguments> \\
        --parent-pid PID

It starts `python -m sglang.launch_server <arguments>` in a process group of its own, polls
`PID`, and stops the whole group (the server, its scheduler and detokenizer processes) when that
process is gone or when it is itself told to stop (SIGTERM, SIGINT): SIGTERM to the server, then
SIGKILL to the group after `GRACE_S`. Its exit code is the server's (or 3 when the parent died).
Should this process itself be killed, the server gets SIGKILL from the kernel
(`PR_SET_PDEATHSIG`; this process has one thread, so the signal means its death), and SGLang's
own processes follow theirs.
"""

import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE_S = 5.0
EXIT_PARENT_DIED = 3  # as sao_jax.lifetime
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the server, before it runs: SIGKILL when this process dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def stop(server: subprocess.Popen) -> None:
    """Stops the server and every process of its group."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)  # its children, whether it exited or not
    except (ProcessLookupError, PermissionError):
        pass
    server.wait()


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[-2] != "--parent-pid":
        print("usage: sglang_child.py <sglang.launch_server arguments> --parent-pid PID",
              file=sys.stderr)
        return 2
    parent, args = int(argv[-1]), argv[:-2]
    server = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", *args],
                              start_new_session=True, preexec_fn=_die_with_parent)
    told = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: told.append(signum))
    while server.poll() is None:
        if told or os.getppid() != parent:
            stop(server)
            return EXIT_PARENT_DIED if not told else 0
        time.sleep(0.2)
    stop(server)  # what the server left behind
    return server.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
