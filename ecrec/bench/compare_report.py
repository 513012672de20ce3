"""The report of ``ecrec-bench compare``: the table, the notes under it, the plot and the JSON.

Formatting only: every figure comes from ``ecrec.bench.accounting``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from ecrec.bench.table import cell, megabytes, print_rows, span

PLOT_BUCKET_S = 0.5  # the plot's buckets of useful samples per second


COLUMNS = [
    ("strategy", "strategy", "{}"),
    ("samples_per_s_failure_free", "samples/s", "{:,.0f}"),
    ("overhead_vs_none", "overhead", "{:+.1%}"),
    ("overhead_ci95", "ovh 95% CI", None),
    ("cpu_overhead_vs_none", "cpu ovh", "{:+.1%}"),
    ("cpu_overhead_ci95", "cpu 95% CI", None),
    ("recovery_s", "recovery s", "{:.2f}"),
    ("fully_redundant_s", "redundant s", "{:.2f}"),
    ("throughput_during_recovery_ratio", "useful tput", "{:.2f}"),
    ("lost_training_s", "lost train s", "{:.3f}"),
    ("lost_training_s_range", "(range)", span("{:.3f}")),
    ("lost_updates", "lost upd.", "{:,}"),
    ("pls", "PLS", "{:.4f}"),
    ("pls_samples", "PLS smp", "{:.4f}"),  # sample-weighted: the lookups of the lost updates
    ("test_auc", "AUC", "{:.4f}"),
    ("state_matches_failure_free", "exact", "{}"),
    ("memory_mechanism", "mem ovh", "{:.3f}"),  # the mechanism only (JSON memory_overhead: with the accounting)
    ("memory_steady_over_none", "mem steady", "{:+.2f}"),
    ("memory_peak_over_none", "mem peak", "{:+.2f}"),
    ("checkpoint_bytes", "ckpt MB", megabytes("{:.1f}")),
]


#: the overhead columns and the spreads of their runs: a 95% CI column shows the spread's, and an overhead within
#: the noise is marked ``~``
_SPREADS = {"overhead_ci95": "overhead_spread", "cpu_overhead_ci95": "cpu_overhead_spread",
            "overhead_vs_none": "overhead_spread", "cpu_overhead_vs_none": "cpu_overhead_spread"}


def _cell(row: dict, key: str, f) -> str:
    spread = row.get(_SPREADS[key]) if key in _SPREADS else None
    if key in ("overhead_ci95", "cpu_overhead_ci95"):
        if not spread or spread.get("ci95_low") is None:
            return "-"
        return f"[{spread['ci95_low']:+.1%}, {spread['ci95_high']:+.1%}]"
    text = cell(row.get(key), f)
    if row.get(key) is not None and (spread or {}).get("within_noise"):
        text += "~"
    return text


def print_table(rows: list[dict]) -> None:
    print_rows(rows, COLUMNS, cell_of=_cell)


def print_intervals(rows: list[dict], cfg: dict) -> None:
    """The checkpoint intervals of the run and the inputs the models chose them from."""
    chosen = [r for r in rows if r.get("interval")]
    if not chosen:
        return
    print(f"\ncheckpoint intervals (job MTBF {cfg['mtbf_s']:g} s {cfg['mtbf_source']}, target PLS "
          f"{cfg['target_pls']:g} {cfg['target_pls_source']}):")
    for r in chosen:
        i = r["interval"]
        if "interval_steps" in i:
            if i["how"] == "Daly":
                why = (f"Daly from o_save {1e3 * i['o_save_s']:.1f} ms (measured stall), MTBF {i['mtbf_s']:g} s, "
                       f"at least the persist time {1e3 * (i.get('o_persist_s') or 0.0):.0f} ms: "
                       f"{i['interval_s']:.3f} s / step {1e3 * i['step_s']:.1f} ms (measured)")
            else:
                why = "given"
            print(f"  {r['strategy']:<9} every {i['interval_steps']} steps ({why}){_plan_note(i)}{_store_note(r)}")
        else:
            partial = f", partial saves every {i['partial_interval_s']:.3f} s" if i.get("partial_interval_s") else ""
            if i["how"] == "target PLS":
                why = f"2 x PLS {i['target_pls']:g} x {i['servers']} servers x MTBF {i['mtbf_s']:g} s"
            elif i["how"].startswith("equal PLS"):
                unit = "samples" if i.get("pls_basis") == "samples" else "updates"
                why = (f"equal PLS: unsaved {unit} {i['lost_ratio']:.3f} x cpr's at the same interval (modelled by "
                       f"replaying this run's updates of server {cfg['fail_server']}); modelled PLS "
                       f"{i['expected_pls']:.4f}")
            else:
                why = "given"
            print(f"  {r['strategy']:<9} every {i['interval_s']:.3f} s{partial} ({why}){_plan_note(i)}{_store_note(r)}")


def _store_note(row: dict) -> str:
    """The checkpoint store's rate as the servers saw it: bytes written over the seconds their writes took."""
    servers = [v for v in (row.get("stats") or {}).values() if isinstance(v, dict)]
    written = sum(v.get("bytes_written", 0) for v in servers)
    seconds = sum(v.get("persist_s_total", 0.0) for v in servers)
    if not written or not seconds:
        return ""
    return f"; store {written / seconds / 1e6:.0f} MB/s per write ({written / 1e6:.0f} MB in {seconds:.2f} s)"


def _plan_note(interval: dict) -> str:
    """CPR's plan (``recovery=auto``), when it chose: which recovery and both modelled overheads."""
    plan = interval.get("plan")
    if not plan:
        return ""
    return (f"; CPR's plan: {plan['recovery']} recovery (modelled overhead partial {plan['partial_overhead']:.2%}, "
            f"full {plan['full_overhead']:.2%})")


def print_failures(rows: list[dict]) -> None:
    print("\nper failure (rate: each worker's samples/s over its steps just before the kill, time in steps; the "
          "window runs from the kill to full redundancy, back to speed and past the furthest step reached, "
          "whichever is last; useful tput: samples of steps past that furthest step / time in steps / rate; "
          "lost = paused + replayed + deficit, +- its noise):")
    for r in rows:
        for n, f in enumerate(r.get("failures") or []):
            phase = f" phase {f['phase']:.2f}" if f.get("phase") is not None else ""
            lost = f.get("lost_training_s")
            noise = f.get("lost_training_noise_s")
            print(f"  {r['strategy']:<9} #{n + 1}{phase:<11} rate {f.get('samples_per_s_before') or 0:8,.0f}/s  "
                  f"window {f.get('window_s') or 0:6.3f} s  paused {f.get('paused_s') or 0:6.3f}  "
                  f"replayed {f.get('replayed_s') or 0:6.3f}  deficit {f.get('deficit_s') or 0:6.3f}  "
                  f"lost {'-' if lost is None else f'{lost:.3f}'}{'' if noise is None else f' +- {noise:.3f}'} s  "
                  f"useful tput {f.get('useful_throughput_ratio') or 0:.2f}")


def write_plot(path: str, rows: list[dict], fail_at) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("ecrec-bench compare: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(10, 5))
    width = None
    for row in rows:
        tl = row["timeline"]
        if not tl["t"]:
            continue
        # buckets of about PLOT_BUCKET_S: a step is ~0.01-0.1 s, so finer buckets hold 0 or 1 step each
        n = max(1, int(round(PLOT_BUCKET_S / tl["bucket_s"])))
        t, y = np.asarray(tl["t"]), np.asarray(tl["useful_samples_per_s"])
        m = len(t) // n * n
        t, y = t[n - 1:m:n], y[:m].reshape(-1, n).mean(axis=1)
        width = n * tl["bucket_s"]
        ax.step(t, y, where="pre", linewidth=1.4, label=f"{row['strategy']} (mean of {tl['failures']} failures)")
    ax.axvline(0.0, color="red", linestyle="--", linewidth=1, label="server killed")
    ax.set_xlabel("seconds from the failure")
    ax.set_ylabel(f"useful samples / s ({width or PLOT_BUCKET_S:g} s buckets)")
    ax.set_title("Useful training progress around a server failure (replayed steps do not count)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)




def print_report(figures: dict, cfg: dict, warnings: list[str]) -> None:
    """The table and the notes under it (``figures``: ``ecrec.bench.accounting.table``)."""
    reference, rows = figures["reference"], figures["rows"]
    aa = reference.get("aa_overhead")
    print()
    print_table(rows + ([aa_row(aa)] if aa else []))
    base = reference.get("samples_per_s_failure_free") or 0.0
    if reference.get("samples_per_s_rounds") is not None:
        noise = (f"{len(reference['samples_per_s_rounds'])} interleaved rounds in a shuffled order, reference "
                 f"spread {reference['noise']:.1%}")
    else:
        runs = reference.get("samples_per_s_runs") or [base, base]
        noise = f"before {runs[0]:,.0f}, after {runs[1]:,.0f}: drift {reference.get('noise') or 0:.1%}"
    print(f"\nreference (none, no failure): {base:,.0f} samples/s ({noise}), AUC {reference['test_auc'] or 0:.4f}")
    print("overhead and cpu ovh: median over rounds of the per-round ratio to the reference (reference rate / rate; "
          "CPU per sample / the reference's), 95 % percentile-bootstrap interval of that median; ~ marks an "
          "interval holding zero; A/A: the reference's two slices of each round against each other")
    for name, d in figures["differences"].items():
        mark = "within noise" if d["within_noise"] else "outside noise"
        print(f"  overhead {name}: median {d['median']:+.1%} [{d['ci95_low']:+.1%}, {d['ci95_high']:+.1%}] ({mark})")
    print_intervals(rows, cfg)
    print_failures(rows)
    print_cpu([reference, *rows])
    print_costs(figures.get("costs") or {})
    for line in warnings:
        print(f"warning: {line}; read its timings as ratios only (the load averages are in the JSON)",
              file=sys.stderr)


def print_costs(costs: dict) -> None:
    """The expected cost per day at each MTBF asked (``ecrec.bench.cost``)."""
    from ecrec.bench.cost import print_cost_tables

    print_cost_tables(costs, "cost = overhead x 24 h + failures/day x training lost per failure; a checkpointing "
                             "strategy at its model's interval for that MTBF (overhead / r, replayed part x r, r = "
                             "that interval / the run's)")


def aa_row(aa: dict) -> dict:
    """The A/A row of the table: the reference against itself, overhead columns only."""
    return {"strategy": "none (A/A)", "overhead_vs_none": aa["wall"]["median"], "overhead_spread": aa["wall"],
            "cpu_overhead_vs_none": aa["cpu"]["median"], "cpu_overhead_spread": aa["cpu"]}


def print_cpu(rows: list[dict]) -> None:
    if not any(row.get("cpu_ms_per_step") for row in rows):
        return
    print("\nCPU ms per failure-free step (user + system, from each process's counters):")
    for row in rows:
        c = row.get("cpu_ms_per_step")
        if c:
            print(f"  {row['strategy']:<18} worker {c['worker']:6.2f}  servers {c['servers']:6.2f}  "
                  f"coordinator {c['coordinator']:5.2f}  total {c['total']:6.2f}")


def write_json(path: str, figures: dict, config: dict, runs: dict, warnings: list[str], work_dir: str) -> None:
    """The report as JSON: the figures, and under ``runs`` every record they were computed from."""
    rows = figures["rows"]
    report = {"config": config, "reference": {k: v for k, v in figures["reference"].items() if k != "timeline"},
              "strategies": {row["strategy"]: row for row in rows},
              "intervals": {row["strategy"]: row["interval"] for row in rows if row.get("interval")},
              "overhead_differences": figures["differences"], "aa_overhead": figures["reference"].get("aa_overhead"),
              "cost_per_day": figures.get("costs") or {},
              "load_warnings": warnings, "runs": runs}
    text = json.dumps(report, indent=1, default=json_default)
    with open(path, "w") as f:  # temporary paths (checkpoint dirs) are shown relative to the work dir
        f.write(text.replace(work_dir, "<work-dir>"))


def json_default(o):
    """``json.dump``'s ``default`` for numpy scalars and arrays (the benchmarks' reports)."""
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
