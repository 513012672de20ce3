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
    """A batch's deltas in one parity arena (the tables of one row width), as applied or held back here."""

    arena: int  # the arena's row width
    slots: np.ndarray  # arena slots
    positions: np.ndarray
    parity: int  # which parity of the stripes
    deltas: np.ndarray
    old_versions: np.ndarray
    seqs: np.ndarray  # the push of each row's delta


@dataclass
class DenseEntry:
    name: str
    delta: np.ndarray
    old_version: int
    seq: int


@dataclass
class LogEntry:
    """One batch: pushes ``first_seq``..``seq`` of the source."""

    seq: int
    first_seq: int
    push_ids: list[tuple[str, int]]
    destinations: tuple[int, ...]
    destination_ids: tuple[str, ...] = ()
    tables: list[TableEntry] = field(default_factory=list)
    dense: list[DenseEntry] = field(default_factory=list)


class SourceLog:
    """What this server holds of one owner index: the chain of the owner's current incarnation (batches are
    applied strictly in the order they name, later ones held back meanwhile) and the applied batches the
    owner has not confirmed yet, oldest first."""

    def __init__(self, source: int, history: int = 100_000, max_held: int = 256):
        self.source = source
        self.source_id = ""  # the incarnation of the chain
        self.entries: OrderedDict[int, LogEntry] = OrderedDict()
        self.confirmed_upto = 0
        self.applied_upto = 0  # the chain is applied up to this batch
        self.held: dict[int, object] = {}  # prev_seq -> a batch that arrived before its predecessor
        self.max_held = max_held
        self.closed = False  # resolution closed this incarnation: its batches are refused
        self.resolved_ids: deque[str] = deque(maxlen=16)  # earlier incarnations, resolved: refused
        self.committed: deque[tuple[str, int]] = deque(maxlen=history)

    def restart(self, source_id: str) -> None:
        """A chain for a new incarnation of the source (the previous one was resolved)."""
        if self.source_id:
            self.resolved_ids.append(self.source_id)
        self.source_id = source_id
        self.entries.clear()
        self.held.clear()
        self.applied_upto = 0
        self.confirmed_upto = 0
        self.closed = False

    def confirm(self, upto: int) -> None:
        if upto <= self.confirmed_upto:
            return
        self.confirmed_upto = upto
        while self.entries:
            seq, entry = next(iter(self.entries.items()))
            if seq > upto:
                break
            self.entries.popitem(last=False)
            self.committed.extend(entry.push_ids)

    def affected_slots(self, arena: int) -> np.ndarray:
        """Arena slots (of the arena of that row width) that logged batches touched."""
        parts = [t.slots for e in self.entries.values() for t in e.tables if t.arena == arena]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
