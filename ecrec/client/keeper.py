"""An idle worker's unconfirmed pushes, kept moving in the background.

A push is acknowledged before its parity is applied everywhere; until its owner confirms it, the worker's
courier holds it, and if the owner fails it is replayed to the replacement at the worker's next call to that
index.  A worker that pushes and then makes no call (waiting on input, evaluating, between epochs) would leave
its acknowledged push out of its rows after such a failure for as long as it stays idle, while other workers
train on those rows.  The keeper closes that gap: while the courier holds pushes and the worker has made no call
for ``ClientConfig.idle_poll_s``, it pulls one row from each index holding them, every ``idle_poll_s``.  Such a
pull carries the courier's relays, brings confirmations back (which release the held pushes) and, when a new
incarnation serves the index, replays the held pushes there first (``Cluster._replay_if_replaced``): the push
is back in its rows within about ``idle_poll_s`` plus the failover of one call after the replacement serves.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref


log = logging.getLogger("ecrec.client")


class IdleKeeper:
    """The background thread of one :class:`~ecrec.client.cluster.Cluster` (started at its first held push)."""

    #: polls failing in a row before the thread stops (the next held push starts it again): a cluster that is
    #: gone, or a client dropped without close(), is not polled forever
    MAX_FAILURES = 5

    def __init__(self, cluster, poll_s: float):
        self._cluster = weakref.ref(cluster)  # a client dropped without close() is not kept alive by its keeper
        self.poll_s = poll_s
        self.last_call = time.monotonic()
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.polls = 0
        self._failures = 0

    def called(self) -> None:
        """The worker made a call (the keeper stays out of its way for ``poll_s``)."""
        self.last_call = time.monotonic()

    def holding(self) -> None:
        """The courier holds pushes now: start the thread (once) and let it look."""
        if self.poll_s <= 0 or self._closed.is_set():
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._failures = 0
                self._thread = threading.Thread(target=self._run, name="ecrec-idle-keeper", daemon=True)
                self._thread.start()
        self._wake.set()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()

    @property
    def cluster(self):
        return self._cluster()

    def _run(self) -> None:
        while not self._closed.is_set():
            cluster = self.cluster
            if cluster is None or self._failures >= self.MAX_FAILURES:
                return
            held = cluster.courier.unconfirmed()  # (read each time: a caller may swap the courier)
            del cluster
            if not held:
                self._wake.wait(30.0)  # until the next held push (and now and then: a dropped client ends it)
                self._wake.clear()
                continue
            # after failures in a row (the cluster unreachable, or this client abandoned) poll less often
            self._closed.wait(min(5.0, self.poll_s * (2 ** self._failures)))
            if self._closed.is_set() or time.monotonic() - self.last_call < self.poll_s:
                continue
            try:
                self.poll()
                self._failures = 0
            except RuntimeError as exc:
                if "after shutdown" in str(exc):  # the client's channels were shut down: nothing left to poll
                    log.info("background poll stops: %s", exc)
                    return
                self._report(exc)
            except Exception as exc:  # noqa: BLE001 - reported; the worker's own next call meets it too
                self._report(exc)

    def _report(self, exc: Exception) -> None:
        self._failures += 1
        if self._failures == 1 or self._failures >= self.MAX_FAILURES:
            log.warning("background poll of the owners of unconfirmed pushes failed (%d in a row%s): %s",
                        self._failures, "; stopping until the next push" if self._failures >= self.MAX_FAILURES
                        else "", exc)

    def poll(self) -> None:
        """One pull from each index whose pushes the courier holds (``Cluster.poll_indices``)."""
        cluster = self.cluster
        if cluster is None:
            return
        if cluster.poll_indices(cluster.courier.held_indices(), give_up=self._closed.is_set):
            self.polls += 1
