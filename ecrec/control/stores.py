"""Where the coordinator keeps its state (the map, dense tensors, promotions in progress, the server key).

Two stores, chosen by ``--store``: a local file written atomically (the default, one coordinator), and etcd
(``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``), where the state is one key and every write is a
compare-and-swap transaction that also requires this coordinator to hold the leader key: two coordinators can
never both write, and a deposed leader's write is refused (:class:`NotLeader`).  Coordinators elect their
leader through etcd (:class:`ecrec.control.etcd.Election`); the leader's address is kept beside the state, so any
coordinator can name it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading

from google.protobuf.message import DecodeError

from ecrec.control.etcd import (EtcdClient, EtcdError, EtcdTLS, Election, etcd_url, get_op, modified_at, parse_etcd_url, put_op,
                        value_is)
from ecrec.control.etcd_lease import servers_prefix
from ecrec.wire import coordinator_pb2

log = logging.getLogger("ecrec.state_store")


class NotLeader(RuntimeError):
    """This coordinator does not (or no longer) lead: it must not change the map."""


class StoreUnavailable(RuntimeError):
    """The store could not be reached: the change was not recorded (and must not be acted on)."""


class FileStore:
    """The state in one local file (or nowhere: ``path`` None), always led by this process."""

    kind = "file"

    def __init__(self, path: str | None):
        self.path = path

    def describe(self) -> str:
        return f"file {self.path}" if self.path else "memory (no --state-path)"

    def campaign(self, stop: threading.Event) -> bool:
        return True

    @property
    def lost(self) -> threading.Event | None:
        return None

    def leader_address(self) -> str:
        return ""

    def coordinators(self) -> list[str]:
        return []  # only this one

    def holds(self) -> bool:
        return True

    def load(self) -> coordinator_pb2.CoordinatorState | None:
        if not self.path or not os.path.exists(self.path):
            return None
        state = coordinator_pb2.CoordinatorState()
        with open(self.path, "rb") as f:
            data = f.read()
        if not data:  # written whole by a rename, never empty: something else emptied it
            raise ValueError(f"{self.path} is empty, not a saved coordinator state; restore it, or move it away to "
                             "start a new cluster")
        try:
            state.ParseFromString(data)
        except DecodeError as exc:
            raise ValueError(f"{self.path} is not a saved coordinator state ({exc}); restore it, or move it away "
                             "to start a new cluster") from None
        return state

    def save(self, state: coordinator_pb2.CoordinatorState) -> None:
        if not self.path:
            return
        directory = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".coordinator-state-")
        with os.fdopen(fd, "wb") as f:
            f.write(state.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def resign(self) -> None:
        pass

    def close(self) -> None:
        pass


class EtcdStore:
    """The state as the key ``PREFIX/state`` on etcd, the leader as ``PREFIX/leader`` (bound to its lease)."""

    kind = "etcd"

    def __init__(self, endpoints: list[str], prefix: str, me: str, address: str, ttl_s: int = 3,
                 timeout_s: float = 2.0, tls: EtcdTLS | None = None):
        self.client = EtcdClient(endpoints, timeout_s=timeout_s, tls=tls)
        self.endpoints = endpoints
        self.prefix = prefix.rstrip("/")
        self.state_key = f"{self.prefix}/state".encode()
        self.leader_key = f"{self.prefix}/leader".encode()
        self.servers_prefix = servers_prefix(self.prefix)
        self.me = me
        self.address = address
        self._value = f"{me}@{address}".encode()
        self.election = Election(self.client, self.leader_key, self._value, ttl_s,
                                 member_key=f"{self.prefix}/coordinators/{address}".encode())
        self._revision = 0  # the state key's mod revision this leader last read or wrote

    def describe(self) -> str:
        return f"etcd {','.join(self.endpoints)} key {self.state_key.decode()}"

    def campaign(self, stop: threading.Event) -> bool:
        return self.election.campaign(stop)

    @property
    def lost(self) -> threading.Event:
        return self.election.lost

    def holds(self) -> bool:
        """Whether this coordinator may act as the leader now (its etcd lease surely current)."""
        return self.election.holds()

    def leader_address(self) -> str:
        """The leading coordinator's address ("" when none leads or etcd cannot be reached)."""
        try:
            value = self.election.leader()
        except EtcdError:
            return ""
        return value.decode().partition("@")[2] if value else ""

    def coordinators(self) -> list[str]:
        """Every live coordinator's address (each announces itself under ``PREFIX/coordinators/ADDRESS``, bound to
        its election lease); raises :class:`StoreUnavailable` when etcd cannot be read."""
        try:
            values = self.election.candidates()
        except EtcdError as exc:
            raise StoreUnavailable(str(exc)) from None
        return sorted({value.decode().partition("@")[2] for value in values} - {""})

    def _read(self):
        try:
            return self.client.get(self.state_key)
        except EtcdError as exc:
            raise StoreUnavailable(str(exc)) from None

    def load(self) -> coordinator_pb2.CoordinatorState | None:
        """The state as etcd holds it now; remembers its revision for the next write's compare."""
        kv = self._read()
        self._revision = kv.mod_revision if kv is not None else 0
        return coordinator_pb2.CoordinatorState.FromString(kv.value) if kv is not None else None

    def peek(self) -> coordinator_pb2.CoordinatorState | None:
        """The state as etcd holds it now (a follower's read: remembers nothing)."""
        kv = self._read()
        return coordinator_pb2.CoordinatorState.FromString(kv.value) if kv is not None else None

    def save(self, state: coordinator_pb2.CoordinatorState) -> None:
        """Writes ``state`` if this coordinator still leads and nobody wrote since its last read or write.  When
        the outcome is unknown (etcd did not answer) or the write was refused, this coordinator steps down
        (:attr:`lost`): the next leader, maybe this one again, starts from what etcd holds."""
        if not self.election.holds():
            raise NotLeader("this coordinator does not hold the leadership now (its etcd lease is not surely current)")
        data = state.SerializeToString()
        try:
            reply = self.client.txn([value_is(self.leader_key, self._value), modified_at(self.state_key, self._revision)],
                                    [put_op(self.state_key, data)], [get_op(self.state_key), get_op(self.leader_key)])
        except EtcdError as exc:
            self.election.lost.set()
            raise StoreUnavailable(f"{exc}; stepping down") from None
        if not reply.succeeded:
            now = reply.responses[0].response_range.kvs
            leader = reply.responses[1].response_range.kvs
            if now and now[0].value == data and leader and leader[0].value == self._value:
                self._revision = now[0].mod_revision  # this very write committed before (its answer was lost)
                return
            self.election.lost.set()
            raise NotLeader("the state was not written: this coordinator no longer holds the leader key, or another "
                            "wrote the state since (compare-and-swap refused)")
        self._revision = reply.header.revision

    def lease_store_url(self) -> str:
        """Where the servers take their leases (``map.lease_store``): every member's advertised client address
        (etcd's member list), then the endpoints this coordinator dials."""
        try:
            members = self.client.member_endpoints()
        except EtcdError as exc:
            log.warning("etcd's member list cannot be read (%s): servers dial %s", exc, ",".join(self.endpoints))
            members = []
        return etcd_url(list(dict.fromkeys(members + self.endpoints)), self.prefix)

    def server_leases(self) -> dict[str, int]:
        """server_id -> etcd lease id of every server whose lease key exists bound to a lease
        (``ecrec.control.lease``; a key written without one, by hand, holds no server's lease: that server is gone,
        or stops at its next renewal); raises :class:`StoreUnavailable` when etcd cannot be read."""
        try:
            kvs = self.client.get_prefix(self.servers_prefix)
        except EtcdError as exc:
            raise StoreUnavailable(str(exc)) from None
        return {kv.key[len(self.servers_prefix):].decode(): kv.lease for kv in kvs if kv.lease}

    def revoke_lease(self, lease: int) -> None:
        """Revokes a server's etcd lease (its key goes with it); raises :class:`StoreUnavailable` when etcd did not
        answer (the revocation may still happen)."""
        try:
            self.client.revoke(lease)
        except EtcdError as exc:
            raise StoreUnavailable(str(exc)) from None

    def resign(self) -> None:
        self.election.resign()

    def close(self) -> None:
        self.client.close()


def parse_store(url: str | None) -> tuple[str, dict]:
    """``--store`` -> (kind, arguments): None or a path or ``file://PATH`` -> file; ``etcd://EP[,EP...][/PREFIX]``
    -> etcd (default prefix ``/ecrec``).  Raises ValueError naming what is wrong."""
    if not url:
        return "file", {}
    if url.startswith("file://"):
        return "file", {"path": url[len("file://"):]}
    if url.startswith("etcd://"):
        endpoints, prefix = parse_etcd_url(url)
        return "etcd", {"endpoints": endpoints, "prefix": prefix}
    if "://" in url:
        raise ValueError(f"--store {url!r}: unknown scheme (use etcd://HOST:PORT[,HOST:PORT...][/PREFIX] or file://PATH)")
    return "file", {"path": url}
