"""Which pushes a server applied (:class:`AppliedPushes`, bounded in bytes, so a retry is answered "already
applied") and the numbers it gives them (:class:`PushSequencer`, the versions stamped on the rows a push changes)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from ecrec import errors

#: bytes a table entry of :class:`AppliedPushes` costs beside its worker's name (dict slot, key tuple, ints;
#: measured with ``sys.getsizeof``, rounded up)
ENTRY_OVERHEAD_BYTES = 200


class AppliedPushes:
    """Which pushes this server applied, in bounded memory, so a retry is answered "already applied".

    A worker sends its pushes to a server in increasing sequence and retries or replays only pushes it was
    not sure of, oldest first, so per worker incarnation the highest sequence applied (its *high-water mark*)
    tells applied from new: a push at or below it was applied here or, after a recovery, kept.  Pushes not
    yet confirmed also keep the sequence they got here (``recent``), which a retry's reply carries.

    Bounds, in bytes (``max_bytes``, names counted with :data:`ENTRY_OVERHEAD_BYTES` each): the marks take at
    most three quarters and are never forgotten -- forgetting one would let a retry of an old push apply
    twice -- so a new worker incarnation beyond them is refused (:meth:`admit`, ``ResourceExhausted``); the
    recent sequences take the rest, oldest forgotten first (a forgotten one falls back to the mark: still
    "already applied", only the reply's sequence is 0).  Marks a recovery installs (``force``) are never
    refused: they only ever come from servers.
    """

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes = max_bytes
        self.max_recent_bytes = max_bytes // 4
        self.max_marks_bytes = max_bytes - self.max_recent_bytes
        self._marks: dict[str, int] = {}
        self._parts: dict[str, int] = {}  # worker -> how many servers its push at the mark went to (0: not said)
        self._when: dict[str, float] = {}  # worker -> when its mark last moved (time.monotonic())
        self._recent: OrderedDict[tuple[str, int], int] = OrderedDict()
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
        """Raises ``ResourceExhausted`` when ``worker`` (a push key, ``name#digest``) is new here and its mark would not
        fit: the caller is refused, no mark is forgotten.  Changes nothing."""
        with self._lock:
            if worker in self._marks or self.marks_bytes + self.cost(worker) <= self.max_marks_bytes:
                return
            raise errors.ResourceExhausted(
                f"this server remembers the pushes of {len(self._marks)} worker incarnations in "
                f"{self.marks_bytes} bytes (bound --max-applied-bytes {self.max_bytes}: three quarters for them); "
                "a new incarnation is refused (forgetting one could apply its retried pushes twice)")

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
            if seq:
                if key not in self._recent:
                    self.recent_bytes += self.cost(worker)
                self._recent[key] = seq
                while self.recent_bytes > self.max_recent_bytes and self._recent:
                    (old, _), _ = self._recent.popitem(last=False)
                    self.recent_bytes -= self.cost(old)

    def marks(self) -> list[tuple[str, int, int, float]]:
        """Every worker incarnation's mark here: ``(push key, highest sequence applied, the servers that push went
        to or 0, seconds since it was applied here)``."""
        now = time.monotonic()
        with self._lock:
            return [(worker, mark, self._parts.get(worker, 0), now - self._when.get(worker, now))
                    for worker, mark in self._marks.items()]

    def confirmed(self, upto: int) -> None:
        """Every push with a sequence here up to ``upto`` is durable: forget their sequences."""
        with self._lock:
            while self._recent:
                key, seq = next(iter(self._recent.items()))
                if seq > upto:
                    break
                self._recent.popitem(last=False)
                self.recent_bytes -= self.cost(key[0])

    def __len__(self) -> int:
        with self._lock:
            return len(self._marks) + len(self._recent)


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

    @property
    def last(self) -> int:
        """The last number given (0: none yet in this incarnation)."""
        return self._base | self._count if self._base else 0
