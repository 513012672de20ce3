"""The receiving side of the parity path: a server applies other owners' batches to its parity rows
and dense replicas, and keeps them in a per-source log until the owner confirms them.

Batches arrive relayed by workers (inside pulls and pushes) or directly from their owner, in any order;
each source's batches form a chain (every batch names its predecessor) applied strictly in order, later
ones held back until their predecessor arrives, duplicates skipped.  A batch is validated whole before
anything of it changes.  For a failed owner the log answers resolution: close the chain and list what
is held, then undo the batches resolution drops (XOR cancels, versions go back) and forget the
incarnation.  While a failed owner's batches are unresolved, the rows they touched are not *ready* for a
rebuild to read.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from ecrec import errors, transport
from ecrec.cluster_map import live_servers
from ecrec.codec import Codec
from ecrec.shards import TableShard
from ecrec.strategies.base import StrategyHost
from ecrec.strategies.erasure.parity_store import ParityStore
from ecrec.strategies.erasure.source_log import DenseEntry, LogEntry, SourceLog, TableEntry
from ecrec.wire import embedding_pb2, parity_pb2

log = logging.getLogger("ecrec.strategies.erasure")


class ParityReceiver:
    """Parity stores and source logs of one server (see the module docstring)."""

    def __init__(self, host: StrategyHost, codec: Codec, counters):
        self.host = host
        self.codec = codec
        self.counters = counters
        self.stores: dict[str, ParityStore] = {}
        self.logs: dict[int, SourceLog] = {}
        self.lock = threading.Lock()  # guards the logs
        self.resolved_sources: dict[int, str] = {}  # failed index -> server id of the replacement that resolved it

    # --- stores --------------------------------------------------------------------------------------------
    def add_table(self, shard: TableShard, encode: bool) -> ParityStore:
        store = ParityStore(shard.spec, self.host.layout, self.host.index, self.codec)
        if encode:
            store.encode_initial()
        self.stores[shard.spec.name] = store
        return store

    def store(self, table: str) -> ParityStore:
        store = self.stores.get(table)
        if store is None:
            raise errors.NotFound(f"unknown table {table!r}")
        return store

    # --- applying ------------------------------------------------------------------------------------------
    def _parse(self, b: parity_pb2.ParityBatch):
        """Validates one batch before anything of it is applied; returns its tables and dense deltas."""
        layout = self.host.layout
        tables = []
        for t in b.tables:
            store = self.store(t.table)
            slots = transport.bytes_to_ids(t.parity_slots)
            positions = transport.bytes_to_ids(t.positions)
            pidx = transport.bytes_to_ids(t.parity_index)
            old_versions = transport.bytes_to_ids(t.old_versions)
            row_bytes = store.spec.row_bytes
            if (not (len(slots) == len(positions) == len(pidx) == len(old_versions))
                    or len(t.deltas) != len(slots) * row_bytes):
                raise errors.InvalidRequest(f"table {t.table!r}: inconsistent parity batch lengths")
            if len(slots) and (slots.min() < 0 or slots.max() >= len(store.built)
                               or positions.min() < 0 or positions.max() >= layout.k
                               or pidx.min() < 0 or pidx.max() >= layout.m):
                raise errors.InvalidRequest(f"table {t.table!r}: parity slot, position or index out of range")
            if len(slots) and (store.slot_to_stripe[slots] < 0).any():
                raise errors.FailedPrecondition(
                    f"server {self.host.index} holds no parity row at some slot of {t.table!r}")
            deltas = np.frombuffer(t.deltas, dtype=np.uint8).reshape(len(slots), row_bytes)
            tables.append((store, slots, positions, pidx, deltas, old_versions))
        dense = []
        for d in b.dense:
            shard = self.host.dense(d.name)
            if len(d.value) != shard.nbytes:
                raise errors.InvalidRequest(
                    f"dense tensor {d.name!r}: delta of {len(d.value)} bytes, expected {shard.nbytes}")
            dense.append((shard, np.frombuffer(d.value, dtype=np.uint8), d.old_version))
        return tables, dense

    def _apply_locked(self, lg: SourceLog, b: parity_pb2.ParityBatch, parsed) -> None:
        self.host.faults.hit("before_parity_apply")
        tables, dense = parsed
        entry = LogEntry(b.seq, (b.push_id.worker, b.push_id.sequence), tuple(b.destinations), tuple(b.destination_ids))
        for store, slots, positions, pidx, deltas, old_versions in tables:
            store.apply(b.seq, slots, positions, pidx, deltas)
            entry.tables.append(TableEntry(store.spec.name, slots, positions, pidx, deltas, old_versions))
        for shard, delta, old_version in dense:
            shard.apply_delta(delta, b.seq)
            entry.dense.append(DenseEntry(shard.spec.name, delta, old_version))
        lg.entries[b.seq] = entry
        lg.applied_upto = b.seq
        self.counters["batches_applied"] += 1

    def receive(self, batches: list[parity_pb2.ParityBatch], strict: bool) -> dict[int, SourceLog]:
        """Applies batches (any sources, any order): each source's chain strictly in the order its batches
        name, later ones held back until their predecessor arrives; duplicates are skipped.  A batch addressed
        to another incarnation of this server, or from a source incarnation already resolved, is refused:
        with ``strict`` (the owner's direct call) as an error, else (relayed) it is dropped and counted.
        Returns the logs of the sources seen (their watermarks answer the caller)."""
        self.host.require_index()
        seen: dict[int, SourceLog] = {}
        for b in batches:
            try:
                parsed = self._parse(b)
                with self.lock:
                    lg = self._chain_for(b)
                    seen[b.source] = lg
                    if b.seq <= lg.applied_upto:
                        self.counters["duplicate_batches"] += 1
                    elif b.prev_seq == lg.applied_upto:
                        self._apply_locked(lg, b, parsed)
                        while lg.applied_upto in lg.held:  # successors that arrived first
                            nxt, nxt_parsed = lg.held.pop(lg.applied_upto)
                            self._apply_locked(lg, nxt, nxt_parsed)
                    elif len(lg.held) < lg.max_held:
                        lg.held[b.prev_seq] = (b, parsed)
                        self.counters["held_back_batches"] += 1
                    else:
                        raise errors.ResourceExhausted(
                            f"server {self.host.index}: {len(lg.held)} batches of source {b.source} wait for batch "
                            f"{lg.applied_upto}'s successor; send the chain in order")
                    lg.confirm(b.confirmed_upto)
            except errors.EcrecError as exc:
                if strict:
                    raise
                self.counters["refused_relayed_batches"] += 1
                log.warning("relayed parity batch of source %d seq %d refused: %s", b.source, b.seq, exc)
        return seen

    def _chain_for(self, b: parity_pb2.ParityBatch) -> SourceLog:
        """The log of ``b``'s source, checked against ``b``'s incarnations (call with the lock held)."""
        if b.destination_id and b.destination_id != self.host.server_id:
            self.counters["stale_batches"] += 1
            raise errors.FailedPrecondition(
                f"batch addressed to incarnation {b.destination_id} of server {b.destination}; this is "
                f"{self.host.server_id}: the destination was replaced, refresh the map")
        lg = self.logs.get(b.source)
        if lg is None:
            lg = self.logs[b.source] = SourceLog(b.source)
        if b.source_id != lg.source_id:
            if b.source_id in lg.resolved_ids:
                raise errors.FailedPrecondition(
                    f"source {b.source} incarnation {b.source_id} was replaced and resolved; batch refused")
            if lg.entries and not lg.closed and lg.source_id:
                # resolution of the previous incarnation never reached this server: keep what it applied
                log.error("source %d changed incarnation (%s -> %s) with %d unresolved batches; keeping them",
                          b.source, lg.source_id, b.source_id, len(lg.entries))
                self.counters["unresolved_incarnation_switches"] += 1
                for e in lg.entries.values():
                    lg.committed.append(e.push_id)
            lg.restart(b.source_id)
        if lg.closed:
            raise errors.FailedPrecondition(f"source {b.source} incarnation {b.source_id} is being resolved; batch refused")
        return lg

    def watermarks(self, seen: dict[int, SourceLog]) -> list[embedding_pb2.ParityWatermark]:
        with self.lock:
            return [embedding_pb2.ParityWatermark(source=s, source_id=lg.source_id, destination=self.host.index,
                                                  destination_id=self.host.server_id, applied_upto=lg.applied_upto)
                    for s, lg in seen.items() if lg.source_id]

    def on_relay(self, relay) -> list[embedding_pb2.ParityWatermark]:
        """Batches a worker relayed (serialized); returns the watermarks of their sources."""
        batches = []
        for r in relay:
            b = parity_pb2.ParityBatch()
            try:
                b.ParseFromString(r.batch)
            except Exception:  # noqa: BLE001 - a malformed relay is dropped and counted, never applied
                self.counters["refused_relayed_batches"] += 1
                log.warning("a relayed parity batch could not be parsed; dropped")
                continue
            batches.append(b)
        return self.watermarks(self.receive(batches, strict=False))

    def apply(self, request: parity_pb2.ParityBatches) -> parity_pb2.ParityAck:
        """The owner's direct call: its batches (or only its confirmation) in one message."""
        self.host.require_index()
        seen = self.receive(list(request.batches), strict=True)
        with self.lock:
            lg = seen.get(request.source) or self.logs.get(request.source)
            if lg is None or lg.source_id != request.source_id:
                return parity_pb2.ParityAck(applied_upto=0, destination_id=self.host.server_id)
            lg.confirm(request.confirmed_upto)
            return parity_pb2.ParityAck(applied_upto=lg.applied_upto, destination_id=self.host.server_id)

    # --- resolution of a failed source (the survivors' side) ---------------------------------------------
    def list_source(self, source: int) -> parity_pb2.ResolveSourceReply:
        """Closes the chain of ``source``'s current incarnation (its later batches are refused, held-back ones
        dropped) and lists what this server applied of it: logged entries, confirmation, recent commits."""
        reply = parity_pb2.ResolveSourceReply()
        with self.lock:
            lg = self.logs.get(source)
            if lg is None:
                lg = self.logs[source] = SourceLog(source)
            lg.closed = True
            lg.held.clear()
            for seq, e in lg.entries.items():
                reply.logged.add(seq=seq, push_id=embedding_pb2.PushId(worker=e.push_id[0], sequence=e.push_id[1]),
                                 destinations=list(e.destinations), destination_ids=list(e.destination_ids))
            reply.confirmed_upto = lg.confirmed_upto
            for w, s in lg.committed:
                reply.committed.add(worker=w, sequence=s)
        return reply

    def commit_resolution(self, source: int, undo_seqs, replacement_id: str) -> None:
        """Undoes ``undo_seqs`` of ``source`` (newest first), commits the rest, and forgets the incarnation."""
        with self.lock:
            lg = self.logs.get(source)
            if lg is None:
                return
            undo = set(undo_seqs)
            undone = 0
            for seq in sorted(undo, reverse=True):
                e = lg.entries.get(seq)
                if e is None:
                    continue
                undone += 1
                for t in e.tables:
                    self.stores[t.table].undo(seq, t.slots, t.positions, t.pidx, t.deltas, t.old_versions)
                for d in e.dense:
                    self.host.dense(d.name).undo_delta(d.delta, seq, d.old_version)
            self.counters["undone_batches"] += undone
            for seq, e in lg.entries.items():
                if seq not in undo:
                    lg.committed.append(e.push_id)
            if lg.source_id:
                lg.resolved_ids.append(lg.source_id)
            lg.source_id = ""
            lg.entries.clear()
            lg.held.clear()
            lg.applied_upto = lg.confirmed_upto = 0
            lg.closed = False
            self.resolved_sources[source] = replacement_id

    # --- what a rebuild may read -------------------------------------------------------------------------
    def suspect_sources(self) -> set[int]:
        """Failed owners whose logged batches are not resolved yet (reads of affected rows must wait)."""
        m = self.host.cluster_map
        live = live_servers(m)
        failed = {i for i in range(m.num_servers) if i not in live}
        with self.lock:
            return {s for s, lg in self.logs.items() if lg.entries and s in failed}

    def unresolved_slots(self, table: str, suspects: set[int]) -> np.ndarray:
        """Parity slots of ``table`` touched by unresolved batches of ``suspects``."""
        with self.lock:
            parts = [self.logs[s].affected_slots(table) for s in suspects]
        parts = [p for p in parts if len(p)]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)

    def dense_unresolved(self, name: str) -> bool:
        suspects = self.suspect_sources()
        with self.lock:
            return any(d.name == name for s in suspects for e in self.logs[s].entries.values() for d in e.dense)

    def read_parity(self, table: str, stripes: np.ndarray, parity_index: np.ndarray):
        """Parity rows of ``stripes`` (this server must hold them): ``(payload, versions (n, k), ready)``."""
        layout = self.host.layout
        if len(stripes) != len(parity_index) or len(stripes) == 0:
            raise errors.InvalidRequest("stripes and parity_index must be non-empty and of equal length")
        store = self.store(table)
        holders = layout.parity_servers(stripes)[np.arange(len(stripes)), parity_index]
        if (holders != self.host.index).any():
            raise errors.FailedPrecondition(f"server {self.host.index} does not hold those parity rows")
        slots = layout.parity_slot(stripes, parity_index)
        suspects = self.suspect_sources()
        with store.lock:
            payload = store.rows(slots)
            versions = store.versions[slots]
            ready = store.built[slots].copy()
        if suspects:
            ready &= ~np.isin(slots, self.unresolved_slots(table, suspects))
        return payload, versions, ready
