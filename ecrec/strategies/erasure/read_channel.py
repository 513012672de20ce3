"""A replacement's reads of stripe members over parity channels, not gRPC calls.

While an index rebuilds, every training step that touches its rows waits for them to be rebuilt on demand: one
``ReadRows`` to each survivor holding a member of their stripes, then a decode.  Through gRPC (Python) each of
those calls costs the step a millisecond or more of dispatch on both ends, more on a busy machine, and it is on
the step's critical path.  Here the same request goes over a parity channel
(:mod:`~ecrec.strategies.erasure.parity_channel`: a TCP connection opened through an authenticated
``OpenParityChannel`` call, served by a thread of the survivor that answers it as ``ReadRows`` would): every
survivor's request is written first, then their answers are read, one round trip for all without a thread
hand-off.  The row-by-row rebuild in the background reads the same way.

:meth:`RowReader.call_many` answers as ``Peers.call_many`` does (a reply per call, in order: None for a server
not live or gone, an error status raised as ``PeerError``).  A call its channel cannot serve goes through
gRPC: a TLS cluster, ``rebuild_transport=grpc``, a connection that cannot be opened or fails before its answer
(a reused connection is first tried again on a new one), an error status (gRPC's call then gives the error).  A
read that timed out is not sent again: its server is reported and the reply is None, as gRPC's deadline
answers.  After a failure, reads to that server go through gRPC for a while that doubles with each failure in a
row (:data:`RETRY_S` up to :data:`RETRY_MAX_S`).  Connections kept are closed when the rebuild ends
(:meth:`RowReader.release`).
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
#: connections kept open to one server (as many as requests reading at once; more open and close)
KEEP_PER_SERVER = 16
#: after a server's channel failed, reads to it go through gRPC for this long, doubling with each failure in a
#: row up to RETRY_MAX_S (s)
RETRY_S = 1.0
RETRY_MAX_S = 60.0
#: opening a connection may take this long (s)
CONNECT_S = 2.0
#: statuses after which the survivor closed the connection or serves no reads on it: not kept
_NOT_KEPT = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED)
#: what :meth:`RowReader._answer` returns for a read that timed out (its reply stays None, not sent again)
_TIMED_OUT = object()


class RowReader:
    """``ReadRows`` calls to a server's peers, over parity channels where they can go."""

    def __init__(self, host, counters, transport_option: str = "socket"):
        self.host = host
        self.counters = counters  # reads_over_channel, reads_over_grpc: calls answered each way
        self.enabled = transport_option == "socket"
        self._lock = threading.Lock()
        self._idle: dict[str, list[parity_channel.Channel]] = {}  # address -> open connections not in use
        self._failures: dict[str, tuple[int, float]] = {}  # address -> (failures in a row, no channel until then)
        self._closed = False

    def call_many(self, calls: list[tuple[int, object]]) -> list:
        """``ReadRows`` of every ``(index, request)`` at once; the replies in order (None: that server is not
        live or gone, as ``Peers.call_many`` answers)."""
        replies: list = [None] * len(calls)
        addresses = [self.host.peers.address_of(index) for index, _ in calls]
        todo = [n for n, address in enumerate(addresses) if address is not None]
        if todo and self._usable():
            todo = self._over_channels(calls, addresses, todo, replies)
        if todo:
            self.counters.add("reads_over_grpc", len(todo))
            for n, reply in zip(todo, self.host.peers.call_many([(calls[n][0], "ReadRows", calls[n][1])
                                                                  for n in todo], PARITY)):
                replies[n] = reply
        return replies

    def release(self) -> None:
        """Closes the connections kept (the rebuild ended: nothing reads until another)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for channels in idle.values():
            for channel in channels:
                channel.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.release()

    # ------------------------------------------------------------------------------------------------------------
    def _usable(self) -> bool:
        security = self.host.peers.security
        return self.enabled and not self._closed and not (security is not None and security.tls)

    def _over_channels(self, calls, addresses, todo, replies) -> list[int]:
        """Sends every call it can over a channel, then reads their answers; returns the calls left for gRPC."""
        host = self.host
        deadline = time.monotonic() + host.config.rpc_timeout_s
        sent, left, answered = [], [], 0
        try:
            for n in todo:
                address, body = addresses[n], calls[n][1].SerializeToString()
                channel = self._send(address, body, deadline)
                if channel is None:
                    left.append(n)
                else:
                    sent.append((n, address, channel))
            for answered, (n, address, channel) in enumerate(sent, 1):
                reply = self._answer(address, channel, deadline)  # the channel kept or closed, whatever happens
                if reply is None:
                    left.append(n)
                elif reply is not _TIMED_OUT:
                    replies[n] = reply
        finally:
            for _, _, channel in sent[answered:]:  # an unexpected error: answers not read, connections not kept
                channel.close()
        return sorted(left)

    def _answer(self, address: str, channel: parity_channel.Channel, deadline: float):
        """The reply to the read sent on ``channel``: a ``ReadRowsReply``; None to send it through gRPC (the
        connection failed, or an error status: gRPC's call gives the error); :data:`_TIMED_OUT` (reported, its
        reply None, as gRPC's deadline answers: not sent again with a new one)."""
        try:
            data = channel.answer(deadline, self.host.config.max_message_bytes)
        except TimeoutError:
            channel.close()
            self._failed(address)
            self.host.peers.report(address, "ReadRows: DEADLINE_EXCEEDED (parity channel)")
            return _TIMED_OUT
        except OSError as exc:
            channel.close()
            self._failed(address)
            log.info("parity channel read from %s failed (%r); through gRPC", address, exc)
            return None
        except parity_channel.ChannelError as exc:
            if exc.code() in _NOT_KEPT:
                channel.close()
                self._failed(address)
            else:
                self._give_back(address, channel)  # the connection is fine
            return None
        except BaseException:
            channel.close()
            raise
        self._give_back(address, channel)
        self.counters.add("reads_over_channel", 1)
        return parity_pb2.ReadRowsReply.FromString(data)

    def _send(self, address: str, body: bytes, deadline: float) -> parity_channel.Channel | None:
        """Sends ``body`` as a read on a kept connection (again on a new one if that fails) or a new one; the
        channel to read its answer from, or None (through gRPC)."""
        for reused in (True, False):
            channel = self._take(address) if reused else self._open(address)
            if channel is None:
                continue
            try:
                channel.send([body], len(body), self.host.epoch, parity_channel.READ, deadline)
                return channel
            except OSError:
                channel.close()
                if not reused:
                    self._failed(address)
        return None

    def _take(self, address: str) -> parity_channel.Channel | None:
        """A kept connection to ``address`` (None: none, or channels to it are off for now)."""
        now = time.monotonic()
        stale, channel = [], None
        with self._lock:
            if self._failures.get(address, (0, 0.0))[1] > now:
                return None
            idle = self._idle.get(address, [])
            while idle:
                candidate = idle.pop()
                if now - candidate.last_used <= IDLE_S and not candidate.closed:
                    channel = candidate
                    break
                stale.append(candidate)
        for old in stale:
            old.close()
        return channel

    def _open(self, address: str) -> parity_channel.Channel | None:
        with self._lock:
            if self._closed or self._failures.get(address, (0, 0.0))[1] > time.monotonic():
                return None
        try:
            return parity_channel.open_to(self.host, address, CONNECT_S)
        except (grpc.RpcError, OSError) as exc:
            detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else repr(exc)
            log.info("no parity channel for reads from %s (%s); reads go through gRPC", address, detail)
            self._failed(address)
            return None

    def _give_back(self, address: str, channel: parity_channel.Channel) -> None:
        channel.last_used = time.monotonic()
        with self._lock:
            self._failures.pop(address, None)
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < KEEP_PER_SERVER:
                idle.append(channel)
                return
        channel.close()

    def _failed(self, address: str) -> None:
        with self._lock:
            failures = self._failures.get(address, (0, 0.0))[0] + 1
            wait = min(RETRY_MAX_S, RETRY_S * 2 ** (failures - 1))
            self._failures[address] = (failures, time.monotonic() + wait)
