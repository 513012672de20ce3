"""The fast rebuild path: a replacement's rows rebuilt block by block from streams of every survivor.

Placement is block-periodic (``ecrec.coding.layout``): in block ``b`` (stripes ``b*S .. b*S+S-1``) every server
holds data slots ``b*k .. b*k+k-1`` and parity slots ``b*m .. b*m+m-1``, and which member of which of the
replacement's stripes a survivor holds at each of those positions is the same in every block.  So the
replacement asks each survivor once per *round* of blocks for the positions it needs
(``ParityService.StreamStripes``: one request, the rows sent as frames of several blocks, the same blocks
per frame from every survivor (:mod:`~ecrec.strategies.erasure.frames`), over a direct connection
(:mod:`~ecrec.strategies.erasure.frame_socket`) or the reply stream, all survivors at once, the next round
fetched while this one is decoded), then, frame by frame, per position:

- a data row ``t``: the stripe's other ``k - 1`` data rows and its parity 0, decoded as one linear
  combination over whole arrays (``Codec.combine`` with ``Codec.data_decode_coefficients``: ISA-L, no
  per-row Python), installed with one array write;
- a parity row ``j``: the stripe's ``k`` data rows, encoded the same way with the code's coefficients.

Every survivor sends each position's rows as one contiguous run (position-major), so the decoder works on
the received buffers without gathering or copying them.

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
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np

from ecrec import errors
from ecrec.net import transport
from ecrec.net.cluster_map import live_servers
from ecrec.net.peers import PARITY
from ecrec.coding.codec import Codec
from ecrec.coding.layout import Layout
from ecrec.tables.shards import TableShard
from ecrec.strategies.base import StrategyHost
from ecrec.strategies.erasure import frame_socket, frames
from ecrec.strategies.erasure.options import MAX_FRAME_BYTES, ErasureOptions
from ecrec.strategies.erasure.parity_store import ParityArena, TableParity
from ecrec.strategies.erasure.receiver import ParityReceiver
from ecrec.strategies.erasure.resolution import embeddable
from ecrec.wire import parity_pb2

log = logging.getLogger("ecrec.strategies.erasure")

#: bytes per frame when the caller does not choose (the replacement asks for ``rebuild_frame_bytes``)
FRAME_BYTES = ErasureOptions.rebuild_frame_bytes
#: a stream that stalls this long is given up (its rows go to the row-by-row path)
STREAM_TIMEOUT_S = 60.0


def lower_priority(nice: int) -> None:
    """Lowers the calling thread's OS scheduling priority by ``nice`` (on Linux a thread is its own task, so
    only this thread); where that is not possible, nothing.  Not undone: call it on threads of background
    work only (an unprivileged process cannot raise a priority again)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:
        log.debug("cannot lower the rebuild's priority: %s", exc)


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
def check_request(layout: Layout, spec, request: parity_pb2.StreamStripesRequest) -> None:
    blocks = -(-layout.num_stripes(spec.num_rows) // layout.num_servers)
    if not 0 <= request.first_block < request.end_block <= blocks:
        raise errors.InvalidRequest(f"table {request.table!r}: blocks [{request.first_block}, {request.end_block}) "
                                    f"out of range [0, {blocks})")
    if any(t >= layout.k for t in request.data_positions) or any(j >= layout.m for j in request.parity_indices):
        raise errors.InvalidRequest(f"data positions must be < k={layout.k} and parity indices < m={layout.m}")
    if len(set(request.data_positions)) != len(request.data_positions) or \
            len(set(request.parity_indices)) != len(request.parity_indices):
        raise errors.InvalidRequest("data positions and parity indices must not repeat")
    if request.blocks_per_message < 0:
        raise errors.InvalidRequest("blocks_per_message must be >= 0")
    if request.deliver_port and not (1024 <= request.deliver_port <= 65535
                                     and len(request.ticket) == frame_socket.TICKET_BYTES):
        raise errors.InvalidRequest(f"deliver_port must be a port in [1024, 65535] (got {request.deliver_port}) with a "
                                    f"ticket of {frame_socket.TICKET_BYTES} bytes (got {len(request.ticket)})")
    step = frame_step(spec, layout, request)
    size = frames.frame_bytes(step, len(request.data_positions), len(request.parity_indices), spec.row_bytes, layout.k)
    if size > MAX_FRAME_BYTES:
        raise errors.InvalidRequest(f"blocks_per_message={request.blocks_per_message} makes frames of {size} bytes, "
                                    f"more than {MAX_FRAME_BYTES}")


def blocks_per_frame(spec, layout: Layout, positions: int, indices: int, frame_bytes: int = FRAME_BYTES) -> int:
    """Blocks per frame of about ``frame_bytes`` for these positions and indices (at least one)."""
    per_block = frames.block_bytes(positions, indices, spec.row_bytes, layout.k)
    return max(1, frame_bytes // max(per_block, 1))


def frame_step(spec, layout: Layout, request: parity_pb2.StreamStripesRequest) -> int:
    """The blocks per frame a survivor sends for ``request`` (its ``blocks_per_message``, else the default)."""
    return request.blocks_per_message or blocks_per_frame(spec, layout, len(request.data_positions),
                                                          len(request.parity_indices))


def read_blocks(host: StrategyHost, receiver: ParityReceiver, request: parity_pb2.StreamStripesRequest,
                settle=None, bound=None) -> Iterator[np.ndarray]:
    """This server's rows of ``request`` as frame buffers (:mod:`~ecrec.strategies.erasure.frames`) of
    ``blocks_per_message`` blocks (validated by :func:`check_request`), each row copied once into its frame.
    Ready flags mean what they mean for ``ReadRows``: a parity row touched by an unresolved failed owner is
    not ready.  ``settle(shard, reads)`` runs after each frame's data rows are copied (the owner's
    :meth:`~ecrec.strategies.erasure.owner.ParityOwner.settle_rows`: the rows as they were at the last closed
    group); ``bound(versions)``, after it, gives the frame's confirmed bound (no data positions: 0)."""
    layout = host.layout
    k, m, S = layout.k, layout.m, layout.num_servers
    shard = host.table(request.table)
    arena, part = receiver.part(request.table)
    positions = [int(t) for t in request.data_positions]
    pidx = np.array(request.parity_indices, dtype=np.int64)
    step = frame_step(shard.spec, layout, request)
    num_stripes = layout.num_stripes(shard.spec.num_rows)
    counters = receiver.counters  # this stream's CPU by part: gathering rows, and sealing them -- settled at the last
    # closed group, their confirmed bound read (``stream_seal_cpu_s``) -- not the send
    for b0 in range(request.first_block, request.end_block, step):
        b1 = min(request.end_block, b0 + step)
        with counters.cpu("stream_read_cpu_s"):
            blocks = np.arange(b0, b1, dtype=np.int64)
            buffer, frame = frames.allocate(b0, b1 - b0, len(positions), len(pidx), shard.spec.row_bytes, k)
            reads = []
            for c, t in enumerate(positions):  # each position's rows evenly spaced here, one contiguous run there
                slots = t + blocks * k
                rewrites = shard.read_into(slots, frame.data[c], frame.data_versions[c], frame.data_ready[c])
                reads.append((slots, frame.data[c], frame.data_versions[c], frame.data_ready[c], rewrites))
        if positions and settle is not None:
            with counters.cpu("stream_seal_cpu_s"):
                settle(shard, reads)
        if positions and bound is not None:
            with counters.cpu("stream_seal_cpu_s"):
                frames.set_confirmed(buffer, bound(frame.data_versions))
        with counters.cpu("stream_read_cpu_s"):
            suspects = receiver.suspect_sources() if len(pidx) else None
            unresolved = receiver.unresolved_slots(arena, suspects) if suspects else None
            for c, j in enumerate(pidx):
                slots = part.arena_slots(j + blocks * m)
                arena.read_into(slots, frame.parity[c], frame.parity_versions[c], frame.parity_ready[c])
                stripes = blocks * S + (host.index - k - j) % S
                ready = frame.parity_ready[c]
                ready[stripes >= num_stripes] = 0
                if unresolved is not None:
                    ready[np.isin(slots, unresolved)] = 0
        counters.add("stream_bytes", len(buffer))
        yield buffer


# --- the replacement's side --------------------------------------------------------------------------------------
class BulkRebuild:
    """The fast path of one replacement (see the module docstring): :meth:`fetch` a round of blocks from every
    survivor, then :meth:`rebuild_round` installs what they allow."""

    def __init__(self, host: StrategyHost, codec: Codec, receiver: ParityReceiver, counters,
                 frame_bytes: int = FRAME_BYTES, transport_name: str = "socket", nice: int = 0):
        self.host = host
        self.frame_bytes = frame_bytes
        tls = host.peers.security is not None and host.peers.security.tls
        self.transport = "grpc" if tls else transport_name  # rows never in clear on a TLS cluster
        self.codec = codec
        self.receiver = receiver
        self.counters = counters
        self.plan = position_plan(host.layout, host.index)
        self.survivors = sorted(set(self.plan.data) | set(self.plan.parity))  # every server this one reads from
        self.decode = {t: codec.data_decode_coefficients(t, 0) for t in range(host.layout.k)}
        self._counters_lock = threading.Lock()  # the streams of a round count from several threads
        self._pool = ThreadPoolExecutor(max_workers=max(2, host.layout.num_servers), thread_name_prefix="ecrec-bulk",
                                        initializer=lower_priority, initargs=(nice,))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def frame_blocks(self, spec) -> int:
        """Blocks per frame, the same from every survivor (so that frame ``i`` of each covers the same
        blocks): about ``frame_bytes`` from the survivor sending the most per block."""
        return min(blocks_per_frame(spec, self.host.layout, len(self.plan.data.get(s, [])),
                                    len(self.plan.parity.get(s, [])), self.frame_bytes) for s in self.survivors)

    # --- reading -----------------------------------------------------------------------------------------------
    def _stream(self, server: int, spec, b0: int, b1: int) -> list[frames.Frame] | None:
        """One survivor's frames of blocks ``[b0, b1)``, or None when it is not live or the stream failed."""
        peers = self.host.peers
        address = peers.address_of(server)
        if address is None:
            return None
        step = self.frame_blocks(spec)
        request = parity_pb2.StreamStripesRequest(table=spec.name, first_block=b0, end_block=b1,
                                                  data_positions=self.plan.data.get(server, []),
                                                  parity_indices=self.plan.parity.get(server, []),
                                                  blocks_per_message=step)
        expect = _Expected(spec, self.host.layout.k, request)
        try:
            with self.counters.cpu("bulk_receive_cpu_s"):  # this stream's thread receiving its frames
                received = self._over_socket(address, request, expect) if self.transport == "socket" else None
                over_socket = received is not None
                if received is None:
                    received = self._over_grpc(address, request, expect)
            expect.check(received)
        except grpc.RpcError as exc:  # the rows stay not ready: the row-by-row path retries them
            log.info("fast rebuild: server %d stream of %r blocks %d..%d failed (%s); those rows go row by row",
                     server, spec.name, b0, b1, exc.code().name)
            if transport.is_unavailable(exc):
                peers.report(address, f"StreamStripes: {exc.code().name}")
            return None
        except frames.FrameError as exc:
            log.warning("fast rebuild: server %d sent a bad frame of %r (%s); its rows of blocks %d..%d go row by "
                        "row", server, spec.name, exc, b0, b1)
            return None
        read = sum(expect.bytes_per_block * f.blocks for f in received)
        with self._counters_lock:
            self.counters.add("bulk_bytes_read", read)
            self.counters.add("bulk_bytes_over_socket", read if over_socket else 0)
        return received

    def _call(self, address: str):
        return self.host.peers.channel(address).unary_stream(  # no response deserializer: frames as received
            frames.FULL_METHOD, request_serializer=parity_pb2.StreamStripesRequest.SerializeToString)

    def _over_grpc(self, address: str, request, expect: "_Expected") -> list[frames.Frame]:
        stream = self._call(address)(request, timeout=STREAM_TIMEOUT_S, metadata=self.host.peers.metadata())
        received = []
        for raw in stream:
            if len(received) == expect.count:
                stream.cancel()
                raise frames.FrameError(f"more than the {expect.count} frames due")
            received.append(expect.parse(raw))
        return received

    def _over_socket(self, address: str, request, expect: "_Expected") -> list[frames.Frame] | None:
        """The frames over a connection the survivor opens to this server (:mod:`~ecrec.strategies.erasure.
        frame_socket`); None when that is not possible here (then this rebuild uses the gRPC stream)."""
        try:
            listener = frame_socket.FrameListener(self.host.config.host, STREAM_TIMEOUT_S)
        except OSError as exc:
            return self._socket_refused(f"cannot listen on {self.host.config.host}: {exc!r}")
        with listener:
            asked = parity_pb2.StreamStripesRequest()  # a copy: a fallback sends ``request`` as it came
            asked.CopyFrom(request)
            asked.deliver_port, asked.ticket = listener.port, listener.ticket
            stream = self._call(address)(asked, timeout=STREAM_TIMEOUT_S, metadata=self.host.peers.metadata())
            # a call that fails (delivery refused or impossible) stops the wait for its connection at once
            stream.add_done_callback(lambda call: call.code() == grpc.StatusCode.OK or listener.close())
            try:
                received = listener.receive(expect.count, expect.positions, expect.indices, expect.row_bytes,
                                            expect.k, expect.max_frame_bytes)
            except (OSError, frames.FrameError) as exc:
                stream.cancel()
                code = stream.code()
                if code is not None and code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED,
                                                     grpc.StatusCode.FAILED_PRECONDITION):
                    raise stream from exc  # the survivor failed (unavailable, fenced, ...): as on the gRPC path
                detail = stream.details() if code == grpc.StatusCode.FAILED_PRECONDITION else repr(exc)
                return self._socket_refused(detail)
            for _ in stream:  # ends OK once the survivor sent every frame
                raise frames.FrameError("a frame on the reply stream although delivery over a connection was asked")
        return received

    def _socket_refused(self, detail: str) -> None:
        log.warning("fast rebuild: frames over a direct connection failed (%s); this rebuild uses the gRPC "
                    "stream (option rebuild_transport=grpc chooses it from the start)", detail)
        self.transport = "grpc"
        return None

    def fetch(self, spec, b0: int, b1: int):
        """Starts reading blocks ``[b0, b1)`` from every survivor at once; returns a future of
        ``{server: [frame, ...] | None}`` (every survivor's frame ``i`` covers the same blocks)."""
        live = live_servers(self.host.cluster_map)
        # before anything is read: the rows a parity embeds must not be of an owner resolved since (adopt_locked)
        generations = {s: self.receiver.generation(s) for s in self.survivors}
        sids = {s: live[s].server_id if s in live else "" for s in self.survivors}
        futures = {s: self._pool.submit(self._stream, s, spec, b0, b1) for s in self.survivors}
        return _Gathered(futures, generations, sids)

    # --- decoding and installing ---------------------------------------------------------------------------------
    def rebuild_round(self, shard: TableShard, arena: ParityArena, part: TableParity,
                      read: dict[int, list[frames.Frame] | None]) -> tuple[int, int]:
        """Installs the rows of a round that its frames allow, frame by frame, decoding straight from the
        received buffers; returns ``(data rows, parity rows)`` installed."""
        received = [frames_of for frames_of in read.values() if frames_of is not None]
        data_rows = parity_rows = 0
        # the round's CPU (bulk_round_cpu_s), of it decoding and installing (_rebuild_blocks): the rest is checks
        with self.counters.cpu("bulk_round_cpu_s"):
            owners = self._owners(read) if received else {}
            for i in range(len(received[0]) if received else 0):
                group = {s: (frames_of[i] if frames_of is not None else None) for s, frames_of in read.items()}
                first = received[0][i]
                d, p = self._rebuild_blocks(shard, arena, part, first.first_block, first.first_block + first.blocks,
                                            group, owners, read)
                data_rows, parity_rows = data_rows + d, parity_rows + p
        return data_rows, parity_rows

    def _owners(self, read: "RoundRead") -> dict[int, tuple]:
        """Asks every survivor whose data rows a parity may embed this round for its confirmed bound and committed
        push ids (after its frames: they cover every version within the frames' bounds); returns, per survivor
        that answered as the incarnation its frames came from, ``(server id, bound, committed)``."""
        sources = sorted({server for members in self.plan.parity_source.values() for server, _ in members.values()
                          if read.get(server) is not None})
        calls = [(server, "ReadRows", parity_pb2.ReadRowsRequest(confirmed=True)) for server in sources]
        out = {}
        for server, reply in zip(sources, self.host.peers.call_many(calls, PARITY) if calls else []):
            if reply is not None and reply.server_id and reply.server_id == read.sids.get(server):
                out[server] = (reply.server_id, reply.confirmed_upto, [(c.worker, c.sequence) for c in reply.committed])
        return out

    def _rebuild_blocks(self, shard: TableShard, arena: ParityArena, part: TableParity, b0: int, b1: int,
                        read: dict[int, frames.Frame | None], owners: dict[int, tuple], round_read: "RoundRead"
                        ) -> tuple[int, int]:
        """Installs the rows of blocks ``[b0, b1)`` that one frame of each survivor allows (a parity row only from
        data rows a resolution of their owners keeps or can undo here: ``owners`` from :meth:`_owners`)."""
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
                with self.counters.cpu("bulk_decode_cpu_s"):
                    payload = self.codec.combine([(a, members[u]) for u, a in self.decode[t].items()])
                with self.counters.cpu("bulk_install_cpu_s"):
                    data_rows += shard.install(slots, payload, pv[:, t], mask=ok)
                continue
            rows = np.flatnonzero(ok)
            with self.counters.cpu("bulk_decode_cpu_s"):  # the rows' selection too
                payload = self.codec.combine([(a, members[u][rows]) for u, a in self.decode[t].items()])
            with self.counters.cpu("bulk_install_cpu_s"):
                data_rows += shard.install(slots[rows], payload, pv[rows, t])
        suspects = self.receiver.suspect_sources()
        unresolved = self.receiver.unresolved_slots(arena, suspects) if suspects else None
        num_stripes = layout.num_stripes(num_rows)
        for j, members in self.plan.parity_source.items():
            if any(read.get(s) is None or s not in owners for s, _ in members.values()):
                continue
            stripes = blocks * S + (index - k - j) % S
            slots = part.arena_slots(blocks * m + j)
            ok = (stripes < num_stripes) & ~arena.is_built(slots)
            for server, col in members.values():
                ok &= read[server].data_ready[col]
                # only versions a resolution keeps or can undo here (row by row later for the others: the owner
                # delivers their batches)
                limit = max(read[server].confirmed_upto, self.receiver.logged_upto(server, owners[server][0]))
                ok &= embeddable(read[server].data_versions[col], limit)
            if unresolved is not None:
                ok &= ~np.isin(slots, unresolved)
            rows = _selection(ok)
            if rows is None:
                continue
            coefficients = self.codec.coefficients[j]
            with self.counters.cpu("bulk_decode_cpu_s"):  # the rows' selection too
                encoded = self.codec.combine([(coefficients[u], read[server].data[col][rows])
                                              for u, (server, col) in members.items()])
            versions = np.stack([read[server].data_versions[col][rows] for _, (server, col) in
                                 sorted(members.items())], axis=1)
            with self.receiver.lock:  # bounds and ids kept, rows built, with no resolution of an owner between
                if not all(self.receiver.adopt_locked(server, *owners[server], round_read.generations[server])
                           for server, _ in members.values()):
                    continue
                with self.counters.cpu("bulk_install_cpu_s"):
                    parity_rows += arena.build(slots[rows], encoded, versions)
        return data_rows, parity_rows


def _selection(ok: np.ndarray):
    """An index for the rows marked ``ok``: a slice when all are (no copy), None when none are."""
    if ok.all():
        return slice(None)
    rows = np.flatnonzero(ok)
    return rows if len(rows) else None


class _Expected:
    """What the frames of one ``StreamStripesRequest`` must be: their shape, and how they tile its blocks."""

    def __init__(self, spec, k: int, request: parity_pb2.StreamStripesRequest):
        self.positions, self.indices = len(request.data_positions), len(request.parity_indices)
        self.row_bytes, self.k = spec.row_bytes, k
        self.first, self.end, self.step = request.first_block, request.end_block, request.blocks_per_message
        self.count = len(range(self.first, self.end, self.step))
        self.bytes_per_block = frames.block_bytes(self.positions, self.indices, self.row_bytes, k)
        self.max_frame_bytes = frames.frame_bytes(self.step, self.positions, self.indices, self.row_bytes, k)

    def parse(self, raw) -> frames.Frame:
        return frames.parse(raw, self.positions, self.indices, self.row_bytes, self.k)

    def check(self, received: list[frames.Frame]) -> None:
        """Raises ``FrameError`` unless frame ``i`` holds blocks ``[first + i*step, ...)``, all of them."""
        for i, frame in enumerate(received):
            due = self.first + i * self.step
            if (frame.first_block, frame.blocks) != (due, min(self.step, self.end - due)):
                raise frames.FrameError(f"frame of blocks [{frame.first_block}, {frame.first_block + frame.blocks})"
                                        f" where [{due}, {min(self.end, due + self.step)}) was due")
        if len(received) != self.count:
            raise frames.FrameError(f"{len(received)} frames where {self.count} were due")


class _Gathered:
    """The per-survivor futures of one round, as one future."""

    def __init__(self, futures, generations: dict[int, int], sids: dict[int, str]):
        self.futures = futures
        self.generations = generations  # per survivor, its resolution count here before the read
        self.sids = sids  # per survivor, the incarnation the map named when the read started

    def result(self) -> "RoundRead":
        return RoundRead({s: f.result() for s, f in self.futures.items()}, self.generations, self.sids)


class RoundRead(dict):
    """One round's frames per survivor (None: not read), with what :meth:`BulkRebuild.fetch` noted first."""

    def __init__(self, frames_of: dict, generations: dict[int, int], sids: dict[int, str]):
        super().__init__(frames_of)
        self.generations = generations
        self.sids = sids
