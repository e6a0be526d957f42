"""Checks that both workspace backends must pass (tests/envs/swe/test_namespace.py and
test_container.py)."""


def a_write_past_the_disk_bound_fails_and_the_workspace_goes_on(ws) -> str:
    """With `disk_bytes` of 16 MiB: a second 10 MB file fails with ENOSPC under the repository and
    under /tmp, and once the files are gone the repository takes a new one. Returns the error
    line the shell printed."""
    for where in ("/testbed", "/tmp"):
        result = ws.run(f"cd {where}; head -c 10M /dev/zero > a; echo rc=$?; "
                        "head -c 10M /dev/zero > b; echo rc=$?", timeout=30)
        assert result.returncode == 0, result.output
        lines = result.output.splitlines()
        assert lines[0] == "rc=0" and lines[-1] == "rc=1", result.output
        assert "No space left on device" in lines[1], result.output
    result = ws.run("rm a b && head -c 10M /dev/zero > c && echo ok && git status --short",
                    timeout=30)
    assert result.output == "ok\n?? c\n", result.output
    return lines[1]
