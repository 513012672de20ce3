"""The fast rebuild path: a replacement's rows rebuilt block by block from streams of every survivor.

Placement is block-periodic (``ecrec.layout``): in block ``b`` (stripes ``b*S .. b*S+S-1``) every server
holds data slots ``b*k .. b*k+k-1`` and parity slots ``b*m .. b*m+m-1``, and which member of which of the
replacement's stripes a survivor holds at each of those positions is the same in every block.  So the
replacement asks each survivor once per *round* of blocks for the positions it needs
(``ParityService.StreamStripes``: one request, the rows streamed several blocks per message, all
survivors at once, the next round fetched while this one is decoded), then per position:

- a data row ``t``: the stripe's other ``k - 1`` data rows and its parity 0, decoded as one linear
  combination over whole arrays (``Codec.combine`` with ``Codec.data_decode_coefficients``: ISA-L, no
  per-row Python), installed with one array write;
- a parity row ``j``: the stripe's ``k`` data rows, encoded the same way with the code's coefficients.

Every survivor sends each position's rows as one contiguous run (position-major), so the decoder works on
the received arrays without gathering them.

Only rows whose members were all read ready, and whose versions agree (the parity's version vector equals
the data rows' versions: no delta in flight), are installed; everything else (a member on a failed or
rebuilding server, a delta in flight, an unresolved source) is left not ready for the row-by-row path of
``rebuild.py``, which also decides what is lost.  So this path only ever speeds up the rebuild: every row
it installs is exactly what the row-by-row path would have installed.

:func:`read_blocks` is the survivor's side (the reply of ``StreamStripes``); :func:`position_plan` is the
choice of positions, a pure function of the layout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np

from ecrec import errors, transport
from ecrec.codec import Codec
from ecrec.layout import Layout
from ecrec.peers import PARITY
from ecrec.shards import TableShard
from ecrec.strategies.base import StrategyHost
from ecrec.strategies.erasure.parity_store import ParityArena, TableParity
from ecrec.strategies.erasure.receiver import ParityReceiver
from ecrec.wire import parity_pb2

log = logging.getLogger("ecrec.strategies.erasure")

#: bytes per StripeChunk message when the caller does not choose
MESSAGE_BYTES = 4 << 20
#: a stream that stalls this long is given up (its rows go to the row-by-row path)
STREAM_TIMEOUT_S = 60.0


# --- which positions, from which server ------------------------------------------------------------------------
@dataclass(frozen=True)
class PositionPlan:
    """What the replacement at ``index`` reads from each survivor, and where each of its members is.

    ``data[server]`` / ``parity[server]``: the data positions and parity indices to ask ``server`` for (the
    same in every block).  ``data_source[t]``: for the replacement's data row at position ``t``, the
    ``(server, column)`` of each other data member ``t'`` (``{t': ...}``) and of its parity 0;
    ``parity_source[j]``: for its parity row ``j``, the ``(server, column)`` of each data member."""

    data: dict[int, list[int]]
    parity: dict[int, list[int]]
    data_source: dict[int, tuple[dict[int, tuple[int, int]], tuple[int, int]]]
    parity_source: dict[int, dict[int, tuple[int, int]]]


def position_plan(layout: Layout, index: int) -> PositionPlan:
    """The positions the replacement of ``index`` needs from every other server (see :class:`PositionPlan`)."""
    S, k, m = layout.num_servers, layout.k, layout.m
    data: dict[int, list[int]] = {}
    parity: dict[int, list[int]] = {}

    def column(table: dict[int, list[int]], server: int, position: int) -> tuple[int, int]:
        cols = table.setdefault(server, [])
        if position not in cols:
            cols.append(position)
        return server, cols.index(position)

    data_source = {}
    for t in range(k):  # the replacement's data row t of stripe s: s = b*S + (index - t) % S
        others = {u: column(data, (index - t + u) % S, u) for u in range(k) if u != t}
        data_source[t] = (others, column(parity, (index - t + k) % S, 0))
    parity_source = {}
    for j in range(m):  # its parity row j of stripe s: s = b*S + (index - k - j) % S
        parity_source[j] = {u: column(data, (index - k - j + u) % S, u) for u in range(k)}
    return PositionPlan(data, parity, data_source, parity_source)


# --- the survivor's side -----------------------------------------------------------------------------------------
def check_request(layout: Layout, num_rows: int, request: parity_pb2.StreamStripesRequest) -> None:
    blocks = -(-layout.num_stripes(num_rows) // layout.num_servers)
    if not 0 <= request.first_block < request.end_block <= blocks:
        raise errors.InvalidRequest(f"table {request.table!r}: blocks [{request.first_block}, {request.end_block}) "
                                    f"out of range [0, {blocks})")
    if any(t >= layout.k for t in request.data_positions) or any(j >= layout.m for j in request.parity_indices):
        raise errors.InvalidRequest(f"data positions must be < k={layout.k} and parity indices < m={layout.m}")
    if request.blocks_per_message < 0:
        raise errors.InvalidRequest("blocks_per_message must be >= 0")


def read_blocks(host: StrategyHost, receiver: ParityReceiver, request: parity_pb2.StreamStripesRequest
                ) -> Iterator[parity_pb2.StripeChunk]:
    """This server's rows of ``request`` as messages of several blocks (validated by :func:`check_request`).
    Ready flags mean what they mean for ``ReadRows``: a parity row touched by an unresolved failed owner is
    not ready."""
    layout = host.layout
    k, m, S = layout.k, layout.m, layout.num_servers
    shard = host.table(request.table)
    arena, part = receiver.part(request.table)
    positions = np.array(request.data_positions, dtype=np.int64)
    pidx = np.array(request.parity_indices, dtype=np.int64)
    per_block = (len(positions) + len(pidx)) * shard.spec.row_bytes
    step = request.blocks_per_message or max(1, MESSAGE_BYTES // max(per_block, 1))
    num_stripes = layout.num_stripes(shard.spec.num_rows)
    for b0 in range(request.first_block, request.end_block, step):
        b1 = min(request.end_block, b0 + step)
        blocks = np.arange(b0, b1, dtype=np.int64)
        chunk = parity_pb2.StripeChunk(first_block=b0, blocks=b1 - b0)
        if len(positions):  # position-major: each position's rows are one contiguous run at the other end
            runs = [shard.read_bytes(int(t) + blocks * k) for t in positions]  # each evenly spaced: one copy
            chunk.data = runs[0][0] if len(runs) == 1 else b"".join(r[0] for r in runs)
            chunk.data_versions = transport.ids_to_bytes(np.concatenate([r[1] for r in runs]))
            chunk.data_ready = np.concatenate([r[2] for r in runs]).astype(np.uint8).tobytes()
        if len(pidx):
            stripes = (blocks[None, :] * S + (host.index - k - pidx[:, None]) % S).reshape(-1)
            exists = stripes < num_stripes
            local = (pidx[:, None] + blocks[None, :] * m).reshape(-1)
            slots = part.arena_slots(local)
            payload, versions, ready = arena.read(slots)
            ready &= exists
            suspects = receiver.suspect_sources()
            if suspects:
                ready &= ~np.isin(slots, receiver.unresolved_slots(arena, suspects))
            chunk.parity = payload.tobytes()
            chunk.parity_versions = transport.ids_to_bytes(versions.reshape(-1))
            chunk.parity_ready = ready.astype(np.uint8).tobytes()
        yield chunk


# --- the replacement's side --------------------------------------------------------------------------------------
@dataclass
class Members:
    """One survivor's rows for a round of ``blocks`` blocks (``None`` arrays: it did not answer)."""

    data: np.ndarray | None = None  # (positions, blocks, row_bytes) uint8: each position's rows contiguous
    data_versions: np.ndarray | None = None  # (positions, blocks) int64
    data_ready: np.ndarray | None = None  # (positions, blocks) bool
    parity: np.ndarray | None = None  # (indices, blocks, row_bytes)
    parity_versions: np.ndarray | None = None  # (indices, blocks, k)
    parity_ready: np.ndarray | None = None  # (indices, blocks)


class BulkRebuild:
    """The fast path of one replacement (see the module docstring): :meth:`fetch` a round of blocks from every
    survivor, then :meth:`rebuild_round` installs what they allow."""

    def __init__(self, host: StrategyHost, codec: Codec, receiver: ParityReceiver, counters):
        self.host = host
        self.codec = codec
        self.receiver = receiver
        self.counters = counters
        self.plan = position_plan(host.layout, host.index)
        self.decode = {t: codec.data_decode_coefficients(t, 0) for t in range(host.layout.k)}
        self._pool = ThreadPoolExecutor(max_workers=max(2, host.layout.num_servers), thread_name_prefix="ecrec-bulk")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- reading -----------------------------------------------------------------------------------------------
    def _stream(self, server: int, spec, b0: int, b1: int) -> Members | None:
        """One survivor's rows of blocks ``[b0, b1)``, or None when it is not live or the stream failed."""
        layout, peers = self.host.layout, self.host.peers
        positions, indices = self.plan.data.get(server, []), self.plan.parity.get(server, [])
        address = peers.address_of(server)
        if address is None:
            return None
        n, rb, k = b1 - b0, spec.row_bytes, layout.k
        p, j = len(positions), len(indices)
        out = Members(np.empty((p, n, rb), np.uint8), np.empty((p, n), np.int64), np.zeros((p, n), bool),
                      np.empty((j, n, rb), np.uint8), np.empty((j, n, k), np.int64), np.zeros((j, n), bool))
        request = parity_pb2.StreamStripesRequest(table=spec.name, first_block=b0, end_block=b1,
                                                  data_positions=positions, parity_indices=indices)
        try:
            stream = peers.stub(address, PARITY).StreamStripes(request, timeout=STREAM_TIMEOUT_S,
                                                               metadata=peers.metadata())
            for chunk in stream:
                lo, hi = chunk.first_block - b0, chunk.first_block - b0 + chunk.blocks
                if p:
                    out.data[:, lo:hi] = np.frombuffer(chunk.data, np.uint8).reshape(p, hi - lo, rb)
                    out.data_versions[:, lo:hi] = transport.bytes_to_ids(chunk.data_versions).reshape(p, hi - lo)
                    out.data_ready[:, lo:hi] = np.frombuffer(chunk.data_ready, np.uint8).reshape(p, hi - lo) != 0
                if j:
                    out.parity[:, lo:hi] = np.frombuffer(chunk.parity, np.uint8).reshape(j, hi - lo, rb)
                    out.parity_versions[:, lo:hi] = transport.bytes_to_ids(chunk.parity_versions).reshape(
                        j, hi - lo, k)
                    out.parity_ready[:, lo:hi] = np.frombuffer(chunk.parity_ready, np.uint8).reshape(j, hi - lo) != 0
        except grpc.RpcError as exc:  # the rows stay not ready: the row-by-row path retries them
            log.info("fast rebuild: server %d stream of %r blocks %d..%d failed (%s); those rows go row by row",
                     server, spec.name, b0, b1, exc.code().name)
            if transport.is_unavailable(exc):
                peers.report(address, f"StreamStripes: {exc.code().name}")
            return None
        self.counters["bulk_bytes_read"] += out.data.nbytes + out.parity.nbytes
        return out

    def fetch(self, spec, b0: int, b1: int):
        """Starts reading blocks ``[b0, b1)`` from every survivor at once; returns a future of
        ``{server: Members | None}``."""
        servers = sorted(set(self.plan.data) | set(self.plan.parity))
        futures = {s: self._pool.submit(self._stream, s, spec, b0, b1) for s in servers}
        return _Gathered(futures)

    # --- decoding and installing ---------------------------------------------------------------------------------
    def rebuild_round(self, shard: TableShard, arena: ParityArena, part: TableParity, b0: int, b1: int,
                      read: dict[int, Members | None]) -> tuple[int, int]:
        """Installs the rows of blocks ``[b0, b1)`` that the round's reads allow; returns ``(data rows, parity
        rows)`` installed."""
        layout = self.host.layout
        k, m, S, index = layout.k, layout.m, layout.num_servers, self.host.index
        blocks = np.arange(b0, b1, dtype=np.int64)
        num_rows = shard.spec.num_rows
        data_rows = parity_rows = 0
        for t, (others, (pserver, pcol)) in self.plan.data_source.items():
            slots = blocks * k + t
            ids = (blocks * S + (index - t) % S) * k + t
            src = read.get(pserver)
            if src is None or any(read.get(s) is None for s, _ in others.values()):
                continue
            pv = src.parity_versions[pcol]  # (n, k): the parity's version of every data member
            ok = (ids < num_rows) & src.parity_ready[pcol]
            for u, (server, col) in others.items():
                ok &= read[server].data_ready[col] & (read[server].data_versions[col] == pv[:, u])
            ok &= ~shard.is_ready(slots)  # rebuilt on demand meanwhile: skip (install re-checks under the lock)
            members = {u: read[server].data[col] for u, (server, col) in others.items()}
            members[k] = src.parity[pcol]
            selected = int(ok.sum())
            if not selected:
                continue
            if 2 * selected >= len(ok):  # mostly: decode every row, install the selected ones through a mask
                payload = self.codec.combine([(a, members[u]) for u, a in self.decode[t].items()])
                data_rows += shard.install(slots, payload, pv[:, t], mask=ok)
                continue
            rows = np.flatnonzero(ok)
            payload = self.codec.combine([(a, members[u][rows]) for u, a in self.decode[t].items()])
            data_rows += shard.install(slots[rows], payload, pv[rows, t])
        suspects = self.receiver.suspect_sources()
        unresolved = self.receiver.unresolved_slots(arena, suspects) if suspects else None
        num_stripes = layout.num_stripes(num_rows)
        for j, members in self.plan.parity_source.items():
            if any(read.get(s) is None for s, _ in members.values()):
                continue
            stripes = blocks * S + (index - k - j) % S
            slots = part.arena_slots(blocks * m + j)
            ok = (stripes < num_stripes) & ~arena.is_built(slots)
            for server, col in members.values():
                ok &= read[server].data_ready[col]
            if unresolved is not None:
                ok &= ~np.isin(slots, unresolved)
            rows = _selection(ok)
            if rows is None:
                continue
            coefficients = self.codec.coefficients[j]
            encoded = self.codec.combine([(coefficients[u], read[server].data[col][rows])
                                          for u, (server, col) in members.items()])
            versions = np.stack([read[server].data_versions[col][rows] for _, (server, col) in
                                 sorted(members.items())], axis=1)
            parity_rows += arena.build(slots[rows], encoded, versions)
        return data_rows, parity_rows


def _selection(ok: np.ndarray):
    """An index for the rows marked ``ok``: a slice when all are (no copy), None when none are."""
    if ok.all():
        return slice(None)
    rows = np.flatnonzero(ok)
    return rows if len(rows) else None


class _Gathered:
    def __init__(self, futures):
        self.futures = futures

    def result(self) -> dict[int, Members | None]:
        return {s: f.result() for s, f in self.futures.items()}
