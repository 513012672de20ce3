"""A cache-line prefetch for compiled loops that touch rows at random slots (numba; imported by the modules of those
loops: the parity apply, the placement check, the optimizer's pass).

``fetch(address)`` asks the CPU for the cache line at ``address`` to write it, ``fetch_read(address)`` to read it
(``llvm.prefetch``): no fault on any address, no effect on results, only on when the line arrives.
``fetch_lines(address, nbytes[, write])`` asks for every line of ``nbytes`` from ``address`` (at most
:data:`MAX_BYTES`: the hardware's own prefetcher follows a longer row).  A loop fetches the row it will touch a few
iterations ahead, so that the misses of rows scattered over a large array overlap instead of coming one after
another.

Whether this numba's LLVM takes the hint is tried once, at import, on a one-line loop (cached on disk by numba like
the others).  Where it does not, :data:`ENABLED` is False and a warning says so; the hint then compiles to nothing
in every loop compiled after (the flag is read when a loop is compiled, not at run time), and those loops are not
cached (``cache=ENABLED``: numba's cache key is a loop's own code, not this flag, so a loop built without the hint
must not be loaded where the hint compiles).  For the same reason numba does not see an edit of this file in the
loops cached from it: clear their ``__pycache__/*.nb[ic]`` after one.
"""

from __future__ import annotations

import logging

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

log = logging.getLogger("ecrec.kernels")

#: a cache line
LINE = 64
#: the most a ``fetch_lines`` asks for
MAX_BYTES = 1024
#: whether the hint is emitted (False: nothing, where LLVM will not take it)
ENABLED = True


def _hint(write: int):
    """The codegen of a prefetch for writing (1) or reading (0)."""

    def codegen(context, builder, sig, args):
        if ENABLED:
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p],
                                                  ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
            # rw, locality = 3 (keep it in every cache level), cache type = 1 (data)
            builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, write), ir.Constant(i32, 3),
                              ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return codegen


@intrinsic
def fetch(typingctx, address):  # pragma: no cover - numba
    """A hint to fetch the cache line at ``address`` to write it (a no-op where the CPU has no such instruction)."""
    return types.void(types.intp), _hint(1)


@intrinsic
def fetch_read(typingctx, address):  # pragma: no cover - numba
    """A hint to fetch the cache line at ``address`` to read it."""
    return types.void(types.intp), _hint(0)


@njit(nogil=True, boundscheck=False, inline="always")
def fetch_lines(address, nbytes, write=True):  # pragma: no cover - numba
    """Fetches, to write them (or, ``write=False``, to read them), the cache lines of ``nbytes`` (at most
    ``MAX_BYTES``) from ``address`` (which need not start a line).  ``write`` is a constant at every call: the
    branch compiles away."""
    line = address - address % LINE
    end = address + min(nbytes, MAX_BYTES)
    while line < end:
        if write:
            fetch(line)
        else:
            fetch_read(line)
        line += LINE


def _probe():
    """A loop with both hints, compiled now (or loaded from numba's cache, once it compiled here)."""
    return njit(types.void(types.intp), cache=True, nogil=True)(_probe_loop)


def _probe_loop(address):  # pragma: no cover - numba
    fetch(address)
    fetch_read(address)


try:
    _probe()
except Exception as exc:  # noqa: BLE001 - an LLVM that will not take the hint: loops without it
    log.warning("compiled loops run without prefetching: this numba's LLVM does not take llvm.prefetch (%s)", exc)
    ENABLED = False
