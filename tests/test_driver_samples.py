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


def _reference(history, restored, index=1):
    """The count spelled out row by row (each row's first ``counts`` updates since the base were put back by the
    restore, the rest lost), and the ids each step keeps."""
    reflected = dict(zip(restored["rows"].get("t", {}).get("ids", []), restored["rows"].get("t", {}).get("counts", [])))
    seen, lost_updates, lost_samples, kept = collections.Counter(), 0, 0, []
    for _, _, lookups in history:
        ids, n = lookups.get("t", (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        mask = []
        for i, c in zip(ids.tolist(), n.tolist()):
            if i % 2 == index:
                seen[i] += 1
                if seen[i] > reflected.get(i, 0):
                    lost_updates, lost_samples = lost_updates + 1, lost_samples + c
                    mask.append(False)
                    continue
            mask.append(True)
        kept.append(ids[np.asarray(mask, dtype=bool)].tolist() if len(ids) else [])
    return lost_updates, lost_samples, kept


def test_a_long_history_is_counted_exactly_as_row_by_row():
    """Thousands of steps, a hundred thousand lost updates (a partial recovery late in a long interval): the
    count and the lineage it leaves equal the row-by-row reference."""
    rng = np.random.default_rng(5)
    c = Cluster()
    d = driver_on(c)
    for _ in range(3000):
        ids = rng.choice(4000, size=80, replace=False)
        step(d, c, ids, rng.integers(1, 5, size=80))
    base_entry = 1  # the base was taken after the history's first step: counter 0 there
    delta_ids = rng.choice(np.arange(1, 4000, 2), size=300, replace=False)
    restored = {"base_row_updates": {"t": 0}, "rows": {"t": {"ids": delta_ids.tolist(),
                                                             "counts": rng.integers(1, 3, size=300).tolist()}}}
    history = list(d._history)[base_entry:]
    lost_updates, lost_samples, kept = _reference(history, restored)
    c.restored = restored
    c.counters[1] = sum(restored["rows"]["t"]["counts"])  # what the replacement holds: the delta's updates
    assert lost_updates > 100_000
    assert count(d, c, lost_updates) == lost_samples
    assert [list(h[2]["t"][0]) if "t" in h[2] else [] for h in list(d._history)[base_entry:]] == kept
    assert d._counter_by_server[1] == c.counters[1]


def _pending_failure(d, c, lost, restored, counter):
    """A failure as ``_on_failure`` leaves it: its count waits for ``settle``."""
    from baselines.driver import FailureEvent

    c.restored, c.counters[1] = restored, counter
    event = FailureEvent(step=0, indices=[1], recovery="partial", lost_updates=lost)
    d._pending_samples.append({"index": 1, "lost": lost, "end": d._history_first + len(d._history),
                               "keep": d._history_horizon_steps(), "restored": restored, "counter": counter,
                               "event": event})
    return event


def test_a_waiting_count_is_made_between_steps_when_asked_or_at_twice_the_horizon():
    """A count waits for the caller's ``settle`` (a benchmark calls it after the failure's window, so that no
    step it times pays for the count); the history keeps the steps it needs meanwhile, up to twice its horizon,
    and the count is made there if nobody asked."""
    for asked in (True, False):
        c = Cluster()
        d = driver_on(c)
        d._history_horizon_steps = lambda: 5
        step(d, c, [1, 3], [2, 1])
        step(d, c, [1], [3])
        step(d, c, [3], [4])
        event = _pending_failure(d, c, 3, {"base_row_updates": {"t": 0}, "rows": {"t": {"ids": [1], "counts": [1]}}}, 1)
        d._history_horizon_steps = lambda: 2  # steps slow down while the server recovers: the horizon shrinks,
        for _ in range(6):  # the count still waits up to twice the horizon of when the failure was seen (5)
            step(d, c, [0], [1])  # steps of server 0's rows only: the history grows to 10, no count yet
        assert len(d._history) == 10 and event.lost_samples is None and d._pending_samples
        if asked:
            d.settle()
            assert event.lost_samples == 8 and not d._pending_samples
            step(d, c, [0], [1])
            assert len(d._history) == 2  # back to the horizon once nothing waits
        else:
            step(d, c, [0], [1])  # one more: counted inside this step, then the history drops to its horizon
            assert event.lost_samples == 8 and len(d._history) == 2
        assert d.lost_samples == 8
