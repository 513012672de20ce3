"""``ecrec-bench report``: a ``compare`` JSON's report, recomputed from the records it keeps.

Every figure of ``compare``'s table is a function of the step records, events, kills and slices its JSON
saves (``ecrec.bench.accounting``).  This reads a JSON, recomputes the table, the paired differences, the
expected cost per day and the load warning from those records alone (no cluster, no clock), prints them,
and says how far the recomputed figures are from the ones saved in the file.  ``--json`` writes the
recomputed report (the records carried over), e.g. after the accounting changed.

Examples::

    ecrec-bench report docs/results/compare-quick.json
    ecrec-bench report compare.json --cost-mtbf-hours 8 --json compare-8h.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys

#: figures compared between the saved table and the recomputed one
CHECKED = ("samples_per_s_failure_free", "overhead_vs_none", "cpu_overhead_vs_none", "lost_training_s",
           "recovery_s", "fully_redundant_s", "throughput_during_recovery_ratio", "paused_s", "replayed_s",
           "deficit_s", "lost_updates", "pls")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a JSON written by `ecrec-bench compare --json`")
    p.add_argument("--cost-mtbf-hours", type=float, default=None,
                   help="the MTBF of the cost per day besides the run's own (default: the one the JSON was made with)")
    p.add_argument("--json", metavar="PATH", help="write the recomputed report as JSON")


def recompute(report: dict, cost_mtbf_hours: float | None = None) -> tuple[dict, list[str]]:
    """The figures (``accounting.table``) and load warnings of a compare report, from its records."""
    from ecrec.bench.accounting import load_warnings, table

    config = report["config"]
    measurement = config.get("throughput_measurement")
    slices = measurement.get("slices") if isinstance(measurement, dict) else None
    fail_at = config.get("fail_at")
    fail_at = fail_at if fail_at is not None and fail_at >= 0 else None
    hours = set(config.get("cost_mtbf_hours") or [])
    if cost_mtbf_hours is not None:
        hours = {config["mtbf_s"] / 3600.0, cost_mtbf_hours}
    figures = table(report["runs"], slices, config["strategies"], fail_at, config.get("seed", 0),
                    sorted(h * 3600.0 for h in hours))
    warnings = load_warnings({"compare (before it started)": {"before": config.get("load_average_before")}},
                             config.get("cpu_count") or 1)
    return figures, warnings


def largest_difference(saved: dict, figures: dict) -> tuple[float, str | None]:
    """The largest relative difference between the saved table's figures and recomputed ones (and where)."""
    worst, where = 0.0, None
    for row in figures["rows"]:
        old = saved.get("strategies", {}).get(row["strategy"], {})
        for key in CHECKED:
            a, b = old.get(key), row.get(key)
            if a is None and b is None:
                continue
            if a is None or b is None:
                return math.inf, f"{row['strategy']}.{key}"
            diff = abs(a - b) / max(abs(a), abs(b), 1e-12)
            if diff > worst:
                worst, where = diff, f"{row['strategy']}.{key}"
    return worst, where


def run(args) -> int:
    from ecrec.bench import compare_report

    if args.cost_mtbf_hours is not None and not (math.isfinite(args.cost_mtbf_hours) and args.cost_mtbf_hours > 0):
        print("ecrec-bench report: --cost-mtbf-hours must be finite and > 0", file=sys.stderr)
        return 2
    try:
        with open(args.path) as f:
            report = json.load(f)
        if not isinstance(report, dict) or "runs" not in report or "config" not in report:
            raise ValueError("it has no 'runs' and 'config': not written by `ecrec-bench compare --json`")
        figures, warnings = recompute(report, args.cost_mtbf_hours)
        table = io.StringIO()  # rendered whole before anything is printed: a damaged config fails here, cleanly
        with contextlib.redirect_stdout(table):
            compare_report.print_report(figures, report["config"], warnings)
        worst, where = largest_difference(report, figures)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, ArithmeticError) as exc:  # damaged
        what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"ecrec-bench report: cannot recompute {args.path!r}: {what}", file=sys.stderr)
        return 2
    print(table.getvalue(), end="")
    print(f"\nrecomputed from the records in {args.path}: largest relative difference from the saved table "
          f"{worst:.2e}" + (f" ({where})" if where else ""))
    if args.json:
        compare_report.write_json(args.json, figures, report["config"], report["runs"], warnings, "<work-dir>")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
