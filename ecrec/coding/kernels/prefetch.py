"""A cache-line prefetch for compiled loops that touch rows at random slots (numba; imported when first used).

``fetch(address)`` asks the CPU for the cache line at ``address`` for writing (``llvm.prefetch``): no fault on any
address, no effect on results, only on when the line arrives.  ``fetch_lines(address, nbytes)`` asks for every line
of ``nbytes`` from ``address``.  A loop fetches the row it will touch a few iterations ahead, so that the misses of
rows scattered over a large array overlap instead of coming one after another.

Whether this numba's LLVM takes the hint is tried once, at import, on a one-line loop (cached on disk by numba like
the others); where it does not, :data:`ENABLED` is False, a warning says so, and the hint compiles to nothing in
every loop compiled after (read when a loop is compiled, not at run time).
"""

from __future__ import annotations

import logging

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

log = logging.getLogger("ecrec.kernels")

#: a cache line
LINE = 64
#: whether ``fetch`` emits the hint (False: nothing, where LLVM will not take it)
ENABLED = True


@intrinsic
def fetch(typingctx, address):  # pragma: no cover - numba
    """A hint to fetch the cache line at ``address`` for writing (a no-op where the CPU has no such instruction)."""
    signature = types.void(types.intp)

    def codegen(context, builder, sig, args):
        if ENABLED:
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p],
                                                  ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
            # rw = 1 (a write follows), locality = 3 (keep it in every cache level), cache type = 1 (data)
            builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, 1), ir.Constant(i32, 3),
                              ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return signature, codegen


@njit(nogil=True, boundscheck=False, inline="always")
def fetch_lines(address, nbytes):  # pragma: no cover - numba
    """Fetches every cache line of ``nbytes`` from ``address`` (which need not start a line)."""
    line = address - address % LINE
    end = address + nbytes
    while line < end:
        fetch(line)
        line += LINE


def _probe():
    """A loop with the hint, compiled now (or loaded from numba's cache, once it compiled here)."""
    return njit(types.void(types.intp), cache=True, nogil=True)(_probe_loop)


def _probe_loop(address):  # pragma: no cover - numba
    fetch(address)


try:
    _probe()
except Exception as exc:  # noqa: BLE001 - an LLVM that will not take the hint: loops without it
    log.warning("compiled loops run without prefetching: this numba's LLVM does not take llvm.prefetch (%s)", exc)
    ENABLED = False
