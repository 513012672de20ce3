"""The compiled row loops of the ISA-L backend (``ecrec.coding.kernels.cpu``), imported when first used.

ISA-L's entry points are called through their addresses, passed in as arguments (not baked into the code as a
ctypes object's constants would be), so numba caches the loops on disk: a server loads them instead of compiling
them at every start (0.8 s of CPU each time before).  Per row: ``dst ^= c * src`` over ``width`` bytes, with
``gf_vect_mad`` from ``min_mad`` bytes up and ``ec_encode_data_update`` below.

The parity rows a batch updates are scattered over the arena (at millions of rows, each a cache miss and often a
TLB miss), and each row's ISA-L call is too long for the CPU to run ahead to the next row's: so the loops ask for
the parity row :data:`PREFETCH_ROWS` rows ahead (its first ``prefetch.MAX_BYTES``, and its version and built
flags) while they work on this one (:mod:`~ecrec.coding.kernels.prefetch`).  Where this numba cannot emit
``llvm.prefetch``, the loops do without it.
"""

from __future__ import annotations

import logging

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ecrec.coding.kernels import prefetch

log = logging.getLogger("ecrec.kernels")

#: bytes of one coefficient's ISA-L table (``ec_init_tables`` with k = rows = 1)
TABLE_BYTES = 32
#: how many rows ahead the loops fetch the parity row they will update (8: 1.24x the deltas applied per second at
#: random slots of 512-byte rows, docs/results/apply-prefetch)
PREFETCH_ROWS = 8


@intrinsic
def _gf_vect_mad(typingctx, fn, length, vec, vec_i, tables, src, dest):  # pragma: no cover - numba
    """``gf_vect_mad(int len, int vec, int vec_i, u8 *gftbls, u8 *src, u8 *dest)`` at address ``fn``."""
    signature = types.void(types.intp, types.int32, types.int32, types.int32, types.intp, types.intp, types.intp)

    def codegen(context, builder, sig, args):
        i32, ip = ir.IntType(32), context.get_value_type(types.intp)
        fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, ip, ip, ip])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), args[1:])
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _ec_encode_data_update(typingctx, fn, length, k, rows, vec_i, tables, data, coding):  # pragma: no cover
    """``ec_encode_data_update(int len, int k, int rows, int vec_i, u8 *g_tbls, u8 *data, u8 **coding)`` at
    address ``fn``."""
    signature = types.void(types.intp, types.int32, types.int32, types.int32, types.int32, types.intp, types.intp,
                           types.intp)

    def codegen(context, builder, sig, args):
        i32, ip = ir.IntType(32), context.get_value_type(types.intp)
        fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i32, ip, ip, ip])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), args[1:])
        return context.get_dummy_value()

    return signature, codegen


@njit(nogil=True, boundscheck=False, inline="always")
def _row(mad, update, c, dst, src, t_addr, width, min_mad, coding, coding_addr):  # pragma: no cover - numba
    """The step both loops take per row (``coding``: a one-pointer array the loop allocates once)."""
    tbl = t_addr + np.int64(c) * TABLE_BYTES
    if width >= min_mad:
        _gf_vect_mad(mad, width, 1, 0, tbl, src, dst)
    else:
        coding[0] = dst
        _ec_encode_data_update(update, width, 1, 1, 0, tbl, src, coding_addr)


def _ro(dtype):  # read-only arrays (frombuffer) and writable ones both convert to this
    return types.Array(dtype, 1, "C", readonly=True)


def _loop(mad, update, p_addr, p_stride, d_addr, d_stride, slots, coeffs, t_addr, width,
          min_mad):  # pragma: no cover - numba
    coding = np.empty(1, dtype=np.uint64)  # ec_encode_data_update wants an array of dest pointers
    coding_addr = coding.ctypes.data
    n = slots.shape[0]
    for r in range(min(n, PREFETCH_ROWS)):
        prefetch.fetch_lines(p_addr + slots[r] * p_stride, width)
    for r in range(n):
        if r + PREFETCH_ROWS < n:
            prefetch.fetch_lines(p_addr + slots[r + PREFETCH_ROWS] * p_stride, width)
        c = coeffs[r]
        if c == 0:
            continue
        _row(mad, update, c, p_addr + slots[r] * p_stride, d_addr + r * d_stride, t_addr, width, min_mad, coding,
             coding_addr)


def _versioned(mad, update, p_addr, p_stride, d_addr, d_stride, slots, positions, coeff_row, vflat, built, seqs, k,
               t_addr, width, min_mad):  # pragma: no cover - numba
    coding = np.empty(1, dtype=np.uint64)
    coding_addr = coding.ctypes.data
    applied = 0
    n = slots.shape[0]
    v_addr, b_addr = vflat.ctypes.data, built.ctypes.data
    for r in range(min(n, PREFETCH_ROWS)):
        prefetch.fetch_lines(p_addr + slots[r] * p_stride, width)
        prefetch.fetch(v_addr + (slots[r] * k + positions[r]) * 8)
        prefetch.fetch_read(b_addr + slots[r])
    for r in range(n):
        if r + PREFETCH_ROWS < n:  # this row's parity, version and built flag on their way by then
            ahead = slots[r + PREFETCH_ROWS]
            prefetch.fetch_lines(p_addr + ahead * p_stride, width)
            prefetch.fetch(v_addr + (ahead * k + positions[r + PREFETCH_ROWS]) * 8)
            prefetch.fetch_read(b_addr + ahead)
        s = slots[r]
        if not built[s]:
            continue
        w = s * k + positions[r]
        if seqs[r] <= vflat[w]:
            continue
        vflat[w] = seqs[r]
        applied += 1
        c = coeff_row[positions[r]]
        if c == 0:
            continue
        _row(mad, update, c, p_addr + s * p_stride, d_addr + r * d_stride, t_addr, width, min_mad, coding,
             coding_addr)
    return applied


def _compile(cache: bool = True):
    """Both loops, compiled eagerly (explicit signatures; loaded from numba's cache when there): never inside a
    first request.  The cache is keyed by the code, not by :data:`PREFETCHES`: loops built without the hint are
    never cached (``cache=False``), so none is ever loaded where the hint compiles."""
    ip = types.intp
    loop_signature = types.void(ip, ip, ip, ip, ip, ip, _ro(types.int64), _ro(types.uint8), ip, ip, ip)
    versioned_signature = types.int64(ip, ip, ip, ip, ip, ip, _ro(types.int64), _ro(types.int64), _ro(types.uint8),
                                      types.Array(types.int64, 1, "C"), types.Array(types.boolean, 1, "C"),
                                      _ro(types.int64), ip, ip, ip, ip)
    return (njit(loop_signature, cache=cache, nogil=True, boundscheck=False)(_loop),
            njit(versioned_signature, cache=cache, nogil=True, boundscheck=False)(_versioned))


try:
    loop, versioned = _compile(cache=prefetch.ENABLED)
except Exception as exc:  # noqa: BLE001 - the hint compiled in the probe, not here: the same loops without it
    log.warning("the ISA-L loops compile without prefetching (%s)", exc)
    prefetch.ENABLED = False  # and so every loop compiled after (none of them cached)
    loop, versioned = _compile(cache=False)
#: whether the loops prefetch (False where this numba's LLVM would not compile them with ``llvm.prefetch``)
PREFETCHES = prefetch.ENABLED
