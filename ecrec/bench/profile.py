"""``ecrec-bench profile``: where a server's CPU goes while a worker trains, sampled with py-spy.

Starts a local cluster of the chosen strategy, trains the quick preset's DLRM in this process, and
while it trains samples one server (``--server``, default 1) and this worker with ``py-spy record``
(a sampling profiler: it reads the running process from outside and changes nothing in it).  Prints the
functions with the most samples (own time, then inclusive), the processes' CPU per step, and writes
py-spy's raw collapsed stacks (``--out DIR``: one ``*.folded`` file per process, for flamegraph.pl or
speedscope).

    ecrec-bench profile --strategy ecrec --seconds 8
    ecrec-bench profile --strategy none --server 0 --out /tmp/prof
    ecrec-bench profile --strategy ecrec --no-py-spy --seconds 30 --json ecrec.json   # CPU by part, no sampling
    ecrec-bench profile --against none --no-py-spy --seconds 20 --json quick.json     # what ecrec adds per row
    ecrec-bench profile --against none --rows 4000000 --no-py-spy --seconds 20         # ... on 4M x 64 rows
    ecrec-bench profile --against ecrec --against-option parity_transport=grpc --rows 4000000 --no-py-spy
                                                      # one setting of ecrec against another, side by side
    ecrec-bench profile --against ecrec --against-server-option no_gc_freeze=true --rows 4000000 --no-py-spy
                                                      # ... or one server setting against another

``--against none`` runs a cluster of the baseline beside it, on the same workload (the two train in alternate
slices, ``--rounds`` of each, so that both meet the same machine), and reports what ``--strategy`` adds: the
servers' CPU per row update (all threads, over the rows the pushes updated) and its parts (the strategy's own
counters: the delta XORed apart from the optimizer's pass, the merge, the batches built, serialized, sealed,
verified, parsed and applied, the watermarks; ``rest`` is what they do not see), and the step times side by side
(median, p99, the share of time in steps over 30 ms, the longest step with the worker's and the servers' CPU over it).
``--rows N`` trains the recovery benchmark's workload on tables of ``N`` x ``--dim`` rows instead of the quick
preset's DLRM.

Besides the samples it prints every server's CPU per step by thread (request handlers, gRPC's own threads, the
strategy's threads), by request handler, and the strategy's own CPU counters (for ``ecrec``: the group
closes, the relayed batches applied, ...), summed over the servers.

py-spy comes with the ``dev`` extra (``pip install py-spy``); it needs permission to read another
process's memory (root, or ``kernel.yama.ptrace_scope = 0``).  To profile a server you run yourself:
``py-spy record --pid PID --duration 10 --format raw --output server.folded`` (or ``py-spy top --pid PID``).
"""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _erasure(args) -> bool:
    from ecrec.strategies import available, get_spec

    # an unknown name is refused by its own check, with the names there are
    return any(s in available() and get_spec(s).kind == "erasure" for s in (args.strategy, args.against) if s)


#: flags that apply only with another (``ecrec.bench.cli.ignored_flag``): given without it, they are refused
ONLY_WITH = (
    (("dim", "tables", "optimizer", "batch_size", "ids_per_sample"), "--rows (the quick preset's DLRM has shapes "
                                                                      "of its own)", lambda a: a.rows is not None),
    (("k", "m"), "an erasure strategy as --strategy or --against", _erasure),
    (("server", "rate", "top"), "py-spy's sampling, which --no-py-spy turns off", lambda a: not a.no_py_spy),
)


def add_arguments(p) -> None:
    p.add_argument("--strategy", default="ecrec", help="strategy of the cluster (default ecrec)")
    p.add_argument("--servers", type=int, default=4, help="embedding servers (default 4)")
    p.add_argument("--k", type=int, default=2, help="data rows per stripe (erasure strategies; default 2)")
    p.add_argument("--m", type=int, default=1, help="parity rows per stripe (erasure strategies; default 1)")
    p.add_argument("--server", type=int, default=1, help="index of the server to sample (default 1)")
    p.add_argument("--seconds", type=float, default=8.0,
                   help="how long each strategy trains, in all (default 8), sampled throughout")
    p.add_argument("--rate", type=int, default=250, help="samples per second (default 250)")
    p.add_argument("--top", type=int, default=25, help="functions to list (default 25)")
    p.add_argument("--out", help="directory for the collapsed stacks (default: a temporary one)")
    p.add_argument("--no-py-spy", action="store_true",
                   help="no sampling: only the processes' CPU per step, by server thread and by part of the strategy")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--against", metavar="STRATEGY",
                   help="a baseline cluster run beside the profiled one on the same workload (e.g. none; the two "
                        "train in alternate slices): the report adds what --strategy adds per row update, by part, "
                        "and the step times side by side")
    p.add_argument("--rounds", type=int, default=6,
                   help="rounds, in each of which every cluster trains a slice of --seconds / ROUNDS; with --against "
                        "the two run side by side, the order alternating, and the report gives the median and spread "
                        "over the rounds of what the strategy adds (default 6)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a strategy option of --strategy's cluster (repeatable; e.g. coalesce_bytes=1048576)")
    p.add_argument("--against-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a strategy option of --against's cluster (repeatable): with --against naming --strategy "
                        "itself, one setting against another side by side (e.g. --strategy ecrec --against ecrec "
                        "--against-option parity_transport=grpc)")
    p.add_argument("--server-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of --strategy's servers (repeatable; an `ecrec-server serve` flag with underscores, "
                        "a switch as true/false: e.g. no_gc_freeze=true)")
    p.add_argument("--against-server-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of --against's servers (repeatable): one server setting against another side by "
                        "side (e.g. --strategy ecrec --against ecrec --against-server-option no_gc_freeze=true)")
    p.add_argument("--rows", type=int, help="rows per table: the recovery benchmark's training workload on tables of "
                                            "this size instead of the quick preset's DLRM")
    p.add_argument("--dim", type=int, default=64, help="--rows: embedding dimension (default 64)")
    p.add_argument("--tables", type=int, default=1, help="--rows: tables (default 1)")
    p.add_argument("--optimizer", choices=("adagrad", "sgd"), default="adagrad", help="--rows: optimizer (default adagrad)")
    p.add_argument("--batch-size", type=int, default=512, help="--rows: samples per step (default 512)")
    p.add_argument("--ids-per-sample", type=int, default=4, help="--rows: ids per sample per table (default 4)")
    p.epilog = "example: ecrec-bench profile --strategy ecrec --against none --rows 4000000 --no-py-spy --seconds 20"


def _summarize(folded: Path, top: int) -> list[str]:
    """Top functions by own and by inclusive samples from py-spy's raw (collapsed) output."""
    own, inclusive = collections.Counter(), collections.Counter()
    total = 0
    for line in folded.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0].strip() + " (" + f.split(" (")[-1] if " (" in f else f for f in stack.split(";")]
        if frames:
            own[frames[-1]] += n
        for frame in set(frames[1:]):
            inclusive[frame] += n
    lines = [f"  {total} samples"]
    lines += ["  own time:"] + [f"    {100 * n / max(total, 1):5.1f}%  {name}" for name, n in own.most_common(top)]
    lines += ["  inclusive:"] + [f"    {100 * n / max(total, 1):5.1f}%  {name}" for name, n in inclusive.most_common(top)]
    return lines


def _server_counters(cluster) -> dict[str, float]:
    """Every server's counters that add up over time, summed: CPU seconds by thread kind (``thread:*``), by
    request handler (``handler:*``), rows handled (``rows:pushed``: updated by pushes) and the strategy's own (its
    ``*_cpu_s`` and event counts)."""
    out: dict[str, float] = {}
    for stats in cluster.strategy_call("stats").values():
        server = stats.get("server", {})
        items = [(f"thread:{k}", v) for k, v in server.get("threads_cpu_s", {}).items()]
        items += [(f"handler:{k}", v) for k, v in server.get("cpu_seconds", {}).items()]
        items += [(f"rows:{k}", v) for k, v in server.get("rows", {}).items()]
        items += [("gc:full_collections", server.get("gc_full_collections", 0)),  # (ecrec.server.collector)
                  ("gc:pause_s", server.get("gc_pause_s", 0.0))]
        items += [(f"strategy:{k}", v) for k, v in stats.items() if isinstance(v, (int, float))
                  and not isinstance(v, bool) and (k.endswith("_cpu_s") or k in COUNTED)]
        for key, value in items:
            out[key] = out.get(key, 0.0) + float(value)
    return out


#: strategy counters worth a figure per step (beside every ``*_cpu_s``)
COUNTED = ("groups_closed", "group_pushes", "batches_built", "relay_batches", "direct_batches", "batches_applied",
           "delta_bytes_applied", "parity_bytes_relayed", "refused_relayed_batches", "refused_watermarks",
           "framed_batches", "protobuf_batches", "parity_bytes_sent", "channel_batches", "channel_frames")


def _cpu_like(key: str) -> bool:
    """Whether a server counter is seconds (reported in ms: CPU, or ``gc:pause_s``, the wall time full garbage
    collections held the servers) rather than a count."""
    return key.startswith(("thread:", "handler:")) or key.endswith(("_cpu_s", "pause_s"))


def print_summary(report: dict) -> None:
    """The run's CPU per step, from its report (the JSON ``--json`` writes): the processes, then the servers'
    threads, request handlers and strategy counters, summed."""
    n = max(report["steps"], 1)
    elapsed = report["elapsed_s"]
    print(f"ecrec-bench profile: strategy {report.get('name') or report['strategy']}, {report['steps']} steps in {elapsed:.1f} s "
          f"({1e3 * elapsed / n:.2f} ms per step; load average {report['load_average_before'][0]:.2f} before, "
          f"{report['load_average_after'][0]:.2f} after)")
    for part, value in report["cpu_ms_per_step"].items():
        print(f"  CPU {part:<12} {value:6.2f} ms per step")
    times = report.get("step_times")  # files written before the steps were timed one by one have none
    if times and times.get("steps"):
        longest = times["longest"]
        print(f"  steps: median {times['median_ms']:.2f} ms, p90 {times['p90_ms']:.2f}, p99 {times['p99_ms']:.2f}, "
              f"max {times['max_ms']:.1f}; {times['stall_share']:.1%} of the time in steps over 30 ms; the longest: "
              f"worker CPU {longest['worker_cpu_ms']:.1f} ms, servers {longest['servers_cpu_ms']:.0f} ms (10 ms ticks)")
    print("  servers, summed, per step (CPU ms; counts):")
    for key, value in report["servers_per_step"].items():
        print(f"    {key:<40} {value:10.3f}{' ms' if _cpu_like(key) else ''}")


def _sampling(spy: str, pids: dict[str, int], seconds: float, rate: int, out: Path) -> dict:
    """py-spy recorders of ``pids`` (name -> pid), started now (none without ``spy``)."""
    if not spy:
        return {}
    return {name: subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--duration", str(max(1, math.ceil(seconds))), "--rate", str(rate),
         "--format", "raw", "--output", str(out / f"{name}.folded"), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for name, pid in pids.items()}


def stop_recorders(recorders: dict, timeout_s: float) -> dict[str, str]:
    """Waits up to ``timeout_s`` (in all) for each py-spy recorder to end, stops any still running (its samples
    are then incomplete), and returns why each one that did not end well failed (name -> reason)."""
    failed = {}
    deadline = time.monotonic() + timeout_s
    for name, rec in recorders.items():
        try:
            _, err = rec.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rec.kill()
            _, err = rec.communicate()
            failed[name] = "still running when it should have ended; stopped, its samples dropped"
            continue
        if rec.returncode != 0:
            failed[name] = (err or b"").decode(errors="replace").strip()[-400:] or f"exit code {rec.returncode}"
    return failed


def _slice(work, pids: list[int], seconds: float) -> dict:
    """Steps of ``work`` for ``seconds``, each timed (with the worker's and each server's CPU over it), and the
    processes' CPU and the servers' counters over the slice."""
    from ecrec.bench.compare_running import process_cpu_seconds

    counters_before = _server_counters(work.cluster)
    gc_before = _worker_gc()
    before = work.cpu_seconds()
    records: list[tuple[float, float, list[float]]] = []
    servers = [process_cpu_seconds(p) for p in pids]
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        t, c = time.perf_counter(), time.process_time()
        work.step()
        now = [process_cpu_seconds(p) for p in pids]
        records.append((time.perf_counter() - t, time.process_time() - c, [a - b for a, b in zip(now, servers)]))
        servers = now
    elapsed = time.perf_counter() - t0
    after = work.cpu_seconds()
    gc_after = _worker_gc()
    counters_after = _server_counters(work.cluster)
    counters = {k: counters_after.get(k, 0.0) - counters_before.get(k, 0.0)
                for k in set(counters_after) | set(counters_before)}
    counters.update({k: gc_after[k] - gc_before[k] for k in gc_before})
    return {"elapsed_s": elapsed, "records": records, "cpu_s": {k: after[k] - before[k] for k in before},
            "counters": counters}


def _worker_gc() -> dict[str, float]:
    """This process's (the worker's) full garbage collections so far (``worker_gc:*``: reported beside the servers'
    counters)."""
    import gc

    return {"worker_gc:full_collections": float(gc.get_stats()[2]["collections"])}


def _report(strategy: str, args, work, slices: list[dict], loads: tuple, name: str | None = None) -> dict:
    """One cluster's report from its slices (summed); ``name``: how the run calls it, when not its strategy."""
    from ecrec.bench import profile_runs

    records = [r for s in slices for r in s["records"]]
    n = max(len(records), 1)
    elapsed = sum(s["elapsed_s"] for s in slices)
    cpu = {part: 1e3 * sum(s["cpu_s"][part] for s in slices) / n for part in ("worker", "servers", "coordinator")}
    keys = sorted({k for s in slices for k in s["counters"]})
    per_step = {k: sum(s["counters"].get(k, 0.0) for s in slices) / n for k in keys}
    from ecrec.bench.recovery import server_gc

    named = {"name": name} if name and name != strategy else {}
    return {"strategy": strategy, **named, "servers": args.servers, "k": args.k, "m": args.m, "steps": len(records),
            "elapsed_s": elapsed, "load_average_before": list(loads[0]), "load_average_after": list(loads[1]),
            "workload": work.description, "samples_per_s": len(records) * work.samples / max(elapsed, 1e-9),
            "cpu_ms_per_step": cpu,
            "servers_per_step": {k: (1e3 * v if _cpu_like(k) else v) for k, v in per_step.items()},
            "step_times": profile_runs.step_records(records),
            "servers_gc": server_gc(work.cluster),
            "units": "servers_per_step: CPU ms for thread:*, handler:* and *_cpu_s, ms for gc:pause_s; counts for the "
                     "rest (worker_gc:*: the worker's, this process's)",
            "sampled": {}}


def profile(runs: list[tuple[str, str, dict, dict]], args, out: Path, spy: str) -> tuple[dict, list[dict]]:
    """The clusters of ``runs`` (``(name, strategy, options, server options)``, :func:`profile_runs.clusters`) side
    by side: each
    started and warmed, then ``args.rounds`` rounds in which each trains a slice of ``args.seconds / args.rounds``
    (the order alternating from round to round, the other cluster idle meanwhile); py-spy samples the last one's
    server and this worker throughout when ``spy``.  Returns each cluster's report by name (its slices summed) and
    each round's reports."""
    from ecrec.bench import profile_runs

    works: dict = {}
    recorders: dict = {}
    failed: dict = {}
    strategies = [name for name, *_ in runs]
    kinds = {name: strategy for name, strategy, *_ in runs}
    try:
        for i, (name, strategy, options, settings) in enumerate(runs):
            print(f"ecrec-bench profile: starting a cluster of {name} ...", file=sys.stderr)
            works[name] = profile_runs.workload(strategy, args, out / f"{i}-{strategy}", options, settings)
            works[name].warm()
        target = strategies[-1]
        pids = {s: w.server_pids() for s, w in works.items()}
        procs = {f"server{args.server}": pids[target][args.server], "worker": os.getpid()}
        recorders = _sampling(spy, procs, args.seconds * len(strategies), args.rate, out)
        load_before = os.getloadavg()
        slices: dict[str, list[dict]] = {s: [] for s in strategies}
        rounds = []
        for r in range(args.rounds):
            order = strategies if r % 2 == 0 else strategies[::-1]
            done = {}
            for strategy in order:
                done[strategy] = _slice(works[strategy], pids[strategy], args.seconds / args.rounds)
                slices[strategy].append(done[strategy])
            rounds.append(done)
            print(f"ecrec-bench profile: round {r + 1} of {args.rounds}: "
                  + ", ".join(f"{s} {len(d['records'])} steps" for s, d in done.items()), file=sys.stderr)
        failed = stop_recorders(recorders, args.seconds * len(strategies) + 60)
        for name, why in failed.items():
            print(f"ecrec-bench profile: py-spy on {name} failed: {why}", file=sys.stderr)
        loads = (load_before, os.getloadavg())
        reports = {s: _report(kinds[s], args, works[s], slices[s], loads, s) for s in strategies}
        per_round = [{s: _report(kinds[s], args, works[s], [d], loads, s) for s, d in done.items()} for done in rounds]
    finally:
        for rec in recorders.values():  # on an error: none left behind (after the rounds they have all ended)
            if rec.poll() is None:
                rec.kill()
                rec.wait()
        for work in works.values():
            work.close()
    for name in procs:
        folded = out / f"{name}.folded"
        if folded.exists() and name not in failed:  # a recorder that failed or was stopped: no summary
            reports[target]["sampled"][name] = _summarize(folded, args.top)
            reports[target].setdefault("sampled_files", {})[name] = str(folded)
    return reports, per_round


def run(args) -> int:
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if args.no_py_spy:
        spy = ""
    elif not os.path.exists(spy):
        print("ecrec-bench profile: py-spy is not installed (pip install py-spy, or the dev extra)", file=sys.stderr)
        return 2
    from ecrec.bench import profile_runs

    problem = _check(args)
    if problem:
        print(f"ecrec-bench profile: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ecrec-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    kept: set[Path] = set()
    try:
        return _run(args, out, spy, kept)
    finally:
        if not args.out:  # a temporary directory: the clusters' files (checkpoints of a model's size) go
            _remove_except(out, kept)


def _remove_except(folder: Path, kept: set[Path]) -> None:
    """Removes everything under ``folder`` but the files in ``kept`` (and ``folder`` itself when nothing is)."""
    import shutil

    kept = {p.resolve() for p in kept}
    if not kept:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.resolve() in kept:
            continue
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                path.rmdir()
        else:
            path.unlink(missing_ok=True)


def _run(args, out: Path, spy: str, kept: set[Path]) -> int:
    from ecrec.bench import profile_runs

    runs = profile_runs.clusters(args)
    base = runs[0][0] if args.against else None
    reports, per_round = profile(runs, args, out, spy)
    for report in reports.values():
        print_summary(report)
    report = reports[args.strategy]
    kept.update(Path(p) for r in reports.values() for p in r.get("sampled_files", {}).values() if p)
    for name, lines in report["sampled"].items():
        print(f"\n{name} ({report.get('sampled_files', {}).get(name, '')}):")
        print("\n".join(lines))
    document = {**report, "options": runs[-1][2]}  # the options of the profiled cluster (reproduce the file)
    if runs[-1][3]:
        document["server_options"] = runs[-1][3]
    if args.against:
        added = profile_runs.added_by(reports[base], report)
        rounds_added = [profile_runs.added_by(r[base], r[args.strategy]) for r in per_round]
        print()
        profile_runs.print_added(added, base, args.strategy)
        document = {"command": "profile", "against": base, "against_strategy": args.against, "strategy": args.strategy,
                    "workload": report["workload"], "options": runs[-1][2], "against_options": runs[0][2],
                    "seconds": args.seconds, "rounds": args.rounds, "flags": _flags(args), "runs": reports,
                    "per_round": per_round, "added": added, "rounds_added": rounds_added,
                    "summary": profile_runs.summarize(rounds_added)}
        for key, settings in (("server_options", runs[-1][3]), ("against_server_options", runs[0][3])):
            if settings:
                document[key] = settings
        if args.rounds > 1:
            print()
            profile_runs.print_summary_of_runs(document["summary"], base, args.strategy)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(document, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _flags(args) -> str:
    """The command line's options that shape the workload and the cluster (what reproduces the file)."""
    out = []
    for name in ("servers", "k", "m", "rows", "dim", "tables", "optimizer", "batch_size", "ids_per_sample"):
        value, default = getattr(args, name), _DEFAULTS.get(name)
        if value is not None and value != default and (args.rows or name in ("servers", "k", "m")):
            out.append(f"--{name.replace('_', '-')} {value}")
    out += [f"--option {o}" for o in args.option]
    out += [f"--against-option {o}" for o in args.against_option]
    out += [f"--server-option {o}" for o in args.server_option]
    out += [f"--against-server-option {o}" for o in args.against_server_option]
    return " ".join(out)


#: the defaults of the options :func:`_flags` names
_DEFAULTS = {"servers": 4, "k": 2, "m": 1, "rows": None, "dim": 64, "tables": 1, "optimizer": "adagrad",
             "batch_size": 512, "ids_per_sample": 4}


def _check(args) -> str:
    """What is wrong with the arguments ("" when nothing)."""
    from ecrec.strategies import available

    names = available()
    for flag, value in (("--strategy", args.strategy), ("--against", args.against)):
        if value and value not in names:
            return f"{flag} {value!r} is not a strategy (installed: {', '.join(names)})"
    if args.against_option and not args.against:
        return "--against-option needs --against"
    if args.against_server_option and not args.against:
        return "--against-server-option needs --against"
    from ecrec.bench.profile_runs import server_options

    try:
        mine = server_options(args.server_option)
        theirs = server_options(args.against_server_option, "--against-server-option")
    except ValueError as exc:
        return str(exc)
    if (args.against and args.against == args.strategy and sorted(args.against_option) == sorted(args.option)
            and mine == theirs):
        return ("--against names --strategy itself with the same options: give the baseline another setting "
                "(--against-option KEY=VALUE, --against-server-option KEY=VALUE) or name another strategy")
    from ecrec.bench.checks import servers_problem

    if args.servers < 1:
        return "--servers must be >= 1"
    problem = servers_problem(args.servers)
    if problem:
        return problem
    if not 0 <= args.server < args.servers:
        return f"--server must be in [0, {args.servers})"
    if args.seconds <= 0:
        return "--seconds must be > 0"
    if args.rounds < 1:
        return "--rounds must be >= 1"
    if args.rate < 1:
        return "--rate must be >= 1 (samples per second)"
    if args.top < 1:
        return "--top must be >= 1"
    for flag, items in (("--option", args.option), ("--against-option", args.against_option)):
        for item in items:
            if "=" not in item:
                return f"{flag} {item!r}: expected KEY=VALUE"
    if args.rows is not None and args.rows < 1:
        return "--rows must be >= 1"
    for flag, value in (("--dim", args.dim), ("--tables", args.tables), ("--batch-size", args.batch_size),
                        ("--ids-per-sample", args.ids_per_sample)):
        if value < 1:
            return f"{flag} must be >= 1"
    if args.rows is not None:  # the clusters run side by side, each with its tables
        from ecrec.bench.checks import tables_problem

        erasure = _erasure(args)
        problem = tables_problem(f"--tables {args.tables} x --rows {args.rows} x --dim {args.dim}",
                                 args.tables * (2 if args.against else 1), args.rows, args.dim, args.optimizer,
                                 *((args.k, args.m) if erasure else (0, 0)))
        if problem:
            return problem
    from ecrec.strategies import get_spec
    from ecrec.strategies.registry import cluster_error

    for flag, strategy, items in (("--strategy/--option/--k/--m", args.strategy, args.option),
                                  ("--against/--against-option/--k/--m", args.against, args.against_option)):
        kind = get_spec(strategy).kind if strategy else None
        options = dict(item.split("=", 1) for item in items)
        if kind == "checkpoint" and args.rows is not None:  # --rows: its directory is the profile's, its interval
            options.setdefault("dir", "checkpoints")        # the user's to give (the quick preset models one)
        elif kind not in ("none", "erasure"):
            continue
        erasure = kind == "erasure"
        error = cluster_error(strategy, args.servers, args.k if erasure else 0, args.m if erasure else 0, options)
        if error:
            return f"{flag}: {error}"
    from ecrec.bench.cli import ignored_flag

    return ignored_flag(args) or ""
