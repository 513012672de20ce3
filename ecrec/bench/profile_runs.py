"""The workloads ``ecrec-bench profile`` trains, one step at a time, and the figures made of what it recorded.

Two workloads: the quick preset's DLRM (``compare``'s worker), and with ``--rows N`` the recovery benchmark's
(embedding bags over ``--tables`` tables of ``N`` x ``--dim`` rows, ``--batch-size`` samples of
``--ids-per-sample`` uniform ids each, a linear head).  Each step is timed, with the worker's CPU and the
servers' (``/proc``: 10 ms ticks) over it, so the longest step says whether the worker or the servers were busy.

:func:`added_by` is every figure of a profile against a baseline run: what ``--strategy`` adds per row update
(the servers' CPU, all threads, from their own process clocks, over the rows pushes updated), part by part from
the strategy's own counters (``part_*_cpu_s``), the rest being what the counters do not see (handlers and gRPC
carrying relayed bytes, the direct senders, bookkeeping outside the parts), and the step times side by side.
"""

from __future__ import annotations

import math
import time
from argparse import Namespace
from pathlib import Path

import numpy as np

#: steps trained before anything is measured (tables touched, kernels warm, groups flowing)
WARM_STEPS = 30
#: a step longer than this is a stall (the issue's measure: share of time in such steps)
STALL_MS = 30.0
#: the parity path's parts the erasure strategy counts (``part_<name>_cpu_s``), in the order a delta meets them
PARTS = ("delta", "merge", "build", "serialize", "seal", "frame", "verify", "parse", "apply", "watermarks")


class QuickWorkload:
    """The quick preset's DLRM trained by ``compare``'s worker on a local cluster of ``strategy``."""

    def __init__(self, strategy: str, args, out: Path, options: dict[str, str], server_options: dict | None = None):
        from ecrec.bench import compare

        # the keys compare's _config adds to a preset: none given (full: interval_steps, then the warm saves')
        cfg = dict(compare.PRESETS["quick"], servers=args.servers, k=args.k, m=args.m, steps=100_000,
                   checkpoint_interval_steps=None, cpr_interval_s=None, strategy_options={strategy: dict(options)},
                   server_options=dict(server_options or {}))
        cargs = Namespace(dataset="synthetic", seed=0, mtbf_hours=None, checkpoint_interval_steps=None, workers=1,
                          keep=False)
        data_path, _ = compare.prepare_data(cargs, cfg, out)
        self.description = {"workload": "quick", "batch_size": cfg["batch_size"], "tables": cfg["tables"],
                            "rows_per_table": cfg["rows_per_table"], "dim": cfg["embedding_dim"]}
        self.samples = cfg["batch_size"]
        self.run = compare.StrategyRun(strategy, strategy, cargs, cfg, data_path, out, None)
        self.servers = args.servers

    @property
    def cluster(self):
        return self.run.trainer.cluster

    def warm(self) -> None:
        self.run.advance(WARM_STEPS)

    def step(self) -> None:
        self.run.advance(self.run.trainer.step + 1)

    def server_pids(self) -> list[int]:
        return self.run.server_pids()

    def cpu_seconds(self) -> dict[str, float]:
        return self.run.cpu_seconds()

    def close(self) -> None:
        self.run.close()


class RowsWorkload:
    """The recovery benchmark's training worker (``ecrec.bench.recovery_training``) on tables of ``--rows``."""

    def __init__(self, strategy: str, args, out: Path, options: dict[str, str], server_options: dict | None = None):
        from ecrec.bench.compare_running import process_cpu_seconds, wait_until_idle
        from ecrec.bench.recovery_training import _Worker
        from ecrec.client import Cluster
        from ecrec.config import ClientConfig
        from ecrec.ops.local import LocalCluster, LocalClusterSpec

        from ecrec.strategies import get_spec

        self._cpu = process_cpu_seconds
        kind = get_spec(strategy).kind
        k, m = (args.k, args.m) if kind == "erasure" else (0, 0)
        options = dict(options)
        if kind == "checkpoint":  # its checkpoints under the profile's directory
            options.setdefault("dir", str(out / "checkpoints"))
        self.local = LocalCluster(LocalClusterSpec(servers=args.servers, strategy=strategy, k=k, m=m, options=options,
                                                   server_options=dict(server_options or {})))
        self.local.start(timeout_s=180)
        self.servers = args.servers
        self.client = None
        try:
            self.client = Cluster.connect(self.local.coordinator_address, ClientConfig(rpc_timeout_s=600.0),
                                          worker="profile")
            names = [f"t{i}" for i in range(args.tables)]
            for name in names:
                self.client.create_table(name, args.rows, args.dim, optimizer=args.optimizer, lr=0.05, seed=0,
                                         initial_accumulator_value=0.1 if args.optimizer == "adagrad" else 0.0)
            wait_until_idle(self.server_pids())
            wargs = Namespace(seed=0, rows=args.rows, dim=args.dim, batch_size=args.batch_size,
                              ids_per_sample=args.ids_per_sample, mtbf_hours=1.0)
            self.worker = _Worker(strategy, wargs, self.client, names)
        except BaseException:
            self.close()
            raise
        self.samples = args.batch_size
        self.description = {"workload": "rows", "batch_size": args.batch_size, "tables": args.tables,
                            "rows_per_table": args.rows, "dim": args.dim, "ids_per_sample": args.ids_per_sample,
                            "optimizer": args.optimizer}

    @property
    def cluster(self):
        return self.client

    def warm(self) -> None:
        for _ in range(WARM_STEPS):
            self.worker.train_one()

    def step(self) -> None:
        self.worker.train_one()

    def server_pids(self) -> list[int]:
        return [self.local.pid_of_index(i) for i in range(self.servers)]

    def cpu_seconds(self) -> dict[str, float]:
        return {"worker": time.process_time(), "servers": sum(self._cpu(p) for p in self.server_pids()),
                "coordinator": self._cpu(self.local.coordinator_proc.pid)}

    def close(self) -> None:
        if self.client is not None:
            self.client.close(confirm_timeout_s=30.0)
        self.local.close()


def _options(items) -> dict[str, str]:
    """``KEY=VALUE`` flags as a dict (checked for their ``=`` by ``profile._check``)."""
    return dict(item.split("=", 1) for item in items or [])


def server_options(items, flag: str = "--server-option") -> dict:
    """``flag KEY=VALUE`` items as ``ServerConfig`` field -> value (``true``/``false`` for a switch), those equal
    to the default left out; raises ValueError naming an unknown field, a setting the local cluster gives each
    server itself (its coordinator, address, port, index, role, security), a value of the wrong kind or one the
    server would refuse."""
    import dataclasses

    from ecrec.config import EtcdClientOptions, SecurityOptions, ServerConfig, _field_type, cli_fields

    fields = {f.name: f for f in cli_fields(ServerConfig)}
    managed = {"coordinator", "host", "advertise_host", "port", "device", "standby", "want_index", "metrics_port"}
    managed |= {f.name for cls in (SecurityOptions, EtcdClientOptions) for f in dataclasses.fields(cls)}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
    out = {}
    for key, value in _options(items).items():
        f = fields.get(key)
        if f is None:
            raise ValueError(f"{flag} {key}: no such server setting (ecrec-server serve --help lists them; "
                             "write the flag's name with underscores, e.g. no_gc_freeze=true)")
        if key in managed:
            raise ValueError(f"{flag} {key}: the local cluster sets it for each server itself")
        kind = _field_type(ServerConfig, f)
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"{flag} {key}={value}: expected true or false")
            parsed = value.lower() in ("true", "1", "yes")
        elif kind in (int, float):
            try:
                parsed = kind(value)
            except ValueError:
                raise ValueError(f"{flag} {key}={value}: expected {'an integer' if kind is int else 'a number'}") \
                    from None
        else:
            parsed = value
        if parsed != f.default:
            out[key] = parsed
    try:  # what the server would refuse at its start, said now
        ServerConfig(coordinator="127.0.0.1:1", **out)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{flag}: {exc}") from None
    return out


def clusters(args) -> list[tuple[str, str, dict[str, str], dict]]:
    """``(name, strategy, options, server options)`` of each cluster to run, the baseline (``--against``) first,
    with its ``--against-option``s and ``--against-server-option``s (the profiled one has the ``--option``s and
    ``--server-option``s): the profiled one is named by its strategy, the baseline by its strategy too, or, when it
    is the same strategy, by it and its options (``ecrec (parity_transport=grpc)``)."""
    profiled = (args.strategy, args.strategy, _options(args.option),
                server_options(getattr(args, "server_option", None)))
    if not args.against:
        return [profiled]
    against = getattr(args, "against_option", None) or []
    against_server = getattr(args, "against_server_option", None) or []
    name = args.against
    if args.against == args.strategy:
        name = f"{args.against} ({' '.join(against + against_server or ['defaults'])})"
    return [(name, args.against, _options(against), server_options(against_server, "--against-server-option")),
            profiled]


def workload(strategy: str, args, out: Path, options: dict[str, str], server_settings: dict | None = None):
    """The workload ``args`` ask for, on a fresh local cluster of ``strategy`` with ``options`` and its servers'
    ``server_settings`` (its files under ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    kind = RowsWorkload if args.rows else QuickWorkload
    return kind(strategy, args, out, options, server_settings)


def step_records(records: list[tuple[float, float, list[float]]]) -> dict:
    """The step-time distribution of ``(seconds, worker CPU s, [each server's CPU s])`` per step: median, p90,
    p99, max (ms), the share of the time in steps over ``STALL_MS``, and the longest step with what the worker
    and each server spent over it."""
    if not records:
        return {"steps": 0}
    ms = np.array([1e3 * r[0] for r in records])
    longest = int(np.argmax(ms))
    servers = [1e3 * c for c in records[longest][2]]
    return {"steps": len(records), "median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90)),
            "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max()),
            "stall_share": float(ms[ms > STALL_MS].sum() / ms.sum()),
            "longest": {"ms": float(ms[longest]), "worker_cpu_ms": 1e3 * records[longest][1],
                        "servers_cpu_ms": sum(servers), "each_server_cpu_ms": servers, "index": longest}}


#: where the servers spend what the strategy adds (``servers_per_step`` keys), beside the parts
PLACES = ("handler:Push", "handler:Pull", "strategy:apply_parity_cpu_s", "thread:ecrec-parity-closer",
          "thread:ecrec-parity-sender", "thread:ecrec-parity-channel", "thread:ecrec-strategy-timer", "thread:Thread-1 (_serve)", "thread:other")


def added_by(base: dict, run: dict) -> dict:
    """What ``run``'s strategy adds over ``base``'s (two profile reports of one workload): the servers' CPU per
    row update (µs; all threads, ``thread:total``, over the rows its pushes updated), by part (``PARTS`` from its
    counters, ``rest`` = the remainder), per step (ms), and the step times' ratios."""
    rs, bs = run["servers_per_step"], base["servers_per_step"]
    rows = rs.get("rows:pushed") or 0.0
    added_ms = rs.get("thread:total", 0.0) - bs.get("thread:total", 0.0)
    per_row = (lambda ms: 1e3 * ms / rows) if rows else (lambda ms: math.nan)
    parts = {name: rs.get(f"strategy:part_{name}_cpu_s", 0.0) for name in PARTS}
    parts_us = {name: per_row(ms) for name, ms in parts.items()}
    parts_us["rest"] = per_row(added_ms - sum(parts.values()))
    places_us = {place: per_row(rs.get(place, 0.0) - bs.get(place, 0.0)) for place in PLACES}
    bt, rt = base["step_times"], run["step_times"]

    def ratio(key):
        return rt[key] / bt[key] if bt.get(key) else math.nan

    return {"rows_updated_per_step": rows, "server_cpu_ms_per_step": added_ms,
            "server_cpu_us_per_row_update": per_row(added_ms), "parts_us_per_row_update": parts_us,
            "places_us_per_row_update": places_us,
            "total_cpu_ratio": sum(run["cpu_ms_per_step"].values()) / sum(base["cpu_ms_per_step"].values()),
            "samples_per_s_ratio": run["samples_per_s"] / base["samples_per_s"],
            "median_step_ratio": ratio("median_ms"), "p99_step_ratio": ratio("p99_ms"),
            "stall_share": rt.get("stall_share", math.nan), "base_stall_share": bt.get("stall_share", math.nan),
            # the servers' full garbage collections (all of them together, per step) and the time they held them
            "gc_full_collections_per_step": rs.get("gc:full_collections", 0.0),
            "base_gc_full_collections_per_step": bs.get("gc:full_collections", 0.0),
            "gc_pause_ms_per_step": rs.get("gc:pause_s", 0.0), "base_gc_pause_ms_per_step": bs.get("gc:pause_s", 0.0),
            # and the worker's (this process: one worker trains both clusters, in turn)
            "worker_gc_full_collections_per_step": rs.get("worker_gc:full_collections", 0.0),
            "base_worker_gc_full_collections_per_step": bs.get("worker_gc:full_collections", 0.0)}


def print_added(added: dict, base: str, strategy: str) -> None:
    """The lines of :func:`added_by`'s figures."""
    print(f"{strategy} over {base}: {added['server_cpu_ms_per_step']:+.2f} ms of server CPU per step, "
          f"{added['rows_updated_per_step']:.0f} rows updated per step: "
          f"{added['server_cpu_us_per_row_update']:+.2f} us per row update; total CPU {added['total_cpu_ratio']:.3f}x; "
          f"samples/s {added['samples_per_s_ratio']:.3f}x; median step {added['median_step_ratio']:.2f}x, "
          f"p99 {added['p99_step_ratio']:.2f}x; time in steps over {STALL_MS:.0f} ms {added['stall_share']:.1%} "
          f"({base}: {added['base_stall_share']:.1%})")
    print(f"  servers' full garbage collections: {added['gc_full_collections_per_step'] * 1e3:.2f} per 1000 steps, "
          f"holding them {added['gc_pause_ms_per_step']:.3f} ms per step ({base}: "
          f"{added['base_gc_full_collections_per_step'] * 1e3:.2f}, {added['base_gc_pause_ms_per_step']:.3f} ms); the "
          f"worker's: {added['worker_gc_full_collections_per_step'] * 1e3:.2f} per 1000 steps ({base}: "
          f"{added['base_worker_gc_full_collections_per_step'] * 1e3:.2f})")
    print("  per row update, by part (us):  " + "  ".join(f"{name} {us:.3f}"
                                                          for name, us in added["parts_us_per_row_update"].items()))
    print("  per row update, by place (us): " + "  ".join(f"{place.split(':', 1)[1]} {us:+.3f}"
                                                          for place, us in added["places_us_per_row_update"].items()))


#: the figures of :func:`added_by` a profile gives as median and spread over its rounds
SUMMARIZED = ("server_cpu_us_per_row_update", "total_cpu_ratio", "samples_per_s_ratio", "median_step_ratio",
              "p99_step_ratio", "stall_share")


def summarize(added: list[dict]) -> dict:
    """Median, min and max over the rounds (``added``: :func:`added_by` of each) of each of ``SUMMARIZED`` and of
    each part per row update."""
    def spread(values):
        values = [v for v in values if not math.isnan(v)]
        if not values:
            return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
        return {"median": float(np.median(values)), "min": min(values), "max": max(values), "n": len(values)}

    out = {key: spread([a[key] for a in added]) for key in SUMMARIZED}
    out["parts_us_per_row_update"] = {name: spread([a["parts_us_per_row_update"][name] for a in added])
                                      for name in added[0]["parts_us_per_row_update"]}
    return out


def print_summary_of_runs(summary: dict, base: str, strategy: str) -> None:
    rounds = summary["server_cpu_us_per_row_update"]["n"]
    print(f"{strategy} over {base}, {rounds} rounds, median [min, max]:")
    for key in SUMMARIZED:
        s = summary[key]
        print(f"  {key:<30} {s['median']:8.3f}  [{s['min']:.3f}, {s['max']:.3f}]")
    print("  per row update, by part (us), median: " + "  ".join(
        f"{name} {s['median']:.3f}" for name, s in summary["parts_us_per_row_update"].items()))
