"""The owner side of the parity path: each applied push becomes one batch per destination.

For every row a push changed, ``delta = old payload XOR new payload`` goes, with the row's stripe
position, to the ``m`` parity servers of its stripe; a dense tensor's delta goes to its ``m``
backups.  All deltas of one push for one destination form one ``ParityBatch`` tagged ``(source,
seq, push id, destinations)``; the push's sequence (also the version the server stamped on its rows)
orders the batches.  The push is acknowledged once every live destination applied its batch
(:class:`PushCompletion`); ``confirmed_upto`` -- every push up to it is acknowledged everywhere --
rides on later batches so receivers can trim their logs.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np

from ecrec.cluster_map import live_servers
from ecrec.strategies.base import AppliedPush, StrategyHost
from ecrec.strategies.erasure.sender import DestinationSender
from ecrec.wire import embedding_pb2, parity_pb2


class PushCompletion:
    """Waits for the batches of one push at every destination."""

    def __init__(self, futures: list[Future], on_done):
        self._futures = futures
        self._on_done = on_done
        self._done = False
        self._lock = threading.Lock()

    def result(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in self._futures:
            f.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            if not self._done:
                self._done = True
                self._on_done()
        return None


def build_batches(push: AppliedPush, layout, source: int, source_id: str) -> dict[int, parity_pb2.ParityBatch]:
    """One :class:`ParityBatch` per destination index holding every delta of ``push`` meant for it."""
    batches: dict[int, parity_pb2.ParityBatch] = {}
    push_id = embedding_pb2.PushId(worker=push.push_id[0], sequence=push.push_id[1])

    def batch(destination: int) -> parity_pb2.ParityBatch:
        b = batches.get(destination)
        if b is None:
            b = batches[destination] = parity_pb2.ParityBatch(source=source, source_id=source_id, seq=push.seq,
                                                              push_id=push_id)
        return b

    for update in push.tables:
        delta = np.bitwise_xor(update.old, update.new)
        stripes, positions = layout.stripe_of(update.ids)
        name = update.shard.spec.name
        for j in range(layout.m):  # parity j of each row's stripe; a row's parities are on distinct servers
            dest = layout.member_server(stripes, layout.k + j)
            for d in np.unique(dest).tolist():
                rows = np.flatnonzero(dest == d)
                batch(d).tables.add(
                    table=name, parity_slots=layout.parity_slot(stripes[rows], j).tobytes(),
                    positions=positions[rows].tobytes(),
                    parity_index=np.full(len(rows), j, dtype=np.int64).tobytes(), deltas=delta[rows].tobytes())
    for update in push.dense:
        delta = np.bitwise_xor(update.old, update.new).reshape(-1)
        for d in layout.dense_servers(update.dense.spec.name)[1:]:
            batch(d).dense.add(name=update.dense.spec.name, value=delta.tobytes())
    return batches


class ParityOwner:
    """Sequencing and batch building on the owning server; one :class:`DestinationSender` per destination."""

    def __init__(self, host: StrategyHost, options, closed: threading.Event, counters):
        self.host = host
        self.options = options
        self.closed = closed
        self.counters = counters
        self.senders: dict[int, DestinationSender] = {}
        self._inflight: set[int] = set()
        self._last_seq = 0
        self._lock = threading.Lock()

    def confirmed_upto(self) -> int:
        """Every push of this owner with a sequence up to this is acknowledged everywhere."""
        with self._lock:
            return (min(self._inflight) - 1) if self._inflight else self._last_seq

    def sender(self, destination: int) -> DestinationSender:
        s = self.senders.get(destination)
        if s is None:
            s = self.senders[destination] = DestinationSender(
                self.host, destination, self.confirmed_upto, self.options.heartbeat_s, self.closed, self.counters)
        return s

    def on_push(self, push: AppliedPush) -> PushCompletion | None:
        host = self.host
        batches = build_batches(push, host.layout, host.index, host.server_id)
        seq = push.seq
        with self._lock:
            self._last_seq = seq
            if not batches:
                return None
            self._inflight.add(seq)
        destinations = sorted(batches)
        live = live_servers(host.cluster_map)
        destination_ids = [live[d].server_id if d in live else "" for d in destinations]
        for b in batches.values():
            b.destinations.extend(destinations)
            b.destination_ids.extend(destination_ids)
        faults = host.faults
        if faults.armed("after_partial_parity") and len(destinations) >= 2:
            first = destinations[0]
            self.sender(first).submit(batches[first]).result(timeout=self.options.partial_parity_wait_s)
            faults.hit("after_partial_parity")
        futures = [self.sender(d).submit(batches[d]) for d in destinations]

        def done():
            with self._lock:
                self._inflight.discard(seq)

        return PushCompletion(futures, done)
