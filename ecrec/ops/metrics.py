"""Prometheus metrics of an embedding server or of the coordinator, on ``--metrics-port``.

Nothing is counted twice: a collector reads, at scrape time, the state the process already keeps —
a server's per-method handler counters and latency histogram (``ecrec.server.counters.HandlerCounters``), its
strategy's ``stats()`` (parity batches and bytes, log lengths, rebuild progress, checkpoint saves and
loads), and the coordinator's cluster map (epoch, servers by state, events).  Each process serves its
own registry (never the global one) over HTTP with ``prometheus_client``, bound to the process's host.

Rates (pulls and pushes per second) are Prometheus' job: ``rate(ecrec_server_requests_total[1m])``.
The metric list, with help texts, is in docs/operations.md ("Prometheus metrics").
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ecrec.config import bracketed_host
from ecrec.net.cluster_map import fully_redundant
from ecrec.net.refusals import REFUSALS

log = logging.getLogger("ecrec.metrics")

#: a strategy's ``stats()`` entries exported as metrics, in groups: a group is exported when its strategy
#: reports its marker key, every metric of it (0 until the strategy counts one).  Per entry: stats key ->
#: (metric name, kind, help).
STRATEGY_METRICS = {
    "ecrec": ("redundancy_bytes", {
        # the owner side: parity batches built from this server's pushes
        "batches_built": ("ecrec_parity_batches_sent", "counter", "parity batches built for parity servers (direct or relayed)"),
        "relay_batches": ("ecrec_parity_batches_relayed", "counter", "parity batches handed to workers to relay"),
        "direct_batches": ("ecrec_parity_batches_direct", "counter", "parity batches sent straight to a parity server"),
        "parity_bytes_sent": ("ecrec_parity_bytes_direct", "counter", "bytes of parity messages sent straight to parity servers"),
        "parity_bytes_relayed": ("ecrec_parity_bytes_relayed", "counter", "bytes of parity batches handed to workers to relay"),
        "unconfirmed_pushes": ("ecrec_parity_unconfirmed_pushes", "gauge", "pushes of this owner not yet applied everywhere"),
        # the parity side: batches applied here
        "batches_applied": ("ecrec_parity_batches_applied", "counter", "parity batches applied on this server"),
        "delta_bytes_applied": ("ecrec_parity_delta_bytes_applied", "counter", "delta bytes applied to parity rows and replicas"),
        "duplicate_batches": ("ecrec_parity_batches_duplicate", "counter", "parity batches received again and skipped"),
        "refused_relayed_batches": ("ecrec_parity_batches_refused", "counter",
                                    "parity batches a worker carried that were refused (seal not checking, wrong "
                                    "server, stale incarnation)"),
        "refused_watermarks": ("ecrec_parity_watermarks_refused", "counter",
                               "watermarks a worker carried whose seal did not check (refused)"),
        "undone_batches": ("ecrec_parity_batches_undone", "counter", "parity batches undone by a recovery (XOR again)"),
        "log_entries": ("ecrec_parity_log_entries", "gauge", "parity batches held in this server's logs until confirmed"),
        "parity_rows": ("ecrec_parity_rows", "gauge", "parity rows held"),
        "redundancy_bytes": ("ecrec_redundancy_bytes", "gauge", "bytes of parity rows and dense replicas held"),
        # recovery
        "recovering": ("ecrec_recovering", "gauge", "1 while this server rebuilds its rows in the background"),
        "rows_rebuilt": ("ecrec_rebuild_data_rows", "counter", "data rows rebuilt (on demand or in the background)"),
        "parity_rows_rebuilt": ("ecrec_rebuild_parity_rows", "counter", "parity rows rebuilt by re-encoding"),
        "rebuild_rows_total": ("ecrec_rebuild_rows", "gauge", "rows (data and parity) a rebuild of this server covers"),
        "rebuild_rows_pending": ("ecrec_rebuild_rows_pending", "gauge", "rows still waiting for the rebuild"),
        "rebuild_s": ("ecrec_rebuild_last_seconds", "gauge", "duration of the last completed background rebuild"),
    }),
    "checkpoint": ("bytes_written", {  # full, cpr, cpr-mfu, cpr-ssu
        "saves": ("ecrec_checkpoint_saves", "counter", "full checkpoints saved"),
        "partial_saves": ("ecrec_checkpoint_partial_saves", "counter", "partial (MFU/SSU) checkpoints saved"),
        "bytes_written": ("ecrec_checkpoint_bytes_written", "counter", "checkpoint bytes written"),
        "rows_saved_full": ("ecrec_checkpoint_rows_saved_full", "counter", "rows written by full checkpoints"),
        "rows_saved_partial": ("ecrec_checkpoint_rows_saved_partial", "counter", "rows written by partial checkpoints"),
        "persist_s_total": ("ecrec_checkpoint_save_seconds", "counter", "seconds spent writing checkpoints (after the snapshot)"),
        "snapshot_s_total": ("ecrec_checkpoint_snapshot_seconds", "counter", "seconds spent taking checkpoint snapshots"),
        "persist_s_last": ("ecrec_checkpoint_last_save_seconds", "gauge", "duration of the last checkpoint write"),
        "snapshot_s_last": ("ecrec_checkpoint_last_snapshot_seconds", "gauge", "duration of the last checkpoint snapshot"),
        "write_errors": ("ecrec_checkpoint_write_errors", "counter", "checkpoint writes that failed"),
        "writing": ("ecrec_checkpoint_writes_in_flight", "gauge", "checkpoint writes in progress"),
        "loads": ("ecrec_checkpoint_loads", "counter", "checkpoints loaded (recoveries)"),
        "load_s_last": ("ecrec_checkpoint_last_load_seconds", "gauge", "duration of the last checkpoint load"),
        "load_bytes_last": ("ecrec_checkpoint_last_load_bytes", "gauge", "bytes read by the last checkpoint load"),
    }),
}


def _number(value) -> float | None:
    if isinstance(value, (int, float)):  # bool included
        return float(value)
    return None


class ServerCollector:
    """Metrics of one embedding server, read from its ``ecrec.server.state.ServerState`` at scrape time (this module
    never imports the server: ``state`` is handed in)."""

    def __init__(self, state):
        self.state = state

    def describe(self) -> list[Metric]:
        """Every family a scrape may hold, whatever the strategy (a scrape restricted by ``name[]`` finds them)."""
        every = {marker: 0 for marker, _ in STRATEGY_METRICS.values()}
        return [*self._own(), *strategy_metrics({**every, "rebuild_rows_total": 0})]

    def collect(self) -> Iterable[Metric]:
        yield from self._own()
        strategy = self.state.strategy
        if strategy is None:
            return
        try:
            stats = strategy.stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because a strategy's stats did; logged
            log.exception("strategy %s: stats() failed during a metrics scrape", strategy.name)
            return
        yield from strategy_metrics(stats)

    def _own(self) -> Iterable[Metric]:
        state = self.state
        handlers = state.handlers.snapshot()
        requests = CounterMetricFamily("ecrec_server_requests", "data-plane requests handled, by method",
                                       labels=["method"])
        cpu = CounterMetricFamily("ecrec_server_request_cpu_seconds",
                                  "CPU seconds of the handling thread, by method", labels=["method"])
        for method in sorted(handlers["calls"]):
            requests.add_metric([method], handlers["calls"][method])
            cpu.add_metric([method], handlers["cpu_seconds"][method])
        yield requests
        yield cpu
        yield refusals_metric()
        yield from state.handlers.latency.collect()  # prometheus_client's Histogram, observed per request
        rows = handlers.get("rows", {})
        yield CounterMetricFamily("ecrec_server_rows_pulled", "rows served to pulls", value=rows.get("pulled", 0))
        yield CounterMetricFamily("ecrec_server_rows_pushed", "rows updated by pushes", value=rows.get("pushed", 0))
        status = state.status()
        yield GaugeMetricFamily("ecrec_server_epoch", "the cluster-map epoch this server holds", value=status["epoch"])
        yield GaugeMetricFamily("ecrec_server_index", "this server's index (-1: standby)", value=status["index"])
        yield GaugeMetricFamily("ecrec_server_data_rows", "data rows this server holds", value=status["data_rows"])
        yield GaugeMetricFamily("ecrec_server_standby_reserve_bytes", "table memory a standby holds ready for its "
                                "promotion (ecrec.server.reserve)", value=status["standby_reserve_bytes"])
        yield CounterMetricFamily("ecrec_server_gc_full_collections", "Python's full garbage collections in this "
                                  "process (each holds the interpreter: ecrec.server.collector)",
                                  value=status["gc_full_collections_total"])
        yield CounterMetricFamily("ecrec_server_gc_pause_seconds", "time held by full garbage collections",
                                  value=status["gc_pause_total_s"])
        yield GaugeMetricFamily("ecrec_server_gc_longest_pause_seconds", "the longest full garbage collection since "
                                "the server started serving", value=status["gc_longest_pause_ms"] / 1e3)
        yield GaugeMetricFamily("ecrec_server_lease_remaining_seconds",
                                "seconds left of this server's lease from the coordinator (0: none; it stops serving)",
                                value=status["lease_remaining_s"])


def refusals_metric() -> Metric:
    """Requests this process refused, by method and status (``ecrec.net.refusals.REFUSALS``)."""
    family = CounterMetricFamily("ecrec_requests_refused", "requests refused for their content, a bound or the "
                                 "caller (bad input, RESOURCE_EXHAUSTED, PERMISSION_DENIED, ...), by method and status",
                                 labels=["method", "code"])
    for (method, code), count in sorted(REFUSALS.snapshot().items()):
        family.add_metric([method, code], count)
    return family


def strategy_metrics(stats: dict) -> Iterable[Metric]:
    """A strategy's ``stats()`` as counters and gauges (:data:`STRATEGY_METRICS`), plus the rebuild progress."""
    for marker, entries in STRATEGY_METRICS.values():
        if marker not in stats:
            continue
        for key, (name, kind, help_text) in entries.items():
            value = _number(stats.get(key, 0))
            if value is None:
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help_text, value=value)
    total = _number(stats.get("rebuild_rows_total"))
    if total is not None:
        pending = _number(stats.get("rebuild_rows_pending")) or 0.0
        progress = 1.0 if total == 0 else (total - pending) / total
        yield GaugeMetricFamily("ecrec_rebuild_progress_ratio", "rows rebuilt of the rows to rebuild (1: complete)",
                                value=progress)


class CoordinatorCollector:
    """Metrics of the coordinator, read from the cluster map it serves at scrape time.

    ``read_map`` returns a copy of the map ``GetClusterMap`` answers (``ecrec.control.leadership.served_map``:
    a follower's is the one etcd holds), or None when it knows none (etcd unreachable, or holding no map yet);
    ``leading`` says whether this coordinator leads (None: it always does).
    """

    def __init__(self, read_map: Callable, leading: Callable[[], bool] | None = None):
        self.read_map = read_map
        self.leading = leading

    def describe(self) -> list[Metric]:
        """Every family a scrape may hold (a scrape restricted by ``name[]`` finds them)."""
        from ecrec.wire import cluster_pb2

        return list(CoordinatorCollector(lambda: cluster_pb2.ClusterMap()).collect())

    def collect(self) -> Iterable[Metric]:
        from ecrec.wire import cluster_pb2

        yield GaugeMetricFamily("ecrec_coordinator_leading", "1 when this coordinator leads (changes the map); 0: a "
                                "follower, which serves the map etcd holds", value=int(self.leading is None
                                                                                          or self.leading()))
        yield refusals_metric()
        cluster_map = self.read_map()
        yield GaugeMetricFamily("ecrec_coordinator_map_known", "1 when this coordinator could read the cluster map "
                                "(0: a follower that cannot reach etcd, or etcd holds no map yet: no ecrec_cluster_* "
                                "series then)", value=int(cluster_map is not None))
        if cluster_map is None:
            return
        yield GaugeMetricFamily("ecrec_cluster_epoch", "the cluster map's epoch", value=cluster_map.epoch)
        yield GaugeMetricFamily("ecrec_cluster_indices", "server indices of the cluster", value=cluster_map.num_servers)
        yield GaugeMetricFamily("ecrec_cluster_ready", "1 when every index has a live server",
                                value=int(cluster_map.ready))
        yield GaugeMetricFamily("ecrec_cluster_fully_redundant",
                                "1 when every index has an active server that is not recovering",
                                value=int(fully_redundant(cluster_map)))
        by_state = GaugeMetricFamily("ecrec_cluster_servers", "servers in the map, by state", labels=["state"])
        for state in ("ACTIVE", "RECOVERING", "PROMOTING", "STANDBY", "FAILED"):
            number = cluster_pb2.ServerState.Value(state)
            by_state.add_metric([state.lower()], sum(1 for s in cluster_map.servers if s.state == number))
        yield by_state
        yield GaugeMetricFamily("ecrec_cluster_tables", "embedding tables", value=len(cluster_map.tables))
        yield GaugeMetricFamily("ecrec_cluster_dense_tensors", "dense tensors", value=len(cluster_map.dense))
        events = GaugeMetricFamily("ecrec_cluster_events", "events in the map's history (the last 1000), by kind",
                                   labels=["kind"])
        last = GaugeMetricFamily("ecrec_cluster_last_event_timestamp_seconds", "wall time of the last event, by kind",
                                 labels=["kind"])
        for kind in ("failed", "promoted", "redundant", "data_loss"):
            of_kind = [e for e in cluster_map.events if e.kind == kind]
            events.add_metric([kind], len(of_kind))
            if of_kind:
                last.add_metric([kind], of_kind[-1].wall_time)
        yield events
        yield last
        lost = GaugeMetricFamily("ecrec_cluster_data_loss_stripes",
                                 "stripes that lost more than m members at once (unrecoverable), by table",
                                 labels=["table"])
        for loss in cluster_map.data_loss:
            lost.add_metric([loss.table], loss.stripe_count)
        yield lost


@dataclass
class MetricsEndpoint:
    """A running HTTP endpoint serving one registry at ``http://address/metrics``."""

    address: str
    _server: object
    _thread: threading.Thread

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


#: connections the metrics port queues while its threads answer others (prometheus_client's server keeps 5: a
#: hundred scrapers at once met SYN retries of 1, 3 and 7 s)
LISTEN_BACKLOG = 128


def _start_http_server(port: int, host: str, registry):
    """prometheus_client's ``start_http_server`` with a listen backlog of :data:`LISTEN_BACKLOG`."""
    from wsgiref.simple_server import make_server

    from prometheus_client import exposition, start_http_server

    best_family = getattr(exposition, "_get_best_family", None)
    handler = getattr(exposition, "_SilentHandler", None)
    if best_family is None or handler is None:  # a prometheus_client without them: its own server, backlog and all
        return start_http_server(port, addr=host, registry=registry)

    class Server(exposition.ThreadingWSGIServer):
        request_queue_size = LISTEN_BACKLOG

    Server.address_family, addr = best_family(host, port)
    server = make_server(addr, port, exposition.make_wsgi_app(registry), Server, handler_class=handler)
    thread = threading.Thread(target=server.serve_forever, name="ecrec-metrics", daemon=True)
    thread.start()
    return server, thread


def serve(collector, host: str, port: int) -> MetricsEndpoint:
    """Serves ``collector`` (and this process's CPU and memory) on ``host:port`` (0: any free port)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--metrics-port must be 0..65535, got {port}")
    # a scrape restricted by name (``/metrics?name[]=...``) finds only series the registry knows by name: ours
    # describe theirs, auto_describe asks ProcessCollector's collect
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    ProcessCollector(registry=registry)
    # an IPv6 host as the servers take it (``--host [::1]``, the form of a gRPC address) or bare (``::1``): bound
    # bare, shown in brackets (``[::1]:9100``, a URL's and the cluster map's form)
    shown = bracketed_host(host)
    bind = shown.strip("[]")
    try:
        server, thread = _start_http_server(port, bind, registry)
    except OSError as exc:
        raise OSError(f"--metrics-port {port}: cannot serve metrics on {shown}:{port}: "
                      f"{exc.strerror or exc}") from None
    endpoint = MetricsEndpoint(f"{shown}:{server.server_port}", server, thread)
    log.info("metrics at http://%s/metrics", endpoint.address)
    return endpoint
