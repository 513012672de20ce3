"""Training data for the DLRM workload: batches, the Criteo TSV reader, a synthetic generator.

Everything the benchmark trains on goes through one format, the Criteo TSV
(Kaggle Display Advertising / Terabyte click logs)::

    label \\t I1 .. I13 \\t C1 .. C26 \\n

``label`` is 0 or 1, ``I*`` are integer counts (may be empty or negative), ``C*``
hexadecimal hashes (may be empty).  Features become:

- dense: ``log(1 + max(x, 0))`` as float32, an empty field is 0;
- categorical: ``int(hex, 16) % num_rows`` of that table, an empty field is row 0.

Pieces:

- :class:`Batch`: what a training step consumes (dense ``(B, 13)``, one
  ``(indices, offsets)`` pair per table as ``torch.nn.EmbeddingBag`` takes them,
  labels ``(B,)``).
- :class:`CriteoReader`: streams batches from a (possibly gzipped) TSV, parsing
  chunks of lines with numpy; malformed lines are reported with their line
  numbers and skipped (``on_malformed="skip"``) or refused (``"error"``);
  ``shard=(rank, world_size)`` gives torchrun workers disjoint lines.
- :func:`write_synthetic_criteo`: writes that format with Zipf-distributed ids
  and a planted signal (the default data set, sized for a laptop).
- :class:`InMemoryDataset`: a whole small file as arrays, for benchmarks that
  must not be parse-bound, with a train/test split.

MovieLens-100k is converted to the same arrays by ``ecrec.workload.movielens``.
"""

from __future__ import annotations

import gzip
import logging
import os
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

log = logging.getLogger("ecrec.workload.data")

CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26
MAX_TABLE_ROWS = 1 << 58  # keeps the hex-modulo arithmetic inside int64
_MAX_INT_DIGITS = 18
_MAX_HEX_DIGITS = 64

_HEX = np.full(256, -1, dtype=np.int16)
_HEX[ord("0"):ord("9") + 1] = np.arange(10)
_HEX[ord("a"):ord("f") + 1] = np.arange(10, 16)
_HEX[ord("A"):ord("F") + 1] = np.arange(10, 16)


# --- batches ---------------------------------------------------------------------------------------

@dataclass
class Batch:
    """One training step's worth of samples.

    ``dense``: float32 ``(B, num_dense)``; ``sparse``: per table an
    ``(indices, offsets)`` pair of int64 tensors, as ``EmbeddingBag`` takes them
    (one id per sample per table here, so ``offsets`` is ``arange(B)``);
    ``labels``: float32 ``(B,)``; ``line_numbers``: for batches from a file, the
    1-based line each sample came from (else ``None``).
    """

    dense: torch.Tensor
    sparse: list[tuple[torch.Tensor, torch.Tensor]]
    labels: torch.Tensor
    line_numbers: np.ndarray | None = None

    @classmethod
    def from_arrays(cls, dense: np.ndarray, ids: np.ndarray, labels: np.ndarray,
                    line_numbers: np.ndarray | None = None) -> "Batch":
        """Builds a batch from ``dense (B, D)``, ``ids (B, T)`` (one id per sample per table), ``labels (B,)``."""
        dense = np.ascontiguousarray(dense, dtype=np.float32)
        labels = np.ascontiguousarray(labels, dtype=np.float32).reshape(-1)
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 2 or dense.ndim != 2 or not (len(dense) == len(ids) == len(labels)):
            raise ValueError(f"batch arrays disagree: dense {dense.shape}, ids {ids.shape}, labels {labels.shape}")
        return cls._from_columns(dense, np.ascontiguousarray(ids.T), labels, line_numbers)

    @classmethod
    def _from_columns(cls, dense: np.ndarray, ids_by_table: np.ndarray, labels: np.ndarray,
                      line_numbers: np.ndarray | None) -> "Batch":
        offsets = torch.arange(len(labels), dtype=torch.int64)
        sparse = [(torch.from_numpy(np.ascontiguousarray(ids_by_table[t])), offsets) for t in range(len(ids_by_table))]
        return cls(torch.from_numpy(dense), sparse, torch.from_numpy(labels), line_numbers)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def ids(self) -> np.ndarray:
        """The ids as an int64 ``(B, T)`` array (one id per sample per table)."""
        return np.stack([idx.numpy() for idx, _ in self.sparse], axis=1) if self.sparse else np.zeros((len(self), 0), np.int64)


# --- the Criteo TSV reader -------------------------------------------------------------------------

def _column_name(col: int, num_dense: int) -> str:
    if col == 0:
        return "label"
    if col <= num_dense:
        return f"I{col}"
    return f"C{col - num_dense}"


def _normalize_table_sizes(table_sizes: int | Sequence[int], num_sparse: int) -> list[int]:
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
        self.table_sizes = _normalize_table_sizes(table_sizes, self.num_sparse)
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
            fields = _Fields(padded, n)
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


_BAD_DEC = np.ones(256, dtype=np.uint8)
_BAD_DEC[ord("0"):ord("9") + 1] = 0
_BAD_HEX = (_HEX < 0).astype(np.uint8)
# _LEN_MASK[l]: the low l bytes of a word
_LEN_MASK = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)
_U = np.uint64
_ONES = 0x0101010101010101
_HIGH = _U(0x8080808080808080)


def _not_in_ranges(w: np.ndarray, ranges) -> np.ndarray:
    """Per byte of ``w``: 0xFF-style flag (the byte's high bit) where the byte is in none of ``ranges``."""
    x7 = w & _U(0x7F7F7F7F7F7F7F7F)

    def ge(lo: int) -> np.ndarray:  # high bit of each byte set iff byte >= lo (bytes < 0x80: no carries)
        return (x7 + _U((0x80 - lo) * _ONES)) & _HIGH

    inside = np.zeros_like(w)
    for lo, hi in ranges:
        inside |= ge(lo) & ~ge(hi + 1)
    flag = ((w & _HIGH) | (~inside & _HIGH)) >> _U(7)  # 1 in the low bit of each bad byte
    return flag * _U(0xFF)


class _Fields:
    """Vectorized field decoding over one chunk's bytes.

    Fields of at most 8 bytes (all of Criteo's) are decoded eight characters at a
    time: one unaligned big-endian 64-bit load per field, right-aligned, then
    SIMD-within-a-register arithmetic, for the value and for the per-byte
    character-class checks.  Longer fields, and integers with a '+' sign, take
    the general per-character path.
    """

    def __init__(self, padded: np.ndarray, n: int):
        self.padded = padded
        self.arr = padded[:n]
        self.n = n
        self.words = np.ndarray(shape=(n,), dtype=">u8", buffer=padded, offset=0, strides=(1,))

    def _aligned(self, fs: np.ndarray, flen: np.ndarray) -> np.ndarray:
        """The (<= 8) bytes of each field as a right-aligned integer (first character most significant)."""
        w = self.words[np.minimum(fs, self.n - 1) if self.n else fs].astype(np.uint64)
        shift = (np.uint64(64) - np.minimum(flen, 8).astype(np.uint64) * np.uint64(8))
        w = np.where(flen == 0, _U(0), w >> np.minimum(shift, _U(63)))
        return w

    def ints(self, fs: np.ndarray, flen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(max(value, 0) as int64, bad mask)`` of decimal integer fields; empty is 0."""
        first = self.padded[fs]
        signed = first == 45  # '-'
        slow = (flen > 8) | (first == 43)  # long, or '+'
        w = self._aligned(fs, flen)
        d = w - (_U(0x3030303030303030) & _LEN_MASK[np.minimum(flen, 8)])
        d = ((d >> _U(8)) * _U(10) + d) & _U(0x00FF00FF00FF00FF)
        d = ((d >> _U(16)) * _U(100) + d) & _U(0x0000FFFF0000FFFF)
        d = ((d >> _U(32)) * _U(10000) + d) & _U(0x00000000FFFFFFFF)
        values = np.where(signed, 0, d.astype(np.int64))
        # a leading '-' is not checked as a digit
        body = _LEN_MASK[np.minimum(flen, 8) - signed.astype(np.int64).clip(0, None)]
        bad = (_not_in_ranges(w, ((0x30, 0x39),)) & body) != 0
        bad |= signed & (flen == 1)
        if slow.any():
            idx = np.flatnonzero(slow.reshape(-1))
            v, b = _parse_ints(self.arr, fs.reshape(-1)[idx], flen.reshape(-1)[idx])
            values.reshape(-1)[idx] = np.maximum(v, 0)
            bad.reshape(-1)[idx] = b
        return values, bad

    def hex(self, fs: np.ndarray, flen: np.ndarray, mods: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(int(field, 16) % mods, bad mask)`` of hex fields; empty is 0."""
        w = self._aligned(fs, flen)
        nib = (w & _U(0x0F0F0F0F0F0F0F0F)) + ((w >> _U(6)) & _U(0x0101010101010101)) * _U(9)
        nib = ((nib >> _U(4)) | nib) & _U(0x00FF00FF00FF00FF)
        nib = ((nib >> _U(8)) | nib) & _U(0x0000FFFF0000FFFF)
        nib = ((nib >> _U(16)) | nib) & _U(0x00000000FFFFFFFF)
        values = nib.astype(np.int64) % mods
        bad = (_not_in_ranges(w, ((0x30, 0x39), (0x41, 0x46), (0x61, 0x66))) & _LEN_MASK[np.minimum(flen, 8)]) != 0
        slow = flen > 8
        if slow.any():
            idx = np.flatnonzero(slow.reshape(-1))
            v, b = _parse_hex(self.arr, fs.reshape(-1)[idx], flen.reshape(-1)[idx], mods.reshape(-1)[idx])
            values.reshape(-1)[idx] = v
            bad.reshape(-1)[idx] = b
        return values, bad


def _gather(arr: np.ndarray, fs: np.ndarray, flen: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Characters of fields as ``(..., width)`` uint8 (0 past a field's end) and the in-field mask."""
    j = np.arange(width, dtype=np.int64)
    inside = j < flen[..., None]
    chars = arr[np.minimum(fs[..., None] + j, max(arr.size - 1, 0))]
    chars[~inside] = 0
    return chars, inside


def _parse_ints(arr, fs, flen) -> tuple[np.ndarray, np.ndarray]:
    """General path: decimal integers with an optional sign; empty is 0. Returns ``(int64 values, bad mask)``."""
    width = int(min(max(int(flen.max(initial=0)), 1), _MAX_INT_DIGITS + 1))
    chars, inside = _gather(arr, fs, np.minimum(flen, width), width)
    signed = (chars[..., 0] == 45) | (chars[..., 0] == 43)  # '-' or '+'
    digits = chars.astype(np.int64) - 48
    is_digit = (digits >= 0) & (digits <= 9)
    ok_char = is_digit | ~inside
    ok_char[..., 0] |= signed
    bad = ~ok_char.all(axis=-1) | (signed & (flen == 1)) | (flen - signed > _MAX_INT_DIGITS)
    values = np.zeros(flen.shape, dtype=np.int64)
    for k in range(width):
        take = inside[..., k] & is_digit[..., k]
        values = np.where(take, values * 10 + digits[..., k], values)
    values = np.where(chars[..., 0] == 45, -values, values)
    return values, bad


def _parse_hex(arr, fs, flen, mods) -> tuple[np.ndarray, np.ndarray]:
    """General path: hex values modulo ``mods`` (same shape); empty is 0. Returns ``(int64 values, bad mask)``."""
    width = int(min(max(int(flen.max(initial=0)), 1), _MAX_HEX_DIGITS))
    chars, inside = _gather(arr, fs, np.minimum(flen, width), width)
    nibbles = _HEX[chars].astype(np.int64)
    bad = ((nibbles < 0) & inside).any(axis=-1) | (flen > _MAX_HEX_DIGITS)
    nibbles = np.maximum(nibbles, 0)
    values = np.zeros(flen.shape, dtype=np.int64)
    for k in range(width):
        values = np.where(inside[..., k], (values * 16 + nibbles[..., k]) % mods, values)
    return values, bad


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


# --- in-memory data set ----------------------------------------------------------------------------

class InMemoryDataset:
    """A whole (small) data set as arrays; yields :class:`Batch` es without parsing.

    ``dense`` float32 ``(N, D)``, ``ids`` int64 ``(N, T)`` (one id per sample per
    table), ``labels`` float32 ``(N,)``; ``table_sizes`` (rows per table) is
    optional metadata for building the model.
    """

    def __init__(self, dense: np.ndarray, ids: np.ndarray, labels: np.ndarray,
                 table_sizes: Sequence[int] | None = None):
        dense = np.ascontiguousarray(dense, dtype=np.float32)
        ids = np.asarray(ids, dtype=np.int64)
        labels = np.ascontiguousarray(labels, dtype=np.float32).reshape(-1)
        if dense.ndim != 2 or ids.ndim != 2 or not (len(dense) == len(ids) == len(labels)):
            raise ValueError(f"dataset arrays disagree: dense {dense.shape}, ids {ids.shape}, labels {labels.shape}")
        self.dense = dense
        self._ids_by_table = np.ascontiguousarray(ids.T)  # (T, N): a table's ids of a batch are contiguous
        self.labels = labels
        self.table_sizes = None if table_sizes is None else [int(s) for s in table_sizes]
        if self.table_sizes is not None:
            if len(self.table_sizes) != ids.shape[1]:
                raise ValueError(f"{len(self.table_sizes)} table sizes for {ids.shape[1]} tables")
            if ids.size and (ids.min() < 0 or np.any(ids.max(axis=0) >= np.asarray(self.table_sizes))):
                raise ValueError("ids out of range of table_sizes")

    @classmethod
    def from_tsv(cls, path: str | os.PathLike, table_sizes: int | Sequence[int], on_malformed: str = "skip",
                 num_dense: int = CRITEO_NUM_DENSE, num_sparse: int = CRITEO_NUM_SPARSE,
                 max_samples: int | None = None, shard: tuple[int, int] = (0, 1)) -> "InMemoryDataset":
        """Loads a Criteo TSV once (see :class:`CriteoReader` for the arguments)."""
        reader = CriteoReader(path, table_sizes, on_malformed=on_malformed, shard=shard,
                              num_dense=num_dense, num_sparse=num_sparse)
        dense, ids, labels = reader.read_arrays(max_samples)
        ds = cls(dense, ids, labels, reader.table_sizes)
        ds.read_stats = reader.stats
        return ds

    def __len__(self) -> int:
        return int(self.labels.size)

    @property
    def ids(self) -> np.ndarray:
        """int64 ``(N, T)`` (a transposed view)."""
        return self._ids_by_table.T

    @property
    def num_dense(self) -> int:
        return int(self.dense.shape[1])

    @property
    def num_tables(self) -> int:
        return int(self._ids_by_table.shape[0])

    def subset(self, index: np.ndarray) -> "InMemoryDataset":
        index = np.asarray(index)
        return InMemoryDataset(self.dense[index], self._ids_by_table[:, index].T, self.labels[index], self.table_sizes)

    def split(self, test_fraction: float = 0.1, shuffle: bool = True, seed: int = 0) -> tuple["InMemoryDataset", "InMemoryDataset"]:
        """``(train, test)``: the last ``test_fraction`` of the samples (after a seeded shuffle, if ``shuffle``)."""
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        n = len(self)
        order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
        n_test = max(1, int(round(n * test_fraction)))
        if n_test >= n:
            raise ValueError(f"{n} samples are too few to split off {test_fraction:.0%}")
        return self.subset(np.sort(order[: n - n_test])), self.subset(np.sort(order[n - n_test:]))

    def shard(self, rank: int, world_size: int) -> "InMemoryDataset":
        """Samples ``i`` with ``i % world_size == rank`` (disjoint, complete)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got ({rank}, {world_size})")
        return self.subset(np.arange(rank, len(self), world_size))

    def batch(self, index: np.ndarray | slice) -> Batch:
        if isinstance(index, slice):
            return Batch._from_columns(self.dense[index], self._ids_by_table[:, index], self.labels[index], None)
        index = np.asarray(index)
        return Batch._from_columns(self.dense[index], self._ids_by_table[:, index], self.labels[index], None)

    def batches(self, batch_size: int, shuffle: bool = False, seed: int = 0, drop_last: bool = False) -> Iterator[Batch]:
        """One epoch of batches, in order or in a seeded random order."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        n = len(self)
        stop = (n // batch_size) * batch_size if drop_last else n
        order = np.random.default_rng(seed).permutation(n) if shuffle else None
        for s in range(0, stop, batch_size):
            e = min(s + batch_size, n)
            yield self.batch(slice(s, e) if order is None else order[s:e])

    def repeat(self, batch_size: int, steps: int, shuffle: bool = True, seed: int = 0) -> Iterator[Batch]:
        """Exactly ``steps`` full batches, cycling over epochs (each reshuffled with ``seed + epoch``)."""
        if len(self) < batch_size:
            raise ValueError(f"{len(self)} samples are fewer than one batch of {batch_size}")
        done, epoch = 0, 0
        while done < steps:
            for b in self.batches(batch_size, shuffle=shuffle, seed=seed + epoch, drop_last=True):
                yield b
                done += 1
                if done == steps:
                    return
            epoch += 1


# --- synthetic data --------------------------------------------------------------------------------

@dataclass(frozen=True)
class SyntheticInfo:
    """What :func:`write_synthetic_criteo` wrote. Read it back with ``table_sizes`` to map ids one to one."""

    path: str
    num_samples: int
    num_dense: int
    table_sizes: list[int]
    seed: int
    positive_rate: float
    oracle_auc: float  # AUC of the true click probabilities: the best any model can reach


_SYNTH_CHUNK = 1 << 15


def _zipf_cdf(rows: int, a: float) -> np.ndarray:
    p = np.arange(1, rows + 1, dtype=np.float64) ** (-a)
    c = np.cumsum(p)
    return c / c[-1]


def write_synthetic_criteo(path: str | os.PathLike, num_samples: int = 100_000, num_tables: int = CRITEO_NUM_SPARSE,
                           rows_per_table: int | Sequence[int] = 10_000, zipf_a: float = 1.05, seed: int = 0,
                           num_dense: int = CRITEO_NUM_DENSE, signal_tables: int | None = None,
                           signal_scale: float = 0.8, dense_signal_scale: float = 0.5,
                           missing_rate: float = 0.05) -> SyntheticInfo:
    """Writes ``num_samples`` Criteo-format lines with a learnable planted signal; deterministic from ``seed``.

    Table ``t`` has ``rows_per_table[t]`` rows; row 0 stands for "missing" (an
    empty field, probability ``missing_rate``), the others are drawn with a
    bounded Zipf law of exponent ``zipf_a`` over popularity ranks, scattered over
    the row ids by a fixed permutation, and written as 8-digit hex (the row id
    itself, so reading with ``table_sizes = rows_per_table`` recovers it).
    Integer features are heavy-tailed counts (empty with ``missing_rate``).

    The label is drawn from ``sigmoid(b + sum_t w_t[id_t] + sum_j beta_j z_j)``:
    ``w_t`` are hidden per-row weights (N(0, ``signal_scale``²)) of the first
    ``signal_tables`` tables (default ``min(8, num_tables)``), ``z_j`` the
    standardized ``log1p`` dense features, ``beta_j ~ N(0, dense_signal_scale²)``.
    """
    path = os.fspath(path)
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if num_tables < 1 or num_dense < 0:
        raise ValueError("need num_tables >= 1 and num_dense >= 0")
    sizes = _normalize_table_sizes(rows_per_table, num_tables)
    if min(sizes) < 2:
        raise ValueError("rows_per_table must be >= 2 (row 0 is reserved for missing values)")
    if max(sizes) > 1 << 32:
        raise ValueError("rows_per_table must be <= 2**32 (ids are written as 8-digit hex)")
    if not zipf_a > 0:
        raise ValueError(f"zipf_a must be > 0, got {zipf_a}")
    if not 0.0 <= missing_rate < 1.0:
        raise ValueError(f"missing_rate must be in [0, 1), got {missing_rate}")
    n_signal = min(8, num_tables) if signal_tables is None else int(signal_tables)
    if not 0 <= n_signal <= num_tables:
        raise ValueError(f"signal_tables must be in [0, {num_tables}], got {signal_tables}")

    rng = np.random.default_rng(seed)
    cdfs = [_zipf_cdf(s - 1, zipf_a) for s in sizes]
    perms = [rng.permutation(s - 1) + 1 for s in sizes]  # popularity rank -> row id (1 .. s-1)
    weights = [rng.normal(0.0, signal_scale, s).astype(np.float64) if t < n_signal else None
               for t, s in enumerate(sizes)]
    for w in weights:
        if w is not None:
            w[0] = 0.0
    dense_mu = rng.uniform(0.0, 2.0, num_dense)
    dense_sigma = rng.uniform(0.8, 1.6, num_dense)
    beta = rng.normal(0.0, dense_signal_scale, num_dense)
    bias = -1.5
    pop_mean, pop_std = _dense_moments(dense_mu, dense_sigma, missing_rate)

    scores, labels_all = [], []
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii", newline="\n") as f:
        for chunk_index, start in enumerate(range(0, num_samples, _SYNTH_CHUNK)):
            n = min(_SYNTH_CHUNK, num_samples - start)
            crng = np.random.default_rng([seed, chunk_index])
            logit = np.full(n, bias)
            columns: list[list[str]] = []
            # dense: log-normal counts, so log1p(x) ~ roughly normal
            z = crng.standard_normal((n, num_dense))
            counts = np.floor(np.expm1(np.maximum(dense_mu + dense_sigma * z, 0.0))).astype(np.int64)
            dense_missing = crng.random((n, num_dense)) < missing_rate
            logf = np.where(dense_missing, 0.0, np.log1p(counts))
            logit += ((logf - pop_mean) / pop_std) @ beta  # population moments: chunk independent
            # categorical
            cat_cols = []
            for t, s in enumerate(sizes):
                ranks = np.searchsorted(cdfs[t], crng.random(n), side="right")
                ranks = np.minimum(ranks, s - 2)
                ids = perms[t][ranks]
                ids[crng.random(n) < missing_rate] = 0
                if weights[t] is not None:
                    logit += weights[t][ids]
                cat_cols.append(ids)
            p = 1.0 / (1.0 + np.exp(-logit))
            labels = (crng.random(n) < p).astype(np.int64)
            scores.append(p)
            labels_all.append(labels)
            columns.append(labels.astype(str).tolist())
            for j in range(num_dense):
                col = counts[:, j].astype(str).astype(object)
                col[dense_missing[:, j]] = ""
                columns.append(col.tolist())
            for ids in cat_cols:
                columns.append(["" if i == 0 else f"{i:08x}" for i in ids.tolist()])
            f.write("\n".join(map("\t".join, zip(*columns))))
            f.write("\n")
    os.replace(tmp, path)
    from ecrec.workload.metrics import auc  # local import: metrics is tiny, avoid a cycle at import time

    y = np.concatenate(labels_all) if labels_all else np.zeros(0)
    s = np.concatenate(scores) if scores else np.zeros(0)
    oracle = auc(y, s) if y.size and 0 < y.sum() < y.size else float("nan")
    return SyntheticInfo(path=path, num_samples=int(num_samples), num_dense=int(num_dense), table_sizes=sizes,
                         seed=int(seed), positive_rate=float(y.mean()) if y.size else float("nan"), oracle_auc=oracle)


def _dense_moments(mu: np.ndarray, sigma: np.ndarray, missing_rate: float) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std of ``log1p(floor(expm1(max(mu + sigma z, 0))))`` with missing as 0, by quadrature."""
    z = np.linspace(-8, 8, 4001)
    w = np.exp(-0.5 * z * z)
    w /= w.sum()
    x = np.maximum(mu[:, None] + sigma[:, None] * z[None, :], 0.0)
    v = np.log1p(np.floor(np.expm1(x)))
    m1 = (1 - missing_rate) * (v * w).sum(axis=1)
    m2 = (1 - missing_rate) * (v * v * w).sum(axis=1)
    std = np.sqrt(np.maximum(m2 - m1 * m1, 1e-12))
    return m1, std


def criteo_batches(path: str | os.PathLike, table_sizes: int | Sequence[int], batch_size: int, **kwargs) -> Iterator[Batch]:
    """Shorthand for ``iter(CriteoReader(path, table_sizes, batch_size, **kwargs))``."""
    return iter(CriteoReader(path, table_sizes, batch_size, **kwargs))


__all__ = [
    "Batch", "CriteoReader", "ReadStats", "InMemoryDataset", "SyntheticInfo", "write_synthetic_criteo",
    "criteo_batches", "CRITEO_NUM_DENSE", "CRITEO_NUM_SPARSE",
]
