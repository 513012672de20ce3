"""One delta per row per group: the changes of a group of pushes, merged.

A group's pushes arrive as the server applied them: per push and table, the rows' slots, their deltas
(``payload before XOR after``, computed while the rows were in cache) and their versions before it.  A row
changed by several pushes of the group needs one delta, the XOR of its deltas (consecutive deltas XOR to
``payload before the group's first push to it XOR payload after its last``), stamped with its version before
the first and the last push's sequence.  :func:`merge_rows` finds each row's changes with a hash table and
writes the merged deltas grouped by stripe position, then table -- so the rows of one destination are one run
-- in one compiled pass.  Large segments (at scale: a few
pushes of many rows) are read in place, not concatenated: those payloads are cold by then, and every pass
over them costs memory bandwidth; many small ones (a hot, skewed workload) are concatenated first.
"""

from __future__ import annotations

import functools

import numpy as np

#: a row's key: its table's rank above its slot
TABLE_SHIFT = 40
SLOT_MASK = (1 << TABLE_SHIFT) - 1
#: segments of at least this many payload bytes on average are read in place (fetching an array's address costs
#: a few microseconds in Python; concatenating small ones is cheaper)
IN_PLACE_MIN_BYTES = 64 << 10


@functools.lru_cache(maxsize=None)
def _merge_kernel(word: str):
    """Compiles (once per word size, cached on disk by numba) the merge; rows are XORed ``word`` at a time."""
    from numba import carray, njit, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    dtype = np.dtype(word)

    @intrinsic
    def as_pointer(typingctx, address):  # pragma: no cover - numba
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], cgutils.voidptr_t)

        return types.voidptr(types.intp), codegen

    @njit(cache=True, nogil=True, boundscheck=False)
    def merge(slots, tables, seqs, old_versions, segment, offset, addresses, counts_in, width, k,
              ntables):  # pragma: no cover - numba
        n = slots.shape[0]
        bits = 4
        while (1 << bits) < 2 * n:
            bits += 1
        size = 1 << bits
        mask = size - 1
        shift = np.uint64(64 - bits)
        hkey = np.full(size, -1, dtype=np.int64)
        hfirst = np.empty(size, dtype=np.int64)
        hlast = np.empty(size, dtype=np.int64)
        cell = np.empty(n, dtype=np.int64)  # each change's hash cell
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
            cell[i] = h
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
        out_deltas = np.empty((found, width), dtype=dtype)
        position = np.empty(size, dtype=np.int64)  # hash cell -> its row in the output
        for u in range(found):
            h = unique[u]
            key = hkey[h]
            slot = key & SLOT_MASK
            b = (slot % k) * ntables + (key >> TABLE_SHIFT)
            j = fill[b]
            fill[b] = j + 1
            position[h] = j
            out_slots[j] = slot
            out_old_versions[j] = old_versions[hfirst[h]]
            out_versions[j] = seqs[hlast[h]]
        for i in range(n):  # every change, in push order: the first copied, later ones XORed on
            h = cell[i]
            j = position[h]
            s = segment[i]
            rows = carray(as_pointer(addresses[s]), (counts_in[s], width), dtype)
            r = offset[i]
            if hfirst[h] == i:
                for c in range(width):
                    out_deltas[j, c] = rows[r, c]
            else:
                for c in range(width):
                    out_deltas[j, c] ^= rows[r, c]
        return counts, out_slots, out_deltas, out_old_versions, out_versions

    return merge


def merge_rows(slots: list[np.ndarray], tables: list[int], seqs: list[int], deltas: list[np.ndarray],
               old_versions: list[np.ndarray], k: int, ntables: int):
    """Merges the changes of a group, given segment by segment in push order (a segment: one push's rows of one
    table: ``slots``, the table's rank, the push's sequence, ``(rows, width)`` uint8 ``deltas`` (payload before
    XOR after), ``old_versions``; every delta array the same width and C-contiguous).

    Returns ``(counts, slots, deltas, old_versions, versions)``: one entry per row changed, grouped by stripe
    position then table (``counts[p, t]`` rows of table ``t`` at position ``p``; within one, in order of first
    change), each delta the XOR of the row's deltas in the group (its payload before the first XOR after the
    last), its version before the first and the last one's sequence."""
    width = deltas[0].shape[1]
    word = "uint64" if width % 8 == 0 else "uint8"
    lengths = np.array([len(a) for a in slots], dtype=np.int64)
    n = int(lengths.sum())
    if n * width < IN_PLACE_MIN_BYTES * len(slots):
        # many small segments: one concatenation is cheaper than fetching every array's address here
        deltas = [np.concatenate(deltas)]
        segment, offset, seg_rows = np.zeros(n, np.int64), np.arange(n, dtype=np.int64), np.array([n], np.int64)
    else:
        segment = np.repeat(np.arange(len(slots), dtype=np.int64), lengths)
        offset = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        seg_rows = lengths
    for a in deltas:
        if not a.flags.c_contiguous or a.dtype != np.uint8 or a.shape[1] != width:
            raise ValueError("merge_rows needs C-contiguous uint8 deltas of one width")
    counts, out_slots, merged, out_old, out_versions = _merge_kernel(word)(
        np.concatenate(slots).astype(np.int64, copy=False), np.repeat(np.asarray(tables, dtype=np.int64), lengths),
        np.repeat(np.asarray(seqs, dtype=np.int64), lengths),
        np.concatenate(old_versions).astype(np.int64, copy=False), segment, offset,
        np.array([a.ctypes.data for a in deltas], dtype=np.int64), seg_rows, width // np.dtype(word).itemsize, k,
        ntables)
    return counts.reshape(k, ntables), out_slots, merged.view(np.uint8), out_old, out_versions


def warm_up() -> None:
    """Compiles the kernels now (a replacement's first group must not wait for them)."""
    for width in (8, 3):
        one = np.zeros((1, width), dtype=np.uint8)
        merge_rows([np.zeros(1, np.int64)], [0], [1], [one], [np.zeros(1, np.int64)], 1, 1)
