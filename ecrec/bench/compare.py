"""``ecrec-bench compare``: one workload, one failure trace, every strategy, one report.

For each strategy it starts a local cluster (separate processes on 127.0.0.1, one standby),
trains the same DLRM on the same data through the SDK, kills the same server (SIGKILL) at the
same step, and measures side by side in one run:

- failure-free throughput (steps before the failure) and its overhead against ``none`` (a
  failure-free reference run of ``none`` is always made first; its final state is also the
  reference of ``state_matches_failure_free``);
- the failure: promotion of the standby, time back to full speed (``recovery_s``; for full
  recovery that includes redoing the rolled-back steps), full redundancy, the longest step,
  throughput while recovering over throughput before;
- lost updates (counted exactly: the checkpoint driver's balance for ``cpr*``; the failed
  shard's acknowledged row updates for ``none``; zero for ``ecrec`` when the state matches
  the failure-free run bit for bit), PLS, test AUC and log loss;
- memory held for redundancy over model bytes, checkpoint bytes written, network bytes.

Prints a table, and writes ``--json`` and a ``--plot`` of throughput over time with the
failure marked.  ``--workers W > 1`` launches W workers with torchrun, each on its own shard.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np



def strategy_names() -> list[str]:
    """Every installed strategy, in report order (from the specs: nothing here lists them)."""
    from ecrec.strategies import ordered

    return ordered()


def _kind(strategy: str) -> str:
    """The kind of a strategy (``none``, ``erasure``, ``checkpoint``); a report label such as
    ``none (no failure)`` names its strategy first."""
    from ecrec.strategies import get_spec

    return get_spec(strategy.split(" ", 1)[0]).kind
PRESETS = {
    # a few minutes on 2 cores for every strategy
    "quick": dict(servers=4, k=2, m=1, steps=1000, fail_at=700, fail_server=1, batch_size=256, tables=8,
                  rows_per_table=20_000, samples=60_000, embedding_dim=16, checkpoint_interval_steps=100,
                  cpr_interval_s=1.5, partial_interval_s=0.4),
    # a larger run: more steps and rows
    "standard": dict(servers=4, k=2, m=1, steps=1500, fail_at=800, fail_server=1, batch_size=512, tables=26,
                     rows_per_table=50_000, samples=300_000, embedding_dim=16, checkpoint_interval_steps=200,
                  cpr_interval_s=8.0, partial_interval_s=2.0),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick", help="workload size (default quick)")
    p.add_argument("--strategies", default=None,
                   help=f"comma-separated (default: every installed one, {','.join(strategy_names())})")
    p.add_argument("--servers", type=int, help="embedding servers")
    p.add_argument("--k", type=int, help="data rows per stripe (ecrec)")
    p.add_argument("--m", type=int, help="parity rows per stripe (ecrec)")
    p.add_argument("--steps", type=int, help="training steps per worker")
    p.add_argument("--fail-at", type=int, help="step at which a server is killed (negative: no failure)")
    p.add_argument("--fail-server", type=int, help="index of the server killed")
    p.add_argument("--batch-size", type=int, help="samples per step per worker")
    p.add_argument("--dataset", default="synthetic",
                   help="synthetic (default; generated, Zipf ids with a planted signal) | criteo:PATH | movielens")
    p.add_argument("--checkpoint-interval-steps", type=int, help="checkpoint interval of full/cpr* (default: preset)")
    p.add_argument("--mtbf-hours", type=float, default=None,
                   help="MTBF for the checkpoint interval model (used when no explicit interval is given)")
    p.add_argument("--workers", type=int, default=1, help="training workers (> 1: launched with torchrun)")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds of failure-free throughput measurement (default 5)")
    p.add_argument("--model", choices=["auto", "ecrec", "torchrec"], default="auto",
                   help="the DLRM: TorchRec's (torchrec.models.dlrm.DLRM over our cluster collection), ours, or auto "
                        "(default: TorchRec's when the torchrec extra is installed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of throughput over time, failure marked")
    p.add_argument("--work-dir", help="where data and checkpoints go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")


# --- data -----------------------------------------------------------------------------------------
def prepare_data(args, cfg: dict, work: Path) -> tuple[Path, dict]:
    """Writes the dataset as .npz (dense, ids, labels, table_sizes) and returns its description."""
    from ecrec.workload.data import InMemoryDataset, write_synthetic_criteo

    out = work / "data.npz"
    if args.dataset == "synthetic":
        tsv = work / "synthetic.tsv"
        info = write_synthetic_criteo(tsv, num_samples=cfg["samples"], num_tables=cfg["tables"],
                                      rows_per_table=cfg["rows_per_table"], seed=args.seed)
        ds = InMemoryDataset.from_tsv(tsv, info.table_sizes, num_sparse=len(info.table_sizes))
        desc = {"name": "synthetic", "samples": len(ds), "tables": len(info.table_sizes),
                "rows_per_table": cfg["rows_per_table"], "oracle_auc": info.oracle_auc}
    elif args.dataset.startswith("criteo:"):
        path = args.dataset.split(":", 1)[1]
        if not os.path.exists(path):
            raise SystemExit(f"ecrec-bench compare: no such Criteo file {path!r}")
        ds = InMemoryDataset.from_tsv(path, cfg["rows_per_table"])
        desc = {"name": "criteo", "path": path, "samples": len(ds), "tables": ds.num_tables,
                "rows_per_table": cfg["rows_per_table"]}
    elif args.dataset == "movielens":
        from ecrec.workload.movielens import load_movielens

        try:
            ml = load_movielens()
        except FileNotFoundError as exc:
            raise SystemExit(f"ecrec-bench compare: {exc}\n  fetch it with: python -m ecrec.workload.movielens fetch") from None
        ds = ml.dataset()
        desc = {"name": "movielens-100k", "samples": len(ds), "tables": ds.num_tables}
    else:
        raise SystemExit(f"ecrec-bench compare: unknown --dataset {args.dataset!r} (synthetic | criteo:PATH | movielens)")
    np.savez(out, dense=ds.dense, ids=ds.ids, labels=ds.labels, table_sizes=np.asarray(ds.table_sizes))
    return out, desc


# --- one run ----------------------------------------------------------------------------------------
class StrategyRun:
    """One strategy's local cluster and worker, advanced in pieces so strategies can be interleaved."""

    def __init__(self, strategy: str, label: str, args, cfg: dict, data_path: Path, work: Path, fail_at: int | None):
        from ecrec.bench.trainer import TrainConfig
        from ecrec.local import LocalCluster, LocalClusterSpec

        self.strategy, self.label, self.args, self.cfg, self.fail_at = strategy, label, args, cfg, fail_at
        options = {}
        k = m = 0
        if _kind(strategy) == "erasure":
            k, m = cfg["k"], cfg["m"]
        if _kind(strategy) == "checkpoint":
            from baselines.options import VARIANTS

            variant, full_only = VARIANTS[strategy]
            ckpt = work / f"ckpt-{label}"
            shutil.rmtree(ckpt, ignore_errors=True)
            options["dir"] = str(ckpt)
            if args.mtbf_hours and not args.checkpoint_interval_steps:
                options["mtbf_s"] = str(args.mtbf_hours * 3600)
            elif full_only:  # consistent cuts: the driver saves every N steps
                options["interval_steps"] = str(cfg["checkpoint_interval_steps"])
            else:  # partial recovery: each server saves on its own timer
                options["interval_s"] = str(cfg["cpr_interval_s"])
            if variant is not None:
                options[f"{variant}_interval_s"] = str(cfg["partial_interval_s"])
        self.local = LocalCluster(LocalClusterSpec(servers=cfg["servers"], standby=1, strategy=strategy, k=k, m=m,
                                                   options=options))
        self.records_dir = work / f"records-{label}"
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.killed: dict = {}
        self.trainer = None
        self.local.start()
        self.tcfg = TrainConfig(
            address=self.local.coordinator_address, data_path=str(data_path), strategy=strategy, steps=cfg["steps"],
            batch_size=cfg["batch_size"], embedding_dim=cfg["embedding_dim"], seed=args.seed,
            checkpoint_interval_steps=cfg["checkpoint_interval_steps"] if "interval_steps" in options else None,
            mtbf_s=args.mtbf_hours * 3600 if args.mtbf_hours else None, records_dir=str(self.records_dir),
            model=getattr(args, "model", "auto"))

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far (user + system, from the processes' own counters): this process (the worker),
        the cluster's servers (standbys included) and its coordinator."""
        return {"worker": time.process_time(),
                "servers": sum(process_cpu_seconds(p.pid) for p in self.local.server_procs),
                "coordinator": process_cpu_seconds(self.local.coordinator_proc.pid)}

    def kill(self) -> None:
        self.killed["pid"] = self.local.pid_of_index(self.cfg["fail_server"])
        self.killed["time"] = time.time()
        self.local.kill(self.killed["pid"])

    def _on_step(self, step: int) -> None:
        _progress(self.label, step, self.cfg["steps"])
        if self.fail_at is not None and step == self.fail_at and "pid" not in self.killed:
            self.kill()

    def advance(self, until: int) -> int:
        """Trains (in this process) until step ``until``; returns the samples trained."""
        if self.trainer is None:
            from ecrec.bench.trainer import Trainer

            self.trainer = Trainer(self.tcfg, 0, 1)
        return self.trainer.advance(until, self._on_step)

    def finish(self) -> dict:
        """Trains to the end (the failure included) and collects the run's figures; stops the cluster."""
        try:
            if self.args.workers > 1:
                result = _run_torchrun(self.tcfg, self.args.workers, self.records_dir, self.fail_at, self.kill, self.label)
                state = None
            else:
                self.advance(self.cfg["steps"])
                _progress(self.label, self.cfg["steps"], self.cfg["steps"], done=True)
                result = self.trainer.finish()
                state = _final_state(result.get("cluster"), self.local)
            cluster_map = self.local.cluster_map()
            stats = _strategy_stats(self.local, self.strategy)
        finally:
            self.close()
        return {"result": result, "killed": self.killed, "state": state, "stats": stats, "map": cluster_map,
                "events": [dict(kind=e.kind, index=e.index, wall_time=e.wall_time) for e in cluster_map.events]}

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        self.local.close()
        if not self.args.keep:
            shutil.rmtree(self.records_dir, ignore_errors=True)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process from ``/proc/PID/stat`` (0 when it is gone or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def run_strategy(strategy: str, args, cfg: dict, data_path: Path, work: Path, fail_at: int | None,
                 progress_label: str) -> dict:
    """One strategy from start to end on its own (no interleaving)."""
    run = StrategyRun(strategy, progress_label, args, cfg, data_path, work, fail_at)
    return run.finish()


def run_interleaved(strategies: list[str], args, cfg: dict, data_path: Path, work: Path, fail_at: int,
                    rounds: int) -> tuple[dict, dict, dict]:
    """Failure-free throughput measured side by side, then each strategy's failure.

    Every strategy's cluster (and a failure-free ``none`` reference) is started; the steps up to
    a little before the failure are trained in ``rounds`` slices, strategy after strategy in a
    rotating order, so machine noise hits all alike; the per-round throughput ratios against the
    reference give the overhead. Then each strategy trains on alone, through its failure (the
    last ``max(50, checkpoint interval)`` steps before it run uninterrupted, so checkpoint cycles
    are in their normal phase when the server dies).
    """
    names = ["reference", *strategies]
    runs: dict[str, StrategyRun] = {}
    try:
        for name in names:
            runs[name] = StrategyRun("none" if name == "reference" else name, name, args, cfg, data_path, work,
                                     None if name == "reference" else fail_at)
        warm = min(10, fail_at // 4)
        for run in runs.values():
            run.advance(warm)
        # the last steps before the failure run alone and uninterrupted, so checkpoint cycles (timers)
        # are in a normal phase when the server dies
        lead = max(cfg.get("checkpoint_interval_steps") or 0, 50)
        end = max(warm + rounds, fail_at - lead)
        bounds = np.linspace(warm, end, rounds + 1).astype(int)
        rates: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, dict[str, float]] = {n: {"worker": 0.0, "servers": 0.0, "coordinator": 0.0} for n in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                before = runs[name].cpu_seconds()
                t0 = time.perf_counter()
                samples = runs[name].advance(int(bounds[r + 1]))
                rates[name].append(samples / max(time.perf_counter() - t0, 1e-9))
                after = runs[name].cpu_seconds()
                for part in cpu[name]:
                    cpu[name][part] += after[part] - before[part]
        steps = int(bounds[-1] - bounds[0])
        cpu_ms = {n: {part: 1e3 * v / max(steps, 1) for part, v in parts.items()} for n, parts in cpu.items()}
        for parts in cpu_ms.values():
            parts["total"] = parts["worker"] + parts["servers"] + parts["coordinator"]
        results = {}
        for name in names:
            results[name] = runs.pop(name).finish()
    finally:
        for run in runs.values():
            run.close()
    return results, rates, {"rounds": rounds, "bounds": [int(b) for b in bounds], "cpu_ms_per_step": cpu_ms}


def _run_torchrun(tcfg, workers: int, records_dir: Path, fail_at, kill, label) -> dict:
    config_path = records_dir / "config.json"
    config_path.write_text(json.dumps(dataclasses.asdict(tcfg)))
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc_per_node={workers}", "-m", "ecrec.bench.trainer", str(config_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    rank0 = records_dir / "rank0.jsonl"
    killed = False  # per run (a flag on ``kill``, a bound method, was shared by every strategy's run)
    try:
        while proc.poll() is None:
            step = _last_step(rank0)
            _progress(label, step, tcfg.steps)
            if fail_at is not None and step >= fail_at and not killed:
                kill()
                killed = True
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun workers failed with exit code {proc.returncode}")
    _progress(label, tcfg.steps, tcfg.steps, done=True)
    records = []
    for path in sorted(records_dir.glob("rank*.jsonl")):
        rank = int(path.stem[len("rank"):])
        records += [dict(json.loads(line), rank=rank) for line in path.read_text().splitlines() if line]
    records.sort(key=lambda r: r["end"])
    summary = json.loads((records_dir / "rank0.result.json").read_text())
    return {"records": records, "evaluation": summary["evaluation"], "driver": summary["driver"],
            "client_bytes": summary["client_bytes"], "cluster": None}


def _last_step(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError):
        return 0


def _progress(label: str, step: int, total: int, done: bool = False) -> None:
    from ecrec import console

    console.progress(label, step, total, done)  # rich bars on a terminal, plain lines in a log


def _final_state(cluster, local) -> dict | None:
    if cluster is None:
        return None
    state = {}
    for t in cluster.refresh_map().tables:
        _, payload = cluster.read_payload(t.name)
        state[t.name] = payload.view(np.uint32).copy()
    for d in cluster.map.dense:
        state["dense:" + d.name] = cluster.read_dense_payload(d.name)[: int(np.prod(d.shape))].view(np.uint32).copy()
    return state


def _strategy_stats(local, strategy: str) -> dict:
    from ecrec.client import Cluster

    try:
        c = Cluster.connect(local.coordinator_address, wait_ready_s=30)
        return {str(i): v for i, v in c.strategy_call("stats").items()}
    except Exception as exc:  # noqa: BLE001 - the report says so
        return {"error": str(exc)}


# --- metrics ----------------------------------------------------------------------------------------
def summarize(strategy: str, run: dict, reference: dict | None, cfg: dict, fail_at) -> dict:
    records = run["result"]["records"]
    ends = np.array([r["end"] for r in records])
    starts = np.array([r["start"] for r in records])
    samples = np.array([r["samples"] for r in records])
    durations = ends - starts
    kill_t = run["killed"].get("time")
    warm = min(10, len(records) // 4)
    # the steps before the failure, by step number (W workers' records interleave; a rollback repeats steps)
    steps_done = np.array([r["step"] for r in records])
    before = steps_done >= warm
    if fail_at is not None:
        before &= steps_done < fail_at
        if kill_t is not None:
            before &= ends <= kill_t
    # time spent in steps (not wall span: interleaved measurement leaves gaps between slices), times the
    # workers that step side by side, so it compares with the wall-clock throughput while recovering
    workers = len({r.get("rank", 0) for r in records}) or 1
    rate = workers * samples[before].sum() / max(durations[before].sum(), 1e-9) if before.any() else None
    median_step = float(np.median(durations[before])) if before.any() else None
    out = {"strategy": strategy, "samples_per_s_failure_free": rate, "median_step_s": median_step}
    events = run["events"]
    if kill_t is not None:
        after = ends > kill_t
        out["max_stall_s"] = float(durations[after].max()) if after.any() else None
        promoted = [e["wall_time"] for e in events if e["kind"] == "promoted" and e["wall_time"] >= kill_t]
        redundant = [e["wall_time"] for e in events if e["kind"] == "redundant" and e["wall_time"] >= kill_t]
        out["promotion_s"] = promoted[0] - kill_t if promoted else None
        out["fully_redundant_s"] = (redundant[0] - kill_t) if redundant and _kind(strategy) != "none" else None
        # back to full speed: progress past the failure step, and the next steps at pre-failure speed
        steps = np.array([r["step"] for r in records])
        # after a rollback (full recovery) progress counts only from the rewound position on
        rewound = [i for i in np.flatnonzero(after) if records[i].get("rewind_to") is not None]
        first = rewound[-1] + 1 if rewound else 0
        back = None
        for i in np.flatnonzero(after & (steps >= fail_at) & (np.arange(len(records)) >= first)):
            window = durations[i:i + 5]
            if len(window) and np.median(window) <= 1.25 * median_step:
                back = ends[i]
                break
        out["recovery_s"] = back - kill_t if back is not None else None
        if promoted:
            w0 = promoted[0]
            w1 = min(max(redundant[0] if redundant else w0, w0 + 2.0), ends[-1])  # not past the end of training
            inside = (ends > w0) & (ends <= w1)
            during = samples[inside].sum() / (w1 - w0) if inside.any() else 0.0
            out["throughput_during_recovery_ratio"] = during / rate if rate else None
        else:
            out["throughput_during_recovery_ratio"] = None
    else:
        out.update(max_stall_s=None, promotion_s=None, fully_redundant_s=None, recovery_s=None,
                   throughput_during_recovery_ratio=None)
    driver = run["result"].get("driver")
    total_rows = int(sum(r["rows"] for r in records))
    if driver:
        out["driver"] = {k: driver.get(k) for k in ("o_save_s", "o_load_s", "saves", "save_stall_s",
                                                     "full_interval_s", "mode")}
        out["lost_updates"] = driver["lost_updates"]
        out["pls"] = driver["pls"]
        out["updates_rolled_back"] = driver["updates_rolled_back"]
        out["steps_redone"] = driver["steps_redone"]
    elif _kind(strategy) == "none" and kill_t is not None:
        index = str(cfg["fail_server"])
        lost = sum(int(r["rows_by_server"].get(index, r["rows_by_server"].get(int(index), 0)))
                   for r in records if r["end"] <= kill_t)
        out["lost_updates"], out["pls"] = lost, lost / max(total_rows, 1)
    else:
        out["lost_updates"], out["pls"] = None, None
    ev = run["result"]["evaluation"]
    out["test_auc"], out["test_logloss"] = ev.get("auc"), ev.get("logloss")
    state, ref_state = run["state"], reference["state"] if reference else None
    if state is not None and ref_state is not None:
        out["state_matches_failure_free"] = state.keys() == ref_state.keys() and all(
            np.array_equal(state[k], ref_state[k]) for k in ref_state)
        if _kind(strategy) == "erasure" and out["state_matches_failure_free"] and out["lost_updates"] is None:
            out["lost_updates"], out["pls"] = 0, 0.0
    else:
        out["state_matches_failure_free"] = None
    stats = run["stats"]
    model_bytes = _model_bytes(run["map"])
    per_server = [v for v in stats.values() if isinstance(v, dict)]
    redundancy = sum(v.get("redundancy_bytes", 0) for v in per_server)
    out["memory_overhead"] = redundancy / model_bytes if model_bytes else None
    out["checkpoint_bytes"] = int(sum(v.get("bytes_written", 0) for v in per_server))
    out["network_bytes"] = int(run["result"]["client_bytes"] + sum(v.get("parity_bytes_sent", 0) for v in per_server))
    out["rows_acknowledged"] = total_rows
    out["elapsed_s"] = float(ends[-1] - starts[0]) if len(records) else None
    out["timeline"] = _timeline(records, kill_t)
    out["stats"] = stats
    return out


def _model_bytes(cluster_map) -> int:
    from ecrec.tables import DenseSpec, TableSpec

    total = sum(TableSpec.from_proto(t).row_bytes * t.num_rows for t in cluster_map.tables)
    return total + sum(DenseSpec.from_proto(d).payload_bytes for d in cluster_map.dense)


def _timeline(records, kill_t, bucket_s: float = 0.25) -> dict:
    """Throughput in buckets over the last uninterrupted stretch of training (interleaved
    measurement leaves gaps before it), with the failure's time on the same clock."""
    if not records:
        return {"t": [], "samples_per_s": [], "failure_t": None}
    gaps = [i for i in range(1, len(records)) if records[i]["start"] - records[i - 1]["end"] > 0.5]
    records = records[gaps[-1]:] if gaps else records
    t0 = records[0]["start"]
    ends = np.array([r["end"] - t0 for r in records])
    samples = np.array([r["samples"] for r in records])
    edges = np.arange(0, ends.max() + bucket_s, bucket_s)
    counts, _ = np.histogram(ends, bins=edges, weights=samples)
    edges, counts = edges[:-1], counts[:-1]  # the last bucket is cut short by the end of training
    return {"t": [float(x) for x in edges[1:]], "samples_per_s": [float(c / bucket_s) for c in counts],
            "failure_t": (kill_t - t0) if kill_t else None}


# --- output -------------------------------------------------------------------------------------------
COLUMNS = [
    ("strategy", "strategy", "{}"),
    ("samples_per_s_failure_free", "samples/s", "{:,.0f}"),
    ("overhead_vs_none", "overhead", "{:+.1%}"),
    ("cpu_overhead_vs_none", "cpu ovh", "{:+.1%}"),
    ("recovery_s", "recovery s", "{:.2f}"),
    ("fully_redundant_s", "redundant s", "{:.2f}"),
    ("max_stall_s", "max stall s", "{:.2f}"),
    ("throughput_during_recovery_ratio", "tput in rec.", "{:.2f}"),
    ("lost_updates", "lost upd.", "{:,}"),
    ("pls", "PLS", "{:.4f}"),
    ("test_auc", "AUC", "{:.4f}"),
    ("state_matches_failure_free", "exact", "{}"),
    ("memory_overhead", "mem ovh", "{:.2f}"),
    ("checkpoint_bytes", "ckpt MB", None),
]


def print_table(rows: list[dict]) -> None:
    def fmt(row, key, f):
        v = row.get(key)
        if v is None:
            return "-"
        if key == "checkpoint_bytes":
            return f"{v / 1e6:.1f}"
        return f.format(v)

    from ecrec import console

    console.print_table([title for _, title, _ in COLUMNS], [[fmt(r, key, f) for key, _, f in COLUMNS] for r in rows])


def write_plot(path: str, rows: list[dict], fail_at) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("ecrec-bench compare: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(10, 5))
    for row in rows:
        tl = row["timeline"]
        if not tl["t"]:
            continue
        shift = tl["failure_t"] or 0.0
        ax.plot(np.array(tl["t"]) - shift, tl["samples_per_s"], label=row["strategy"], linewidth=1.2)
    ax.axvline(0.0, color="red", linestyle="--", linewidth=1, label=f"server killed (step {fail_at})")
    ax.set_xlabel("seconds from the failure")
    ax.set_ylabel("samples / s (0.25 s buckets)")
    ax.set_title("Training throughput around one server failure")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    cfg = dict(PRESETS[args.preset])
    for key in ("servers", "k", "m", "steps", "fail_at", "fail_server", "batch_size", "checkpoint_interval_steps"):
        value = getattr(args, key)
        if value is not None:
            cfg[key] = value
    known = strategy_names()
    strategies = [s.strip() for s in (args.strategies or ",".join(known)).split(",") if s.strip()]
    unknown = [s for s in strategies if s not in known]
    if unknown:
        print(f"ecrec-bench compare: unknown strategies {unknown}; choose from {', '.join(known)}", file=sys.stderr)
        return 2
    if not 0 <= cfg["fail_server"] < cfg["servers"]:
        print(f"ecrec-bench compare: --fail-server must be in [0, {cfg['servers']})", file=sys.stderr)
        return 2
    if any(_kind(s) == "erasure" for s in strategies) and cfg["k"] + cfg["m"] > cfg["servers"]:
        print(f"ecrec-bench compare: k + m = {cfg['k'] + cfg['m']} exceeds --servers {cfg['servers']}", file=sys.stderr)
        return 2
    fail_at = cfg["fail_at"] if cfg["fail_at"] is not None and cfg["fail_at"] >= 0 else None
    if fail_at is not None and fail_at >= cfg["steps"]:
        print("ecrec-bench compare: --fail-at must be below --steps", file=sys.stderr)
        return 2
    if args.workers < 1:
        print("ecrec-bench compare: --workers must be >= 1", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print("ecrec-bench compare: --rounds must be >= 1", file=sys.stderr)
        return 2
    checkpointing = [s for s in strategies if _kind(s) == "checkpoint"]
    if args.workers > 1 and checkpointing:
        print(f"ecrec-bench compare: {', '.join(checkpointing)} need one checkpoint driver that sees every worker's "
              "pushes (consistent cuts, rollback of every worker's data position, exact lost-update counts), which "
              "the torchrun launcher does not coordinate yet; run them with --workers 1 (none and ecrec scale out)",
              file=sys.stderr)
        return 2
    from ecrec.workload.dlrm import resolve_arch

    try:
        args.model = resolve_arch(getattr(args, "model", "auto"))
    except ValueError as exc:
        print(f"ecrec-bench compare: --model: {exc}", file=sys.stderr)
        return 2
    from ecrec.transport import tune_allocator

    tune_allocator()
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="ecrec-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"ecrec-bench compare: preset {args.preset}, {cfg['servers']} servers, {cfg['steps']} steps x "
          f"{cfg['batch_size']} samples, {args.workers} worker(s), kill server {cfg['fail_server']} at step {fail_at}, "
          f"{'TorchRec' if args.model == 'torchrec' else 'our'} DLRM",
          file=sys.stderr)
    try:
        data_path, data_desc = prepare_data(args, cfg, work)
        print(f"  data: {data_desc}", file=sys.stderr)
        side_by_side = args.workers == 1 and fail_at is not None and fail_at >= 100
        if side_by_side:
            results, rates, plan = run_interleaved(strategies, args, cfg, data_path, work, fail_at, args.rounds)
            reference = results.pop("reference")
        else:
            reference = run_strategy("none", args, cfg, data_path, work, None, "reference")
            results = {s: run_strategy(s, args, cfg, data_path, work, fail_at, s) for s in strategies}
        ref_summary = summarize("none (no failure)", reference, None, cfg, None)
        rows = [summarize(s, results[s], reference, cfg, fail_at) for s in strategies]
        if side_by_side:
            ref_rates = np.array(rates["reference"])
            base = float(np.median(ref_rates))
            ref_summary["samples_per_s_rounds"] = ref_rates.tolist()
            ref_summary["cpu_ms_per_step"] = plan["cpu_ms_per_step"]["reference"]
            ref_summary["noise"] = float((ref_rates.max() - ref_rates.min()) / base)
            for row in rows:
                mine = np.array(rates[row["strategy"]])
                row["samples_per_s_failure_free"] = float(np.median(mine))
                row["samples_per_s_rounds"] = mine.tolist()
                row["overhead_vs_none"] = float(np.median(ref_rates / mine) - 1.0)
                row["cpu_ms_per_step"] = plan["cpu_ms_per_step"][row["strategy"]]
                row["cpu_overhead_vs_none"] = row["cpu_ms_per_step"]["total"] / ref_summary["cpu_ms_per_step"]["total"] - 1.0
            noise_text = (f"{len(ref_rates)} interleaved rounds, reference spread {ref_summary['noise']:.1%}")
        else:
            # the reference again after the strategies: machine drift shows as the spread of the two
            print("  reference run again (drift check)", file=sys.stderr)
            again = summarize("none (no failure)", run_strategy("none", args, cfg, data_path, work, None, "reference2"),
                              None, cfg, None)
            ref_rates = [ref_summary["samples_per_s_failure_free"], again["samples_per_s_failure_free"]]
            base = float(np.mean(ref_rates))
            ref_summary["samples_per_s_runs"] = ref_rates
            ref_summary["noise"] = abs(ref_rates[1] - ref_rates[0]) / base
            for row in rows:
                rate = row["samples_per_s_failure_free"]
                row["overhead_vs_none"] = (base / rate - 1.0) if rate and base else None
            noise_text = f"before {ref_rates[0]:,.0f}, after {ref_rates[1]:,.0f}: drift {ref_summary['noise']:.1%}"
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print_table(rows)
    print(f"\nreference (none, no failure): {base:,.0f} samples/s ({noise_text}), AUC {ref_summary['test_auc']:.4f}")
    if ref_summary.get("cpu_ms_per_step"):
        print("CPU ms per failure-free step (user + system, from each process's counters):")
        for row in [ref_summary, *rows]:
            c = row.get("cpu_ms_per_step")
            if c:
                print(f"  {row['strategy']:<18} worker {c['worker']:6.2f}  servers {c['servers']:6.2f}  "
                      f"coordinator {c['coordinator']:5.2f}  total {c['total']:6.2f}")
    config = {**cfg, "preset": args.preset, "dataset": data_desc, "workers": args.workers, "seed": args.seed,
              "model": args.model,
              "strategies": strategies, "cpu_count": os.cpu_count(),
              "throughput_measurement": plan if side_by_side else "sequential runs, reference before and after"}
    if args.json:
        report = {"config": config, "reference": {k: v for k, v in ref_summary.items() if k != "timeline"},
                  "strategies": {row["strategy"]: row for row in rows}}
        text = json.dumps(report, indent=2, default=_json_default)
        with open(args.json, "w") as f:  # temporary paths (checkpoint dirs) are shown relative to the work dir
            f.write(text.replace(str(work), "<work-dir>"))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(args.plot, rows, fail_at)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
