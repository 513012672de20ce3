"""``ecrec-bench recovery --during-training``: a worker trains through the failure; training time lost.

The worker looks up every table of the recovery benchmark (embedding bags, ``--ids-per-sample`` uniform ids
per sample and table), feeds the sum to a linear head (registered on the servers, replicated like any dense
tensor) and pushes; step ``n`` always trains on the same batch, so a rolled-back step replays exactly.
``full`` and ``cpr`` are driven by ``baselines.driver.CheckpointDriver`` (initial checkpoint at the start,
intervals from the Young/Daly model or the PLS target at ``--mtbf-hours``).  One step record per step:
``{step, start, end, samples}``; the JSON keeps them all (``step_records``), with the cluster's events.

:func:`lost_training` turns the records into the training time lost to the failure: over the window from
the kill to the end of training, the wall time minus the time the *new* work done in it (steps past the
furthest step reached before the kill) takes at the pre-failure rate.  That is, in one number, the paused
time, the replayed steps' time and the integral of the throughput deficit while recovering; it is also
split into those three parts.
"""

from __future__ import annotations

import math
import time

import numpy as np


def first_event(local, kind: str, index: int, since: float) -> float | None:
    """Wall time of the first ``kind`` event of ``index`` at or after ``since`` in the map's events, or None."""
    return next((e.wall_time for e in local.cluster_map().events
                 if e.kind == kind and e.index == index and e.wall_time >= since), None)


def lost_training(records: list[dict], kill_time: float,
                  recovering_from: float | None = None, recovering_until: float | None = None) -> dict:
    """Training time lost to a failure at ``kill_time``, from step records (``step``, ``start``, ``end``,
    ``samples``; in the order run, a rolled-back step appears again).

    - ``rate_before``: samples/s over the steps that ended before the kill (time in steps);
    - ``lost_training_s``: ``(end - kill) - new samples / rate_before``, where new samples are those of steps
      past the furthest step reached before the kill, ``end`` the last record's end (a step
      under way at the kill counts whole: the window then starts at its start);
    - ``replayed_s``: time in steps at or below that furthest step (redone after a rollback);
    - ``paused_s``: time from the kill until the first step that started after it began, plus the first
      step's excess over the median step before (detection, promotion, reload, the first on-demand rebuild);
    - ``deficit_s``: the rest (slower steps while recovering);
    - ``throughput_ratio``: new samples per second while recovering, from ``recovering_from`` (the promotion;
      default the kill) to ``recovering_until`` (full redundancy), at least 2 s, over ``rate_before``;
      ``longest_step_s`` after the kill; ``median_step_s`` before.
    """
    before = [r for r in records if r["end"] <= kill_time]
    after = [r for r in records if r["end"] > kill_time]
    if not before or not after:
        raise ValueError("lost_training needs steps before and after the failure")
    durations_before = np.array([r["end"] - r["start"] for r in before])
    rate = sum(r["samples"] for r in before) / max(float(durations_before.sum()), 1e-9)
    median = float(np.median(durations_before))
    end = after[-1]["end"]
    furthest = max(r["step"] for r in before)
    new = replayed = 0.0
    high = furthest
    for r in after:
        if r["step"] > high:
            new += r["samples"]
            high = r["step"]
        else:
            replayed += r["end"] - r["start"]
    window_start = min(kill_time, after[0]["start"])  # a step under way at the kill counts whole
    lost = (end - window_start) - new / rate
    first = after[0]
    paused = max(0.0, first["start"] - kill_time) + max(0.0, (first["end"] - max(first["start"], kill_time)) - median)
    start = max(recovering_from or kill_time, kill_time)
    until = max(recovering_until or start, start + 2.0)
    in_new, high = 0.0, furthest
    for r in after:
        if r["step"] > high:
            high = r["step"]
            if start < r["end"] <= until:
                in_new += r["samples"]
    window = min(until, end) - start
    paused = min(paused, max(lost - replayed, 0.0))
    return {"rate_before": rate, "median_step_s": median, "lost_training_s": lost, "replayed_s": replayed,
            "paused_s": paused, "deficit_s": lost - replayed - paused,
            "throughput_ratio": (in_new / window) / rate if window > 0 else None,
            "longest_step_s": max(r["end"] - r["start"] for r in after), "window_s": end - kill_time}


class _Worker:
    """The benchmark's training loop (see the module docstring)."""

    def __init__(self, strategy: str, args, cluster, names: list[str]):
        import torch

        from ecrec.client import EmbeddingBagCollection

        torch.manual_seed(args.seed)
        torch.set_num_threads(1)
        self.args, self.cluster, self.names = args, cluster, names
        self.bags = EmbeddingBagCollection(cluster, names, mode="sum")
        self.head = torch.nn.Linear(args.dim * len(names), 1)
        cluster.register_dense(self.head, optimizer="sgd", lr=0.01)
        self.driver = None
        if strategy in ("full", "cpr"):
            from baselines.driver import CheckpointDriver

            self.driver = CheckpointDriver(cluster, mtbf_s=args.mtbf_hours * 3600)
            self.driver.start(0)
        self.step = 0
        self.records: list[dict] = []

    def batch(self, step: int):
        import torch

        rng = np.random.default_rng((self.args.seed, step))
        b, n = self.args.batch_size, self.args.ids_per_sample
        inputs = []
        for _ in self.names:
            ids = torch.from_numpy(rng.integers(0, self.args.rows, b * n))
            inputs.append((ids, torch.arange(0, b * n, n)))
        labels = torch.from_numpy(rng.integers(0, 2, b).astype(np.float32))
        return inputs, labels

    def train_one(self) -> None:
        import torch

        step = self.step
        t0 = time.time()
        inputs, labels = self.batch(step)
        pooled = self.bags(inputs)
        logits = self.head(torch.cat(pooled, dim=1)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        result = self.cluster.step()
        resume = self.driver.after_step(step, result) if self.driver is not None else None
        self.records.append({"step": step, "start": t0, "end": time.time(), "samples": len(labels),
                             "rewind_to": resume})
        self.step = resume if resume is not None else step + 1


def train_through_failure(strategy: str, args, local, cluster, names: list[str], measure_memory,
                          progress) -> dict:
    """Trains ``--before-s``, kills ``--fail-server``, trains until full redundancy plus ``--after-s``; returns
    the lost-training figures and a timeline.  ``measure_memory()`` (the servers' memory, just before the
    kill) and ``progress(text)`` come from the caller."""
    worker = _Worker(strategy, args, cluster, names)
    for _ in range(10):  # warm-up: first calls, compiled paths
        worker.train_one()
    worker.records.clear()
    t_start = time.time()
    while time.time() - t_start < args.before_s:
        worker.train_one()
    out = measure_memory()
    index = args.fail_server
    t_kill = time.time()
    local.kill(local.pid_of_index(index))
    progress(f"killed server {index} after {len(worker.records)} steps")
    redundant = None
    last_check = 0.0
    while time.time() - t_kill < args.max_s:
        worker.train_one()
        now = time.time()
        if redundant is None and now - last_check > 0.25:
            last_check = now
            redundant = first_event(local, "redundant", index, t_kill)
            if redundant is not None and strategy in ("full", "cpr") and worker.driver.events:
                redundant = max(redundant, t_kill + worker.driver.events[-1].seconds)
        if redundant is not None and now > max(redundant, t_kill) + args.after_s:
            break
    promoted = first_event(local, "promoted", index, t_kill)
    figures = lost_training(worker.records, t_kill, recovering_from=promoted, recovering_until=redundant)
    out.update({k if k != "rate_before" else "samples_per_s_before": v for k, v in figures.items()})
    out["redundant_s"] = redundant - t_kill if redundant is not None else None
    out["go_on_s"] = next(r["end"] for r in worker.records if r["end"] > t_kill) - t_kill  # the first step done
    out["promotion_s"] = promoted - t_kill if promoted else None
    out["steps"] = len(worker.records)
    if worker.driver is not None:
        report = worker.driver.report()
        out["checkpoint_interval_s"] = report.get("full_interval_s")
        out["o_save_s"], out["o_load_s"] = report.get("o_save_s"), report.get("o_load_s")
        out["steps_redone"] = report.get("steps_redone")
        out["lost_updates"] = report.get("lost_updates")
        interval = report.get("full_interval_s")
        if strategy == "full" and interval:
            # Young/Daly's expectation: a failure lands on average half an interval after the last checkpoint
            out["expected_lost_s"] = figures["paused_s"] + max(figures["deficit_s"], 0.0) + interval / 2
    if "expected_lost_s" not in out:
        out["expected_lost_s"] = figures["lost_training_s"]
    out["timeline"] = _timeline(worker.records, t_kill)
    out.update(saved_records(worker.records, local, t_kill, strategy))
    return out


def saved_records(records: list[dict], local, kill_t: float, strategy: str) -> dict:
    """Every step (``ecrec.bench.accounting.STEP_FIELDS``), the cluster's events and the kill, for the JSON,
    and the failure's figures as ``compare`` accounts them (``accounting``: the rate just before the kill)."""
    from ecrec.bench.accounting import failure_account, step_columns
    from ecrec.strategies import get_spec

    events = [dict(kind=e.kind, index=e.index, wall_time=e.wall_time) for e in local.cluster_map().events]
    kind = get_spec(strategy).kind
    return {"step_records": step_columns(records), "events": events, "kills": [{"time": kill_t}],
            "accounting": failure_account(records, events, kill_t, None, -math.inf, kind)}


def _timeline(records: list[dict], kill_time: float, bucket_s: float = 0.25) -> dict:
    ends = np.array([r["end"] - kill_time for r in records])
    samples = np.array([r["samples"] for r in records])
    edges = np.arange(ends.min() - bucket_s, ends.max() + bucket_s, bucket_s)
    counts, _ = np.histogram(ends, bins=edges, weights=samples)
    return {"t": [float(x) for x in edges[1:]], "samples_per_s": [float(c / bucket_s) for c in counts]}
