"""The standby reserve (``ecrec/server/reserve.py``): zeroed arrays prepared in the background, each handed out once,
dropped when no longer wanted or after the promotion.  Its use by a promoted standby is checked in
``test_recovery_fast.py`` (the reserve's size before, nothing left after, every row bit-exact)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ecrec.server import reserve as reserve_module
from ecrec.server.reserve import Reserve


def _prepared(reserve: Reserve, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while reserve.pending:
        assert time.monotonic() < deadline, "the reserve was not prepared"
        time.sleep(0.01)


def test_a_reserve_prepares_zeroed_arrays_and_hands_each_out_once():
    reserve = Reserve()
    reserve.prepare({"a": [((1000, 64), "uint8"), ((10,), "int64")], "b": [((5, 3), "float32")]})
    _prepared(reserve)
    assert reserve.nbytes == 1000 * 64 + 80 + 60
    taken = reserve.take("a", (1000, 64), np.uint8)
    assert taken.shape == (1000, 64) and taken.dtype == np.uint8 and not taken.any()
    assert reserve.nbytes == 80 + 60
    again = reserve.take("a", (1000, 64), np.uint8)  # none left of that shape: a new one
    assert again is not taken and again.shape == (1000, 64) and not again.any()
    other = reserve.take("b", (5, 4), np.float32)  # a shape not prepared: a new one, the prepared one stays
    assert other.shape == (5, 4) and reserve.nbytes == 80 + 60
    assert reserve.take("b", (5, 3), "float32").dtype == np.float32 and reserve.nbytes == 80


def test_a_reserve_drops_tables_no_longer_wanted_and_everything_when_closed():
    reserve = Reserve()
    reserve.prepare({"a": [((100,), "uint8")], "b": [((200,), "uint8")]})
    _prepared(reserve)
    reserve.prepare({"b": [((200,), "uint8")], "c": [((300,), "uint8")]})  # a dropped, c added
    _prepared(reserve)
    assert reserve.nbytes == 500
    reserve.close()
    assert reserve.nbytes == 0 and not reserve.pending
    reserve.prepare({"d": [((10,), "uint8")]})  # closed: nothing more
    assert reserve.nbytes == 0 and not reserve.pending
    assert reserve.take("b", (200,), np.uint8).shape == (200,)  # still answers, with new arrays


class _GatedNumpy:
    """numpy for ``ecrec.server.reserve``, whose filler thread waits at its second array until ``gate`` is set:
    what the filler makes before a stop is then one array, whatever the machine's speed (CI of ebe9ee6 met five
    made between a prepare and a stop when the bound depended on it)."""

    def __init__(self):
        self.gate, self.started = threading.Event(), 0
        self.before = set(threading.enumerate())  # a filler left by an earlier test is not gated

    def __getattr__(self, name):
        return getattr(np, name)

    def zeros(self, *args, **kwargs):
        thread = threading.current_thread()
        if thread.name == "ecrec-reserve" and thread not in self.before:
            self.started += 1
            if self.started > 1:
                assert self.gate.wait(30), "the test never let the filler go on"
        return np.zeros(*args, **kwargs)


def test_a_reserve_prepares_what_is_asked_while_it_is_filling_and_stops_when_told(monkeypatch):
    reserve = Reserve()
    for n in range(30):  # the second prepare often meets the filler finishing the first
        reserve.prepare({f"a{n}": [((1000,), "uint8")]})
        reserve.prepare({f"a{n}": [((1000,), "uint8")], f"b{n}": [((2000,), "uint8")]})
        _prepared(reserve)
        assert reserve.nbytes == 3000, n
    gated = _GatedNumpy()
    monkeypatch.setattr(reserve_module, "np", gated)
    try:
        reserve.prepare({"big": [((16 << 20,), "uint8")] * 16})  # 256 MB: tens of milliseconds to make
        taken = reserve.take("big", (16 << 20,), np.uint8)  # likely before the filler made one: a new one then
        assert taken.shape == (16 << 20,) and not taken.any()
        reserve.stop_preparing()  # a promotion starts
    finally:
        gated.gate.set()  # the filler finishes the array it was making: dropped, nothing after it
    _prepared(reserve)
    held = reserve.nbytes
    time.sleep(0.2)
    assert reserve.nbytes == held <= 4 * (16 << 20)  # nothing made after the stop (not the 16 asked for)
    assert reserve.take("big", (16 << 20,), np.uint8).shape == (16 << 20,)  # what is held is still handed out


@pytest.mark.cluster
def test_a_standby_is_warm_before_it_can_be_promoted_whatever_the_strategy(make_cluster):
    """A standby compiles the kernel that fills new tables before it registers (a promoted ``none``/``full``/
    ``cpr`` standby used to compile it inside the failure), and holds its tables' memory ready."""
    from ecrec.bench.processes import standby_status
    from ecrec.client import Cluster

    local = make_cluster(servers=2, standby=1, strategy="none")
    cluster = Cluster.connect(local.coordinator_address)
    cluster.create_table("t", 1000, 8, optimizer="adagrad", seed=1)
    deadline = time.monotonic() + 60
    while True:
        # settled: the standby has seen the map that names the table, not only "nothing pending" (a standby the
        # table's map broadcast has not reached yet has nothing pending either; CI of cdd89af met that once)
        status = standby_status(cluster)
        if len(status) == 1 and status[0]["settled"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(status) == 1 and status[0]["index"] == -1
    assert status[0].get("kernels_ready") is True  # compiled though it never filled a table
    assert status[0]["standby_reserve_bytes"] > 0 and not status[0]["standby_reserve_pending"]
