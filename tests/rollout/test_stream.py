"""The trajectory stream over real loopback sockets: backpressure, durability, leases, restarts."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import grain
import grpc
import numpy as np
import pytest

from sao_jax.rollout.proto import trajectory_pb2 as pb
from sao_jax.rollout.stream import (
    LOG_NAME,
    CorruptLogError,
    Ledger,
    OldLogFormatError,
    PromptsExhausted,
    TrajectoryClient,
    TrajectoryLog,
    TrajectoryServer,
)
from sao_jax.rollout.stream.leases import prompt_message
from sao_jax.rollout.stream.log import frame_header
from tests.rollout.prompts import prompt_source
from tests.rollout.trajectories import VOCAB, assert_same, make_trajectory

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def answering(lease) -> dict:
    """The fields of a trajectory that answers `lease` (a `LeasedPrompt`)."""
    return dict(prompt_id=lease.prompt_id, lease_id=lease.lease_id, group_id=lease.group_id,
                prompt_index=lease.prompt_index)


@pytest.fixture
def server(tmp_path):
    servers = []

    def start(**kwargs):
        kwargs.setdefault("vocab_size", VOCAB)
        kwargs.setdefault("policy_version", None)
        s = TrajectoryServer(str(tmp_path / "stream"), **kwargs).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop(grace=0)


def test_1000_trajectories_with_producers_faster_than_the_consumer(server):
    maxsize, producers, per_producer, batch = 16, 8, 125, 8
    s = server(maxsize=maxsize)
    sent = [[make_trajectory(16, seed=p * per_producer + i) for i in range(per_producer)]
            for p in range(producers)]
    acks, submit_s = [], []
    lock = threading.Lock()

    def produce(trajectories):
        with TrajectoryClient(s.address) as client:
            for t in trajectories:
                start = time.perf_counter()
                ack = client.submit(t)
                with lock:
                    acks.append(ack)
                    submit_s.append(time.perf_counter() - start)

    received, sizes_seen = [], []

    def consume():
        deadline = time.monotonic() + 120
        while len(received) < producers * per_producer:
            # A learner slower than its producers, whatever the machine's load: each step waits
            # until the queue is full (so producers are being held back) while any producer runs.
            while s.qsize() < maxsize and any(t.is_alive() for t in threads):
                assert time.monotonic() < deadline, "the producers stalled"
                time.sleep(0.001)
            got = s.get_batch(batch, timeout=10)
            assert got, "the stream stalled"
            sizes_seen.append(s.qsize())
            received.extend(got)
            s.consumed([t.trajectory_id for t in got])
            time.sleep(0.008)  # a learner step: slower than the producers

    threads = [threading.Thread(target=produce, args=(ts,)) for ts in sent]
    consumer = threading.Thread(target=consume)
    for t in [*threads, consumer]:
        t.start()
    for t in [*threads, consumer]:
        t.join(timeout=120)
        assert not t.is_alive()

    sent_ids = [t.trajectory_id for ts in sent for t in ts]
    got_ids = [t.trajectory_id for t in received]
    assert len(got_ids) == 1000 and sorted(got_ids) == sorted(sent_ids)  # none lost, none twice
    assert all(a.status == "accepted" for a in acks)
    by_id = {t.trajectory_id: t for ts in sent for t in ts}
    for t in received[::97]:
        assert_same(t, by_id[t.trajectory_id])

    m = s.metrics()
    assert m["stream/accepted"] == 1000 and m["stream/duplicates"] == 0
    assert m["stream/consumed"] == 1000 and m["stream/queue_size"] == 0
    # Producers were held back: the queue filled to its bound and never past it, many submits
    # waited for room, and the waiting was real time (at least one consumer step each time).
    assert m["stream/queue_max_seen"] == maxsize
    assert m["stream/submits_waited"] >= 100, m
    assert m["stream/submit_wait_s"] > 0.2, m
    assert max(submit_s) > 0.008  # at least one submit outlasted a consumer step
    assert max(sizes_seen) <= maxsize


def test_a_resend_is_never_counted_twice(server):
    s = server(maxsize=4)
    client = TrajectoryClient(s.address)
    t = make_trajectory()
    assert client.submit(t).status == "accepted"
    assert client.submit(t).status == "duplicate"
    assert client.submit(make_trajectory(trajectory_id=t.trajectory_id, seed=5)).ok
    assert [got.trajectory_id for got in s.get_batch(4, timeout=0.2)] == [t.trajectory_id]
    s.consumed([t.trajectory_id])
    assert client.submit(t).status == "duplicate"  # after it was used, too
    m = s.metrics()
    assert m["stream/accepted"] == 1 and m["stream/duplicates"] == 3


def test_get_batch_returns_arrival_order_and_times_out(server):
    s = server(maxsize=4)
    client = TrajectoryClient(s.address)
    ts = [make_trajectory(seed=i) for i in range(3)]
    for t in ts:
        client.submit(t)
    start = time.monotonic()
    got = s.get_batch(4, timeout=0.3)  # only 3 will ever come
    assert time.monotonic() - start >= 0.3
    assert [t.trajectory_id for t in got] == [t.trajectory_id for t in ts]
    client.submit(make_trajectory(seed=9))
    assert client.submit(got[0]).status == "duplicate"  # taken, still remembered
    with pytest.raises(ValueError, match="can never gather"):
        s.get_batch(5)


def test_malformed_trajectories_are_rejected_with_their_messages(server):
    s = server(maxsize=8, max_length=64, routes=(2, 2, 4))  # a learner replaying routes
    client = TrajectoryClient(s.address)
    bad = {
        # routes of another model: refused here, not a crash in the learner's batch
        "routed_experts": make_trajectory(routed_experts=np.zeros((17, 3, 2), np.int16)),
        "rewards": make_trajectory(rewards=np.where(np.arange(12) == 11, np.nan, 0)),
        "action_mask": make_trajectory(action_mask=np.ones(10, bool)),
        "response_ids": make_trajectory(response_ids=np.full(12, VOCAB)),
        "rollout_logprobs": make_trajectory(rollout_logprobs=np.full(12, np.nan)),
    }
    for field, t in bad.items():
        ack = client.submit(t)
        assert (ack.status, ack.field, ack.ok) == ("rejected", field, False)
        assert ack.message
    ack = client.submit(make_trajectory(0))
    assert (ack.field, ack.message) == ("response_ids", "empty response")
    ack = client.submit(make_trajectory(60))
    assert ack.message == "prompt (5) + response (60) tokens exceed max_length 64"
    early = make_trajectory(action_mask=np.arange(12) >= 2, rewards=np.eye(12)[0],
                            rollout_logprobs=np.full(12, -1.0), weight_versions=np.zeros(12, int))
    ack = client.submit(early)
    assert ack.message == ("reward 1.0 at position 0, before the first action token "
                           "(position 2)")
    assert client.submit(make_trajectory()).status == "accepted"

    m = s.metrics()
    assert m["stream/rejected"] == 8 and m["stream/accepted"] == 1
    assert m["stream/rejected/rewards"] == 2 and m["stream/rejected/response_ids"] == 3
    assert m["stream/rejected/rollout_logprobs"] == 1
    assert s.qsize() == 1


def test_large_trajectories_round_trip(server):
    s = server(maxsize=2, vocab_size=151_936)
    client = TrajectoryClient(s.address)
    for length in (32_768, 400_000):  # the second is ~7 MB, past gRPC's default 4 MB limit
        t = make_trajectory(length, response_ids=np.random.default_rng(0).integers(
            0, 151_936, length))
        assert client.submit(t).status == "accepted"
        (got,) = s.get_batch(1, timeout=10)
        assert_same(got, t)


def test_token_is_required_when_set(server):
    s = server(maxsize=4, token="s3cret")
    for client in (TrajectoryClient(s.address), TrajectoryClient(s.address, token="wrong")):
        for call, arg in ((client.submit, make_trajectory()), (client.lease_prompts, 1)):
            with pytest.raises(grpc.RpcError) as info:
                call(arg)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert TrajectoryClient(s.address, token="s3cret").submit(make_trajectory()).ok
    m = s.metrics()
    assert m["stream/unauthenticated"] == 4 and m["stream/accepted"] == 1


def test_binding_beyond_loopback_needs_a_token(tmp_path):
    with pytest.raises(ValueError, match="pass token="):
        TrajectoryServer(str(tmp_path), policy_version=None, vocab_size=VOCAB, host="0.0.0.0")
    assert not os.path.exists(tmp_path / LOG_NAME)


def test_one_server_per_directory(server, tmp_path):
    server()
    with pytest.raises(RuntimeError, match="another TrajectoryServer"):
        TrajectoryServer(str(tmp_path / "stream"), policy_version=None, vocab_size=VOCAB)


def test_leases_expire_discards_reissue_and_the_source_ends(server):
    s = server(prompts=prompt_source(4), lease_timeout_s=0.3)
    client = TrajectoryClient(s.address)
    first = client.lease_prompts(2)
    assert [p.prompt_id for p in first] == ["q0", "q1"]
    assert first[0].data == {"prompt_id": "q0", "question": "What is 0 + 0?"}
    time.sleep(0.4)  # the worker holding them died
    again = client.lease_prompts(3)
    assert [p.lease_id for p in again[:2]] == [p.lease_id for p in first]  # re-issued first
    assert [p.prompt_id for p in again] == ["q0", "q1", "q2"]

    answers = [make_trajectory(seed=i, **answering(p)) for i, p in enumerate(again)]
    for t in answers:
        assert client.submit(t).status == "accepted"
    taken = s.get_batch(3, timeout=5)
    s.consumed([taken[0].trajectory_id, taken[1].trajectory_id])
    s.discard([taken[2].trajectory_id])  # too stale: its prompt goes out again, newly leased
    last = client.lease_prompts(5)
    assert [p.prompt_id for p in last] == ["q2", "q3"]
    assert last[0].lease_id != again[2].lease_id
    for i, p in enumerate(last):
        client.submit(make_trajectory(seed=10 + i, **answering(p)))
    s.consumed(t.trajectory_id for t in s.get_batch(2, timeout=5))
    with pytest.raises(PromptsExhausted):
        client.lease_prompts(1)
    m = s.metrics()
    assert m["stream/leased"] == 4 and m["stream/leases_expired"] == 2
    assert m["stream/discarded"] == 1 and m["stream/prompts_reissued"] == 1
    with pytest.raises(KeyError, match="never accepted"):
        s.consumed(["no-such-id"])


def test_stop_releases_waiting_producers_and_they_resend_after_a_restart(server, tmp_path):
    s = server(maxsize=1)
    port = s.port
    client = TrajectoryClient(s.address, retry_timeout_s=20)
    first, second = make_trajectory(seed=1), make_trajectory(seed=2)
    assert client.submit(first).status == "accepted"
    acks = []
    producer = threading.Thread(target=lambda: acks.append(client.submit(second)))
    producer.start()
    time.sleep(0.5)
    assert not acks  # held back: the queue is full
    s.stop(grace=1)  # the waiting Submit gets UNAVAILABLE; the client keeps retrying
    time.sleep(0.3)
    assert not acks
    s2 = server(maxsize=4, port=port)
    producer.join(timeout=20)
    assert [a.status for a in acks] == ["accepted"]  # never recorded before: not a duplicate
    got = s2.get_batch(2, timeout=5)
    assert [t.trajectory_id for t in got] == [first.trajectory_id, second.trajectory_id]


# The learner in a child process, driven through stdin, so that it can be SIGKILLed mid-run.
LEARNER = """
import json, sys
from sao_jax.rollout.stream import TrajectoryServer
from tests.rollout.prompts import prompt_source
server = TrajectoryServer(sys.argv[1], policy_version=None,
                          vocab_size=1000, prompts=prompt_source(),
                          maxsize=int(sys.argv[2]))
server.start()
print(server.port, flush=True)
for line in sys.stdin:
    command, n = line.split()
    batch = server.get_batch(int(n), timeout=10)
    if command == "consume":
        server.consumed([t.trajectory_id for t in batch])
    print(json.dumps([t.trajectory_id for t in batch]), flush=True)
"""


class Learner:
    """The learner in a child process; `ask` sends it a command and reads its answer."""

    def __init__(self, workdir: str, maxsize: int):
        self.process = subprocess.Popen(
            [sys.executable, "-c", LEARNER, workdir, str(maxsize)], cwd=REPO, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.port = int(self.process.stdout.readline())

    def ask(self, command: str) -> list[str]:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def sigkill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process.stdout.close()
        self.process.stdin.close()


def test_restart_after_sigkill_loses_nothing_and_reuses_nothing(tmp_path):
    workdir = str(tmp_path / "stream")
    learner = Learner(workdir, maxsize=64)
    try:
        client = TrajectoryClient(f"127.0.0.1:{learner.port}")
        leases = client.lease_prompts(6)
        assert [p.prompt_id for p in leases] == [f"q{i}" for i in range(6)]
        answers = [make_trajectory(seed=i, **answering(p)) for i, p in enumerate(leases[:4])]
        for t in answers:
            assert client.submit(t).status == "accepted"
        consumed = learner.ask("consume 2")  # used by a checkpointed step
        taken = learner.ask("take 1")  # in a step that no checkpoint holds
        assert consumed == [t.trajectory_id for t in answers[:2]]
        assert taken == [answers[2].trajectory_id]
        learner.sigkill()
    finally:
        learner.close()

    s = TrajectoryServer(workdir, policy_version=None,
                         vocab_size=VOCAB, prompts=prompt_source(), maxsize=64).start()
    try:
        client = TrajectoryClient(s.address)
        again = s.get_batch(2, timeout=5)  # accepted but never consumed: available again
        assert [t.trajectory_id for t in again] == [t.trajectory_id for t in answers[2:]]
        for got, sent in zip(again, answers[2:], strict=True):
            assert_same(got, sent)
        assert s.get_batch(1, timeout=0.2) == []  # consumed ones never come back
        for t in answers:  # and every resend is recognised
            assert client.submit(t).status == "duplicate"
        s.discard([again[0].trajectory_id])  # too stale: its prompt (q2) goes out again
        # The two unanswered leases are issued again, then q2, then the iterator resumes at q6.
        issued = client.lease_prompts(4)
        assert [p.lease_id for p in issued[:2]] == [p.lease_id for p in leases[4:]]
        assert [p.prompt_id for p in issued] == ["q4", "q5", "q2", "q6"]
        m = s.metrics()
        assert m["stream/leases_reissued"] == 3 and m["stream/leased"] == 1
        assert m["stream/accepted"] == 0 and m["stream/duplicates"] == 4
    finally:
        s.stop()


def test_a_torn_tail_is_cut_off_and_corruption_refused(tmp_path):
    workdir = str(tmp_path / "stream")
    path = os.path.join(workdir, LOG_NAME)
    ts = [make_trajectory(seed=i) for i in range(3)]
    with TrajectoryServer(workdir, policy_version=None, vocab_size=VOCAB) as s:
        client = TrajectoryClient(s.address)
        for t in ts:
            client.submit(t)
    size = os.path.getsize(path)

    def restart_and_check():
        with TrajectoryServer(workdir, policy_version=None, vocab_size=VOCAB) as s:
            assert [t.trajectory_id for t in s.get_batch(3, timeout=1)] == \
                [t.trajectory_id for t in ts]
        assert os.path.getsize(path) == size  # compacted back to the same records

    record = pb.LogRecord(accepted=make_trajectory(seed=3).to_proto()).SerializeToString()
    frame = frame_header(record) + record
    for tail in (frame[:5],  # a crash while appending: in the header,
                 frame[:100],  # in the payload,
                 frame[:-1],  # just before its end,
                 frame[:12] + bytes(4096)):  # a power loss: pages never written
        with open(path, "ab") as f:
            f.write(tail)
        restart_and_check()

    frames = [(offset, n) for offset, n, _ in TrajectoryLog(path).frames()]
    header = frames[1][0] - 12  # the second frame: its header, then its payload
    for position, problem in ((header + 1, "a bad frame header"),
                              (frames[1][0] + 5, "a frame failing its checksum")):
        with open(path, "r+b") as f:
            f.seek(position)
            byte = f.read(1)
            f.seek(position)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(CorruptLogError, match=f"{problem} at byte {header}, with data"):
            TrajectoryServer(workdir, policy_version=None, vocab_size=VOCAB)
        with open(path, "r+b") as f:  # repair it
            f.seek(position)
            f.write(byte)
        restart_and_check()  # the failed start released the directory


def test_compaction_drops_consumed_trajectories_and_keeps_their_ids(tmp_path):
    workdir = str(tmp_path / "stream")
    ts = [make_trajectory(2048, seed=i) for i in range(10)]
    with TrajectoryServer(workdir, policy_version=None, vocab_size=VOCAB, maxsize=16) as s:
        client = TrajectoryClient(s.address)
        for t in ts:
            client.submit(t)
        s.consumed(t.trajectory_id for t in s.get_batch(8, timeout=5))
        before = os.path.getsize(os.path.join(workdir, LOG_NAME))
        s.compact()
        after = os.path.getsize(os.path.join(workdir, LOG_NAME))
        assert after < before / 3
        assert client.submit(ts[0]).status == "duplicate"
    with TrajectoryServer(workdir, policy_version=None, vocab_size=VOCAB, maxsize=16) as s:
        assert [t.trajectory_id for t in s.get_batch(2, timeout=1)] == \
            [t.trajectory_id for t in ts[8:]]
        assert all(TrajectoryClient(s.address).submit(t).status == "duplicate" for t in ts)


def test_sigkill_under_backpressure_then_restart_delivers_each_trajectory_once(tmp_path):
    """Producers blocked on a full queue when the learner dies resend to its successor: every
    trajectory is used exactly once across the two lives."""
    workdir = str(tmp_path / "stream")
    learner = Learner(workdir, maxsize=8)
    sent = [[make_trajectory(seed=100 * p + i) for i in range(15)] for p in range(3)]
    acks = []

    def produce(trajectories):
        with TrajectoryClient(f"127.0.0.1:{learner.port}", retry_timeout_s=30) as client:
            acks.extend(client.submit(t) for t in trajectories)

    threads = [threading.Thread(target=produce, args=(ts,)) for ts in sent]
    try:
        for t in threads:
            t.start()
        used_before = learner.ask("consume 5")
        time.sleep(0.3)  # the queue fills again; producers wait on their acks
        learner.sigkill()
    finally:
        learner.close()
    assert len(acks) < 45  # some were still waiting when it died

    s = TrajectoryServer(workdir, policy_version=None,
                         vocab_size=VOCAB, maxsize=8, port=learner.port).start()
    try:
        used_after = []
        while len(used_before) + len(used_after) < 45:
            batch = s.get_batch(4, timeout=20)
            assert batch, "trajectories went missing"
            used_after += [t.trajectory_id for t in batch]
            s.consumed(used_after[-len(batch):])
        for t in threads:
            t.join(timeout=30)
        assert s.get_batch(1, timeout=0.3) == []
    finally:
        s.stop()
    assert sorted(used_before + used_after) == sorted(t.trajectory_id for ts in sent for t in ts)
    assert len(acks) == 45 and all(a.ok for a in acks)


def test_a_rejected_answer_frees_its_lease_for_another_attempt_then_gives_up(server):
    s = server(prompts=prompt_source(2), max_in_flight=1)
    with TrajectoryClient(s.address) as client:
        (lease,) = client.lease_prompts(5)
        assert client.lease_prompts(5) == []  # admission: one in flight
        for attempt in range(3):
            bad = dataclasses.replace(make_trajectory(8, seed=attempt), **answering(lease))
            bad = dataclasses.replace(bad, response_ids=np.full(8, VOCAB + 1))
            assert client.submit(bad).status == "rejected"
            if attempt < 2:  # handed out again, same lease, same prompt
                assert [p.lease_id for p in client.lease_prompts(5)] == [lease.lease_id]
        assert s.metrics()["stream/prompts_given_up"] == 1
        (fresh,) = client.lease_prompts(5)  # room again: the next prompt
        assert fresh.prompt_id != lease.prompt_id


def test_a_failed_episode_is_issued_again_shares_the_attempts_then_is_given_up(server):
    s = server(prompts=prompt_source(3), lease_budget=0)
    s.grant_leases(1)
    assert s.unanswered() == 1  # granted, not yet leased
    with TrajectoryClient(s.address, worker_id="w0") as client:
        (lease,) = client.lease_prompts(5)
        assert s.unanswered() == 1  # leased, unanswered
        assert client.report_failure(lease.lease_id, lease.prompt_id, "KeyError: 'x'")
        (again,) = client.lease_prompts(5)  # re-issues pass the budget
        assert (again.lease_id, again.prompt_id) == (lease.lease_id, lease.prompt_id)
        bad = dataclasses.replace(make_trajectory(8), **answering(lease),
                                  response_ids=np.full(8, VOCAB + 1))
        assert client.submit(bad).status == "rejected"  # a rejection is an attempt too
        assert [p.lease_id for p in client.lease_prompts(5)] == [lease.lease_id]
        assert not client.report_failure(lease.lease_id, lease.prompt_id, "boom")
        assert client.lease_prompts(5) == []  # given up, and the budget is spent
        assert s.unanswered() == 0  # so a synchronous learner grants a replacement
        # An unknown (or already closed) lease is not issued again.
        assert not client.report_failure("no-such-lease", "q9", "boom")
    metrics = s.metrics()
    assert metrics["stream/episodes_failed"] == 3 and metrics["stream/prompts_given_up"] == 1
    assert metrics["stream/rejected"] == 1


def test_lease_budget_grants_batches_and_reissues_pass_freely(server, tmp_path):
    s = server(prompts=prompt_source(10), lease_budget=0)
    client = TrajectoryClient(s.address)
    assert client.lease_prompts(4) == []  # nothing granted yet
    s.grant_leases(3)
    first = client.lease_prompts(4)
    assert [p.prompt_id for p in first] == ["q0", "q1", "q2"]
    assert client.lease_prompts(4) == []  # the budget is spent
    client.submit(make_trajectory(seed=0, **answering(first[0])))
    (taken,) = s.get_batch(1, timeout=5)
    s.discard([taken.trajectory_id])  # a re-issued prompt needs no budget
    assert [p.prompt_id for p in client.lease_prompts(4)] == ["q0"]
    s.grant_leases(1)
    assert [p.prompt_id for p in client.lease_prompts(4)] == ["q3"]
    unlimited = TrajectoryServer(str(tmp_path / "other"), policy_version=None, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="lease_budget"):
        unlimited.grant_leases(1)
    unlimited.stop(grace=0)


def test_groups_lease_each_prompt_group_size_times_and_reissues_keep_the_group(server):
    s = server(prompts=prompt_source(10), group_size=3)
    client = TrajectoryClient(s.address)
    leased = client.lease_prompts(2)  # a whole group even when fewer are asked for
    assert [p.prompt_id for p in leased] == ["q0"] * 3
    groups = {p.group_id for p in leased}
    assert len(groups) == 1 and len({p.lease_id for p in leased}) == 3
    client.submit(make_trajectory(seed=0, **answering(leased[0])))
    (taken,) = s.get_batch(1, timeout=5)
    s.discard([taken.trajectory_id])
    (again,) = client.lease_prompts(1)
    assert again.lease_id != leased[0].lease_id and again.group_id == groups.pop()
    assert [(p.prompt_id, p.group_id) for p in client.lease_prompts(1)] == [("q1", 1)] * 3


def test_the_learner_step_is_a_typed_field_of_prompts_as_they_are_handed_out(server, tmp_path):
    """`set_learner_step` stamps every prompt handed out from then on, re-issued ones included,
    in `Prompt.learner_step`; the prompt's data stays the source's element, and the log's lease
    records carry no step."""
    s = server(prompts=prompt_source(10), lease_timeout_s=0.2)
    client = TrajectoryClient(s.address)
    (first,) = client.lease_prompts(1)
    assert first.learner_step is None
    assert first.data == {"prompt_id": "q0", "question": "What is 0 + 0?"}
    s.set_learner_step(7)
    (p,) = client.lease_prompts(1)
    assert p.learner_step == 7
    assert p.data == {"prompt_id": "q1", "question": "What is 1 + 1?"}
    time.sleep(0.3)  # q0 and q1 expire: issued again, at the learner's step of now
    s.set_learner_step(8)
    again = client.lease_prompts(2)
    assert [(q.lease_id, q.learner_step) for q in again] == [(first.lease_id, 8), (p.lease_id, 8)]
    with pytest.raises(ValueError, match="a learner step is an int >= 0"):
        s.set_learner_step(-1)
    client.close()
    log = TrajectoryLog(str(tmp_path / "stream" / LOG_NAME))
    records = [r.leased for r in log.records() if r.HasField("leased")]
    assert records and not any(q.HasField("learner_step") for r in records for q in r.prompts)


def test_the_queue_order_is_the_log_order_so_a_restart_replays_it(tmp_path):
    """Concurrent submits finish their fsyncs in any order; the queue still follows the log."""
    path = str(tmp_path / "stream")
    s = TrajectoryServer(path, policy_version=None, vocab_size=VOCAB, maxsize=400).start()
    sent = [make_trajectory(8, seed=i) for i in range(240)]

    def produce(chunk):
        with TrajectoryClient(s.address) as client:
            for t in chunk:
                assert client.submit(t).status == "accepted"

    threads = [threading.Thread(target=produce, args=(sent[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    first = [t.trajectory_id for t in s.get_batch(240, timeout=10)]
    s.stop(grace=0)
    again = TrajectoryServer(path, policy_version=None, vocab_size=VOCAB, maxsize=400).start()
    try:
        assert [t.trajectory_id for t in again.get_batch(240, timeout=10)] == first
    finally:
        again.stop(grace=0)


# ---- Hostile input ---------------------------------------------------------------------------

HUGE = "x" * 2_000_000  # 2 MB: far past every limit (the audit sent 20 MB; the same path)


def _with_version(t, version: int, **changes):
    """`t` with every action token sampled by `version`."""
    return dataclasses.replace(t, weight_versions=np.where(t.action_mask, version, -1), **changes)


def test_over_long_strings_are_rejected_clipped_in_logs_and_never_written(server, tmp_path,
                                                                         caplog):
    s = server(prompts=prompt_source(4))
    log_path = tmp_path / "stream" / LOG_NAME
    with TrajectoryClient(s.address) as client:
        (lease,) = client.lease_prompts(1)
        answer = answering(lease)
        size = os.path.getsize(log_path)
        hostile = {
            "trajectory_id": make_trajectory(trajectory_id=HUGE, **answer),
            "lease_id": make_trajectory(lease_id=HUGE),
            "prompt_id": make_trajectory(prompt_id=HUGE),
            "finish_reason": make_trajectory(finish_reason=HUGE, **answer),
            "env_metadata": make_trajectory(env_metadata={"note": HUGE}, **answer),
            "timings": make_trajectory(timings={HUGE: 1.0}),
        }
        with caplog.at_level("INFO", logger="sao_jax.rollout.stream"):
            for field, t in hostile.items():
                ack = client.submit(t)
                assert (ack.status, ack.field) == ("rejected", field), ack.message
                assert "characters long, more than the limit of" in ack.message
                assert len(ack.message) < 300 and len(ack.trajectory_id) < 300
            with TrajectoryClient(s.address, worker_id=HUGE) as sender:  # a Submit's sender
                ack = sender.submit(make_trajectory(seed=3, **answer))
            assert (ack.status, ack.field) == ("rejected", "worker_id")
            assert "characters long, more than the limit of" in ack.message
        assert os.path.getsize(log_path) == size  # nothing of them reached the log
        assert caplog.records and max(len(r.getMessage()) for r in caplog.records) < 500
        # The answers to the lease freed it, as any rejection does.
        assert [p.lease_id for p in client.lease_prompts(1)] == [lease.lease_id]
        assert client.submit(make_trajectory()).status == "accepted"
    m = s.metrics()
    assert m["stream/rejected"] == 7 and m["stream/accepted"] == 1
    assert m["stream/rejected/env_metadata"] == 1 and m["stream/rejected/timings"] == 1


def test_over_long_ids_in_leases_and_failure_reports_are_invalid_arguments(server, caplog):
    from sao_jax.rollout.proto import trajectory_pb2_grpc as pb_grpc

    s = server(prompts=prompt_source(4))
    with grpc.insecure_channel(s.address, options=[
            ("grpc.max_send_message_length", 2**28)]) as channel:
        stub = pb_grpc.TrajectoryServiceStub(channel)
        calls = [(stub.LeasePrompts, pb.LeaseRequest(n=1, worker_id=HUGE),
                  "LeaseRequest.worker_id")]
        for name in ("lease_id", "prompt_id", "worker_id"):
            fields = {"lease_id": "l", "prompt_id": "q0", "worker_id": "w", name: HUGE}
            calls.append((stub.ReportFailure, pb.EpisodeFailure(**fields),
                          f"EpisodeFailure.{name}"))
        with caplog.at_level("INFO", logger="sao_jax.rollout.stream"):
            for call, request, field in calls:
                with pytest.raises(grpc.RpcError) as info:
                    call(request, timeout=30)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert info.value.details() == (f"{field}: is 2000000 characters long, more "
                                                "than the limit of 256")
            # The error text of a failure report is free text for the log: clipped there,
            # never refused.
            (lease,) = stub.LeasePrompts(pb.LeaseRequest(n=1, worker_id="w0"), timeout=30).prompts
            reply = stub.ReportFailure(pb.EpisodeFailure(
                lease_id=lease.lease_id, prompt_id=lease.prompt_id, error=HUGE, worker_id="w0"),
                timeout=30)
            assert reply.reissued
        assert max(len(r.getMessage()) for r in caplog.records) < 2500
    m = s.metrics()
    assert m["stream/invalid_requests"] == 4 and m["stream/episodes_failed"] == 1


def test_an_answer_must_carry_its_leases_prompt(server):
    s = server(prompts=prompt_source(4))
    with TrajectoryClient(s.address) as client:
        (lease,) = client.lease_prompts(1)
        ack = client.submit(make_trajectory(**{**answering(lease), "prompt_id": "q3"}))
        assert (ack.status, ack.field) == ("rejected", "prompt_id")
        assert ack.message == f"'q3' is not the prompt of lease {lease.lease_id!r} ('q0')"
        assert [p.lease_id for p in client.lease_prompts(1)] == [lease.lease_id]  # again
        assert client.submit(make_trajectory(**answering(lease))).ok


def test_versions_newer_than_the_learners_are_rejected_and_their_lease_issued_again(server):
    s = server(prompts=prompt_source(4), policy_version=3, max_in_flight=1)
    with TrajectoryClient(s.address) as client:
        (lease,) = client.lease_prompts(1)
        answer = _with_version(make_trajectory(**answering(lease)), 3)
        early = dataclasses.replace(answer, weight_versions=np.where(
            np.arange(12) == 9, 4, answer.weight_versions))  # one token from version 4
        for _ in range(5):  # more than a lease's attempts: the prompt is not at fault
            ack = client.submit(early)
            assert (ack.status, ack.field) == ("rejected", "weight_versions")
            assert ack.message.startswith("version 4 on action token at position 9 is newer than "
                                          "the learner's policy version 3")
            assert [p.lease_id for p in client.lease_prompts(1)] == [lease.lease_id]
        s.set_policy_version(4)  # published: now it may come
        assert client.submit(early).status == "accepted"
    m = s.metrics()
    assert m["stream/rejected/weight_versions"] == 5 and m["stream/prompts_given_up"] == 0
    with pytest.raises(ValueError, match="versions never go down"):
        s.set_policy_version(3)
    with pytest.raises(ValueError, match=">= 0"):
        s.set_policy_version(-1)
    with pytest.raises(TypeError, match="is an int"):
        s.set_policy_version(4.5)
    # Negative versions on action tokens were refused all along (Trajectory.validate).
    with TrajectoryClient(s.address) as client:
        ack = client.submit(_with_version(make_trajectory(), -2))
        assert (ack.status, ack.field) == ("rejected", "weight_versions")
        assert "negative version -2" in ack.message


def test_a_restart_behind_the_log_discards_newer_trajectories_and_reissues_their_prompts(
        tmp_path):
    """A learner resumed from the checkpoint of version 5 while the log holds trajectories that
    weights 6 and 7 sampled: none is trained with a negative lag, no leased prompt is lost."""
    workdir = str(tmp_path / "stream")
    with TrajectoryServer(workdir, vocab_size=VOCAB, prompts=prompt_source(8),
                          policy_version=4) as s, TrajectoryClient(s.address) as client:
        leases = client.lease_prompts(4)
        for i, (lease, version) in enumerate(zip(leases, (4, 5, 6, 7), strict=True)):
            s.set_policy_version(version)
            assert client.submit(_with_version(make_trajectory(seed=i, **answering(lease)),
                                               version)).ok
        assert client.submit(_with_version(make_trajectory(seed=9), 7)).ok  # no lease
        used = s.get_batch(1, timeout=5)
        s.consumed([t.trajectory_id for t in used])  # version 4: checkpointed, gone for good

    with TrajectoryServer(workdir, vocab_size=VOCAB, prompts=prompt_source(8),
                          policy_version=5) as s, TrajectoryClient(s.address) as client:
        assert [t.prompt_id for t in s.get_batch(1, timeout=5)] == ["q1"]  # version 5 stays
        assert s.qsize() == 0
        m = s.metrics()
        assert m["stream/replay_discarded_newer"] == 3 and m["stream/prompts_reissued"] == 2
        again = client.lease_prompts(3)
        assert [p.prompt_id for p in again] == ["q2", "q3", "q4"]  # re-issued first, then fresh
        assert {p.lease_id for p in again[:2]}.isdisjoint(p.lease_id for p in leases)
        reissued = again[:2]

    with TrajectoryServer(workdir, vocab_size=VOCAB, prompts=prompt_source(8),
                          policy_version=5) as s, TrajectoryClient(s.address) as client:
        assert s.metrics()["stream/replay_discarded_newer"] == 0  # the discard was logged
        assert [t.prompt_id for t in s.get_batch(1, timeout=5)] == ["q1"]
        assert sorted(p.lease_id for p in client.lease_prompts(3)) == sorted(
            p.lease_id for p in [*reissued, again[2]])  # outstanding: issued again


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = bytes.fromhex("000000040000000000")  # a SETTINGS frame with no settings
SETTINGS_ACK = bytes.fromhex("000000040100000000")


def _seconds_until_closed(socks, limit_s: float) -> list[float]:
    """How long after the call each socket was closed by the server (the server's SETTINGS it
    sent are read and dropped); a socket still open after `limit_s` counts as `limit_s`."""
    import selectors

    start = time.monotonic()
    closed = {}
    with selectors.DefaultSelector() as selector:
        for i, sock in enumerate(socks):
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, i)
        while len(closed) < len(socks) and time.monotonic() - start < limit_s:
            for key, _ in selector.select(0.5):
                try:
                    data = key.fileobj.recv(4096)
                except ConnectionResetError:
                    data = b""
                if not data:
                    closed[key.data] = time.monotonic() - start
                    selector.unregister(key.fileobj)
    return [closed.get(i, limit_s) for i in range(len(socks))]


@pytest.mark.parametrize("sent", [b"", b"PRI * HTTP/2.0\r\n", PREFACE,
                                  PREFACE + EMPTY_SETTINGS],
                         ids=["nothing", "half a preface", "a preface", "no SETTINGS ack"])
def test_50_connections_that_never_complete_their_handshake_are_closed(server, sent):
    """Half an HTTP/2 handshake, 50 times over (a hostile probe): each connection is dropped
    after `handshake_timeout_s`, not held for gRPC's 120 s (60 s once SETTINGS came without
    the acknowledgement of the server's)."""
    import socket

    s = server(handshake_timeout_s=0.5)
    socks = [socket.create_connection(("127.0.0.1", s.port), timeout=30) for _ in range(50)]
    try:
        for sock in socks:
            sock.sendall(sent)
        waited = _seconds_until_closed(socks, limit_s=25)
    finally:
        for sock in socks:
            sock.close()
    # Not a tight timing assertion (a loaded machine is slow): without the timeouts every one
    # of them would still be open at the limit.
    assert max(waited) < 15, sorted(waited)[-5:]
    with TrajectoryClient(s.address) as client:  # others are served as before
        assert client.submit(make_trajectory()).ok


def test_an_idle_connection_is_closed_and_the_client_reconnects(server):
    import socket

    s = server(idle_timeout_s=0.5)
    with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
        sock.sendall(PREFACE + EMPTY_SETTINGS + SETTINGS_ACK)  # a whole handshake, then nothing
        assert max(_seconds_until_closed([sock], limit_s=25)) < 15
    with TrajectoryClient(s.address) as client:
        assert client.submit(make_trajectory(seed=1)).ok
        time.sleep(1.5)  # idle: the server closes the connection
        assert client.submit(make_trajectory(seed=2)).ok  # and the channel opens another
    with pytest.raises(ValueError, match="idle_timeout_s"):
        server(idle_timeout_s=0)


def test_connections_past_the_limit_are_closed_as_they_open(server, tmp_path):
    import socket

    s = server(max_connections=2)
    preface = PREFACE + EMPTY_SETTINGS
    held = [socket.create_connection(("127.0.0.1", s.port), timeout=30) for _ in range(2)]
    try:
        for sock in held:  # two complete HTTP/2 connections, idle: the server's SETTINGS
            sock.sendall(preface)
            assert sock.recv(4096)
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as third:
            third.sendall(preface)
            try:
                assert third.recv(4096) == b""  # closed at once (without the limit: SETTINGS)
            except ConnectionResetError:
                pass
    finally:
        for sock in held:
            sock.close()
    with TrajectoryClient(s.address) as client:  # room again: served as before
        assert client.submit(make_trajectory()).ok
    with pytest.raises(ValueError, match="max_connections"):
        TrajectoryServer(str(tmp_path / "other"), policy_version=None,
                         vocab_size=VOCAB, max_connections=0)


def test_a_trajectory_claiming_a_version_beyond_the_learners_is_refused(server, tmp_path):
    """A hostile probe claimed version 2**31 - 1: accepted, its policy lag would be negative and
    it would never count as stale. The version is a required argument, so that no learner can
    leave the guard off, and it holds from the first submit."""
    s = server(prompts=prompt_source(4), policy_version=0)
    with TrajectoryClient(s.address) as client:
        (lease,) = client.lease_prompts(1)
        ack = client.submit(_with_version(make_trajectory(**answering(lease)), 2**31 - 1))
        assert (ack.status, ack.field) == ("rejected", "weight_versions")
        assert "version 2147483647 on action token at position 0 is newer than the learner's " \
               "policy version 0" in ack.message
        assert [p.lease_id for p in client.lease_prompts(1)] == [lease.lease_id]  # issued again
        assert client.submit(_with_version(make_trajectory(**answering(lease)), 0)).ok
    assert s.qsize() == 1
    with pytest.raises(TypeError, match="policy_version"):
        TrajectoryServer(str(tmp_path / "other"), vocab_size=VOCAB)


def test_a_rejection_from_another_worker_leaves_the_lease_alone(server):
    """A hostile probe: three rejected submits (and a failure report) naming another worker's
    lease. Only the worker a lease was handed to can give it back, so the owner's good answer
    is still accepted as the answer to its lease."""
    s = server(prompts=prompt_source(4), lease_budget=1)
    with TrajectoryClient(s.address, worker_id="victim") as victim, \
            TrajectoryClient(s.address, worker_id="thief") as thief:
        (lease,) = victim.lease_prompts(1)
        for attempt in range(3):
            bad = dataclasses.replace(make_trajectory(8, seed=attempt), **answering(lease),
                                      response_ids=np.full(8, VOCAB + 1))
            assert thief.submit(bad).status == "rejected"
        assert not thief.report_failure(lease.lease_id, lease.prompt_id, "boom")
        assert thief.lease_prompts(4) == []  # not issued again: it is still the victim's
        assert victim.submit(make_trajectory(seed=9, **answering(lease))).status == "accepted"
    m = s.metrics()
    assert m["stream/give_backs_ignored"] == 4 and m["stream/prompts_given_up"] == 0
    assert m.get("stream/answers_to_closed_leases", 0) == 0 and m["stream/outstanding_leases"] == 0


def test_leases_carry_their_group_and_prompt_row_and_answers_must_match(server, tmp_path):
    rows = [{"prompt_id": f"q{i}", "index": 10 + i} for i in range(6)]
    s = server(prompts=grain.MapDataset.source(rows).to_iter_dataset(), group_size=2)
    with TrajectoryClient(s.address) as client:
        leased = client.lease_prompts(4)
        assert [(p.prompt_id, p.group_id, p.prompt_index) for p in leased] == [
            ("q0", 0, 10), ("q0", 0, 10), ("q1", 1, 11), ("q1", 1, 11)]
        for name, value in (("group_id", 1), ("group_id", None), ("prompt_index", 11),
                            ("prompt_index", None)):
            ack = client.submit(make_trajectory(**{**answering(leased[0]), name: value}))
            assert (ack.status, ack.field) == ("rejected", name)
            assert ack.message.startswith(f"{value} is not the {name} of lease ")
        assert client.submit(make_trajectory(seed=1, **answering(leased[1]))).ok
        (taken,) = s.get_batch(1, timeout=5)
        assert (taken.group_id, taken.prompt_index) == (0, 10)  # typed, through the log too
    s.stop(grace=0)
    # A restart (the log compacted at start-up) keeps counting groups where it was.
    with TrajectoryServer(str(tmp_path / "stream"), vocab_size=VOCAB, policy_version=None,
                          prompts=grain.MapDataset.source(rows).to_iter_dataset(),
                          group_size=2) as again, TrajectoryClient(again.address) as client:
        assert again.get_batch(1, timeout=5)[0].group_id == 0
        leased = client.lease_prompts(6)  # the three outstanding again, then fresh groups
        assert [(p.prompt_id, p.group_id) for p in leased] == [
            ("q0", 0), ("q1", 1), ("q1", 1), ("q2", 2), ("q2", 2), ("q3", 3), ("q3", 3)]
    with pytest.raises(TypeError, match="an int >= 0; prompt 'q' has '7'"):
        prompt_message({"prompt_id": "q", "index": "7"}, lease_id="l", group_id=0)


def test_an_answer_must_name_a_lease_this_learner_issued(server):
    """A hostile probe: a trajectory naming a lease id never issued, with a prompt row no
    training prompt has, was accepted unchecked, and that row then stopped the learner
    (`PromptSlots`). It is refused, naming lease_id. A late second answer to a closed lease is
    still checked against that lease's prompt, and accepted when it matches."""
    rows = [{"prompt_id": f"q{i}", "index": 10 + i} for i in range(4)]
    s = server(prompts=grain.MapDataset.source(rows).to_iter_dataset())
    with TrajectoryClient(s.address) as client:
        (lease,) = client.lease_prompts(1)
        forged = make_trajectory(**{**answering(lease), "lease_id": "forged", "prompt_index": 99})
        ack = client.submit(forged)
        assert (ack.status, ack.field) == ("rejected", "lease_id")
        assert "'forged' is not a lease this learner issued" in ack.message
        assert client.submit(make_trajectory(seed=1, **answering(lease))).ok
        late = make_trajectory(seed=2, **{**answering(lease), "prompt_index": 99})
        assert (client.submit(late).status, client.submit(late).field) == ("rejected",
                                                                          "prompt_index")
        assert client.submit(make_trajectory(seed=3, **answering(lease))).ok
    assert [t.prompt_index for t in s.get_batch(2, timeout=5)] == [10, 10]
    m = s.metrics()
    assert m["stream/rejected/lease_id"] == 1 and m["stream/answers_to_closed_leases"] == 1


def test_a_log_of_the_first_format_is_refused_with_the_way_out(tmp_path):
    """Logs written before `group_id` and `prompt_index` existed cannot say which group or row
    a record belongs to: the server refuses them, saying what to do, and touches nothing."""
    workdir = tmp_path / "stream"
    workdir.mkdir()
    old = b"SAOLOG1\n" + frame_header(b"x") + b"x"
    (workdir / LOG_NAME).write_bytes(old)
    with pytest.raises(OldLogFormatError, match="move the stream directory") as e:
        TrajectoryServer(str(workdir), vocab_size=VOCAB, policy_version=None)
    assert "group_id and prompt_index" in str(e.value)
    assert (workdir / LOG_NAME).read_bytes() == old
    with pytest.raises(OldLogFormatError):
        Ledger.read(str(workdir / LOG_NAME))


def test_the_ledger_reads_what_the_log_holds_before_and_after_compaction(server, tmp_path):
    s = server(prompts=prompt_source(6))
    path = str(tmp_path / "stream" / LOG_NAME)
    with TrajectoryClient(s.address, worker_id="w0") as client:
        leases = client.lease_prompts(3)
        answers = [make_trajectory(seed=i, **answering(p)) for i, p in enumerate(leases[:2])]
        for t in answers:
            assert client.submit(t).ok
        s.consumed([s.get_batch(1, timeout=5)[0].trajectory_id])
    ledger = Ledger.read(path)  # who held and who answered each lease: a dead worker's losses
    assert ledger.leased_to == {p.lease_id: "w0" for p in leases}
    assert ledger.answered_by == {p.lease_id: {"w0"} for p in leases[:2]}
    for _ in range(2):  # as written, then compacted
        ledger = Ledger.read(path)
        assert ledger.accepted == {t.trajectory_id for t in answers}
        assert ledger.retired == {answers[0].trajectory_id}
        assert ledger.pending == {answers[1].trajectory_id}
        assert leases[2].lease_id in ledger.unanswered
        assert not {p.lease_id for p in leases[:2]} & ledger.unanswered
        s.compact()
    assert ledger.unanswered == {leases[2].lease_id}  # compacted: only the outstanding one
    assert ledger.leased_to == {p.lease_id: "" for p in leases[1:]}  # and keeps no holder
    assert ledger.answered_by == {leases[1].lease_id: {"w0"}}  # the pending trajectory's


def test_a_learner_resuming_keeps_the_logs_newer_trajectories_and_still_refuses_new_ones(
        tmp_path):
    """The learner's way (`discard_newer=False`): what the killed run accepted stays queued in
    its order, so the resumed run redoes its steps on the same data; new submits from weights
    beyond the checkpoint are refused all the same."""
    workdir = str(tmp_path / "stream")
    with TrajectoryServer(workdir, vocab_size=VOCAB, prompts=prompt_source(8),
                          policy_version=4) as s, TrajectoryClient(s.address) as client:
        leases = client.lease_prompts(3)
        sent = []
        for i, (lease, version) in enumerate(zip(leases, (4, 5, 6), strict=True)):
            s.set_policy_version(version)
            sent.append(_with_version(make_trajectory(seed=i, **answering(lease)), version))
            assert client.submit(sent[-1]).ok
    with TrajectoryServer(workdir, vocab_size=VOCAB, prompts=prompt_source(8), policy_version=4,
                          discard_newer=False) as s, TrajectoryClient(s.address) as client:
        assert [t.trajectory_id for t in s.get_batch(3, timeout=5)] == [
            t.trajectory_id for t in sent]
        assert s.metrics()["stream/replay_discarded_newer"] == 0
        ack = client.submit(_with_version(make_trajectory(seed=7), 5))
        assert (ack.status, ack.field) == ("rejected", "weight_versions")
