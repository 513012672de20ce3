"""Which pushes a server applied (:class:`AppliedPushes`, bounded in bytes, so a retry is answered "already
applied") and the numbers it gives them (:class:`PushSequencer`, the versions stamped on the rows a push changes)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict

import numpy as np

from ecrec import errors

#: bytes a table entry of :class:`AppliedPushes` costs beside its worker's name (dict slots of the mark, its parts
#: and time, key tuple, ints; measured with ``sys.getsizeof``, rounded up)
ENTRY_OVERHEAD_BYTES = 320


class AppliedPushes:
    """Which pushes this server applied, in bounded memory, so a retry is answered "already applied".

    A worker sends its pushes to a server in increasing sequence and retries or replays only pushes it was
    not sure of, oldest first, so per worker incarnation the highest sequence applied (its *high-water mark*)
    tells applied from new: a push at or below it was applied here or, after a recovery, kept.  Pushes not
    yet confirmed also keep the sequence they got here (``recent``), which a retry's reply carries.

    Bounds, in bytes (``max_bytes``, names counted with :data:`ENTRY_OVERHEAD_BYTES` each): the marks take at
    most three quarters; the recent sequences take the rest, oldest forgotten first (a forgotten one falls back
    to the mark: still "already applied", only the reply's sequence is 0).  Marks a recovery installs
    (``force``) are never refused: they only ever come from servers.

    A mark is never simply forgotten: a retry of an old push of its incarnation would then apply twice.  When
    the marks are full, a new incarnation is admitted (:meth:`admit`) by forgetting marks idle for more than
    ``forget_idle_s`` (far beyond any worker's retry deadline) whose pushes are all confirmed; each forgotten
    incarnation goes into a Bloom filter (:class:`Forgotten`), and a push of an incarnation in it is refused
    (``FailedPrecondition``: it may be a retry of a push applied here) -- refused rather than forgotten when
    unsure: a false positive refuses a new incarnation, never applies an update twice.  The SDK then goes on
    under another incarnation (its pushes of the forgotten one were all confirmed, so none is retried).  With no
    idle mark to forget, or the filter full, a new incarnation is refused (``ResourceExhausted``) and nothing is
    forgotten.
    """

    def __init__(self, max_bytes: int = 64 << 20, forget_idle_s: float = 3600.0):
        self.max_bytes = max_bytes
        self.max_recent_bytes = max_bytes // 4
        self.max_marks_bytes = max_bytes - self.max_recent_bytes
        self.forget_idle_s = forget_idle_s
        self._marks: dict[str, int] = {}
        self._parts: dict[str, int] = {}  # worker -> how many servers its push at the mark went to (0: not said)
        self._when: OrderedDict[str, float] = OrderedDict()  # worker -> when its mark last moved, oldest first
        self._recent: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._recent_of: dict[str, int] = {}  # worker -> its entries in _recent (pushes not yet confirmed)
        # worker -> (sequence, parts, when) of its last push refused here: a snapshot's cut counts that part as ended
        self._refused: OrderedDict[str, tuple[int, int, float]] = OrderedDict()
        self.forgotten = Forgotten()
        self.marks_bytes = 0
        self.recent_bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def cost(worker: str) -> int:
        return len(worker) + ENTRY_OVERHEAD_BYTES

    def get(self, key: tuple[str, int]) -> int | None:
        """The push's sequence here (0: applied before the last confirmation, or by an earlier incarnation of
        this index), or None when it was not applied."""
        worker, sequence = key
        with self._lock:
            seq = self._recent.get(key)
            if seq is not None:
                return seq
            mark = self._marks.get(worker)
            return 0 if mark is not None and sequence <= mark else None

    def admit(self, worker: str) -> None:
        """Makes room for ``worker`` (a push key, ``name#digest``) when it is new here: forgets idle marks if it
        must (see the class docstring).  Raises ``FailedPrecondition`` for an incarnation forgotten here, and
        ``ResourceExhausted`` when no room can be made; then nothing changed."""
        with self._lock:
            if worker in self._marks:
                return
            if worker in self.forgotten:
                raise errors.FailedPrecondition(
                    f"this server {errors.FORGOTTEN_INCARNATION} {worker.split('#')[0]!r} after it was idle (its table of "
                    "applied pushes was full): a push of it may be a retry of one applied here, so none is applied; "
                    "start a new incarnation of the worker (a new Cluster)")
            if self.marks_bytes + self.cost(worker) <= self.max_marks_bytes:
                return
            if self._forget_idle_locked(self.marks_bytes + self.cost(worker) - self.max_marks_bytes):
                return
            raise errors.ResourceExhausted(
                f"this server remembers the pushes of {len(self._marks)} worker incarnations in "
                f"{self.marks_bytes} bytes (bound --max-applied-bytes {self.max_bytes}: three quarters for them), "
                f"none idle for {self.forget_idle_s:g} s (--forget-idle-marks-s); a new incarnation is refused "
                "(forgetting a mark in use could apply its retried pushes twice)")

    def _forget_idle_locked(self, need: int) -> bool:
        """Forgets marks idle longer than ``forget_idle_s`` with no unconfirmed push, oldest first, until ``need``
        bytes are free -- and some more, a sixteenth of the table, so that the next new incarnations are admitted
        without another pass; returns whether ``need`` bytes are free (nothing forgotten when they cannot be).
        The marks are kept in the order they last moved: the pass stops at the first one not idle."""
        if self.forgotten.full:
            return False
        now, want = time.monotonic(), max(need, self.max_marks_bytes // 16)
        chosen, freed = [], 0
        for worker, when in self._when.items():
            if freed >= want or len(chosen) >= self.forgotten.room or now - when <= self.forget_idle_s:
                break
            if self._recent_of.get(worker):
                continue  # a push of it is not confirmed yet
            chosen.append(worker)
            freed += self.cost(worker)
        if freed < need:
            return False
        for worker in chosen:
            self.forgotten.add(worker)
            del self._marks[worker]
            self._parts.pop(worker, None)
            self._when.pop(worker, None)
            self.marks_bytes -= self.cost(worker)
        return True

    def add(self, key: tuple[str, int], seq: int = 0, force: bool = False, parts: int = 0) -> None:
        """Records an applied push; a new incarnation must have been admitted (:meth:`admit`) unless ``force``.
        ``parts``: how many servers the push went to (what a snapshot's cut checks, :meth:`marks`)."""
        worker, sequence = key
        with self._lock:
            mark = self._marks.get(worker)
            if mark is None:
                if not force and self.marks_bytes + self.cost(worker) > self.max_marks_bytes:
                    raise errors.ResourceExhausted(f"no room for the mark of a new worker incarnation "
                                                   f"(--max-applied-bytes {self.max_bytes})")
                self._marks[worker] = sequence
                self._parts[worker], self._when[worker] = parts, time.monotonic()
                self.marks_bytes += self.cost(worker)
            elif sequence > mark:
                self._marks[worker] = sequence
                self._parts[worker], self._when[worker] = parts, time.monotonic()
                self._when.move_to_end(worker)
            if seq:
                if key not in self._recent:
                    self.recent_bytes += self.cost(worker)
                    self._recent_of[worker] = self._recent_of.get(worker, 0) + 1
                self._recent[key] = seq
                while self.recent_bytes > self.max_recent_bytes and self._recent:
                    (old, _), _ = self._recent.popitem(last=False)
                    self._dropped_recent_locked(old)

    #: refused pushes remembered (the last of each worker, newest kept)
    MAX_REFUSED = 4096

    def refused(self, key: tuple[str, int], parts: int) -> None:
        """Notes that push ``key`` (which went to ``parts`` servers) was refused here, not applied."""
        worker, sequence = key
        with self._lock:
            self._refused[worker] = (sequence, parts, time.monotonic())
            self._refused.move_to_end(worker)
            while len(self._refused) > self.MAX_REFUSED:
                self._refused.popitem(last=False)

    def marks(self, max_age_s: float | None = None) -> list[tuple[str, int, int, float, bool]]:
        """The worker incarnations' marks here, those that moved within ``max_age_s`` (None: all), newest first:
        ``(push key, highest sequence applied, the servers that push went to or 0, seconds since it moved,
        False)``; and, newer than its mark, a worker's last push refused here: ``(..., True)``."""
        now = time.monotonic()
        out = []
        with self._lock:
            for worker in reversed(self._when):  # in the order the marks last moved
                age = now - self._when[worker]
                if max_age_s is not None and age > max_age_s:
                    break
                out.append((worker, self._marks[worker], self._parts.get(worker, 0), age, False))
            for worker in reversed(self._refused):
                sequence, parts, when = self._refused[worker]
                if max_age_s is not None and now - when > max_age_s:
                    break
                if sequence > self._marks.get(worker, 0):
                    out.append((worker, sequence, parts, now - when, True))
        return out

    def confirmed(self, upto: int) -> None:
        """Every push with a sequence here up to ``upto`` is durable: forget their sequences."""
        with self._lock:
            while self._recent:
                key, seq = next(iter(self._recent.items()))
                if seq > upto:
                    break
                self._recent.popitem(last=False)
                self._dropped_recent_locked(key[0])

    def _dropped_recent_locked(self, worker: str) -> None:
        self.recent_bytes -= self.cost(worker)
        left = self._recent_of.get(worker, 0) - 1
        if left > 0:
            self._recent_of[worker] = left
        else:
            self._recent_of.pop(worker, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._marks) + len(self._recent)


class Forgotten:
    """A Bloom filter of the worker incarnations whose marks were forgotten (:class:`AppliedPushes`): 8 Mbit
    and 7 hashes, at most :data:`capacity` entries (then about 1 false positive in 10^6 checks); full, it takes
    no more, and no mark is forgotten."""

    BITS = 1 << 23
    HASHES = 7
    capacity = 150_000

    def __init__(self):
        self._bits = np.zeros(self.BITS // 8, dtype=np.uint8)
        self.count = 0

    @property
    def full(self) -> bool:
        return self.count >= self.capacity

    @property
    def room(self) -> int:
        return self.capacity - self.count

    def _positions(self, worker: str) -> np.ndarray:
        digest = hashlib.blake2b(worker.encode("utf-8", "surrogatepass"), digest_size=8 * self.HASHES,
                                 person=b"ecrec-forgotten").digest()
        return np.frombuffer(digest, dtype="<u8") % self.BITS

    def add(self, worker: str) -> None:
        p = self._positions(worker)
        np.bitwise_or.at(self._bits, (p >> 3).astype(np.int64), (1 << (p & 7)).astype(np.uint8))
        self.count += 1

    def __contains__(self, worker: str) -> bool:
        if not self.count:
            return False
        p = self._positions(worker)
        return bool(((self._bits[(p >> 3).astype(np.int64)] >> (p & 7).astype(np.uint8)) & 1).all())


class PushSequencer:
    """Numbers the pushes applied here: ``(epoch at the first push << 32) | count``.

    The number is the version stamped on every row a push changes; a later incarnation of the same
    index starts above every earlier one (its first push sees a newer epoch)."""

    def __init__(self):
        self._base = 0
        self._count = 0

    def next(self, epoch: int) -> int:
        if self._base == 0:
            self._base = max(1, epoch) << 32
        self._count += 1
        return self._base | self._count

    def floor(self, epoch: int) -> int:
        """A number above every version this server's rows hold now and below every push numbered from now: a
        snapshot's cut.  Before this incarnation's first push, its base as that push will fix it (the map epoch
        never goes down; a replacement's rebuilt rows carry the versions of the incarnations before it, below)."""
        return self._base | self._count if self._base else max(1, epoch) << 32

    @property
    def last(self) -> int:
        """The last number given (0: none yet in this incarnation)."""
        return self._base | self._count if self._base else 0
