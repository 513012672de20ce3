"""What a worker carries for the servers: parity batches from owners to their parity servers, the parity
servers' watermarks back to the owners, and every push until its owner says it is durable.

Where the owners relay (strategy option ``relay``: by default only where their direct path has no parity channel,
on TLS), ECRec's parity path rides on the requests a worker sends every step anyway (``docs/protocol.md``, "The
update path"; ``docs/push-path.md``): a push reply carries the owner's parity batches, the worker attaches them
to its next pull or push to each destination, and the destination's reply carries watermarks that the
worker hands to the owner with its next push.  No RPC of its own.  Elsewhere the owners send every batch
directly and the worker carries none.

A push is acknowledged before its parity is applied, so until its owner reports it *confirmed* (applied
at every parity server) the worker keeps it.  When the owner's index is served by a new incarnation (the
owner failed and was replaced), the worker replays its unconfirmed pushes to the replacement, in order and
with their push ids, before anything else it sends there: the replacement answers those recovery kept
"already applied" and applies the others once.  So an acknowledged push survives the owner's failure in
its parity servers or in this worker; it is lost only if the owner and this worker both fail before it is
confirmed -- and then the worker's run has ended (its process is gone), and a restarted worker starts
from what the servers hold (with a new worker name).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

from ecrec.wire import embedding_pb2

log = logging.getLogger("ecrec.courier")

#: an upper bound on the bytes of a repeated field's tag and length around one message
FIELD_BYTES = 6


@dataclass
class HeldPush:
    """A push acknowledged by ``server_id`` as sequence ``seq`` and not yet confirmed there."""

    request: embedding_pb2.PushRequest
    seq: int
    server_id: str


class Courier:
    """One worker's relay of parity batches and watermarks, and its unconfirmed pushes, per server index."""

    def __init__(self):
        self._lock = threading.Lock()
        self._outgoing: dict[int, list[embedding_pb2.RelayBatch]] = {}  # destination index -> batches
        self._acks: dict[int, dict[tuple[int, str], embedding_pb2.ParityWatermark]] = {}  # owner index -> latest
        self._held: dict[int, OrderedDict[tuple, HeldPush]] = {}  # owner index -> pushes, oldest first
        self._held_by: dict[int, Counter] = {}  # owner index -> its held pushes per incarnation that acknowledged them
        self.stats = {"relayed": 0, "replayed": 0, "replayed_already_applied": 0}

    # --- what goes out --------------------------------------------------------------------------------------
    def ack_bytes(self, index: int) -> int:
        """The bytes the watermarks waiting for server ``index`` add to its next push (they always go with it)."""
        with self._lock:
            acks = self._acks.get(index)
            return sum(a.ByteSize() + FIELD_BYTES for a in acks.values()) if acks else 0

    def attach(self, index: int, request, budget: int | None = None) -> int:
        """Puts the batches for server ``index`` (and, on a push, the watermarks of its own batches) into
        ``request``; returns the bytes added.  They leave the courier: a destination that is gone or replaced does
        not need them (its owner sends the replacement everything it has not applied).  ``budget``: the bytes the
        request may grow by; batches beyond it stay for a later request, oldest first (so a request never grows
        past its message limit: a step's part refused for its size while others applied would be half a step)."""
        with self._lock:
            relay = self._outgoing.pop(index, None)
            acks = self._acks.pop(index, None) if isinstance(request, embedding_pb2.PushRequest) else None
            added = sum(a.ByteSize() + FIELD_BYTES for a in acks.values()) if acks else 0
            if relay and budget is not None:
                taken = 0
                for r in relay:
                    size = r.ByteSize() + FIELD_BYTES
                    if added + size > budget:
                        break
                    added += size
                    taken += 1
                if taken < len(relay):
                    self._outgoing[index] = relay[taken:] + self._outgoing.get(index, [])
                relay = relay[:taken]
            elif relay:
                added += sum(r.ByteSize() + FIELD_BYTES for r in relay)
        if relay:
            request.relay.extend(relay)
            self.stats["relayed"] += len(relay)
        if acks:
            request.acks.extend(acks.values())
        return added

    # --- what comes back ----------------------------------------------------------------------------------------
    def received(self, index: int, reply) -> None:
        """A pull or push reply of server ``index``: destinations' watermarks to take to their owners; for a
        push, its batches to deliver; and the server's confirmation, which releases held pushes."""
        with self._lock:
            for wm in reply.watermarks:
                self._acks.setdefault(wm.source, {})[(wm.destination, wm.destination_id)] = wm
            if isinstance(reply, embedding_pb2.PushReply):
                for r in reply.relay:
                    self._outgoing.setdefault(r.destination, []).append(r)
            held = self._held.get(index)
            if held and reply.server_id:
                while held:  # oldest first: confirmation is a prefix
                    key, h = next(iter(held.items()))
                    if h.server_id != reply.server_id or not 0 < h.seq <= reply.confirmed_upto:
                        break
                    self._release_locked(index, key)

    def pushed(self, index: int, request: embedding_pb2.PushRequest, reply: embedding_pb2.PushReply) -> None:
        """Server ``index`` acknowledged ``request``; keep it until confirmed (if its strategy confirms)."""
        self.received(index, reply)
        key = (request.push_id.worker, request.push_id.incarnation, request.push_id.sequence)
        with self._lock:
            self._release_locked(index, key)  # held already (a retry): held again as this acknowledgement says
            if reply.seq > reply.confirmed_upto and reply.server_id:
                self._held.setdefault(index, OrderedDict())[key] = HeldPush(request, reply.seq, reply.server_id)
                self._held_by.setdefault(index, Counter())[reply.server_id] += 1
            # else durable already (or a strategy without confirmations)

    def _release_locked(self, index: int, key: tuple) -> HeldPush | None:
        held = self._held.get(index)
        h = held.pop(key, None) if held else None
        if h is not None:
            self._uncount_locked(index, h.server_id)
        return h

    def _uncount_locked(self, index: int, server_id: str) -> None:
        by = self._held_by[index]
        by[server_id] -= 1
        if not by[server_id]:
            del by[server_id]

    # --- replay -----------------------------------------------------------------------------------------------
    def holds(self, index: int) -> bool:
        """Whether pushes to ``index`` wait for their confirmation (read without the lock: a hint)."""
        return bool(self._held.get(index))

    def held_elsewhere(self, index: int, server_id: str | None) -> bool:
        """Whether a held push of ``index`` was acknowledged by another incarnation than ``server_id`` (the one
        serving it now): nothing else may go there before it is replayed.  Any of them, not only the oldest: a
        replay cut short leaves the oldest replayed and a later one not, and a new push overtaking that one would
        raise the worker's high-water mark there above it (the replay then answered "already applied", the push
        lost: the simulator's schedule, ``tests/test_simulation.py``)."""
        with self._lock:
            by = self._held_by.get(index)  # O(1) per request, however many pushes are held
            return bool(by) and (len(by) > 1 or server_id not in by)

    def to_replay(self, index: int, server_id: str) -> list[tuple[tuple[str, int], embedding_pb2.PushRequest]]:
        """The held pushes of ``index`` acknowledged by another incarnation than ``server_id``, oldest first."""
        with self._lock:
            held = self._held.get(index)
            if not held:
                return []
            return [(key, h.request) for key, h in held.items() if h.server_id != server_id]

    def replayed(self, index: int, key: tuple[str, int], reply: embedding_pb2.PushReply) -> None:
        self.stats["replayed"] += 1
        self.received(index, reply)
        with self._lock:
            h = self._held.get(index, {}).get(key)
            if h is None:
                return
            if reply.already_applied and reply.seq == 0 or reply.seq <= reply.confirmed_upto:
                self.stats["replayed_already_applied"] += int(reply.already_applied)
                self._release_locked(index, key)  # kept by recovery (durable) or confirmed already
            else:
                self._uncount_locked(index, h.server_id)  # held on, as acknowledged by the incarnation that answered
                self._held_by[index][reply.server_id] += 1
                h.seq, h.server_id = reply.seq, reply.server_id

    def held_indices(self) -> set[int]:
        """The indices whose pushes wait for their confirmation."""
        with self._lock:
            return {i for i, held in self._held.items() if held}

    def unconfirmed(self, index: int | None = None) -> int:
        """Pushes held until their owner confirms them: to every server, or to server ``index``."""
        with self._lock:
            if index is not None:
                return len(self._held.get(index, ()))
            return sum(len(h) for h in self._held.values())

    def pending_relay(self) -> int:
        with self._lock:
            return sum(len(r) for r in self._outgoing.values())
