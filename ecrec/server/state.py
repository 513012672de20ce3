"""A server's state: what it holds (its index, the map, its shards of tables and dense tensors, the pushes it
applied, its lease, its strategy) and every change to it (a new map, a table, a promotion).

:class:`ServerState` is what a strategy sees of its server: it implements
:class:`ecrec.strategies.base.StrategyHost`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time

import grpc
import numpy as np

from ecrec import errors, faults
from ecrec.coding.layout import Layout
from ecrec.config import ServerConfig
from ecrec.control.lease import ServingLease
from ecrec.net import transport
from ecrec.net.peers import CoordinatorClient, Peers
from ecrec.net.seal import Sealer
import ecrec.server.collector as collector
from ecrec.server.applied import AppliedPushes, PushSequencer
from ecrec.server.cut import PushHold, ServerCuts
from ecrec.server.counters import HandlerCounters
from ecrec.server.requests import parse_dense_spec, validate_map
from ecrec.server.reserve import Reserve
from ecrec.strategies.base import FaultToleranceStrategy
from ecrec.strategies.registry import get_spec
from ecrec.tables import spec as tables
from ecrec.tables.shards import DenseShard, TableShard
from ecrec.tables.spec import DenseSpec, TableSpec
from ecrec.wire import cluster_pb2

log = logging.getLogger("ecrec.server")


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
        self.applied = AppliedPushes(config.max_applied_bytes, config.forget_idle_marks_s)
        self.sequencer = PushSequencer()
        self.handlers = HandlerCounters()
        self.lease = ServingLease()
        self._promote_lock = threading.Lock()
        self._promoted_to = -1  # the index a finished promotion gave this server
        self.apply_lock = threading.Lock()  # pushes apply one at a time (the strategy sees a total order)
        # a snapshot's cut: pushes wait meanwhile, a quarter of the handler threads at most (the rest are told to
        # retry), so that the snapshot's own calls and the other pushes' find a thread
        self.hold = PushHold(self.apply_lock, config.max_push_hold_s, max_waiters=max(1, config.max_workers // 4))
        self.cuts = ServerCuts(max_ttl_s=config.max_snapshot_s)  # snapshots' cuts being written: rows as at each
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
        self.cluster_id = ""  # (set with the server key)
        self._refresh_lock = threading.Lock()
        self._refreshed_at = float("-inf")  # when a caller's newer epoch last made this server fetch the map
        self._fetched_at = float("-inf")  # ... and when the last such fetch that succeeded began

    def set_server_key(self, key: bytes) -> None:
        """The cluster's server key (the coordinator's Register reply): what this server seals batches and
        watermarks with, and proves its identity to peers with."""
        self.sealer = Sealer(key)
        self._proof = self.sealer.caller_proof(self._server_id)
        # the cluster this server belongs to, named without its secret: a new cluster has a new key, a
        # restarted coordinator keeps its own (files a strategy writes carry it: ``StrategyHost.cluster_id``)
        self.cluster_id = hashlib.sha256(b"ecrec-cluster-id\0" + bytes(key)).hexdigest()[:16]

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
        self.check_member(caller, epoch)
        return caller

    def check_member(self, caller: str, caller_epoch: int = 0) -> None:
        """``caller`` (proven a server of this cluster) is still a server of the map, after catching up with its
        newer epoch: an old incarnation of a peer is fenced off (``FailedPrecondition``)."""
        if caller_epoch > self.epoch:
            self.catch_up(caller_epoch)
        if self.map is not None and not any(s.server_id == caller and s.state != cluster_pb2.FAILED
                                            for s in self.map.servers):
            raise errors.FailedPrecondition(f"caller {caller} is not a server of the cluster map (epoch {self.epoch}): "
                                            "an old incarnation or a stranger; refused")

    def tables(self) -> list[TableShard]:
        with self.lock:
            return [self._tables[name] for name in sorted(self._tables)]

    def table(self, name: str) -> TableShard:
        shard = self._tables.get(name)
        if shard is None:
            raise errors.NotFound(f"unknown table {name!r}")
        return shard

    def serving_table(self, name: str) -> TableShard:
        """A table to read or push to: refused as busy (the caller retries) while a restore in bulk rewrites it
        (``ecrec.snapshot.bulk``); a read compares ``shard.fills`` before and after (:meth:`still_serving`)."""
        shard = self.table(name)
        if shard.restore is not None:
            raise errors.Busy(restoring(shard))
        return shard

    @staticmethod
    def still_serving(shards_and_fills) -> None:
        """After a read of ``(shard, fills seen before)``: refused as busy when a restore began meanwhile (the rows
        read may be half rewritten)."""
        for shard, fills in shards_and_fills:
            if shard.restore is not None or shard.fills != fills:
                raise errors.Busy(restoring(shard))

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

    def last_push_seq(self) -> int:
        return self.sequencer.last

    def status(self) -> dict:
        """Who this server is and what it holds (``ecrec-server status``, the metrics endpoint)."""
        return {"index": self.index, "epoch": self.epoch, "server_id": self._server_id, "address": self.address,
                "metrics_address": self.metrics_address,
                "lease_remaining_s": self.lease.remaining_s(),
                "data_rows": sum(len(shard.owned_ids) for shard in self.tables()),
                "dense_tensors": len(self.dense_tensors()),
                "standby_reserve_bytes": self.reserve.nbytes, "standby_reserve_pending": self.reserve.pending,
                "standby_reserve_used_bytes": self.reserve.used_bytes, "kernels_ready": tables.kernels_ready(),
                "snapshot_cuts": len(self.cuts), "snapshot_cut_bytes": self.cuts.nbytes,
                **collector.watch().status()}

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
            if new_map.tables and self.strategy.fills_in_bulk:
                from ecrec.snapshot import bulk

                bulk.adopt_marks(self)  # a table its peers are restoring is refused here too
            return bool(self.strategy.on_recovery(index))
        finally:
            self._promoting = False
            self.reserve.close()  # what the promotion did not take is freed


def restoring(shard: TableShard) -> str:
    return (f"table {shard.name!r} is being restored from a snapshot (in bulk): it serves again once every server "
            "holds it; a restore cut short is finished by loading the snapshot again")
