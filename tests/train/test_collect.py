"""Batches of whole groups from the stream (`BatchCollector`): groups are the trajectories'
typed `group_id`, never anything read out of a lease id."""

import collections
import dataclasses

import numpy as np

from sao_jax.train.collect import BatchCollector
from tests.rollout.trajectories import make_trajectory


class FakeServer:
    """`get_batch` hands out the queued trajectories in order; `discard` records the ids."""

    def __init__(self, trajectories):
        self.queue = collections.deque(trajectories)
        self.discarded = []

    def get_batch(self, n, timeout=None):
        return [self.queue.popleft() for _ in range(min(n, len(self.queue)))]

    def discard(self, ids):
        self.discarded += list(ids)


def member(group_id, k, version=3, **fields):
    """Trajectory k of group `group_id`, every action token sampled by `version`."""
    t = make_trajectory(seed=k, trajectory_id=f"g{group_id}-{k}", group_id=group_id,
                        lease_id=f"lease-{group_id}-{k}", **fields)
    return dataclasses.replace(t, weight_versions=np.where(t.action_mask, version, -1))


def test_batches_hold_whole_groups_by_group_id_in_order_of_completion():
    # Groups 7 and 2 interleave; the lease ids look like "<group>-<k>" but mean nothing here.
    arrivals = [member(7, 0), member(2, 0), member(2, 1), member(7, 1), member(2, 2),
                member(5, 0), member(7, 2), member(5, 1)]
    server = FakeServer(arrivals)
    collector = BatchCollector(server, batch_size=6, group_size=3, max_staleness=1)
    batch, _ = collector.collect(version=3, poll=lambda: None)
    assert [t.trajectory_id for t in batch] == ["g2-0", "g2-1", "g2-2", "g7-0", "g7-1", "g7-2"]
    assert list(collector.groups) == [5] and collector.held() == 1  # group 5 waits for more
    assert [t.trajectory_id for t in server.queue] == ["g5-1"]  # taken no sooner than needed


def test_a_stale_member_is_discarded_and_its_group_waits_for_the_reissue():
    server = FakeServer([member(1, 0), member(1, 1, version=0), member(1, 2), member(1, 3)])
    collector = BatchCollector(server, batch_size=3, group_size=3, max_staleness=2)
    batch, _ = collector.collect(version=3, poll=lambda: None)
    assert server.discarded == ["g1-1"] and collector.stale == 1
    assert [t.trajectory_id for t in batch] == ["g1-0", "g1-2", "g1-3"]


def test_trajectories_of_no_group_are_groups_of_their_own():
    ungrouped = [make_trajectory(seed=i, trajectory_id=f"t{i}") for i in range(4)]
    collector = BatchCollector(FakeServer(ungrouped), batch_size=4, group_size=1,
                               max_staleness=5)
    batch, _ = collector.collect(version=3, poll=lambda: None)
    assert [t.trajectory_id for t in batch] == ["t0", "t1", "t2", "t3"]
