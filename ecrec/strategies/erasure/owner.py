"""The owner side of the parity path: the pushes applied here become, a group at a time, one sealed batch per
destination, kept in an outbox until every destination has applied it.

A push only records what it changed (its rows' slots, their deltas -- the server computes ``old XOR new``
while the rows are in cache -- and versions before: no work per row here).  A *group* of consecutive pushes closes after ``coalesce_pushes`` pushes,
``coalesce_bytes`` (the first group at a size staggered by server: :meth:`ParityOwner._first_group_bytes`), ``coalesce_s``, or at once while a server recovers; closing it computes one delta per row
the group changed -- ``payload before the group's first push to it XOR payload after its last``, stamped with
the row's version before the first and the last push's sequence -- so a hot row updated in most pushes of a
group sends one delta, not one per push, and undoing the group is one XOR.  The deltas go to the ``m``
parity servers of each row's stripe; a dense tensor's delta goes to its ``m`` backups.  All deltas of one group
for one destination form one ``ParityBatch``.

Delivery is pipelined (``docs/protocol.md``, "The update path"): a push is acknowledged as soon as it is applied here.
The group it closes is built on the owner's closer thread, off the push path, and each destination's
:class:`~ecrec.strategies.erasure.sender.DestinationSender` delivers its batch directly, as a frame (over a parity
channel, or a gRPC call).  Where the option ``relay`` asks for it (by default only where the direct path has no
parity channel: TLS, ``parity_transport=grpc``), a small group is instead built at once, its batches serialized and
sealed (:mod:`ecrec.net.seal`), and they go back to the worker in that push's reply; the worker attaches them to
its next request to each destination (the *relay*: no RPC of its own).  The destinations' sealed watermarks
come back with the worker's next push (:meth:`ParityOwner.on_acks`); one that does not check is refused.  A
relayed batch not acknowledged within ``relay_timeout_s`` (a worker that stopped, died, or dropped it) is sent
directly by the destination's sender.

A rebuild must read a data row at a group boundary (a merged delta is all or nothing: a parity that embeds a row
between two pushes of one group would take the first push's delta twice). What a rebuild may embed already keeps
that out (an open group's versions are above the confirmed bound and in no log: it would wait for the group to
close), so this is for progress: a rebuild reads every row as it was after this owner's last *closed* group
(:meth:`ParityOwner.settle_rows`): against the open group as it stands (read with no push under way), its deltas are
XORed back out of the rows it changed, and each gets the version it had before the group's first push to it. The
open group then reaches the rebuilt parity whole, as one delta from that version; groups go on coalescing while a
server recovers (one-push groups, as before, cost training a batch per push and destination). While a server
recovers or is missing, groups still go directly (built by the closer thread and sent by the senders, not relayed:
the worker's next request may be a step away, and its bandwidth is training's), and the owner's timer closes an open
group at its next tick.

Each destination incarnation gets the owner's batches as a *chain*: every batch names the previous one
(``prev_seq``) and the destination applies them strictly in that order, whichever path brought them.
When a destination is replaced, the chain restarts at the replacement with every batch for it not confirmed
everywhere (the replacement's rebuild embeds a row's version only once it is confirmed or its batches are in the
replacement's log, where a resolution can undo them; a batch the rebuilt row already holds is skipped by its
version, and logged).  A rebuild's read gets the owner's confirmed bound and committed push ids with the rows
(:meth:`ParityOwner.confirmed_bound`).  ``confirmed_upto`` -- every push up to it is applied at all its destinations -- goes
back to the worker, which keeps each push until it is confirmed and replays the unconfirmed ones if this
owner fails, and to the destinations, which then trim their logs.

The chains, the outbox's acknowledgements, confirmation and restarts are decided by the sans-I/O core
:class:`~ecrec.strategies.erasure.outbox.Outbox` (the simulator runs the same class); this module is its adapter:
the lock, the groups, seals, the closer thread and the senders.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import numpy as np

from ecrec import errors
from ecrec.net.cluster_map import live_servers
from ecrec.strategies.base import AppliedPush, PushOutcome, StrategyHost
from ecrec.strategies.erasure import batch_frames, merge
from ecrec.strategies.erasure.groups import (OpenChanges, PushGroup, before_group, build_batches,
                                             dense_before_group)
from ecrec.strategies.erasure.outbox import (ACKED, BEYOND, EVERY_VERSION, Chain, Outbox, OutboxEntry, SealedBatch,
                                             confirmed_bound)
from ecrec.strategies.erasure.sender import DestinationSender
from ecrec.wire import cluster_pb2, parity_pb2

log = logging.getLogger("ecrec.strategies.erasure")

#: after a verification read data rows here (seal_for_read), groups stay one push each this long (s), unless this
#: server's map turns first from a server recovering or missing to every server back and none recovering
READ_EAGER_S = 5.0
#: the closer thread, with nothing to build, looks again this often anyway (s): a safety net
IDLE_CLOSER_WAKE_S = 5.0
__all__ = ["EVERY_VERSION", "Chain", "OutboxEntry", "ParityOwner", "SealedBatch", "confirmed_bound"]


class ParityOwner:
    """The outbox, the chains and the senders of one owning server (see the module docstring).

    One class: the open group, the outbox and the chains change together under one lock, in push order (a push,
    an acknowledgement and a replaced destination each update all three in one critical section), so they are
    one piece of state; building a group's batches is outside it (``ecrec.strategies.erasure.groups``)."""

    def __init__(self, host: StrategyHost, options, closed: threading.Event, counters):
        self.host = host
        self.options = options
        self.closed = closed
        self.counters = counters
        self.box = Outbox()  # the outbox, chains, confirmation and committed push ids: the sans-I/O core
        self.outbox = self.box.entries
        self.chains = self.box.chains
        self.senders: dict[int, DestinationSender] = {}
        self.lock = threading.Condition()
        self._group: PushGroup | None = None  # pushes not closed into batches yet
        self._open_changes: dict = {}  # shard -> (group, its pushes, OpenChanges): the open group's, for reads
        self._eager = False  # a server is recovering or missing: groups go directly, the timer closes them early
        self._eager_until = 0.0  # every group one push until then (seal_for_read: a verification read rows here)
        self._last_ack = 0.0  # when a destination last acknowledged (monotonic): confirmations wait a heartbeat
        self._closing: deque[tuple[PushGroup, OutboxEntry]] = deque()  # groups for the closer thread, in order
        self._closer: threading.Thread | None = None
        self._closer_wake = threading.Event()
        self._stagger = True  # the next group closes at a size staggered by index (_first_group_bytes)
        self._group_bytes = options.coalesce_bytes  # the size that closes the open group
        merge.warm_up()  # compiled now, not in the first group a push closes

    # --- state read by others -------------------------------------------------------------------------------
    def confirmed_upto(self) -> int:
        with self.lock:
            return self.box.confirmed

    def confirmed_bound(self) -> int:
        """For a rebuild that embeds this server's data rows or dense tensors in a parity or replica (read them
        first): every version at or below the bound is applied at every destination, or was kept by the
        resolution that rebuilt this index, so every later resolution keeps it.  A version above it may still be
        undone: it must not be embedded.  :meth:`committed`, read after it, covers the pushes below it."""
        numbered = self.host.last_push_seq()
        with self.lock:
            # below every push numbered (a push numbered but not handed over yet is above it: its rows may hold it
            # already); 0 until the first push is handed over
            return confirmed_bound(numbered, self.box.confirmed)

    def committed(self) -> dict[str, int]:
        """Per worker incarnation, the highest sequence of its pushes here that is confirmed or was kept."""
        with self.lock:
            return dict(self.box.committed)

    def note_committed(self, push_ids) -> None:
        """Push ids that stand without a batch of this incarnation (kept by the resolution that rebuilt it)."""
        with self.lock:
            self.box.commit(push_ids)

    def deliver_now(self) -> None:
        """A rebuild found rows here above the confirmed bound: every batch the workers still carry goes directly,
        now, so that the bound passes them (instead of after ``relay_timeout_s``).  The open group stays open: a
        rebuild reads rows at the last closed group (:meth:`settle_rows`), so none of its pushes is in them."""
        with self.lock:
            destinations = set()
            for e in self.outbox.values():
                e.relayed = False
                destinations |= e.pending
        for d in sorted(destinations):
            self.sender(d).wake(due_now=True)

    # --- reads for a rebuild: at the last closed group -----------------------------------------------------------
    def _changes(self, shard, group: PushGroup | None, size: int) -> OpenChanges | None:
        """The first ``size`` pushes of the open ``group`` indexed for reads of ``shard`` (None: no group), kept
        per table and extended as the group grows (dropped when it closes).  Built outside the lock (a push waits
        for it there): a group's pushes never change, and the list only grows."""
        if group is None or not size:
            return None
        with self.lock:
            cached = self._open_changes.get(shard)
        if cached is None or cached[0] is not group or cached[1] > size:
            cached = (group, 0, OpenChanges.of([], shard))
        if cached[1] == size:
            return cached[2]
        changes = cached[2].extended(group.pushes[cached[1]:size], shard)
        with self.lock:
            now = self._open_changes.get(shard)
            if self._group is group and (now is None or now[0] is not group or now[1] < size):
                self._open_changes[shard] = (group, size, changes)
        return changes

    def _take_out(self, shard, group: PushGroup | None, size: int, reads) -> None:
        """The first ``size`` pushes of ``group`` taken back out of ``reads`` (:func:`before_group`)."""
        changes = self._changes(shard, group, size)
        if changes is not None:
            for slots, payload, versions, _, _ in reads:
                before_group(changes, slots, payload, versions)

    def dense_at_boundary(self, name: str, payload: np.ndarray) -> int | None:
        """:meth:`settle_rows` for dense tensor ``name`` (this server its primary): its payload bytes as read
        just now, changed in place; returns its version after the last closed group, or None when the open group
        did not change it (the version read stands).  Call with pushes paused."""
        with self.lock:
            pushes = list(self._group.pushes) if self._group is not None else []
        return dense_before_group(pushes, name, payload) if pushes else None

    def settle_rows(self, shard, reads: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]]) -> int:
        """Rows of ``shard`` copied without pushes paused (by ``TableShard.read_into``: ``(slots, payload, versions,
        ready, rewrites)`` per read, arrays changed in place: a frame of the fast rebuild, a ``ReadRows``) made what
        they were after this owner's last closed group: rows a push changed since they were copied are read again
        (``TableShard.reread_changed``), then the open group is taken out of them (:func:`before_group`).  Returns
        how many rows were read again.

        Pushes are not paused when they need not be: every push numbered was handed to the open group before the
        re-read and no push was numbered, added or closed until after it (the sequencer, the outbox's last push and
        the group, read before and after), so the rows re-read are the table as the open group left it.  Else (a
        push under way: numbered, not handed over yet) the same is done in a pause of pushes, which is short: the
        rows are copied already.  Threads that read for a rebuild may run at a low OS priority
        (``rebuild_nice``): they seldom hold the apply lock that every push needs."""
        with self.lock:
            group, handed = self._group, self.box.last_seq
            size = len(group.pushes) if group is not None else 0
        if self.host.last_push_seq() == handed:
            again = sum(shard.reread_changed(*read) for read in reads)
            with self.lock:
                still = (self._group is group and (len(group.pushes) if group is not None else 0) == size
                         and self.box.last_seq == handed and self.host.last_push_seq() == handed)
            if still:
                self._take_out(shard, group, size, reads)
                return again
        else:
            again = 0
        with self.host.pushes_paused():  # no push under way now: the rows and the open group agree
            again += sum(shard.reread_changed(*read) for read in reads)
            with self.lock:  # the timer may close the group meanwhile (no pause): an earlier boundary, as good
                group = self._group
                size = len(group.pushes) if group is not None else 0
            self._take_out(shard, group, size, reads)
        self.counters.add("settled_paused", 1)
        return again

    def unconfirmed(self) -> int:
        """Pushes not yet applied at every destination (in closed batches or the open group)."""
        with self.lock:
            return self.box.unconfirmed(self._group is not None)

    def _live_id(self, destination: int) -> str:
        """The incarnation serving ``destination`` now ("" for none): asked when a chain starts, not per group."""
        live = live_servers(self.host.cluster_map).get(destination)
        return live.server_id if live is not None else ""

    def _seal(self, batch: parity_pb2.ParityBatch) -> SealedBatch:
        """``batch`` serialized and sealed with the server key, as the worker (or the direct path) carries it."""
        sealer = self.host.sealer
        if sealer is None:
            raise errors.Unavailable(f"server {self.host.index} holds no server key yet (not registered); "
                                     "its parity batches cannot be sealed")
        t0 = time.thread_time()
        data = batch.SerializeToString()
        t1 = time.thread_time()
        mac = sealer.batch_mac(data)
        self.counters.add("part_serialize_cpu_s", t1 - t0)
        self.counters.add("part_seal_cpu_s", time.thread_time() - t1)
        return SealedBatch(batch.destination, batch.destination_id, data, mac)

    def _sealed(self, entry: OutboxEntry, destination: int) -> SealedBatch:
        relay = entry.sealed.get(destination)
        if relay is None:
            relay = entry.sealed[destination] = self._seal(full_batch(entry, destination))
        return relay

    # --- a push -----------------------------------------------------------------------------------------------
    def on_push(self, push: AppliedPush) -> PushOutcome:
        """Adds the push to the open group (called in push order, under the server's apply lock); when the group
        is full (pushes, bytes) or old, closes it: its batches go directly, or, where the owner relays (option
        ``relay``), a small group's go back in this reply -- never while a server recovers or is missing
        (:meth:`_close_locked`)."""
        options, faults = self.options, self.host.faults
        with self.lock:
            self.box.numbered(push.seq)
            group = self._group
            now = time.monotonic()
            if group is None:
                group = self._group = PushGroup(push.seq, push.seq, now)
                self._group_bytes = self._first_group_bytes() if self._stagger else options.coalesce_bytes
                self._stagger = False
            group.add(push)
            group.last_push = now
            eager = now < self._eager_until  # a verification read rows here: one-push groups for a while
            self._stagger |= eager  # the first group after one-push groups is staggered again (close_group too)
            close = (len(group.pushes) >= options.coalesce_pushes or group.nbytes >= self._group_bytes
                     or now - group.started >= options.coalesce_s or eager
                     or faults.armed("after_partial_parity") or faults.armed("after_parity_before_ack"))
            # while a server recovers, a group goes directly: relayed, its batches would cross the worker twice
            # (sealed, in its reply and its next requests) and wait for its next step
            entry, relay = self._close_locked(relayed=True, direct=eager or self._eager) if close else (None, [])
            confirmed = self.box.confirmed
            if self.outbox:
                oldest = next(iter(self.outbox.values()))
                if oldest.created <= now - options.relay_timeout_s:  # the relay did not deliver it: directly
                    self._wake_overdue_locked(now)
        if entry is not None:
            self._after_close(entry)
        return PushOutcome(relay=relay, seq=push.seq, confirmed_upto=confirmed)

    def _first_group_bytes(self) -> int:
        """The bytes that close this owner's first group (and the first after one-push groups, or after a close by
        other than count or size): ``(i + 1) / S`` of
        ``coalesce_bytes`` at index ``i`` of ``S``.  A worker's step pushes to every server at once, so groups
        that all start at the same push and close at the same size close in the same step on every server -- the
        builds, frames and applies of the whole cluster in one burst (steps of 40-80 ms at 4M rows, where groups
        close by size); started at staggered sizes, each step meets about one server's.  Later groups close at
        ``coalesce_bytes`` (or ``coalesce_pushes``) and keep the phase while training goes on; a group closed
        otherwise (:meth:`close_group`: training paused, the timer while a server recovers, a verification's read,
        a flush) or one-push groups (a verification's window) start it again."""
        layout, index = self.host.layout, self.host.index
        if not self.options.coalesce_stagger or layout is None or index is None or index < 0:
            return self.options.coalesce_bytes
        return max(1, self.options.coalesce_bytes * (index + 1) // layout.num_servers)

    def _close_locked(self, relayed: bool, direct: bool = False):
        """Closes the open group into an outbox entry (call with the lock held).  A small group's batches are built
        now and returned to relay (``relayed``) in this push's reply; a group holding ``direct_bytes`` or more, any
        group while an earlier one is still being built (chains stay in push order), or any group at all with
        ``direct`` (a server recovers) goes to the closer thread, which builds it off the push path and sends its
        batches directly.  Returns the entry built now and its relay (None, [] when there is nothing to do now)."""
        group, self._group = self._group, None
        if group is None:
            return None, []
        self._open_changes.clear()
        entry = OutboxEntry(group.last_seq, group.first_seq, time.monotonic(), {}, set(), relayed,
                            push_ids=group.push_ids)
        self.box.add(entry)
        self.counters.add("groups_closed", 1)
        self.counters.add("group_pushes", len(group.pushes))
        faults = self.host.faults
        # fault injection (tests) builds the group now and holds its batches in this push's reply -- relayed,
        # whatever the option -- so that they reach only the destinations the fault lets them reach
        inline = faults.armed("after_partial_parity") or faults.armed("after_parity_before_ack")
        if not inline and (direct or self._closing or group.nbytes >= self.options.direct_bytes
                           or not self._relays()):
            entry.relayed, entry.built = False, False
            self._closing.append((group, entry))
            self._start_closer_locked()
            self._closer_wake.set()
            return None, []
        t0 = time.thread_time()
        batches = build_batches(group, self.host.layout, self.host.index, self.host.server_id, self.counters)
        relay = self._install_locked(entry, batches)
        self.counters.add("group_close_cpu_s", time.thread_time() - t0)
        return entry, relay

    def _install_locked(self, entry: OutboxEntry, batches: dict[int, parity_pb2.ParityBatch],
                        sections: dict | None = None) -> list[SealedBatch]:
        """Addresses a group's batches to the chains (in push order: this is called in it) and puts them in its
        outbox entry (``sections``: their bulk fields, kept as arrays for a frame); returns the sealed batches to
        relay (those of a relayed entry, each at most ``relay_max_bytes``; the others are sent directly)."""
        entry.sections = sections or {}
        destinations = self.box.install(entry, batches, self._live_id, self._group is not None)
        relay = []
        for d in destinations:
            if self.chains[d].server_id and entry.relayed:
                sealed = self._sealed(entry, d)
                if len(sealed.batch) <= self.options.relay_max_bytes:
                    relay.append(sealed)
                    self.counters.add("parity_bytes_relayed", len(sealed.batch))
        if entry.relayed and len(relay) < len(destinations):
            entry.relayed = False  # a batch too big to relay: the sender delivers them all (a second copy is skipped)
        self.counters.add("batches_built", len(batches))
        self.counters.add("relay_batches", len(relay))
        if not batches:
            self.lock.notify_all()
        return relay

    def _relays(self) -> bool:
        """Whether small groups are relayed by the workers (option ``relay``; 'auto': only where the direct path
        has no parity channel -- its frames would be gRPC calls, dearer than the relay's ride on requests the worker
        makes anyway)."""
        mode = self.options.relay
        if mode != "auto":
            return mode == "on"
        security = self.host.peers.security
        return self.options.parity_transport != "socket" or (security is not None and security.tls)

    def _start_closer_locked(self) -> None:
        if self._closer is None:
            self._closer = threading.Thread(target=self._close_in_background, name="ecrec-parity-closer", daemon=True)
            self._closer.start()

    def _close_in_background(self) -> None:
        """The closer thread: builds the batches of the groups that go directly, in order, off the push path.  It
        outlives an error (logged; the group is tried again at the next wake): every such group waits for it."""
        while not self.closed.is_set():
            self._closer_wake.wait(IDLE_CLOSER_WAKE_S)
            self._closer_wake.clear()
            try:
                self._close_pending()
            except Exception:  # noqa: BLE001 - reported; pushes stay unconfirmed meanwhile (the worker keeps them)
                log.exception("the parity closer failed; it tries again in %.0f s", IDLE_CLOSER_WAKE_S)

    def _close_pending(self) -> None:
        """Builds, installs and hands to the senders every group waiting for the closer, oldest first."""
        while not self.closed.is_set():
            with self.lock:
                if not self._closing:
                    break
                group, entry = self._closing[0]
            t0 = time.thread_time()
            sections: dict = {}  # sent directly: as frames, the bulk bytes never in protobuf
            try:
                batches = build_batches(group, self.host.layout, self.host.index, self.host.server_id,
                                        self.counters, sections)
            except Exception:  # noqa: BLE001 - reported; the entry stays unbuilt (pushes unconfirmed: replayed)
                log.exception("building the parity batches of pushes %d..%d failed", group.first_seq,
                              group.last_seq)
                return
            with self.lock:
                self._closing.popleft()
                self._install_locked(entry, batches, sections)
                self.counters.add("group_close_cpu_s", time.thread_time() - t0)
            self._after_close(entry)

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

    def close_group(self, restagger: bool = True) -> None:
        """Closes the open group now; its batches go directly.  Not by count or size (training paused: the timer; a
        read; a flush), every server's next group starts at the same push: the next is staggered again
        (``restagger``; the timer's close of a group only older than ``coalesce_s`` is not a pause)."""
        with self.lock:
            self._stagger |= restagger
            # while a server recovers, off this thread (the timer's): built by the closer, sent directly
            entry, _ = self._close_locked(relayed=False, direct=self._eager)
        if entry is not None:
            self._after_close(entry)

    def seal_for_read(self) -> None:
        """Before this server's data rows are all read and compared with their parity (``verify_parity``; a rebuild
        reads at the last closed group instead: :meth:`settle_rows`).  A merged delta is all or nothing: a row must
        not be read while a group holds some of its pushes and not others.  So groups become one push each (for
        ``READ_EAGER_S`` after the last such read, or until this server's map turns to every server back and none
        recovering: :meth:`on_map_change`), and the group open now closes with pushes paused (none is half
        applied).  A later read then finds every group either contained in the row read (its versions say so:
        skipped) or after it whole."""
        with self.lock:
            self._eager_until = time.monotonic() + READ_EAGER_S
            if self._group is None:
                return
        with self.host.pushes_paused():
            self.close_group()

    def on_timer(self) -> None:
        """Closes a group no push came to for ``coalesce_s`` (training paused or ended: its parity must not wait
        for the next push), one older than that, or any open group while a server recovers or is missing (its
        batches go directly, and the parity a rebuild compares lags training by about this timer's period); wakes the
        senders of
        destinations with batches the relay did not deliver in time, and those owed a confirmation by an idle
        owner (so that they trim their logs)."""
        now = time.monotonic()
        with self.lock:
            group = self._group
            limit = max(self.options.coalesce_s, self.options.relay_timeout_s)
            idle = group is not None and now - group.last_push >= limit
            close = group is not None and (self._eager or idle or now - group.started >= limit)
        if close:
            self.close_group(restagger=idle)  # a group only too old (slow steps): training goes on, phases stay
        with self.lock:
            self._wake_overdue_locked(now)
            if self.outbox or self._group is not None or now - self._last_ack < self.options.heartbeat_s:
                return
            owed = [s for s in self.senders.values() if s.sent_confirm < self.box.confirmed]
        for sender in owed:
            sender.wake()

    def _wake_overdue_locked(self, now: float) -> None:
        """Wakes the sender of every destination that has not acknowledged a batch due for direct delivery."""
        cutoff = now - self.options.relay_timeout_s
        overdue = set()
        for e in self.outbox.values():
            if not e.relayed or e.created <= cutoff:
                overdue |= e.pending
        for d in overdue:
            sender = self.senders.get(d)
            if sender is not None:
                sender.wake()

    def needs_timer(self) -> bool:
        """Whether :meth:`on_timer` has anything to watch (an open group, batches not applied everywhere, a
        confirmation not sent)."""
        with self.lock:
            return (self._group is not None or bool(self.outbox)
                    or any(s.sent_confirm < self.box.confirmed for s in self.senders.values()))

    def admit(self) -> None:
        """Backpressure, before a push is applied: while ``max_unconfirmed`` pushes wait for their parity, waits
        (the senders deliver directly meanwhile), then refuses with ``Unavailable`` (the worker retries)."""
        with self.lock:
            self._wait_for_room()

    def _wait_for_room(self) -> None:
        limit, box = self.options.max_unconfirmed, self.box
        if box.last_seq - box.confirmed < limit:
            return
        for sender in list(self.senders.values()):
            sender.wake(due_now=True)
        deadline = time.monotonic() + self.host.config.rpc_timeout_s
        while box.last_seq - box.confirmed >= limit:
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.Unavailable(
                    f"server {self.host.index}: {box.last_seq - box.confirmed} pushes wait for their parity "
                    f"servers to apply them (limit {limit}); a parity server is slow or unreachable")
            self.lock.wait(left)

    def relay_for(self, seq: int) -> list[SealedBatch]:
        """The relay batches of an unconfirmed push again (its first reply was lost)."""
        with self.lock:
            entry = next((e for e in self.outbox.values() if e.first_seq <= seq <= e.seq), None)
            if entry is None or not entry.relayed:  # sent directly: the worker carries none of it
                return []
            return [self._sealed(entry, d) for d in sorted(entry.pending) if entry.batches[d].destination_id]

    # --- acknowledgements ---------------------------------------------------------------------------------------
    def ack(self, destination: int, destination_id: str, applied_upto: int) -> None:
        """``destination`` (incarnation ``destination_id``) has applied this owner's chain up to ``applied_upto``
        (from its own reply, or a watermark whose seal checked)."""
        with self.lock:
            before = self.box.confirmed
            verdict = self.box.ack(destination, destination_id, applied_upto, self._group is not None)
            if verdict == BEYOND:  # never sent that far: not from this chain (a bug, not a worker)
                log.error("server %d (%s) acknowledged batch %d of a chain sent up to %d; ignored", destination,
                          destination_id, applied_upto, self.chains[destination].last_seq)
            if verdict == ACKED:
                self._last_ack = time.monotonic()
            if self.box.confirmed != before:
                self.lock.notify_all()

    def on_acks(self, acks, worker: str = "") -> None:
        """Watermarks of this server's batches, relayed by a worker from the destinations' replies.  Only a
        watermark whose seal checks counts; any other is refused, counted and logged with the worker."""
        host = self.host
        sealer = host.sealer
        cap = host.config.max_relay_batches
        if len(acks) > cap:  # dropped unread, as relayed batches beyond the bound (a destination answers again)
            self.counters.add("refused_watermarks", len(acks) - cap)
            log.warning("%d watermarks relayed by %s beyond the %d one request may carry (--max-relay-batches): "
                        "dropped unread", len(acks) - cap, worker or "a worker", cap)
            acks = list(acks)[:cap]
        refused = []
        for wm in acks:
            if wm.source != host.index or wm.source_id != host.server_id:
                continue  # for an earlier incarnation of this index: nothing to confirm here
            if sealer is None or not sealer.watermark_ok(wm):
                refused.append(wm.destination)
                continue
            self.ack(wm.destination, wm.destination_id, wm.applied_upto)
        if refused:  # one line per message, not one per watermark
            self.counters.add("refused_watermarks", len(refused))
            log.warning("%d watermarks relayed by %s do not carry their destination's seal (destinations %s); refused",
                        len(refused), worker or "a worker", ", ".join(map(str, sorted(set(refused))[:8])))

    # --- destinations replaced -----------------------------------------------------------------------------------
    def on_map_change(self) -> None:
        """Restarts the chain of every destination whose server changed, with every batch it has not applied;
        while a server recovers or is missing, groups go directly (the timer closes them early), and once none does
        a verification's window of one-push groups ends at once, not ``READ_EAGER_S`` after its last read (a group
        per push instead of one per ``coalesce_pushes``: those seconds cost training up to a third of its speed)."""
        m = self.host.cluster_map
        live = live_servers(m)
        close_now = False
        with self.lock:
            was_eager = self._eager
            self._eager = len(live) < m.num_servers or any(s.state == cluster_pb2.RECOVERING for s in live.values())
            if self._eager and not was_eager:
                # a server failed: its replacement's rebuild needs every parity server current, now: the open
                # group and every batch the workers hold go directly
                close_now = self._group is not None
                for e in self.outbox.values():
                    e.relayed = False
            elif was_eager and not self._eager:
                # every server is back and none recovers: a window of one-push groups a verification's read opened
                # here ends (seal_for_read).  Safe because a replacement turns ACTIVE only once its rebuild is
                # done, and it embedded only versions confirmed or in its log (bulk.embeddable, the version checks
                # of data rows), each read at a closed group.  A later verification closes the open group first
                # and opens the window again.
                self._eager_until = 0.0
            # every batch for a replaced destination not confirmed everywhere goes to the replacement (Outbox.restart)
            restarted = self.box.restart({i: s.server_id for i, s in live.items()})
        if close_now:
            self.close_group()
        for d in restarted:
            self.counters.add("chains_restarted", 1)
            sender = self.sender(d)
            sender.sent_confirm = 0  # the new incarnation has been told nothing
            sender.cancel_stale()  # a call hanging on the old incarnation must not hold up the replacement's chain
            sender.wake(due_now=True)
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
            return self.box.due(destination, everything, cutoff)

    def next_due(self, destination: int) -> float | None:
        """When the oldest batch ``destination`` has not acknowledged is due for direct delivery (monotonic); now
        for one not relayed; None when none is pending."""
        with self.lock:
            chain = self.chains.get(destination)
            if chain is None or not chain.server_id:
                return None
            due = [e.created + self.options.relay_timeout_s if e.relayed else 0.0
                   for e in self.outbox.values() if destination in e.pending]
            return min(due) if due else None

    def messages_for(self, destination: int, entries: list[OutboxEntry]) -> list[tuple[list, int]] | None:
        """``entries``' batches for ``destination`` still unacknowledged there, as messages of at most
        ``max_batch_bytes`` (addressed to the current incarnation), each with the confirmation to send beside it;
        None while no server holds it.  A message is a list of ``(batch, sections)``: ``sections`` the batch's
        bulk fields as arrays (a frame's, :mod:`~ecrec.strategies.erasure.batch_frames`), or None when the batch
        holds them.  They go over a server-to-server call whose caller proves it is a server: no seal needed."""
        with self.lock:
            chain = self.chains.get(destination)
            if chain is None or not chain.server_id:
                return None
            messages, current, size = [], [], 0
            for entry in entries:
                if destination not in entry.pending:
                    continue
                batch, sections = entry.batches[destination], entry.sections.get(destination)
                n = batch.ByteSize() + (batch_frames.sections_nbytes(sections) if sections else 0)
                if current and size + n > self.options.max_batch_bytes:
                    messages.append(current)
                    current, size = [], 0
                current.append((batch, sections))
                size += n
            if current:
                messages.append(current)
            return [(m, self.box.confirmed) for m in messages]

    def flush(self, timeout_s: float) -> int:
        """Sends every unacknowledged batch directly and waits (up to ``timeout_s``) until all are applied;
        returns how many pushes are still unconfirmed."""
        self.close_group()
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
            left = self.box.last_seq - self.box.confirmed if self.outbox else 0
            owed = [] if left else [s for s in self.senders.values() if s.sent_confirm < self.box.confirmed]
            confirmed = self.box.confirmed
        for sender in owed:  # the destinations trim their logs now, not at the next heartbeat
            sender.confirm(confirmed)
        return left

    def close(self) -> None:
        self._closer_wake.set()
        for sender in list(self.senders.values()):
            sender.wake()


def full_batch(entry: OutboxEntry, destination: int) -> parity_pb2.ParityBatch:
    """``entry``'s batch for ``destination`` with its bulk fields (filled from its sections when it was built for a
    frame): what a relay seals or the protobuf path sends."""
    sections = entry.sections.get(destination)
    batch = entry.batches[destination]
    return batch_frames.fill(batch, sections) if sections else batch
