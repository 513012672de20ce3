"""A small etcd v3 client over etcd's gRPC API (stubs generated from ``proto/ecrec/wire/etcd.proto``).

What the control plane needs and no more: read a key with its revisions, compare-and-swap transactions, leases
with a keep-alive stream.  Every call has a deadline; a call that finds its member unreachable goes to the next
endpoint (etcd forwards writes to its raft leader itself), and an error that is
not the member's absence is raised as :class:`EtcdError` naming the call.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import grpc

from ecrec.control.lease import LeaseKeeper, LeaseUnreachable, Renewal
from ecrec.wire import etcd_pb2, etcd_pb2_grpc

log = logging.getLogger("ecrec.etcd")

#: status codes that mean "this member cannot answer now": the next endpoint is tried
_MOVE_ON = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class EtcdError(RuntimeError):
    """An etcd call failed on every endpoint, or was refused."""


def _refused(exc: grpc.RpcError) -> bool:
    """The member could not be reached at all (so a write surely did not reach etcd through it)."""
    details = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAVAILABLE and any(
        word in details for word in ("connection refused", "failed to connect", "connect failed", "unreachable",
                                     "no route"))


@dataclass(frozen=True)
class EtcdTLS:
    """TLS to etcd: the CA that signed its members' certificates, and this process's client certificate."""

    ca: str
    cert: str | None = None
    key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path):
            with open(path, "rb") as f:
                return f.read()
        return grpc.ssl_channel_credentials(read(self.ca), read(self.key) if self.key else None,
                                            read(self.cert) if self.cert else None)


def parse_endpoints(text: str) -> list[str]:
    """``HOST:PORT[,HOST:PORT...]`` -> the list, each checked to name a port."""
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    if not endpoints:
        raise ValueError("etcd endpoints: none given (HOST:PORT[,HOST:PORT...])")
    for e in endpoints:
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {e!r}: expected HOST:PORT")
    return endpoints


def etcd_url(endpoints: list[str], prefix: str) -> str:
    """The ``etcd://EP[,EP...]/PREFIX`` URL of ``endpoints`` and ``prefix`` (what :func:`parse_etcd_url` reads)."""
    return f"etcd://{','.join(endpoints)}{prefix.rstrip('/')}"


def parse_etcd_url(url: str) -> tuple[list[str], str]:
    """``etcd://EP[,EP...][/PREFIX]`` -> (endpoints, prefix; default ``/ecrec``); ValueError naming the problem."""
    if not url.startswith("etcd://"):
        raise ValueError(f"{url!r} is not an etcd:// URL (etcd://HOST:PORT[,HOST:PORT...][/PREFIX])")
    hosts, slash, prefix = url[len("etcd://"):].partition("/")
    return parse_endpoints(hosts), "/" + prefix if slash and prefix else "/ecrec"


class EtcdClient:
    """Keys, transactions and leases on the etcd cluster at ``endpoints``."""

    def __init__(self, endpoints: list[str], timeout_s: float = 2.0, tls: EtcdTLS | None = None):
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        creds = tls.credentials() if tls is not None else None
        self._channels = [grpc.secure_channel(e, creds) if creds is not None else grpc.insecure_channel(e)
                          for e in self.endpoints]
        self._current = 0
        self._lock = threading.Lock()
        self._streams: dict[int, _KeepAliveStream] = {}  # lease -> its keep-alive stream

    def close(self) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()
        for c in self._channels:
            c.close()

    def _call(self, service: str, method: str, request, timeout_s: float | None = None, write: bool = False):
        """``method`` of ``service`` on the current member, else on each other member in turn.  A ``write`` goes
        to the next member only when the first refused the connection outright: after a deadline, or an etcd
        error that may follow a commit ("leader changed", "request timed out"), its outcome is unknown and the
        caller must read before it writes again (raised as :class:`EtcdError`)."""
        errors = []
        with self._lock:
            start = self._current
        for i in range(len(self._channels)):
            at = (start + i) % len(self._channels)
            stub = getattr(etcd_pb2_grpc, f"{service}Stub")(self._channels[at])
            try:
                reply = getattr(stub, method)(request, timeout=timeout_s or self.timeout_s)
            except grpc.RpcError as exc:
                if exc.code() in _MOVE_ON:
                    errors.append(f"{self.endpoints[at]}: {exc.code().name}")
                    if write and not _refused(exc):
                        raise EtcdError(f"etcd {method}: outcome unknown ({'; '.join(errors)})") from None
                    continue
                raise EtcdError(f"etcd {method} at {self.endpoints[at]}: {exc.code().name}: {exc.details()}") from None
            with self._lock:
                self._current = at
            return reply
        raise EtcdError(f"etcd {method}: no member answered ({'; '.join(errors)})")

    # --- keys --------------------------------------------------------------------------------------
    def get(self, key: bytes) -> etcd_pb2.KeyValue | None:
        """The key's value and revisions (a linearizable read), or None when it does not exist."""
        reply = self._call("KV", "Range", etcd_pb2.RangeRequest(key=key))
        return reply.kvs[0] if reply.kvs else None

    def get_prefix(self, prefix: bytes) -> list[etcd_pb2.KeyValue]:
        """Every key that starts with ``prefix`` (a linearizable read)."""
        return list(self._call("KV", "Range", etcd_pb2.RangeRequest(key=prefix, range_end=prefix_end(prefix))).kvs)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Writes ``key`` unconditionally; returns the store's revision after it."""
        return self._call("KV", "Put", etcd_pb2.PutRequest(key=key, value=value, lease=lease),
                          write=True).header.revision

    def delete(self, key: bytes) -> int:
        """Deletes ``key`` (an operator's ``etcdctl del``); returns how many keys went."""
        return self._call("KV", "DeleteRange", etcd_pb2.DeleteRangeRequest(key=key), write=True).deleted

    def txn(self, compare: list, success: list, failure: list | None = None) -> etcd_pb2.TxnResponse:
        return self._call("KV", "Txn", etcd_pb2.TxnRequest(compare=compare, success=success, failure=failure or []),
                          write=True)

    # --- members ---------------------------------------------------------------------------------
    def member_endpoints(self) -> list[str]:
        """HOST:PORT of every member's advertised client URL (what other processes dial: etcd's member list)."""
        reply = self._call("Cluster", "MemberList", etcd_pb2.MemberListRequest())
        return [u.partition("://")[2] or u for m in reply.members if not m.isLearner for u in m.clientURLs]

    # --- leases ------------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        reply = self._call("Lease", "LeaseGrant", etcd_pb2.LeaseGrantRequest(TTL=int(ttl_s)))
        if reply.error:
            raise EtcdError(f"etcd LeaseGrant: {reply.error}")
        return reply.ID

    def revoke(self, lease: int) -> None:
        with self._lock:
            stream = self._streams.pop(lease, None)
        if stream is not None:
            stream.close()
        try:
            self._call("Lease", "LeaseRevoke", etcd_pb2.LeaseRevokeRequest(ID=lease))
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    def keep_alive_once(self, lease: int, timeout_s: float | None = None) -> int:
        """Renews ``lease`` once (each member gets ``timeout_s``); returns its new TTL (0 or less: the lease is
        gone).  Raises :class:`EtcdError` when no member answered."""
        return self.keep_alive(lease, timeout_s).TTL

    def keep_alive(self, lease: int, timeout_s: float | None = None) -> etcd_pb2.LeaseKeepAliveResponse:
        """:meth:`keep_alive_once`'s whole answer (its header carries the store's revision).  The renewal goes on
        the lease's keep-alive stream, opened once and kept (etcd's own clients do the same: a renewal is then one
        message, not a call); a stream that fails or does not answer in time is dropped and the next member is
        tried on a new one (a renewal is idempotent)."""
        errors = []
        with self._lock:
            start = self._current
            stream = self._streams.get(lease)
        for i in range(len(self._channels)):
            at = (start + i) % len(self._channels)
            if stream is None or stream.member != at:
                if stream is not None:
                    stream.close()
                stream = _KeepAliveStream(self._channels[at], at)
                with self._lock:
                    old, self._streams[lease] = self._streams.get(lease), stream
                if old is not None and old is not stream:
                    old.close()
            try:
                reply = stream.renew(lease, timeout_s or self.timeout_s)
            except EtcdError as exc:
                errors.append(f"{self.endpoints[at]}: {exc}")
                self._drop_stream(lease, stream)
                stream = None
                continue
            with self._lock:
                self._current = at
            if reply.TTL <= 0:  # gone: nothing more to renew on it
                self._drop_stream(lease, stream)
            return reply
        raise EtcdError(f"etcd LeaseKeepAlive: no member answered ({'; '.join(errors)})")

    def _drop_stream(self, lease: int, stream) -> None:
        with self._lock:
            if self._streams.get(lease) is stream:
                del self._streams[lease]
        stream.close()


class _KeepAliveStream:
    """One ``LeaseKeepAlive`` call to one member, kept open: each renewal is one request on it and the next answer.
    One renewal at a time; a renewal that gets no answer in time, or an error, ends the stream (its caller opens
    another), so a late answer is never taken for the next renewal's."""

    def __init__(self, channel: grpc.Channel, member: int):
        self.member = member
        self._requests: queue.Queue = queue.Queue()
        self._replies: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._call = etcd_pb2_grpc.LeaseStub(channel).LeaseKeepAlive(iter(self._requests.get, None))
        threading.Thread(target=self._read, name="ecrec-etcd-keepalive", daemon=True).start()

    def _read(self) -> None:
        try:
            for reply in self._call:
                self._replies.put(reply)
            self._replies.put(EtcdError("the keep-alive stream ended"))
        except grpc.RpcError as exc:
            self._replies.put(EtcdError(exc.code().name + ("" if exc.code() in _MOVE_ON else f": {exc.details()}")))

    def renew(self, lease: int, timeout_s: float) -> etcd_pb2.LeaseKeepAliveResponse:
        with self._lock:
            if self._closed:
                raise EtcdError("the keep-alive stream is closed")
            self._requests.put(etcd_pb2.LeaseKeepAliveRequest(ID=lease))
            try:
                reply = self._replies.get(timeout=timeout_s)
            except queue.Empty:
                self._end()  # a late answer must never be taken for the next renewal's
                raise EtcdError("no answer in time") from None
            if isinstance(reply, Exception):
                self._end()
                raise reply
            return reply

    def _end(self) -> None:
        if not self._closed:
            self._closed = True
            self._requests.put(None)
            self._call.cancel()

    def close(self) -> None:
        with self._lock:
            self._end()


# --- transaction building blocks ----------------------------------------------------------------------
def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix`` (etcd's convention)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # every key


def value_is(key: bytes, value: bytes) -> etcd_pb2.Compare:
    return etcd_pb2.Compare(result=etcd_pb2.Compare.EQUAL, target=etcd_pb2.Compare.VALUE, key=key, value=value)


def modified_at(key: bytes, revision: int) -> etcd_pb2.Compare:
    """``key`` was last written at ``revision`` (0: it does not exist)."""
    return etcd_pb2.Compare(result=etcd_pb2.Compare.EQUAL, target=etcd_pb2.Compare.MOD, key=key,
                            mod_revision=revision)


def absent(key: bytes) -> etcd_pb2.Compare:
    return etcd_pb2.Compare(result=etcd_pb2.Compare.EQUAL, target=etcd_pb2.Compare.CREATE, key=key,
                            create_revision=0)


def put_op(key: bytes, value: bytes, lease: int = 0) -> etcd_pb2.RequestOp:
    return etcd_pb2.RequestOp(request_put=etcd_pb2.PutRequest(key=key, value=value, lease=lease))


def get_op(key: bytes) -> etcd_pb2.RequestOp:
    return etcd_pb2.RequestOp(request_range=etcd_pb2.RangeRequest(key=key))


#: how often a candidate that cannot reach etcd says so again
ELECTION_REMIND_S = 10.0


class Election:
    """Leadership among coordinators through one lease-bound key (``key`` = this candidate's ``value`` while
    it leads).  :meth:`campaign` blocks until this candidate leads; a :class:`~ecrec.control.lease.LeaseKeeper`
    renews the lease every third of its TTL; :meth:`holds` is true only until two thirds of the TTL after the last
    renewal etcd answered (counted from when it was sent, so always before etcd can expire the lease and let
    another lead); :attr:`lost` is set when a renewal finds the lease gone or none succeeded for that long: this
    candidate must not act as leader any more."""

    def __init__(self, client: EtcdClient, key: bytes, value: bytes, ttl_s: int, member_key: bytes | None = None):
        if ttl_s < 2:
            raise ValueError(f"the election's lease TTL must be at least 2 s (etcd's minimum), got {ttl_s}")
        self.client, self.key, self.value, self.ttl_s = client, key, value, ttl_s
        #: where this candidate announces itself (``value``, bound to its lease: it goes when the candidate does),
        #: so any candidate can list the others (:meth:`candidates`)
        self.member_key = member_key
        self.lease = 0
        self._lease_granted_at = 0.0  # when the lease was last granted or renewed (before the request went)
        self._valid_until = 0.0  # monotonic: this candidate may act as leader until then
        self.lost = threading.Event()
        self._keeper: LeaseKeeper | None = None

    def leader(self) -> bytes | None:
        kv = self.client.get(self.key)
        return kv.value if kv is not None else None

    def candidates(self) -> list[bytes]:
        """The values of every live candidate's member key (those under the same prefix as :attr:`member_key`)."""
        if self.member_key is None:
            return []
        prefix = self.member_key.rpartition(b"/")[0] + b"/"
        return [kv.value for kv in self.client.get_prefix(prefix)]

    def campaign(self, stop: threading.Event, poll_s: float = 0.25) -> bool:
        """Waits until this candidate holds the key (True) or ``stop`` is set (False)."""
        last_error, said_at, failing_since = "", 0.0, None
        if self._keeper is not None:  # the keeper of an earlier term ends
            self._keeper.stop(join_s=self.ttl_s)
            self._keeper = None
        while not stop.is_set():
            try:
                if not self.lease:
                    sent = time.monotonic()
                    self.lease = self.client.grant(self.ttl_s)
                    self._lease_granted_at = sent
                    if self.member_key is not None:
                        self.client.put(self.member_key, self.value, lease=self.lease)
                reply = self.client.txn([absent(self.key)], [put_op(self.key, self.value, self.lease)],
                                        [get_op(self.key)])
                held = [] if reply.succeeded else reply.responses[0].response_range.kvs
                # won, or the key is ours already (an earlier try committed and its answer was lost): our lease
                # is alive as long as the key exists
                if reply.succeeded or (held and held[0].value == self.value and held[0].lease == self.lease):
                    self._valid_until = self._lease_granted_at + self.ttl_s * 2.0 / 3.0
                    self.lost.clear()
                    self._keeper = self._new_keeper().start()
                    return True
                # someone else leads: keep our lease alive meanwhile so it is ready when the key goes
                sent = time.monotonic()
                if self.client.keep_alive_once(self.lease, self._member_timeout()) <= 0:
                    self.lease = 0
                else:
                    self._lease_granted_at = sent
            except EtcdError as exc:
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                # once per distinct error, and every ELECTION_REMIND_S while it lasts (not every poll)
                if str(exc) != last_error or now - said_at >= ELECTION_REMIND_S:
                    log.warning("election: %s%s", exc, f" (etcd unreachable for {now - failing_since:.0f} s: check "
                                "the --store endpoints and, with TLS, the --etcd-* or --tls-* files)"
                                if now - failing_since >= ELECTION_REMIND_S else "")
                    last_error, said_at = str(exc), now
                self.lease = 0
                stop.wait(poll_s)
                continue
            failing_since = None
            stop.wait(poll_s)
        return False

    def _member_timeout(self) -> float:
        """Each member's deadline for a renewal: short enough that trying every member fits a third of the TTL."""
        return max(0.05, self.ttl_s / 3.0 / max(1, len(self.client.endpoints)))

    def _new_keeper(self) -> LeaseKeeper:
        trust_s = self.ttl_s * 2.0 / 3.0  # how long after a renewal was sent this candidate may still lead
        lease = self.lease

        def renew() -> Renewal:
            sent = time.monotonic()  # etcd renews it when the request arrives: after this
            try:
                ttl = self.client.keep_alive_once(lease, self._member_timeout())
            except EtcdError as exc:
                raise LeaseUnreachable(str(exc)) from None
            return Renewal(sent, float(max(ttl, 0)), reason="lease expired")

        def renewed(renewal: Renewal) -> None:
            self._valid_until = renewal.sent + trust_s

        def lost(why: str) -> None:
            log.error("election: lost the leadership (%s)", why)
            self._valid_until = 0.0
            self.lost.set()

        def unreachable(last_ok: float, exc: Exception) -> bool:
            log.warning("election: renewing the leader's lease: %s", exc)
            if time.monotonic() - last_ok >= trust_s:  # another may lead soon
                lost("etcd unreachable for two thirds of the lease")
                return True
            return False

        keeper = LeaseKeeper("ecrec-election", renew, period_s=lambda: self.ttl_s / 3.0, on_renewed=renewed,
                             on_lost=lost, on_unreachable=unreachable, last_sent=self._lease_granted_at,
                             # try again soon, not a whole period later, and never past the trust
                             retry_s=lambda: min(self.ttl_s / 9.0,
                                                 max(0.0, keeper.last_ok + trust_s - time.monotonic())))
        return keeper

    def holds(self) -> bool:
        """Whether this candidate may act as leader now (see the class)."""
        return not self.lost.is_set() and time.monotonic() < self._valid_until

    def resign(self) -> None:
        """Gives the leadership up (the key goes with the lease)."""
        if self._keeper is not None:
            self._keeper.stop()
        if self.lease:
            try:
                self.client.revoke(self.lease)
            except EtcdError as exc:
                log.warning("election: revoking the lease: %s", exc)
            self.lease = 0
        self._valid_until = 0.0
        self.lost.set()
