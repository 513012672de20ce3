"""The receiving side of the parity path: a server applies other owners' batches to its parity rows
and dense replicas, and keeps them in a per-source log until the owner confirms them.

Batches arrive relayed by workers (inside pulls and pushes) or directly from their owner, in any order,
always sealed by their owner (:mod:`ecrec.net.seal`): one whose seal does not check -- changed, made up, or not
from a server -- is refused, counted and logged with the worker that carried it, and changes nothing.  Each
source's batches form a chain (every batch names its predecessor) applied strictly in order, later
ones held back until their predecessor arrives, duplicates skipped.  A batch is validated whole before
anything of it changes.  For a failed owner the log answers resolution: close the chain and list what
is held, then undo the batches resolution drops (XOR cancels, versions go back) and forget the
incarnation.  While a failed owner's batches are unresolved, the rows they touched are not *ready* for a
rebuild to read.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from ecrec import errors
from ecrec.net import transport
from ecrec.net.cluster_map import LIVE_STATES, live_servers
from ecrec.coding.codec import Codec
from ecrec.tables.shards import TableShard
from ecrec.strategies.base import StrategyHost, push_key_chars
from ecrec.strategies.erasure import batch_frames
from ecrec.strategies.erasure.parity_store import ParityArena, TableParity, place_rows
from ecrec.strategies.erasure.source_log import (APPLY, CLOSED, DUPLICATE, FOREIGN, HELD, RESOLVED, RESTARTED, DenseEntry,
                                                LogEntry, SourceLog, TableEntry)
from ecrec.wire import cluster_pb2, embedding_pb2, parity_pb2

log = logging.getLogger("ecrec.strategies.erasure")


@dataclass
class Resolution:
    """This server's part in the resolution of a failed index by one replacement (repeated calls answered the same)."""

    replacement_id: str
    failed_id: str  # the incarnation whose chain the listing closed ("": none held here)
    listing: parity_pb2.ResolveSourceReply
    listed: frozenset  # the sequences listed: the only ones a commit may undo
    committed: bool = False


class ParityReceiver:
    """Parity stores and source logs of one server (see the module docstring)."""

    def __init__(self, host: StrategyHost, codec: Codec, counters):
        self.host = host
        self.codec = codec
        self.counters = counters
        self.arenas: dict[int, ParityArena] = {}  # row width -> the parity rows of every table that wide
        self.parts: dict[str, tuple[ParityArena, TableParity]] = {}
        self._names_cache: dict[tuple, tuple] = {}
        # compile the hot path now, not in the first request (a replacement's first batches meet training)
        codec.kernel.warm_up()
        place_rows(np.zeros(1, np.int64), np.ones(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64),
                   np.zeros(1, np.int64), 1, np.zeros(1, np.int64))
        self.logs: dict[int, SourceLog] = {}
        self.lock = threading.Lock()  # guards the logs
        self.resolved_sources: dict[int, str] = {}  # failed index -> server id of the replacement that resolved it
        self.resolutions: dict[int, Resolution] = {}  # failed index -> its latest resolution here
        self.listings: dict[int, int] = {}  # index -> how many times its chain was listed for a resolution here

    # --- stores --------------------------------------------------------------------------------------------
    def add_table(self, shard: TableShard, encode: bool) -> TableParity:
        """Adds a table's parity rows to the arena of its row width (initial parity encoded when ``encode``)."""
        width = shard.spec.row_bytes
        with self.lock:
            arena = self.arenas.get(width)
            if arena is None:
                arena = self.arenas[width] = ParityArena(width, self.host.layout, self.host.index, self.codec)
        part = arena.add_table(shard.spec, allocate=lambda shape, dtype: self.host.allocate(shard.spec.name, shape,
                                                                                           dtype))
        if encode:
            arena.encode_initial(part)
        self.parts[shard.spec.name] = (arena, part)
        return part

    def part(self, table: str) -> tuple[ParityArena, TableParity]:
        found = self.parts.get(table)
        if found is None:
            raise errors.NotFound(f"unknown table {table!r}")
        return found

    # --- applying ------------------------------------------------------------------------------------------
    def _tables_of(self, names) -> tuple[ParityArena, np.ndarray, np.ndarray]:
        """The arena of ``names`` with each table's offset and parity-slot count (cached per list of names:
        an owner sends the same list with every batch)."""
        key = tuple(names)
        found = self._names_cache.get(key)
        if found is None:
            parts = [self.part(name) for name in key]
            arena = parts[0][0]
            if any(a is not arena for a, _ in parts):
                raise errors.InvalidRequest(f"tables {list(key)} have rows of different widths in one delta group")
            found = (arena, np.array([p.offset for _, p in parts], dtype=np.int64),
                     np.array([p.count for _, p in parts], dtype=np.int64))
            self._names_cache[key] = found
        return found

    def _parse(self, b: parity_pb2.ParityBatch, sections=None):
        """Validates one batch before anything of it is applied; returns its deltas per arena and dense deltas.
        ``sections``: its table entries' bulk fields, when a frame brought them (``batch_frames``) rather than
        ``b``."""
        layout = self.host.layout
        config = self.host.config
        if len(b.push_ids) > config.max_push_ids_per_batch:
            raise errors.InvalidRequest(f"a parity batch carries {len(b.push_ids)} push ids; the bound is "
                                        f"{config.max_push_ids_per_batch} (--max-push-ids-per-batch)")
        longest = push_key_chars()  # name#digest (ecrec.strategies.base.push_key)
        if any(len(p.worker) > longest or p.incarnation for p in b.push_ids):
            raise errors.InvalidRequest(f"a parity batch carries a push id that is not a server's push key "
                                        f"(at most {longest} characters, no incarnation)")
        tables = []
        if sections is not None and len(sections) != len(b.tables):
            raise errors.InvalidRequest(f"a parity frame has sections for {len(sections)} of {len(b.tables)} table "
                                        "entries")
        for i, t in enumerate(b.tables):
            if not t.tables:
                raise errors.InvalidRequest("parity deltas must name their tables")
            arena, offsets, limits = self._tables_of(t.tables)
            table_rows, parity_slots, positions, raw, old_versions, seqs = (
                sections[i] if sections is not None else (t.table_rows, t.parity_slots, t.positions, t.deltas,
                                                          t.old_versions, t.seqs))
            counts = transport.bytes_to_ids(table_rows)
            local = transport.bytes_to_ids(parity_slots)
            n = len(local)
            positions = transport.bytes_to_ids(positions)
            old_versions = transport.bytes_to_ids(old_versions)
            seqs = transport.bytes_to_ids(seqs)
            if (len(counts) != len(offsets) or len(positions) != n or len(old_versions) != n or len(seqs) != n
                    or len(raw) != n * arena.row_bytes or t.parity >= layout.m):
                raise errors.InvalidRequest(f"tables {list(t.tables)}: inconsistent parity batch lengths or parity index")
            if n == 0:
                continue
            if (seqs - b.first_seq).view(np.uint64).max() > b.seq - b.first_seq:
                raise errors.InvalidRequest(f"tables {list(t.tables)}: a delta's push is not in this batch "
                                            f"({b.first_seq}..{b.seq})")
            slots, checked = place_rows(local, counts, offsets, limits, positions, layout.k, arena.slot_to_stripe)
            if checked != n:
                if checked < 0:
                    raise errors.InvalidRequest(f"tables {list(t.tables)}: the rows per table do not add up to {n}")
                table = t.tables[int(np.searchsorted(np.cumsum(counts), checked, side="right"))]
                raise errors.InvalidRequest(
                    f"table {table!r}: parity slot {int(local[checked])} or stripe position {int(positions[checked])} "
                    f"is out of range, or server {self.host.index} holds no parity row there")
            deltas = np.frombuffer(raw, dtype=np.uint8).reshape(n, arena.row_bytes)
            tables.append((arena, slots, positions, int(t.parity), deltas, old_versions, seqs))
        dense = []
        for d in b.dense:
            shard = self.host.dense(d.name)
            if len(d.value) != shard.nbytes:
                raise errors.InvalidRequest(
                    f"dense tensor {d.name!r}: delta of {len(d.value)} bytes, expected {shard.nbytes}")
            if not b.first_seq <= d.seq <= b.seq:
                raise errors.InvalidRequest(f"dense tensor {d.name!r}: push {d.seq} is not in this batch")
            dense.append((shard, np.frombuffer(d.value, dtype=np.uint8), d.old_version, d.seq))
        return tables, dense

    def _apply_locked(self, lg: SourceLog, b: parity_pb2.ParityBatch, parsed) -> None:
        for _ in range(max(1, len(b.push_ids))):  # counted per push the batch carries
            self.host.faults.hit("before_parity_apply")
        t0 = time.thread_time()
        tables, dense = parsed
        entry = LogEntry(b.seq, b.first_seq, [(p.worker, p.sequence) for p in b.push_ids], tuple(b.destinations),
                         tuple(b.destination_ids))
        for arena, slots, positions, parity, deltas, old_versions, seqs in tables:
            arena.apply(seqs, slots, positions, parity, deltas)
            entry.tables.append(TableEntry(arena.row_bytes, slots, positions, parity, deltas, old_versions, seqs))
        for shard, delta, old_version, seq in dense:
            shard.apply_delta(delta, seq)
            entry.dense.append(DenseEntry(shard.spec.name, delta, old_version, seq))
        lg.record(b.seq, entry)
        self.counters.add("part_apply_cpu_s", time.thread_time() - t0)
        self.counters.add("batches_applied", 1)
        self.counters.add("delta_bytes_applied", sum(t[4].nbytes for t in tables)
                          + sum(delta.nbytes for _, delta, _, _ in dense))

    def receive(self, batches: list[parity_pb2.ParityBatch], strict: bool,
                sections: list | None = None) -> dict[int, SourceLog]:
        """Applies batches (any sources, any order): each source's chain strictly in the order its batches
        name, later ones held back until their predecessor arrives; duplicates are skipped.  A batch addressed
        to another incarnation of this server, or from a source incarnation already resolved, is refused:
        with ``strict`` (the owner's direct call) as an error, else (relayed) it is dropped and counted.
        Returns the logs of the sources seen (their watermarks answer the caller).  ``sections[i]``: the bulk
        fields of ``batches[i]``'s table entries when a frame brought them."""
        self.host.require_index()
        seen: dict[int, SourceLog] = {}
        for i, b in enumerate(batches):
            try:
                t0 = time.thread_time()
                extra = sections[i] if sections is not None else None
                parsed = self._parse(b, extra)
                self.counters.add("part_parse_cpu_s", time.thread_time() - t0)
                with self.lock:
                    lg = self._chain_for(b)
                    seen[b.source] = lg
                    size = b.ByteSize() + (batch_frames.sections_nbytes(extra) if extra is not None else 0)
                    offer = lg.offer(b.seq, b.prev_seq, (b, parsed), size)
                    if offer.kind == DUPLICATE:
                        self.counters.add("duplicate_batches", 1)
                    elif offer.kind == APPLY:  # it, and successors that arrived first
                        for _, (nxt, nxt_parsed) in offer.ready:
                            self._apply_locked(lg, nxt, nxt_parsed)
                    elif offer.kind == HELD:
                        self.counters.add("held_back_batches", 1)
                    else:
                        raise errors.ResourceExhausted(
                            f"server {self.host.index}: {len(lg.held)} batches of source {b.source} ({lg.held_bytes} "
                            f"bytes; bounds {lg.max_held} batches, --max-held-bytes {lg.max_held_bytes}) wait for "
                            f"batch {lg.applied_upto}'s successor; send the chain in order")
                    lg.confirm(b.confirmed_upto)
            except errors.EcrecError as exc:
                if strict:
                    raise
                self.counters.add("refused_relayed_batches", 1)
                log.warning("relayed parity batch of source %d seq %d refused: %s", b.source, b.seq, exc)
        return seen

    def _chain_for(self, b: parity_pb2.ParityBatch) -> SourceLog:
        """The log of ``b``'s source, checked against ``b``'s incarnations (call with the lock held)."""
        if b.destination != self.host.index:
            raise errors.FailedPrecondition(f"batch addressed to server {b.destination}; this is server {self.host.index}")
        if b.destination_id and b.destination_id != self.host.server_id:
            self.counters.add("stale_batches", 1)
            raise errors.FailedPrecondition(
                f"batch addressed to incarnation {b.destination_id} of server {b.destination}; this is "
                f"{self.host.server_id}: the destination was replaced, refresh the map")
        lg = self.logs.get(b.source)
        if lg is None:
            lg = self.logs[b.source] = self._new_log(b.source)
        previous, unresolved = lg.source_id, len(lg.entries) if not lg.closed else 0
        current = live_servers(self.host.cluster_map).get(b.source) if b.source_id != lg.source_id else None
        verdict = lg.incarnation(b.source_id, current is not None and current.server_id == b.source_id)
        if verdict == RESOLVED:
            raise errors.FailedPrecondition(
                f"source {b.source} incarnation {b.source_id} was replaced and resolved; batch refused")
        if verdict == FOREIGN:
            self.counters.add("foreign_batches", 1)
            raise errors.FailedPrecondition(
                f"batch from {b.source_id}, which server {self.host.index}'s map (epoch {self.host.epoch}) does "
                f"not name as index {b.source}: refused until the map does")
        if verdict == CLOSED:
            raise errors.FailedPrecondition(f"source {b.source} incarnation {b.source_id} is being resolved; batch refused")
        if verdict == RESTARTED and previous and unresolved:
            # resolution of the previous incarnation never reached this server: what it applied is kept
            log.error("source %d changed incarnation (%s -> %s) with %d unresolved batches; keeping them",
                      b.source, previous, b.source_id, unresolved)
            self.counters.add("unresolved_incarnation_switches", 1)
        return lg

    def watermarks(self, seen: dict[int, SourceLog]) -> list[embedding_pb2.ParityWatermark]:
        """The sealed watermarks of ``seen``'s chains, for a worker to take to their owners."""
        sealer = self.host.sealer
        if sealer is None:
            return []
        with self.lock:
            marks = [(s, lg.source_id, lg.applied_upto) for s, lg in seen.items() if lg.source_id]
        return [sealer.seal_watermark(embedding_pb2.ParityWatermark(
            source=s, source_id=sid, destination=self.host.index, destination_id=self.host.server_id,
            applied_upto=upto)) for s, sid, upto in marks]

    def unseal(self, sealed, worker: str = "") -> list[parity_pb2.ParityBatch]:
        """The batches of ``sealed`` (``RelayBatch`` or alike) whose seal checks, parsed; each other one is refused,
        counted and logged naming ``worker`` (who carried it)."""
        sealer = self.host.sealer
        batches = []
        refused: dict[str, list[int]] = {}  # why -> the destinations of the batches refused for it
        cap = self.host.config.max_relay_batches
        if len(sealed) > cap:  # dropped unread: checking each seal costs time (an owner sends them again)
            beyond = [r.destination for r in list(sealed)[cap:]]
            refused[f"beyond the {cap} batches one request may carry (--max-relay-batches); dropped unread"] = beyond
            self.counters.add("relay_batches_unchecked", len(beyond))
            sealed = list(sealed)[:cap]
        mac_s = parse_s = 0.0
        for r in sealed:
            b = parity_pb2.ParityBatch()
            why = ""
            data = r.batch
            t0 = time.thread_time()
            if sealer is None:
                why = "this server holds no server key yet"
            elif not sealer.batch_ok(data, r.mac):
                why = "its seal does not check (changed, made up, or not from a server)"
            else:
                t1 = time.thread_time()
                mac_s += t1 - t0
                try:
                    b.ParseFromString(data)
                except Exception:  # noqa: BLE001 - a sealed batch that does not parse is refused, never applied
                    why = "it does not parse"
                parse_s += time.thread_time() - t1
            if why:
                refused.setdefault(why, []).append(r.destination)
                continue
            batches.append(b)
        self.counters.add("part_verify_cpu_s", mac_s)
        self.counters.add("part_parse_cpu_s", parse_s)
        for why, destinations in refused.items():  # one line per message and reason, not one per batch
            self.counters.add("refused_relayed_batches", len(destinations))
            if len(destinations) == 1:
                log.warning("a parity batch for server %d relayed by %s was refused: %s", destinations[0],
                            worker or "an unnamed caller", why)
            else:
                log.warning("%d parity batches (for servers %s) relayed by %s were refused: %s", len(destinations),
                            ", ".join(map(str, sorted(set(destinations))[:8])), worker or "an unnamed caller", why)
        return batches

    def on_relay(self, relay, worker: str = "") -> list[embedding_pb2.ParityWatermark]:
        """Batches a worker relayed (sealed); returns the sealed watermarks of their sources."""
        seen = self.receive(self.unseal(relay, worker), strict=False)
        t0 = time.thread_time()
        try:
            return self.watermarks(seen)
        finally:
            self.counters.add("part_watermarks_cpu_s", time.thread_time() - t0)

    def apply(self, request: parity_pb2.ParityBatches, sections: list | None = None) -> parity_pb2.ParityAck:
        """The owner's direct call (its caller proved it is a server: ``check_peer``): its batches (or only its
        confirmation) in one message; sealed ones (``sealed``) must carry their owner's seal.  ``sections``: the
        batches' bulk fields when the message came as a frame (``batch_frames``)."""
        self.host.require_index()
        batches = list(request.batches)
        if sections is not None:
            if request.sealed:
                raise errors.InvalidRequest("a parity frame carries no sealed batches")
            sections = list(sections)
        if len(request.sealed):
            unsealed = self.unseal(request.sealed, f"the caller of ApplyParity (source {request.source})")
            if len(unsealed) != len(request.sealed):
                raise errors.PermissionDenied(f"{len(request.sealed) - len(unsealed)} of {len(request.sealed)} "
                                              "parity batches do not carry their owner's seal; none applied")
            batches += unsealed
        for b in batches:
            if b.source != request.source or b.source_id != request.source_id:
                raise errors.InvalidRequest(f"a batch of source {b.source} ({b.source_id}) in a message of source "
                                            f"{request.source} ({request.source_id}); nothing applied")
        seen = self.receive(batches, strict=True, sections=sections)
        with self.lock:
            lg = seen.get(request.source) or self.logs.get(request.source)
            if lg is None or lg.source_id != request.source_id:
                return parity_pb2.ParityAck(applied_upto=0, destination_id=self.host.server_id)
            lg.confirm(request.confirmed_upto)
            return parity_pb2.ParityAck(applied_upto=lg.applied_upto, destination_id=self.host.server_id)

    # --- resolution of a failed source (the survivors' side) ---------------------------------------------
    def _new_log(self, source: int) -> SourceLog:
        return SourceLog(source, max_held_bytes=self.host.config.max_held_bytes)

    def check_resolver(self, source: int, caller: str) -> None:
        """Refuses (``FailedPrecondition``) a resolution of ``source`` by ``caller`` (a proven server, check_peer)
        unless ``caller`` is its replacement: the server the map names at ``source`` as ``PROMOTING`` (the
        coordinator records a promotion before it sends Promote), ``RECOVERING`` or ``ACTIVE``.  Any other holder
        means ``source`` did not fail to this caller: its chain is never closed."""
        host = self.host
        for attempt in range(2):
            m = host.cluster_map
            if m is None or not 0 <= source < m.num_servers:
                raise errors.InvalidRequest(f"source {source} is not an index of the cluster")
            holder = next((s for s in m.servers if s.index == source and s.state != cluster_pb2.FAILED), None)
            why = ""
            if holder is None:
                why = (f"the map (epoch {m.epoch}) names no server at index {source}: a replacement resolves an index "
                       "once the coordinator has recorded its promotion")
            elif holder.server_id != caller:
                what = "a live owner" if holder.state in LIVE_STATES else "its replacement, being promoted"
                why = (f"index {source} is held by {holder.server_id} (map epoch {m.epoch}; {what}), not by {caller}: "
                       "only its replacement resolves an index, after it failed")
            if not why:
                return
            if attempt == 0:
                host.refresh_map()  # this server's map may be older than the caller's
        self.counters.add("refused_resolutions", 1)
        log.warning("ResolveSource of source %d refused: %s", source, why)
        raise errors.FailedPrecondition(f"resolution of source {source} refused: {why}")

    def list_source(self, source: int, replacement_id: str = "") -> parity_pb2.ResolveSourceReply:
        """Closes the chain of ``source``'s failed incarnation (its later batches are refused, held-back ones
        dropped) and lists what this server applied of it: logged entries, confirmation, commits.  Idempotent:
        the same replacement asking again gets the same listing and nothing changes (the chain a replacement
        started since is never closed).  A chain whose incarnation the map names live is refused."""
        with self.lock:
            done = self.resolutions.get(source)
            if done is not None and done.replacement_id == replacement_id:
                self.counters.add("repeated_resolutions", 1)
                return done.listing
            lg = self.logs.get(source)
            if lg is None:
                lg = self.logs[source] = self._new_log(source)
            live = {s.server_id for s in live_servers(self.host.cluster_map).values()}
            if lg.source_id and lg.source_id in live:
                raise errors.FailedPrecondition(f"the chain of source {source} is of {lg.source_id}, which serves an "
                                                "index of the map: a live owner's chain is not resolved")
            lg.close_for_resolution()
            self.listings[source] = self.listings.get(source, 0) + 1  # rows read of it before are stale (adopt)
            reply = parity_pb2.ResolveSourceReply()
            lg.listing(reply)
            self.resolutions[source] = Resolution(replacement_id, lg.source_id, reply, frozenset(lg.entries))
        return reply

    def commit_resolution(self, source: int, undo_seqs, replacement_id: str) -> None:
        """Undoes ``undo_seqs`` of ``source``'s failed incarnation (newest first; only batches its listing to
        this replacement named), commits the rest, and forgets the incarnation.  Refused without that listing;
        a repeated commit changes nothing."""
        with self.lock:
            done = self.resolutions.get(source)
            if done is None or done.replacement_id != replacement_id:
                raise errors.FailedPrecondition(f"no listing of source {source} for {replacement_id}: a commit follows "
                                                "its replacement's listing")
            if done.committed:
                self.counters.add("repeated_resolutions", 1)
                return
            lg = self.logs.get(source)
            if lg is None or lg.source_id != done.failed_id or not lg.closed:
                raise errors.FailedPrecondition(f"the chain of source {source} changed since its listing; list again")
            undone = lg.resolve(set(undo_seqs) & done.listed)
            for e in undone:  # newest first
                for t in e.tables:
                    self.arenas[t.arena].undo(t.seqs, t.slots, t.positions, t.parity, t.deltas, t.old_versions)
                for d in reversed(e.dense):
                    self.host.dense(d.name).undo_delta(d.delta, d.seq, d.old_version)
            self.counters.add("undone_batches", len(undone))
            done.committed = True
            self.resolved_sources[source] = replacement_id

    # --- what a rebuild may read -------------------------------------------------------------------------
    def suspect_sources(self) -> set[int]:
        """Failed owners whose logged batches are not resolved yet (reads of affected rows must wait)."""
        m = self.host.cluster_map
        live = live_servers(m)
        failed = {i for i in range(m.num_servers) if i not in live}
        with self.lock:
            return {s for s, lg in self.logs.items() if lg.entries and s in failed}

    def unresolved_slots(self, arena: ParityArena, suspects: set[int]) -> np.ndarray:
        """Arena slots touched by unresolved batches of ``suspects``."""
        with self.lock:
            parts = [self.logs[s].affected_slots(arena.row_bytes) for s in suspects]
        parts = [p for p in parts if len(p)]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)

    def dense_unconfirmed(self, name: str) -> bool:
        """Whether a logged (applied, not confirmed) delta of dense tensor ``name`` is held here: its replica may
        still be undone, so a rebuild must not copy it yet."""
        with self.lock:
            return any(d.name == name for lg in self.logs.values() for e in lg.entries.values() for d in e.dense)

    def committed_of(self, source: int) -> dict[str, int]:
        """The committed push ids of ``source`` held here (per worker incarnation, the highest sequence)."""
        with self.lock:
            lg = self.logs.get(source)
            return dict(lg.committed) if lg is not None else {}

    def generation(self, source: int) -> int:
        """How many times ``source`` was listed for a resolution here: take it before reading rows of ``source``
        for a rebuild, hand it to :meth:`adopt_locked`."""
        with self.lock:
            return self.listings.get(source, 0)

    def logged_upto(self, source: int, source_id: str) -> int:
        """Every batch of incarnation ``source_id`` up to this sequence is in this server's log (or confirmed):
        a rebuilt parity may hold versions up to it, a resolution undoes them here if it must.  (Its owner sends a
        restarted chain every batch not confirmed everywhere: ``ParityOwner.on_map_change``.)"""
        with self.lock:
            return self.logged_upto_locked(source, source_id)

    def logged_upto_locked(self, source: int, source_id: str) -> int:
        lg = self.logs.get(source)
        return lg.logged_upto(source_id) if lg is not None else 0

    def commit_locked(self, source: int, push_ids) -> None:
        """Push ids of ``source`` that stand in a replica copied from another backup (with the lock held)."""
        lg = self.logs.get(source)
        if lg is None:
            lg = self.logs[source] = self._new_log(source)
        lg.commit(push_ids)

    def adopt_locked(self, source: int, source_id: str, bound: int, committed, generation: int) -> bool:
        """Before a parity or replica rebuilt from ``source``'s rows (incarnation ``source_id``, read after
        ``generation``) counts as built, with the lock held: keeps the owner's confirmed ``bound`` and committed
        push ids (worker, highest sequence) in its log, so that a resolution of ``source`` keeps the pushes
        embedded here and answers a replay of a confirmed one "already applied".  False -- nothing changes, the
        rows must be read again -- when ``source`` was listed for a resolution since (its rows may be of an
        incarnation resolved since) or its log here is of another incarnation still open."""
        if self.listings.get(source, 0) != generation:
            return False
        lg = self.logs.get(source)
        if lg is None:
            lg = self.logs[source] = self._new_log(source)
        return lg.adopt(source_id, bound, committed)

    def dense_unresolved(self, name: str) -> bool:
        suspects = self.suspect_sources()
        with self.lock:
            return any(d.name == name for s in suspects for e in self.logs[s].entries.values() for d in e.dense)

    def read_parity(self, table: str, stripes: np.ndarray, parity_index: np.ndarray):
        """Parity rows of ``stripes`` (this server must hold them): ``(payload, versions (n, k), ready)``."""
        layout = self.host.layout
        if len(stripes) != len(parity_index) or len(stripes) == 0:
            raise errors.InvalidRequest("stripes and parity_index must be non-empty and of equal length")
        arena, part = self.part(table)
        if (stripes.min() < 0 or stripes.max() >= layout.num_stripes(part.spec.num_rows)
                or parity_index.min() < 0 or parity_index.max() >= layout.m):
            raise errors.InvalidRequest(f"table {table!r}: stripe or parity index out of range")
        holders = layout.parity_servers(stripes)[np.arange(len(stripes)), parity_index]
        if (holders != self.host.index).any():
            raise errors.FailedPrecondition(f"server {self.host.index} does not hold those parity rows")
        slots = part.arena_slots(layout.parity_slot(stripes, parity_index))
        suspects = self.suspect_sources()
        payload, versions, ready = arena.read(slots)
        if suspects:
            ready &= ~np.isin(slots, self.unresolved_slots(arena, suspects))
        return payload, versions, ready
