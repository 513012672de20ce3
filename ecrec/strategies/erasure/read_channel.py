"""A replacement's reads of stripe members over parity channels, not gRPC calls.

While an index rebuilds, every training step that touches its rows waits for them to be rebuilt on demand: one
``ReadRows`` to each survivor holding a member of their stripes, then a decode.  Through gRPC (Python) each of
those calls costs the step about a millisecond or more of dispatch on both ends, more on a busy machine, and it
is on the step's critical path.  Here the same request goes over a parity channel
(:mod:`~ecrec.strategies.erasure.parity_channel`: a TCP connection opened through an authenticated
``OpenParityChannel`` call, served by a thread of the survivor that answers it as ``ReadRows`` would): every
survivor's request is written first, then their answers are read, one round trip for all without a thread
hand-off.

:meth:`RowReader.call_many` answers as ``Peers.call_many`` does (a reply per call, in order), and sends a call
through gRPC whenever its channel cannot serve it (a TLS cluster, ``rebuild_transport=grpc``, a connection that
cannot be opened or fails, any error status: gRPC's call then gives the error, or None for a server gone, as
before).  So this path only ever makes a read faster.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from ecrec.net.peers import PARITY
from ecrec.strategies.erasure import parity_channel
from ecrec.wire import parity_pb2

log = logging.getLogger("ecrec.strategies.erasure")

#: an idle connection older than this is closed, not used (a middlebox may have dropped it) (s)
IDLE_S = 60.0
#: connections kept open to one server (as many as reads at once from the peers' call pool; more open and close)
KEEP_PER_SERVER = 16
#: after a server's channel could not be opened, reads to it go through gRPC for this long (s)
RETRY_S = 30.0
#: opening a connection may take this long (s)
CONNECT_S = 2.0


class RowReader:
    """``ReadRows`` calls to a server's peers, over parity channels where they can go."""

    def __init__(self, host, counters, transport_option: str = "socket"):
        self.host = host
        self.counters = counters  # reads_over_channel, reads_over_grpc: calls answered each way
        self.enabled = transport_option == "socket"
        self._lock = threading.Lock()
        self._idle: dict[str, list[parity_channel.Channel]] = {}  # address -> open connections not in use
        self._failed_until: dict[str, float] = {}  # address -> when to try a channel to it again
        self._closed = False

    def call_many(self, calls: list[tuple[int, object]]) -> list:
        """``ReadRows`` of every ``(index, request)`` at once; the replies in order (None: that server is not
        live or gone, as ``Peers.call_many`` answers)."""
        replies: list = [None] * len(calls)
        fallback = list(range(len(calls)))
        if self._usable():
            fallback = self._over_channels(calls, replies)
        if fallback:
            self.counters.add("reads_over_grpc", len(fallback))
            for n, reply in zip(fallback, self.host.peers.call_many([(calls[n][0], "ReadRows", calls[n][1])
                                                                       for n in fallback], PARITY)):
                replies[n] = reply
        return replies

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for channels in idle.values():
            for channel in channels:
                channel.close()

    # ------------------------------------------------------------------------------------------------------------
    def _usable(self) -> bool:
        security = self.host.peers.security
        return self.enabled and not self._closed and not (security is not None and security.tls)

    def _over_channels(self, calls, replies) -> list[int]:
        """Sends every call it can over a channel, then reads their answers; returns the calls left for gRPC."""
        host = self.host
        deadline = time.monotonic() + host.config.rpc_timeout_s
        sent, left = [], []
        for n, (index, request) in enumerate(calls):
            address = host.peers.address_of(index)
            channel = self._take(address) if address is not None else None
            if channel is None:
                left.append(n)
                continue
            body = request.SerializeToString()
            try:
                channel.send([body], len(body), host.epoch, parity_channel.READ, deadline)
            except OSError:
                channel.close()
                self._failed(address)
                left.append(n)
                continue
            sent.append((n, address, channel))
        for n, address, channel in sent:
            try:
                data = channel.answer(deadline, host.config.max_message_bytes)
            except OSError as exc:
                channel.close()
                self._failed(address)
                log.info("parity channel read from %s failed (%r); through gRPC", address, exc)
                left.append(n)
                continue
            except parity_channel.ChannelError:
                self._give_back(address, channel)  # the connection is fine; gRPC's call gives the error
                left.append(n)
                continue
            self._give_back(address, channel)
            replies[n] = parity_pb2.ReadRowsReply.FromString(data)
            self.counters.add("reads_over_channel", 1)
        return sorted(left)

    def _take(self, address: str) -> parity_channel.Channel | None:
        now = time.monotonic()
        with self._lock:
            if self._failed_until.get(address, 0.0) > now:
                return None
            idle = self._idle.get(address, [])
            stale = []
            while idle:
                channel = idle.pop()
                if now - channel.last_used <= IDLE_S and not channel.closed:
                    break
                stale.append(channel)
            else:
                channel = None
        for old in stale:
            old.close()
        return channel if channel is not None else self._open(address)

    def _open(self, address: str) -> parity_channel.Channel | None:
        host = self.host
        try:
            reply = host.peers.stub(address, PARITY).OpenParityChannel(
                parity_pb2.OpenParityChannelRequest(), timeout=min(CONNECT_S, host.config.rpc_timeout_s),
                metadata=host.peers.metadata())
            channel = parity_channel.Channel(address.rsplit(":", 1)[0], reply.port, reply.ticket,
                                             min(CONNECT_S, host.config.rpc_timeout_s))
        except (grpc.RpcError, OSError) as exc:
            detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else repr(exc)
            log.info("no parity channel for reads from %s (%s); reads go through gRPC", address, detail)
            self._failed(address)
            return None
        channel.key = address
        return channel

    def _give_back(self, address: str, channel: parity_channel.Channel) -> None:
        channel.last_used = time.monotonic()
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < KEEP_PER_SERVER:
                idle.append(channel)
                return
        channel.close()

    def _failed(self, address: str) -> None:
        with self._lock:
            self._failed_until[address] = time.monotonic() + RETRY_S
