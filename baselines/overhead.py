"""The checkpoint overhead model of CPR (Maeng et al., the CPR paper, MLSys 2021): pure functions, no I/O.

Symbols (seconds unless said otherwise):

- ``t_save``: checkpoint interval (time between the starts of two saves);
- ``mtbf``: mean time between failures of the job (``T_fail``);
- ``o_save``, ``o_load``, ``o_res``: cost of one save (the time training is stalled by it),
  one load, one reschedule (restart) after a failure;
- ``n_emb``: number of embedding shards (servers);
- ``t_total``: failure-free training time; overheads are returned in the same unit as
  ``t_total`` (with the default ``t_total=1`` they are fractions of the training time).

Full recovery (every node reloads the last checkpoint and redoes the lost work)::

    O_full = o_save * t_total / t_save + (t_total / mtbf) * (o_load + o_res + t_save / 2)

whose optimum is Young's ``t_save = sqrt(2 * o_save * mtbf)``; Daly's higher-order
refinement is :func:`daly_interval`.  The save's stall ``o_save`` is not its whole cost: the
write runs on after it for ``o_persist`` seconds (``persist_s``), a save cannot start before the
previous one is on disk, and a failure meanwhile falls back to the checkpoint before.  So the
interval is at least ``o_persist`` and a failure loses ``t_save / 2 + o_persist`` of work on average
(``persist_s`` of :func:`optimal_full_interval`, :func:`full_overhead`, :func:`plan_recovery`).  Partial recovery (only the failed shard reloads,
nobody redoes work) has no lost-computation term::

    O_partial = o_save * t_total / t_save + (t_total / mtbf) * (o_load + o_res)

so its overhead falls as the interval grows and accuracy bounds it instead: the
expected portion of lost updates is ``PLS ~= t_save / (2 * n_emb * mtbf)`` (one shard of
``n_emb`` loses on average half an interval of its updates per failure), hence the
interval for a target PLS ``p`` is ``t_save = 2 * p * n_emb * mtbf``.

:func:`plan_recovery` makes CPR's choice: partial recovery at the PLS-bounded interval
when its modelled overhead is below full recovery's at its own optimum, full recovery
otherwise (a very small PLS target forces saves so frequent that rolling everything back
is cheaper).  The benchmark's ``simulate`` command reuses these functions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

FORMULAS = ("young", "daly")


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return value


def _non_negative(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


def young_interval(o_save: float, mtbf: float) -> float:
    """Young (1974): ``sqrt(2 * o_save * mtbf)``."""
    return math.sqrt(2.0 * _positive("o_save", o_save) * _positive("mtbf", mtbf))


def daly_interval(o_save: float, mtbf: float) -> float:
    """Daly (2006) higher-order optimum of the compute time between checkpoints.

    ``sqrt(2 d M) * (1 + sqrt(d / 2M) / 3 + (d / 2M) / 9) - d`` for ``d < 2M``, else ``M``
    (``d = o_save``, ``M = mtbf``).
    """
    d, m = _positive("o_save", o_save), _positive("mtbf", mtbf)
    if d >= 2.0 * m:
        return m
    x = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - d


def optimal_full_interval(o_save: float, mtbf: float, formula: str = "daly", persist_s: float = 0.0) -> float:
    """Young's or Daly's optimum from the stall ``o_save``, and never below the persist time ``persist_s``."""
    persist_s = _non_negative("persist_s", persist_s)
    if formula == "young":
        return max(young_interval(o_save, mtbf), persist_s)
    if formula == "daly":
        return max(daly_interval(o_save, mtbf), persist_s)
    raise ValueError(f"formula must be one of {FORMULAS}, got {formula!r}")


def full_overhead(t_save: float, o_save: float, o_load: float, mtbf: float, o_res: float = 0.0,
                  t_total: float = 1.0, persist_s: float = 0.0) -> float:
    """``O_full``: saves plus, per failure, load, reschedule and half an interval (plus the persist latency) of
    redone work."""
    t_save, mtbf = _positive("t_save", t_save), _positive("mtbf", mtbf)
    o_save, o_load, o_res = _non_negative("o_save", o_save), _non_negative("o_load", o_load), _non_negative("o_res", o_res)
    persist_s = _non_negative("persist_s", persist_s)
    return o_save * t_total / t_save + (t_total / mtbf) * (o_load + o_res + t_save / 2.0 + persist_s)


def partial_overhead(t_save: float, o_save: float, o_load: float, mtbf: float, o_res: float = 0.0,
                     t_total: float = 1.0) -> float:
    """``O_partial``: saves plus, per failure, load and reschedule (no work is redone)."""
    t_save, mtbf = _positive("t_save", t_save), _positive("mtbf", mtbf)
    o_save, o_load, o_res = _non_negative("o_save", o_save), _non_negative("o_load", o_load), _non_negative("o_res", o_res)
    return o_save * t_total / t_save + (t_total / mtbf) * (o_load + o_res)


def expected_pls(t_save: float, n_emb: int, mtbf: float) -> float:
    """Modelled portion of lost updates with partial recovery: ``t_save / (2 n_emb mtbf)``."""
    if int(n_emb) < 1:
        raise ValueError(f"n_emb must be >= 1, got {n_emb}")
    return _positive("t_save", t_save) / (2.0 * int(n_emb) * _positive("mtbf", mtbf))


def interval_for_pls(target_pls: float, n_emb: int, mtbf: float) -> float:
    """Partial-recovery interval for a target PLS: ``2 * target_pls * n_emb * mtbf``."""
    p = float(target_pls)
    if not (math.isfinite(p) and 0 < p < 1):
        raise ValueError(f"target_pls must be in (0, 1), got {target_pls}")
    if int(n_emb) < 1:
        raise ValueError(f"n_emb must be >= 1, got {n_emb}")
    return 2.0 * p * int(n_emb) * _positive("mtbf", mtbf)


def pls(lost_updates: int, all_updates: int) -> float:
    """Measured PLS: lost row updates / all row updates (0 when nothing was updated)."""
    if lost_updates < 0 or all_updates < 0:
        raise ValueError(f"update counts must be >= 0, got lost={lost_updates} all={all_updates}")
    return float(lost_updates) / float(all_updates) if all_updates else 0.0


@dataclass(frozen=True)
class RecoveryPlan:
    """CPR's decision: which recovery, at which interval, and why (both modelled overheads)."""

    recovery: str  # "partial" | "full"
    interval_s: float  # the interval to use for the chosen recovery
    full_interval_s: float  # full recovery's optimum
    partial_interval_s: float  # the PLS-bounded interval
    full_overhead: float  # fraction of training time, each at its own interval
    partial_overhead: float
    expected_pls: float  # of partial recovery at partial_interval_s (0 when full is chosen)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_recovery(o_save: float, o_load: float, mtbf: float, n_emb: int, target_pls: float, o_res: float = 0.0,
                  formula: str = "daly", persist_s: float = 0.0) -> RecoveryPlan:
    """Chooses partial or full recovery by modelled overhead (fractions of training time)."""
    t_full = optimal_full_interval(max(float(o_save), 1e-9), mtbf, formula, persist_s)
    t_partial = max(interval_for_pls(target_pls, n_emb, mtbf), persist_s)
    o_full = full_overhead(t_full, o_save, o_load, mtbf, o_res, persist_s=persist_s)
    o_part = partial_overhead(t_partial, o_save, o_load, mtbf, o_res)
    if o_part < o_full:
        return RecoveryPlan("partial", t_partial, t_full, t_partial, o_full, o_part, expected_pls(t_partial, n_emb, mtbf))
    return RecoveryPlan("full", t_full, t_full, t_partial, o_full, o_part, 0.0)
