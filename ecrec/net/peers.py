"""Calling other processes of the cluster: one channel per address, a deadline on every call, failures
reported to the coordinator, and the cluster map followed to a replacement.

Everything that talks to an embedding server by *index* goes through :class:`Peers`: the client SDK
(pulls, pushes, strategy commands), a server's parity sender and the rebuild engine's row reads.  A
call that finds its server gone (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED) reports the address to
the coordinator, whose reply is the new map; the call is then retried at the replacement the map
names, until ``retry_deadline_s``.  Any other status is raised as :class:`PeerError` with the
server's own message.  :class:`CoordinatorClient` is the one place that calls the coordinator.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from ecrec import errors
from ecrec.net import transport
from ecrec.net.cluster_map import live_address
from ecrec.wire import (
    cluster_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    embedding_pb2_grpc,
    parity_pb2_grpc,
)

log = logging.getLogger("ecrec.peers")

#: the services a peer serves, by the name callers use
EMBEDDING = "embedding"
PARITY = "parity"
_STUBS = {EMBEDDING: embedding_pb2_grpc.EmbeddingServerStub, PARITY: parity_pb2_grpc.ParityServiceStub}


class PeerError(errors.EcrecError):
    """A peer answered a call with an error status (not "gone"): ``code`` is its gRPC status."""

    def __init__(self, index: int, address: str, method: str, code: grpc.StatusCode, details: str):
        super().__init__(f"server {index} ({address}) {method}: {code.name}: {details}")
        self.index, self.address, self.method, self.code, self.details = index, address, method, code, details
        self.status = code.name


class PeerUnreachable(errors.Unavailable):
    """A server index stayed unreachable (and unreplaced) until the retry deadline."""


class ChannelDropped(grpc.RpcError):
    """A call on a channel the stall watcher closed (its server was declared failed): CANCELLED, as the calls it
    cancelled in flight -- gone, the caller follows the map."""

    def __init__(self, address: str):
        super().__init__(f"the channel to {address} was closed: its server was declared failed")
        self.address = address

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return str(self)


#: one warning per subject (a server's address, the coordinator) this often while the same thing keeps failing; the
#: rest go to DEBUG (a failover retried every few milliseconds logged ~170 lines in 3 s)
WARN_EVERY_S = 10.0
_warned: dict[object, float] = {}
_warned_lock = threading.Lock()


def warn_level(subject) -> int:
    """WARNING when a warning about ``subject`` is due (the first, or WARN_EVERY_S after the last), else DEBUG."""
    now = time.monotonic()
    with _warned_lock:
        if now - _warned.get(subject, -WARN_EVERY_S) < WARN_EVERY_S:
            return logging.DEBUG
        if len(_warned) > 4096:  # addresses of servers long gone
            _warned.clear()
        _warned[subject] = now
        return logging.WARNING


#: the pause before a call answered ABORTED (the server is busy for a moment) is sent again to the same server
BUSY_RETRY_S = 0.01
#: a call answered busy for this long is logged with the server's reason (a table whose restore was cut short
#: stays busy until the snapshot is loaded again: the call would otherwise wait out its deadline in silence)
BUSY_WARN_S = 2.0


class BusyWait:
    """One call's wait on a server that answers it busy (ABORTED): logged with the server's reason once it has lasted
    :data:`BUSY_WARN_S` at one address, then at most every ``WARN_EVERY_S`` per address and method, with nothing in
    between (not even at DEBUG: retries come every :data:`BUSY_RETRY_S`)."""

    def __init__(self):
        self.since, self.address = 0.0, None

    def note(self, index: int, address: str, method: str, details: str | None, left_s: float) -> None:
        """The server at ``address`` answered busy again (``details``: its reason; ``left_s``: the call's time left)."""
        now = time.monotonic()
        if address != self.address:
            self.since, self.address = now, address
        if now - self.since >= BUSY_WARN_S and warn_level(("busy", address, method)) == logging.WARNING:
            log.warning("server %d (%s) %s: busy for %.0f s (%s); retrying for up to %.0f s more", index, address,
                        method, now - self.since, details, max(0.0, left_s))

    def reset(self) -> None:
        """The call met something other than busy: a later busy answer starts a new wait."""
        self.address = None


#: how a coordinator that does not lead starts its refusal; the leader's address follows "the leader is "
#: (``...; the leader is HOST:PORT; retry there``, ``ecrec.control.leadership``)
NOT_LEADER = "this coordinator does not lead"


def leader_named(details: str) -> str:
    """The leader's address a follower's refusal names (``""`` when none leads yet, the address is a wildcard
    nobody can dial, or ``details`` is no such refusal)."""
    if not details.startswith(NOT_LEADER):
        return ""
    leader = details.partition("the leader is ")[2].split(";", 1)[0].strip()
    host = leader.rpartition(":")[0].strip("[]")
    return "" if leader in ("", "being elected") or host in ("", "0.0.0.0", "::") else leader


class FailoverStub:
    """A coordinator stub over one or several coordinators (``host:port,host:port``, an etcd-backed control plane):
    each call goes to the one that answered last, and on UNAVAILABLE (it does not lead, or is gone) or a deadline
    (paused) to the next, each with the call's own deadline; a follower's refusal that names the leader sends the
    call there next, even when the caller was given only the follower (it is remembered for later calls).  The
    last error is raised when none answers."""

    #: codes after which the next coordinator is tried
    MOVE_ON = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    def __init__(self, addresses: list[str], max_message_bytes: int = 256 << 20, security=None):
        self.addresses = list(addresses)
        self._max_message_bytes, self._security = max_message_bytes, security
        self._channels = [transport.make_channel(a, max_message_bytes, security) for a in self.addresses]
        self._stubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in self._channels]
        self._current = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        for c in self._channels:
            c.close()

    def _index_of(self, address: str) -> int:
        """The position of ``address`` among the coordinators, added when it is new (a leader learned of)."""
        with self._lock:
            if address not in self.addresses:
                log.info("following the leading coordinator at %s", address)
                self._channels.append(transport.make_channel(address, self._max_message_bytes, self._security))
                self._stubs.append(coordinator_pb2_grpc.CoordinatorStub(self._channels[-1]))
                self.addresses.append(address)
            return self.addresses.index(address)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(request, timeout=None, **kwargs):
            start, last = self._current, None
            order = [(start + i) % len(self._stubs) for i in range(len(self._stubs))]
            tried: set[int] = set()
            while order:
                at = order.pop(0)
                if at in tried:
                    continue
                tried.add(at)
                try:
                    reply = getattr(self._stubs[at], name)(request, timeout=timeout, **kwargs)
                except grpc.RpcError as exc:
                    if exc.code() not in self.MOVE_ON:
                        raise
                    last = exc
                    leader = leader_named(exc.details() or "") if exc.code() == grpc.StatusCode.UNAVAILABLE else ""
                    if leader:
                        order.insert(0, self._index_of(leader))
                    continue
                if name not in ("GetClusterMap", "GetCoordinators"):  # followers answer those too: stay with the
                    self._current = at                                # one that leads
                return reply
            raise last
        return call


#: the schemes of gRPC's own target names, taken as they are
GRPC_SCHEMES = ("dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock")


def _bracketed_example(host: str, port: str) -> str:
    """``[host]:port`` where ``host`` is an IPv6 address (``::1:7000`` -> ``[::1]:7000``), else the form alone (in
    ``2001:db8::7000`` no split into an address and a port is sure)."""
    try:
        ipaddress.IPv6Address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return "[ADDRESS]:PORT, e.g. [::1]:7000"
    return f"[{host.strip('[]')}]:{port}"


def coordinator_stub(address: str, max_message_bytes: int = 256 << 20, security=None) -> "FailoverStub":
    """A stub for the coordinator at ``address``, or for the coordinators at ``host:port,host:port``."""
    addresses = [a.strip() for a in address.split(",") if a.strip()]
    if not addresses:
        raise ValueError("coordinator address: none given (host:port[,host:port...])")
    for a in addresses:  # gRPC takes a port number modulo 65536: 127.0.0.1:93241 would reach port 27705
        target = a.split(":", 1)[0] in GRPC_SCHEMES  # gRPC's own target names (dns:///host:port, ipv4:a.b.c.d:port)
        if "://" in a and not target:
            raise ValueError(f"coordinator address {a!r}: host:port, not a URL (no scheme)")
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"coordinator address {a!r}: not host:port with a port in 1-65535")
        inner = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not target and ((":" in inner and inner == host) or "[" in inner or "]" in inner):
            # gRPC read ::1:50051 as the address ::0.1.0.1 on port 443, and timed out
            raise ValueError(f"coordinator address {a!r}: an IPv6 address goes in brackets before its port "
                             f"({_bracketed_example(inner, port)}), and brackets around a whole address only")
    return FailoverStub(addresses, max_message_bytes, security)


class CoordinatorClient:
    """The coordinator's methods with a deadline each; maps it returns go to ``on_map``.  ``address`` may name
    several coordinators (``host:port,host:port``): calls follow the leader (:class:`FailoverStub`)."""

    def __init__(self, address: str, timeout_s: float, max_message_bytes: int = 256 << 20,
                 on_map: Callable[[cluster_pb2.ClusterMap], None] | None = None, security=None):
        self.address = address
        self.timeout_s = timeout_s
        self.stub = coordinator_stub(address, max_message_bytes, security)
        self.on_map = on_map or (lambda m: None)

    def get_map(self, timeout_s: float | None = None) -> cluster_pb2.ClusterMap:
        m = self.stub.GetClusterMap(coordinator_pb2.GetClusterMapRequest(),
                                    timeout=self.timeout_s if timeout_s is None else timeout_s)
        self.on_map(m)
        return m

    def report_failure(self, address: str, detail: str) -> cluster_pb2.ClusterMap | None:
        """Tells the coordinator ``address`` looks gone; adopts the map it answers (or, if the report
        fails, the current map).  Returns the map, or None when the coordinator is unreachable too."""
        try:
            m = self.stub.ReportFailure(coordinator_pb2.ReportFailureRequest(address=address, detail=detail),
                                        timeout=self.timeout_s)
            self.on_map(m)
            return m
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # no longer in the map: replaced already, nothing to say
                log.debug("%s is no longer in the cluster map (replaced already)", address)
            else:
                log.log(warn_level(("report", address)),
                        "reporting %s to the coordinator failed: %s", address, exc.code().name)
        try:
            return self.get_map()
        except grpc.RpcError as exc:
            log.log(warn_level("coordinator"),
                    "coordinator %s unreachable: %s", self.address, exc.code().name)
            return None

    def report_redundant(self, index: int, server_id: str, rebuild_seconds: float) -> None:
        m = self.stub.ReportRedundant(coordinator_pb2.ReportRedundantRequest(
            index=index, server_id=server_id, rebuild_seconds=rebuild_seconds), timeout=self.timeout_s)
        self.on_map(m)


#: a call to a server in flight this long has its server's place in the map checked, then every STALL_CHECK_S
#: (``Peers(watch_stalls=True)``): a server declared failed meanwhile (paused, cut off) has its calls cancelled
STALL_S = 2.0
STALL_CHECK_S = 1.0


class Peers:
    """Embedding servers by index (see the module docstring).

    ``current_map`` returns the newest map this process knows; ``coordinator`` receives failure
    reports (and its replies update that map through its ``on_map``).  With ``watch_stalls``, a call that has
    waited :data:`STALL_S` has the map fetched (every :data:`STALL_CHECK_S` while it waits): once its server is
    no live holder there (declared failed: paused, cut off), its channel is closed, which cancels the calls on
    it, and they follow the map to the replacement -- a paused server held a step for its whole ``timeout_s``
    (twice: the fallback called it again), though its standby served within seconds.
    """

    def __init__(self, current_map: Callable[[], cluster_pb2.ClusterMap | None], coordinator: CoordinatorClient,
                 timeout_s: float, retry_deadline_s: float, max_message_bytes: int = 256 << 20,
                 retry_pause_s: float = 0.05, identity: Callable[[], tuple] | None = None, security=None,
                 watch_stalls: bool = False):
        self.watch_stalls = watch_stalls
        self._inflight: dict[int, tuple[str, float]] = {}  # call token -> (address, when it was sent)
        self._next_call = 0
        self._watcher: threading.Thread | None = None
        self._closed = threading.Event()
        self.current_map = current_map
        self.security = security
        self.identity = identity or (lambda: ())
        self.coordinator = coordinator
        self.timeout_s = timeout_s
        self.retry_deadline_s = retry_deadline_s
        self.max_message_bytes = max_message_bytes
        self.retry_pause_s = retry_pause_s
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[tuple[str, str], object] = {}
        self.retries = 0
        self._pool: ThreadPoolExecutor | None = None

    def _parallel(self, calls: list) -> list:
        """Runs ``[(fn, args, kwargs)]`` at once and returns ``[(result, exception)]`` in order: the last in this
        thread, the others on long-lived threads.  Blocking gRPC calls on a few threads cost less CPU here than
        futures, which start a new polling thread whenever a channel has no call in flight (measured: 0.99 vs
        1.6 ms of CPU per fan-out of four calls)."""
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="ecrec-peers")

        def run(fn, args, kwargs):
            try:
                return fn(*args, **kwargs), None
            except Exception as exc:  # noqa: BLE001 - handed to the caller with the others
                return None, exc

        futures = [self._pool.submit(run, *call) for call in calls[:-1]]
        last = [run(*calls[-1])] if calls else []
        return [f.result() for f in futures] + last

    # --- addressing ------------------------------------------------------------------------------------------
    def address_of(self, index: int) -> str | None:
        m = self.current_map()
        return live_address(m, index) if m is not None else None

    def stub(self, address: str, service: str = EMBEDDING):
        """The (cached) stub of ``service`` at ``address``; one channel per address."""
        key = (address, service)
        with self._lock:
            stub = self._stubs.get(key)
            if stub is None:
                stub = self._stubs[key] = _STUBS[service](self._channel_locked(address))
            return stub

    def channel(self, address: str) -> grpc.Channel:
        """The (cached) channel to ``address``, for a method no generated stub has (raw-bytes replies)."""
        with self._lock:
            return self._channel_locked(address)

    def _channel_locked(self, address: str) -> grpc.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = transport.make_channel(address, self.max_message_bytes, self.security)
        return channel

    def metadata(self) -> tuple:
        """What every call carries about its caller (a server's id and map epoch, for fencing)."""
        return tuple(self.identity())

    def report(self, address: str, detail: str) -> None:
        self.coordinator.report_failure(address, detail)

    # --- calls whose server was declared failed while they wait ---------------------------------------------
    def _tracked(self, address: str, service: str, method: str, request, **kwargs):
        """``method`` of ``service`` at ``address`` (a blocking call), known to the stall watcher meanwhile.  Its
        stub is taken here, in the call: a channel the watcher closed between taking a stub and calling it raised
        a ``ValueError``; it reads as CANCELLED (gone: the caller follows the map), as a call it cancelled does."""
        token = None
        if self.watch_stalls:
            with self._lock:
                self._next_call += 1
                token = self._next_call
                self._inflight[token] = (address, time.monotonic())
                if self._watcher is None and not self._closed.is_set():
                    self._watcher = threading.Thread(target=self._watch, name="ecrec-peers-stalls", daemon=True)
                    self._watcher.start()
        try:
            return getattr(self.stub(address, service), method)(request, **kwargs)
        except ValueError as exc:
            if self._closed.is_set() or "closed channel" not in str(exc):
                raise
            raise ChannelDropped(address) from None
        finally:
            if token is not None:
                with self._lock:
                    self._inflight.pop(token, None)

    def _watch(self) -> None:
        while not self._closed.wait(STALL_CHECK_S):
            now = time.monotonic()
            with self._lock:
                stalled = {address for address, sent in self._inflight.values() if now - sent >= STALL_S}
            if not stalled:
                continue
            try:
                self.coordinator.get_map(timeout_s=min(self.timeout_s, 5.0))  # adopted through on_map
            except grpc.RpcError:
                continue  # the coordinator is away too: the calls wait out their deadline
            except ValueError:  # its channel closed under it: this client is closing
                return
            m = self.current_map()
            if m is None:
                continue
            live = {live_address(m, i) for i in range(m.num_servers)}
            for address in sorted(stalled - live):
                log.warning("server %s was declared failed while calls to it waited: they are cancelled and "
                            "follow the cluster map", address)
                self._drop_channel(address)

    def _drop_channel(self, address: str) -> None:
        """Closes the channel to ``address`` (its calls in flight end CANCELLED); a later call opens a new one."""
        with self._lock:
            channel = self._channels.pop(address, None)
            for key in [k for k in self._stubs if k[0] == address]:
                del self._stubs[key]
        if channel is not None:
            channel.close()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            channels, self._channels, self._stubs = self._channels, {}, {}
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        for channel in channels.values():
            channel.close()

    # --- calls ---------------------------------------------------------------------------------------------------
    def call(self, index: int, method: str, request, service: str = EMBEDDING, timeout_s: float | None = None,
             retry_deadline_s: float | None = None, give_up: Callable[[], bool] | None = None,
             prepare: Callable[[int], None] | None = None):
        """Calls ``method`` at the server holding ``index``; when it is gone, reports it, follows the map to
        the replacement and retries the same request until the retry deadline (then PeerUnreachable).
        ``give_up()`` returning True stops the retries early (PeerUnreachable); ``prepare(index)`` runs before
        every attempt (the client replays unconfirmed pushes to a replacement there)."""
        deadline = time.monotonic() + (self.retry_deadline_s if retry_deadline_s is None else retry_deadline_s)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        coordinator_failed = None  # the last map fetch's error (a coordinator that does not answer)
        busy = BusyWait()
        while True:
            if prepare is not None:
                prepare(index)
            address = self.address_of(index)
            if address is not None:
                try:
                    return self._tracked(address, service, method, request, timeout=timeout_s,
                                         metadata=self.metadata())
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.ABORTED:  # busy for a moment (a snapshot's cut): not gone
                        now = time.monotonic()
                        if now > deadline:
                            raise PeerError(index, address, method, exc.code(), exc.details()) from None
                        busy.note(index, address, method, exc.details(), deadline - now)
                        time.sleep(BUSY_RETRY_S)
                        continue
                    busy.reset()
                    if not transport.is_unavailable(exc):
                        raise PeerError(index, address, method, exc.code(), exc.details()) from None
                    log.log(warn_level(("call", address)),
                            "server %d (%s) %s: %s; following the cluster map", index, address, method,
                            exc.code().name)
                    self.retries += 1
                    self.report(address, f"{method}: {exc.code().name}")
                    moved = self.address_of(index)
                    if moved is not None and moved != address:
                        continue  # the coordinator's reply already names the replacement: retry there now
            if time.monotonic() > deadline or (give_up is not None and give_up()):
                raise PeerUnreachable(f"server index {index} unreachable and not replaced within "
                                      f"{self.retry_deadline_s if retry_deadline_s is None else retry_deadline_s:.0f} s"
                                      f" ({self._why_not_replaced(coordinator_failed)})")
            time.sleep(self.retry_pause_s)
            try:
                self.coordinator.get_map()
                coordinator_failed = None
            except grpc.RpcError as exc:
                coordinator_failed = exc.code().name
                log.log(warn_level("coordinator"),
                        "coordinator unreachable (%s); retrying", exc.code().name)

    def _why_not_replaced(self, coordinator_failed: str | None) -> str:
        """What the map says of why an index was not replaced: the words of :class:`PeerUnreachable`."""
        if coordinator_failed:
            return (f"the coordinator did not answer ({coordinator_failed}): none leads, or its etcd has no quorum; "
                    "its log says which")
        m = self.current_map()
        if m is None:
            return "no cluster map known: the coordinator's log says why"
        if any(s.state == cluster_pb2.PROMOTING for s in m.servers):
            return ("a standby is being promoted (it restores or rebuilds first; a longer retry deadline, "
                    "ClientConfig.retry_deadline_s, waits for it)")
        if not any(s.state == cluster_pb2.STANDBY for s in m.servers):
            return "no standby is registered: start one with ecrec-server serve --standby"
        return ("a standby is registered but was not promoted: the coordinator could not record the promotion "
                "(its etcd without quorum?) or has not declared the server failed yet; its log says which")

    def call_once(self, index: int, method: str, request, service: str = EMBEDDING):
        """One attempt at ``index``: the reply, or None when no live server holds it or it is gone (then
        reported).  Other errors raise PeerError."""
        return self.call_many([(index, method, request)], service)[0]

    def call_many(self, calls: list[tuple[int, str, object]], service: str = EMBEDDING,
                  tolerate_errors: bool = False) -> list:
        """Sends every ``(index, method, request)`` at once (one round trip for all) and returns the replies in
        order; a reply is None when its server is not live or is gone (reported),
        or, with ``tolerate_errors``, when it answered any error (logged)."""
        pending, work = [], []
        for index, method, request in calls:
            address = self.address_of(index)
            pending.append((index, address, method))
            if address is not None:
                work.append((self._tracked, (address, service, method, request),
                             {"timeout": self.timeout_s, "metadata": self.metadata()}))
        results = iter(self._parallel(work))
        replies = []
        for index, address, method in pending:
            if address is None:
                replies.append(None)
                continue
            reply, exc = next(results)
            if exc is None:
                replies.append(reply)
                continue
            if not isinstance(exc, grpc.RpcError):
                raise exc
            if not transport.is_unavailable(exc):
                error = PeerError(index, address, method, exc.code(), exc.details())
                if not tolerate_errors:
                    raise error from None
                log.warning("%s", error)
            else:
                self.report(address, f"{method}: {exc.code().name}")
            replies.append(None)
        return replies

    def fan_out(self, method: str, requests: dict[int, object], service: str = EMBEDDING,
                prepare: Callable[[int], None] | None = None, collect: bool = False) -> dict[int, object]:
        """One request per index in parallel; a call whose server is gone falls back to :meth:`call`, which
        follows the map and retries the same request.  ``prepare`` as in :meth:`call`.  An error status (not
        "gone") raises :class:`PeerError`, or with ``collect`` stands in that index's place in the result while
        the other calls go on."""
        sent, work = [], []
        for index, request in requests.items():
            if prepare is not None:
                prepare(index)
            address = self.address_of(index)
            if address is not None:
                sent.append((index, address))
                work.append((self._tracked, (address, service, method, request),
                             {"timeout": self.timeout_s, "metadata": self.metadata()}))
        outcome = {index: (address, *result) for (index, address), result in zip(sent, self._parallel(work))}
        replies = {}
        for index, request in requests.items():
            if index in outcome:
                address, reply, exc = outcome[index]
                if exc is None:
                    replies[index] = reply
                    continue
                if not isinstance(exc, grpc.RpcError):
                    raise exc
                if not transport.is_unavailable(exc) and exc.code() != grpc.StatusCode.ABORTED:
                    error = PeerError(index, address, method, exc.code(), exc.details())
                    if not collect:
                        raise error from None
                    replies[index] = error
                    continue
            try:
                replies[index] = self.call(index, method, request, service, prepare=prepare)
            except (PeerError, PeerUnreachable) as error:
                if not collect:
                    raise
                # the other calls were sent (and may be applied): this index's failure stands in its place
                replies[index] = error if isinstance(error, PeerError) else PeerError(
                    index, self.address_of(index) or "-", method, grpc.StatusCode.UNAVAILABLE, str(error))
        return replies
