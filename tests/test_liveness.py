"""Liveness: no single slow process stalls training for longer than the failure timeout plus the lease, and
an index never stays RECOVERING once its rows are rebuilt.

Real processes on 127.0.0.1: a paused standby (SIGSTOP) chosen for a promotion, a coordinator slowed between a
standby's answer and its record (``ECREC_COORDINATOR_FAULT``), a rebuild that meets a transient error
(``ECREC_FAULT=during_rebuild@1:error``), a coordinator paused beyond the servers' leases.
"""

from __future__ import annotations

import os
import threading
import time
import types

import grpc
import numpy as np
import pytest
import torch

from ecrec.wire import cluster_pb2, embedding_pb2, embedding_pb2_grpc
from helpers import assert_same, baseline, final_state, kill_index, train, wait_redundant

pytestmark = pytest.mark.cluster


def _pid(server: cluster_pb2.ServerInfo) -> int:
    return int(server.server_id.split(":")[1])  # server ids are host:pid:nonce


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped yet) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_paused_standby_is_skipped_for_a_healthy_one(make_cluster):
    """The standby the coordinator would promote first is paused; a server is killed.  Training goes on within
    20 s with the other standby promoted, bit-exactly; the paused one, resumed, is fenced and stops."""
    expected = baseline(make_cluster, 4, 2, 1)
    local = make_cluster(servers=4, standby=2, strategy="ecrec", k=2, m=1)
    seen: dict = {}

    def on_step(step, cluster):
        now = time.monotonic()
        if step == 15:
            standbys = [s for s in local.cluster_map().servers if s.state == cluster_pb2.STANDBY]
            assert len(standbys) == 2
            seen["paused"], seen["healthy"] = standbys[0], standbys[1]
            local.pause(_pid(standbys[0]))
            kill_index(local, 1)
            seen["killed_at"] = now
        elif step == 16:
            seen["first_step_after"] = now - seen["killed_at"]

    try:
        cluster, names = train(local.coordinator_address, on_step)
        m = wait_redundant(cluster, 1)
        holder = next(s for s in m.servers if s.index == 1 and s.state == cluster_pb2.ACTIVE)
        assert holder.server_id == seen["healthy"].server_id, (holder, seen)
        print(f"paused standby: first step {seen['first_step_after']:.2f} s after the kill; index 1 promoted to "
              f"the healthy standby")
        assert seen["first_step_after"] < 20.0, f"training stalled {seen['first_step_after']:.1f} s after the kill"
        assert_same(final_state(cluster, names), expected)
    finally:
        local.resume(_pid(seen["paused"])) if "paused" in seen else None
    # the paused standby, back, learns it was declared failed (its lease renewal is refused) and stops
    paused = _pid(seen["paused"])
    deadline = time.monotonic() + 30
    while _alive(paused) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(paused), "the paused standby kept running after it was resumed"
    assert not any(s.server_id == seen["paused"].server_id and s.state != cluster_pb2.FAILED
                   for s in local.cluster_map().servers)


def test_a_report_of_redundancy_before_the_promotion_is_recorded(make_cluster):
    """The coordinator records a promotion 1.5 s after the standby answered it; the small table's rebuild has
    long finished and reported by then.  The index still reaches ACTIVE within 5 s of its rebuild."""
    local = make_cluster(servers=4, standby=1, strategy="ecrec", k=2, m=1,
                         coordinator_env={"ECREC_COORDINATOR_FAULT": "record_promotion@1:delay=1.5"})

    def on_step(step, cluster):
        if step == 10:
            kill_index(local, 2)

    cluster, names = train(local.coordinator_address, on_step)
    m = wait_redundant(cluster, 1, timeout_s=60)
    stats = cluster.strategy_call("stats", indices=[2])[2]
    promoted = next(e for e in m.events if e.kind == "promoted" and e.index == 2)
    redundant = next(e for e in m.events if e.kind == "redundant" and e.index == 2)
    rebuilt_at = stats["promoted_wall_time"] + stats["rebuild_s"]
    print(f"record delayed 1.5 s: ACTIVE {redundant.wall_time - rebuilt_at:.2f} s after the rebuild ended "
          f"({redundant.wall_time - promoted.wall_time:.2f} s after the promotion was recorded)")
    assert redundant.wall_time - rebuilt_at < 5.0, (redundant.wall_time - rebuilt_at, stats)
    assert redundant.wall_time >= promoted.wall_time
    assert all(v["mismatched"] == 0 for v in cluster.strategy_call("verify_parity").values())


def test_a_rebuild_survives_a_transient_error(make_cluster):
    """The replacement's background rebuild meets an error (a peer's or the coordinator's, as during their
    restart): it retries and finishes, bit-exactly, instead of leaving the index RECOVERING for good."""
    expected = baseline(make_cluster, 4, 2, 1)
    local = make_cluster(servers=4, standby=1, strategy="ecrec", k=2, m=1,
                         server_env={"standby0": {"ECREC_FAULT": "during_rebuild@1:error"}})

    def on_step(step, cluster):
        if step == 10:
            kill_index(local, 3)

    cluster, names = train(local.coordinator_address, on_step)
    wait_redundant(cluster, 1, timeout_s=60)
    stats = cluster.strategy_call("stats", indices=[3])[3]
    assert stats["rebuild_retries"] >= 1, stats
    assert_same(final_state(cluster, names), expected)


def test_a_server_refuses_on_its_own_lease(make_cluster):
    """The coordinator is paused beyond the lease: each server stops serving on its own clock (Pull and Push
    answer UNAVAILABLE naming the lease), and serves again once its renewal is granted."""
    local = make_cluster(servers=3, strategy="none", coordinator_options={"lease_s": 2.0})
    from ecrec.client import Cluster

    cluster = Cluster.connect(local.coordinator_address)
    cluster.create_table("t", 64, 4, optimizer="sgd", lr=0.1, seed=1)
    server = next(s for s in cluster.refresh_map().servers if s.index == 0)
    stub = embedding_pb2_grpc.EmbeddingServerStub(grpc.insecure_channel(server.address))
    ids = np.arange(64, dtype=np.int64)
    owned = [int(i) for i in ids[cluster.layout.locate(ids)[0] == 0]]  # the rows index 0 holds
    pull = embedding_pb2.PullRequest(tables=[embedding_pb2.TableIds(table="t", ids=np.array(owned, np.int64).tobytes())])
    stub.Pull(pull, timeout=10)  # serves while its lease lasts
    coordinator = local.coordinator_proc.pid
    local.pause(coordinator)
    try:
        time.sleep(2.0 + 1.5)
        for call in (lambda: stub.Pull(pull, timeout=10),
                     lambda: stub.Push(embedding_pb2.PushRequest(
                         push_id=embedding_pb2.PushId(worker="w", sequence=1),
                         tables=[embedding_pb2.TableGrads(table="t", ids=np.array(owned[:1], np.int64).tobytes(),
                                                          grads=np.zeros(4, np.float32).tobytes())]), timeout=10)):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "lease" in info.value.details(), info.value.details()
    finally:
        local.resume(coordinator)
    deadline = time.monotonic() + 20
    while True:  # renewed: serving again
        try:
            stub.Pull(pull, timeout=10)
            break
        except grpc.RpcError as exc:
            assert time.monotonic() < deadline, exc.details()
            time.sleep(0.2)


def test_a_caller_with_a_newer_map_naming_another_holder_is_refused():
    """Fencing by epoch, apart from the lease: a server whose lease still runs, asked by a caller that has seen a
    newer map, fetches that map; when it names another server at this index, the call is refused (UNAVAILABLE,
    naming the new epoch), and a caller with the same epoch as before is served."""
    from ecrec import errors
    from ecrec.control.lease import ServingLease as Lease
    from ecrec.server.state import ServerState

    def cluster_map(epoch: int, holder: str) -> cluster_pb2.ClusterMap:
        m = cluster_pb2.ClusterMap(epoch=epoch, num_servers=3, strategy="none", k=1, m=0, ready=True)
        m.servers.add(index=0, address="127.0.0.1:1", server_id="me", state=cluster_pb2.ACTIVE)
        m.servers.add(index=1, address="127.0.0.1:2", server_id=holder, state=cluster_pb2.ACTIVE)
        if holder != "me":
            m.servers[0].index, m.servers[0].state = 2, cluster_pb2.ACTIVE
        return m

    class Coordinator:  # what the server's own coordinator client does with a fetched map: adopt it
        newest = cluster_map(7, "other")

        def __init__(self, state):
            self.state, self.fetched = state, 0

        def get_map(self):
            self.fetched += 1
            self.state.map = self.newest

    state = ServerState.__new__(ServerState)  # the fencing logic alone: no sockets, no strategy
    state.lease, state._promoting, state._server_id, state.index = Lease(), False, "me", 1
    state.config = types.SimpleNamespace(map_refresh_interval_s=0.0)
    state._refresh_lock, state._refreshed_at, state._fetched_at = threading.Lock(), 0.0, 0.0
    state.lease.grant(time.monotonic(), 60.0)
    state.map = cluster_map(5, "me")
    state.coordinator = Coordinator(state)
    state.require_serving(caller_epoch=5)  # the same map: served, nothing fetched
    assert state.coordinator.fetched == 0
    with pytest.raises(errors.Unavailable, match="no longer holds index 1"):
        state.require_serving(caller_epoch=7)
    assert state.coordinator.fetched == 1
    with pytest.raises(errors.Unavailable, match="lease"):  # and the lease alone refuses too
        state.lease.until = time.monotonic() - 1
        state.map = cluster_map(5, "me")
        state.require_serving(caller_epoch=5)


@pytest.mark.parametrize("resumed", [True, False], ids=["resumed", "never-resumed"])
def test_a_table_created_while_its_server_is_paused_and_replaced_is_on_every_index(make_cluster, resumed):
    """A server paused while a table and a dense tensor are created is declared failed and replaced; the standby's
    promotion carried the map of its moment, without them.  The coordinator published them once the paused server
    answered (late, for nobody): the replacement never had them -- reads NOT_FOUND, parity and replicas short, and
    ``status`` said fully redundant; never resumed, the create waited out its 600 s deadline.  Now the create
    finishes on the replacement, and every index holds exactly what a cluster without the pause holds."""
    import torch

    from ecrec.client import Cluster
    from helpers import serving_pid

    def create(cluster: Cluster) -> None:
        cluster.create_table("t", 3000, 8, optimizer="adagrad", lr=0.05, seed=1)
        torch.manual_seed(0)
        cluster.register_dense(torch.nn.Linear(4, 3), optimizer="adagrad", lr=0.1)

    reference = Cluster.connect(make_cluster(servers=3, strategy="ecrec", k=2, m=1).coordinator_address)
    create(reference)
    local = make_cluster(servers=3, standby=1, strategy="ecrec", k=2, m=1)
    client = Cluster.connect(local.coordinator_address)
    paused = local.pid_of_index(0)
    local.pause(paused)
    outcome: dict = {}

    def run() -> None:
        try:
            create(client)
            outcome["ok"] = True
        except Exception as exc:  # noqa: BLE001 - the test reports it
            outcome["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while serving_pid(local, 0) in (None, paused):
            assert time.monotonic() < deadline, "index 0 was not promoted to the standby"
            time.sleep(0.1)
        if resumed:
            time.sleep(1.0)
            local.resume(paused)
        worker.join(120)
        assert outcome == {"ok": True}, outcome
        m = wait_redundant(client, 1)
        assert [t.name for t in m.tables] == ["t"] and len(m.dense) == 2
        assert np.array_equal(client.read_payload("t")[1].view(np.uint32),
                              reference.read_payload("t")[1].view(np.uint32))
        for d in m.dense:
            assert np.array_equal(client.read_dense_payload(d.name), reference.read_dense_payload(d.name))
        ours = client.strategy_call("verify_parity")
        theirs = reference.strategy_call("verify_parity")
        assert all(v["mismatched"] == 0 for v in ours.values()), ours
        assert sorted(v["checked"] for v in ours.values()) == sorted(v["checked"] for v in theirs.values()), \
            (ours, theirs)
    finally:
        if not resumed:
            local.resume(paused)


@pytest.mark.parametrize("how", ["stopping", "deposed"])
def test_a_create_waiting_on_a_promotion_ends_at_once_when_its_coordinator_stops_or_is_deposed(how):
    """A create waits for a promotion under way (its standby's map lacks the new table); a coordinator that stops,
    or loses the leadership (its promoter then leaves that promotion to the next leader), waited out the whole
    create_timeout_s holding the create lock.  Now it answers at once: the client retries at the leader."""
    from ecrec.config import ClusterSpec, CoordinatorConfig
    from ecrec.control.cluster_state import ACTIVE, PROMOTING
    from ecrec.control.coordinator import Coordinator
    from ecrec.control.stores import NotLeader

    coordinator = Coordinator(CoordinatorConfig(cluster=ClusterSpec(num_servers=2), create_timeout_s=30.0))
    state = coordinator.state
    state.map.servers.add(server_id="a", address="127.0.0.1:1", index=0, state=ACTIVE)
    state.map.servers.add(server_id="b", address="127.0.0.1:2", index=1, state=PROMOTING)
    coordinator.links.call_each = lambda addresses, call, **_: {a: None for a in addresses}  # created at once
    if how == "stopping":
        coordinator.stopping.set()
    else:
        state.store = types.SimpleNamespace(kind="etcd", holds=lambda: False)
        state.leading.clear()

    class Context:
        def abort(self, code, details):
            raise grpc.RpcError(f"{code.name}: {details}")

    started = time.monotonic()
    with pytest.raises((grpc.RpcError, NotLeader)) as info:
        coordinator._create_on_holders(Context(), "table 't'", range(2), None, lambda: state.map.tables.add(name="t"))
    assert time.monotonic() - started < 5.0
    assert ("stopping" if how == "stopping" else "no longer leads") in str(info.value)
    assert not state.map.tables  # nothing published


def test_a_step_that_meets_more_failures_than_parity_covers_says_what_was_applied(make_cluster):
    """Two of three servers (k=2, m=1) killed with pushes held for one of them: the step's part at the survivor
    was applied, the other parts failed (the replay to the replacement DATA_LOSS, the other index unreachable).
    The step raised a plain ClusterError, inviting a retry that applies the survivor's part twice; now it raises
    StepPartlyApplied naming the applied and the refused parts ("do not retry")."""
    import torch

    from ecrec.client import Cluster, EmbeddingBag, StepPartlyApplied
    from ecrec.config import ClientConfig

    local = make_cluster(servers=3, standby=1, strategy="ecrec", k=2, m=1)
    client = Cluster.connect(local.coordinator_address, config=ClientConfig(retry_deadline_s=5.0))
    client.create_table("t", 600, 4, optimizer="sgd", lr=0.1, init="zeros")
    bag = EmbeddingBag(client, "t")
    every_server = torch.arange(0, 600, 7)
    for _ in range(3):  # held, not yet confirmed (groups close every 64 pushes, or 0.5 s)
        bag(every_server[None, :]).sum().backward()
        client.step()
    assert client.courier.unconfirmed()
    bag(every_server[None, :]).sum().backward()  # the step's rows pulled; the servers die before its push
    for pid in [local.pid_of_index(0), local.pid_of_index(1)]:
        os.kill(pid, 9)
    with pytest.raises(StepPartlyApplied) as info:
        client.step()
    assert set(info.value.applied) == {2}, (info.value.applied, info.value.refused)
    assert set(info.value.refused) == {0, 1}, info.value.refused
    assert "do not retry" in str(info.value)


def test_a_failover_is_a_few_warnings_not_one_per_retry(make_cluster, caplog):
    """While a paused server is declared failed and replaced (seconds), a worker's calls retry every few
    milliseconds: each retry logged a warning ("...; following the cluster map", "reporting ... failed"), about
    170 lines in 3 s.  Now one per server address every 10 s (the rest at DEBUG)."""
    import torch

    from ecrec.client import Cluster, EmbeddingBag

    local = make_cluster(servers=3, standby=1, strategy="ecrec", k=2, m=1)
    client = Cluster.connect(local.coordinator_address)
    client.create_table("t", 600, 4, optimizer="sgd", lr=0.1, init="zeros")
    bag = EmbeddingBag(client, "t")
    ids = torch.arange(0, 600, 7)[None, :]
    paused = local.pid_of_index(1)
    local.pause(paused)
    try:
        with caplog.at_level("DEBUG", logger="ecrec"):
            for _ in range(3):
                bag(ids).sum().backward()
                client.step()
    finally:
        local.resume(paused)
    retried = [r for r in caplog.records if "following the cluster map" in r.getMessage()]
    warned = [r for r in retried if r.levelname == "WARNING"]
    assert retried and 1 <= len(warned) <= 2, [(r.levelname, r.getMessage()) for r in retried][:10]
    assert sum(r.levelname == "WARNING" for r in caplog.records if "to the coordinator failed" in r.getMessage()) <= 2


def test_a_create_while_an_index_has_no_server_waits_for_its_replacement(make_cluster):
    """A create made while an index has no live holder (failed, its standby not promoted yet) was refused at once
    (FAILED_PRECONDITION "cluster not ready": seen by a register_dense right after a failover in CI); the client now
    retries it as it retries calls to servers through a failover, and it is made once the index is served again."""
    import torch

    from ecrec.client import Cluster

    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1)
    client = Cluster.connect(local.coordinator_address)
    local.kill(local.pid_of_index(0))
    deadline = time.monotonic() + 30
    while client.refresh_map().ready:  # declared failed, nobody to promote
        assert time.monotonic() < deadline, "the killed server was never declared failed"
        time.sleep(0.1)
    outcome: dict = {}

    def create() -> None:
        try:
            client.create_table("t", 300, 4, optimizer="sgd", lr=0.1, seed=1)
            client.register_dense(torch.nn.Linear(2, 1))
            outcome["ok"] = True
        except Exception as exc:  # noqa: BLE001 - the test reports it
            outcome["error"] = exc

    worker = threading.Thread(target=create, daemon=True)
    worker.start()
    time.sleep(1.0)
    assert worker.is_alive() and not outcome, outcome  # waiting, not refused
    local.start_server(standby=True)  # the replacement comes
    worker.join(90)
    assert outcome == {"ok": True}, outcome
    m = client.refresh_map()
    assert [t.name for t in m.tables] == ["t"] and len(m.dense) == 2 and m.ready


def test_a_step_waiting_on_a_paused_server_follows_its_replacement_while_it_is_still_paused(make_cluster):
    """A call already sent to a server that is then paused waited its whole deadline (30 s by default; then the
    fallback called the same server again: 60 s), though the coordinator declared it failed and its standby served
    within seconds.  Now a call that has waited 2 s has the map checked; once its server is declared failed its
    calls are cancelled and follow the map.  The step ends while the server is still paused, exactly once."""
    from ecrec.client import Cluster
    from ecrec.config import ClientConfig
    from helpers import ROWS, assert_counts, counting_push

    local = make_cluster(servers=3, standby=1, strategy="ecrec", k=2, m=1)
    setup = Cluster.connect(local.coordinator_address, config=ClientConfig(rpc_timeout_s=120.0))
    setup.create_table("t", ROWS, 4, optimizer="sgd", lr=1.0, init="zeros")
    setup.close()
    client = Cluster.connect(local.coordinator_address, config=ClientConfig(rpc_timeout_s=90.0,
                                                                             retry_deadline_s=180.0))
    initial = client.read_payload("t")[1].copy()
    counts = np.zeros(ROWS)
    for _ in range(3):
        counting_push(client, np.arange(ROWS))
        counts += 1
    pid = local.pid_of_index(0)
    local.pause(pid)
    done = threading.Event()
    try:
        worker = threading.Thread(target=lambda: (counting_push(client, np.arange(ROWS)), done.set()), daemon=True)
        worker.start()
        assert done.wait(60), "the step still waits on the paused server (its deadline is 90 s)"
        counts += 1
    finally:
        local.resume(pid)
    worker.join(60)
    counting_push(client, np.arange(ROWS))
    counts += 1
    assert_counts(client, initial, counts)
    client.close()


def wait_for_parity(cluster):
    """verify_parity once the replacement has rebuilt (its rows are checked against their stripes then)."""
    from helpers import wait_for

    wait_for(lambda: all(s.state != cluster_pb2.RECOVERING for s in cluster.refresh_map().servers), 60,
             "the replacement's rebuild")
    return cluster.strategy_call("verify_parity")


def test_a_create_whose_server_dies_under_it_is_made_on_the_replacement(make_cluster, caplog):
    """A holder killed while it created its shard (before the coordinator declared it failed) dropped the call:
    the coordinator took that for a refusal and create_table failed with a raw UNAVAILABLE ('Stream removed'),
    nothing published, though the standby took the index a moment later.  The coordinator checks the server: it
    is declared failed and the shard is made on its replacement."""
    from ecrec.client import Cluster

    local = make_cluster(servers=3, standby=1, strategy="ecrec", k=2, m=1,
                         server_env={1: {"ECREC_FAULT": "during_create@1"}})
    cluster = Cluster.connect(local.coordinator_address)
    try:
        victim = local.pid_of_index(1)
        with caplog.at_level("WARNING", logger="ecrec.client"):
            spec = cluster.create_table("t", 300, 4, optimizer="adagrad", lr=0.05, seed=1)
        # made by the coordinator on the replacement, not refused (the client retried only a refusal whose text it
        # knew: 'Socket closed' yes, 'Connection reset by peer' no -- that one reached the training loop)
        assert not [r for r in caplog.records if "cannot be made now" in r.getMessage()], caplog.text
        assert [t.name for t in cluster.refresh_map().tables] == ["t"] and spec.num_rows == 300
        assert local.pid_of_index(1) != victim  # the standby holds index 1 now, with the shard
        expected = Cluster.connect(make_cluster(servers=2, strategy="none").coordinator_address)
        expected.create_table("t", 300, 4, optimizer="adagrad", lr=0.05, seed=1)
        np.testing.assert_array_equal(cluster.read_table("t", "payload"), expected.read_table("t", "payload"))
        verify = wait_for_parity(cluster)
        assert all(v["mismatched"] == 0 for v in verify.values()) and sum(v["checked"] for v in verify.values())
    finally:
        cluster.close()


def test_a_call_whose_channel_the_stall_watcher_closes_under_it_follows_the_map(make_cluster):
    """The watcher closes the channel of a server declared failed; a call that had taken its stub just before
    raised a bare ValueError ('Cannot invoke RPC on closed channel!') to the training loop -- after the other
    parts of a step were applied and before the courier recorded them.  It reads as CANCELLED now: followed."""
    from ecrec.client import Cluster

    local = make_cluster(servers=2, strategy="none")
    client = Cluster.connect(local.coordinator_address)
    try:
        client.create_table("t", 20, 4, seed=1)
        expected = client.pull("t", [0, 1, 2, 3]).clone()
        peers, real_stub, dropped = client.peers, client.peers.stub, []

        def stub_then_drop(address, service="embedding"):
            stub = real_stub(address, service)
            if not dropped:  # the watcher closes it right after this call took it
                dropped.append(address)
                peers._drop_channel(address)
            return stub

        peers.stub = stub_then_drop
        assert torch.equal(client.pull("t", [0, 1, 2, 3]), expected) and dropped
    finally:
        client.close()


@pytest.mark.cluster
def test_an_index_left_unreplaced_says_why(make_cluster):
    """A call to an index nobody replaced ended 'not replaced within N s (is a standby available?)' -- also when a
    standby was there and the coordinator could not promote it (etcd without quorum)."""
    from ecrec.client import Cluster, ClusterError
    from ecrec.config import ClientConfig

    local = make_cluster(servers=2, strategy="none")
    cluster = Cluster.connect(local.coordinator_address, ClientConfig(retry_deadline_s=3.0))
    try:
        cluster.create_table("t", 20, 2, optimizer="sgd", lr=0.1)
        ids = np.flatnonzero(cluster.layout.locate(np.arange(20))[0] == 1)[:2]
        local.kill(local.pid_of_index(1))
        with pytest.raises(ClusterError, match="not replaced within 3 s \\(no standby is registered: start one "
                                               "with ecrec-server serve --standby\\)"):
            cluster.pull("t", ids)
        local.kill(local.coordinator_proc.pid)
        with pytest.raises(ClusterError, match="not replaced within 3 s \\(the coordinator did not answer"):
            cluster.pull("t", ids)
    finally:
        cluster.close(confirm_timeout_s=1.0)


@pytest.mark.cluster
def test_close_waits_for_confirmations_no_longer_than_it_was_told(make_cluster):
    """``close(confirm_timeout_s=2)`` with a server paused took 5-10 s (20 s and more with the default 10 s): the
    polls it makes for confirmations retried for 10 s each and waited out a call's own deadline."""
    from ecrec.client import Cluster, EmbeddingBag

    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, options={"coalesce_s": 60, "coalesce_pushes": 1000,
                                                                       "coalesce_bytes": 1 << 30})
    cluster = Cluster.connect(local.coordinator_address)
    cluster.create_table("t", 300, 4, optimizer="sgd", lr=0.1)
    bag = EmbeddingBag(cluster, "t")
    for _ in range(5):
        bag(torch.arange(0, 300, 7), torch.arange(0, 43, 1)).sum().backward()
        cluster.step()
    assert cluster.courier.unconfirmed() > 0  # their groups stay open
    paused = local.pid_of_index(0)
    local.pause(paused)
    try:
        t0 = time.monotonic()
        cluster.close(confirm_timeout_s=2.0)
        took = time.monotonic() - t0
    finally:
        local.resume(paused)
    assert took < 6.0, took  # (10 s and more before; the bound is the contract, with room for a loaded machine)


_EXITER = """
    import sys
    import torch
    from ecrec.client import Cluster, EmbeddingBag
    from ecrec.config import ClientConfig

    cluster = Cluster.connect(sys.argv[1], config=ClientConfig(rpc_timeout_s=20.0, retry_deadline_s=60.0,
                                                               confirm_at_exit_s=float(sys.argv[2])), worker="exiter")
    EmbeddingBag(cluster, "t")(torch.arange(0, 300, 7)[None, :]).sum().backward()
    cluster.step()
    print("unconfirmed", cluster.courier.unconfirmed(), flush=True)
    sys.stdin.readline()  # the test pauses the cluster meanwhile; the script then ends without close()
"""


@pytest.mark.cluster
def test_a_process_that_ends_without_close_waits_for_confirmations_no_longer_than_told(make_cluster, tmp_path):
    """A worker that ends without ``close()`` waits at exit for its pushes to be confirmed, up to
    ``confirm_at_exit_s``: with its whole cluster paused, no call's own deadline (20 s here) or failure report
    stretches that wait, and a Ctrl-C ends a longer one at once, saying so, with no traceback."""
    import signal
    import subprocess
    import sys
    import textwrap

    from ecrec.client import Cluster

    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, options={"coalesce_s": 60, "coalesce_pushes": 1000,
                                                                       "coalesce_bytes": 1 << 30})
    setup = Cluster.connect(local.coordinator_address)
    setup.create_table("t", 300, 4, optimizer="sgd", lr=0.1)
    setup.close()
    script = tmp_path / "exiter.py"
    script.write_text(textwrap.dedent(_EXITER))
    frozen = [p.pid for p in [*local.server_procs, local.coordinator_proc] if p.poll() is None]

    def run(wait_s: str, interrupt: bool):
        proc = subprocess.Popen([sys.executable, str(script), local.coordinator_address, wait_s], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert int(proc.stdout.readline().split()[-1]) > 0  # the group stays open: the wait has work to do
            for pid in frozen:
                local.pause(pid)
            t0 = time.monotonic()
            proc.stdin.write("end\n")
            proc.stdin.flush()
            if interrupt:
                line = proc.stderr.readline()  # said after a second of waiting
                assert "exiting without close(): waiting up to" in line and "worker(s) exiter" in line, line
                proc.send_signal(signal.SIGINT)
            err = proc.communicate(timeout=60)[1]
            return time.monotonic() - t0, proc.returncode, err
        finally:
            for pid in frozen:
                local.resume(pid)
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    took, code, err = run("2", interrupt=False)
    assert took < 6.0 and code == 0, (took, code, err[-2000:])  # 2 s and the interpreter's own exit
    assert "closing worker exiter with" in err and "Traceback" not in err, err[-2000:]
    took, code, err = run("600", interrupt=True)
    assert took < 6.0 and code == 0, (took, code, err[-2000:])
    assert "stopped waiting for confirmations (interrupted)" in err and "Traceback" not in err, err[-2000:]
