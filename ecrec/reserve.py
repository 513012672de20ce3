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
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for arrays in self._held.values() for a in arrays)

    @property
    def pending(self) -> bool:
        """Whether arrays wanted are still being prepared."""
        with self._lock:
            return not self._closed and any(len(self._held.get(name, [])) < len(shapes)
                                            for name, shapes in self._wanted.items())

    def prepare(self, wanted: dict[str, list[Shape]]) -> None:
        """Makes sure arrays of ``wanted`` (table name -> shapes) are held, preparing the missing ones on a
        background thread; tables no longer wanted are dropped."""
        with self._lock:
            if self._closed or wanted == self._wanted:
                return
            self._wanted = {name: list(shapes) for name, shapes in wanted.items()}
            for name in [n for n in self._held if n not in wanted]:
                del self._held[name]
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._fill, name="ecrec-reserve", daemon=True)
                self._thread.start()

    def _fill(self) -> None:
        t0, made = time.perf_counter(), 0
        while True:
            with self._lock:
                todo = next(((name, shape) for name, shapes in self._wanted.items()
                             for shape in shapes[len(self._held.get(name, [])):]), None) if not self._closed else None
            if todo is None:
                break
            name, (shape, dtype) = todo
            array = np.zeros(shape, dtype=dtype)
            array.reshape(-1)[:: max(1, 4096 // array.itemsize)] = 0  # one write per page: the kernel backs it
            with self._lock:
                if self._closed or self._wanted.get(name) is None:
                    continue
                self._held.setdefault(name, []).append(array)
            made += array.nbytes
        if made:
            log.info("standby reserve: %.0f MB of table memory ready for a promotion in %.2f s", made / 1e6,
                     time.perf_counter() - t0)

    def take(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A zeroed array of ``shape`` and ``dtype``: a held one of table ``name`` when there is one, else a
        new one."""
        shape, dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        with self._lock:
            arrays = self._held.get(name, [])
            for i, array in enumerate(arrays):
                if array.shape == shape and array.dtype == dtype:
                    return arrays.pop(i)
        return np.zeros(shape, dtype=dtype)

    def close(self) -> None:
        """Frees everything held and prepares nothing more (after a promotion)."""
        with self._lock:
            self._closed = True
            self._held.clear()
            self._wanted.clear()
