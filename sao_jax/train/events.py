"""Reading the learner's tensorboardX event files back (tests, benchmarks, notebooks).

    for event in read_events("runs/toy/tb"):
        for value in event.summary.value: ...

Event files are TFRecord streams: a little-endian uint64 length, a uint32 CRC of it, the
serialized `Event`, a uint32 CRC of that. Files are read in name order (their names start with
the creation time), so a resumed run's file comes after the killed run's.
"""

from __future__ import annotations

import glob
import os
import struct
from collections.abc import Iterator


def read_events(logdir: str) -> Iterator:
    """Every `tensorboardX.proto.event_pb2.Event` under `logdir`, file by file, in order."""
    from tensorboardX.proto import event_pb2

    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            yield event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
