"""``ecrec-bench snapshot``: how fast a cluster saves a snapshot and restores it onto a cluster of another shape.

One cluster (``--servers``, ``--k``/``--m`` with ``--strategy ecrec``) creates ``--tables`` tables of ``--rows``
x ``--dim`` (Adagrad by default: weights and accumulators, 8 bytes a float pair), saves a snapshot into
``--dir`` (every server writing its own file at once), then a second cluster of another shape
(``--restore-servers``, ``--restore-k``/``--restore-m``) restores it.  Printed and saved: MB/s of the save and
of the restore, each server's write time, the client's peak memory during each (VmHWM, reset before), the
disk's own rate for the same bytes (a file written and fsynced; the goal), load averages, whether the snapshot's
files equal the saving cluster's rows and the restored rows equal the files (``--verify``: every row, or a
sample of 100,000; the saving cluster is stopped before the restoring one starts) and, with ``ecrec``, whether
every parity row matches its stripe.  The save is reported by part, summed over the servers (``save.parts``:
CPU seconds reading their own rows, taking their peers', placing rows, checksumming, writing; the servers'
other work; seconds waited for rows and for the disk; the rows' bytes by where they came from), and so is the
restore (``restore.parts``: the client checking every chunk and creating the tables; the restore in bulk by
step and the servers' fills, CPU seconds of placing rows, checking them and encoding parity; reading again and
pushing whatever was not restored in bulk).

Examples::

    ecrec-bench snapshot --rows 4000000 --dim 64 --json snapshot-4m-1.json
    ecrec-bench snapshot --rows 200000 --servers 4 --k 2 --m 1 --restore-servers 5 --restore-k 3 --restore-m 2
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of each table (default 1,000,000)")
    p.add_argument("--dim", type=int, default=64, help="embedding dim (default 64)")
    p.add_argument("--tables", type=int, default=1, help="number of tables (default 1)")
    p.add_argument("--optimizer", default="adagrad", choices=["adagrad", "sgd"])
    p.add_argument("--servers", type=int, default=4, help="servers of the saving cluster (default 4)")
    p.add_argument("--strategy", default="ecrec", help="strategy of both clusters (default ecrec)")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--restore-servers", type=int, default=3, help="servers of the restoring cluster (default 3)")
    p.add_argument("--restore-k", type=int, default=2)
    p.add_argument("--restore-m", type=int, default=1)
    p.add_argument("--dir", default=None, help="the directory to write the snapshot in, as DIR/snapshot (on the "
                                                "disk to measure; default: a temporary directory); the snapshot is "
                                                "removed after the run unless --keep")
    p.add_argument("--keep", action="store_true", help="keep the snapshot after the run (in --dir, or the temporary "
                                                       "directory, which is then named)")
    p.add_argument("--verify", choices=["all", "sample", "no"], default="sample",
                   help="compare the restored rows with the saved ones: all, a sample of 100,000, or not")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")


def _peak_reset() -> None:
    from ecrec.bench.compare_running import reset_peak_memory

    reset_peak_memory([os.getpid()])


def _peak_bytes() -> int:
    from ecrec.bench.processes import memory_of

    return memory_of([os.getpid()])["peak_rss_bytes"]


def disk_rate(directory: Path, nbytes: int) -> float:
    """MB/s of writing ``nbytes`` to a new file of ``directory`` and fsyncing it (64 MB writes)."""
    block = np.random.default_rng(0).integers(0, 255, size=64 << 20, dtype=np.uint8).tobytes()
    target = directory / ".disk-rate"
    t0 = time.perf_counter()
    with open(target, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    target.unlink()
    return max(1, nbytes // len(block)) * len(block) / 1e6 / seconds


def _servers_cpu(cluster) -> float:
    """CPU seconds (user + system) the cluster's servers have used so far, from their own process clocks (asked
    through ``stats``: ``/proc``'s counters go by 10 ms ticks, and a small table's restore costs each server less)."""
    return sum(stats.get("server", {}).get("threads_cpu_s", {}).get("total", 0.0)
               for stats in cluster.strategy_call("stats").values())


def _cluster(servers: int, strategy: str, k: int, m: int):
    from ecrec.ops.local import LocalCluster, LocalClusterSpec

    local = LocalCluster(LocalClusterSpec(servers=servers, strategy=strategy, k=k if strategy == "ecrec" else 0,
                                          m=m if strategy == "ecrec" else 0,
                                          server_options={"no_standby_reserve": True}))
    local.start(timeout_s=180)
    return local


def _equal(cluster, path: Path, manifest: dict, how: str, seed: int) -> bool | None:
    """Whether ``cluster``'s rows equal the snapshot's files, bit for bit: every row, or a sample of 100,000 a
    table (the saving cluster right after the save, the restoring one after the restore: the two need not run
    side by side)."""
    from ecrec.snapshot import files as snapshot_files

    if how == "no":
        return None
    for name, spec in manifest["tables"].items():
        rows = spec["num_rows"]
        wanted = np.arange(rows) if how == "all" else np.unique(np.random.default_rng(seed).integers(0, rows, 100_000))
        for key, columns in (("weight", slice(0, spec["dim"])), ("state", slice(spec["dim"], None))):
            info = manifest["tensors"].get(f"tables/{name}/{key}")
            if info is None:
                continue
            for chunk in info["chunks"]:
                a, n = chunk["offsets"][0], chunk["sizes"][0]
                ids = wanted[(wanted >= a) & (wanted < a + n)]
                if not len(ids):
                    continue
                saved = snapshot_files.map_tensor(str(path), chunk["file"], chunk["offset"], chunk["length"],
                                                  chunk["sizes"])[ids - a]
                if not np.array_equal(saved.view(np.uint32),
                                      cluster.read_rows(name, ids, "payload")[:, columns].view(np.uint32)):
                    return False
    return True


def save_parts(manifest: dict) -> dict:
    """What the save's parts took, summed over the servers (``ecrec.snapshot.part.Parts``): CPU seconds of each,
    and of the servers' other work (serving their peers' reads, the calls' handling: their total less the parts),
    wall seconds waited, and the rows' bytes by where they came from."""
    servers = manifest.get("parts", {})
    total = {"cpu_s": {}, "wall_s": {}, "bytes": {}}
    for parts in servers.values():
        for kind in total:
            for name, value in parts.get(kind, {}).items():
                total[kind][name] = round(total[kind].get(name, 0) + value, 4)
    return total


def describe_parts(phase: dict) -> str:
    """One line: the save's CPU seconds of each part and the rest of the servers' CPU (what they spent serving
    each other's reads and everything else); the restore's parts (``restore_parts``)."""
    parts = phase.get("parts") or {}
    if parts and "cpu_s" not in parts:  # a restore: the client's parts
        return ("by part: " + ", ".join(f"{name.removesuffix('_s').replace('_', ' ')} {seconds:.2f} s"
                                        for name, seconds in parts.items()))
    cpu = parts.get("cpu_s", {})
    if not cpu:
        return ""
    rest = phase["servers_cpu_s"] - sum(cpu.values())
    return ("CPU s by part: " + ", ".join(f"{name} {seconds:.2f}" for name, seconds in cpu.items())
            + f", other server work {rest:.2f}; waited: "
            + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.get("wall_s", {}).items())
            + "; rows (MB): " + ", ".join(f"{name} {nbytes / 1e6:,.0f}" for name, nbytes in parts.get("bytes", {}).items()))


def print_summary(out: dict) -> None:
    """The run's summary, from its report (the JSON ``--json`` writes): save and restore, disk, checks, load."""
    c = out["config"]
    mb = out["save"]["bytes"] / 1e6
    print(f"snapshot of {c['tables']} x {c['rows']:,} x {c['dim']} ({c['optimizer']}, {mb:,.0f} MB): "
          f"{c['servers']} servers -> {c['restore_servers']}")
    for phase in ("save", "restore"):
        f = out[phase]
        print(f"  {phase:<8} {f['seconds']:7.2f} s  {f['mb_per_s']:7.0f} MB/s  CPU s: servers {f['servers_cpu_s']:.2f}, "
              f"client {f['client_cpu_s']:.2f}  client peak {(f['client_peak_bytes'] or 0) / 1e6:,.0f} MB")
        if describe_parts(f):
            print(f"           {describe_parts(f)}")
    print(f"  disk (one file, fsynced) {out['disk_mb_per_s']:,.0f} MB/s;  restored rows equal: {out['exact']};  "
          f"parity mismatched: {out.get('parity_mismatched', '-')};  servers declared failed: "
          f"{out.get('failures_declared', '-')}")
    print(f"  load average before {out['load_average_before'][0]:.2f}, after {out['load_average_after'][0]:.2f} "
          f"({out['cpu_count']} cores)")


def run(args) -> int:
    if args.rows < 1 or args.dim < 1 or args.tables < 1 or args.servers < 1 or args.restore_servers < 1:
        print("ecrec-bench snapshot: --rows, --dim, --tables and the server counts must be positive", file=sys.stderr)
        return 2
    from ecrec.bench.checks import count_problem, servers_problem
    from ecrec.config import MAX_LOCAL_SERVERS

    problem = servers_problem(args.servers) or count_problem(
        "--restore-servers", args.restore_servers, MAX_LOCAL_SERVERS, "each is a process of its own on this machine")
    if problem:  # (a typo must not start two thousand processes)
        print(f"ecrec-bench snapshot: {problem}", file=sys.stderr)
        return 2
    from ecrec.strategies import get_spec
    from ecrec.strategies.registry import cluster_error

    try:
        kind = get_spec(args.strategy).kind
    except ValueError as exc:
        print(f"ecrec-bench snapshot: --strategy: {exc}", file=sys.stderr)
        return 2
    if kind == "checkpoint":
        print(f"ecrec-bench snapshot: --strategy {args.strategy}: a checkpointing strategy keeps its own checkpoints; "
              "this benchmark runs clusters of none or ecrec", file=sys.stderr)
        return 2
    erasure = args.strategy == "ecrec"  # as _cluster starts them
    for what, servers, k, m in (("saving", args.servers, args.k, args.m),
                                ("restoring", args.restore_servers, args.restore_k, args.restore_m)):
        error = cluster_error(args.strategy, servers, k if erasure else 0, m if erasure else 0, {})
        if error:
            print(f"ecrec-bench snapshot: the {what} cluster: {error}", file=sys.stderr)
            return 2
    from ecrec.bench.checks import tables_problem

    for what, k, m in (("saving", args.k, args.m), ("restoring", args.restore_k, args.restore_m)):  # one at a time
        problem = tables_problem(f"--tables {args.tables} x --rows {args.rows} x --dim {args.dim} (the {what} "
                                 "cluster)", args.tables, args.rows, args.dim, args.optimizer,
                                 *((k, m) if erasure else (0, 0)))
        if problem:
            print(f"ecrec-bench snapshot: {problem}", file=sys.stderr)
            return 2
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ecrec-snapshot-bench-"))
    try:
        return _run(args, work)
    finally:
        if not args.dir and not args.keep:  # the temporary directory, on an error too
            shutil.rmtree(work, ignore_errors=True)


def _run(args, work: Path) -> int:
    from ecrec.client import Cluster, ClusterError
    from ecrec.config import ClientConfig
    from ecrec.snapshot import SnapshotError

    path = work / "snapshot"
    if path.exists():
        print(f"ecrec-bench snapshot: {path} exists; choose another --dir", file=sys.stderr)
        return 2
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"ecrec-bench snapshot: cannot use --dir {args.dir}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("dir", "keep")}
    if config.get("json"):
        config["json"] = os.path.basename(config["json"])  # the file's name, not this machine's path
    out = {"config": config,
           "load_average_before": list(os.getloadavg()), "cpu_count": os.cpu_count()}
    names = [f"t{i}" for i in range(args.tables)]
    source_local = target_local = None
    try:
        source_local = _cluster(args.servers, args.strategy, args.k, args.m)
        config = ClientConfig(rpc_timeout_s=600.0)
        source = Cluster.connect(source_local.coordinator_address, config, worker="bench-save")
        for name in names:
            source.create_table(name, args.rows, args.dim, optimizer=args.optimizer, lr=0.05, seed=args.seed,
                                initial_accumulator_value=0.1 if args.optimizer == "adagrad" else 0.0)
        messages: list[str] = []
        _peak_reset()
        cpu0, client0 = _servers_cpu(source), time.process_time()
        t0 = time.perf_counter()
        manifest = source.save(str(path), on_progress=lambda text: (messages.append(text.replace(str(path), "SNAPSHOT")),
                                                                  print(f"  save: {text}", file=sys.stderr)))
        save_s = time.perf_counter() - t0
        out["save"] = {"seconds": save_s, "bytes": manifest["bytes"], "mb_per_s": manifest["bytes"] / 1e6 / save_s,
                       "client_peak_bytes": _peak_bytes(), "servers_cpu_s": _servers_cpu(source) - cpu0,
                       "client_cpu_s": time.process_time() - client0, "messages": messages,
                       "parts": save_parts(manifest)}
        out["saved_exact"] = _equal(source, path, manifest, args.verify, args.seed)  # the files hold the cluster
        source.close()
        source_local.close()  # one cluster at a time: the restoring one has the machine to itself
        source_local = None
        target_local = _cluster(args.restore_servers, args.strategy, args.restore_k, args.restore_m)
        target = Cluster.connect(target_local.coordinator_address, config, worker="bench-restore")
        messages = []
        _peak_reset()
        cpu0, client0 = _servers_cpu(target), time.process_time()
        t0 = time.perf_counter()
        restored_manifest = target.load(str(path), on_progress=lambda text: (messages.append(
            f"{time.perf_counter() - t0:7.2f} s {text.replace(str(path), 'SNAPSHOT')}"),
                                                       print(f"  restore: {messages[-1]}", file=sys.stderr)))
        restore_s = time.perf_counter() - t0
        out["restore"] = {"seconds": restore_s, "bytes": manifest["bytes"],
                          "mb_per_s": manifest["bytes"] / 1e6 / restore_s, "client_peak_bytes": _peak_bytes(),
                          "servers_cpu_s": _servers_cpu(target) - cpu0, "client_cpu_s": time.process_time() - client0,
                          "messages": messages[:1] + messages[-1:], "parts": restored_manifest.get("restore_parts")}
        restored = _equal(target, path, manifest, args.verify, args.seed)  # ... and the restored cluster the files
        out["exact"] = None if restored is None else bool(restored and out["saved_exact"])
        if args.strategy == "ecrec" and args.verify != "no":
            checked = target.strategy_call("verify_parity")
            out["parity_mismatched"] = int(sum(r["mismatched"] for r in checked.values()))
        out["failures_declared"] = sum(1 for e in target.refresh_map().events if e.kind == "failed")
        target.close()
    # a place the servers cannot write (--dir /proc) or read back, a table they refuse: said, no traceback
    except (SnapshotError, ClusterError) as exc:
        print(f"ecrec-bench snapshot: {exc}", file=sys.stderr)
        return 1
    finally:
        for local in (source_local, target_local):
            if local is not None:
                local.close()
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
    out["disk_mb_per_s"] = disk_rate(work, out["save"]["bytes"])  # with no cluster running: the disk alone
    out["load_average_after"] = list(os.getloadavg())
    print_summary(out)
    if args.keep:
        print(f"the snapshot is kept in {path} (ecrec-server restore, or Cluster.load, reads it)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["exact"] in (True, None) and not out.get("parity_mismatched") and not out.get("failures_declared") else 1
