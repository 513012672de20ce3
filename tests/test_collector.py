"""Full garbage collections counted and kept short (``ecrec.server.collector``): a server freezes the objects of its
start-up, so that a full collection walks only what serving made since."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from ecrec.client import Cluster
import ecrec.server.collector as collector


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the rest of this process's tests as they were


class _Node:
    pass


def _tracked() -> int:
    """Objects the collector tracks outside the permanent generation (what a full collection walks)."""
    return sum(len(gc.get_objects(generation)) for generation in range(3))


def test_a_watch_counts_full_collections_and_their_pauses_only():
    watch = collector.Watch()
    try:
        gc.collect(0)
        gc.collect(1)
        assert watch.full_collections == 0 and watch.pause_s == 0.0
        gc.collect()
        gc.collect()
        assert watch.full_collections == 2
        assert watch.pause_s > 0 and 0 < watch.longest_s <= watch.pause_s
        status = watch.status()
        assert status["gc_full_collections"] == status["gc_full_collections_total"] == 2
        assert status["gc_longest_pause_ms"] == pytest.approx(1e3 * watch.longest_s)
        watch.mark()  # (a server's start-up over): the status counts from here, the totals go on
        status = watch.status()
        assert (status["gc_full_collections"], status["gc_pause_s"], status["gc_longest_pause_ms"]) == (0, 0.0, 0.0)
        gc.collect()
        status = watch.status()
        assert status["gc_full_collections"] == 1 and status["gc_full_collections_total"] == 3
        assert 0 < status["gc_pause_s"] < status["gc_pause_total_s"]
    finally:
        watch.close()
    gc.collect()
    assert watch.full_collections == 3  # closed: no longer counting


def test_a_watch_made_during_a_collection_ignores_its_stop():
    watch = collector.Watch()
    try:
        watch._on_gc("stop", {"generation": 2, "collected": 0})  # the stop of a collection it never saw start
        assert watch.full_collections == 0 and watch.pause_s == 0.0
    finally:
        watch.close()


def test_freeze_collects_the_garbage_first_then_keeps_every_live_object_out_of_collections(unfrozen):
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: garbage only a collection finds
    dead = weakref.ref(a)
    del a, b
    kept = [_Node() for _ in range(20_000)]  # live, tracked
    before = _tracked()
    frozen, took = collector.freeze()
    assert dead() is None  # collected, not frozen
    # (a frozen object that dies later still leaves: the count can only fall from what the freeze reported)
    assert frozen >= gc.get_freeze_count() >= len(kept)
    assert _tracked() <= before - len(kept)  # a full collection no longer walks them
    status = collector.watch().status()
    assert status["gc_frozen_objects"] == frozen and took > 0
    assert status["gc_freeze_collect_ms"] == pytest.approx(1e3 * took)
    new = [_Node() for _ in range(1000)]
    assert _tracked() >= len(new)  # what is made after the freeze is collected as ever
    assert len(kept) == 20_000


def _gc_status(local) -> list[dict]:
    cluster = Cluster.connect(local.coordinator_address, local.client_config(), worker="gc-test")
    try:
        stats = cluster.strategy_call("stats")
        return [stats[i]["server"] for i in sorted(stats)]
    finally:
        cluster.close()


@pytest.mark.cluster
def test_servers_freeze_their_start_up_unless_told_not_to(make_cluster):
    frozen = _gc_status(make_cluster(servers=3, strategy="ecrec", k=2, m=1))
    for status in frozen:
        # the imports, kernels and strategy of a server: tens of thousands of objects no collection walks again
        assert status["gc_frozen_objects"] > 20_000 and status["gc_freeze_collect_ms"] > 0, status
        assert status["gc_full_collections"] >= 0 and status["gc_pause_s"] >= 0  # counted from the start-up's end
    kept = _gc_status(make_cluster(servers=3, strategy="ecrec", k=2, m=1, server_options={"no_gc_freeze": True}))
    for status in kept:
        assert status["gc_frozen_objects"] == 0, status


def test_a_server_setting_of_the_profile_is_checked_against_the_servers_settings():
    from ecrec.bench.profile_runs import server_options

    options = server_options(["no_gc_freeze=true", "rpc_timeout_s=3"])
    assert options == {"no_gc_freeze": True, "rpc_timeout_s": 3.0} and type(options["rpc_timeout_s"]) is float
    assert server_options(["no_gc_freeze=1"]) == {"no_gc_freeze": True}
    assert np.isclose(server_options(["map_refresh_interval_s=0.5"])["map_refresh_interval_s"], 0.5)
    assert server_options(["no_gc_freeze=false", "rpc_timeout_s=10"]) == {}  # the defaults: nothing to set
    with pytest.raises(ValueError, match="no such server setting"):
        server_options(["gc=off"])
    for managed in ("port=7000", "standby=true", "want_index=0", "metrics_port=9100", "host=0.0.0.0"):
        with pytest.raises(ValueError, match="sets it for each server itself"):
            server_options([managed])
    with pytest.raises(ValueError, match="expected an integer"):
        server_options(["max_workers=many"])
    with pytest.raises(ValueError, match="rpc_timeout_s"):
        server_options(["rpc_timeout_s=-1"])  # as the server would refuse it
