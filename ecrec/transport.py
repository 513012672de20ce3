"""gRPC plumbing shared by every process: channels, servers, byte packing and status errors.

Rows travel as packed little-endian bytes (ids int64, values float32).  Every
remote call in ECRec goes through a stub made here and carries a timeout.
"""

from __future__ import annotations

import ctypes
from concurrent import futures

import grpc
import numpy as np

INT64 = np.dtype("<i8")
FLOAT32 = np.dtype("<f4")


def tune_allocator(mmap_threshold: int = 64 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Keeps glibc from mmap-ing (and page-faulting) every message-sized buffer.

    Every pull reply and push request allocates buffers of a few MiB; above glibc's mmap
    threshold each is a fresh mapping whose pages fault on first touch, which tripled the
    server's handler time here (1.4 ms vs 0.4 ms for a 4096 x 64 pull).  Same effect as
    ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``; a no-op (False) off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):
        return False


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # fail fast on a dead peer instead of waiting for the reconnect backoff
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.enable_retries", 0),
    ]


def make_channel(address: str, max_message_bytes: int = 256 << 20) -> grpc.Channel:
    return grpc.insecure_channel(address, options=channel_options(max_message_bytes))


def make_server(max_workers: int, max_message_bytes: int = 256 << 20) -> grpc.Server:
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ecrec-rpc"),
        options=channel_options(max_message_bytes),
    )


def bind(server: grpc.Server, host: str, port: int) -> int:
    """Binds ``host:port`` (port 0: any free port); returns the port or raises naming the address."""
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:
        raise OSError(f"cannot bind {host}:{port}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port} (in use or not a local address)")
    return bound


def ids_to_bytes(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype=INT64).tobytes()


def floats_to_bytes(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype=FLOAT32).tobytes()


def bytes_to_ids(data: bytes) -> np.ndarray:
    if len(data) % 8:
        raise ValueError(f"ids must be little-endian int64 bytes: length {len(data)} is not a multiple of 8")
    return np.frombuffer(data, dtype=INT64).astype(np.int64, copy=False)


def bytes_to_floats(data: bytes, shape: tuple[int, ...] | None = None) -> np.ndarray:
    if len(data) % 4:
        raise ValueError(f"values must be little-endian float32 bytes: length {len(data)} is not a multiple of 4")
    arr = np.frombuffer(data, dtype=FLOAT32).astype(np.float32, copy=False)
    if shape is not None:
        expected = int(np.prod(shape))
        if arr.size != expected:
            raise ValueError(f"expected {expected} float32 values ({4 * expected} bytes) for shape {tuple(shape)}, got {arr.size}")
        arr = arr.reshape(shape)
    return arr


class RequestError(Exception):
    """A request is invalid; carries the gRPC status code that answers it."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def is_unavailable(exc: BaseException) -> bool:
    """Whether an RPC error means the peer is gone (so the caller should follow the map and retry)."""
    return isinstance(exc, grpc.RpcError) and exc.code() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    )
