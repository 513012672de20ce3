"""Promotion: a standby takes the index of a failed server, once that server surely serves no more.

A failed server is replaced at once when its process is gone, else only after its lease has run out (on etcd:
its key is gone, and a TTL has passed since this leader's own answered revocation or since it first saw the key
gone).  A promotion is recorded before the standby hears of it (its entry ``PROMOTING`` at the index, the intent
persisted; the ``Promote`` carries that recorded map: one epoch, one map), runs on its own thread with a
deadline, and skips a standby that stops answering health checks meanwhile; a restarted or newly elected
coordinator finishes a recorded promotion first.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent import futures

import grpc

from ecrec.control.cluster_state import (ACTIVE, FAILED, PROMOTING, RECOVERING, STANDBY, ClusterState,
                                         rounds_while_leading)
from ecrec.control.detection import connection_refused
from ecrec.control.links import ServerLinks
from ecrec.control.stores import StoreUnavailable
from ecrec.wire import cluster_pb2, coordinator_pb2, embedding_pb2

log = logging.getLogger("ecrec.coordinator")


class Promoter:
    """Fences failed servers and promotes standbys into their indices (see the module).  ``declare_failed`` is
    the failure detector's (a standby whose process is gone mid-promotion)."""

    def __init__(self, state: ClusterState, links: ServerLinks, stop: threading.Event, declare_failed):
        self.state = state
        self.config = state.config
        self.links = links
        self._stop = stop
        self._declare_failed = declare_failed
        self._lock = threading.Lock()  # one round at a time (the promoter thread; a client's report; a test)
        self.wake = threading.Event()  # wakes the promoter (a failure declared, a standby registered)
        self.promoted = threading.Condition()  # notified after each round of promotions

    def on_failure(self, fence: bool = False) -> None:
        """A server was declared failed (``fence``: it may still hold an etcd lease, revoke it now), or the
        monitor finished a round: promote what can be promoted."""
        if fence:
            self.fence_etcd_leases()
        self.wake.set()

    def safe_to_replace(self, failed: list[cluster_pb2.ServerInfo], etcd_leases: dict[str, int] | None) -> bool:
        """Whether none of ``failed`` can still be serving: each is gone, or its lease has run out (with etcd
        leases: its key is gone, and a TTL has passed since this leader's answered revocation or since it first saw
        the key gone)."""
        cs, now = self.state, time.monotonic()
        return all(s.server_id in cs.gone or (cs.leases.get(s.server_id, 0.0) <= now and (
            etcd_leases is None or (s.server_id not in etcd_leases and s.server_id not in cs.untimed)))
                   for s in failed)

    # --- etcd leases (``map.lease_store``) -----------------------------------------------------------
    def fence_etcd_leases(self) -> dict[str, int] | None:
        """Revokes the etcd lease of every failed server (and removed standby) that still holds one: it stops at
        its next renewal, so it may serve until a TTL after the revocation, which the promotion waits.  A failed
        server whose key is gone is timed from when this leader first sees that (whoever revoked it, whenever).
        A revocation etcd did not answer is tried again next round.  Returns the leases etcd holds now, or None
        when etcd cannot be read (nothing is promoted then)."""
        cs = self.state
        with cs.lock:  # only what was so before the read: a key read before a server registered says nothing
            untimed_before, dropped_before = set(cs.untimed), set(cs.dropped)
        try:
            leases = cs.store.server_leases()
        except StoreUnavailable as exc:
            log.warning("the servers' etcd leases cannot be read: %s", exc)
            return None
        with cs.lock:
            failed = {s.server_id for s in cs.map.servers if s.state == FAILED}
            cs.untimed &= failed  # an entry no longer in the map (replaced) is moot
            # a standby back in the map (its removal was rolled back) is not fenced; one whose key is gone is done
            cs.dropped -= {s.server_id for s in cs.map.servers} | (dropped_before - leases.keys())
            for server_id in (cs.untimed & untimed_before) - leases.keys():
                # revoked (or expired) by now, by whoever: a TTL from here covers it
                cs.leases[server_id] = max(cs.leases.get(server_id, 0.0), time.monotonic() + cs.lease_wait_s)
                cs.untimed.discard(server_id)
            doomed = {server_id: lease for server_id, lease in leases.items() if server_id in failed | cs.dropped}
            for server_id in doomed.keys() & failed:
                cs.leases[server_id] = math.inf  # until the revocation is answered
        for server_id, lease in doomed.items():
            answered = False
            try:
                cs.store.revoke_lease(lease)
                answered = True
                log.info("revoked the etcd lease of %s server %s", "failed" if server_id in failed else "removed",
                         server_id)
            except StoreUnavailable as exc:  # it may still happen: untimed until answered, or the key seen gone
                log.warning("revoking the etcd lease of server %s: %s", server_id, exc)
            finally:
                with cs.lock:
                    if server_id in failed:
                        cs.leases[server_id] = time.monotonic() + cs.lease_wait_s
                        if answered:
                            cs.untimed.discard(server_id)
                        else:
                            cs.untimed.add(server_id)
                    elif answered:
                        cs.dropped.discard(server_id)
            if answered:
                leases.pop(server_id, None)
        return leases

    # --- promotions --------------------------------------------------------------------------------
    def promote_standbys(self) -> None:
        """One round: every promotion that can be done now, one after another."""
        with self._lock:
            try:
                self._promote_standbys_locked()
            finally:
                with self.promoted:
                    self.promoted.notify_all()

    def _choose_locked(self, etcd_leases: dict[str, int] | None = None
                       ) -> tuple[cluster_pb2.ServerInfo, int, cluster_pb2.ClusterMap | None] | None:
        """The next promotion: (its standby's entry, the index, the map that recorded it now or None when it was
        recorded before), recorded in the map as ``PROMOTING`` (one epoch, one map: the Promote carries this
        recorded map) and persisted as the intent; None when there is none to do now.  A promotion begun before
        (by this or a crashed coordinator) is finished first, with its own standby, unless that standby has been
        declared failed meanwhile."""
        cs = self.state
        for server_id, p in list(cs.promoting.items()):
            entry = next((s for s in cs.map.servers if s.server_id == server_id and s.state != FAILED), None)
            if entry is not None and entry.state == PROMOTING and entry.index == p.index:
                return entry, p.index, None
            if entry is not None and entry.state == STANDBY:  # recorded by an older coordinator before its Promote
                return entry, p.index, self._record_promoting_locked(entry, p.index)
            del cs.promoting[server_id]  # its standby failed (or was promoted): the intent is void
            cs.save_locked()
        failed_entries = [s for s in cs.map.servers if s.state == FAILED and s.index >= 0]
        held = {s.index for s in cs.map.servers if s.index >= 0 and s.state != FAILED}
        failed = sorted({s.index for s in failed_entries} - held)
        standbys = [s for s in cs.map.servers if s.state == STANDBY]
        if not failed or not standbys:
            return None
        # a restarted server that asked for one of these indices first, else any standby; an index whose failed
        # holders (a server, a standby abandoned midway through its promotion) may still serve waits their lease
        safe = [i for i in failed if self.safe_to_replace([s for s in failed_entries if s.index == i], etcd_leases)]
        if not safe:
            return None
        chosen = next((s for s in standbys if cs.wanted.get(s.server_id) in safe), standbys[0])
        index = cs.wanted[chosen.server_id] if cs.wanted.get(chosen.server_id) in safe else safe[0]
        return chosen, index, self._record_promoting_locked(chosen, index)

    def _record_promoting_locked(self, chosen: cluster_pb2.ServerInfo, index: int) -> cluster_pb2.ClusterMap:
        chosen.index = index
        chosen.state = PROMOTING
        self.state.promoting[chosen.server_id] = coordinator_pb2.PendingPromotion(
            server_id=chosen.server_id, address=chosen.address, index=index)
        return self.state.bump_locked()  # persisted with the intent: a restart finishes it

    def _promote_standbys_locked(self) -> None:
        cs = self.state
        while not self._stop.is_set() and (cs.leads() or cs.store.kind == "file"):
            etcd_leases = None
            if cs.map.lease_store:
                with cs.lock:  # read etcd only when there is something to fence or promote
                    work = bool(cs.promoting or cs.dropped or cs.untimed) or (
                        any(s.state == STANDBY for s in cs.map.servers)
                        and any(s.state == FAILED and s.index >= 0 for s in cs.map.servers))
                if not work:
                    return
                etcd_leases = self.fence_etcd_leases()
                if etcd_leases is None:
                    return  # etcd cannot be read: no promotion can be recorded either
            with cs.lock:
                choice = self._choose_locked(etcd_leases)
                if choice is None:
                    return
                chosen, index, snapshot = choice
                address, server_id = chosen.address, chosen.server_id
                recorded = snapshot if snapshot is not None else cluster_pb2.ClusterMap.FromString(
                    cs.map.SerializeToString())
                dense = [embedding_pb2.CreateDenseRequest(spec=d.spec, initial_value=d.initial_value)
                         for name, d in cs.dense.items() if index in cs.layout.dense_servers(name)]
                stub = self.links.handle(address).embedding
            if snapshot is not None:
                log.info("promoting %s to index %d (epoch %d)", address, index, snapshot.epoch)
                self.links.broadcast(snapshot)
            ack = self._send_promote(stub, address, server_id, index, recorded, dense)
            if ack is None:
                if self._still_promoting(server_id, index):
                    return  # it is healthy but did not finish (e.g. a survivor is slow): the promoter retries
                log.warning("standby %s did not complete its promotion to index %d and was declared failed; the "
                            "next standby takes the index once its lease has run out", address, index)
                with cs.lock:
                    if cs.promoting.pop(server_id, None) is not None:
                        cs.save_locked()
                continue
            cs.faults.hit("record_promotion")
            with cs.lock:
                entry = next((s for s in cs.map.servers if s.server_id == server_id and s.state == PROMOTING
                              and s.index == index), None)
                if entry is None:  # declared failed while its Promote was answered: the next standby goes
                    continue
                for s in list(cs.map.servers):
                    if s.index == index and s.state == FAILED:
                        cs.map.servers.remove(s)
                entry.state = RECOVERING if ack.recovering else ACTIVE
                cs.wanted.pop(server_id, None)
                cs.promoting.pop(server_id, None)
                cs.extend_lease_locked(server_id, self.config.lease_s)
                cs.event_locked("promoted", index, address)
                if not ack.recovering:
                    cs.event_locked("redundant", index, address)
                snapshot = cs.bump_locked()
            log.info("promoted %s to index %d (epoch %d)%s", address, index, snapshot.epoch,
                     "; it rebuilds in the background" if ack.recovering else "")
            self.links.broadcast(snapshot)

    def _still_promoting(self, server_id: str, index: int) -> bool:
        with self.state.lock:
            return any(s.server_id == server_id and s.state == PROMOTING and s.index == index
                       for s in self.state.map.servers)

    def _send_promote(self, stub, address: str, server_id: str, index: int, recorded: cluster_pb2.ClusterMap,
                      dense) -> embedding_pb2.Ack | None:
        """Sends Promote (idempotent) until it is answered, while the standby stays ``PROMOTING``: the health
        monitor runs on its own thread and declares a standby that stops answering failed, which ends the wait
        at once.  Returns the ack, or None (the standby failed, or a call ended in an error that is not a
        timeout: the promoter retries later)."""
        request = embedding_pb2.PromoteRequest(index=index, map=recorded, dense=dense)
        give_up = time.monotonic() + self.config.rpc_timeout_s
        while not self._stop.is_set() and self._still_promoting(server_id, index):
            if self.state.store.kind != "file" and not self.state.leads():
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
                if connection_refused(address, self.config.health_timeout_s):
                    self._declare_failed(address, gone=True)
                    return None
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() > give_up:
                    return None  # e.g. a survivor did not answer its resolution yet: retried later
            except (grpc.FutureCancelledError, futures.CancelledError):
                return None
        return None

    def run(self) -> None:
        """Promotes standbys into failed indices; on its own thread, so a slow or paused standby never holds up
        the health checks (which are what declare it failed)."""
        rounds_while_leading(self.state, self._stop, self.wake, self.config.health_interval_s, self._round)

    def _round(self) -> None:
        try:
            self.promote_standbys()
        except Exception:  # noqa: BLE001 - reported, never swallowed; retried at the next wake
            log.exception("promotion failed")
