"""A deterministic, single-threaded model of the parity protocol, driven by a seeded schedule of actions.

Servers, workers and the network are plain objects; time is the order of actions.  Row values are symbolic: every
state a data row reaches is a fresh *atom*, a delta is the pair ``{old, new}`` and a parity is the XOR (symmetric
difference) of its stripe's data atoms, so applying a delta twice cancels it and an undo is the same XOR again,
exactly as the byte-wise code behaves; a rebuilt data row is the parity XOR the other members, and what it decodes
to tells which pushes it holds.  The decisions are made by production's sans-I/O core, the same objects the servers
and the SDK run: each parity server's log of each owner (``source_log.SourceLog``: which incarnation a batch may
join, apply in order or hold back or skip, what a resolution lists, undoes and keeps, what a rebuild adopts), each
worker's keep-and-replay of its unconfirmed pushes (``client.courier.Courier``, on the same protobuf requests and
replies), the placement (``Layout``), resolution's kept prefix (``resolution.decide``, on the same protobuf
listings), which versions a rebuild may embed (``resolution.embeddable``), and each owner's outbox, chains, confirmation and committed push
ids (``outbox.Outbox``).  What is modelled here: every push closes its own group, its batch
addressed and sent at once (as a relay did) or, with the closer, acknowledged first and built later, in push
order, by a ``build`` action (as every group that goes directly is, on the owner's closer thread); one row per
push, m = 1.  ``rule="any"`` replaces the last two by what the code did before the closing fix (a
rebuild embeds any version it reads and takes no committed push ids; a restarted chain re-sends only what the
old destination had not acknowledged): the simulator must find the window there.

With ``coalesce`` (a schedule's ``("coalesce",)`` header), pushes join their owner's open group instead, and a
``close`` action closes it: one delta per row it changed (the XOR of its pushes' deltas, from the version before
the first to the last), one batch per destination; a rebuild reads each data row as it was after its owner's last
closed group (``ParityOwner.settle_rows``: the open group's deltas taken back out), so a parity never embeds a
row between two pushes of one group.  ``rule="unsettled"`` reads the rows as they are instead, the open group's
pushes in them: still safe (their versions are above the owner's confirmed bound and in no log, so a rebuild waits
for the group to close), only slower.  ``rule="loose"`` reads them so and embeds any version read, as ``any`` does:
the simulator must find a parity holding part of a merged delta there.

Actions are state-independent (``("deliver", 7)`` delivers message ``7 mod`` the number in flight, ``("kill", 9)``
the server ``9 mod`` the number of servers; an action that does not apply is a no-op), so a failing schedule can be
shrunk by dropping actions and rerun from its list alone.  A schedule's first action names how many servers it runs
(3 to 6, ``("servers", n)``).
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ecrec.client.courier import Courier
from ecrec.coding.layout import Layout
from ecrec.net import transport
from ecrec.strategies.erasure.outbox import EVERY_VERSION, Outbox, OutboxEntry
from ecrec.strategies.erasure.resolution import decide, embeddable
from ecrec.strategies.erasure.source_log import APPLY, RESTARTED, SAME, SourceLog
from ecrec.wire import embedding_pb2, parity_pb2

S, K, M = 4, 2, 1  # the servers by default (a schedule may name 3 to 6: its first action ("servers", n))
SERVER_COUNTS = (3, 4, 5, 6)
ROWS = 8
WORKERS = ("w0", "w1")


#: the actions that can change a data row (a push, a replay in a poll, a rebuilt row): the rows are checked after
#: each of them (a push held twice is caught when its atom is made, whatever the action)
ROW_CHANGING = frozenset({"push", "poll", "rebuild", "promote"})
#: and those that can change a parity row (a batch applied, an undo, a rebuilt parity): parity is checked after each
PARITY_CHANGING = frozenset({"deliver", "dup", "rebuild", "promote"})


class Violation(AssertionError):
    """An invariant broken: what, and after which action."""


@dataclass
class LogEntry:
    """What ``SourceLog`` keeps of an applied batch (the fields it reads), and how to undo it here."""

    seq: int
    first_seq: int
    push_ids: list
    destinations: tuple
    destination_ids: tuple
    row: int
    delta: frozenset
    old_version: int
    changes: list | None = None  # a coalesced group's: [(row, delta, old_version, version)]


@dataclass
class Payload:
    """What a push's batch carries to its one destination (m = 1): the delta of its row, and how to undo it."""

    pid: tuple[str, int]
    row: int
    delta: frozenset
    old_version: int

    def changes(self, seq: int) -> list[tuple[int, frozenset, int, int]]:
        return [(self.row, self.delta, self.old_version, seq)]


@dataclass
class GroupPayload:
    """What a coalesced group's batch carries to one destination: per row of it the group changed, one delta (the XOR
    of its pushes' deltas), its version before the group's first push to it and the last one's sequence."""

    pids: list
    rows: list  # [(row, delta, old_version, version)]
    first_seq: int
    destinations: tuple = ()  # every destination of the group, and their incarnations (addressed when built)
    destination_ids: tuple = ()

    def changes(self, seq: int) -> list[tuple[int, frozenset, int, int]]:
        return self.rows


class Server:
    def __init__(self, sim: "Sim", index: int, sid: str, epoch: int):
        self.sim, self.index, self.sid = sim, index, sid
        self.base, self.count = epoch << 32, 0
        self.rows: dict[int, frozenset] = {}  # data row -> its value (one atom when sound)
        self.versions: dict[int, int] = {}
        self.ready: dict[int, bool] = {}
        self.parity: dict[int, frozenset] = {}  # stripe -> XOR of its data atoms
        self.pvv: dict[int, list[int]] = {}  # stripe -> the version of each data position the parity holds
        self.built: dict[int, bool] = {}
        self.held_back: dict[int, list] = {}  # stripe -> [(seq, pos, delta)] for a parity not built yet, read
        self.marked: set[int] = set()  # stripes whose parity rebuild has started reading (ParityArena.begin_read)
        self.reading: dict[int, tuple] = {}  # stripe -> what its rebuild read (the rows, versions, owners' bounds)
        self.listings: dict[int, int] = {}  # source -> times listed for a resolution here (the receiver's generation)
        self.box = Outbox()  # production's owner core: outbox, chains, confirmation, committed push ids
        self.payload: dict[int, Payload] = {}  # seq -> what its batch carries
        self.marks: dict[str, int] = {}  # worker -> highest sequence applied here (or kept)
        self.logs: dict[int, SourceLog] = {}
        self.closing: list[tuple] = []  # (entry, {destination: batch}) acknowledged, not built yet (the closer)
        self.sent: dict[tuple[int, int], object] = {}  # (seq, destination) -> what that batch carries
        self.open: list[tuple] = []  # the open group (coalesce): (seq, pid, row, delta, old_version) per push

    # --- owner (ParityOwner: every push its own group, or coalesced; sent at once, or built later by the closer) ----
    @property
    def confirmed(self) -> int:
        return self.box.confirmed

    def bound(self) -> int:
        return self.box.bound()

    def send(self, entry: OutboxEntry, dest: int) -> None:
        """One entry's batch to ``dest`` as addressed now (the relay or the direct sender), with the confirmation."""
        b = entry.batches[dest]
        if b.destination_id:
            p = self.sent[(b.seq, dest)]
            if isinstance(p, GroupPayload):  # every destination the batch names, as addressed now (a resolution
                # keeps a group only where all of them have it)
                p = dataclasses.replace(p, destinations=tuple(b.destinations), destination_ids=tuple(b.destination_ids))
            self.sim.net.append(("batch", self.index, self.sid, dest, b.destination_id, b.seq, b.prev_seq, p,
                                 self.box.confirmed))

    def apply_push(self, pid, row: int) -> tuple[int, bool]:
        """A push (or a replay) of ``pid`` to ``row``: ``(seq, already applied)``."""
        w, n = pid
        if self.marks.get(w, -1) >= n:
            return 0, True
        self.count += 1
        seq = self.base | self.count
        self.box.numbered(seq)
        old = self.rows[row]
        new = self.sim.new_atom(row, self.sim.atoms[_one(old, row)] + Counter([pid]))
        delta = old ^ new
        self.rows[row], old_version, self.versions[row] = new, self.versions[row], seq
        self.sim.history[(row, seq)] = new
        self.marks[w] = n
        if self.sim.coalesce:  # it joins the open group; a "close" action makes its batches
            self.open.append((seq, pid, row, delta, old_version))
            return seq, False
        dest = self.sim.parity_of(row // K)
        self.payload[seq] = self.sent[(seq, dest)] = Payload(pid, row, delta, old_version)
        batch = parity_pb2.ParityBatch(source=self.index, source_id=self.sid, seq=seq, first_seq=seq)
        entry = OutboxEntry(seq, seq, 0.0, {}, relayed=not self.sim.closer, built=False, push_ids=[pid])
        self.box.add(entry)
        self.closing.append((entry, {dest: batch}))
        if not self.sim.closer:  # built and sent at once, as a relay did; else later, in push order (ParityOwner)
            self.build()
        return seq, False

    def close(self) -> None:
        """The open group closes (coalesce): one delta per row it changed, one batch per destination."""
        if not self.open:
            return
        pushes, self.open = self.open, []
        merged: dict[int, list] = {}  # row -> [delta, old_version, version], rows in order of first change
        for seq, _, row, delta, old_version in pushes:
            m = merged.get(row)
            if m is None:
                merged[row] = [delta, old_version, seq]
            else:
                m[0], m[2] = m[0] ^ delta, seq
        first, last, pids = pushes[0][0], pushes[-1][0], [p for _, p, *_ in pushes]
        by_dest: dict[int, list] = {}
        for row, (delta, old_version, version) in merged.items():
            by_dest.setdefault(self.sim.parity_of(row // K), []).append((row, delta, old_version, version))
        batches = {}
        for dest, rows in by_dest.items():
            self.sent[(last, dest)] = GroupPayload(pids, rows, first)
            batches[dest] = parity_pb2.ParityBatch(source=self.index, source_id=self.sid, seq=last, first_seq=first)
        entry = OutboxEntry(last, first, 0.0, {}, relayed=not self.sim.closer, built=False, push_ids=pids)
        self.box.add(entry)
        self.closing.append((entry, batches))
        if not self.sim.closer:
            self.build()

    def at_boundary(self, row: int) -> tuple[frozenset, int]:
        """A data row as it was after this owner's last closed group: the open group's deltas to it taken back
        out, its version before the group's first push to it (``ParityOwner.settle_rows``)."""
        value, version = self.rows[row], self.versions[row]
        if self.sim.rule in ("unsettled", "loose"):  # the rows as they are, the open group's pushes in them
            return value, version
        for _, _, r, delta, old_version in reversed(self.open):
            if r == row:
                value, version = value ^ delta, old_version
        return value, version

    def build(self) -> None:
        """The closer thread: the oldest group acknowledged and not built yet is built, addressed to the chains as
        they are now, and sent (``ParityOwner._close_pending``)."""
        if self.closing:
            entry, batches = self.closing.pop(0)
            self.box.install(entry, batches, lambda d: self.sim.live_ids().get(d, ""), group_open=bool(self.open))
            for dest in sorted(batches):
                self.send(entry, dest)

    def on_ack(self, dest: int, dest_id: str, upto: int) -> None:
        self.box.ack(dest, dest_id, upto, group_open=bool(self.open))

    def on_map_change(self, old_rule: bool = False) -> None:
        """Chains restart at replaced destinations (``Outbox.restart``), every batch due there sent at once.
        ``old_rule``: as before the closing fix, a restarted chain re-sends only what the old incarnation had not
        acknowledged."""
        aside = {}
        if old_rule:  # the batches a destination acknowledged are left out of the restart, as then
            for e in self.box.entries.values():
                for d in [d for d in e.batches if d not in e.pending]:
                    aside[(e.seq, d)] = e.batches.pop(d)
        restarted = self.box.restart(self.sim.live_ids())
        for (seq, d), b in aside.items():
            self.box.entries[seq].batches[d] = b
        for d in restarted:
            for e in self.box.due(d, everything=True, cutoff=0.0):
                self.send(e, d)

    def tick(self) -> None:
        """The direct sender: every batch not acknowledged goes again, and the confirmation with it."""
        for dest, chain in self.box.chains.items():
            if chain.server_id:
                for e in self.box.due(dest, everything=True, cutoff=0.0):
                    self.send(e, dest)
                self.sim.net.append(("confirm", self.index, self.sid, dest, chain.server_id, self.box.confirmed))

    # --- parity -------------------------------------------------------------------------------------------------
    def log_of(self, source: int) -> SourceLog:
        return self.logs.setdefault(source, SourceLog(source))

    def on_batch(self, source: int, source_id: str, seq: int, prev: int, p: Payload, confirmed: int) -> None:
        """``receiver.receive``: the log decides; this applies what it says to and answers the watermark."""
        lg = self.log_of(source)
        named_live = source not in self.sim.down and self.sim.servers[source].sid == source_id
        if lg.incarnation(source_id, named_live) not in (SAME, RESTARTED):
            return  # refused: resolved, not named by the map, or being resolved
        offer = lg.offer(seq, prev, p, 1)
        if offer.kind == APPLY:
            for s, q in offer.ready:
                self._apply(lg, s, q)
        lg.confirm(confirmed)
        self.sim.net.append(("ack", self.index, self.sid, source, source_id, lg.applied_upto))

    def _apply(self, lg: SourceLog, seq: int, p) -> None:
        changes = p.changes(seq)
        for row, delta, _, version in changes:
            stripe, pos = divmod(row, K)
            if self.built.get(stripe):
                if self.pvv[stripe][pos] < version:  # else the rebuilt parity holds it already: skipped
                    self.parity[stripe] ^= delta
                    self.pvv[stripe][pos] = version
            elif stripe in self.marked:
                self.held_back.setdefault(stripe, []).append((version, pos, delta))
            # else dropped: the parity's rebuild has not read the stripe yet, and the data it will read holds this
            # change (its owner applied it before sending it); the log still records it, for a resolution
        if isinstance(p, Payload):
            lg.record(seq, LogEntry(seq, seq, [p.pid], (self.index,), (self.sid,), p.row, p.delta, p.old_version))
        else:
            lg.record(seq, LogEntry(seq, p.first_seq, list(p.pids), p.destinations, p.destination_ids, changes[0][0],
                                    changes[0][1], changes[0][2], changes))

    def undo(self, e: LogEntry) -> None:
        for row, delta, old_version, version in reversed(e.changes or [(e.row, e.delta, e.old_version, e.seq)]):
            stripe, pos = divmod(row, K)
            if self.built.get(stripe):
                if self.pvv[stripe][pos] != version:
                    continue  # as production's undo: only where the parity holds that delta as the row's newest
                self.parity[stripe] ^= delta
                self.pvv[stripe][pos] = old_version
            else:
                self.held_back[stripe] = [h for h in self.held_back.get(stripe, []) if h[0] != version]


def _one(value: frozenset, row: int) -> str:
    if len(value) != 1:
        raise Violation(f"row {row} decodes to {sorted(value)}: not one state of the row (parity inconsistent)")
    return next(iter(value))


class Sim:
    def __init__(self, rule: str = "confirmed", servers: int = S, closer: bool = False, coalesce: bool = False):
        self.n = servers
        self.closer = closer  # groups built later, on the owner's closer thread ("build" actions), not at the push
        self.coalesce = coalesce  # pushes join their owner's open group; "close" actions close it
        self.layout = Layout(servers, K, M)
        self._owners = [int(i) for i in self.layout.locate(np.arange(ROWS))[0]]
        self._parities = [int(i) for i in self.layout.parity_servers(np.arange(ROWS // K))[:, 0]]
        self.rule = rule
        self.atoms: dict[str, Counter] = {}
        self.atom_row: dict[str, int] = {}
        self.history: dict[tuple[int, int], frozenset] = {}  # (row, version) -> the row's value at that version
        self.epoch = 1
        self.servers = {i: Server(self, i, f"s{i}.1", self.epoch) for i in range(servers)}
        self.down: set[int] = set()
        self.net: list[tuple] = []
        self.couriers = {w: Courier() for w in WORKERS}  # each worker's unconfirmed pushes, production's courier
        self.next_seq = {w: 0 for w in WORKERS}
        self.acked: dict[tuple, int] = {}  # pid -> row
        self.trace: list[str] = []
        for r in range(ROWS):
            owner = self.owner_of(r)
            self.servers[owner].rows[r] = self.history[(r, 0)] = self.new_atom(r, Counter())
            self.servers[owner].versions[r] = 0
            self.servers[owner].ready[r] = True
        for s in self.servers.values():
            for stripe in range(ROWS // K):
                if self.parity_of(stripe) == s.index:
                    s.parity[stripe] = self.xor_of_stripe(stripe)
                    s.pvv[stripe], s.built[stripe] = [0] * K, True

    def new_atom(self, row: int, pids: Counter) -> frozenset:
        name = f"r{row}.{len(self.atoms)}"
        self.atoms[name], self.atom_row[name] = pids, row
        if any(c > 1 for c in pids.values()):
            raise Violation(f"row {row} holds push {[p for p, c in pids.items() if c > 1]} twice")
        return frozenset([name])

    def owner_of(self, row: int) -> int:
        return self._owners[row]

    def parity_of(self, stripe: int) -> int:
        return self._parities[stripe]

    def xor_of_stripe(self, stripe: int) -> frozenset:
        out = frozenset()
        for r in range(stripe * K, stripe * K + K):
            out ^= self.servers[self.owner_of(r)].rows[r]
        return out

    def live(self, i: int) -> Server | None:
        return None if i in self.down else self.servers[i]

    def live_ids(self) -> dict[int, str]:
        """The map: index -> the incarnation serving it (an index down has none)."""
        return {i: s.sid for i, s in self.servers.items() if i not in self.down}

    # --- actions ------------------------------------------------------------------------------------------------
    def push(self, w: str, row: int) -> None:
        o = self.live(self.owner_of(row))
        if o is None or not o.ready.get(row) or self._replay_due(w, o):
            return
        self.next_seq[w] += 1
        pid = (w, self.next_seq[w])
        request = embedding_pb2.PushRequest(push_id=embedding_pb2.PushId(worker=w, sequence=pid[1]),
                                            tables=[embedding_pb2.TableGrads(table="t", ids=transport.ids_to_bytes([row]))])
        seq, already = o.apply_push(pid, row)
        self.acked[pid] = row
        self.couriers[w].pushed(o.index, request, self._reply(o, seq, already))

    @staticmethod
    def _reply(o: Server, seq: int, already: bool) -> embedding_pb2.PushReply:
        return embedding_pb2.PushReply(already_applied=already, seq=seq, confirmed_upto=o.confirmed, server_id=o.sid)

    def _replay_due(self, w: str, o: Server) -> bool:
        return self.couriers[w].held_elsewhere(o.index, o.sid)

    def poll(self, w: str) -> None:
        """The worker's next call to every index it holds pushes of (its idle keeper, or a step): confirmations
        come back; held pushes are replayed to a replacement first, in order (``Cluster._replay_if_replaced``)."""
        courier = self.couriers[w]
        for index in sorted(courier.held_indices()):
            o = self.live(index)
            if o is None:
                continue
            for key, request in courier.to_replay(index, o.sid):
                pid = (request.push_id.worker, request.push_id.sequence)
                row = int(transport.bytes_to_ids(request.tables[0].ids)[0])
                if not o.ready.get(row) and not self.rebuild_data(o, row):
                    break  # a replay goes in order: one that must wait holds back the later ones
                seq, already = o.apply_push(pid, row)  # a replay, with its push id
                courier.replayed(index, key, self._reply(o, seq, already))
            courier.received(index, embedding_pb2.PullReply(confirmed_upto=o.confirmed, server_id=o.sid))

    def deliver(self, n: int, duplicate: bool = False, drop: bool = False) -> None:
        if not self.net:
            return
        i = n % len(self.net)
        msg = self.net[i] if duplicate else self.net.pop(i)
        if drop:
            return
        kind, src, src_id, dst, dst_id = msg[:5]
        d = self.live(dst)
        if d is None or d.sid != dst_id:
            return
        if kind == "batch":
            _, _, _, _, _, seq, prev, p, confirmed = msg
            d.on_batch(src, src_id, seq, prev, p, confirmed)
        elif kind == "ack":
            d.on_ack(src, src_id, msg[5])
        elif kind == "confirm":
            lg = d.log_of(src)
            if lg.source_id == src_id:
                lg.confirm(msg[5])

    def tick(self, i: int) -> None:
        s = self.live(i % self.n)
        if s is not None:
            s.tick()

    def build(self, i: int) -> None:
        s = self.live(i % self.n)
        if s is not None:
            s.build()

    def close(self, i: int) -> None:
        s = self.live(i % self.n)
        if s is not None:
            s.close()

    def kill(self, i: int) -> None:
        """One failure at a time (m = 1): only while every index is served and fully rebuilt."""
        if self.down or any(not all(s.ready.values()) or not all(s.built.values()) for s in self.servers.values()):
            return
        self.down.add(i % self.n)
        for s in self.servers.values():
            if s.index not in self.down:
                s.on_map_change()

    def promote(self) -> None:
        """The replacement of the failed index: chains restart there, resolution of its pushes, rows not ready."""
        if not self.down:
            return
        x = self.down.pop()
        old = self.servers[x]
        self.epoch += 1
        new = self.servers[x] = Server(self, x, f"s{x}.{self.epoch}", self.epoch)
        for r in old.rows:
            new.rows[r], new.versions[r], new.ready[r] = frozenset(), 0, False
        for stripe in old.parity:
            new.parity[stripe], new.pvv[stripe], new.built[stripe] = frozenset(), [0] * K, False
        for s in self.servers.values():  # owners restart their chain to x with every batch not confirmed
            if s is not new:
                s.on_map_change(old_rule=self.rule == "any")
        # resolution of x's pushes, by the rule production runs, on the listings production builds
        listings, survivors = {}, [s for s in self.servers.values() if s is not new]
        for s in survivors:  # receiver.list_source
            s.listings[x] = s.listings.get(x, 0) + 1
            lg = s.log_of(x)
            lg.close_for_resolution()
            listings[s.index] = parity_pb2.ResolveSourceReply()
            lg.listing(listings[s.index])
        decision = decide(listings, {i: s.sid for i, s in self.servers.items()})
        undo = set(decision.undo)
        for s in survivors:  # receiver.commit_resolution
            listed = {e.seq for e in listings[s.index].logged}
            for e in s.log_of(x).resolve(undo & listed):
                s.undo(e)
        standing = decision.kept + decision.committed
        for w, n in standing:
            new.marks[w] = max(new.marks.get(w, -1), n)
        new.box.commit(standing)
        self.trace.append(f"    resolution of {old.sid}: kept {decision.kept}, undo {sorted(undo)}, "
                          f"committed {decision.committed}")

    def rebuild_data(self, s: Server, row: int) -> bool:
        """A data row of a replacement: parity XOR the other members, when their versions agree."""
        if s.ready.get(row) is not False:
            return False
        stripe, pos = divmod(row, K)
        q = self.live(self.parity_of(stripe))
        if q is None or not q.built.get(stripe):
            return False
        value = q.parity[stripe]
        for r in range(stripe * K, stripe * K + K):
            if r == row:
                continue
            o = self.live(self.owner_of(r))
            if o is None or not o.ready.get(r):
                return False  # a member missing: later
            row_value, row_version = o.at_boundary(r)  # read at its owner's last closed group
            if row_version != q.pvv[stripe][r % K]:
                return False  # a delta in flight: later
            value ^= row_value
        _one(value, row)
        s.rows[row], s.versions[row], s.ready[row] = value, q.pvv[stripe][pos], True
        return True

    def rebuild_parity(self, s: Server, stripe: int) -> bool:
        """A parity row of a replacement, in two steps as production does it: a read (the row marked first, so that
        deltas for it are held from then on; the stripe's data rows at versions the rule lets it embed, with their
        owners' bounds and committed ids), then, at a later action, the build (the owners' bounds adopted unless an
        owner was listed for a resolution since: then read again; the deltas held since the read applied where newer)."""
        if s.built.get(stripe) is not False:
            return False
        read = s.reading.pop(stripe, None)
        if read is None:
            s.marked.add(stripe)  # before the data is read
            members = []
            for r in range(stripe * K, stripe * K + K):
                o = self.live(self.owner_of(r))
                if o is None or not o.ready.get(r):
                    return False
                members.append((o, r))
            read = [o.at_boundary(r) for o, r in members]  # each at its owner's last closed group
            if self.rule not in ("any", "loose") and not all(
                    embeddable(version, max(o.bound(), s.log_of(o.index).logged_upto(o.sid)))
                    for (o, _), (_, version) in zip(members, read)):
                for o, _ in members:  # the owner, told a rebuild waits, sends its batches now
                    o.tick()
                return False
            value = frozenset()
            for row_value, _ in read:
                value ^= row_value
            s.reading[stripe] = (value, [version for _, version in read],
                                 [(o.index, o.sid, o.bound(), list(o.box.committed.items()), s.listings.get(o.index, 0))
                                  for o, _ in members])
            return False
        value, versions, owners = read
        if self.rule not in ("any", "loose"):
            for index, sid, bound, committed, listed in owners:  # receiver.adopt_locked
                if s.listings.get(index, 0) != listed or not s.log_of(index).adopt(sid, bound, committed):
                    return False  # an owner resolved since the read: read again
        s.parity[stripe], s.pvv[stripe], s.built[stripe] = value, list(versions), True
        for seq, pos, delta in s.held_back.pop(stripe, []):  # in arrival order, as ParityArena._apply_held
            if seq > s.pvv[stripe][pos]:
                s.parity[stripe] ^= delta
                s.pvv[stripe][pos] = seq
        return True

    def rebuild(self, i: int, n: int) -> None:
        s = self.live(i % self.n)
        if s is None:
            return
        todo = [("d", r) for r, ok in s.ready.items() if not ok] + [("p", st) for st, ok in s.built.items() if not ok]
        if todo:
            kind, what = todo[n % len(todo)]
            (self.rebuild_data if kind == "d" else self.rebuild_parity)(s, what)

    # --- running ------------------------------------------------------------------------------------------------
    def act(self, action: tuple) -> None:
        kind, *args = action
        self.trace.append(f"{action}")
        {"push": self.push, "poll": self.poll, "deliver": self.deliver, "dup": lambda n: self.deliver(n, duplicate=True),
         "drop": lambda n: self.deliver(n, drop=True), "tick": self.tick, "kill": self.kill, "promote": self.promote,
         "rebuild": self.rebuild, "build": self.build, "close": self.close}[kind](*args)
        if kind in ROW_CHANGING:
            self.check_rows()
        if kind in PARITY_CHANGING:
            self.check_parity()

    def check_rows(self) -> None:
        for s in self.servers.values():
            if s.index in self.down:
                continue
            for r, value in s.rows.items():
                if s.ready.get(r):
                    _one(value, r)  # and new_atom refused any push held twice

    def check_parity(self) -> None:
        """Every built parity row is the encoding of the versions of its data rows that it says it holds (each a
        version some push produced), whatever is in flight, held back or about to be undone."""
        for s in self.servers.values():
            if s.index in self.down:
                continue
            for stripe, built in s.built.items():
                if not built:
                    continue
                expected = frozenset()
                for pos, version in enumerate(s.pvv[stripe]):
                    value = self.history.get((stripe * K + pos, version))
                    if value is None:
                        raise Violation(f"stripe {stripe}: parity at {s.sid} holds version {version} of row "
                                        f"{stripe * K + pos}, which no push produced")
                    expected ^= value
                if s.parity[stripe] != expected:
                    raise Violation(f"stripe {stripe}: parity at {s.sid} is not the encoding of the versions it "
                                    f"holds {s.pvv[stripe]}")

    def settle(self, rounds: int = 200) -> None:
        """Runs the system to quiescence: replacements, rebuilds, direct sends, deliveries, the workers' polls."""
        for _ in range(rounds):
            self.act(("promote",))
            for i in range(self.n):
                for n in range(2 * ROWS):
                    self.act(("rebuild", i, n))
                if self.live(i) is not None and self.servers[i].open:
                    self.act(("close", i))
                while self.live(i) is not None and self.servers[i].closing:
                    self.act(("build", i))
                self.act(("tick", i))
            while self.net:
                self.act(("deliver", 0))
            for w in WORKERS:
                self.act(("poll", w))
            if not self.net and not any(c.unconfirmed() for c in self.couriers.values()) and all(
                    all(s.ready.values()) and all(s.built.values()) and not any(e.pending for e in s.box.entries.values())
                    for s in self.servers.values()):
                return
        raise Violation("no quiescence: " + "; ".join(f"{w} holds {c.unconfirmed()}" for w, c in self.couriers.items()))

    def check_final(self) -> None:
        for stripe in range(ROWS // K):
            q = self.servers[self.parity_of(stripe)]
            if q.parity[stripe] != self.xor_of_stripe(stripe):
                raise Violation(f"stripe {stripe}: parity at {q.sid} is not the encoding of its data rows")
        for pid, row in self.acked.items():
            value = self.servers[self.owner_of(row)].rows[row]
            count = self.atoms[_one(value, row)][pid]
            if count != 1:
                raise Violation(f"acknowledged push {pid} is in row {row} {count} times")


def schedule(seed: int, length: int | None = None, closer: bool = False, coalesce: bool = False) -> list[tuple]:
    """A seeded list of actions (state-independent: see the module docstring), 30 to 150 of them by default.  With
    ``closer``, the owners build each group later, on their closer thread (a ``("closer",)`` header and ``build``
    actions); without it, the same seed gives the same schedule as before the closer was modelled.  With
    ``coalesce``, pushes join their owner's open group (a ``("coalesce",)`` header and ``close`` actions)."""
    rng = random.Random(seed)
    length = length if length is not None else rng.randint(30, 150)
    kinds = ["push", "deliver", "poll", "tick", "dup", "drop", "kill", "promote", "rebuild"]
    weights = [24, 30, 6, 6, 2, 2, 3, 5, 10]
    out = [("servers", rng.choice(SERVER_COUNTS))]
    if closer:
        kinds, weights = kinds + ["build"], weights + [12]
        out.append(("closer",))
    if coalesce:
        kinds, weights = kinds + ["close"], weights + [8]
        out.append(("coalesce",))
    for _ in range(length):
        kind = rng.choices(kinds, weights)[0]
        if kind == "push":
            out.append(("push", rng.choice(WORKERS), rng.randrange(ROWS)))
        elif kind in ("deliver", "dup", "drop"):
            out.append((kind, rng.randrange(64)))
        elif kind == "poll":
            out.append(("poll", rng.choice(WORKERS)))
        elif kind in ("tick", "kill", "build", "close"):
            out.append((kind, rng.randrange(60)))
        elif kind == "promote":
            out.append(("promote",))
        else:
            out.append(("rebuild", rng.randrange(60), rng.randrange(64)))
    return out


def run(actions: list[tuple], rule: str = "confirmed") -> str | None:
    """Runs ``actions`` then settles; the violation found (its message), or None.  A first action
    ``("servers", n)`` sets the number of servers (else ``S``); a ``("closer",)`` after it models the closer, a
    ``("coalesce",)`` after those coalesced groups."""
    servers, closer, coalesce = S, False, False
    if actions and actions[0][0] == "servers":
        servers, actions = actions[0][1], actions[1:]
    if actions and actions[0] == ("closer",):
        closer, actions = True, actions[1:]
    if actions and actions[0] == ("coalesce",):
        coalesce, actions = True, actions[1:]
    sim = Sim(rule, servers, closer, coalesce)
    try:
        for a in actions:
            sim.act(a)
        sim.settle()
        sim.check_final()
    except Violation as exc:
        return str(exc)
    return None


def shrink(actions: list[tuple], rule: str = "confirmed") -> list[tuple]:
    """A shorter schedule that still fails (greedy: drop chunks, then single actions, while it fails); a leading
    ``("servers", n)``, ``("closer",)`` and ``("coalesce",)`` stay."""
    assert run(actions, rule) is not None
    first = 1 if actions and actions[0][0] == "servers" else 0
    first += 1 if len(actions) > first and actions[first] == ("closer",) else 0
    first += 1 if len(actions) > first and actions[first] == ("coalesce",) else 0
    chunk = max(1, len(actions) // 2)
    while chunk >= 1:
        i, changed = first, False
        while i < len(actions):
            trial = actions[:i] + actions[i + chunk:]
            if trial and run(trial, rule) is not None:
                actions, changed = trial, True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return actions


__all__ = ["EVERY_VERSION", "Sim", "Violation", "run", "schedule", "shrink"]
