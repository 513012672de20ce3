"""The running part of ``ecrec-bench compare``: each strategy's local cluster and worker, the interleaved
failure-free rounds (timed slices), the failures and their scheduling.

What it returns is turned into saved records by ``ecrec.bench.compare.run_record`` and into figures by
``ecrec.bench.accounting``; nothing here computes a figure of the report.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ecrec.bench.intervals import PARTIALS_PER_INTERVAL, cpr_interval  # noqa: F401 - re-exported (compare, tests)

WARM_STEPS = 30  # steps every run trains before the intervals are chosen (the save stall and step time measured)
WARM_SAVE_STEPS = 5  # full's interval during the warm steps, so that its save stall is measured a few times
MIN_STEPS_BETWEEN_FAILURES = 20
#: steps trained between the end of the previous failure (a settled standby included) and the next kill: the
#: rate of that failure is measured on them (``ecrec.bench.accounting.rate_before``), the same for every
#: strategy (the first failure has the steps before ``--fail-at``)
QUIET_STEPS = 30
STANDBY_IDLE_CPU = 0.05  # CPU seconds per second below which a freshly started standby counts as started
STANDBY_IDLE_SAMPLE_S = 0.5  # over at least this long
STANDBY_SETTLE_LIMIT_S = 60.0  # and at most this long after it was started
REDUNDANT_WAIT_S = 120.0  # after the last step, how long the results wait for ecrec's last rebuild to finish
CLOSE_CONFIRM_S = 5.0  # at close, how long a run waits for its last pushes to be confirmed (0 warned every run)



def _kind(strategy: str) -> str:
    """The kind of a strategy (``none``, ``erasure``, ``checkpoint``); a report label such as
    ``none (no failure)`` names its strategy first."""
    from ecrec.strategies import get_spec

    return get_spec(strategy.split(" ", 1)[0]).kind


# --- one run ----------------------------------------------------------------------------------------
class StrategyRun:
    """One strategy's local cluster and worker, advanced in pieces so strategies can be interleaved.

    It also schedules the strategy's failures (see the module docstring) and chooses its checkpoint
    intervals after the warm steps (:meth:`prepare`).
    """

    def __init__(self, strategy: str, label: str, args, cfg: dict, data_path: Path, work: Path, fail_at: int | None):
        from ecrec.bench.lost_training import failure_phases
        from ecrec.bench.trainer import TrainConfig
        from ecrec.ops.local import LocalCluster, LocalClusterSpec

        self.strategy, self.label, self.args, self.cfg, self.fail_at = strategy, label, args, cfg, fail_at
        self.kind = _kind(strategy)
        self.failures = cfg["failures"] if fail_at is not None else 0
        # drawn with the run's seed in equal parts of the interval, off the grid of the partial saves
        self.phases = failure_phases(cfg["failures"], seed=args.seed, avoid=PARTIALS_PER_INTERVAL)
        options = {}
        k = m = 0
        self.variant = None
        if self.kind == "erasure":
            k, m = cfg["k"], cfg["m"]
        interval_steps = None
        if self.kind == "checkpoint":
            from baselines.options import VARIANTS

            self.variant, full_only = VARIANTS[strategy]
            self.full_only = full_only
            ckpt = work / f"ckpt-{label}"
            shutil.rmtree(ckpt, ignore_errors=True)
            options["dir"] = str(ckpt)
            if cfg.get("checkpoint_url"):  # a store the servers reach (fsspec); a run's own sub-directory, emptied
                from baselines.storage import Storage

                options["dir"] = f"{cfg['checkpoint_url'].rstrip('/')}/ckpt-{label}"
                store = Storage.open(cfg["checkpoint_url"])
                if f"ckpt-{label}" in store.listdir(""):
                    store.remove_tree(f"ckpt-{label}")
            options["files"] = cfg.get("checkpoint_files", "one")  # one data file and one fsync per checkpoint
            if cfg.get("bandwidth_mb_s"):
                options["bandwidth_mb_s"] = str(cfg["bandwidth_mb_s"])
            if full_only:  # consistent cuts: the driver saves every N steps (the model's N is set after the warm steps)
                interval_steps = cfg["checkpoint_interval_steps"] or WARM_SAVE_STEPS
                options["interval_steps"] = str(interval_steps)
            elif cfg.get("cpr_interval_s"):  # partial recovery at the given interval
                options["interval_s"] = str(cfg["cpr_interval_s"])
            else:  # CPR's own plan: the driver measures o_save/o_load and picks partial or full recovery
                options.update(mtbf_s=str(cfg["mtbf_s"]), target_pls=str(cfg["target_pls"]), recovery="auto")
        options.update(cfg.get("strategy_options", {}).get(strategy, {}))  # e.g. profile's --option
        self.full_mode = self.kind == "checkpoint" and self.full_only  # cpr*: also when CPR's plan picks full
        self.local = LocalCluster(LocalClusterSpec(servers=cfg["servers"], standby=1,
                                                   strategy=strategy, k=k, m=m, options=options,
                                                   server_options=dict(cfg.get("server_options", {}))))
        self.records_dir = work / f"records-{label}"
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.kills: list[dict] = []
        self.interval: dict | None = None  # the interval chosen for this run and why (prepare)
        self.trainer = None
        self._planned: dict | None = None  # the next failure: {"step": N} or {"time": T}
        self._quiet_since: float | None = None  # when the next failure was first planned (the previous one over)
        self._median_step_s: float | None = None
        self._timers_paused = False
        self._standby: dict | None = None  # the standby started for the next failure and whether it settled
        self._reconfigure = False  # after a failure: give the replacement the tuned interval (once)
        self.load_average = {"before": list(os.getloadavg())}  # one-minute, five, fifteen
        self.memory: dict[str, dict] = {}  # phase -> the servers' resident and peak bytes (memory_end)
        self._memory_reset = False
        self._result: dict | None = None
        self._state: dict | None = None
        self.local.start()
        wait_until_idle([p.pid for p in self.local.server_procs])  # kernels compiled before anything is timed
        self.tcfg = TrainConfig(
            address=self.local.coordinator_address, data_path=str(data_path), strategy=strategy, steps=cfg["steps"],
            batch_size=cfg["batch_size"], embedding_dim=cfg["embedding_dim"], lr=cfg["lr"], seed=args.seed,
            checkpoint_interval_steps=interval_steps, records_dir=str(self.records_dir),
            model=getattr(args, "model", "auto"),
            snapshot_every=getattr(args, "snapshot_every", 0) if self.kind == "erasure" else 0,
            snapshot_dir=str(work / f"snapshots-{label}"))

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far (user + system, from the processes' own counters): this process (the worker),
        the cluster's servers (standbys included) and its coordinator."""
        return {"worker": time.process_time(),
                "servers": sum(process_cpu_seconds(p.pid) for p in self.local.server_procs),
                "coordinator": process_cpu_seconds(self.local.coordinator_proc.pid)}

    # --- memory -----------------------------------------------------------------------------------------
    def memory_start(self) -> None:
        """Starts a memory phase: the serving servers' peak resident memory is reset (``clear_refs``), so that
        the peak read at its end (:meth:`memory_end`) is that phase's own (a save's, a rebuild's)."""
        self._memory_reset = reset_peak_memory(self.server_pids())

    def memory_end(self, phase: str) -> None:
        """Records the serving servers' resident memory now and its peak since :meth:`memory_start`."""
        from ecrec.bench.processes import memory_of

        self.memory[phase] = dict(memory_of(self.server_pids()), peak_reset=self._memory_reset)

    def server_pids(self) -> list[int]:
        return [self.local.pid_of_index(i) for i in range(self.cfg["servers"])]

    # --- checkpoint timers and intervals ----------------------------------------------------------------
    def pause_timers(self, paused: bool) -> None:
        """Pauses or resumes the servers' checkpoint timers (pausing waits for the writes under way)."""
        if self.kind != "checkpoint" or self.trainer is None or self._timers_paused == paused:
            return
        self.trainer.cluster.strategy_call("timers", {"paused": paused})
        self._timers_paused = paused

    def prepare(self, tuning=None) -> None:
        """Trains the warm steps, then sets the interval the models choose (see ``choose_interval``)."""
        self.advance(min(WARM_STEPS, max(self.fail_at or self.cfg["steps"], 1)))
        if self.kind == "checkpoint":
            self.interval = self.choose_interval(tuning)

    def warm_step_s(self) -> float:
        from ecrec.bench.intervals import warm_step_s

        return warm_step_s(self.trainer.records)

    def choose_interval(self, tuning=None) -> dict:
        """The interval the models choose after the warm steps (``ecrec.bench.intervals.choose_interval``)."""
        from ecrec.bench.intervals import choose_interval

        info = choose_interval(self.strategy, self.cfg, self.trainer.records, self.trainer.driver, tuning)
        self.full_mode = "interval_steps" in info  # full, or a cpr* strategy whose plan picked full recovery
        return info

    def shard_updates(self):
        """The row updates the failed server receives at each step of this run (for equal-PLS tuning)."""
        from ecrec.bench.intervals import shard_updates

        step_ids = [list(b.ids.T) for b in self.trainer.batches]
        return shard_updates(step_ids, list(self.trainer.table_sizes), self.trainer.cluster.layout,
                             self.cfg["fail_server"])

    # --- failures -----------------------------------------------------------------------------------------
    def kill(self, step: int | None = None) -> None:
        pid = self.local.pid_of_index(self.cfg["fail_server"])
        # --workers > 1: the kill comes at --fail-at (rank 0's step), at no chosen phase of the interval
        phase = self.phases[len(self.kills)] if self.kind == "checkpoint" and self.args.workers == 1 else None
        self.kills.append({"pid": pid, "time": time.time(), "step": step, "phase": phase,
                           "quiet_since": self._quiet_since, **({"planned": self._planned} if self._planned else {})})
        self._planned = None
        self._quiet_since = None
        self._standby = None
        self._reconfigure = True
        self.local.kill(pid)

    def _on_step(self, step: int) -> None:
        _progress(self.label, step, self.cfg["steps"])
        if self.fail_at is None or step < self.fail_at or len(self.kills) >= self.failures:
            return
        if self._planned is not None:
            if step >= self._planned.get("step", math.inf) or time.time() >= self._planned.get("time", math.inf):
                self.kill(step)
            return
        if self.kills and not self._recovered(step):
            return
        if self._median_step_s is None:
            self._median_step_s = self.warm_step_s()
        if self._quiet_since is None and self.kills:
            self._quiet_since = time.time()
        self._plan(step)

    def _recovered(self, step: int) -> bool:
        """Whether the previous failure is over: back to speed, redundant again, a standby waiting."""
        from ecrec.bench.lost_training import back_to_speed

        last = self.kills[-1]
        if step - (last["step"] or 0) < MIN_STEPS_BETWEEN_FAILURES:
            return False
        recent = [r for r in self.trainer.records if r["end"] > last["time"] - 1.0]
        if back_to_speed(recent, last["time"], self._median_step_s) is None:
            return False
        if self.kind == "checkpoint" and self.trainer.driver is not None and len(self.trainer.driver.events) < len(self.kills):
            return False
        cluster_map = self.local.cluster_map()
        if not any(s.index < 0 for s in cluster_map.servers):
            if self._standby is None:  # started only now, so that its start-up does not slow a recovery
                self._standby = {"proc": self.local.start_server(standby=True), "step": step,
                                 "started": time.monotonic(), "sample": None, "settled": False}
            return False
        if self._standby is not None and not self._standby_settled(step):
            return False
        if self.kind == "erasure" and not any(e.kind == "redundant" and e.wall_time >= last["time"]
                                              for e in cluster_map.events):
            return False
        return True

    def _standby_settled(self, step: int) -> bool:
        """Whether the standby started for the next failure has finished starting: registered some steps ago
        and using (almost) no CPU, i.e. done compiling its kernels.  A standby promoted while still starting
        took seconds to serve (measured: 2.4-10 s against 0.3-0.5 s), which would charge its start-up to
        the failure."""
        sb = self._standby
        if sb["settled"]:
            return True
        if step - sb["step"] < MIN_STEPS_BETWEEN_FAILURES:
            return False
        now, cpu = time.monotonic(), process_cpu_seconds(sb["proc"].pid)
        previous = sb["sample"]
        if previous is not None and now - previous[0] < STANDBY_IDLE_SAMPLE_S:
            return False
        sb["sample"] = (now, cpu)
        if previous is None:
            return False
        idle = (cpu - previous[1]) / (now - previous[0]) <= STANDBY_IDLE_CPU
        if idle or now - sb["started"] > STANDBY_SETTLE_LIMIT_S:
            sb["settled"] = True
        return sb["settled"]

    def _plan(self, step: int) -> None:
        """Plans the next failure at its phase of the checkpoint interval (for strategies without one, at
        once), after a failure at least ``QUIET_STEPS`` steps (or their median time) from now."""
        phase = self.phases[len(self.kills)]
        quiet = QUIET_STEPS if self.kills else 0
        if self.kind != "checkpoint":
            self._planned = {"step": step + quiet}
        elif self.full_mode:
            driver = self.trainer.driver
            n = int(driver.interval_steps)
            offset = min(int(round(phase * n)), n - 1)
            target = driver.last_save_step + offset
            while target < step + max(quiet, 1):
                target += n
            self._planned = {"step": target, "interval_steps": n, "offset_steps": offset}
        else:
            index = self.cfg["fail_server"]
            if self._reconfigure:  # a replacement starts from the cluster's options, not the tuned interval
                self._reconfigure = False
                if self.interval and self.interval.get("servers_interval_s"):
                    self.trainer.cluster.strategy_call("configure", {"interval_s": self.interval["interval_s"]},
                                                       indices=[index])
                    return  # configure restarts the timer: it starts at its next tick
            reply = self.trainer.cluster.strategy_call("timers", {}, indices=[index])[index]
            if reply.get("next_full_in_s") is None or not reply.get("interval_s"):
                return  # the timer starts at its next tick
            now, interval = time.time(), float(reply["interval_s"])
            at = now + reply["next_full_in_s"] - interval + phase * interval
            while at < now + max(quiet * self._median_step_s, 0.01):
                at += interval
            self._planned = {"time": at, "interval_s": interval, "offset_s": phase * interval}

    def advance(self, until: int) -> int:
        """Trains (in this process) until step ``until``; returns the samples trained."""
        if self.trainer is None:
            from ecrec.bench.trainer import Trainer

            self.trainer = Trainer(self.tcfg, 0, 1)
        return self.trainer.advance(until, self._on_step)

    def finish(self) -> dict:
        """Trains to the end (the failures included) and collects the run's figures; stops the cluster."""
        try:
            self.train_to_end()
            if not self.memory:  # run on its own: one phase, from the warm steps to the end
                self.memory_end("run")
            return self.collect()
        finally:
            self.close()

    def train_to_end(self) -> None:
        """Trains the remaining steps, the failures included (``--workers > 1``: the torchrun workers)."""
        self.load_average["before_failures"] = list(os.getloadavg())
        if self.args.workers > 1:
            self.failures = min(self.failures, 1)
            if self.kind == "checkpoint":  # rank 0 chooses the interval after the warm steps, as prepare() does
                warm = min(WARM_STEPS, max(self.fail_at or self.cfg["steps"], 1))
                cfg = {k: v for k, v in self.cfg.items() if isinstance(v, (str, int, float, bool, type(None)))}
                self.tcfg.extra["choose_interval"] = {"after_steps": warm, "cfg": cfg}
            self._result = _run_torchrun(self.tcfg, self.args.workers, self.records_dir, self.fail_at,
                                         lambda: self.kill(None), self.label)
            self.interval = self._result.pop("interval", None) or self.interval
            self._state = None
        else:
            self.pause_timers(False)
            self.advance(self.cfg["steps"])
            _progress(self.label, self.cfg["steps"], self.cfg["steps"], done=True)
            self._result = self.trainer.finish()
            self._state = _final_state(self._result.get("cluster"), self.local)
        self.load_average["after"] = list(os.getloadavg())
        if len(self.kills) < self.failures:
            print(f"  {self.label}: {len(self.kills)} of {self.failures} failures fitted in {self.cfg['steps']} "
                  "steps (each waits for the previous one to be over and for its phase of the interval)",
                  file=sys.stderr)

    def collect(self) -> dict:
        """The run's results once trained to the end (:meth:`train_to_end`); the cluster still runs.  With
        ``ecrec``, a rebuild still running after the last step (a failure near the end, a loaded machine) is
        waited for (up to ``REDUNDANT_WAIT_S``), so that its time to full redundancy is measured, not missing."""
        cluster_map = self.local.cluster_map()
        if self.kind == "erasure" and self.kills:
            last, deadline = self.kills[-1]["time"], time.monotonic() + REDUNDANT_WAIT_S
            waited = False
            while (not any(e.kind == "redundant" and e.wall_time >= last for e in cluster_map.events)
                   and time.monotonic() < deadline):
                if not waited:
                    print(f"  {self.label}: waiting for the last rebuild to finish (full redundancy; at most "
                          f"{REDUNDANT_WAIT_S:.0f} s)", file=sys.stderr)
                    waited = True
                time.sleep(0.1)
                cluster_map = self.local.cluster_map()
        stats = _strategy_stats(self.local, self.strategy)
        return {"result": self._result, "killed": {"failures": self.kills}, "state": self._state, "stats": stats,
                "map": cluster_map, "interval": self.interval, "planned_failures": self.failures,
                "load_average": dict(self.load_average), "memory": dict(self.memory),
                "events": [dict(kind=e.kind, index=e.index, wall_time=e.wall_time) for e in cluster_map.events]}

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        client = self._result.get("cluster") if isinstance(self._result, dict) else None
        if client is None and self.trainer is not None:  # not finished (a profile's slices, an interrupted run)
            client = getattr(self.trainer, "cluster", None)
        if client is not None:  # its idle keeper would poll a cluster that is gone; its last pushes confirmed first
            client.close(confirm_timeout_s=CLOSE_CONFIRM_S)
        self.local.close()
        if not self.args.keep:
            shutil.rmtree(self.records_dir, ignore_errors=True)


def wait_until_idle(pids: list[int], limit_s: float = STANDBY_SETTLE_LIMIT_S) -> bool:
    """Waits until every process uses at most ``STANDBY_IDLE_CPU`` CPU-seconds per second over
    ``STANDBY_IDLE_SAMPLE_S`` (a server compiles its kernels after it registers, holding the GIL, so a
    request that comes during that time waits for it); gives up after ``limit_s``.  Returns whether idle."""
    deadline = time.monotonic() + limit_s
    before = {pid: process_cpu_seconds(pid) for pid in pids}
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(STANDBY_IDLE_SAMPLE_S)
        now = {pid: process_cpu_seconds(pid) for pid in pids}
        t1 = time.monotonic()
        if all((now[pid] - before[pid]) / (t1 - t0) <= STANDBY_IDLE_CPU for pid in pids):
            return True
        before, t0 = now, t1
    return False


def equal_pls_for(runs: dict, cfg: dict, seed: int) -> dict | None:
    """cpr, cpr-mfu and cpr-ssu tuned to cpr's PLS (``ecrec.bench.intervals.equal_pls_intervals``) from the
    row updates of the failed server, replayed from the first cpr* run's batches (the same for every run); each
    update weighs its row's lookups in the batch unless ``cfg["pls_basis"]`` is ``updates``."""
    from ecrec.bench.intervals import equal_pls_intervals

    names = [n for n in ("cpr", "cpr-mfu", "cpr-ssu") if n in runs]
    if not names:
        return None
    first = runs[names[0]]
    t_cpr, _ = cpr_interval(cfg)
    p = t_cpr / (2.0 * cfg["servers"] * cfg["mtbf_s"])  # the PLS of cpr's interval (the target unless one is given)
    updates = first.shard_updates()
    out = {}
    for name in names:
        step_s = runs[name].warm_step_s()
        out.update(equal_pls_intervals(p, cfg["servers"], cfg["mtbf_s"], step_s, updates, [name],
                                       partials_per_interval=PARTIALS_PER_INTERVAL, seed=seed,
                                       weighted=cfg.get("pls_basis", "samples") == "samples"))
    return out


def reset_peak_memory(pids: list[int]) -> bool:
    """Resets the peak resident memory (``VmHWM``) of ``pids`` (``/proc/PID/clear_refs``, Linux); whether it
    could for every one (when not, a phase's peak is the process's since it started)."""
    ok = True
    for pid in pids:
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            ok = False
    return ok


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process from ``/proc/PID/stat`` (0 when it is gone or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def run_strategy(strategy: str, args, cfg: dict, data_path: Path, work: Path, fail_at: int | None,
                 progress_label: str) -> dict:
    """One strategy from start to end on its own (no interleaving): warm steps, intervals, failures."""
    run = StrategyRun(strategy, progress_label, args, cfg, data_path, work, fail_at)
    try:
        if args.workers == 1:
            run.prepare()
            if args.equal_pls and strategy in ("cpr-mfu", "cpr-ssu"):
                run.interval = run.choose_interval(equal_pls_for({strategy: run, "cpr": run}, cfg, args.seed))
        run.memory_start()
    except BaseException:
        run.close()
        raise
    return run.finish()


def run_sequential(strategies: list[str], args, cfg: dict, data_path: Path, work: Path, fail_at: int | None) -> dict:
    """Each strategy from start to end on its own, the failure-free reference (``none``) first."""
    results = {"reference": run_strategy("none", args, cfg, data_path, work, None, "reference")}
    for name in strategies:
        results[name] = run_strategy(name, args, cfg, data_path, work, fail_at, name)
    return results


def run_interleaved(strategies: list[str], args, cfg: dict, data_path: Path, work: Path, fail_at: int,
                    rounds: int) -> tuple[dict, dict]:
    """Failure-free throughput measured side by side, then each strategy's failures.

    Every strategy's cluster (and a failure-free ``none`` reference) is started and trains its warm
    steps; the intervals are chosen; the steps up to a little before the first failure are trained in
    ``rounds`` rounds of slices, one per strategy and two halves of the reference's (the A/A pair), in
    an order shuffled per round (``--seed``).  A checkpointing strategy's timers run only inside its
    slices, and pausing them at the end of a slice waits for its writes, inside the slice's time.  Every
    slice is recorded (``ecrec.bench.accounting.SLICE_FIELDS``).  Then each strategy trains on through
    its failures, one after another in a shuffled order, every other cluster still up (and idle), so
    that each meets its failures in the same state of the machine.
    """
    names = ["reference", *strategies]
    runs: dict[str, StrategyRun] = {}
    rng = np.random.default_rng(args.seed)
    try:
        for name in names:
            runs[name] = StrategyRun("none" if name == "reference" else name, name, args, cfg, data_path, work,
                                     None if name == "reference" else fail_at)
        for run in runs.values():
            run.advance(min(WARM_STEPS, fail_at // 4))
            run.pause_timers(True)
        tuning = equal_pls_for(runs, cfg, args.seed) if args.equal_pls else None
        for run in runs.values():
            if run.kind == "checkpoint":
                run.interval = run.choose_interval(tuning)
        warm = len(runs["reference"].trainer.records)
        end = max(warm + 2 * rounds, fail_at - 30)
        bounds = np.linspace(warm, end, rounds + 1).astype(int)
        for run in runs.values():
            run.memory_start()
        slices: list[dict] = []
        orders = []
        for r in range(rounds):
            order = [names[i] for i in rng.permutation(len(names))]
            order.insert(int(rng.integers(0, len(order) + 1)), "reference")  # the reference's second half
            orders.append(order)
            halfway = (int(bounds[r]) + int(bounds[r + 1])) // 2
            for position, name in enumerate(order):
                part = None
                until = int(bounds[r + 1])
                if name == "reference":
                    part = sum(1 for s in slices if s["run"] == "reference" and s["round"] == r)
                    until = halfway if part == 0 else until
                slices.append(dict(_slice(runs[name], until), round=r, position=position, run=name, part=part))
        for run in runs.values():
            run.memory_end("failure_free")
        failure_order = [strategies[i] for i in rng.permutation(len(strategies))]
        for name in ["reference", *failure_order]:
            runs[name].memory_start()
            runs[name].train_to_end()
            runs[name].memory_end("failures")
        results = {name: runs[name].collect() for name in names}
    finally:
        for run in runs.values():
            run.close()
    return results, {"rounds": rounds, "bounds": [int(b) for b in bounds], "orders": orders, "slices": slices,
                     "failure_order": failure_order}


def _slice(run: StrategyRun, until: int) -> dict:
    """Trains ``run`` to step ``until`` as one timed slice: samples, wall seconds, CPU seconds by process."""
    before, first_step = run.cpu_seconds(), run.trainer.step
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    run.pause_timers(False)
    samples = run.advance(until)
    run.pause_timers(True)  # waits for the writes this slice started: their time is charged here
    wall = time.perf_counter() - t0
    after = run.cpu_seconds()
    return {"first_step": int(first_step), "end_step": int(run.trainer.step), "samples": int(samples),
            "wall_s": wall, "cpu_s": {part: after[part] - before[part] for part in before}, "load_average": load}


def _run_torchrun(tcfg, workers: int, records_dir: Path, fail_at, kill, label) -> dict:
    config_path = records_dir / "config.json"
    config_path.write_text(json.dumps(dataclasses.asdict(tcfg)))
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc_per_node={workers}", "-m", "ecrec.bench.trainer", str(config_path)]
    # the checkpointing strategies' workers talk through gloo (baselines.workers): on the loopback interface
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    rank0 = records_dir / "rank0.jsonl"
    killed = False  # per run (a flag on ``kill``, a bound method, was shared by every strategy's run)
    try:
        while proc.poll() is None:
            step = _last_step(rank0)
            _progress(label, step, tcfg.steps)
            if fail_at is not None and step >= fail_at and not killed:
                kill()
                killed = True
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun workers failed with exit code {proc.returncode}")
    _progress(label, tcfg.steps, tcfg.steps, done=True)
    records = []
    for path in sorted(records_dir.glob("rank*.jsonl")):
        rank = int(path.stem[len("rank"):])
        records += [dict(json.loads(line), rank=rank) for line in path.read_text().splitlines() if line]
    records.sort(key=lambda r: r["end"])
    summaries = {int(p.name[len("rank"):].split(".", 1)[0]): json.loads(p.read_text())
                 for p in records_dir.glob("rank*.result.json")}
    summary = summaries[0]  # rank 0: the evaluation and the checkpoint driver (every rank's pushes counted)
    return {"records": records, "evaluation": summary["evaluation"], "driver": summary["driver"],
            "client_bytes": sum(s["client_bytes"] for s in summaries.values()), "cluster": None,
            "interval": summary.get("interval")}


def _last_step(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError):
        return 0


def _progress(label: str, step: int, total: int, done: bool = False) -> None:
    from ecrec.ops import console

    console.progress(label, step, total, done)  # rich bars on a terminal, plain lines in a log


def _final_state(cluster, local) -> dict | None:
    if cluster is None:
        return None
    state = {}
    for t in cluster.refresh_map().tables:
        _, payload = cluster.read_payload(t.name)
        state[t.name] = payload.view(np.uint32).copy()
    for d in cluster.map.dense:
        state["dense:" + d.name] = cluster.read_dense_payload(d.name)[: int(np.prod(d.shape))].view(np.uint32).copy()
    return state


def _strategy_stats(local, strategy: str) -> dict:
    from ecrec.client import Cluster

    try:
        c = Cluster.connect(local.coordinator_address, wait_ready_s=30)
        return {str(i): v for i, v in c.strategy_call("stats").items()}
    except Exception as exc:  # noqa: BLE001 - the report says so
        return {"error": str(exc)}
