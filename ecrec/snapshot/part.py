"""A server's part of a snapshot: the rows of the id ranges it was given, gathered from their owners (its own
shard and its peers, in parallel), and the dense tensors it was given, written to its own ``.distcp`` file.

Every server writes at once, each its own file, so a snapshot is written at the servers' combined rate and no
client ever holds the model.  A range of ids is contiguous in the snapshot (DCP's chunks are hyper-rectangles)
but spread evenly over every server in the cluster (the layout rotates rows across servers), so each server
reads about ``(S-1)/S`` of its range from its peers while it writes the previous chunk: ``ReadPayload`` calls
whose rows the peer sends over a connection it opens to the writer (:func:`deliver`; in the replies on a TLS
cluster).  Each row's weights and state go straight into the chunk's two items, written past the page cache
where the file system allows (``snapshot_files.open_direct``); :class:`Parts` says what each part took.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from ecrec import errors
from ecrec.snapshot import files as snapshot_files
from ecrec.snapshot.tally import Tally
from ecrec.net import transport
from ecrec.net.peers import PeerError, PeerUnreachable
from ecrec.strategies.erasure import frame_socket
from ecrec.wire import embedding_pb2

#: the default and largest item written (a chunk of rows' weights or state)
CHUNK_BYTES = 64 << 20
MAX_CHUNK_BYTES = 128 << 20
#: the largest ``ReadPayload`` reply asked of a peer
READ_BYTES = 4 << 20
#: reads in flight at once
READERS = 4

log = logging.getLogger(__name__)


_writing: set[str] = set()  # the files being written by this process (one writer each)
_writing_lock = threading.Lock()


def _local(path: str) -> str:
    """A ``file://`` URL as the local path it names (what the root is compared on); anything else as it is."""
    return path[len("file://"):] if path.startswith("file://") else path


def _within(path: str, root: str) -> bool:
    path, root = _local(path), _local(root)
    if snapshot_files.is_url(root) or snapshot_files.is_url(path):  # ".." refused before (validate)
        return path.rstrip("/") == root.rstrip("/") or path.startswith(root.rstrip("/") + "/")
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root + os.sep)


def validate(state, request) -> list:
    """Checks a ``WriteSnapshotRequest`` before anything is written; returns ``[(shard, start, stop)]``."""
    if not snapshot_files.DATA_FILE.match(request.file):
        raise errors.InvalidRequest(f"file {request.file!r}: a plain name ending in .distcp is expected")
    if not request.path:
        raise errors.InvalidRequest("no snapshot path")
    if not snapshot_files.is_url(request.path) and not os.path.isabs(request.path):
        raise errors.InvalidRequest(f"snapshot path {request.path!r} is relative: each server would resolve it in "
                                    "its own directory; send an absolute path or a URL")
    if snapshot_files.is_url(request.path) and ".." in request.path.split("://", 1)[1].split("/"):
        raise errors.InvalidRequest(f"snapshot URL {request.path!r} holds a '..' segment: send the location itself")
    root = state.config.snapshot_root
    if root and not _within(request.path, root):
        raise errors.PermissionDenied(f"snapshot path {request.path!r} is outside this server's --snapshot-root "
                                      f"{root!r}")
    if request.chunk_bytes < 0 or request.chunk_bytes > MAX_CHUNK_BYTES:
        raise errors.InvalidRequest(f"chunk_bytes {request.chunk_bytes} outside [0, {MAX_CHUNK_BYTES}]")
    ranges = []
    for r in request.ranges:
        shard = state.serving_table(r.table)
        if not 0 <= r.start < r.stop <= shard.spec.num_rows:
            raise errors.InvalidRequest(f"table {r.table!r}: range [{r.start}, {r.stop}) outside its "
                                        f"{shard.spec.num_rows} rows")
        ranges.append((shard, r.start, r.stop))
    for name in request.dense:
        state.dense(name)
    return ranges


#: what the opening of a connection delivering a snapshot's rows MACs (a ticket of the fast rebuild or of a parity
#: channel opens none of these, nor one of these theirs)
DELIVERY_PURPOSE = b"ecrec snapshot rows"


def check_delivery(state, context, request) -> str:
    """A peer's read of a snapshot's rows to be delivered over a connection (``ReadPayload`` with
    ``deliver_port``), checked before anything is read: rows of one table by ids, a port and a ticket, a caller
    that proves it is a server of the map (``check_peer``: a worker or a stranger may not ask), no TLS (the rows
    would travel in clear).  Returns the host to deliver to: *the caller's as the map lists it*, never an
    address of the request."""
    if request.all_rows or request.dense or not request.table:
        raise errors.InvalidRequest("deliver_port reads rows of one table by ids (no all_rows, no dense tensors)")
    if not (1024 <= request.deliver_port <= 65535 and len(request.ticket) == frame_socket.TICKET_BYTES):
        raise errors.InvalidRequest(f"deliver_port must be a port in [1024, 65535] (got {request.deliver_port}) "
                                    f"with a ticket of {frame_socket.TICKET_BYTES} bytes (got {len(request.ticket)})")
    caller = state.check_peer(context, changes_parity=False)
    if state.peers.security is not None and state.peers.security.tls:
        raise errors.FailedPrecondition("rows are not delivered over a plain connection on a TLS cluster; ask "
                                        "without deliver_port")
    m = state.map
    address = next((s.address for s in (m.servers if m is not None else ()) if s.server_id == caller), None)
    if address is None:
        raise errors.FailedPrecondition(f"caller {caller} has no address in the cluster map: ask without "
                                        "deliver_port")
    return address.rsplit(":", 1)[0]


def deliver(state, host: str, request, shard, slots: np.ndarray) -> None:
    """Sends the rows a checked read (:func:`check_delivery`) asks for to ``host`` at its port, after a MAC of the
    ticket (:mod:`~ecrec.strategies.erasure.frame_socket`); the reply (sent after) carries no payload: the
    caller takes the bytes once it is OK."""
    payload = _rows_at(state, shard, slots, request.cut)
    try:
        frame_socket.send_frames(host, request.deliver_port, request.ticket, [payload.reshape(-1)],
                                 state.config.rpc_timeout_s, purpose=DELIVERY_PURPOSE)
    except OSError as exc:
        raise errors.FailedPrecondition(f"delivering {len(slots)} rows to {host}:{request.deliver_port} failed "
                                        f"({exc!r}); ask without deliver_port") from None


class _Delivery:
    """A writer's reads of its peers' rows over connections they open to it (:func:`deliver`), one per read;
    the first that cannot be made so (a TLS cluster, a host this server cannot listen on, a peer that cannot
    connect) turns the rest of this write to the rows in the replies (``ReadPayload`` over gRPC)."""

    def __init__(self, state):
        self.state = state
        security = state.peers.security
        self.enabled = security is None or not security.tls
        self.refused = ""

    def read(self, r: int, request, nbytes: int) -> np.ndarray | None:
        """The ``nbytes`` of rows ``request`` asks server ``r`` for, delivered; None when they could not be (the
        caller then asks over gRPC)."""
        if not self.enabled:
            return None
        state = self.state
        address = state.peers.address_of(r)
        if address is None:
            return None
        try:
            listener = frame_socket.FrameListener(state.config.host, state.config.rpc_timeout_s, DELIVERY_PURPOSE)
        except OSError as exc:
            return self._refuse(f"cannot listen on {state.config.host}: {exc!r}")
        with listener:
            asked = embedding_pb2.ReadPayloadRequest()
            asked.CopyFrom(request)
            asked.deliver_port, asked.ticket = listener.port, listener.ticket
            call = state.peers.stub(address).ReadPayload.future(asked, timeout=state.config.rpc_timeout_s,
                                                                metadata=state.peers.metadata())
            # a call that fails stops the wait for its connection at once, and so does one answered with the rows
            # in its reply (a server of a release that does not deliver: it ignores the fields)
            call.add_done_callback(lambda c: (c.code() != grpc.StatusCode.OK or len(c.result().payload))
                                   and listener.close())
            rows = np.empty(nbytes, dtype=np.uint8)
            try:
                listener.receive_into(memoryview(rows))
                call.result()
            except (OSError, grpc.RpcError) as exc:
                call.cancel()
                code = call.code()
                if code == grpc.StatusCode.OK:  # answered in the reply (see above), or sent too few bytes
                    return self._refuse("a peer answered without delivering the rows")
                if code not in (None, grpc.StatusCode.OK, grpc.StatusCode.CANCELLED,
                                grpc.StatusCode.FAILED_PRECONDITION):
                    return None  # the peer's own trouble (unavailable, busy): the gRPC read retries and reports it
                return self._refuse(call.details() if code == grpc.StatusCode.FAILED_PRECONDITION else repr(exc))
        return rows

    def _refuse(self, detail: str) -> None:
        if self.enabled:
            log.warning("snapshot: rows over a direct connection failed (%s); this write reads them over gRPC",
                        detail)
        self.enabled, self.refused = False, detail
        return None


#: the parts :class:`Parts` times: thread CPU seconds, then wall seconds
CPU_PARTS = ("own_rows", "peer_rows", "place", "checksum", "write")
WALL_PARTS = ("waiting_for_rows", "sync")
#: where the rows a server writes came from: its own shard, its peers over connections they opened to it
#: (:func:`deliver`), its peers' ``ReadPayload`` replies
BYTES_FROM = ("own", "delivered", "in_replies")


class Parts:
    """What a server's part of a snapshot took, by part: CPU seconds of the threads that read its own rows
    (``own_rows``), asked its peers for theirs (``peer_rows``: the calls and their replies received), placed the
    rows into a chunk (``place``), checksummed the chunks (``checksum``) and wrote them (``write``: the zip records
    and the system calls); wall seconds the writer waited for a chunk's rows (``waiting_for_rows``) and for the
    disk (``sync``: the fsync); the rows' bytes by where they came from.  What the peers spent serving the reads
    counts in their own totals."""

    def __init__(self):
        self.cpu_s, self.wall_s, self.bytes = Tally(CPU_PARTS), Tally(WALL_PARTS), Tally(BYTES_FROM)
        self.cpu, self.wall, self.count = self.cpu_s.cpu, self.wall_s.wall, self.bytes.add

    def as_dict(self) -> dict:
        return {"cpu_s": self.cpu_s.as_dict(), "wall_s": self.wall_s.as_dict(), "bytes": self.bytes.as_dict()}


def _rows_at(state, shard, slots: np.ndarray, cut: str) -> np.ndarray:
    """A copy of rows ``slots`` of this server's shard, as they were at the snapshot's ``cut`` when it has one."""
    return (shard.read_payload_at(slots, state.cuts.get(cut, "table", shard.name)) if cut
            else shard.read_payload(slots))


def _chunk_buffers(spec, rows: int) -> list[tuple[np.ndarray, slice]]:
    """A chunk's arrays, each the rows of one item (weights, then the optimizer state when the table has one) and
    the columns of a row's floats it takes: filled by :func:`_gather`, written as they are."""
    parts = [(snapshot_files.aligned_empty((rows, spec.dim), np.float32), slice(0, spec.dim))]
    if spec.row_floats > spec.dim:
        parts.append((snapshot_files.aligned_empty((rows, spec.row_floats - spec.dim), np.float32),
                      slice(spec.dim, spec.row_floats)))
    return parts


def _gather(state, shard, start: int, stop: int, pool: ThreadPoolExecutor, cut: str,
            buffers: list[tuple[np.ndarray, slice]], parts: Parts, delivery: "_Delivery | None" = None) -> None:
    """The rows ``start..stop-1`` in id order, into the first ``stop - start`` rows of ``buffers`` (weights, state:
    :func:`_chunk_buffers`): this server's own from its shard, the rest from their owners (reads of at most
    :data:`READ_BYTES`, several in flight, delivered over connections the owners open to this server when
    ``delivery`` can, else in ``ReadPayload`` replies: gRPC moves small messages several times faster than one
    large one).  A range of whole blocks (``S*k`` rows: every server holds ``k`` rows of each, in
    consecutive slots) is read as consecutive slots and placed by strided copies, each row's weights and state
    straight into their items; any other range (a table's tail) row by row."""
    layout, spec = state.layout, shard.spec
    block = layout.num_servers * layout.k
    n = stop - start
    targets = [(buffer[:n], columns) for buffer, columns in buffers]
    pieces = []  # (server, ids, where: row positions, or the first block of a run of whole blocks)
    by_block = start % block == 0 and n % block == 0 and stop <= spec.num_rows
    if by_block:
        per = max(1, min(READ_BYTES // spec.row_bytes, state.config.max_ids_per_request) // layout.k)  # blocks a
        # message
        first = start // block
        for r in range(layout.num_servers):
            for b0 in range(0, n // block, per):
                b1 = min(n // block, b0 + per)
                slots = np.arange((first + b0) * layout.k, (first + b1) * layout.k, dtype=np.int64)
                pieces.append((r, layout.ids_of_slots(r, slots), b0))
    else:
        ids = np.arange(start, stop, dtype=np.int64)
        owners, _ = layout.locate(ids)
        per = max(1, min(READ_BYTES // spec.row_bytes, state.config.max_ids_per_request))
        for r in np.unique(owners):
            where = np.flatnonzero(owners == r)
            for a in range(0, len(where), per):
                pieces.append((int(r), ids[where[a:a + per]], where[a:a + per]))

    def place(r: int, rows: np.ndarray, where) -> None:
        floats = rows.view(np.float32)  # (rows, row_floats)
        if not by_block:
            for target, columns in targets:
                target[where] = floats[:, columns]
            return
        floats = floats.reshape(-1, layout.k, spec.row_floats)
        for target, columns in targets:
            into = target.reshape(-1, block, target.shape[1])[where:where + len(floats)]
            for t in range(layout.k):  # slot t of a block holds the row at position ((r - t) % S) * k + t of it
                into[:, ((r - t) % layout.num_servers) * layout.k + t] = floats[:, t, columns]

    def read(piece) -> None:
        r, ids, where = piece
        if r == state.index:
            with parts.cpu("own_rows"):
                slots = shard.slots_for(ids)
                state.strategy.ensure_rows([(shard, slots)])
                data = _rows_at(state, shard, slots, cut)
        else:  # as it was at the snapshot's cut, when it has one
            with parts.cpu("peer_rows"):
                request = embedding_pb2.ReadPayloadRequest(table=shard.name, ids=transport.ids_to_bytes(ids), cut=cut)
                data = delivery.read(r, request, len(ids) * spec.row_bytes) if delivery is not None else None
                source = "delivered"
                if data is None:
                    data, source = state.peers.call(r, "ReadPayload", request).payload, "in_replies"
            if len(data) != len(ids) * spec.row_bytes:
                raise errors.Internal(f"server {r} answered {len(data)} bytes for {len(ids)} rows")
        parts.count("own" if r == state.index else source, len(ids) * spec.row_bytes)
        with parts.cpu("place"):
            place(r, np.frombuffer(data, dtype=np.uint8).reshape(len(ids), spec.row_bytes), where)

    for future in [pool.submit(read, piece) for piece in pieces]:
        future.result()


def write(state, request) -> tuple[list[dict], int, float, dict]:
    """Writes this server's part; returns its items (``key, offsets, sizes, file, offset, length, sha256``),
    the file's size, the seconds it took and what each part took (:meth:`Parts.as_dict`)."""
    t0 = time.perf_counter()
    ranges = validate(state, request)
    target = snapshot_files.join(request.path, request.file)
    with _writing_lock:
        if target in _writing:
            raise errors.FailedPrecondition(f"server {state.index} is writing {target} already")
        _writing.add(target)
    parts = Parts()
    try:
        items, size = _write(state, request, ranges, parts)
    except FileExistsError:
        raise errors.AlreadyExists(f"server {state.index}: {target} exists; a snapshot never overwrites a file "
                                   "(remove the old snapshot first)") from None
    except OSError as exc:
        raise errors.FailedPrecondition(f"server {state.index} writing {target}: {exc}") from None
    except (PeerError, PeerUnreachable) as exc:  # not UNAVAILABLE: this server is fine, a peer's read was not
        raise errors.FailedPrecondition(f"server {state.index} gathering rows for {target}: {exc}") from None
    finally:
        with _writing_lock:
            _writing.discard(target)
    return items, size, time.perf_counter() - t0, parts.as_dict()


def _write_item(stream, values: np.ndarray, parts: Parts, direct: int | None) -> dict:
    with parts.cpu("write"):
        written = snapshot_files.write_item(stream, values, direct)
    with parts.cpu("checksum"):
        written["sha256"] = snapshot_files.digest(values)
    return written


@contextlib.contextmanager
def _direct(stream):
    """A descriptor for the file's chunks to go to the disk past the page cache (``snapshot_files.open_direct``),
    or None; closed after."""
    fd = snapshot_files.open_direct(stream)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def _write(state, request, ranges, parts: Parts) -> tuple[list[dict], int]:
    chunk_bytes = request.chunk_bytes or CHUNK_BYTES
    delivery = _Delivery(state)
    items: list[dict] = []
    snapshot_files.makedirs(request.path)
    if snapshot_files.is_url(request.path) and snapshot_files.exists(request.path, request.file):
        raise FileExistsError(request.file)  # a store's "wb" would replace it (a local path is opened "xb")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ecrec-snapshot-gather") as gatherer, \
            ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="ecrec-snapshot-read") as pool, \
            snapshot_files.open_file(request.path, request.file, "wb" if snapshot_files.is_url(request.path) else "xb") \
            as stream, _direct(stream) as direct:
        for shard, start, stop in ranges:
            spec = shard.spec
            block = state.layout.num_servers * state.layout.k
            rows = max(1, chunk_bytes // spec.row_bytes)
            rows = rows // block * block or rows  # whole blocks: read as consecutive slots
            rows = min(rows, stop - start)
            # two chunks' arrays, reused: one gathered while the other is written (no new pages a chunk)
            chunks = [_chunk_buffers(spec, rows) for _ in range(min(2, -(-(stop - start) // rows)))]
            pending = gatherer.submit(_gather, state, shard, start, min(stop, start + rows), pool, request.cut,
                                      chunks[0], parts, delivery)
            for i, a in enumerate(range(start, stop, rows)):
                with parts.wall("waiting_for_rows"):
                    pending.result()
                b = min(stop, a + rows)
                if b < stop:  # the next chunk is gathered while this one is written
                    pending = gatherer.submit(_gather, state, shard, b, min(stop, b + rows), pool, request.cut,
                                              chunks[(i + 1) % 2], parts, delivery)
                for (buffer, _), part in zip(chunks[i % 2], ("weight", "state")):
                    values = buffer[:b - a]
                    items.append({"key": f"tables/{spec.name}/{part}", "offsets": [a, 0],
                                  "sizes": list(values.shape), "file": request.file,
                                  **_write_item(stream, values, parts, direct)})
            del chunks
        for name in request.dense:
            dense = state.dense(name)
            state.strategy.ensure_dense(dense)
            raw = dense.read_at(state.cuts.get(request.cut, "dense", name)) if request.cut else dense.read()[0]
            value = raw.view(np.float32)  # the payload bytes as its floats
            items.append({"key": f"dense/{name}/payload", "offsets": [0], "sizes": [len(value)],
                          "file": request.file, **_write_item(stream, value, parts, direct)})
        with parts.wall("sync"):
            snapshot_files.durable(stream)
        size = stream.tell()
    return items, size
