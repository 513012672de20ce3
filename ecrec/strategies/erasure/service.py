"""``ParityService``: the erasure-coding strategy's gRPC edge between servers.

``ApplyParity`` (owner -> parity server, the direct path; ``ApplyParityFrames`` and ``OpenParityChannel`` for its
frames), ``Flush`` (deliver everything pending, e.g.
before a verification), ``ResolveSource`` (replacement -> survivors), ``ReadRows`` (rebuild ->
stripe members) and ``StreamStripes`` (the fast rebuild path, :mod:`~ecrec.strategies.erasure.bulk`: registered by
:func:`add_to_server` beside the generated methods, its replies raw frames).  Each method checks the request's shape, calls the part that
owns the state (:class:`~ecrec.strategies.erasure.receiver.ParityReceiver`, the shards) and turns domain
errors into gRPC status codes (:func:`ecrec.net.transport.service_method`); nothing else here.
"""

from __future__ import annotations

import threading
import time

import grpc
from google.protobuf.message import DecodeError
import numpy as np

from ecrec import errors
from ecrec.net import transport
from ecrec.strategies.base import StrategyHost
from ecrec.strategies.erasure import batch_frames, bulk, frame_socket, frames, parity_channel
from ecrec.strategies.erasure.owner import EVERY_VERSION, ParityOwner
from ecrec.strategies.erasure.receiver import ParityReceiver
from ecrec.wire import cluster_pb2, parity_pb2, parity_pb2_grpc

MAX_FLUSH_S = 60.0
#: a replacement that stops reading delivered frames this long fails the delivery (s)
DELIVER_TIMEOUT_S = 30.0


def add_to_server(servicer: ParityServicer, server) -> None:
    """Registers the generated methods, ``StreamStripes``, whose replies (frames, :mod:`~ecrec.strategies.
    erasure.frames`) gRPC sends as they are, without a protobuf serializer, and ``ApplyParityFrames``, whose request
    is a frame of parity batches (:mod:`~ecrec.strategies.erasure.batch_frames`) received as it is."""
    parity_pb2_grpc.add_ParityServiceServicer_to_server(servicer, server)
    stripes = grpc.unary_stream_rpc_method_handler(servicer.StreamStripes,
                                                   request_deserializer=parity_pb2.StreamStripesRequest.FromString)
    batches = grpc.unary_unary_rpc_method_handler(servicer.ApplyParityFrames,
                                                  response_serializer=parity_pb2.ParityAck.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        frames.SERVICE, {frames.METHOD: stripes, batch_frames.METHOD: batches}),))


class ParityServicer(parity_pb2_grpc.ParityServiceServicer):
    def __init__(self, host: StrategyHost, owner: ParityOwner, receiver: ParityReceiver, sender_nice: int = 0):
        self.host = host
        self.sender_nice = sender_nice  # OS priority lowered on the threads that deliver frames
        self.owner = owner
        self.receiver = receiver
        self._channels_lock = threading.Lock()
        self._channels: parity_channel.ChannelListener | None = None  # opened at the first OpenParityChannel
        self._closed = False

    @transport.service_method
    def ApplyParity(self, request, context):
        t0 = time.thread_time()
        try:
            self.host.check_peer(context)
            return self.receiver.apply(request)
        finally:
            self.receiver.counters.add("apply_parity_cpu_s", time.thread_time() - t0)

    @transport.service_method
    def ApplyParityFrames(self, request: bytes, context):
        """``ApplyParity`` with the batches as a frame (:mod:`~ecrec.strategies.erasure.batch_frames`): their bulk
        bytes read in place."""
        t0 = time.thread_time()
        try:
            self.host.check_peer(context)
            return self._apply_frame(request)
        finally:
            self.receiver.counters.add("apply_parity_cpu_s", time.thread_time() - t0)

    def _apply_frame(self, frame) -> parity_pb2.ParityAck:
        t0 = time.thread_time()
        try:
            meta, sections = batch_frames.decode(frame)
        except batch_frames.FrameError as exc:
            raise errors.InvalidRequest(str(exc)) from None
        self.receiver.counters.add("part_parse_cpu_s", time.thread_time() - t0)
        return self.receiver.apply(meta, sections)

    @transport.service_method
    def OpenParityChannel(self, request, context):
        """A port and a one-time ticket for the caller's parity channel (:mod:`~ecrec.strategies.erasure.
        parity_channel`); the listening socket opens at the first call."""
        caller = self.host.check_peer(context)
        if self.host.peers.security is not None and self.host.peers.security.tls:
            raise errors.FailedPrecondition("no parity channel on a TLS cluster (the deltas would travel in clear): "
                                            "send frames with ApplyParityFrames")
        with self._channels_lock:
            if self._closed:
                raise errors.Unavailable("this server is closing")
            if self._channels is None:
                self._channels = parity_channel.ChannelListener(
                    self.host.config.host, self._channel_frame, self.host.config.max_message_bytes,
                    self.host.config.rpc_timeout_s, read=self._channel_read)
            channels = self._channels
        return parity_pb2.OpenParityChannelReply(port=channels.port, ticket=channels.ticket_for(caller))

    def _channel_read(self, caller: str, epoch: int, body) -> parity_pb2.ReadRowsReply:
        """A read from the parity channel of ``caller``: checked as a ``ReadRows`` call would be (this server
        serves; the caller is still a server of the map, after catching up with its epoch), then answered by it."""
        self.host.require_serving()
        self.host.check_member(caller, epoch)
        try:
            request = parity_pb2.ReadRowsRequest.FromString(bytes(body))
        except DecodeError:
            raise errors.InvalidRequest("a parity channel read that is not a ReadRowsRequest") from None
        return self._read_rows(request)

    def _channel_frame(self, caller: str, epoch: int, frame) -> parity_pb2.ParityAck:
        """A frame from the parity channel of ``caller``: checked as an ``ApplyParityFrames`` call would be (this
        server serves; the caller is still a server of the map, after catching up with its epoch), then applied."""
        t0 = time.thread_time()
        try:
            self.host.require_serving()
            self.host.check_member(caller, epoch)
            return self._apply_frame(frame)
        finally:
            self.receiver.counters.add("apply_parity_cpu_s", time.thread_time() - t0)
            self.receiver.counters.add("channel_frames", 1)

    def close(self) -> None:
        """Closes the parity channels' listening socket and connections."""
        with self._channels_lock:
            self._closed = True
            channels, self._channels = self._channels, None
        if channels is not None:
            channels.close()

    @transport.service_method
    def Flush(self, request, context):
        self.host.check_peer(context)
        if not 0 <= request.timeout_s <= MAX_FLUSH_S:
            raise errors.InvalidRequest(f"timeout_s must be in [0, {MAX_FLUSH_S:.0f}], got {request.timeout_s}")
        return parity_pb2.FlushReply(unconfirmed=self.owner.flush(request.timeout_s or 10.0))

    @transport.service_method
    def ResolveSource(self, request, context):
        caller = self.host.check_peer(context)
        if request.replacement_id and request.replacement_id != caller:
            raise errors.InvalidRequest(f"replacement_id {request.replacement_id[:64]!r} is not the caller ({caller}); "
                                        "a server resolves for itself")
        self.receiver.check_resolver(request.source, caller)
        if not request.commit:
            return self.receiver.list_source(request.source, caller)
        self.receiver.commit_resolution(request.source, request.undo_seqs, caller)
        return parity_pb2.ResolveSourceReply()

    @transport.service_method
    def ReadRows(self, request, context):
        self.host.check_peer(context, changes_parity=False)
        return self._read_rows(request)

    def _read_rows(self, request) -> parity_pb2.ReadRowsReply:
        """``ReadRows`` of a proven peer (through gRPC or its parity channel)."""
        self.host.require_index()
        if request.sections:
            if any(section.sections for section in request.sections):
                raise errors.InvalidRequest("ReadRows sections cannot hold sections")
            reply = parity_pb2.ReadRowsReply(sections=[self._read(section) for section in request.sections])
        elif request.confirmed and not (request.table or request.ids or request.dense):
            reply = parity_pb2.ReadRowsReply()  # the bound and committed push ids only
        else:
            reply = self._read(request)
        if request.confirmed:
            self._add_confirmed(request, reply)
        return reply

    def _add_confirmed(self, request, reply: parity_pb2.ReadRowsReply) -> None:
        """The confirmed bound and committed push ids, read after the rows (``ReadRowsRequest.confirmed``).  A dense
        replica held here for another primary: its logged deltas make it not ready instead (a backup knows no
        bound of its primary's), and the committed ids are that primary's as logged here."""
        dense = [r.dense for r in (request.sections or [request]) if r.dense]
        primaries = {self.host.layout.dense_servers(name)[0] for name in dense}
        if dense and primaries != {self.host.index}:
            if len(primaries) > 1 or any(r.ids or r.stripes for r in (request.sections or [request])):
                raise errors.InvalidRequest("a confirmed read of dense replicas names one primary's tensors only")
            bound, committed = EVERY_VERSION, self.receiver.committed_of(primaries.pop())
            for section, name in zip(reply.sections or [reply], dense):
                if self.receiver.dense_unconfirmed(name):
                    section.ready = b"\x00"
        else:
            versions = [transport.bytes_to_ids(section.versions) for section, r in
                        zip(reply.sections or [reply], request.sections or [request]) if r.ids or r.dense]
            bound = self._bound_for(np.concatenate(versions) if versions else np.zeros(0, np.int64))
            committed = self.owner.committed()  # after the bound: it covers every push at or below it
        reply.confirmed_upto = bound
        reply.server_id = self.host.server_id
        for worker, sequence in committed.items():
            reply.committed.add(worker=worker, sequence=sequence)

    def _bound_for(self, versions: np.ndarray) -> int:
        """The owner's confirmed bound for data rows read at ``versions``; when some are above it, their batches
        go directly now (the rebuild waits for them), not at the relay timeout."""
        bound = self.owner.confirmed_bound()
        if versions.size and int(versions.max()) > bound:
            self.owner.deliver_now()
        return bound

    @transport.service_method
    def StreamStripes(self, request, context):
        self.host.check_peer(context, changes_parity=False)
        self.host.require_index()
        shard = self.host.table(request.table)
        self.receiver.part(request.table)
        bulk.check_request(self.host.layout, shard.spec, request)
        if request.deliver_port:
            return self._deliver(request, self._caller_host(context), context)
        return self._stream(request, context)

    def _stream(self, request, context):
        """The reply stream (validated above); a domain error midway ends it with its status."""
        # gRPC's handler thread runs this generator and sends what it yields: its clock from here to the end is the
        # stream's CPU -- unless the generator ends elsewhere (a cancelled call finalized later): then not counted
        cpu0, thread = time.thread_time(), threading.get_ident()
        try:
            for buffer in bulk.read_blocks(self.host, self.receiver, request, self.owner.settle_rows, self._bound_for):
                yield buffer.tobytes()
        except errors.EcrecError as exc:
            code, message = transport.grpc_status_of(exc)
            context.abort(code, message)
        finally:
            if threading.get_ident() == thread:
                self.receiver.counters.add("stream_cpu_s", time.thread_time() - cpu0)

    def _caller_host(self, context) -> str:
        """Where frames may be delivered: the host of the calling server as the map lists it (check_peer
        verified the caller is a server of the map); never an address from the request."""
        if self.host.peers.security is not None and self.host.peers.security.tls:
            raise errors.FailedPrecondition("frames are not delivered over a plain connection on a TLS cluster; "
                                            "ask without deliver_port")
        caller = dict(context.invocation_metadata() or ()).get("ecrec-caller")
        m = self.host.cluster_map
        address = next((s.address for s in (m.servers if m is not None else ())
                        if caller and s.server_id == caller
                        and s.state in (cluster_pb2.RECOVERING, cluster_pb2.PROMOTING)), None)
        if address is None:
            raise errors.FailedPrecondition("deliver_port needs a caller that is a rebuilding server of the cluster "
                                            "map (ecrec-caller metadata; state RECOVERING, or PROMOTING while its "
                                            "promotion is recorded)")
        return address.rsplit(":", 1)[0]

    def _deliver(self, request, caller_host: str, context):
        """Sends the frames over a connection to the caller (:mod:`~ecrec.strategies.erasure.frame_socket`), on
        a thread of its own at a lower OS priority (training's requests here go first); the reply stream carries
        none and ends OK once all were sent."""
        failed: list[BaseException] = []
        cancelled = threading.Event()
        context.add_callback(cancelled.set)  # the call ended (cancelled by the caller, its deadline): stop sending

        def send() -> None:
            bulk.lower_priority(self.sender_nice)
            try:
                with self.receiver.counters.cpu("stream_cpu_s"):  # the whole delivery (read_blocks counts its parts)
                    frame_socket.send_frames(caller_host, request.deliver_port, request.ticket,
                                             bulk.read_blocks(self.host, self.receiver, request,
                                                              self.owner.settle_rows, self._bound_for),
                                             DELIVER_TIMEOUT_S, stop=cancelled)
            except BaseException as exc:  # noqa: BLE001 - handed to the call, which reports it
                failed.append(exc)

        sender = threading.Thread(target=send, name="ecrec-deliver", daemon=True)
        sender.start()
        sender.join()
        if failed and isinstance(failed[0], errors.EcrecError):
            code, message = transport.grpc_status_of(failed[0])
            context.abort(code, message)
        if failed and isinstance(failed[0], OSError):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"delivering frames to {caller_host}:{request.deliver_port} failed: {failed[0]!r}")
        if failed:
            raise failed[0]
        yield from ()

    def _read(self, request) -> parity_pb2.ReadRowsReply:
        host = self.host
        if request.dense:
            dense = host.dense(request.dense)
            payload, version, ready = dense.read()  # copied without pausing pushes, then, as it was at this owner's
            with host.pushes_paused():  # last closed group (owner.py): read again only if a push changed it since
                if dense.read_version() != version:
                    payload, version, ready = dense.read()
                before = self.owner.dense_at_boundary(request.dense, payload)
            version = version if before is None else before
            ready = ready and not self.receiver.dense_unresolved(request.dense)
            return parity_pb2.ReadRowsReply(payload=payload.tobytes(),
                                            versions=transport.ids_to_bytes(np.array([version])),
                                            ready=bytes([1 if ready else 0]))
        if request.ids:
            shard = host.table(request.table)
            slots = shard.slots_for(transport.bytes_to_ids(request.ids))
            payload = np.empty((len(slots), shard.spec.row_bytes), np.uint8)
            versions, ready = np.empty(len(slots), np.int64), np.empty(len(slots), np.uint8)
            rewrites = shard.read_into(slots, payload, versions, ready)
            # as they were at this owner's last closed group (owner.py)
            self.owner.settle_rows(shard, [(slots, payload, versions, ready, rewrites)])
            return parity_pb2.ReadRowsReply(payload=payload.tobytes(), versions=transport.ids_to_bytes(versions),
                                            ready=ready.tobytes())
        if not request.table:
            raise errors.InvalidRequest("ReadRows needs a table (with ids or stripes) or a dense tensor")
        payload, versions, ready = self.receiver.read_parity(
            request.table, transport.bytes_to_ids(request.stripes), transport.bytes_to_ids(request.parity_index))
        return parity_pb2.ReadRowsReply(payload=payload.tobytes(), versions=transport.ids_to_bytes(versions.reshape(-1)),
                                        ready=ready.astype(np.uint8).tobytes())
