"""Requests this process refused, by method and gRPC status: the metric ``ecrec_requests_refused``."""

from __future__ import annotations

import threading

import grpc


class Refusals:
    """Requests this process refused, by method and gRPC status (a bad input, a bound, a wrong caller): the
    metric ``ecrec_requests_refused`` whose rate shows a misbehaving or hostile caller."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, str], int] = {}

    def add(self, method: str, code: grpc.StatusCode) -> None:
        with self._lock:
            key = (method, code.name)
            self.counts[key] = self.counts.get(key, 0) + 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self.counts)


#: this process's refusals (servers and coordinators count theirs here)
REFUSALS = Refusals()
