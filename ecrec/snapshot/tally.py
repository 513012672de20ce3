"""Amounts by part, added from several threads: what a snapshot's save (each server) and restore (the client)
spent where.  ``cpu(part)`` adds the calling thread's CPU seconds of a block, ``wall(part)`` its wall seconds,
``add(part, amount)`` anything else (bytes)."""

from __future__ import annotations

import contextlib
import threading
import time


class Tally:
    def __init__(self, parts=()):
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(parts, 0)

    def add(self, part: str, amount: float) -> None:
        with self._lock:
            self._values[part] = self._values.get(part, 0) + amount

    def cpu(self, part: str):
        return self._timed(part, time.thread_time)

    def wall(self, part: str):
        return self._timed(part, time.perf_counter)

    @contextlib.contextmanager
    def _timed(self, part: str, clock):
        t0 = clock()
        try:
            yield
        finally:
            self.add(part, clock() - t0)

    def as_dict(self) -> dict:
        """Every part's amount, seconds rounded to 0.1 ms (counts as they are)."""
        with self._lock:
            return {k: round(v, 4) if isinstance(v, float) else v for k, v in self._values.items()}
