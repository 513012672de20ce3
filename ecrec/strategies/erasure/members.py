"""Reading the members of stripes for a rebuild or a verification: every member server at once, one ``ReadRows``
per server with a section per table (:func:`gather_many`); with ``confirmed`` reads, each owner's incarnation,
confirmed bound and committed push ids come with its rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ecrec.net import transport
from ecrec.net.peers import PARITY
from ecrec.strategies.base import StrategyHost
from ecrec.tables.shards import TableShard
from ecrec.tables.spec import TableSpec
from ecrec.wire import parity_pb2


# --- reading stripe members --------------------------------------------------------------------------------------
@dataclass
class StripeMembers:
    """What the members of ``n`` stripes hold: data members ``0..k-1``, then parities ``k..k+m-1``."""

    payload: np.ndarray  # (k + m, n, row_bytes) uint8
    ready: np.ndarray  # (k + m, n) bool: read, and ready to be used (virtual rows past the end: True)
    answered: np.ndarray  # (k + m, n) bool: the member's server answered (or the row is virtual)
    data_versions: np.ndarray  # (k, n) int64
    parity_versions: np.ndarray  # (m, n, k) int64
    # with ``confirmed`` reads, each answering owner's incarnation, confirmed bound and committed push ids
    # (worker -> highest sequence), read after its rows
    owners: dict[int, tuple[str, int, dict[str, int]]] | None = None


@dataclass
class StripeRead:
    """What to read of ``stripes`` of one table: the data members ``want_data`` (``(k, n)`` bool) and, with
    ``want_parity``, every parity member."""

    spec: TableSpec
    stripes: np.ndarray
    want_data: np.ndarray
    want_parity: bool
    local: TableShard | None = None  # members held here are read from it (else they count as not answered)
    confirmed: bool = False  # also each owner's confirmed bound and committed ids (a parity rebuild)


def gather_members(host: StrategyHost, spec: TableSpec, stripes: np.ndarray, want_data: np.ndarray,
                   want_parity: bool, local: TableShard | None = None, confirmed: bool = False) -> StripeMembers:
    """The members of one table's ``stripes`` (see :func:`gather_many`)."""
    return gather_many(host, [StripeRead(spec, stripes, want_data, want_parity, local, confirmed)])[0]


def gather_many(host: StrategyHost, reads: list[StripeRead], reader=None) -> list[StripeMembers]:
    """Reads the wanted members of several tables' stripes from their servers: one request per server for
    everything it holds of them (sections of one ``ReadRows``), all requests at once (through ``reader``, a
    :class:`~ecrec.strategies.erasure.read_channel.RowReader`, where given: over parity channels).

    Data members past the table's end are virtual zero rows: ready, version 0.
    """
    layout = host.layout
    k, m = layout.k, layout.m
    outs = []
    per_server: dict[int, list] = {}  # server -> [(read number, member, rows, section)]
    for n_read, read in enumerate(reads):
        spec, stripes, n = read.spec, read.stripes, len(read.stripes)
        out = StripeMembers(np.zeros((k + m, n, spec.row_bytes), dtype=np.uint8), np.zeros((k + m, n), dtype=bool),
                            np.zeros((k + m, n), dtype=bool), np.zeros((k, n), dtype=np.int64),
                            np.zeros((m, n, k), dtype=np.int64))
        if read.confirmed:
            out.owners = {}
        outs.append(out)
        ids = layout.stripe_row_ids(stripes)  # (n, k)
        for t in range(k):
            virtual = ids[:, t] >= spec.num_rows
            out.ready[t, virtual] = out.answered[t, virtual] = True
            want = read.want_data[t] & ~virtual
            owners = layout.member_server(stripes, t)
            for srv in np.unique(owners[want]).tolist():
                sel = np.flatnonzero(want & (owners == srv))
                if srv == host.index:
                    if read.local is not None:
                        rows = read.local.read(read.local.slots_for(ids[sel, t]))
                        out.payload[t, sel], out.data_versions[t, sel], out.ready[t, sel] = \
                            rows.payload, rows.versions, rows.ready
                        out.answered[t, sel] = True
                    continue
                per_server.setdefault(srv, []).append((n_read, t, sel, parity_pb2.ReadRowsRequest(
                    table=spec.name, ids=transport.ids_to_bytes(ids[sel, t]))))
        if read.want_parity:
            pservers = layout.parity_servers(stripes)
            for j in range(m):
                for srv in np.unique(pservers[:, j]).tolist():
                    if srv == host.index:
                        continue
                    sel = np.flatnonzero(pservers[:, j] == srv)
                    per_server.setdefault(srv, []).append((n_read, k + j, sel, parity_pb2.ReadRowsRequest(
                        table=spec.name, stripes=transport.ids_to_bytes(stripes[sel]),
                        parity_index=transport.ids_to_bytes(np.full(len(sel), j)))))
    servers = sorted(per_server)
    confirmed = {srv for srv, parts in per_server.items() if any(reads[n].confirmed for n, *_ in parts)}
    calls = [(srv, parity_pb2.ReadRowsRequest(sections=[sec for *_, sec in per_server[srv]],
                                              confirmed=srv in confirmed))
             for srv in servers]
    replies = reader.call_many(calls) if reader is not None else host.peers.call_many(
        [(srv, "ReadRows", request) for srv, request in calls], PARITY)
    for srv, reply in zip(servers, replies):
        if reply is None:
            continue
        if srv in confirmed:
            info = (reply.server_id, reply.confirmed_upto, {c.worker: c.sequence for c in reply.committed})
            for n_read in {n for n, *_ in per_server[srv]}:
                if reads[n_read].confirmed:
                    outs[n_read].owners[srv] = info
        for (n_read, member, sel, _), section in zip(per_server[srv], reply.sections):
            out, row_bytes = outs[n_read], reads[n_read].spec.row_bytes
            out.payload[member, sel] = np.frombuffer(section.payload, dtype=np.uint8).reshape(len(sel), row_bytes)
            out.ready[member, sel] = np.frombuffer(section.ready, dtype=np.uint8).astype(bool)
            out.answered[member, sel] = True
            versions = transport.bytes_to_ids(section.versions)
            if member < k:
                out.data_versions[member, sel] = versions
            else:
                out.parity_versions[member - k, sel] = versions.reshape(len(sel), k)
    return outs
