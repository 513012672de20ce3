"""The erasure codec: Reed-Solomon ``(k, m)`` over GF(2^8) through pyeclib, plus parity deltas.

One :class:`Codec` serves one code.  A *stripe* has ``k`` data rows (indices ``0..k-1``)
and ``m`` parity rows (``k..k+m-1``), all of the same byte length ``n``.

- :meth:`Codec.encode` / :meth:`Codec.encode_stripes` build parity in bulk and
  :meth:`Codec.reconstruct` / :meth:`Codec.reconstruct_stripes` rebuild lost rows; both go
  through pyeclib (the reference), in column chunks so one pyeclib call covers many
  stripes and large buffers do not hit glibc's slow path for big allocations.
- :meth:`Codec.combine` (``XOR_i c_i * rows_i`` over whole arrays, one ISA-L call per row) with
  :meth:`Codec.data_decode_coefficients` decodes a lost data row from the other data rows and one
  parity, and re-encodes one parity row, without pyeclib's fragment copies: the fast rebuild path.
- :meth:`Codec.apply_delta` is the update hot path: a data row at position ``i`` changes
  by ``delta = old ^ new``; every parity ``j`` does ``parity_j ^= c[j][i] * delta``.  The
  coefficients ``c`` are *probed from pyeclib* at construction (encode the identity,
  read the parity), so the delta kernels (``ecrec.coding.kernels``) agree with pyeclib for
  any backend, ``k`` and ``m``.  numpy arrays run on the CPU kernel, cupy arrays on the
  GPU kernel.

pyeclib facts relied on (pyeclib 1.8, isa_l backends, checked again at construction):
systematic code; a fragment is an 80-byte header plus ``ceil(len / k)`` payload bytes;
fragment ``i`` carries input bytes ``[i*S, (i+1)*S)``; with checksums off the header of
a fragment encoded from zeros of the same length is a valid header for any payload.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ecrec.coding.kernels import KernelBackend, get_kernel, gf_mul, gf_mul_table, is_device_array

__all__ = ["Codec", "SUPPORTED_BACKENDS", "check_code", "gf_mul"]

#: pyeclib backends whose parity is byte-wise linear over GF(2^8)/0x11d.
SUPPORTED_BACKENDS = ("isa_l_rs_vand", "isa_l_rs_cauchy")
#: most fragments per stripe (liberasurecode's limit, pyeclib's PYECLIB_MAX_DATA/PARITY)
MAX_FRAGMENTS = 32
#: largest k for which isa_l_rs_vand is MDS (any k of the k+m rows rebuild the rest), by m.
#: ISA-L's Vandermonde-derived matrix is not always invertible: checked exhaustively here on
#: the probed coefficients (every square submatrix of c), m <= 3 is MDS for every k up to
#: k + m = 32; m = 4 fails from k = 22 (2 singular submatrices, 20 at k = 28); m = 5 from
#: k = 6; larger m were not cleared.  isa_l_rs_cauchy (a Cauchy matrix) is always MDS.
VAND_MDS_MAX_K = {1: MAX_FRAGMENTS - 1, 2: MAX_FRAGMENTS - 2, 3: MAX_FRAGMENTS - 3, 4: 21, 5: 5}
#: bytes of pyeclib's fragment header
FRAGMENT_HEADER_BYTES = 80
#: data bytes per pyeclib call in encode/reconstruct.  Measured on 64 MiB, k=4, m=2
#: (GB/s of data encoded): whole buffer in one call 0.27-0.33; chunks of 64 KiB 2.86,
#: 256 KiB 2.93, 1 MiB 2.51, 2 MiB 2.12, 4 MiB 1.86 (bigger fragments fall into
#: glibc's mmap/page-fault path).
DEFAULT_CHUNK_BYTES = 256 * 1024
_HEADER_CACHE_SIZE = 16


def _as_int(value: Any, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{label} must be an int, got {type(value).__name__}")
    return int(value)


def _as_index(value: Any, label: str, upper: int) -> int:
    v = _as_int(value, label)
    if not 0 <= v < upper:
        raise ValueError(f"{label} {v} out of range [0, {upper})")
    return v


def _to_host(value: Any) -> Any:
    return value.get() if is_device_array(value) else value


def check_code(k: Any, m: Any, backend: Any) -> tuple[int, int]:
    """Validates a code's parameters without building it (no pyeclib call); returns ``(k, m)``.

    Raises TypeError/ValueError naming the problem: k < 1, m < 1, too many fragments, an
    unsupported backend, or a Vandermonde code that is not MDS for this k and m."""
    k, m = _as_int(k, "k"), _as_int(m, "m")
    if k < 1:
        raise ValueError(f"k (data rows per stripe) must be >= 1, got {k}")
    if m < 1:
        raise ValueError(f"m (parity rows per stripe) must be >= 1, got {m}")
    if k + m > MAX_FRAGMENTS:
        raise ValueError(f"k + m must be <= {MAX_FRAGMENTS} (pyeclib/liberasurecode limit), got {k} + {m}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a pyeclib ec_type name, got {type(backend).__name__}")
    if backend == "liberasurecode_rs_vand":
        raise ValueError(
            "backend 'liberasurecode_rs_vand' is not supported: its parity is linear over 16-bit "
            "words, not bytes, so byte-wise GF(2^8) deltas would corrupt it; "
            f"use one of {', '.join(SUPPORTED_BACKENDS)}"
        )
    if backend not in SUPPORTED_BACKENDS:
        raise ValueError(f"unsupported backend {backend!r}; use one of {', '.join(SUPPORTED_BACKENDS)}")
    if backend == "isa_l_rs_vand" and k > VAND_MDS_MAX_K.get(m, 0):
        raise ValueError(
            f"backend 'isa_l_rs_vand' is not MDS for k={k}, m={m}: ISA-L's Vandermonde-derived matrix "
            "then has singular submatrices, so some sets of m lost rows could not be rebuilt; "
            "use 'isa_l_rs_cauchy' (MDS for every k, m)"
        )
    return k, m


class Codec:
    """Reed-Solomon ``(k, m)`` codec: pyeclib for bulk work, kernels for row deltas.

    ``backend`` is the pyeclib ``ec_type`` (``isa_l_rs_vand`` or ``isa_l_rs_cauchy``);
    ``kernel`` names the delta backend (``auto``, ``cpu``, ``gpu``, ... see
    ``ecrec.coding.kernels``) or is a :class:`~ecrec.coding.kernels.base.KernelBackend` instance.
    ``chunk_bytes`` is the data volume of one pyeclib call in bulk encode/reconstruct.
    """

    def __init__(
        self,
        k: int,
        m: int,
        backend: str = "isa_l_rs_vand",
        kernel: str | KernelBackend = "auto",
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        k, m = check_code(k, m, backend)
        chunk_bytes = _as_int(chunk_bytes, "chunk_bytes")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if not isinstance(kernel, (str, KernelBackend)):
            raise TypeError(f"kernel must be a kernel name or a KernelBackend, got {type(kernel).__name__}")

        from pyeclib.ec_iface import ECDriver, ECDriverError

        try:
            self._driver = ECDriver(k=k, m=m, ec_type=backend, chksum_type="none")
        except ECDriverError as exc:
            raise RuntimeError(f"pyeclib cannot create {backend!r} with k={k}, m={m}: {exc}") from exc
        self.k, self.m, self.backend = k, m, backend
        self.chunk_bytes = chunk_bytes
        self._headers: OrderedDict[int, list[bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self._arrays_ok = False  # whether pyeclib's encode takes numpy arrays (probed below)
        self.coefficients = self._probe_coefficients()
        self.kernel: KernelBackend = get_kernel(kernel) if isinstance(kernel, str) else kernel
        self._kernels = {self.kernel.device: self.kernel}

    def __repr__(self) -> str:
        return f"Codec(k={self.k}, m={self.m}, backend={self.backend!r}, kernel={self.kernel.name!r})"

    # ------------------------------------------------------------------ set-up
    def _probe_coefficients(self) -> np.ndarray:
        k, m = self.k, self.m
        identity = np.eye(k, dtype=np.uint8)  # column i holds a unit byte at position i
        frags = self._driver.encode(identity.tobytes())
        try:  # passing numpy arrays saves a copy per chunk; use it only if it gives the same bytes
            self._arrays_ok = self._driver.encode(identity) == frags
        except Exception:  # noqa: BLE001 - this pyeclib build wants bytes
            self._arrays_ok = False
        if len(frags) != k + m or any(len(f) != FRAGMENT_HEADER_BYTES + k for f in frags):
            raise RuntimeError(f"pyeclib {self.backend!r} does not produce {k}+{m} fragments of 80+len/k bytes")
        payloads = np.stack([np.frombuffer(f, np.uint8, offset=FRAGMENT_HEADER_BYTES) for f in frags])
        if not np.array_equal(payloads[:k], identity):
            raise RuntimeError(f"pyeclib {self.backend!r} is not systematic as expected")
        coefficients = payloads[k:].copy()
        coefficients.setflags(write=False)
        # byte-wise linearity over GF(2^8)/0x11d: a random block must match the matrix product
        rng = np.random.default_rng(k * 64 + m)
        data = rng.integers(0, 256, (k, 61), dtype=np.uint8)
        expect = np.zeros((m, 61), dtype=np.uint8)
        mul = gf_mul_table()
        for j in range(m):
            for i in range(k):
                expect[j] ^= mul[coefficients[j, i]][data[i]]
        if not np.array_equal(self._encode_block(data), expect):
            raise RuntimeError(f"pyeclib {self.backend!r} parity is not byte-wise linear over GF(2^8)/0x11d")
        return coefficients

    def _kernel_for(self, device: bool) -> KernelBackend:
        where = "gpu" if device else "cpu"
        kernel = self._kernels.get(where)
        if kernel is None:
            kernel = get_kernel(where)  # gpu raises RuntimeError with the reason when unusable
            self._kernels[where] = kernel
        return kernel

    # ------------------------------------------------------------------ pyeclib blocks
    def _encode_block(self, block: np.ndarray) -> list[np.ndarray]:
        """Parity payloads (m arrays of W bytes) of a C-contiguous ``(k, W)`` block."""
        frags = self._driver.encode(block if self._arrays_ok else block.tobytes())
        return [np.frombuffer(f, np.uint8, offset=FRAGMENT_HEADER_BYTES) for f in frags[self.k :]]

    def _header_templates(self, width: int) -> list[bytes]:
        """Headers of all k+m fragments for payloads of ``width`` bytes (from encoding zeros)."""
        with self._lock:
            headers = self._headers.get(width)
            if headers is not None:
                self._headers.move_to_end(width)
                return headers
        frags = self._driver.encode(bytes(self.k * width))
        headers = [bytes(f[:FRAGMENT_HEADER_BYTES]) for f in frags]
        with self._lock:
            self._headers[width] = headers
            while len(self._headers) > _HEADER_CACHE_SIZE:
                self._headers.popitem(last=False)
        return headers

    def _blocks(self, stripes: int, n: int):
        """Splits ``stripes`` x ``n`` columns into pyeclib calls of about ``chunk_bytes`` data.

        Yields ``(s0, s1, c0, c1)``: stripes ``s0:s1`` and columns ``c0:c1``; either one
        stripe and a column range, or several whole stripes laid side by side.
        """
        cols = max(1, self.chunk_bytes // self.k)
        if n >= cols:
            for s in range(stripes):
                for c0 in range(0, n, cols):
                    yield s, s + 1, c0, min(n, c0 + cols)
        else:
            group = max(1, cols // n)
            for s0 in range(0, stripes, group):
                yield s0, min(stripes, s0 + group), 0, n

    # ------------------------------------------------------------------ encode
    def encode(self, data: np.ndarray) -> np.ndarray:
        """Parity ``(m, n)`` of one stripe ``data`` ``(k, n)`` uint8, byte-for-byte pyeclib's."""
        self._check_host_array(data, "data", 2)
        if data.shape[0] != self.k:
            raise ValueError(f"data must have shape (k={self.k}, n), got {data.shape}")
        return self.encode_stripes(data[None])[0]

    def encode_stripes(self, data: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Parity ``(stripes, m, n)`` of ``data`` ``(stripes, k, n)``; many stripes per pyeclib call.  ``out``: an
        array of that shape to write it into (reused by a caller encoding block after block)."""
        self._check_host_array(data, "data", 3)
        stripes, k, n = data.shape
        if k != self.k:
            raise ValueError(f"data must have shape (stripes, k={self.k}, n), got {data.shape}")
        if out is None:
            out = np.empty((stripes, self.m, n), dtype=np.uint8)
        elif out.shape != (stripes, self.m, n) or out.dtype != np.uint8:
            raise ValueError(f"out must be uint8 {(stripes, self.m, n)}, got {out.dtype} {out.shape}")
        if stripes == 0 or n == 0:
            return out
        for s0, s1, c0, c1 in self._blocks(stripes, n):
            # (k, stripes*cols): row i is data row i of every stripe in the block, side by side
            block = np.ascontiguousarray(data[s0:s1, :, c0:c1].transpose(1, 0, 2)).reshape(k, -1)
            for j, payload in enumerate(self._encode_block(block)):
                out[s0:s1, j, c0:c1] = payload.reshape(s1 - s0, c1 - c0)
        return out

    # ------------------------------------------------------------------ reconstruct
    def reconstruct(self, available: Mapping[int, np.ndarray], missing: Iterable[int]) -> dict[int, np.ndarray]:
        """Rebuilds rows ``missing`` of one stripe from ``available`` ``{index: (n,) uint8}``.

        Needs at least ``k`` available rows; indices ``0..k-1`` are data, ``k..k+m-1`` parity.
        """
        avail, wanted = self._check_reconstruct(available, missing, 1)
        result = self._reconstruct({i: a[None] for i, a in avail.items()}, wanted)
        return {i: r[0] for i, r in result.items()}

    def reconstruct_stripes(
        self, available: Mapping[int, np.ndarray], missing: Iterable[int]
    ) -> dict[int, np.ndarray]:
        """Batch form of :meth:`reconstruct`: arrays are ``(stripes, n)``, one row per stripe."""
        avail, wanted = self._check_reconstruct(available, missing, 2)
        return self._reconstruct(avail, wanted)

    def _reconstruct(self, avail: dict[int, np.ndarray], wanted: list[int]) -> dict[int, np.ndarray]:
        stripes, n = next(iter(avail.values())).shape
        out = {i: np.empty((stripes, n), dtype=np.uint8) for i in wanted}
        if not wanted or stripes == 0 or n == 0:
            return out
        sources = sorted(avail)[: self.k]  # data rows first: they are what decoding needs most
        for s0, s1, c0, c1 in self._blocks(stripes, n):
            width = (s1 - s0) * (c1 - c0)
            headers = self._header_templates(width)
            frags = [b"".join((headers[i], np.ascontiguousarray(avail[i][s0:s1, c0:c1]).data)) for i in sources]
            rebuilt = self._driver.reconstruct(frags, list(wanted))  # returned in sorted index order
            for i, frag in zip(sorted(wanted), rebuilt):
                if len(frag) != FRAGMENT_HEADER_BYTES + width:
                    raise RuntimeError(f"pyeclib returned a fragment of {len(frag)} bytes for index {i}")
                out[i][s0:s1, c0:c1] = np.frombuffer(frag, np.uint8, offset=FRAGMENT_HEADER_BYTES).reshape(
                    s1 - s0, c1 - c0
                )
        return out

    def _check_reconstruct(self, available, missing, ndim: int) -> tuple[dict[int, np.ndarray], list[int]]:
        total = self.k + self.m
        if not isinstance(available, Mapping):
            raise TypeError(f"available must be a mapping {{index: array}}, got {type(available).__name__}")
        avail: dict[int, np.ndarray] = {}
        shape = None
        for key, arr in available.items():
            i = _as_index(key, "available index", total)
            self._check_host_array(arr, f"available[{i}]", ndim)
            if shape is None:
                shape = arr.shape
            elif arr.shape != shape:
                raise ValueError(f"available rows differ in shape: {shape} and {arr.shape} (index {i})")
            avail[i] = arr
        if len(avail) < self.k:
            raise ValueError(f"need at least k={self.k} available rows to reconstruct, got {len(avail)}")
        if isinstance(missing, (str, bytes)) or not isinstance(missing, Iterable):
            raise TypeError(f"missing must be an iterable of indices, got {type(missing).__name__}")
        wanted: list[int] = []
        for value in missing:
            i = _as_index(value, "missing index", total)
            if i in avail:
                raise ValueError(f"index {i} is both available and missing")
            if i in wanted:
                raise ValueError(f"index {i} is listed twice in missing")
            wanted.append(i)
        return avail, wanted

    # ------------------------------------------------------------------ linear combinations
    def combine(self, terms: Iterable[tuple[int, np.ndarray]], out: np.ndarray | None = None) -> np.ndarray:
        """``out ^= XOR_i gf_mul(c_i, rows_i)`` over ``terms`` ``[(c_i, rows_i)]`` (each ``(n, w)`` uint8); ``out``
        defaults to zeros.  With coefficients from :attr:`coefficients` this is parity ``j`` of stripes whose
        data rows are the ``rows_i``; with :meth:`data_decode_coefficients` it rebuilds a data row.  Runs on
        the CPU kernel (ISA-L ``gf_vect_mad``), one call per term over all rows at once."""
        terms = [(int(c), rows) for c, rows in terms]
        if not terms:
            raise ValueError("combine needs at least one term")
        shape = terms[0][1].shape
        for c, rows in terms:
            self._check_host_array(rows, "rows", 2)
            if rows.shape != shape:
                raise ValueError(f"combine: rows of shapes {shape} and {rows.shape}")
            if not 0 <= c < 256:
                raise ValueError(f"combine: coefficient {c} is not a byte")
        if out is None:
            out = np.zeros(shape, dtype=np.uint8)
        elif out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"combine: out must be C-contiguous uint8 of shape {shape}")
        if shape[0] == 0 or shape[1] == 0:
            return out
        kernel = self._kernel_for(False)
        flat = out.reshape(1, -1)  # every row side by side: one long vector, one kernel call per term
        first = np.zeros(1, dtype=np.int64)
        for c, rows in terms:
            if c:
                kernel.apply_delta_batch(flat, first, np.full(1, c, dtype=np.uint8),
                                         np.ascontiguousarray(rows).reshape(1, -1), validated=True)
        return out

    def data_decode_coefficients(self, lost: int, parity: int = 0) -> dict[int, int]:
        """``{member: a}`` such that data row ``lost`` is ``XOR a * row[member]`` over the stripe's other data
        rows and parity ``parity`` (member ``k + parity``), for :meth:`combine`."""
        lost = _as_index(lost, "lost", self.k)
        parity = _as_index(parity, "parity", self.m)
        row = self.coefficients[parity]
        c = int(row[lost])
        if c == 0:
            raise ValueError(f"parity {parity} does not depend on data row {lost}: it cannot rebuild it")
        inverse = next(x for x in range(1, 256) if gf_mul(c, x) == 1)
        out = {u: gf_mul(inverse, int(row[u])) for u in range(self.k) if u != lost}
        out[self.k + parity] = inverse
        return out

    # ------------------------------------------------------------------ deltas
    def apply_delta(
        self,
        parity: Any,
        position: Any,
        delta: Any,
        slots: Any = None,
        parity_index: Any = None,
    ) -> None:
        """Applies data-row deltas to parity in place: ``parity ^= c[j][position] * delta``.

        Forms (all validate everything before mutating anything):

        - ``apply_delta(parity (m, n), position, delta (n,))``: every parity row of a stripe;
        - ``apply_delta(parity (n,), position, delta (n,), parity_index=j)``: parity ``j`` only;
        - ``apply_delta(parity (rows, w), position, delta (b, w), slots=(b,), parity_index=...)``:
          a batch, ``parity[slots[r]] ^= c[parity_index[r]][position[r]] * delta[r]``;
          ``position`` and ``parity_index`` are scalars or ``(b,)``; ``parity_index`` is
          required when ``m > 1``.  Duplicate slots accumulate.

        numpy arrays use the CPU kernel; cupy arrays the GPU kernel (asynchronous).
        """
        device = is_device_array(parity)
        if is_device_array(delta) != device:
            raise TypeError("parity and delta must both be numpy arrays or both be cupy arrays")
        xp = self._kernel_for(device)._xp() if device else np
        for label, arr in (("parity", parity), ("delta", delta)):
            if not isinstance(arr, xp.ndarray):
                raise TypeError(f"{label} must be a {xp.__name__} array, got {type(arr).__name__}")
            if arr.dtype != np.uint8:
                raise TypeError(f"{label} must have dtype uint8, got {arr.dtype}")
        kernel = self._kernel_for(device)

        if slots is None:
            pos = _as_index(position, "position", self.k)
            if delta.ndim != 1:
                raise ValueError(f"delta must be 1-D (n,) without slots, got shape {delta.shape}")
            if parity_index is None:
                if parity.ndim != 2 or parity.shape[0] != self.m:
                    raise ValueError(f"parity must have shape (m={self.m}, n), got {parity.shape}")
                if parity.shape[1] != delta.shape[0]:
                    raise ValueError(f"delta length {delta.shape[0]} != parity row length {parity.shape[1]}")
                rows = np.arange(self.m, dtype=np.int64)
                coeffs = np.ascontiguousarray(self.coefficients[:, pos])
                kernel.apply_delta_batch(parity, rows, coeffs, xp.broadcast_to(delta, (self.m, delta.shape[0])))
                return
            j = _as_index(parity_index, "parity_index", self.m)
            if parity.ndim != 1:
                raise ValueError(f"parity must be 1-D (n,) with a scalar parity_index, got shape {parity.shape}")
            if parity.shape[0] != delta.shape[0]:
                raise ValueError(f"delta length {delta.shape[0]} != parity length {parity.shape[0]}")
            coeff = np.array([self.coefficients[j, pos]], dtype=np.uint8)
            kernel.apply_delta_batch(parity[None], np.zeros(1, np.int64), coeff, delta[None])
            return

        # batched form
        if parity.ndim != 2:
            raise ValueError(f"parity must be 2-D (rows, width) with slots, got shape {parity.shape}")
        if delta.ndim != 2:
            raise ValueError(f"delta must be 2-D (batch, width) with slots, got shape {delta.shape}")
        b = delta.shape[0]
        positions = self._per_row(position, "position", b, self.k)
        if parity_index is None:
            if self.m > 1:
                raise ValueError(
                    f"parity_index is required with slots when m={self.m} > 1 "
                    "(which parity row j each slot holds decides the coefficient)"
                )
            parity_index = 0
        indices = self._per_row(parity_index, "parity_index", b, self.m)
        coeffs = np.ascontiguousarray(self.coefficients[indices, positions])
        kernel.apply_delta_batch(parity, slots, coeffs, delta)

    def _per_row(self, value: Any, label: str, b: int, upper: int) -> np.ndarray:
        """A scalar or ``(b,)`` integer argument as ``(b,)`` intp indices in ``[0, upper)``."""
        value = _to_host(value)
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return np.full(b, _as_index(value, label, upper), dtype=np.intp)
        arr = np.asarray(value)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{label} must be an int or an integer array, got dtype {arr.dtype}")
        if arr.shape != (b,):
            raise ValueError(f"{label} must be a scalar or have shape ({b},), got {arr.shape}")
        if b and (int(arr.min()) < 0 or int(arr.max()) >= upper):
            bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
            raise ValueError(f"{label} {bad} out of range [0, {upper})")
        return arr.astype(np.intp)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _check_host_array(arr: Any, label: str, ndim: int) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"{label} must be a numpy array, got {type(arr).__name__}")
        if arr.dtype != np.uint8:
            raise TypeError(f"{label} must have dtype uint8, got {arr.dtype}")
        if arr.ndim != ndim:
            raise ValueError(f"{label} must be {ndim}-D, got shape {arr.shape}")
