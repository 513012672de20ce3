"""The compiled row loops of the ISA-L backend (``ecrec.coding.kernels.cpu``), imported when first used.

ISA-L's entry points are called through their addresses, passed in as arguments (not baked into the code as a
ctypes object's constants would be), so numba caches the loops on disk: a server loads them instead of compiling
them at every start (0.8 s of CPU each time before).  Per row: ``dst ^= c * src`` over ``width`` bytes, with
``gf_vect_mad`` from ``min_mad`` bytes up and ``ec_encode_data_update`` below.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

#: bytes of one coefficient's ISA-L table (``ec_init_tables`` with k = rows = 1)
TABLE_BYTES = 32


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


_ip = types.intp


# compiled eagerly (explicit signatures; loaded from numba's cache when there): never inside a first request
@njit(types.void(_ip, _ip, _ip, _ip, _ip, _ip, _ro(types.int64), _ro(types.uint8), _ip, _ip, _ip),
      cache=True, nogil=True, boundscheck=False)
def loop(mad, update, p_addr, p_stride, d_addr, d_stride, slots, coeffs, t_addr, width, min_mad):  # pragma: no cover
    coding = np.empty(1, dtype=np.uint64)  # ec_encode_data_update wants an array of dest pointers
    coding_addr = coding.ctypes.data
    for r in range(slots.shape[0]):
        c = coeffs[r]
        if c == 0:
            continue
        _row(mad, update, c, p_addr + slots[r] * p_stride, d_addr + r * d_stride, t_addr, width, min_mad, coding,
             coding_addr)


@njit(types.int64(_ip, _ip, _ip, _ip, _ip, _ip, _ro(types.int64), _ro(types.int64), _ro(types.uint8),
                  types.Array(types.int64, 1, "C"), types.Array(types.boolean, 1, "C"), _ro(types.int64), _ip, _ip,
                  _ip, _ip),
      cache=True, nogil=True, boundscheck=False)
def versioned(mad, update, p_addr, p_stride, d_addr, d_stride, slots, positions, coeff_row, vflat, built, seqs, k,
              t_addr, width, min_mad):  # pragma: no cover - numba
    coding = np.empty(1, dtype=np.uint64)
    coding_addr = coding.ctypes.data
    applied = 0
    for r in range(slots.shape[0]):
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
