"""The coordinator: keeps the cluster map, creates tables, watches servers, promotes standbys.

The map (servers by index, standbys, tables, dense specs, the strategy and its parameters) changes only here,
and every change increases its **epoch**, is recorded in the store and pushed to every server (retried until each
has it; servers also learn the newest epoch with every lease renewal).  Clients read the map with
``GetClusterMap`` and refresh it when a call fails.

The coordinator is its parts, one job each: :class:`~ecrec.control.cluster_state.ClusterState` (the map's state
machine and its store), :class:`~ecrec.control.links.ServerLinks` (stubs, the map's broadcast),
:class:`~ecrec.control.detection.FailureDetector` (health checks, declarations of failure),
:class:`~ecrec.control.promotion.Promoter` (fencing, standbys into failed indices) and
:mod:`ecrec.control.leadership` (which coordinator leads, the process serving one).  :class:`Coordinator` is their
gRPC face: registrations, leases, tables and dense tensors, reports from servers and clients.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import grpc

from ecrec.config import SHARED_CA_WARNING, CoordinatorConfig
from ecrec.control.cluster_state import ACTIVE, FAILED, PROMOTING, RECOVERING, STANDBY, ClusterState
from ecrec.control.detection import FailureDetector, connection_refused
from ecrec.control.etcd import EtcdTLS
from ecrec.control.leadership import CoordinatorServer
from ecrec.control.links import ServerLinks
from ecrec.control.promotion import Promoter
from ecrec.control.stores import EtcdStore, NotLeader, StoreUnavailable
from ecrec.net import transport
from ecrec.tables.spec import DenseSpec, TableSpec
from ecrec.wire import cluster_pb2, coordinator_pb2, coordinator_pb2_grpc, embedding_pb2

log = logging.getLogger("ecrec.coordinator")


def default_server_bytes() -> int:
    """60 percent of this host's memory (the default ``--max-server-bytes``)."""
    try:
        return int(0.6 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):  # pragma: no cover - not on Linux
        return 1 << 62


#: a create call's error that says its server went away under it, not that it refused
_GONE_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")

#: the shortest deadline of a coordinator's calls to etcd (s): taken from --health-timeout-s alone, a 5 ms health
#: check gave every etcd call 10 ms, and no coordinator could lead
MIN_ETCD_TIMEOUT_S = 0.5


def etcd_timeout_s(config) -> float:
    """The deadline of a coordinator's etcd calls: two health checks', at most half the leader's TTL, at least
    :data:`MIN_ETCD_TIMEOUT_S`."""
    return max(MIN_ETCD_TIMEOUT_S, min(config.health_timeout_s * 2, float(config.election_ttl_s) / 2))


class Coordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """The coordinator's RPCs over its parts (see the module); :meth:`start` serves them."""

    def __init__(self, config: CoordinatorConfig):
        self.config = config
        self.state = ClusterState(config)  # raises ValueError naming a bad --store or state file
        self.stopping = threading.Event()
        self.links = ServerLinks(self.state, self.stopping)
        self.promoter = Promoter(self.state, self.links, self.stopping, self._declare_failed)
        self.detector = FailureDetector(self.state, self.links, self.stopping, self.promoter.on_failure)
        self._create_lock = threading.Lock()  # one table or dense tensor created at a time
        self.address = ""  # where this coordinator serves (set when it starts)

    def _declare_failed(self, address: str, gone: bool = False, why: str = "") -> None:
        self.detector.declare_failed(address, gone, why)

    @property
    def map(self) -> cluster_pb2.ClusterMap:
        return self.state.map

    def take_over(self, store) -> cluster_pb2.ClusterMap:
        """Leads from what ``store`` holds (``ClusterState.take_over``), with fresh stubs for every server."""
        with self.state.lock:
            snapshot = self.state.take_over(store)
            self.links.forget()
        return snapshot

    def _holder(self, request, context) -> cluster_pb2.ServerInfo:
        """The map's entry of the server a report comes from (``request.index``, ``request.server_id``); aborts
        FAILED_PRECONDITION when that server does not hold that index.  Call with the lock held."""
        info = self.state.holder_locked(request.index, request.server_id)
        if info is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"server {request.server_id!r} does not hold index {request.index}")
        return info

    # --- RPCs ------------------------------------------------------------------------------------
    def Register(self, request, context):
        if not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address is required")
        n = self.state.map.num_servers
        if not -1 <= request.want_index < n:  # taken as "any" before (forming) or waited for forever (a standby)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"index {request.want_index} is not an index of this cluster (0 to {n - 1}); "
                          "-1 takes whichever is free")
        etcd_leases = self._check_etcd_lease(request, context) if self.state.map.lease_store else None
        with self.state.lock:
            holder = next((s for s in self.state.map.servers if s.address == request.address and s.state != FAILED
                           and s.server_id != request.server_id), None)
            if etcd_leases is not None:
                leased = holder is not None and holder.server_id in etcd_leases
            else:
                leased = holder is not None and self.state.leases.get(holder.server_id, 0.0) > time.monotonic()
            holder_id = holder.server_id if holder is not None else ""
            holder_health = (holder.health_address or holder.address) if holder is not None else ""
        if leased and self.detector.answers(request.address):
            # a live server holds this address: the caller is mistaken or hostile, not a restart of it
            context.abort(grpc.StatusCode.ALREADY_EXISTS,
                          f"{request.address} is held by live server {holder_id} (its lease is current and it answers "
                          "health checks); a restarted server registers once the old one is gone")
        # the old process is gone when nothing listens on its health port any more; a paused one (the new process
        # may share its data port) may serve until its lease ends, which a promotion over it waits
        holder_gone = bool(holder_health) and connection_refused(holder_health, self.config.health_timeout_s)
        with self.state.lock:
            for s in self.state.map.servers:
                if s.address == request.address and s.state != FAILED:
                    if s.server_id == request.server_id:  # a retried Register
                        self.state.extend_lease_locked(s.server_id, self.config.lease_s)
                        return coordinator_pb2.RegisterReply(map=self.state.map, index=s.index, lease_s=self.config.lease_s,
                                                             server_key=self.state.server_key)
                    s.state = FAILED  # the same address re-registers: the old process is gone or unresponsive
                    if s.server_id == holder_id and holder_gone:
                        self.state.gone.add(s.server_id)
                    elif etcd_leases is not None:  # fenced (its lease revoked) and timed before a promotion
                        self.state.untimed.add(s.server_id)
                        self.state.leases[s.server_id] = max(self.state.leases.get(s.server_id, 0.0),
                                                        time.monotonic() + self.state.lease_wait_s)
            taken = {s.index for s in self.state.map.servers if s.index >= 0 and s.state != FAILED}
            forming = len(self.state.map.tables) == 0 and len(self.state.dense) == 0
            index = -1
            if not request.standby and forming:
                if 0 <= request.want_index < self.state.map.num_servers and request.want_index not in taken:
                    index = request.want_index
                else:
                    free = [i for i in range(self.state.map.num_servers) if i not in taken]
                    index = free[0] if free else -1
            info = self.state.map.servers.add(
                index=index, address=request.address, server_id=request.server_id or request.address,
                state=ACTIVE if index >= 0 else STANDBY, health_address=request.health_address,
            )
            if index < 0 and request.want_index >= 0:
                self.state.wanted[info.server_id] = request.want_index
            self.links.forget(request.address)  # a new process at this address: new stubs, new counters
            self.state.extend_lease_locked(info.server_id, self.config.lease_s)
            snapshot = self.state.bump_locked()
        log.info("registered %s as %s (epoch %d)", request.address, f"index {index}" if index >= 0 else "standby", snapshot.epoch)
        self.links.broadcast(snapshot)
        self.detector.wake.set()
        self.promoter.wake.set()
        return coordinator_pb2.RegisterReply(map=snapshot, index=index, lease_s=self.config.lease_s,
                                             server_key=self.state.server_key)

    def _check_etcd_lease(self, request, context) -> dict[str, int]:
        """With etcd leases: aborts the registration unless the caller's key exists, bound to the lease it names;
        returns every server's lease."""
        if not request.etcd_lease:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this cluster's servers hold etcd leases (lease store {self.state.map.lease_store}): grant one and "
                          "bind PREFIX/servers/<server_id> to it before registering (an older ecrec-server?)")
        try:
            leases = self.state.store.server_leases()
        except StoreUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd cannot be read to check the server's lease: {exc}")
        if leases.get(request.server_id or request.address) != request.etcd_lease:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"etcd holds no key servers/{request.server_id} bound to lease {request.etcd_lease:x}: "
                          "bind it before registering")
        return leases

    def RenewLease(self, request, context):
        """Extends a server's lease while the map holds it (active, recovering or standby), else refuses: a
        server that has been declared failed stops serving at once."""
        if self.state.map.lease_store:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this cluster's servers hold etcd leases (lease store {self.state.map.lease_store}), not leases "
                          "renewed with the coordinator")
        with self.state.lock:
            info = next((s for s in self.state.map.servers if s.server_id == request.server_id and s.state != FAILED), None)
            if info is None:
                return coordinator_pb2.RenewLeaseReply(granted=False, epoch=self.state.map.epoch,
                                                       reason="not in the cluster map (declared failed or unknown)")
            if request.index >= 0 and info.index != request.index and info.state != STANDBY:
                return coordinator_pb2.RenewLeaseReply(granted=False, epoch=self.state.map.epoch,
                                                       reason=f"holds index {info.index}, not {request.index}")
            self.state.extend_lease_locked(request.server_id, self.config.lease_s)
            return coordinator_pb2.RenewLeaseReply(granted=True, lease_s=self.config.lease_s, epoch=self.state.map.epoch)

    def ReportDataLoss(self, request, context):
        """A replacement cannot rebuild some stripes: recorded in the map (and its events) for every client."""
        with self.state.lock:
            info = self._holder(request, context)
            merged = [self.state.merge_data_loss_locked(d) for d in request.lost]
            changed = [entry for entry, _ in merged if entry is not None]
            news = [entry for entry, new in merged if new]
            for _ in news:  # one event per table and set of members lost: not one per round of a rebuild's reports
                self.state.event_locked("data_loss", request.index, info.address)
            snapshot = self.state.bump_locked() if changed else None
        if snapshot is not None:
            log.log(logging.ERROR if news else logging.INFO, "index %d reports data loss: %s", request.index,
                    "; ".join(f"table {d.table!r}: {d.stripe_count} stripes lost in all" for d in changed))
            self.links.broadcast(snapshot)
        return self.state.snapshot()

    def GetClusterMap(self, request, context):
        return self.state.snapshot()

    def mark_restored(self, path: str) -> None:
        """Records that ``--restore`` put snapshot ``path`` in this cluster (with the map, in its store): a later
        leader or a restarted coordinator does not restore it again over training.  Raises when the store did not
        record it (``NotLeader``, ``StoreUnavailable``)."""
        with self.state.lock:
            self.state.restored_from = str(path)
            self.state.save_locked()  # (a refusal rolls it back and is raised)

    def CreateTable(self, request, context):
        try:
            spec = TableSpec.from_proto(request).validate()
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with self._create_lock:
            with self.state.lock:
                for t in self.state.map.tables:
                    if t.name == spec.name:
                        if TableSpec.from_proto(t) == spec:
                            return self.state.snapshot()
                        context.abort(
                            grpc.StatusCode.ALREADY_EXISTS,
                            f"table {spec.name!r} exists with a different spec ({TableSpec.from_proto(t)})",
                        )
                if not self.state.map.ready:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.state.not_ready_message())
                self._check_server_bytes(context, f"table {spec.name!r}", self._table_bytes(spec))
            request_proto = spec.to_proto()
            snapshot = self._create_on_holders(
                context, f"table {spec.name!r}", range(self.state.layout.num_servers),
                lambda stub, timeout: stub.CreateTable(request_proto, timeout=timeout),
                lambda: self.state.map.tables.append(spec.to_proto()))
        log.info("created table %s (%d rows x %d, %s)", spec.name, spec.num_rows, spec.dim, spec.optimizer)
        self.links.broadcast(snapshot)
        return snapshot

    def _create_on_holders(self, context, what: str, indices, create, publish) -> cluster_pb2.ClusterMap:
        """Has the server holding each of ``indices`` run ``create(stub, timeout_s)``, then ``publish()`` puts the new table or
        dense tensor in the map (with the state's lock held) and returns the new map.  Published only once every
        index's live holder has it: a standby promoted meanwhile got a map without it (its Promote carries the map
        of its promotion), so it is created there too once the promotion is recorded; a server replaced meanwhile
        is not waited for, and its error is none (a paused server answering late created its shard for nobody).
        Aborts UNAVAILABLE when a live holder refuses, after ``create_timeout_s``, or when this coordinator stops or
        no longer leads (the client retries at the leader)."""
        indices = list(indices)
        created: set[str] = set()  # server ids that have it
        deadline = time.monotonic() + self.config.create_timeout_s
        live = (ACTIVE, RECOVERING)

        def holders_locked() -> dict[str, cluster_pb2.ServerInfo]:
            return {s.server_id: s for s in self.state.map.servers if s.index in indices and s.state != FAILED}

        def still_wanted(address: str) -> bool:
            with self.state.lock:
                return any(s.address == address and s.state in live for s in holders_locked().values())

        while True:
            if self.stopping.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, f"creating {what}: this coordinator is stopping; nothing "
                              "was published: retry")
            if self.state.store.kind != "file" and not self.state.leads():
                # deposed: its map (a promotion it recorded, a server it did not see fail) is no longer the one
                raise NotLeader(f"this coordinator no longer leads (while creating {what}); nothing was published")
            with self.state.lock:
                holders = holders_locked()
                todo = [s for s in holders.values() if s.state in live and s.server_id not in created]
                promoting = [s for s in holders.values() if s.state == PROMOTING]
                if not todo and not promoting:
                    publish()
                    return self.state.bump_locked()
            if time.monotonic() > deadline:
                waiting = ", ".join(s.address for s in todo + promoting)
                context.abort(grpc.StatusCode.UNAVAILABLE, f"creating {what}: not done within --create-timeout-s "
                              f"({self.config.create_timeout_s:g} s) on {waiting}; nothing was published")
            if not todo:  # a promotion under way: created there once it is recorded
                time.sleep(min(self.config.health_interval_s, 0.1))
                continue
            ids = {s.address: s.server_id for s in todo}
            left = max(1.0, deadline - time.monotonic())  # the whole create within --create-timeout-s
            answers = self.links.call_each(list(ids), lambda stub: create(stub, left), still_wanted=still_wanted,
                                           poll_s=min(self.config.health_interval_s, 0.5))
            refused, gone = [], []
            for address, error in answers.items():
                if error is None:
                    created.add(ids[address])
                elif error != "replaced" and still_wanted(address):
                    # a holder that dropped the call (killed under it, before it was declared failed) is checked,
                    # not taken for a refusal: declared failed, its replacement gets the shard; alive, asked again
                    (gone if any(f": {code}:" in error for code in _GONE_CODES) else refused).append(address)
            if refused:
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"creating {what}: {'; '.join(answers[a] for a in refused)}")
            for address in gone:
                self.detector.check_server(address)
            if gone:
                time.sleep(min(self.config.health_interval_s, 0.1))

    def _table_bytes(self, spec: TableSpec) -> int:
        """What table ``spec`` asks of one server: its shard of rows (weights and optimizer state) and the parity
        rows its strategy keeps beside them (the layout's parity slots)."""
        layout = self.state.layout
        slots = layout.data_slots_per_server(spec.num_rows)
        if layout.m > 0:
            slots += layout.parity_slots_per_server(spec.num_rows)
        return slots * spec.row_bytes

    def _check_server_bytes(self, context, what: str, more: int) -> None:
        """Aborts with RESOURCE_EXHAUSTED when the map's tables and dense tensors and ``more`` bytes would ask more
        of one server than ``--max-server-bytes``; call with the state's lock held, before anything is created."""
        bound = self.config.max_server_bytes or default_server_bytes()
        held = (sum(self._table_bytes(TableSpec.from_proto(t)) for t in self.state.map.tables)
                + sum(DenseSpec.from_proto(d).payload_bytes for d in self.state.map.dense))
        if held + more > bound:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{what} would need {more} bytes on each server beside the {held} its tables and dense "
                          f"tensors hold, more than the bound of {bound} bytes (--max-server-bytes; default 60 "
                          "percent of the coordinator host's memory): nothing created; shard the model over more "
                          "servers or raise the bound if the servers have the memory")

    def RegisterDense(self, request, context):
        try:
            spec = DenseSpec.from_proto(request.spec).validate()
            transport.bytes_to_floats(request.initial_value, spec.shape)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with self._create_lock:
            with self.state.lock:
                existing = self.state.dense.get(spec.name)
                if existing is not None:
                    if DenseSpec.from_proto(existing.spec) == spec:
                        return self.state.snapshot()
                    context.abort(grpc.StatusCode.ALREADY_EXISTS, f"dense tensor {spec.name!r} exists with a different spec")
                if not self.state.map.ready:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.state.not_ready_message())
                self._check_server_bytes(context, f"dense tensor {spec.name!r}", spec.payload_bytes)
            req = embedding_pb2.CreateDenseRequest(spec=spec.to_proto(), initial_value=request.initial_value)

            def publish() -> None:
                self.state.dense[spec.name] = coordinator_pb2.RegisterDenseRequest(
                    spec=spec.to_proto(), initial_value=request.initial_value)
                self.state.map.dense.append(spec.to_proto())
            snapshot = self._create_on_holders(
                context, f"dense tensor {spec.name!r}", self.state.layout.dense_servers(spec.name),
                lambda stub, timeout: stub.CreateDense(req, timeout=timeout), publish)
        self.links.broadcast(snapshot)
        return snapshot

    def ReportFailure(self, request, context):
        with self.state.lock:
            known = any(s.address == request.address for s in self.state.map.servers)
        if not known:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no server at {request.address!r} in the map")
        # the detail is the client's text: quoted and cut, so that it cannot write lines of its own into this log
        log.info("client reports %s: %r", request.address, request.detail[:200] or "(no detail)")
        if not self.detector.check_server(request.address):
            # promote a standby now when it is safe, so the reply names the replacement; never longer than a
            # promotion deadline (the promoter runs on its own thread; the client follows the map meanwhile)
            with self.promoter.promoted:
                self.promoter.wake.set()
                self.promoter.promoted.wait(self.config.promote_timeout_s)
        return self.state.snapshot()

    def ReportRedundant(self, request, context):
        with self.state.lock:
            info = self._holder(request, context)
            if info.state == PROMOTING:  # its Promote's answer is still on its way here: the server retries
                context.abort(grpc.StatusCode.UNAVAILABLE, f"the promotion of {request.server_id!r} to index "
                              f"{request.index} is not recorded yet; retry")
        snapshot = self.detector.mark_redundant(request.index, request.server_id,
                                        f"rebuild took {request.rebuild_seconds:.2f} s")
        if snapshot is not None:
            return snapshot
        return self.state.snapshot()

    def GetCoordinators(self, request, context):
        """Every live coordinator and the one that leads (answered by followers too)."""
        store = self.state.store
        try:
            others = store.coordinators()
        except StoreUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the coordinators cannot be listed: {exc}")
        leads = self.state.leading.is_set() and store.holds()
        leader = self.address if leads else store.leader_address()
        reply = coordinator_pb2.GetCoordinatorsReply(answered_by=self.address, leader=leader, store=store.describe())
        for address in sorted(set(others) | {self.address}):
            reply.coordinators.add(address=address, leads=address == leader)
        return reply

    def start(self) -> CoordinatorServer:
        """Serves this coordinator (on etcd: campaigns for the leadership first)."""
        if self.state.store_args is None:
            return CoordinatorServer(self)
        cfg, args = self.config, self.state.store_args
        files, shared = cfg.etcd_tls_files()
        tls = EtcdTLS(*files) if files else None
        if shared:
            log.warning(SHARED_CA_WARNING)
        me = f"{socket.gethostname()}-{os.getpid()}"
        return CoordinatorServer(self, lambda address: EtcdStore(
            args["endpoints"], args["prefix"], me=me, address=address, ttl_s=cfg.election_ttl_s,
            timeout_s=etcd_timeout_s(cfg), tls=tls))
