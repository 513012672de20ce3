"""The coordinator's links to the servers: stubs per address (health checks on a server's own health port), the
map sent to every server after each change (retried until each acknowledged it), and calls made on many servers
at once (creating a table or a dense tensor)."""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2_grpc

from ecrec.control.cluster_state import FAILED, ClusterState
from ecrec.net import transport
from ecrec.wire import cluster_pb2, embedding_pb2_grpc

log = logging.getLogger("ecrec.coordinator")


class ServerHandle:
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


class ServerLinks:
    """One :class:`ServerHandle` per address, the map's broadcast, and calls on several servers."""

    def __init__(self, state: ClusterState, stop: threading.Event):
        self.state = state
        self.config = state.config
        self._stop = stop
        self._handles: dict[str, ServerHandle] = {}
        self._broadcast_pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="ecrec-broadcast")
        self.behind = threading.Event()  # a server missed a map: the monitor sends it again

    def handle(self, address: str) -> ServerHandle:
        """The stubs of ``address`` (made on first use, from the map's entry for it); call with the lock held."""
        h = self._handles.get(address)
        if h is None:
            info = next((s for s in self.state.map.servers if s.address == address), None)
            h = self._handles[address] = ServerHandle(address, info.health_address if info is not None else "",
                                                      self.config.security)
        return h

    def forget(self, address: str | None = None) -> None:
        """Drops the stubs of ``address`` (a new process registered there: new stubs, new counters), or all."""
        if address is None:
            self._handles.clear()
        else:
            self._handles.pop(address, None)

    def broadcast(self, snapshot: cluster_pb2.ClusterMap) -> None:
        """Sends the map to every server not declared failed; :meth:`rebroadcast` retries those that missed it."""
        for s in snapshot.servers:
            if s.state == FAILED:
                continue
            with self.state.lock:
                h = self.handle(s.address)
            if self._stop.is_set():
                return  # stopping: the pool is shut down
            try:
                fut = self._broadcast_pool.submit(h.embedding.UpdateClusterMap, snapshot,
                                                  timeout=self.config.rpc_timeout_s)
            except RuntimeError:  # the pool was shut down meanwhile (the coordinator stops)
                return
            fut.add_done_callback(lambda f, h=h, epoch=snapshot.epoch: self._map_sent(h, epoch, f))

    def _map_sent(self, h: ServerHandle, epoch: int, fut) -> None:
        if fut.exception() is None:
            h.map_epoch = max(h.map_epoch, epoch)
        else:
            log.debug("map update to %s failed: %s", h.health_address, fut.exception())
            self.behind.set()

    def rebroadcast(self) -> None:
        """Sends the current map again to every live server that has not acknowledged it (or a newer one)."""
        with self.state.lock:
            epoch = self.state.map.epoch
            behind = [s for s in self.state.map.servers
                      if s.state != FAILED and self.handle(s.address).map_epoch < epoch]
            snapshot = cluster_pb2.ClusterMap()
            snapshot.CopyFrom(self.state.map)
            handles = [self.handle(s.address) for s in behind]
        for h in handles:
            try:
                h.embedding.UpdateClusterMap(snapshot, timeout=self.config.health_timeout_s)
                h.map_epoch = max(h.map_epoch, epoch)
            except grpc.RpcError:
                pass

    def call_all(self, addresses: list[str], call) -> str | None:
        """Runs ``call(stub)`` on every address in parallel; returns the first error's text or None."""
        errors = [e for e in self.call_each(addresses, call).values() if e is not None]
        return "; ".join(errors) or None

    def call_each(self, addresses: list[str], call, still_wanted=None, poll_s: float = 0.5) -> dict[str, str | None]:
        """Runs ``call(stub)`` on every address in parallel: address -> None (done) or its error's text.  With
        ``still_wanted(address) -> bool``, asked every ``poll_s`` while a call is under way, a call whose server
        is no longer wanted (it was replaced) is not waited for: its answer is ``"replaced"``."""
        with self.state.lock:
            stubs = [(a, self.handle(a).embedding) for a in addresses]
        out: dict[str, str | None] = {}
        pool = futures.ThreadPoolExecutor(max_workers=max(1, len(stubs)), thread_name_prefix="ecrec-call")
        try:
            running = {pool.submit(call, stub): address for address, stub in stubs}
            while running:
                done, _ = futures.wait(running, timeout=poll_s if still_wanted else None)
                for fut in done:
                    address = running.pop(fut)
                    try:
                        fut.result()
                        out[address] = None
                    except grpc.RpcError as exc:
                        out[address] = f"server {address}: {exc.code().name}: {exc.details()}"
                if still_wanted is not None:
                    for fut, address in list(running.items()):
                        if not still_wanted(address):
                            del running[fut]
                            out[address] = "replaced"
        finally:
            pool.shutdown(wait=False)  # a call to a replaced server ends by its own deadline
        return out

    def close(self) -> None:
        self._broadcast_pool.shutdown(wait=False, cancel_futures=True)
