"""The delta-kernel interface and the GF(2^8) arithmetic every kernel shares.

A parity row is updated without the rest of its stripe: ``parity ^= gf_mul(c, delta)``,
where ``c`` is the stripe coefficient that :class:`ecrec.coding.codec.Codec` probes from pyeclib.
A *kernel backend* applies a batch of such updates in one call::

    parity[slots[r]] ^= gf_mul(coeffs[r], delta[r])      for r in range(len(slots))

Backends (``cpu``, ``gpu``, and the individual CPU implementations) subclass
:class:`KernelBackend`, implement ``_apply`` and are registered by name in
``ecrec.coding.kernels``.  The public ``apply_delta_batch`` validates every argument
*before* anything is mutated, then hands normalised arrays to ``_apply``.
Duplicate slots in one batch must accumulate (both deltas XORed in).

Arithmetic is GF(2^8) with the polynomial 0x11d, the field of ISA-L and therefore
of pyeclib's ``isa_l_rs_vand`` / ``isa_l_rs_cauchy`` backends.
"""

from __future__ import annotations

import abc
import functools
from typing import Any, ClassVar

import numpy as np

#: The reduction polynomial of GF(2^8) used by ISA-L: x^8 + x^4 + x^3 + x^2 + 1.
GF_POLY = 0x11D


def _gf_mul_scalar(a: int, b: int) -> int:
    """Shift-and-xor product (builds the table below)."""
    product = 0
    while b:
        if b & 1:
            product ^= a
        a <<= 1
        if a & 0x100:
            a ^= GF_POLY
        b >>= 1
    return product


def gf_mul(a: Any, b: Any) -> Any:
    """Product in GF(2^8) modulo 0x11d; two ints give an int, arrays a uint8 array (broadcast).

    Raises ValueError for an operand outside [0, 255] and TypeError for non-integer arrays."""
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        a, b = int(a), int(b)
        if not (0 <= a < 256 and 0 <= b < 256):
            raise ValueError(f"gf_mul operands must be bytes in [0, 255], got {a} and {b}")
        return _gf_mul_scalar(a, b)
    a_arr, b_arr = np.asarray(a), np.asarray(b)
    for label, arr in (("a", a_arr), ("b", b_arr)):
        if arr.dtype.kind not in "iu":
            raise TypeError(f"gf_mul operand {label} must hold integers, got dtype {arr.dtype}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 255):
            raise ValueError(f"gf_mul operand {label} holds values outside [0, 255]")
    return gf_mul_table()[a_arr.astype(np.intp), b_arr.astype(np.intp)]


@functools.lru_cache(maxsize=1)
def gf_mul_table() -> np.ndarray:
    """The full 256 x 256 multiplication table (read-only uint8, ``table[c][x] = c*x``)."""
    exp = np.zeros(512, dtype=np.int64)
    log = np.zeros(256, dtype=np.int64)
    x = 1
    for i in range(255):  # 2 generates the multiplicative group of GF(2^8)/0x11d
        exp[i] = x
        log[x] = i
        x = _gf_mul_scalar(x, 2)
    exp[255:510] = exp[0:255]
    a = np.arange(256)
    table = exp[log[a][:, None] + log[a][None, :]].astype(np.uint8)
    table[0, :] = 0
    table[:, 0] = 0
    table.setflags(write=False)
    return table


def is_device_array(array: Any) -> bool:
    """True for CuPy arrays (checked by type, so cupy is never imported here)."""
    return type(array).__module__.split(".")[0] == "cupy"


class KernelBackend(abc.ABC):
    """Applies batches of GF(2^8) row deltas to parity rows in place.

    Subclasses set ``name`` and ``device`` (``"cpu"``: numpy arrays, ``"gpu"``: cupy
    arrays) and implement :meth:`available` and :meth:`_apply`.
    """

    name: ClassVar[str] = "?"
    #: where the arrays live: "cpu" (numpy) or "gpu" (cupy)
    device: ClassVar[str] = "cpu"

    @classmethod
    @abc.abstractmethod
    def available(cls) -> bool:
        """Whether this backend can run in this process (never raises)."""

    @property
    def description(self) -> str:
        """One line saying what actually runs (e.g. which CPU implementation)."""
        return self.name

    def apply_delta_batch(self, parity: Any, slots: Any, coeffs: Any, delta: Any, validated: bool = False) -> None:
        """``parity[slots[r]] ^= gf_mul(coeffs[r], delta[r])`` for every ``r``, in place.

        ``parity`` is ``(rows, width)`` uint8, ``slots`` ``(b,)`` integers in ``[0, rows)``,
        ``coeffs`` ``(b,)`` uint8 and ``delta`` ``(b, width)`` uint8.  Raises
        ``TypeError``/``ValueError`` before mutating anything when an argument is wrong.
        ``validated=True`` skips those checks: for a caller on the hot path (the parity
        store) that built the arrays itself (int64 slots in range, uint8 coefficients,
        C-contiguous uint8 rows).
        """
        if validated:
            if len(slots) and parity.shape[1]:
                self._apply(parity, slots, coeffs, delta)
            return
        parity, slots, coeffs, delta = self._check(parity, slots, coeffs, delta)
        if slots.shape[0] == 0 or parity.shape[1] == 0:
            return
        self._apply(parity, slots, coeffs, delta)

    @abc.abstractmethod
    def _apply(self, parity: Any, slots: Any, coeffs: Any, delta: Any) -> None:
        """Does the work on validated arrays: ``slots`` int64, ``coeffs`` uint8, both 1-D."""

    def warm_up(self) -> None:
        """Compiles whatever this backend compiles lazily (a server does this at start, not in a request)."""
        xp = self._xp()
        parity = xp.zeros((2, 8), dtype=np.uint8)
        delta = xp.ones((2, 8), dtype=np.uint8)
        self.apply_delta_batch(parity, xp.zeros(2, dtype=np.int64), xp.ones(2, dtype=np.uint8), delta)
        self.apply_versioned(parity, np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64), np.ones(2, dtype=np.uint8),
                             delta, np.zeros((2, 2), dtype=np.int64), np.ones(2, dtype=bool), np.ones(2, dtype=np.int64))

    def apply_versioned(self, parity: Any, slots: np.ndarray, positions: np.ndarray, coeff_row: np.ndarray,
                        delta: Any, versions: np.ndarray, built: np.ndarray, seqs: np.ndarray) -> int:
        """The parity store's hot path, on validated arrays, row after row: where the parity row is built and
        its version ``versions[slots[r], positions[r]]`` is below ``seqs[r]``, applies
        ``parity[slots[r]] ^= gf_mul(coeff_row[positions[r]], delta[r])`` and sets that version to ``seqs[r]``.
        ``versions`` is ``(rows, k)`` int64, ``built`` ``(rows,)`` bool (host arrays).  A (slot, position) may
        come more than once, with increasing ``seqs``.  Returns how many rows were applied.  Backends may fuse
        this into one loop."""
        k = versions.shape[1]
        flat = versions.reshape(-1)
        where = slots * k + positions
        # a row repeated with a newer push applies as well: every copy is compared with the version before
        fresh = built[slots] & (seqs > flat[where])
        if not fresh.any():
            return 0
        if not fresh.all():
            slots, positions, delta, where, seqs = slots[fresh], positions[fresh], delta[fresh], where[fresh], seqs[fresh]
        xp = self._xp()
        coeffs = coeff_row[positions]
        if xp is np:
            self._apply(parity, slots, coeffs, np.ascontiguousarray(delta))
        else:
            self._apply(parity, xp.asarray(slots), xp.asarray(coeffs), xp.ascontiguousarray(xp.asarray(delta)))
        np.maximum.at(flat, where, seqs)
        return int(len(slots))

    # --- validation ---------------------------------------------------------------------------
    def _xp(self):
        return np

    def _check(self, parity, slots, coeffs, delta):
        xp = self._xp()
        for label, arr in (("parity", parity), ("delta", delta)):
            if not isinstance(arr, xp.ndarray):
                raise TypeError(
                    f"kernel {self.name!r}: {label} must be a {xp.__name__} array, got {type(arr).__name__}"
                )
            if arr.dtype != np.uint8:
                raise TypeError(f"kernel {self.name!r}: {label} must have dtype uint8, got {arr.dtype}")
            if arr.ndim != 2:
                raise ValueError(f"kernel {self.name!r}: {label} must be 2-D (rows, width), got shape {arr.shape}")
        if not getattr(parity.flags, "writeable", True):  # cupy arrays have no such flag
            raise ValueError(f"kernel {self.name!r}: parity is read-only")
        if any(a.size and a.shape[1] > 1 and a.strides[1] != 1 for a in (parity, delta)):
            raise ValueError(f"kernel {self.name!r}: rows of parity and delta must be contiguous (stride 1)")
        if any(a.strides[0] < 0 for a in (parity, delta)):
            raise ValueError(f"kernel {self.name!r}: negative row strides are not supported")
        slots = self._index_array("slots", slots)
        coeffs = self._index_array("coeffs", coeffs)
        b = slots.shape[0]
        if coeffs.shape[0] != b or delta.shape[0] != b:
            raise ValueError(
                f"kernel {self.name!r}: batch sizes differ: slots {slots.shape[0]}, "
                f"coeffs {coeffs.shape[0]}, delta rows {delta.shape[0]}"
            )
        if delta.shape[1] != parity.shape[1]:
            raise ValueError(
                f"kernel {self.name!r}: delta width {delta.shape[1]} != parity width {parity.shape[1]}"
            )
        if b:
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 0 or hi >= parity.shape[0]:
                bad = lo if lo < 0 else hi
                raise ValueError(f"kernel {self.name!r}: slot {bad} out of range [0, {parity.shape[0]})")
            if coeffs.dtype != np.uint8:
                clo, chi = int(coeffs.min()), int(coeffs.max())
                if clo < 0 or chi > 255:
                    raise ValueError(f"kernel {self.name!r}: coefficient {clo if clo < 0 else chi} is not a byte")
        coeffs = xp.ascontiguousarray(coeffs, dtype=np.uint8)
        return parity, slots, coeffs, delta

    def _index_array(self, label: str, values) -> Any:
        xp = self._xp()
        arr = xp.asarray(values)
        if arr.ndim != 1:
            raise ValueError(f"kernel {self.name!r}: {label} must be 1-D, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"kernel {self.name!r}: {label} must hold integers, got dtype {arr.dtype}")
        if label == "slots":
            arr = xp.ascontiguousarray(arr, dtype=np.int64)
        return arr

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.description}>"
