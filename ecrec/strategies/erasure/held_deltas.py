"""Deltas held back for parity rows that are being rebuilt, kept as arrays.

While a replacement rebuilds its parity rows, deltas keep arriving for rows not built yet; a row encoded from
data read at some version needs, once built, exactly the deltas newer than that version.  :class:`HeldDeltas`
keeps them in arrival order in growing arrays: a batch's held rows are one copy, with no Python work per row
(at scale a batch holds hundreds of rows for a replacement, every step, until its rebuild ends).  A build takes
the rows it installs in one pass; an undo (resolution) drops the ones it cancels.  Entries taken or dropped are
marked dead and squeezed out once they are most of the arrays.
"""

from __future__ import annotations

import numpy as np

#: entries the arrays start with (they double as needed)
INITIAL_CAPACITY = 1024


class HeldDeltas:
    """Deltas ``(slot, position, seq, delta)`` for parity rows not built yet, in the order they arrived."""

    def __init__(self, row_bytes: int):
        self.row_bytes = row_bytes
        self.clear()

    def clear(self) -> None:
        self.n = 0  # entries used (alive or dead)
        self.alive_count = 0
        self.slots = np.zeros(0, dtype=np.int64)
        self.positions = np.zeros(0, dtype=np.int64)
        self.seqs = np.zeros(0, dtype=np.int64)
        self.alive = np.zeros(0, dtype=bool)
        self.deltas = np.zeros((0, self.row_bytes), dtype=np.uint8)

    def __len__(self) -> int:
        return self.alive_count

    @property
    def nbytes(self) -> int:
        """Bytes of delta held (alive entries)."""
        return self.alive_count * self.row_bytes

    def holds(self, slot: int) -> bool:
        """Whether a delta for ``slot`` is held."""
        n = self.n
        return bool((self.alive[:n] & (self.slots[:n] == slot)).any())

    def add(self, slots: np.ndarray, positions: np.ndarray, seqs: np.ndarray, deltas: np.ndarray) -> None:
        """Holds ``deltas[r]`` for ``slots[r]`` (its stripe position and push sequence beside it), after the rest."""
        count = len(slots)
        if not count:
            return
        self._reserve(self.n + count)
        end = self.n + count
        self.slots[self.n:end] = slots
        self.positions[self.n:end] = positions
        self.seqs[self.n:end] = seqs
        self.alive[self.n:end] = True
        self.deltas[self.n:end] = deltas
        self.n = end
        self.alive_count += count

    def take(self, member: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Removes and returns, in arrival order, the held deltas of the slots marked in ``member`` (a bool array
        over the arena's slots): ``(slots, positions, seqs, deltas)``."""
        n = self.n
        if not self.alive_count:
            return self.empty()
        picked = np.flatnonzero(self.alive[:n] & member[self.slots[:n]])
        out = (self.slots[picked], self.positions[picked], self.seqs[picked], self.deltas[picked])
        self._kill(picked)
        return out

    def drop(self, slots: np.ndarray, positions: np.ndarray, seqs: np.ndarray) -> int:
        """Drops the held deltas that are exactly ``(slots[r], positions[r], seqs[r])`` for some ``r`` (an undo of
        deltas not applied yet); returns how many."""
        n = self.n
        if not self.alive_count or not len(slots):
            return 0
        candidates = np.flatnonzero(self.alive[:n] & np.isin(self.slots[:n], slots))
        if not len(candidates):
            return 0
        wanted = set(zip(np.asarray(slots).tolist(), np.asarray(positions).tolist(), np.asarray(seqs).tolist()))
        triples = zip(self.slots[candidates].tolist(), self.positions[candidates].tolist(),
                      self.seqs[candidates].tolist())
        gone = candidates[[t in wanted for t in triples]]
        self._kill(gone)
        return len(gone)

    def empty(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What :meth:`take` returns when nothing is held for the rows asked."""
        return (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                np.zeros((0, self.row_bytes), np.uint8))

    # --- storage --------------------------------------------------------------------------------------------
    def _kill(self, index: np.ndarray) -> None:
        self.alive[index] = False
        self.alive_count -= len(index)
        if self.alive_count == 0:
            self.n = 0  # keep the arrays for the next ones
        elif self.n - self.alive_count > max(INITIAL_CAPACITY, self.n // 2):
            self._squeeze()

    def _squeeze(self) -> None:
        keep = np.flatnonzero(self.alive[:self.n])
        count = len(keep)
        for name in ("slots", "positions", "seqs", "deltas"):
            array = getattr(self, name)
            array[:count] = array[keep]
        self.alive[:count] = True
        self.alive[count:self.n] = False
        self.n = count

    def _reserve(self, size: int) -> None:
        capacity = len(self.slots)
        if size <= capacity:
            return
        capacity = max(INITIAL_CAPACITY, capacity)
        while capacity < size:
            capacity *= 2
        for name in ("slots", "positions", "seqs", "alive", "deltas"):
            old = getattr(self, name)
            new = np.zeros((capacity,) + old.shape[1:], dtype=old.dtype)
            new[:self.n] = old[:self.n]
            setattr(self, name, new)
