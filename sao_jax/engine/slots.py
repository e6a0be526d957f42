"""The embedded engine's requests and its KV-cache slots: which request holds each row, the
per-row inputs of the decode step, and the prefix cache (what a free row still holds).

`Slots` is bookkeeping on the host: the scheduler (`scheduler.py`) decides when a request takes,
advances or leaves a row, and runs the programs over the arrays this keeps. It touches no
device memory.

Prefix cache: a row keeps the keys and values of the request that left it (its prompt and all
but its last output token) until another request takes it. `choose` gives a new request the free
row holding the longest prefix of its prompt (at least `MIN_CACHED_PREFIX` tokens, and never the
whole prompt: the last prompt token's logits sample the first new token), else the lowest free
row. Nothing held is reused across a weight load (`new_weights`) or after `forget`.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from sao_jax.engine.programs import seed_words
from sao_jax.engine.sglang_api import RequestSpec

MIN_CACHED_PREFIX = 16  # shorter shared prefixes are prefilled again (the smallest bucket anyway)


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence in the engine: its spec, its tokens so far, where it runs."""

    spec: RequestSpec
    rid: str
    stop_ids: frozenset[int]
    future: asyncio.Future  # resolves to the reply dict
    created: float
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    ids_logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    input_logprobs: list[float] | None = None  # [i]: prompt token i + 1's, from position i
    input_ids_logprobs: list[list[float]] | None = None
    routed_experts: np.ndarray | None = None  # [tokens, layers, top-k] int32, once finished
    slot: int = -1
    version: str | None = None  # the weights that generated its tokens (set when admitted)
    max_batch: int = 0
    finish_reason: dict | None = None
    cached: int = 0  # prompt tokens whose keys and values its slot held already (prefix cache)
    weights: int = -1  # the engine's weight generation when it was prefilled (-1: not yet)
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # for streams


def common_prefix(a, b) -> int:
    """How many first elements two sequences share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Slots:
    """`max_batch` rows of `max_seq_len` positions: the request in each (None: free), the
    tokens a free row still holds, and the decode step's per-row inputs, packed by dtype so that
    a step sends three arrays (`decode_inputs`)."""

    def __init__(self, max_batch: int, max_seq_len: int):
        self.max_seq_len = max_seq_len
        self.requests: list[Request | None] = [None] * max_batch
        self.held_tokens: list[tuple[int, ...] | None] = [None] * max_batch
        self.weights = 0  # counts weight loads: a held prefix is only good under its own
        self._ints_Bx4 = np.zeros((max_batch, 4), np.int32)  # token, position, top_k, seeded
        self._floats_Bx2 = np.zeros((max_batch, 2), np.float32)  # temperature, top_p
        self._seed_Bx2 = np.zeros((max_batch, 2), np.uint32)
        self._tokens_B, self._positions_B, self._top_k_B, self._seeded_B = self._ints_Bx4.T
        self._temperature_B, self._top_p_B = self._floats_Bx2.T
        self._top_p_B[:] = 1.0

    @property
    def running(self) -> int:
        return len(self.requests) - self.requests.count(None)  # C-speed: asked often a step

    @property
    def has_free(self) -> bool:
        return None in self.requests

    def active(self) -> list[Request]:
        return [req for req in self.requests if req is not None]

    def choose(self, spec: RequestSpec) -> tuple[int, int]:
        """A free row for `spec` and how many of its prompt's first tokens that row holds
        already (the module's docstring). A request that wants its prompt's log-probs is
        prefilled whole."""
        free = [s for s, req in enumerate(self.requests) if req is None]
        if not spec.wants_input_logprobs:
            best, most = -1, MIN_CACHED_PREFIX - 1
            for s in free:
                held = self.held_tokens[s]
                if held is not None and len(held) > most:
                    n = min(common_prefix(held, spec.prompt), len(spec.prompt) - 1)
                    if n > most:
                        best, most = s, n
            if best >= 0:
                return best, most
        return free[0], 0

    def take(self, req: Request) -> None:
        """`req` takes the row `choose` gave it (`req.slot`, `req.cached`): what the row holds
        past `req.cached` is about to be overwritten."""
        self.requests[req.slot] = req
        self.held_tokens[req.slot] = None

    def start(self, req: Request) -> None:
        """`req`'s prompt is in its row (prefilled under the current weights): its sampling
        parameters go into the decode step's inputs."""
        slot, spec = req.slot, req.spec
        req.weights = self.weights
        self._positions_B[slot] = len(spec.prompt)
        self._temperature_B[slot] = spec.temperature
        self._top_p_B[slot], self._top_k_B[slot] = spec.top_p, spec.top_k
        self._seeded_B[slot] = spec.sampling_seed is not None
        self._seed_Bx2[slot] = seed_words(spec.sampling_seed or 0)

    def feed(self, slot: int, token: int) -> None:
        """The token the row feeds to the next decode step."""
        self._tokens_B[slot] = token

    def advance(self, slot: int) -> None:
        """A decode step wrote the row's next position."""
        self._positions_B[slot] += 1

    def leave(self, req: Request, *, keep_prefix: bool = True) -> None:
        """`req` leaves its row (finished or aborted); with `keep_prefix` the row goes on holding
        its keys and values (its prompt and all but its last output token) when they are of the
        current weights."""
        slot = req.slot
        if keep_prefix and req.weights == self.weights:
            self.held_tokens[slot] = (*req.spec.prompt, *req.output[:-1])
        self.requests[slot] = None
        # A free row inside a decode step's rows is stepped too: past the row's end its key and
        # value are dropped, and the prefix it holds stays intact.
        self._tokens_B[slot], self._positions_B[slot] = 0, self.max_seq_len
        self._seeded_B[slot] = False
        req.slot = -1

    def forget(self) -> None:
        """No row holds a prefix any more (`/flush_cache`; the caches were lost)."""
        self.held_tokens = [None] * len(self.requests)

    def new_weights(self) -> None:
        """The weights changed: the held prefixes are of the old ones."""
        self.weights += 1
        self.forget()

    def decode_inputs(self, n: int, seeded: bool) -> tuple[np.ndarray, ...]:
        """Rows [0, n)'s inputs, copied (the program reads them after the host moves on): ints
        `[n, 4]` (token, position, top_k, seeded), floats `[n, 2]` (temperature, top_p) and,
        with `seeded`, the seeds `[n, 2]` (else None)."""
        return (self._ints_Bx4[:n].copy(), self._floats_Bx2[:n].copy(),
                self._seed_Bx2[:n].copy() if seeded else None)
