"""The learner's prompt leases (`Leases`) and the prompts they carry (`prompt_message`).

A prompt drawn from the prompt source is leased `group_size` times, as a group: every lease of the
draw carries the same integer `group_id` (and the prompt's row, `prompt_index`, when the source's
element has an "index"), and a lease issued again in place of a discarded trajectory keeps both
under a new lease id. Lease ids are opaque: nothing reads a group or a slot back out of one.

A lease is outstanding from its issue until an accepted trajectory answers it. It is handed to
the worker that leased it, its owner, until it expires or that worker gives it back (a rejected
answer or a failed episode): then it waits to be issued again, up to `MAX_ATTEMPTS` attempts in
all, after which the prompt is given up. Only the owner can give a lease back: a rejection or a
failure report from another worker that names it changes nothing.

A closed lease (answered or given up) is remembered, its prompt's ids only, for the last
`CLOSED_MEMORY` closings: a late answer to it (an expired lease answered twice) is checked
against its prompt like any other, and a lease id that is neither outstanding nor remembered was
never issued here (`known`).
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from sao_jax.rollout.proto import trajectory_pb2 as pb

# A lease whose answers were rejected this many times is given up (a prompt that cannot yield a
# valid trajectory, e.g. one too long for max_length, must not circulate forever).
MAX_ATTEMPTS = 3

# Closed leases remembered for late answers: at ~100 bytes each, 6.5 MB at most, and far more
# than the leases of the few steps an answer can be late by.
CLOSED_MEMORY = 1 << 16


class Leases:
    """Outstanding leases, their owners and attempts; the prompts of accepted trajectories.

    Not thread-safe: `TrajectoryServer` holds its lock around every call.
    """

    def __init__(self):
        self._outstanding: dict[str, pb.Prompt] = {}  # lease id -> prompt, not yet answered
        self._fulfilled: dict[str, pb.Prompt] = {}  # trajectory id -> its lease's prompt
        self._pending: collections.deque[str] = collections.deque()  # lease ids to issue again
        self._handed: dict[str, tuple[float, str]] = {}  # lease id -> (when, owner)
        self._attempts: collections.Counter[str] = collections.Counter()  # given back
        # lease id -> (prompt_id, group_id, prompt_index or None) of the last closed leases
        self._closed: collections.OrderedDict[str, tuple[str, int, int | None]] = \
            collections.OrderedDict()
        self.next_group_id = 0

    def __len__(self) -> int:
        """Outstanding leases."""
        return len(self._outstanding)

    def prompt(self, lease_id: str) -> pb.Prompt | None:
        """The prompt of an outstanding lease; None if it is not outstanding."""
        return self._outstanding.get(lease_id)

    def known(self, lease_id: str) -> tuple[str, int, int | None] | None:
        """`(prompt_id, group_id, prompt_index)` of a lease outstanding or among the last
        `CLOSED_MEMORY` closed (`prompt_index` None when the prompt has no row); None for a
        lease id this learner never issued (or closed long ago)."""
        prompt = self._outstanding.get(lease_id)
        if prompt is not None:
            return _ids(prompt)
        return self._closed.get(lease_id)

    def _close(self, prompt: pb.Prompt) -> None:
        self._closed[prompt.lease_id] = _ids(prompt)
        self._closed.move_to_end(prompt.lease_id)
        while len(self._closed) > CLOSED_MEMORY:
            self._closed.popitem(last=False)

    def live_prompts(self) -> list[pb.Prompt]:
        """What a compacted log must keep: outstanding leases' prompts and those of accepted
        trajectories not yet consumed (a discard issues them again)."""
        return [*self._outstanding.values(), *self._fulfilled.values()]

    # -- issuing -----------------------------------------------------------------------------

    def draw_group(self) -> int:
        """A new group id, for the leases of one prompt draw."""
        group_id = self.next_group_id
        self.next_group_id += 1
        return group_id

    def add(self, prompts: Iterable[pb.Prompt], *, pending: bool) -> None:
        """Records leases as outstanding: handed out by the caller now, or (`pending`) to be
        issued by the next `take_pending`."""
        for prompt in prompts:
            self._outstanding[prompt.lease_id] = prompt
            self.next_group_id = max(self.next_group_id, prompt.group_id + 1)
            if pending:
                self._pending.append(prompt.lease_id)

    def pend_all(self) -> int:
        """After a restart: every outstanding lease is to be issued again. Returns how many."""
        self._pending.extend(self._outstanding)
        return len(self._pending)

    def expire(self, now: float, timeout_s: float) -> int:
        """Leases handed out more than `timeout_s` ago are to be issued again; returns how many."""
        expired = 0
        for lease_id, (handed_at, _) in list(self._handed.items()):
            if now - handed_at > timeout_s:
                del self._handed[lease_id]
                if lease_id in self._outstanding:
                    self._pending.append(lease_id)
                    expired += 1
        return expired

    def take_pending(self, n: int) -> list[pb.Prompt]:
        """Up to n leases to issue again, oldest first."""
        prompts = []
        while len(prompts) < n and self._pending:
            lease_id = self._pending.popleft()
            if lease_id in self._outstanding:
                prompts.append(self._outstanding[lease_id])
        return prompts

    def hand(self, prompts: Iterable[pb.Prompt], now: float, owner: str) -> None:
        """These outstanding leases go to `owner` at `now`."""
        for prompt in prompts:
            self._handed[prompt.lease_id] = (now, owner)

    def reissue(self, trajectory_id: str) -> pb.Prompt | None:
        """A new lease, in the same group, for the prompt an accepted trajectory answered (it is
        being discarded); None if it answered no lease. The caller logs it, then `add`s it."""
        prompt = self._fulfilled.get(trajectory_id)
        if prompt is None:
            return None
        again = pb.Prompt()
        again.CopyFrom(prompt)
        again.lease_id = uuid.uuid4().hex
        return again

    # -- answers -----------------------------------------------------------------------------

    def answer(self, lease_id: str, trajectory_id: str) -> bool:
        """An accepted trajectory answers `lease_id`: the lease closes. Returns whether it was
        outstanding."""
        prompt = self._outstanding.pop(lease_id, None)
        self._handed.pop(lease_id, None)
        if prompt is None:
            return False
        self._fulfilled[trajectory_id] = prompt
        self._close(prompt)
        return True

    def retire(self, trajectory_id: str) -> None:
        """An accepted trajectory is consumed or discarded: its prompt is no longer needed."""
        self._fulfilled.pop(trajectory_id, None)

    def give_back(self, lease_id: str, owner: str, *, spend_attempt: bool = True) -> str:
        """The owner of a handed-out lease gives it back (a rejected answer, a failed episode).

        Returns "reissued" (it will be issued again), "given_up" (its prompt used its
        `MAX_ATTEMPTS` attempts: the lease closes, not logged, so a restart offers it once more),
        "not_owner" (it is handed to another worker: nothing changes) or "ignored" (not
        outstanding, or not handed out: nothing changes). `spend_attempt=False` issues it again
        without counting an attempt.
        """
        handed = self._handed.get(lease_id)
        if handed is None or lease_id not in self._outstanding:
            return "ignored"
        if handed[1] != owner:
            return "not_owner"
        del self._handed[lease_id]
        if spend_attempt:
            self._attempts[lease_id] += 1
        if self._attempts[lease_id] >= MAX_ATTEMPTS:
            self._close(self._outstanding.pop(lease_id))
            return "given_up"
        self._pending.append(lease_id)
        return "reissued"


# ---------------------------------------------------------------------------------------------
# Prompts.


def _ids(prompt: pb.Prompt) -> tuple[str, int, int | None]:
    return (prompt.prompt_id, prompt.group_id,
            prompt.prompt_index if prompt.HasField("prompt_index") else None)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode()
    raise TypeError(f"a prompt holds a {type(value).__name__}, which JSON cannot carry")


def prompt_message(element: Any, lease_id: str, group_id: int) -> pb.Prompt:
    """A prompt source's element (a mapping) as a leasable prompt.

    Its `prompt_id` is the element's "prompt_id" if it has one, else a hash of its content, so the
    same prompt keeps its id across epochs (the running-mean baseline keys on it). Its
    `prompt_index` is the element's "index" (a non-negative int), if it has one.
    """
    if not isinstance(element, Mapping):
        raise TypeError(f"prompt source elements must be mappings, got {type(element).__name__}")
    data_json = json.dumps(dict(element), sort_keys=True, default=_json_default)
    prompt_id = element.get("prompt_id")
    if prompt_id is None:
        prompt_id = hashlib.sha256(data_json.encode()).hexdigest()[:16]
    index = element.get("index")
    if index is not None and (isinstance(index, bool) or not isinstance(index, (int, np.integer))
                              or index < 0):
        raise TypeError(f"a prompt's \"index\" is its row, an int >= 0; prompt {prompt_id!r} has "
                        f"{index!r}")
    return pb.Prompt(lease_id=lease_id, prompt_id=str(prompt_id), data_json=data_json,
                     group_id=group_id, prompt_index=None if index is None else int(index))


def encode_state(state: Any) -> str:
    """A prompt iterator's state (bytes or JSON values) as JSON text."""
    if isinstance(state, bytes):
        return json.dumps({"bytes_b64": base64.b64encode(state).decode()})
    return json.dumps({"json": state}, default=_json_default)


def decode_state(text: str) -> Any:
    """`encode_state`'s inverse."""
    wrapped = json.loads(text)
    if "bytes_b64" in wrapped:
        return base64.b64decode(wrapped["bytes_b64"])
    return wrapped["json"]
