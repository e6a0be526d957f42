"""The engines' own counters as TensorBoard scalars (`engine/...`), read from `/server_info`.

Where a rollout's time goes is the engine's to say: how many requests it prefilled (an aborted
request is prefilled again when it is resubmitted), how many decode steps it ran and how many
tokens they gave, so how full its batches were, and the seconds its prefills and decode steps
took (`prefill_s`, `decode_s`: wall time of the compute calls, the wait for a CPU included),
and how many prompt tokens it prefilled and found in its prefix cache (`prefill_tokens`,
`cached_tokens`: a multi-turn episode's next turn reuses its previous turn's keys and values).
The embedded engine reports these counters (`engine.scheduler`); SGLang's `/server_info` does
not, and gives no `engine/` scalars.

Every `EVERY` steps the learner asks each engine, with a short timeout, and writes the sums over
the engines that answered. The counters run from each engine's start (an engine restarted starts
again from zero).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence

EVERY = 10  # learner steps between two reads
TIMEOUT_S = 1.0  # per engine: a busy engine is skipped, not waited for
COUNTERS = ("prefills", "decode_steps", "decode_tokens", "finish_stop", "finish_length",
            "finish_abort", "prefill_s", "decode_s", "prefill_tokens", "cached_tokens")


def read(urls: Sequence[str], timeout_s: float = TIMEOUT_S) -> dict[str, float]:
    """The engines' summed counters as scalars: `engine/<counter>` for each of COUNTERS, and
    `engine/decode_batch_mean` (tokens per decode step) and `engine/aborted_frac` (of finished
    requests). Empty when no engine answered with them."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    answered = 0
    for url in urls:
        try:
            with urllib.request.urlopen(url + "/server_info", timeout=timeout_s) as reply:
                info = json.load(reply)
        except (OSError, ValueError):  # unreachable, slow, or not JSON: skipped this time
            continue
        if not isinstance(info, dict) or "decode_batch_sizes" not in info:
            continue  # not the embedded engine (SGLang has none of these counters)
        answered += 1
        for name in COUNTERS:
            value = info.get(name, 0)
            totals[name] += float(value) if isinstance(value, int | float) else 0.0
    if not answered:
        return {}
    finished = totals["finish_stop"] + totals["finish_length"] + totals["finish_abort"]
    scalars = {f"engine/{name}": value for name, value in totals.items()}
    scalars["engine/decode_batch_mean"] = totals["decode_tokens"] / max(totals["decode_steps"], 1)
    scalars["engine/aborted_frac"] = totals["finish_abort"] / max(finished, 1)
    return scalars
