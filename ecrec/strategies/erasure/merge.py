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

import numpy as np

#: segments of at least this many payload bytes on average are read in place (fetching an array's address costs
#: a few microseconds in Python; concatenating small ones is cheaper)
IN_PLACE_MIN_BYTES = 64 << 10


def _merge_kernel():
    """The compiled merge (``merge_kernel.merge``: loaded from numba's disk cache, or compiled once per word
    size and cached there)."""
    from ecrec.strategies.erasure import merge_kernel

    return merge_kernel.merge


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
    if n >= 2**31:  # the kernel numbers changes and rows in int32
        raise ValueError(f"merge_rows: {n:,} changes in one group; at most 2**31 - 1")
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
    counts, out_slots, merged, out_old, out_versions = _merge_kernel()(
        np.concatenate(slots).astype(np.int64, copy=False), np.repeat(np.asarray(tables, dtype=np.int64), lengths),
        np.repeat(np.asarray(seqs, dtype=np.int64), lengths),
        np.concatenate(old_versions).astype(np.int64, copy=False), segment, offset,
        np.array([a.ctypes.data for a in deltas], dtype=np.int64), seg_rows, width // np.dtype(word).itemsize, k,
        ntables, np.empty((0, 1), dtype=word))
    return counts.reshape(k, ntables), out_slots, merged.view(np.uint8), out_old, out_versions


def warm_up() -> None:
    """Compiles the kernels now (a replacement's first group must not wait for them)."""
    for width in (8, 3):
        one = np.zeros((1, width), dtype=np.uint8)
        merge_rows([np.zeros(1, np.int64)], [0], [1], [one], [np.zeros(1, np.int64)], 1, 1)
