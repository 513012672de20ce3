"""A server's part of a snapshot: the rows of the id ranges it was given, gathered from their owners (its own
shard and its peers, in parallel), and the dense tensors it was given, written to its own ``.distcp`` file.

Every server writes at once, each its own file, so a snapshot is written at the servers' combined rate and no
client ever holds the model.  A range of ids is contiguous in the snapshot (DCP's chunks are hyper-rectangles)
but spread evenly over every server in the cluster (the layout rotates rows across servers), so each server
reads about ``(S-1)/S`` of its range from its peers (``ReadPayload``) while it writes the previous chunk.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ecrec import errors
from ecrec.snapshot import files as snapshot_files
from ecrec.net import transport
from ecrec.net.peers import PeerError, PeerUnreachable
from ecrec.wire import embedding_pb2

#: the default and largest item written (a chunk of rows' weights or state)
CHUNK_BYTES = 64 << 20
MAX_CHUNK_BYTES = 128 << 20
#: the largest ``ReadPayload`` reply asked of a peer
READ_BYTES = 4 << 20
#: reads in flight at once
READERS = 4


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
        shard = state.table(r.table)
        if not 0 <= r.start < r.stop <= shard.spec.num_rows:
            raise errors.InvalidRequest(f"table {r.table!r}: range [{r.start}, {r.stop}) outside its "
                                        f"{shard.spec.num_rows} rows")
        ranges.append((shard, r.start, r.stop))
    for name in request.dense:
        state.dense(name)
    return ranges


def _gather(state, shard, start: int, stop: int, pool: ThreadPoolExecutor, cut: str = "") -> np.ndarray:
    """The payload of rows ``start..stop-1`` in id order: this server's own from its shard, the rest from their
    owners (``ReadPayload`` messages of at most :data:`READ_BYTES`, several in flight: gRPC moves small
    messages several times faster than one large one).  A range of whole blocks (``S*k`` rows: every server
    holds ``k`` rows of each, in consecutive slots) is read as consecutive slots and placed by strided copies;
    any other range (a table's tail) row by row."""
    layout, spec = state.layout, shard.spec
    block = layout.num_servers * layout.k
    payload = np.empty((stop - start, spec.row_bytes), dtype=np.uint8)
    pieces = []  # (server, ids, where: row positions, or the first block of a run of whole blocks)
    if start % block == 0 and (stop - start) % block == 0 and stop <= spec.num_rows:
        by_block = payload.reshape(-1, block, spec.row_bytes)
        per = max(1, min(READ_BYTES // spec.row_bytes, state.config.max_ids_per_request) // layout.k)  # blocks a
        # message
        first = start // block
        for r in range(layout.num_servers):
            for b0 in range(0, len(by_block), per):
                b1 = min(len(by_block), b0 + per)
                slots = np.arange((first + b0) * layout.k, (first + b1) * layout.k, dtype=np.int64)
                pieces.append((r, layout.ids_of_slots(r, slots), b0))
    else:
        by_block = None
        ids = np.arange(start, stop, dtype=np.int64)
        owners, _ = layout.locate(ids)
        per = max(1, min(READ_BYTES // spec.row_bytes, state.config.max_ids_per_request))
        for r in np.unique(owners):
            where = np.flatnonzero(owners == r)
            for a in range(0, len(where), per):
                pieces.append((int(r), ids[where[a:a + per]], where[a:a + per]))

    def place(r: int, rows: np.ndarray, where) -> None:
        if by_block is None:
            payload[where] = rows
            return
        rows = rows.reshape(-1, layout.k, spec.row_bytes)
        target = by_block[where:where + len(rows)]
        for t in range(layout.k):  # slot t of a block holds the row at position ((r - t) % S) * k + t of it
            target[:, ((r - t) % layout.num_servers) * layout.k + t] = rows[:, t]

    def read(piece) -> None:
        r, ids, where = piece
        if r == state.index:
            slots = shard.slots_for(ids)
            state.strategy.ensure_rows([(shard, slots)])
            data = (shard.read_payload_bytes_at(slots, state.cuts.get(cut, "table", shard.name)) if cut
                    else shard.read_payload_bytes(slots))
        else:  # as it was at the snapshot's cut, when it has one
            data = state.peers.call(r, "ReadPayload", embedding_pb2.ReadPayloadRequest(
                table=shard.name, ids=transport.ids_to_bytes(ids), cut=cut)).payload
            if len(data) != len(ids) * spec.row_bytes:
                raise errors.Internal(f"server {r} answered {len(data)} bytes for {len(ids)} rows")
        place(r, np.frombuffer(data, dtype=np.uint8).reshape(len(ids), spec.row_bytes), where)

    for future in [pool.submit(read, piece) for piece in pieces]:
        future.result()
    return payload.view(np.float32)


def write(state, request) -> tuple[list[dict], int, float]:
    """Writes this server's part; returns its items (``key, offsets, sizes, file, offset, length, sha256``),
    the file's size and the seconds it took."""
    t0 = time.perf_counter()
    ranges = validate(state, request)
    target = snapshot_files.join(request.path, request.file)
    with _writing_lock:
        if target in _writing:
            raise errors.FailedPrecondition(f"server {state.index} is writing {target} already")
        _writing.add(target)
    try:
        items, size = _write(state, request, ranges)
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
    return items, size, time.perf_counter() - t0


def _write(state, request, ranges) -> tuple[list[dict], int]:
    chunk_bytes = request.chunk_bytes or CHUNK_BYTES
    items: list[dict] = []
    snapshot_files.makedirs(request.path)
    if snapshot_files.is_url(request.path) and snapshot_files.exists(request.path, request.file):
        raise FileExistsError(request.file)  # a store's "wb" would replace it (a local path is opened "xb")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ecrec-snapshot-gather") as gatherer, \
            ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="ecrec-snapshot-read") as pool, \
            snapshot_files.open_file(request.path, request.file, "wb" if snapshot_files.is_url(request.path) else "xb") \
            as stream:
        for shard, start, stop in ranges:
            spec = shard.spec
            block = state.layout.num_servers * state.layout.k
            rows = max(1, chunk_bytes // spec.row_bytes)
            rows = rows // block * block or rows  # whole blocks: read as consecutive slots
            pending = gatherer.submit(_gather, state, shard, start, min(stop, start + rows), pool, request.cut)
            for a in range(start, stop, rows):
                payload = pending.result()
                b = min(stop, a + rows)
                if b < stop:  # the next chunk is gathered while this one is written
                    pending = gatherer.submit(_gather, state, shard, b, min(stop, b + rows), pool, request.cut)
                parts = [("weight", slice(0, spec.dim))]
                if spec.row_floats > spec.dim:
                    parts.append(("state", slice(spec.dim, spec.row_floats)))
                for part, columns in parts:
                    values = payload[:, columns]
                    written = snapshot_files.write_tensor(stream, values)
                    items.append({"key": f"tables/{spec.name}/{part}", "offsets": [a, 0],
                                  "sizes": list(values.shape), "file": request.file, **written})
                del payload
        for name in request.dense:
            dense = state.dense(name)
            state.strategy.ensure_dense(dense)
            raw = dense.read_at(state.cuts.get(request.cut, "dense", name)) if request.cut else dense.read()[0]
            value = raw.view(np.float32)  # the payload bytes as its floats
            written = snapshot_files.write_tensor(stream, value)
            items.append({"key": f"dense/{name}/payload", "offsets": [0], "sizes": [len(value)],
                          "file": request.file, **written})
        snapshot_files.durable(stream)
        size = stream.tell()
    return items, size
