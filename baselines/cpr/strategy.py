"""The checkpointing strategies themselves: ``full``, ``cpr``, ``cpr-mfu``, ``cpr-ssu`` (``baselines.cpr`` says what
each does), their set-up, intervals and the server's hooks (a push, the timer, a recovery).  Saving, restoring and
the commands are mixed in from ``baselines.cpr.saving``, ``.restoring`` and ``.commands``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from baselines import overhead
from baselines.cpr.account import TableAccount
from baselines.cpr.commands import CheckpointCommands
from baselines.cpr.restoring import CheckpointRestoring, refusal
from baselines.cpr.saving import WAIT_TIMEOUT_S, CheckpointSaving
from baselines.options import CheckpointOptions, layout_params, parse_options
from baselines.storage import CheckpointError, Storage, Throttled
from ecrec.strategies.base import AppliedPush, FaultToleranceStrategy, StrategyHost

log = logging.getLogger("baselines.cpr")


class _CheckpointStrategy(CheckpointCommands, CheckpointRestoring, CheckpointSaving, FaultToleranceStrategy):
    """What the four strategies share: set-up, intervals and the hooks here; saving, restoring and the commands
    mixed in (one object: they share the writer, the locks, the counters and the stats). See ``baselines.cpr``."""

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
        self._acct: dict[str, TableAccount] = {}
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
            "corrupt_skipped": [], "last_seq": None, "last_committed_seq": None, "last_committed_cut": None, "pruned": 0,
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
    def _account(self, shard) -> TableAccount:
        acct = self._acct.get(shard.spec.name)
        if acct is None:
            acct = self._acct[shard.spec.name] = TableAccount(shard, self.variant, self.opts.ssu_sample)
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
            raise refusal(exc) from None
        if info.get("seq") is None:
            log.warning("replaced index %d: no checkpoint in %s; the shard starts from initial values",
                        failed_index, self.storage.describe(f"server-{failed_index}"))
        else:
            log.info("replaced index %d: restored checkpoint seq %s (+%d deltas) in %.3f s", failed_index,
                     info["seq"], len(info["deltas"]), info["load_s"])

    def close(self) -> None:
        for pending in list(self._pending):
            try:
                pending.result(timeout=WAIT_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - already logged and counted by the writer
                pass
        self._writer.shutdown(wait=False, cancel_futures=True)


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
