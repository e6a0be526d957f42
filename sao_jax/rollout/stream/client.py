"""The rollout worker's end of the trajectory stream (`TrajectoryClient`)."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

import grpc

from sao_jax.rollout.proto import trajectory_pb2 as pb
from sao_jax.rollout.proto import trajectory_pb2_grpc as pb_grpc
from sao_jax.rollout.trajectory import Trajectory

DEFAULT_MAX_MESSAGE_BYTES = 256 * 2**20
_ACK_STATUS = {pb.Ack.ACCEPTED: "accepted", pb.Ack.DUPLICATE: "duplicate",
               pb.Ack.REJECTED: "rejected"}


@dataclasses.dataclass(frozen=True)
class Ack:
    """The learner's answer to a submitted trajectory.

    `status` is "accepted" (durably recorded now), "duplicate" (recorded before) or "rejected"
    (failed validation; `field` and `message` say why).
    """

    trajectory_id: str
    status: str
    field: str = ""
    message: str = ""

    @property
    def ok(self) -> bool:
        """The learner holds this trajectory: accepted now or before."""
        return self.status in ("accepted", "duplicate")


@dataclasses.dataclass(frozen=True)
class LeasedPrompt:
    """A prompt leased to a worker: answer it with a trajectory carrying `lease_id`, `group_id`
    and `prompt_index` (the learner refuses one whose fields differ from its lease's).

    `group_id` is the prompt draw the lease belongs to (its `group_size` leases share it);
    `prompt_index` is the prompt's row in the learner's prompt source, None if it has none;
    `learner_step` is the learner's step when it handed the lease out
    (`TrajectoryServer.set_learner_step`), None if it has set none.
    """

    lease_id: str
    prompt_id: str
    data: dict[str, Any]  # the prompt source's element, as JSON gave it back
    group_id: int
    prompt_index: int | None = None
    learner_step: int | None = None


class PromptsExhausted(Exception):
    """The prompt source is finished and no lease is outstanding: nothing more will be issued."""


class TrajectoryClient:
    """A rollout worker's connection to the learner. Thread-safe; one per process is enough.

    Calls block (a submit for as long as the learner applies backpressure): from asyncio code, call
    them through `asyncio.to_thread`. Calls are retried while the server is UNAVAILABLE (e.g.
    restarting); retries are safe because ids are idempotent.

    Args:
      address: the learner's "host:port".
      worker_id: who this client is: the owner of the leases it takes, sent with every lease
        request, submit and failure report (only a lease's owner can give it back, module doc of
        `leases.py`), and named in the learner's logs. None: a fresh random id.
      token: sent as `authorization: Bearer <token>` metadata when set.
      retry_timeout_s: keep retrying an UNAVAILABLE server (e.g. restarting) this long.
      max_message_bytes: gRPC message limit, both directions.
    """

    def __init__(self, address: str, *, worker_id: str | None = None, token: str | None = None,
                 retry_timeout_s: float = 60.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   # Reconnect to a restarted learner within a second or two, not minutes.
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 2000)]
        self.worker_id = worker_id if worker_id is not None else f"client-{uuid.uuid4().hex[:12]}"
        self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.TrajectoryServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._retry_timeout_s = retry_timeout_s

    def _call(self, method, request, timeout: float | None):
        deadline = time.monotonic() + self._retry_timeout_s
        delay = 0.05
        while True:
            try:
                return method(request, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, 2.0)

    def submit(self, trajectory: Trajectory, timeout: float | None = None) -> Ack:
        """Sends a trajectory; returns once the learner has recorded it (or rejected it).

        Blocks while the learner's queue is full (backpressure). `timeout` bounds each attempt
        (None: wait as long as the learner makes us).
        """
        request = trajectory.to_proto()
        request.worker_id = self.worker_id
        reply = self._call(self._stub.Submit, request, timeout)
        return Ack(reply.trajectory_id, _ACK_STATUS.get(reply.status, "rejected"), reply.field,
                   reply.message)

    def lease_prompts(self, n: int, *, timeout: float | None = 60.0) -> list[LeasedPrompt]:
        """Leases up to n prompts (fewer, or none, while others hold the rest).

        Raises `PromptsExhausted` when nothing more will ever be issued.
        """
        reply = self._call(self._stub.LeasePrompts,
                           pb.LeaseRequest(n=n, worker_id=self.worker_id), timeout)
        if reply.exhausted and not reply.prompts:
            raise PromptsExhausted("the learner's prompt source is finished")
        return [LeasedPrompt(p.lease_id, p.prompt_id, json.loads(p.data_json), p.group_id,
                             p.prompt_index if p.HasField("prompt_index") else None,
                             p.learner_step if p.HasField("learner_step") else None)
                for p in reply.prompts]

    def report_failure(self, lease_id: str, prompt_id: str, error: str, *,
                       timeout: float | None = 60.0) -> bool:
        """Tells the learner that the episode of a lease failed (its environment raised);
        returns whether the lease will be issued again (False: the prompt is given up, or the
        lease is not this worker's to give back)."""
        reply = self._call(self._stub.ReportFailure, pb.EpisodeFailure(
            lease_id=lease_id, prompt_id=prompt_id, error=error[:2000],
            worker_id=self.worker_id), timeout)
        return reply.reissued

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TrajectoryClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
