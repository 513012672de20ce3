"""``ecrec-bench recovery``: one server killed in a cluster holding large tables, each strategy side by side.

For each strategy asked (``--strategies``, default ``ecrec,full,cpr``) it starts a local cluster (separate
processes on 127.0.0.1, one standby), creates the same tables (``--rows`` x ``--dim``, ``--tables`` of them,
``--optimizer``), takes the strategy's protection (``ecrec``: the parity the tables are created with; ``full``
and ``cpr``: one checkpoint of every server, written and fsynced), SIGKILLs one server and reports:

- ``go-on s``: from the kill until training can go on — a pull of rows of the failed server answers
  (``ecrec``: promotion and the on-demand rebuild of those rows; ``cpr``: promotion and the replacement's
  checkpoint reload; ``full``: promotion and every server's rollback to the checkpoint);
- ``redundant s``: from the kill until the failed index is fully protected again (``ecrec``: the
  replacement's background rebuild ends; checkpoint strategies: the state is the checkpoint again);
- ``restored MB`` and ``MB/s``: bytes put back on the replacement (``ecrec``: data and parity rows rebuilt;
  ``full``: every server's reload; ``cpr``: the failed shard's) over ``redundant s``, and for checkpoint
  strategies the reload itself (``reload s``, ``reload MB/s``: reading and verifying the files, from the same
  disk, and writing them into the tables; just written, so mostly from the page cache);
- table creation time and rate, the checkpoint write, and each strategy's memory per GB of model, steady and
  peak: the servers' resident memory just before the kill (``steady GB/GB``: what the strategy keeps) and
  their peak resident memory since they started (``peak GB/GB``: a save's or an encode's temporaries too),
  over the model's bytes, the redundancy the strategy reports (``redundancy_gb_per_model_gb``), and with
  ``none`` in the run each one's excess over ``none``'s (``over none``).

``--during-training``: a worker (embedding bags over every table, a linear head, Adagrad/SGD on the
servers, ``full`` and ``cpr`` driven by ``baselines.driver.CheckpointDriver`` with the Daly or PLS
interval for ``--mtbf-hours``) trains before and through ``--failures`` kills, and the report adds training
time lost per failure (:func:`lost_training`: paused time + replayed steps + the deficit of throughput while
recovering; mean and range), the throughput while recovering over before, and the longest step; for ``ecrec``,
what the replacement's rebuild took by part, from its own counters (the whole rebuild, the fast path and its wait
for the survivors' streams, the requests that rebuilt their rows on demand and their time, the pacer's duty with
``--option rebuild_slowdown=S``: a line per failure, and ``rebuild_parts`` in the JSON), and, idle too, the fast
path's CPU by part from the servers' own thread clocks -- the survivors gathering their frames' rows, sealing them
(settled at the last closed parity group, the confirmed bound read) and sending them; the replacement receiving,
decoding, installing, and checking -- in CPU seconds and ms per MB rebuilt (``rebuild_cpu``).  ``full``'s
and ``cpr``'s kills fall at stratified phases of their interval ((i + 0.5) / n, measured from a save), so
the mean loss is the expectation over the interval, measured rather than modelled; the run's MTBF must be
short enough for the interval to fit in ``--max-s`` (a clear error says so otherwise).  A new standby is
started, and waited for, before each further kill.  The report ends with the expected cost per day
(``ecrec.bench.cost``: overhead against ``none``'s rate, which needs ``none`` in the run, plus failures per
day x training lost per failure) at the run's MTBF and at ``--cost-mtbf-hours``.

Examples::

    ecrec-bench recovery                                         # 400k x 64 Adagrad, ecrec/full/cpr, idle
    ecrec-bench recovery --rows 4000000 --strategies ecrec       # 4M x 64 (2 GB of rows + optimizer state)
    ecrec-bench recovery --during-training --strategies none,ecrec,full,cpr --failures 3 --json rec.json
    ecrec-bench recovery --rows 4000000 --during-training --mtbf-hours 0.2 --cost-mtbf-hours 24 --plot rec.png
    ecrec-bench recovery --rows 4000000 --strategies ecrec --during-training --option rebuild_slowdown=0.1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ecrec.bench.cost import cost_table, print_cost_tables
from ecrec.bench.processes import memory_of, wait_standby_reserve  # noqa: F401 - re-exported
from ecrec.bench.recovery_training import (IntervalDoesNotFit, describe_cpu, first_event, rebuild_cpu_of,
                                           stream_counters)
from ecrec.bench.table import megabytes, print_rows, span

DEFAULT_STRATEGIES = "ecrec,full,cpr"
#: health checks and leases that tolerate a loaded machine (creating and reloading gigabytes keeps servers busy
#: for seconds); a killed server is still declared failed at once (its connection is refused)
COORDINATOR_OPTIONS = dict(health_timeout_s=5, failure_timeout_s=15, failures_before_dead=5, lease_s=20,
                           rpc_timeout_s=600)
OPTIMIZERS = ("adagrad", "sgd")


def _strategies(args) -> list[str]:
    return [s.strip() for s in args.strategies.split(",") if s.strip()]


#: flags that apply only with another (``ecrec.bench.cli.ignored_flag``): given without it, they are refused
ONLY_WITH = (
    (("batch_size", "ids_per_sample", "before_s", "after_s", "max_s", "mtbf_hours", "failures", "cost_mtbf_hours",
      "target_pls"), "--during-training", lambda a: a.during_training),
    (("k", "m", "option"), "ecrec among --strategies", lambda a: "ecrec" in _strategies(a)),
    (("target_pls",), "cpr among --strategies", lambda a: "cpr" in _strategies(a)),
    (("probe_rows",), "an idle run (no --during-training: training reads its own rows)",
     lambda a: not a.during_training),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=400_000, help="rows per table (default 400000)")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension (default 64)")
    p.add_argument("--tables", type=int, default=1, help="tables (default 1)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adagrad",
                   help="server-side optimizer; its state is part of every row (default adagrad)")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma-separated: ecrec, full, cpr, none (default {DEFAULT_STRATEGIES})")
    p.add_argument("--servers", type=int, default=4, help="embedding servers (default 4; one standby more)")
    p.add_argument("--k", type=int, default=2, help="ecrec: data rows per stripe (default 2)")
    p.add_argument("--m", type=int, default=1, help="ecrec: parity rows per stripe (default 1)")
    p.add_argument("--fail-server", type=int, default=1, help="index of the server killed (default 1)")
    p.add_argument("--probe-rows", type=int, default=4096,
                   help="rows of the pull that tells when training can go on (default 4096)")
    p.add_argument("--verify", choices=("auto", "yes", "no"), default="auto",
                   help="compare every row after recovery with before (and ecrec's parity with its data); "
                        "auto: when the model is at most 1 GB and no training runs (default auto)")
    p.add_argument("--during-training", action="store_true", help="a worker trains through the failure")
    p.add_argument("--batch-size", type=int, default=512, help="--during-training: samples per step (default 512)")
    p.add_argument("--ids-per-sample", type=int, default=4, help="--during-training: ids per sample per table (default 4)")
    p.add_argument("--before-s", type=float, default=6.0,
                   help="--during-training: seconds trained before the kill, after warm-up (default 6)")
    p.add_argument("--after-s", type=float, default=3.0,
                   help="--during-training: seconds trained after full redundancy (default 3)")
    p.add_argument("--max-s", type=float, default=180.0,
                   help="--during-training: most seconds trained after the kill (default 180)")
    p.add_argument("--mtbf-hours", type=float, default=0.1,
                   help="--during-training: the run's MTBF for full's Daly and cpr's PLS interval, short enough for "
                        "the interval to be measured whole (default 0.1)")
    p.add_argument("--failures", type=int, default=1,
                   help="--during-training: kills per strategy, full's and cpr's each at its own phase of the "
                        "checkpoint interval, (i + 0.5) / n (default 1: half an interval)")
    p.add_argument("--cost-mtbf-hours", type=float, default=24.0,
                   help="--during-training: the MTBF the expected cost per day is reported at (default 24)")
    p.add_argument("--target-pls", type=float, default=0.02, help="--during-training: cpr's target PLS (default 0.02)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra option of strategy ecrec (e.g. rebuild_batch_rows=65536); repeatable")
    p.add_argument("--server-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of every server (an `ecrec-server serve` flag with underscores, a switch as "
                        "true/false: e.g. no_gc_freeze=true); repeatable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG: restore rates, and with --during-training the "
                                                  "throughput around the failure")
    p.add_argument("--work-dir", help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true",
                   help="keep what the run wrote: the temporary work directory, or the checkpoints under --work-dir "
                        "(removed by default; the --work-dir itself and what it held before always stay)")


# --- checks ---------------------------------------------------------------------------------------------------------
def check_args(args) -> str | None:
    """The first problem with the arguments, as a sentence, or None."""
    known = ("ecrec", "full", "cpr", "none")
    strategies = _strategies(args)
    if not strategies:
        return "--strategies is empty"
    unknown = [s for s in strategies if s not in known]
    if unknown:
        return f"unknown strategies {unknown}; choose from {', '.join(known)}"
    if len(set(strategies)) != len(strategies):
        return "--strategies lists a strategy twice"
    for name in ("rows", "dim", "tables", "servers", "probe_rows", "batch_size", "ids_per_sample"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    from ecrec.bench.checks import count_problem, servers_problem

    too_many = servers_problem(args.servers) or count_problem("--probe-rows", args.probe_rows, 1 << 20,
                                                               "rows of one pull, drawn from 8 times as many ids")
    if too_many:
        return too_many
    if args.failures < 1:
        return "--failures must be >= 1"
    if args.failures > 1 and not args.during_training:
        return "--failures needs --during-training (an idle run kills one server once)"
    for name in ("before_s", "after_s", "max_s", "mtbf_hours", "cost_mtbf_hours"):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be > 0"
    if not 0 < args.target_pls < 1:
        return "--target-pls must be in (0, 1)"
    if not 0 <= args.fail_server < args.servers:
        return f"--fail-server must be in [0, {args.servers})"
    if "ecrec" in strategies:
        if args.k < 1 or args.m < 1:
            return "--k and --m must be >= 1"
        if args.k + args.m > args.servers:
            return f"k + m = {args.k + args.m} exceeds --servers {args.servers}"
    from ecrec.bench.checks import tables_problem

    k, m = (args.k, args.m) if "ecrec" in strategies else (0, 0)
    problem = tables_problem(f"--tables {args.tables} x --rows {args.rows} x --dim {args.dim}", args.tables,
                             args.rows, args.dim, args.optimizer, k, m)
    if problem:
        return problem
    for item in args.option:
        if "=" not in item:
            return f"--option {item!r} is not KEY=VALUE"
    if args.option:  # checked as the coordinator checks them, before any cluster starts
        from ecrec.strategies.erasure.options import parse

        try:
            parse(dict(item.split("=", 1) for item in args.option)).validate()
        except ValueError as exc:
            return f"--option: {exc}"
    from ecrec.bench.profile_runs import server_options

    try:
        server_options(args.server_option)
    except ValueError as exc:
        return str(exc)
    from ecrec.bench.cli import ignored_flag

    return ignored_flag(args)


# --- one strategy ---------------------------------------------------------------------------------------------------
def _options(strategy: str, args, work: Path) -> dict:
    if strategy == "ecrec":
        return dict(item.split("=", 1) for item in args.option)
    if strategy in ("full", "cpr"):
        ckpt = work / f"ckpt-{strategy}"
        shutil.rmtree(ckpt, ignore_errors=True)
        options = {"dir": str(ckpt)}
        if not args.during_training:
            options["interval_steps" if strategy == "full" else "interval_s"] = "1000000000"
        elif strategy == "full":
            options["mtbf_s"] = str(args.mtbf_hours * 3600)
        else:
            options.update(mtbf_s=str(args.mtbf_hours * 3600), target_pls=str(args.target_pls), recovery="partial")
        return options
    return {}


def wait_started(cluster, servers: int, timeout_s: float = 300.0) -> None:
    """Creates a tiny table until every server has answered: started, kernels compiled (a loaded machine can
    take longer than one creation deadline)."""
    from ecrec.client import ClusterError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            cluster.create_table("warm-up", servers * 8, 4)
            return
        except ClusterError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _progress(label: str, text: str) -> None:
    print(f"  {label:<6} {text}", file=sys.stderr, flush=True)


def _wait_event(local, kind: str, index: int, since: float, timeout_s: float) -> float | None:
    """:func:`first_event`, polled until it happens (None after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = first_event(local, kind, index, since)
        if found is not None:
            return found
        time.sleep(0.02)
    return None


def server_gc(cluster) -> dict:
    """Each server's full garbage collections since it started serving, and the longest (``ecrec.server.collector``;
    a replacement's since its own start), its objects frozen out of them and the full collection over those
    before, by index."""
    keys = ("gc_full_collections", "gc_pause_s", "gc_longest_pause_ms", "gc_frozen_objects", "gc_freeze_collect_ms")
    return {str(i): {k: stats.get("server", {}).get(k) for k in keys}
            for i, stats in sorted(cluster.strategy_call("stats").items())}


def run_strategy(strategy: str, args, work: Path) -> dict:
    """One strategy: cluster, tables, protection, the kill, the measurements; the cluster is stopped after."""
    from ecrec.client import Cluster
    from ecrec.config import ClientConfig
    from ecrec.ops.local import LocalCluster, LocalClusterSpec
    from ecrec.tables.spec import TableSpec

    k, m = (args.k, args.m) if strategy == "ecrec" else (0, 0)
    out: dict = {"strategy": strategy}
    from ecrec.bench.profile_runs import server_options

    spec = LocalClusterSpec(servers=args.servers, standby=1, strategy=strategy, k=k, m=m,
                            options=_options(strategy, args, work), coordinator_options=COORDINATOR_OPTIONS,
                            server_options=server_options(getattr(args, "server_option", None)))
    local = LocalCluster(spec)
    local.start(timeout_s=180)
    try:
        cluster = Cluster.connect(local.coordinator_address, ClientConfig(rpc_timeout_s=600.0), worker="bench")
        wait_started(cluster, args.servers)
        names = [f"t{i}" for i in range(args.tables)]
        t0 = time.perf_counter()
        for name in names:
            cluster.create_table(name, args.rows, args.dim, optimizer=args.optimizer, lr=0.05, seed=args.seed,
                                 initial_accumulator_value=0.1 if args.optimizer == "adagrad" else 0.0)
        out["create_s"] = time.perf_counter() - t0
        row_bytes = TableSpec("x", 1, args.dim, optimizer=args.optimizer).row_bytes
        out["model_bytes"] = model_bytes = args.tables * args.rows * row_bytes
        out["create_mb_per_s"] = model_bytes / 1e6 / out["create_s"]
        _progress(strategy, f"created {args.tables} x {args.rows:,} x {args.dim} ({model_bytes / 1e6:,.0f} MB) in "
                            f"{out['create_s']:.2f} s")
        out.update(wait_standby_reserve(cluster))
        verify = args.verify == "yes" or (args.verify == "auto" and model_bytes <= 1 << 30 and not args.during_training)
        before = {name: cluster.read_payload(name)[1] for name in names} if verify else None
        if args.during_training:
            from ecrec.bench.recovery_training import train_through_failure

            out.update(train_through_failure(strategy, args, local, cluster, names,
                                             lambda: _memory(local, cluster, model_bytes),
                                             lambda text: _progress(strategy, text)))
        else:
            if strategy in ("full", "cpr"):
                t = time.perf_counter()
                saved = cluster.strategy_call("save", {"kind": "full", "cut": 1, "step": 0, "wait": True})
                out["checkpoint_write_s"] = time.perf_counter() - t
                out["checkpoint_bytes"] = int(sum(r.get("bytes", 0) for r in saved.values()))
                out["checkpoint_write_mb_per_s"] = out["checkpoint_bytes"] / 1e6 / out["checkpoint_write_s"]
            out.update(_memory(local, cluster, model_bytes))
            out.update(_kill_idle(strategy, args, local, cluster, names, row_bytes))
        out["server_gc"] = server_gc(cluster)
        if verify:
            after = {name: cluster.read_payload(name)[1] for name in names}
            out["exact"] = all(np.array_equal(before[n].view(np.uint32), after[n].view(np.uint32)) for n in names)
            if strategy == "ecrec":
                checked = cluster.strategy_call("verify_parity")
                out["parity_mismatched"] = int(sum(r["mismatched"] for r in checked.values()))
                out["exact"] = out["exact"] and out["parity_mismatched"] == 0
        cluster.close()
    finally:
        local.close()
    return out


def _memory(local, cluster, model_bytes: int) -> dict:
    pids = [local.pid_of_index(i) for i in range(local.spec.servers)]
    mem = memory_of(pids)
    stats = cluster.strategy_call("stats")
    redundancy = sum(int(s.get("redundancy_bytes", 0)) for s in stats.values())
    gb = model_bytes / 1e9
    return {"server_rss_bytes": mem["rss_bytes"], "server_peak_rss_bytes": mem["peak_rss_bytes"],
            "memory_gb_per_model_gb": mem["peak_rss_bytes"] / 1e9 / gb,
            "memory_steady_gb_per_model_gb": mem["rss_bytes"] / 1e9 / gb,
            "redundancy_gb_per_model_gb": redundancy / 1e9 / gb}


def _kill_idle(strategy: str, args, local, cluster, names: list[str], row_bytes: int) -> dict:
    out: dict = {}
    rng = np.random.default_rng(args.seed)
    layout = cluster.layout
    ids = rng.integers(0, args.rows, 8 * args.probe_rows)
    probe = ids[layout.locate(ids)[0] == args.fail_server][: args.probe_rows]  # rows of the failed server
    index = args.fail_server
    pid = local.pid_of_index(index)
    from ecrec.bench.compare import process_cpu_seconds

    others = [p.pid for p in local.server_procs if p.pid != pid and p.poll() is None]
    survivors = [i for i in range(layout.num_servers) if i != index]
    streamed = stream_counters(cluster, survivors) if strategy == "ecrec" else {}
    cpu0 = {p: process_cpu_seconds(p) for p in others}
    t_kill = time.time()
    local.kill(pid)
    cluster.pull_many({name: probe for name in names})
    if strategy == "full":  # every server back to the checkpoint, as the driver does
        restored = cluster.strategy_call("restore", {"cut": 1})
        out["reload_s"] = max(r["load_s"] for r in restored.values())
        out["restored_bytes"] = int(sum(r.get("bytes", 0) for r in restored.values()))
    t_go = time.time()
    out["go_on_s"] = t_go - t_kill
    promoted = _wait_event(local, "promoted", index, t_kill, 60)
    out["promotion_s"] = promoted - t_kill if promoted else None
    declared = first_event(local, "failed", index, t_kill)
    out["declared_failed_s"] = declared - t_kill if declared else None
    if strategy == "ecrec":
        redundant = _wait_event(local, "redundant", index, t_kill, 600)
        out["redundant_s"] = redundant - t_kill if redundant else None
        stats = cluster.strategy_call("stats", indices=[index])[index]
        out["restored_bytes"] = int((stats["rows_rebuilt"] + stats["parity_rows_rebuilt"]) * row_bytes)
        out["rebuild_s"] = stats.get("rebuild_s")
        out["bulk_rows"] = int(stats.get("bulk_rows_rebuilt", 0))
        out["rows_rebuilt"] = int(stats["rows_rebuilt"] + stats["parity_rows_rebuilt"])
        out["rebuild_cpu"] = rebuild_cpu_of(cluster, index, streamed, survivors, args)
        _progress(strategy, describe_cpu(out["rebuild_cpu"]))
    elif strategy == "cpr":
        stats = cluster.strategy_call("stats", indices=[index])[index]
        out["reload_s"] = stats.get("load_s_last")
        out["restored_bytes"] = int(stats.get("load_bytes_last", 0))
        out["redundant_s"] = out["go_on_s"]
    elif strategy == "full":
        out["redundant_s"] = out["go_on_s"]
    else:
        out["redundant_s"] = None
    # CPU of every server process from the kill to here (the machine is shared: wall time alone misleads)
    out["recovery_cpu_s"] = sum(process_cpu_seconds(p) - c for p, c in cpu0.items())
    if out.get("restored_bytes") and out.get("redundant_s"):
        out["restored_mb_per_s"] = out["restored_bytes"] / 1e6 / out["redundant_s"]
        out["restored_mb_per_cpu_s"] = out["restored_bytes"] / 1e6 / max(out["recovery_cpu_s"], 1e-9)
    if out.get("reload_s"):
        out["reload_mb_per_s"] = out["restored_bytes"] / 1e6 / out["reload_s"]
    return out


# --- output -----------------------------------------------------------------------------------------------------------
COLUMNS = [
    ("strategy", "strategy", "{}"),
    ("go_on_s", "go-on s", "{:.3f}"),
    ("redundant_s", "redundant s", "{:.2f}"),
    ("restored_bytes", "restored MB", megabytes("{:,.0f}")),
    ("restored_mb_per_s", "MB/s", "{:,.0f}"),
    ("recovery_cpu_s", "CPU s", "{:.2f}"),
    ("reload_s", "reload s", "{:.2f}"),
    ("reload_mb_per_s", "reload MB/s", "{:,.0f}"),
    ("create_s", "create s", "{:.2f}"),
    ("create_mb_per_s", "create MB/s", "{:,.0f}"),
    ("memory_steady_gb_per_model_gb", "steady GB/GB", "{:.2f}"),
    ("memory_steady_overhead_gb_per_gb", "over none", "{:+.2f}"),
    ("memory_gb_per_model_gb", "peak GB/GB", "{:.2f}"),
    ("memory_overhead_gb_per_gb", "over none", "{:+.2f}"),
    ("exact", "exact", "{}"),
]
TRAINING_COLUMNS = [
    ("strategy", "strategy", "{}"),
    ("samples_per_s_before", "samples/s", "{:,.0f}"),
    ("lost_training_s", "lost s", "{:.2f}"),
    ("paused_s", "paused s", "{:.2f}"),
    ("replayed_s", "replayed s", "{:.2f}"),
    ("deficit_s", "deficit s", "{:.2f}"),
    ("lost_training_s_range", "(range)", span("{:.2f}")),
    ("throughput_ratio", "tput in rec.", "{:.2f}"),
    ("longest_step_s", "longest step s", "{:.3f}"),
    ("redundant_s", "redundant s", "{:.2f}"),
    ("checkpoint_interval_s", "ckpt interval s", "{:.0f}"),
]


def write_plot(path: str, rows: list[dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("ecrec-bench recovery: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return False
    timelines = [r for r in rows if r.get("timeline")]
    fig, axes = plt.subplots(1, 2 if timelines else 1, figsize=(12 if timelines else 6, 4.5), squeeze=False)
    ax = axes[0][0]
    names = [r["strategy"] for r in rows]
    ax.bar(names, [r.get("go_on_s") or 0 for r in rows], label="until training goes on")
    ax.bar(names, [max(0.0, (r.get("redundant_s") or 0) - (r.get("go_on_s") or 0)) for r in rows],
           bottom=[r.get("go_on_s") or 0 for r in rows], label="until fully redundant")
    ax.set_ylabel("seconds after the kill")
    ax.set_title("Recovery of one server")
    ax.legend()
    if timelines:
        ax = axes[0][1]
        for r in timelines:
            tl = r["timeline"]
            ax.plot(tl["t"], tl["samples_per_s"], label=r["strategy"], linewidth=1.2)
        ax.axvline(0.0, color="red", linestyle="--", linewidth=1, label="server killed")
        ax.set_xlabel("seconds from the failure")
        ax.set_ylabel("samples / s (0.25 s buckets)")
        ax.set_title("Training throughput around the failure")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(args) -> int:
    problem = check_args(args)
    if problem:
        print(f"ecrec-bench recovery: {problem}", file=sys.stderr)
        return 2
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    from ecrec.client import ClusterError
    from ecrec.tables.spec import TableSpec

    row_bytes = TableSpec("x", 1, args.dim, optimizer=args.optimizer).row_bytes
    model = args.tables * args.rows * row_bytes
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="ecrec-recovery-"))
    work.mkdir(parents=True, exist_ok=True)
    there_before = {p.name for p in work.iterdir()}  # a --work-dir's own files are never removed
    print(f"ecrec-bench recovery: {args.tables} table(s) x {args.rows:,} rows x {args.dim} ({args.optimizer}, "
          f"{row_bytes} B per row, {model / 1e6:,.0f} MB; {model / args.servers / 1e6:,.0f} MB per server), "
          f"{args.servers} servers + 1 standby, kill server {args.fail_server}"
          f"{', training through the failure' if args.during_training else ', idle'}", file=sys.stderr)
    load_before = os.getloadavg()  # the JSON keeps it: a figure measured beside other jobs is read as such
    rows = []
    try:
        for strategy in strategies:
            try:
                row = run_strategy(strategy, args, work)
            except IntervalDoesNotFit as exc:
                print(f"ecrec-bench recovery: {exc}", file=sys.stderr)
                return 2
            except ClusterError as exc:  # refused by the cluster (a table too large for its servers): one line
                print(f"ecrec-bench recovery: {strategy}: {exc}", file=sys.stderr)
                return 1
            rows.append(row)
            print_rows(rows, TRAINING_COLUMNS if args.during_training else COLUMNS, stream=sys.stderr)
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
        elif not args.keep:  # --work-dir: what this run wrote there (the checkpoints) goes, the directory stays
            for path in work.iterdir():
                if path.name in there_before:
                    continue
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
    _memory_over_none(rows)
    costs = _costs(rows, args, model) if args.during_training else {}
    print_report(rows, args.during_training, costs)
    if args.json:
        config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        config.update(strategies=strategies, row_bytes=row_bytes, model_bytes=model, cpu_count=os.cpu_count(),
                      load_average_before=list(load_before), load_average_after=list(os.getloadavg()))
        from ecrec.bench.compare import json_default

        with open(args.json, "w") as f:
            json.dump({"config": config, "strategies": {r["strategy"]: r for r in rows}, "cost_per_day": costs}, f,
                      indent=2,
                      default=json_default)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot and write_plot(args.plot, rows):
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _memory_over_none(rows: list[dict]) -> None:
    """With ``none`` in the run: each strategy's server memory beyond ``none``'s, per GB of model, resident
    just before the kill (``memory_steady_overhead_gb_per_gb``: parity, logs, snapshots kept) and at its peak
    since the servers started (``memory_overhead_gb_per_gb``: a save's or an encode's temporaries too)."""
    base = next((r for r in rows if r["strategy"] == "none" and r.get("server_peak_rss_bytes")), None)
    if base is None:
        return
    for r in rows:
        if r.get("server_peak_rss_bytes"):
            r["memory_overhead_gb_per_gb"] = (r["server_peak_rss_bytes"] - base["server_peak_rss_bytes"]) / r["model_bytes"]
            r["memory_steady_overhead_gb_per_gb"] = (r["server_rss_bytes"] - base["server_rss_bytes"]) / r["model_bytes"]


def _costs(rows: list[dict], args, model_bytes: int) -> dict:
    """The expected cost per day (``ecrec.bench.cost``) at the run's MTBF and at ``--cost-mtbf-hours``, keyed
    by the MTBF in hours.  The failure-free overhead is each strategy's rate before the kill against ``none``'s
    (runs one after the other, not side by side: ``compare`` measures it side by side); without ``none`` in
    the run there is no overhead and no cost."""
    base = next((r.get("samples_per_s_before") for r in rows if r["strategy"] == "none"), None)
    for r in rows:
        rate = r.get("samples_per_s_before")
        r["overhead_vs_none"] = base / rate - 1.0 if base and rate else None
    return {f"{h:g}": cost_table(rows, h * 3600.0, model_bytes) for h in sorted({args.mtbf_hours, args.cost_mtbf_hours})}


#: the note under the cost tables of ``--during-training``
COST_NOTE = ("overhead: each strategy's rate before its first kill against none's, runs one after another (noisy: "
             "`ecrec-bench compare` measures it side by side); failures: training lost per failure, measured")


def print_report(rows: list[dict], during_training: bool, costs: dict) -> None:
    """The tables, the ratios and (``during_training``) the expected cost per day: what ``run`` prints at the end,
    from the rows and costs its JSON keeps (``strategies``, ``cost_per_day``)."""
    print()
    print_rows(rows, COLUMNS)
    if during_training:
        print()
        print_rows(rows, TRAINING_COLUMNS)
    _print_ratios(rows, during_training)
    if during_training:
        note = COST_NOTE
        if not any(r["strategy"] == "none" for r in rows):  # every overhead is a '-': say why
            note += "; no 'none' run here: no overhead, so no cost (add none to --strategies)"
        print_cost_tables(costs, note)


def _how_much_sooner(ours: float, theirs: float) -> str:
    """``2.50x sooner`` or ``4.00x later`` (never ``0.25x sooner``)."""
    return f"{theirs / ours:.2f}x sooner" if ours <= theirs else f"{ours / theirs:.2f}x later"


def _print_ratios(rows: list[dict], during_training: bool) -> None:
    by = {r["strategy"]: r for r in rows}
    ec = by.get("ecrec")
    if ec is None:
        return
    for other in ("full", "cpr"):
        o = by.get(other)
        if o and o.get("redundant_s") and ec.get("redundant_s"):
            print(f"ecrec fully redundant {_how_much_sooner(ec['redundant_s'], o['redundant_s'])} than {other} "
                  f"({ec['redundant_s']:.2f} s against {o['redundant_s']:.2f} s)")
        if during_training and o and o.get("lost_training_s") and ec.get("lost_training_s") is not None:
            print(f"ecrec training time lost per failure / {other}'s (both measured, {other}'s over its interval): "
                  f"{ec['lost_training_s'] / o['lost_training_s']:.3f}")


