"""Strategy ``ecrec``: erasure-coded embedding rows, replicated dense tensors, recovery without pause.

Owner side (every push, under the server's apply lock):
  each updated row's ``delta = old payload XOR new payload`` goes, with the row's stripe
  position, to the ``m`` parity servers of its stripe; a dense tensor's delta goes to its
  ``m`` backups.  All deltas of one push for one destination form one ``ParityBatch`` tagged
  ``(source, seq, push id, destinations)``; a per-destination sender delivers batches in
  sequence order (coalescing queued ones into one RPC) and the push is acknowledged once every
  live destination has applied its batch.  ``confirmed_upto`` (every push up to it is
  acknowledged everywhere) rides on later batches, or on a heartbeat, so receivers can trim
  their logs.  Data rows carry the ``seq`` of their last update as a version.

Receiver side: ``ApplyParity`` applies each batch through :class:`ecrec.parity.ParityStore`
(version-checked, so idempotent) and logs it in the source's :class:`ecrec.parity.SourceLog`.

Recovery (this server promoted to a failed index ``f``):
  1. resolution: every live server lists ``f``'s logged batches; a push whose batch is held
     by every surviving destination (or that is confirmed) is kept -- ``f`` may have
     acknowledged it, so its id joins the replacement's applied pushes -- and any other is
     undone where it was applied (XOR cancels);
  2. the replacement serves at once; a request touching a row not yet rebuilt rebuilds it
     first (``ensure_rows``), and a background thread rebuilds the rest in batches:
     data rows by ``Codec.reconstruct`` from ``k`` ready members of each stripe whose
     versions agree, parity rows by re-encoding the ``k`` data rows (newer deltas applied
     after, older ones skipped), dense tensors by copying a replica;
  3. when everything is rebuilt it reports full redundancy to the coordinator.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import numpy as np

from ecrec import transport
from ecrec.cluster_map import live_address, live_servers
from ecrec.codec import Codec
from ecrec.parity import DenseEntry, LogEntry, ParityStore, SourceLog, TableEntry
from ecrec.strategies.base import FaultToleranceStrategy
from ecrec.transport import RequestError, invalid
from ecrec.wire import coordinator_pb2, embedding_pb2

log = logging.getLogger("ecrec.strategies.ecrec")

OPTIONS = {
    "backend": "isa_l_rs_vand",
    "rebuild_batch_rows": "4096",
    "rebuild_pause_s": "0.002",
    "rebuild_duty": "1.0",  # share of wall time the background rebuild may work (< 1 throttles it; on-demand
    # rebuilds of the rows training touches then last longer, which cost more here than they save)
    "heartbeat_s": "0.2",
}
MAX_COALESCE = 64


class PushCompletion:
    """Waits for the batches of one push at every destination."""

    def __init__(self, futures: list[Future], on_done):
        self._futures = futures
        self._on_done = on_done
        self._done = False
        self._lock = threading.Lock()

    def result(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in self._futures:
            f.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            if not self._done:
                self._done = True
                self._on_done()
        return None


class DestinationSender:
    """Delivers one owner's batches to one destination index, in sequence order."""

    def __init__(self, strategy: "ErasureCoding", destination: int):
        self.strategy = strategy
        self.destination = destination
        self.queue: queue.Queue = queue.Queue()
        self.sent_confirm = 0
        self.thread = threading.Thread(target=self._run, name=f"ecrec-parity-sender-{destination}", daemon=True)
        self.thread.start()

    def submit(self, batch: embedding_pb2.ParityBatch) -> Future:
        fut: Future = Future()
        self.queue.put((batch, fut))
        return fut

    def _run(self) -> None:
        st = self.strategy
        while not st.closed.is_set():
            try:
                first = self.queue.get(timeout=st.heartbeat_s)
            except queue.Empty:
                confirm = st.confirmed_upto()
                if confirm > self.sent_confirm:
                    self._deliver([], confirm)
                continue
            items = [first]
            while len(items) < MAX_COALESCE:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._deliver(items, st.confirmed_upto())

    def _deliver(self, items: list, confirm: int) -> None:
        st = self.strategy
        message = embedding_pb2.ParityBatches(batches=[b for b, _ in items], source=st.server.index,
                                              source_id=st.server.server_id, confirmed_upto=confirm)
        while not st.closed.is_set():
            address = st.live_address(self.destination)
            if address is None:  # destination failed, not yet replaced: its replacement re-encodes
                break
            try:
                st.server.peer_by_address(address).ApplyParity(message, timeout=st.server.config.rpc_timeout_s)
                st.counters["parity_bytes_sent"] += message.ByteSize()
                self.sent_confirm = max(self.sent_confirm, confirm)
                break
            except grpc.RpcError as exc:
                if not transport.is_unavailable(exc):
                    err = RuntimeError(f"parity server {self.destination} ({address}) refused a batch: "
                                       f"{exc.code().name}: {exc.details()}")
                    log.error("%s", err)
                    for _, fut in items:
                        fut.set_exception(err)
                    return
                st.report_unreachable(address, f"ApplyParity: {exc.code().name}")
                if st.live_address(self.destination) in (None, address):
                    time.sleep(0.05)  # not replaced yet (else retry at the replacement at once)
        for _, fut in items:
            if not fut.done():
                fut.set_result(None)


class ErasureCoding(FaultToleranceStrategy):
    name = "ecrec"
    needs_old_payload = True
    rebuilds_rows = True

    @classmethod
    def layout_params(cls, num_servers: int, k: int, m: int, options: dict) -> tuple[int, int, dict]:
        if k < 1 or m < 1:
            raise ValueError(f"strategy 'ecrec' needs --k >= 1 and --m >= 1 (got k={k}, m={m})")
        if k + m > num_servers:
            raise ValueError(f"strategy 'ecrec': k + m = {k + m} exceeds the {num_servers} servers")
        unknown = set(options) - set(OPTIONS)
        if unknown:
            raise ValueError(f"strategy 'ecrec': unknown option(s) {sorted(unknown)}; known: {sorted(OPTIONS)}")
        merged = {**OPTIONS, **options}
        Codec(k, m, backend=merged["backend"])  # validates the backend
        for key in ("rebuild_batch_rows",):
            if int(merged[key]) < 1:
                raise ValueError(f"strategy 'ecrec': {key} must be >= 1")
        for key in ("rebuild_pause_s", "heartbeat_s"):
            if float(merged[key]) < 0:
                raise ValueError(f"strategy 'ecrec': {key} must be >= 0")
        if not 0 < float(merged["rebuild_duty"]) <= 1:
            raise ValueError("strategy 'ecrec': rebuild_duty must be in (0, 1]")
        return k, m, merged

    def __init__(self, server, options: dict):
        super().__init__(server, options)
        opts = {**OPTIONS, **options}
        self.heartbeat_s = float(opts["heartbeat_s"])
        self.rebuild_batch_rows = int(opts["rebuild_batch_rows"])
        self.rebuild_pause_s = float(opts["rebuild_pause_s"])
        self.rebuild_duty = float(opts["rebuild_duty"])
        m = server.map
        kernel = "gpu" if server.config.device == "cuda" else "auto"
        self.codec = Codec(m.k, m.m, backend=opts["backend"], kernel=kernel)
        self.closed = threading.Event()
        self.parity: dict[str, ParityStore] = {}
        self.data_built: dict[str, np.ndarray] = {}
        self.dense_built: dict[str, bool] = {}
        self._pending_dense: dict[str, list] = {}  # dense deltas that arrived while the replica was rebuilt
        self.logs: dict[int, SourceLog] = {}
        self.log_lock = threading.Lock()
        self.senders: dict[int, DestinationSender] = {}
        self.seq_base = 0
        self.counter = 0
        self.inflight: set[int] = set()
        self.last_seq = 0
        self.seq_lock = threading.Lock()
        self._current: dict | None = None
        self.recovering = threading.Event()
        self._foreground_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ecrec-on-demand")
        self.rebuild_lock = threading.Lock()
        self.foreground = 0
        self.resolved_sources: dict[int, str] = {}  # failed index -> server id of the failed incarnation
        self.counters = defaultdict(float)

    # --- helpers ---------------------------------------------------------------------------------
    @property
    def layout(self):
        return self.server.layout

    def live_address(self, index: int) -> str | None:
        return live_address(self.server.map, index)

    def failed_indices(self) -> set[int]:
        live = live_servers(self.server.map)
        return {i for i in range(self.layout.num_servers) if i not in live}

    def report_unreachable(self, address: str, detail: str) -> None:
        stub = self.server.coordinator
        try:
            m = stub.ReportFailure(coordinator_pb2.ReportFailureRequest(address=address, detail=detail), timeout=5)
            self.server.adopt_map(m)
        except grpc.RpcError:
            try:
                self.server.adopt_map(stub.GetClusterMap(coordinator_pb2.GetClusterMapRequest(), timeout=5))
            except grpc.RpcError as exc:
                log.warning("coordinator unreachable: %s", exc.code().name)

    def sender(self, destination: int) -> DestinationSender:
        s = self.senders.get(destination)
        if s is None:
            s = self.senders[destination] = DestinationSender(self, destination)
        return s

    def confirmed_upto(self) -> int:
        with self.seq_lock:
            return (min(self.inflight) - 1) if self.inflight else self.last_seq

    def source_log(self, source: int) -> SourceLog:
        with self.log_lock:
            lg = self.logs.get(source)
            if lg is None:
                lg = self.logs[source] = SourceLog(source)
            return lg

    # --- creation ----------------------------------------------------------------------------------
    def on_table_created(self, shard) -> None:
        store = ParityStore(shard.spec, self.layout, self.server.index, self.codec)
        if not self.server.promoting:
            t0 = time.perf_counter()
            store.encode_initial()
            self.counters["initial_encode_s"] += time.perf_counter() - t0
        self.parity[shard.spec.name] = store
        self.data_built[shard.spec.name] = np.ones(len(shard.payload), dtype=bool)

    def on_dense_created(self, dense) -> None:
        self.dense_built[dense.spec.name] = True

    # --- owner side --------------------------------------------------------------------------------
    def begin_push(self, push_id) -> None:
        with self.seq_lock:
            if self.seq_base == 0:
                self.seq_base = max(1, self.server.epoch) << 32
            self.counter += 1
            seq = self.seq_base | self.counter
            self.inflight.add(seq)
            self.last_seq = seq
        self._current = {"seq": seq, "push_id": push_id, "batches": {}}

    def _batch(self, destination: int) -> embedding_pb2.ParityBatch:
        cur = self._current
        b = cur["batches"].get(destination)
        if b is None:
            b = cur["batches"][destination] = embedding_pb2.ParityBatch(
                source=self.server.index, source_id=self.server.server_id, seq=cur["seq"],
                push_id=embedding_pb2.PushId(worker=cur["push_id"][0], sequence=cur["push_id"][1]))
        return b

    def on_update(self, shard, ids, slots, old, new):
        seq = self._current["seq"]
        shard.versions[slots] = seq
        delta = np.bitwise_xor(old, new)
        layout = self.layout
        stripes, positions = layout.stripe_of(ids)
        name = shard.spec.name
        for j in range(layout.m):  # parity j of each row's stripe; a row's parities are on distinct servers
            dest = (stripes + (layout.k + j)) % layout.num_servers
            for d in np.unique(dest).tolist():
                rows = np.flatnonzero(dest == d)
                pslots = layout.parity_slot(stripes[rows], j)
                self._batch(d).tables.add(
                    table=name, parity_slots=pslots.tobytes(), positions=positions[rows].tobytes(),
                    parity_index=np.full(len(rows), j, dtype=np.int64).tobytes(), deltas=delta[rows].tobytes())
        return None

    def on_dense_update(self, dense, old, new):
        dense.version = self._current["seq"]
        delta = np.bitwise_xor(old, new).reshape(-1)
        for d in self.layout.dense_servers(dense.spec.name)[1:]:
            self._batch(d).dense.add(name=dense.spec.name, value=delta.tobytes())
        return None

    def end_push(self):
        cur, self._current = self._current, None
        seq = cur["seq"]
        batches = cur["batches"]
        if not batches:
            with self.seq_lock:
                self.inflight.discard(seq)
            return None
        destinations = sorted(batches)
        live = live_servers(self.server.map)
        destination_ids = [live[d].server_id if d in live else "" for d in destinations]
        for b in batches.values():
            b.destinations.extend(destinations)
            b.destination_ids.extend(destination_ids)
        faults = self.server.faults
        if faults.armed("after_partial_parity") and len(destinations) >= 2:
            first = destinations[0]
            self.sender(first).submit(batches[first]).result(timeout=30)
            faults.hit("after_partial_parity")
        futures = [self.sender(d).submit(batches[d]) for d in destinations]

        def done():
            with self.seq_lock:
                self.inflight.discard(seq)

        return PushCompletion(futures, done)

    # --- receiver side -----------------------------------------------------------------------------
    def handle_rpc(self, method: str, request, context):
        if method == "ApplyParity":
            return self._apply_parity(request)
        if method == "ResolveSource":
            return self._resolve_source(request)
        if method == "ReadRows":
            return self._read_rows(request)
        raise NotImplementedError(f"strategy 'ecrec' does not serve {method}")

    def _apply_parity(self, request: embedding_pb2.ParityBatches) -> embedding_pb2.ParityAck:
        self.server.require_index()
        lg = self.source_log(request.source)
        # validate before applying anything
        parsed = []
        for b in request.batches:
            tables = []
            for t in b.tables:
                store = self.parity.get(t.table)
                if store is None:
                    raise RequestError(grpc.StatusCode.NOT_FOUND, f"unknown table {t.table!r}")
                slots = transport.bytes_to_ids(t.parity_slots)
                positions = transport.bytes_to_ids(t.positions)
                pidx = transport.bytes_to_ids(t.parity_index)
                row_bytes = store.spec.row_bytes
                if not (len(slots) == len(positions) == len(pidx)) or len(t.deltas) != len(slots) * row_bytes:
                    raise invalid(f"table {t.table!r}: inconsistent parity batch lengths")
                if len(slots) and (slots.min() < 0 or slots.max() >= len(store.built)
                                   or positions.min() < 0 or positions.max() >= self.layout.k
                                   or pidx.min() < 0 or pidx.max() >= self.layout.m):
                    raise invalid(f"table {t.table!r}: parity slot, position or index out of range")
                if len(slots) and (store.slot_to_stripe[slots] < 0).any():
                    raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                       f"server {self.server.index} holds no parity row at some slot of {t.table!r}")
                deltas = np.frombuffer(t.deltas, dtype=np.uint8).reshape(len(slots), row_bytes)
                tables.append((store, slots, positions, pidx, deltas))
            dense = []
            for d in b.dense:
                shard = self.server.dense_tensor(d.name)
                if len(d.value) != shard.floats.nbytes:
                    raise invalid(f"dense tensor {d.name!r}: delta of {len(d.value)} bytes, expected {shard.floats.nbytes}")
                dense.append((shard, np.frombuffer(d.value, dtype=np.uint8)))
            parsed.append((b, tables, dense))
        with self.log_lock:
            if lg.source_id != request.source_id:
                if lg.entries and lg.source_id:
                    log.warning("source %d changed incarnation (%s -> %s) with %d unresolved entries",
                                request.source, lg.source_id, request.source_id, len(lg.entries))
                lg.source_id = request.source_id
            for b, tables, dense in parsed:
                self.server.faults.hit("before_parity_apply")
                if b.seq in lg.entries or b.seq <= lg.confirmed_upto:
                    continue  # a re-sent batch: already applied
                entry = LogEntry(b.seq, (b.push_id.worker, b.push_id.sequence), tuple(b.destinations),
                                 tuple(b.destination_ids))
                for store, slots, positions, pidx, deltas in tables:
                    fresh, prev, pended = store.apply(b.seq, slots, positions, pidx, deltas)
                    entry.tables.append(TableEntry(store.spec.name, slots, positions, pidx, deltas, fresh, prev, pended))
                for shard, delta in dense:
                    with shard.lock:
                        applied = self.dense_built.get(shard.spec.name, True) and b.seq > shard.version
                        prev_version = shard.version
                        if applied:
                            np.bitwise_xor(shard.floats.view(np.uint8).reshape(-1), delta,
                                           out=shard.floats.view(np.uint8).reshape(-1))
                            shard.version = b.seq
                        else:
                            self._pending_dense.setdefault(shard.spec.name, []).append((b.seq, delta.copy()))
                    entry.dense.append(DenseEntry(shard.spec.name, delta, applied, prev_version))
                lg.entries[b.seq] = entry
                lg.applied_upto = max(lg.applied_upto, b.seq)
            lg.confirm(request.confirmed_upto)
            self.counters["batches_applied"] += len(parsed)
        return embedding_pb2.ParityAck(applied_upto=lg.applied_upto)

    def _resolve_source(self, request: embedding_pb2.ResolveSourceRequest) -> embedding_pb2.ResolveSourceReply:
        lg = self.source_log(request.source)
        reply = embedding_pb2.ResolveSourceReply()
        with self.log_lock:
            if not request.commit:
                for seq, e in lg.entries.items():
                    reply.logged.add(seq=seq, push_id=embedding_pb2.PushId(worker=e.push_id[0], sequence=e.push_id[1]),
                                     destinations=list(e.destinations), destination_ids=list(e.destination_ids))
                reply.confirmed_upto = lg.confirmed_upto
                for w, s in lg.committed:
                    reply.committed.add(worker=w, sequence=s)
                return reply
            undo = set(request.undo_seqs)
            for seq in sorted(undo, reverse=True):
                e = lg.entries.get(seq)
                if e is None:
                    continue
                for t in e.tables:
                    self.parity[t.table].undo(seq, t.slots, t.positions, t.pidx, t.deltas, t.fresh, t.prev, t.pended)
                for d in e.dense:
                    shard = self.server.dense[d.name]
                    with shard.lock:
                        if d.applied:
                            np.bitwise_xor(shard.floats.view(np.uint8).reshape(-1), d.delta,
                                           out=shard.floats.view(np.uint8).reshape(-1))
                            shard.version = d.prev_version
                        else:
                            waiting = self._pending_dense.get(d.name, [])
                            waiting[:] = [p for p in waiting if p[0] != seq]
            self.counters["undone_batches"] += len(undo & set(lg.entries))
            for seq, e in lg.entries.items():
                if seq not in undo:
                    lg.committed.append(e.push_id)
            lg.entries.clear()
            lg.source_id = ""
            lg.confirmed_upto = 0
            self.resolved_sources[request.source] = request.replacement_id
        return reply

    def _suspect_sources(self) -> set[int]:
        """Failed owners whose logged batches are not resolved yet (reads of affected rows must wait)."""
        with self.log_lock:
            return self._suspect_sources_locked()

    def _read_rows(self, request: embedding_pb2.ReadRowsRequest) -> embedding_pb2.ReadRowsReply:
        st = self.server
        st.require_index()
        if request.dense:
            shard = st.dense_tensor(request.dense)
            with shard.lock:
                ready = self.dense_built.get(request.dense, True) and not (self._suspect_sources() and
                                                                           self._dense_affected(request.dense))
                return embedding_pb2.ReadRowsReply(payload=shard.floats.tobytes(),
                                                   versions=transport.ids_to_bytes(np.array([shard.version])),
                                                   ready=bytes([1 if ready else 0]))
        shard = st.table(request.table)
        if request.ids:
            ids = transport.bytes_to_ids(request.ids)
            slots = shard.slots_for(ids)
            built = self.data_built[request.table]
            with shard.lock:
                payload = shard.payload[slots]
                versions = shard.versions[slots]
                ready = built[slots]
            return embedding_pb2.ReadRowsReply(payload=payload.tobytes(), versions=transport.ids_to_bytes(versions),
                                               ready=ready.astype(np.uint8).tobytes())
        stripes = transport.bytes_to_ids(request.stripes)
        pidx = transport.bytes_to_ids(request.parity_index)
        if len(stripes) != len(pidx) or len(stripes) == 0:
            raise invalid("stripes and parity_index must be non-empty and of equal length")
        store = self.parity[request.table]
        holders = self.layout.parity_servers(stripes)[np.arange(len(stripes)), pidx]
        if (holders != st.index).any():
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"server {st.index} does not hold those parity rows")
        slots = self.layout.parity_slot(stripes, pidx)
        suspects = self._suspect_sources()
        with store.lock:
            payload = store.rows(slots)
            versions = store.versions[slots]
            ready = store.built[slots].copy()
        if suspects:
            with self.log_lock:
                for s in suspects:
                    ready &= ~np.isin(slots, self.logs[s].affected_slots(request.table))
        return embedding_pb2.ReadRowsReply(payload=payload.tobytes(), versions=transport.ids_to_bytes(versions.reshape(-1)),
                                           ready=ready.astype(np.uint8).tobytes())

    def _dense_affected(self, name: str) -> bool:
        with self.log_lock:
            return any(d.name == name for s in self._suspect_sources_locked() for e in self.logs[s].entries.values()
                       for d in e.dense)

    def _suspect_sources_locked(self) -> set[int]:
        failed = self.failed_indices()
        return {s for s, lg in self.logs.items() if lg.entries and s in failed}

    # --- recovery ----------------------------------------------------------------------------------
    def on_recovery(self, failed_index: int) -> bool:
        t0 = time.perf_counter()
        self.recovery_started = time.time()
        for name, shard in self.server.tables.items():
            self.data_built[name] = np.ones(len(shard.payload), dtype=bool)
            self.data_built[name][shard.owned_slots] = False
            self.parity[name].mark_unbuilt()
        for name in self.server.dense:
            self.dense_built[name] = False
        self.recovering.set()
        kept = self._resolve(failed_index)
        for key in kept:
            self.server.applied.add(key, None)
        self.counters["resolve_s"] = time.perf_counter() - t0
        self.counters["promoted_wall_time"] = self.recovery_started
        threading.Thread(target=self._background_rebuild, name="ecrec-rebuild", daemon=True).start()
        return True

    def _peers(self) -> dict[int, str]:
        return {i: s.address for i, s in live_servers(self.server.map).items() if i != self.server.index}

    def _resolve(self, f: int) -> list[tuple[str, int]]:
        """Step 1 of recovery: decide which of ``f``'s logged pushes stand; undo the others everywhere."""
        timeout = self.server.config.rpc_timeout_s
        peers = self._peers()
        listing: dict[int, embedding_pb2.ResolveSourceReply] = {}
        for i, address in peers.items():
            try:
                listing[i] = self.server.peer_by_address(address).ResolveSource(
                    embedding_pb2.ResolveSourceRequest(source=f, replacement_id=self.server.server_id), timeout=timeout)
            except grpc.RpcError as exc:
                log.warning("resolution: server %d (%s) unreachable (%s); it is treated as failed", i, address,
                            exc.code().name)
        survivors = set(listing)
        confirmed = max((r.confirmed_upto for r in listing.values()), default=0)
        holders: dict[int, set[int]] = defaultdict(set)
        info: dict[int, embedding_pb2.LoggedPush] = {}
        committed: set[tuple[str, int]] = set()
        for i, r in listing.items():
            for e in r.logged:
                holders[e.seq].add(i)
                info[e.seq] = e
            committed.update((c.worker, c.sequence) for c in r.committed)
        # a destination is a witness only if the server that got the push still holds its index
        # (a replacement promoted since knows nothing of the failed owner's earlier batches)
        current = {i: s.server_id for i, s in live_servers(self.server.map).items()}
        undo, kept = [], []
        for seq, e in info.items():
            needed = {d for d, sid in zip(e.destinations, e.destination_ids) if d in survivors and current.get(d) == sid}
            if seq <= confirmed or needed <= holders[seq]:
                kept.append((e.push_id.worker, e.push_id.sequence))
            else:
                undo.append(seq)
        for i in survivors:
            try:
                self.server.peer_by_address(peers[i]).ResolveSource(
                    embedding_pb2.ResolveSourceRequest(source=f, commit=True, undo_seqs=undo,
                                                       replacement_id=self.server.server_id), timeout=timeout)
            except grpc.RpcError as exc:
                log.warning("resolution commit on server %d failed: %s", i, exc.code().name)
        self.counters["resolved_kept"] = len(kept)
        self.counters["resolved_undone"] = len(undo)
        log.info("resolved index %d: %d logged pushes kept, %d undone (%d servers)", f, len(kept), len(undo), len(survivors))
        return kept + sorted(committed)

    # rebuild -----------------------------------------------------------------------------------------
    def ensure_rows(self, items) -> None:
        if not self.recovering.is_set():
            return
        work = []
        for shard, slots in items:
            built = self.data_built[shard.spec.name]
            missing = slots[~built[slots]]
            if len(missing):
                work.append((shard, np.unique(missing)))
        if not work:
            return
        self.foreground += 1
        try:
            if len(work) == 1:
                self._rebuild_data(*work[0], foreground=True)
            else:  # the tables' member reads overlap: one round trip instead of one per table
                futures = [self._foreground_pool.submit(self._rebuild_data, shard, slots, True) for shard, slots in work]
                for f in futures:
                    f.result()
        finally:
            self.foreground -= 1

    def ensure_dense(self, dense) -> None:
        if self.recovering.is_set() and not self.dense_built.get(dense.spec.name, True):
            self.foreground += 1
            try:
                self._rebuild_dense(dense)
            finally:
                self.foreground -= 1

    def _read(self, index: int, request) -> embedding_pb2.ReadRowsReply | None:
        address = self.live_address(index)
        if address is None or index == self.server.index:
            return None
        try:
            return self.server.peer_by_address(address).ReadRows(request, timeout=self.server.config.rpc_timeout_s)
        except grpc.RpcError as exc:
            if transport.is_unavailable(exc):
                self.report_unreachable(address, f"ReadRows: {exc.code().name}")
                return None
            raise

    def _read_many(self, calls: list[tuple[int, embedding_pb2.ReadRowsRequest]]) -> list:
        """Sends every ``(index, request)`` at once (gRPC futures); a reply is None when its server is gone."""
        futures = []
        for index, request in calls:
            address = self.live_address(index)
            if address is None or index == self.server.index:
                futures.append((None, None))
                continue
            futures.append((address, self.server.peer_by_address(address).ReadRows.future(
                request, timeout=self.server.config.rpc_timeout_s)))
        replies = []
        for address, fut in futures:
            if fut is None:
                replies.append(None)
                continue
            try:
                replies.append(fut.result())
            except grpc.RpcError as exc:
                if not transport.is_unavailable(exc):
                    raise
                self.report_unreachable(address, f"ReadRows: {exc.code().name}")
                replies.append(None)
        return replies

    def _ids_of_slots(self, slots: np.ndarray) -> np.ndarray:
        layout, index = self.layout, self.server.index
        block, pos = np.divmod(slots, layout.k)
        stripe = block * layout.num_servers + (index - pos) % layout.num_servers
        return stripe * layout.k + pos

    def _rebuild_data(self, shard, slots: np.ndarray, foreground: bool = False, deadline_s: float = 120.0) -> None:
        """Rebuilds this server's data rows at ``slots`` from ``k`` consistent members of their stripes."""
        spec, layout = shard.spec, self.layout
        k, m, S = layout.k, layout.m, layout.num_servers
        deadline = time.monotonic() + deadline_s
        todo = slots
        while len(todo):
            with self.rebuild_lock if not foreground else contextlib.nullcontext():
                built = self.data_built[spec.name]
                todo = todo[~built[todo]]
                if not len(todo):
                    return
                ids = self._ids_of_slots(todo)
                stripes, my_pos = np.divmod(ids, k)
                n = len(ids)
                row_bytes = spec.row_bytes
                # members: data positions 0..k-1, parity k..k+m-1
                member_payload = np.zeros((k + m, n, row_bytes), dtype=np.uint8)
                member_ready = np.zeros((k + m, n), dtype=bool)
                data_versions = np.zeros((k, n), dtype=np.int64)
                parity_versions = np.zeros((m, n, k), dtype=np.int64)
                member_ids = stripes[:, None] * k + np.arange(k)[None, :]
                calls, targets = [], []
                for t in range(k):
                    idt = member_ids[:, t]
                    mine = my_pos == t
                    virtual = idt >= spec.num_rows
                    member_ready[t, virtual & ~mine] = True  # zero rows past the end
                    want = ~mine & ~virtual
                    owners = (stripes + t) % S
                    for srv in np.unique(owners[want]):
                        sel = np.flatnonzero(want & (owners == srv))
                        calls.append((int(srv), embedding_pb2.ReadRowsRequest(table=spec.name, ids=transport.ids_to_bytes(idt[sel]))))
                        targets.append((t, sel))
                pservers = layout.parity_servers(stripes)
                for j in range(m):
                    for srv in np.unique(pservers[:, j]):
                        sel = np.flatnonzero(pservers[:, j] == srv)
                        calls.append((int(srv), embedding_pb2.ReadRowsRequest(
                            table=spec.name, stripes=transport.ids_to_bytes(stripes[sel]),
                            parity_index=transport.ids_to_bytes(np.full(len(sel), j)))))
                        targets.append((k + j, sel))
                for (member, sel), r in zip(targets, self._read_many(calls)):
                    if r is None:
                        continue
                    member_payload[member, sel] = np.frombuffer(r.payload, dtype=np.uint8).reshape(len(sel), row_bytes)
                    member_ready[member, sel] = np.frombuffer(r.ready, dtype=np.uint8).astype(bool)
                    if member < k:
                        data_versions[member, sel] = transport.bytes_to_ids(r.versions)
                    else:
                        parity_versions[member - k, sel] = transport.bytes_to_ids(r.versions).reshape(len(sel), k)
                # choose k members per row: ready data rows first, then ready parities whose versions agree
                done_rows, payloads = [], []
                groups: dict[tuple, list] = defaultdict(list)
                row_version = np.zeros(n, dtype=np.int64)
                # fast path (vectorized): every other data member ready + the first ready parity agrees
                own = np.arange(k)[:, None] == my_pos[None, :]
                all_data = (member_ready[:k] | own).all(axis=0)
                parity_ready = member_ready[k:]
                has_parity = parity_ready.any(axis=0)
                j0 = np.argmax(parity_ready, axis=0)
                pv0 = parity_versions[j0, np.arange(n)]  # (n, k)
                agree = ((data_versions.T == pv0) | own.T).all(axis=1)
                fast = all_data & has_parity & agree
                row_version[fast] = pv0[fast, my_pos[fast]]
                for i in range(k):
                    for j in range(m):
                        rows = np.flatnonzero(fast & (my_pos == i) & (j0 == j))
                        if len(rows):
                            groups[(i, tuple(t for t in range(k) if t != i), (j,))].append(rows)
                # slow path, row by row: lost data members, parities that must agree with each other
                for r in np.flatnonzero(~fast & has_parity).tolist():
                    i = int(my_pos[r])
                    data_members = [t for t in range(k) if t != i and member_ready[t, r]]
                    parities = [j for j in range(m) if member_ready[k + j, r]]
                    if len(data_members) + len(parities) < k:
                        continue
                    chosen = parities[: k - len(data_members)]
                    pv = parity_versions[chosen, r]  # (len(chosen), k)
                    if (pv != pv[0]).any():
                        continue  # parities disagree: a delta is in flight, retry
                    if any(data_versions[t, r] != pv[0, t] for t in data_members):
                        continue  # a data row is newer than the parity: its delta is in flight
                    row_version[r] = pv[0, i]
                    groups[(i, tuple(data_members), tuple(chosen))].append(np.array([r]))
                for (i, data_members, chosen), parts in groups.items():
                    rows = np.concatenate(parts)
                    available = {t: member_payload[t, rows] for t in data_members}
                    available.update({k + j: member_payload[k + j, rows] for j in chosen})
                    out = self.codec.reconstruct_stripes(available, [i])[i]
                    done_rows.append(rows)
                    payloads.append(out)
                if done_rows:
                    rows = np.concatenate(done_rows)
                    payload = np.concatenate(payloads)
                    with shard.lock:
                        fresh = ~built[todo[rows]]
                        sl = todo[rows][fresh]
                        shard.payload[sl] = payload[fresh]
                        shard.versions[sl] = row_version[rows][fresh]
                        built[sl] = True
                    self.counters["rows_rebuilt"] += int(fresh.sum())
                todo = todo[~built[todo]]
            if len(todo):
                if time.monotonic() > deadline:
                    raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                       f"table {spec.name!r}: {len(todo)} rows cannot be rebuilt yet (members unavailable)")
                time.sleep(0.01)

    def _rebuild_parity(self, store: ParityStore, slots: np.ndarray) -> int:
        """Re-encodes parity rows from their stripes' data rows; returns how many were built."""
        spec, layout = store.spec, self.layout
        k, S = layout.k, layout.num_servers
        stripes = store.slot_to_stripe[slots]
        pidx = store.slot_to_parity_index[slots]
        suspects = self._suspect_sources()
        if suspects:
            with self.log_lock:
                for s in suspects:
                    keep = ~np.isin(slots, self.logs[s].affected_slots(spec.name))
                    slots, stripes, pidx = slots[keep], stripes[keep], pidx[keep]
        n = len(slots)
        data = np.zeros((n, k, spec.row_bytes), dtype=np.uint8)
        versions = np.zeros((n, k), dtype=np.int64)
        ready = np.ones(n, dtype=bool)
        ids = stripes[:, None] * k + np.arange(k)[None, :]
        calls, targets = [], []
        for t in range(k):
            owners = (stripes + t) % S
            valid = ids[:, t] < spec.num_rows
            for srv in np.unique(owners[valid]):
                sel = np.flatnonzero(valid & (owners == srv))
                calls.append((int(srv), embedding_pb2.ReadRowsRequest(table=spec.name, ids=transport.ids_to_bytes(ids[sel, t]))))
                targets.append((t, sel))
        for (t, sel), r in zip(targets, self._read_many(calls)):
            if r is None:
                ready[sel] = False
                continue
            data[sel, t] = np.frombuffer(r.payload, dtype=np.uint8).reshape(len(sel), spec.row_bytes)
            versions[sel, t] = transport.bytes_to_ids(r.versions)
            ready[sel] &= np.frombuffer(r.ready, dtype=np.uint8).astype(bool)
        if not ready.any():
            return 0
        parity = self.codec.encode_stripes(data[ready])
        rows = parity[np.arange(int(ready.sum())), pidx[ready]]
        built = store.build(slots[ready], rows, versions[ready])
        self.counters["parity_rows_rebuilt"] += built
        return built

    def _rebuild_dense(self, dense) -> None:
        name = dense.spec.name
        with self.rebuild_lock:
            if self.dense_built.get(name, True):
                return
            deadline = time.monotonic() + 120
            while True:
                for idx in self.layout.dense_servers(name):
                    if idx == self.server.index:
                        continue
                    r = self._read(idx, embedding_pb2.ReadRowsRequest(dense=name))
                    if r is not None and r.ready == b"\x01":
                        with dense.lock:
                            dense.floats.view(np.uint8).reshape(-1)[:] = np.frombuffer(r.payload, dtype=np.uint8)
                            dense.version = int(transport.bytes_to_ids(r.versions)[0])
                            for seq, delta in self._pending_dense.pop(name, []):
                                if seq > dense.version:
                                    np.bitwise_xor(dense.floats.view(np.uint8).reshape(-1), delta,
                                                   out=dense.floats.view(np.uint8).reshape(-1))
                                    dense.version = seq
                            self.dense_built[name] = True
                        return
                if time.monotonic() > deadline:
                    raise RequestError(grpc.StatusCode.UNAVAILABLE, f"dense tensor {name!r}: no replica available")
                time.sleep(0.02)

    def _background_rebuild(self) -> None:
        t0 = time.perf_counter()
        batch = self.rebuild_batch_rows
        try:
            for name, shard in list(self.server.tables.items()):
                built = self.data_built[name]
                while True:
                    todo = shard.owned_slots[~built[shard.owned_slots]]
                    if not len(todo):
                        break
                    started = time.perf_counter()
                    self._rebuild_data(shard, todo[:batch])
                    self.server.faults.hit("during_rebuild")
                    self._yield(time.perf_counter() - started)
            for name, dense in list(self.server.dense.items()):
                self._rebuild_dense(dense)
            for name, store in list(self.parity.items()):
                while True:
                    todo = store.unbuilt_slots()
                    if not len(todo):
                        break
                    started = time.perf_counter()
                    if self._rebuild_parity(store, todo[:batch]) == 0:
                        time.sleep(0.02)
                    self.server.faults.hit("during_rebuild")
                    self._yield(time.perf_counter() - started)
        except Exception:  # noqa: BLE001 - reported, never swallowed; the server stays recovering
            log.exception("background rebuild failed; this server stays RECOVERING")
            return
        elapsed = time.perf_counter() - t0
        self.counters["rebuild_s"] = elapsed
        self.recovering.clear()
        log.info("rebuild done in %.2f s: %d data rows, %d parity rows", elapsed, self.counters["rows_rebuilt"],
                 self.counters["parity_rows_rebuilt"])
        try:
            self.server.coordinator.ReportRedundant(coordinator_pb2.ReportRedundantRequest(
                index=self.server.index, server_id=self.server.server_id, rebuild_seconds=elapsed), timeout=10)
        except grpc.RpcError as exc:
            log.error("reporting full redundancy failed: %s", exc.details())

    def _yield(self, worked_s: float) -> None:
        """Lets training go first: wait while a foreground request rebuilds, then rest so that the
        background rebuild keeps to ``rebuild_duty`` of the wall time (at least ``rebuild_pause_s``)."""
        while self.foreground > 0 and not self.closed.is_set():
            time.sleep(0.001)
        rest = max(self.rebuild_pause_s, worked_s * (1.0 / self.rebuild_duty - 1.0))
        if rest:
            self.closed.wait(rest)

    # --- commands, stats -----------------------------------------------------------------------------
    def call(self, command: str, args: dict) -> dict:
        if command == "verify_parity":
            return self._verify_parity()
        return super().call(command, args)

    def _verify_parity(self) -> dict:
        """Compares every parity row held here with a fresh encode of its stripe's current data rows."""
        mismatched, checked = 0, 0
        for name, store in self.parity.items():
            slots = store.slots
            if not len(slots):
                continue
            spec, k, S = store.spec, self.layout.k, self.layout.num_servers
            stripes = store.slot_to_stripe[slots]
            ids = stripes[:, None] * k + np.arange(k)[None, :]
            data = np.zeros((len(slots), k, spec.row_bytes), dtype=np.uint8)
            for t in range(k):
                owners = (stripes + t) % S
                valid = ids[:, t] < spec.num_rows
                for srv in np.unique(owners[valid]):
                    sel = np.flatnonzero(valid & (owners == srv))
                    if srv == self.server.index:
                        shard = self.server.tables[name]
                        data[sel, t] = shard.payload[shard.slots_for(ids[sel, t])]
                        continue
                    r = self._read(int(srv), embedding_pb2.ReadRowsRequest(table=name, ids=transport.ids_to_bytes(ids[sel, t])))
                    if r is None:
                        raise RequestError(grpc.StatusCode.UNAVAILABLE, f"server {srv} unavailable for verification")
                    data[sel, t] = np.frombuffer(r.payload, dtype=np.uint8).reshape(len(sel), spec.row_bytes)
            expected = self.codec.encode_stripes(data)[np.arange(len(slots)), store.slot_to_parity_index[slots]]
            with store.lock:
                actual = store.rows(slots)
            mismatched += int((expected != actual).any(axis=1).sum())
            checked += len(slots)
        for name, dense in self.server.dense.items():
            primary = self.layout.dense_servers(name)[0]
            if primary == self.server.index:
                continue
            r = self._read(primary, embedding_pb2.ReadRowsRequest(dense=name))
            checked += 1
            if r is None or r.payload != dense.floats.tobytes():
                mismatched += 1
        return {"checked": checked, "mismatched": mismatched}

    def stats(self) -> dict:
        parity_bytes = sum(len(store.slots) * store.spec.row_bytes for store in self.parity.values())
        replica_bytes = sum(d.floats.nbytes for name, d in self.server.dense.items()
                            if self.layout.dense_servers(name)[0] != self.server.index)
        return {k: v for k, v in self.counters.items()} | {
            "recovering": self.recovering.is_set(), "redundancy_bytes": parity_bytes + replica_bytes}

    def close(self) -> None:
        self.closed.set()
        self._foreground_pool.shutdown(wait=False, cancel_futures=True)
