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

Modules: ``strategy`` (the four strategies: set-up, intervals, the server's hooks), ``saving`` (snapshot, persist,
prune), ``restoring`` (find, verify, apply a checkpoint), ``commands`` (``call``'s handlers and ``stats``),
``account`` (one table's counters).
"""

from baselines.cpr.strategy import FullCheckpoint, PartialRecovery, PartialRecoveryMFU, PartialRecoverySSU

__all__ = ["FullCheckpoint", "PartialRecovery", "PartialRecoveryMFU", "PartialRecoverySSU"]
