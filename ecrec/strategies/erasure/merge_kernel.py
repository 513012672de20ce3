"""The compiled merge of :mod:`ecrec.strategies.erasure.merge` (numba; imported when first used).

Module-level, with no closure: numba caches it on disk once per word size, so a server process loads it instead
of compiling it (a closure over a fresh intrinsic compiled it in every process: seconds of CPU per server start,
and a new cache file each time).
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

#: a row's key: its table's rank above its slot
TABLE_SHIFT = 40
SLOT_MASK = (1 << TABLE_SHIFT) - 1


@intrinsic
def _pointer_like(typingctx, address, proto):  # pragma: no cover - numba
    """The address as a pointer to elements of ``proto``'s dtype (the rows a segment's delta array holds)."""
    signature = types.CPointer(proto.dtype)(types.intp, proto)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return signature, codegen


@njit(cache=True, nogil=True, boundscheck=False)
def merge(slots, tables, seqs, old_versions, segment, offset, addresses, counts_in, width, k,
          ntables, proto):  # pragma: no cover - numba
    n = slots.shape[0]
    bits = 4
    while (1 << bits) < 2 * n:
        bits += 1
    size = 1 << bits
    mask = size - 1
    shift = np.uint64(64 - bits)
    # open addressing: a cell holds a key (-1: empty) and its row's number u, side by side (one cache line a
    # probe); per row u, in order of first change: its key, first and last change, and place in the output
    table = np.empty((size, 2), dtype=np.int64)
    for h in range(size):
        table[h, 0] = -1
    cell = np.empty(n, dtype=np.int32)  # each change's row number u
    keys = np.empty(n, dtype=np.int64)  # per row u: its key, first and last change
    first = np.empty(n, dtype=np.int32)
    last = np.empty(n, dtype=np.int32)
    found = 0
    for i in range(n):
        key = (tables[i] << TABLE_SHIFT) | slots[i]
        h = np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> shift)
        while True:
            kk = table[h, 0]
            if kk == key:
                u = table[h, 1]
                last[u] = i
                break
            if kk == -1:
                u = found
                table[h, 0] = key
                table[h, 1] = u
                keys[u] = key
                first[u] = i
                last[u] = i
                found += 1
                break
            h = (h + 1) & mask
        cell[i] = u
    counts = np.zeros(k * ntables, dtype=np.int64)
    for u in range(found):
        key = keys[u]
        counts[((key & SLOT_MASK) % k) * ntables + (key >> TABLE_SHIFT)] += 1
    fill = np.empty(k * ntables, dtype=np.int64)
    total = 0
    for b in range(k * ntables):
        fill[b] = total
        total += counts[b]
    out_slots = np.empty(found, dtype=np.int64)
    out_old_versions = np.empty(found, dtype=np.int64)
    out_versions = np.empty(found, dtype=np.int64)
    out_deltas = np.empty((found, width), dtype=proto.dtype)
    position = np.empty(found, dtype=np.int32)
    for u in range(found):
        key = keys[u]
        slot = key & SLOT_MASK
        b = (slot % k) * ntables + (key >> TABLE_SHIFT)
        j = fill[b]
        fill[b] = j + 1
        position[u] = j
        out_slots[j] = slot
        out_old_versions[j] = old_versions[first[u]]
        out_versions[j] = seqs[last[u]]
    for i in range(n):
        u = cell[i]
        j = position[u]
        s = segment[i]
        rows = carray(_pointer_like(addresses[s], proto), (counts_in[s], width))
        r = offset[i]
        if first[u] == i:
            for c in range(width):
                out_deltas[j, c] = rows[r, c]
        else:
            for c in range(width):
                out_deltas[j, c] ^= rows[r, c]
    return counts, out_slots, out_deltas, out_old_versions, out_versions
