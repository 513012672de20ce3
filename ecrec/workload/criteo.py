"""Streaming the Criteo TSV format (Kaggle Display Advertising / Terabyte click logs) into :class:`Batch` es:
:class:`CriteoReader` parses chunks of lines with numpy (the fields by ``ecrec.workload.tsv_fields``), reports
malformed lines with their numbers or refuses them, and shards a file's lines between torchrun workers.  The
format and the features it becomes: ``ecrec.workload.data``."""

from __future__ import annotations

import gzip
import logging
import os
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from ecrec.workload.batch import Batch
from ecrec.workload.tsv_fields import Fields

log = logging.getLogger("ecrec.workload.data")  # the name the reader has always logged under

CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26
MAX_TABLE_ROWS = 1 << 58  # keeps the hex-modulo arithmetic inside int64


def _column_name(col: int, num_dense: int) -> str:
    if col == 0:
        return "label"
    if col <= num_dense:
        return f"I{col}"
    return f"C{col - num_dense}"


def normalize_table_sizes(table_sizes: int | Sequence[int], num_sparse: int) -> list[int]:
    """Rows of each of ``num_sparse`` tables (one int: the same for all), each checked to be in [1, 2**58]."""
    if isinstance(table_sizes, (int, np.integer)):
        sizes = [int(table_sizes)] * num_sparse
    else:
        sizes = [int(s) for s in table_sizes]
    if len(sizes) != num_sparse:
        raise ValueError(f"table_sizes has {len(sizes)} entries for {num_sparse} categorical columns")
    for i, s in enumerate(sizes):
        if not 1 <= s <= MAX_TABLE_ROWS:
            raise ValueError(f"table_sizes[{i}] must be in [1, 2**58], got {s}")
    return sizes


@dataclass
class ReadStats:
    """What one pass of a :class:`CriteoReader` saw (reset at the start of every pass)."""

    lines: int = 0           # physical lines in the file (all shards)
    shard_lines: int = 0     # lines assigned to this shard
    samples: int = 0         # good lines turned into samples
    blank: int = 0           # empty lines of this shard (ignored, not malformed)
    malformed: int = 0       # malformed lines of this shard
    malformed_lines: list[tuple[int, str]] = field(default_factory=list)  # (1-based line, reason), first max_reported

    def summary(self, path: str) -> str:
        first = ", ".join(f"{n} ({why})" for n, why in self.malformed_lines[:5])
        more = " ..." if self.malformed > 5 else ""
        return f"{path}: skipped {self.malformed} malformed line(s) of {self.shard_lines}: {first}{more}"


@dataclass
class _Parsed:
    dense: np.ndarray        # float32 (n, num_dense)
    ids: np.ndarray          # int64 (num_sparse, n) -- by table
    labels: np.ndarray       # float32 (n,)
    lines: np.ndarray        # int64 (n,), 1-based line numbers

class CriteoReader:
    """Streams :class:`Batch` es from a Criteo-format TSV file (plain or ``.gz``).

    ``table_sizes``: rows per categorical table (a list, or one int for all);
    a categorical value ``h`` goes to row ``int(h, 16) % num_rows``, an empty one
    to row 0.  ``on_malformed``: ``"skip"`` counts malformed lines (wrong column
    count, bad label, bad integer, bad hex), keeps the first ``max_reported`` of
    them with their 1-based line numbers in ``stats.malformed_lines`` and logs a
    summary at the end of the pass; ``"error"`` raises ``ValueError`` naming the
    file and line.  Empty lines are ignored.  ``shard=(rank, world_size)``: this
    reader takes line ``n`` (1-based) when ``(n - 1) % world_size == rank``, so
    the shards of one file are disjoint and together cover it.

    Iterating the reader makes one pass over the file (iterate again for another
    epoch).  ``drop_last`` drops a final batch smaller than ``batch_size``.
    """

    def __init__(self, path: str | os.PathLike, table_sizes: int | Sequence[int], batch_size: int = 1024,
                 on_malformed: str = "skip", shard: tuple[int, int] = (0, 1), num_dense: int = CRITEO_NUM_DENSE,
                 num_sparse: int = CRITEO_NUM_SPARSE, drop_last: bool = False, max_reported: int = 1000,
                 chunk_bytes: int = 4 << 20):
        self.path = os.fspath(path)
        if on_malformed not in ("skip", "error"):
            raise ValueError(f"on_malformed must be 'skip' or 'error', got {on_malformed!r}")
        rank, world = (int(shard[0]), int(shard[1]))
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"shard must be (rank, world_size) with 0 <= rank < world_size, got {shard}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_dense < 0 or num_sparse < 0 or num_dense + num_sparse == 0:
            raise ValueError("need at least one feature column")
        self.num_dense = int(num_dense)
        self.num_sparse = int(num_sparse)
        self.table_sizes = normalize_table_sizes(table_sizes, self.num_sparse)
        self.batch_size = int(batch_size)
        self.on_malformed = on_malformed
        self.shard = (rank, world)
        self.drop_last = bool(drop_last)
        self.max_reported = int(max_reported)
        self.chunk_bytes = max(int(chunk_bytes), 1 << 12)
        self.stats = ReadStats()
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"Criteo TSV file not found: {self.path}")

    # iteration --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        pend: list[_Parsed] = []
        pending = 0
        for parsed in self._chunks():
            pend.append(parsed)
            pending += len(parsed.labels)
            if pending < self.batch_size:
                continue
            merged = _concat(pend)
            n_full = (pending // self.batch_size) * self.batch_size
            for s in range(0, n_full, self.batch_size):
                yield _slice_batch(merged, s, s + self.batch_size)
            pend = [_slice(merged, n_full, pending)] if n_full < pending else []
            pending -= n_full
        if pending and not self.drop_last:
            merged = _concat(pend)
            yield _slice_batch(merged, 0, pending)

    def read_arrays(self, max_samples: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One pass into memory: ``(dense float32 (N, D), ids int64 (N, T), labels float32 (N,))``."""
        parts: list[_Parsed] = []
        total = 0
        for parsed in self._chunks():
            parts.append(parsed)
            total += len(parsed.labels)
            if max_samples is not None and total >= max_samples:
                break
        if not parts:
            return (np.zeros((0, self.num_dense), np.float32), np.zeros((0, self.num_sparse), np.int64),
                    np.zeros(0, np.float32))
        merged = _concat(parts)
        if max_samples is not None:
            merged = _slice(merged, 0, min(max_samples, total))
        return merged.dense, merged.ids.T, merged.labels  # ids: a (N, T) view of the by-table array

    def _open(self):
        if self.path.endswith(".gz"):
            return gzip.open(self.path, "rb")
        return open(self.path, "rb")

    def _chunks(self) -> Iterator[_Parsed]:
        self.stats = ReadStats()
        first_line = 0
        carry = b""
        with self._open() as f:
            while True:
                block = f.read(self.chunk_bytes)
                if not block:
                    if carry:
                        yield from self._emit(carry, first_line)
                        first_line += carry.count(b"\n") + (0 if carry.endswith(b"\n") else 1)
                    break
                data = carry + block
                cut = data.rfind(b"\n")
                if cut < 0:
                    carry = data
                    continue
                chunk, carry = data[: cut + 1], data[cut + 1:]
                yield from self._emit(chunk, first_line)
                first_line += chunk.count(b"\n")
        self.stats.lines = first_line
        if self.stats.malformed:
            log.warning("%s", self.stats.summary(self.path))

    def _emit(self, chunk: bytes, first_line: int) -> Iterator[_Parsed]:
        parsed = self._parse(chunk, first_line)
        if len(parsed.labels):
            yield parsed

    # parsing ----------------------------------------------------------------------------------
    def _malformed(self, line_numbers: np.ndarray, reasons: list[str]) -> None:
        """Records malformed lines (sorted by line number) or raises on the first one."""
        if not len(line_numbers):
            return
        order = np.argsort(line_numbers, kind="stable")
        if self.on_malformed == "error":
            i = int(order[0])
            raise ValueError(f"{self.path}:{int(line_numbers[i])}: malformed Criteo line: {reasons[i]} "
                             "(pass on_malformed='skip' to skip malformed lines)")
        self.stats.malformed += len(line_numbers)
        room = self.max_reported - len(self.stats.malformed_lines)
        for i in order[: max(room, 0)]:
            self.stats.malformed_lines.append((int(line_numbers[i]), reasons[i]))

    def _field_text(self, buf: bytes, start: int, end: int) -> str:
        text = buf[start:end].decode("utf-8", errors="replace")
        return repr(text if len(text) <= 40 else text[:40] + "...")

    def _parse(self, buf: bytes, first_line: int) -> _Parsed:
        nd, ns = self.num_dense, self.num_sparse
        ncols = 1 + nd + ns
        n = len(buf)
        padded = np.frombuffer(buf + b"\0" * 8, dtype=np.uint8)  # 8 spare bytes: any field start can load a word
        arr = padded[:n]
        nl = np.flatnonzero(arr == 10)
        ends = nl if buf.endswith(b"\n") else np.append(nl, n)
        nlines = ends.size
        starts = np.empty(nlines, dtype=np.int64)
        starts[:1] = 0
        starts[1:] = ends[:-1] + 1
        line_no = first_line + 1 + np.arange(nlines, dtype=np.int64)  # 1-based
        rank, world = self.shard
        mine = ((line_no - 1) % world == rank) if world > 1 else np.ones(nlines, dtype=bool)
        # strip a trailing '\r' (CRLF files)
        has_cr = (ends > starts) & (arr[np.maximum(ends - 1, 0)] == 13)
        ends = ends - has_cr
        blank = ends == starts
        tabs = np.flatnonzero(arr == 9)
        tabs_before_end = np.searchsorted(tabs, ends)  # tabs of lines 0..i
        first_tab = np.empty(nlines, dtype=np.int64)
        first_tab[:1] = 0
        first_tab[1:] = tabs_before_end[:-1]
        ntabs = tabs_before_end - first_tab
        self.stats.shard_lines += int(mine.sum())
        self.stats.blank += int((mine & blank).sum())
        candidates = mine & ~blank
        good = candidates & (ntabs == ncols - 1)
        wrong = np.flatnonzero(candidates & ~good)
        bad_lines = [line_no[wrong]]
        bad_reasons = [f"wrong column count: {int(ntabs[i]) + 1} columns, expected {ncols}" for i in wrong]

        g = np.flatnonzero(good)
        ng = g.size
        if ng:
            t = tabs[first_tab[g, None] + np.arange(ncols - 1)]
            fs = np.concatenate([starts[g, None], t + 1], axis=1)
            fe = np.concatenate([t, ends[g, None]], axis=1)
            flen = fe - fs
            bad_field = np.zeros((ng, ncols), dtype=bool)
            # label
            first = arr[np.minimum(fs[:, 0], n - 1)]
            bad_field[:, 0] = (flen[:, 0] != 1) | ((first != 48) & (first != 49))
            labels = (first == 49).astype(np.float32)
            fields = Fields(padded, n)
            # integer columns
            dense = np.zeros((ng, nd), dtype=np.float32)
            if nd:
                values, bad_int = fields.ints(fs[:, 1:1 + nd], flen[:, 1:1 + nd])
                bad_field[:, 1:1 + nd] = bad_int
                dense = np.log1p(values.astype(np.float64)).astype(np.float32)
            # hex columns
            ids = np.zeros((ns, ng), dtype=np.int64)
            if ns:
                mods = np.broadcast_to(np.asarray(self.table_sizes, dtype=np.int64), (ng, ns))
                values, bad_hex = fields.hex(fs[:, 1 + nd:], flen[:, 1 + nd:], mods)
                bad_field[:, 1 + nd:] = bad_hex
                ids = np.ascontiguousarray(values.T)
            bad_row = bad_field.any(axis=1)
            if bad_row.any():
                rows = np.flatnonzero(bad_row)
                bad_lines.append(line_no[g[rows]])
                for r in rows:
                    col = int(np.argmax(bad_field[r]))
                    kind = "label" if col == 0 else ("integer" if col <= nd else "hex value")
                    bad_reasons.append(f"column {col + 1} ({_column_name(col, nd)}): bad {kind} "
                                       f"{self._field_text(buf, int(fs[r, col]), int(fe[r, col]))}")
                keep = ~bad_row
                dense, ids, labels, g = dense[keep], ids[:, keep], labels[keep], g[keep]
        else:
            dense = np.zeros((0, nd), np.float32)
            ids = np.zeros((ns, 0), np.int64)
            labels = np.zeros(0, np.float32)
        self._malformed(np.concatenate(bad_lines), bad_reasons)
        self.stats.samples += int(labels.size)
        return _Parsed(np.ascontiguousarray(dense), np.ascontiguousarray(ids), labels, line_no[g])


def _concat(parts: list[_Parsed]) -> _Parsed:
    if len(parts) == 1:
        return parts[0]
    return _Parsed(np.concatenate([p.dense for p in parts]), np.concatenate([p.ids for p in parts], axis=1),
                   np.concatenate([p.labels for p in parts]), np.concatenate([p.lines for p in parts]))


def _slice(p: _Parsed, a: int, b: int) -> _Parsed:
    return _Parsed(p.dense[a:b], p.ids[:, a:b], p.labels[a:b], p.lines[a:b])


def _slice_batch(p: _Parsed, a: int, b: int) -> Batch:
    return Batch._from_columns(np.ascontiguousarray(p.dense[a:b]), p.ids[:, a:b], np.ascontiguousarray(p.labels[a:b]),
                               p.lines[a:b].copy())


def criteo_batches(path: str | os.PathLike, table_sizes: int | Sequence[int], batch_size: int, **kwargs) -> Iterator[Batch]:
    """Shorthand for ``iter(CriteoReader(path, table_sizes, batch_size, **kwargs))``."""
    return iter(CriteoReader(path, table_sizes, batch_size, **kwargs))
