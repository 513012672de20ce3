"""What a server counts about its own work: calls, seconds and CPU seconds per data-plane method with a latency
histogram (:class:`HandlerCounters`), rows pulled and pushed, and CPU seconds by kind of thread
(:func:`threads_cpu_s`); read by ``stats`` and by the metrics endpoint (``ecrec.ops.metrics``)."""

from __future__ import annotations

import contextlib
import threading
import time

from prometheus_client import Histogram

#: upper bounds (seconds) of the request-latency histogram buckets; a last bucket takes the rest (+Inf)
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class HandlerCounters:
    """Calls, seconds, CPU seconds (of the handling thread) and a latency histogram per data-plane method of
    this server, and the rows pulled and pushed; read by ``stats`` and by the metrics endpoint
    (``ecrec.ops.metrics``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        # per method: prometheus_client's own histogram (in no registry: ecrec.ops.metrics.ServerCollector yields it)
        self.latency = Histogram("ecrec_server_request_duration_seconds", "wall time of a data-plane request, by method",
                                 ["method"], buckets=LATENCY_BUCKETS_S, registry=None)
        self._latency_of: dict[str, object] = {}  # method -> its histogram child (labels() looked up once)
        self.rows: dict[str, int] = {}  # "pulled", "pushed": rows served and rows updated

    @contextlib.contextmanager
    def measure(self, method: str):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            with self._lock:
                self.calls[method] = self.calls.get(method, 0) + 1
                self.seconds[method] = self.seconds.get(method, 0.0) + wall
                self.cpu_seconds[method] = self.cpu_seconds.get(method, 0.0) + cpu
                child = self._latency_of.get(method)
                if child is None:
                    child = self._latency_of[method] = self.latency.labels(method)
            child.observe(wall)

    def count_rows(self, kind: str, rows: int) -> None:
        with self._lock:
            self.rows[kind] = self.rows.get(kind, 0) + rows

    def snapshot(self) -> dict:
        with self._lock:
            return {"calls": dict(self.calls), "seconds": dict(self.seconds), "cpu_seconds": dict(self.cpu_seconds),
                    "rows": dict(self.rows)}


def threads_cpu_s() -> dict[str, float]:
    """CPU seconds of this process by kind of thread: Python threads by name (numbers stripped, so a pool's
    threads add up), ``other`` for threads Python does not know (gRPC's own), ``total`` for the process."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, AttributeError, TypeError):  # a thread that just ended; a platform without thread clocks
            continue
        name = t.name.rstrip("0123456789_-") or "thread"
        out[name] = out.get(name, 0.0) + cpu
    total = time.process_time()
    return out | {"other": max(0.0, total - sum(out.values())), "total": total}
