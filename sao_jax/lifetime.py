"""Children die with their parent: engines and workers watch the process that started them."""

from __future__ import annotations

import logging
import os
import threading
import time

EXIT_PARENT_DIED = 3
log = logging.getLogger(__name__)


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> threading.Thread:
    """Exits this process as soon as `parent_pid` is no longer its parent (the parent died and
    the process was re-parented), polling every `interval_s` seconds on a daemon thread.

    Polling rather than `PR_SET_PDEATHSIG`: the signal fires when the parent *thread* that
    started us exits, which is not the parent process dying.
    """

    def watch():
        while True:
            if os.getppid() != parent_pid:
                log.warning("parent process %d is gone: exiting", parent_pid)
                logging.shutdown()
                os._exit(EXIT_PARENT_DIED)
            time.sleep(interval_s)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
