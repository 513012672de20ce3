"""Faults beyond crash-stop: a paused server that resumes after its replacement, more failures than the
code survives, a restarted worker reusing its name, and callers that send what no member of the cluster
would.  Real processes on 127.0.0.1.

The counting workload: SGD with lr=1 and a gradient of 1 on every looked-up element, so after ``n``
acknowledged pushes touching a row, the row is exactly its initial value minus ``n`` (small integers:
float32 is exact), whatever the order.
"""

from __future__ import annotations

import shutil
import time

import grpc
import numpy as np
import pytest

from ecrec.net import transport
from ecrec.client import Cluster, ClusterError
from ecrec.config import ClientConfig
from ecrec.wire import cluster_pb2, embedding_pb2, embedding_pb2_grpc, parity_pb2, parity_pb2_grpc
from helpers import DIM, FAST, ROWS, assert_counts, counting_push, start, wait_for

pytestmark = pytest.mark.cluster

@pytest.mark.parametrize("store", ["file", pytest.param("etcd", marks=pytest.mark.skipif(
    shutil.which("etcd") is None, reason="needs the etcd binary (apt-get install etcd-server)"))])
def test_paused_server_that_resumes_after_its_replacement_serves_and_acknowledges_nothing(make_cluster, store):
    """With ``store="etcd"`` the servers' leases are etcd leases: the paused server's is revoked or expires."""
    local, client, initial = start(make_cluster, servers=3, standby=1, store=store)
    counts = np.zeros(ROWS)
    rng = np.random.default_rng(0)

    def push_some():
        ids = rng.choice(ROWS, 8, replace=False)
        counting_push(client, ids)
        counts[ids] += 1

    for _ in range(5):
        push_some()
    victim = next(s for s in client.refresh_map().servers if s.index == 1)
    pid = local.pid_of_index(1)
    local.pause(pid)
    try:
        for _ in range(5):  # training goes on: the client times out, reports, follows the map to the replacement
            push_some()
        m = wait_for(lambda: (lambda m: m if any(s.index == 1 and s.server_id != victim.server_id
                                                  and s.state in (cluster_pb2.ACTIVE, cluster_pb2.RECOVERING)
                                                  for s in m.servers) else None)(client.refresh_map()),
                     30, "a replacement of the paused server")
    finally:
        local.resume(pid)
    # the old process is awake now, with its old map and rows; it must not act on any of them
    old = embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(victim.address))
    old_parity = parity_pb2_grpc.ParityServiceStub(transport.make_channel(victim.address))
    ids = np.arange(ROWS, dtype=np.int64)
    refused = []
    for call in [
        lambda: old.Pull(embedding_pb2.PullRequest(tables=[embedding_pb2.TableIds(
            table="t", ids=transport.ids_to_bytes(ids))], epoch=m.epoch), timeout=5),
        lambda: old.Pull(embedding_pb2.PullRequest(tables=[embedding_pb2.TableIds(
            table="t", ids=transport.ids_to_bytes(ids))]), timeout=5),
        lambda: old.Push(embedding_pb2.PushRequest(
            tables=[embedding_pb2.TableGrads(table="t", ids=transport.ids_to_bytes(ids[:2]),
                                             grads=np.ones((2, DIM), np.float32).tobytes())],
            push_id=embedding_pb2.PushId(worker="late", sequence=1, incarnation="x")), timeout=5),
        lambda: old_parity.ReadRows(parity_pb2.ReadRowsRequest(table="t", ids=transport.ids_to_bytes(ids[:2])),
                                    timeout=5),
    ]:
        try:
            call()
            refused.append(None)
        except grpc.RpcError as exc:
            refused.append(exc.code())
    # UNAVAILABLE: it stopped serving (its lease was refused) or is gone; CANCELLED: it is shutting down; never
    # an answer
    assert all(code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED)
               for code in refused), refused
    proc = next(p for p in local.server_procs if p.pid == pid)
    wait_for(lambda: proc.poll() is not None, 20, "the replaced process to exit")
    # declared failed, it exits 1 (it exited 0: a supervisor restarting failed processes left it down)
    assert proc.returncode == 1, (proc.returncode, local.stderr_tail(pid))
    for _ in range(5):
        push_some()
    assert_counts(client, initial, counts)


def test_more_failures_than_m_end_in_data_loss_within_seconds(make_cluster):
    local, client, initial = start(make_cluster, servers=3, standby=2)
    counting_push(client, np.arange(10))
    pids = [local.pid_of_index(1), local.pid_of_index(2)]
    started = time.monotonic()
    for pid in pids:  # every stripe spans all three servers: two lost members of a k=2 m=1 stripe
        local.kill(pid)
    m = wait_for(lambda: (lambda m: m if len(m.data_loss) else None)(client.refresh_map()), 30, "data loss in the map")
    took = time.monotonic() - started
    assert [d.table for d in m.data_loss] == ["t"]
    assert m.data_loss[0].stripe_count > 0 and len(m.data_loss[0].stripes) > 0
    assert set(m.data_loss[0].indices) & {1, 2}
    assert any(e.kind == "data_loss" for e in m.events)
    # both replacements report (some stripes more than once): the map keeps one entry for the table, the union of
    # what they found; with three servers every stripe has a member on both killed servers, so all are lost
    stripes = client.layout.num_stripes(ROWS)
    m = wait_for(lambda: (lambda m: m if m.data_loss[0].stripe_count == stripes else None)(client.refresh_map()),
                 30, f"all {stripes} stripes counted as lost")
    assert [d.table for d in m.data_loss] == ["t"]
    assert list(m.data_loss[0].stripes) == list(range(min(stripes, 64)))
    assert {1, 2} <= set(m.data_loss[0].indices)
    # a read of a lost row fails at once with DATA_LOSS naming the table, not after the retry deadline
    lost_rows = np.flatnonzero(client.layout.locate(np.arange(ROWS))[0] != 0)[:4]
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"DATA_LOSS.*'?t'?") as lost:
        client.pull("t", lost_rows)
    assert time.monotonic() - t0 < FAST["retry_deadline_s"] / 2
    # and says what to do (it was a plain ClusterError that named no way back)
    from ecrec.client.cluster import ClusterDataLoss

    assert isinstance(lost.value, ClusterDataLoss) and "restore the last snapshot" in str(lost.value)
    print(f"data loss in the map {took:.2f} s after the kills")
    # `status --wait` polled its whole wait (a bar stuck at 0 %) for a redundancy no rebuild can bring back
    import subprocess
    import sys

    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ecrec.cli", "status", "--coordinator", local.coordinator_address,
                        "--wait", "120"], capture_output=True, text=True, timeout=150)
    assert r.returncode == 1 and "DATA LOSS" in r.stdout and "no rebuild brings it back" in r.stderr, r
    assert time.monotonic() - t0 < 60


def test_a_restarted_worker_with_the_same_name_is_applied(make_cluster):
    local, client, initial = start(make_cluster, servers=3)
    counts = np.zeros(ROWS)
    for step in range(4):
        ids = np.arange(step, step + 10)
        counting_push(client, ids)
        counts[ids] += 1
    client.close()
    again = Cluster.connect(local.coordinator_address, config=ClientConfig(**FAST), worker="counter")  # sequence 1 again
    for step in range(4):
        ids = np.arange(step, step + 10)
        counting_push(again, ids)
        counts[ids] += 1
    assert_counts(again, initial, counts)


def test_maps_and_parity_from_strangers_are_refused_and_change_nothing(make_cluster):
    local, client, initial = start(make_cluster, servers=3)
    counting_push(client, np.arange(20))
    before = client.read_payload("t")[1].copy()
    server = client.refresh_map().servers[0]
    stub = embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(server.address))
    parity = parity_pb2_grpc.ParityServiceStub(transport.make_channel(server.address))
    for change, expected in [("k", "changes k"), ("num_servers", "changes num_servers"),
                             ("strategy", "changes strategy"), ("servers", "two live holders")]:
        bad = cluster_pb2.ClusterMap()
        bad.CopyFrom(client.map)
        bad.epoch = 10 ** 6
        if change == "k":
            bad.k = 1
        elif change == "num_servers":
            bad.num_servers = 4
        elif change == "strategy":
            bad.strategy = "none"
        else:
            bad.servers.add(index=0, address="127.0.0.1:1", server_id="evil", state=cluster_pb2.ACTIVE)
        with pytest.raises(grpc.RpcError) as info:
            stub.UpdateClusterMap(bad, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and expected in info.value.details()
    batch = parity_pb2.ParityBatches(source=1, source_id="a-stranger", batches=[parity_pb2.ParityBatch(
        source=1, source_id="a-stranger", seq=1, first_seq=1)])
    with pytest.raises(grpc.RpcError) as info:
        parity.ApplyParity(batch, timeout=5, metadata=(("ecrec-caller", "a-stranger"), ("ecrec-epoch", "1")))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
    assert client.refresh_map().epoch < 10 ** 6
    np.testing.assert_array_equal(client.read_payload("t")[1].view(np.uint32), before.view(np.uint32))
    verify = client.strategy_call("verify_parity")
    assert all(v["mismatched"] == 0 for v in verify.values()), verify
    # the servers still take real pushes after all that
    counting_push(client, np.arange(5))
    counts = np.zeros(ROWS)
    counts[:20] += 1
    counts[:5] += 1
    assert_counts(client, initial, counts)


def test_a_process_registering_at_a_silent_holders_address_replaces_it_only_after_its_lease():
    """A paused server still holds its sockets (a new process may share its port): a registration at its address
    marks it failed, but a promotion over it waits its lease; one whose health port refuses connections is gone
    (a killed process) and is replaced at once.  An in-process coordinator behind real gRPC; the "servers" are
    sockets that listen and never answer (as a paused process's do) or are closed (a killed one's)."""
    import socket

    from ecrec.config import ClusterSpec, CoordinatorConfig
    from ecrec.control.coordinator import Coordinator, CoordinatorServer
    from ecrec.net.peers import coordinator_stub
    from ecrec.wire import coordinator_pb2

    def silent():
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        return s, f"127.0.0.1:{s.getsockname()[1]}"

    coordinator = Coordinator(CoordinatorConfig(cluster=ClusterSpec(num_servers=2), host="127.0.0.1", port=0,
                                                lease_s=6.0, health_timeout_s=0.3, failure_timeout_s=120.0,
                                                failures_before_dead=1000))
    server = CoordinatorServer(coordinator)
    sockets, stub = [], None
    try:
        stub = coordinator_stub(server.address)
        for name, paused in (("paused", True), ("killed", False)):
            data, address = silent()
            health, health_address = silent()
            sockets += [data, health]
            stub.Register(coordinator_pb2.RegisterRequest(address=address, server_id=f"{name}-old",
                                                          health_address=health_address), timeout=10)
            if not paused:
                health.close()  # nothing listens there any more
            _, other_health = silent()
            sockets.append(_)
            stub.Register(coordinator_pb2.RegisterRequest(address=address, server_id=f"{name}-new", standby=True,
                                                          health_address=other_health), timeout=10)
            old = next(s for s in coordinator.map.servers if s.server_id == f"{name}-old")
            assert old.state == cluster_pb2.FAILED
            # the paused one may still serve until its lease (6 s from its registration) runs out
            assert coordinator.promoter.safe_to_replace([old], None) is (not paused), name
    finally:
        if stub is not None:
            stub.close()
        server.stop(0)
        for s in sockets:
            s.close()
