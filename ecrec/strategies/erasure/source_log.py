"""The log of parity batches a server applied for one owner (a *source*) and that the owner has not
confirmed yet.

Each entry keeps what is needed to undo the batch (XOR the same deltas again, restore the previous
versions, drop held-back deltas).  Recovery of a failed owner reads these logs (``DESIGN.md``, "The
update path"); a confirmation from the owner trims them, and the push ids of trimmed entries are kept a
while (``committed``) so that a retry after a recovery is answered "already applied".
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class TableEntry:
    table: str
    slots: np.ndarray
    positions: np.ndarray
    pidx: np.ndarray
    deltas: np.ndarray
    fresh: np.ndarray
    prev: np.ndarray
    pended: np.ndarray


@dataclass
class DenseEntry:
    name: str
    delta: np.ndarray
    applied: bool
    prev_version: int


@dataclass
class LogEntry:
    seq: int
    push_id: tuple[str, int]
    destinations: tuple[int, ...]
    destination_ids: tuple[str, ...] = ()
    tables: list[TableEntry] = field(default_factory=list)
    dense: list[DenseEntry] = field(default_factory=list)


class SourceLog:
    """Unconfirmed batches received from one owner index, oldest first."""

    def __init__(self, source: int, history: int = 100_000):
        self.source = source
        self.source_id = ""
        self.entries: OrderedDict[int, LogEntry] = OrderedDict()
        self.confirmed_upto = 0
        self.applied_upto = 0
        self.committed: deque[tuple[str, int]] = deque(maxlen=history)

    def confirm(self, upto: int) -> None:
        if upto <= self.confirmed_upto:
            return
        self.confirmed_upto = upto
        while self.entries:
            seq, entry = next(iter(self.entries.items()))
            if seq > upto:
                break
            self.entries.popitem(last=False)
            self.committed.append(entry.push_id)

    def affected_slots(self, table: str) -> np.ndarray:
        parts = [t.slots for e in self.entries.values() for t in e.tables if t.table == table]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
