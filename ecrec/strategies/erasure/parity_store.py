"""Parity rows held by one server, with per-row version vectors: one arena per row width.

A :class:`ParityArena` holds this server's parity rows of every table whose rows have the same byte
width, side by side in one array (``ecrec.coding.layout`` says which stripes and parity index each table's
rows are; :class:`TableParity` is one table's part, at an offset).  So the deltas of one batch, whatever
tables they touch, are one version check and one kernel call.  For every parity row the arena keeps the
version (owner push sequence) last applied for each of the stripe's ``k`` data positions.  A delta is
applied only when its sequence is newer than the recorded version, which makes a batch idempotent and
lets a rebuilt row skip deltas already contained in the data it was encoded from.  While a row is being
rebuilt (``built`` false) its incoming deltas wait in ``pending``.  With the GPU kernel the parity rows
live in device memory; versions and pending deltas stay on the host.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np

from ecrec.coding.codec import Codec
from ecrec.coding.layout import Layout
from ecrec.tables.spec import TableSpec, fill_initial_payload

ENCODE_CHUNK_STRIPES = 16384


@functools.lru_cache(maxsize=1)
def _place_kernel():
    """Compiles (once, cached on disk by numba) the check that places a batch in an arena."""
    from numba import njit

    @njit(cache=True, nogil=True, boundscheck=False)
    def place(local, counts, offsets, limits, positions, k, slot_to_stripe):  # pragma: no cover - numba
        """Arena slots of a batch's rows (table after table), or -1 at the first row out of range or
        holding no parity row here (the caller refuses the batch)."""
        n = local.shape[0]
        slots = np.empty(n, dtype=np.int64)
        r = 0
        for t in range(counts.shape[0]):
            for _ in range(counts[t]):
                if r >= n:
                    return slots, -1
                s = local[r]
                p = positions[r]
                if s < 0 or s >= limits[t] or p < 0 or p >= k:
                    return slots, r
                s += offsets[t]
                if slot_to_stripe[s] < 0:
                    return slots, r
                slots[r] = s
                r += 1
        if r != n:
            return slots, -1
        return slots, n

    return place


def place_rows(local, counts, offsets, limits, positions, k, slot_to_stripe) -> tuple[np.ndarray, int]:
    """``(arena slots, rows checked)``: all ``len(local)`` rows are in range and held here when the count
    equals it; else the count is the first bad row (-1: the counts do not add up)."""
    return _place_kernel()(local, counts, offsets, limits, positions, k, slot_to_stripe)


@dataclass
class TableParity:
    """One table's part of an arena: arena slots ``offset .. offset + count``; this server holds the parity
    rows at ``slots`` (arena slots) of ``stripes`` (parity index ``parity_index``)."""

    spec: TableSpec
    offset: int
    count: int
    slots: np.ndarray
    stripes: np.ndarray
    parity_index: np.ndarray

    def arena_slots(self, local: np.ndarray) -> np.ndarray:
        return self.offset + np.asarray(local, dtype=np.int64)


class ParityArena:
    """This server's parity rows of every table ``row_bytes`` wide (see the module docstring)."""

    def __init__(self, row_bytes: int, layout: Layout, index: int, codec: Codec):
        self.row_bytes = row_bytes
        self.layout = layout
        self.index = index
        self.codec = codec
        self.on_device = codec.kernel.name == "gpu"
        if self.on_device:
            import cupy

            self._xp = cupy
        else:
            self._xp = np
        self.parity = self._xp.zeros((0, row_bytes), dtype=np.uint8)
        self.versions = np.zeros((0, layout.k), dtype=np.int64)
        self.built = np.ones(0, dtype=bool)
        self.slot_to_stripe = np.zeros(0, dtype=np.int64)  # -1: a slot holding no parity row
        self.slot_to_parity_index = np.zeros(0, dtype=np.int64)
        self.pending: dict[int, list[tuple[int, int, np.ndarray]]] = {}  # slot -> [(position, seq, delta)]
        self.tables: dict[str, TableParity] = {}
        self.unbuilt_count = 0  # parity rows waiting to be rebuilt (deltas for them are held back)
        self.lock = threading.Lock()

    @property
    def size(self) -> int:
        return len(self.built)

    # --- tables ------------------------------------------------------------------------------------------
    def add_table(self, spec: TableSpec, allocate=np.zeros) -> TableParity:
        """Appends a table's parity rows (zeros, built) to the arena; ``allocate(shape, dtype)`` gives the zeroed
        rows of the arena's first table on the CPU (a promoted standby's come from its reserve)."""
        if spec.row_bytes != self.row_bytes:
            raise ValueError(f"table {spec.name!r} has rows of {spec.row_bytes} bytes, this arena {self.row_bytes}")
        layout, xp = self.layout, self._xp
        stripes, pidx, local = layout.parity_rows_of(self.index, spec.num_rows)
        n = layout.parity_slots_per_server(spec.num_rows)
        with self.lock:
            offset = self.size
            part = TableParity(spec, offset, n, offset + local, stripes, pidx)
            to_stripe = np.full(n, -1, dtype=np.int64)
            to_stripe[local] = stripes
            to_pidx = np.zeros(n, dtype=np.int64)
            to_pidx[local] = pidx
            parity = allocate((n, self.row_bytes), np.uint8) if offset == 0 and xp is np else \
                xp.zeros((n, self.row_bytes), dtype=np.uint8)
            new = {"parity": parity, "versions": np.zeros((n, layout.k), np.int64),
                   "built": np.ones(n, dtype=bool), "slot_to_stripe": to_stripe, "slot_to_parity_index": to_pidx}
            for name, added in new.items():  # the first table takes fresh (lazily zeroed) arrays: no copy
                setattr(self, name, added if offset == 0 else
                        (xp if name == "parity" else np).concatenate([getattr(self, name), added]))
            self.tables[spec.name] = part
        return part

    def encode_initial(self, part: TableParity) -> None:
        """Parity of a table's initial rows (computable locally: initial rows are a pure function).  Rows all
        zero have parity zero (the code is linear), which the fresh arena holds already."""
        spec = part.spec
        if spec.initially_zero:
            return
        for start in range(0, len(part.slots), ENCODE_CHUNK_STRIPES):
            stripes = part.stripes[start:start + ENCODE_CHUNK_STRIPES]
            ids = self.layout.stripe_row_ids(stripes)
            valid = (ids < spec.num_rows).reshape(-1)
            data = np.zeros((len(stripes), self.layout.k, spec.row_bytes), dtype=np.uint8)
            fill_initial_payload(spec, ids.reshape(-1)[valid], data.reshape(-1, spec.row_bytes).view(np.float32),
                                 np.flatnonzero(valid))
            parity = self.codec.encode_stripes(data)
            j = part.parity_index[start:start + ENCODE_CHUNK_STRIPES]
            with self.lock:
                self.set_rows(part.slots[start:start + ENCODE_CHUNK_STRIPES], parity[np.arange(len(stripes)), j])

    # --- deltas --------------------------------------------------------------------------------------------
    def apply(self, seqs: np.ndarray, slots: np.ndarray, positions: np.ndarray, parity: int, deltas: np.ndarray) -> int:
        """Applies a batch's deltas (row ``r`` from push ``seqs[r]``; a row may come once per push, in push order)
        to parity ``parity`` of their stripes (``slots``: arena slots) where the row does not hold that push
        yet; rows being rebuilt hold them back.  Returns how many deltas were applied."""
        kernel = self.codec.kernel
        with self.lock:
            applied = kernel.apply_versioned(self.parity, slots, positions, self.codec.coefficients[parity], deltas,
                                             self.versions, self.built, seqs)
            if not self.unbuilt_count:
                return applied
            built = self.built[slots]
            if not built.all():
                for r in np.flatnonzero(~built):
                    self.pending.setdefault(int(slots[r]), []).append((int(positions[r]), int(seqs[r]), deltas[r].copy()))
            return applied

    def _xor(self, slots, positions, parity, deltas) -> None:
        """Applies deltas unconditionally (rebuild and undo); ``parity``: one index for every row, or an array."""
        coeffs = self.codec.coefficients[parity][positions] if np.ndim(parity) == 0 else \
            self.codec.coefficients[parity, positions]
        xp = self._xp
        if xp is np:
            self.codec.kernel.apply_delta_batch(self.parity, slots, coeffs, np.ascontiguousarray(deltas), validated=True)
        else:
            self.codec.kernel.apply_delta_batch(self.parity, xp.asarray(slots), xp.asarray(coeffs),
                                                xp.ascontiguousarray(xp.asarray(deltas)), validated=True)

    def undo(self, seqs: np.ndarray, slots, positions, parity: int, deltas, old_versions) -> int:
        """Cancels a batch: newest row first, where a parity row holds that delta as its newest of that data
        row, XOR it again and go back to its ``old_versions`` (also right when the row was rebuilt from data
        that already held it); drops the deltas held back.  Resolution undoes a suffix of a source's batches,
        newest first, so a delta a row holds is then always its newest.  Returns how many deltas were undone."""
        k = self.layout.k
        undone = 0
        with self.lock:
            flat = self.versions.reshape(-1)
            for r in range(len(slots) - 1, -1, -1):
                slot, position, seq = int(slots[r]), int(positions[r]), int(seqs[r])
                if not self.built[slot]:
                    waiting = self.pending.get(slot)
                    if waiting:
                        waiting[:] = [p for p in waiting if not (p[0] == position and p[1] == seq)]
                    continue
                if flat[slot * k + position] != seq:
                    continue
                self._xor(np.array([slot]), np.array([position]), parity, deltas[r:r + 1])
                flat[slot * k + position] = old_versions[r]
                undone += 1
        return undone

    # --- reading --------------------------------------------------------------------------------------------
    def rows(self, slots: np.ndarray) -> np.ndarray:
        """Parity rows at ``slots`` as a host array (copied from the device when the GPU kernel is used)."""
        out = self.parity[self._xp.asarray(slots)] if self.on_device else self.parity[slots]
        return out.get() if self.on_device else out

    def set_rows(self, slots: np.ndarray, rows: np.ndarray) -> None:
        if self.on_device:
            self.parity[self._xp.asarray(slots)] = self._xp.asarray(rows)
        else:
            self.parity[slots] = rows

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(rows, versions, built)`` of ``slots``, read atomically."""
        with self.lock:
            return self.rows(slots), self.versions[slots], self.built[slots].copy()

    def read_into(self, slots: np.ndarray, rows: np.ndarray, versions: np.ndarray, built: np.ndarray) -> None:
        """Like :meth:`read`, into the caller's host arrays (a frame of the fast rebuild's streams)."""
        with self.lock:
            if self.on_device:
                rows[...] = self.rows(slots)
            else:
                np.take(self.parity, slots, axis=0, out=rows)
            versions[...] = self.versions[slots]
            built[...] = self.built[slots]

    # --- rebuild -------------------------------------------------------------------------------------------
    def mark_unbuilt(self) -> None:
        with self.lock:
            self.built[:] = self.slot_to_stripe < 0  # slots holding no parity row stay "built"
            self.unbuilt_count = int((~self.built).sum())
            self.pending.clear()

    def build(self, slots: np.ndarray, parity_rows: np.ndarray, versions: np.ndarray) -> int:
        """Installs rebuilt rows (encoded from data rows at ``versions``) and applies the held-back deltas
        newer than them; returns how many rows were installed."""
        with self.lock:
            fresh = ~self.built[slots]
            if not fresh.all():
                slots, parity_rows, versions = slots[fresh], parity_rows[fresh], versions[fresh]
            if not len(slots):
                return 0
            self.set_rows(slots, parity_rows)
            self.versions[slots] = versions
            for slot in [s for s in slots.tolist() if s in self.pending]:
                for position, seq, delta in self.pending.pop(slot):
                    if seq > self.versions[slot, position]:
                        self._xor(np.array([slot]), np.array([position]), np.array([self.slot_to_parity_index[slot]]),
                                  delta[None, :])
                        self.versions[slot, position] = seq
            self.built[slots] = True
            self.unbuilt_count -= len(slots)
            return len(slots)

    def is_built(self, slots: np.ndarray) -> np.ndarray:
        """Whether each of ``slots`` holds a built parity row (a copy)."""
        with self.lock:
            return self.built[slots]

    def unbuilt(self, part: TableParity) -> np.ndarray:
        """The table's parity rows (arena slots) not built yet."""
        with self.lock:
            return part.slots[~self.built[part.slots]]
