"""A server's part of a snapshot: the rows of the id ranges it was given, gathered from their owners (its own
shard and its peers, in parallel), and the dense tensors it was given, written to its own ``.distcp`` file.

Every server writes at once, each its own file, so a snapshot is written at the servers' combined rate and no
client ever holds the model.  A range of ids is contiguous in the snapshot (DCP's chunks are hyper-rectangles)
but spread evenly over every server in the cluster (the layout rotates rows across servers), so each server
reads about ``(S-1)/S`` of its range from its peers (``ReadPayload``) while it writes the previous chunk.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ecrec import errors, snapshot_files, transport
from ecrec.peers import PeerError, PeerUnreachable
from ecrec.wire import embedding_pb2

#: the default and largest item written (a chunk of rows' weights or state)
CHUNK_BYTES = 64 << 20
MAX_CHUNK_BYTES = 128 << 20


def validate(state, request) -> list:
    """Checks a ``WriteSnapshotRequest`` before anything is written; returns ``[(shard, start, stop)]``."""
    if not snapshot_files.DATA_FILE.match(request.file):
        raise errors.InvalidRequest(f"file {request.file!r}: a plain name ending in .distcp is expected")
    if not request.path:
        raise errors.InvalidRequest("no snapshot path")
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


def _gather(state, shard, ids: np.ndarray, pool: ThreadPoolExecutor) -> np.ndarray:
    """The payload of rows ``ids`` in that order: this server's own from its shard, the rest from their owners
    (one ``ReadPayload`` per owner, in parallel)."""
    owners, slots = state.layout.locate(ids)
    payload = np.empty((len(ids), shard.spec.row_bytes), dtype=np.uint8)

    def read_peer(owner: int, where: np.ndarray) -> None:
        reply = state.peers.call(owner, "ReadPayload", embedding_pb2.ReadPayloadRequest(
            table=shard.name, ids=transport.ids_to_bytes(ids[where])))
        if transport.bytes_to_ids(reply.ids).shape != (len(where),):
            raise errors.Internal(f"server {owner} answered {len(reply.ids) // 8} rows of {len(where)} asked")
        payload[where] = np.frombuffer(reply.payload, dtype=np.uint8).reshape(len(where), shard.spec.row_bytes)

    futures = [pool.submit(read_peer, int(owner), np.flatnonzero(owners == owner))
               for owner in np.unique(owners) if owner != state.index]
    mine = np.flatnonzero(owners == state.index)
    if len(mine):
        state.strategy.ensure_rows([(shard, slots[mine])])
        payload[mine] = shard.read_payload(slots[mine])
    for future in futures:
        future.result()
    return payload.view(np.float32)


def write(state, request) -> tuple[list[dict], int, float]:
    """Writes this server's part; returns its items (``key, offsets, sizes, file, offset, length, sha256``),
    the file's size and the seconds it took."""
    t0 = time.perf_counter()
    ranges = validate(state, request)
    try:
        items, size = _write(state, request, ranges)
    except OSError as exc:
        raise errors.FailedPrecondition(f"server {state.index} writing "
                                        f"{snapshot_files.join(request.path, request.file)}: {exc}") from None
    except (PeerError, PeerUnreachable) as exc:
        raise errors.Unavailable(f"server {state.index} gathering rows for a snapshot: {exc}") from None
    return items, size, time.perf_counter() - t0


def _write(state, request, ranges) -> tuple[list[dict], int]:
    chunk_bytes = request.chunk_bytes or CHUNK_BYTES
    items: list[dict] = []
    snapshot_files.makedirs(request.path)
    with ThreadPoolExecutor(max_workers=state.layout.num_servers + 1, thread_name_prefix="ecrec-snapshot") as pool, \
            snapshot_files.open_file(request.path, request.file, "wb") as stream:
        for shard, start, stop in ranges:
            spec = shard.spec
            rows = max(1, chunk_bytes // spec.row_bytes)
            pending = pool.submit(_gather, state, shard, np.arange(start, min(stop, start + rows), dtype=np.int64),
                                  pool)
            for a in range(start, stop, rows):
                payload = pending.result()
                b = min(stop, a + rows)
                if b < stop:  # the next chunk is gathered while this one is written
                    pending = pool.submit(_gather, state, shard, np.arange(b, min(stop, b + rows), dtype=np.int64),
                                          pool)
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
            value = dense.read()[0].view(np.float32)  # the payload bytes as its floats
            written = snapshot_files.write_tensor(stream, value)
            items.append({"key": f"dense/{name}/payload", "offsets": [0], "sizes": [len(value)],
                          "file": request.file, **written})
        snapshot_files.durable(stream)
        size = stream.tell()
    return items, size
