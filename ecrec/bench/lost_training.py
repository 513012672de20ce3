"""What one failure costs a training job, computed from a worker's step records (pure functions, no I/O).

A record is one training step as ``ecrec.bench.trainer`` writes it: ``step`` (the data position),
``start`` and ``end`` (wall clock), ``samples`` and ``rewind_to`` (set on the step whose failure
made full recovery roll every server back).

*Useful progress.*  A step is useful when it takes the job past the furthest point reached before
it: its step index exceeds every earlier step that stuck (a rolled-back step does not stick).
Replays after a rollback are not useful, so a rollback shows as the dip it is.

*The window of a failure* runs from the kill to full redundancy or back to speed, whichever is
later.  Inside it, with ``rate`` the job's failure-free samples per second, the training lost is

    lost_training_s = window - useful samples / rate = paused_s + replayed_s + deficit_s

split by where the time went: ``paused_s`` from the kill to the end of the first step after it
(detection, promotion, reload or rollback; less one normal step when that step was useful; from
the start of the step under way at the kill when the kill fell inside a step),
``replayed_s`` the steps redone after a rollback, ``deficit_s`` the time the useful steps took
beyond the failure-free speed (rebuilds competing with training).

*Failure phases.*  A checkpointing strategy loses what it did since its last save, so where a
failure falls in the checkpoint interval decides its cost.  :func:`failure_phases` spreads
``n`` failures over one interval, one in each of ``n`` equal parts: at their midpoints, or (with a
seed, as ``compare`` runs them) at points drawn in mirrored pairs ``x``, ``1 - x`` and kept off the
grid of the partial saves.  Either way their mean phase is exactly one half, so a cost linear in the
phase averages to its expected value.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

#: a step after the failure counts as back to speed when the median of it and the next steps
#: (``BACK_TO_SPEED_STEPS`` in all) takes at most ``BACK_TO_SPEED_SLACK`` x the failure-free median step
BACK_TO_SPEED_STEPS = 5
BACK_TO_SPEED_SLACK = 1.25


def failure_phases(count: int, seed: int | None = None, avoid: int = 0, margin: float = 0.02) -> list[float]:
    """``count`` points of one checkpoint interval, as fractions of it, one in each of ``count`` equal parts;
    their mean is exactly one half.

    Without ``seed``: the midpoints ``(i + 0.5) / count``.  With ``seed``: the first half drawn uniformly in
    their parts and the second half their mirror images ``1 - x`` (the middle one of an odd count at one half),
    all at least ``margin`` from every multiple of ``1 / avoid`` (the partial saves, ``avoid`` per interval) so
    that no failure meets a save at the same instant.  The middle one, when one half is on that grid, moves to
    ``0.5 + margin`` and the mirror of the first point ``margin`` earlier, which keeps the mean.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"the number of failures must be an integer >= 1, got {count!r}")
    if seed is None:
        return [(i + 0.5) / count for i in range(count)]
    if isinstance(avoid, bool) or not isinstance(avoid, int) or avoid < 0:
        raise ValueError(f"avoid must be an integer >= 0, got {avoid!r}")
    if not (isinstance(margin, (int, float)) and math.isfinite(margin) and 0 <= margin < 0.5 / count):
        raise ValueError(f"margin must be in [0, {0.5 / count:g}) for {count} failures, got {margin!r}")

    def off_grid(x: float) -> bool:
        return not avoid or min(abs(x - k / avoid) for k in range(avoid + 1)) >= margin - 1e-12

    rng = np.random.default_rng(seed)
    half = count // 2
    for _ in range(10_000):
        first = [float(rng.uniform(i / count + margin, (i + 1) / count - margin)) for i in range(half)]
        phases = first + ([0.5] if count % 2 else []) + [1.0 - x for x in reversed(first)]
        if count % 2 and not off_grid(0.5):
            if not half:  # one failure, and one half is a save: the nearest point off the grid
                return [0.5 + margin]
            phases[half] = 0.5 + margin
            phases[-1] -= margin  # the mirror of the first point: the mean stays one half
        inside = all(i / count <= x < (i + 1) / count for i, x in enumerate(phases))
        if inside and all(off_grid(x) for x in phases):
            return phases
    raise ValueError(f"no {count} failure phases at least {margin} from every 1/{avoid} of the interval")


def useful_mask(records: list[dict]) -> np.ndarray:
    """For each record, whether it took its worker (``rank``; several workers step side by side) past every
    step of that worker that stuck before it."""
    useful = np.zeros(len(records), dtype=bool)
    furthest: dict = {}
    for i, r in enumerate(records):
        if r.get("rewind_to") is not None:
            continue  # rolled back with the failure it met: neither useful nor reached
        rank = r.get("rank", 0)
        if r["step"] > furthest.get(rank, -math.inf):
            useful[i] = True
            furthest[rank] = r["step"]
    return useful


def furthest_step_before(records: list[dict], t: float) -> int | None:
    """The furthest step reached before ``t``: the furthest that stuck among the steps started before it."""
    steps = [r["step"] for r in records if r["start"] < t and r.get("rewind_to") is None]
    return max(steps) if steps else None


def back_to_speed(records: list[dict], kill_t: float, median_step_s: float) -> float | None:
    """When training is back to full speed after the failure at ``kill_t``: the end of the first useful
    step past the furthest step reached before the failure from which the next steps run at failure-free
    speed (None when that never happens)."""
    if not median_step_s or median_step_s <= 0:
        raise ValueError(f"median_step_s must be > 0, got {median_step_s!r}")
    furthest = furthest_step_before(records, kill_t)
    useful = useful_mask(records)
    durations = np.array([r["end"] - r["start"] for r in records])
    for i, r in enumerate(records):
        if r["end"] <= kill_t or not useful[i] or (furthest is not None and r["step"] <= furthest):
            continue
        window = durations[i:i + BACK_TO_SPEED_STEPS]
        if len(window) and np.median(window) <= BACK_TO_SPEED_SLACK * median_step_s:
            return float(r["end"])
    return None


@dataclass(frozen=True)
class FailureCost:
    """The cost of one failure over its window (seconds unless said otherwise)."""

    kill_t: float
    window_s: float  # from the kill (or the start of the step under way then) to the end of the window
    useful_samples: int
    useful_throughput_ratio: float  # useful samples per second in the window / failure-free rate
    paused_s: float
    replayed_s: float
    deficit_s: float
    lost_training_s: float  # paused + replayed + deficit = window - useful samples / rate

    def to_dict(self) -> dict:
        return asdict(self)


def failure_cost(records: list[dict], kill_t: float, window_end_t: float, rate: float) -> FailureCost:
    """Useful progress and lost training time of the failure at ``kill_t`` (see the module docstring).

    ``window_end_t`` is moved to the end of the step running at that moment, and the window's start to the
start of the step under way at the kill (if any), so no step is cut;
    ``rate`` is the failure-free samples per second of the same job.
    """
    if not (rate and rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be finite and > 0, got {rate!r}")
    if window_end_t < kill_t:
        raise ValueError(f"the window ends ({window_end_t}) before the failure ({kill_t})")
    useful = useful_mask(records)
    after = [i for i, r in enumerate(records) if r["end"] > kill_t]
    after.sort(key=lambda i: records[i]["end"])
    inside: list[int] = []
    for i in after:
        inside.append(i)
        if records[i]["end"] >= window_end_t:
            break
    if not inside:
        raise ValueError(f"no step ends after the failure at {kill_t}")
    end_t = records[inside[-1]]["end"]
    start_t = min(kill_t, records[inside[0]]["start"])  # a step under way at the kill belongs to the window
    paused = replayed = deficit = 0.0
    useful_samples = 0
    previous_end = start_t
    for n, i in enumerate(inside):
        r = records[i]
        span = r["end"] - previous_end  # the time this step stands for, waiting before it included
        previous_end = r["end"]
        if useful[i]:
            useful_samples += int(r["samples"])
        if n == 0:
            paused = span - (r["samples"] / rate if useful[i] else 0.0)
        elif useful[i]:
            deficit += span - r["samples"] / rate
        else:
            replayed += span
    window = end_t - start_t
    return FailureCost(kill_t=float(kill_t), window_s=float(window), useful_samples=useful_samples,
                       useful_throughput_ratio=float(useful_samples / window / rate) if window > 0 else 0.0,
                       paused_s=float(paused), replayed_s=float(replayed), deficit_s=float(deficit),
                       lost_training_s=float(paused + replayed + deficit))


def useful_timeline(records: list[dict], kill_t: float, before_s: float = 1.0, after_s: float = 3.0,
                    bucket_s: float = 0.1) -> dict:
    """Useful samples per second in buckets around the failure at ``kill_t`` (time 0 = the kill)."""
    if bucket_s <= 0 or before_s < 0 or after_s <= 0:
        raise ValueError("bucket_s and after_s must be > 0 and before_s >= 0")
    useful = useful_mask(records)
    ends = np.array([r["end"] - kill_t for r in records])
    samples = np.array([r["samples"] if u else 0 for r, u in zip(records, useful)], dtype=np.float64)
    edges = np.arange(-before_s, after_s + bucket_s / 2, bucket_s)
    counts, _ = np.histogram(ends, bins=edges, weights=samples)
    return {"t": [float(x) for x in edges[1:]], "useful_samples_per_s": [float(c / bucket_s) for c in counts],
            "bucket_s": bucket_s}


def mean_and_range(values: list[float | None]) -> dict | None:
    """``{"mean", "min", "max", "n"}`` of the values that are not None (None when none is)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return {"mean": float(np.mean(xs)), "min": min(xs), "max": max(xs), "n": len(xs)}
