"""One delta per row per group: the changes of a group of pushes, merged.

A group's pushes arrive as the server applied them: per push and table, the rows' slots, their payload before
and after the push and their versions before it.  A row changed by several pushes of the group needs one delta,
``payload before the group's first push to it XOR payload after its last`` (XOR of consecutive deltas is one
delta), stamped with its version before the first and the last push's sequence.  :func:`merge_rows` finds each
row's first and last change with a hash table and writes the merged deltas grouped by stripe position, then
table -- so the rows of one destination are one run -- in one compiled pass (no sort of every change, no
temporary copy per step).
"""

from __future__ import annotations

import functools

import numpy as np

#: a row's key: its table's rank above its slot
TABLE_SHIFT = 40
SLOT_MASK = (1 << TABLE_SHIFT) - 1


@functools.lru_cache(maxsize=1)
def _merge_kernel():
    """Compiles (once, cached on disk by numba) the merge."""
    from numba import njit

    @njit(cache=True, nogil=True, boundscheck=False)
    def merge(slots, tables, seqs, old, new, old_versions, k, ntables):  # pragma: no cover - numba
        n = slots.shape[0]
        width = old.shape[1]
        bits = 4
        while (1 << bits) < 2 * n:
            bits += 1
        size = 1 << bits
        mask = size - 1
        shift = np.uint64(64 - bits)
        hkey = np.full(size, -1, dtype=np.int64)
        hfirst = np.empty(size, dtype=np.int64)
        hlast = np.empty(size, dtype=np.int64)
        unique = np.empty(n, dtype=np.int64)  # hash cells of the rows, in order of first change
        found = 0
        for i in range(n):
            key = (tables[i] << TABLE_SHIFT) | slots[i]
            h = np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> shift)
            while True:
                if hkey[h] == key:
                    hlast[h] = i
                    break
                if hkey[h] == -1:
                    hkey[h] = key
                    hfirst[h] = i
                    hlast[h] = i
                    unique[found] = h
                    found += 1
                    break
                h = (h + 1) & mask
        counts = np.zeros(k * ntables, dtype=np.int64)
        for u in range(found):
            key = hkey[unique[u]]
            counts[((key & SLOT_MASK) % k) * ntables + (key >> TABLE_SHIFT)] += 1
        fill = np.empty(k * ntables, dtype=np.int64)
        total = 0
        for b in range(k * ntables):
            fill[b] = total
            total += counts[b]
        out_slots = np.empty(found, dtype=np.int64)
        out_old_versions = np.empty(found, dtype=np.int64)
        out_versions = np.empty(found, dtype=np.int64)
        out_deltas = np.empty((found, width), dtype=old.dtype)
        for u in range(found):
            h = unique[u]
            key = hkey[h]
            slot = key & SLOT_MASK
            b = (slot % k) * ntables + (key >> TABLE_SHIFT)
            j = fill[b]
            fill[b] = j + 1
            first, last = hfirst[h], hlast[h]
            out_slots[j] = slot
            out_old_versions[j] = old_versions[first]
            out_versions[j] = seqs[last]
            for c in range(width):
                out_deltas[j, c] = old[first, c] ^ new[last, c]
        return counts, out_slots, out_deltas, out_old_versions, out_versions

    return merge


def merge_rows(slots: np.ndarray, tables: np.ndarray, seqs: np.ndarray, old: np.ndarray, new: np.ndarray,
               old_versions: np.ndarray, k: int, ntables: int):
    """Merges the changes of a group (rows in push order: ``slots``, table ranks ``tables``, push sequences
    ``seqs``, ``(n, width)`` uint8 payloads ``old`` before and ``new`` after each change, ``old_versions``).

    Returns ``(counts, slots, deltas, old_versions, versions)``: one entry per row changed, grouped by stripe
    position then table (``counts[p, t]`` rows of table ``t`` at position ``p``; within one, in order of first
    change), each delta ``old`` of its first change XOR ``new`` of its last."""
    width = old.shape[1]
    if width % 8 == 0 and old.flags.c_contiguous and new.flags.c_contiguous:  # XOR 8 bytes at a time
        old, new = old.view(np.uint64), new.view(np.uint64)
    counts, out_slots, deltas, out_old, out_versions = _merge_kernel()(
        slots, tables, seqs, old, new, old_versions, k, ntables)
    return counts.reshape(k, ntables), out_slots, deltas.view(np.uint8), out_old, out_versions


def warm_up() -> None:
    """Compiles the kernel now (a replacement's first group must not wait for it)."""
    for dtype_width in (8, 3):
        one = np.zeros((1, dtype_width), dtype=np.uint8)
        merge_rows(np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64), one, one,
                   np.zeros(1, np.int64), 1, 1)
