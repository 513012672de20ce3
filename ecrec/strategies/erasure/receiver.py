"""The receiving side of the parity path: a server applies other owners' batches to its parity rows
and dense replicas, and keeps them in a per-source log until the owner confirms them.

A batch is validated whole before anything changes; applying is idempotent (per-row versions), so a
re-sent batch changes nothing.  For a failed owner the log answers resolution: list what is held,
then undo the batches resolution drops (XOR cancels) and forget the source.  While a failed owner's
batches are unresolved, the rows they touched are not *ready* for a rebuild to read.
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

    def source_log(self, source: int) -> SourceLog:
        with self.lock:
            lg = self.logs.get(source)
            if lg is None:
                lg = self.logs[source] = SourceLog(source)
            return lg

    # --- applying ------------------------------------------------------------------------------------------
    def _parse(self, batches) -> list:
        """Validates every batch of a message before anything is applied."""
        layout = self.host.layout
        parsed = []
        for b in batches:
            tables = []
            for t in b.tables:
                store = self.store(t.table)
                slots = transport.bytes_to_ids(t.parity_slots)
                positions = transport.bytes_to_ids(t.positions)
                pidx = transport.bytes_to_ids(t.parity_index)
                row_bytes = store.spec.row_bytes
                if not (len(slots) == len(positions) == len(pidx)) or len(t.deltas) != len(slots) * row_bytes:
                    raise errors.InvalidRequest(f"table {t.table!r}: inconsistent parity batch lengths")
                if len(slots) and (slots.min() < 0 or slots.max() >= len(store.built)
                                   or positions.min() < 0 or positions.max() >= layout.k
                                   or pidx.min() < 0 or pidx.max() >= layout.m):
                    raise errors.InvalidRequest(f"table {t.table!r}: parity slot, position or index out of range")
                if len(slots) and (store.slot_to_stripe[slots] < 0).any():
                    raise errors.FailedPrecondition(
                        f"server {self.host.index} holds no parity row at some slot of {t.table!r}")
                deltas = np.frombuffer(t.deltas, dtype=np.uint8).reshape(len(slots), row_bytes)
                tables.append((store, slots, positions, pidx, deltas))
            dense = []
            for d in b.dense:
                shard = self.host.dense(d.name)
                if len(d.value) != shard.nbytes:
                    raise errors.InvalidRequest(
                        f"dense tensor {d.name!r}: delta of {len(d.value)} bytes, expected {shard.nbytes}")
                dense.append((shard, np.frombuffer(d.value, dtype=np.uint8)))
            parsed.append((b, tables, dense))
        return parsed

    def apply(self, request: parity_pb2.ParityBatches) -> parity_pb2.ParityAck:
        """Applies one owner's batches in order, logs them, and trims the log to its confirmation."""
        self.host.require_index()
        lg = self.source_log(request.source)
        parsed = self._parse(request.batches)
        with self.lock:
            if lg.source_id != request.source_id:
                if lg.entries and lg.source_id:
                    log.warning("source %d changed incarnation (%s -> %s) with %d unresolved entries",
                                request.source, lg.source_id, request.source_id, len(lg.entries))
                lg.source_id = request.source_id
            for b, tables, dense in parsed:
                self.host.faults.hit("before_parity_apply")
                if b.seq in lg.entries or b.seq <= lg.confirmed_upto:
                    continue  # a re-sent batch: already applied
                entry = LogEntry(b.seq, (b.push_id.worker, b.push_id.sequence), tuple(b.destinations),
                                 tuple(b.destination_ids))
                for store, slots, positions, pidx, deltas in tables:
                    fresh, prev, pended = store.apply(b.seq, slots, positions, pidx, deltas)
                    entry.tables.append(TableEntry(store.spec.name, slots, positions, pidx, deltas, fresh, prev, pended))
                for shard, delta in dense:
                    applied, prev_version = shard.apply_delta(delta, b.seq)
                    entry.dense.append(DenseEntry(shard.spec.name, delta, applied, prev_version))
                lg.entries[b.seq] = entry
                lg.applied_upto = max(lg.applied_upto, b.seq)
            lg.confirm(request.confirmed_upto)
            self.counters["batches_applied"] += len(parsed)
        return parity_pb2.ParityAck(applied_upto=lg.applied_upto)

    # --- resolution of a failed source (the survivors' side) ---------------------------------------------
    def list_source(self, source: int) -> parity_pb2.ResolveSourceReply:
        """What this server holds of ``source``'s batches: logged entries, confirmation, recent commits."""
        lg = self.source_log(source)
        reply = parity_pb2.ResolveSourceReply()
        with self.lock:
            for seq, e in lg.entries.items():
                reply.logged.add(seq=seq, push_id=embedding_pb2.PushId(worker=e.push_id[0], sequence=e.push_id[1]),
                                 destinations=list(e.destinations), destination_ids=list(e.destination_ids))
            reply.confirmed_upto = lg.confirmed_upto
            for w, s in lg.committed:
                reply.committed.add(worker=w, sequence=s)
        return reply

    def commit_resolution(self, source: int, undo_seqs, replacement_id: str) -> None:
        """Undoes ``undo_seqs`` of ``source`` (newest first), commits the rest, and forgets the source."""
        lg = self.source_log(source)
        with self.lock:
            undo = set(undo_seqs)
            for seq in sorted(undo, reverse=True):
                e = lg.entries.get(seq)
                if e is None:
                    continue
                for t in e.tables:
                    self.stores[t.table].undo(seq, t.slots, t.positions, t.pidx, t.deltas, t.fresh, t.prev, t.pended)
                for d in e.dense:
                    self.host.dense(d.name).undo_delta(d.delta, seq, d.applied, d.prev_version)
            self.counters["undone_batches"] += len(undo & set(lg.entries))
            for seq, e in lg.entries.items():
                if seq not in undo:
                    lg.committed.append(e.push_id)
            lg.entries.clear()
            lg.source_id = ""
            lg.confirmed_upto = 0
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
