"""The server process (``ecrec-server serve``): binds its gRPC and health ports, registers with the coordinator,
keeps its lease (granted by the coordinator, or an etcd lease when the map names a lease store: one
:class:`~ecrec.control.lease.LeaseKeeper` either way), runs the strategy's timer and stops when its lease is
refused (it was replaced)."""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import threading
import time
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ecrec.config import SHARED_CA_WARNING, ServerConfig
from ecrec.control.etcd import EtcdTLS
from ecrec.control.etcd_lease import EtcdLease
from ecrec.control.lease import CoordinatorLease, LeaseKeeper, Renewal
from ecrec.net import transport
import ecrec.server.collector as collector
from ecrec.server.service import EmbeddingServicer
from ecrec.server.state import ServerState
from ecrec.snapshot import bulk as snapshot_bulk
from ecrec.tables import spec as tables
from ecrec.wire import coordinator_pb2, embedding_pb2_grpc

log = logging.getLogger("ecrec.server")

#: how long a server that lost its lease lets calls in flight finish before it exits (they are refused anyway)
REPLACED_GRACE_S = 0.2
#: while renewals cannot reach the coordinator (or etcd), one warning this often, with the count of tries
UNREACHABLE_LOG_S = 10.0


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
        collector.watch()  # full collections counted from the start (status, metrics)
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
        self.etcd_lease: EtcdLease | None = None
        self._keeper: LeaseKeeper | None = None  # renews the lease (either backend) until it is lost or we stop
        self._registered = threading.Event()  # renewals grant the serving lease only once registered
        self.fenced: str | None = None  # why the lease was lost (declared failed): the process exits 1
        self._lost_registering = ""  # why the lease was lost before the registration ended
        self._seen_revision = 0  # etcd's revision at the last map fetch a renewal asked for
        # renewals that could not reach the coordinator (or etcd) since the last one that did: when the first
        # failed, how many, when one was last logged and what it said (one line every UNREACHABLE_LOG_S, not one a
        # try, unless the reason changes)
        self._unreachable: list | None = None
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
        started = time.perf_counter()
        tables.warm_up()
        snapshot_bulk.warm_up()  # and a restore's gather
        log.info("kernels warm in %.2f s", time.perf_counter() - started)
        self._first_map(deadline)
        if not self.config.no_gc_freeze:  # the start-up's objects (imports, kernels, the strategy) out of every
            frozen, took = collector.freeze()  # later full collection
            log.info("%d objects of the start-up kept out of garbage collections (a full collection over them took "
                     "%.0f ms)", frozen, 1e3 * took)
        collector.watch().mark()  # the status counts full collections from here: while serving
        if self.state.map is not None and self.state.map.lease_store:
            files, shared = self.config.etcd_tls_files()
            tls = EtcdTLS(*files) if files else None
            if shared:
                log.warning(SHARED_CA_WARNING)
            self.etcd_lease = EtcdLease(self.state.map.lease_store, self.state.map.lease_s, self.state.server_id,
                                        self.state.address, tls)
            self.etcd_lease.acquire(deadline)  # before registering: the coordinator checks the key
            self._seen_revision = self.etcd_lease.revision
            # kept alive from now on (no coordinator may lead yet, or one may be slow to answer): a registration
            # never outlasts it; renewals grant the serving lease once registered
            self._keeper = self._keep(self._renew_etcd, self.etcd_lease.period_s, self.etcd_lease.renewed_at)
        try:
            sent, reply = self._register(max(1.0, deadline - time.monotonic()))
        except BaseException:
            if self._keeper is not None:  # the etcd lease kept alive through the registration: given up
                self._keeper.stop()
            if self.etcd_lease is not None:
                self.etcd_lease.release()
            raise
        if self.etcd_lease is None:
            lease = CoordinatorLease(self.state.coordinator, self.state.server_id,
                                     lambda: (self.state.index, self.state.epoch), reply.lease_s)
            self._keeper = self._keep(lease.renew, lease.period_s, sent)
        self._timer_thread = threading.Thread(target=self._timer_loop, name="ecrec-strategy-timer", daemon=True)
        self._timer_thread.start()

    def _first_map(self, deadline: float) -> None:
        """Reads the coordinator's map until ``deadline`` (it may not be up yet: a warning every 10 s).  A coordinator that refuses this server's credentials, or that takes calls without the
        token this server was given (its own calls would carry none, and every one would be refused here), ends
        the start at once with RuntimeError: neither gets better by waiting."""
        from ecrec.net.peers import warn_level

        while self.state.map is None and time.monotonic() < deadline:
            try:
                self.state.coordinator.get_map()
                break
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise RuntimeError(f"coordinator {self.config.coordinator} refuses this server: "
                                       f"{exc.code().name}: {exc.details()} (start both with the same --token-file "
                                       "and certificates of the same --tls-ca)") from None
                log.log(warn_level(("waiting for", self.config.coordinator)), "waiting for coordinator %s: %s",
                        self.config.coordinator, exc.code().name)
                time.sleep(0.2)
        security = self.config.security
        if self.state.map is not None and security.token:
            from ecrec.net.peers import coordinator_stub
            from ecrec.net.security import Security

            probe = coordinator_stub(self.config.coordinator,
                                     security=Security(security.tls_cert, security.tls_key, security.tls_ca, None))
            try:
                probe.GetClusterMap(coordinator_pb2.GetClusterMapRequest(), timeout=self.config.coordinator_timeout_s)
            except grpc.RpcError:
                return  # refused (or unreachable): it checks the token, as this server does
            finally:
                probe.close()
            raise RuntimeError(f"coordinator {self.config.coordinator} answers calls without the token this server "
                               "was given (--token-file): its own calls would carry none and be refused here; start "
                               "it with the same --token-file")

    def _register(self, timeout_s: float) -> tuple[float, coordinator_pb2.RegisterReply]:
        """Registers with the coordinator (retried while it is unavailable) and takes the serving lease; returns
        when the accepted request was sent and the reply."""
        stub = self.state.coordinator.stub
        deadline = time.monotonic() + timeout_s
        request = coordinator_pb2.RegisterRequest(
            address=self.state.address, standby=self.config.standby, server_id=self.state.server_id,
            want_index=self.config.want_index, health_address=f"{self.public_host}:{self.health_port}",
            etcd_lease=self.etcd_lease.id if self.etcd_lease is not None else 0,
        )
        reply = None
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
        self._registered.set()  # from here a renewal that finds the lease gone stops this server
        if self.etcd_lease is not None:
            gone = self.etcd_lease.gone or self._lost_registering
            if gone:  # revoked (it was replaced) or expired while registering, or its keeper failed: it never serves
                raise RuntimeError(f"this server's etcd lease {self.etcd_lease.id:x} is gone ({gone}) "
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
        if self.config.want_index >= 0 and reply.index != self.config.want_index:
            # --index N taken (or the cluster formed already): it waits as a spare, first in line for N
            log.warning("index %d is held by another server (or the cluster has formed): this server is a standby, "
                        "promoted into index %d first should it fail", self.config.want_index, self.config.want_index)
        return sent, reply

    # --- the lease: one keeper, either backend (ecrec.control.lease) ------------------------------------------
    def _keep(self, renew, period_s, last_sent: float) -> LeaseKeeper:
        return LeaseKeeper("ecrec-lease", renew, period_s, on_renewed=self._lease_renewed, on_lost=self._lease_lost,
                           on_unreachable=self._lease_unreachable, last_sent=last_sent).start()

    def _renew_etcd(self) -> Renewal:
        if self.state.map is not None and self._registered.is_set():
            self.etcd_lease.follow(self.state.map.lease_store)  # a new leader may reach etcd elsewhere
        return self.etcd_lease.renew()

    def _lease_renewed(self, renewal: Renewal) -> None:
        """A renewal was granted: the serving lease extends from when it was sent; a newer map it hints at (the
        coordinator's epoch, etcd's revision) is fetched off this thread."""
        if self._unreachable is not None:
            log.info("the lease is renewed again, after %d failed tries in %.1f s", self._unreachable[1],
                     time.monotonic() - self._unreachable[0])
            self._unreachable = None
        if not self._registered.is_set():
            return  # registering: the registration grants the serving lease
        st = self.state
        st.lease.grant(renewal.sent, renewal.ttl_s)
        if self.etcd_lease is None:
            if renewal.epoch > st.epoch:
                self._refresh_map_soon()
        elif renewal.revision > self._seen_revision and self._refresh_map_soon():
            self._seen_revision = renewal.revision

    def _lease_lost(self, reason: str) -> None:
        """The coordinator refused the lease or etcd says it is gone: this server was replaced (or expired).  It
        stops serving at once and exits; while registering, the registration fails instead."""
        if not self._registered.is_set():
            self._lost_registering = reason  # the registration raises it
            return
        log.error("this server's lease is gone (%s): it was declared failed (a standby takes its index, if one is "
                  "free); stopping, exit status 1 (started again, it joins as a new server)", reason)
        self.fenced = reason
        self.state.lease.revoke(reason)
        # no grace worth waiting for: every call in flight is refused at its reply (the lease is revoked)
        threading.Thread(target=self.stop, args=(REPLACED_GRACE_S,), name="ecrec-stop", daemon=True).start()

    def _lease_unreachable(self, last_ok: float, exc: Exception) -> bool:
        now = time.monotonic()
        if self._unreachable is None:
            self._unreachable = [now, 0, -math.inf, ""]
        since, tries, logged, said = self._unreachable
        self._unreachable[1] = tries = tries + 1
        reason = type(exc).__name__ + re.sub(r"[0-9.]+", "#", str(exc))[:80]  # its kind, not its numbers
        if now - logged < UNREACHABLE_LOG_S and reason == said:
            return False  # keep trying, quietly: the line above still stands (a new reason is said at once)
        self._unreachable[2], self._unreachable[3] = now, reason
        many = f" ({tries} tries in {now - since:.0f} s)" if tries > 1 else ""
        if not self._registered.is_set():
            log.warning("renewing the etcd lease while registering: %s%s", exc, many)
        elif self.state.index >= 0:
            left = self.state.lease.remaining_s()
            log.warning("%s; %s%s", exc, f"serving until {left:.1f} s from now" if left > 0 else
                        "its lease has run out: serving nothing until the coordinator answers", many)
        else:
            log.warning("%s; a standby, it waits to be reachable again%s", exc, many)
        return False  # keep trying: the serving lease runs out by itself

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
            self.state.cuts.expire()  # a snapshot's cut whose snapshotter is gone stops keeping rows
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
        if self._keeper is not None:
            self._keeper.stop()
        self._grpc.stop(grace_s).wait()
        self._health_grpc.stop(0).wait()
        if self.etcd_lease is not None:
            self.etcd_lease.release()
        self.stopped.set()
