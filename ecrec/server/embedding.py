"""The embedding server: holds this server's shard of every table and its dense tensors.

One process per server.  It registers with the coordinator, receives the cluster map (its index,
the layout, the tables), and answers pulls and pushes for the rows the layout gives it.  A push is
validated whole before anything changes, coalesced (duplicate ids summed), applied with a
``torch.optim`` compatible optimizer (``ecrec.tables.shards``), handed once to the active fault-tolerance
strategy with the old and new payload bytes (``on_push``), and acknowledged once the strategy's
completion (if any) is done.  Each push id is applied at most once.

:class:`ServerState` is what a strategy sees of its server (it implements
:class:`ecrec.strategies.base.StrategyHost`); :class:`EmbeddingServicer` is the gRPC face.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Histogram

from ecrec import errors, faults
from ecrec.snapshot import part as snapshot_part
from ecrec.net import transport
from ecrec.config import ServerConfig
from ecrec.control.etcd import EtcdError, EtcdTLS
from ecrec.coding.layout import Layout
from ecrec.net.peers import CoordinatorClient, Peers
from ecrec.server.reserve import Reserve
from ecrec.net.seal import Sealer
from ecrec.control.lease import EtcdServerLease
from ecrec.tables.shards import DenseShard, TableShard
from ecrec.strategies.base import AppliedPush, DenseUpdate, FaultToleranceStrategy, TableUpdate, push_key
from ecrec.strategies.registry import get_spec
from ecrec.tables import spec as tables
from ecrec.tables.spec import DenseSpec, TableSpec
from ecrec.wire import cluster_pb2, coordinator_pb2, embedding_pb2, embedding_pb2_grpc

log = logging.getLogger("ecrec.server")


#: bytes a table entry of :class:`AppliedPushes` costs beside its worker's name (dict slot, key tuple, ints;
#: measured with ``sys.getsizeof``, rounded up)
ENTRY_OVERHEAD_BYTES = 200


class AppliedPushes:
    """Which pushes this server applied, in bounded memory, so a retry is answered "already applied".

    A worker sends its pushes to a server in increasing sequence and retries or replays only pushes it was
    not sure of, oldest first, so per worker incarnation the highest sequence applied (its *high-water mark*)
    tells applied from new: a push at or below it was applied here or, after a recovery, kept.  Pushes not
    yet confirmed also keep the sequence they got here (``recent``), which a retry's reply carries.

    Bounds, in bytes (``max_bytes``, names counted with :data:`ENTRY_OVERHEAD_BYTES` each): the marks take at
    most three quarters and are never forgotten -- forgetting one would let a retry of an old push apply
    twice -- so a new worker incarnation beyond them is refused (:meth:`admit`, ``ResourceExhausted``); the
    recent sequences take the rest, oldest forgotten first (a forgotten one falls back to the mark: still
    "already applied", only the reply's sequence is 0).  Marks a recovery installs (``force``) are never
    refused: they only ever come from servers.
    """

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes = max_bytes
        self.max_recent_bytes = max_bytes // 4
        self.max_marks_bytes = max_bytes - self.max_recent_bytes
        self._marks: dict[str, int] = {}
        self._recent: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.marks_bytes = 0
        self.recent_bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def cost(worker: str) -> int:
        return len(worker) + ENTRY_OVERHEAD_BYTES

    def get(self, key: tuple[str, int]) -> int | None:
        """The push's sequence here (0: applied before the last confirmation, or by an earlier incarnation of
        this index), or None when it was not applied."""
        worker, sequence = key
        with self._lock:
            seq = self._recent.get(key)
            if seq is not None:
                return seq
            mark = self._marks.get(worker)
            return 0 if mark is not None and sequence <= mark else None

    def admit(self, worker: str) -> None:
        """Raises ``ResourceExhausted`` when ``worker`` (``name@incarnation``) is new here and its mark would not
        fit: the caller is refused, no mark is forgotten.  Changes nothing."""
        with self._lock:
            if worker in self._marks or self.marks_bytes + self.cost(worker) <= self.max_marks_bytes:
                return
            raise errors.ResourceExhausted(
                f"this server remembers the pushes of {len(self._marks)} worker incarnations in "
                f"{self.marks_bytes} bytes (bound --max-applied-bytes {self.max_bytes}: three quarters for them); "
                "a new incarnation is refused (forgetting one could apply its retried pushes twice)")

    def add(self, key: tuple[str, int], seq: int = 0, force: bool = False) -> None:
        """Records an applied push; a new incarnation must have been admitted (:meth:`admit`) unless ``force``."""
        worker, sequence = key
        with self._lock:
            mark = self._marks.get(worker)
            if mark is None:
                if not force and self.marks_bytes + self.cost(worker) > self.max_marks_bytes:
                    raise errors.ResourceExhausted(f"no room for the mark of a new worker incarnation "
                                                   f"(--max-applied-bytes {self.max_bytes})")
                self._marks[worker] = sequence
                self.marks_bytes += self.cost(worker)
            elif sequence > mark:
                self._marks[worker] = sequence
            if seq:
                if key not in self._recent:
                    self.recent_bytes += self.cost(worker)
                self._recent[key] = seq
                while self.recent_bytes > self.max_recent_bytes and self._recent:
                    (old, _), _ = self._recent.popitem(last=False)
                    self.recent_bytes -= self.cost(old)

    def confirmed(self, upto: int) -> None:
        """Every push with a sequence here up to ``upto`` is durable: forget their sequences."""
        with self._lock:
            while self._recent:
                key, seq = next(iter(self._recent.items()))
                if seq > upto:
                    break
                self._recent.popitem(last=False)
                self.recent_bytes -= self.cost(key[0])

    def __len__(self) -> int:
        with self._lock:
            return len(self._marks) + len(self._recent)


#: upper bounds (seconds) of the request-latency histogram buckets; a last bucket takes the rest (+Inf)
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class HandlerCounters:
    """Calls, seconds, CPU seconds (of the handling thread) and a latency histogram per data-plane method of
    this server, and the rows pulled and pushed; read by ``stats`` and by the metrics endpoint
    (``ecrec.ops.metrics``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        # per method: prometheus_client's own histogram (in no registry: ecrec.ops.metrics.ServerCollector yields it)
        self.latency = Histogram("ecrec_server_request_duration_seconds", "wall time of a data-plane request, by method",
                                 ["method"], buckets=LATENCY_BUCKETS_S, registry=None)
        self._latency_of: dict[str, object] = {}  # method -> its histogram child (labels() looked up once)
        self.rows: dict[str, int] = {}  # "pulled", "pushed": rows served and rows updated

    @contextlib.contextmanager
    def measure(self, method: str):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            with self._lock:
                self.calls[method] = self.calls.get(method, 0) + 1
                self.seconds[method] = self.seconds.get(method, 0.0) + wall
                self.cpu_seconds[method] = self.cpu_seconds.get(method, 0.0) + cpu
                child = self._latency_of.get(method)
                if child is None:
                    child = self._latency_of[method] = self.latency.labels(method)
            child.observe(wall)

    def count_rows(self, kind: str, rows: int) -> None:
        with self._lock:
            self.rows[kind] = self.rows.get(kind, 0) + rows

    def snapshot(self) -> dict:
        with self._lock:
            return {"calls": dict(self.calls), "seconds": dict(self.seconds), "cpu_seconds": dict(self.cpu_seconds),
                    "rows": dict(self.rows)}


class Lease:
    """This server's lease: it serves while it holds one.  The coordinator promotes a replacement only after the
    lease it granted ran out (on its clock); here a lease is counted from *before* the request that got it was
    sent, and shortened by ``margin``, so this server always stops first."""

    def __init__(self, margin: float = 0.9):
        self.margin = margin
        self.until = 0.0  # monotonic
        self.length_s = 0.0
        self.revoked = ""  # why the coordinator refused it (this server was replaced)

    def grant(self, sent_at: float, length_s: float) -> None:
        if self.revoked:
            return
        self.length_s = length_s
        self.until = max(self.until, sent_at + length_s * self.margin)

    def revoke(self, reason: str) -> None:
        self.revoked = reason or "revoked"
        self.until = 0.0

    def valid(self) -> bool:
        return not self.revoked and time.monotonic() < self.until


class PushSequencer:
    """Numbers the pushes applied here: ``(epoch at the first push << 32) | count``.

    The number is the version stamped on every row a push changes; a later incarnation of the same
    index starts above every earlier one (its first push sees a newer epoch)."""

    def __init__(self):
        self._base = 0
        self._count = 0

    def next(self, epoch: int) -> int:
        if self._base == 0:
            self._base = max(1, epoch) << 32
        self._count += 1
        return self._base | self._count


def validate_map(new_map: cluster_pb2.ClusterMap, current: cluster_pb2.ClusterMap | None) -> None:
    """Raises ``InvalidRequest`` naming the problem when ``new_map`` cannot be a map of this cluster: a shape
    that differs from ``current`` (servers, k, m, strategy and its options are fixed at the cluster's start),
    or server entries with impossible indices or two live holders of one index."""
    if new_map.epoch < 0 or new_map.num_servers <= 0:
        raise errors.InvalidRequest(f"cluster map epoch {new_map.epoch} with {new_map.num_servers} servers is invalid")
    if new_map.k < 0 or new_map.m < 0 or new_map.k + new_map.m > new_map.num_servers:
        raise errors.InvalidRequest(f"cluster map k={new_map.k} m={new_map.m} does not fit {new_map.num_servers} "
                                    "servers")
    holders: dict[int, str] = {}
    for s in new_map.servers:
        if s.index < -1 or s.index >= new_map.num_servers:
            raise errors.InvalidRequest(f"cluster map names index {s.index} of {new_map.num_servers} servers")
        if s.index >= 0 and s.state != cluster_pb2.FAILED:
            if s.index in holders and holders[s.index] != s.server_id:
                raise errors.InvalidRequest(f"cluster map names two live holders of index {s.index}")
            holders[s.index] = s.server_id
    if current is None:
        return
    for field in ("num_servers", "k", "m", "strategy"):
        if getattr(new_map, field) != getattr(current, field):
            raise errors.InvalidRequest(f"cluster map changes {field} from {getattr(current, field)!r} to "
                                        f"{getattr(new_map, field)!r}; a cluster's shape is fixed at its start")
    if dict(new_map.strategy_options) != dict(current.strategy_options):
        raise errors.InvalidRequest("cluster map changes the strategy's options; they are fixed at the cluster's "
                                    "start")


class ServerState:
    """Everything one embedding server holds; what a strategy sees of its server (``StrategyHost``)."""

    def __init__(self, config: ServerConfig, server_id: str, services: transport.LateServices | None = None):
        self.config = config
        self._server_id = server_id
        self.address = ""
        self.metrics_address = ""  # host:port of the Prometheus endpoint, when one is served (ecrec.ops.metrics)
        self.index = -1
        self._promoting = False  # True while Promote creates this server's tables (their rows get rebuilt)
        self.map: cluster_pb2.ClusterMap | None = None
        self._layout: Layout | None = None
        self._tables: dict[str, TableShard] = {}
        self._dense: dict[str, DenseShard] = {}
        self.strategy: FaultToleranceStrategy | None = None
        self.applied = AppliedPushes(config.max_applied_bytes)
        self.sequencer = PushSequencer()
        self.handlers = HandlerCounters()
        self.lease = Lease()
        self._promote_lock = threading.Lock()
        self._promoted_to = -1  # the index a finished promotion gave this server
        self.apply_lock = threading.Lock()  # pushes apply one at a time (the strategy sees a total order)
        self.faults = faults.FaultInjector(config.fault_spec)
        self.lock = threading.RLock()  # guards map/index/tables dicts (not row data)
        self.index_set = threading.Condition(self.lock)
        self._services = services
        self.reserve = Reserve()  # a standby's table memory, prepared for its promotion (ecrec.server.reserve)
        self.sealer: Sealer | None = None  # MACs under the server key (ecrec.net.seal), from the Register reply
        self.coordinator = CoordinatorClient(config.coordinator, config.coordinator_timeout_s,
                                             config.max_message_bytes, on_map=self.adopt_map,
                                             security=config.security)
        self.peers = Peers(lambda: self.map, self.coordinator, timeout_s=config.rpc_timeout_s,
                           retry_deadline_s=config.rpc_timeout_s, max_message_bytes=config.max_message_bytes,
                           identity=self._identity, security=config.security)
        self._proof = ""  # this server's ecrec-caller-proof (set with the server key)
        self._refresh_lock = threading.Lock()
        self._refreshed_at = float("-inf")  # when a caller's newer epoch last made this server fetch the map
        self._fetched_at = float("-inf")  # ... and when the last such fetch that succeeded began

    def set_server_key(self, key: bytes) -> None:
        """The cluster's server key (the coordinator's Register reply): what this server seals batches and
        watermarks with, and proves its identity to peers with."""
        self.sealer = Sealer(key)
        self._proof = self.sealer.caller_proof(self._server_id)

    def _identity(self) -> tuple:
        """Metadata of every call this server makes: its id, a proof of it (the server key's), its map epoch."""
        return (("ecrec-caller", self._server_id), ("ecrec-caller-proof", self._proof), ("ecrec-epoch", str(self.epoch)))

    # --- StrategyHost ----------------------------------------------------------------------------------------
    @property
    def server_id(self) -> str:
        return self._server_id

    @property
    def layout(self) -> Layout | None:
        return self._layout

    @property
    def cluster_map(self) -> cluster_pb2.ClusterMap | None:
        return self.map

    @property
    def epoch(self) -> int:
        return self.map.epoch if self.map is not None else 0

    @property
    def promoting(self) -> bool:
        return self._promoting

    def require_index(self) -> None:
        if self.index < 0 or self._layout is None:
            raise errors.FailedPrecondition("this server holds no index yet (standby)")

    def require_serving(self, caller_epoch: int = 0) -> None:
        """Refuses (UNAVAILABLE: the caller follows the map) unless this server holds a lease and still holds
        its index in the newest map a caller has seen."""
        if not self.lease.valid():
            why = f"it was replaced ({self.lease.revoked})" if self.lease.revoked else "its lease ran out"
            raise errors.Unavailable(f"server {self.index} ({self.server_id}) does not serve: {why}; refresh the map")
        if self._promoting:
            raise errors.Unavailable(f"server {self.server_id} is being promoted to index {self.index}: it serves once "
                                     "its tables exist and its rows are marked for rebuilding; retry")
        if caller_epoch > self.epoch:  # the caller has seen a newer map: this server may have been replaced
            self.catch_up(caller_epoch)
            if self.map is not None and self.index >= 0:
                holder = next((s for s in self.map.servers if s.index == self.index and s.state != cluster_pb2.FAILED
                               ), None)
                if holder is None or holder.server_id != self.server_id:
                    raise errors.Unavailable(f"server {self.server_id} no longer holds index {self.index} "
                                             f"(map epoch {self.epoch}); refresh the map")

    def catch_up(self, caller_epoch: int) -> None:
        """A caller names map epoch ``caller_epoch``, newer than this server's: fetches the coordinator's map, at
        most once per ``map_refresh_interval_s`` (a caller that comes within the interval waits out its rest, so
        concurrent callers share one fetch).  The epoch is refused with ``InvalidRequest`` only when a fetch that
        began after this call arrived still shows an older map (every map a server or client sees was recorded
        by the coordinator first, a promotion's included): a map fetched before the call arrived proves nothing,
        the coordinator may have issued the caller's epoch since.  With the coordinator unreachable the call goes
        on with the map held (the lease fences a replaced server anyway)."""
        interval = self.config.map_refresh_interval_s
        arrived = time.monotonic()
        with self._refresh_lock:
            while caller_epoch > self.epoch and self._fetched_at < arrived:
                wait = self._refreshed_at + interval - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                started = time.monotonic()
                self._refreshed_at = started
                if not self.refresh_map():
                    return
                self._fetched_at = started
            definitive = self._fetched_at >= arrived
        if definitive and caller_epoch > self.epoch:
            raise errors.InvalidRequest(f"map epoch {caller_epoch} was never issued (the coordinator's is "
                                        f"{self.epoch}); refused")

    def refresh_map(self) -> bool:
        """Fetches the coordinator's map (a peer or a lease renewal showed a newer epoch); False when it could not."""
        try:
            self.coordinator.get_map()
            return True
        except grpc.RpcError as exc:
            log.warning("could not refresh the cluster map: %s", exc.code().name)
            return False

    def check_peer(self, context, changes_parity: bool = True) -> str:
        """A server-to-server call (every method of the parity plane, reads included): refused unless the caller
        proves it is a server of this cluster (``ecrec-caller`` with its ``ecrec-caller-proof`` under the server
        key) -- a worker or a stranger may not, whatever id it claims, on every cluster (token-only and plain
        included) -- and unless it is a server of the map (after catching up with the caller's newer epoch),
        so an old incarnation of a peer is fenced off.  Returns the caller's server id.  (``changes_parity`` is
        kept for callers' readability: reads need the same proof.)"""
        meta = dict(context.invocation_metadata() or ())
        caller, proof = meta.get("ecrec-caller", ""), meta.get("ecrec-caller-proof", "")
        try:
            epoch = int(meta.get("ecrec-epoch", "0") or 0)
        except ValueError:
            raise errors.InvalidRequest("ecrec-epoch metadata must be an integer") from None
        self.require_serving()
        if self.sealer is None:
            raise errors.Unavailable("this server holds no server key yet (not registered); retry")
        if not self.sealer.caller_ok(caller, proof):
            raise errors.FailedPrecondition(f"caller {caller[:64] or '(unnamed)'} does not prove it is a server of "
                                            "this cluster (ecrec-caller-proof under the server key); a worker or a "
                                            "stranger may not make this call; refused")
        if epoch > self.epoch:
            self.catch_up(epoch)
        if self.map is not None and not any(s.server_id == caller and s.state != cluster_pb2.FAILED
                                            for s in self.map.servers):
            raise errors.FailedPrecondition(f"caller {caller} is not a server of the cluster map (epoch {self.epoch}): "
                                            "an old incarnation or a stranger; refused")
        return caller

    def tables(self) -> list[TableShard]:
        with self.lock:
            return [self._tables[name] for name in sorted(self._tables)]

    def table(self, name: str) -> TableShard:
        shard = self._tables.get(name)
        if shard is None:
            raise errors.NotFound(f"unknown table {name!r}")
        return shard

    def dense_tensors(self) -> list[DenseShard]:
        with self.lock:
            return [self._dense[name] for name in sorted(self._dense)]

    def dense(self, name: str) -> DenseShard:
        d = self._dense.get(name)
        if d is None:
            raise errors.NotFound(f"unknown dense tensor {name!r} on server {self.index}")
        return d

    def pushes_paused(self) -> contextlib.AbstractContextManager:
        return self.apply_lock

    def mark_applied(self, push_id: tuple[str, int]) -> None:
        self.applied.add(push_id, 0, force=True)

    def status(self) -> dict:
        """Who this server is and what it holds (``ecrec-server status``, the metrics endpoint)."""
        return {"index": self.index, "epoch": self.epoch, "server_id": self._server_id, "address": self.address,
                "metrics_address": self.metrics_address,
                "lease_remaining_s": max(0.0, self.lease.until - time.monotonic()) if self.lease.valid() else 0.0,
                "data_rows": sum(len(shard.owned_ids) for shard in self.tables()),
                "dense_tensors": len(self.dense_tensors()),
                "standby_reserve_bytes": self.reserve.nbytes, "standby_reserve_pending": self.reserve.pending,
                "standby_reserve_used_bytes": self.reserve.used_bytes, "kernels_ready": tables.kernels_ready()}

    # --- map changes -----------------------------------------------------------------------------------------
    def adopt_map(self, new_map: cluster_pb2.ClusterMap) -> None:
        """Adopts ``new_map`` unless it is older than this server's; a map that changes the cluster's shape
        (servers, code, strategy) or names impossible indices is refused with ``InvalidRequest``."""
        validate_map(new_map, self.map)
        with self.lock:
            if self.map is not None and (new_map.epoch < self.map.epoch or new_map == self.map):
                return  # older, or the map held (a rebroadcast, the coordinator asking a recovering server)
            self.map = new_map
            self._layout = Layout(new_map.num_servers, new_map.k, new_map.m)
            if self.strategy is None:
                self._start_strategy(new_map)
            if self.index < 0 and not self._promoting:  # the map may tell this server its index first
                mine = [s.index for s in new_map.servers if s.server_id == self._server_id and s.index >= 0
                        and s.state == cluster_pb2.ACTIVE]
                if mine and not new_map.tables:
                    self.index = mine[0]
            self.index_set.notify_all()
            strategy = self.strategy
            if self.config.standby and self.index < 0 and not self._promoting and not self.config.no_standby_reserve:
                self.reserve.prepare(self._reserve_wanted(new_map))
        strategy.on_map_change()

    def _reserve_wanted(self, m: cluster_pb2.ClusterMap) -> dict:
        """The arrays a promotion of this standby would allocate for each table of ``m`` (every index's shard
        has the same shape): the shard's rows and what the strategy keeps per row."""
        specs = [TableSpec.from_proto(t) for t in m.tables]
        wanted = {spec.name: [((self._layout.data_slots_per_server(spec.num_rows), spec.row_bytes), "uint8")]
                  for spec in specs}
        for name, shapes in self.strategy.reserve_shapes(specs).items():
            wanted[name] = wanted.get(name, []) + shapes
        return wanted

    def allocate(self, table: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A zeroed array for table ``table``: from the standby reserve when it holds one of that shape."""
        return self.reserve.take(table, shape, dtype)

    def _start_strategy(self, m: cluster_pb2.ClusterMap) -> None:
        spec = get_spec(m.strategy)
        strategy = spec.load_class()(self, spec.parse_options(dict(m.strategy_options)))
        if self._services is not None:
            for add_servicer, servicer in strategy.services():
                add_servicer(servicer, self._services)
        self.strategy = strategy

    def wait_for_index(self, timeout_s: float = 10.0) -> None:
        """Makes sure this server holds its index and a strategy before it creates anything.

        The coordinator counts a server (and may call it) as soon as it answered its Register; the reply, or the
        map broadcast after it, may still be on its way here.  So a server that holds no index yet asks the
        coordinator for the map instead of waiting for those messages (``adopt_map`` takes the index it names
        and builds the strategy).  Only a standby, which holds no index in the map either, is refused."""
        with self.lock:
            ready = self.index >= 0 and self.strategy is not None
        if not ready:
            self.refresh_map()
        with self.lock:
            self.index_set.wait_for(lambda: self.index >= 0 and self.strategy is not None, timeout=timeout_s)
            self.require_index()

    def create_table(self, spec: TableSpec) -> bool:
        """Creates the shard of ``spec``; False when an identical table already exists."""
        self.wait_for_index()
        with self.lock:
            existing = self._tables.get(spec.name)
            if existing is not None:
                if existing.spec != spec:
                    raise errors.AlreadyExists(
                        f"table {spec.name!r} exists with a different spec ({existing.spec}); got {spec}")
                return False
            fill = not (self._promoting and self.strategy.rebuilds_rows)
            shard = TableShard(spec, self._layout, self.index, initial_values=fill,
                               allocate=lambda shape, dtype: self.allocate(spec.name, shape, dtype))
            self._tables[spec.name] = shard
        self.strategy.on_table_created(shard)
        return True

    def create_dense(self, spec: DenseSpec, initial: np.ndarray) -> bool:
        self.wait_for_index()
        if self.index not in self._layout.dense_servers(spec.name):
            raise errors.FailedPrecondition(
                f"dense tensor {spec.name!r} belongs to servers {self._layout.dense_servers(spec.name)}, not {self.index}")
        with self.lock:
            existing = self._dense.get(spec.name)
            if existing is not None:
                if existing.spec != spec:
                    raise errors.AlreadyExists(f"dense tensor {spec.name!r} exists with a different spec")
                return False
            dense = DenseShard(spec, initial)
            self._dense[spec.name] = dense
        self.strategy.on_dense_created(dense)
        return True

    def promote(self, index: int, new_map: cluster_pb2.ClusterMap, dense) -> bool:
        """Takes ``index`` of a failed server: its tables and dense tensors, then the strategy's recovery.
        Returns whether the strategy keeps rebuilding in the background.  Idempotent: promoting again to the
        same index (a retried call, a restarted coordinator) reports the state instead of starting over; a
        promotion that failed midway (e.g. a survivor did not answer its resolution) runs again."""
        with self._promote_lock:
            if self._promoted_to == index:
                return self.strategy.is_recovering()
            recovering = self._promote(index, new_map, dense)
            self._promoted_to = index
            return recovering

    def _promote(self, index: int, new_map: cluster_pb2.ClusterMap, dense) -> bool:
        with self.lock:
            if self.index >= 0 and self.index != index:
                raise errors.FailedPrecondition(f"this server already holds index {self.index}")
            self._promoting = True  # first: the map adopted now prepares no more reserve
            self.reserve.stop_preparing()  # the promotion takes what is held; its tables are created now
            try:
                self.adopt_map(new_map)
            except BaseException:
                self._promoting = False
                raise
            self.index = index
        log.info("promoted to index %d (epoch %d): creating %d tables", index, new_map.epoch, len(new_map.tables))
        try:
            for t in new_map.tables:
                self.create_table(TableSpec.from_proto(t))
            for d in dense:
                spec, initial = parse_dense_spec(d.spec, d.initial_value)
                self.create_dense(spec, initial)
            return bool(self.strategy.on_recovery(index))
        finally:
            self._promoting = False
            self.reserve.close()  # what the promotion did not take is freed


def parse_dense_spec(p: cluster_pb2.DenseSpec, value: bytes) -> tuple[DenseSpec, np.ndarray]:
    try:
        spec = DenseSpec.from_proto(p).validate()
    except ValueError as exc:
        raise errors.InvalidRequest(str(exc)) from None
    initial = transport.bytes_to_floats(value, spec.shape)
    if not np.isfinite(initial).all():
        raise errors.InvalidRequest(f"dense tensor {spec.name!r}: initial value has NaN or Inf")
    return spec, initial


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Values that replace ``columns`` of a push's rows (``TableGrads.assign``), in place of gradients."""
    values: np.ndarray  # float32 (rows, width)
    columns: slice


def _assignment(spec: TableSpec, t, ids: np.ndarray, slots: np.ndarray):
    """An assignment's ``(ids, slots, Assignment)``, sorted by id; refused (``InvalidRequest``, naming the
    table) when an id repeats, the bytes do not fit the width or a value is not finite."""
    kind = t.assign
    if kind == embedding_pb2.WEIGHTS:
        columns, what = slice(0, spec.dim), "weights"
    elif kind == embedding_pb2.PAYLOAD:
        columns, what = slice(0, spec.row_floats), "payload (weights and optimizer state)"
    elif kind == embedding_pb2.STATE:
        if spec.state_width == 0:
            raise errors.InvalidRequest(f"table {spec.name!r}: optimizer {spec.optimizer!r} keeps no state to assign")
        columns, what = slice(spec.dim, spec.row_floats), "optimizer state"
    else:
        raise errors.InvalidRequest(f"table {spec.name!r}: unknown assignment {kind}")
    width = columns.stop - columns.start
    if len(t.grads) != 4 * width * len(ids):
        raise errors.InvalidRequest(f"table {spec.name!r}: assigning the {what} of {len(ids)} rows needs "
                                    f"{4 * width * len(ids)} bytes ({width} floats a row), got {len(t.grads)}")
    order = np.argsort(ids, kind="stable")
    ids, slots = ids[order], slots[order]
    if len(ids) > 1 and (ids[1:] == ids[:-1]).any():
        raise errors.InvalidRequest(f"table {spec.name!r}: row {int(ids[1:][ids[1:] == ids[:-1]][0])} is assigned "
                                    "twice in one push")
    values = transport.bytes_to_floats(t.grads, (len(order), width))[order]
    if not np.isfinite(values).all():
        raise errors.InvalidRequest(f"table {spec.name!r}: an assigned value is NaN or Inf")
    state_from = {embedding_pb2.STATE: 0, embedding_pb2.PAYLOAD: spec.dim}.get(kind)
    if spec.optimizer == "adagrad" and state_from is not None and (values[:, state_from:] < 0).any():
        raise errors.InvalidRequest(f"table {spec.name!r}: an Adagrad accumulator is negative")
    return ids, slots, Assignment(values, columns)


def _dense_assignment(spec: DenseSpec, g) -> Assignment:
    """A dense tensor's whole payload (weights then optimizer state) that replaces its own
    (``DenseValue.assign`` = PAYLOAD: a restore); refused naming the tensor when it does not fit."""
    if g.assign != embedding_pb2.PAYLOAD:
        raise errors.InvalidRequest(f"dense tensor {spec.name!r}: only its whole payload can be assigned")
    width = spec.numel * (1 + spec.state_width)
    if len(g.value) != 4 * width:
        raise errors.InvalidRequest(f"dense tensor {spec.name!r}: assigning its payload needs {4 * width} bytes "
                                    f"({spec.numel} weights and their optimizer state), got {len(g.value)}")
    values = transport.bytes_to_floats(g.value)
    if not np.isfinite(values).all():
        raise errors.InvalidRequest(f"dense tensor {spec.name!r}: an assigned value is NaN or Inf")
    if spec.optimizer == "adagrad" and (values[spec.numel:] < 0).any():
        raise errors.InvalidRequest(f"dense tensor {spec.name!r}: an Adagrad accumulator is negative")
    return Assignment(values, slice(0, width))


def _coalesce(ids: np.ndarray, slots: np.ndarray, grads: np.ndarray):
    """Sums the gradients of duplicate ids (like ``torch.sparse`` coalesce); returns sorted unique rows."""
    if len(ids) < 2 or bool((ids[1:] > ids[:-1]).all()):  # the SDK sends sorted unique ids
        return ids, slots, grads
    uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    if len(uniq) == len(ids):
        order = np.argsort(ids, kind="stable")
        return ids[order], slots[order], grads[order]
    summed = np.zeros((len(uniq), grads.shape[1]), dtype=np.float32)
    np.add.at(summed, inverse.reshape(-1), grads)
    return uniq, slots[first], summed


def threads_cpu_s() -> dict[str, float]:
    """CPU seconds of this process by kind of thread: Python threads by name (numbers stripped, so a pool's
    threads add up), ``other`` for threads Python does not know (gRPC's own), ``total`` for the process."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, AttributeError, TypeError):  # a thread that just ended; a platform without thread clocks
            continue
        name = t.name.rstrip("0123456789_-") or "thread"
        out[name] = out.get(name, 0.0) + cpu
    total = time.process_time()
    return out | {"other": max(0.0, total - sum(out.values())), "total": total}


def _caller(context, worker: str = "") -> str:
    """Who sent a request, for a log line: the worker's name (a push's) and its address."""
    peer = context.peer() if context is not None else ""
    return f"worker {worker[:64]!r} ({peer})" if worker else f"the worker at {peer}"


def _utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_push_id(push_id, config: ServerConfig) -> None:
    """Raises ``InvalidRequest`` naming the bound when a push id's worker name or incarnation is missing or too
    long (``--max-worker-name-bytes``, ``--max-incarnation-bytes``): every server keeps them (a mark per
    incarnation, the push ids in parity logs), so their size is bounded before anything changes."""
    if not push_id.worker:
        raise errors.InvalidRequest("push_id.worker is required (it makes retries safe)")
    name = _utf8_bytes(push_id.worker) if len(push_id.worker) <= config.max_worker_name_bytes else -1
    if name < 0 or name > config.max_worker_name_bytes:
        raise errors.InvalidRequest(f"push_id.worker is longer than {config.max_worker_name_bytes} bytes "
                                    "(--max-worker-name-bytes); push refused")
    if len(push_id.incarnation) > config.max_incarnation_bytes or (
            _utf8_bytes(push_id.incarnation) > config.max_incarnation_bytes):
        raise errors.InvalidRequest(f"push_id.incarnation is longer than {config.max_incarnation_bytes} bytes "
                                    "(--max-incarnation-bytes); push refused")


def check_ids(sections, config: ServerConfig, reply_row_bytes=None) -> None:
    """Raises ``InvalidRequest`` naming the bound when the ids of ``sections`` (messages with an ``ids`` field of
    int64) number more than ``--max-ids-per-request`` together, repeats included, or when the reply they ask
    for (``reply_row_bytes(section)`` bytes per id) would not fit in one message: checked before anything is
    read or allocated."""
    sections = list(sections)
    count = sum(len(section.ids) // 8 for section in sections)
    if count > config.max_ids_per_request:
        raise errors.InvalidRequest(f"{count} row ids in one request (repeats included); the bound is "
                                    f"{config.max_ids_per_request} (--max-ids-per-request): split the request")
    if reply_row_bytes is not None:
        nbytes = sum(len(section.ids) // 8 * reply_row_bytes(section) for section in sections)
        if nbytes > config.max_message_bytes:
            raise errors.InvalidRequest(f"the reply would hold {nbytes} bytes of rows, more than one message "
                                        f"({config.max_message_bytes} bytes, --max-message-bytes): split the request")


class EmbeddingServicer(embedding_pb2_grpc.EmbeddingServerServicer):
    """The gRPC face of a :class:`ServerState`."""

    def __init__(self, state: ServerState):
        self.state = state

    # --- data plane ------------------------------------------------------------------------------------------
    @transport.service_method
    def Pull(self, request, context):
        with self.state.handlers.measure("Pull"):
            return self._pull(request, context)

    def _pull(self, request, context):
        st = self.state
        st.require_index()
        st.require_serving(request.epoch)
        if not request.tables and not request.dense:
            raise errors.InvalidRequest("empty pull: name at least one table or dense tensor")
        check_ids(request.tables, st.config, lambda t: 4 * st.table(t.table).spec.dim)
        watermarks = st.strategy.on_relay(request.relay, _caller(context)) if request.relay else []
        plans = []
        for t in request.tables:
            shard = st.table(t.table)
            plans.append((shard, shard.slots_for(transport.bytes_to_ids(t.ids))))
        dense = [st.dense(name) for name in request.dense]
        strategy = st.strategy
        strategy.ensure_rows(plans)
        for d in dense:
            strategy.ensure_dense(d)
        reply = embedding_pb2.PullReply(watermarks=watermarks, server_id=st.server_id,
                                        confirmed_upto=strategy.confirmed_upto())
        for shard, slots in plans:
            reply.values.append(shard.weights(slots).tobytes())
        st.handlers.count_rows("pulled", sum(len(slots) for _, slots in plans))
        for d in dense:
            reply.dense.add(name=d.spec.name, value=d.weights_bytes())
        st.require_serving(request.epoch)  # fenced again right before the reply: a pause since the check above
        return reply

    def _validate_push(self, request):
        """Checks the whole push before anything changes; returns the coalesced table and dense plans."""
        st = self.state
        table_plans = []
        seen_tables = set()
        for t in request.tables:
            if t.table in seen_tables:
                raise errors.InvalidRequest(f"table {t.table!r} appears twice in one push")
            seen_tables.add(t.table)
            shard = st.table(t.table)
            ids = transport.bytes_to_ids(t.ids)
            slots = shard.slots_for(ids)
            if t.assign != embedding_pb2.GRADIENT:
                table_plans.append((shard, *_assignment(shard.spec, t, ids, slots)))
                continue
            dim = shard.spec.dim
            if len(t.grads) != 4 * dim * len(ids):
                raise errors.InvalidRequest(
                    f"table {t.table!r}: {len(ids)} ids of dim {dim} need {4 * dim * len(ids)} gradient bytes, "
                    f"got {len(t.grads)}")
            grads = transport.bytes_to_floats(t.grads, (len(ids), dim))
            if not np.isfinite(grads).all():
                raise errors.InvalidRequest(f"table {t.table!r}: gradient has NaN or Inf")
            table_plans.append((shard, *_coalesce(ids, slots, grads)))
        dense_plans = []
        seen_dense = set()
        for g in request.dense:
            if g.name in seen_dense:
                raise errors.InvalidRequest(f"dense tensor {g.name!r} appears twice in one push")
            seen_dense.add(g.name)
            d = st.dense(g.name)
            if st.layout.dense_servers(g.name)[0] != st.index:
                raise errors.FailedPrecondition(f"server {st.index} is not the primary of {g.name!r}")
            if g.assign != embedding_pb2.GRADIENT:
                dense_plans.append((d, _dense_assignment(d.spec, g)))
                continue
            if len(g.value) != 4 * d.spec.numel:
                raise errors.InvalidRequest(
                    f"dense tensor {g.name!r}: expected {4 * d.spec.numel} gradient bytes, got {len(g.value)}")
            grad = transport.bytes_to_floats(g.value)
            if not np.isfinite(grad).all():
                raise errors.InvalidRequest(f"dense tensor {g.name!r}: gradient has NaN or Inf")
            dense_plans.append((d, grad))
        return table_plans, dense_plans

    @transport.service_method
    def Push(self, request, context):
        with self.state.handlers.measure("Push"):
            plans = self._validate(request)
            watermarks = self._receive_relayed(request, context)
            return self._apply(request, plans, watermarks)

    @transport.service_method
    def Replay(self, request, context):
        """A worker's unconfirmed pushes, in order: validated whole, the rows they touch rebuilt once (a
        replacement rebuilds on demand), then each applied exactly once as :meth:`Push` would."""
        with self.state.handlers.measure("Replay"):
            if not request.pushes:
                raise errors.InvalidRequest("empty replay")
            check_ids([t for push in request.pushes for t in push.tables], self.state.config)
            plans = [self._validate(push) for push in request.pushes]
            strategy = self.state.strategy
            needed: dict[str, tuple] = {}
            for table_plans, _ in plans:
                for shard, _, slots, _ in table_plans:
                    shard_slots = needed.setdefault(shard.spec.name, (shard, []))[1]
                    shard_slots.append(slots)
            strategy.ensure_rows([(shard, np.unique(np.concatenate(parts))) for shard, parts in needed.values()])
            reply = embedding_pb2.ReplayReply()
            for push, push_plans in zip(request.pushes, plans):
                reply.replies.append(self._apply(push, push_plans, [], replayed=True))
            self.state.require_serving()
            return reply

    def _validate(self, request):
        st = self.state
        st.require_index()
        st.require_serving(request.epoch)
        if not request.tables and not request.dense:
            raise errors.InvalidRequest("empty push: no table rows and no dense gradients")
        check_push_id(request.push_id, st.config)
        check_ids(request.tables, st.config)
        return self._validate_push(request)

    def _receive_relayed(self, request, context) -> list:
        """What the worker carries from other servers (sealed batches for this server, sealed watermarks of its
        own batches): handed to the strategy, which refuses whatever a server did not seal."""
        strategy = self.state.strategy
        if not request.relay and not request.acks:
            return []
        worker = _caller(context, request.push_id.worker)
        watermarks = strategy.on_relay(request.relay, worker) if request.relay else []
        if request.acks:
            strategy.on_acks(request.acks, worker)
        return watermarks

    def _apply(self, request, plans, watermarks, replayed: bool = False):
        """Applies one validated push once (a known push id is answered "already applied")."""
        st = self.state
        table_plans, dense_plans = plans
        strategy = st.strategy
        for d, _ in dense_plans:  # rebuilt before anything reads them, the reply of a retry included
            strategy.ensure_dense(d)
        key = push_key(request.push_id)
        seq = st.applied.get(key)
        if seq is not None:  # a retry (or a replay) of a push applied here or kept by recovery
            return self._push_reply(request, True, 0, strategy.on_retry(key, seq), watermarks)
        strategy.ensure_rows([(shard, slots) for shard, _, slots, _ in table_plans])
        strategy.admit_push()  # waits (or refuses) while too many pushes wait for their redundancy
        st.faults.hit("before_local_commit")
        # apply, one push at a time; the strategy sees the old and new bytes of everything it changed
        keep_old, want_delta = strategy.needs_old_payload, strategy.needs_delta
        rows_updated = 0
        with st.apply_lock:
            seq = st.applied.get(key)  # a concurrent retry may have won
            if seq is not None:
                return self._push_reply(request, True, 0, strategy.on_retry(key, seq), watermarks)
            st.applied.admit(key[0])  # a new incarnation beyond the table's bound is refused, nothing applied
            push = AppliedPush(key, st.sequencer.next(st.epoch))
            for shard, ids, slots, grads in table_plans:
                if isinstance(grads, Assignment):
                    old, new, old_versions = shard.assign_rows(slots, grads.values, grads.columns, push.seq,
                                                               keep_old, want_delta)
                else:
                    old, new, old_versions = shard.apply_gradients(slots, grads, push.seq, keep_old, want_delta)
                push.tables.append(TableUpdate(shard, ids, slots, None, new, old_versions, delta=old) if want_delta
                                   else TableUpdate(shard, ids, slots, old, new, old_versions))
                rows_updated += len(slots)
                push.nbytes += new.nbytes
            for d, grad in dense_plans:
                if isinstance(grad, Assignment):
                    old, new, old_version = d.assign_payload(grad.values, push.seq, keep_old, want_delta)
                else:
                    old, new, old_version = d.apply_gradient(grad, push.seq, keep_old, want_delta)
                push.dense.append(DenseUpdate(d, None, new, old_version, delta=old) if want_delta
                                  else DenseUpdate(d, old, new, old_version))
                push.nbytes += new.nbytes
            outcome = strategy.on_push(push)
            st.applied.add(key, push.seq)
            if outcome is not None and outcome.confirmed_upto:
                st.applied.confirmed(outcome.confirmed_upto)
        st.handlers.count_rows("pushed", rows_updated)
        if replayed or request.replay:
            st.faults.hit("during_replay")
        # acknowledged once the strategy's completion (if any) is done
        if outcome is not None and outcome.completion is not None:
            outcome.completion.result(timeout=st.config.rpc_timeout_s)
        st.faults.hit("after_parity_before_ack")
        st.require_serving()  # no acknowledgement from a server whose lease ran out meanwhile
        return self._push_reply(request, False, rows_updated, outcome, watermarks)

    def _push_reply(self, request, already_applied: bool, rows: int, outcome, watermarks):
        reply = embedding_pb2.PushReply(already_applied=already_applied, rows_updated=rows,
                                        server_id=self.state.server_id, watermarks=watermarks)
        if outcome is not None:
            for r in outcome.relay:  # sealed batches for the worker to carry (one copy, into the reply)
                reply.relay.add(destination=r.destination, destination_id=r.destination_id, batch=r.batch, mac=r.mac)
            reply.seq = outcome.seq
            reply.confirmed_upto = outcome.confirmed_upto
        if request.return_dense:
            for g in request.dense:
                reply.dense.add(name=g.name, value=self.state.dense(g.name).weights_bytes())
        return reply

    @transport.service_method
    def ReadPayload(self, request, context):
        st = self.state
        st.require_index()
        st.require_serving()
        reply = embedding_pb2.ReadPayloadReply()
        if request.table:
            shard = st.table(request.table)
            if request.all_rows:
                order = np.argsort(shard.owned_ids, kind="stable")
                ids, slots = shard.owned_ids[order], shard.owned_slots[order]
            else:
                check_ids([request], st.config, lambda _: shard.spec.row_bytes)
                ids = transport.bytes_to_ids(request.ids)
                slots = shard.slots_for(ids)
            st.strategy.ensure_rows([(shard, slots)])
            reply.ids = transport.ids_to_bytes(ids)
            reply.payload = shard.read_payload_bytes(slots)
            reply.row_bytes = shard.spec.row_bytes
        for name in request.dense:
            d = st.dense(name)
            st.strategy.ensure_dense(d)
            reply.dense.add(name=name, value=d.read()[0].tobytes())
        st.require_serving()
        return reply

    @transport.service_method
    def WriteSnapshot(self, request, context):
        st = self.state
        st.require_index()
        st.require_serving()
        items, size, seconds = snapshot_part.write(st, request)
        return embedding_pb2.WriteSnapshotReply(items_json=json.dumps(items), bytes=size, seconds=seconds)

    @transport.service_method
    def StrategyCall(self, request, context):
        st = self.state
        if st.strategy is None:
            raise errors.FailedPrecondition("no cluster map yet")
        try:
            args = json.loads(request.args_json) if request.args_json else {}
        except json.JSONDecodeError as exc:
            raise errors.InvalidRequest(f"args_json is not JSON: {exc}") from None
        if not isinstance(args, dict):
            raise errors.InvalidRequest("args_json must be a JSON object")
        result = st.strategy.call(request.command, args)
        if request.command == "stats":
            result = dict(result, server=st.handlers.snapshot() | st.status() | {"threads_cpu_s": threads_cpu_s()})
        return embedding_pb2.StrategyCallReply(result_json=json.dumps(result))

    @transport.service_method
    def Echo(self, request, context):
        if request.reply_bytes > 0:
            if request.reply_bytes > self.state.config.max_message_bytes:
                raise errors.InvalidRequest(f"reply_bytes {request.reply_bytes} exceeds the message limit")
            return embedding_pb2.EchoMessage(data=bytes(request.reply_bytes))
        return request

    # --- control plane ---------------------------------------------------------------------------------------
    @transport.service_method
    def CreateTable(self, request, context):
        try:
            spec = TableSpec.from_proto(request).validate()
        except ValueError as exc:
            raise errors.InvalidRequest(str(exc)) from None
        self.state.create_table(spec)
        return embedding_pb2.Ack(epoch=self.state.epoch)

    @transport.service_method
    def CreateDense(self, request, context):
        spec, initial = parse_dense_spec(request.spec, request.initial_value)
        self.state.create_dense(spec, initial)
        return embedding_pb2.Ack(epoch=self.state.epoch)

    @transport.service_method
    def UpdateClusterMap(self, request, context):
        st = self.state
        st.adopt_map(request)
        recovering = st.promoting or (st.index >= 0 and st.strategy is not None and st.strategy.is_recovering())
        return embedding_pb2.Ack(epoch=st.epoch, recovering=recovering, index=-1 if st.promoting else st.index)

    @transport.service_method
    def Promote(self, request, context):
        recovering = self.state.promote(request.index, request.map, request.dense)
        return embedding_pb2.Ack(epoch=self.state.epoch, recovering=recovering)


def check_device(device: str) -> None:
    """``--device cuda`` needs a usable GPU kernel (cupy, a CUDA device, the kernel compiled and self-tested):
    raises RuntimeError naming what is missing.  ``cpu`` needs nothing: parity work then runs on the CPU
    even where a GPU works."""
    if device == "cpu":
        return
    if device != "cuda":
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    from ecrec.coding.kernels import gpu

    ok, why = gpu.probe()
    if not ok:
        raise RuntimeError(f"--device cuda: no usable GPU for the parity kernel: {why}; not registering "
                           "(run with --device cpu, or fix the CUDA setup)")


class EmbeddingServer:
    """Runs one embedding server: gRPC service, health service on its own port, registration, lease, timer."""

    def __init__(self, config: ServerConfig):
        self.config = config
        check_device(config.device)  # before binding or registering: a server that cannot serve takes no index
        self.public_host = config.public_host  # a wildcard --host without --advertise-host raises here
        security = config.security  # reads the certificate, key, CA and token files (an unusable one raises here)
        self._grpc = transport.make_server(config.max_workers, config.max_message_bytes, security)
        services = transport.LateServices()
        self._grpc.add_generic_rpc_handlers((services,))
        self.state = ServerState(config, server_id=f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
                                 services=services)
        embedding_pb2_grpc.add_EmbeddingServerServicer_to_server(EmbeddingServicer(self.state), self._grpc)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        self.port = transport.bind(self._grpc, config.host, config.port, security)
        self.state.address = f"{self.public_host}:{self.port}"
        # the coordinator's health checks have threads of their own: a server busy with pushes still answers
        self._health_grpc = transport.make_server(2, security=security)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_grpc)
        self.health_port = transport.bind(self._health_grpc, config.host, 0, security)
        self._stop = threading.Event()
        self.stopped = threading.Event()  # set when this server stops (replaced: its lease was refused)
        self._timer_thread: threading.Thread | None = None
        #: the lease on etcd, when the map names a lease store (the control plane is on etcd); else None: the
        #: coordinator grants it (RenewLease)
        self.etcd_lease: EtcdServerLease | None = None
        self._refreshing = threading.Lock()  # held while a map fetch the lease loop asked for is under way

    def start(self) -> None:
        self._grpc.start()
        self._health_grpc.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        # start the strategy (and compile its kernels) from the current map before registering: a compile holds
        # the interpreter for seconds, and a registered server that cannot answer its health checks is declared
        # failed
        deadline = time.monotonic() + self.config.register_timeout_s
        # warm whatever a promotion would compile (the kernel that fills new tables): a standby is ready to take
        # any index at once, whatever the strategy
        log.info("kernels warm in %.2f s", tables.warm_up())
        while self.state.map is None and time.monotonic() < deadline:
            self.state.refresh_map()
            if self.state.map is None:
                time.sleep(0.2)
        if self.state.map is not None and self.state.map.lease_store:
            cfg = self.config
            tls = EtcdTLS(cfg.tls_ca, cfg.tls_cert, cfg.tls_key) if cfg.tls_ca else None
            self.etcd_lease = EtcdServerLease(self.state.map.lease_store, self.state.map.lease_s, self.state.server_id,
                                              self.state.address, tls)
            self.etcd_lease.acquire(deadline)  # before registering: the coordinator checks the key
        self._register(max(1.0, deadline - time.monotonic()))
        self._timer_thread = threading.Thread(target=self._timer_loop, name="ecrec-strategy-timer", daemon=True)
        self._timer_thread.start()
        threading.Thread(target=self._lease_loop, name="ecrec-lease", daemon=True).start()

    def _register(self, timeout_s: float) -> None:
        stub = self.state.coordinator.stub
        deadline = time.monotonic() + timeout_s
        request = coordinator_pb2.RegisterRequest(
            address=self.state.address, standby=self.config.standby, server_id=self.state.server_id,
            want_index=self.config.want_index, health_address=f"{self.public_host}:{self.health_port}",
            etcd_lease=self.etcd_lease.id if self.etcd_lease is not None else 0,
        )
        # the etcd lease is kept alive all along (no coordinator may lead yet, or one may be slow to answer): a
        # registration never outlasts it
        registered = threading.Event()
        keeper = None
        if self.etcd_lease is not None:
            keeper = threading.Thread(target=self._keep_etcd_lease_until, args=(registered,),
                                      name="ecrec-lease-registering", daemon=True)
            keeper.start()
        try:
            while True:
                sent = time.monotonic()
                try:
                    reply = stub.Register(request, timeout=self.config.rpc_timeout_s)
                    break
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                        raise RuntimeError(f"cannot register with coordinator {self.config.coordinator}: "
                                           f"{exc.details()}") from None
                    if self.etcd_lease is not None and self.etcd_lease.gone:
                        break
                    time.sleep(0.2)
        finally:
            registered.set()
            if keeper is not None:
                keeper.join()
        if self.etcd_lease is not None:
            if self.etcd_lease.gone:  # revoked (it was replaced) or expired while registering: it never serves
                raise RuntimeError(f"this server's etcd lease {self.etcd_lease.id:x} is gone ({self.etcd_lease.gone}) "
                                   f"before it registered with coordinator {self.config.coordinator}")
            self.state.lease.grant(self.etcd_lease.renewed_at, self.etcd_lease.ttl_s)
        else:
            self.state.lease.grant(sent, reply.lease_s)
        try:
            self.state.set_server_key(reply.server_key)
        except ValueError as exc:
            raise RuntimeError(f"coordinator {self.config.coordinator} sent no usable server key ({exc}); "
                               "is it an older version?") from None
        with self.state.lock:
            if reply.index >= 0 and self.state.index < 0:
                self.state.index = reply.index
            self.state.adopt_map(reply.map)  # ignored when a broadcast brought a newer map first
        log.info("registered at %s as %s (epoch %d)", self.state.address,
                 f"index {reply.index}" if reply.index >= 0 else "standby", reply.map.epoch)

    def _keep_etcd_lease_until(self, done: threading.Event) -> None:
        """Keeps the etcd lease alive a third of its TTL ahead until ``done`` (the registration ended); it
        grants no serving lease (the registration does) and stops at once when etcd says the lease is gone."""
        lease = self.etcd_lease
        wait = max(0.0, lease.renewed_at + lease.ttl_s / 3.0 - time.monotonic())
        while not done.wait(wait) and not self._stop.is_set():
            try:
                sent, ttl = lease.renew()
            except EtcdError as exc:
                log.warning("renewing the etcd lease while registering: %s", exc)
                wait = lease.ttl_s / 9.0
                continue
            except Exception:  # noqa: BLE001 - e.g. its client closed by a stop meanwhile: reported, and ended
                if not self._stop.is_set():
                    log.exception("renewing the etcd lease while registering")
                return
            if ttl <= 0:
                return  # ``lease.gone`` says why
            wait = max(0.0, sent + lease.ttl_s / 3.0 - time.monotonic())

    def _lease_loop(self) -> None:
        """Renews the lease a third of its length ahead; stops this server when the coordinator refuses (it was
        declared failed and is being replaced)."""
        if self.etcd_lease is not None:
            return self._etcd_lease_loop()
        st = self.state
        while not self._stop.is_set():
            period = max(0.05, st.lease.length_s / 3) if st.lease.length_s else 0.5
            if self._stop.wait(period):
                return
            sent = time.monotonic()
            try:
                reply = st.coordinator.stub.RenewLease(coordinator_pb2.RenewLeaseRequest(
                    server_id=st.server_id, index=st.index, epoch=st.epoch), timeout=period)
            except grpc.RpcError as exc:
                log.warning("lease renewal failed (%s); serving until %.1f s from now", exc.code().name,
                            max(0.0, st.lease.until - time.monotonic()))
                continue
            if not reply.granted:
                log.error("the coordinator refused this server's lease (%s): it was replaced; stopping", reply.reason)
                st.lease.revoke(reply.reason)
                threading.Thread(target=self.stop, name="ecrec-stop", daemon=True).start()
                return
            st.lease.grant(sent, reply.lease_s)
            if reply.epoch > st.epoch:
                st.refresh_map()

    def _etcd_lease_loop(self) -> None:
        """Keeps the etcd lease alive a third of its TTL ahead (sooner after a failed try); stops this server when
        etcd says the lease is gone (the coordinator revoked it to replace this server, or it expired).  A
        renewal that shows a newer store revision than the map's fetch makes this server fetch the map."""
        st, lease = self.state, self.etcd_lease
        period = lease.ttl_s / 3.0
        seen = lease.revision
        wait = max(0.0, lease.renewed_at + period - time.monotonic())  # a third of the TTL from the last renewal
        while not self._stop.wait(wait):
            if st.map is not None:
                lease.follow(st.map.lease_store)
            try:
                sent, ttl = lease.renew()
            except EtcdError as exc:
                log.warning("etcd lease renewal failed (%s); serving until %.1f s from now", exc,
                            max(0.0, st.lease.until - time.monotonic()))
                wait = period / 3.0
                continue
            wait = max(0.0, sent + period - time.monotonic())  # a third of the TTL from this one, however long it took
            if ttl <= 0:
                log.error("this server's etcd lease %x is gone (%s); stopping", lease.id, lease.gone)
                st.lease.revoke(f"its etcd lease is gone ({lease.gone})")
                threading.Thread(target=self.stop, name="ecrec-stop", daemon=True).start()
                return
            st.lease.grant(sent, ttl)
            if lease.revision > seen and self._refresh_map_soon():
                seen = lease.revision

    def _refresh_map_soon(self) -> bool:
        """Fetches the map on a thread of its own (a slow coordinator never delays a lease renewal); False when
        a fetch is still under way."""
        if not self._refreshing.acquire(blocking=False):
            return False

        def run():
            try:
                self.state.refresh_map()
            finally:
                self._refreshing.release()
        threading.Thread(target=run, name="ecrec-map-refresh", daemon=True).start()
        return True

    def _timer_loop(self) -> None:
        while not self._stop.is_set():
            strategy = self.state.strategy
            interval = getattr(strategy, "timer_interval_s", None) if strategy else None
            if self._stop.wait(interval or 0.5):
                return
            if interval and self.state.index >= 0 and self.state.lease.valid():
                try:
                    strategy.on_timer()
                except Exception:  # noqa: BLE001 - reported, never swallowed
                    log.exception("strategy %s: on_timer failed", strategy.name)

    def wait(self) -> None:
        self._grpc.wait_for_termination()

    def stop(self, grace_s: float = 2.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._health.enter_graceful_shutdown()
        if self.state.strategy is not None:
            try:
                self.state.strategy.close()
            except Exception:  # noqa: BLE001
                log.exception("strategy close failed")
        self._grpc.stop(grace_s).wait()
        self._health_grpc.stop(0).wait()
        if self.etcd_lease is not None:
            self.etcd_lease.release()
        self.stopped.set()
