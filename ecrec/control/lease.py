"""Leases: a process acts (a server serves, a coordinator leads) only while its lease surely lasts.

One abstraction, two backends, one keep-alive loop:

- :class:`ServingLease` is what the holder checks before it acts: valid until a margin before the lease could
  end, counted from *before* the request that renewed it was sent, so the holder always stops first;
- a backend renews once and says how it went (:class:`Renewal`): :class:`CoordinatorLease` asks the
  coordinator (``RenewLease``, the file-store control plane), ``ecrec.control.etcd_lease.EtcdLease`` keeps an
  etcd lease alive on one long-lived keep-alive stream (the etcd control plane);
- :class:`LeaseKeeper` is the loop every holder runs (a server's lease, on either backend, and a coordinator's
  election on etcd): a renewal a third of the TTL after the last one was sent, sooner after a failed try, and
  the holder's callbacks on each outcome.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from ecrec.wire import coordinator_pb2

log = logging.getLogger("ecrec.lease")


class LeaseUnreachable(RuntimeError):
    """A renewal got no answer: the lease may still be alive (try again soon) or may be running out."""


@dataclass(frozen=True)
class Renewal:
    """The outcome of one renewal: ``sent`` (monotonic, before the request went), the TTL granted in seconds
    (0: the lease is gone or refused, ``reason`` says why) and what else the answer told (the newest map epoch
    the coordinator knows, etcd's revision: a newer map may be waiting)."""

    sent: float
    ttl_s: float
    reason: str = ""
    epoch: int = 0
    revision: int = 0

    @property
    def granted(self) -> bool:
        return self.ttl_s > 0


class ServingLease:
    """The holder's view of its lease: it serves while :meth:`valid`.  Granted from when the renewal was sent,
    shortened by ``margin``; once revoked it stays revoked (this holder was replaced)."""

    def __init__(self, margin: float = 0.9):
        self.margin = margin
        self.until = 0.0  # monotonic
        self.length_s = 0.0
        self.revoked = ""  # why it was refused or lost (this server was replaced)

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

    def remaining_s(self) -> float:
        return max(0.0, self.until - time.monotonic()) if self.valid() else 0.0


class LeaseKeeper:
    """Renews a lease until it is lost or :meth:`stop` is called, on a thread of its own.

    ``renew()`` renews once: a :class:`Renewal`, or :class:`LeaseUnreachable` when nobody answered.  The next
    renewal is sent ``period_s()`` after the last one was *sent* (however long it took), or ``retry_s()`` after a
    failed try.  ``on_renewed(renewal)`` follows every granted renewal; ``on_lost(reason)`` a refused one (the
    loop ends); ``on_unreachable(last_ok, error)`` a failed try, and ends the loop when it returns True (the
    holder gives up: e.g. a leader unsure of its lease for too long).  A callback's own error is reported and
    ends the loop, never swallowed."""

    def __init__(self, name: str, renew: Callable[[], Renewal], period_s: Callable[[], float],
                 on_renewed: Callable[[Renewal], None], on_lost: Callable[[str], None],
                 on_unreachable: Callable[[float, Exception], bool] | None = None,
                 retry_s: Callable[[], float] | None = None, last_sent: float | None = None):
        self.name = name
        self._renew, self._period_s = renew, period_s
        self._retry_s = retry_s or (lambda: period_s() / 3.0)
        self._on_renewed, self._on_lost, self._on_unreachable = on_renewed, on_lost, on_unreachable
        self.last_ok = time.monotonic() if last_sent is None else last_sent  # when the last granted renewal went
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "LeaseKeeper":
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, join_s: float | None = None) -> None:
        self._stop.set()
        if join_s is not None and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join_s)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        wait = max(0.0, self.last_ok + self._period_s() - time.monotonic())
        try:
            while not self._stop.wait(wait):
                try:
                    renewal = self._renew()
                except LeaseUnreachable as exc:
                    if self._stop.is_set():
                        return
                    if self._on_unreachable is not None and self._on_unreachable(self.last_ok, exc):
                        return
                    wait = self._retry_s()
                    continue
                if self._stop.is_set():
                    return
                wait = max(0.0, renewal.sent + self._period_s() - time.monotonic())
                if not renewal.granted:
                    self._on_lost(renewal.reason or "the lease is gone")
                    return
                self.last_ok = renewal.sent
                self._on_renewed(renewal)
        except Exception as exc:  # noqa: BLE001 - reported, never swallowed: the holder gives its lease up
            if not self._stop.is_set():
                log.exception("%s: the lease keeper stopped on an unexpected error", self.name)
                self._on_lost(f"its lease keeper failed ({type(exc).__name__}: {exc})")


class CoordinatorLease:
    """A server's lease granted by the coordinator (the file-store control plane): renewed with ``RenewLease``,
    refused once the server was declared failed."""

    def __init__(self, coordinator, server_id: str, where: Callable[[], tuple[int, int]], ttl_s: float):
        self._coordinator = coordinator  # ecrec.net.peers.CoordinatorClient
        self._server_id = server_id
        self._where = where  # () -> (index, epoch) this server holds now
        self.ttl_s = ttl_s

    def period_s(self) -> float:
        return max(0.05, self.ttl_s / 3.0) if self.ttl_s else 0.5

    def renew(self) -> Renewal:
        index, epoch = self._where()
        sent = time.monotonic()
        try:
            reply = self._coordinator.stub.RenewLease(coordinator_pb2.RenewLeaseRequest(
                server_id=self._server_id, index=index, epoch=epoch), timeout=self.period_s())
        except grpc.RpcError as exc:
            raise LeaseUnreachable(f"lease renewal failed ({exc.code().name})") from None
        if reply.granted:
            self.ttl_s = reply.lease_s
            return Renewal(sent, reply.lease_s, epoch=reply.epoch)
        if reply.epoch < epoch:
            # a coordinator whose map is older than this server's never held it: one started without the state
            # of this cluster (another --state-path, or none).  Not a verdict on this server: it keeps its rows,
            # serves nothing once its lease runs out, and goes on once the coordinator of its map answers again
            raise LeaseUnreachable(f"the coordinator answers with map epoch {reply.epoch}, older than this "
                                   f"server's {epoch}: it does not hold this cluster's state (restarted without its "
                                   "--state-path?); restart it with that path, or stop this server to start over")
        return Renewal(sent, 0.0, reason=f"the coordinator refused it ({reply.reason})", epoch=reply.epoch)
