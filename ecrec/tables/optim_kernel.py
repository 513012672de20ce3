"""The optimizer's pass over a push's rows, compiled: gather, update, check, and keep the old bytes, in one call.

:func:`ecrec.tables.optim.apply` is the reference (numpy, ``torch.optim`` semantics); :func:`update_rows` computes
bit for bit the same float32 results (the same operations in the same order, each rounded to float32, no fused
multiply-add: numba contracts nothing unless ``fastmath``) in one pass per row while the row is in cache: copy it
out of the table, keep its old bytes when a strategy needs them (a row to restore) or its delta (old bytes XOR new:
parity's update, written once, while both are in cache), apply the optimizer, and flag it when a result is not
finite.  Per table and push that is one compiled call with the GIL
released, where numpy takes about a dozen calls, each a pass over the rows and a temporary.  Compiled once and
cached on disk by numba, like the parity merge (where the prefetch hint below compiles).

A push's rows are at random slots of a table of millions: each a cache miss that one row's work is too long for
the CPU to start early, so the pass fetches the row :data:`FETCH_ROWS` rows ahead
(:mod:`~ecrec.coding.kernels.prefetch`: its first kilobyte; the pass only reads the table) while it updates this one.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ecrec.coding.kernels import prefetch
from ecrec.coding.kernels.prefetch import fetch_lines

SGD, ADAGRAD = 0, 1
#: how many rows ahead the pass fetches the table row it will update
FETCH_ROWS = 8
KINDS = {"sgd": SGD, "adagrad": ADAGRAD}
#: what the pass keeps of each row's bytes before the update: nothing, the bytes, or the delta (bytes XOR after)
KEEP_NOTHING, KEEP_OLD, KEEP_DELTA = 0, 1, 2


# error_model="numpy": a division by zero gives inf or NaN, as in numpy (the row is then refused as not finite),
# not a ZeroDivisionError
@njit(cache=prefetch.ENABLED, nogil=True, boundscheck=False, error_model="numpy")
def _update(table_f, table_u, slots, grads, dim, kind, neg_lr, eps, rows_f, rows_u, old_u, keep,
            bad):  # pragma: no cover - numba
    n = slots.shape[0]
    width = table_f.shape[1]
    for i in range(n):  # every slot in range before any is read (the table is read without bounds checks)
        if slots[i] < 0 or slots[i] >= table_f.shape[0]:
            return -1 - i
    any_bad = 0
    base, row_bytes = table_u.ctypes.data, width * 4  # C-contiguous rows (``usable``), every slot in range
    for i in range(min(n, FETCH_ROWS)):
        fetch_lines(base + slots[i] * row_bytes, row_bytes, False)
    for i in range(n):
        if i + FETCH_ROWS < n:
            fetch_lines(base + slots[i + FETCH_ROWS] * row_bytes, row_bytes, False)
        s = slots[i]
        for c in range(width):  # the row's bits as they are (NaN payloads included): the old bytes, exactly
            rows_u[i, c] = table_u[s, c]
        if keep == KEEP_OLD:
            for c in range(width):
                old_u[i, c] = table_u[s, c]
        if kind == ADAGRAD:
            for c in range(dim):  # s += g * g; w += -lr * (g / (sqrt(s) + eps)), each step rounded to float32
                g = grads[i, c]
                state = rows_f[i, dim + c] + g * g
                rows_f[i, dim + c] = state
                std = np.sqrt(state) + eps
                rows_f[i, c] = rows_f[i, c] + neg_lr * (g / std)
        else:
            for c in range(dim):
                rows_f[i, c] = rows_f[i, c] + neg_lr * grads[i, c]
        finite = True
        for c in range(width):
            if not np.isfinite(rows_f[i, c]):
                finite = False
        bad[i] = not finite
        if not finite:
            any_bad = 1
        if keep == KEEP_DELTA:  # the row's old bytes (still in the table) XOR its new ones, both in cache
            for c in range(width):
                old_u[i, c] = table_u[s, c] ^ rows_u[i, c]
    return any_bad


def usable(table: np.ndarray, optimizer: str) -> bool:
    """Whether :func:`update_rows` takes this table (a C-contiguous float32 array of rows in host memory, a known
    optimizer); else the caller uses the numpy reference."""
    return (type(table) is np.ndarray and table.ndim == 2 and table.dtype == np.float32
            and table.flags.c_contiguous and optimizer in KINDS)


def update_rows(table: np.ndarray, slots: np.ndarray, grads: np.ndarray, optimizer: str, dim: int, lr: float,
                eps: float, keep_old: bool, delta: bool = False
                ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Rows ``slots`` (unique, in range) of ``table`` (``(slots, row_floats)`` float32) after the optimizer with
    ``grads`` (``(n, dim)`` float32), on copies -- ``table`` is only read.  Returns ``(rows, old, bad)``: the new
    rows (``(n, row_floats)`` float32), their bytes before (``(n, row_bytes)`` uint8, when ``keep_old``) -- or,
    with ``delta``, their bytes before XOR after (the same array, no separate pass) --, and a mask of the rows whose
    result is not finite (None when every one is).  A slot out of range raises ``IndexError`` (nothing is read)."""
    n, width = len(slots), table.shape[1]
    keep_old = keep_old or delta
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    grads = np.ascontiguousarray(grads, dtype=np.float32).reshape(n, dim)
    rows = np.empty((n, width), dtype=np.float32)
    old = np.empty((n, width * 4), dtype=np.uint8) if keep_old else np.empty((0, 0), dtype=np.uint8)
    bad = np.empty(n, dtype=np.bool_)
    found = _update(table, table.view(np.uint32), slots, grads, dim, KINDS[optimizer], np.float32(-lr),
                    np.float32(eps), rows, rows.view(np.uint32), old.view(np.uint32),
                    KEEP_DELTA if delta else KEEP_OLD if keep_old else KEEP_NOTHING, bad)
    if found < 0:
        i = -1 - found
        raise IndexError(f"slot {int(slots[i])} is out of range for a table of {table.shape[0]} slots")
    return rows, (old if keep_old else None), (bad if found else None)


def warm_up() -> None:
    """Loads (or compiles) the kernel now, not in a server's first push: for gradients in a buffer of their own and
    for read-only ones (a request's bytes seen as floats in place: numba compiles each kind apart)."""
    table = np.zeros((2, 2), dtype=np.float32)
    grads = np.zeros((1, 1), np.float32)
    update_rows(table, np.zeros(1, np.int64), grads, "adagrad", 1, 0.1, 1e-10, True, delta=True)
    grads.setflags(write=False)
    update_rows(table, np.zeros(1, np.int64), grads, "adagrad", 1, 0.1, 1e-10, True, delta=True)
