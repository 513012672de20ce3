"""Named counters that request handlers, the owner's closer and the background rebuild add to at once.

``counters[name] += f()`` is not atomic: Python reads the old value *before* it calls ``f`` and stores the
sum after, so an increment made by another thread while ``f`` runs (a rebuild's install waiting on a lock,
say) is lost. ``Counters.add`` evaluates the amount first and adds it under a lock; ``Counters.cpu(name)`` adds the
calling thread's CPU seconds of a block (as ``ecrec.snapshot.tally.Tally.cpu`` does for a snapshot's parts)."""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict


class Counters(defaultdict):
    """A ``defaultdict(float)`` (read it as one) whose writers use :meth:`add`."""

    def __init__(self) -> None:
        super().__init__(float)
        self._lock = threading.Lock()

    def add(self, name: str, amount: float) -> None:
        with self._lock:
            self[name] += amount

    @contextlib.contextmanager
    def cpu(self, name: str):
        """Adds the calling thread's CPU seconds in the ``with`` block to ``name`` (raised or not)."""
        t0 = time.thread_time()
        try:
            yield
        finally:
            self.add(name, time.thread_time() - t0)

    def __reduce__(self):  # a plain dict when copied or pickled: the lock stays behind
        return dict, (dict(self),)
