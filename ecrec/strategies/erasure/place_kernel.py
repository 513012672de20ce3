"""The compiled placement check of :mod:`ecrec.strategies.erasure.parity_store` (numba; imported when first used).

Module-level, with no closure (a closure over the prefetch hint, an object of each process, would be cached anew by
every process; see ``merge_kernel``).  A batch's rows name parity slots at random: at millions of rows each
``slot_to_stripe`` entry read is a cache miss, so the loop fetches the one :data:`FETCH_ROWS` rows ahead
(:mod:`~ecrec.coding.kernels.prefetch`; cached only where the hint compiles) while it checks this one.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ecrec.coding.kernels import prefetch
from ecrec.coding.kernels.prefetch import fetch_read

#: how many rows ahead the check fetches the ``slot_to_stripe`` entry it will read
FETCH_ROWS = 16


@njit(nogil=True, boundscheck=False, inline="always")
def _next_row(counts, table, left):  # pragma: no cover - numba
    """A cursor over a batch's rows, table after table, moved one row on: ``(table, rows of it left after this)``
    (past the last row it stays in the last table)."""
    while left <= 0 and table + 1 < counts.shape[0]:
        table += 1
        left = counts[table]
    return table, left - 1


@njit(cache=prefetch.ENABLED, nogil=True, boundscheck=False)
def place(local, counts, offsets, limits, positions, k, slot_to_stripe):  # pragma: no cover - numba
    """Arena slots of a batch's rows (table after table), or -1 at the first row out of range or holding no parity
    row here (the caller refuses the batch)."""
    n = local.shape[0]
    slots = np.empty(n, dtype=np.int64)
    base = slot_to_stripe.ctypes.data
    tables = counts.shape[0]
    # a second cursor, FETCH_ROWS rows ahead: the table of that row (-1: none), and its rows left after it
    ahead_table, ahead_left = -1, 0
    for _ in range(FETCH_ROWS + 1):
        ahead_table, ahead_left = _next_row(counts, ahead_table, ahead_left)
    r = 0
    for t in range(tables):
        for _ in range(counts[t]):
            if r >= n:
                return slots, -1
            if r + FETCH_ROWS < n and ahead_table >= 0:  # a hint: an address out of range is never read
                fetch_read(base + (local[r + FETCH_ROWS] + offsets[ahead_table]) * 8)
            ahead_table, ahead_left = _next_row(counts, ahead_table, ahead_left)
            s = local[r]
            p = positions[r]
            if s < 0 or s >= limits[t] or p < 0 or p >= k:
                return slots, r
            s += offsets[t]
            if slot_to_stripe[s] < 0:
                return slots, r
            slots[r] = s
            r += 1
    if r != n:
        return slots, -1
    return slots, n
