"""Python's garbage collector in a long-running process: its full collections, counted and timed, and the objects of
the process's start-up kept out of them.

A full (generation 2) collection walks every object the collector tracks, holding the interpreter meanwhile.  A
server's start-up leaves about 130,000 of them (grpc, protobuf, numba and what their imports build), none ever
garbage: with them a full collection took 80-200 ms in a server on this project's 2-core machines (measured at
start-up), a stall of every step waiting on that server whenever one came.  :func:`freeze` collects once and moves
everything alive to the collector's permanent generation (``gc.freeze``), so a full collection walks only what
serving made since.  :class:`Watch` counts full collections and their pauses (a server's status and metrics report
them; none came while servers trained or recovered in the benchmarks, with or without the freeze).
"""

from __future__ import annotations

import gc
import threading
import time


def freeze() -> int:
    """Collects what is garbage now, then keeps every object alive now out of later collections; returns how many
    objects are frozen (they are never collected: call it once the start-up's objects are made)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class Watch:
    """Full collections of this process from the moment it is made: count, total and longest pause (seconds, by the
    wall clock: the interpreter is held for all of it).  One per process: :func:`watch`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._started = 0.0
        self.full_collections = 0
        self.pause_s = 0.0
        self.longest_s = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        with self._lock:
            self.full_collections += 1
            self.pause_s += pause
            self.longest_s = max(self.longest_s, pause)

    def reset(self) -> None:
        """Counts from now on (a server's start-up is over)."""
        with self._lock:
            self.full_collections, self.pause_s, self.longest_s = 0, 0.0, 0.0

    def close(self) -> None:
        """Stops counting (the callback is removed)."""
        try:
            gc.callbacks.remove(self._on_gc)
        except ValueError:
            pass

    def status(self) -> dict:
        """``gc_full_collections``, ``gc_pause_s``, ``gc_longest_pause_ms``, ``gc_frozen_objects`` (O(1): no
        object is visited)."""
        with self._lock:
            out = {"gc_full_collections": self.full_collections, "gc_pause_s": self.pause_s,
                   "gc_longest_pause_ms": 1e3 * self.longest_s}
        out["gc_frozen_objects"] = gc.get_freeze_count()
        return out


_watch: Watch | None = None
_watch_lock = threading.Lock()


def watch() -> Watch:
    """This process's :class:`Watch` (made at the first call: it counts from then on)."""
    global _watch
    with _watch_lock:
        if _watch is None:
            _watch = Watch()
        return _watch
