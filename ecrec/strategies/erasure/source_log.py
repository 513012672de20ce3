"""The log of parity batches a server applied for one owner (a *source*) and that the owner has not
confirmed yet.

Each entry keeps what is needed to undo the batch (XOR the same deltas again, restore the previous
versions, drop held-back deltas).  Recovery of a failed owner reads these logs (``docs/protocol.md``, "A
failed owner: resolution and replay"); a confirmation from the owner trims them, and the push ids of trimmed entries are kept as
each worker incarnation's highest sequence (``committed``) so that a retry after a recovery is answered
"already applied".
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

    def __init__(self, source: int, max_held: int = 256, max_held_bytes: int = 64 << 20):
        self.source = source
        self.source_id = ""  # the incarnation of the chain
        self.entries: OrderedDict[int, LogEntry] = OrderedDict()
        self.confirmed_upto = 0
        self.applied_upto = 0  # the chain is applied up to this batch
        self.held: dict[int, tuple] = {}  # prev_seq -> (batch, parsed, bytes): arrived before its predecessor
        self.max_held = max_held
        self.max_held_bytes = max_held_bytes
        self.held_bytes = 0
        self.closed = False  # resolution closed this incarnation: its batches are refused
        self.resolved_ids: deque[str] = deque(maxlen=16)  # earlier incarnations, resolved: refused
        # per worker incarnation, the highest sequence of its pushes confirmed here (a retry at or below it after a
        # recovery is "already applied"): one entry per incarnation, as many as the owners admit (their
        # --max-applied-bytes), never forgotten
        self.committed: dict[str, int] = {}

    def commit(self, push_ids) -> None:
        """Records confirmed (or kept) push ids: each worker incarnation's highest sequence."""
        committed = self.committed
        for worker, sequence in push_ids:
            if sequence > committed.get(worker, -1):
                committed[worker] = sequence

    def hold(self, prev_seq: int, batch, parsed, nbytes: int) -> bool:
        """Holds ``batch`` until its predecessor arrives; False (nothing held) beyond ``max_held`` batches or
        ``max_held_bytes``."""
        if len(self.held) >= self.max_held or self.held_bytes + nbytes > self.max_held_bytes:
            return False
        old = self.held.get(prev_seq)
        if old is not None:
            self.held_bytes -= old[2]
        self.held[prev_seq] = (batch, parsed, nbytes)
        self.held_bytes += nbytes
        return True

    def unhold(self, prev_seq: int):
        batch, parsed, nbytes = self.held.pop(prev_seq)
        self.held_bytes -= nbytes
        return batch, parsed

    def drop_held(self) -> None:
        self.held.clear()
        self.held_bytes = 0

    def restart(self, source_id: str) -> None:
        """A chain for a new incarnation of the source (the previous one was resolved)."""
        if self.source_id:
            self.resolved_ids.append(self.source_id)
        self.source_id = source_id
        self.entries.clear()
        self.drop_held()
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
            self.commit(entry.push_ids)

    def affected_slots(self, arena: int) -> np.ndarray:
        """Arena slots (of the arena of that row width) that logged batches touched."""
        parts = [t.slots for e in self.entries.values() for t in e.tables if t.arena == arena]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
