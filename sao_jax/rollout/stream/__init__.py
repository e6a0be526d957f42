"""The trajectory stream: rollout workers lease prompts and submit trajectories to the learner.

In parts: `log.py`, the learner's append-only log and its ledger (`TrajectoryLog`, `Ledger`);
`leases.py`, the lease bookkeeping (groups, owners, attempts); `server.py`, the learner's gRPC
server (`TrajectoryServer`), whose RPCs (Submit, LeasePrompts, ReportFailure) are in `service.py`;
it listens through `network.py` (`Listener`: address, token, connection limits), starts from its
directory with `restart.py` (lock, replay, the prompt iterator resumed) and keeps the learner's
limits in `admission.py` (in-flight prompts, lease budget, policy version, learner step);
`client.py`, the worker's client (`TrajectoryClient`). The names below are importable from here.

Learner side, `TrajectoryServer` (a threaded gRPC server, `proto/trajectory.proto`):
  - Accepted means durably recorded (docs/design.md, "Rules that keep it real"): a valid
    trajectory is appended to `<workdir>/trajectories.log` and fsynced before its ack goes out.
    Concurrent submits share fsyncs (group commit).
  - Backpressure, nothing dropped: the learner's queue holds at most `maxsize` accepted
    trajectories; a Submit that finds it full waits, holding its ack, until the learner takes a
    batch (`get_batch`). The producer is blocked on its ack, so it is held back.
  - Idempotent ids: a trajectory id accepted before (in this run or, through the log, any earlier
    one) is acknowledged as DUPLICATE and neither queued nor counted again.
  - Malformed trajectories (`Trajectory.validate` fails) are acknowledged as REJECTED with the
    field and message, logged, and counted in `metrics()`; resending them will not help. Their
    lease is issued again, as is the lease of an episode a worker reports failed
    (`ReportFailure`: its environment raised), until the prompt has failed 3 times; then it is
    given up (`stream/prompts_given_up`). Only the worker a lease was handed to (its owner, the
    `worker_id` it leased with) can give it back so: a rejected submit or a failure report from
    another worker naming the lease leaves it alone (`stream/give_backs_ignored`).
  - Prompts (docs/design.md, "Prompts"): the server owns the prompt iterator (grain's, or any one
    with `get_state()` / `set_state()`) and leases prompts; each lease, with the iterator state
    after it, is on disk before the worker hears of it. Leases outstanding at a restart, or older
    than `lease_timeout_s`, are issued again (the same lease id), before fresh prompts. Each
    prompt carries its group (`group_id`, an int shared by the `group_size` leases of one draw)
    and its row (`prompt_index`, the element's "index"); an answer to an outstanding lease must
    carry the lease's (REJECTED naming the field otherwise), and the learner groups and indexes
    by these fields alone.
  - Restart: the log is replayed. Accepted trajectories that the learner has not declared
    `consumed` are queued again, consumed ones never come back, outstanding leases are re-issued,
    and the prompt iterator resumes where it was. The log is compacted at start-up and whenever
    dead records outgrow `compact_bytes`. A log of the first format, from before `group_id` and
    `prompt_index`, is refused with the way out (`OldLogFormatError`, `log.py`).
  - The learner calls `consumed(ids)` once a checkpoint holding the step that used them is saved,
    so that a restart from that checkpoint neither loses nor re-uses a trajectory; `discard(ids)`
    drops trajectories unused (e.g. too stale) and issues their prompts again.
  - Loopback by default. Binding any other address needs a `token`, which every call must then
    carry as `authorization: Bearer <token>` metadata (UNAUTHENTICATED otherwise). There is no TLS:
    the token keeps strangers out of a trusted network, not eavesdroppers.

Versions: the learner tells the server its policy version (`policy_version=`, a required
argument, at start: a resumed learner's checkpoint version; `set_policy_version(v)` before engines
may sample with v, i.e. before it publishes v). A trajectory that an action token's
weight version places ahead of it cannot come from weights this learner published (its policy lag
would be negative, so it would never count as stale): it is REJECTED naming `weight_versions`, and
its lease is issued again without spending one of its attempts (the prompt is not at fault: an
engine still holds weights from beyond the learner's checkpoint). At start-up, accepted
trajectories in the log that are newer than `policy_version` (accepted after the checkpoint the
learner resumed from, sampled by weights it published later) are discarded as `discard` does,
unless `discard_newer=False`: their prompts are issued again under new lease ids, counted in
`stream/replay_discarded_newer`, so that none is trained with a negative lag and no leased prompt
is lost (one that answered no lease is only dropped). The learner keeps them instead: each was
accepted under the version guard of the run that made it, and a resumed learner redoes the steps
after its checkpoint on the same data, in the same order, so it reaches a trajectory's version
again before it takes it (no negative lag), and every redone step is the step it replaces
(tests/faults, test_e). Without a policy version (None, given explicitly) versions are not
compared.

Hostile input: every string of every message is bounded (`trajectory.py` names the limits: ids
and metadata keys 256 characters, metadata string values 64 Ki). An over-long one is REJECTED
(Submit, its sender's `worker_id` included; the log is not written) or refused with
INVALID_ARGUMENT (`LeaseRequest.worker_id`, `EpisodeFailure.lease_id` / `prompt_id` /
`worker_id`), naming the field and the limit; log lines show over-long texts clipped
(`trajectory.clip`). `EpisodeFailure.error`, free text for the log only, is clipped in the log,
never refused. A trajectory answering an outstanding lease must carry that lease's `prompt_id`,
`group_id` and `prompt_index` (REJECTED naming the field otherwise). A client that
opens a connection and never completes the HTTP/2 handshake (its preface and SETTINGS, and the
acknowledgement of the server's SETTINGS) is disconnected after `handshake_timeout_s`, one with
no call in progress after `idle_timeout_s`, and connections past `max_connections` are closed as
they open (so that a flood of them cannot take the file descriptors the learner needs for its log
and checkpoints; a worker holds one). `LeasePrompts` hands out at most 4096 prompts a call.

Worker side, `TrajectoryClient(address, worker_id=...)`: `lease_prompts(n)`,
`submit(trajectory) -> Ack` and `report_failure(lease_id, ...)`, retrying while the server is
UNAVAILABLE (e.g. restarting); retries are safe because ids are idempotent.

Messages are not chunked: both ends raise gRPC's limit to 256 MiB (~15M tokens).
"""

from sao_jax.rollout.stream.client import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Ack,
    LeasedPrompt,
    PromptsExhausted,
    TrajectoryClient,
)
from sao_jax.rollout.stream.leases import MAX_ATTEMPTS
from sao_jax.rollout.stream.log import (
    LOG_NAME,
    CorruptLogError,
    Ledger,
    OldLogFormatError,
    TrajectoryLog,
)
from sao_jax.rollout.stream.network import is_loopback
from sao_jax.rollout.stream.server import TrajectoryServer

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "LOG_NAME",
    "MAX_ATTEMPTS",
    "Ack",
    "CorruptLogError",
    "LeasedPrompt",
    "Ledger",
    "OldLogFormatError",
    "PromptsExhausted",
    "TrajectoryClient",
    "TrajectoryLog",
    "TrajectoryServer",
    "is_loopback",
]
