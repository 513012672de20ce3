"""The log of parity batches a server applied for one owner (a *source*) and that the owner has not
confirmed yet.

Each entry keeps what is needed to undo the batch (XOR the same deltas again, restore the previous
versions, drop held-back deltas).  Recovery of a failed owner reads these logs (``docs/protocol.md``, "A
failed owner: resolution and replay"); a confirmation from the owner trims them, and the push ids of trimmed entries are kept as
each worker incarnation's highest sequence (``committed``) so that a retry after a recovery is answered
"already applied".

A ``SourceLog`` is part of the protocol's sans-I/O core (``docs/protocol.md``, "Core and adapter"): it decides
(which incarnation a batch may join, apply or hold back or skip, what a resolution lists, undoes and keeps, what
a rebuild may adopt) and keeps the state those decisions need; it has no lock, socket, thread or clock, and never
touches a row.  ``receiver.ParityReceiver`` is its adapter (gRPC, the lock, the arenas the deltas go into), and
the simulator (``tests/sim``) drives the same class.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ecrec.strategies.erasure.outbox import EVERY_VERSION
from ecrec.wire import embedding_pb2


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


#: what :meth:`SourceLog.incarnation` decides for a batch of some incarnation of the source
SAME, RESTARTED, RESOLVED, FOREIGN, CLOSED = "same", "restarted", "resolved", "foreign", "closed"
#: what :meth:`SourceLog.offer` decides for a batch of the current incarnation
DUPLICATE, APPLY, HELD, FULL = "duplicate", "apply", "held", "full"


class Offer(NamedTuple):
    """What to do with an offered batch: ``kind`` (duplicate, apply, held, full) and, for ``apply``, the batches to
    apply now, in order, as ``(seq, item)`` -- the offered one and every held successor it releases."""

    kind: str
    ready: list


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
        self.held: dict[int, tuple] = {}  # prev_seq -> (seq, item, bytes): arrived before its predecessor
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

    # --- a batch arrives ------------------------------------------------------------------------------------
    def incarnation(self, source_id: str, named_live: bool) -> str:
        """Whether a batch of incarnation ``source_id`` may join this log: ``SAME`` (its chain), ``RESTARTED``
        (a new incarnation the map names live, ``named_live``: its chain starts here; batches an earlier
        incarnation left unresolved are kept, committed), or refused: ``RESOLVED`` (replaced and resolved),
        ``FOREIGN`` (the map does not name it yet), ``CLOSED`` (being resolved)."""
        if source_id != self.source_id:
            if source_id in self.resolved_ids:
                return RESOLVED
            if not named_live:
                return FOREIGN
            if self.entries and not self.closed and self.source_id:
                for e in self.entries.values():  # resolution of the previous incarnation never reached here
                    self.commit(e.push_ids)
            self.restart(source_id)
            return RESTARTED
        return CLOSED if self.closed else SAME

    def offer(self, seq: int, prev_seq: int, item: Any, nbytes: int) -> Offer:
        """Batch ``seq`` (following ``prev_seq`` in its chain) of the current incarnation: ``DUPLICATE`` (applied
        already: skip it), ``APPLY`` (it and the held successors it releases, in order: apply each, then
        :meth:`record` it), ``HELD`` (its predecessor has not arrived) or ``FULL`` (it would be held beyond
        ``max_held`` batches or ``max_held_bytes``: refuse it)."""
        if seq <= self.applied_upto:
            return Offer(DUPLICATE, [])
        if prev_seq == self.applied_upto:
            ready = [(seq, item)]
            while seq in self.held:
                seq, nxt, nb = self.held.pop(seq)
                self.held_bytes -= nb
                ready.append((seq, nxt))
            return Offer(APPLY, ready)
        if len(self.held) >= self.max_held or self.held_bytes + nbytes > self.max_held_bytes:
            return Offer(FULL, [])
        old = self.held.get(prev_seq)
        if old is not None:
            self.held_bytes -= old[2]
        self.held[prev_seq] = (seq, item, nbytes)
        self.held_bytes += nbytes
        return Offer(HELD, [])

    def record(self, seq: int, entry) -> None:
        """Batch ``seq`` is applied (``entry`` says how to undo it and names its push ids)."""
        self.entries[seq] = entry
        self.applied_upto = seq

    def logged_upto(self, source_id: str) -> int:
        """Every batch of incarnation ``source_id`` up to this sequence is in this log or confirmed (0 for another
        incarnation, or one being resolved)."""
        return self.applied_upto if self.source_id == source_id and not self.closed else 0

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

    # --- resolution of a failed incarnation, a rebuild's adoption -----------------------------------------------
    def close_for_resolution(self) -> None:
        """The incarnation failed: its later batches are refused (``CLOSED``), held-back ones dropped."""
        self.closed = True
        self.drop_held()

    def listing(self, reply) -> None:
        """Fills ``reply`` (a ``ResolveSourceReply``) with what this log holds: logged batches, confirmation, commits."""
        for seq, e in self.entries.items():
            reply.logged.add(seq=seq, first_seq=e.first_seq, destinations=list(e.destinations),
                             destination_ids=list(e.destination_ids),
                             push_ids=[embedding_pb2.PushId(worker=w, sequence=q) for w, q in e.push_ids])
        reply.confirmed_upto = self.confirmed_upto
        for w, q in self.committed.items():
            reply.committed.add(worker=w, sequence=q)

    def resolve(self, undo: set[int]) -> list:
        """Ends the failed incarnation by resolution's decision: returns the entries of ``undo`` to undo (newest
        first: the caller XORs their deltas back), commits every other one, and forgets the incarnation (its
        batches are refused from now on)."""
        undone = [self.entries[seq] for seq in sorted(undo, reverse=True) if seq in self.entries]
        for seq, e in self.entries.items():
            if seq not in undo:
                self.commit(e.push_ids)
        if self.source_id:
            self.resolved_ids.append(self.source_id)
        self.source_id = ""
        self.entries.clear()
        self.drop_held()
        self.applied_upto = self.confirmed_upto = 0
        self.closed = False
        return undone

    def adopt(self, source_id: str, bound: int, committed) -> bool:
        """A parity or replica rebuilt from rows of incarnation ``source_id`` is about to count as built: keeps
        the owner's confirmed ``bound`` and committed push ids here, so that a resolution of the source keeps
        what the rebuild embedded.  False (nothing changes; read the rows again) when this log is of another
        incarnation still open, ``source_id`` was resolved, or it is being resolved."""
        if self.source_id != source_id:
            if source_id in self.resolved_ids or (self.source_id and not self.closed):
                return False
            self.restart(source_id)
        elif self.closed:
            return False
        self.commit(committed)
        if 0 < bound < EVERY_VERSION:  # the owner's own confirmation (none numbered: nothing to confirm)
            self.confirm(bound)
        return True

    def affected_slots(self, arena: int) -> np.ndarray:
        """Arena slots (of the arena of that row width) that logged batches touched."""
        parts = [t.slots for e in self.entries.values() for t in e.tables if t.arena == arena]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
