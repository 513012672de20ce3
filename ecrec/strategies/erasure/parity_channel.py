"""The direct path's parity frames over a plain TCP connection from owner to parity server.

At scale an owner sends each parity server a frame of megabytes every few steps (:mod:`~ecrec.strategies.
erasure.batch_frames`).  Through gRPC (Python) that frame was joined into one ``bytes``, copied into gRPC's
buffers, and on the other side turned back into a ``bytes`` object with the GIL held: most of what the direct
path cost.  Here the owner writes the frame's sections to a socket as they are (``sendmsg``, no join) and the
parity server reads it straight into one buffer (``recv_into``, the GIL released), then applies it in place.

Opening is a gRPC call, ``OpenParityChannel``, which proves the caller is a server of the map (``check_peer``)
and answers a port and a one-time ticket; the owner connects to that port *on the parity server's host as its
map lists it* and sends a MAC of the ticket (:func:`opening`); the parity server answers :data:`ACCEPTED`, and the
connection then belongs to that caller.
On it, the owner sends one request at a time and waits for its answer:

    request   16 bytes: the body's length (u64; its top bit set for a read), the caller's map epoch (u64); then
              the body
    answer    12 bytes: a gRPC status code (u32; 0 = OK), the length of what follows (u64); then the serialized
              reply (OK) or the error's message (UTF-8)

A body is a parity frame, answered with a ``ParityAck``, or (the length's top bit, :data:`READ_BIT`, set) a
serialized ``ReadRowsRequest``, answered with its ``ReadRowsReply``: a replacement's on-demand rebuild reads the
members of the rows a step needs this way, one round trip without gRPC's dispatch where it is the step's critical
path (:mod:`~ecrec.strategies.erasure.read_channel`).

Each request is checked as a gRPC call would be (the server serves, the caller is still a server of the map,
after catching up with its epoch) and applied by the same code as ``ApplyParityFrames`` (a read answered by the
same code as ``ReadRows``).  Not used on TLS clusters
(the deltas would travel in clear), and never required: any failure of the connection makes the owner send that
frame through gRPC (a read: ``ReadRows``) and open a new connection later (after a delay that doubles with each
failure in a row).
"""

from __future__ import annotations

import logging
import secrets
import socket
import struct
import threading
import time

import grpc
import numpy as np

from ecrec import errors
from ecrec.net import transport
from ecrec.strategies.erasure import frame_socket

log = logging.getLogger("ecrec.strategies.erasure")

REQUEST = struct.Struct("<QQ")
#: request kinds: a parity frame (answered with a ParityAck), a ReadRows request (answered with its reply)
FRAME, READ = 0, 1
#: a read's length has this bit set (a frame's never does: no frame is 2**63 bytes)
READ_BIT = 1 << 63
ANSWER = struct.Struct("<IQ")
#: the largest error message an answer carries (bytes)
MAX_MESSAGE_BYTES = 1 << 16
#: a connection idle this long is closed by the parity server (an owner gone without closing it holds nothing
#: for ever; an owner that comes back opens another) (s)
IDLE_S = 600.0
#: what the parity server answers an opening whose ticket it gave (the owner's channel is open once it reads it)
ACCEPTED = b"\x01"
#: a connection that has not sent its opening within this is closed (s), and at most this many wait for theirs
OPENING_S = 5.0
MAX_OPENING = 32
#: a ticket not used within this is forgotten (s)
TICKET_TTL_S = 30.0
#: what the opening of a parity channel MACs (not the fast rebuild's: a ticket of one cannot open the other)
PURPOSE = b"ecrec parity channel"
#: sendmsg takes at most this many buffers at once (IOV_MAX is 1024 on Linux)
MAX_BUFFERS = 512
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def opening(ticket: bytes) -> bytes:
    return frame_socket.opening(ticket, PURPOSE)


class ChannelError(Exception):
    """The parity server answered a request with an error status: ``code()`` and ``details()`` as a
    ``grpc.RpcError`` has them, so the sender handles both alike."""

    def __init__(self, code, message: str):
        super().__init__(f"{code.name}: {message}")
        self._code, self._message = code, message

    def code(self):
        return self._code

    def details(self) -> str:
        return self._message


# --- the parity server's end -------------------------------------------------------------------------------------
class ChannelListener:
    """One listening socket on this server's serving host; :meth:`ticket_for` a proven caller, then a thread per
    connection that reads requests and answers them with ``handle(caller, epoch, frame) -> ParityAck`` and
    ``read(caller, epoch, body) -> ReadRowsReply`` (reads refused ``UNIMPLEMENTED`` without one; domain errors
    become their gRPC status)."""

    def __init__(self, host: str, handle, max_frame_bytes: int, timeout_s: float, read=None):
        self.handle = handle
        self.read = read
        self.max_frame_bytes = max_frame_bytes
        self.timeout_s = timeout_s  # a request whose header came must arrive whole within this
        self._lock = threading.Lock()
        self._tickets: dict[bytes, tuple[str, float]] = {}  # opening -> (caller, expiry)
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._opening = threading.BoundedSemaphore(MAX_OPENING)  # connections not yet past their opening
        self._sock = _listen(host.strip("[]"))
        self.port = self._sock.getsockname()[1]
        self.accepted = 0
        self._acceptor = threading.Thread(target=self._accept_loop, name="ecrec-parity-channel-accept", daemon=True)
        self._acceptor.start()

    def ticket_for(self, caller: str) -> bytes:
        """A one-time ticket that opens a connection belonging to ``caller`` (a server ``check_peer`` proved)."""
        ticket = secrets.token_bytes(frame_socket.TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            self._tickets = {k: v for k, v in self._tickets.items() if v[1] > now}
            self._tickets[opening(ticket)] = (caller, now + TICKET_TTL_S)
        return ticket

    def close(self) -> None:
        """Stops accepting and ends every connection (each thread closes its own socket: a descriptor is never
        closed under a thread that may still use it)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        for s in [self._sock, *conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if not self._acceptor.is_alive():
            self._sock.close()

    def _accept_loop(self) -> None:
        """Accepts until closed; an error of one accept (out of descriptors, a connection reset before it was
        taken) is logged and the loop goes on, so the port never stays open with nobody taking connections."""
        logged = 0.0
        try:
            while True:
                try:
                    conn, _ = self._sock.accept()
                except OSError as exc:
                    if self._closed:
                        return
                    if time.monotonic() - logged > 10.0:  # at most every 10 s while it lasts
                        logged = time.monotonic()
                        log.warning("parity channel: accept failed (%r); accepting again", exc)
                    time.sleep(0.05)
                    continue
                if not self._opening.acquire(blocking=False):  # too many connections without their opening yet
                    conn.close()
                    continue
                try:
                    threading.Thread(target=self._open, args=(conn,), name="ecrec-parity-channel", daemon=True).start()
                except RuntimeError:  # no thread to serve it: the owner sends through gRPC
                    self._opening.release()
                    conn.close()
        finally:
            self._sock.close()

    def _open(self, conn: socket.socket) -> None:
        """Reads the opening (a stranger's connection is closed), answers :data:`ACCEPTED`, then serves the
        connection's requests."""
        opened = False
        try:
            first = bytearray(frame_socket.OPENING_BYTES)
            try:
                frame_socket.read_exactly(conn, memoryview(first), time.monotonic() + OPENING_S)
            finally:
                self._opening.release()
            with self._lock:
                caller, expiry = self._tickets.pop(bytes(first), (None, 0.0))
                if caller is None or expiry < time.monotonic() or self._closed:
                    return
                self._conns.add(conn)
                opened = True
                self.accepted += 1
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(ACCEPTED)
            self._serve(conn, caller)
        except OSError:
            pass  # the owner went away or sent garbage: it opens another connection
        except Exception:  # noqa: BLE001 - reported, never swallowed; the owner falls back to gRPC
            log.exception("parity channel")
        finally:
            if opened:
                with self._lock:
                    self._conns.discard(conn)
            conn.close()

    def _serve(self, conn: socket.socket, caller: str) -> None:
        head = bytearray(REQUEST.size)
        while True:
            conn.settimeout(IDLE_S)  # idle between requests: the owner's next group may be a while away
            try:
                if not _read_first(conn, memoryview(head)):
                    return  # the owner closed the connection
            except TimeoutError:
                return  # idle for long (an owner gone without a word): closed; the owner opens another
            size, epoch = REQUEST.unpack(head)
            handle, what = self.handle, "parity frame"
            if size & READ_BIT:
                size &= READ_BIT - 1
                handle, what = self.read or _no_reads, "read"
            if size > self.max_frame_bytes:
                _answer(conn, grpc.StatusCode.INVALID_ARGUMENT,
                        f"a {what} of {size} bytes announced; at most {self.max_frame_bytes}")
                return  # the stream cannot be resynchronised: the connection ends
            frame = np.empty(size, np.uint8)
            frame_socket.read_exactly(conn, memoryview(frame), time.monotonic() + self.timeout_s)
            try:
                ack = handle(caller, epoch, frame)
            except errors.EcrecError as exc:
                _answer(conn, *transport.grpc_status_of(exc))
                continue
            except ValueError as exc:  # as transport.service_method answers it
                _answer(conn, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - reported, and answered INTERNAL as a gRPC handler's would be
                log.exception("parity channel request from %s", caller)
                _answer(conn, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
                continue
            payload = ack.SerializeToString()
            conn.sendall(ANSWER.pack(0, len(payload)) + payload)


def _listen(host: str) -> socket.socket:
    """A listening socket on ``host`` (a wildcard address listens on IPv4 and IPv6 where the system can)."""
    if host in ("", "0.0.0.0", "::") and socket.has_dualstack_ipv6():
        return socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=16)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, 0), family=family, backlog=16)


def _read_first(conn: socket.socket, view: memoryview) -> bool:
    """Reads a request's header; False when the connection ended cleanly before it."""
    n = conn.recv_into(view)
    if n == 0:
        return False
    if n < len(view):
        frame_socket.read_exactly(conn, view[n:], time.monotonic() + 5.0)
    return True


def _no_reads(caller, epoch, body):
    raise errors.Unimplemented("this parity channel serves no reads")


def _answer(conn: socket.socket, code, message: str) -> None:
    data = message.encode("utf-8", "replace")[:MAX_MESSAGE_BYTES]
    conn.sendall(ANSWER.pack(code.value[0], len(data)) + data)


# --- the owner's end ----------------------------------------------------------------------------------------------
def open_to(host, address: str, connect_s: float) -> "Channel":
    """A channel to the server at ``address``: its ``OpenParityChannel`` (the call proves this server), then the
    connection to the port it answered, on that server's host as the map lists it, within ``connect_s`` (at most
    the host's RPC timeout).  Raises ``grpc.RpcError`` or ``OSError``."""
    from ecrec.net.peers import PARITY
    from ecrec.wire import parity_pb2

    timeout = min(connect_s, host.config.rpc_timeout_s)
    reply = host.peers.stub(address, PARITY).OpenParityChannel(parity_pb2.OpenParityChannelRequest(), timeout=timeout,
                                                               metadata=host.peers.metadata())
    channel = Channel(address.rsplit(":", 1)[0], reply.port, reply.ticket, timeout)
    channel.key = address
    return channel


class Channel:
    """A connection to one parity server, opened with the port and ticket its ``OpenParityChannel`` answered; open
    once the parity server answered :data:`ACCEPTED` (within ``timeout_s``: a port that takes connections but
    does not serve fails here, not at the first frame)."""

    def __init__(self, host: str, port: int, ticket: bytes, timeout_s: float):
        self.address = (host.strip("[]"), port)
        self.key = None  # what the owner opened it for (the destination's address)
        self.closed = False
        self.last_used = time.monotonic()
        self._sock = socket.create_connection(self.address, timeout=timeout_s)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.settimeout(timeout_s)
            self._sock.sendall(opening(ticket))
            answer = bytearray(len(ACCEPTED))
            frame_socket.read_exactly(self._sock, memoryview(answer), time.monotonic() + timeout_s)
            if bytes(answer) != ACCEPTED:
                raise ConnectionError(f"the parity server answered {bytes(answer)!r} to the opening, not accepted")
        except OSError:
            self._sock.close()
            raise

    def request(self, parts: list, size: int, epoch: int, timeout_s: float, kind: int = FRAME,
                max_answer_bytes: int = 1 << 20):
        """Sends one request (``parts``: its body's buffers in order, ``size`` bytes in all) and returns the
        serialized reply of the answer (at most ``max_answer_bytes``); raises :class:`ChannelError` for an error
        status, ``OSError`` when the connection fails (closed, reset, timed out: the caller closes it and goes
        through gRPC)."""
        deadline = time.monotonic() + timeout_s
        self.send(parts, size, epoch, kind, deadline)
        return self.answer(deadline, max_answer_bytes)

    def send(self, parts: list, size: int, epoch: int, kind: int, deadline: float) -> None:
        """The first half of :meth:`request` (several connections' requests can be sent before any answer is read)."""
        _sendmsg_all(self._sock, [REQUEST.pack(size | (READ_BIT if kind == READ else 0), epoch), *parts], deadline)

    def answer(self, deadline: float, max_answer_bytes: int = 1 << 20) -> bytes:
        """The second half of :meth:`request`: the answer to the request sent last."""
        head = bytearray(ANSWER.size)
        frame_socket.read_exactly(self._sock, memoryview(head), deadline)
        code, n = ANSWER.unpack(head)
        if n > max(MAX_MESSAGE_BYTES, max_answer_bytes):
            raise ConnectionError(f"a parity channel's answer of {n} bytes announced")
        body = bytearray(n)
        frame_socket.read_exactly(self._sock, memoryview(body), deadline)
        if code:
            raise ChannelError(_CODES.get(code, grpc.StatusCode.UNKNOWN), body.decode("utf-8", "replace"))
        return bytes(body)

    def abort(self) -> None:
        """Ends the connection from another thread: a :meth:`request` under way fails with ``OSError`` (the socket
        itself is closed by the thread that uses it, :meth:`close`)."""
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Closes the connection (the thread that makes its requests, or when none can be under way)."""
        self.abort()
        self._sock.close()


def _sendmsg_all(sock: socket.socket, buffers: list, deadline: float) -> None:
    """Writes every buffer, in order, with as few system calls as ``sendmsg`` allows; no copy of the bulk bytes."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    first = 0  # views before this one are sent
    while first < len(views):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out sending a parity frame")
        sock.settimeout(remaining)
        sent = sock.sendmsg(views[first:first + MAX_BUFFERS])
        while sent:
            if sent >= len(views[first]):
                sent -= len(views[first])
                first += 1
            else:
                views[first] = views[first][sent:]
                sent = 0
