"""Fault injection for tests: make a server die (SIGKILL) at a named point of the protocol.

Off by default.  Armed only through the server process's environment, never by a request:

    ECREC_FAULT="after_partial_parity@3"      # die the 3rd time this point is reached
    ECREC_FAULT="before_local_commit@5,during_rebuild@2"

Points (where the server calls :func:`hit`):

- ``before_local_commit``: a push was validated, nothing applied yet;
- ``after_partial_parity``: a push's batch reached some parity servers, not all;
- ``after_parity_before_ack``: every parity server applied the push, the worker has no ack;
- ``before_parity_apply``: a parity server received a batch and dies before applying it (counted once
  per push the batch carries);
- ``during_rebuild``: a replacement dies in the middle of its background rebuild;
- ``during_replay``: a replacement dies after applying a push a worker replayed to it (the worker's
  replay of its unconfirmed pushes then continues at the next replacement).

``point@n:hold=PATH`` pauses the thread at the n-th passage until the file ``PATH`` exists, instead of
killing the process (a test holds a replacement's background rebuild while it fails another server, then
creates the file).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

POINTS = ("before_local_commit", "after_partial_parity", "after_parity_before_ack", "before_parity_apply", "during_rebuild",
          "during_replay")
ENV = "ECREC_FAULT"

log = logging.getLogger("ecrec.faults")


class FaultInjector:
    def __init__(self, spec: str = ""):
        self._armed: dict[str, int] = {}
        self._holds: dict[str, str] = {}  # point -> the file whose existence releases it
        self._lock = threading.Lock()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            item, _, hold = item.partition(":hold=")
            name, _, count = item.partition("@")
            if name not in POINTS:
                raise ValueError(f"{ENV}: unknown fault point {name!r}; known: {', '.join(POINTS)}")
            try:
                n = int(count or 1)
            except ValueError:
                raise ValueError(f"{ENV}: {item!r}: the count after @ must be an integer") from None
            if n < 1:
                raise ValueError(f"{ENV}: {item!r}: the count must be >= 1")
            self._armed[name] = n
            if hold:
                self._holds[name] = hold

    def armed(self, point: str) -> bool:
        return point in self._armed

    def hit(self, point: str) -> None:
        """Counts one passage through ``point``; kills this process on the armed passage."""
        if point not in self._armed:
            return
        with self._lock:
            self._armed[point] -= 1
            fire = self._armed[point] == 0
        if fire and point in self._holds:
            path = self._holds[point]
            log.warning("fault injection: holding at %s until %s exists", point, path)
            while not os.path.exists(path):
                time.sleep(0.02)
            log.warning("fault injection: released at %s", point)
            return
        if fire:
            log.warning("fault injection: SIGKILL at %s", point)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)


def from_environment() -> FaultInjector:
    return FaultInjector(os.environ.get(ENV, ""))
