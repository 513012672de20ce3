"""A snapshot's cut: a moment no worker's step is half applied, held on every server while they write.

A step is one push with one push id, sent at once to every server it touches (``PushRequest.parts`` says how
many).  A snapshot taken while workers train must not hold part of a step: rows of two different steps.  So
before the servers write, :class:`Cut` asks every server to hold the pushes that arrive from then on
(``HoldPushes``: they wait, then apply), and reads, at that moment, each worker's last push applied there.  A
worker whose last push reached fewer servers than it went to is mid-step: the holds are released so that its
other parts land, and taken again a moment later, until every worker is between steps.  The servers then write
what they hold, and the release says whether each hold stood throughout (a hold expires by itself, so that a
snapshotter that died cannot stop training); one that did not means pushes ran meanwhile, and the snapshot is
refused.

A step half applied and left so -- its worker died between its parts -- stays half applied in the cluster
itself; once every applied part of it is older than :data:`ABANDONED_S` the cut takes the cluster as it is and
names the step in the manifest (``half_applied_steps``).
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from ecrec.wire import embedding_pb2

log = logging.getLogger("ecrec.snapshot")

#: a half-applied step whose applied parts are all older than this is taken as abandoned (its worker stopped
#: mid-step), not as in flight: a worker retries a missing part within its call deadline (30 s by default)
ABANDONED_S = 45.0


class CutError(RuntimeError):
    """No consistent cut could be taken or kept (the message says why); nothing was written."""


def half_applied(replies: dict[int, embedding_pb2.HoldPushesReply]) -> list[dict]:
    """The workers whose last push reached fewer servers than it went to, from each index's hold reply: for each,
    its push key, sequence, the servers it went to, the indices holding it, and the age of its newest part."""
    per_worker: dict[str, dict[int, embedding_pb2.PushMark]] = {}
    for index, reply in replies.items():
        for mark in reply.marks:
            per_worker.setdefault(mark.worker, {})[index] = mark
    out = []
    for worker, marks in per_worker.items():
        top = max(m.sequence for m in marks.values())
        holding = {i: m for i, m in marks.items() if m.sequence == top}
        parts = max(m.parts for m in holding.values())
        if parts and len(holding) < parts:
            out.append({"worker": worker, "sequence": top, "parts": parts, "applied_at": sorted(holding),
                        "age_s": min(m.age_s for m in holding.values())})
    return out


class Cut:
    """Holds every server's pushes at a moment between steps (see the module docstring)."""

    def __init__(self, cluster, indices: list[int], hold_s: float):
        self.cluster, self.indices, self.hold_s = cluster, list(indices), float(hold_s)
        self.holder = uuid.uuid4().hex
        self.attempts = 0
        self.abandoned: list[dict] = []
        self._held = False

    def _call_all(self, hold_s: float) -> dict[int, embedding_pb2.HoldPushesReply]:
        peers = self.cluster.peers
        request = embedding_pb2.HoldPushesRequest(holder=self.holder, hold_s=hold_s)

        def call(index: int):
            address = peers.address_of(index)
            if address is None:
                raise CutError(f"no live server holds index {index}")
            try:
                return peers.stub(address).HoldPushes(request, timeout=self.cluster.config.rpc_timeout_s,
                                                      metadata=peers.metadata())
            except grpc.RpcError as exc:
                raise CutError(f"server {index} ({address}) HoldPushes: {exc.code().name}: {exc.details()}") from None

        with ThreadPoolExecutor(max_workers=max(1, len(self.indices)), thread_name_prefix="ecrec-cut") as pool:
            futures = {i: pool.submit(call, i) for i in self.indices}
            replies, error = {}, None
            for i, future in futures.items():
                try:
                    replies[i] = future.result()
                except CutError as exc:
                    error = error or exc
        if error is not None:
            if hold_s > 0:
                self._release_quietly()
            raise error
        return replies

    def take(self, timeout_s: float) -> None:
        """Holds every server's pushes at a moment no worker's step is half applied; raises :class:`CutError`
        when none came within ``timeout_s`` (workers that never pause between steps), nothing held then."""
        deadline = time.monotonic() + timeout_s
        pause = 0.002
        while True:
            self.attempts += 1
            replies = self._call_all(self.hold_s)
            self._held = True
            mid = half_applied(replies)
            in_flight = [w for w in mid if w["age_s"] < ABANDONED_S]
            if not in_flight:
                self.abandoned = mid
                for w in mid:
                    log.warning("snapshot: worker %s's push %d reached servers %s of %d %.0f s ago and no more: taken "
                                "as it stands in the cluster", w["worker"], w["sequence"], w["applied_at"],
                                w["parts"], w["age_s"])
                return
            self._release_quietly()
            if time.monotonic() + pause > deadline:
                names = ", ".join(f"{w['worker']} (push {w['sequence']} on {len(w['applied_at'])} of {w['parts']} "
                                  "servers)" for w in in_flight[:3])
                raise CutError(f"no moment between steps in {timeout_s:.0f} s ({self.attempts} tries): {names} "
                               "mid-step each time; a snapshot holds no half step, so it was not taken. Pause the "
                               "workers between steps, or snapshot from the training loop (Cluster.snapshot_every)")
            time.sleep(pause)  # the step's other parts land meanwhile
            pause = min(pause * 2, 0.1)

    def release(self) -> list[int]:
        """Releases every hold; returns the indices whose hold did not stand throughout (empty: the cut held)."""
        if not self._held:
            return []
        self._held = False
        replies = self._call_all(0.0)
        return sorted(i for i, reply in replies.items() if not reply.held_throughout)

    def _release_quietly(self) -> None:
        self._held = False
        try:
            self._call_all(0.0)
        except CutError as exc:  # the holds expire by themselves
            log.warning("snapshot: releasing the hold on pushes: %s (it expires by itself)", exc)
