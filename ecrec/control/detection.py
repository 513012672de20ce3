"""Failure detection: which servers are alive, and which must be replaced.

Servers are watched with the standard gRPC health service on a port of their own (a server busy with pushes still
answers), in parallel (one server that does not answer delays no other's check).  A server is declared failed
when its health port does not answer and a connection to its data port is refused (the process is gone; one in
its stop's grace still answers there) or when it misses ``failures_before_dead`` checks in a
row spanning at least ``failure_timeout_s`` (a client's report only triggers a check); on etcd, also when its
lease key is gone.  The monitor also asks ``RECOVERING`` servers for their state (an index whose report of full
redundancy was lost still becomes ``ACTIVE``) and sends maps again to servers that missed one.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2

from ecrec.control.cluster_state import FAILED, RECOVERING, STANDBY, ClusterState, rounds_while_leading
from ecrec.control.links import ServerLinks
from ecrec.control.stores import NotLeader, StoreUnavailable
from ecrec.wire import cluster_pb2

log = logging.getLogger("ecrec.coordinator")


def connection_refused(address: str, timeout_s: float) -> bool:
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


class FailureDetector:
    """Health checks, declarations of failure, the state of recovering servers (see the module).
    ``on_failure()`` is called after each declaration (the promoter fences and replaces)."""

    def __init__(self, state: ClusterState, links: ServerLinks, stop: threading.Event, on_failure):
        self.state = state
        self.config = state.config
        self.links = links
        self._stop = stop
        self._on_failure = on_failure
        self.wake = threading.Event()  # set to run the monitor now (a registration, a failure)
        self._check_pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="ecrec-health-check")

    def answers(self, address: str) -> bool:
        """Whether the server registered at ``address`` answers a health check now."""
        with self.state.lock:
            h = self.links.handle(address)
        try:
            resp = h.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.config.health_timeout_s)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def check_server(self, address: str) -> bool:
        """Health-checks ``address``; declares it failed when nothing listens there any more (its process is
        gone), or when it has failed ``failures_before_dead`` checks in a row over at least
        ``failure_timeout_s``.  True if alive."""
        with self.state.lock:
            h = self.links.handle(address)
        answered = False  # the process answered at all (a server stopping gracefully answers NOT_SERVING)
        try:
            resp = h.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.config.health_timeout_s)
            alive = resp.status == health_pb2.HealthCheckResponse.SERVING
            answered = True
        except grpc.RpcError:
            alive = False
        if alive:
            h.failed_checks = 0
            return True
        now = time.monotonic()
        if h.failed_checks == 0:
            h.first_failed_at = now
        h.failed_checks += 1
        # gone at once only when nothing answers: a server in its stop's grace has closed its data port while
        # requests already in flight still run there, and its health port still answers; it fails by the
        # checks (and its lease) instead
        gone = not answered and connection_refused(address, self.config.health_timeout_s)
        if gone or (h.failed_checks >= self.config.failures_before_dead
                    and now - h.first_failed_at >= self.config.failure_timeout_s):
            self.declare_failed(address, gone)
        return False

    def declare_failed(self, address: str, gone: bool = False, why: str = "") -> None:
        cs = self.state
        with cs.lock:
            info = next((s for s in cs.map.servers if s.address == address and s.state != FAILED), None)
            if info is None:
                return
            if gone:
                cs.gone.add(info.server_id)
            elif cs.map.lease_store:
                # its etcd lease may have been revoked (by a deposed leader, by hand) moments ago: it may serve
                # until its next renewal, so a TTL from now bounds it, until this leader times its end
                cs.leases[info.server_id] = max(cs.leases.get(info.server_id, 0.0), time.monotonic() + cs.lease_wait_s)
                if info.state != STANDBY:
                    cs.untimed.add(info.server_id)
            was_standby = info.state == STANDBY
            if was_standby:
                cs.map.servers.remove(info)
                if cs.map.lease_store:
                    cs.dropped.add(info.server_id)
            else:
                info.state = FAILED
                cs.event_locked("failed", info.index, address)
            snapshot = cs.bump_locked()
        log.warning("server %s (%s) declared failed (%s); epoch %d", address,
                    "standby" if was_standby else f"index {info.index}",
                    "its process is gone" if gone else why or "missed its health checks", snapshot.epoch)
        self.links.broadcast(snapshot)
        self._on_failure(fence=bool(cs.map.lease_store and not gone))
        self.wake.set()

    def check_etcd_leases(self) -> None:
        """Declares failed every server of the map whose etcd lease key is gone (it expired: the server stopped
        serving, or will stop at its next renewal)."""
        with self.state.lock:
            known = {s.server_id: s.address for s in self.state.map.servers if s.state != FAILED}
        try:
            leases = self.state.store.server_leases()  # read after ``known``: a server registers with its key there
        except StoreUnavailable as exc:
            log.warning("the servers' etcd leases cannot be read: %s", exc)
            return
        for server_id, address in known.items():
            if server_id not in leases:
                self.declare_failed(address, why="its etcd lease expired")

    def poll_recovering(self) -> None:
        """Asks each ``RECOVERING`` server for its state (the map update's ack says whether it still rebuilds):
        an index whose report of full redundancy was lost or refused still becomes ``ACTIVE``."""
        with self.state.lock:
            recovering = [(s.address, s.server_id, s.index) for s in self.state.map.servers if s.state == RECOVERING]
            snapshot = cluster_pb2.ClusterMap()
            snapshot.CopyFrom(self.state.map)
            stubs = {address: self.links.handle(address).embedding for address, _, _ in recovering}
        for address, server_id, index in recovering:
            try:
                ack = stubs[address].UpdateClusterMap(snapshot, timeout=self.config.health_timeout_s)
            except grpc.RpcError:
                continue
            if ack.recovering or ack.index != index:
                continue
            self.mark_redundant(index, server_id, "its rebuild finished (asked by the coordinator)")

    def mark_redundant(self, index: int, server_id: str, why: str) -> cluster_pb2.ClusterMap | None:
        with self.state.lock:
            snapshot = self.state.mark_redundant_locked(index, server_id)
        if snapshot is None:
            return None
        log.info("index %d fully redundant again: %s; epoch %d", index, why, snapshot.epoch)
        self.links.broadcast(snapshot)
        return snapshot

    def run(self) -> None:
        """The monitor: every ``health_interval_s`` or when woken, while this coordinator leads."""
        rounds_while_leading(self.state, self._stop, self.wake, self.config.health_interval_s, self._round)

    def _round(self) -> bool | None:
        """Health checks, etcd lease keys, recovering servers, maps that did not reach a server; False once the
        coordinator stops."""
        with self.state.lock:
            addresses = [s.address for s in self.state.map.servers if s.state != FAILED]
        try:
            checks = self._check_pool.map(self.check_server, addresses)
        except RuntimeError:  # the pool was shut down (the coordinator stops): nothing was submitted
            return False
        try:
            list(checks)
        except (NotLeader, StoreUnavailable) as exc:  # RuntimeErrors too: a declaration the store did not record
            log.warning("a failure found by the health checks was not recorded (%s); the next round, here or at the "
                        "next leader, checks again", exc)
        except Exception:  # noqa: BLE001 - reported, never swallowed
            log.exception("health checks failed")
        if self.state.map.lease_store:
            try:
                self.check_etcd_leases()
            except Exception:  # noqa: BLE001 - reported, never swallowed
                log.exception("checking the servers' etcd leases failed")
        self._on_failure(fence=False)  # a round of promotions (a standby may have registered)
        try:
            self.poll_recovering()
        except Exception:  # noqa: BLE001 - reported, never swallowed
            log.exception("asking recovering servers for their state failed")
        if self.links.behind.is_set():
            self.links.behind.clear()
            self.links.rebroadcast()
        return None

    def close(self) -> None:
        self._check_pool.shutdown(wait=False, cancel_futures=True)

