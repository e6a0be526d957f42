"""The processes of a uid, as /proc lists them: the sandbox and namespace tests check that none
of a run's processes outlive it."""

import os
import re
from pathlib import Path


def processes_of(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        match = re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE)
        if match and int(match.group(1)) == uid:
            pids.append(int(entry))
    return pids
