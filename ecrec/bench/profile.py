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
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--strategy", default="ecrec", help="strategy of the cluster (default ecrec)")
    p.add_argument("--servers", type=int, default=4, help="embedding servers (default 4)")
    p.add_argument("--k", type=int, default=2, help="data rows per stripe (erasure strategies; default 2)")
    p.add_argument("--m", type=int, default=1, help="parity rows per stripe (erasure strategies; default 1)")
    p.add_argument("--server", type=int, default=1, help="index of the server to sample (default 1)")
    p.add_argument("--seconds", type=float, default=8.0, help="how long to sample (default 8)")
    p.add_argument("--rate", type=int, default=250, help="samples per second (default 250)")
    p.add_argument("--top", type=int, default=25, help="functions to list (default 25)")
    p.add_argument("--out", help="directory for the collapsed stacks (default: a temporary one)")
    p.add_argument("--no-py-spy", action="store_true",
                   help="no sampling: only the processes' CPU per step, by server thread and by part of the strategy")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.epilog = "example: ecrec-bench profile --strategy ecrec --seconds 8"


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
    request handler (``handler:*``) and the strategy's own (its ``*_cpu_s`` and event counts)."""
    out: dict[str, float] = {}
    for stats in cluster.strategy_call("stats").values():
        server = stats.get("server", {})
        items = [(f"thread:{k}", v) for k, v in server.get("threads_cpu_s", {}).items()]
        items += [(f"handler:{k}", v) for k, v in server.get("cpu_seconds", {}).items()]
        items += [(f"strategy:{k}", v) for k, v in stats.items() if isinstance(v, (int, float))
                  and not isinstance(v, bool) and (k.endswith("_cpu_s") or k in COUNTED)]
        for key, value in items:
            out[key] = out.get(key, 0.0) + float(value)
    return out


#: strategy counters worth a figure per step (beside every ``*_cpu_s``)
COUNTED = ("groups_closed", "group_pushes", "batches_built", "relay_batches", "direct_batches", "batches_applied",
           "delta_bytes_applied", "parity_bytes_relayed", "refused_relayed_batches", "refused_watermarks")


def _cpu_like(key: str) -> bool:
    """Whether a server counter is CPU seconds (reported in ms) rather than a count."""
    return key.startswith(("thread:", "handler:")) or key.endswith("_cpu_s")


def print_summary(report: dict) -> None:
    """The run's CPU per step, from its report (the JSON ``--json`` writes): the processes, then the servers'
    threads, request handlers and strategy counters, summed."""
    n = max(report["steps"], 1)
    elapsed = report["elapsed_s"]
    print(f"ecrec-bench profile: strategy {report['strategy']}, {report['steps']} steps in {elapsed:.1f} s "
          f"({1e3 * elapsed / n:.2f} ms per step; load average {report['load_average_before'][0]:.2f} before, "
          f"{report['load_average_after'][0]:.2f} after)")
    for part, value in report["cpu_ms_per_step"].items():
        print(f"  CPU {part:<12} {value:6.2f} ms per step")
    print("  servers, summed, per step (CPU ms; counts):")
    for key, value in report["servers_per_step"].items():
        print(f"    {key:<40} {value:10.3f}{' ms' if _cpu_like(key) else ''}")


def run(args) -> int:
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if args.no_py_spy:
        spy = ""
    elif not os.path.exists(spy):
        print("ecrec-bench profile: py-spy is not installed (pip install py-spy, or the dev extra)", file=sys.stderr)
        return 2
    from argparse import Namespace

    from ecrec.bench import compare

    if not 0 <= args.server < args.servers:
        print(f"ecrec-bench profile: --server must be in [0, {args.servers})", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ecrec-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(compare.PRESETS["quick"], servers=args.servers, k=args.k, m=args.m, steps=100_000)
    cargs = Namespace(dataset="synthetic", seed=0, mtbf_hours=None, checkpoint_interval_steps=None, workers=1,
                      keep=False)
    data_path, _ = compare.prepare_data(cargs, cfg, out)
    run_ = compare.StrategyRun(args.strategy, args.strategy, cargs, cfg, data_path, out, None)
    try:
        run_.advance(30)  # warm up (tables, numba, first pulls)
        server_pid = run_.local.pid_of_index(args.server)
        procs = {f"server{args.server}": server_pid, "worker": os.getpid()}
        stop = threading.Event()
        recorders = {name: subprocess.Popen(
            [spy, "record", "--pid", str(pid), "--duration", str(int(args.seconds)), "--rate", str(args.rate),
             "--format", "raw", "--output", str(out / f"{name}.folded"), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for name, pid in procs.items()} if spy else {}
        load_before = os.getloadavg()
        counters_before = _server_counters(run_.trainer.cluster)
        before = run_.cpu_seconds()
        step0 = run_.trainer.step
        t0 = time.perf_counter()

        def train():
            while not stop.is_set():
                run_.advance(run_.trainer.step + 10)

        worker = threading.Thread(target=train, daemon=True)
        worker.start()
        for name, rec in recorders.items():
            _, err = rec.communicate(timeout=args.seconds + 60)
            if rec.returncode != 0:
                print(f"ecrec-bench profile: py-spy on {name} failed: {err.decode().strip()[-400:]}", file=sys.stderr)
        if not recorders:
            time.sleep(args.seconds)
        stop.set()
        worker.join()
        steps = run_.trainer.step - step0
        after = run_.cpu_seconds()
        counters_after = _server_counters(run_.trainer.cluster)
        elapsed = time.perf_counter() - t0
        load_after = os.getloadavg()
    finally:
        run_.close()
    n = max(steps, 1)
    cpu = {part: 1e3 * (after[part] - before[part]) / n for part in ("worker", "servers", "coordinator")}
    per_step = {key: (counters_after.get(key, 0.0) - counters_before.get(key, 0.0)) / n
                for key in sorted(set(counters_after) | set(counters_before))}
    report = {"strategy": args.strategy, "servers": args.servers, "k": args.k, "m": args.m, "steps": steps,
              "elapsed_s": elapsed, "load_average_before": list(load_before), "load_average_after": list(load_after),
              "cpu_ms_per_step": cpu,
              "servers_per_step": {k: (1e3 * v if _cpu_like(k) else v) for k, v in per_step.items()},
              "units": "servers_per_step: CPU ms for thread:*, handler:* and *_cpu_s; counts for the rest",
              "sampled": {}}
    print_summary(report)
    for name in procs:
        folded = out / f"{name}.folded"
        if folded.exists():
            lines = _summarize(folded, args.top)
            report["sampled"][name] = lines
            print(f"\n{name} ({folded}):")
            print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
