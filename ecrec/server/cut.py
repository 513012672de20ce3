"""A snapshot's cut on one server: a short hold on pushes, then its rows as they were at that moment.

A snapshot taken while workers train must hold no half step (``ecrec.snapshot.cut`` finds the moment).  The
server's part, here: :class:`PushHold` holds the pushes that arrive (they wait, then apply), except those a
snapshot admits to complete a step already half applied; at the cut, :class:`ServerCuts` notes the last push
sequence and the hold ends -- milliseconds after it began.  From then on every row a push changes first leaves
its bytes at the cut in the cut's copy (:class:`ShardCut`, only rows changed since), and the snapshot reads
rows as they were at the cut while training goes on.  A cut is dropped when the snapshot ends, or expires: at the
TTL its snapshot asked for (its write deadline) or ``max_ttl_s`` at the latest, and, once used, when it has gone
:data:`IDLE_S` unused since -- no read through it (this server's or another's read of rows at the cut) and no write
of this server's part under way (:meth:`ServerCuts.kept`).  A snapshot client killed mid-save (SIGKILL: no drop)
leaves its cuts until the servers' writes end plus :data:`IDLE_S`, not for the whole write deadline it asked for.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import numpy as np

from ecrec import errors

log = logging.getLogger("ecrec.server")

#: a cut unused this long (no read through it, no write of this server's part under way) expires (s)
IDLE_S = 120.0


class PushHold:
    """Pushes wait while a snapshot holds them (see the module docstring).  One holder at a time; a hold lasts
    at most ``max_s`` from when it was taken however often it is extended, and expires by itself."""

    def __init__(self, apply_lock: threading.Lock, max_s: float, max_waiters: int = 4):
        self._cond = threading.Condition(apply_lock)
        self.max_s = max_s
        self.max_waiters = max_waiters  # pushes that wait at once: the rest are told to retry (handler threads
        self.waiting = 0                # must stay free for the snapshot's own calls)
        self.holder = ""
        self.taken_at = 0.0
        self.expires_at = 0.0
        self.admitted: dict[str, int] = {}  # push key -> the highest sequence that passes
        self.expired = ""  # the last holder whose hold expired before it ended it
        self._past: list[tuple[float, float]] = []  # (taken, ended) of recent holds: pushes held at most max_s a minute

    def _standing_locked(self) -> bool:
        if self.holder and time.monotonic() >= self.expires_at:
            log.warning("a snapshot's hold on pushes expired before its cut: pushes go on")
            self.expired = self.holder
            self._ended(self.expires_at)
        return bool(self.holder)

    def _ended(self, at: float) -> None:
        self._past.append((self.taken_at, at))
        self.holder, self.admitted = "", {}
        self._cond.notify_all()

    def held_last_minute_s(self) -> float:
        now = time.monotonic()
        self._past = [(a, b) for a, b in self._past if b > now - 60.0]
        return sum(b - max(a, now - 60.0) for a, b in self._past)

    def holds_for(self, holder: str) -> bool:
        """Whether ``holder``'s hold stands now (the caller holds the apply lock)."""
        return self._standing_locked() and self.holder == holder

    def take(self, holder: str, hold_s: float) -> None:
        """Holds pushes (or extends ``holder``'s hold) for ``hold_s`` seconds, at most until ``max_s`` after it
        was taken; the caller holds the apply lock, so no push is halfway applied.  ``ResourceExhausted`` while
        another holder's hold stands."""
        now = time.monotonic()
        if self._standing_locked() and self.holder != holder:
            raise errors.ResourceExhausted("another snapshot holds this server's pushes now (one at a time): retry "
                                           "in a moment")
        if self.holder != holder:
            if self.expired == holder:
                raise errors.FailedPrecondition("this snapshot's hold on pushes expired: take the cut again")
            held = self.held_last_minute_s()
            if held >= 0.999 * self.max_s:  # holds last milliseconds as a rule: a flood
                raise errors.ResourceExhausted(f"pushes were held {held:.1f} s in the last minute "
                                               f"(at most --max-push-hold-s {self.max_s:g} s a minute): retry later")
            self.holder, self.taken_at, self.admitted = holder, now, {}
        self.expires_at = min(now + hold_s, self.taken_at + self.max_s)

    def admit(self, holder: str, admitted: dict[str, int]) -> None:
        """Lets the pushes of ``admitted`` (push key -> highest sequence) through ``holder``'s hold: the other
        parts of steps half applied elsewhere."""
        if not self.holds_for(holder):
            raise errors.FailedPrecondition("this snapshot holds no pushes here (its hold expired or was never "
                                            "taken): take the cut again")
        for worker, sequence in admitted.items():
            self.admitted[worker] = max(sequence, self.admitted.get(worker, 0))
        self._cond.notify_all()

    def release(self, holder: str) -> None:
        if self.holds_for(holder):
            self._ended(time.monotonic())

    def wait_locked(self, key: tuple[str, int]) -> None:
        """Waits, the apply lock released meanwhile, while a hold stands that does not admit push ``key`` (at most
        until it expires: a few seconds).  With ``max_waiters`` pushes waiting already it raises ``Busy`` instead
        (the worker retries the same push in a moment): a waiting push holds a handler thread, and the
        snapshot's next calls need one."""
        worker, sequence = key
        if not (self._standing_locked() and sequence > self.admitted.get(worker, 0)):
            return
        if self.waiting >= self.max_waiters:
            raise errors.Busy("a snapshot's cut holds pushes here for a moment: retry this push")
        self.waiting += 1
        try:
            while self._standing_locked() and sequence > self.admitted.get(worker, 0):
                self._cond.wait(max(0.001, self.expires_at - time.monotonic()))
        finally:
            self.waiting -= 1


class ShardCut:
    """One table shard's rows as they were at a cut: the bytes of each row a push changed since (saved by the
    push, before it writes), beside the shard's current rows for the others."""

    def __init__(self, seq: int, num_slots: int, row_bytes: int):
        self.seq = seq
        self.num_slots = num_slots
        self._where: np.ndarray | None = None  # slot -> its saved row, -1: unchanged (made at the first save: a
        # cut is marked while pushes are held, and must cost nothing there)
        self._rows = np.empty((0, row_bytes), dtype=np.uint8)
        self._count = 0
        self.broken = ""  # why the rows at the cut are gone (rewritten outside any push)

    @property
    def nbytes(self) -> int:
        return (0 if self._where is None else self._where.nbytes) + self._rows.nbytes

    def save(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Keeps ``rows`` (their bytes at the cut) of ``slots``, written now for the first time since the cut; the
        shard's lock is held."""
        n = len(slots)
        if self._where is None:
            self._where = np.full(self.num_slots, -1, dtype=np.int32 if self.num_slots < 2**31 else np.int64)
        if self._count + n > len(self._rows):  # at most one row a slot: never more than the shard
            size = min(max(2 * len(self._rows), self._count + n, 1024), self.num_slots)
            grown = np.empty((size, self._rows.shape[1]), dtype=np.uint8)
            grown[: self._count] = self._rows[: self._count]
            self._rows = grown
        self._rows[self._count:self._count + n] = rows
        self._where[slots] = np.arange(self._count, self._count + n)
        self._count += n

    def unchanged(self, versions: np.ndarray) -> bool:
        """Whether no row of ``versions`` (read now) changed since the cut: the rows read now are the rows at it
        (a snapshot's read then copies them once); raises as :meth:`substitute` does once the cut is broken."""
        if self.broken:
            raise errors.FailedPrecondition(f"{self.broken} while the snapshot was written: take it again")
        return not bool((versions > self.seq).any())

    def substitute(self, slots: np.ndarray, payload: np.ndarray, versions: np.ndarray) -> None:
        """Puts back, into ``payload`` (rows of ``slots`` read now, with their ``versions``), the bytes at the cut of
        rows changed since; the shard's lock is held."""
        if self.unchanged(versions):
            return
        newer = versions > self.seq
        where = self._where[slots[newer]] if self._where is not None else np.full(int(newer.sum()), -1)
        if (where < 0).any():
            raise errors.FailedPrecondition("a row changed since the snapshot's cut by other than a push (a rebuild): "
                                            "its bytes at the cut are gone; take the snapshot again")
        payload[newer] = self._rows[where]


class DenseCut:
    """A dense tensor's payload at a cut (saved by the first push that changes it since)."""

    def __init__(self, seq: int):
        self.seq = seq
        self.payload: np.ndarray | None = None
        self.broken = ""

    @property
    def nbytes(self) -> int:
        return 0 if self.payload is None else self.payload.nbytes


class ServerCuts:
    """The cuts this server keeps for snapshots being written, by holder; each expires by itself."""

    def __init__(self, max_cuts: int = 2, max_ttl_s: float = 3600.0):
        self.max_ttl_s = max_ttl_s
        # holder -> [expires_at unless in use, {(kind, name): (cut, its shard)}, the latest it may expire, writes
        # of this server's part under way]
        self._cuts: dict[str, list] = {}
        self.max_cuts = max_cuts
        self._lock = threading.RLock()

    @property
    def nbytes(self) -> int:
        """Memory the cuts hold (their maps and the rows changed since)."""
        with self._lock:
            return sum(cut.nbytes for _, parts, *_ in self._cuts.values() for cut, _ in parts.values())

    def mark(self, holder: str, seq: int, ttl_s: float, tables, dense) -> None:
        """Marks a cut at push sequence ``seq`` on every table shard and dense tensor (the apply lock is held, no
        push halfway)."""
        self.expire()
        with self._lock:
            if len(self._cuts) >= self.max_cuts and holder not in self._cuts:
                soonest = max(0.0, min(expires for expires, *_ in self._cuts.values()) - time.monotonic())
                raise errors.ResourceExhausted(
                    f"{len(self._cuts)} snapshots hold cuts here (at most {self.max_cuts}): retry when one ends (a cut "
                    f"whose snapshot was killed is freed when it expires, the first in {soonest:.0f} s)")
            self._mark_locked(holder, seq, ttl_s, tables, dense)

    def _mark_locked(self, holder: str, seq: int, ttl_s: float, tables, dense) -> None:
        parts: dict = {}
        for shard in tables:
            cut = ShardCut(seq, shard.num_slots, shard.spec.row_bytes)
            parts[("table", shard.name)] = (cut, shard)
            shard.add_cut(holder, cut)
        for d in dense:
            cut = DenseCut(seq)
            parts[("dense", d.name)] = (cut, d)
            d.add_cut(holder, cut)
        now = time.monotonic()
        latest = now + min(ttl_s, self.max_ttl_s)
        self._cuts[holder] = [latest, parts, latest, 0]  # until its first use, the TTL asked for

    def _used_locked(self, entry: list) -> None:
        entry[0] = min(entry[2], time.monotonic() + IDLE_S)

    @contextlib.contextmanager
    def kept(self, holder: str):
        """Keeps ``holder``'s cut (if it is here) while the block runs -- this server writing its part, which may
        go minutes between reads through it (a slow disk) -- and :data:`IDLE_S` after (up to its latest expiry)."""
        with self._lock:
            entry = self._cuts.get(holder)
            if entry is not None:
                entry[3] += 1
        try:
            yield
        finally:
            if entry is not None:
                with self._lock:
                    entry[3] -= 1
                    self._used_locked(entry)

    def get(self, holder: str, kind: str, name: str):
        """The cut of ``holder`` on table or dense tensor ``name`` (``kind``); a read through it keeps the cut
        :data:`IDLE_S` from now (up to its latest expiry)."""
        self.expire()
        with self._lock:
            entry = self._cuts.get(holder)
            if entry is not None:
                self._used_locked(entry)
        if entry is None:
            raise errors.FailedPrecondition("no such snapshot cut on this server (it expired, or the server was "
                                            "replaced since): take the snapshot again")
        part = entry[1].get((kind, name))
        if part is None:
            raise errors.FailedPrecondition(f"{kind} {name!r} was created after the snapshot's cut")
        return part[0]

    def drop(self, holder: str) -> bool:
        """Forgets ``holder``'s cut and frees its copies; returns whether it was still here."""
        with self._lock:
            entry = self._cuts.pop(holder, None)
        if entry is None:
            return False
        for _, owner in entry[1].values():
            owner.drop_cut(holder)
        return True

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            gone = [h for h, (expires_at, _, latest, writing) in self._cuts.items()
                    if now >= latest or (now >= expires_at and not writing)]
        for holder in gone:
            log.warning("a snapshot's cut expired before the snapshot ended: its copies are freed")
            self.drop(holder)

    def __len__(self) -> int:
        with self._lock:
            return len(self._cuts)
