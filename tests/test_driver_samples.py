"""The checkpoint driver's sample-weighted loss count (``baselines.driver.CheckpointDriver._lost_samples``), in
process: a stand-in for the cluster answers the two questions the count asks (the servers' counters and what a
restore put back); the history is fed exactly as ``after_step`` feeds it.  Two failures of the same index
restoring the same base: the second is counted against what the replacement's state holds, not against pushes
the first failure already lost."""

from __future__ import annotations

import collections

import numpy as np

from baselines.driver import CheckpointDriver


class Layout:
    def locate(self, ids):
        ids = np.asarray(ids, dtype=np.int64)
        return ids % 2, ids // 2  # server = id mod 2


class Cluster:
    def __init__(self):
        self.layout = Layout()
        self.last_lookups = {}
        self.counters = {0: 0, 1: 0}
        self.restored = {"base_row_updates": {"t": 0}, "rows": {}}

    def strategy_call(self, command, args=None, indices=None):
        if command == "stats":
            return {i: {"row_updates_total": c} for i, c in self.counters.items()}
        if command == "restored_rows":
            return {i: self.restored for i in indices}
        raise AssertionError(command)


def driver_on(cluster) -> CheckpointDriver:
    d = CheckpointDriver.__new__(CheckpointDriver)  # only what the sample accounting reads
    d.cluster, d.mode, d.sample_history_s = cluster, "partial", 3600.0
    d._configured, d.opts, d.plan = {}, type("Opts", (), {"interval_s": None})(), None
    d._samples_dropped, d.lost_samples, d._history = 0, 0, collections.deque()
    d._step_s, d._last_step_at = None, None
    d._history_first, d._pending_samples = 0, []
    d._counter_by_server = dict(cluster.counters)
    d._history.append((0.0, dict(d._counter_by_server), {}))
    return d


def count(d, cluster, lost_updates):
    """The count as ``settle`` makes it for a failure seen now."""
    return d._lost_samples(1, lost_updates, cluster.restored, cluster.counters[1], len(d._history))


def step(d, cluster, ids, lookups):
    ids = np.asarray(ids, dtype=np.int64)
    cluster.last_lookups = {"t": (ids, np.asarray(lookups, dtype=np.int64))} if len(ids) else {}
    by_server = {i: int((ids % 2 == i).sum()) for i in (0, 1)}
    for i, n in by_server.items():
        cluster.counters[i] += n
    d._remember({"rows": len(ids), "rows_by_server": by_server})


def test_two_failures_of_one_index_restoring_the_same_base_count_only_what_each_lost():
    c = Cluster()
    d = driver_on(c)
    step(d, c, [1, 3], [2, 1])
    step(d, c, [1], [3])
    step(d, c, [3], [4])
    # failure 1: base (counter 0) + a delta holding row 1 with one update; nothing applied since the restore
    c.restored = {"base_row_updates": {"t": 0}, "rows": {"t": {"ids": [1], "counts": [1]}}}
    c.counters[1] = 1
    # lost: row 1's second update (3 lookups), row 3's two (1 + 4)
    assert count(d, c, 3) == 8
    assert d._counter_by_server[1] == 1
    step(d, c, [3], [5])
    step(d, c, [1], [7])
    # failure 2: the same base and delta again (no full save since); the state held row 1's first update, then
    # row 3 (5 lookups) and row 1 (7) were applied and are lost now
    c.counters[1] = 1
    assert count(d, c, 2) == 12
    # a count that does not match the exact row-update count is refused, not guessed
    step(d, c, [1], [2])
    c.counters[1] = 1
    assert count(d, c, 5) is None
    assert d.samples_acked == 2 + 1 + 3 + 4 + 5 + 7 + 2  # every lookup acknowledged, the lost ones included


def test_a_base_older_than_the_history_is_not_counted():
    c = Cluster()
    d = driver_on(c)
    step(d, c, [1], [1])
    c.restored = {"base_row_updates": {"t": 7}, "rows": {}}  # a counter no kept step boundary had
    c.counters[1] = 7
    assert count(d, c, 0) is None


def test_the_history_is_kept_in_steps_not_wall_time():
    """A benchmark pauses a strategy between its slices: minutes of wall time may pass within one interval of
    the strategy's own time, so the history is bounded by a number of steps (three intervals of them)."""
    c = Cluster()
    d = driver_on(c)
    d.sample_history_s = 1.0
    d._configured = {"interval_s": 2.0}
    for _ in range(50):
        step(d, c, [1], [1])
    d._step_s = 0.01  # 100 steps a second: 3 x 2 s + 10 s = 16 s of steps
    assert d._history_horizon_steps() == 1602
    assert len(d._history) == 51 and d.samples_acked == 50


def test_counts_made_later_in_order_equal_counts_made_at_each_failure():
    """``settle`` counts the failures after the fact (not inside the recovery's time): the steps trained since a
    failure do not change its count, and a second failure is counted against the first's lineage."""
    from baselines.driver import FailureEvent

    c = Cluster()
    d = driver_on(c)
    step(d, c, [1, 3], [2, 1])
    step(d, c, [1], [3])
    step(d, c, [3], [4])

    def failure(lost, restored, counter):
        c.restored, c.counters[1] = restored, counter
        event = FailureEvent(step=0, indices=[1], recovery="partial", lost_updates=lost)
        d._pending_samples.append({"index": 1, "lost": lost, "end": d._history_first + len(d._history),
                                   "restored": restored, "counter": counter, "event": event})
        d._counter_by_server[1] += 0  # the driver's own count goes on from where it was, as in _on_failure
        return event

    same_base = {"base_row_updates": {"t": 0}, "rows": {"t": {"ids": [1], "counts": [1]}}}
    first = failure(3, same_base, 1)
    step(d, c, [3], [5])  # trained before the count is made
    step(d, c, [1], [7])
    second = failure(2, same_base, 1)
    d.settle()
    assert (first.lost_samples, second.lost_samples, d.lost_samples) == (8, 12, 20)
    assert d.samples_acked == 2 + 1 + 3 + 4 + 5 + 7
