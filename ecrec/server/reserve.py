"""Memory a standby prepares for its promotion: zeroed arrays whose pages already exist.

A fresh numpy array of zeros costs nothing until a page of it is first written; then the kernel finds and
zeroes that page (2 MB at a time with transparent huge pages).  A promoted replacement writes its whole
shard while it rebuilds, and the first training step after the failure writes rows scattered over all of
it.  Measured here on a 512 MB shard: 4,088 scattered rows took 65-170 ms to write into a fresh array and
1 ms into one whose pages existed; writing the whole array took 86-675 ms fresh and 25 ms otherwise.

A standby has nothing else to do.  When it learns the cluster map it allocates and touches, on a background
thread, one array of every large shape its promotion will need (per table: the shard's rows, and what the
strategy keeps per row); the promotion takes them by table name (:meth:`Reserve.take`), anything else is
allocated then, as before, and what the promotion did not take is freed.  The cost is the memory of one
server's tables, which the standby needs the moment it is promoted anyway; ``--no-standby-reserve`` turns
it off.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

log = logging.getLogger("ecrec.reserve")

Shape = tuple[tuple[int, ...], str]  # (shape, dtype name)


class Reserve:
    """Zeroed, touched arrays by table name (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[str, list[np.ndarray]] = {}
        self._wanted: dict[str, list[Shape]] = {}
        self._todo: list[tuple[str, Shape]] = []  # what the filler makes next
        self._making: tuple[str, Shape] | None = None  # what it makes now
        self._filling = False
        self._closed = False
        self.used_bytes = 0  # handed out by take()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for arrays in self._held.values() for a in arrays)

    @property
    def pending(self) -> bool:
        """Whether arrays wanted are still being prepared."""
        with self._lock:
            return bool(self._todo) or self._making is not None

    def prepare(self, wanted: dict[str, list[Shape]]) -> None:
        """Makes sure arrays of ``wanted`` (table name -> shapes) are held, preparing the missing ones on a
        background thread; tables no longer wanted are dropped."""
        with self._lock:
            if self._closed or wanted == self._wanted:
                return
            self._wanted = {name: list(shapes) for name, shapes in wanted.items()}
            for name in [n for n in self._held if n not in wanted]:
                del self._held[name]
            self._todo = []
            for name, shapes in self._wanted.items():
                have = [(a.shape, a.dtype.name) for a in self._held.get(name, [])]
                if self._making is not None and self._making[0] == name:
                    have.append(self._making[1])
                for shape in shapes:
                    key = (tuple(shape[0]), np.dtype(shape[1]).name)
                    if key in have:
                        have.remove(key)
                    else:
                        self._todo.append((name, key))
            if self._todo and not self._filling:
                self._filling = True
                threading.Thread(target=self._fill, name="ecrec-reserve", daemon=True).start()

    def _fill(self) -> None:
        t0, made = time.perf_counter(), 0
        while True:
            with self._lock:
                if not self._todo or self._closed:
                    self._filling, self._making = False, None
                    break
                self._making = self._todo.pop(0)
                name, (shape, dtype) = self._making
            array = np.zeros(shape, dtype=dtype)
            array.reshape(-1)[:: max(1, 4096 // array.itemsize)] = 0  # one write per page: the kernel backs it
            with self._lock:
                self._making = None
                if not self._closed and name in self._wanted:
                    self._held.setdefault(name, []).append(array)
                    made += array.nbytes
        if made:
            log.info("standby reserve: %.0f MB of table memory ready for a promotion in %.2f s", made / 1e6,
                     time.perf_counter() - t0)

    def stop_preparing(self) -> None:
        """Prepares nothing more (a promotion starts: it takes what is held, allocates the rest itself)."""
        with self._lock:
            self._todo = []
            self._closed = True

    def take(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A zeroed array of ``shape`` and ``dtype``: a held one of table ``name`` when there is one, else a
        new one."""
        shape, dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        with self._lock:
            arrays = self._held.get(name, [])
            for i, array in enumerate(arrays):
                if array.shape == shape and array.dtype == dtype:
                    self.used_bytes += array.nbytes
                    return arrays.pop(i)
        return np.zeros(shape, dtype=dtype)

    def close(self) -> None:
        """Frees everything held and prepares nothing more (after a promotion)."""
        with self._lock:
            self._closed = True
            self._todo = []
            self._held.clear()
            self._wanted.clear()
