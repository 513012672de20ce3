"""A server's data: its shard of every table and its dense tensors, each guarded by its own lock.

A :class:`TableShard` holds this server's rows of one table as a ``(slots, row_bytes)`` uint8
payload (weights then optimizer state, float32), the *version* of every row (the push sequence
that last changed it) and whether each row is *ready*.  Rows of a promoted replacement start not
ready and become ready when the strategy installs their rebuilt bytes.  A :class:`DenseShard` is one
dense tensor held here (its primary or a replica): one payload row, a version, and while it is
rebuilt the replica deltas that arrived meanwhile.

Everything a strategy or the server does to the data goes through the methods here; each takes the
shard's lock for exactly the operation it names, so compound updates (a rebuilt row written and
marked ready, a delta XORed and its version bumped) are atomic with respect to every reader.  A push's
gradients go through one compiled pass per table (:mod:`ecrec.tables.optim_kernel`: gather, old bytes,
optimizer, check) where the rows are a host array, else through the numpy reference (:mod:`ecrec.tables.optim`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from ecrec import errors
from ecrec.tables import optim, optim_kernel
from ecrec.coding.layout import Layout
from ecrec.tables.spec import DenseSpec, TableSpec, fill_initial_payload


@dataclass
class RowsRead:
    """Rows read together with their versions and ready flags (copies)."""

    payload: np.ndarray  # (n, row_bytes) uint8
    versions: np.ndarray  # (n,) int64
    ready: np.ndarray  # (n,) bool


@dataclass
class PreparedRows:
    """An update of some rows computed but not written (:meth:`TableShard.prepare_gradients`)."""

    slots: np.ndarray
    old: np.ndarray | None  # the rows' payload bytes before (a copy), when asked for; with ``delta``, before XOR after
    rows: np.ndarray  # (n, row_floats) float32: the new rows
    delta: bool = False  # ``old`` is already the delta (the compiled pass wrote it)


@dataclass
class PreparedDense:
    """A dense tensor's update computed but not written (:meth:`DenseShard.prepare_gradient`)."""

    old: np.ndarray | None
    floats: np.ndarray  # (1, numel * (1 + state_width)) float32: the new payload


class _HoldsCuts:
    """The snapshot cuts a shard keeps while they are written (``ecrec.server.cut``), by holder; ``_lock`` and
    ``_cuts`` are the shard's."""

    #: rewrites outside pushes so far (a restore, a rollback: no version changes): a read made outside the lock
    #: compares it (``TableShard.reread_changed``)
    _rewrites = 0

    def add_cut(self, holder: str, cut) -> None:
        with self._lock:
            self._cuts[holder] = cut

    def drop_cut(self, holder: str) -> None:
        with self._lock:
            self._cuts.pop(holder, None)

    def _break_cuts(self, why: str) -> None:
        """Data rewritten outside any push (the lock held): no cut can keep what it was, and a read made before
        it is stale whatever the versions say."""
        self._rewrites += 1
        for cut in self._cuts.values():
            cut.broken = why


class TableShard(_HoldsCuts):
    """This server's rows of one table (see the module docstring)."""

    def __init__(self, spec: TableSpec, layout: Layout, index: int, initial_values: bool = True,
                 allocate=np.zeros):
        """``allocate(shape, dtype)``: a zeroed array for the rows (a promoted standby's comes from its
        reserve, :mod:`ecrec.server.reserve`)."""
        self.spec = spec
        self.layout = layout
        self.index = index
        self._lock = threading.Lock()
        self.owned_ids, self.owned_slots = layout.rows_of(index, spec.num_rows)
        self.num_slots = layout.data_slots_per_server(spec.num_rows)
        self._payload = allocate((self.num_slots, spec.row_bytes), np.uint8)
        self._floats = self._payload.view(np.float32)  # (slots, row_floats)
        # gradients go through the compiled pass where it takes the rows (host memory, a known optimizer); a server
        # loads it before it registers (spec.warm_up)
        self._compiled = optim_kernel.usable(self._floats, spec.optimizer)
        if initial_values and not spec.initially_zero:  # a replacement whose strategy rebuilds every row skips
            # this, and zeroed rows are initial rows already
            fill_initial_payload(spec, self.owned_ids, self._floats, self.owned_slots)
        self._versions = np.zeros(self.num_slots, dtype=np.int64)
        self._ready = np.ones(self.num_slots, dtype=bool)
        self.row_updates = 0  # distinct rows updated, summed over pushes
        # CPU spent keeping rows' old bytes and XORing them into deltas (a strategy's); in the compiled pass the old
        # bytes are kept as the rows are gathered, at no cost of their own: only the XOR is counted there
        self.delta_cpu_s = 0.0
        self._cuts: dict = {}  # snapshot cuts being written (ecrec.server.cut.ShardCut), by holder
        # a restore in bulk (ecrec.snapshot.bulk): its mark while it runs (pushes and pulls refused), whether rows
        # were rewritten since the last one finished, how many fills began (a read compares), the digest of the
        # last one finished here; set under the server's apply lock
        self.restore = None
        self.rewritten = False
        self.fills = 0
        self.restored_from = ""

    @property
    def name(self) -> str:
        return self.spec.name

    def touched(self) -> bool:
        """Whether a push changed any row here, or a row is not ready (being rebuilt)."""
        with self._lock:
            return bool(self._versions.any() or not self._ready.all())

    def fill_from(self, gather, block: int, check=None) -> int:
        """Rewrites every owned row from ``gather(ids, out, at)`` (a restore in bulk, ``ecrec.snapshot.bulk``),
        ``block`` rows per hold of the lock, each block passed to ``check`` (which may raise) once written;
        versions stay as they are.  Returns the rows written."""
        for start in range(0, len(self.owned_ids), block):
            ids, slots = self.owned_ids[start:start + block], self.owned_slots[start:start + block]
            with self._lock:
                self._break_cuts("rows were rewritten (a restore)")
                gather(ids, self._floats, slots)
                if check is not None:
                    run = _as_slice(slots)
                    check(self._floats[run] if run is not None else self._floats[slots])
        return len(self.owned_ids)

    @property
    def nbytes(self) -> int:
        return self._payload.nbytes

    # --- addressing ------------------------------------------------------------------------------------------
    def slots_for(self, ids: np.ndarray) -> np.ndarray:
        """Validates that ``ids`` are in range and owned here; returns their slots."""
        if ids.size == 0:
            raise errors.InvalidRequest(f"table {self.spec.name!r}: no row ids")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.spec.num_rows:
            bad = lo if lo < 0 else hi
            raise errors.InvalidRequest(f"table {self.spec.name!r}: row id {bad} out of range [0, {self.spec.num_rows})")
        servers, slots = self.layout.locate(ids)
        wrong = servers != self.index
        if wrong.any():
            i = int(np.argmax(wrong))
            raise errors.FailedPrecondition(
                f"table {self.spec.name!r}: row {int(ids[i])} is owned by server {int(servers[i])}, "
                f"not by server {self.index}; refresh the cluster map"
            )
        return slots

    # --- training --------------------------------------------------------------------------------------------
    def apply_gradients(self, slots: np.ndarray, grads: np.ndarray, version: int,
                        keep_old: bool, delta: bool = False) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """Runs the table's optimizer on rows ``slots`` (unique) and stamps them with ``version``;
        returns their ``(old, new)`` payload bytes (``old`` None unless ``keep_old``; with ``delta``, ``old XOR
        new`` instead of ``old``, computed while the rows are in cache) and old versions.  Raises
        ``InvalidRequest`` and changes nothing when a resulting row would not be finite."""
        return self.commit(self.prepare_gradients(slots, grads, keep_old or delta, delta), version, delta)

    def prepare_gradients(self, slots: np.ndarray, grads: np.ndarray, keep_old: bool,
                          delta: bool = False) -> PreparedRows:
        """What the optimizer makes of rows ``slots`` (unique) with ``grads``, computed on copies: nothing here
        changes until :meth:`commit`.  With ``delta`` the old bytes kept are each row's delta (before XOR after),
        written by the compiled pass while the row is in cache (:meth:`commit` then makes no pass of its own).
        Raises ``InvalidRequest`` naming the rows when a result would not be
        finite (a finite gradient large enough to overflow the optimizer's state): such an update is refused
        whole, as a NaN gradient is, because one ``inf`` accumulator makes every later snapshot unloadable."""
        spec = self.spec
        if self._compiled:  # one compiled pass: gather, old bytes, optimizer, check (optim_kernel), under the
            with self._lock:  # lock as it reads the table (a few microseconds per hundred rows)
                rows, old, bad = optim_kernel.update_rows(self._floats, slots, grads, spec.optimizer, spec.dim,
                                                          spec.lr, spec.eps, keep_old, delta)
            if bad is not None:
                self._refuse_not_finite(slots, bad)
            return PreparedRows(slots, old, rows, delta=delta)
        rows, old = self._copy_rows(slots, keep_old)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, not logged as a warning
            optim.apply(spec.optimizer, rows, grads, spec.dim, spec.lr, spec.eps)
        self._check_finite(slots, rows)
        return PreparedRows(slots, old, rows)

    def prepare_assignment(self, slots: np.ndarray, values: np.ndarray, columns: slice,
                           keep_old: bool) -> PreparedRows:
        """Rows ``slots`` with ``columns`` replaced by ``values`` (a load or a warm start), on copies; checked
        as :meth:`prepare_gradients` checks."""
        rows, old = self._copy_rows(slots, keep_old)
        rows[:, columns] = values
        self._check_finite(slots, rows)
        return PreparedRows(slots, old, rows)

    def _copy_rows(self, slots: np.ndarray, keep_old: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Copies of rows ``slots`` as floats to update, and of their bytes as they are when ``keep_old``."""
        with self._lock:
            rows = self._floats[slots]  # a copy: fancy indexing
        if not keep_old:
            return rows, None
        t0 = time.thread_time()
        old = rows.view(np.uint8).copy()
        self.delta_cpu_s += time.thread_time() - t0  # the caller holds the server's apply lock (or owns the shard)
        return rows, old

    def _check_finite(self, slots: np.ndarray, rows: np.ndarray) -> None:
        bad = ~np.isfinite(rows).all(axis=1)
        if bad.any():
            self._refuse_not_finite(slots, bad)

    def _refuse_not_finite(self, slots: np.ndarray, bad: np.ndarray) -> None:
        """Refuses an update that would leave the rows ``slots[bad]`` non-finite, naming the first of them."""
        ids = self.layout.ids_of_slots(self.index, np.asarray(slots[bad][:5], dtype=np.int64)).tolist()
        raise errors.InvalidRequest(
            f"table {self.spec.name!r}: the update would leave {int(bad.sum())} rows with a non-finite weight "
            f"or optimizer state (ids {', '.join(map(str, ids))}{', ...' if bad.sum() > 5 else ''}): the "
            "gradient is too large for the optimizer; push refused, nothing applied")

    def commit(self, prepared: PreparedRows, version: int,
               delta: bool = False) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """Writes prepared rows and stamps them with ``version`` (the caller holds the server's apply lock, so
        nothing wrote them since they were prepared); returns what :meth:`apply_gradients` returns."""
        slots, old, rows = prepared.slots, prepared.old, prepared.rows
        if prepared.delta and not delta:
            raise ValueError("rows prepared with their delta, committed for their old bytes")
        with self._lock:
            old_versions = self._versions[slots]
            if self._cuts:  # rows changed for the first time since a snapshot's cut leave their bytes there first
                for cut in list(self._cuts.values()):
                    first = old_versions <= cut.seq
                    if first.any():
                        cut.save(slots[first], self._payload[slots[first]])
            self._floats[slots] = rows
            self._versions[slots] = version
            self.row_updates += len(slots)
        if delta and not prepared.delta:  # rows prepared by numpy (an assignment, a table the pass does not take)
            t0 = time.thread_time()
            np.bitwise_xor(old, rows.view(np.uint8), out=old)
            self.delta_cpu_s += time.thread_time() - t0
        return old, rows.view(np.uint8), old_versions

    def assign_rows(self, slots: np.ndarray, values: np.ndarray, columns: slice, version: int,
                    keep_old: bool, delta: bool = False) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """Replaces ``columns`` of rows ``slots`` (unique) with ``values`` (a load or a warm start, not a
        gradient) and stamps them with ``version``; returns what :meth:`apply_gradients` returns."""
        return self.commit(self.prepare_assignment(slots, values, columns, keep_old or delta), version, delta)

    def weights(self, slots: np.ndarray) -> np.ndarray:
        """The rows' weights (float32 ``(n, dim)``, a copy)."""
        with self._lock:
            return self._floats[slots, : self.spec.dim]

    # --- reading and writing whole payloads ------------------------------------------------------------------
    def read_payload(self, slots: np.ndarray) -> np.ndarray:
        with self._lock:
            return self._payload[slots]

    def read_payload_bytes(self, slots: np.ndarray) -> bytes:
        """The rows' payload as bytes; slots that run consecutively (a snapshot's reads) are copied as one
        slice, not gathered row by row."""
        if len(slots) > 1 and slots[-1] - slots[0] == len(slots) - 1 and bool((np.diff(slots) == 1).all()):
            with self._lock:
                return self._payload[int(slots[0]):int(slots[-1]) + 1].tobytes()
        return self.read_payload(slots).tobytes()

    def read_payload_at(self, slots: np.ndarray, cut) -> np.ndarray:
        """The rows' payload as it was at a snapshot's cut (``ecrec.server.cut.ShardCut``), a copy; consecutive
        slots are copied as one slice."""
        run = _as_slice(slots) if len(slots) > 1 else None
        where = run if run is not None and run.step == 1 else slots
        with self._lock:
            payload = self._payload[where]
            if run is not None and run.step == 1:
                payload = payload.copy()
            cut.substitute(slots, payload, self._versions[where])
        return payload

    def read_payload_bytes_at(self, slots: np.ndarray, cut) -> bytes:
        """:meth:`read_payload_at` as bytes: consecutive slots no push changed since the cut (most of a
        snapshot's reads) copied once, straight from the table."""
        run = _as_slice(slots) if len(slots) > 1 else None
        if run is not None and run.step == 1:
            with self._lock:
                if cut.unchanged(self._versions[run]):
                    return self._payload[run].tobytes()
        return self.read_payload_at(slots, cut).tobytes()

    def read(self, slots: np.ndarray) -> RowsRead:
        """Payload, versions and ready flags of ``slots``, read atomically."""
        with self._lock:
            return RowsRead(self._payload[slots], self._versions[slots], self._ready[slots])

    def read_into(self, slots: np.ndarray, payload: np.ndarray, versions: np.ndarray, ready: np.ndarray) -> int:
        """Like :meth:`read`, into the caller's arrays (a frame of the fast rebuild's streams): one copy, straight
        from a strided view when the slots are evenly spaced.  Returns the count of rewrites outside pushes so far,
        for :meth:`reread_changed`."""
        run = _as_slice(slots)
        where = run if run is not None else slots
        with self._lock:
            payload[...] = self._payload[where]
            versions[...] = self._versions[where]
            ready[...] = self._ready[where]
            return self._rewrites

    def reread_changed(self, slots: np.ndarray, payload: np.ndarray, versions: np.ndarray, ready: np.ndarray,
                       rewrites: int) -> int:
        """Rows read earlier by :meth:`read_into` (which returned ``rewrites``) made what they are now: those whose
        version or ready flag changed since (a push stamps its own version on every row it writes; a rebuild's
        install makes a row ready) are read again, and all of them when rows were rewritten outside pushes
        meanwhile.  Returns how many were read again.  What this leaves is the rows as they were at the re-read
        (each unchanged since its copy, or read again then), at the cost of reading only what changed."""
        run = _as_slice(slots)
        where = run if run is not None else slots
        with self._lock:
            if rewrites != self._rewrites:
                payload[...] = self._payload[where]
                versions[...] = self._versions[where]
                ready[...] = self._ready[where]
                return len(slots)
            changed = np.flatnonzero((self._versions[where] != versions) | (self._ready[where] != (ready != 0)))
            if len(changed):
                again = slots[changed]
                payload[changed] = self._payload[again]
                versions[changed] = self._versions[again]
                ready[changed] = self._ready[again]
            return len(changed)

    def write_payload(self, slots: np.ndarray, payload: np.ndarray) -> None:
        """Rewrites rows outside any push (a checkpoint strategy's rollback): a snapshot's cut being written
        cannot keep their bytes, so it fails rather than mix states."""
        with self._lock:
            self._break_cuts("rows were rewritten (a rollback)")
            self._payload[slots] = payload

    def reset_to_initial(self) -> None:
        """Every owned row back to its initial value."""
        with self._lock:
            self._break_cuts("rows were reset to their initial values (a rollback)")
            fill_initial_payload(self.spec, self.owned_ids, self._floats, self.owned_slots)

    # --- rebuilding ------------------------------------------------------------------------------------------
    def mark_unready(self) -> None:
        """Every owned row is to be rebuilt (a promoted replacement)."""
        with self._lock:
            self._ready[:] = True
            self._ready[self.owned_slots] = False

    def unready(self, slots: np.ndarray) -> np.ndarray:
        """Those of ``slots`` not ready yet."""
        with self._lock:
            return slots[~self._ready[slots]]

    def is_ready(self, slots: np.ndarray) -> np.ndarray:
        """Whether each of ``slots`` is ready (a copy)."""
        with self._lock:
            return self._ready[slots]

    def unready_owned(self) -> np.ndarray:
        with self._lock:
            return self.owned_slots[~self._ready[self.owned_slots]]

    def install(self, slots: np.ndarray, payload: np.ndarray, versions: np.ndarray,
                mask: np.ndarray | None = None) -> int:
        """Writes rebuilt rows that are still not ready (and marked in ``mask``, when given) and marks them ready;
        returns how many.  Evenly spaced slots (the fast rebuild path) are written through one strided view; the
        few rows to keep (rebuilt on demand meanwhile, or not in ``mask``) are saved and put back."""
        run = _as_slice(slots)
        with self._lock:
            if run is not None:
                fresh = ~self._ready[run]
                if mask is not None:
                    fresh &= mask
                if fresh.all():
                    self._payload[run] = payload
                    self._versions[run] = versions
                    self._ready[run] = True
                    return len(slots)
                # a few rows to keep (rebuilt on demand, or not selected): write the whole run, then put them
                # back (a masked copy is byte by byte); under the lock, so nobody sees the run in between
                rows, row_versions = self._payload[run], self._versions[run]  # views
                keep = np.flatnonzero(~fresh)
                kept, kept_versions = rows[keep], row_versions[keep]
                rows[:] = payload
                row_versions[:] = versions
                rows[keep] = kept
                row_versions[keep] = kept_versions
                ready = self._ready[run]
                ready |= fresh
                return len(slots) - len(keep)
            if mask is not None:
                slots, payload, versions = slots[mask], payload[mask], versions[mask]
            fresh = ~self._ready[slots]
            sl = slots[fresh]
            self._payload[sl] = payload[fresh]
            self._versions[sl] = versions[fresh]
            self._ready[sl] = True
            return int(fresh.sum())


def _as_slice(slots: np.ndarray) -> slice | None:
    """``slots`` as a slice when they are evenly spaced and increasing (else None)."""
    if len(slots) < 2:
        return None
    step = int(slots[1] - slots[0])
    if step < 1 or int(slots[-1] - slots[0]) != step * (len(slots) - 1) or (np.diff(slots) != step).any():
        return None
    return slice(int(slots[0]), int(slots[-1]) + 1, step)


class DenseShard(_HoldsCuts):
    """One dense tensor held here: a single payload row ``[weights | optimizer state]`` (float32)."""

    def __init__(self, spec: DenseSpec, initial_value: np.ndarray):
        self.spec = spec
        self._lock = threading.Lock()
        self._floats = np.zeros((1, spec.numel * (1 + spec.state_width)), dtype=np.float32)
        self._floats[0, : spec.numel] = initial_value.reshape(-1)
        self._floats[0, spec.numel :] = np.float32(spec.initial_accumulator_value)
        self._bytes = self._floats.view(np.uint8).reshape(-1)
        self.version = 0
        self.ready = True
        self._pending: list[tuple[int, np.ndarray]] = []  # replica deltas that arrived while not ready
        self.delta_cpu_s = 0.0  # CPU of the deltas made here (a pass of numpy's after the optimizer's)
        self._cuts: dict = {}  # snapshot cuts being written (ecrec.server.cut.DenseCut), by holder

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def nbytes(self) -> int:
        return self._bytes.nbytes

    def apply_gradient(self, grad: np.ndarray, version: int,
                       keep_old: bool, delta: bool = False) -> tuple[np.ndarray | None, np.ndarray, int]:
        """Runs the optimizer (this server is the tensor's primary); returns ``(old, new)`` payload bytes (with
        ``delta``, ``old XOR new`` in place of ``old``) and the old version.  Raises ``InvalidRequest`` and
        changes nothing when the result would not be finite."""
        return self.commit(self.prepare_gradient(grad, keep_old or delta), version, delta)

    def prepare_gradient(self, grad: np.ndarray, keep_old: bool) -> PreparedDense:
        """The optimizer's result, on a copy (see :meth:`TableShard.prepare_gradients`)."""
        spec = self.spec
        floats, old = self._copy(keep_old)
        with np.errstate(over="ignore", invalid="ignore"):
            optim.apply(spec.optimizer, floats, grad[None, :], spec.numel, spec.lr, spec.eps)
        self._check_finite(floats)
        return PreparedDense(old, floats)

    def prepare_assignment(self, payload: np.ndarray, keep_old: bool) -> PreparedDense:
        """The whole payload replaced (weights then optimizer state, float32: a restore), on a copy."""
        floats, old = self._copy(keep_old)
        floats[0, :] = payload
        self._check_finite(floats)
        return PreparedDense(old, floats)

    def _copy(self, keep_old: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """A copy of the payload as floats to update, and of its bytes when ``keep_old``."""
        with self._lock:
            floats = self._floats.copy()
        return floats, (floats.view(np.uint8).reshape(-1).copy() if keep_old else None)

    def _check_finite(self, floats: np.ndarray) -> None:
        bad = int((~np.isfinite(floats)).sum())
        if bad:
            raise errors.InvalidRequest(
                f"dense tensor {self.spec.name!r}: the update would leave {bad} non-finite values in its weights or "
                "optimizer state: the gradient is too large for the optimizer; push refused, nothing applied")

    def commit(self, prepared: PreparedDense, version: int, delta: bool = False) -> tuple[np.ndarray | None, np.ndarray, int]:
        """Writes a prepared payload (the caller holds the server's apply lock); returns what
        :meth:`apply_gradient` returns."""
        old = prepared.old
        with self._lock:
            for cut in self._cuts.values():  # the first change since a snapshot's cut leaves the payload there
                if self.version <= cut.seq and cut.payload is None:
                    cut.payload = self._bytes.copy()
            self._floats[...] = prepared.floats
            old_version, self.version = self.version, version
        new = prepared.floats.view(np.uint8).reshape(-1)  # the prepared copy is the new payload: no other copy
        if delta:
            t0 = time.thread_time()
            np.bitwise_xor(old, new, out=old)
            self.delta_cpu_s += time.thread_time() - t0
        return old, new, old_version

    def assign_payload(self, payload: np.ndarray, version: int,
                       keep_old: bool, delta: bool = False) -> tuple[np.ndarray | None, np.ndarray, int]:
        """Replaces the whole payload (weights then optimizer state, float32): a restore; returns what
        :meth:`apply_gradient` returns."""
        return self.commit(self.prepare_assignment(payload, keep_old or delta), version, delta)

    def weights_bytes(self) -> bytes:
        with self._lock:
            return self._floats[0, : self.spec.numel].tobytes()

    def read(self) -> tuple[np.ndarray, int, bool]:
        """``(payload bytes copy, version, ready)``."""
        with self._lock:
            return self._bytes.copy(), self.version, self.ready

    def read_version(self) -> int:
        """The version alone (a push stamps its own on the tensor; a copy read earlier is current while it holds)."""
        with self._lock:
            return self.version

    def read_at(self, cut) -> np.ndarray:
        """The payload bytes as they were at a snapshot's cut (``ecrec.server.cut.DenseCut``)."""
        with self._lock:
            if cut.broken:
                raise errors.FailedPrecondition(f"{cut.broken} while the snapshot was written: take it again")
            if self.version <= cut.seq:
                return self._bytes.copy()
            if cut.payload is None:
                raise errors.FailedPrecondition(f"dense tensor {self.spec.name!r} changed since the snapshot's cut by "
                                                "other than a push: take the snapshot again")
            return cut.payload.copy()

    def write(self, payload: np.ndarray, version: int | None = None) -> None:
        with self._lock:
            self._break_cuts("the dense tensor was rewritten (a rollback)")
            self._bytes[:] = payload
            if version is not None:
                self.version = version

    # --- replication (deltas from the primary) -----------------------------------------------------------
    def apply_delta(self, delta: np.ndarray, seq: int) -> tuple[bool, int]:
        """XORs a replica delta newer than this copy (held back while not ready); returns
        ``(applied, previous version)``."""
        with self._lock:
            prev = self.version
            if self.ready and seq > self.version:
                np.bitwise_xor(self._bytes, delta, out=self._bytes)
                self.version = seq
                return True, prev
            if not self.ready:
                self._pending.append((seq, delta.copy()))
            return False, prev

    def undo_delta(self, delta: np.ndarray, seq: int, old_version: int) -> bool:
        """Cancels the delta of push ``seq`` if this copy holds it as its newest (XOR again, back to
        ``old_version``), or drops it while held back; returns whether the bytes changed.  Resolution undoes
        a suffix of pushes newest first, so a delta this copy holds is then always its newest."""
        with self._lock:
            if not self.ready:
                self._pending[:] = [p for p in self._pending if p[0] != seq]
                return False
            if self.version != seq:
                return False  # never applied here (or already undone)
            np.bitwise_xor(self._bytes, delta, out=self._bytes)
            self.version = old_version
            return True

    def mark_unready(self) -> None:
        with self._lock:
            self.ready = False
            self._pending.clear()

    def install(self, payload: np.ndarray, version: int) -> None:
        """Installs a replica's payload and then the held-back deltas newer than it; marks ready."""
        with self._lock:
            self._bytes[:] = payload
            self.version = version
            for seq, delta in self._pending:
                if seq > self.version:
                    np.bitwise_xor(self._bytes, delta, out=self._bytes)
                    self.version = seq
            self._pending.clear()
            self.ready = True
