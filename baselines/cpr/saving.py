"""Saving a checkpoint (CheckFreq's snapshot/persist): a copy of each table's owned rows in memory with pushes
paused, then one background writer thread that writes it, one checkpoint at a time, and prunes old ones.

Part of the checkpointing strategies (``baselines.cpr``): :class:`CheckpointSaving` holds the methods, its state
(the writer, the pending writes, the next sequence numbers, the stats) lives on the strategy, set up in
:class:`baselines.cpr.strategy._CheckpointStrategy`'s ``__init__``.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future

import numpy as np

from baselines.cpr.account import TableAccount
from baselines.storage import DenseSnapshot, Snapshot, TableSnapshot, read_manifest, scan, write_checkpoint
from ecrec import errors

log = logging.getLogger("baselines.cpr")

WAIT_TIMEOUT_S = 25.0  # a commanded save/restore waits at most this for the writer (below the client's RPC timeout)
MAX_QUEUED = 1  # snapshots a commanded save may leave waiting behind the running write before it stalls


def spec_dict(spec) -> dict:
    """What a checkpoint records of a table's spec (a restore checks it against the live table's)."""
    return {"num_rows": int(spec.num_rows), "dim": int(spec.dim), "optimizer": spec.optimizer, "row_bytes": int(spec.row_bytes)}


class CheckpointSaving:
    """Snapshot, persist and prune (see the module docstring)."""

    def _index(self) -> int:
        index = self.host.index
        if index < 0:
            raise errors.FailedPrecondition("this server holds no index yet (standby)")
        return index

    def _alloc_seq(self) -> int:
        if self._next_seq is None:
            entries = scan(self.storage, self._index())
            self._next_seq = max((e.seq for e in entries), default=0) + 1
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _alloc_delta(self, base: int) -> int:
        if base not in self._next_delta:
            entries = scan(self.storage, self._index())
            self._next_delta[base] = max((e.delta for e in entries if e.seq == base and e.delta is not None), default=0) + 1
        k = self._next_delta[base]
        self._next_delta[base] = k + 1
        return k

    def _outstanding(self) -> list[Future]:
        self._pending = [f for f in self._pending if not f.done()]
        return self._pending

    def _wait_pending(self, keep: int = 0) -> float:
        """Waits until at most ``keep`` writes are outstanding; returns the seconds waited.

        A write error is not raised here: ``_persist`` recorded and logged it, and replies report it.
        """
        t0 = time.perf_counter()
        waited = False
        while len(self._outstanding()) > keep:
            waited = True
            try:
                self._pending[0].result(timeout=WAIT_TIMEOUT_S)
            except TimeoutError:
                raise errors.DeadlineExceeded(f"a checkpoint write is still running after {WAIT_TIMEOUT_S:.0f} s") from None
            except Exception:  # noqa: BLE001 - recorded in stats by _persist and reported in replies
                pass
        return time.perf_counter() - t0 if waited else 0.0

    def save(self, kind: str = "full", cut: int | None = None, step: int | None = None, wait: bool = False,
             blocking: bool = True, keep_cut: int | None = None, defer: bool = False) -> dict:
        """Snapshot now (under each table's lock), persist in the background; see the module docstring.

        ``defer`` (the timer's saves): when a write still runs, answer ``{"deferred": True}`` and save nothing;
        the caller keeps the save due (``saves_deferred`` counts each save deferred once, not each retry)."""
        index = self._index()
        if self.needs_restore:
            raise errors.FailedPrecondition(
                f"server {index} replaced a failed server and was not rolled back yet: restore a "
                "checkpoint cut first (CheckpointDriver does this on a failure)")
        if kind not in ("full", "partial"):
            raise ValueError(f"save kind must be 'full' or 'partial', got {kind!r}")
        if kind == "partial" and self.variant is None:
            raise ValueError(f"strategy {self.name!r} has no partial saves (use cpr-mfu or cpr-ssu)")
        with self._lock:
            waited = 0.0
            if self._outstanding() and defer:
                if not self._deferring:
                    self._deferring = True
                    with self._stats_lock:
                        self._s["saves_deferred"] += 1
                return {"skipped": False, "deferred": True}
            self._deferring = False
            if self._outstanding():
                if not blocking:
                    with self._stats_lock:
                        self._s["saves_skipped"] += 1
                    log.info("checkpoint %s save skipped: the previous write is still running", kind)
                    return {"skipped": True}
                # queue behind the running write (its snapshot is already in memory); stall only when
                # MAX_QUEUED snapshots are already waiting for the writer
                waited = self._wait_pending(keep=MAX_QUEUED)
                with self._stats_lock:
                    self._s["saves_queued"] += 1
                    self._s["save_wait_s"] += waited
            with self._stats_lock:
                write_errors, last_error = self._s["write_errors"], self._s["last_error"]
            if kind == "partial" and self._base_seq is None:
                kind = "full"  # nothing to build a delta on yet
            t0 = time.perf_counter()
            with self.host.pushes_paused():  # rows and update counters from one instant
                snap = self._snapshot_full(index, cut, step) if kind == "full" else self._snapshot_delta(index, cut, step)
                self._updates_at_snapshot = sum(shard.row_updates for shard in self.host.tables())
            snap.snapshot_s = time.perf_counter() - t0
            rows = sum(len(t.ids) for t in snap.tables)
            with self._stats_lock:
                self._s["saves" if kind == "full" else "partial_saves"] += 1
                self._s["rows_saved_full" if kind == "full" else "rows_saved_partial"] += rows
                self._s["snapshot_s_total"] += snap.snapshot_s
                self._s["snapshot_s_last"] = snap.snapshot_s
                self._s["last_seq"] = snap.seq
                last_cut = self._s["last_committed_cut"]
            pending = self._writer.submit(self._persist, snap, keep_cut)
            self._pending.append(pending)
        reply = {"skipped": False, "kind": kind, "seq": snap.seq, "delta": snap.delta, "cut": cut, "rows": rows,
                 "snapshot_s": snap.snapshot_s, "wait_s": waited, "last_committed_cut": last_cut,
                 "write_errors": write_errors, "last_error": last_error}
        if wait:
            manifest = pending.result(timeout=WAIT_TIMEOUT_S)
            reply.update(bytes=manifest["bytes"], persist_s=manifest["persist_s"], last_committed_cut=cut)
        return reply

    def _tables(self) -> list:
        return [(shard.spec.name, shard) for shard in self.host.tables()]

    def _dense(self) -> list:
        return [(d.spec.name, d) for d in self.host.dense_tensors()]

    def _snapshot_full(self, index: int, cut, step) -> Snapshot:
        seq = self._alloc_seq()
        snap = Snapshot(index, seq, "full", self.name, cut=cut, step=step, wall_time=time.time(),
                        cluster=self.host.cluster_id)
        for name, shard in self._tables():
            acct = self._account(shard)
            payload = shard.read_payload(shard.owned_slots)  # a copy (fancy indexing)
            updates = acct.updates
            acct.reset_capture()
            if acct.reservoir is not None:
                acct.reset_sample()
            snap.tables.append(TableSnapshot(name, spec_dict(shard.spec), shard.owned_ids, payload, updates))
        for name, d in self._dense():
            snap.dense.append(DenseSnapshot(name, d.read()[0].view(np.float32)))
        self._base_seq = seq
        return snap

    def _select(self, acct: TableAccount, shard) -> np.ndarray:
        """Slots a partial save considers (before dropping rows unchanged since their last save)."""
        if self.variant == "mfu":
            owned = shard.owned_slots
            freq = acct.freq[owned]
            hot = owned[freq > 0]
            k = max(1, math.ceil(self.opts.mfu_fraction * len(owned)))
            if len(hot) > k:
                f = acct.freq[hot]
                hot = hot[np.argpartition(-f, k - 1)[:k]]
            return hot
        return np.empty(0, dtype=np.int64)  # ssu: read under the lock (the sample changes with every push)

    def _snapshot_delta(self, index: int, cut, step) -> Snapshot:
        base = self._base_seq
        snap = Snapshot(index, base, "delta", self.name, delta=self._alloc_delta(base), cut=cut, step=step,
                        wall_time=time.time(), cluster=self.host.cluster_id)
        for name, shard in self._tables():
            acct = self._account(shard)
            candidates = self._select(acct, shard)
            if self.variant == "ssu":
                candidates = np.unique(acct.reservoir[:acct.res_size])
                acct.reset_sample()
            slots = candidates[acct.since_full[candidates] > acct.captured[candidates]]
            slots = np.sort(slots)
            payload = shard.read_payload(slots)
            counts = acct.since_full[slots].copy()
            acct.captured[slots] = counts
            snap.tables.append(TableSnapshot(name, spec_dict(shard.spec), acct.slot_to_id[slots], payload,
                                             acct.updates, counts))
        return snap

    def _persist(self, snap: Snapshot, keep_cut: int | None) -> dict:
        t0 = time.perf_counter()
        try:
            manifest = write_checkpoint(self.storage, snap, packed=self.opts.files == "one")
        except Exception as exc:
            with self._stats_lock:
                self._s["write_errors"] += 1
                self._s["last_error"] = f"writing {self.storage.describe(snap.dirname)}: {type(exc).__name__}: {exc}"
            log.exception("checkpoint write of %s failed", self.storage.describe(snap.dirname))
            raise
        persist_s = time.perf_counter() - t0
        manifest["persist_s"] = persist_s
        with self._stats_lock:
            self._s["bytes_written"] += manifest["bytes"]
            self._s["persist_s_total"] += persist_s
            self._s["persist_s_last"] = persist_s
            self._s["last_committed_seq"] = snap.seq
            if snap.cut is not None:
                self._s["last_committed_cut"] = snap.cut
        if snap.kind == "full":
            try:
                self._prune(snap.server_index, keep_cut)
            except Exception as exc:  # noqa: BLE001 - reported: old checkpoints stay, nothing is lost
                with self._stats_lock:
                    self._s["last_error"] = f"pruning old checkpoints: {type(exc).__name__}: {exc}"
                log.exception("pruning old checkpoints failed")
        return manifest

    def _prune(self, index: int, keep_cut: int | None) -> None:
        """Deletes full checkpoints (with their deltas) beyond the newest ``keep``, never a cut >= ``keep_cut``,
        and torn directories older than the newest complete checkpoint."""
        entries = scan(self.storage, index)
        fulls = [e for e in entries if e.delta is None and e.complete]
        if not fulls:
            return
        newest = fulls[-1].seq
        doomed = set()
        for e in fulls[:-self.opts.keep]:
            cut = read_manifest(self.storage, e.dirname).get("cut")
            if cut is not None and (keep_cut is None or cut >= keep_cut):
                continue
            doomed.add(e.seq)
        removed = 0
        for e in entries:
            if e.seq in doomed or (not e.complete and e.seq < newest):
                self.storage.remove_tree(e.dirname)
                removed += 1
        with self._stats_lock:
            self._s["pruned"] += removed
