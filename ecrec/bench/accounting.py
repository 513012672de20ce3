"""Every figure of ``ecrec-bench compare``'s table, as a pure function of the records a run saves.

A run saves its steps (:data:`STEP_FIELDS`, one column each, :func:`step_columns`), the cluster's events
(``kind``, ``index``, ``wall_time``), its kills and, for the failure-free measurement, its slices
(:data:`SLICE_FIELDS`).  Nothing here reads a clock or a process: the report recomputed from a JSON's
records is the report.

- *Failures* (:func:`failure_account`): the rate is measured for each failure and each worker from that
  worker's steps just before the kill (time in steps, so harness time between steps counts for no
  strategy); the window closes at full redundancy, back to speed, and only once training is past the
  furthest step reached before the kill; lost = paused + replayed + deficit, with the noise of that
  figure from the spread of the steps.
- *Overhead* (:func:`overhead`): per round, reference rate / strategy rate from slices of the same round;
  the median over rounds and a seeded bootstrap interval of that same median, for wall time and CPU;
  the A/A row sets the reference's two slices of each round against each other.

See ``ecrec.bench.lost_training`` for useful steps and back to speed.
"""

from __future__ import annotations

import math

import numpy as np

from ecrec.bench.lost_training import back_to_speed, mean_and_range, useful_mask, useful_timeline

#: the columns of a saved step; ``useful`` is derived (a step past the furthest its worker reached)
STEP_FIELDS = ("worker", "step", "start", "end", "samples", "useful", "rewind_to", "rows", "rows_on_failed")
#: the columns of a saved failure-free slice; ``part`` splits the reference's slice of a round in two
SLICE_FIELDS = ("round", "position", "run", "part", "first_step", "end_step", "samples", "wall_s", "cpu_s")
RATE_STEPS = 50  # the rate of a failure: at most this many steps just before the kill
NOISE_Z = 1.96  # lost training's noise: this many standard deviations
BOOTSTRAP_RESAMPLES = 4000
#: per-failure figures summarized as mean (the key) and range (key + "_range")
FAILURE_FIELDS = ("max_stall_s", "promotion_s", "fully_redundant_s", "recovery_s", "throughput_during_recovery_ratio",
                  "lost_training_s", "paused_s", "replayed_s", "deficit_s", "window_s", "lost_training_noise_s")


# --- step records ---------------------------------------------------------------------------------------
def worker_of(record: dict) -> int:
    return int(record.get("worker", record.get("rank", 0)))


def step_columns(records: list[dict], failed_server: int | None = None) -> dict:
    """The run's steps as JSON columns (:data:`STEP_FIELDS`); ``rows_on_failed``: rows each step pushed to
    ``failed_server``."""
    useful = useful_mask(records)
    key = str(failed_server)

    def on_failed(r):
        by = r.get("rows_by_server") or {}
        return int(by.get(key, by.get(failed_server, 0))) if failed_server is not None else 0

    return {"worker": [worker_of(r) for r in records], "step": [int(r["step"]) for r in records],
            "start": [float(r["start"]) for r in records], "end": [float(r["end"]) for r in records],
            "samples": [int(r["samples"]) for r in records], "useful": [bool(u) for u in useful],
            "rewind_to": [r.get("rewind_to") for r in records], "rows": [int(r.get("rows", 0)) for r in records],
            "rows_on_failed": [on_failed(r) for r in records]}


def step_records(columns: dict) -> list[dict]:
    """Records back from :func:`step_columns` (``rank`` = ``worker``, as the trainer writes them)."""
    names = [n for n in STEP_FIELDS if n in columns]
    out = [dict(zip(names, values)) for values in zip(*(columns[n] for n in names))]
    for r in out:
        r["rank"] = r["worker"]
    return out


def by_worker(records: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in records:
        out.setdefault(worker_of(r), []).append(r)
    return out


# --- failure-free rate ------------------------------------------------------------------------------------
def failure_free_rate(records: list[dict], first_kill_t: float | None, fail_at: int | None) -> tuple:
    """``(samples/s of the job, median step s)`` over the steps before the first kill (or ``fail_at``), the
    first calls' set-up left out; time in steps; W workers side by side make W times one worker's rate."""
    ends = np.array([r["end"] for r in records])
    if first_kill_t is not None:
        clean = int(np.sum(ends <= first_kill_t))
    else:
        clean = fail_at if fail_at is not None else len(records)
    before = records[min(10, clean // 4):clean]
    if not before:
        return None, None
    durations = np.array([r["end"] - r["start"] for r in before])
    workers = len({worker_of(r) for r in records}) or 1
    rate = workers * sum(r["samples"] for r in before) / max(float(durations.sum()), 1e-9)
    return float(rate), float(np.median(durations))


def rate_before(records: list[dict], kill_t: float, since: float = -math.inf, max_steps: int = RATE_STEPS) -> dict | None:
    """One worker's rate just before the kill: the last ``max_steps`` useful steps that ended before
    ``kill_t`` and started at or after ``since`` (the previous failure's window end, or when the run found
    it over); time in steps.  ``relative_se``: the standard error of the time per sample over its mean."""
    useful = useful_mask(records)
    picked = [r for r, u in zip(records, useful) if u and r["end"] <= kill_t and r["start"] >= since][-max_steps:]
    if not picked:
        return None
    durations = np.array([r["end"] - r["start"] for r in picked], dtype=np.float64)
    per_sample = durations / np.array([max(r["samples"], 1) for r in picked], dtype=np.float64)
    several = len(picked) > 1
    return {"samples_per_s": float(sum(r["samples"] for r in picked) / max(durations.sum(), 1e-12)),
            "median_step_s": float(np.median(durations)), "steps": len(picked), "from_t": float(picked[0]["start"]),
            "step_sd_s": float(durations.std(ddof=1)) if several else 0.0,
            "relative_se": float(per_sample.std(ddof=1) / per_sample.mean() / math.sqrt(len(picked))) if several
            else 0.0}


# --- one failure ------------------------------------------------------------------------------------------
def first_event_after(events: list[dict], kind: str, kill_t: float, limit: float) -> float | None:
    times = [e["wall_time"] for e in events if e["kind"] == kind and kill_t <= e["wall_time"] < limit]
    return min(times) if times else None


def passed_furthest_t(records: list[dict], kill_t: float) -> float | None:
    """The end of the first useful step after the kill past the furthest step reached before it."""
    useful = useful_mask(records)
    furthest = max((r["step"] for r, u in zip(records, useful) if u and r["start"] < kill_t), default=-math.inf)
    return next((r["end"] for r, u in zip(records, useful) if u and r["end"] > kill_t and r["step"] > furthest), None)


def window_end(records: list[dict], kill_t: float, back_t: float | None, redundant_t: float | None) -> float:
    """The window closes at the latest of back to speed, full redundancy and training past the furthest
    step reached before the kill; the last step when one of them never came."""
    last = records[-1]["end"]
    passed = passed_furthest_t(records, kill_t)
    if back_t is None or passed is None:
        return last
    return min(max(x for x in (back_t, redundant_t, passed) if x is not None), last)


def step_costs(records: list[dict], kill_t: float, end_t: float, rate: dict) -> dict:
    """Lost training of one worker over the window ``[kill_t, end_t]``, in time in steps (each step from the
    kill on counts its duration, a step under way at the kill whole): lost = that time - useful samples /
    rate = paused (the first step) + replayed + deficit."""
    useful = useful_mask(records)
    per_s = rate["samples_per_s"]
    inside = [i for i, r in enumerate(records) if r["end"] > kill_t]
    inside = [i for n, i in enumerate(inside) if n == 0 or records[inside[n - 1]]["end"] < end_t]
    paused = replayed = deficit = in_steps = 0.0
    useful_samples = 0
    for n, i in enumerate(inside):
        r = records[i]
        charged = r["end"] - r["start"]
        in_steps += charged
        expected = r["samples"] / per_s if useful[i] else 0.0
        useful_samples += int(r["samples"]) if useful[i] else 0
        if n == 0:
            paused = charged - expected
        elif useful[i]:
            deficit += charged - expected
        else:
            replayed += charged
    wall = records[inside[-1]]["end"] - min(kill_t, records[inside[0]]["start"])
    noise = NOISE_Z * math.hypot(math.sqrt(len(inside)) * rate["step_sd_s"],
                                 useful_samples / per_s * rate["relative_se"])
    return {"window_s": wall, "time_in_steps_s": in_steps, "useful_samples": useful_samples,
            "useful_throughput_ratio": useful_samples / in_steps / per_s if in_steps > 0 else 0.0,
            "paused_s": paused, "replayed_s": replayed, "deficit_s": deficit,
            "lost_training_s": paused + replayed + deficit, "lost_training_noise_s": noise,
            "samples_per_s_before": per_s, "rate_steps": rate["steps"]}


def failure_account(records: list[dict], events: list[dict], kill_t: float, next_kill_t: float | None,
                    since: float, kind: str) -> dict:
    """One failure's figures: promotion, redundancy, back to speed, max stall; per worker that met it (mean
    over them: they lose the same time side by side) the rate just before the kill and the lost training."""
    limit = next_kill_t if next_kill_t is not None else math.inf
    mine = [r for r in records if r["start"] < limit]  # steps after the next kill belong to that failure
    after = [r["end"] - r["start"] for r in mine if r["end"] > kill_t]
    promoted = first_event_after(events, "promoted", kill_t, limit)
    redundant = first_event_after(events, "redundant", kill_t, limit) if kind != "none" else None
    out = {"kill_t": kill_t, "max_stall_s": max(after) if after else None,
           "promotion_s": promoted - kill_t if promoted is not None else None,
           "fully_redundant_s": redundant - kill_t if redundant is not None else None, "recovery_s": None}
    costs, backs, ends = [], [], []
    for worker in by_worker(mine).values():
        rate = rate_before(worker, kill_t, since)
        if rate is None or not any(r["end"] > kill_t for r in worker):
            continue  # a worker done before the kill met nothing
        back = back_to_speed(worker, kill_t, rate["median_step_s"])
        end_t = window_end(worker, kill_t, back, redundant)
        costs.append(step_costs(worker, kill_t, end_t, rate))
        backs.append(back)
        ends.append(end_t)
    if not costs:
        return out
    if all(b is not None for b in backs):
        out["recovery_s"] = max(backs) - kill_t
    out.update({k: float(np.mean([c[k] for c in costs])) for k in costs[0]})
    out["useful_samples"] = int(sum(c["useful_samples"] for c in costs))
    out["rate_steps"] = int(min(c["rate_steps"] for c in costs))
    out["window_end_t"] = max(ends)
    out["throughput_during_recovery_ratio"] = out["useful_throughput_ratio"]
    return out


def failure_accounts(records: list[dict], events: list[dict], kills: list[dict], kind: str) -> list[dict]:
    """Each kill's :func:`failure_account`, its rate measured after the previous failure's window and
    after the kill's ``quiet_since`` (when the run found the previous failure over: recorded by the run)."""
    out, since = [], -math.inf
    for i, kill in enumerate(kills):
        next_t = kills[i + 1]["time"] if i + 1 < len(kills) else None
        since = max(since, kill.get("quiet_since") or -math.inf)  # the previous failure over, a standby settled
        figures = failure_account(records, events, kill["time"], next_t, since, kind)
        figures.update({key: kill.get(key) for key in ("step", "phase", "planned", "quiet_since")
                        if kill.get(key) is not None})
        since = figures.get("window_end_t", kill["time"])
        out.append(figures)
    return out


def failure_summary(per_failure: list[dict]) -> dict:
    """Mean (the key) and range (key + ``_range``) of each per-failure figure."""
    out = {}
    for key in FAILURE_FIELDS:
        summary = mean_and_range([f.get(key) for f in per_failure])
        out[key] = summary["mean"] if summary else None
        out[key + "_range"] = [summary["min"], summary["max"]] if summary else None
    return out


def lost_updates_of_none(records: list[dict], last_kill_t: float) -> int:
    """Row updates the killed server acknowledged before the last kill: what ``none`` loses."""
    return int(sum(r.get("rows_on_failed", 0) for r in records if r["end"] <= last_kill_t))


# --- one run's row -----------------------------------------------------------------------------------------
def strategy_row(record: dict, fail_at: int | None) -> dict:
    """A strategy's row of the table from its saved run record (``ecrec.bench.compare.run_record``)."""
    records = step_records(record["steps"])
    kills, kind = record["kills"], record["kind"]
    rate, median_step = failure_free_rate(records, kills[0]["time"] if kills else None, fail_at)
    out = {"strategy": record["strategy"], "samples_per_s_failure_free": rate, "median_step_s": median_step}
    out["failures"] = failure_accounts(records, record["events"], kills, kind)
    out["failures_planned"] = record.get("planned_failures", len(kills))
    out.update(failure_summary(out["failures"]))
    out["failure_timing"] = ("each failure at its own phase of one checkpoint interval: (i + 0.5) / n"
                             if kind == "checkpoint" else "each failure once the previous one is over")
    out.update(lost_updates(record, records, out["failures"]))
    evaluation = record.get("evaluation") or {}
    out["test_auc"], out["test_logloss"] = evaluation.get("auc"), evaluation.get("logloss")
    out["state_matches_failure_free"] = record.get("state_matches_failure_free")
    if kind == "erasure" and out["state_matches_failure_free"] and out["lost_updates"] is None:
        out["lost_updates"], out["pls"] = 0, 0.0
    elif kind == "erasure" and out["state_matches_failure_free"] is None and out["lost_updates"] is None \
            and rebuilt_without_loss(record.get("stats") or {}, out["failures"]):
        out["lost_updates"], out["pls"] = 0, 0.0  # several workers: no failure-free state to compare with
    out.update(resource_figures(record, records))
    if record.get("interval"):
        out["interval"] = record["interval"]
    out["timeline"] = mean_timeline([useful_timeline(records, k["time"], before_s=1.0, after_s=4.0, bucket_s=0.1)
                                     for k in kills])
    out["stats"] = record.get("stats") or {}
    return out


def rebuilt_without_loss(stats: dict, per_failure: list[dict]) -> bool:
    """Whether an erasure-coded run's every failure ended in full redundancy and its rebuilds reported no row
    lost (``rows_lost`` and ``parity_rows_lost`` of every server that rebuilt are 0): then no update was lost,
    which is what a run whose final state cannot be compared with a failure-free one (several workers) has."""
    servers = [v for v in stats.values() if isinstance(v, dict)]
    rebuilt = [v for v in servers if "rows_lost" in v]
    return (bool(per_failure) and all(f.get("fully_redundant_s") is not None for f in per_failure) and bool(rebuilt)
            and all(not v.get("rows_lost") and not v.get("parity_rows_lost") for v in rebuilt))


def lost_updates(record: dict, records: list[dict], per_failure: list[dict]) -> dict:
    """Lost updates and PLS: counted by the checkpoint driver, or for ``none`` every update the killed
    server acknowledged (None when neither applies); per failure when the driver saw each one."""
    driver, kind = record.get("driver"), record["kind"]
    total_rows = int(sum(r.get("rows", 0) for r in records))
    if driver:
        out = {"driver": {k: driver.get(k) for k in ("o_save_s", "o_load_s", "o_persist_s", "saves", "save_stall_s",
                                                    "full_interval_s", "interval_steps", "mode", "plan")},
               "lost_updates": driver["lost_updates"], "pls": driver["pls"],
               "lost_samples": driver.get("lost_samples"), "pls_samples": driver.get("pls_samples"),
               "updates_rolled_back": driver["updates_rolled_back"], "steps_redone": driver["steps_redone"]}
        if len(driver.get("failures") or []) == len(per_failure):
            for figures, event in zip(per_failure, driver["failures"]):
                figures["lost_updates"] = event.get("lost_updates")
                figures["lost_samples"] = event.get("lost_samples")
                figures["steps_redone"] = (event["step"] + 1 - event["resume_step"]
                                           if event.get("resume_step") is not None else None)
        return out
    if kind == "none" and record["kills"]:
        lost = lost_updates_of_none(records, record["kills"][-1]["time"])
        return {"lost_updates": lost, "pls": lost / max(total_rows, 1)}
    return {"lost_updates": None, "pls": None}


def resource_figures(record: dict, records: list[dict]) -> dict:
    """Memory kept for fault tolerance over model bytes, checkpoint and network bytes, rows, elapsed time."""
    per_server = [v for v in (record.get("stats") or {}).values() if isinstance(v, dict)]
    model_bytes = record.get("model_bytes") or 0
    redundancy = sum(v.get("redundancy_bytes", 0) for v in per_server)  # the mechanism's own (parity, MFU counters)
    accounting = sum(v.get("accounting_bytes", 0) for v in per_server)  # the benchmark's exact loss accounting
    return {"memory_overhead": (redundancy + accounting) / model_bytes if model_bytes else None,
            "memory_mechanism": redundancy / model_bytes if model_bytes else None, **memory_figures(record),
            "checkpoint_bytes": int(sum(v.get("bytes_written", 0) for v in per_server)),
            "network_bytes": int((record.get("client_bytes") or 0) + sum(v.get("parity_bytes_sent", 0)
                                                                        for v in per_server)),
            "rows_acknowledged": int(sum(r.get("rows", 0) for r in records)),
            "elapsed_s": float(records[-1]["end"] - records[0]["start"]) if records else None}


#: the memory phases a run records, in the order the report prefers for its steady and peak figures
MEMORY_PHASES = ("failure_free", "run")


def memory_figures(record: dict) -> dict:
    """The servers' memory over the model's bytes: ``memory_steady`` (resident at the end of the failure-free
    phase) and ``memory_peak`` (the peak within it: saves and their temporaries included), and
    ``memory_peak_failures`` (the peak through the failures: promotion, reload, rebuild); None where not
    recorded.  :func:`table` adds each one's excess over the reference (``none``) as ``*_over_none``."""
    model_bytes = record.get("model_bytes") or 0
    memory = record.get("memory") or {}
    steady = next((memory[p] for p in MEMORY_PHASES if p in memory), None)
    failures = memory.get("failures")

    def per_model(reading, key):
        return reading[key] / model_bytes if reading and model_bytes and reading.get(key) else None

    return {"memory_steady": per_model(steady, "rss_bytes"), "memory_peak": per_model(steady, "peak_rss_bytes"),
            "memory_peak_failures": per_model(failures, "peak_rss_bytes")}


def memory_over_reference(row: dict, reference: dict) -> dict:
    """``row``'s memory figures (:func:`memory_figures`) less the reference's: what fault tolerance costs."""
    out = {}
    for key in ("memory_steady", "memory_peak", "memory_peak_failures"):
        mine, base = row.get(key), reference.get(key)
        out[key + "_over_none"] = mine - base if mine is not None and base is not None else None
    return out


def mean_timeline(timelines: list[dict]) -> dict:
    """Useful samples per second around the failures, averaged over them (time 0 = the kill)."""
    if not timelines:
        return {"t": [], "useful_samples_per_s": [], "failures": 0}
    values = np.mean([tl["useful_samples_per_s"] for tl in timelines], axis=0)
    return {"t": timelines[0]["t"], "useful_samples_per_s": [float(v) for v in values], "failures": len(timelines),
            "bucket_s": timelines[0]["bucket_s"]}


# --- overhead ---------------------------------------------------------------------------------------------
def round_rates(slices: list[dict], run: str) -> list[float]:
    """Per round, samples per wall second of ``run``'s slices of that round (its parts together)."""
    rounds = sorted({s["round"] for s in slices if s["run"] == run})
    out = []
    for r in rounds:
        mine = [s for s in slices if s["run"] == run and s["round"] == r]
        out.append(sum(s["samples"] for s in mine) / max(sum(s["wall_s"] for s in mine), 1e-12))
    return out


def round_cpu_per_sample(slices: list[dict], run: str) -> list[float]:
    """Per round, CPU seconds (worker, servers, coordinator) per sample of ``run``'s slices of that round."""
    rounds = sorted({s["round"] for s in slices if s["run"] == run})
    out = []
    for r in rounds:
        mine = [s for s in slices if s["run"] == run and s["round"] == r]
        cpu = sum(sum(s["cpu_s"].values()) for s in mine)
        out.append(cpu / max(sum(s["samples"] for s in mine), 1))
    return out


def bootstrap_median_interval(values, seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES) -> tuple:
    """The 95 % percentile-bootstrap interval of the median (None, None with fewer than two values)."""
    xs = np.asarray(list(values), dtype=np.float64)
    if xs.size < 2:
        return None, None
    rng = np.random.default_rng(seed)
    medians = np.median(xs[rng.integers(0, xs.size, size=(resamples, xs.size))], axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)


def median_with_interval(values, seed: int = 0) -> dict:
    """The median of per-round values and the bootstrap interval of that same median."""
    xs = [float(v) for v in values]
    if not xs or not all(math.isfinite(x) for x in xs):
        raise ValueError(f"need one or more finite values, got {xs!r}")
    low, high = bootstrap_median_interval(xs, seed)
    return {"median": float(np.median(xs)), "mean": float(np.mean(xs)), "ci95_low": low, "ci95_high": high,
            "low": min(xs), "high": max(xs), "rounds": len(xs), "within_noise": None if low is None else low <= 0.0 <= high,
            "method": "median over rounds, 95 % percentile bootstrap of the median"}


def ratio_statistic(numerators, denominators, seed: int = 0) -> dict:
    """Per round ``numerator / denominator - 1`` (an overhead): median, its interval, the log-ratios."""
    a, b = np.asarray(list(numerators), dtype=np.float64), np.asarray(list(denominators), dtype=np.float64)
    if a.shape != b.shape or a.size == 0 or np.any(a <= 0) or np.any(b <= 0):
        raise ValueError(f"need the same number (>= 1) of positive values, got {a.tolist()} and {b.tolist()}")
    out = median_with_interval(a / b - 1.0, seed)
    out["log_ratios"] = np.log(a / b).tolist()
    return out


def overhead(slices: list[dict], run: str, reference: str = "reference", seed: int = 0) -> dict:
    """``run``'s wall-time and CPU overhead over ``reference``, paired per round."""
    ref_rates, rates = round_rates(slices, reference), round_rates(slices, run)
    wall = ratio_statistic(ref_rates, rates, seed)
    cpu = ratio_statistic(round_cpu_per_sample(slices, run), round_cpu_per_sample(slices, reference), seed)
    return {"wall": wall, "cpu": cpu, "samples_per_s_rounds": rates}


def aa_overhead(slices: list[dict], reference: str = "reference", seed: int = 0) -> dict | None:
    """The reference against itself, the statistic of :func:`overhead` with the first part of each round in
    the strategy's place and the second in the reference's (each part a slice of its own at its own place in
    the round's order); None without two parts per round."""
    parts = {}
    for s in slices:
        if s["run"] == reference and s.get("part") is not None:
            parts.setdefault(s["round"], {})[s["part"]] = s
    pairs = [p for _, p in sorted(parts.items()) if len(p) == 2]
    if not pairs:
        return None

    def rate(s):
        return s["samples"] / max(s["wall_s"], 1e-12)

    def cpu(s):
        return sum(s["cpu_s"].values()) / max(s["samples"], 1)

    first, second = ([p[k] for p in pairs] for k in sorted(pairs[0]))
    return {"wall": ratio_statistic([rate(s) for s in second], [rate(s) for s in first], seed),
            "cpu": ratio_statistic([cpu(s) for s in first], [cpu(s) for s in second], seed)}


def paired_difference(slices: list[dict], a: str, b: str, reference: str = "reference", seed: int = 0) -> dict:
    """``overhead(a) - overhead(b)`` per round (wall time), its median and interval."""
    ref = np.asarray(round_rates(slices, reference))
    diff = ref / np.asarray(round_rates(slices, a)) - ref / np.asarray(round_rates(slices, b))
    return median_with_interval(diff, seed)


# --- conditions -------------------------------------------------------------------------------------------
def load_warnings(load_averages: dict, cores: int) -> list[str]:
    """A line for each run whose one-minute load average at any of its readings (before, after, ...)
    exceeded the cores."""
    out = []
    for name, load in load_averages.items():
        worst = max((reading[0] for reading in (load or {}).values() if reading), default=0.0)
        if worst > cores:
            out.append(f"{name}: load average {worst:.1f} on {cores} cores (other jobs ran beside it)")
    return out


# --- the failure-free columns of the table ----------------------------------------------------------------
#: the paired differences the report quotes (CPR's variants against CPR, ECRec against the others)
DIFFERENCES = (("cpr-mfu", "cpr"), ("cpr-ssu", "cpr"), ("ecrec", "full"), ("ecrec", "cpr"))


def overhead_fields(slices: list[dict], run: str, seed: int = 0) -> dict:
    """A strategy's failure-free columns from the slices: rate per round and its median, the wall and CPU
    overheads (median per-round ratio to the reference, minus 1) with their intervals."""
    figures = overhead(slices, run, seed=seed)
    return {"samples_per_s_rounds": figures["samples_per_s_rounds"],
            "samples_per_s_failure_free": float(np.median(figures["samples_per_s_rounds"])),
            "overhead_vs_none": figures["wall"]["median"], "overhead_spread": figures["wall"],
            "cpu_overhead_vs_none": figures["cpu"]["median"], "cpu_overhead_spread": figures["cpu"]}


def reference_fields(slices: list[dict], reference: str = "reference", seed: int = 0) -> dict:
    """The reference's rate per round, their spread over the median (``noise``) and the A/A row."""
    rates = np.asarray(round_rates(slices, reference))
    base = float(np.median(rates))
    return {"samples_per_s_rounds": rates.tolist(), "samples_per_s_failure_free": base,
            "noise": float((rates.max() - rates.min()) / base), "aa_overhead": aa_overhead(slices, reference, seed)}


def differences(slices: list[dict], names, seed: int = 0) -> dict:
    """:func:`paired_difference` of each pair of :data:`DIFFERENCES` that ran, with more than one round."""
    rounds = len({s["round"] for s in slices})
    return {f"{a} - {b}": paired_difference(slices, a, b, seed=seed)
            for a, b in DIFFERENCES if a in names and b in names and rounds > 1}


def cpu_ms_per_step(slices: list[dict], run: str) -> dict:
    """CPU milliseconds per failure-free step of ``run``, by process and in total, over all its slices."""
    mine = [s for s in slices if s["run"] == run]
    steps = max(sum(s["end_step"] - s["first_step"] for s in mine), 1)
    parts = {part: 1e3 * sum(s["cpu_s"][part] for s in mine) / steps for part in ("worker", "servers", "coordinator")}
    parts["total"] = parts["worker"] + parts["servers"] + parts["coordinator"]
    return parts


# --- the whole table ----------------------------------------------------------------------------------------
def table(runs: dict, slices: list[dict] | None, strategies: list[str], fail_at: int | None, seed: int = 0,
          cost_mtbf_s=()) -> dict:
    """The report's figures from the saved records: ``reference`` (its row), ``rows`` (one per strategy),
    ``differences`` and ``costs`` (the expected cost per day at each MTBF of ``cost_mtbf_s``, seconds:
    ``ecrec.bench.cost``, keyed by the MTBF in hours).  With slices (side by side) the failure-free columns
    come from them; without, from the steps, the reference run before (``reference``) and after
    (``reference2``) the strategies."""
    out = _table(runs, slices, strategies, fail_at, seed)
    from ecrec.bench.cost import cost_table

    model_bytes = runs["reference"].get("model_bytes") or None
    out["costs"] = {f"{mtbf / 3600:g}": cost_table(out["rows"], mtbf, model_bytes) for mtbf in cost_mtbf_s}
    return out


def _table(runs: dict, slices: list[dict] | None, strategies: list[str], fail_at: int | None, seed: int) -> dict:
    reference = strategy_row(runs["reference"], None)
    rows = [strategy_row(runs[name], fail_at) for name in strategies]
    for row in rows:
        row.update(memory_over_reference(row, reference))
    if slices:
        reference.update(reference_fields(slices, seed=seed), cpu_ms_per_step=cpu_ms_per_step(slices, "reference"))
        for row in rows:
            row.update(overhead_fields(slices, row["strategy"], seed),
                       cpu_ms_per_step=cpu_ms_per_step(slices, row["strategy"]))
        return {"reference": reference, "rows": rows, "differences": differences(slices, strategies, seed)}
    again = strategy_row(runs["reference2"], None) if "reference2" in runs else reference
    rates = [reference["samples_per_s_failure_free"], again["samples_per_s_failure_free"]]
    base = float(np.mean(rates)) if all(rates) else None
    reference["samples_per_s_runs"] = rates
    reference["noise"] = abs(rates[1] - rates[0]) / base if base else None
    for row in rows:
        rate = row["samples_per_s_failure_free"]
        row["overhead_vs_none"] = (base / rate - 1.0) if rate and base else None
    return {"reference": reference, "rows": rows, "differences": {}}
