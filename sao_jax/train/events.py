"""The learner's tensorboardX event files: written synchronously, read back in order.

    writer = EventWriter("runs/toy/tb", purge_step=None)
    writer.add_scalar("reward/mean", 0.5, step=1)
    writer.flush()  # every event added so far is now in the operating system's hands

    for event in read_events("runs/toy/tb"):
        for value in event.summary.value: ...

Event files are TFRecord streams: a little-endian uint64 length, a uint32 CRC of it, the
serialized `Event`, a uint32 CRC of that. Files are read in name order (their names hold the
creation time), so a resumed run's file comes after the killed run's.

Why not tensorboardX's `SummaryWriter`: it hands events to a writer thread through a
multiprocessing queue, and its `flush()` writes only what that thread has already dequeued. A
run killed right after a checkpoint then lost the checkpointed step's scalars, and the resume
(which purges only later steps) never wrote them again. `EventWriter` writes in the caller's
thread with tensorboardX's own event and summary builders, so `flush()` before a checkpoint
makes the log durable up to it; the cost is about 0.3 ms for a step's 25 scalars here.
"""

from __future__ import annotations

import glob
import logging
import os
import struct
import sys
import time
from collections.abc import Iterator


def _without_torch_import_tensorboardx() -> None:
    """Imports the tensorboardX package with torch hidden, unless torch is loaded already.
    The package's `__init__` imports its `SummaryWriter`, which imports torch when it is
    installed (to accept torch tensors), and any submodule import runs that `__init__`: 2.3 s
    of CPU at every learner start where torch is installed (the dev extra has it), for code
    this module never calls. A None in `sys.modules` makes `import torch` raise ImportError,
    which tensorboardX catches; the entry is removed after, so torch imports as usual later."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        return
    sys.modules["torch"] = None
    try:
        import tensorboardX  # noqa: F401
    finally:
        del sys.modules["torch"]


_without_torch_import_tensorboardx()

from tensorboardX import summary  # noqa: E402
from tensorboardX.event_file_writer import EventsWriter  # noqa: E402
from tensorboardX.proto.event_pb2 import Event, SessionLog  # noqa: E402

# tensorboardX logs "NaN or Inf found in input tensor" for every such scalar. Here a NaN is
# written on purpose, "nothing to measure this step" (the fresh rows' gap under injected lag,
# the routing split with no re-routed token), and a non-finite loss is the learner's to report
# (`skipped_steps`): the warning, once per tag and step, only buried the progress line.
logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)


class EventWriter:
    """The `add_scalar` / `add_text` / `flush` / `close` subset of `SummaryWriter`, synchronous.

    `purge_step=s` hides, in TensorBoard and in `read_events` consumers that honour it, every
    earlier event at a step >= s (tensorboardX's and TensorBoard's resume convention).
    """

    def __init__(self, logdir: str, purge_step: int | None = None):
        os.makedirs(logdir, exist_ok=True)
        # The name starts with the second (tensorboardX's format); the nanoseconds after it
        # keep two files of the same second apart and in creation order.
        self._file = EventsWriter(os.path.join(logdir, "events"), f".{time.time_ns()}")
        if purge_step is not None:
            self._write(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._summary(summary.scalar(tag, float(value)), step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self._summary(summary.text(tag, text), step)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def _summary(self, value, step: int) -> None:
        self._write(Event(summary=value, step=int(step)))

    def _write(self, event) -> None:
        event.wall_time = time.time()
        self._file.write_event(event)


def read_events(logdir: str) -> Iterator:
    """Every `tensorboardX.proto.event_pb2.Event` under `logdir`, file by file, in order."""
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            yield Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
