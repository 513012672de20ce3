"""The owner side of the parity path: each applied push becomes one batch per destination, kept in an
outbox until every destination has applied it.

For every row a push changed, ``delta = old payload XOR new payload`` (with the row's stripe position
and its version before the push) goes to the ``m`` parity servers of its stripe; a dense tensor's delta
goes to its ``m`` backups.  All deltas of one push for one destination form one ``ParityBatch``.

Delivery is pipelined (``DESIGN.md``, "The update path"): the push is acknowledged as soon as it is
applied here and its batches are in the :class:`Outbox`; the batches go back to the worker in the push
reply, and the worker attaches them to its next request to each destination (the *relay*: no RPC of
its own).  The destinations' watermarks come back with the worker's next push (:meth:`ParityOwner.ack`).
A batch not acknowledged within ``relay_timeout_s`` (a worker that stopped or died, several workers out
of order) is sent directly by the destination's :class:`~ecrec.strategies.erasure.sender.DestinationSender`.

Each destination incarnation gets the owner's batches as a *chain*: every batch names the previous one
(``prev_seq``) and the destination applies them strictly in that order, whichever path brought them.
When a destination is replaced, the chain restarts at the replacement with every batch it has not
acknowledged (the replacement's rebuild already contains those older than what it read; its version
check skips them).  ``confirmed_upto`` -- every push up to it is applied at all its destinations -- goes
back to the worker, which keeps each push until it is confirmed and replays the unconfirmed ones if this
owner fails, and to the destinations, which then trim their logs.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ecrec import errors
from ecrec.cluster_map import live_servers
from ecrec.strategies.base import AppliedPush, PushOutcome, StrategyHost
from ecrec.strategies.erasure.sender import DestinationSender
from ecrec.wire import embedding_pb2, parity_pb2


def build_batches(push: AppliedPush, layout, source: int, source_id: str) -> dict[int, parity_pb2.ParityBatch]:
    """One :class:`ParityBatch` per destination index holding every delta of ``push`` meant for it."""
    batches: dict[int, parity_pb2.ParityBatch] = {}
    push_id = embedding_pb2.PushId(worker=push.push_id[0], sequence=push.push_id[1])

    def batch(destination: int) -> parity_pb2.ParityBatch:
        b = batches.get(destination)
        if b is None:
            b = batches[destination] = parity_pb2.ParityBatch(source=source, source_id=source_id, seq=push.seq,
                                                              push_id=push_id)
        return b

    for update in push.tables:
        delta = np.bitwise_xor(update.old, update.new)
        stripes, positions = layout.stripe_of(update.ids)
        old_versions = update.old_versions
        name = update.shard.spec.name
        for j in range(layout.m):  # parity j of each row's stripe; a row's parities are on distinct servers
            dest = layout.member_server(stripes, layout.k + j)
            for d in np.unique(dest).tolist():
                rows = np.flatnonzero(dest == d)
                batch(d).tables.add(
                    table=name, parity_slots=layout.parity_slot(stripes[rows], j).tobytes(),
                    positions=positions[rows].tobytes(),
                    parity_index=np.full(len(rows), j, dtype=np.int64).tobytes(), deltas=delta[rows].tobytes(),
                    old_versions=old_versions[rows].astype(np.int64).tobytes())
    for update in push.dense:
        delta = np.bitwise_xor(update.old, update.new).reshape(-1)
        for d in layout.dense_servers(update.dense.spec.name)[1:]:
            batch(d).dense.add(name=update.dense.spec.name, value=delta.tobytes(), old_version=update.old_version)
    return batches


@dataclass
class OutboxEntry:
    """One push's batches, until every destination has applied its own."""

    seq: int
    push_id: tuple[str, int]
    created: float
    batches: dict[int, parity_pb2.ParityBatch]
    pending: set[int] = field(default_factory=set)  # destinations that have not acknowledged it


@dataclass
class Chain:
    """This owner's batches to one destination incarnation (``server_id`` empty: no live server)."""

    server_id: str
    last_seq: int = 0  # the last batch addressed to this incarnation: the next one's prev_seq
    acked_upto: int = 0  # applied there up to here
    restarted: bool = False  # every pending batch is to be (re)sent directly now


class ParityOwner:
    """The outbox, the chains and the senders of one owning server (see the module docstring)."""

    def __init__(self, host: StrategyHost, options, closed: threading.Event, counters):
        self.host = host
        self.options = options
        self.closed = closed
        self.counters = counters
        self.outbox: OrderedDict[int, OutboxEntry] = OrderedDict()
        self.chains: dict[int, Chain] = {}
        self.senders: dict[int, DestinationSender] = {}
        self.lock = threading.Condition()
        self._confirmed = 0  # every push up to this is applied everywhere
        self._last_seq = 0

    # --- state read by others -------------------------------------------------------------------------------
    def confirmed_upto(self) -> int:
        with self.lock:
            return self._confirmed

    def unconfirmed(self) -> int:
        with self.lock:
            return len(self.outbox)

    def _chain(self, destination: int) -> Chain:
        """The chain to the incarnation now serving ``destination`` (call with the lock held)."""
        chain = self.chains.get(destination)
        if chain is None:
            live = live_servers(self.host.cluster_map).get(destination)
            chain = self.chains[destination] = Chain(live.server_id if live is not None else "")
        return chain

    def _address(self, batch: parity_pb2.ParityBatch, destination: int, chain: Chain) -> None:
        batch.destination = destination
        batch.destination_id = chain.server_id
        batch.prev_seq = chain.last_seq
        batch.confirmed_upto = self._confirmed
        chain.last_seq = batch.seq

    # --- a push -----------------------------------------------------------------------------------------------
    def on_push(self, push: AppliedPush) -> PushOutcome:
        host = self.host
        batches = build_batches(push, host.layout, host.index, host.server_id)
        destinations = sorted(batches)
        live = live_servers(host.cluster_map)
        destination_ids = [live[d].server_id if d in live else "" for d in destinations]
        for b in batches.values():
            b.destinations.extend(destinations)
            b.destination_ids.extend(destination_ids)
        relay = []
        with self.lock:
            self._wait_for_room()
            self._last_seq = push.seq
            if not batches:
                if not self.outbox:
                    self._confirmed = push.seq
                return PushOutcome(seq=push.seq, confirmed_upto=self._confirmed)
            entry = OutboxEntry(push.seq, push.push_id, time.monotonic(), batches, set(destinations))
            self.outbox[push.seq] = entry
            for d in destinations:
                chain = self._chain(d)
                self._address(batches[d], d, chain)
                if chain.server_id:
                    relay.append(embedding_pb2.RelayBatch(destination=d, destination_id=chain.server_id,
                                                          batch=batches[d].SerializeToString()))
            confirmed = self._confirmed
        self.counters["relay_batches"] += len(relay)
        for d in destinations:  # each destination's sender delivers what the relay does not, in time
            self.sender(d)
        faults = host.faults
        if faults.armed("after_partial_parity") and len(destinations) >= 2:
            self.sender(destinations[0]).deliver([entry], wait=True, timeout_s=self.options.partial_parity_wait_s)
            faults.hit("after_partial_parity")
        if faults.armed("after_parity_before_ack"):  # every destination applies it before the worker hears back
            for d in destinations:
                self.sender(d).deliver([entry], wait=True, timeout_s=self.options.partial_parity_wait_s)
        return PushOutcome(relay=relay, seq=push.seq, confirmed_upto=confirmed)

    def _wait_for_room(self) -> None:
        """Backpressure: at most ``max_unconfirmed`` pushes wait for their parity (call with the lock held)."""
        limit = self.options.max_unconfirmed
        if len(self.outbox) < limit:
            return
        for sender in list(self.senders.values()):
            sender.wake(due_now=True)
        deadline = time.monotonic() + self.host.config.rpc_timeout_s
        while len(self.outbox) >= limit:
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.Unavailable(
                    f"server {self.host.index}: {len(self.outbox)} pushes wait for their parity servers to apply them "
                    f"(limit {limit}); a parity server is slow or unreachable")
            self.lock.wait(left)

    def relay_for(self, seq: int) -> list[embedding_pb2.RelayBatch]:
        """The relay batches of an unconfirmed push again (its first reply was lost)."""
        with self.lock:
            entry = self.outbox.get(seq)
            if entry is None:
                return []
            return [embedding_pb2.RelayBatch(destination=d, destination_id=entry.batches[d].destination_id,
                                             batch=entry.batches[d].SerializeToString())
                    for d in sorted(entry.pending) if entry.batches[d].destination_id]

    # --- acknowledgements ---------------------------------------------------------------------------------------
    def ack(self, destination: int, destination_id: str, applied_upto: int) -> None:
        """``destination`` (incarnation ``destination_id``) has applied this owner's chain up to ``applied_upto``."""
        with self.lock:
            chain = self.chains.get(destination)
            if chain is None or chain.server_id != destination_id or applied_upto <= chain.acked_upto:
                return
            chain.acked_upto = applied_upto
            for seq, entry in self.outbox.items():
                if seq > applied_upto:
                    break
                entry.pending.discard(destination)
            before = self._confirmed
            while self.outbox:
                seq, entry = next(iter(self.outbox.items()))
                if entry.pending:
                    break
                self.outbox.popitem(last=False)
                self._confirmed = seq
            if not self.outbox:
                self._confirmed = max(self._confirmed, self._last_seq)
            if self._confirmed != before:
                self.lock.notify_all()

    def on_acks(self, acks) -> None:
        """Watermarks of this server's batches, relayed by a worker from the destinations' replies."""
        host = self.host
        for wm in acks:
            if wm.source == host.index and wm.source_id == host.server_id:
                self.ack(wm.destination, wm.destination_id, wm.applied_upto)

    # --- destinations replaced -----------------------------------------------------------------------------------
    def on_map_change(self) -> None:
        """Restarts the chain of every destination whose server changed, with every batch it has not applied."""
        live = live_servers(self.host.cluster_map)
        restarted = []
        with self.lock:
            for d, chain in list(self.chains.items()):
                now = live[d].server_id if d in live else ""
                if now == chain.server_id:
                    continue
                fresh = self.chains[d] = Chain(now, restarted=bool(now))
                for entry in self.outbox.values():
                    if d in entry.pending:
                        self._address(entry.batches[d], d, fresh)
                if now:
                    restarted.append(d)
        for d in restarted:
            self.counters["chains_restarted"] += 1
            self.sender(d).wake(due_now=True)

    # --- direct delivery -----------------------------------------------------------------------------------------
    def sender(self, destination: int) -> DestinationSender:
        with self.lock:
            s = self.senders.get(destination)
            if s is None:
                s = self.senders[destination] = DestinationSender(self, destination)
            return s

    def due(self, destination: int, everything: bool) -> list[OutboxEntry]:
        """Entries ``destination`` has not acknowledged: all of them, or those older than ``relay_timeout_s``."""
        cutoff = time.monotonic() - self.options.relay_timeout_s
        with self.lock:
            chain = self.chains.get(destination)
            if chain is None or not chain.server_id:
                return []
            if chain.restarted:
                everything, chain.restarted = True, False
            return [e for e in self.outbox.values() if destination in e.pending and (everything or e.created <= cutoff)]

    def messages_for(self, destination: int, entries: list[OutboxEntry]) -> list[tuple[list, int]] | None:
        """``entries``' batches for ``destination`` still unacknowledged there, as messages of at most
        ``max_batch_bytes`` (copies, addressed to the current incarnation); None while no server holds it."""
        with self.lock:
            chain = self.chains.get(destination)
            if chain is None or not chain.server_id:
                return None
            messages, current, size = [], [], 0
            for entry in entries:
                if destination not in entry.pending:
                    continue
                batch = parity_pb2.ParityBatch()
                batch.CopyFrom(entry.batches[destination])
                batch.confirmed_upto = self._confirmed
                n = batch.ByteSize()
                if current and size + n > self.options.max_batch_bytes:
                    messages.append(current)
                    current, size = [], 0
                current.append(batch)
                size += n
            if current:
                messages.append(current)
            return [(m, self._confirmed) for m in messages]

    def flush(self, timeout_s: float) -> int:
        """Sends every unacknowledged batch directly and waits (up to ``timeout_s``) until all are applied;
        returns how many pushes are still unconfirmed."""
        with self.lock:
            destinations = sorted({d for e in self.outbox.values() for d in e.pending})
        for d in destinations:
            self.sender(d).wake(due_now=True)
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while self.outbox and not self.closed.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.lock.wait(min(left, 0.05))
            return len(self.outbox)

    def close(self) -> None:
        for sender in list(self.senders.values()):
            sender.wake()
