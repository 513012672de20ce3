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
- ``during_replay``: a replacement dies after a push a worker replayed to it is applied, or found applied
  already (its parity reached the survivors before the owner died, so the rebuild brought it back); the
  worker's replay of its unconfirmed pushes then continues at the next replacement;
- ``during_create``: a server dies while it creates a table's shard (the coordinator waits for its answer).

``point@n:hold=PATH`` pauses the thread at the n-th passage until the file ``PATH`` exists, instead of
killing the process (a test holds a replacement's background rebuild while it fails another server, then
creates the file).  ``point@n:error`` raises a transient error there once (UNAVAILABLE: a peer or the coordinator
answered an error; the code around it must retry).  ``point@n:delay=S`` sleeps ``S`` seconds at every passage from the n-th on (a slow disk, a
slow process).

The coordinator has points of its own, armed by ``ECREC_COORDINATOR_FAULT`` in its environment:

- ``record_map``: every change of the map is persisted (a slow ``fsync`` holds the coordinator's lock);
- ``record_promotion``: a standby answered its Promote; the coordinator has not recorded it yet.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

POINTS = ("before_local_commit", "after_partial_parity", "after_parity_before_ack", "before_parity_apply", "during_rebuild",
          "during_replay", "during_create")
ENV = "ECREC_FAULT"
COORDINATOR_POINTS = ("record_map", "record_promotion")
COORDINATOR_ENV = "ECREC_COORDINATOR_FAULT"

log = logging.getLogger("ecrec.faults")


class FaultInjector:
    def __init__(self, spec: str = "", points: tuple[str, ...] = POINTS, env: str = ENV):
        self._armed: dict[str, int] = {}
        self._holds: dict[str, str] = {}  # point -> the file whose existence releases it
        self._delays: dict[str, float] = {}  # point -> seconds slept at each passage from the armed one on
        self._lock = threading.Lock()
        self._errors: set[str] = set()  # points that raise a transient error instead of killing
        for item in filter(None, (part.strip() for part in spec.split(","))):
            if item.endswith(":error"):
                item = item[: -len(":error")]
                self._errors.add(item.partition("@")[0])
            item, _, delay = item.partition(":delay=")
            item, _, hold = item.partition(":hold=")
            name, _, count = item.partition("@")
            if name not in points:
                raise ValueError(f"{env}: unknown fault point {name!r}; known: {', '.join(points)}")
            if delay:
                try:
                    self._delays[name] = float(delay)
                except ValueError:
                    raise ValueError(f"{env}: {item!r}: the delay must be a number of seconds") from None
                if not 0 <= self._delays[name] <= 3600:
                    raise ValueError(f"{env}: {item!r}: the delay must be 0..3600 s")
            try:
                n = int(count or 1)
            except ValueError:
                raise ValueError(f"{env}: {item!r}: the count after @ must be an integer") from None
            if n < 1:
                raise ValueError(f"{env}: {item!r}: the count must be >= 1")
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
            slow = self._armed[point] <= 0 and point in self._delays
        if slow:
            time.sleep(self._delays[point])
            return
        if fire and point in self._errors:
            from ecrec import errors

            log.warning("fault injection: transient error at %s", point)
            raise errors.Unavailable(f"fault injection: a transient error at {point}")
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


def coordinator_from_environment() -> FaultInjector:
    return FaultInjector(os.environ.get(COORDINATOR_ENV, ""), COORDINATOR_POINTS, COORDINATOR_ENV)
