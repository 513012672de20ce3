"""A server's lease as an etcd lease (when the cluster map names a ``lease_store``: the control plane is on etcd):
the etcd backend of :mod:`ecrec.control.lease`.

The server grants the lease and binds the key ``PREFIX/servers/<server_id>`` to it before it registers, then keeps
it alive itself (a :class:`~ecrec.control.lease.LeaseKeeper`, on the lease's one keep-alive stream); it serves only
while the lease surely lasts (:class:`~ecrec.control.lease.ServingLease`: counted from before each renewal was
sent, shortened by a margin, so it stops before etcd could expire the lease).  The coordinator
replaces a server by revoking its lease, and promotes a replacement only once the key is gone and, after a
revocation, a whole TTL has passed (``ecrec.control.coordinator``); a server whose renewal finds its lease gone stops.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from ecrec.control.etcd import EtcdClient, EtcdError, EtcdTLS, parse_etcd_url
from ecrec.control.lease import LeaseUnreachable, Renewal

log = logging.getLogger("ecrec.server_lease")


def servers_prefix(prefix: str) -> bytes:
    """Where the servers' lease keys live under the control plane's etcd ``prefix``."""
    return f"{prefix.rstrip('/')}/servers/".encode()


def lease_ttl_s(lease_s: float) -> int:
    """The TTL of a server's etcd lease for a ``--lease-s`` of ``lease_s`` (whole seconds, etcd's minimum 2)."""
    return max(2, math.ceil(lease_s))


def parse_lease_store(url: str) -> tuple[list[str], str]:
    """``etcd://EP[,EP...]/PREFIX`` (a map's ``lease_store``) -> (endpoints, prefix); ValueError naming the problem."""
    try:
        return parse_etcd_url(url)
    except ValueError as exc:
        raise ValueError(f"the map's lease store: {exc}") from None


class EtcdLease:
    """This server's etcd lease and its key.  :meth:`acquire` once before registering, :meth:`renew` a third of
    the TTL apart, :meth:`follow` when the map names other endpoints (a new leader's), :meth:`release` at stop."""

    def __init__(self, lease_store: str, lease_s: float, server_id: str, address: str, tls: EtcdTLS | None = None):
        self.endpoints, prefix = parse_lease_store(lease_store)
        self.url = lease_store
        self.ttl_s = lease_ttl_s(lease_s)
        self.key = servers_prefix(prefix) + server_id.encode()
        self.address = address
        self._tls = tls
        self._lock = threading.Lock()
        self.client = EtcdClient(self.endpoints, timeout_s=self.member_timeout_s, tls=tls)
        self.id = 0
        self.renewed_at = 0.0  # monotonic: when the last grant or renewal etcd answered was sent
        self.revision = 0  # the store's revision at the last renewal: a newer one may mean a newer map
        self.gone = ""  # why the lease is gone, once a renewal found it so (this server must not serve then)

    @property
    def member_timeout_s(self) -> float:
        """Each member's deadline: trying every member fits within a third of the TTL."""
        return max(0.05, self.ttl_s / 3.0 / max(1, len(self.endpoints)))

    def acquire(self, deadline: float) -> None:
        """Grants the lease and binds the key to it, retrying until ``deadline`` (monotonic); the lease lasts
        ``ttl_s`` from after :attr:`renewed_at`.  Raises RuntimeError when etcd never answered."""
        last = ""
        while True:
            sent = time.monotonic()
            try:
                self.id = self.client.grant(self.ttl_s)
                self.revision = self.client.put(self.key, self.address.encode(), lease=self.id)
                self.renewed_at = sent
                log.info("holding etcd lease %x (TTL %d s) with key %s", self.id, self.ttl_s, self.key.decode())
                return
            except EtcdError as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot take a lease on etcd ({self.url}): {last}")
            time.sleep(0.2)

    def period_s(self) -> float:
        return self.ttl_s / 3.0

    def renew(self) -> Renewal:
        """Keeps the lease alive once and checks the key is still bound to it.  The renewal's TTL is 0 when the
        lease is gone, or the key is (deleted by hand: the coordinator sees this server gone and replaces it a TTL
        later, while the lease itself lives on); :attr:`gone` and the renewal's reason say why.  Raises
        :class:`~ecrec.control.lease.LeaseUnreachable` when no member answered."""
        with self._lock:
            client = self.client
        sent = time.monotonic()
        try:
            reply = client.keep_alive(self.id, self.member_timeout_s)
            self.revision = max(self.revision, reply.header.revision)
            if reply.TTL <= 0:
                self.gone = "revoked: this server was replaced, or it expired"
                return Renewal(sent, 0.0, reason=self.gone, revision=self.revision)
            kv = client.get(self.key)  # read after the renewal: a key deleted before this read ends the lease here
        except EtcdError as exc:
            raise LeaseUnreachable(f"etcd lease renewal failed ({exc})") from None
        if kv is None or kv.lease != self.id:
            self.gone = f"its key {self.key.decode()} was deleted" if kv is None else \
                f"its key {self.key.decode()} is bound to another lease ({kv.lease:x})"
            return Renewal(sent, 0.0, reason=self.gone, revision=self.revision)
        self.renewed_at = sent
        return Renewal(sent, float(min(int(reply.TTL), self.ttl_s)), revision=self.revision)

    def follow(self, lease_store: str) -> None:
        """Dials the endpoints ``lease_store`` names too (first): the coordinator that leads now reaches etcd
        there.  The same lease, on the same etcd cluster."""
        if not lease_store or lease_store == self.url:
            return
        try:
            endpoints, _ = parse_lease_store(lease_store)
        except ValueError as exc:
            log.warning("ignoring the map's lease store: %s", exc)
            return
        merged = list(dict.fromkeys(endpoints + self.endpoints))
        with self._lock:
            self.endpoints, self.url = merged, lease_store
            old, self.client = self.client, EtcdClient(merged, timeout_s=self.member_timeout_s, tls=self._tls)
        old.close()

    def release(self) -> None:
        """Revokes the lease (a stopping server): its key goes at once."""
        if self.id:
            try:
                self.client.revoke(self.id)
            except EtcdError as exc:
                log.warning("revoking this server's etcd lease: %s", exc)
        self.client.close()


#: the name earlier releases gave it
EtcdServerLease = EtcdLease
