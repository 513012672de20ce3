"""The coordinator: keeps the cluster map, creates tables, watches servers, promotes standbys.

The map (servers by index, standbys, tables, dense specs, the strategy and its parameters) changes only
here, and every change increases its **epoch** and is pushed to every server (retried until each has it;
servers also learn the newest epoch with every lease renewal).  Clients read the map with
``GetClusterMap`` and refresh it when a call fails.

Failure detection and fencing: every server holds a **lease** it renews (``RenewLease``); it serves only
while its lease lasts, and a renewal is refused once it has been declared failed.  Servers are watched
with the standard gRPC health service on a port of their own (a busy server still answers).  A server is
declared failed when a connection to it is refused (the process is gone) or when it misses
``failures_before_dead`` checks in a row spanning at least ``failure_timeout_s`` (a client's report only
triggers a check).  Its replacement is promoted once it is surely not serving: at once when its process
is gone, else only after its lease has run out.  A promotion is recorded before the standby hears of it (its
entry ``PROMOTING`` at the index; the ``Promote`` carries that recorded map), runs on its own thread with a
deadline, and skips a standby that stops answering health checks meanwhile.  The map and promotions in
progress are kept in a store (``ecrec.control.stores``): with ``state_path`` a local file written atomically, so a
restarted coordinator keeps them and finishes the promotions; with ``--store etcd://...`` one etcd key written by
compare-and-swap, shared by several coordinators of which one leads (elected through etcd) and the others
answer ``GetClusterMap`` from etcd and send every other call to the leader (UNAVAILABLE naming it).  A change
the store did not record is rolled back and not acted on.  ``RECOVERING`` servers are asked for their state
until they report full redundancy.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import socket
import threading
import time
from collections import OrderedDict
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ecrec import faults
from ecrec.net import seal, transport
from ecrec.config import CoordinatorConfig
from ecrec.control.etcd import EtcdTLS, etcd_url
from ecrec.control.etcd_lease import lease_ttl_s
from ecrec.control.stores import EtcdStore, FileStore, NotLeader, StoreUnavailable, parse_store
from ecrec.coding.layout import Layout
from ecrec.strategies import get_spec
from ecrec.tables.spec import DenseSpec, TableSpec
from ecrec.wire import cluster_pb2, coordinator_pb2, coordinator_pb2_grpc, embedding_pb2, embedding_pb2_grpc

log = logging.getLogger("ecrec.coordinator")

ACTIVE = cluster_pb2.ACTIVE
STANDBY = cluster_pb2.STANDBY
FAILED = cluster_pb2.FAILED
RECOVERING = cluster_pb2.RECOVERING
PROMOTING = cluster_pb2.PROMOTING
#: lost stripes listed in a map's data-loss entry (all of them are counted)
DATA_LOSS_LISTED = 64


class _ServerHandle:
    """Stubs for one server address (health checks go to its health address when it has one)."""

    def __init__(self, address: str, health_address: str = "", security=None):
        self.channel = transport.make_channel(address, security=security)
        self.embedding = embedding_pb2_grpc.EmbeddingServerStub(self.channel)
        self.health_address = health_address or address
        self.health = health_pb2_grpc.HealthStub(
            self.channel if not health_address else transport.make_channel(health_address, security=security))
        self.failed_checks = 0
        self.first_failed_at = 0.0  # monotonic time of the first check of the current run of failures
        self.map_epoch = 0  # the newest map this server acknowledged


def _connection_refused(address: str, timeout_s: float) -> bool:
    """Whether a TCP connection to ``address`` is refused: nothing listens there, so the process is gone (a
    paused or partitioned process still accepts, or times out)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


class Coordinator(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, config: CoordinatorConfig):
        self.config = config
        spec = config.cluster
        self.strategy_spec = get_spec(spec.strategy)
        k, m, options = self.strategy_spec.layout_params(spec.num_servers, spec.k, spec.m, dict(spec.strategy_options))
        self.layout = Layout(spec.num_servers, k, m)
        self._lock = threading.RLock()
        self._create_lock = threading.Lock()
        self._handles: dict[str, _ServerHandle] = {}
        self._dense: OrderedDict[str, coordinator_pb2.RegisterDenseRequest] = OrderedDict()
        self._broadcast_pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="ecrec-broadcast")
        self._stop = threading.Event()
        self._wake = threading.Event()  # set to run the monitor now (a registration, a failure)
        self._promote_lock = threading.Lock()
        self._promote_wake = threading.Event()  # wakes the promoter (a failure declared, a standby registered)
        self._promoted = threading.Condition()  # notified after each round of promotions
        self.faults = faults.coordinator_from_environment()  # fault injection for tests (ecrec.faults); off
        self._check_pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="ecrec-health-check")
        self._wanted: dict[str, int] = {}  # standby server_id -> the index it asked for (a restarted server)
        self._leases: dict[str, float] = {}  # server_id -> when its lease runs out (monotonic, this clock)
        #: etcd leases (``map.lease_store``): failed servers whose end this leader has not timed yet.  A TTL is
        #: counted from this leader's own answered revocation, or from when it first sees the key gone (a deposed
        #: leader's revocation, or an operator's, may land at any moment before); none is replaced until then
        self._untimed: set[str] = set()
        #: standbys removed from the map whose etcd lease is still to be revoked (kept until etcd answers)
        self._dropped: set[str] = set()
        self._gone: set[str] = set()  # failed servers whose process is known gone (connection refused)
        self._lost_stripes: dict[str, set[int]] = {}  # table -> every lost stripe reported (the map lists some)
        self._promoting: dict[str, coordinator_pb2.PendingPromotion] = {}  # server_id -> promotion in progress
        self._map_pusher = threading.Event()  # wakes the map broadcaster
        self.map = cluster_pb2.ClusterMap(
            epoch=1, num_servers=spec.num_servers, strategy=spec.strategy, k=k, m=m,
        )
        self.map.strategy_options.update({str(a): str(b) for a, b in options.items()})
        self.server_key = seal.new_key()  # servers seal what workers carry with it (ecrec.net.seal); never in the map
        self._initial = cluster_pb2.ClusterMap()
        self._initial.CopyFrom(self.map)
        self._saved = b""  # the state the store holds (serialized): a change it refused is rolled back to this
        self._saved_sets: tuple[set, dict] = (set(), {})  # ... with the gone servers and wanted indices then
        #: set while this coordinator leads (always with a file store; with etcd once elected)
        self.leading = threading.Event()
        kind, store_args = parse_store(config.store)  # raises ValueError naming a bad --store
        if kind == "etcd" and config.state_path:
            raise ValueError("--store etcd://... and --state-path both name where the map is kept: choose one")
        if kind == "etcd" and config.election_ttl_s < 2:
            raise ValueError(f"--election-ttl-s must be at least 2 (etcd's shortest lease), got {config.election_ttl_s}")
        self._store_args = store_args if kind == "etcd" else None
        # how long after a server's last renewal it may still serve: with etcd, the TTL of its etcd lease (a saved
        # map's, when longer: ``_load``)
        self._own_lease_wait_s = lease_ttl_s(config.lease_s) if kind == "etcd" else config.lease_s
        self._lease_wait_s = self._own_lease_wait_s
        if kind == "etcd":  # servers hold etcd leases there (ecrec.control.lease)
            for m in (self.map, self._initial):
                m.lease_store = etcd_url(store_args["endpoints"], store_args["prefix"])
                m.lease_s = self._lease_wait_s
        path = store_args.get("path") or config.state_path
        self.store = FileStore(path)
        if path and os.path.exists(path):
            self._load(self.store.load(), path)
        self._saved = self._state_locked().SerializeToString()

    # --- persistence -----------------------------------------------------------------------------
    def _load(self, state: coordinator_pb2.CoordinatorState, path: str) -> None:
        saved = state.map
        if (saved.num_servers, saved.strategy, saved.k, saved.m) != (self.map.num_servers, self.map.strategy, self.map.k, self.map.m):
            raise ValueError(
                f"{path} holds a map for {saved.num_servers} servers, strategy {saved.strategy!r}, k={saved.k}, m={saved.m}; "
                f"this coordinator was started for {self.map.num_servers}, {self.map.strategy!r}, k={self.map.k}, m={self.map.m}"
            )
        self.map.CopyFrom(saved)
        self.map.epoch = saved.epoch + 1
        if self.map.lease_store and saved.lease_s > self._own_lease_wait_s:
            # its servers were granted etcd leases that long: a shorter wait would not cover them.  Kept from now
            # on (servers that register later get it too): a shorter --lease-s takes effect with a new cluster
            log.warning("the saved map's servers hold %g s etcd leases, longer than this coordinator's %g s "
                        "(--lease-s): keeping %g s", saved.lease_s, self._own_lease_wait_s, saved.lease_s)
            self._lease_wait_s = lease_ttl_s(saved.lease_s)
        if self.map.lease_store:
            self.map.lease_s = self._lease_wait_s
        for d in state.dense:
            self._dense[d.spec.name] = d
        for p in state.promoting:
            self._promoting[p.server_id] = p
        if state.server_key:  # the servers registered with it hold it: a restarted coordinator keeps it
            self.server_key = seal.check_key(state.server_key)
        # every server's lease is unknown: wait a whole lease before promoting over any of them
        now = time.monotonic()
        for s in self.map.servers:
            self._leases[s.server_id] = now + self._lease_wait_s
        log.info("restored the cluster map from %s (epoch %d, %d tables)", path, self.map.epoch, len(self.map.tables))

    def take_over(self, store) -> cluster_pb2.ClusterMap:
        """This coordinator was elected through ``store`` (etcd): adopts the state it holds (a fresh map when
        there is none yet), records it with a new epoch, and leads.  Raises what the store raises; then it
        does not lead."""
        with self._lock:
            self.store = store
            state = store.load()
            self.map.CopyFrom(self._initial)
            self._dense.clear()
            self._promoting.clear()
            self._lost_stripes.clear()
            self._handles.clear()
            self._gone.clear()
            self._wanted.clear()
            self._leases.clear()
            self._untimed.clear()
            self._dropped.clear()
            self._lease_wait_s = self._own_lease_wait_s
            if state is not None:
                self._load(state, store.describe())
                self._saved = state.SerializeToString()
                if self.map.lease_store:
                    # a deposed leader (or an operator) may revoke a failed server's lease at any moment: its end
                    # is timed from this leader's own revocation, or from when it sees the key gone
                    self._untimed.update(s.server_id for s in self.map.servers if s.state == FAILED)
            else:
                self._saved = self._state_locked().SerializeToString()
            if self.map.lease_store:  # servers reach etcd where this leader and etcd's member list say
                self.map.lease_store = store.lease_store_url()
            self.leading.set()
            try:
                snapshot = self._bump_locked()
            except BaseException:
                self.leading.clear()
                raise
        return snapshot

    def step_down(self, why: str) -> None:
        """This coordinator no longer leads (its etcd lease is gone): it changes nothing from now on."""
        with self._lock:
            if self.leading.is_set():
                log.error("coordinator steps down: %s", why)
            self.leading.clear()

    def _state_locked(self) -> coordinator_pb2.CoordinatorState:
        return coordinator_pb2.CoordinatorState(map=self.map, dense=list(self._dense.values()),
                                                promoting=list(self._promoting.values()), server_key=self.server_key)

    def _save_locked(self) -> None:
        """Records the state in the store; when the store refuses it (not the leader, or unreachable) every change
        since the last recorded state is rolled back and the error raised, so nothing unrecorded is acted on."""
        state = self._state_locked()
        try:
            self.faults.hit("record_map")
            if self.store.kind != "file" and not self.leading.is_set():
                raise NotLeader("this coordinator does not lead")
            self.store.save(state)
        except Exception:
            self._roll_back_locked()
            raise
        self._saved = state.SerializeToString()
        self._saved_sets = (set(self._gone), dict(self._wanted))

    def _roll_back_locked(self) -> None:
        gone, wanted = self._saved_sets
        self._gone, self._wanted = set(gone), dict(wanted)
        saved = coordinator_pb2.CoordinatorState.FromString(self._saved)
        self.map.CopyFrom(saved.map)
        self._dense.clear()
        for d in saved.dense:
            self._dense[d.spec.name] = d
        self._promoting.clear()
        for p in saved.promoting:
            self._promoting[p.server_id] = p

    # --- map helpers (call with the lock held) -------------------------------------------------------
    def _handle(self, address: str) -> _ServerHandle:
        h = self._handles.get(address)
        if h is None:
            info = next((s for s in self.map.servers if s.address == address), None)
            h = self._handles[address] = _ServerHandle(address, info.health_address if info is not None else "",
                                                                 self.config.security)
        return h

    def _servers(self, state=None) -> list[cluster_pb2.ServerInfo]:
        return [s for s in self.map.servers if state is None or s.state == state]

    def _at_index(self, index: int) -> cluster_pb2.ServerInfo | None:
        for s in self.map.servers:
            if s.index == index and s.state != FAILED:
                return s
        return None

    def _event_locked(self, kind: str, index: int, address: str) -> None:
        self.map.events.add(kind=kind, index=index, address=address, wall_time=time.time(), epoch=self.map.epoch + 1)
        if len(self.map.events) > 1000:
            del self.map.events[: len(self.map.events) - 1000]

    def _bump_locked(self) -> cluster_pb2.ClusterMap:
        self.map.epoch += 1
        live = {s.index for s in self.map.servers if s.index >= 0 and s.state in (ACTIVE, RECOVERING)}
        self.map.ready = len(live) == self.map.num_servers
        # keep servers sorted: by index, standbys last, failed entries dropped once replaced
        entries = sorted(self.map.servers, key=lambda s: (s.index < 0, s.index, s.state == FAILED))
        del self.map.servers[:]
        self.map.servers.extend(entries)
        self._save_locked()
        snapshot = cluster_pb2.ClusterMap()
        snapshot.CopyFrom(self.map)
        return snapshot

    def _broadcast(self, snapshot: cluster_pb2.ClusterMap) -> None:
        """Sends the map to every server not declared failed; the broadcaster retries those that missed it."""
        for s in snapshot.servers:
            if s.state == FAILED:
                continue
            h = self._handle(s.address)
            if self._stop.is_set():
                return  # stopping: the pool is shut down
            try:
                fut = self._broadcast_pool.submit(h.embedding.UpdateClusterMap, snapshot,
                                                  timeout=self.config.rpc_timeout_s)
            except RuntimeError:  # the pool was shut down meanwhile (the coordinator stops)
                return
            fut.add_done_callback(lambda f, h=h, epoch=snapshot.epoch: self._map_sent(h, epoch, f))

    def _map_sent(self, h: _ServerHandle, epoch: int, fut) -> None:
        if fut.exception() is None:
            h.map_epoch = max(h.map_epoch, epoch)
        else:
            log.debug("map update to %s failed: %s", h.health_address, fut.exception())
            self._map_pusher.set()

    def _rebroadcast(self) -> None:
        """Sends the current map again to every live server that has not acknowledged it (or a newer one)."""
        with self._lock:
            epoch = self.map.epoch
            behind = [s for s in self.map.servers if s.state != FAILED and self._handle(s.address).map_epoch < epoch]
            snapshot = cluster_pb2.ClusterMap()
            snapshot.CopyFrom(self.map)
        for s in behind:
            h = self._handle(s.address)
            try:
                h.embedding.UpdateClusterMap(snapshot, timeout=self.config.health_timeout_s)
                h.map_epoch = max(h.map_epoch, epoch)
            except grpc.RpcError:
                pass

    # --- RPCs ------------------------------------------------------------------------------------
    def Register(self, request, context):
        if not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address is required")
        etcd_leases = self._check_etcd_lease(request, context) if self.map.lease_store else None
        with self._lock:
            holder = next((s for s in self.map.servers if s.address == request.address and s.state != FAILED
                           and s.server_id != request.server_id), None)
            if etcd_leases is not None:
                leased = holder is not None and holder.server_id in etcd_leases
            else:
                leased = holder is not None and self._leases.get(holder.server_id, 0.0) > time.monotonic()
            holder_id = holder.server_id if holder is not None else ""
            holder_health = (holder.health_address or holder.address) if holder is not None else ""
        if leased and self._answers(request.address):
            # a live server holds this address: the caller is mistaken or hostile, not a restart of it
            context.abort(grpc.StatusCode.ALREADY_EXISTS,
                          f"{request.address} is held by live server {holder_id} (its lease is current and it answers "
                          "health checks); a restarted server registers once the old one is gone")
        # the old process is gone when nothing listens on its health port any more; a paused one (the new process
        # may share its data port) may serve until its lease ends, which a promotion over it waits
        holder_gone = bool(holder_health) and _connection_refused(holder_health, self.config.health_timeout_s)
        with self._lock:
            for s in self.map.servers:
                if s.address == request.address and s.state != FAILED:
                    if s.server_id == request.server_id:  # a retried Register
                        self._leases[s.server_id] = time.monotonic() + self.config.lease_s
                        return coordinator_pb2.RegisterReply(map=self.map, index=s.index, lease_s=self.config.lease_s,
                                                             server_key=self.server_key)
                    s.state = FAILED  # the same address re-registers: the old process is gone or unresponsive
                    if s.server_id == holder_id and holder_gone:
                        self._gone.add(s.server_id)
                    elif etcd_leases is not None:  # fenced (its lease revoked) and timed before a promotion
                        self._untimed.add(s.server_id)
                        self._leases[s.server_id] = max(self._leases.get(s.server_id, 0.0),
                                                        time.monotonic() + self._lease_wait_s)
            taken = {s.index for s in self.map.servers if s.index >= 0 and s.state != FAILED}
            forming = len(self.map.tables) == 0 and len(self._dense) == 0
            index = -1
            if not request.standby and forming:
                if 0 <= request.want_index < self.map.num_servers and request.want_index not in taken:
                    index = request.want_index
                else:
                    free = [i for i in range(self.map.num_servers) if i not in taken]
                    index = free[0] if free else -1
            info = self.map.servers.add(
                index=index, address=request.address, server_id=request.server_id or request.address,
                state=ACTIVE if index >= 0 else STANDBY, health_address=request.health_address,
            )
            if index < 0 and request.want_index >= 0:
                self._wanted[info.server_id] = request.want_index
            self._handles.pop(request.address, None)  # a new process at this address: new stubs, new counters
            self._leases[info.server_id] = time.monotonic() + self.config.lease_s
            snapshot = self._bump_locked()
        log.info("registered %s as %s (epoch %d)", request.address, f"index {index}" if index >= 0 else "standby", snapshot.epoch)
        self._broadcast(snapshot)
        self._wake.set()
        self._promote_wake.set()
        return coordinator_pb2.RegisterReply(map=snapshot, index=index, lease_s=self.config.lease_s,
                                             server_key=self.server_key)

    def _check_etcd_lease(self, request, context) -> dict[str, int]:
        """With etcd leases: aborts the registration unless the caller's key exists, bound to the lease it names;
        returns every server's lease."""
        if not request.etcd_lease:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this cluster's servers hold etcd leases (lease store {self.map.lease_store}): grant one and "
                          "bind PREFIX/servers/<server_id> to it before registering (an older ecrec-server?)")
        try:
            leases = self.store.server_leases()
        except StoreUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd cannot be read to check the server's lease: {exc}")
        if leases.get(request.server_id or request.address) != request.etcd_lease:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"etcd holds no key servers/{request.server_id} bound to lease {request.etcd_lease:x}: "
                          "bind it before registering")
        return leases

    def _answers(self, address: str) -> bool:
        """Whether the server registered at ``address`` answers a health check now."""
        with self._lock:
            h = self._handle(address)
        try:
            resp = h.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.config.health_timeout_s)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def RenewLease(self, request, context):
        """Extends a server's lease while the map holds it (active, recovering or standby), else refuses: a
        server that has been declared failed stops serving at once."""
        if self.map.lease_store:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this cluster's servers hold etcd leases (lease store {self.map.lease_store}), not leases "
                          "renewed with the coordinator")
        with self._lock:
            info = next((s for s in self.map.servers if s.server_id == request.server_id and s.state != FAILED), None)
            if info is None:
                return coordinator_pb2.RenewLeaseReply(granted=False, epoch=self.map.epoch,
                                                       reason="not in the cluster map (declared failed or unknown)")
            if request.index >= 0 and info.index != request.index and info.state != STANDBY:
                return coordinator_pb2.RenewLeaseReply(granted=False, epoch=self.map.epoch,
                                                       reason=f"holds index {info.index}, not {request.index}")
            self._leases[request.server_id] = time.monotonic() + self.config.lease_s
            return coordinator_pb2.RenewLeaseReply(granted=True, lease_s=self.config.lease_s, epoch=self.map.epoch)

    def ReportDataLoss(self, request, context):
        """A replacement cannot rebuild some stripes: recorded in the map (and its events) for every client."""
        with self._lock:
            info = next((s for s in self.map.servers if s.index == request.index and s.server_id == request.server_id
                         and s.state != FAILED), None)
            if info is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"server {request.server_id!r} does not hold index {request.index}")
            changed = [entry for entry in (self._merge_data_loss_locked(d) for d in request.lost) if entry is not None]
            for _ in changed:
                self._event_locked("data_loss", request.index, info.address)
            snapshot = self._bump_locked() if changed else None
        if snapshot is not None:
            log.error("index %d reports data loss: %s", request.index,
                      "; ".join(f"table {d.table!r}: {d.stripe_count} stripes lost in all" for d in changed))
            self._broadcast(snapshot)
        with self._lock:
            return cluster_pb2.ClusterMap.FromString(self.map.SerializeToString())

    def _merge_data_loss_locked(self, report: cluster_pb2.DataLoss) -> cluster_pb2.DataLoss | None:
        """Folds one report into the map's single entry for its table (every replacement of a lost stripe's
        members reports it, some more than once): the union of the stripes (the first
        ``DATA_LOSS_LISTED`` listed, all counted), of the indices, the first report's time.  Returns the
        entry when the report added something, else None."""
        if not (report.stripes or report.stripe_count):
            return None  # reports no stripe: nothing to record
        lost = self._lost_stripes.setdefault(report.table, set())
        entry = next((d for d in self.map.data_loss if d.table == report.table), None)
        if entry is None:
            entry = self.map.data_loss.add(table=report.table, wall_time=report.wall_time or time.time())
        elif not lost:  # a restarted coordinator: only the listed stripes are known
            lost.update(entry.stripes)
        before = (len(lost), entry.stripe_count, len(entry.indices))
        lost.update(report.stripes)
        entry.stripe_count = max(len(lost), entry.stripe_count, report.stripe_count)
        entry.stripes[:] = heapq.nsmallest(DATA_LOSS_LISTED, lost)
        entry.indices[:] = sorted(set(entry.indices) | set(report.indices))
        return entry if (len(lost), entry.stripe_count, len(entry.indices)) != before else None

    def GetClusterMap(self, request, context):
        with self._lock:
            return cluster_pb2.ClusterMap.FromString(self.map.SerializeToString())

    def CreateTable(self, request, context):
        try:
            spec = TableSpec.from_proto(request).validate()
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with self._create_lock:
            with self._lock:
                for t in self.map.tables:
                    if t.name == spec.name:
                        if TableSpec.from_proto(t) == spec:
                            return cluster_pb2.ClusterMap.FromString(self.map.SerializeToString())
                        context.abort(
                            grpc.StatusCode.ALREADY_EXISTS,
                            f"table {spec.name!r} exists with a different spec ({TableSpec.from_proto(t)})",
                        )
                if not self.map.ready:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, self._not_ready_message())
                targets = [s.address for s in self.map.servers if s.index >= 0 and s.state in (ACTIVE, RECOVERING)]
            error = self._call_all(targets, lambda stub: stub.CreateTable(spec.to_proto(), timeout=self.config.create_timeout_s))
            if error:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"creating table {spec.name!r}: {error}")
            with self._lock:
                self.map.tables.append(spec.to_proto())
                snapshot = self._bump_locked()
        log.info("created table %s (%d rows x %d, %s)", spec.name, spec.num_rows, spec.dim, spec.optimizer)
        self._broadcast(snapshot)
        return snapshot

    def RegisterDense(self, request, context):
        try:
            spec = DenseSpec.from_proto(request.spec).validate()
            transport.bytes_to_floats(request.initial_value, spec.shape)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with self._create_lock:
            with self._lock:
                existing = self._dense.get(spec.name)
                if existing is not None:
                    if DenseSpec.from_proto(existing.spec) == spec:
                        return cluster_pb2.ClusterMap.FromString(self.map.SerializeToString())
                    context.abort(grpc.StatusCode.ALREADY_EXISTS, f"dense tensor {spec.name!r} exists with a different spec")
                if not self.map.ready:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, self._not_ready_message())
                targets = [self._at_index(i).address for i in self.layout.dense_servers(spec.name)]
            req = embedding_pb2.CreateDenseRequest(spec=spec.to_proto(), initial_value=request.initial_value)
            error = self._call_all(targets, lambda stub: stub.CreateDense(req, timeout=self.config.create_timeout_s))
            if error:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"creating dense tensor {spec.name!r}: {error}")
            with self._lock:
                self._dense[spec.name] = coordinator_pb2.RegisterDenseRequest(spec=spec.to_proto(), initial_value=request.initial_value)
                self.map.dense.append(spec.to_proto())
                snapshot = self._bump_locked()
        self._broadcast(snapshot)
        return snapshot

    def ReportFailure(self, request, context):
        with self._lock:
            known = any(s.address == request.address for s in self.map.servers)
        if not known:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no server at {request.address!r} in the map")
        log.info("client reports %s: %s", request.address, request.detail or "(no detail)")
        if not self._check_server(request.address):
            # promote a standby now when it is safe, so the reply names the replacement; never longer than a
            # promotion deadline (the promoter runs on its own thread; the client follows the map meanwhile)
            with self._promoted:
                self._promote_wake.set()
                self._promoted.wait(self.config.promote_timeout_s)
        with self._lock:
            return cluster_pb2.ClusterMap.FromString(self.map.SerializeToString())

    def ReportRedundant(self, request, context):
        with self._lock:
            info = next((s for s in self.map.servers if s.index == request.index and s.server_id == request.server_id
                         and s.state != FAILED), None)
            if info is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"server {request.server_id!r} does not hold index {request.index}")
            if info.state == PROMOTING:  # its Promote's answer is still on its way here: the server retries
                context.abort(grpc.StatusCode.UNAVAILABLE, f"the promotion of {request.server_id!r} to index "
                              f"{request.index} is not recorded yet; retry")
        snapshot = self._mark_redundant(request.index, request.server_id,
                                        f"rebuild took {request.rebuild_seconds:.2f} s")
        if snapshot is not None:
            return snapshot
        with self._lock:
            return cluster_pb2.ClusterMap.FromString(self.map.SerializeToString())

    # --- helpers ---------------------------------------------------------------------------------
    def _not_ready_message(self) -> str:
        live = sum(1 for s in self.map.servers if s.index >= 0 and s.state in (ACTIVE, RECOVERING))
        return f"cluster not ready: {live} of {self.map.num_servers} servers hold their index"

    def _call_all(self, addresses: list[str], call) -> str | None:
        """Runs ``call(stub)`` on every address in parallel; returns the first error's text or None."""
        with self._lock:
            stubs = [(a, self._handle(a).embedding) for a in addresses]
        errors = []
        with futures.ThreadPoolExecutor(max_workers=max(1, len(stubs))) as pool:
            for address, fut in [(a, pool.submit(call, s)) for a, s in stubs]:
                try:
                    fut.result()
                except grpc.RpcError as exc:
                    errors.append(f"server {address}: {exc.code().name}: {exc.details()}")
        return "; ".join(errors) or None

    # --- failure detection and promotion ---------------------------------------------------------
    def _check_server(self, address: str) -> bool:
        """Health-checks ``address``; declares it failed when nothing listens there any more (its process is
        gone), or when it has failed ``failures_before_dead`` checks in a row over at least
        ``failure_timeout_s``.  True if alive."""
        h = self._handle(address)
        try:
            resp = h.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.config.health_timeout_s)
            alive = resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            alive = False
        if alive:
            h.failed_checks = 0
            return True
        now = time.monotonic()
        if h.failed_checks == 0:
            h.first_failed_at = now
        h.failed_checks += 1
        gone = _connection_refused(address, self.config.health_timeout_s)
        if gone or (h.failed_checks >= self.config.failures_before_dead
                    and now - h.first_failed_at >= self.config.failure_timeout_s):
            self._declare_failed(address, gone)
        return False

    def _declare_failed(self, address: str, gone: bool = False, why: str = "") -> None:
        with self._lock:
            info = next((s for s in self.map.servers if s.address == address and s.state != FAILED), None)
            if info is None:
                return
            if gone:
                self._gone.add(info.server_id)
            elif self.map.lease_store:
                # its etcd lease may have been revoked (by a deposed leader, by hand) moments ago: it may serve
                # until its next renewal, so a TTL from now bounds it, until this leader times its end
                self._leases[info.server_id] = max(self._leases.get(info.server_id, 0.0),
                                                   time.monotonic() + self._lease_wait_s)
                if info.state != STANDBY:
                    self._untimed.add(info.server_id)
            was_standby = info.state == STANDBY
            if was_standby:
                self.map.servers.remove(info)
                if self.map.lease_store:
                    self._dropped.add(info.server_id)
            else:
                info.state = FAILED
                self._event_locked("failed", info.index, address)
            snapshot = self._bump_locked()
        log.warning("server %s (%s) declared failed (%s); epoch %d", address,
                    "standby" if was_standby else f"index {info.index}",
                    "its process is gone" if gone else why or "missed its health checks", snapshot.epoch)
        self._broadcast(snapshot)
        if self.map.lease_store and not gone:
            self._fence_etcd_leases()
        self._wake.set()
        self._promote_wake.set()

    def _safe_to_replace(self, failed: list[cluster_pb2.ServerInfo], etcd_leases: dict[str, int] | None) -> bool:
        """Whether none of ``failed`` can still be serving: each is gone, or its lease has run out (with etcd
        leases: its key is gone, and a TTL has passed since this leader's answered revocation or since it first saw
        the key gone)."""
        now = time.monotonic()
        return all(s.server_id in self._gone or (self._leases.get(s.server_id, 0.0) <= now and (
            etcd_leases is None or (s.server_id not in etcd_leases and s.server_id not in self._untimed)))
                   for s in failed)

    # --- etcd leases (``map.lease_store``) -----------------------------------------------------------
    def _fence_etcd_leases(self) -> dict[str, int] | None:
        """Revokes the etcd lease of every failed server (and removed standby) that still holds one: it stops at
        its next renewal, so it may serve until a TTL after the revocation, which the promotion waits.  A failed
        server whose key is gone is timed from when this leader first sees that (whoever revoked it, whenever).
        A revocation etcd did not answer is tried again next round.  Returns the leases etcd holds now, or None
        when etcd cannot be read (nothing is promoted then)."""
        with self._lock:  # only what was so before the read: a key read before a server registered says nothing
            untimed_before, dropped_before = set(self._untimed), set(self._dropped)
        try:
            leases = self.store.server_leases()
        except StoreUnavailable as exc:
            log.warning("the servers' etcd leases cannot be read: %s", exc)
            return None
        with self._lock:
            failed = {s.server_id for s in self.map.servers if s.state == FAILED}
            self._untimed &= failed  # an entry no longer in the map (replaced) is moot
            # a standby back in the map (its removal was rolled back) is not fenced; one whose key is gone is done
            self._dropped -= {s.server_id for s in self.map.servers} | (dropped_before - leases.keys())
            for server_id in (self._untimed & untimed_before) - leases.keys():
                # revoked (or expired) by now, by whoever: a TTL from here covers it
                self._leases[server_id] = max(self._leases.get(server_id, 0.0), time.monotonic() + self._lease_wait_s)
                self._untimed.discard(server_id)
            doomed = {server_id: lease for server_id, lease in leases.items() if server_id in failed | self._dropped}
            for server_id in doomed.keys() & failed:
                self._leases[server_id] = math.inf  # until the revocation is answered
        for server_id, lease in doomed.items():
            answered = False
            try:
                self.store.revoke_lease(lease)
                answered = True
                log.info("revoked the etcd lease of %s server %s", "failed" if server_id in failed else "removed",
                         server_id)
            except StoreUnavailable as exc:  # it may still happen: untimed until answered, or the key seen gone
                log.warning("revoking the etcd lease of server %s: %s", server_id, exc)
            finally:
                with self._lock:
                    if server_id in failed:
                        self._leases[server_id] = time.monotonic() + self._lease_wait_s
                        if answered:
                            self._untimed.discard(server_id)
                        else:
                            self._untimed.add(server_id)
                    elif answered:
                        self._dropped.discard(server_id)
            if answered:
                leases.pop(server_id, None)
        return leases

    def _check_etcd_leases(self) -> None:
        """Declares failed every server of the map whose etcd lease key is gone (it expired: the server stopped
        serving, or will stop at its next renewal)."""
        with self._lock:
            known = {s.server_id: s.address for s in self.map.servers if s.state != FAILED}
        try:
            leases = self.store.server_leases()  # read after ``known``: a server registers with its key in place
        except StoreUnavailable as exc:
            log.warning("the servers' etcd leases cannot be read: %s", exc)
            return
        for server_id, address in known.items():
            if server_id not in leases:
                self._declare_failed(address, why="its etcd lease expired")

    def _promote_standbys(self) -> None:
        with self._promote_lock:  # one promoter at a time (the promoter thread; a test may call it too)
            try:
                self._promote_standbys_locked()
            finally:
                with self._promoted:
                    self._promoted.notify_all()

    def _choose_locked(self, etcd_leases: dict[str, int] | None = None
                       ) -> tuple[cluster_pb2.ServerInfo, int, cluster_pb2.ClusterMap | None] | None:
        """The next promotion: (its standby's entry, the index, the map that recorded it now or None when it was
        recorded before), recorded in the map as ``PROMOTING`` (one epoch, one map: the Promote carries this
        recorded map) and persisted as the intent; None when there is none to do now.  A promotion begun before (by this or a crashed coordinator) is finished first, with its own
        standby, unless that standby has been declared failed meanwhile."""
        for server_id, p in list(self._promoting.items()):
            entry = next((s for s in self.map.servers if s.server_id == server_id and s.state != FAILED), None)
            if entry is not None and entry.state == PROMOTING and entry.index == p.index:
                return entry, p.index, None
            if entry is not None and entry.state == STANDBY:  # recorded by an older coordinator before its Promote
                return entry, p.index, self._record_promoting_locked(entry, p.index)
            del self._promoting[server_id]  # its standby failed (or was promoted): the intent is void
            self._save_locked()
        failed_entries = [s for s in self.map.servers if s.state == FAILED and s.index >= 0]
        held = {s.index for s in self.map.servers if s.index >= 0 and s.state != FAILED}
        failed = sorted({s.index for s in failed_entries} - held)
        standbys = [s for s in self.map.servers if s.state == STANDBY]
        if not failed or not standbys:
            return None
        # a restarted server that asked for one of these indices first, else any standby; an index whose failed
        # holders (a server, a standby abandoned midway through its promotion) may still serve waits their lease
        safe = [i for i in failed if self._safe_to_replace([s for s in failed_entries if s.index == i], etcd_leases)]
        if not safe:
            return None
        chosen = next((s for s in standbys if self._wanted.get(s.server_id) in safe), standbys[0])
        index = self._wanted[chosen.server_id] if self._wanted.get(chosen.server_id) in safe else safe[0]
        return chosen, index, self._record_promoting_locked(chosen, index)

    def _record_promoting_locked(self, chosen: cluster_pb2.ServerInfo, index: int) -> cluster_pb2.ClusterMap:
        chosen.index = index
        chosen.state = PROMOTING
        self._promoting[chosen.server_id] = coordinator_pb2.PendingPromotion(server_id=chosen.server_id,
                                                                             address=chosen.address, index=index)
        return self._bump_locked()  # persisted with the intent: a restart finishes it

    def _leads(self) -> bool:
        return self.leading.is_set() and self.store.holds()

    def _promote_standbys_locked(self) -> None:
        while not self._stop.is_set() and (self._leads() or self.store.kind == "file"):
            etcd_leases = None
            if self.map.lease_store:
                with self._lock:  # read etcd only when there is something to fence or promote
                    work = bool(self._promoting or self._dropped or self._untimed) or (
                        any(s.state == STANDBY for s in self.map.servers)
                        and any(s.state == FAILED and s.index >= 0 for s in self.map.servers))
                if not work:
                    return
                etcd_leases = self._fence_etcd_leases()
                if etcd_leases is None:
                    return  # etcd cannot be read: no promotion can be recorded either
            with self._lock:
                choice = self._choose_locked(etcd_leases)
                if choice is None:
                    return
                chosen, index, snapshot = choice
                address, server_id = chosen.address, chosen.server_id
                recorded = snapshot if snapshot is not None else cluster_pb2.ClusterMap.FromString(
                    self.map.SerializeToString())
                dense = [embedding_pb2.CreateDenseRequest(spec=d.spec, initial_value=d.initial_value)
                         for name, d in self._dense.items() if index in self.layout.dense_servers(name)]
                stub = self._handle(address).embedding
            if snapshot is not None:
                log.info("promoting %s to index %d (epoch %d)", address, index, snapshot.epoch)
                self._broadcast(snapshot)
            ack = self._send_promote(stub, address, server_id, index, recorded, dense)
            if ack is None:
                if self._still_promoting(server_id, index):
                    return  # it is healthy but did not finish (e.g. a survivor is slow): the promoter retries
                log.warning("standby %s did not complete its promotion to index %d and was declared failed; the "
                            "next standby takes the index once its lease has run out", address, index)
                with self._lock:
                    if self._promoting.pop(server_id, None) is not None:
                        self._save_locked()
                continue
            self.faults.hit("record_promotion")
            with self._lock:
                entry = next((s for s in self.map.servers if s.server_id == server_id and s.state == PROMOTING
                              and s.index == index), None)
                if entry is None:  # declared failed while its Promote was answered: the next standby goes
                    continue
                for s in list(self.map.servers):
                    if s.index == index and s.state == FAILED:
                        self.map.servers.remove(s)
                entry.state = RECOVERING if ack.recovering else ACTIVE
                self._wanted.pop(server_id, None)
                self._promoting.pop(server_id, None)
                self._leases[server_id] = time.monotonic() + self.config.lease_s
                self._event_locked("promoted", index, address)
                if not ack.recovering:
                    self._event_locked("redundant", index, address)
                snapshot = self._bump_locked()
            log.info("promoted %s to index %d (epoch %d)%s", address, index, snapshot.epoch,
                     "; it rebuilds in the background" if ack.recovering else "")
            self._broadcast(snapshot)

    def _still_promoting(self, server_id: str, index: int) -> bool:
        with self._lock:
            return any(s.server_id == server_id and s.state == PROMOTING and s.index == index for s in self.map.servers)

    def _send_promote(self, stub, address: str, server_id: str, index: int, recorded: cluster_pb2.ClusterMap,
                      dense) -> embedding_pb2.Ack | None:
        """Sends Promote (idempotent) until it is answered, while the standby stays ``PROMOTING``: the health
        monitor runs on its own thread and declares a standby that stops answering failed, which ends the wait
        at once.  Returns the ack, or None (the standby failed, or a call ended in an error that is not a
        timeout: the promoter retries later)."""
        request = embedding_pb2.PromoteRequest(index=index, map=recorded, dense=dense)
        give_up = time.monotonic() + self.config.rpc_timeout_s
        while not self._stop.is_set() and self._still_promoting(server_id, index):
            if self.store.kind != "file" and not self._leads():
                return None  # deposed: the next leader finishes this promotion
            call = stub.Promote.future(request, timeout=self.config.promote_timeout_s)
            while not call.done():
                try:
                    return call.result(timeout=self.config.health_interval_s)
                except (grpc.FutureTimeoutError, futures.TimeoutError):
                    if not self._still_promoting(server_id, index) or self._stop.is_set():
                        call.cancel()
                        return None
                except grpc.RpcError:
                    break
            try:
                return call.result()
            except grpc.RpcError as exc:
                log.warning("promoting %s to index %d: %s: %s", address, index, exc.code().name, exc.details())
                if _connection_refused(address, self.config.health_timeout_s):
                    self._declare_failed(address, gone=True)
                    return None
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() > give_up:
                    return None  # e.g. a survivor did not answer its resolution yet: retried later
            except (grpc.FutureCancelledError, futures.CancelledError):
                return None
        return None

    def _poll_recovering(self) -> None:
        """Asks each ``RECOVERING`` server for its state (the map update's ack says whether it still rebuilds):
        an index whose report of full redundancy was lost or refused still becomes ``ACTIVE``."""
        with self._lock:
            recovering = [(s.address, s.server_id, s.index) for s in self.map.servers if s.state == RECOVERING]
            snapshot = cluster_pb2.ClusterMap()
            snapshot.CopyFrom(self.map)
        for address, server_id, index in recovering:
            try:
                ack = self._handle(address).embedding.UpdateClusterMap(snapshot, timeout=self.config.health_timeout_s)
            except grpc.RpcError:
                continue
            if ack.recovering or ack.index != index:
                continue
            self._mark_redundant(index, server_id, "its rebuild finished (asked by the coordinator)")

    def _mark_redundant(self, index: int, server_id: str, why: str) -> cluster_pb2.ClusterMap | None:
        with self._lock:
            info = next((s for s in self.map.servers if s.index == index and s.server_id == server_id
                         and s.state == RECOVERING), None)
            if info is None:
                return None
            info.state = ACTIVE
            self._event_locked("redundant", info.index, info.address)
            snapshot = self._bump_locked()
        log.info("index %d fully redundant again: %s; epoch %d", index, why, snapshot.epoch)
        self._broadcast(snapshot)
        return snapshot

    def _promoter(self) -> None:
        """Promotes standbys into failed indices; on its own thread, so a slow or paused standby never holds up
        the health checks (which are what declare it failed)."""
        while not self._stop.is_set():
            self._promote_wake.wait(self.config.health_interval_s)
            self._promote_wake.clear()
            if self._stop.is_set():
                return
            if not self.leading.is_set():
                continue
            try:
                self._promote_standbys()
            except Exception:  # noqa: BLE001 - reported, never swallowed; retried at the next wake
                log.exception("promotion failed")

    def _monitor(self) -> None:
        """Health checks (in parallel: one server that does not answer delays no other's check), the state of
        recovering servers, maps that did not reach a server."""
        while not self._stop.is_set():
            self._wake.wait(self.config.health_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            if not self.leading.is_set():
                continue
            with self._lock:
                addresses = [s.address for s in self.map.servers if s.state != FAILED]
            try:
                list(self._check_pool.map(self._check_server, addresses))
            except RuntimeError:  # the pool was shut down (the coordinator stops)
                return
            except Exception:  # noqa: BLE001 - reported, never swallowed
                log.exception("health checks failed")
            if self.map.lease_store:
                try:
                    self._check_etcd_leases()
                except Exception:  # noqa: BLE001 - reported, never swallowed
                    log.exception("checking the servers' etcd leases failed")
            self._promote_wake.set()
            try:
                self._poll_recovering()
            except Exception:  # noqa: BLE001 - reported, never swallowed
                log.exception("asking recovering servers for their state failed")
            if self._map_pusher.is_set():
                self._map_pusher.clear()
                self._rebroadcast()

    def start(self) -> "CoordinatorServer":
        if self._store_args is None:
            return CoordinatorServer(self)
        cfg, args = self.config, self._store_args
        tls = EtcdTLS(cfg.tls_ca, cfg.tls_cert, cfg.tls_key) if cfg.tls_ca else None
        me = f"{socket.gethostname()}-{os.getpid()}"
        return CoordinatorServer(self, lambda address: EtcdStore(
            args["endpoints"], args["prefix"], me=me, address=address, ttl_s=cfg.election_ttl_s,
            timeout_s=min(cfg.health_timeout_s * 2, float(cfg.election_ttl_s) / 2), tls=tls))


class _Guarded:
    """The coordinator's RPCs as served: while it does not lead, every call but ``GetClusterMap`` is answered
    UNAVAILABLE naming the leader (callers go on to the next coordinator), and ``GetClusterMap`` reads the map
    from the store; a change the store refused (this coordinator was deposed, or the store is unreachable) is
    answered UNAVAILABLE too, never with a map nobody recorded."""

    def __init__(self, coordinator: Coordinator):
        self._c = coordinator

    def __getattr__(self, name: str):
        method = getattr(self._c, name)
        c = self._c

        def guarded(request, context):
            if not (c.leading.is_set() and c.store.holds()):
                if name == "GetClusterMap" and c.store.kind != "file":
                    try:
                        state = c.store.peek()
                    except StoreUnavailable as exc:
                        context.abort(grpc.StatusCode.UNAVAILABLE, f"no coordinator leads and etcd cannot be read: {exc}")
                    if state is not None:
                        return state.map
                leader = c.store.leader_address()
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"this coordinator does not lead; the leader is {leader or 'being elected'}; retry there")
            try:
                return method(request, context)
            except (NotLeader, StoreUnavailable) as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"the change was not recorded: {exc}; retry")
        return guarded


class CoordinatorServer:
    """Runs a :class:`Coordinator` behind a gRPC server with its health monitor.  With an etcd store it first
    campaigns for the leadership (serving maps meanwhile), leads until it loses its lease, then campaigns
    again."""

    def __init__(self, coordinator: Coordinator, store_factory=None):
        self.coordinator = coordinator
        config = coordinator.config
        self._grpc = transport.make_server(max_workers=16, security=config.security)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(_Guarded(coordinator), self._grpc)
        self.port = transport.bind(self._grpc, config.host, config.port, config.security)
        self.address = f"{config.host}:{self.port}"
        self._leadership = None
        if store_factory is not None:
            coordinator.store = store_factory(self.address)
            self._grpc.start()
            self._leadership = threading.Thread(target=self._lead, name="ecrec-leadership", daemon=True)
            self._leadership.start()
        else:
            with coordinator._lock:
                snapshot = coordinator._bump_locked()
                coordinator.leading.set()
            self._grpc.start()
            coordinator._broadcast(snapshot)
        self._monitor = threading.Thread(target=coordinator._monitor, name="ecrec-health-monitor", daemon=True)
        self._monitor.start()
        self._promoter = threading.Thread(target=coordinator._promoter, name="ecrec-promoter", daemon=True)
        self._promoter.start()

    def _lead(self) -> None:
        """Campaign, take over, lead until the lease is lost; again, until the coordinator stops."""
        c = self.coordinator
        store = c.store
        while not c._stop.is_set():
            if not store.campaign(c._stop):
                return
            try:
                snapshot = c.take_over(store)
            except (NotLeader, StoreUnavailable) as exc:
                log.warning("elected, but could not take over: %s", exc)
                store.resign()
                c._stop.wait(0.5)
                continue
            except Exception:  # noqa: BLE001 - e.g. etcd holds another cluster's map: no coordinator can lead
                log.critical("elected, but the state in %s cannot be used; stopping this coordinator",
                             store.describe(), exc_info=True)
                store.resign()
                os._exit(2)
            log.info("leading the cluster from %s (epoch %d, %d servers, %d tables)", self.address, snapshot.epoch,
                     len(snapshot.servers), len(snapshot.tables))
            c._broadcast(snapshot)
            c._wake.set()
            c._promote_wake.set()
            while not c._stop.is_set() and not store.lost.wait(0.2):
                pass
            c.step_down("its etcd lease is gone, or a write's outcome was unknown" if not c._stop.is_set()
                        else "stopping")
            store.resign()  # the key goes now: a follower (or this one again) takes over from what etcd holds

    def wait(self) -> None:
        self._grpc.wait_for_termination()

    def stop(self, grace_s: float = 1.0) -> None:
        self.coordinator._stop.set()
        self.coordinator.leading.clear()
        self.coordinator.store.resign()
        if self._leadership is not None:
            self._leadership.join(timeout=2.0)
        self.coordinator.store.resign()  # in case a campaign won meanwhile
        self.coordinator._wake.set()
        self.coordinator._promote_wake.set()
        self._grpc.stop(grace_s).wait()
        self.coordinator._broadcast_pool.shutdown(wait=False, cancel_futures=True)
        self.coordinator._check_pool.shutdown(wait=False, cancel_futures=True)
