"""The checkpoint driver's sample-weighted loss count: the lookups of the row updates a partial recovery lost.

Sample-weighted PLS (CPR's own definition: a portion of lost *samples*): every step the driver
also keeps, per table, the ids the step updated and how many lookups of the batch each had
(``Cluster.last_lookups``), for the last ``sample_history_s`` seconds or three of the servers' full
intervals, whichever is longer (up to twice that while a failure's count waits for :meth:`SampleLoss.settle`,
which a benchmark calls between steps).  At a partial recovery it
finds the step at which the restored base was taken (the failed server's update counter then
equals the base's), takes each row's updates since then in order, skips the first ones the
deltas put back (``restored_rows``) and the last ones the replacement applied after its restore,
and adds up the lookups of the rest: the samples whose updates were lost.  The lost ones are then
dropped from the history, so that a later failure of the same index is counted against what its
state holds.  The count is checked
against the exact row-update count; where it cannot be made (the base is older than the history,
or several workers push: ``CheckpointDriver.add_acked``, or a step's rows that are not this worker's lookups)
``lost_samples`` is None, never a guess; so is the dense copy dropped then.

:class:`SampleLoss` is mixed into ``baselines.driver.CheckpointDriver``: its history lives on the driver (set up
by :meth:`SampleLoss._init_samples`), beside the driver's own exact row-update count that checks it.
"""

from __future__ import annotations

import collections
import logging
import time

import numpy as np

log = logging.getLogger("baselines.driver")


class SampleLoss:
    """The history of steps and the count of lost samples (see the module docstring)."""

    def _init_samples(self, sample_history_s: float) -> None:
        # sample-weighted accounting (module docstring): per step (time, counters after it, ids and lookups)
        self.sample_history_s = float(sample_history_s)
        self._samples_dropped = 0  # lookups of the steps no longer in the history (samples_acked: with the rest)
        self._history_first = 0  # the number of the history's first entry (entries are numbered from the start)
        # failures whose lost samples are counted later (settle): counting them at the failure would charge the
        # benchmark's accounting to the strategy's recovery time
        self._pending_samples: list[dict] = []
        self._step_s: float | None = None  # EWMA of the time between steps (the history's horizon in steps)
        self._last_step_at: float | None = None
        self.lost_samples: int | None = 0  # None once a failure's could not be counted
        self._history: collections.deque = collections.deque()
        self._counter_by_server: dict[int, int] = {}

    def _remember(self, result: dict) -> None:
        """Keeps this step's updates per server and its ids with their lookups (see the module docstring)."""
        lookups = self.cluster.last_lookups
        if self.lost_samples is None:
            return
        if sum(len(ids) for ids, _ in lookups.values()) < int(result.get("rows", 0)):
            # more rows acknowledged than this worker looked up: other workers' results summed in; the samples
            # cannot be counted exactly, so they are not counted at all
            log.info("sample-weighted PLS off: a step acknowledged rows this worker did not look up")
            self.lost_samples = None
            self._drop_history()
            return
        for i, rows in (result.get("rows_by_server") or {}).items():
            self._counter_by_server[int(i)] = self._counter_by_server.get(int(i), 0) + int(rows)
        now = time.monotonic()
        if self._last_step_at is not None and now - self._last_step_at < 1.0:  # a step's time, not a pause
            dt = now - self._last_step_at
            self._step_s = dt if self._step_s is None else 0.95 * self._step_s + 0.05 * dt
        self._last_step_at = now
        self._history.append((now, dict(self._counter_by_server), lookups))  # the client's fresh arrays, kept as is
        keep = self._history_horizon_steps()
        # twice the horizon of when the failure was seen, if longer (steps slow while a server recovers)
        limit = 2 * max([keep] + [int(p.get("keep", 0)) for p in self._pending_samples])
        if len(self._history) > limit and self._pending_samples:
            # a failure's count needs steps the history would drop: while one waits the history holds up to twice
            # its horizon, so that a caller can settle() between steps (a benchmark: after the failure's window,
            # not inside a step it times), and only then is it counted here
            self.settle()
        while len(self._history) > keep and self._history and not self._pending_samples:
            self._samples_dropped += sum(int(n.sum()) for _, n in self._history.popleft()[2].values())
            self._history_first += 1

    def _drop_history(self) -> None:
        if self.lost_samples is None:  # no count any more: the client need not count lookups either
            self.cluster.count_lookups = False
        self._samples_dropped += sum(int(n.sum()) for h in self._history for _, n in h[2].values())
        self._history_first += len(self._history)
        self._history.clear()

    @property
    def samples_acked(self) -> int:
        """Lookups of every acknowledged row update since start (summed lazily: the history holds them)."""
        return self._samples_dropped + sum(int(n.sum()) for h in self._history for _, n in h[2].values())

    def _history_horizon_steps(self) -> int:
        """How many steps are kept: ``sample_history_s`` of steps, or three full intervals of the servers'
        timers when that is longer (a restored base is at most about one interval and one write old).  Counted
        in steps, not wall time: a benchmark that pauses the timers between its slices stops this clock too."""
        interval = self._configured.get("interval_s") or self.opts.interval_s
        if interval is None and self.plan is not None:
            interval = self.plan.partial_interval_s
        seconds = max(self.sample_history_s, 3.0 * float(interval or 0.0) + 10.0)
        return int(seconds / max(self._step_s or 0.001, 1e-4)) + 2

    def settle(self) -> None:
        """Counts the lost samples of the failures seen so far (:meth:`report` and :meth:`pls_samples` call it;
        ``after_step`` only when the history would otherwise drop the steps a count needs)."""
        pending, self._pending_samples = self._pending_samples, []
        for p in pending:
            counted = None
            if self.lost_samples is not None:
                try:
                    counted = self._lost_samples(p["index"], p["lost"], p["restored"], p["counter"],
                                                 p["end"] - self._history_first)
                except Exception as exc:  # noqa: BLE001 - reported (logged, the count None), never guessed
                    log.warning("the lost samples of server %d could not be counted: %s: %s", p["index"],
                                type(exc).__name__, exc)
            p["event"].lost_samples = counted
            self.lost_samples = None if counted is None or self.lost_samples is None else self.lost_samples + counted
        if self.lost_samples is None:
            self._drop_history()  # nothing more is counted: keep no history

    def _lost_samples(self, index: int, lost_updates: int, restored: dict, counter_now: int, end: int) -> int | None:
        """The lookups of the updates server ``index``'s partial recovery lost, or None when they cannot be
        counted exactly (checked against ``lost_updates``): ``restored`` is what its replacement's restore put
        back (``restored_rows``), ``counter_now`` its update counter when the failure was seen and ``end`` the
        history's length then.  When counted, the history is rewritten to what the replacement's state holds
        (the lost updates dropped, its counters renumbered), so that a later failure of the same index,
        restoring the same base or a newer one, is counted against that state."""
        base = sum(int(v) for v in restored["base_row_updates"].values())
        restored_counter = base + sum(sum(r["counts"]) for r in restored["rows"].values())
        history = list(self._history)  # the same entries (their dicts are rewritten in place below)
        after = [h[1].get(index, 0) for h in history]
        if end < 1 or base not in after[:end]:
            return None  # the base was taken before the oldest step kept (or not at a step boundary)
        first = after.index(base) + 1
        applied_since = counter_now - restored_counter  # updates the replacement applied after its restore
        last, acc = end, 0
        while acc < applied_since and last > first:
            last -= 1
            acc += after[last] - after[last - 1]
        if acc != applied_since:
            return None
        lost_rows = lost_samples = 0
        keep: dict[tuple[int, str], np.ndarray] = {}  # (entry, table) -> which of its ids stay in the lineage
        lost_in: dict[int, int] = {}  # entry -> updates of ``index`` it loses
        for table in {t for h in history[first:last] for t in h[2]}:
            parts = [(g, history[g][2][table]) for g in range(first, last) if table in history[g][2]]
            ids = np.concatenate([p[1][0] for p in parts]).astype(np.int64)
            weights = np.concatenate([p[1][1] for p in parts]).astype(np.int64)
            entry = np.concatenate([np.full(len(p[1][0]), p[0]) for p in parts])
            pos = np.concatenate([np.arange(len(p[1][0])) for p in parts])
            servers, _ = self.cluster.layout.locate(ids)
            mine = np.flatnonzero(servers == index)
            sort = mine[np.lexsort((entry[mine], ids[mine]))]  # this server's rows, by row then by step
            rows = ids[sort]
            starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]]) if len(rows) else np.zeros(0, np.int64)
            rank = np.arange(len(rows)) - np.repeat(starts, np.diff(np.r_[starts, len(rows)]))
            saved = restored["rows"].get(table, {"ids": [], "counts": []})
            reflected = np.zeros(len(rows), dtype=np.int64)
            if saved["ids"]:
                saved_ids, saved_counts = np.asarray(saved["ids"]), np.asarray(saved["counts"])
                by_id = np.argsort(saved_ids)
                saved_ids, saved_counts = saved_ids[by_id], saved_counts[by_id]
                at = np.clip(np.searchsorted(saved_ids, rows), 0, len(saved_ids) - 1)
                hit = saved_ids[at] == rows
                reflected[hit] = saved_counts[at[hit]]
            lost = sort[rank >= reflected]  # the updates after the first ``reflected`` of each row
            lost_rows += len(lost)
            lost_samples += int(weights[lost].sum())
            # each entry's lost updates, one sort for all of them (not a pass over ``lost`` per entry: thousands
            # of steps and millions of lost updates made that minutes)
            lost = lost[np.argsort(entry[lost], kind="stable")]
            entries = entry[lost]
            cuts = np.flatnonzero(np.r_[True, entries[1:] != entries[:-1]]) if len(lost) else np.zeros(0, np.int64)
            for a, b in zip(cuts.tolist(), np.r_[cuts[1:], len(lost)].tolist()):
                g = int(entries[a])
                mask = np.ones(len(history[g][2][table][0]), dtype=bool)
                mask[pos[lost[a:b]]] = False
                keep[(g, table)] = mask
                lost_in[g] = lost_in.get(g, 0) + (b - a)
        if lost_rows != lost_updates:
            return None
        for (g, table), mask in keep.items():  # the lineage: what the replacement's state holds
            ids, n = history[g][2][table]
            self._samples_dropped += int(n[~mask].sum())  # acknowledged all the same: samples_acked keeps them
            history[g][2][table] = (ids[mask], n[mask])
        counter = base
        for g in range(first, len(history)):  # the steps after the failure too: their increments stand
            counter += after[g] - after[g - 1] - lost_in.get(g, 0)
            history[g][1][index] = counter
            if g == end - 1 and counter != counter_now:
                return None
        self._counter_by_server[index] = counter
        return lost_samples
