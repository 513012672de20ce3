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
from ecrec.wire import cluster_pb2, embedding_pb2, parity_pb2


@dataclass
class PushGroup:
    """Consecutive pushes ``first_seq``..``last_seq`` whose deltas go out as one batch per destination."""

    first_seq: int
    last_seq: int
    started: float
    last_push: float = 0.0
    push_ids: list[tuple[str, int]] = field(default_factory=list)
    rows: list[tuple] = field(default_factory=list)  # (table, row_bytes, ids, deltas, old_versions, seq)
    dense: list[tuple] = field(default_factory=list)  # (name, delta, old_version, seq)
    nbytes: int = 0

    def add(self, push: AppliedPush) -> None:
        """Keeps ``push``'s deltas (computed in place of its old payload bytes, which are the server's copy)."""
        self.last_seq = push.seq
        self.push_ids.append(push.push_id)
        for u in push.tables:
            if len(u.ids):
                np.bitwise_xor(u.old, u.new, out=u.old)
                self.rows.append((u.shard.spec.name, u.shard.spec.row_bytes, u.ids, u.old, u.old_versions, push.seq))
                self.nbytes += u.old.nbytes
        for u in push.dense:
            self.dense.append((u.dense.spec.name, np.bitwise_xor(u.old, u.new).reshape(-1), u.old_version, push.seq))
            self.nbytes += u.old.nbytes


def build_batches(group: PushGroup, layout, source: int, source_id: str) -> dict[int, parity_pb2.ParityBatch]:
    """One :class:`ParityBatch` per destination index holding every delta of ``group`` meant for it.

    Vectorized over the group's tables and pushes: the rows of one row width are concatenated (push after
    push, table after table) and one stable sort by destination splits them, keeping that order."""
    batches: dict[int, parity_pb2.ParityBatch] = {}
    push_ids = [embedding_pb2.PushId(worker=w, sequence=q) for w, q in group.push_ids]

    def batch(destination: int) -> parity_pb2.ParityBatch:
        b = batches.get(destination)
        if b is None:
            b = batches[destination] = parity_pb2.ParityBatch(source=source, source_id=source_id, seq=group.last_seq,
                                                              first_seq=group.first_seq, push_ids=push_ids)
        return b

    by_width: dict[int, list] = {}
    for row in group.rows:
        by_width.setdefault(row[1], []).append(row)
    k, m, servers = layout.k, layout.m, layout.num_servers
    for segments in by_width.values():
        names = [seg[0] for seg in segments]
        counts = np.array([len(seg[2]) for seg in segments])
        if len(segments) == 1:
            _, _, ids, delta, old_versions, seq = segments[0]
            seqs = np.full(len(ids), seq, dtype=np.int64)
        else:
            ids = np.concatenate([seg[2] for seg in segments])
            delta = np.concatenate([seg[3] for seg in segments])
            old_versions = np.concatenate([seg[4] for seg in segments])
            seqs = np.repeat(np.array([seg[5] for seg in segments], dtype=np.int64), counts)
        segment_of_row = np.repeat(np.arange(len(segments)), counts)
        stripes, positions = np.divmod(ids, k)
        block = stripes // servers
        for j in range(m):  # parity j of each row's stripe; a row's parities are on distinct servers
            dest = (stripes + (k + j)) % servers
            order = np.argsort(dest, kind="stable")  # by destination, keeping push and table order
            bounds = np.searchsorted(dest[order], np.arange(servers + 1))
            slots_j, positions_j, seqs_j = (block * m + j)[order], positions[order], seqs[order]
            delta_j = delta[order]
            versions_j, segment_j = old_versions[order].astype(np.int64, copy=False), segment_of_row[order]
            for d in range(servers):
                b0, b1 = bounds[d], bounds[d + 1]
                if b0 == b1:
                    continue
                batch(d).tables.add(
                    tables=names, table_rows=np.bincount(segment_j[b0:b1], minlength=len(segments)).tobytes(),
                    parity_slots=slots_j[b0:b1].tobytes(), positions=positions_j[b0:b1].tobytes(), parity=j,
                    deltas=delta_j[b0:b1].tobytes(), old_versions=versions_j[b0:b1].tobytes(),
                    seqs=seqs_j[b0:b1].tobytes())
    for name, delta, old_version, seq in group.dense:
        for d in layout.dense_servers(name)[1:]:
            batch(d).dense.add(name=name, value=delta.tobytes(), old_version=old_version, seq=seq)
    return batches


@dataclass
class OutboxEntry:
    """One group's batches, until every destination has applied its own."""

    seq: int  # the group's last push
    first_seq: int
    created: float
    batches: dict[int, parity_pb2.ParityBatch]
    pending: set[int] = field(default_factory=set)  # destinations that have not acknowledged it
    relayed: bool = True  # went back in a push reply (else it is due for direct delivery at once)


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
        self._group: PushGroup | None = None  # pushes not closed into batches yet
        self._eager = False  # close every group at once (a server is recovering or missing)

    # --- state read by others -------------------------------------------------------------------------------
    def confirmed_upto(self) -> int:
        with self.lock:
            return self._confirmed

    def unconfirmed(self) -> int:
        """Pushes not yet applied at every destination (in closed batches or the open group)."""
        with self.lock:
            if not self.outbox and self._group is None:
                return 0
            return self._last_seq - self._confirmed

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
        """Adds the push to the open group; when the group is full (pushes, bytes) or old, or while any server
        recovers (a rebuild reads parity: it must not lag), closes it: its batches go back in this reply."""
        options, faults = self.options, self.host.faults
        with self.lock:
            if self._last_seq == 0:  # this incarnation's first push: sequences are consecutive from here
                self._confirmed = push.seq - 1
            group = self._group
            if group is None:
                group = self._group = PushGroup(push.seq, push.seq, time.monotonic())
            group.add(push)
            group.last_push = time.monotonic()
            self._last_seq = push.seq
            close = (len(group.push_ids) >= options.coalesce_pushes or group.nbytes >= options.coalesce_bytes
                     or time.monotonic() - group.started >= options.coalesce_s or self._eager
                     or faults.armed("after_partial_parity") or faults.armed("after_parity_before_ack"))
            entry, relay = self._close_locked(relayed=True) if close else (None, [])
            confirmed = self._confirmed
        if entry is not None:
            self._after_close(entry)
        return PushOutcome(relay=relay, seq=push.seq, confirmed_upto=confirmed)

    def _close_locked(self, relayed: bool):
        """Turns the open group into batches in the outbox; returns the entry and its relay (call with the lock)."""
        group, self._group = self._group, None
        if group is None:
            return None, []
        batches = build_batches(group, self.host.layout, self.host.index, self.host.server_id)
        if not batches:
            if not self.outbox:
                self._confirmed = group.last_seq
            return None, []
        destinations = sorted(batches)
        destination_ids = [self._chain(d).server_id for d in destinations]
        entry = OutboxEntry(group.last_seq, group.first_seq, time.monotonic(), batches, set(destinations), relayed)
        self.outbox[group.last_seq] = entry
        relay = []
        for d in destinations:
            b = batches[d]
            b.destinations.extend(destinations)
            b.destination_ids.extend(destination_ids)
            chain = self._chain(d)
            self._address(b, d, chain)
            if chain.server_id and relayed:
                relay.append(embedding_pb2.RelayBatch(destination=d, destination_id=chain.server_id,
                                                      batch=b.SerializeToString()))
        self.counters["batches_built"] += len(batches)
        self.counters["relay_batches"] += len(relay)
        return entry, relay

    def _after_close(self, entry: OutboxEntry) -> None:
        destinations = sorted(entry.batches)
        for d in destinations:  # each destination's sender delivers what the relay does not, in time
            sender = self.senders.get(d) or self.sender(d)
            if not entry.relayed:
                sender.wake(due_now=True)
        faults = self.host.faults
        if faults.armed("after_partial_parity") and len(destinations) >= 2:
            self.sender(destinations[0]).deliver([entry], wait=True, timeout_s=self.options.partial_parity_wait_s)
            faults.hit("after_partial_parity")
        if faults.armed("after_parity_before_ack"):  # every destination applies it before the worker hears back
            for d in destinations:
                self.sender(d).deliver([entry], wait=True, timeout_s=self.options.partial_parity_wait_s)

    def on_timer(self) -> None:
        """Closes a group no push came to for ``relay_timeout_s`` (training paused or ended); its batches go
        directly."""
        with self.lock:
            group = self._group
            if group is None or time.monotonic() - group.last_push < self.options.relay_timeout_s:
                return
            entry, _ = self._close_locked(relayed=False)
        if entry is not None:
            self._after_close(entry)

    def admit(self) -> None:
        """Backpressure, before a push is applied: while ``max_unconfirmed`` pushes wait for their parity, waits
        (the senders deliver directly meanwhile), then refuses with ``Unavailable`` (the worker retries)."""
        with self.lock:
            self._wait_for_room()

    def _wait_for_room(self) -> None:
        limit = self.options.max_unconfirmed
        if self._last_seq - self._confirmed < limit:
            return
        for sender in list(self.senders.values()):
            sender.wake(due_now=True)
        deadline = time.monotonic() + self.host.config.rpc_timeout_s
        while self._last_seq - self._confirmed >= limit:
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.Unavailable(
                    f"server {self.host.index}: {self._last_seq - self._confirmed} pushes wait for their parity "
                    f"servers to apply them (limit {limit}); a parity server is slow or unreachable")
            self.lock.wait(left)

    def relay_for(self, seq: int) -> list[embedding_pb2.RelayBatch]:
        """The relay batches of an unconfirmed push again (its first reply was lost)."""
        with self.lock:
            entry = next((e for e in self.outbox.values() if e.first_seq <= seq <= e.seq), None)
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
            if not self.outbox and self._group is None:
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
        """Restarts the chain of every destination whose server changed, with every batch it has not applied;
        while a server recovers or is missing, groups close at every push."""
        m = self.host.cluster_map
        live = live_servers(m)
        restarted = []
        entry = None
        with self.lock:
            was_eager = self._eager
            self._eager = len(live) < m.num_servers or any(s.state == cluster_pb2.RECOVERING for s in live.values())
            if self._eager and not was_eager:
                # a server failed: its replacement's rebuild needs every parity server current, now: the open
                # group and every batch the workers hold go directly
                entry, _ = self._close_locked(relayed=False)
                for e in self.outbox.values():
                    e.relayed = False
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
        if entry is not None:
            self._after_close(entry)
        for d in restarted:
            self.counters["chains_restarted"] += 1
            self.sender(d).wake(due_now=True)
        if self._eager:
            for sender in list(self.senders.values()):
                sender.wake(due_now=True)

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
            return [e for e in self.outbox.values()
                    if destination in e.pending and (everything or not e.relayed or e.created <= cutoff)]

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
        with self.lock:
            entry, _ = self._close_locked(relayed=False)
        if entry is not None:
            self._after_close(entry)
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while self.outbox and not self.closed.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.lock.wait(min(left, 0.05))
            return self._last_seq - self._confirmed if self.outbox else 0

    def close(self) -> None:
        for sender in list(self.senders.values()):
            sender.wake()
