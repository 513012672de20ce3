"""ECRec recovery is bit-exact: after failures at any point of the protocol, every row, its optimizer
state and every dense tensor equal those of a failure-free run with the same data, and every parity
row equals a fresh encode of its stripe.

Real processes on 127.0.0.1; servers are killed with SIGKILL, either by the test or by the fault
injection armed in one server's environment (``ecrec.faults``).  The training loop sees no exception.
"""

from __future__ import annotations

import time

import pytest

from ecrec.client import Cluster
from helpers import TABLES, assert_same, baseline, final_state, kill_index, train, wait_redundant

pytestmark = pytest.mark.cluster

@pytest.mark.parametrize("point,index,count", [
    ("before_local_commit", 1, 15),
    ("after_partial_parity", 1, 15),
    ("after_parity_before_ack", 1, 15),
    ("before_parity_apply", 2, 40),
])
def test_injected_failure_is_recovered_bit_exactly(make_cluster, point, index, count):
    expected = baseline(make_cluster, 4, 2, 1)
    # after_partial_parity: the dying push reached one parity server; a long relay timeout keeps the owner's
    # direct sends from completing it at the others however slowly the machine runs.  before_parity_apply: groups
    # of 8 pushes, so that the parity server meets its 40th push in batches during training however fast the steps
    # run (groups closed only by age, 0.5 s, came after the last step when 60 steps took less)
    options = ({"relay_timeout_s": "5"} if point == "after_partial_parity"
               else {"coalesce_pushes": "8"} if point == "before_parity_apply" else {})
    local = make_cluster(servers=4, standby=1, strategy="ecrec", k=2, m=1, options=options,
                         server_env={index: {"ECREC_FAULT": f"{point}@{count}"}})
    victim = local.pid_of_index(index)
    cluster, names = train(local.coordinator_address)
    assert next(p for p in local.server_procs if p.pid == victim).poll() is not None, "the fault did not fire"
    wait_redundant(cluster, 1)
    assert_same(final_state(cluster, names), expected)
    stats = cluster.strategy_call("stats", indices=[index])[index]
    assert stats["rows_rebuilt"] > 0
    # bit-exact either way; what resolution decided tells "kept" from "undone"
    if point == "after_parity_before_ack":  # every parity server applied every push before its ack: all kept
        assert stats["resolved_undone"] == 0 and stats["resolved_kept"] >= 1, stats
    if point == "after_partial_parity":  # the dying push is held by one parity server only: undone there
        assert stats["resolved_undone"] >= 1, stats


def test_replacement_killed_during_rebuild(make_cluster):
    expected = baseline(make_cluster, 4, 2, 1)
    local = make_cluster(servers=4, standby=1, strategy="ecrec", k=2, m=1,
                         options={"rebuild_batch_rows": "32", "rebuild_pause_s": "0.02"},
                         server_env={"standby0": {"ECREC_FAULT": "during_rebuild@3"}})

    def on_step(step, cluster):
        if step == 20:
            kill_index(local, 1)
            deadline = time.monotonic() + 30
            while not any(e.kind == "promoted" for e in local.cluster_map().events):
                assert time.monotonic() < deadline, "the armed standby was never promoted"
                time.sleep(0.05)
            local.start_server(standby=True)  # a clean spare for when the armed replacement dies

    cluster, names = train(local.coordinator_address, on_step)
    m = wait_redundant(cluster, 1)
    promoted = [e for e in m.events if e.kind == "promoted"]
    dead = sum(1 for p in local.server_procs if p.poll() is not None)
    assert dead == 2 and len(promoted) == 2, (dead, list(m.events))
    assert_same(final_state(cluster, names), expected)


def test_two_servers_killed_at_once_with_m2(make_cluster):
    expected = baseline(make_cluster, 5, 2, 2)
    local = make_cluster(servers=5, standby=2, strategy="ecrec", k=2, m=2)

    def on_step(step, cluster):
        if step == 20:
            pids = [local.pid_of_index(1), local.pid_of_index(3)]
            for pid in pids:
                local.kill(pid)

    cluster, names = train(local.coordinator_address, on_step)
    wait_redundant(cluster, 2)
    assert_same(final_state(cluster, names), expected)


def test_second_failure_during_rebuild_with_m2(make_cluster, tmp_path):
    """Server 3 dies while the replacement of server 1 rebuilds: every standby is armed to hold its background
    rebuild after its first batch until the test creates a file, so the second failure meets the rebuild in
    progress however fast the machine is."""
    expected = baseline(make_cluster, 5, 2, 2)
    release = tmp_path / "release-rebuild"
    local = make_cluster(servers=5, standby=2, strategy="ecrec", k=2, m=2,
                         options={"rebuild_batch_rows": "16"},
                         server_env={"standby": {"ECREC_FAULT": f"during_rebuild@1:hold={release}"}})
    seen = {}

    def on_step(step, cluster):
        if step == 15:
            kill_index(local, 1)
            deadline = time.monotonic() + 120  # a liveness bound (the promotion), not a measurement
            while not any(s.index == 1 and s.state == 4 for s in local.cluster_map().servers):  # 4 = RECOVERING
                assert time.monotonic() < deadline, "index 1 was never taken by a rebuilding replacement"
                time.sleep(0.02)
        if step == 17:
            m = local.cluster_map()
            seen["recovering"] = [s.index for s in m.servers if s.state == 4]
            seen["redundant_before"] = [e.index for e in m.events if e.kind == "redundant"]
            kill_index(local, 3)
            release.touch()

    cluster, names = train(local.coordinator_address, on_step)
    m = wait_redundant(cluster, 2)
    assert seen["recovering"] == [1] and seen["redundant_before"] == [], seen
    assert sorted(e.index for e in m.events if e.kind == "redundant") == [1, 3]
    assert_same(final_state(cluster, names), expected)


def test_dense_primary_killed(make_cluster):
    expected = baseline(make_cluster, 4, 2, 1)
    local = make_cluster(servers=4, standby=1, strategy="ecrec", k=2, m=1)
    probe = Cluster.connect(local.coordinator_address)
    primary = probe.layout.dense_servers("0.weight")[0]

    cluster, names = train(local.coordinator_address, lambda step, cluster: step == 25 and kill_index(local, primary))
    assert "0.weight" in names
    wait_redundant(cluster, 1)
    assert_same(final_state(cluster, names), expected)


def test_parity_rebuilt_then_a_second_failure_recovers(make_cluster):
    """The first replacement's parity rows must be right: the second failure (of another server)
    is rebuilt from them."""
    expected = baseline(make_cluster, 4, 2, 1)
    local = make_cluster(servers=4, standby=2, strategy="ecrec", k=2, m=1)
    holder = {}

    def on_step(step, cluster):
        if step == 10:
            kill_index(local, 0)
        if step == 35:
            holder["map"] = wait_redundant(Cluster.connect(local.coordinator_address), 1)
            kill_index(local, 2)

    cluster, names = train(local.coordinator_address, on_step)
    wait_redundant(cluster, 2)
    assert_same(final_state(cluster, names), expected)


def test_coordinator_restart_keeps_the_map(make_cluster, tmp_path):
    expected = baseline(make_cluster, 4, 2, 1)
    local = make_cluster(servers=4, standby=1, strategy="ecrec", k=2, m=1, state_path=str(tmp_path / "map.pb"))
    epochs = {}

    def on_step(step, cluster):
        if step == 10:
            epochs["before"] = local.cluster_map().epoch
            local.kill(local.coordinator_proc.pid)
            local.restart_coordinator()
            m = local.cluster_map()
            epochs["after"] = m.epoch
            assert [t.name for t in m.tables] == [name for name, *_ in TABLES]
        if step == 30:
            kill_index(local, 2)

    cluster, names = train(local.coordinator_address, on_step)
    assert epochs["after"] > epochs["before"]
    wait_redundant(cluster, 1)
    assert_same(final_state(cluster, names), expected)


def test_servers_outlive_a_coordinator_restarted_without_their_state_and_go_on_with_the_right_one(make_cluster,
                                                                                                  tmp_path):
    """A coordinator restarted without its --state-path (a wrong path, a cleaned /tmp) knows none of the servers:
    each was told "not in the cluster map", took itself for replaced, and exited, every row of the cluster gone.
    Now a refusal from a coordinator whose map is older than the server's is not a verdict: the servers keep
    their rows and wait, and once the coordinator is restarted with the state they serve again, as they were."""
    import os
    import shutil

    import numpy as np

    state = tmp_path / "map.pb"
    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, state_path=str(state))
    client = Cluster.connect(local.coordinator_address)
    client.create_table("t", 300, 4, optimizer="sgd", lr=1.0, seed=5)
    client.write_rows("t", np.arange(300), np.full((300, 4), 2.5, np.float32), checked=True)
    client.wait_confirmed()
    before = client.read_payload("t")[1].copy()
    servers = [p.pid for p in local.server_procs]
    local.kill(local.coordinator_proc.pid)
    shutil.move(str(state), str(tmp_path / "kept.pb"))  # the path is "wrong" now: nothing there
    local.restart_coordinator()
    time.sleep(6.0)  # two leases: each server was refused several times
    assert all(os.path.exists(f"/proc/{pid}") for pid in servers), "a server exited"
    assert any("older than this server's" in line for pid in servers for line in local.stderr_tail(pid))
    local.kill(local.coordinator_proc.pid)
    shutil.move(str(tmp_path / "kept.pb"), str(state))
    local.restart_coordinator()
    ready = Cluster.connect(local.coordinator_address, wait_ready_s=60)
    deadline = time.monotonic() + 60
    while True:
        try:
            after = ready.read_payload("t")[1]
            break
        except Exception:  # noqa: BLE001 - the servers' leases come back within a renewal or two
            assert time.monotonic() < deadline, "the servers did not serve again"
            time.sleep(0.2)
    np.testing.assert_array_equal(after.view(np.uint32), before.view(np.uint32))


def test_a_table_created_while_the_coordinator_restarts_waits_for_it(make_cluster, tmp_path):
    """create_table and register_dense failed at once while no coordinator could take them (the leader dying, the
    next being elected; the one coordinator restarting), where every server call retries through its failover.
    Now they retry for the client's retry deadline."""
    import threading

    import torch

    local = make_cluster(servers=2, strategy="none", state_path=str(tmp_path / "map.pb"))
    client = Cluster.connect(local.coordinator_address)
    client.create_table("first", 10, 4)
    local.kill(local.coordinator_proc.pid)
    outcome = {}

    def create():
        try:
            client.create_table("second", 10, 4)
            client.register_dense(torch.nn.Linear(2, 2))
            outcome["ok"] = True
        except Exception as exc:  # noqa: BLE001 - the test reports it
            outcome["error"] = exc

    worker = threading.Thread(target=create, daemon=True)
    worker.start()
    time.sleep(1.5)  # the calls meet no coordinator meanwhile
    assert not outcome, outcome
    local.restart_coordinator()
    worker.join(60)
    assert outcome == {"ok": True}, outcome
    assert [t.name for t in client.refresh_map().tables] == ["first", "second"]
