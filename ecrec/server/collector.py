"""Python's garbage collector in a long-running process: its full collections, counted and timed, and the objects of
the process's start-up kept out of them.

A full (generation 2) collection walks every object the collector tracks, holding the interpreter meanwhile.  A
server's start-up leaves about 130,000 of them (grpc, protobuf, numba and what their imports build), none ever
garbage: a full collection over them takes tens to hundreds of milliseconds on a loaded 2-core machine
(``gc_freeze_collect_ms`` in a server's status is the one made just before the freeze), a stall of every step
waiting on that server whenever one came.  :func:`freeze` collects once and moves everything alive to the
collector's permanent generation (``gc.freeze``), so a full collection walks only what serving made since.
:class:`Watch` counts full collections and their pauses (a server's status and metrics report them; none came
while servers trained or recovered in the benchmarks, with or without the freeze).
"""

from __future__ import annotations

import gc
import threading
import time


def freeze() -> tuple[int, float]:
    """Collects what is garbage now, then keeps every object alive now out of later collections (they are never
    collected: call it once the start-up's objects are made); returns how many objects are frozen and the seconds
    that last full collection over all of them took.  :func:`watch` records both."""
    w = watch()
    started = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - started
    gc.freeze()
    w.frozen, w.freeze_collect_s = gc.get_freeze_count(), took  # (counted once here: the count walks them all)
    return w.frozen, took


class Watch:
    """Full collections of this process from the moment it is made: count, total and longest pause (seconds, by the
    wall clock: the interpreter is held for all of it), as totals (never decreasing: the metrics' counters) and
    since :meth:`mark` (a server's figures while it serves).  One per process: :func:`watch`.

    The callback runs inside a collection, on whichever thread triggered it, and takes no lock (a collection can
    start inside any allocation, a locked section included): it replaces one tuple, which readers take whole."""

    def __init__(self):
        self._started: float | None = None
        self._totals = (0, 0.0, 0.0)  # full collections, their pauses, the longest
        self._mark = (0, 0.0)  # the totals' first two at mark()
        self._longest_since_mark = 0.0
        self.frozen = 0  # objects freeze() froze, counted then (0: none; those that die later leave the count)
        self.freeze_collect_s = 0.0  # the full collection freeze() made over them
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # made during a collection: its stop without its start
            return
        pause = time.perf_counter() - self._started
        self._started = None
        n, total, longest = self._totals
        self._totals = (n + 1, total + pause, max(longest, pause))
        self._longest_since_mark = max(self._longest_since_mark, pause)

    def mark(self) -> None:
        """The figures since a moment (a server's start-up is over): :meth:`status` counts from here."""
        n, total, _ = self._totals
        self._mark = (n, total)
        self._longest_since_mark = 0.0

    @property
    def full_collections(self) -> int:
        return self._totals[0]

    @property
    def pause_s(self) -> float:
        return self._totals[1]

    @property
    def longest_s(self) -> float:
        return self._totals[2]

    def close(self) -> None:
        """Stops counting (the callback is removed)."""
        try:
            gc.callbacks.remove(self._on_gc)
        except ValueError:
            pass

    def status(self) -> dict:
        """Since :meth:`mark`: ``gc_full_collections``, ``gc_pause_s``, ``gc_longest_pause_ms``; the totals
        (``gc_full_collections_total``, ``gc_pause_total_s``); ``gc_frozen_objects`` and
        ``gc_freeze_collect_ms`` (the full collection over them before they were frozen).  Nothing is walked."""
        (n, total, _), (n0, total0) = self._totals, self._mark
        return {"gc_full_collections": n - n0, "gc_pause_s": total - total0,
                "gc_longest_pause_ms": 1e3 * self._longest_since_mark, "gc_full_collections_total": n,
                "gc_pause_total_s": total, "gc_frozen_objects": self.frozen,
                "gc_freeze_collect_ms": 1e3 * self.freeze_collect_s}


_watch: Watch | None = None
_watch_lock = threading.Lock()


def watch() -> Watch:
    """This process's :class:`Watch` (made at the first call: it counts from then on)."""
    global _watch
    with _watch_lock:
        if _watch is None:
            _watch = Watch()
        return _watch
