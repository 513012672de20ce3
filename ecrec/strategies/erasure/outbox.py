"""An owner's outbox and chains as a sans-I/O core: which batches each destination incarnation has not applied,
how they chain, and what is confirmed.

Part of the protocol's core (``docs/protocol.md``, "Core and adapter"): plain state and decisions, no lock,
socket, thread or clock of its own.  ``owner.ParityOwner`` is its adapter (the lock, the groups and their batches,
seals, the senders' threads); the simulator (``tests/sim``) drives the same class.

Each destination incarnation gets the owner's batches as a *chain*: a batch names the previous one addressed to
that incarnation (``prev_seq``).  An entry (a closed group) leaves the outbox once every destination applied its
batch, in push order; ``confirmed`` follows, and the entry's push ids become *committed* (per worker incarnation,
the highest sequence).  A replaced destination's chain restarts with every entry not confirmed everywhere.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

#: a confirmed bound covering every version held here (no push numbered in this incarnation yet)
EVERY_VERSION = (1 << 63) - 1


def confirmed_bound(last_numbered: int, confirmed: int) -> int:
    """An owner's confirmed bound (:meth:`Outbox.bound`): with no push numbered in this incarnation every version
    it holds is older (initial, or kept by the resolution that rebuilt it), so all stand; otherwise every push up
    to ``confirmed`` is applied at every destination."""
    return EVERY_VERSION if last_numbered == 0 else confirmed


class SealedBatch(NamedTuple):
    """A serialized ``ParityBatch`` with its owner's seal: what a ``RelayBatch`` carries (same fields), kept
    once per batch and copied once into the reply that carries it."""

    destination: int
    destination_id: str = ""
    batch: bytes = b""
    mac: bytes = b""


@dataclass
class OutboxEntry:
    """One group's batches, until every destination has applied its own."""

    seq: int  # the group's last push
    first_seq: int
    created: float
    batches: dict  # destination -> parity_pb2.ParityBatch
    pending: set[int] = field(default_factory=set)  # destinations that have not acknowledged it
    relayed: bool = True  # went back in a push reply (else it is due for direct delivery at once)
    sealed: dict[int, SealedBatch] = field(default_factory=dict)  # as addressed now, serialized once
    built: bool = True  # False while the owner's closer thread builds its batches
    push_ids: list = field(default_factory=list)  # the group's pushes: committed when the entry is confirmed
    # destination -> its batch's bulk sections, when the batch carries only the rest (a frame's: batch_frames)
    sections: dict = field(default_factory=dict)


@dataclass
class Chain:
    """This owner's batches to one destination incarnation (``server_id`` empty: no live server)."""

    server_id: str
    last_seq: int = 0  # the last batch addressed to this incarnation: the next one's prev_seq
    acked_upto: int = 0  # applied there up to here
    restarted: bool = False  # every pending batch is to be (re)sent directly now


#: what :meth:`Outbox.ack` made of an acknowledgement
STALE, BEYOND, ACKED = "stale", "beyond", "acked"


class Outbox:
    """The outbox, the chains, the confirmation and the committed push ids of one owner incarnation."""

    def __init__(self):
        self.entries: OrderedDict[int, OutboxEntry] = OrderedDict()
        self.chains: dict[int, Chain] = {}
        self.confirmed = 0  # every push up to this is applied everywhere
        # per worker incarnation, the highest sequence of its pushes here that is confirmed (or kept by the
        # resolution that rebuilt this index): a rebuild that embeds this server's rows takes these with them
        self.committed: dict[str, int] = {}
        self.last_seq = 0  # the last push numbered

    # --- pushes and groups -----------------------------------------------------------------------------------
    def numbered(self, seq: int) -> None:
        """Push ``seq`` was applied here (in order); the first of this incarnation starts the confirmation."""
        if self.last_seq == 0:  # sequences are consecutive from here
            self.confirmed = seq - 1
        self.last_seq = seq

    def add(self, entry: OutboxEntry) -> None:
        """A group closed: its entry waits for its batches (``install``) and their acknowledgements."""
        self.entries[entry.seq] = entry

    def chain(self, destination: int, live_id: str) -> Chain:
        """The chain to ``destination`` (started at ``live_id``, the incarnation serving it, if there is none)."""
        chain = self.chains.get(destination)
        if chain is None:
            chain = self.chains[destination] = Chain(live_id)
        return chain

    def address(self, batch, destination: int, chain: Chain) -> None:
        """Addresses ``batch`` (a ``ParityBatch``) as the next of ``chain``, with the confirmation now."""
        batch.destination = destination
        batch.destination_id = chain.server_id
        batch.prev_seq = chain.last_seq
        batch.confirmed_upto = self.confirmed
        chain.last_seq = batch.seq

    def install(self, entry: OutboxEntry, batches: dict, live_id: Callable[[int], str], group_open: bool) -> list[int]:
        """``entry``'s batches are built: each is addressed to its destination's chain, in push order (call in
        it); returns the destinations, sorted.  ``live_id(d)``, the incarnation serving ``d`` now, is asked only for
        a destination with no chain yet.  An entry with no batch is confirmed at once."""
        destinations = sorted(batches)
        destination_ids = [(self.chains.get(d) or self.chain(d, live_id(d))).server_id for d in destinations]
        entry.batches, entry.pending, entry.built = batches, set(destinations), True
        for d in destinations:
            b = batches[d]
            b.destinations.extend(destinations)
            b.destination_ids.extend(destination_ids)
            self.address(b, d, self.chains[d])
        if not batches:
            self.advance(group_open)
        return destinations

    # --- acknowledgements, confirmation ----------------------------------------------------------------------
    def commit(self, push_ids) -> None:
        committed = self.committed
        for worker, sequence in push_ids:
            if sequence > committed.get(worker, -1):
                committed[worker] = sequence

    def advance(self, group_open: bool) -> bool:
        """Pops the leading entries that are built and applied everywhere; ``confirmed`` follows (to the last push
        when nothing waits, ``group_open`` telling whether pushes wait in a group not closed yet).  Whether it
        moved."""
        before = self.confirmed
        while self.entries:
            seq, entry = next(iter(self.entries.items()))
            if entry.pending or not entry.built:
                break
            self.entries.popitem(last=False)
            self.commit(entry.push_ids)
            self.confirmed = seq
        if not self.entries and not group_open:
            self.confirmed = max(self.confirmed, self.last_seq)
        return self.confirmed != before

    def ack(self, destination: int, destination_id: str, applied_upto: int, group_open: bool) -> str:
        """``destination`` (incarnation ``destination_id``) applied this owner's chain up to ``applied_upto``:
        ``ACKED`` (taken), ``STALE`` (another incarnation, or not news: ignored) or ``BEYOND`` (further than the
        chain was ever sent: not from this chain; ignored)."""
        chain = self.chains.get(destination)
        if chain is None or chain.server_id != destination_id or applied_upto <= chain.acked_upto:
            return STALE
        if applied_upto > chain.last_seq:
            return BEYOND
        chain.acked_upto = applied_upto
        for seq, entry in self.entries.items():
            if seq > applied_upto:
                break
            entry.pending.discard(destination)
        self.advance(group_open)
        return ACKED

    def bound(self) -> int:
        """The confirmed bound (:func:`confirmed_bound`) of the pushes numbered here so far."""
        return confirmed_bound(self.last_seq, self.confirmed)

    def unconfirmed(self, group_open: bool) -> int:
        return self.last_seq - self.confirmed if self.entries or group_open else 0

    # --- destinations replaced -------------------------------------------------------------------------------
    def restart(self, live_ids: dict[int, str]) -> list[int]:
        """Restarts the chain of every destination whose incarnation changed (``live_ids``: index -> the server
        serving it; an index missing has none): the new one gets every entry with a batch for it that is not
        confirmed everywhere, acknowledged by the old incarnation or not -- the replacement's rebuild embeds the
        rows they changed only once they are in its log (or confirmed), so that a resolution of this owner can
        undo them there.  Returns the destinations restarted at a live incarnation."""
        restarted = []
        for d, chain in list(self.chains.items()):
            now = live_ids.get(d, "")
            if now == chain.server_id:
                continue
            fresh = self.chains[d] = Chain(now, restarted=bool(now))
            for entry in self.entries.values():
                if d in entry.batches:
                    if now:
                        entry.pending.add(d)
                    # re-addressed as a copy, never in place: a sender may be serializing the old one outside the
                    # owner's lock (in place, it could send a new destination with an old prev_seq)
                    batch = type(entry.batches[d])()
                    batch.CopyFrom(entry.batches[d])
                    self.address(batch, d, fresh)
                    entry.batches[d] = batch
                    entry.sealed.pop(d, None)
            if now:
                restarted.append(d)
        return restarted

    # --- direct delivery -------------------------------------------------------------------------------------
    def due(self, destination: int, everything: bool, cutoff: float) -> list[OutboxEntry]:
        """Entries ``destination`` has not acknowledged: all of them (``everything``, or once after a restart) or
        those not relayed or created at or before ``cutoff``.  None while no server holds it."""
        chain = self.chains.get(destination)
        if chain is None or not chain.server_id:
            return []
        if chain.restarted:
            everything, chain.restarted = True, False
        return [e for e in self.entries.values()
                if destination in e.pending and (everything or not e.relayed or e.created <= cutoff)]
