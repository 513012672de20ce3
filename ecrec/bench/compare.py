"""``ecrec-bench compare``: one workload, one failure schedule, every strategy, one report.

For each strategy it starts a local cluster (separate processes on 127.0.0.1, one standby, another
started once a failure is over; every new process is waited for until it is idle, so that no kernel
compilation is timed or promoted), trains the same DLRM on the same data through the SDK and measures side by side in one run:

- failure-free throughput in ``--rounds`` interleaved rounds of short slices against a failure-free
  ``none`` reference (the order shuffled per round with ``--seed``; the reference trains two half
  slices per round, its A/A pair; checkpoint timers run only inside their own strategy's slices, and
  the writes a slice started are waited for inside it, so their work is charged to them); wall and
  CPU overhead as the median per-round ratio to the reference with a bootstrap interval of that
  median, marked ``~`` when the interval holds zero;
- ``--failures N`` kills of the same server (SIGKILL), each at its own phase of one checkpoint
  interval: failure ``i`` falls in the ``i``-th ``N``-th of the interval of the save before it, at a point
  drawn with ``--seed`` in mirrored pairs (mean phase exactly one half) off the grid of the partial saves
  (``ecrec.bench.lost_training.failure_phases``; for ``none``/``ecrec``, which have no interval,
  as soon as the previous failure is over).  Per failure: promotion, back to speed, full redundancy,
  *useful* throughput (only steps past the furthest step reached before the failure count) and
  ``lost_training_s`` = paused + replayed + throughput deficit, against the rate of the steps just
  before that kill, with its noise; reported as mean and range.  After the rounds every strategy
  meets its failures in turn (shuffled), every cluster still up;
- lost updates (counted exactly), PLS, test AUC and log loss, whether the final state matches the
  failure-free run bit for bit; memory kept for fault tolerance (parity, replicas, MFU/SSU counters)
  over model bytes (``mem ovh``), and the servers' memory beyond the reference's, resident at the end of
  the failure-free rounds (``mem steady``) and at its peak within them (``mem peak``: a save's
  temporaries too), per byte of model; checkpoint and network bytes.

Checkpoint intervals are chosen by the models unless given (``ecrec.bench.intervals``): Daly's
optimum for ``full`` from its measured save stall and the job MTBF; ``2 * PLS * servers * MTBF`` for
``cpr*``; with ``--equal-pls`` ``cpr-mfu``/``cpr-ssu`` lengthen their full interval until they reach
the same PLS as ``cpr``.  The report prints them with their inputs.

The split: ``ecrec.bench.compare_running`` runs the clusters, :func:`run_record` turns a run into the
records the JSON keeps (every step, slice and event, the load averages), ``ecrec.bench.accounting``
computes every figure from those records alone, ``ecrec.bench.compare_report`` prints the table (with
an A/A row) and writes the JSON and a ``--plot`` of useful samples per second around the failures
(mean over the failures).  ``--workers W > 1`` launches W workers with torchrun (one failure, at
``--fail-at``; the runs one after another, no interleaved rounds); the checkpointing strategies' workers
then move in step and share one checkpoint driver on rank 0 (``baselines.workers``): a cut consistent
across the workers, every worker rewound to it, lost updates counted from every worker's pushes.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from ecrec.bench.compare_report import json_default  # noqa: F401 - the benchmarks' JSON writer, used by recovery
from ecrec.bench.compare_running import (  # noqa: F401 - the running part, re-exported (profile, recovery, tests)
    WARM_STEPS, StrategyRun, _kind, process_cpu_seconds, run_interleaved, run_sequential, run_strategy)


def strategy_names() -> list[str]:
    """Every installed strategy, in report order (from the specs: nothing here lists them)."""
    from ecrec.strategies import ordered

    return ordered()


PRESETS = {
    # a few minutes on 2 cores for every strategy.  mtbf_s: the job's MTBF the interval models use (about one
    # failure per strategy's run); target_pls: cpr*'s accuracy bound
    "quick": dict(servers=4, k=2, m=1, steps=1300, fail_at=700, fail_server=1, failures=3, batch_size=256, tables=8,
                  rows_per_table=20_000, samples=60_000, embedding_dim=16, lr=0.05, mtbf_s=10.0, target_pls=0.01,
                  dataset="synthetic"),
    # a larger run: more steps and rows
    "standard": dict(servers=4, k=2, m=1, steps=2200, fail_at=1000, fail_server=1, failures=3, batch_size=512,
                     tables=26, rows_per_table=50_000, samples=300_000, embedding_dim=16, lr=0.05, mtbf_s=60.0,
                     target_pls=0.01, dataset="synthetic"),
    # the quick workload at a realistic save-cost-to-MTBF ratio, where CPR's benefit can show: at PLS 0.1 (the
    # order of the targets CPR studies) cpr's interval 2 x 0.1 x 4 x 30 s = 24 s is 10x or more full's Daly
    # interval (about 1.5-2.5 s from a stall of 40-100 ms); the rounds span 2000 steps (several of full's saves
    # per strategy) and the run is long enough for three failures at their phases of cpr's interval.  The
    # comparison uses CPR's own plan (recovery=auto), so a cpr* run may pick full recovery
    "realistic": dict(servers=4, k=2, m=1, steps=8000, fail_at=2000, fail_server=1, failures=3, batch_size=256,
                      tables=8, rows_per_table=20_000, samples=60_000, embedding_dim=16, lr=0.05, mtbf_s=30.0,
                      target_pls=0.1, dataset="synthetic"),
    # MovieLens-100k (fetched when missing): 90,000 training ratings, a random 10 % held out
    "movielens": dict(servers=4, k=2, m=1, steps=1500, fail_at=800, fail_server=1, failures=3, batch_size=256,
                      tables=9, rows_per_table=None, samples=None, embedding_dim=16, lr=0.1, mtbf_s=10.0,
                      target_pls=0.01, dataset="movielens"),
}
ROUNDS = 12  # failure-free rounds; the quick preset: slices of about 50 steps (the reference: two of about 25)


def _named(args) -> list[str]:
    """The strategies --strategies names (default every installed one), as given."""
    return [s.strip() for s in (",".join(strategy_names()) if args.strategies is None else args.strategies).split(",")
            if s.strip()]


def _listed(args) -> list[str]:
    """The installed strategies of the run; unknown names are left to run()'s own check, which names the
    installed ones."""
    known = strategy_names()
    return [s for s in _named(args) if s in known]


def _has_kind(kind: str):
    return lambda args: any(_kind(s) == kind for s in _listed(args))


#: flags that apply only with another (``ecrec.bench.cli.ignored_flag``): given without it, they are refused
ONLY_WITH = (
    (("k", "m", "snapshot_every"), "an erasure-coded strategy (ecrec) in --strategies", _has_kind("erasure")),
    (("checkpoint_files", "checkpoint_url", "checkpoint_bandwidth_mb_s"),
     "a checkpointing strategy (full, cpr*) in --strategies", _has_kind("checkpoint")),
    (("checkpoint_interval_steps",), "full in --strategies", lambda a: "full" in _listed(a)),
    (("cpr_interval_s", "target_pls"), "a cpr strategy (cpr, cpr-mfu, cpr-ssu) in --strategies",
     lambda a: any(s.startswith("cpr") for s in _listed(a))),
    (("pls_basis",), "--equal-pls", lambda a: a.equal_pls),
    # (--fail-at not given: the preset's, step 700 or later in every preset)
    (("failures", "fail_server"), "a failure (--fail-at 0 or more)", lambda a: a.fail_at is None or a.fail_at >= 0),
    (("rounds",), "side-by-side rounds (--workers 1 and the first failure at step 100 or later)",
     lambda a: a.workers == 1 and (a.fail_at is None or a.fail_at >= 100)),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick", help="workload size (default quick)")
    p.add_argument("--strategies", default=None,
                   help=f"comma-separated (default: every installed one, {','.join(strategy_names())})")
    p.add_argument("--servers", type=int, help="embedding servers")
    p.add_argument("--k", type=int, help="data rows per stripe (ecrec)")
    p.add_argument("--m", type=int, help="parity rows per stripe (ecrec)")
    p.add_argument("--steps", type=int, help="training steps per worker")
    p.add_argument("--fail-at", type=int, help="the first failure comes at or after this step (negative: no failure)")
    p.add_argument("--failures", type=int, help="failures per strategy, spread over one checkpoint interval (preset: 3)")
    p.add_argument("--fail-server", type=int, help="index of the server killed")
    p.add_argument("--batch-size", type=int, help="samples per step per worker")
    p.add_argument("--dataset", default=None,
                   help="synthetic (generated, Zipf ids with a planted signal) | criteo:PATH | movielens "
                        "(fetched when missing); default: the preset's")
    p.add_argument("--checkpoint-interval-steps", type=int,
                   help="full: explicit steps between saves (default: Daly's optimum from the measured save stall)")
    p.add_argument("--cpr-interval-s", type=float,
                   help="cpr*: explicit seconds between full saves (default: from the target PLS)")
    p.add_argument("--mtbf-hours", type=float, default=None,
                   help="the job's MTBF for the interval models (default: the preset's, about one failure per run)")
    p.add_argument("--cost-mtbf-hours", type=float, default=24.0,
                   help="the MTBF the expected cost per day is reported at, besides the run's own (default 24)")
    p.add_argument("--target-pls", type=float, default=None, help="cpr*: target portion of lost updates (preset: 0.01)")
    p.add_argument("--checkpoint-files", choices=["one", "per-table"], default="one",
                   help="checkpointing strategies: one data file and one fsync per checkpoint (default), or a file "
                        "per table and dense tensor")
    p.add_argument("--checkpoint-url", default=None, metavar="URL",
                   help="checkpointing strategies: write checkpoints under this directory or fsspec URL (s3://, gs://, "
                        "file://...) instead of the work directory; each run uses its own sub-directory")
    p.add_argument("--checkpoint-bandwidth-mb-s", type=float, default=None, metavar="MB_S",
                   help="cap the checkpoint store's bandwidth (MB/s each way), as a remote store's (default: none)")
    p.add_argument("--pls-basis", choices=["samples", "updates"], default="samples",
                   help="what --equal-pls equalises: the portion of lost samples (each update weighed by its row's "
                        "lookups in the batch, CPR's definition; default) or of lost row updates")
    p.add_argument("--equal-pls", action="store_true",
                   help="tune cpr-mfu and cpr-ssu to the target PLS of cpr (longer full intervals), as CPR compares them")
    p.add_argument("--workers", type=int, default=1, help="training workers (> 1: launched with torchrun)")
    p.add_argument("--snapshot-every", type=int, default=0, metavar="STEPS",
                   help="ECRec's long-interval fallback for more than m failures in a stripe: every STEPS steps the "
                        "erasure-coded runs' worker writes a snapshot (Cluster.snapshot_every, the newest kept), its "
                        "time counted in their step times and overhead (default 0: none)")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help=f"interleaved rounds of short slices for the failure-free throughput (default {ROUNDS})")
    p.add_argument("--model", choices=["auto", "ecrec", "torchrec"], default="auto",
                   help="the DLRM: TorchRec's (torchrec.models.dlrm.DLRM over our cluster collection), ours, or auto "
                        "(default: TorchRec's when the torchrec extra is installed)")
    p.add_argument("--seed", type=int, default=0, help="data, model and the order of strategies per round")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of useful samples/s around the failures")
    p.add_argument("--work-dir", help="where data and checkpoints go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")


# --- data -----------------------------------------------------------------------------------------
def _dataset_problem(dataset: str) -> str | None:
    """What is wrong with ``--dataset`` (checked before anything is made), or None."""
    if dataset in ("synthetic", "movielens"):
        return None
    if not dataset.startswith("criteo:"):
        return f"unknown --dataset {dataset!r} (synthetic | criteo:PATH | movielens)"
    path = dataset.split(":", 1)[1]
    if not path:
        return "--dataset criteo: names no file; give criteo:PATH (a Criteo TSV file, plain or .gz)"
    if not os.path.exists(path):
        return f"no such Criteo file {path!r}"
    if os.path.isdir(path):
        return f"--dataset criteo:{path} is a directory; name a Criteo TSV file (plain or .gz)"
    return None


def prepare_data(args, cfg: dict, work: Path) -> tuple[Path, dict]:
    """Writes the dataset as .npz (dense, ids, labels, table_sizes) and returns its description."""
    from ecrec.bench.trainer import TrainConfig
    from ecrec.workload.criteo import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
    from ecrec.workload.data import InMemoryDataset
    from ecrec.workload.synthetic import write_synthetic_criteo

    out = work / "data.npz"
    dataset = args.dataset or cfg["dataset"]
    if dataset == "synthetic":
        tsv = work / "synthetic.tsv"
        info = write_synthetic_criteo(tsv, num_samples=cfg["samples"], num_tables=cfg["tables"],
                                      rows_per_table=cfg["rows_per_table"], seed=args.seed)
        ds = InMemoryDataset.from_tsv(tsv, info.table_sizes, num_sparse=len(info.table_sizes))
        desc = {"name": "synthetic", "samples": len(ds), "tables": len(info.table_sizes),
                "rows_per_table": cfg["rows_per_table"], "oracle_auc": info.oracle_auc}
    elif dataset.startswith("criteo:"):
        path = dataset.split(":", 1)[1]
        if not os.path.exists(path):
            raise SystemExit(f"ecrec-bench compare: no such Criteo file {path!r}")
        if os.path.isdir(path):
            raise SystemExit(f"ecrec-bench compare: --dataset criteo:{path} is a directory; name a Criteo TSV file "
                             "(plain or .gz)")
        try:
            ds = InMemoryDataset.from_tsv(path, cfg["rows_per_table"] or 100_000)
        except (OSError, EOFError, ValueError) as exc:  # unreadable, a broken .gz, a line refused
            raise SystemExit(f"ecrec-bench compare: the Criteo file {path!r} cannot be read: {exc}") from None
        # the trainer holds out a tenth for its test AUC and trains on whole batches of the rest, each worker on a
        # shard of it (InMemoryDataset.split and .shard)
        train_needed = cfg["batch_size"] * args.workers
        needed = train_needed + 1
        while needed - max(1, round(needed * TrainConfig.test_fraction)) < train_needed:
            needed += 1
        if len(ds) < needed:
            skipped = f"; {ds.read_stats.summary(path)}" if ds.read_stats.malformed else ""
            batches = f"a batch of {cfg['batch_size']}" + (f" for each of {args.workers} workers"
                                                            if args.workers > 1 else "")
            raise SystemExit(f"ecrec-bench compare: the Criteo file {path!r} holds {len(ds)} sample(s), fewer than "
                             f"the {needed} {batches} and its test split need (a Criteo line: "
                             f"label, {CRITEO_NUM_DENSE} integer and {CRITEO_NUM_SPARSE} categorical fields, "
                             f"tab-separated){skipped}")
        desc = {"name": "criteo", "path": path, "samples": len(ds), "tables": ds.num_tables,
                "rows_per_table": cfg["rows_per_table"]}
    elif dataset == "movielens":
        from ecrec.workload.movielens import load_movielens

        from ecrec.workload.movielens import default_dir, fetch

        try:
            ml = load_movielens()
        except FileNotFoundError:
            print(f"  MovieLens-100k is not in {default_dir()}: fetching it (pip download of the recbole wheel, "
                  "as `python -m ecrec.workload.movielens fetch` does)", file=sys.stderr)
            try:
                fetch()
                ml = load_movielens()
            except (RuntimeError, FileNotFoundError) as exc:
                raise SystemExit(f"ecrec-bench compare: could not fetch MovieLens-100k: {exc}\n  fetch it by hand with "
                                 "`python -m ecrec.workload.movielens fetch [--wheel PATH]`") from None
        ds = ml.dataset()
        desc = {"name": "movielens-100k", "samples": len(ds), "tables": ds.num_tables,
                "positives": "rating >= 4", "test_split": "random 10 % (seeded)"}
    else:
        raise SystemExit(f"ecrec-bench compare: unknown --dataset {dataset!r} (synthetic | criteo:PATH | movielens)")
    np.savez(out, dense=ds.dense, ids=ds.ids, labels=ds.labels, table_sizes=np.asarray(ds.table_sizes))
    return out, desc


# --- the records a run saves ---------------------------------------------------------------------------
def _failures_of(run: dict) -> list[dict]:
    """The run's kills, oldest first (``killed`` holds ``failures``, or one kill's ``time``)."""
    killed = run.get("killed") or {}
    if "failures" in killed:
        return [k for k in killed["failures"] if k.get("time") is not None]
    return [killed] if killed.get("time") is not None else []


def run_record(strategy: str, run: dict, reference: dict | None, cfg: dict) -> dict:
    """What the JSON keeps of one run: every step (``ecrec.bench.accounting.STEP_FIELDS``), the cluster's
    events, the kills, and the figures that come from elsewhere (driver counts, server stats, model bytes,
    the comparison of the final state with the failure-free run's, load averages)."""
    from ecrec.bench.accounting import step_columns

    result = run["result"]
    state, ref_state = run.get("state"), reference["state"] if reference else None
    matches = None
    if state is not None and ref_state is not None:
        matches = state.keys() == ref_state.keys() and all(np.array_equal(state[k], ref_state[k]) for k in ref_state)
    return {"strategy": strategy, "kind": _kind(strategy), "failed_server": cfg.get("fail_server"),
            "steps": step_columns(result["records"], cfg.get("fail_server")), "events": list(run.get("events") or []),
            "kills": [{k: v for k, v in kill.items() if k != "pid"} for kill in _failures_of(run)],
            "planned_failures": run.get("planned_failures", len(_failures_of(run))),
            "driver": result.get("driver"), "evaluation": result.get("evaluation") or {},
            "client_bytes": result.get("client_bytes", 0), "stats": run.get("stats") or {},
            "model_bytes": _model_bytes(run["map"]) if run.get("map") is not None else 0,
            "state_matches_failure_free": matches, "interval": run.get("interval"),
            "load_average": run.get("load_average"), "memory": run.get("memory") or {},
            "snapshots": [{"step": int(r["step"]), "seconds": float(r["snapshot_s"])} for r in result["records"]
                          if r.get("snapshot_s") is not None]}


def summarize(strategy: str, run: dict, reference: dict | None, cfg: dict, fail_at) -> dict:
    """The strategy's row of the table (``ecrec.bench.accounting.strategy_row`` of its :func:`run_record`)."""
    from ecrec.bench.accounting import strategy_row

    return strategy_row(run_record(strategy, run, reference, cfg), fail_at)


def _model_bytes(cluster_map) -> int:
    from ecrec.tables.spec import DenseSpec, TableSpec

    total = sum(TableSpec.from_proto(t).row_bytes * t.num_rows for t in cluster_map.tables)
    return total + sum(DenseSpec.from_proto(d).payload_bytes for d in cluster_map.dense)


def _config(args) -> tuple[dict | None, str | None]:
    """The preset with the command line's values; an error message instead when one is invalid."""
    cfg = dict(PRESETS[args.preset], checkpoint_interval_steps=None, cpr_interval_s=None)
    for key in ("servers", "k", "m", "steps", "fail_at", "fail_server", "batch_size", "checkpoint_interval_steps",
                "failures", "cpr_interval_s", "target_pls"):
        value = getattr(args, key)
        if value is not None:
            cfg[key] = value
    cfg["mtbf_source"] = f"(preset {args.preset})"
    cfg["target_pls_source"] = "(given)" if args.target_pls is not None else f"(given by preset {args.preset})"
    if args.mtbf_hours is not None:
        if not (math.isfinite(args.mtbf_hours) and args.mtbf_hours > 0):
            return None, "--mtbf-hours must be finite and > 0"
        cfg["mtbf_s"] = args.mtbf_hours * 3600.0
        cfg["mtbf_source"] = "(given)"
    if not 0 < cfg["target_pls"] < 1:
        return None, "--target-pls must be in (0, 1)"
    if not (math.isfinite(args.cost_mtbf_hours) and args.cost_mtbf_hours > 0):
        return None, "--cost-mtbf-hours must be finite and > 0"
    if cfg["failures"] < 1:
        return None, "--failures must be >= 1"
    if cfg["checkpoint_interval_steps"] is not None and cfg["checkpoint_interval_steps"] < 1:
        return None, "--checkpoint-interval-steps must be >= 1"
    if cfg["cpr_interval_s"] is not None and not (math.isfinite(cfg["cpr_interval_s"]) and cfg["cpr_interval_s"] > 0):
        return None, "--cpr-interval-s must be finite and > 0"
    cfg["checkpoint_files"] = getattr(args, "checkpoint_files", "one")
    cfg["pls_basis"] = getattr(args, "pls_basis", "samples")
    bandwidth = getattr(args, "checkpoint_bandwidth_mb_s", None)
    if bandwidth is not None and not (math.isfinite(bandwidth) and bandwidth > 0):
        return None, "--checkpoint-bandwidth-mb-s must be finite and > 0"
    cfg["bandwidth_mb_s"] = bandwidth
    cfg["checkpoint_url"] = getattr(args, "checkpoint_url", None)
    if cfg["checkpoint_url"]:
        from baselines.storage import Storage

        try:
            if Storage.open(cfg["checkpoint_url"]).process_local:
                return None, f"--checkpoint-url {cfg['checkpoint_url']!r}: the servers are other processes, use a store they reach"
        except ValueError as exc:
            return None, f"--checkpoint-url: {exc}"
    if (args.dataset or cfg["dataset"]) == "synthetic" and not cfg["rows_per_table"]:
        cfg.update(rows_per_table=20_000, samples=60_000, tables=8)
    return cfg, None


def run(args) -> int:
    cfg, error = _config(args)
    if error:
        print(f"ecrec-bench compare: {error}", file=sys.stderr)
        return 2
    for flag, key in (("--servers", "servers"), ("--steps", "steps"), ("--batch-size", "batch_size")):
        if cfg.get(key) is not None and cfg[key] < 1:
            print(f"ecrec-bench compare: {flag} must be at least 1, got {cfg[key]}", file=sys.stderr)
            return 2
    from ecrec.bench.checks import MAX_BATCH_SIZE, MAX_STEPS, count_problem, servers_problem

    too_many = (servers_problem(cfg["servers"]) or count_problem("--steps", cfg["steps"], MAX_STEPS, "a run that ends")
                or count_problem("--batch-size", cfg["batch_size"], MAX_BATCH_SIZE, "samples per step per worker"))
    if too_many:
        print(f"ecrec-bench compare: {too_many}", file=sys.stderr)
        return 2
    dataset = _dataset_problem(args.dataset if args.dataset is not None else cfg["dataset"])
    if dataset:  # (the SystemExit carries the sentence too, as the dataset's later refusals do)
        print(f"ecrec-bench compare: {dataset}", file=sys.stderr)
        refused = SystemExit(f"ecrec-bench compare: {dataset}")
        refused.code = 2
        raise refused
    known = strategy_names()
    strategies = _named(args)
    if not strategies:
        print(f"ecrec-bench compare: --strategies is empty; choose from {', '.join(known)} (or leave it out: all)",
              file=sys.stderr)
        return 2
    unknown = [s for s in strategies if s not in known]
    if unknown:
        print(f"ecrec-bench compare: unknown strategies {unknown}; choose from {', '.join(known)}", file=sys.stderr)
        return 2
    if len(set(strategies)) < len(strategies):  # one run printed twice, as if two
        print("ecrec-bench compare: --strategies lists a strategy twice", file=sys.stderr)
        return 2
    erasure = [s for s in strategies if _kind(s) == "erasure"]
    if erasure and (cfg["k"] < 1 or cfg["m"] < 1):
        print(f"ecrec-bench compare: --k and --m must be at least 1 for {', '.join(erasure)} (got k={cfg['k']}, "
              f"m={cfg['m']})", file=sys.stderr)
        return 2
    if not 0 <= cfg["fail_server"] < cfg["servers"]:
        print(f"ecrec-bench compare: --fail-server must be in [0, {cfg['servers']})", file=sys.stderr)
        return 2
    if erasure and cfg["k"] + cfg["m"] > cfg["servers"]:
        print(f"ecrec-bench compare: k + m = {cfg['k'] + cfg['m']} exceeds --servers {cfg['servers']}", file=sys.stderr)
        return 2
    fail_at = cfg["fail_at"] if cfg["fail_at"] is not None and cfg["fail_at"] >= 0 else None
    if fail_at is not None and fail_at >= cfg["steps"]:
        first = "--fail-at" if args.fail_at is not None else f"the {args.preset} preset's first failure at step"
        print(f"ecrec-bench compare: --fail-at must be below --steps ({first} {fail_at}, --steps {cfg['steps']}); "
              "lower --fail-at, or --fail-at -1 for no failure", file=sys.stderr)
        return 2
    if args.workers < 1:
        print("ecrec-bench compare: --workers must be >= 1", file=sys.stderr)
        return 2
    from ecrec.bench.checks import count_problem
    from ecrec.config import MAX_LOCAL_SERVERS

    problem = count_problem("--workers", args.workers, MAX_LOCAL_SERVERS, "each is a process of its own on this "
                            "machine, started by torchrun")
    if problem:
        print(f"ecrec-bench compare: {problem}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print("ecrec-bench compare: --rounds must be >= 1", file=sys.stderr)
        return 2
    if args.snapshot_every < 0:
        print("ecrec-bench compare: --snapshot-every must be >= 0", file=sys.stderr)
        return 2
    if args.snapshot_every and args.workers > 1:
        print("ecrec-bench compare: --snapshot-every needs --workers 1 (a snapshot is a consistent cut only when no "
              "other worker pushes meanwhile)", file=sys.stderr)
        return 2
    if args.workers > 1 and args.equal_pls:
        print("ecrec-bench compare: --equal-pls needs --workers 1 (its replay of the failed server's updates reads "
              "one worker's batches)", file=sys.stderr)
        return 2
    from ecrec.workload.dlrm import resolve_arch

    try:
        args.model = resolve_arch(getattr(args, "model", "auto"))
    except ValueError as exc:
        print(f"ecrec-bench compare: --model: {exc}", file=sys.stderr)
        return 2
    if args.equal_pls and not any(s in ("cpr-mfu", "cpr-ssu") for s in strategies):
        print("ecrec-bench compare: --equal-pls tunes cpr-mfu and cpr-ssu to cpr's PLS: include one of them in "
              "--strategies", file=sys.stderr)
        return 2
    from ecrec.bench.cli import ignored_flag

    ignored = ignored_flag(args)
    if ignored:
        print(f"ecrec-bench compare: {ignored}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    from ecrec.net.transport import tune_allocator

    tune_allocator()
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="ecrec-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    kills = ("no kill" if fail_at is None else
             f"{cfg['failures']} kill(s) of server {cfg['fail_server']} from step {fail_at}")
    print(f"ecrec-bench compare: preset {args.preset}, {cfg['servers']} servers, {cfg['steps']} steps x "
          f"{cfg['batch_size']} samples, {args.workers} worker(s), {kills}, "
          f"{'TorchRec' if args.model == 'torchrec' else 'our'} DLRM", file=sys.stderr)
    side_by_side = args.workers == 1 and fail_at is not None and fail_at >= 100
    plan = None
    try:
        data_path, data_desc = prepare_data(args, cfg, work)
        print(f"  data: {data_desc}", file=sys.stderr)
        if side_by_side:
            results, plan = run_interleaved(strategies, args, cfg, data_path, work, fail_at, args.rounds)
        else:
            results = run_sequential(strategies, args, cfg, data_path, work, fail_at)
            # the reference again after the strategies: machine drift shows as the spread of the two
            print("  reference run again (drift check)", file=sys.stderr)
            results["reference2"] = run_strategy("none", args, cfg, data_path, work, None, "reference2")
        reference = results["reference"]
        runs = {name: run_record("none (no failure)" if name.startswith("reference") else name, result,
                                 None if name.startswith("reference") else reference, cfg)
                for name, result in results.items()}
    except RuntimeError as exc:  # a child process failed: its own message is in the exception
        print(f"ecrec-bench compare: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    from ecrec.bench import compare_report
    from ecrec.bench.accounting import load_warnings, table

    cost_mtbf_s = sorted({cfg["mtbf_s"], args.cost_mtbf_hours * 3600.0})
    figures = table(runs, plan["slices"] if plan else None, strategies, fail_at, args.seed, cost_mtbf_s)
    config = {**cfg, "preset": args.preset, "dataset": data_desc, "workers": args.workers, "seed": args.seed,
              "snapshot_every": args.snapshot_every,
              "model": args.model, "cost_mtbf_hours": [m / 3600.0 for m in cost_mtbf_s],
              "strategies": strategies, "cpu_count": os.cpu_count(), "equal_pls": bool(args.equal_pls),
              "throughput_measurement": plan if side_by_side else "sequential runs, reference before and after",
              "load_average_before": list(load_before), "load_average_after": list(os.getloadavg())}
    # only the load before the benchmark started tells of other jobs: once it runs, its own clusters (idle
    # ones included) count in the load average; every run's readings are in the JSON all the same
    warnings = load_warnings({"compare (before it started)": {"before": config["load_average_before"]}},
                             os.cpu_count() or 1)
    compare_report.print_report(figures, cfg, warnings)
    if args.json:
        compare_report.write_json(args.json, figures, config, runs, warnings, str(work))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        compare_report.write_plot(args.plot, figures["rows"], fail_at)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
