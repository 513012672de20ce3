"""CPR-style checkpointing strategies on the ECRec embedding servers: ``full``, ``cpr``, ``cpr-mfu``, ``cpr-ssu``.

Each embedding server runs one of these strategies (``ecrec.strategies`` entry points);
checkpoints are real files under ``dir`` (a local directory or an fsspec URL, see
``baselines.storage``), one directory per server index.

``full`` (:class:`FullCheckpoint`)
    Every server saves its shard (rows with optimizer state) and its dense tensors when
    the worker-side driver (``baselines.driver.CheckpointDriver``) asks, at a step
    boundary, so all servers' checkpoints of one *cut* form a consistent global state.
    On a failure the replacement stays untouched (it refuses to save until restored),
    the driver restores the newest cut that is complete on every server, on every
    server, reloads the dense parameters into the worker and rewinds the worker's data
    position to the cut's step: the lost work is redone.

``cpr`` (:class:`PartialRecovery`)
    Each server saves its shard on its own timer (``timer_interval_s``).  Only a failed
    server's replacement loads that index's newest complete checkpoint (in
    ``on_recovery``); the others keep their state and training goes on.  The row updates
    the failed shard received after that save are lost; the driver counts them exactly.
    The failed server's dense tensors come back from its checkpoint, and the worker's
    ``CheckpointDriver`` then puts them back as they were before the failure from its own copy
    (``baselines.driver.DenseCopy``): in the CPR paper the dense model lives on the trainers, so a
    partial recovery loses embedding rows only.

``cpr-mfu`` (:class:`PartialRecoveryMFU`)
    Like ``cpr``; each server also counts updates per row, and between full saves a
    *partial save* every ``mfu_interval_s`` writes the ``mfu_fraction`` most frequently
    updated rows (those changed since they were last saved) as a delta on top of the
    newest full save.  Restore = base + deltas in order, so hot rows lose fewer updates.

``cpr-ssu`` (:class:`PartialRecoverySSU`)
    Like ``cpr-mfu`` but without per-row access counters: each table keeps a reservoir
    sample (Algorithm R, at most ``ssu_sample`` entries) of the row-update events since
    the last save; a partial save writes the sampled rows.  Sampling update events (not
    distinct rows) favours hot rows the way MFU's counters do.

Snapshot / persist (CheckFreq): a save copies each table's owned rows in memory under
that table's lock (the only time pushes wait), then a single background writer thread
writes the files, one checkpoint at a time.  A timer save finding the writer busy is
deferred, not dropped: the timer keeps it due and takes it at its first tick after the write
ends (``saves_deferred`` counts the deferrals), so the interval never falls below the persist
time; a commanded save (the driver's cuts) queues its snapshot
behind the running write (``saves_queued``) and stalls only when another snapshot is
already queued (``save_wait_s``: time the caller waited beyond the copy).  Before a reload
the files are dropped from the page cache (``Storage.drop_cache``), so o_load is a device read.  A failed write
is logged and reported in ``stats`` and in the next save's reply.

Exact loss accounting: every strategy keeps, per table, the number of row updates its
in-memory state reflects (``row_updates``: +1 per updated row per push).  A checkpoint
records it at snapshot time; partial variants also keep, per row, the updates since the
base snapshot (``since_full``), which a delta stores for each row it saves.  After a
restore the counter is ``base row_updates + sum over rows of the count in the last delta
holding the row``: exactly the updates the restored state reflects.  So at any step
boundary ``updates acknowledged to workers - sum of all servers' counters`` is exactly
the number of row updates lost; the driver computes it (workers know what was
acknowledged, see ``baselines.driver``).  The MFU/SSU per-row counts used for this are
accounting, not part of SSU's selection (which uses only its bounded sample).

Intervals (``baselines.overhead``): an explicit ``interval_s`` (or the driver's
``interval_steps``) overrides; otherwise ``full`` uses Daly's optimum from the measured
save cost and the user's ``mtbf_s`` (computed by the driver), and the partial variants
use ``2 * target_pls * num_servers * mtbf_s``.  With ``recovery=auto`` the driver
measures o_save/o_load on the running cluster and picks partial or full recovery by the
modelled overheads (``configure``; until then an ``auto`` server takes no timer saves, so
``auto`` needs the driver); full recovery of a ``cpr*`` strategy then works like ``full``.

Options (``--option key=value``; validated by :meth:`layout_params` on the coordinator):

========================  ====================================================================
``dir``                   checkpoint root: directory or fsspec URL (required)
``interval_s``            seconds between full saves (explicit; overrides the model)
``interval_steps``        steps between full saves, for driver-driven saves (explicit)
``mtbf_s``                mean time between failures of the job, for the model
``o_res_s``               reschedule cost per failure for the model (default 0)
``formula``               ``daly`` (default) or ``young`` for full recovery's optimum
``files``                 ``per-table`` (default: a file, an fsync and a directory fsync per table and dense
                          tensor) or ``one`` (every record in one data file, fsynced once, then the manifest)
``bandwidth_mb_s``        cap the store's bandwidth, MB/s each way (a remote store's, for benchmarks)
``keep``                  complete full checkpoints kept per server (default 2; >= 2 for full);
                          a driver cut at or after the newest cut the driver saw complete on
                          every server (``keep_cut``) is never deleted
``target_pls``            partial variants: target portion of lost updates, in (0, 1)
``recovery``              partial variants: ``partial`` | ``full`` | ``auto`` (default: auto
                          when ``mtbf_s`` and ``target_pls`` are given, else partial)
``mfu_fraction``          cpr-mfu: fraction of a shard's rows in a partial save (default 0.05)
``mfu_interval_s``        cpr-mfu: seconds between partial saves (default interval / 4)
``ssu_sample``            cpr-ssu: max entries of each table's sample (default 1024)
``ssu_interval_s``        cpr-ssu: seconds between partial saves (default interval / 4)
========================  ====================================================================

A checkpoint that cannot be used is refused with gRPC status DATA_LOSS (a file does not match
its manifest's size or sha256) or FAILED_PRECONDITION (torn: no manifest; missing; another
layout), naming the file; a ``Promote`` whose restore fails is refused the same way.

Commands (``StrategyCall``, JSON): ``save`` {kind, cut, step, wait, keep_cut} (its reply carries the
count of failed writes so far and the last error), ``flush``, ``restored_rows`` (what the last restore put
back, for a sample-weighted count of the lost updates),
``list``, ``restore`` {cut | seq}, ``probe_load``, ``configure`` {mode, interval_s},
``timers`` {paused} (pauses or resumes the timer saves keeping their phase: a benchmark that interleaves
strategies runs each one's timers only during its own slices; its reply gives the seconds to the next
full and partial save), ``stats`` (``redundancy_bytes``: the memory the mechanism needs, MFU's counter per row or
SSU's sample, nothing for ``full`` and ``cpr``; ``accounting_bytes``: the benchmark's loss accounting).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from baselines import overhead
from baselines.options import CheckpointOptions, _float, layout_params, parse_options
from baselines.storage import (
    CheckpointCorrupt,
    CheckpointError,
    DenseSnapshot,
    Snapshot,
    Storage,
    TableSnapshot,
    Throttled,
    latest_chain,
    load_checkpoint,
    read_manifest,
    scan,
    write_checkpoint,
)
from ecrec import errors
from ecrec.strategies.base import AppliedPush, FaultToleranceStrategy, StrategyHost

log = logging.getLogger("baselines.cpr")

WAIT_TIMEOUT_S = 25.0  # a commanded save/restore waits at most this for the writer (below the client's RPC timeout)
MAX_QUEUED = 1  # snapshots a commanded save may leave waiting behind the running write before it stalls


def _spec_dict(spec) -> dict:
    return {"num_rows": int(spec.num_rows), "dim": int(spec.dim), "optimizer": spec.optimizer, "row_bytes": int(spec.row_bytes)}


def _status(exc: CheckpointError) -> errors.EcrecError:
    """The error that answers a checkpoint that cannot be used: DATA_LOSS when corrupt, else FAILED_PRECONDITION."""
    cls = errors.DataLoss if isinstance(exc, CheckpointCorrupt) else errors.FailedPrecondition
    return cls(f"{type(exc).__name__}: {exc}")


# --- per-table accounting ------------------------------------------------------------------------------

class _TableAccount:
    """Counters of one table on this server (mutated under the table's lock)."""

    def __init__(self, shard, variant: str | None, sample_cap: int):
        n = shard.num_slots
        self.updates = 0  # row updates the in-memory state reflects
        self.slot_to_id = np.full(n, -1, dtype=np.int64)
        self.slot_to_id[shard.owned_slots] = shard.owned_ids
        self.since_full = np.zeros(n, dtype=np.int64) if variant else None  # updates since the base snapshot
        self.captured = np.zeros(n, dtype=np.int64) if variant else None  # since_full when the row was last saved
        self.freq = np.zeros(n, dtype=np.int64) if variant == "mfu" else None  # MFU access counters
        self.cap = sample_cap if variant == "ssu" else 0
        self.reservoir = np.zeros(self.cap, dtype=np.int64) if variant == "ssu" else None
        self.res_size = 0
        self.res_seen = 0
        self.res_max = 0

    @property
    def nbytes(self) -> int:
        """Memory the strategy's mechanism needs: MFU's counter per row, SSU's sample (the id map duplicates the
        shard's own, and ``since_full``/``captured`` serve the exact loss accounting, not the strategy)."""
        return int(sum(a.nbytes for a in (self.freq, self.reservoir) if a is not None))

    @property
    def accounting_nbytes(self) -> int:
        """Memory of the instrumentation: the id map and the per-row counts of the exact loss accounting."""
        return int(sum(a.nbytes for a in (self.slot_to_id, self.since_full, self.captured) if a is not None))

    def reset_capture(self) -> None:
        if self.since_full is not None:
            self.since_full.fill(0)
            self.captured.fill(0)

    def reset_sample(self) -> None:
        self.res_size = 0
        self.res_seen = 0

    def sample(self, slots: np.ndarray, rng: np.random.Generator) -> None:
        """Algorithm R over update events: every event seen since the reset is kept with equal probability."""
        cap = self.cap
        take = min(cap - self.res_size, len(slots))
        if take > 0:
            self.reservoir[self.res_size:self.res_size + take] = slots[:take]
            self.res_size += take
            self.res_seen += take
        rest = slots[take:]
        if rest.size:
            # event t (0-based, over all events since the reset) replaces entry j ~ U[0, t] when j < cap
            t = self.res_seen + np.arange(rest.size, dtype=np.int64)
            j = rng.integers(0, t + 1)
            keep = j < cap
            self.reservoir[j[keep]] = rest[keep]
            self.res_seen += rest.size
        self.res_max = max(self.res_max, self.res_size)


# --- the strategies --------------------------------------------------------------------------------------

class _CheckpointStrategy(FaultToleranceStrategy):
    """Shared machinery: snapshot/persist, restore, accounting, commands. See the module docstring."""

    variant: str | None = None  # None | "mfu" | "ssu"
    full_only = False  # FullCheckpoint: recovery is always a global rollback

    @classmethod
    def options_from(cls, options: dict) -> CheckpointOptions:
        """Typed options from strings (the spec's parser: ``baselines.options``)."""
        return parse_options(cls.name, cls.variant, cls.full_only, options)

    @classmethod
    def layout_params(cls, num_servers: int, k: int, m: int, options: dict) -> tuple[int, int, dict]:
        return layout_params(cls.name, cls.variant, cls.full_only, num_servers, k, m, options)

    def __init__(self, host: StrategyHost, options: CheckpointOptions):
        super().__init__(host, options)
        self.opts = options
        self.storage = Storage.open(self.opts.dir)
        if self.opts.bandwidth_mb_s is not None:
            self.storage = Throttled(self.storage, self.opts.bandwidth_mb_s * 1e6)
        # "partial" | "full"; None with recovery=auto until the driver's ``configure`` (no timer saves till then)
        self.mode: str | None = "full" if self.full_only else {"full": "full", "partial": "partial"}.get(self.opts.recovery)
        self._interval_override: float | None = None
        self._lock = threading.RLock()  # serialises snapshots, restores and configuration
        self._stats_lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ecrec-ckpt-writer")
        self._pending: list[Future] = []  # writes submitted and not finished, oldest first
        self._acct: dict[str, _TableAccount] = {}
        self._rng = np.random.default_rng()
        self._next_seq: int | None = None
        self._next_delta: dict[int, int] = {}
        self._base_seq: int | None = None  # seq of the newest full snapshot taken or restored
        self._next_full_at: float | None = None
        # row updates at the last snapshot (taken with pushes paused): the timer skips a shard with nothing new
        # since (counted before the snapshot instead, pushes landing in between made the next save empty), or
        # nothing at all yet (its initial values are known; the first save is the driver's cut, not a race with it)
        self._updates_at_snapshot = 0
        self._next_partial_at: float | None = None
        self._paused_at: float | None = None  # ``timers`` {paused: true}: when the timer saves were paused
        self.needs_restore = False
        self._deferring = False  # a timer save is waiting for the running write (counted once in saves_deferred)
        # what the last restore put back: per table the base's update counter, and the rows its deltas held with
        # the updates since the base each reflects (``restored_rows``: a sample-weighted loss count needs them)
        self._restored_base: dict[str, int] = {}
        self._restored_rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._s = {
            "saves": 0, "partial_saves": 0, "saves_skipped": 0, "saves_deferred": 0, "saves_queued": 0,
            "save_wait_s": 0.0,
            "bytes_written": 0, "snapshot_s_total": 0.0, "snapshot_s_last": 0.0, "persist_s_total": 0.0,
            "persist_s_last": 0.0, "rows_saved_full": 0, "rows_saved_partial": 0, "loads": 0, "load_s_last": 0.0,
            "load_bytes_last": 0, "restored": None, "write_errors": 0, "last_error": None, "incomplete_skipped": [],
            "last_seq": None, "last_committed_seq": None, "last_committed_cut": None, "pruned": 0,
        }

    # --- intervals ---------------------------------------------------------------------------------------
    def full_interval_s(self) -> float | None:
        """Seconds between timer-driven full saves (None: saves are driven by the worker)."""
        if self._interval_override is not None:
            return self._interval_override
        if self.opts.interval_s is not None:
            return self.opts.interval_s
        m = self.host.cluster_map
        if self.opts.target_pls is not None and self.opts.mtbf_s is not None and m is not None:
            return overhead.interval_for_pls(self.opts.target_pls, m.num_servers, self.opts.mtbf_s)
        return None

    def partial_interval_s(self) -> float | None:
        if self.variant is None:
            return None
        explicit = self.opts.mfu_interval_s if self.variant == "mfu" else self.opts.ssu_interval_s
        if explicit is not None:
            return explicit
        full = self.full_interval_s()
        return None if full is None else full / 4.0

    @property
    def timer_interval_s(self) -> float | None:  # read by the server's timer loop at every tick
        if self.mode != "partial" or self.host.index < 0:
            return None
        intervals = [x for x in (self.full_interval_s(), self.partial_interval_s()) if x is not None]
        if not intervals:
            return None
        return min(max(min(intervals) / 4.0, 0.02), 1.0)

    # --- hooks ---------------------------------------------------------------------------------------------
    def _account(self, shard) -> _TableAccount:
        acct = self._acct.get(shard.spec.name)
        if acct is None:
            acct = self._acct[shard.spec.name] = _TableAccount(shard, self.variant, self.opts.ssu_sample)
        return acct

    def on_table_created(self, shard) -> None:
        self._account(shard)

    def on_push(self, push: AppliedPush):
        for update in push.tables:  # under the server's apply lock: snapshots see counters and rows agree
            slots = update.slots
            acct = self._acct.get(update.shard.spec.name) or self._account(update.shard)
            acct.updates += len(slots)
            if acct.since_full is not None:
                acct.since_full[slots] += 1  # slots are unique: the server coalesced the push
            if acct.freq is not None:
                acct.freq[slots] += 1
            if acct.reservoir is not None:
                acct.sample(np.asarray(slots, dtype=np.int64), self._rng)
        return None

    def on_timer(self) -> None:
        full = self.full_interval_s()
        if self.mode != "partial" or full is None or self._paused_at is not None:
            return
        now = time.monotonic()
        partial = self.partial_interval_s()
        if self._next_full_at is None:
            self._next_full_at = now + full
            self._next_partial_at = now + partial if partial else None
            return
        if now >= self._next_full_at:
            kind = "full"
        elif self._next_partial_at is not None and now >= self._next_partial_at:
            kind = "partial"
        else:
            return
        tables = self.host.tables()
        updates = sum(shard.row_updates for shard in tables)
        if (tables or self.host.dense_tensors()) and updates != self._updates_at_snapshot:
            # an idle shard has nothing new: no save.  While the previous write still runs the save stays due
            # (the timer is not moved on) and is taken at the first tick after that write ends
            if self.save(kind=kind, blocking=False, defer=True).get("deferred"):
                return
        if kind == "full":
            self._next_full_at = now + full
        if partial:
            self._next_partial_at = now + partial

    def on_recovery(self, failed_index: int) -> None:
        self._next_full_at = None
        if self.mode == "full":  # (with recovery=auto a replacement restores as for partial; the driver may roll back)
            # a global rollback (the driver's restore) follows; saving this fresh state would poison a cut
            self.needs_restore = True
            log.warning("replaced index %d: waiting for the worker-driven rollback (restore) before any save", failed_index)
            return
        try:
            info = self.restore()
        except CheckpointError as exc:
            log.error("replaced index %d: %s", failed_index, exc)
            raise _status(exc) from None
        if info.get("seq") is None:
            log.warning("replaced index %d: no checkpoint in %s; the shard starts from initial values",
                        failed_index, self.storage.describe(f"server-{failed_index}"))
        else:
            log.info("replaced index %d: restored checkpoint seq %s (+%d deltas) in %.3f s", failed_index,
                     info["seq"], len(info["deltas"]), info["load_s"])

    def call(self, command: str, args: dict) -> dict:
        handlers = {
            "save": self._cmd_save, "flush": self._cmd_flush, "list": self._cmd_list, "restore": self._cmd_restore,
            "probe_load": self._cmd_probe_load, "configure": self._cmd_configure, "timers": self._cmd_timers,
            "stats": lambda a: self.stats(), "restored_rows": self._cmd_restored_rows,
        }
        h = handlers.get(command)
        if h is None:
            raise ValueError(f"strategy {self.name!r} has no command {command!r}; commands: {sorted(handlers)}")
        try:
            return h(args)
        except CheckpointError as exc:
            raise _status(exc) from None

    def close(self) -> None:
        for pending in list(self._pending):
            try:
                pending.result(timeout=WAIT_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - already logged and counted by the writer
                pass
        self._writer.shutdown(wait=False, cancel_futures=True)

    # --- saving ----------------------------------------------------------------------------------------------
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
        snap = Snapshot(index, seq, "full", self.name, cut=cut, step=step, wall_time=time.time())
        for name, shard in self._tables():
            acct = self._account(shard)
            payload = shard.read_payload(shard.owned_slots)  # a copy (fancy indexing)
            updates = acct.updates
            acct.reset_capture()
            if acct.reservoir is not None:
                acct.reset_sample()
            snap.tables.append(TableSnapshot(name, _spec_dict(shard.spec), shard.owned_ids, payload, updates))
        for name, d in self._dense():
            snap.dense.append(DenseSnapshot(name, d.read()[0].view(np.float32)))
        self._base_seq = seq
        return snap

    def _select(self, acct: _TableAccount, shard) -> np.ndarray:
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
                        wall_time=time.time())
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
            snap.tables.append(TableSnapshot(name, _spec_dict(shard.spec), acct.slot_to_id[slots], payload,
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

    # --- restoring ---------------------------------------------------------------------------------------------
    def _find(self, index: int, cut: int | None, seq: int | None):
        entries = scan(self.storage, index)
        if cut is not None:
            for e in reversed(entries):
                if e.delta is None and e.complete and read_manifest(self.storage, e.dirname).get("cut") == cut:
                    return e, [], []
            raise CheckpointError(f"server {index} has no complete checkpoint of cut {cut} in "
                                  f"{self.storage.describe(f'server-{index}')}")
        if seq is not None:
            base = next((e for e in entries if e.seq == seq and e.delta is None), None)
            if base is None:
                raise CheckpointError(f"server {index} has no checkpoint seq {seq}")
            read_manifest(self.storage, base.dirname)  # raises if torn
            deltas = [e for e in entries if e.seq == seq and e.delta is not None and e.complete]
            return base, deltas, [e for e in entries if e.seq == seq and e.delta is not None and not e.complete]
        return latest_chain(self.storage, index)

    def restore(self, cut: int | None = None, seq: int | None = None) -> dict:
        """Loads (and verifies) a checkpoint into this server's tables and dense tensors."""
        index = self._index()
        with self._lock:
            self._wait_pending()
            base, deltas, skipped = self._find(index, cut, seq)
            if skipped:
                names = [e.dirname for e in skipped]
                log.warning("skipping incomplete (torn) checkpoints %s", names)
                with self._stats_lock:
                    self._s["incomplete_skipped"] = names
            if base is None:
                self.needs_restore = False
                return {"seq": None, "deltas": [], "load_s": 0.0, "skipped": [e.dirname for e in skipped]}
            t0 = time.perf_counter()
            loaded = [load_checkpoint(self.storage, base.dirname)] + [load_checkpoint(self.storage, d.dirname) for d in deltas]
            with self.host.pushes_paused():
                self._apply(index, loaded)
            load_s = time.perf_counter() - t0
            manifest = loaded[0].manifest
            self._base_seq = base.seq
            self._next_seq = max((e.seq for e in scan(self.storage, index)), default=0) + 1
            self._next_delta.pop(base.seq, None)
            self._next_full_at = None
            self.needs_restore = False
            info = {
                "seq": base.seq, "cut": manifest.get("cut"), "step": manifest.get("step"),
                "deltas": [d.delta for d in deltas], "skipped": [e.dirname for e in skipped], "load_s": load_s,
                "bytes": sum(x.bytes_read for x in loaded),
                "row_updates": {name: a.updates for name, a in self._acct.items()},
            }
            with self._stats_lock:
                self._s["loads"] += 1
                self._s["load_s_last"] = load_s
                self._s["load_bytes_last"] = info["bytes"]
                self._s["restored"] = info
            return info

    def _apply(self, index: int, loaded) -> None:
        """Checks every table of every checkpoint against this server, then writes base + deltas in order."""
        layout = self.host.layout
        plans = {}  # table -> [(slots, payload, counts, row_updates)] base first
        for n, ck in enumerate(loaded):
            for name, t in ck.tables.items():
                shard = dict(self._tables()).get(name)
                if shard is None:
                    raise CheckpointError(f"{self.storage.describe(ck.dirname)} holds table {name!r}, unknown on this server")
                if t.spec != _spec_dict(shard.spec):
                    raise CheckpointError(f"{self.storage.describe(ck.dirname)}: table {name!r} was saved as {t.spec}, "
                                          f"the live table is {_spec_dict(shard.spec)}")
                servers, slots = layout.locate(t.ids)
                if len(t.ids) and (servers != index).any():
                    raise CheckpointError(f"{self.storage.describe(ck.dirname)}: table {name!r} holds rows not owned by "
                                          f"server {index} (saved under another layout)")
                if n == 0 and len(t.ids) != len(shard.owned_ids):
                    raise CheckpointError(f"{self.storage.describe(ck.dirname)}: table {name!r} has {len(t.ids)} rows, "
                                          f"server {index} owns {len(shard.owned_ids)}")
                if n > 0 and name not in plans:
                    raise CheckpointError(f"{self.storage.describe(ck.dirname)}: delta of table {name!r} has no base")
                plans.setdefault(name, []).append((slots, t.payload, t.counts, t.row_updates))
        for d_name, floats in loaded[0].dense.items():
            d = dict(self._dense()).get(d_name)
            if d is None or d.nbytes != floats.nbytes:
                raise CheckpointError(f"{self.storage.describe(loaded[0].dirname)}: dense tensor {d_name!r} does not "
                                      "match this server's")
        self._restored_rows, self._restored_base = {}, {}
        for name, shard in self._tables():
            acct = self._account(shard)
            acct.reset_capture()
            if acct.reservoir is not None:
                acct.reset_sample()
            steps = plans.get(name)
            if steps is None:  # created after the checkpoint: back to its initial values
                shard.reset_to_initial()
                acct.updates = 0
                continue
            for i, (slots, payload, counts, row_updates) in enumerate(steps):
                shard.write_payload(slots, payload)
                if i == 0:
                    acct.updates = row_updates
                elif acct.since_full is not None and counts is not None:
                    acct.since_full[slots] = counts
                    acct.captured[slots] = counts
            if acct.since_full is not None:
                acct.updates += int(acct.since_full.sum())
                saved = np.flatnonzero(acct.since_full)
                self._restored_rows[name] = (acct.slot_to_id[saved], acct.since_full[saved].copy())
            self._restored_base[name] = int(steps[0][3])
        dense = dict(self._dense())
        for d_name, floats in loaded[0].dense.items():
            dense[d_name].write(np.ascontiguousarray(floats, dtype=np.float32).view(np.uint8).reshape(-1))

    # --- commands ------------------------------------------------------------------------------------------------
    @staticmethod
    def _opt_int(args: dict, key: str) -> int | None:
        v = args.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"argument {key!r} must be an integer, got {v!r}")
        return v

    def _cmd_save(self, args: dict) -> dict:
        unknown = set(args) - {"kind", "cut", "step", "wait", "keep_cut"}
        if unknown:
            raise ValueError(f"save: unknown arguments {sorted(unknown)}")
        return self.save(kind=args.get("kind", "full"), cut=self._opt_int(args, "cut"), step=self._opt_int(args, "step"),
                         wait=bool(args.get("wait", False)), keep_cut=self._opt_int(args, "keep_cut"))

    def _cmd_flush(self, args: dict) -> dict:
        with self._lock:
            waited = self._wait_pending()
        with self._stats_lock:
            return {"waited_s": waited, "last_committed_seq": self._s["last_committed_seq"],
                    "last_committed_cut": self._s["last_committed_cut"], "last_error": self._s["last_error"]}

    def _cmd_list(self, args: dict) -> dict:
        index = self._index()
        complete, incomplete, cuts = [], [], []
        for e in scan(self.storage, index):
            if not e.complete:
                incomplete.append(e.dirname)
                continue
            if e.delta is None:
                m = read_manifest(self.storage, e.dirname)
                complete.append({"seq": e.seq, "cut": m.get("cut"), "step": m.get("step")})
                if m.get("cut") is not None:
                    cuts.append(m["cut"])
            else:
                complete.append({"seq": e.seq, "delta": e.delta})
        return {"complete": complete, "incomplete": incomplete, "cuts": sorted(cuts)}

    def _cmd_restore(self, args: dict) -> dict:
        unknown = set(args) - {"cut", "seq"}
        if unknown:
            raise ValueError(f"restore: unknown arguments {sorted(unknown)}")
        return self.restore(cut=self._opt_int(args, "cut"), seq=self._opt_int(args, "seq"))

    def _cmd_probe_load(self, args: dict) -> dict:
        """Reads and verifies the newest checkpoint without applying it: measures o_load."""
        index = self._index()
        with self._lock:
            self._wait_pending()
        base, deltas, _ = latest_chain(self.storage, index)
        if base is None:
            return {"seq": None, "load_s": 0.0, "bytes": 0}
        t0 = time.perf_counter()
        nbytes = sum(load_checkpoint(self.storage, e.dirname).bytes_read for e in [base, *deltas])
        return {"seq": base.seq, "load_s": time.perf_counter() - t0, "bytes": nbytes}

    def _cmd_restored_rows(self, args: dict) -> dict:
        """What the last restore put back: per table the base checkpoint's update counter and the rows its deltas
        held, with the updates since the base each reflects (global ids and counts as lists)."""
        if args:
            raise ValueError(f"restored_rows: takes no arguments, got {sorted(args)}")
        with self._lock:
            return {"base_row_updates": dict(self._restored_base),
                    "rows": {name: {"ids": ids.tolist(), "counts": counts.tolist()}
                             for name, (ids, counts) in self._restored_rows.items()}}

    def _cmd_configure(self, args: dict) -> dict:
        unknown = set(args) - {"mode", "interval_s"}
        if unknown:
            raise ValueError(f"configure: unknown arguments {sorted(unknown)}")
        with self._lock:
            mode = args.get("mode", self.mode)
            if mode not in ("partial", "full"):
                raise ValueError(f"configure: mode must be 'partial' or 'full', got {mode!r}")
            if self.full_only and mode != "full":
                raise ValueError(f"strategy {self.name!r} only does full recovery")
            if "interval_s" in args:
                v = args["interval_s"]
                self._interval_override = None if v is None else _float("interval_s", v)
            self.mode = mode
            self._next_full_at = None
        return {"mode": self.mode, "interval_s": self.full_interval_s(), "partial_interval_s": self.partial_interval_s()}

    def _cmd_timers(self, args: dict) -> dict:
        """Pauses (``paused: true``) or resumes the timer saves without losing their phase; reports the timers.

        Pausing waits for the writes already started (``waited_s``), so their work ends before the caller
        goes on.
        Resuming moves the next full and partial save later by the time spent paused.
        """
        unknown = set(args) - {"paused"}
        if unknown:
            raise ValueError(f"timers: unknown arguments {sorted(unknown)}")
        paused = args.get("paused")
        if paused is not None and not isinstance(paused, bool):
            raise ValueError(f"timers: paused must be true or false, got {paused!r}")
        waited = 0.0
        with self._lock:
            now = time.monotonic()
            if paused is True and self._paused_at is None:
                self._paused_at = now
                waited = self._wait_pending()
            elif paused is False and self._paused_at is not None:
                shift = now - self._paused_at
                self._paused_at = None
                if self._next_full_at is not None:
                    self._next_full_at += shift
                if self._next_partial_at is not None:
                    self._next_partial_at += shift
            at = self._paused_at if self._paused_at is not None else time.monotonic()
            return {"paused": self._paused_at is not None, "waited_s": waited,
                    "next_full_in_s": None if self._next_full_at is None else self._next_full_at - at,
                    "next_partial_in_s": None if self._next_partial_at is None else self._next_partial_at - at,
                    "interval_s": self.full_interval_s(), "partial_interval_s": self.partial_interval_s()}

    def stats(self) -> dict:
        with self._stats_lock:
            out = dict(self._s)
        out.update(
            strategy=self.name, index=self.host.index, mode=self.mode, needs_restore=self.needs_restore,
            dir=self.storage.url, interval_s=self.full_interval_s(), partial_interval_s=self.partial_interval_s(),
            writing=sum(1 for f in list(self._pending) if not f.done()),
            row_updates={name: a.updates for name, a in self._acct.items()},
        )
        out["row_updates_total"] = sum(out["row_updates"].values())
        out["redundancy_bytes"] = sum(a.nbytes for a in list(self._acct.values()))  # the mechanism's memory only
        out["accounting_bytes"] = sum(a.accounting_nbytes for a in list(self._acct.values()))
        if self.variant == "ssu":
            out["ssu_sample_cap"] = self.opts.ssu_sample
            out["ssu_sample_max"] = max((a.res_max for a in self._acct.values()), default=0)
        if self.variant == "mfu":
            out["mfu_fraction"] = self.opts.mfu_fraction
        return out


class FullCheckpoint(_CheckpointStrategy):
    """``full``: periodic checkpoints at worker-driven consistent cuts; every server rolls back on a failure."""

    name = "full"
    full_only = True


class PartialRecovery(_CheckpointStrategy):
    """``cpr``: only the failed shard reloads its last checkpoint; lost updates are counted."""

    name = "cpr"


class PartialRecoveryMFU(_CheckpointStrategy):
    """``cpr-mfu``: ``cpr`` plus partial saves of the most frequently updated rows."""

    name = "cpr-mfu"
    variant = "mfu"


class PartialRecoverySSU(_CheckpointStrategy):
    """``cpr-ssu``: ``cpr`` plus partial saves of a bounded random sample of updated rows."""

    name = "cpr-ssu"
    variant = "ssu"
