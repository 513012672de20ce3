"""The owner's direct path to one destination: every group's batch not relayed (by default, all of them where there
are parity channels), batches the relay did not deliver in time, a restarted chain, flushes, and confirmations
for an idle destination.  Frames go over a parity channel (a plain connection to the
destination: :mod:`~ecrec.strategies.erasure.parity_channel`) where the cluster allows one, else through gRPC.

One :class:`DestinationSender` (and one thread) per destination index.  It sleeps until the owner wakes it --
a group built to go directly, a batch the relay did not deliver within ``relay_timeout_s`` (the owner notices at
its next push or timer), a
restarted chain, a flush, a confirmation due to an idle destination -- then takes from the owner's outbox the
batches this destination has not acknowledged and that are overdue (or all of them after a restart or a
flush), and sends them in
sequence order in ``ApplyParity`` calls of at most ``max_batch_bytes`` (a server-to-server call whose caller
proves it is a server: the batches need no seal).  The destination's reply is an
acknowledgement like a relayed watermark.  A destination that is gone is reported to the coordinator;
the batches stay in the outbox and go to the replacement once the map names it.  Nothing is dropped: a
refused call (any other status) is logged and retried at the next wake.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from ecrec.net import transport
from ecrec.net.peers import PARITY
from ecrec.strategies.erasure import batch_frames, parity_channel
from ecrec.wire import parity_pb2

log = logging.getLogger("ecrec.strategies.erasure")

#: a sender nobody woke looks at its destination anyway this often (s): a safety net, not the schedule
IDLE_WAKE_S = 5.0
#: after a parity channel could not be opened, frames go through gRPC this long before the next try (s), doubled
#: after each failure in a row up to ``CHANNEL_RETRY_MAX_S`` (a firewall that drops the connection costs little)
CHANNEL_RETRY_S = 5.0
CHANNEL_RETRY_MAX_S = 300.0
#: the longest wait for a parity channel to open (s): the call that asks for it, then the connection
CHANNEL_CONNECT_S = 2.0
#: a parity channel unused this long is opened again before its next frame (a middlebox may have dropped it) (s)
CHANNEL_IDLE_S = 120.0


class DestinationSender:
    """Direct delivery of one owner's batches to ``destination`` (see the module docstring).  ``owner`` is
    the :class:`~ecrec.strategies.erasure.owner.ParityOwner` whose outbox it drains."""

    def __init__(self, owner, destination: int):
        self.owner = owner
        self.destination = destination
        self._wake = threading.Event()
        self._due_now = False
        self._send_lock = threading.Lock()  # one delivery to this destination at a time (thread or caller)
        self.sent_confirm = 0
        self._inflight = None  # the ApplyParity under way (a future): cancelled when its destination is replaced
        self._replaced = 0  # how many times the destination was replaced (a call started before one is stale)
        self._frames_refused = False  # the destination answered UNIMPLEMENTED to a frame: protobuf from then on
        self._channel = None  # the parity channel to the destination (parity_channel.Channel), once opened
        self._channel_off = owner.options.parity_transport != "socket"  # no channels (the option)
        self._channel_unimplemented = False  # the destination at _channel_failed_to has no channels (an old server)
        self._channel_retry_at = 0.0  # after a failed opening, frames go through gRPC until then
        self._channel_failures = 0  # openings failed in a row ...
        self._channel_failed_to = None  # ... to this address
        self.thread = threading.Thread(target=self._run, name=f"ecrec-parity-sender-{destination}", daemon=True)
        self.thread.start()

    def wake(self, due_now: bool = False) -> None:
        self._due_now = self._due_now or due_now
        self._wake.set()

    def _run(self) -> None:
        """Sleeps until woken (the owner wakes it when a batch is due here, a chain restarted, a flush, or a
        confirmation is due to an idle destination), then delivers what is due.  No periodic wake-up: an idle
        cluster costs nothing here."""
        owner = self.owner
        while not owner.closed.is_set():
            self._wake.wait(IDLE_WAKE_S)
            self._wake.clear()
            if owner.closed.is_set():
                self.close_channel()
                return
            everything, self._due_now = self._due_now, False
            entries = owner.due(self.destination, everything)
            try:
                if entries:
                    self.deliver(entries)
                elif owner.confirmed_upto() > self.sent_confirm and not owner.unconfirmed():
                    self._send([], owner.confirmed_upto())  # an idle destination trims its log
            except Exception:  # noqa: BLE001 - reported, never swallowed; retried at the next wake
                log.exception("parity sender to server %d", self.destination)
        self.close_channel()

    def cancel_stale(self) -> None:
        """The destination was replaced: cancels the call under way to its old incarnation, which may hang until
        its deadline (a cut-off or paused server), so that the chain restarts at the replacement now.  The
        replacement's rebuild may already hold this owner's unacknowledged pushes in the rows it read: the
        sooner their batches reach its log, the smaller the window in which this owner's own failure leaves
        them there with no batch to undo them by (``receiver``, resolution).  A call cancelled by mistake (already
        to the replacement) is sent again: a batch applied twice is skipped."""
        self._replaced += 1  # a call whose future is not recorded yet sees this and cancels itself
        call = self._inflight
        if call is not None:
            call.cancel()
        channel = self._channel
        if channel is not None:
            channel.abort()  # the sending thread sees it closed and opens one to the replacement

    def confirm(self, confirmed: int) -> bool:
        """Tells the destination, now, that every push up to ``confirmed`` is applied everywhere (it trims its
        log); True when it answered."""
        if confirmed <= self.sent_confirm:
            return True
        return self._send([], confirmed)

    def deliver(self, entries: list, wait: bool = False, timeout_s: float | None = None) -> None:
        """Sends ``entries``' batches for this destination, in order; with ``wait`` retries (following the map)
        until they are applied or ``timeout_s`` passes."""
        deadline = time.monotonic() + (timeout_s or self.owner.host.config.rpc_timeout_s)
        while True:
            messages = self.owner.messages_for(self.destination, entries)
            if messages is None:  # no live server at the destination yet
                ok = False
            else:
                ok = all(self._send(items, confirmed) for items, confirmed in messages)
            if ok or not wait or time.monotonic() > deadline or self.owner.closed.is_set():
                return
            time.sleep(0.02)

    def _send(self, items: list, confirmed: int) -> bool:
        """One call with ``items`` (``(ParityBatch, sections)`` pairs, :meth:`ParityOwner.messages_for`; the call
        proves this is a server: no seal): when every batch's bulk bytes are arrays, a frame -- over the parity
        channel (:mod:`~ecrec.strategies.erasure.parity_channel`: written to a socket as it is) where the cluster
        allows one, else ``ApplyParityFrames`` (joined once) --, else ``ApplyParity`` (the batches filled)."""
        owner, host = self.owner, self.owner.host
        framed = bool(items) and all(sections is not None for _, sections in items) and not self._frames_refused
        batches = ([b for b, _ in items] if framed else
                   [b if sections is None else batch_frames.fill(b, sections) for b, sections in items])
        message = parity_pb2.ParityBatches(batches=batches, source=host.index, source_id=host.server_id,
                                           confirmed_upto=confirmed)
        if framed:
            t0 = time.thread_time()
            parts = batch_frames.encode_parts(message, [sections for _, sections in items])
            size = sum(memoryview(p).nbytes for p in parts)
            owner.counters.add("part_frame_cpu_s", time.thread_time() - t0)
        with self._send_lock:
            replaced = self._replaced
            address = host.peers.address_of(self.destination)
            if address is None:
                return False
            try:
                ack = self._over_channel(address, parts, size, replaced) if framed else None
                via_channel = ack is not None
                if ack is None:
                    if framed:
                        t0 = time.thread_time()
                        message = b"".join(parts)
                        owner.counters.add("part_frame_cpu_s", time.thread_time() - t0)
                    method = (host.peers.channel(address).unary_unary(  # the frame as it is; the reply is protobuf
                        batch_frames.FULL_METHOD, response_deserializer=parity_pb2.ParityAck.FromString) if framed
                        else host.peers.stub(address, PARITY).ApplyParity)
                    call = method.future(message, timeout=host.config.rpc_timeout_s, metadata=host.peers.metadata())
                    self._inflight = call
                    if self._replaced != replaced:  # replaced between the address lookup and now: stale already
                        call.cancel()
                    try:
                        ack = call.result()
                    finally:
                        self._inflight = None
            except (grpc.FutureCancelledError, grpc.RpcError, parity_channel.ChannelError) as exc:
                if isinstance(exc, grpc.FutureCancelledError) or exc.code() == grpc.StatusCode.CANCELLED:
                    log.info("parity server %d (%s) was replaced: the call to it was cancelled; sending to the "
                             "replacement", self.destination, address)  # by cancel_stale
                    return False
                if framed and exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a server without frames: protobuf
                    self._frames_refused = True
                    log.warning("parity server %d (%s) does not take parity frames; sending protobuf batches",
                                self.destination, address)
                elif transport.is_unavailable(exc) or isinstance(exc, parity_channel.ChannelError) and exc.code() in (
                        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    host.peers.report(address, f"ApplyParity: {exc.code().name}")
                elif exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # e.g. addressed to a replaced incarnation
                    host.refresh_map()
                    log.info("parity server %d (%s) refused %d batches: %s; map refreshed, retrying", self.destination,
                             address, len(batches), exc.details())
                else:
                    log.error("parity server %d (%s) refused %d batches: %s: %s; retrying later", self.destination,
                              address, len(batches), exc.code().name, exc.details())
                return False
        owner.counters.add("parity_bytes_sent", size if framed else message.ByteSize())
        owner.counters.add("direct_batches", len(batches))
        owner.counters.add("framed_batches" if framed else "protobuf_batches", len(batches))
        if via_channel:
            owner.counters.add("channel_batches", len(batches))
        self.sent_confirm = max(self.sent_confirm, confirmed)
        owner.ack(self.destination, ack.destination_id, ack.applied_upto)
        return True

    # --- the parity channel -------------------------------------------------------------------------------------
    def _over_channel(self, address: str, parts: list, size: int, replaced: int) -> parity_pb2.ParityAck | None:
        """Sends a frame over the connection to ``address`` (opened first when there is none; called with
        ``_send_lock`` held); None when there is no channel to use now (a TLS cluster, a server without channels, a
        connection that failed or timed out: the frame goes through gRPC, and channels to ``address`` wait out a
        retry delay that doubles with each failure in a row).  A refusal raises :class:`~ecrec.strategies.erasure.
        parity_channel.ChannelError`; a destination replaced meanwhile (:meth:`cancel_stale`) raises
        ``grpc.FutureCancelledError``, as a cancelled call does."""
        host = self.owner.host
        if self._channel_off or (host.peers.security is not None and host.peers.security.tls):
            return None
        if self._channel_failed_to != address:  # another destination (a replacement): try it at once
            self._channel_failed_to, self._channel_failures, self._channel_retry_at = address, 0, 0.0
            self._channel_unimplemented = False
        channel = self._channel
        if channel is not None and (channel.key != address or channel.closed
                                    or time.monotonic() - channel.last_used > CHANNEL_IDLE_S):
            self._channel = None  # elsewhere, aborted, or idle long enough for a middlebox to have dropped it
            channel.close()
            channel = None
        if channel is None:
            if self._channel_unimplemented or time.monotonic() < self._channel_retry_at:
                return None
            channel = self._open_channel(address)
            if channel is None:
                self._channel_failed()
                return None
            self._channel = channel
        if self._replaced != replaced:  # replaced while the channel opened
            raise grpc.FutureCancelledError()
        try:
            data = channel.request(parts, size, host.epoch, host.config.rpc_timeout_s)
        except OSError as exc:
            self._channel = None
            channel.close()
            if self._replaced != replaced:
                raise grpc.FutureCancelledError() from None
            self._channel_failed()
            log.info("parity channel to server %d (%s) failed (%r); this frame goes through gRPC", self.destination,
                     address, exc)
            return None
        channel.last_used = time.monotonic()
        self._channel_failures = 0
        return parity_pb2.ParityAck.FromString(data)

    def _channel_failed(self) -> None:
        self._channel_failures += 1
        wait = min(CHANNEL_RETRY_MAX_S, CHANNEL_RETRY_S * 2 ** (self._channel_failures - 1))
        self._channel_retry_at = time.monotonic() + wait

    def _open_channel(self, address: str):
        try:
            channel = parity_channel.open_to(self.owner.host, address, CHANNEL_CONNECT_S)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._channel_unimplemented = True  # a server without channels: ApplyParityFrames to it
            log.info("no parity channel to server %d (%s): %s: %s; frames go through gRPC", self.destination, address,
                     exc.code().name, exc.details())
            return None
        except OSError as exc:
            log.warning("no parity channel to server %d (%s): %r; frames go through gRPC", self.destination, address,
                        exc)
            return None
        self.owner.counters.add("channels_opened", 1)
        return channel

    def close_channel(self) -> None:
        """Ends the parity channel from any thread (a request under way on it fails at once; the descriptor is
        closed by the thread that sends, or when the channel is dropped)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.abort()
