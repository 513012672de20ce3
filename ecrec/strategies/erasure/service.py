"""``ParityService``: the erasure-coding strategy's gRPC edge between servers.

``ApplyParity`` (owner -> parity server, the direct path), ``Flush`` (deliver everything pending, e.g.
before a verification), ``ResolveSource`` (replacement -> survivors), ``ReadRows`` (rebuild ->
stripe members) and ``StreamStripes`` (the fast rebuild path, :mod:`~ecrec.strategies.erasure.bulk`).  Each method checks the request's shape, calls the part that
owns the state (:class:`~ecrec.strategies.erasure.receiver.ParityReceiver`, the shards) and turns domain
errors into gRPC status codes (:func:`ecrec.transport.service_method`); nothing else here.
"""

from __future__ import annotations

import numpy as np

from ecrec import errors, transport
from ecrec.strategies.base import StrategyHost
from ecrec.strategies.erasure import bulk
from ecrec.strategies.erasure.owner import ParityOwner
from ecrec.strategies.erasure.receiver import ParityReceiver
from ecrec.wire import parity_pb2, parity_pb2_grpc

MAX_FLUSH_S = 60.0


class ParityServicer(parity_pb2_grpc.ParityServiceServicer):
    def __init__(self, host: StrategyHost, owner: ParityOwner, receiver: ParityReceiver):
        self.host = host
        self.owner = owner
        self.receiver = receiver

    @transport.service_method
    def ApplyParity(self, request, context):
        self.host.check_peer(context)
        return self.receiver.apply(request)

    @transport.service_method
    def Flush(self, request, context):
        self.host.check_peer(context)
        if not 0 <= request.timeout_s <= MAX_FLUSH_S:
            raise errors.InvalidRequest(f"timeout_s must be in [0, {MAX_FLUSH_S:.0f}], got {request.timeout_s}")
        return parity_pb2.FlushReply(unconfirmed=self.owner.flush(request.timeout_s or 10.0))

    @transport.service_method
    def ResolveSource(self, request, context):
        self.host.check_peer(context)
        if not request.commit:
            return self.receiver.list_source(request.source)
        self.receiver.commit_resolution(request.source, request.undo_seqs, request.replacement_id)
        return parity_pb2.ResolveSourceReply()

    @transport.service_method
    def ReadRows(self, request, context):
        self.host.check_peer(context)
        self.host.require_index()
        if request.sections:
            if any(section.sections for section in request.sections):
                raise errors.InvalidRequest("ReadRows sections cannot hold sections")
            return parity_pb2.ReadRowsReply(sections=[self._read(section) for section in request.sections])
        return self._read(request)

    @transport.service_method
    def StreamStripes(self, request, context):
        self.host.check_peer(context)
        self.host.require_index()
        shard = self.host.table(request.table)
        self.receiver.part(request.table)
        bulk.check_request(self.host.layout, shard.spec.num_rows, request)
        return self._stream(request, context)

    def _stream(self, request, context):
        """The reply stream (validated above); a domain error midway ends it with its status."""
        try:
            yield from bulk.read_blocks(self.host, self.receiver, request)
        except errors.EcrecError as exc:
            code, message = transport.grpc_status_of(exc)
            context.abort(code, message)

    def _read(self, request) -> parity_pb2.ReadRowsReply:
        host = self.host
        if request.dense:
            dense = host.dense(request.dense)
            payload, version, ready = dense.read()
            ready = ready and not self.receiver.dense_unresolved(request.dense)
            return parity_pb2.ReadRowsReply(payload=payload.tobytes(),
                                            versions=transport.ids_to_bytes(np.array([version])),
                                            ready=bytes([1 if ready else 0]))
        if request.ids:
            shard = host.table(request.table)
            rows = shard.read(shard.slots_for(transport.bytes_to_ids(request.ids)))
            return parity_pb2.ReadRowsReply(payload=rows.payload.tobytes(), versions=transport.ids_to_bytes(rows.versions),
                                            ready=rows.ready.astype(np.uint8).tobytes())
        if not request.table:
            raise errors.InvalidRequest("ReadRows needs a table (with ids or stripes) or a dense tensor")
        payload, versions, ready = self.receiver.read_parity(
            request.table, transport.bytes_to_ids(request.stripes), transport.bytes_to_ids(request.parity_index))
        return parity_pb2.ReadRowsReply(payload=payload.tobytes(), versions=transport.ids_to_bytes(versions.reshape(-1)),
                                        ready=ready.astype(np.uint8).tobytes())
