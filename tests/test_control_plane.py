"""The control plane on etcd (``--store etcd://...``): a real etcd (the ``etcd`` binary; ``.ci/run`` installs
Debian's ``etcd-server``), two coordinators of which one leads, real servers on 127.0.0.1.

Each test: the promotion completes once, no two maps share an epoch, no acknowledged push is lost (the counting
workload of ``test_safety``).
"""

from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest

from ecrec import state_store
from ecrec.config import ClusterSpec, CoordinatorConfig
from ecrec.coordinator import Coordinator
from ecrec.peers import coordinator_stub
from ecrec.wire import cluster_pb2, coordinator_pb2
from test_safety import ROWS, assert_counts, counting_push, start

HAVE_ETCD = shutil.which("etcd") is not None or __import__("os").path.exists("/usr/bin/etcd")
needs_etcd = pytest.mark.skipif(not HAVE_ETCD, reason="needs the etcd binary (apt-get install etcd-server)")


def test_store_urls_are_parsed_and_bad_ones_named():
    assert state_store.parse_store(None) == ("file", {})
    assert state_store.parse_store("/var/lib/ecrec/state") == ("file", {"path": "/var/lib/ecrec/state"})
    assert state_store.parse_store("file:///tmp/s") == ("file", {"path": "/tmp/s"})
    assert state_store.parse_store("etcd://10.0.0.1:2379,10.0.0.2:2379/jobs/a") == (
        "etcd", {"endpoints": ["10.0.0.1:2379", "10.0.0.2:2379"], "prefix": "/jobs/a"})
    assert state_store.parse_store("etcd://127.0.0.1:2379")[1]["prefix"] == "/ecrec"
    with pytest.raises(ValueError, match="unknown scheme"):
        state_store.parse_store("zk://h:1")
    with pytest.raises(ValueError, match="'h': expected HOST:PORT"):
        state_store.parse_store("etcd://h")
    spec = ClusterSpec(num_servers=2)
    with pytest.raises(ValueError, match="choose one"):
        Coordinator(CoordinatorConfig(cluster=spec, store="etcd://127.0.0.1:2379", state_path="/tmp/x"))
    with pytest.raises(ValueError, match="at least 2"):
        Coordinator(CoordinatorConfig(cluster=spec, store="etcd://127.0.0.1:2379", election_ttl_s=1))


class MapWatcher:
    """Reads the map from every coordinator in turn, all along: no two maps with one epoch may differ."""

    def __init__(self, local):
        self.stubs = [coordinator_stub(a) for a in local.coordinator_addresses]
        self.seen: dict[int, bytes] = {}
        self.conflicts: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.05):
            for stub in self.stubs:
                try:
                    m = stub.GetClusterMap(coordinator_pb2.GetClusterMapRequest(), timeout=2)
                except Exception:  # noqa: BLE001 - a dead or electing coordinator: the next one
                    continue
                key = cluster_pb2.ClusterMap(servers=m.servers, tables=m.tables, data_loss=m.data_loss).SerializeToString()
                if self.seen.setdefault(m.epoch, key) != key:
                    self.conflicts.append(m.epoch)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def holder(local, index):
    m = local.cluster_map()
    return next((s for s in m.servers if s.index == index and s.state != cluster_pb2.FAILED), None)


@needs_etcd
def test_leader_killed_mid_promotion_a_follower_finishes_it(make_cluster, tmp_path):
    release = tmp_path / "release"
    local, client, initial = start(
        make_cluster, servers=3, standby=1, store="etcd", coordinators=2,
        coordinator_env={"ECREC_COORDINATOR_FAULT": f"record_promotion@1:hold={release}"})
    watcher = MapWatcher(local)
    try:
        counts = np.zeros(ROWS)
        for _ in range(3):
            counting_push(client, np.arange(ROWS))
            counts += 1
        standby_id = next(s.server_id for s in local.cluster_map().servers if s.index < 0)
        leader_pid, _ = local.leading_coordinator()
        local.kill(local.pid_of_index(1))
        # the leader recorded the promotion (PROMOTING in etcd), the standby answered; the leader holds before
        # recording the answer: kill it there
        wait_for(lambda: (h := holder(local, 1)) is not None and h.state == cluster_pb2.PROMOTING, 30,
                 "the promotion recorded")
        time.sleep(0.5)  # the standby's answer is on its way to the held leader
        local.kill(leader_pid)
        killed = time.monotonic()
        release.write_text("go")  # the follower passes the same point
        h = wait_for(lambda: (h := holder(local, 1)) is not None and h.state in (cluster_pb2.ACTIVE,
                                                                                 cluster_pb2.RECOVERING) and h,
                     30, "a follower finished the promotion")
        took = time.monotonic() - killed
        assert h.server_id == standby_id  # the promotion begun, finished: once, with its standby
        new_pid, _ = local.leading_coordinator()
        assert new_pid != leader_pid
        counting_push(client, np.arange(ROWS))
        counts += 1
        trained = time.monotonic() - killed
        print(f"promotion finished {took:.2f} s after the leader's kill; training went on after {trained:.2f} s")
        m = local.cluster_map()
        assert sum(1 for s in m.servers if s.server_id == standby_id) == 1
        assert [s.index for s in m.servers if s.state != cluster_pb2.FAILED].count(1) == 1
        assert_counts(client, initial, counts)
    finally:
        watcher.stop()
    assert not watcher.conflicts, f"two maps with one epoch: {watcher.conflicts}"


@needs_etcd
def test_every_coordinator_restarted_keeps_the_map(make_cluster):
    local, client, initial = start(make_cluster, servers=3, standby=1, store="etcd", coordinators=2)
    counts = np.zeros(ROWS)
    counting_push(client, np.arange(ROWS))
    counts += 1
    before = local.cluster_map()
    for p in list(local.coordinator_procs):
        local.kill(p.pid)
    counting_push(client, np.arange(ROWS))  # the data plane does not need the coordinators (within a lease)
    counts += 1
    for address in list(local.coordinator_addresses):
        local.restart_coordinator_at(address)
    wait_for(lambda: local.leading_coordinator(), 30, "a leader")
    after = wait_for(lambda: (m := local.cluster_map()).ready and m.epoch > before.epoch and m, 30,
                     "a newer map recorded by the new leader")
    assert [t.name for t in after.tables] == [t.name for t in before.tables]
    assert {s.server_id for s in after.servers} == {s.server_id for s in before.servers}
    # the restarted leader still promotes
    standby_id = next(s.server_id for s in after.servers if s.index < 0)
    local.kill(local.pid_of_index(0))
    wait_for(lambda: (h := holder(local, 0)) is not None and h.server_id == standby_id
             and h.state in (cluster_pb2.ACTIVE, cluster_pb2.RECOVERING), 40, "index 0 promoted")
    counting_push(client, np.arange(ROWS))
    counts += 1
    assert_counts(client, initial, counts)


@needs_etcd
def test_one_of_three_etcd_members_killed_changes_nothing(make_cluster):
    local, client, initial = start(make_cluster, servers=3, standby=1, store="etcd", coordinators=2, etcd_members=3)
    counts = np.zeros(ROWS)
    leader = local.leading_coordinator()
    local.etcd.kill_member(0)
    for _ in range(5):
        counting_push(client, np.arange(ROWS))
        counts += 1
        time.sleep(0.3)
    assert local.leading_coordinator() == leader  # its lease kept alive through the two members left
    standby_id = next(s.server_id for s in local.cluster_map().servers if s.index < 0)
    local.kill(local.pid_of_index(2))
    wait_for(lambda: (h := holder(local, 2)) is not None and h.server_id == standby_id
             and h.state in (cluster_pb2.ACTIVE, cluster_pb2.RECOVERING), 40, "index 2 promoted")
    counting_push(client, np.arange(ROWS))
    counts += 1
    assert_counts(client, initial, counts)
