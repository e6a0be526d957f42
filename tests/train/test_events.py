"""The learner's event files: durable at `flush()`, readable in order, purge on resume."""

import subprocess
import sys

from sao_jax.train.events import EventWriter, read_events

KILLED_AFTER_FLUSH = """
import os, signal, sys
from sao_jax.train.events import EventWriter
writer = EventWriter(sys.argv[1])
for step in range(1, 6):
    writer.add_scalar("reward/mean", step / 10, step)
writer.add_text("samples", "a transcript", 5)
writer.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def scalars(logdir):
    return [(e.step, v.tag, round(v.simple_value, 6)) for e in read_events(logdir)
            for v in e.summary.value if v.HasField("simple_value")]


def test_flushed_events_survive_a_sigkill(tmp_path):
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_FLUSH, str(tmp_path)])
    assert proc.returncode == -9
    assert scalars(tmp_path) == [(s, "reward/mean", s / 10) for s in range(1, 6)]
    texts = [v.tag for e in read_events(tmp_path) for v in e.summary.value
             if not v.HasField("simple_value")]
    assert texts == ["samples/text_summary"]


def test_a_resumed_writer_marks_its_purge_step_in_a_later_file(tmp_path):
    first = EventWriter(str(tmp_path))
    first.add_scalar("critic/loss", 1.0, 1)
    first.close()
    second = EventWriter(str(tmp_path), purge_step=2)
    second.add_scalar("critic/loss", 0.5, 2)
    second.close()
    events = list(read_events(tmp_path))
    starts = [e.step for e in events if e.HasField("session_log")]
    assert starts == [2]
    assert [e.file_version for e in events if e.file_version] == ["brain.Event:2"] * 2
    assert scalars(tmp_path) == [(1, "critic/loss", 1.0), (2, "critic/loss", 0.5)]


def test_the_writer_does_not_import_torch_and_torch_still_imports_after():
    """tensorboardX's package imports torch when it is installed (2.3 s of every learner's
    start here); the event writer imports it with torch hidden, and hides nothing after."""
    code = ("import sys\nimport sao_jax.train.events\nprint('torch' in sys.modules)\n"
            "import torch\nprint(torch.ones(2).sum().item())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.split() == ["False", "2.0"], done.stdout + done.stderr


def test_a_nan_scalar_is_written_without_a_warning(tmp_path, caplog):
    """NaN is a value the learner writes on purpose ("nothing to measure"): written as it is,
    and tensorboardX's warning about it kept out of the run's output."""
    writer = EventWriter(str(tmp_path))
    writer.add_scalar("policy/logp_mismatch_fresh", float("nan"), step=1)
    writer.close()
    values = [v.simple_value for e in read_events(str(tmp_path)) for v in e.summary.value]
    assert len(values) == 1 and values[0] != values[0]
    assert "NaN" not in caplog.text
