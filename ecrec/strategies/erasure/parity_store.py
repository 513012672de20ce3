"""Parity rows held by one server, with per-row version vectors: one arena per row width.

A :class:`ParityArena` holds this server's parity rows of every table whose rows have the same byte
width, side by side in one array (``ecrec.coding.layout`` says which stripes and parity index each table's
rows are; :class:`TableParity` is one table's part, at an offset).  So the deltas of one batch, whatever
tables they touch, are one version check and one kernel call.  For every parity row the arena keeps the
version (owner push sequence) last applied for each of the stripe's ``k`` data positions.  A delta is
applied only when its sequence is newer than the recorded version, which makes a batch idempotent and
lets a rebuilt row skip deltas already contained in the data it was encoded from.  While a row is being
rebuilt (``built`` false) its incoming deltas wait in ``held`` (:mod:`~ecrec.strategies.erasure.held_deltas`:
arrays, no work per row) -- but only once the rebuild has started reading the data it encodes the row from
(:meth:`ParityArena.begin_read`): a delta that arrives before that read is of a push the data read already
holds (an owner sends a delta after applying its push), so the build would skip it; it is dropped, and until
its read a row not rebuilt costs its incoming deltas nothing.  With the GPU kernel the parity rows live in
device memory; versions and held deltas stay on the host.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ecrec.coding.codec import Codec
from ecrec.coding.layout import Layout
from ecrec.strategies.erasure.held_deltas import HeldDeltas
from ecrec.tables.spec import TableSpec, fill_initial_payload

ENCODE_CHUNK_STRIPES = 16384


def _place_kernel():
    """The compiled check that places a batch in an arena (``place_kernel.place``: loaded from numba's disk cache, or
    compiled once and cached there)."""
    from ecrec.strategies.erasure import place_kernel

    return place_kernel.place


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
        self.held = HeldDeltas(row_bytes)  # deltas for rows not rebuilt yet, in arrival order
        self.reading = np.zeros(0, dtype=bool)  # rows not built whose rebuild read has started (their deltas held)
        self.holding = np.zeros(0, dtype=bool)  # rows with deltas held (or dropped since): what a build looks up
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
                   "built": np.ones(n, dtype=bool), "reading": np.zeros(n, dtype=bool),
                   "holding": np.zeros(n, dtype=bool), "slot_to_stripe": to_stripe, "slot_to_parity_index": to_pidx}
            for name, added in new.items():  # the first table takes fresh (lazily zeroed) arrays: no copy
                setattr(self, name, added if offset == 0 else
                        (xp if name == "parity" else np).concatenate([getattr(self, name), added]))
            self.tables[spec.name] = part
        return part

    def encode_initial(self, part: TableParity) -> None:
        """Parity of a table's initial rows (computable locally: initial rows are a pure function).  Rows all
        zero have parity zero (the code is linear), which the fresh arena holds already."""
        spec = part.spec
        if not spec.initially_zero:
            self.encode_from(part, lambda ids, out, at: fill_initial_payload(spec, ids, out, at))

    def encode_from(self, part: TableParity, gather) -> None:
        """Every parity row of ``part`` encoded from its stripe's data rows, which ``gather(ids, out, at)`` writes
        into ``out[at]`` (float32 rows): a table's initial rows, or a snapshot's (``ecrec.snapshot.bulk``)."""
        spec = part.spec
        block = min(len(part.slots), ENCODE_CHUNK_STRIPES)  # buffers reused block after block: pages touched once
        buffer = np.empty((block, self.layout.k, spec.row_bytes), np.uint8)
        encoded = np.empty((block, self.layout.m, spec.row_bytes), np.uint8)
        for start in range(0, len(part.slots), ENCODE_CHUNK_STRIPES):
            stripes = part.stripes[start:start + ENCODE_CHUNK_STRIPES]
            ids = self.layout.stripe_row_ids(stripes)
            valid = (ids < spec.num_rows).reshape(-1)
            data = buffer[:len(stripes)]
            rows = data.reshape(-1, spec.row_bytes)
            if not valid.all():
                rows[~valid] = 0  # a stripe's members past the table: zero rows
            gather(ids.reshape(-1)[valid], rows.view(np.float32), np.flatnonzero(valid))
            parity = self.codec.encode_stripes(data, out=encoded[:len(stripes)])
            j = part.parity_index[start:start + ENCODE_CHUNK_STRIPES]
            mine = parity[:, int(j[0])] if (j == j[0]).all() else parity[np.arange(len(stripes)), j]
            with self.lock:
                self.set_rows(part.slots[start:start + ENCODE_CHUNK_STRIPES], mine)

    def touched(self, part: TableParity) -> bool:
        """Whether any parity row of ``part`` holds a push's delta or is not built."""
        with self.lock:
            return bool(self.versions[part.slots].any() or not self.built[part.slots].all())

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
                waiting = ~built & self.reading[slots]  # the others' pushes are in the data their rebuild reads
                if waiting.any():
                    self.held.add(slots[waiting], positions[waiting], seqs[waiting], deltas[waiting])
                    self.holding[slots[waiting]] = True
            return applied

    def begin_read(self, slots: np.ndarray) -> None:
        """Before a rebuild reads the data rows it encodes parity rows ``slots`` from: from now on, deltas for the
        ones not built are held back until they are."""
        with self.lock:
            self.reading[slots] = True

    def end_read(self, slots: np.ndarray) -> None:
        """Rows that will not be built (their stripe lost more than ``m`` members): their deltas are no longer
        held, and those held are dropped."""
        with self.lock:
            self.reading[slots] = False
            self._take_held(slots)

    def holds(self, slot: int) -> bool:
        """Whether a delta for parity row ``slot`` (not rebuilt yet) is held back."""
        with self.lock:
            return self.held.holds(slot)

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
            waiting = ~self.built[slots]
            if waiting.any():  # not rebuilt yet: the deltas held back for them are dropped, not applied
                self.held.drop(slots[waiting], positions[waiting], seqs[waiting])
            for r in range(len(slots) - 1, -1, -1):
                slot, position, seq = int(slots[r]), int(positions[r]), int(seqs[r])
                if waiting[r]:
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
        elif len(slots) > 1 and slots[-1] - slots[0] == len(slots) - 1 and (np.diff(slots) == 1).all():
            self.parity[slots[0]:slots[-1] + 1] = rows  # consecutive rows: one copy through a view
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
            self.held.clear()
            self.reading = np.zeros(self.size, dtype=bool)
            self.holding = np.zeros(self.size, dtype=bool)

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
            self._apply_held(*self._take_held(slots))
            self.built[slots] = True
            self.unbuilt_count -= len(slots)
            if not self.unbuilt_count:
                self.held.clear()  # every row built: the arrays go
            return len(slots)

    def _take_held(self, slots: np.ndarray):
        """Removes and returns the deltas held for ``slots`` (``HeldDeltas.take``), looking only at what those rows
        hold (call with the lock held)."""
        if not len(self.held) or not self.holding[slots].any():
            return self.held.empty()
        member = np.zeros(self.size, dtype=bool)
        member[slots] = True
        self.holding[slots] = False
        return self.held.take(member)

    def _apply_held(self, slots: np.ndarray, positions: np.ndarray, seqs: np.ndarray, deltas: np.ndarray) -> None:
        """Applies held deltas (in arrival order) to rows just built: each where its sequence is newer than the
        row's version of its position then, as one after the other would (call with the lock held)."""
        if not len(slots):
            return
        k = self.layout.k
        key = slots * k + positions
        order = np.lexsort((np.arange(len(key)), key))  # by row and position, in arrival order within one
        flat = self.versions.reshape(-1)
        sk, sq = key[order], seqs[order]
        first = np.ones(len(sk), dtype=bool)
        first[1:] = sk[1:] != sk[:-1]
        if (sq[1:][~first[1:]] > sq[:-1][~first[1:]]).all():
            # the usual case: each position's deltas arrive in push order, so the newer ones are a suffix
            newer = sq > flat[sk]
        else:  # out of order (an owner replaced meanwhile): one after the other, as they arrived
            newer = np.zeros(len(sk), dtype=bool)
            latest: dict[int, int] = {}
            for i, (kk, q) in enumerate(zip(sk.tolist(), sq.tolist())):
                if q > latest.get(kk, int(flat[kk])):
                    latest[kk] = q
                    newer[i] = True
        chosen = order[newer]
        if not len(chosen):
            return
        np.maximum.at(flat, key[chosen], seqs[chosen])
        # one call per round in which a row appears at most once (a device kernel may not add up repeats)
        by_slot = chosen[np.argsort(slots[chosen], kind="stable")]
        sorted_slots = slots[by_slot]
        starts = np.ones(len(by_slot), dtype=bool)
        starts[1:] = sorted_slots[1:] != sorted_slots[:-1]
        group_start = np.maximum.accumulate(np.where(starts, np.arange(len(by_slot)), 0))
        rank = np.arange(len(by_slot)) - group_start
        for r in range(int(rank.max()) + 1):
            pick = by_slot[rank == r]
            self._xor(slots[pick], positions[pick], self.slot_to_parity_index[slots[pick]], deltas[pick])

    def is_built(self, slots: np.ndarray) -> np.ndarray:
        """Whether each of ``slots`` holds a built parity row (a copy)."""
        with self.lock:
            return self.built[slots]

    def unbuilt(self, part: TableParity) -> np.ndarray:
        """The table's parity rows (arena slots) not built yet."""
        with self.lock:
            return part.slots[~self.built[part.slots]]
