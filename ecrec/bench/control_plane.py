"""``ecrec-bench control-plane``: what running the control plane on etcd costs in failure-free training.

Two clusters of the same shape run side by side: one with its map in a file (one coordinator), one on a real etcd
(``--etcd-members`` members, ``--coordinators`` coordinators, one leading).  One worker trains on each in turn, in
``--rounds`` paired rounds of ``--steps`` steps (the order alternates), and every slice records the CPU seconds of
each process of that cluster (``/proc``: servers, coordinators, etcd members) and of the worker's thread, and its
wall time.  Printed and saved: the median CPU per step of each part per store, and the median of the paired
ratios etcd / file with their range (CPU seconds do not depend on what else the machine runs; wall time does,
and is reported beside, with the load averages).

Example::

    ecrec-bench control-plane --rounds 6 --steps 150 --json control-plane.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--servers", type=int, default=4, help="servers of each cluster (default 4; ecrec k=2 m=1)")
    p.add_argument("--rows", type=int, default=20_000, help="rows of the one table (default 20,000)")
    p.add_argument("--dim", type=int, default=16, help="embedding dim (default 16)")
    p.add_argument("--batch", type=int, default=256, help="samples per step, 8 ids each (default 256)")
    p.add_argument("--rounds", type=int, default=6, help="paired rounds (default 6)")
    p.add_argument("--steps", type=int, default=150, help="steps per slice (default 150)")
    p.add_argument("--coordinators", type=int, default=2, help="coordinators on etcd (default 2)")
    p.add_argument("--etcd-members", type=int, default=1, help="etcd members (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here")


def _positive(args) -> None:
    """Raises ValueError naming a count below 1, or more processes than this machine is asked to start."""
    from ecrec.bench.checks import count_problem, servers_problem
    from ecrec.config import LOCAL_MEMBERS

    for name in ("servers", "rows", "dim", "batch", "rounds", "steps", "coordinators", "etcd_members"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    problem = (servers_problem(args.servers)
               or count_problem("--coordinators", args.coordinators, LOCAL_MEMBERS, "each is a process of its own")
               or count_problem("--etcd-members", args.etcd_members, LOCAL_MEMBERS, "each is a process of its own"))
    if problem:
        raise ValueError(problem)


def _processes(local) -> dict[str, list[int]]:
    coordinators = local.coordinator_procs or [local.coordinator_proc]
    etcd = [p for p in (local.etcd.procs if local.etcd is not None else []) if p is not None]
    return {"servers": [p.pid for p in local.server_procs if p.poll() is None],
            "coordinators": [p.pid for p in coordinators if p.poll() is None],
            "etcd": [p.pid for p in etcd if p.poll() is None]}


def _cpu(pids: dict[str, list[int]]) -> dict[str, float]:
    from ecrec.bench.compare_running import process_cpu_seconds
    return {part: sum(process_cpu_seconds(p) for p in ps) for part, ps in pids.items()}


def summarize(slices: list[dict]) -> dict:
    """Per store: median CPU seconds per step of each part and in all; the paired ratios etcd / file (same round)
    of the total CPU per step and of the wall time per step, median and range.  A function of the slices only."""
    out: dict = {"stores": {}}
    for store in ("file", "etcd"):
        mine = [s for s in slices if s["store"] == store]
        parts = sorted({k for s in mine for k in s["cpu_s"]})
        out["stores"][store] = {
            "cpu_s_per_step": {p: statistics.median(s["cpu_s"][p] / s["steps"] for s in mine) for p in parts},
            "total_cpu_s_per_step": statistics.median(sum(s["cpu_s"].values()) / s["steps"] for s in mine),
            "wall_s_per_step": statistics.median(s["wall_s"] / s["steps"] for s in mine),
        }
    rounds = sorted({s["round"] for s in slices})
    cpu_ratios, wall_ratios = [], []
    for r in rounds:
        pair = {s["store"]: s for s in slices if s["round"] == r}
        if set(pair) == {"file", "etcd"}:
            per = {k: sum(v["cpu_s"].values()) / v["steps"] for k, v in pair.items()}
            cpu_ratios.append(per["etcd"] / per["file"])
            wall_ratios.append((pair["etcd"]["wall_s"] / pair["etcd"]["steps"])
                               / (pair["file"]["wall_s"] / pair["file"]["steps"]))
    for name, xs in (("cpu_ratio", cpu_ratios), ("wall_ratio", wall_ratios)):
        out[name] = ({"median": statistics.median(xs), "min": min(xs), "max": max(xs), "pairs": xs}
                     if xs else None)
    return out


def run(args) -> int:
    import torch

    from ecrec.client import Cluster, EmbeddingBag
    from ecrec.ops.local import LocalCluster, LocalClusterSpec
    from ecrec.strategies.registry import cluster_error

    try:
        _positive(args)
    except ValueError as exc:
        print(f"ecrec-bench control-plane: {exc}", file=sys.stderr)
        return 2
    error = cluster_error("ecrec", args.servers, 2, 1, {})
    if error:  # before any process starts
        print(f"ecrec-bench control-plane: --servers {args.servers}: {error}", file=sys.stderr)
        return 2
    from ecrec.bench.checks import tables_problem

    problem = tables_problem(f"--rows {args.rows} x --dim {args.dim} (in each of two clusters)", 2, args.rows,
                             args.dim, "adagrad", 2, 1)
    if problem:
        print(f"ecrec-bench control-plane: {problem}", file=sys.stderr)
        return 2
    from ecrec.control.etcd_local import etcd_binary

    try:
        etcd_binary()  # found before the file cluster starts, not after
    except FileNotFoundError as exc:
        print(f"ecrec-bench control-plane: {exc} (the etcd cluster needs it; nothing was started)", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    clusters = {}
    try:
        for store in ("file", "etcd"):
            extra = dict(store="etcd", coordinators=args.coordinators, etcd_members=args.etcd_members) \
                if store == "etcd" else {}
            print(f"starting the {store} cluster ...", flush=True)
            clusters[store] = LocalCluster(LocalClusterSpec(servers=args.servers, strategy="ecrec", k=2, m=1,
                                                            **extra)).start()
        clients, bags = {}, {}
        for store, local in clusters.items():
            client = Cluster.connect(local.coordinator_address, worker=f"bench-{store}")
            client.create_table("t", args.rows, args.dim, optimizer="adagrad", seed=args.seed)
            clients[store], bags[store] = client, EmbeddingBag(client, "t")
        rng = np.random.default_rng(args.seed)

        def train(store: str, steps: int) -> None:
            for _ in range(steps):
                ids = torch.as_tensor(rng.integers(0, args.rows, (args.batch, 8)))
                bags[store](ids).sum().backward()
                clients[store].step()

        for store in clusters:  # warm up: connections, allocations
            train(store, 20)
        slices = []
        for r in range(args.rounds):
            order = ("file", "etcd") if r % 2 == 0 else ("etcd", "file")
            for store in order:
                pids = _processes(clusters[store])
                before, worker0, t0 = _cpu(pids), time.thread_time(), time.perf_counter()
                train(store, args.steps)
                wall, worker = time.perf_counter() - t0, time.thread_time() - worker0
                after = _cpu(pids)
                cpu = {part: after[part] - before[part] for part in after}
                cpu["worker"] = worker
                slices.append({"round": r, "store": store, "steps": args.steps, "wall_s": wall, "cpu_s": cpu})
                print(f"round {r} {store:4s}: {wall / args.steps * 1e3:6.2f} ms/step wall, "
                      f"{sum(cpu.values()) / args.steps * 1e3:6.2f} ms/step CPU "
                      f"({', '.join(f'{k} {v / args.steps * 1e3:.2f}' for k, v in cpu.items())})", flush=True)
        for client in clients.values():
            client.close()
    finally:
        for local in clusters.values():
            local.close()
    summary = summarize(slices)
    load_after = os.getloadavg()
    report = {"config": {**{k: v for k, v in vars(args).items() if not k.startswith("_")},
                         "command": "control-plane", "json": os.path.basename(args.json) if args.json else None,
                         "cpu_count": os.cpu_count(), "load_average_before": list(load_before),
                         "load_average_after": list(load_after)},
              "slices": slices, "summary": summary}
    print_summary(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def print_summary(report: dict) -> None:
    """The run's summary, from its report (the JSON ``--json`` writes): CPU per step by part and store, the
    paired etcd / file ratios, the load."""
    summary, config = report["summary"], report["config"]
    print("\nCPU ms per step (median of the slices):")
    for store, s in summary["stores"].items():
        print(f"  {store:4s}: total {s['total_cpu_s_per_step'] * 1e3:6.2f}  "
              + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in s["cpu_s_per_step"].items())
              + f"  (wall {s['wall_s_per_step'] * 1e3:.2f} ms/step)")
    c, w = summary["cpu_ratio"], summary["wall_ratio"]
    print(f"etcd / file, paired by round: CPU per step {c['median']:.3f} (range {c['min']:.3f}-{c['max']:.3f}), "
          f"wall per step {w['median']:.3f} (range {w['min']:.3f}-{w['max']:.3f})")
    print(f"load average before {config['load_average_before'][0]:.2f}, after {config['load_average_after'][0]:.2f} "
          f"({config['cpu_count']} cores)")
