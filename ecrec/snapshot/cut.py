"""A snapshot's cut: a moment no worker's step is half applied, taken on every server at once.

A step is one push with one push id, sent at once to every server it touches (``PushRequest.parts`` says how
many).  A snapshot taken while workers train must not hold part of a step: rows of two different steps.
:class:`Cut` asks every server to hold the pushes that arrive from then on (``HoldPushes``: they wait, then
apply) and reads each worker's last push applied there.  A worker whose last push reached fewer servers than it
went to is mid-step: its remaining parts are admitted through the holds until they land.  Then every server
marks the cut -- its rows as they are now -- and ends its hold, a few milliseconds after it began; the servers
write their parts as of the cut while pushes go on (a row a push changes leaves its bytes at the cut first:
``ecrec.server.cut``).  A hold expires by itself and a cut too, so that a snapshotter that died cannot stop
training or keep memory.

A step half applied and left so -- its worker died between its parts, or says more parts than it sends --
stays half applied in the cluster itself: once every applied part of it is older than :data:`ABANDONED_S`, or
when its other parts did not come within :attr:`Cut.ADMIT_S` of being let through in a few attempts running,
the cut takes the cluster as it is and names the step in the manifest (``half_applied_steps``).
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from ecrec.net.peers import warn_level
from ecrec.wire import embedding_pb2

log = logging.getLogger("ecrec.snapshot")

#: a half-applied step whose applied parts are all older than this is taken as abandoned (its worker stopped
#: mid-step), not as in flight: a worker retries a missing part within its retry deadline (120 s by default) and
#: one call deadline (30 s)
ABANDONED_S = 180.0


class CutError(RuntimeError):
    """No consistent cut could be taken or kept (the message says why); nothing was written."""


def half_applied(replies: dict[int, embedding_pb2.HoldPushesReply]) -> list[dict]:
    """The workers whose last push reached fewer servers than it went to, from each index's hold reply: for each,
    its push key, sequence, the servers it went to, the indices holding it, and the age of its newest part."""
    per_worker: dict[str, dict[int, embedding_pb2.PushMark]] = {}
    for index, reply in replies.items():
        for mark in reply.marks:
            seen = per_worker.setdefault(mark.worker, {})
            if index not in seen or mark.sequence > seen[index].sequence:  # applied, or a later one refused
                seen[index] = mark
    out = []
    for worker, marks in per_worker.items():
        top = max(m.sequence for m in marks.values())
        holding = {i: m for i, m in marks.items() if m.sequence == top}  # applied there, or refused for good
        parts = max(m.parts for m in holding.values())
        if parts and len(holding) < parts:
            out.append({"worker": worker, "sequence": top, "parts": parts, "applied_at": sorted(holding),
                        "age_s": min(m.age_s for m in holding.values())})
    return out


class Cut:
    """A cut on every server (see the module docstring): :meth:`take`, then the servers write with
    ``cut=holder``, then :meth:`drop`."""

    #: each hold lasts at most this long (the servers cap it at --max-push-hold-s)
    HOLD_S = 5.0
    #: how long an attempt lets half-applied steps complete (their parts land in milliseconds) before it ends its
    #: holds and tries again: failed attempts must not eat the servers' budget of held time
    ADMIT_S = 1.0
    #: attempts that wait for every half-applied step to complete; later ones take a step whose missing parts did
    #: not come within ADMIT_S of being let through as it stands (named in the manifest): a worker that died
    #: mid-step, or one that says more parts than it sends, must not keep every snapshot from being taken
    STRICT_ATTEMPTS = 3

    def __init__(self, cluster, indices: list[int], ttl_s: float):
        self.cluster, self.indices, self.ttl_s = cluster, list(indices), float(ttl_s)
        self.holder = uuid.uuid4().hex
        self.attempts = 0
        self.admitted = 0
        self.abandoned: list[dict] = []
        self.held_s = 0.0  # the longest the servers held pushes for an attempt (seconds)

    def _call_all(self, ending: bool = False, **fields) -> dict[int, embedding_pb2.HoldPushesReply]:
        """``HoldPushes`` with ``fields`` on every server at once; ``ending`` (holds ended, a cut dropped): an
        index no live server holds has nothing to end and is skipped."""
        peers = self.cluster.peers
        request = embedding_pb2.HoldPushesRequest(holder=self.holder, max_age_s=2 * ABANDONED_S, **fields)

        def call(index: int):
            address = peers.address_of(index)
            if address is None:
                if ending:
                    return None
                raise CutError(f"no live server holds index {index}")
            try:
                return peers.stub(address).HoldPushes(request, timeout=self.cluster.config.rpc_timeout_s,
                                                      metadata=peers.metadata())
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    # gone or paused: the coordinator hears it (it promotes a standby sooner) and the map it
                    # answers names the replacement the next attempt asks
                    peers.coordinator.report_failure(address, f"HoldPushes: {exc.code().name}")
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
            raise error
        return replies

    def take(self, timeout_s: float) -> None:
        """Marks the cut on every server at a moment no worker's step is half applied; raises :class:`CutError`
        when that did not happen within ``timeout_s`` (nothing held or marked then)."""
        deadline = time.monotonic() + timeout_s
        pause = 0.01
        last = "no attempt"
        while time.monotonic() < deadline:
            self.attempts += 1
            self.holder = uuid.uuid4().hex  # a fresh one: a hold that expired is never taken again under its id
            t0 = time.monotonic()
            try:
                self._hold_and_mark(min(deadline, t0 + self.ADMIT_S), accept_stuck=self.attempts > self.STRICT_ATTEMPTS)
                self.held_s = max(self.held_s, time.monotonic() - t0)
                return
            except CutError as exc:
                if str(exc) != last:  # what keeps the cut from being taken, said once (it may take the deadline)
                    log.warning("snapshot: no cut yet: %s; trying again for up to %.0f s", exc,
                                max(0.0, deadline - time.monotonic()))
                last = str(exc)
                self._end_quietly()
                try:  # the next attempt asks the servers of the map as it is now (a replacement, not the dead)
                    self.cluster.refresh_map()
                except grpc.RpcError:
                    pass  # the coordinator is unreachable too: the next attempt asks the map as it was
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        raise CutError(f"no consistent cut within {timeout_s:.0f} s ({self.attempts} tries; the last: {last}); the "
                       "snapshot was not taken")

    def _hold_and_mark(self, until: float, accept_stuck: bool = False) -> None:
        replies = self._call_all(hold_s=self.HOLD_S)
        stuck: list[dict] = []
        while True:
            mid = half_applied(replies)
            in_flight = [w for w in mid if w["age_s"] < ABANDONED_S]
            if not in_flight:
                break
            if time.monotonic() > until:
                if accept_stuck:  # their other parts did not come when let through: taken as they stand
                    stuck = in_flight
                    break
                names = ", ".join(f"{w['worker']} (push {w['sequence']} on {len(w['applied_at'])} of {w['parts']} "
                                  "servers)" for w in in_flight[:3])
                raise CutError(f"steps still half applied after their other parts were let through: {names}")
            admit = [embedding_pb2.PushMark(worker=w["worker"], sequence=w["sequence"]) for w in in_flight]
            self.admitted += len(admit)
            time.sleep(0.002)  # their other parts are on their way: let them through, then look again
            replies = self._call_all(hold_s=self.HOLD_S, admit=admit)
        self.abandoned = [w for w in half_applied(replies) if w["age_s"] >= ABANDONED_S] + stuck
        for w in self.abandoned:
            log.warning("snapshot: worker %s's push %d reached servers %s of %d %.0f s ago and no more: taken as it "
                        "stands in the cluster", w["worker"], w["sequence"], w["applied_at"], w["parts"], w["age_s"])
        # the cut (a server whose hold did not stand refuses to mark it: FAILED_PRECONDITION); the holds end
        self._call_all(mark_cut=True, cut_ttl_s=self.ttl_s)

    def drop(self) -> None:
        """Forgets the cut on every server (the snapshot ended); one that cannot be reached lets it expire."""
        try:
            self._call_all(ending=True, drop_cut=True)
        except CutError as exc:
            log.warning("snapshot: dropping its cut: %s (it expires by itself)", exc)

    def _end_quietly(self) -> None:
        """Ends the holds and drops any cut marked (a failed attempt)."""
        for fields in ({"hold_s": 0.0}, {"drop_cut": True}):
            try:
                self._call_all(ending=True, **fields)
            except CutError as exc:  # the holds and cuts expire by themselves
                log.log(warn_level(("cut-end", str(exc))), "snapshot: ending an attempt at a cut: %s (it expires by "
                        "itself)", exc)
