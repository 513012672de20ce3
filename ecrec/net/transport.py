"""gRPC plumbing shared by every process: channels, servers, byte packing and status errors.

Rows travel as packed little-endian bytes (ids int64, values float32).  Every
remote call in ECRec goes through a stub made here and carries a timeout.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re
from concurrent import futures

import grpc
import numpy as np

from ecrec import errors
from ecrec.net.refusals import REFUSALS

#: what a worker name may not hold: control characters (C0, DEL, C1), line and paragraph separators (each splits a
#: log line), lone surrogates (no UTF-8)
_NOT_IN_A_NAME = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
#: ... nor characters one cannot see: text-direction controls (a name with U+202E shows reversed in logs and
#: ``status``: it can pass for another worker's), zero-width and other invisible formatting characters (every
#: Unicode format character, Cf, but those below; Unicode's other default-ignorable ones), fillers that show as
#: blanks, variation selectors (``rank1`` and ``rank1`` + U+FE00 look the same) and tags (so subdivision flag
#: emoji too).  ``test_sdk_input`` checks every Cf character of Python's Unicode is here or in
#: :data:`VISIBLE_FORMAT`
_INVISIBLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180d\u180f\u200b\u200e"
                        "\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\u2800\u3164\ufe00-\ufe0d\ufeff"
                        "\uffa0\ufff0-\ufffb\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
                        "\U000e0000-\U000e0fff]")
#: format characters a name may hold: the zero-width (non-)joiners scripts and emoji need, the Mongolian vowel
#: separator, and number signs drawn above the digits that follow them (Arabic, Syriac, Kaithi)
VISIBLE_FORMAT = "\u0600\u0601\u0602\u0603\u0604\u0605\u06dd\u070f\u0890\u0891\u08e2\u180e\u200c\u200d" \
                 "\U000110bd\U000110cd"
#: ... but the joiners and the Mongolian separator only between two characters of other scripts, and the emoji
#: presentation selectors only after one (``rank1`` + U+200D, or + U+FE0F, looks like ``rank1``)
_LONE_JOINER = re.compile("(?:^|[\x00-\x7f])[\u180e\u200c\u200d\ufe0e\ufe0f]|[\u180e\u200c\u200d](?:$|[\x00-\x7f])")


def worker_name_problem(name: str) -> str | None:
    """What keeps ``name`` from being a worker's name in push ids, logs and ``status`` (None: nothing).  Servers
    ask it of every push: a printable ASCII name, the usual one, is answered without the searches below."""
    if name.isascii() and name.isprintable() and name == name.strip():
        return None
    found = _NOT_IN_A_NAME.search(name)
    if found is not None:
        what, at = ("a lone surrogate (not UTF-8 text)" if "\ud800" <= found.group() <= "\udfff" else
                    "a control character or line separator"), found.start()
    elif (found := _INVISIBLE.search(name)) is not None:
        what, at = "an invisible or text-direction formatting character", found.start()
    elif (found := _LONE_JOINER.search(name)) is not None:
        at = found.start() + (1 if found.group()[0] < "\x80" and len(found.group()) > 1 else 0)
        what = "a joiner or presentation selector beside nothing it could join (it would not show)"
    elif name != name.strip():
        return ("begins or ends with white space (the name would look like one without it): name workers with "
                "printable text")
    else:
        return None
    char = name[at]
    return f"holds {what} ({char!r}, U+{ord(char):04X}, at character {at}): name workers with printable text"


INT64 = np.dtype("<i8")
FLOAT32 = np.dtype("<f4")

log = logging.getLogger("ecrec.transport")


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
        # each channel its own connections: in gRPC's process-wide pool a new channel to an address shared the
        # connection of an older one, and failed at once (UNAVAILABLE, "connection refused") while that one
        # waited out its reconnect backoff after the process that had served there stopped -- though a new
        # process served the address now (a server or coordinator restarted on its port)
        ("grpc.use_local_subchannel_pool", 1),
    ]


def make_channel(address: str, max_message_bytes: int = 256 << 20, security=None) -> grpc.Channel:
    """A channel to ``address``; with ``security`` (:class:`ecrec.net.security.Security`) TLS and/or the token."""
    return _security().secure_channel(address, channel_options(max_message_bytes), security)


def make_server(max_workers: int, max_message_bytes: int = 256 << 20, security=None) -> grpc.Server:
    """A gRPC server; with ``security`` every call is checked (token, roles) before its handler runs."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ecrec-rpc"),
        # no SO_REUSEPORT (gRPC's default on Linux): a port another process serves is "in use", not silently
        # shared -- a second server there took half its calls (a coordinator answered as a server, and back)
        options=channel_options(max_message_bytes) + [("grpc.so_reuseport", 0)],
        interceptors=_security().interceptors(security),
    )


def _security():
    from ecrec.net import security  # late: ecrec.net.security imports the configuration, which may import this module
    return security


class LateServices(grpc.GenericRpcHandler):
    """Services registered after the gRPC server started (a strategy's, once the map names the strategy).

    Added to the server before ``start()``; a generated ``add_XServicer_to_server(servicer, late)``
    then registers into it as if it were the server.  Methods not registered answer UNIMPLEMENTED.
    """

    def __init__(self):
        self._methods: dict[str, grpc.RpcMethodHandler] = {}
        self._generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service_name: str, handlers: dict) -> None:
        for method, handler in handlers.items():
            self._methods[f"/{service_name}/{method}"] = handler

    def service(self, handler_call_details):
        handler = self._methods.get(handler_call_details.method)
        if handler is not None:
            return handler
        for generic in self._generic:
            handler = generic.service(handler_call_details)
            if handler is not None:
                return handler
        return None


def bind(server: grpc.Server, host: str, port: int, security=None) -> int:
    """Binds ``host:port`` (port 0: any free port), with TLS when ``security`` has it; returns the port or
    raises naming the address."""
    return _security().bind(server, host, port, security)


def ids_to_bytes(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype=INT64).tobytes()


def floats_to_bytes(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype=FLOAT32).tobytes()


def bytes_to_ids(data: bytes) -> np.ndarray:
    if len(data) % 8:
        raise errors.InvalidRequest(f"ids must be little-endian int64 bytes: length {len(data)} is not a multiple of 8")
    return np.frombuffer(data, dtype=INT64).astype(np.int64, copy=False)


def bytes_to_floats(data: bytes, shape: tuple[int, ...] | None = None) -> np.ndarray:
    if len(data) % 4:
        raise errors.InvalidRequest(f"values must be little-endian float32 bytes: length {len(data)} is not a multiple of 4")
    arr = np.frombuffer(data, dtype=FLOAT32).astype(np.float32, copy=False)
    if shape is not None:
        expected = int(np.prod(shape))
        if arr.size != expected:
            raise errors.InvalidRequest(f"expected {expected} float32 values ({4 * expected} bytes) for shape {tuple(shape)}, got {arr.size}")
        arr = arr.reshape(shape)
    return arr


def grpc_status_of(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status that answers a domain error (:mod:`ecrec.errors`), or None for anything else."""
    if isinstance(exc, errors.EcrecError):
        return getattr(grpc.StatusCode, exc.status), exc.message
    return None


def service_method(fn):
    """Wraps a servicer method: domain errors become their gRPC status with the message, a plain
    ``ValueError`` becomes INVALID_ARGUMENT, anything else is logged and answered INTERNAL.

    The wrapped method raises instead of calling ``context.abort`` itself."""

    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except grpc.RpcError:
            raise
        except errors.EcrecError as exc:
            code, message = grpc_status_of(exc)
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                REFUSALS.add(fn.__name__, code)
            context.abort(code, message)
        except ValueError as exc:
            REFUSALS.add(fn.__name__, grpc.StatusCode.INVALID_ARGUMENT)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported, never swallowed
            log.exception("%s failed", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__}: {type(exc).__name__}: {exc}")

    return wrapper


def is_unavailable(exc: BaseException) -> bool:
    """Whether an RPC error means the peer is gone (so the caller should follow the map and retry)."""
    return isinstance(exc, grpc.RpcError) and exc.code() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    )


def free_port_outside_ephemeral_range(host: str = "127.0.0.1") -> int:
    """A port that is free now and below the kernel's ephemeral range (``ip_local_port_range``), so no
    ``bind(0)`` or outgoing connection on this host can take it while its owner restarts."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = list(range(max(1024, low - 12000), low))
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} on {host}")
