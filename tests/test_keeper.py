"""The idle keeper (ecrec/client/keeper.py) in one process: it polls while pushes are held and the worker is idle,
stops after failures in a row, and ends with a client that was dropped without close()."""

from __future__ import annotations

import gc
import time

from ecrec.client.keeper import IdleKeeper


class FakeCourier:
    def __init__(self, held):
        self.held = held

    def unconfirmed(self):
        return self.held


class PollingClient:
    """Counts the keeper's polls; fails them when told to."""

    def __init__(self, fail=False):
        self.courier = FakeCourier(1)
        self.fail = fail
        self.polls = 0


class Keeper(IdleKeeper):
    def poll(self):
        client = self.cluster
        if client is None:
            return
        client.polls += 1
        if client.fail:
            raise ConnectionError("cluster gone")


def _wait(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_polls_while_pushes_are_held_and_stops_after_failures_in_a_row():
    client = PollingClient()
    keeper = Keeper(client, 0.01)
    keeper.holding()
    _wait(lambda: client.polls >= 3)
    client.courier.held = 0  # confirmed: no more polls
    time.sleep(0.1)
    polls = client.polls
    time.sleep(0.2)
    assert client.polls <= polls + 1
    client.fail, client.courier.held = True, 1
    keeper.holding()
    _wait(lambda: not keeper._thread.is_alive())
    assert keeper._failures == Keeper.MAX_FAILURES
    client.fail = False
    keeper.holding()  # the next held push starts it again
    _wait(lambda: keeper._failures == 0 and client.polls > polls + Keeper.MAX_FAILURES)
    keeper.close()


def test_a_dropped_client_is_not_kept_alive_and_its_keeper_ends():
    client = PollingClient()
    keeper = Keeper(client, 0.01)
    keeper.holding()
    _wait(lambda: client.polls >= 1)
    del client
    gc.collect()
    _wait(lambda: not keeper._thread.is_alive())
    assert keeper.cluster is None
