"""Frames of the fast rebuild over a plain TCP connection, beside the gRPC call that asked for them.

Python gRPC moves about 1.2 GB/s here and holds the GIL while it turns each received message into a
``bytes`` object; a socket read straight into the frame's buffer (``recv_into``, the GIL released) moves
more than twice that at half the CPU.  So the replacement asks for its rows with the usual gRPC call
(``StreamStripes``: authenticated, fenced, with a deadline) carrying a port and a one-time ticket, and the
survivor, once the call passed every check, connects to that port *on the caller's own host as the cluster
map lists it* (never an address the request names: a caller cannot turn a survivor into a sender of table
rows to anywhere else), sends a MAC of the ticket (:func:`opening`: not bytes the caller chose), then its
frames, and ends the call OK.

- :class:`FrameListener` (the replacement): one listening socket per stream, on the replacement's serving
  host; accepts until a connection opens with the ticket's MAC (others are closed), then reads whole frames.
- :func:`send_frames` (the survivor): connects, sends the opening and each frame buffer as it is (no copy).

A snapshot's rows travel the same way (``ecrec.snapshot.part``: raw rows, not frames, under a ticket of their own
purpose).  Not used on TLS clusters (the rows would travel in clear): there the frames stay on the gRPC stream.
Every blocking step has a timeout; a failure is an ``OSError`` or a :class:`~ecrec.strategies.erasure.frames.
FrameError` naming what happened, and the caller falls back to the gRPC stream.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import threading
import time
from collections.abc import Iterable

import numpy as np

from ecrec.strategies.erasure import frames

TICKET_BYTES = 16
#: what a survivor sends first: a fixed tag, then a MAC of the ticket (never the ticket itself, so that a caller
#: cannot choose the first bytes a survivor sends to a port of its choice)
OPENING_TAG = b"ECRECFS1"
OPENING_BYTES = len(OPENING_TAG) + 32


def opening(ticket: bytes, purpose: bytes = b"ecrec stripe frames") -> bytes:
    """The first bytes of a connection opened with ``ticket`` for ``purpose`` (the fast rebuild's frames unless
    another is named: a ticket of one purpose does not open a connection of another)."""
    return OPENING_TAG + hmac.new(ticket, purpose, hashlib.sha256).digest()


class FrameListener:
    """The replacement's end of one stream: ``with FrameListener(host, timeout_s) as listener`` then
    pass ``listener.port`` and ``listener.ticket`` in the request and call :meth:`receive`."""

    def __init__(self, host: str, timeout_s: float, purpose: bytes = b"ecrec stripe frames"):
        self.timeout_s = timeout_s
        self.purpose = purpose  # what the opening MACs: a ticket of one purpose opens no connection of another
        self.ticket = secrets.token_bytes(TICKET_BYTES)
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((host.strip("[]"), 0))
            self._sock.listen(4)
        except OSError:
            self._sock.close()
            raise
        self.port = self._sock.getsockname()[1]

    def __enter__(self) -> "FrameListener":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Closes the listening socket (a :meth:`receive` waiting to accept then fails at once)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def receive(self, count: int, positions: int, indices: int, row_bytes: int, k: int,
                max_frame_bytes: int) -> list[frames.Frame]:
        """Accepts the survivor's connection and reads ``count`` frames of at most ``max_frame_bytes`` (each
        checked as :func:`frames.parse` does); raises ``OSError`` (timeout, closed, reset) or ``FrameError``."""
        deadline = time.monotonic() + self.timeout_s
        conn = self._accept(deadline)
        with conn:
            out = []
            header = np.empty(frames.HEADER.size, np.uint8)
            for _ in range(count):
                read_exactly(conn, memoryview(header), deadline)
                size = frames.size_from_header(header)
                if size > max_frame_bytes:
                    raise frames.FrameError(f"a frame of {size} bytes announced; at most {max_frame_bytes} asked for")
                buffer = np.empty(size, np.uint8)
                buffer[:len(header)] = header
                read_exactly(conn, memoryview(buffer)[len(header):], deadline)
                out.append(frames.parse(buffer, positions, indices, row_bytes, k))
            return out

    def receive_into(self, view: memoryview) -> None:
        """Accepts the sender's connection and reads exactly ``len(view)`` bytes into ``view`` (raw bytes, no
        frames: a snapshot's rows); raises ``OSError`` (timeout, closed, reset, fewer bytes or more)."""
        deadline = time.monotonic() + self.timeout_s
        with self._accept(deadline) as conn:
            read_exactly(conn, view, deadline)
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            if conn.recv(1):  # the sender closes after its last byte: anything more is not what was asked
                raise ConnectionError(f"the sender sent more than the {len(view)} bytes asked for")

    def _accept(self, deadline: float) -> socket.socket:
        expected = opening(self.ticket, self.purpose)
        while True:
            if time.monotonic() >= deadline:  # connections that never open right do not keep this waiting
                raise TimeoutError("no connection opened with the ticket in time")
            self._sock.settimeout(max(0.001, deadline - time.monotonic()))
            conn, _ = self._sock.accept()
            first = bytearray(OPENING_BYTES)
            try:
                read_exactly(conn, memoryview(first), min(deadline, time.monotonic() + 5.0))
                if hmac.compare_digest(bytes(first), expected):
                    return conn
            except OSError:
                pass
            conn.close()  # not the survivor asked (or it gave up): wait for the right one


def send_frames(host: str, port: int, ticket: bytes, buffers: Iterable[np.ndarray], timeout_s: float,
                stop: threading.Event | None = None, purpose: bytes = b"ecrec stripe frames") -> int:
    """The survivor's end: connects to ``host:port``, sends the :func:`opening` of ``ticket`` (for ``purpose``)
    then every buffer; returns the bytes sent.  Raises ``OSError`` when the replacement cannot be reached or
    stops reading, ``ConnectionAbortedError`` when ``stop`` is set (the call was cancelled)."""
    sent = 0
    with socket.create_connection((host.strip("[]"), port), timeout=timeout_s) as conn:
        conn.settimeout(timeout_s)
        conn.sendall(opening(ticket, purpose))
        for buffer in buffers:
            if stop is not None and stop.is_set():
                raise ConnectionAbortedError("the call was cancelled")
            conn.sendall(memoryview(buffer))
            sent += len(buffer)
    return sent


def read_exactly(conn: socket.socket, view: memoryview, deadline: float) -> None:
    while len(view):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out reading frames")
        conn.settimeout(remaining)
        n = conn.recv_into(view)
        if n == 0:
            raise ConnectionError("the sender closed the connection before its last frame")
        view = view[n:]
