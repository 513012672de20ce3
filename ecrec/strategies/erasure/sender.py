"""The owner's direct path to one destination: batches the relay did not deliver in time, a restarted chain,
flushes, and confirmations for an idle destination.

One :class:`DestinationSender` (and one thread) per destination index.  It sleeps until the owner wakes it --
a batch the relay did not deliver within ``relay_timeout_s`` (the owner notices at its next push or timer), a
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
from ecrec.strategies.erasure import batch_frames
from ecrec.wire import parity_pb2

log = logging.getLogger("ecrec.strategies.erasure")

#: a sender nobody woke looks at its destination anyway this often (s): a safety net, not the schedule
IDLE_WAKE_S = 5.0


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
        proves this is a server: no seal): ``ApplyParityFrames`` when every batch's bulk bytes are arrays (a frame,
        joined once), else ``ApplyParity`` (the batches filled)."""
        owner, host = self.owner, self.owner.host
        framed = bool(items) and all(sections is not None for _, sections in items) and not self._frames_refused
        batches = ([b for b, _ in items] if framed else
                   [b if sections is None else batch_frames.fill(b, sections) for b, sections in items])
        message = parity_pb2.ParityBatches(batches=batches, source=host.index, source_id=host.server_id,
                                           confirmed_upto=confirmed)
        if framed:
            t0 = time.thread_time()
            message = batch_frames.encode(message, [sections for _, sections in items])
            owner.counters.add("part_frame_cpu_s", time.thread_time() - t0)
        with self._send_lock:
            replaced = self._replaced
            address = host.peers.address_of(self.destination)
            if address is None:
                return False
            try:
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
            except (grpc.FutureCancelledError, grpc.RpcError) as exc:
                if isinstance(exc, grpc.FutureCancelledError) or exc.code() == grpc.StatusCode.CANCELLED:
                    log.info("parity server %d (%s) was replaced: the call to it was cancelled; sending to the "
                             "replacement", self.destination, address)  # by cancel_stale
                    return False
                if framed and exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a server without frames: protobuf
                    self._frames_refused = True
                    log.warning("parity server %d (%s) does not take parity frames; sending protobuf batches",
                                self.destination, address)
                elif transport.is_unavailable(exc):
                    host.peers.report(address, f"ApplyParity: {exc.code().name}")
                elif exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # e.g. addressed to a replaced incarnation
                    host.refresh_map()
                    log.info("parity server %d (%s) refused %d batches: %s; map refreshed, retrying", self.destination,
                             address, len(batches), exc.details())
                else:
                    log.error("parity server %d (%s) refused %d batches: %s: %s; retrying later", self.destination,
                              address, len(batches), exc.code().name, exc.details())
                return False
        owner.counters.add("parity_bytes_sent", len(message) if framed else message.ByteSize())
        owner.counters.add("direct_batches", len(batches))
        owner.counters.add("framed_batches" if framed else "protobuf_batches", len(batches))
        self.sent_confirm = max(self.sent_confirm, confirmed)
        owner.ack(self.destination, ack.destination_id, ack.applied_upto)
        return True
