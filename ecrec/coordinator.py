"""The coordinator: keeps the cluster map, creates tables, watches servers, promotes standbys.

The map (servers by index, standbys, tables, dense specs, the strategy and its
parameters) changes only here, and every change increases its **epoch** and is
pushed to every server.  Clients read the map with ``GetClusterMap`` and refresh
it when a call fails.  Servers are watched with the standard gRPC health
service; a server that fails ``failures_before_dead`` checks in a row (or that a
client reports and that then fails a check) is declared failed, and a standby
is promoted to its index.  With ``state_path`` the map is persisted (atomically)
so a restarted coordinator keeps it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ecrec import transport
from ecrec.config import CoordinatorConfig
from ecrec.layout import Layout
from ecrec.strategies import get_spec
from ecrec.tables import DenseSpec, TableSpec
from ecrec.wire import cluster_pb2, coordinator_pb2, coordinator_pb2_grpc, embedding_pb2, embedding_pb2_grpc

log = logging.getLogger("ecrec.coordinator")

ACTIVE = cluster_pb2.ACTIVE
STANDBY = cluster_pb2.STANDBY
FAILED = cluster_pb2.FAILED
RECOVERING = cluster_pb2.RECOVERING


class _ServerHandle:
    """Stubs for one server address."""

    def __init__(self, address: str):
        self.channel = transport.make_channel(address)
        self.embedding = embedding_pb2_grpc.EmbeddingServerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.failed_checks = 0


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
        self._wanted: dict[str, int] = {}  # standby server_id -> the index it asked for (a restarted server)
        self.map = cluster_pb2.ClusterMap(
            epoch=1, num_servers=spec.num_servers, strategy=spec.strategy, k=k, m=m,
        )
        self.map.strategy_options.update({str(a): str(b) for a, b in options.items()})
        if config.state_path and os.path.exists(config.state_path):
            self._load(config.state_path)

    # --- persistence -----------------------------------------------------------------------------
    def _load(self, path: str) -> None:
        state = coordinator_pb2.CoordinatorState()
        with open(path, "rb") as f:
            state.ParseFromString(f.read())
        saved = state.map
        if (saved.num_servers, saved.strategy, saved.k, saved.m) != (self.map.num_servers, self.map.strategy, self.map.k, self.map.m):
            raise ValueError(
                f"{path} holds a map for {saved.num_servers} servers, strategy {saved.strategy!r}, k={saved.k}, m={saved.m}; "
                f"this coordinator was started for {self.map.num_servers}, {self.map.strategy!r}, k={self.map.k}, m={self.map.m}"
            )
        self.map.CopyFrom(saved)
        self.map.epoch = saved.epoch + 1
        for d in state.dense:
            self._dense[d.spec.name] = d
        log.info("restored the cluster map from %s (epoch %d, %d tables)", path, self.map.epoch, len(self.map.tables))

    def _save_locked(self) -> None:
        path = self.config.state_path
        if not path:
            return
        state = coordinator_pb2.CoordinatorState(map=self.map, dense=list(self._dense.values()))
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".coordinator-state-")
        with os.fdopen(fd, "wb") as f:
            f.write(state.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    # --- map helpers (call with the lock held) -------------------------------------------------------
    def _handle(self, address: str) -> _ServerHandle:
        h = self._handles.get(address)
        if h is None:
            h = self._handles[address] = _ServerHandle(address)
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
        for s in snapshot.servers:
            if s.state == FAILED:
                continue
            stub = self._handle(s.address).embedding
            fut = self._broadcast_pool.submit(stub.UpdateClusterMap, snapshot, timeout=self.config.rpc_timeout_s)
            fut.add_done_callback(lambda f, a=s.address: f.exception() and log.warning("map update to %s failed: %s", a, f.exception()))

    # --- RPCs ------------------------------------------------------------------------------------
    def Register(self, request, context):
        if not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address is required")
        with self._lock:
            for s in self.map.servers:
                if s.address == request.address and s.state != FAILED:
                    if s.server_id == request.server_id:  # a retried Register
                        return coordinator_pb2.RegisterReply(map=self.map, index=s.index)
                    s.state = FAILED  # the same address re-registers: the old process is gone
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
                state=ACTIVE if index >= 0 else STANDBY,
            )
            if index < 0 and request.want_index >= 0:
                self._wanted[info.server_id] = request.want_index
            self._handle(request.address).failed_checks = 0
            snapshot = self._bump_locked()
        log.info("registered %s as %s (epoch %d)", request.address, f"index {index}" if index >= 0 else "standby", snapshot.epoch)
        self._broadcast(snapshot)
        self._wake.set()
        return coordinator_pb2.RegisterReply(map=snapshot, index=index)

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
            error = self._call_all(targets, lambda stub: stub.CreateTable(spec.to_proto(), timeout=self.config.rpc_timeout_s))
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
            error = self._call_all(targets, lambda stub: stub.CreateDense(req, timeout=self.config.rpc_timeout_s))
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
        if not self._check_server(request.address, reported=True):
            try:  # promote a standby now, so the reply already names the replacement
                self._promote_standbys()
            except Exception:  # noqa: BLE001 - reported, never swallowed; the monitor retries
                log.exception("promotion failed")
        with self._lock:
            return cluster_pb2.ClusterMap.FromString(self.map.SerializeToString())

    def ReportRedundant(self, request, context):
        with self._lock:
            info = next((s for s in self.map.servers if s.index == request.index and s.server_id == request.server_id
                         and s.state != FAILED), None)
            if info is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"server {request.server_id!r} does not hold index {request.index}")
            if info.state == RECOVERING:
                info.state = ACTIVE
                self._event_locked("redundant", info.index, info.address)
            snapshot = self._bump_locked()
        log.info("index %d fully redundant again (rebuild took %.2f s); epoch %d", request.index,
                 request.rebuild_seconds, snapshot.epoch)
        self._broadcast(snapshot)
        return snapshot

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
    def _check_server(self, address: str, reported: bool = False) -> bool:
        """Health-checks ``address``; declares it failed when it has failed enough checks. True if alive."""
        h = self._handle(address)
        try:
            resp = h.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.config.health_timeout_s)
            alive = resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            alive = False
        if alive:
            h.failed_checks = 0
            return True
        h.failed_checks += 1
        if reported or h.failed_checks >= self.config.failures_before_dead:
            self._declare_failed(address)
        return False

    def _declare_failed(self, address: str) -> None:
        with self._lock:
            info = next((s for s in self.map.servers if s.address == address and s.state != FAILED), None)
            if info is None:
                return
            was_standby = info.state == STANDBY
            if was_standby:
                self.map.servers.remove(info)
            else:
                info.state = FAILED
                self._event_locked("failed", info.index, address)
            snapshot = self._bump_locked()
        log.warning("server %s (%s) declared failed; epoch %d", address, "standby" if was_standby else f"index {info.index}", snapshot.epoch)
        self._broadcast(snapshot)
        self._wake.set()

    def _promote_standbys(self) -> None:
        with self._promote_lock:  # the monitor and a client report may both try
            self._promote_standbys_locked()

    def _promote_standbys_locked(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                failed = sorted({s.index for s in self.map.servers if s.state == FAILED and s.index >= 0}
                                - {s.index for s in self.map.servers if s.index >= 0 and s.state != FAILED})
                standbys = [s for s in self.map.servers if s.state == STANDBY]
                if not failed or not standbys:
                    return
                # a restarted server that asked for this index first, else any standby
                index = failed[0]
                chosen = next((s for s in standbys if self._wanted.get(s.server_id) in failed), standbys[0])
                if self._wanted.get(chosen.server_id) in failed:
                    index = self._wanted[chosen.server_id]
                new_map = cluster_pb2.ClusterMap()
                new_map.CopyFrom(self.map)
                new_map.epoch += 1
                for s in new_map.servers:
                    if s.server_id == chosen.server_id:
                        s.index = index
                        s.state = ACTIVE
                dense = [embedding_pb2.CreateDenseRequest(spec=d.spec, initial_value=d.initial_value)
                         for name, d in self._dense.items() if index in self.layout.dense_servers(name)]
                stub = self._handle(chosen.address).embedding
                address, server_id = chosen.address, chosen.server_id
            try:
                ack = stub.Promote(embedding_pb2.PromoteRequest(index=index, map=new_map, dense=dense), timeout=self.config.rpc_timeout_s)
            except grpc.RpcError as exc:
                log.warning("promoting %s to index %d failed: %s", address, index, exc.details())
                self._declare_failed(address)
                continue
            with self._lock:
                for s in list(self.map.servers):
                    if s.index == index and s.state == FAILED:
                        self.map.servers.remove(s)
                for s in self.map.servers:
                    if s.server_id == server_id:
                        s.index = index
                        s.state = RECOVERING if ack.recovering else ACTIVE
                self._wanted.pop(server_id, None)
                self._event_locked("promoted", index, address)
                if not ack.recovering:
                    self._event_locked("redundant", index, address)
                snapshot = self._bump_locked()
            log.info("promoted %s to index %d (epoch %d)%s", address, index, snapshot.epoch,
                     "; it rebuilds in the background" if ack.recovering else "")
            self._broadcast(snapshot)

    def _monitor(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.config.health_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._lock:
                addresses = [s.address for s in self.map.servers if s.state != FAILED]
            for address in addresses:
                self._check_server(address)
            try:
                self._promote_standbys()
            except Exception:  # noqa: BLE001 - reported, never swallowed
                log.exception("promotion failed")

    def start(self) -> "CoordinatorServer":
        return CoordinatorServer(self)


class CoordinatorServer:
    """Runs a :class:`Coordinator` behind a gRPC server with its health monitor."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator
        config = coordinator.config
        self._grpc = transport.make_server(max_workers=16)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, self._grpc)
        self.port = transport.bind(self._grpc, config.host, config.port)
        self.address = f"{config.host}:{self.port}"
        self._grpc.start()
        with coordinator._lock:
            snapshot = coordinator._bump_locked()
        coordinator._broadcast(snapshot)
        self._monitor = threading.Thread(target=coordinator._monitor, name="ecrec-health-monitor", daemon=True)
        self._monitor.start()

    def wait(self) -> None:
        self._grpc.wait_for_termination()

    def stop(self, grace_s: float = 1.0) -> None:
        self.coordinator._stop.set()
        self.coordinator._wake.set()
        self._grpc.stop(grace_s).wait()
        self.coordinator._broadcast_pool.shutdown(wait=False, cancel_futures=True)
