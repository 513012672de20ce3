"""The worker-side checkpoint driver: consistent cuts, rollback, interval choice and exact loss counting.

    cluster = Cluster.connect(address)
    driver = CheckpointDriver(cluster)            # reads the strategy and options from the cluster map
    driver.start(step=0)                          # initial checkpoint; measures o_save and o_load
    step = 0
    while step < num_steps:
        train_one_batch(data[step])
        result = cluster.step()
        resume = driver.after_step(step, result)  # may save; on a failure recovers
        step = resume if resume is not None else step + 1

What it does, by the recovery the run uses:

- **full** (strategy ``full``, or a ``cpr*`` strategy whose ``recovery`` resolved to full):
  saves are driven from here at step boundaries (``StrategyCall("save", {cut, step})`` on
  every server at once), so the checkpoints of one *cut* form a consistent global state.
  When the client's map shows a server index served by a new process it flushes
  every server's writer, restores the newest cut complete on **every** server, reloads the
  dense parameters into the worker, and returns the cut's step: the training loop rewinds
  its data position there and the lost work is redone.
- **partial** (``cpr``, ``cpr-mfu``, ``cpr-ssu``): servers save on their own timers and the
  replacement restores itself (``on_recovery``); the driver counts what was lost, gives the
  replacement the intervals it was configured with (:meth:`configure`), and puts the dense
  parameters back as they were before the failure: CPR keeps the dense model on its trainers, so
  a partial recovery loses embedding rows only.  The driver keeps that copy (:class:`DenseCopy`):
  it reads the dense payloads (weights and optimizer state) once and applies to them every
  acknowledged step's dense gradients with the servers' own optimizer code, so the copy equals
  the servers' bit for bit.  That holds when every push passes through this driver (one worker);
  with several workers pass ``keep_dense=False`` and a failed server's dense tensors roll back to
  its checkpoint (reported in ``FailureEvent.dense_rolled_back``).

Interval: an explicit ``interval_steps``/``interval_s`` wins; otherwise the full-recovery
interval is Daly's (or Young's) optimum from the *measured* save stall and the user's
``mtbf_s`` (re-evaluated after every save), and with ``recovery=auto`` the choice between
partial and full recovery is ``overhead.plan_recovery`` on the measured o_save and o_load.

Exact loss counting: the driver adds up the rows every push it was given acknowledged
(``cluster.step()``'s ``rows``, and the rows this cluster wrote: ``write_rows``, a warm start) and, at a step
boundary, asks every server for the row
updates its state reflects (``stats.row_updates_total``; a replacement's counter restarts
at its checkpoint's).  Their difference is exactly the row updates lost.  It is exact when
every push of the job passes through :meth:`after_step` (one worker, or workers that hand
their step results to one driver via :meth:`add_acked`) and nothing is pushed while the
driver counts.  PLS = lost / all acknowledged row updates.

Sample-weighted PLS (CPR's own definition: a portion of lost *samples*): the lookups of the lost updates,
counted by ``baselines.sample_loss`` from a history of the steps' ids and lookups; ``lost_samples`` is None
where it cannot be counted exactly, never a guess; so is the dense copy (``baselines.dense_copy``) dropped then.

Every call goes through the client (``Cluster.strategy_call``), so it has the client's RPC
timeout and follows failures to the replacement; errors are raised, never swallowed.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from dataclasses import asdict, dataclass, field

from baselines import overhead
from baselines.dense_copy import DenseCopy
from baselines.options import VARIANTS
from baselines.sample_loss import SampleLoss
from baselines.storage import CheckpointError
from ecrec.client import Cluster, ClusterError
from ecrec.net.cluster_map import live_servers
from ecrec.strategies import get_spec, names_of_kind

log = logging.getLogger("baselines.driver")


@dataclass
class FailureEvent:
    step: int  # the step after which the failure was seen
    indices: list[int]
    recovery: str  # "partial" | "full"
    lost_updates: int = 0  # partial: row updates lost by this failure
    resume_step: int | None = None  # full: where the data position went back to
    cut: int | None = None  # full: the restored cut
    updates_rolled_back: int = 0  # full: acknowledged row updates undone (to be redone)
    restored: dict = field(default_factory=dict)  # partial: index -> what the replacement restored
    dense_rolled_back: list[str] = field(default_factory=list)  # partial: rolled back to the checkpoint
    dense_kept: list[str] = field(default_factory=list)  # partial: put back from the driver's copy
    lost_samples: int | None = None  # partial: the lookups of the lost updates (None: could not be counted)
    seconds: float = 0.0


class CheckpointDriver(SampleLoss):
    """Drives the checkpointing baselines from the training loop (see the module docstring); the sample-weighted
    loss count is mixed in from ``baselines.sample_loss``."""

    def __init__(self, cluster: Cluster, interval_steps: int | None = None, interval_s: float | None = None,
                 mtbf_s: float | None = None, recovery: str | None = None, keep_dense: bool = True,
                 sample_history_s: float = 60.0):
        if interval_steps is not None and (isinstance(interval_steps, bool)
                                           or not isinstance(interval_steps, numbers.Integral) or interval_steps < 1):
            raise ValueError(f"interval_steps must be an integer >= 1, got {interval_steps!r}")
        for name, v in (("interval_s", interval_s), ("mtbf_s", mtbf_s)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)
                                  or not v > 0):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {v!r}")
        if cluster.map is None:
            cluster.refresh_map()
        self.cluster = cluster
        self.strategy = cluster.map.strategy
        spec = get_spec(self.strategy)
        if not spec.checkpoints:
            raise ValueError(f"CheckpointDriver drives the checkpointing strategies ({', '.join(names_of_kind('checkpoint'))}); "
                             f"this cluster runs {self.strategy!r}")
        self.opts = spec.parse_options(dict(cluster.map.strategy_options))
        self.full_only = VARIANTS[self.strategy][1]
        self.interval_steps = interval_steps if interval_steps is not None else self.opts.interval_steps
        self.interval_s = interval_s if interval_s is not None else self.opts.interval_s
        self.mtbf_s = mtbf_s if mtbf_s is not None else self.opts.mtbf_s
        self.recovery = "full" if self.full_only else (recovery or self.opts.recovery)
        if self.recovery not in ("partial", "full", "auto"):
            raise ValueError(f"recovery must be partial, full or auto, got {self.recovery!r}")
        if self.recovery == "auto" and (self.mtbf_s is None or self.opts.target_pls is None):
            raise ValueError("recovery=auto needs mtbf_s and the strategy's target_pls")
        for name, v in (("interval_steps", self.interval_steps), ("interval_s", self.interval_s), ("mtbf_s", self.mtbf_s)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        self.mode: str | None = None  # resolved recovery: "partial" | "full"
        self.plan: overhead.RecoveryPlan | None = None
        self.o_save_s: float | None = None  # EWMA of the measured save stall
        self.o_load_s: float | None = None
        self.o_persist_s: float = 0.0  # the initial save's write time (the slowest server's): T >= it
        self.full_interval_s: float | None = None  # driver-driven interval in seconds (explicit or modelled)
        self.saves = 0
        self.save_stall_s = 0.0
        self.rows_acked_total = 0  # every row update acknowledged to the worker(s) since start
        self.lost_updates = 0
        self.updates_rolled_back = 0
        self.steps_redone = 0
        self.events: list[FailureEvent] = []
        self._balance = 0  # acknowledged row updates the servers' state should reflect
        # what of the cluster's writes was counted (:meth:`_note_assignments`) and seen (:meth:`_dense_written`)
        self._rows_seen, self._dense_seen = cluster.rows_assigned, cluster.dense_assigned
        self._seen = len(cluster.replacements)
        self._addresses: dict[int, str] = self._live()
        self._cut = 0
        self._confirmed_cut: int | None = None
        self._write_errors: dict[int, int] = {}
        self._last_save_step: int | None = None
        self._last_save_time = 0.0
        self._started = False
        self._last_step: int | None = None  # the last step after_step saw (a failure found by report() is after it)
        self._configured: dict = {}  # what configure() set on the servers: a replacement gets it too
        self._init_samples(sample_history_s)
        cluster.count_lookups = not self.full_only  # the client counts each id's lookups for the sample count
        #: partial recovery: the dense parameters are kept here and put back after a failure (None: not kept)
        self.dense_copy: DenseCopy | None = DenseCopy(cluster) if keep_dense and not self.full_only else None
        self._dense_step = -1  # the cluster's steps_done the dense copy holds

    # --- set-up ------------------------------------------------------------------------------------------
    def start(self, step: int = 0) -> dict:
        """Initial checkpoint (durable before returning) at ``step``; measures costs; resolves the recovery mode."""
        self._counter_by_server = self._counters_by_server()
        self._balance = sum(self._counter_by_server.values())
        self._rows_seen, self._dense_seen = self.cluster.rows_assigned, self.cluster.dense_assigned
        self._history.append((time.monotonic(), dict(self._counter_by_server), {}))  # the initial cut's counters
        lists = self.cluster.strategy_call("list")
        self._cut = max((c for r in lists.values() for c in r["cuts"]), default=0)
        self._save(step)
        flushed = self.cluster.strategy_call("flush")
        failed = {i: f["last_error"] for i, f in flushed.items() if f["last_committed_cut"] != self._cut}
        if failed:
            raise CheckpointError(f"the initial checkpoint (cut {self._cut}) was not written on servers {failed}")
        self._confirmed_cut = self._cut
        self.o_persist_s = max(float(r.get("persist_s_last") or 0.0) for r in self.cluster.strategy_call("stats").values())
        probes = self.cluster.strategy_call("probe_load")
        self.o_load_s = max(r["load_s"] for r in probes.values())
        n = self.cluster.layout.num_servers
        if self.recovery == "auto":
            self.plan = overhead.plan_recovery(self.o_save_s, self.o_load_s, self.mtbf_s, n, self.opts.target_pls,
                                               self.opts.o_res_s, self.opts.formula, self.o_persist_s)
            self.mode = self.plan.recovery
            log.info("recovery plan: %s", self.plan)
        else:
            self.mode = self.recovery
        self._update_interval()
        if not self.full_only:
            self.cluster.strategy_call("configure", self._configure_args())
        if self.mode != "partial":
            self.dense_copy = None  # a full recovery rolls everything back to the cut: nothing to keep
            self.cluster.count_lookups = False
        if self.dense_copy is not None:
            self.dense_copy.reload()
            self._dense_step = self.cluster.steps_done
        self._started = True
        return self.report()

    def configure(self, **args) -> dict[int, dict]:
        """Sets the servers' timer intervals (``interval_s``: between full saves); remembered, so that a
        server that replaces a failed one is given them as soon as the failure is seen."""
        unknown = set(args) - {"interval_s"}
        if unknown:
            raise ValueError(f"configure: unknown arguments {sorted(unknown)}; allowed: ['interval_s']")
        replies = self.cluster.strategy_call("configure", args)
        self._configured.update(args)
        return replies

    def _configure_args(self) -> dict:
        # interval_s None: the strategy's own option, whatever an earlier driver of this cluster configured
        args = {"mode": self.mode, "interval_s": None}
        if self.mode == "partial" and self.plan is not None and self.opts.interval_s is None:
            args["interval_s"] = self.plan.partial_interval_s
        args.update(self._configured)
        return args

    def _update_interval(self) -> None:
        if self.mode != "full" or self.interval_s is not None or self.interval_steps is not None:
            self.full_interval_s = self.interval_s
            return
        if self.mtbf_s is None:
            raise ValueError("full recovery needs interval_steps, interval_s or mtbf_s")
        self.full_interval_s = overhead.optimal_full_interval(max(self.o_save_s, 1e-6), self.mtbf_s, self.opts.formula,
                                                              self.o_persist_s)

    # --- the training loop's hooks ------------------------------------------------------------------------
    def add_acked(self, rows: int) -> None:
        """Adds row updates acknowledged to a worker whose step results do not pass through :meth:`after_step`.

        Another worker pushes then: this driver's copy of the dense parameters misses its gradients and its
        lookups are not counted, so the copy is dropped (a failed server's dense tensors roll back with its
        checkpoint, as reported) and the sample-weighted loss is not counted (None)."""
        if self.dense_copy is not None or self.lost_samples is not None:
            log.info("rows acknowledged to another worker: no dense copy, no sample-weighted loss count")
        self.dense_copy = None
        self.lost_samples = None
        self._drop_history()
        self._acked(rows)

    def _acked(self, rows: int) -> None:
        self.rows_acked_total += int(rows)
        self._balance += int(rows)

    def _note_assignments(self) -> None:
        """Rows this cluster wrote since the last hook (``write_rows``: a warm start, a load): the servers count
        them as updates their state reflects, so they are acknowledged updates here too (lost, and counted, when
        their shard rolls back); a row's written value is no step's lookups (the sample-weighted count becomes
        None)."""
        rows, seen = self.cluster.rows_assigned, self._rows_seen
        self._rows_seen = rows
        if rows != seen:
            self._acked(rows - seen)
            if self.lost_samples is not None:
                log.info("rows written (write_rows) while the driver counts: no sample-weighted loss count")
                self.lost_samples = None
                self._drop_history()

    def _dense_written(self) -> bool:
        """Whether this cluster wrote a dense payload (``write_dense``) since the last step: the dense copy then
        reads the servers' payloads once any failure of this step is dealt with (read before, it could take a
        replaced server's rolled-back payload and put that back)."""
        seen, self._dense_seen = self._dense_seen, self.cluster.dense_assigned
        return self._dense_seen != seen and self.dense_copy is not None

    def _reload_dense_copy(self) -> None:
        if self.dense_copy is not None:
            self.dense_copy.reload()  # the servers' payloads now: this step's gradients and the writes included
            self._dense_step = self.cluster.steps_done

    def after_step(self, step: int, result: dict | None = None) -> int | None:
        """Call after batch ``step`` (0-based) was pushed; returns the step to resume from after a rollback."""
        self._last_step = step
        if not self._started:  # the servers' counters already include this step's rows
            self.start(step + 1)
            self.rows_acked_total += int(result.get("rows", 0)) if result else 0
            self._samples_dropped += int(sum(int(n.sum()) for _, n in self.cluster.last_lookups.values()))
            return None
        if result is not None:
            self._acked(result.get("rows", 0))
        self._note_assignments()
        dense_written = self._dense_written()
        if self.dense_copy is not None and self._dense_step != self.cluster.steps_done:
            # once per step of the cluster: a second after_step for one step (with its result, or None) would
            # apply its dense gradients to the copy twice, and a recovery would put that copy back
            self._dense_step = self.cluster.steps_done
            self.dense_copy.advance(self.cluster.last_dense_grads)
        if result is not None and self.mode == "partial":
            self._remember(result)
        if self._failures_pending():
            resume = self._on_failure(step)
            if dense_written:
                self._reload_dense_copy()
            return resume
        if dense_written:
            self._reload_dense_copy()
        if self._due(step):
            try:
                self._save(step + 1)
            except ClusterError:
                if self._failures_pending():
                    return self._on_failure(step)
                raise
        return None

    @property
    def last_save_step(self) -> int | None:
        """The step the newest full save (or the cut restored by a rollback) resumes at; None before the first."""
        return self._last_save_step

    def set_interval_steps(self, steps: int) -> None:
        """From now on a full save every ``steps`` steps, replacing any interval in seconds.

        For a caller that chose the interval itself, e.g. a benchmark that turns Young/Daly's optimum
        in seconds into steps because its wall clock also runs while other runs are timed.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"interval steps must be an integer >= 1, got {steps!r}")
        self.interval_steps = steps
        self.interval_s = None
        self._update_interval()

    def save_now(self, next_step: int, wait: bool = True) -> dict[int, dict]:
        """A full save at a step boundary on every server now (``next_step``: the batch that comes next)."""
        return self._save(next_step, wait=wait)

    # --- saving -----------------------------------------------------------------------------------------------
    def _due(self, step: int) -> bool:
        if self.mode == "partial" and self.interval_steps is None:
            return False  # the servers' timers save
        if self.interval_steps is not None:
            return (step + 1) - self._last_save_step >= self.interval_steps
        if self.full_interval_s is not None:
            return time.monotonic() - self._last_save_time >= self.full_interval_s
        return False

    def _save(self, next_step: int, wait: bool = False) -> dict[int, dict]:
        self._cut += 1
        cut = self._cut
        args = {"kind": "full", "cut": cut, "step": int(next_step), "wait": bool(wait)}
        if self._confirmed_cut is not None:
            args["keep_cut"] = self._confirmed_cut
        t0 = time.perf_counter()
        replies = self.cluster.strategy_call("save", args)
        stall = time.perf_counter() - t0
        self.saves += 1
        self.save_stall_s += stall
        if not wait:  # o_save is the stall training pays (the write runs in the background): an EWMA
            self.o_save_s = stall if self.o_save_s is None else 0.7 * self.o_save_s + 0.3 * stall
        committed = [r["last_committed_cut"] for r in replies.values()]
        self._confirmed_cut = None if any(c is None for c in committed) else min(committed)
        for index, r in replies.items():
            if r.get("write_errors", 0) > self._write_errors.get(index, 0):
                self._write_errors[index] = r["write_errors"]
                log.warning("server %d: a checkpoint write failed: %s", index, r.get("last_error"))
        self._last_save_step = int(next_step)
        self._last_save_time = time.monotonic()
        if self._started:
            self._update_interval()
        return replies

    # --- failures ---------------------------------------------------------------------------------------------
    def _live(self) -> dict[int, str]:
        return {i: s.address for i, s in live_servers(self.cluster.map).items()}

    def _replaced(self) -> list[int]:
        """Indices now served by another process than when last looked at.

        Compares the client's map with the addresses recorded here rather than relying only on
        ``cluster.replacements``, which misses a replacement when the client adopted an intermediate
        map where the index was FAILED (no live address) before the promoted one.
        """
        live = self._live()
        replaced = {i for i, a in live.items() if self._addresses.get(i) not in (None, a)}
        replaced |= {r.index for r in self.cluster.replacements[self._seen:]}
        return sorted(replaced)

    def _failures_pending(self) -> bool:
        return bool(self._replaced())

    def _server_counters(self) -> int:
        return sum(self._counters_by_server().values())

    def _counters_by_server(self) -> dict[int, int]:
        return {i: int(r["row_updates_total"]) for i, r in self.cluster.strategy_call("stats").items()}

    def _on_failure(self, step: int) -> int | None:
        t0 = time.perf_counter()
        indices = self._replaced()
        self._seen = len(self.cluster.replacements)
        self._addresses.update(self._live())
        if self.mode == "full":
            return self._rollback(step, indices, t0)
        by_server = self._counters_by_server()
        counters = sum(by_server.values())
        lost = self._balance - counters
        if lost < 0:
            raise CheckpointError(f"servers reflect {counters} row updates but only {self._balance} were acknowledged "
                                  "to this driver: route every worker's step result through after_step/add_acked")
        self._balance = counters
        self.lost_updates += lost
        pending = None
        if self.lost_samples is not None:
            if len(indices) == 1 and self._history:  # what the count needs, read now; counted later (settle)
                index = indices[0]
                pending = {"index": index, "lost": lost, "end": self._history_first + len(self._history),
                           "keep": self._history_horizon_steps(),  # the horizon now: slower steps later keep it
                           "restored": self.cluster.strategy_call("restored_rows", indices=[index])[index],
                           "counter": by_server[index]}
            else:
                self.lost_samples = None
                self._drop_history()
        stats = self.cluster.strategy_call("stats", indices=indices)
        self.cluster.strategy_call("configure", self._configure_args(), indices=indices)
        dense = [d.name for d in self.cluster.map.dense if self.cluster.layout.dense_servers(d.name)[0] in indices]
        kept = self.dense_copy.put_back(dense) if self.dense_copy is not None else []
        self.cluster.pull_dense()
        event = FailureEvent(step, indices, "partial", lost_updates=lost,
                             dense_rolled_back=[n for n in dense if n not in kept], dense_kept=kept,
                             restored={i: stats[i]["restored"] for i in indices}, seconds=time.perf_counter() - t0)
        self.events.append(event)
        if pending is not None:
            self._pending_samples.append(dict(pending, event=event))
        log.warning("servers %s replaced after step %d: partial recovery, %d row updates lost (PLS so far %.3g)",
                    indices, step, lost, self.pls())
        return None

    def _rollback(self, step: int, indices: list[int], t0: float) -> int:
        flushed = self.cluster.strategy_call("flush")
        for index, f in flushed.items():
            if f.get("last_error"):
                log.warning("server %d: last checkpoint error: %s", index, f["last_error"])
        lists = self.cluster.strategy_call("list")
        common = set.intersection(*(set(r["cuts"]) for r in lists.values()))
        if not common:
            raise CheckpointError("no checkpoint cut is complete on every server "
                                  f"({ {i: r['cuts'] for i, r in lists.items()} }): cannot roll back")
        cut = max(common)
        log.info("rollback: complete cuts per server %s -> cut %d", {i: r["cuts"] for i, r in lists.items()}, cut)
        restored = self.cluster.strategy_call("restore", {"cut": cut})
        steps = {r["step"] for r in restored.values()}
        if len(steps) != 1 or None in steps:
            raise CheckpointError(f"cut {cut} records different steps on different servers: {steps}")
        resume = steps.pop()
        if not self.full_only:
            self.cluster.strategy_call("configure", self._configure_args(), indices=indices)
        self.cluster.zero_grad()
        self.cluster.pull_dense()
        counters = self._server_counters()
        rolled = self._balance - counters
        self._balance = counters
        self.updates_rolled_back += rolled
        self.steps_redone += (step + 1) - resume
        self._last_save_step = resume
        self._last_save_time = time.monotonic()
        event = FailureEvent(step, indices, "full", resume_step=resume, cut=cut, updates_rolled_back=rolled,
                             seconds=time.perf_counter() - t0)
        self.events.append(event)
        log.warning("servers %s replaced after step %d: rolled every server back to cut %d; resuming at step %d",
                    indices, step, cut, resume)
        return resume

    # --- reporting --------------------------------------------------------------------------------------------
    def lost_now(self) -> int:
        """Row updates lost so far, counted now (call at a step boundary)."""
        if self.mode != "partial":
            return self.lost_updates
        self._note_assignments()
        return self.lost_updates + self._balance - self._server_counters()

    def pls(self) -> float:
        return overhead.pls(self.lost_updates, self.rows_acked_total)

    def pls_samples(self) -> float | None:
        """Sample-weighted PLS: lookups of the lost updates over those of every acknowledged update (None when a
        failure's could not be counted)."""
        self.settle()
        if self.lost_samples is None or not self.samples_acked:
            return None
        return overhead.pls(self.lost_samples, self.samples_acked)

    def report(self) -> dict:
        """What the run cost and lost.  A failure no push has met yet (the failed index not touched since: the
        client's map still names the dead server) is found here and counted, in partial recovery, as
        ``after_step`` would (a full recovery's rollback needs a step boundary: the next ``after_step``)."""
        if self._started and self.mode == "partial" and self._last_step is not None:
            self.cluster.refresh_map()
            if self._failures_pending():
                self._on_failure(self._last_step)
        self.settle()
        return {
            "strategy": self.strategy, "mode": self.mode, "plan": self.plan.to_dict() if self.plan else None,
            "o_save_s": self.o_save_s, "o_load_s": self.o_load_s, "o_persist_s": self.o_persist_s, "interval_steps": self.interval_steps,
            "full_interval_s": self.full_interval_s, "saves": self.saves, "save_stall_s": self.save_stall_s,
            "rows_acked": self.rows_acked_total, "lost_updates": self.lost_updates, "pls": self.pls(),
            "samples_acked": self.samples_acked, "lost_samples": self.lost_samples, "pls_samples": self.pls_samples(),
            "updates_rolled_back": self.updates_rolled_back, "steps_redone": self.steps_redone,
            "failures": [asdict(e) for e in self.events],
        }
