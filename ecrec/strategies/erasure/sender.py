"""Delivers one owner's parity batches to one destination index, in sequence order.

One :class:`DestinationSender` (and one thread) per destination.  Queued batches are coalesced into
one ``ApplyParity`` call (at most ``MAX_COALESCE``); an idle sender sends the owner's confirmation
watermark alone every ``heartbeat_s`` so the destination can trim its log.  When the destination is
gone the sender reports it, waits for the map to name a replacement and retries there; when the map
shows no server at that index the batches are dropped (a replacement re-encodes from the data rows).
Each batch's future completes when it was applied (or dropped), or fails with the destination's error.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from ecrec import transport
from ecrec.peers import PARITY
from ecrec.strategies.base import StrategyHost
from ecrec.wire import parity_pb2

log = logging.getLogger("ecrec.strategies.erasure")

MAX_COALESCE = 64


class DestinationSender:
    """Sends one owner's batches to ``destination`` (see the module docstring)."""

    def __init__(self, host: StrategyHost, destination: int, confirmed_upto: Callable[[], int],
                 heartbeat_s: float, closed: threading.Event, counters):
        self.host = host
        self.destination = destination
        self.confirmed_upto = confirmed_upto
        self.heartbeat_s = heartbeat_s
        self.closed = closed
        self.counters = counters
        self.queue: queue.Queue = queue.Queue()
        self.sent_confirm = 0
        self.thread = threading.Thread(target=self._run, name=f"ecrec-parity-sender-{destination}", daemon=True)
        self.thread.start()

    def submit(self, batch: parity_pb2.ParityBatch) -> Future:
        fut: Future = Future()
        self.queue.put((batch, fut))
        return fut

    def _run(self) -> None:
        while not self.closed.is_set():
            try:
                first = self.queue.get(timeout=self.heartbeat_s)
            except queue.Empty:
                confirm = self.confirmed_upto()
                if confirm > self.sent_confirm:
                    self._deliver([], confirm)
                continue
            items = [first]
            while len(items) < MAX_COALESCE:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._deliver(items, self.confirmed_upto())

    def _deliver(self, items: list, confirm: int) -> None:
        host = self.host
        message = parity_pb2.ParityBatches(batches=[b for b, _ in items], source=host.index,
                                           source_id=host.server_id, confirmed_upto=confirm)
        peers = host.peers
        while not self.closed.is_set():
            address = peers.address_of(self.destination)
            if address is None:  # destination failed, not yet replaced: its replacement re-encodes
                break
            try:
                peers.stub(address, PARITY).ApplyParity(message, timeout=host.config.rpc_timeout_s)
                self.counters["parity_bytes_sent"] += message.ByteSize()
                self.sent_confirm = max(self.sent_confirm, confirm)
                break
            except grpc.RpcError as exc:
                if not transport.is_unavailable(exc):
                    err = RuntimeError(f"parity server {self.destination} ({address}) refused a batch: "
                                       f"{exc.code().name}: {exc.details()}")
                    log.error("%s", err)
                    for _, fut in items:
                        fut.set_exception(err)
                    return
                peers.report(address, f"ApplyParity: {exc.code().name}")
                if peers.address_of(self.destination) in (None, address):
                    time.sleep(0.05)  # not replaced yet (else retry at the replacement at once)
        for _, fut in items:
            if not fut.done():
                fut.set_result(None)
