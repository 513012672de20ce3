"""ECRec recovery is bit-exact: after failures at any point of the protocol, every row, its optimizer
state and every dense tensor equal those of a failure-free run with the same data, and every parity
row equals a fresh encode of its stripe.

Real processes on 127.0.0.1; servers are killed with SIGKILL, either by the test or by the fault
injection armed in one server's environment (``ecrec.faults``).  The training loop sees no exception.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ecrec.client import Cluster, EmbeddingBag

pytestmark = pytest.mark.cluster

TABLES = [("user", 600, 8, "adagrad"), ("item", 300, 8, "sgd")]
STEPS, BATCH = 60, 24


class Model(torch.nn.Module):
    def __init__(self, cluster):
        super().__init__()
        torch.manual_seed(7)
        self.bags = {name: EmbeddingBag(cluster, name) for name, *_ in TABLES}
        self.top = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, sparse):
        return self.top(torch.cat([self.bags[n](ids) for n, ids in sparse.items()], dim=1)).squeeze(1)


def data():
    rng = np.random.default_rng(3)
    for _ in range(STEPS):
        sparse = {name: torch.from_numpy(rng.integers(0, rows, (BATCH, 2))) for name, rows, _, _ in TABLES}
        yield sparse, torch.from_numpy((rng.random(BATCH) < 0.4).astype(np.float32))


def train(address, on_step=None):
    """Trains STEPS steps; ``on_step(step)`` runs before each step (to kill servers)."""
    torch.set_num_threads(1)
    cluster = Cluster.connect(address)
    for name, rows, dim, opt in TABLES:
        cluster.create_table(name, rows, dim, optimizer=opt, lr=0.05, eps=1e-8, initial_accumulator_value=0.1, seed=11)
    model = Model(cluster)
    names = cluster.register_dense(model.top, optimizer="adagrad", lr=0.05, eps=1e-8, initial_accumulator_value=0.1)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step, (sparse, label) in enumerate(data()):
        if on_step:
            on_step(step)
        loss_fn(model(sparse), label).backward()
        cluster.step()
    return cluster, names


def wait_redundant(cluster, failures: int, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        m = cluster.refresh_map()
        redundant = sum(1 for e in m.events if e.kind == "redundant")
        if redundant >= failures and all(s.state != 4 for s in m.servers):  # 4 = RECOVERING
            return m
        assert time.monotonic() < deadline, f"not fully redundant after {timeout_s} s: {list(m.events)}"
        time.sleep(0.1)


def final_state(cluster, names):
    state = {}
    for name, *_ in TABLES:
        ids, payload = cluster.read_payload(name)
        state[name] = payload.view(np.uint32).copy()  # bits, not values
    for n in names:
        state["dense:" + n] = cluster.read_dense_payload(n).view(np.uint32).copy()
    verify = cluster.strategy_call("verify_parity")
    assert all(v["mismatched"] == 0 for v in verify.values()), verify
    assert sum(v["checked"] for v in verify.values()) > 0
    return state


_baselines: dict = {}


def baseline(make_cluster, servers, k, m):
    key = (servers, k, m)
    if key not in _baselines:
        local = make_cluster(servers=servers, strategy="ecrec", k=k, m=m)
        cluster, names = train(local.coordinator_address)
        _baselines[key] = final_state(cluster, names)
        local.close()
    return _baselines[key]


def assert_same(state, expected):
    assert state.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(state[name], expected[name], err_msg=f"{name} differs from the failure-free run")


def kill_index(local, index):
    local.kill(local.pid_of_index(index))


@pytest.mark.parametrize("point,index,count", [
    ("before_local_commit", 1, 15),
    ("after_partial_parity", 1, 15),
    ("after_parity_before_ack", 1, 15),
    ("before_parity_apply", 2, 40),
])
def test_injected_failure_is_recovered_bit_exactly(make_cluster, point, index, count):
    expected = baseline(make_cluster, 4, 2, 1)
    # after_partial_parity: the dying push reached one parity server; a long relay timeout keeps the owner's
    # direct sends from completing it at the others however slowly the machine runs
    options = {"relay_timeout_s": "5"} if point == "after_partial_parity" else {}
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

    def on_step(step):
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

    def on_step(step):
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

    def on_step(step):
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

    cluster, names = train(local.coordinator_address, lambda step: step == 25 and kill_index(local, primary))
    assert "0.weight" in names
    wait_redundant(cluster, 1)
    assert_same(final_state(cluster, names), expected)


def test_parity_rebuilt_then_a_second_failure_recovers(make_cluster):
    """The first replacement's parity rows must be right: the second failure (of another server)
    is rebuilt from them."""
    expected = baseline(make_cluster, 4, 2, 1)
    local = make_cluster(servers=4, standby=2, strategy="ecrec", k=2, m=1)
    holder = {}

    def on_step(step):
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

    def on_step(step):
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
