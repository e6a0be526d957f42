"""The RPCs that rollout workers call (`TrajectoryService` in `proto/trajectory.proto`): Submit,
LeasePrompts and ReportFailure, with the checks that guard them; see `sao_jax.rollout.stream` for
what they promise.

`TrajectoryService` is the worker-facing half of `TrajectoryServer` (server.py), the class to
build: the server holds the state these handlers read and change (queue, log, leases, the
learner's limits in its `admission.Admission`, counters, under its condition) and adds the
learner's side, restarts and the network.
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from sao_jax.rollout.proto import trajectory_pb2 as pb
from sao_jax.rollout.proto import trajectory_pb2_grpc as pb_grpc
from sao_jax.rollout.stream.leases import CLOSED_MEMORY, encode_state, prompt_message
from sao_jax.rollout.trajectory import (
    MAX_ID_CHARS,
    Trajectory,
    TrajectoryError,
    check_length,
    clip,
)

log = logging.getLogger("sao_jax.rollout.stream.server")  # the server's logger: its messages

_MAX_LEASE = 4096  # prompts per LeasePrompts call
_POLL_S = 0.25  # how often a waiting Submit checks that its caller is still there
_ERROR_LOG_CHARS = 2000  # an EpisodeFailure's error text, as the log shows it


class TrajectoryService(pb_grpc.TrajectoryServiceServicer):
    """The workers' RPCs, mixed into `TrajectoryServer`, whose state they use."""

    def Submit(self, request: pb.Trajectory, context: grpc.ServicerContext) -> pb.Ack:
        tid = request.trajectory_id
        spend_attempt = True  # a rejection is one of the lease's attempts, unless...
        try:
            check_length("worker_id", request.worker_id, MAX_ID_CHARS)  # the sender, logged
            trajectory = Trajectory.from_proto(request)
            trajectory.validate(*self._limits)
            error = self._lease_error(trajectory)
            if error is None:
                error = self._admission.version_error(trajectory)
                spend_attempt = False  # ...the learner is behind: the prompt is not at fault
        except TrajectoryError as e:
            error = e
        if error is not None:
            with self._cond:
                self._counts["stream/rejected"] += 1
                self._counts[f"stream/rejected/{error.field}"] += 1
                self._give_back(request.lease_id, request.worker_id, spend_attempt)
            log.warning("rejected trajectory %r from %r: %s", clip(tid, 40),
                        clip(request.worker_id, 40), error)
            return pb.Ack(trajectory_id=clip(tid, MAX_ID_CHARS), status=pb.Ack.REJECTED,
                          field=error.field, message=error.message)

        with self._cond:
            while tid in self._inflight:  # a resend racing its original: wait for its outcome
                self._wait(context)
            if tid in self._unconsumed or tid in self._consumed:
                self._counts["stream/duplicates"] += 1
                return pb.Ack(trajectory_id=tid, status=pb.Ack.DUPLICATE)
            self._inflight.add(tid)
            try:
                start = time.monotonic()
                waited = False
                while len(self._queue) + self._reserved >= self._maxsize or self._compacting:
                    waited = True
                    self._wait(context)
            except BaseException:
                self._inflight.discard(tid)
                self._cond.notify_all()
                raise
            self._reserved += 1
            if waited:
                self._counts["stream/submits_waited"] += 1
                self._wait_s += time.monotonic() - start

        location = None
        offset = None
        try:
            with self._cond:  # append order = queue order, so a replay queues the same order
                offset, length, end = self._log.append(pb.LogRecord(accepted=request))
                self._landing[offset] = None
            self._log.sync(end)
            location = (offset, length)
        except ValueError:  # the log closed under us: stopping
            pass
        finally:
            with self._cond:
                self._inflight.discard(tid)
                if offset is None:
                    self._reserved -= 1
                else:
                    self._landing[offset] = (trajectory, location)
                    self._land()  # releases the reservation of every entry it drains
                self._cond.notify_all()
        if location is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the learner is stopping; resend")
        return pb.Ack(trajectory_id=tid, status=pb.Ack.ACCEPTED)

    def _wait(self, context: grpc.ServicerContext) -> None:
        """One wait on the condition (held), giving up if the server stops or the caller left."""
        if self._stopping:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the learner is stopping; resend")
        if not context.is_active():
            context.abort(grpc.StatusCode.CANCELLED, "the caller went away")
        self._cond.wait(_POLL_S)

    def _lease_error(self, trajectory: Trajectory) -> TrajectoryError | None:
        """A trajectory naming a lease must answer one this learner issued (outstanding, or
        closed recently: `Leases.known`), about that lease's prompt, group and prompt row. A
        lease id never issued is refused: its prompt row would be unchecked, and a row that no
        training prompt has stops the learner (`PromptSlots`). A trajectory without a lease is
        not checked here."""
        if not trajectory.lease_id:
            return None
        with self._cond:
            known = self._leases.known(trajectory.lease_id)
        if known is None:
            return TrajectoryError("lease_id", f"{clip(trajectory.lease_id, 40)!r} is not a "
                                               "lease this learner issued (or closed in its "
                                               f"last {CLOSED_MEMORY} closings); answer a "
                                               "lease from LeasePrompts")
        prompt_id, group_id, index = known
        if prompt_id != trajectory.prompt_id:
            return TrajectoryError("prompt_id", f"{clip(trajectory.prompt_id, 40)!r} is not the "
                                                f"prompt of lease {trajectory.lease_id!r} "
                                                f"({clip(prompt_id, 40)!r})")
        for name, theirs, ours in (("group_id", trajectory.group_id, group_id),
                                   ("prompt_index", trajectory.prompt_index, index)):
            if theirs != ours:
                return TrajectoryError(name, f"{theirs} is not the {name} of lease "
                                             f"{trajectory.lease_id!r} ({ours})")
        return None

    def _give_back(self, lease_id: str, worker_id: str, spend_attempt: bool = True) -> bool:
        """A rejected answer or a failed episode from the lease's owner frees it for another
        attempt (held: the condition), up to `leases.MAX_ATTEMPTS` in all; then the prompt is
        given up and counted. From any other worker it changes nothing (counted as
        `stream/give_backs_ignored`). Returns whether the lease will be issued again."""
        outcome = self._leases.give_back(lease_id, worker_id, spend_attempt=spend_attempt)
        if outcome == "given_up":
            self._counts["stream/prompts_given_up"] += 1
            self._cond.notify_all()  # wakes a learner waiting for a batch (`unanswered`)
        elif outcome == "not_owner":
            self._counts["stream/give_backs_ignored"] += 1
            log.warning("%r named lease %r, which is handed to another worker: left alone",
                        clip(worker_id, 40), clip(lease_id, 40))
        return outcome == "reissued"

    def ReportFailure(self, request: pb.EpisodeFailure,
                      context: grpc.ServicerContext) -> pb.FailureAck:
        self._check_lengths(context, request, "EpisodeFailure", ("lease_id", "prompt_id",
                                                                 "worker_id"))
        with self._cond:
            self._counts["stream/episodes_failed"] += 1
            reissued = self._give_back(request.lease_id, request.worker_id)
        log.warning("%s: the episode of prompt %r (lease %s) failed%s: %s", request.worker_id,
                    request.prompt_id, request.lease_id,
                    "" if reissued else "; the prompt is given up",
                    clip(request.error, _ERROR_LOG_CHARS))
        return pb.FailureAck(reissued=reissued)

    def _check_lengths(self, context: grpc.ServicerContext, request, message: str,
                       fields: tuple[str, ...]) -> None:
        """Refuses a request whose named string fields exceed `MAX_ID_CHARS`: INVALID_ARGUMENT
        naming the field and the limit."""
        for name in fields:
            try:
                check_length(f"{message}.{name}", getattr(request, name), MAX_ID_CHARS)
            except TrajectoryError as e:
                with self._cond:
                    self._counts["stream/invalid_requests"] += 1
                log.warning("refused a %s: %s", message, e)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _land(self) -> None:
        """Queues synced trajectories in log order (held: the condition): one whose fsync
        finished early waits for those appended before it."""
        while self._landing:
            offset, landed = next(iter(self._landing.items()))
            if landed is None:
                return
            del self._landing[offset]
            self._reserved -= 1
            trajectory, location = landed
            if location is not None:
                self._accept(trajectory, location)

    def _accept(self, trajectory: Trajectory, location: tuple[int, int]) -> None:
        tid = trajectory.trajectory_id
        self._unconsumed[tid] = location
        self._live_bytes += location[1]
        self._queue.append(trajectory)
        self._queue_max_seen = max(self._queue_max_seen, len(self._queue))
        self._counts["stream/accepted"] += 1
        if not self._leases.answer(trajectory.lease_id, tid) and trajectory.lease_id:
            self._counts["stream/answers_to_closed_leases"] += 1

    def LeasePrompts(self, request: pb.LeaseRequest,
                     context: grpc.ServicerContext) -> pb.LeaseReply:
        self._check_lengths(context, request, "LeaseRequest", ("worker_id",))
        if self._iterator is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this learner has no prompt source")
        n = min(request.n, _MAX_LEASE)
        with self._lease_lock:
            now = time.monotonic()
            with self._cond:
                if self._lease_timeout_s is not None:
                    self._counts["stream/leases_expired"] += self._leases.expire(
                        now, self._lease_timeout_s)
                prompts = self._leases.take_pending(n)
                self._counts["stream/leases_reissued"] += len(prompts)
                room = self._admission.in_flight_room(n, len(self._leases) + len(self._queue))
                if room < n - len(prompts):
                    self._counts["stream/leases_held_back"] += n - len(prompts) - room
                room = self._admission.within_budget(room)

            fresh = []
            exhausted = self._exhausted
            while len(prompts) + len(fresh) < n and len(fresh) < room and not exhausted:
                try:
                    element = next(self._iterator)
                except StopIteration:
                    exhausted = True
                    break
                with self._cond:
                    group_id = self._leases.draw_group()
                fresh.extend(prompt_message(element, uuid.uuid4().hex, group_id)
                             for _ in range(self._group_size))
            if fresh or exhausted != self._exhausted:
                state_json = encode_state(self._iterator.get_state())
                record = pb.LeaseRecord(prompts=fresh, iterator_state_json=state_json,
                                        iterator_exhausted=exhausted,
                                        worker_id=request.worker_id)
                *_, end = self._log.append(pb.LogRecord(leased=record))
                self._log.sync(end)
                self._state_json, self._exhausted = state_json, exhausted

            with self._cond:
                self._admission.spend(len(fresh))
                self._leases.add(fresh, pending=False)
                prompts.extend(fresh)
                self._leases.hand(prompts, now, request.worker_id)
                self._counts["stream/leased"] += len(fresh)
                done = self._exhausted and not len(self._leases)
        log.debug("leased %d prompts to %r", len(prompts), request.worker_id)
        # the learner's step as of handing out (not logged)
        return pb.LeaseReply(prompts=self._admission.stamp(prompts), exhausted=done)
