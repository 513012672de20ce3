"""Expected cost per day of training: which strategy costs least at a given MTBF and model size.

For each strategy, from figures a run measured (``compare``'s table rows, ``recovery``'s rows)::

    cost per day = overhead(M) x 86,400 s  +  failures per day x lost(M)        failures per day = 86,400 s / M

- ``overhead``: the failure-free wall-time overhead over ``none``, measured side by side (its interval too);
- ``lost``: training time lost per failure (paused + replayed + throughput deficit), measured failure by
  failure, mean and range;
- ``M``: the MTBF the cost is asked at.  A checkpointing strategy was run at an interval ``T_run`` its model
  chose for the run's MTBF; at ``M`` the same model chooses ``T_M`` (``full``: Daly's optimum from the
  measured save stall; ``cpr*``: the PLS interval, proportional to the MTBF; an interval given by hand stays).
  With ``r = T_M / T_run`` its overhead (saves per unit of time) becomes ``overhead / r`` and the replayed part
  of its loss (the work since the last save, half an interval on average) ``replayed x r``; the rest of the
  loss is taken as measured.  Counting all of a checkpointing strategy's overhead as save cost is the choice
  that favours it at a longer interval.
- ``cpr*`` also loses updates: ``lost updates per day`` = failures per day x lost updates per failure x ``r``
  (the updates since the last save).  ``none`` loses everything the failed shard learned since the start:
  no rate a short run can give (None).

The cost's interval (``low``-``high``) puts the overhead's 95 % interval together with the range (min to
max) of the loss per failure: not itself a 95 % interval.  ``overhead`` is extra time per unit of work,
counted against a day of wall time: the two differ by a factor ``1 + overhead``, negligible at small ones.
"""

from __future__ import annotations

import math

DAY_S = 86_400.0


def interval_ratio(interval: dict | None, mtbf_s: float) -> float:
    """``T_M / T_run`` for a strategy run with ``interval`` (``compare``'s record of how it was chosen);
    1 when it has none or it was given by hand."""
    from baselines import overhead

    if not interval or interval.get("how") == "given" or not interval.get("interval_s"):
        return 1.0
    run_mtbf = interval.get("mtbf_s")
    if not run_mtbf:
        return 1.0
    if interval.get("formula") or str(interval.get("how", "")).startswith("Daly"):
        o_save = max(float(interval.get("o_save_s") or 0.0), 1e-6)
        formula = interval.get("formula") or "daly"
        persist = float(interval.get("o_persist_s") or 0.0)
        return overhead.optimal_full_interval(o_save, mtbf_s, formula, persist) / overhead.optimal_full_interval(
            o_save, run_mtbf, formula, persist)
    return mtbf_s / run_mtbf  # the PLS interval, 2 x PLS x servers x MTBF, and intervals tuned in proportion


def expected_cost(row: dict, mtbf_s: float, model_bytes: int | None = None) -> dict:
    """The cost per day of ``row`` (a strategy's figures: ``overhead_vs_none`` and its ``overhead_spread``,
    ``lost_training_s`` and its range, ``replayed_s``, ``lost_updates``, ``failures``, ``interval``) at an
    MTBF of ``mtbf_s`` seconds; see the module docstring."""
    if not (isinstance(mtbf_s, (int, float)) and math.isfinite(mtbf_s) and mtbf_s > 0):
        raise ValueError(f"the MTBF must be a finite number of seconds > 0, got {mtbf_s!r}")
    r = interval_ratio(row.get("interval"), mtbf_s)
    per_day = DAY_S / mtbf_s
    ovh = row.get("overhead_vs_none")
    spread = row.get("overhead_spread") or {}
    ovh_low, ovh_high = spread.get("ci95_low", ovh), spread.get("ci95_high", ovh)
    lost, replayed = row.get("lost_training_s"), row.get("replayed_s") or 0.0
    lost_range = row.get("lost_training_s_range") or [lost, lost]
    run_interval_s = (row.get("interval") or {}).get("interval_s")
    out = {"strategy": row.get("strategy"), "mtbf_s": float(mtbf_s), "mtbf_hours": mtbf_s / 3600.0,
           "model_bytes": model_bytes, "failures_per_day": per_day, "interval_ratio": r,
           "interval_s": run_interval_s * r if run_interval_s else None}
    if ovh is None or lost is None:
        out.update(cost_s_per_day=None, cost_fraction=None, cost_low_s=None, cost_high_s=None)
        return out

    def loss(measured):
        return max(0.0, measured - replayed) + replayed * r if measured is not None else None

    out["overhead_s_per_day"] = DAY_S * ovh / r
    out["failures_s_per_day"] = per_day * loss(lost)
    out["cost_s_per_day"] = out["overhead_s_per_day"] + out["failures_s_per_day"]
    out["cost_fraction"] = out["cost_s_per_day"] / DAY_S
    ovh_low, ovh_high = (ovh if v is None else v for v in (ovh_low, ovh_high))
    out["cost_low_s"] = DAY_S * ovh_low / r + per_day * loss(lost_range[0])
    out["cost_high_s"] = DAY_S * ovh_high / r + per_day * loss(lost_range[1])
    failures = len(row.get("failures") or []) or None
    lost_updates = row.get("lost_updates")
    if lost_updates == 0:
        out["lost_updates_per_day"] = 0
    elif lost_updates is not None and failures and run_interval_s:
        out["lost_updates_per_day"] = per_day * lost_updates / failures * r
    else:  # none loses everything the shard learned since the start: not a rate a short run can give
        out["lost_updates_per_day"] = None
    return out


def cost_table(rows: list[dict], mtbf_s: float, model_bytes: int | None = None) -> list[dict]:
    """:func:`expected_cost` of each row, cheapest first (rows without a cost last)."""
    costs = [expected_cost(row, mtbf_s, model_bytes) for row in rows]
    return sorted(costs, key=lambda c: (c["cost_s_per_day"] is None, c["cost_s_per_day"] or 0.0))


def format_cost_table(costs: list[dict]) -> str:
    """The cost table as text (hours per day, percent of the day, its interval: the overhead's 95 % interval
    with the loss's range, lost updates per day)."""
    if not costs:
        return ""
    first = costs[0]
    size = f", model {first['model_bytes'] / 1e6:,.1f} MB" if first.get("model_bytes") else ""
    mtbf = f"{first['mtbf_hours']:g} h" if first["mtbf_hours"] >= 0.1 else f"{first['mtbf_s']:g} s"
    lines = [f"expected cost per day of training at an MTBF of {mtbf} "
             f"({first['failures_per_day']:.2f} failures/day{size}):",
             f"{'strategy':<10} {'overhead h':>10} {'failures h':>10} {'total h':>8} {'% of day':>8} "
             f"{'interval h':>16} {'lost upd./day':>14}"]
    for c in costs:
        if c["cost_s_per_day"] is None:
            lines.append(f"{c['strategy']:<10} {'-':>10} {'-':>10} {'-':>8} {'-':>8} {'-':>16} {'-':>14}")
            continue
        upd = "-" if c["lost_updates_per_day"] is None else f"{c['lost_updates_per_day']:,.0f}"
        interval = f"[{c['cost_low_s'] / 3600:.2f}, {c['cost_high_s'] / 3600:.2f}]"
        lines.append(f"{c['strategy']:<10} {c['overhead_s_per_day'] / 3600:>10.2f} {c['failures_s_per_day'] / 3600:>10.3f} "
                     f"{c['cost_s_per_day'] / 3600:>8.2f} {c['cost_fraction']:>8.1%} {interval:>16} {upd:>14}")
    return "\n".join(lines)


def print_cost_tables(costs: dict, footnote: str) -> None:
    """Prints each table of ``costs`` (keyed by MTBF) and, when there is one, the ``footnote`` under them."""
    for table in costs.values():
        print()
        print(format_cost_table(table))
    if costs:
        print(footnote)
