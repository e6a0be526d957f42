"""The prompts the stream tests lease, in their own module: the learner that test_stream.py runs
in a child process imports `prompt_source` from here."""

import grain


def prompt_source(n: int = 20):
    """The learner's prompt iterator: grain, checkpointable, the same definition on every start."""
    rows = [{"prompt_id": f"q{i}", "question": f"What is {i} + {i}?"} for i in range(n)]
    return grain.MapDataset.source(rows).to_iter_dataset()
