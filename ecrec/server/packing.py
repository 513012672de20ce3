"""A push's rows of every table in one set of arrays (:class:`~ecrec.strategies.base.PackedRows`).

Where a strategy wants each row's delta (``needs_delta``), the compiled optimizer pass of each table writes it into
its part of one buffer for the whole push, and the rows' slots and old versions go into two more: a strategy that
keeps pushes and merges them later (erasure coding's groups) then handles one segment per push, not one per table
-- its Python work per push no longer grows with the number of tables (with 8 tables, a group of 24 pushes was 192
arrays to concatenate, check and address; now 24).  Each table's ``TableUpdate`` holds views of its part, so
nothing else changes.  Only where every table of the push goes through the compiled pass with one row width
(otherwise None: each table's arrays are its own, as before).
"""

from __future__ import annotations

import numpy as np

from ecrec.strategies.base import PackedRows


class PackedPush:
    """The buffers of one push being applied: :meth:`deltas_of` and :meth:`versions_of` give table ``i``'s parts
    (to ``prepare_gradients`` and ``commit``), :attr:`rows` what the strategy gets."""

    def __init__(self, slots: list[np.ndarray], row_bytes: int):
        starts = [0]
        for s in slots:
            starts.append(starts[-1] + len(s))
        total = starts[-1]
        self.starts = starts  # Python ints: a view per table costs a slice, no conversion
        self.deltas = np.empty((total, row_bytes), dtype=np.uint8)
        self.old_versions = np.empty(total, dtype=np.int64)
        self.rows = PackedRows(np.concatenate(slots).astype(np.int64, copy=False), self.deltas, self.old_versions,
                               np.array(starts, dtype=np.int64))

    def deltas_of(self, i: int) -> np.ndarray:
        return self.deltas[self.starts[i]:self.starts[i + 1]]

    def versions_of(self, i: int) -> np.ndarray:
        return self.old_versions[self.starts[i]:self.starts[i + 1]]


def packed_for(table_plans) -> PackedPush | None:
    """Buffers for a push's table plans (``(shard, ids, slots, gradients)``; gradients an ``Assignment`` for a load),
    or None where they cannot be one set: an assignment, a table the compiled pass does not take, row widths that
    differ, no rows."""
    from ecrec.server.requests import Assignment

    if not table_plans:
        return None
    row_bytes = table_plans[0][0].spec.row_bytes
    for shard, _, _, g in table_plans:
        if isinstance(g, Assignment) or not shard.compiled or shard.spec.row_bytes != row_bytes:
            return None
    packed = PackedPush([slots for _, _, slots, _ in table_plans], row_bytes)
    return packed if len(packed.rows.slots) else None
