"""CPU delta kernels: ISA-L through numba (the default), pure numba, and a numpy baseline.

``CpuKernel`` (registered as ``cpu``) is what servers use: it runs the fastest
implementation that loads and passes a self-test in this process:

1. ``isal`` -- ISA-L's ``gf_vect_mad`` / ``ec_encode_data_update`` (SIMD: AVX2,
   AVX-512 or GFNI, dispatched by ISA-L itself), called per row from a numba loop
   through ctypes.  The library is the ``libisal`` that ships inside the pyeclib
   wheel (``pyeclib.libs/``), or a system ``libisal``, or the file named by the
   ``ECREC_ISAL_LIBRARY`` environment variable.
2. ``numba`` -- a numba loop multiplying four bytes at a time in 32-bit words by
   shift-and-xor (no table gathers, so LLVM vectorises it); a 256-byte table row
   handles tails and unaligned rows.
3. ``numpy`` -- 256-entry table lookups with fancy indexing; only a baseline.

Measured on the 2-core development VM (Xeon with AVX-512 + GFNI, shared, so +-30%),
64 MiB of delta bytes in rows of the given width at random parity slots, best of 5,
GB/s of delta bytes applied ("-": not measured):

    row width                  64    512   1024   4096  64 KiB  64 MiB (one row)
    isal gf_vect_mad          1.1    4.7    5.6    5.6    5.0     6.8
    isal ec_encode_data_update 0.6   3.1    5.0    5.1    5.1     5.9
    numba 32-bit words        0.4    0.9    2.0    2.6    2.5     3.3
    numba 64-bit words         -     0.8     -     2.3     -      2.4
    numba 64-bit, no multiply  -      -     2.9     -     3.6     3.7   (32-bit: 3.1, 3.4, 3.8)
    numba 256-byte table      0.2    0.6    1.4    1.5    1.6     2.4
    numba 64K-entry u16 table  -     0.02    -     0.2     -      2.8   (table rebuilt per coefficient)
    numpy 256-byte table       -      -      -     0.3     -      0.3

Small rows at random slots are bound by cache misses on the parity rows (64-byte rows
at sequential slots run at 3 GB/s through ISA-L), so ISA-L's row loops fetch each parity
row a few rows before they update it (``isal_loops``).  Hence ISA-L when it is there
(``gf_vect_mad`` for rows >= 64 bytes, ``ec_encode_data_update`` below), otherwise
32-bit-word numba (as fast as 64-bit without shifts, and needs only 4-byte alignment).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import logging
import os
from pathlib import Path

import numpy as np

from ecrec.coding.kernels.base import KernelBackend, gf_mul_table

log = logging.getLogger("ecrec.kernels")

ISAL_LIBRARY_ENV = "ECREC_ISAL_LIBRARY"
#: bytes per coefficient in ISA-L's tables (32 for the PSHUFB kernels, 8 for GFNI)
_ISAL_TABLE_BYTES = 32  # = isal_loops.TABLE_BYTES (the loops index the tables by it)
#: ISA-L's SIMD ``gf_vect_mad`` kernels need at least this many bytes
_ISAL_MAD_MIN_LEN = 64


# --------------------------------------------------------------------------- numba kernels
@functools.lru_cache(maxsize=1)
def _numba_kernels():
    """Compiles (lazily, cached on disk by numba) the pure-numba kernels.

    Both take every array as a flat 1-D C-contiguous view plus a row stride in elements
    (row ``r`` of ``delta`` starts at ``r * d_stride``; 0 broadcasts one delta row), so
    LLVM sees unit-stride loops whatever the caller's layout and one signature serves all.
    """
    from numba import njit

    @njit(cache=True, nogil=True, boundscheck=False)
    def table_rows(pflat, p_stride, slots, coeffs, dflat, d_stride, width, mul):  # pragma: no cover - numba
        for r in range(slots.shape[0]):
            c = coeffs[r]
            if c == 0:
                continue
            row = mul[c]
            p = pflat[slots[r] * p_stride : slots[r] * p_stride + width]
            d = dflat[r * d_stride : r * d_stride + width]
            for i in range(width):
                p[i] ^= row[d[i]]

    @njit(cache=True, nogil=True, boundscheck=False)
    def word_rows(pflat, p_stride, slots, coeffs, dflat, d_stride, width):  # pragma: no cover - numba
        # uint32 words: c*x = XOR of x*2^i over the set bits i of c, with x*2 done on four
        # bytes at once: ((x & 0x7f..) << 1) ^ (((x >> 7) & 0x01..) * 0x1d)
        lo7 = np.uint32(0x7F7F7F7F)
        ones = np.uint32(0x01010101)
        poly = np.uint32(0x1D)
        one = np.uint32(1)
        seven = np.uint32(7)
        zero = np.uint32(0)
        for r in range(slots.shape[0]):
            c = coeffs[r]
            if c == 0:
                continue
            m0 = zero - np.uint32(c & 1)
            m1 = zero - np.uint32((c >> 1) & 1)
            m2 = zero - np.uint32((c >> 2) & 1)
            m3 = zero - np.uint32((c >> 3) & 1)
            m4 = zero - np.uint32((c >> 4) & 1)
            m5 = zero - np.uint32((c >> 5) & 1)
            m6 = zero - np.uint32((c >> 6) & 1)
            m7 = zero - np.uint32((c >> 7) & 1)
            p = pflat[slots[r] * p_stride : slots[r] * p_stride + width]
            d = dflat[r * d_stride : r * d_stride + width]
            for i in range(width):
                x = d[i]
                acc = x & m0
                x = ((x & lo7) << one) ^ (((x >> seven) & ones) * poly)
                acc ^= x & m1
                x = ((x & lo7) << one) ^ (((x >> seven) & ones) * poly)
                acc ^= x & m2
                x = ((x & lo7) << one) ^ (((x >> seven) & ones) * poly)
                acc ^= x & m3
                x = ((x & lo7) << one) ^ (((x >> seven) & ones) * poly)
                acc ^= x & m4
                x = ((x & lo7) << one) ^ (((x >> seven) & ones) * poly)
                acc ^= x & m5
                x = ((x & lo7) << one) ^ (((x >> seven) & ones) * poly)
                acc ^= x & m6
                x = ((x & lo7) << one) ^ (((x >> seven) & ones) * poly)
                acc ^= x & m7
                p[i] ^= acc

    return table_rows, word_rows


def _flat(rows2d: np.ndarray) -> tuple[np.ndarray, int]:
    """A 1-D view spanning every row of ``rows2d`` (unit inner stride) and its row stride in elements."""
    rows, width = rows2d.shape
    item = rows2d.itemsize
    stride = rows2d.strides[0] // item if rows > 1 else 0
    span = (rows - 1) * stride + width
    return np.lib.stride_tricks.as_strided(rows2d, shape=(span,), strides=(item,)), stride


def _word_aligned(*arrays: np.ndarray) -> bool:
    return all(a.ctypes.data % 4 == 0 and a.strides[0] % 4 == 0 for a in arrays)


def _apply_numba(parity: np.ndarray, slots: np.ndarray, coeffs: np.ndarray, delta: np.ndarray) -> None:
    table_rows, word_rows = _numba_kernels()
    width = parity.shape[1]
    words = width // 4
    if words and _word_aligned(parity, delta):
        pflat, ps = _flat(parity[:, : 4 * words].view(np.uint32))
        dflat, ds = _flat(delta[:, : 4 * words].view(np.uint32))
        word_rows(pflat, ps, slots, coeffs, dflat, ds, words)
        if width % 4 == 0:
            return
        parity, delta = parity[:, 4 * words :], delta[:, 4 * words :]
    pflat, ps = _flat(parity)
    dflat, ds = _flat(delta)
    table_rows(pflat, ps, slots, coeffs, dflat, ds, parity.shape[1], gf_mul_table())


# --------------------------------------------------------------------------- ISA-L
class _Isal:
    """ISA-L entry points bound through ctypes plus the numba row loop that calls them."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        self.path = path
        ptr = ctypes.c_size_t  # pointers passed as integers: one numba signature, no casts
        lib.ec_init_tables.argtypes = [ctypes.c_int, ctypes.c_int, ptr, ptr]
        lib.ec_init_tables.restype = None
        lib.ec_encode_data_update.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr]
        lib.ec_encode_data_update.restype = None
        lib.gf_vect_mad.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr]
        lib.gf_vect_mad.restype = None
        self._lib = lib
        # per-coefficient tables in whatever format this CPU's dispatch wants (PSHUFB or GFNI)
        self.tables = np.zeros((256, _ISAL_TABLE_BYTES), dtype=np.uint8)
        coef = np.zeros(1, dtype=np.uint8)
        for c in range(256):
            coef[0] = c
            lib.ec_init_tables(1, 1, coef.ctypes.data, self.tables[c].ctypes.data)
        self.use_mad = True
        from ecrec.coding.kernels import isal_loops  # compiled once, then loaded from numba's disk cache

        self._entry = (ctypes.cast(lib.gf_vect_mad, ctypes.c_void_p).value,
                       ctypes.cast(lib.ec_encode_data_update, ctypes.c_void_p).value)
        self._loop, self._versioned = isal_loops.loop, isal_loops.versioned

    def apply_versioned(self, parity, slots, positions, coeff_row, delta, versions, built, seqs) -> int:
        """:meth:`KernelBackend.apply_versioned` in one numba loop calling ISA-L per row."""
        width = parity.shape[1]
        if width >= 2**31 or not delta.flags.c_contiguous:
            return -1  # the caller falls back to the generic path
        min_mad = _ISAL_MAD_MIN_LEN if self.use_mad else 2**31
        return self._versioned(
            *self._entry, parity.ctypes.data, parity.strides[0], delta.ctypes.data, delta.strides[0], slots, positions,
            coeff_row, versions.reshape(-1), built, seqs, versions.shape[1], self.tables.ctypes.data, width, min_mad,
        )  # fmt: skip

    def apply(self, parity: np.ndarray, slots: np.ndarray, coeffs: np.ndarray, delta: np.ndarray) -> None:
        width = parity.shape[1]
        if width >= 2**31:
            # ISA-L takes an int length; split very wide rows into column blocks
            step = 1 << 30
            for c0 in range(0, width, step):
                self.apply(parity[:, c0 : c0 + step], slots, coeffs, delta[:, c0 : c0 + step])
            return
        min_mad = _ISAL_MAD_MIN_LEN if self.use_mad else 2**31
        self._loop(
            *self._entry, parity.ctypes.data, parity.strides[0], delta.ctypes.data, delta.strides[0],
            slots, coeffs, self.tables.ctypes.data, width, min_mad,
        )  # fmt: skip

    def self_test(self) -> None:
        """Checks both entry points against the table kernel; disables ``gf_vect_mad`` if it disagrees."""
        rng = np.random.default_rng(0x11D)
        mul = gf_mul_table()
        for use_mad in (True, False):
            self.use_mad = use_mad
            ok = True
            for width in (1, 3, 31, 63, 64, 65, 100, 128, 1000, 4099):
                parity = rng.integers(0, 256, (5, width), dtype=np.uint8)
                delta = rng.integers(0, 256, (6, width), dtype=np.uint8)
                slots = np.array([0, 4, 2, 4, 1, 3], dtype=np.int64)  # duplicate slot 4
                coeffs = np.array([1, 2, 0x8E, 255, 0, rng.integers(3, 255)], dtype=np.uint8)
                expect = parity.copy()
                for r in range(6):
                    expect[slots[r]] ^= mul[coeffs[r]][delta[r]]
                self.apply(parity, slots, coeffs, delta)
                ok = ok and np.array_equal(parity, expect)
            if ok:
                return
            if not use_mad:
                raise RuntimeError(f"ISA-L at {self.path} disagrees with GF(2^8)/0x11d tables")
            log.debug("ISA-L gf_vect_mad disagrees with the tables; using ec_encode_data_update only")


def _isal_candidates() -> list[str]:
    env = os.environ.get(ISAL_LIBRARY_ENV)
    if env:
        return [env]
    found: list[str] = []
    try:
        import pyeclib

        libs = Path(pyeclib.__file__).resolve().parent.parent / "pyeclib.libs"
        found += sorted(glob.glob(str(libs / "libisal*.so*")))
    except ImportError:
        pass
    system = ctypes.util.find_library("isal")
    if system:
        found.append(system)
    return found


@functools.lru_cache(maxsize=1)
def _load_isal() -> _Isal | None:
    """The first ISA-L that loads and passes the self-test, or None (reason logged at debug)."""
    for path in _isal_candidates():
        try:
            isal = _Isal(path)
            isal.self_test()
            return isal
        except Exception as exc:  # noqa: BLE001 - any failure means "not usable", never a crash
            log.debug("ISA-L at %s not usable: %s", path, exc)
    return None


# --------------------------------------------------------------------------- backends
class NumpyKernel(KernelBackend):
    """Baseline: numpy 256-entry table lookups, one row at a time (handles duplicate slots)."""

    name = "numpy"

    @classmethod
    def available(cls) -> bool:
        return True

    def _apply(self, parity, slots, coeffs, delta) -> None:
        mul = gf_mul_table()
        for r in range(slots.shape[0]):
            parity[slots[r]] ^= mul[coeffs[r]][delta[r]]


class NumbaKernel(KernelBackend):
    """Pure numba: 32-bit words by shift-and-xor, byte tables for tails."""

    name = "numba"

    @classmethod
    def available(cls) -> bool:
        try:
            _numba_kernels()
            return True
        except Exception:  # noqa: BLE001
            return False

    def __init__(self):
        if not self.available():
            raise RuntimeError("kernel 'numba' is not available: numba does not import")
        _warm_up(self)

    def _apply(self, parity, slots, coeffs, delta) -> None:
        _apply_numba(parity, slots, coeffs, delta)


class IsalKernel(KernelBackend):
    """ISA-L ``gf_vect_mad`` per row from a numba loop."""

    name = "isal"

    @classmethod
    def available(cls) -> bool:
        try:
            return _load_isal() is not None
        except Exception:  # noqa: BLE001
            return False

    def __init__(self):
        isal = _load_isal()
        if isal is None:
            raise RuntimeError(
                "kernel 'isal' is not available: no libisal found that loads and passes the self-test "
                f"(looked in pyeclib.libs/, the system library path and ${ISAL_LIBRARY_ENV})"
            )
        self._isal = isal

    @property
    def description(self) -> str:
        from ecrec.coding.kernels import isal_loops

        how = "gf_vect_mad" if self._isal.use_mad else "ec_encode_data_update"
        fetch = ", parity rows prefetched" if isal_loops.PREFETCHES else ""
        return f"isal ({how}, {Path(self._isal.path).name}{fetch})"

    def _apply(self, parity, slots, coeffs, delta) -> None:
        self._isal.apply(parity, slots, coeffs, delta)

    def apply_versioned(self, parity, slots, positions, coeff_row, delta, versions, built, seqs) -> int:
        applied = self._isal.apply_versioned(parity, slots, positions, coeff_row, delta, versions, built, seqs)
        if applied < 0:
            return super().apply_versioned(parity, slots, positions, coeff_row, delta, versions, built, seqs)
        return applied


class CpuKernel(KernelBackend):
    """The CPU backend servers use: ISA-L when usable, else numba (see the module docstring)."""

    name = "cpu"

    @classmethod
    def available(cls) -> bool:
        return True  # numpy always works

    def __init__(self):
        if IsalKernel.available():
            self.impl: KernelBackend = IsalKernel()
        elif NumbaKernel.available():
            log.debug("ISA-L not usable; cpu kernel uses numba")
            self.impl = NumbaKernel()
        else:
            log.debug("neither ISA-L nor numba usable; cpu kernel uses numpy")
            self.impl = NumpyKernel()

    @property
    def description(self) -> str:
        return f"cpu: {self.impl.description}"

    def _apply(self, parity, slots, coeffs, delta) -> None:
        self.impl._apply(parity, slots, coeffs, delta)

    def apply_versioned(self, parity, slots, positions, coeff_row, delta, versions, built, seqs) -> int:
        return self.impl.apply_versioned(parity, slots, positions, coeff_row, delta, versions, built, seqs)


def _warm_up(kernel: KernelBackend) -> None:
    """Compiles the numba specialisations (writable and read-only/broadcast delta) up front."""
    for width in (8, 7):
        parity = np.zeros((2, width), dtype=np.uint8)
        delta = np.ones((2, width), dtype=np.uint8)
        kernel.apply_delta_batch(parity, np.zeros(2, np.int64), np.ones(2, np.uint8), delta)
        one_row = np.broadcast_to(delta[0], (2, width))  # read-only delta: its own specialisation
        kernel.apply_delta_batch(parity, np.zeros(2, np.int64), np.ones(2, np.uint8), one_row)
