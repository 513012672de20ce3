"""Parity rows held by one server for one table, with per-row version vectors.

A :class:`ParityStore` holds this server's parity rows of one table (``ecrec.layout``
says which stripes and which parity index) and, for every parity row, the version
(owner push sequence) last applied for each of the stripe's ``k`` data positions.
Applying a delta is skipped when its sequence is not newer than the recorded
version, which makes a batch idempotent and lets a rebuilt row ignore deltas
already contained in the snapshot it was encoded from.  While a row is being
rebuilt (``built`` false) its incoming deltas wait in ``pending``.  With the GPU kernel the
parity rows live in device memory; versions and pending deltas stay on the host.
"""

from __future__ import annotations

import threading

import numpy as np

from ecrec.codec import Codec
from ecrec.layout import Layout
from ecrec.tables import TableSpec, initial_payload

ENCODE_CHUNK_STRIPES = 16384


class ParityStore:
    """This server's parity rows of one table (see the module docstring)."""

    def __init__(self, spec: TableSpec, layout: Layout, index: int, codec: Codec):
        self.spec = spec
        self.layout = layout
        self.index = index
        self.codec = codec
        self.stripes, self.parity_index, self.slots = layout.parity_rows_of(index, spec.num_rows)
        n = layout.parity_slots_per_server(spec.num_rows)
        # with the GPU kernel the parity rows live in device memory; versions and logs stay on the host
        self.on_device = codec.kernel.name == "gpu"
        if self.on_device:
            import cupy

            self._xp = cupy
        else:
            self._xp = np
        self.parity = self._xp.zeros((n, spec.row_bytes), dtype=np.uint8)
        self.versions = np.zeros((n, layout.k), dtype=np.int64)
        self.built = np.ones(n, dtype=bool)
        self.pending: dict[int, list[tuple[int, int, np.ndarray]]] = {}  # slot -> [(position, seq, delta)]
        self.lock = threading.Lock()
        self.slot_to_stripe = np.full(n, -1, dtype=np.int64)
        self.slot_to_stripe[self.slots] = self.stripes
        self.slot_to_parity_index = np.zeros(n, dtype=np.int64)
        self.slot_to_parity_index[self.slots] = self.parity_index

    # --- initial parity ----------------------------------------------------------------------------
    def encode_initial(self) -> None:
        """Parity of the tables' initial rows (computable locally: initial rows are a pure function)."""
        for start in range(0, len(self.slots), ENCODE_CHUNK_STRIPES):
            stripes = self.stripes[start:start + ENCODE_CHUNK_STRIPES]
            ids = self.layout.stripe_row_ids(stripes)
            valid = ids < self.spec.num_rows
            data = np.zeros((len(stripes), self.layout.k, self.spec.row_bytes), dtype=np.uint8)
            data[valid] = initial_payload(self.spec, ids[valid]).view(np.uint8)
            parity = self.codec.encode_stripes(data)
            j = self.parity_index[start:start + ENCODE_CHUNK_STRIPES]
            self.set_rows(self.slots[start:start + ENCODE_CHUNK_STRIPES], parity[np.arange(len(stripes)), j])

    # --- deltas --------------------------------------------------------------------------------------
    def apply(self, seq: int, slots: np.ndarray, positions: np.ndarray, pidx: np.ndarray, deltas: np.ndarray) -> int:
        """Applies one batch's deltas where the row does not hold ``seq`` yet (rows being rebuilt hold them
        back); returns how many rows changed."""
        with self.lock:
            built = self.built[slots]
            fresh = built & (seq > self.versions[slots, positions])
            if fresh.all():
                self._xor(slots, positions, pidx, deltas)
                self.versions[slots, positions] = seq
            elif fresh.any():
                self._xor(slots[fresh], positions[fresh], pidx[fresh], deltas[fresh])
                self.versions[slots[fresh], positions[fresh]] = seq
            if not built.all():
                for r in np.flatnonzero(~built):
                    self.pending.setdefault(int(slots[r]), []).append((int(positions[r]), seq, deltas[r].copy()))
            return int(fresh.sum())

    def _xor(self, slots, positions, pidx, deltas) -> None:
        """The hot path: arrays were validated by the caller (``ApplyParity``), so the kernel runs unchecked."""
        coeffs = self.codec.coefficients[pidx, positions]
        xp = self._xp
        self.codec.kernel.apply_delta_batch(self.parity, xp.asarray(slots), xp.asarray(coeffs),
                                            xp.ascontiguousarray(xp.asarray(deltas)), validated=True)

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """Parity rows at ``slots`` as a host array (copied from the device when the GPU kernel is used)."""
        out = self.parity[self._xp.asarray(slots)] if self.on_device else self.parity[slots]
        return out.get() if self.on_device else out

    def set_rows(self, slots: np.ndarray, rows: np.ndarray) -> None:
        if self.on_device:
            self.parity[self._xp.asarray(slots)] = self._xp.asarray(rows)
        else:
            self.parity[slots] = rows

    def undo(self, seq: int, slots, positions, pidx, deltas, old_versions) -> int:
        """Cancels push ``seq`` where a parity row holds it as its newest delta of that data row (XOR again,
        back to ``old_versions``: also right when the row was rebuilt from data that already held it), and
        drops it where it is held back.  Resolution undoes a suffix of a source's pushes, newest first, so a
        delta a row holds is then always the newest.  Returns how many rows changed."""
        with self.lock:
            built = self.built[slots]
            held = built & (self.versions[slots, positions] == seq)
            if held.any():
                self._xor(slots[held], positions[held], pidx[held], deltas[held])
                self.versions[slots[held], positions[held]] = old_versions[held]
            for r in np.flatnonzero(~built):
                waiting = self.pending.get(int(slots[r]))
                if waiting:
                    waiting[:] = [p for p in waiting if p[1] != seq]
            return int(held.sum())

    # --- rebuild -------------------------------------------------------------------------------------
    def mark_unbuilt(self) -> None:
        with self.lock:
            self.built[:] = False
            self.built[np.setdiff1d(np.arange(len(self.built)), self.slots)] = True  # unused slots
            self.pending.clear()

    def build(self, slots: np.ndarray, parity_rows: np.ndarray, versions: np.ndarray) -> int:
        """Installs rebuilt rows (encoded from data rows at ``versions``) and applies newer pending deltas."""
        done = 0
        with self.lock:
            for r, slot in enumerate(slots.tolist()):
                if self.built[slot]:
                    continue
                self.set_rows(np.array([slot]), parity_rows[r][None, :])
                self.versions[slot] = versions[r]
                for position, seq, delta in self.pending.pop(slot, []):
                    if seq > self.versions[slot, position]:
                        self._xor(np.array([slot]), np.array([position]), np.array([self.slot_to_parity_index[slot]]),
                                  delta[None, :])
                        self.versions[slot, position] = seq
                self.built[slot] = True
                done += 1
        return done

    def unbuilt_slots(self) -> np.ndarray:
        with self.lock:
            return self.slots[~self.built[self.slots]]
