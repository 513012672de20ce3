"""Values written into tables and dense tensors, checked before anything is sent: which columns of a row a write
names (weights, optimizer state, the whole payload), finite float32 numbers, Adagrad accumulators not negative.
Used by every writer: warm starts and ``write_rows``, ``load_state_dict``, snapshot restores."""

from __future__ import annotations

import numpy as np

from ecrec.tables.spec import DenseSpec, TableSpec

#: values are checked this many bytes at a time (a memory-mapped file stays on disk)
CHECK_BYTES = 16 << 20

#: what :meth:`RowIO.read_table` and :meth:`RowIO.write_rows` read or replace of each row
ROW_PARTS = ("weights", "state", "payload")


def columns_of(spec: TableSpec, what: str) -> slice:
    """The columns of a row's float32 payload that ``what`` (:data:`ROW_PARTS`) names."""
    if what == "weights":
        return slice(0, spec.dim)
    if what == "payload":
        return slice(0, spec.row_floats)
    if what == "state":
        if spec.row_floats == spec.dim:
            raise ValueError(f"table {spec.name!r}: optimizer {spec.optimizer!r} keeps no state")
        return slice(spec.dim, spec.row_floats)
    raise ValueError(f"what must be one of {ROW_PARTS}, got {what!r}")


def check_values(spec: TableSpec, values, what: str = "weights") -> None:
    """Raises ``ValueError`` naming the table and the rows when ``values`` are not finite numbers (read a
    push's worth at a time: a memory-mapped file stays on disk)."""
    width = columns_of(spec, what).stop - columns_of(spec, what).start
    chunk = max(1, min(CHECK_BYTES // (4 * width), 65536))
    # Adagrad's accumulators: the state columns (all of them for "state", past dim for "payload")
    state_from = {"state": 0, "payload": spec.dim}.get(what) if spec.optimizer == "adagrad" else None
    for start in range(0, len(values), chunk):
        piece = np.asarray(values[start:start + chunk])
        if piece.dtype.kind not in "fiu":
            raise ValueError(f"table {spec.name!r}: {what} must be numbers, got {piece.dtype}")
        with np.errstate(over="ignore"):
            piece = piece.astype(np.float32, copy=False)  # as sent: 1e39 is Inf in float32
        finite = np.isfinite(piece)
        if not finite.all():
            bad = start + np.flatnonzero(~finite.reshape(len(piece), -1).all(axis=1))
            raise ValueError(f"table {spec.name!r}: {what} must be finite float32 numbers ({_rows(bad)} "
                             f"{'is' if len(bad) == 1 else 'are'} not)")
        if state_from is not None:
            negative = (piece.reshape(len(piece), -1)[:, state_from:] < 0).any(axis=1)
            if negative.any():
                raise ValueError(f"table {spec.name!r}: an Adagrad accumulator is negative "
                                 f"({_rows(start + np.flatnonzero(negative))})")


def _rows(rows: np.ndarray) -> str:
    """``row 5``, ``rows 5, 9, 12``, ``rows 5, 9, 12, ... (40 rows)``: the rows a check found, by position."""
    shown = ", ".join(str(int(r)) for r in rows[:3])
    if len(rows) == 1:
        return f"row {shown}"
    return f"rows {shown}" + (f", ... ({len(rows)} rows)" if len(rows) > 3 else "")


def check_dense_values(spec: DenseSpec, payload: np.ndarray) -> None:
    """Raises ``ValueError`` naming the tensor when a dense payload (weights then optimizer state, float32)
    is not finite or holds a negative Adagrad accumulator."""
    if not np.isfinite(payload).all():
        raise ValueError(f"dense tensor {spec.name!r}: the payload must be finite float32 numbers")
    if spec.optimizer == "adagrad" and (payload[spec.numel:] < 0).any():
        raise ValueError(f"dense tensor {spec.name!r}: an Adagrad accumulator is negative")
