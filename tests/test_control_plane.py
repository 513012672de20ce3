"""The control plane on etcd (``--store etcd://...``): a real etcd (the ``etcd`` binary; ``.ci/run`` installs
Debian's ``etcd-server``), two coordinators of which one leads, real servers on 127.0.0.1.

Each test: the promotion completes once, no two maps share an epoch, no acknowledged push is lost (the counting
workload of ``test_safety``).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from ecrec.control import stores as state_store
from ecrec.client import Cluster
from ecrec.config import ClusterSpec, CoordinatorConfig
from ecrec.control.coordinator import Coordinator
from ecrec.net.peers import coordinator_stub
from ecrec.wire import cluster_pb2, coordinator_pb2
from helpers import ROWS, assert_counts, counting_push, start

HAVE_ETCD = shutil.which("etcd") is not None or os.path.exists("/usr/bin/etcd")
needs_etcd = pytest.mark.skipif(not HAVE_ETCD, reason="needs the etcd binary (apt-get install etcd-server)")


def test_store_urls_are_parsed_and_bad_ones_named():
    assert state_store.parse_store(None) == ("file", {})
    from ecrec.control.etcd import prefix_end
    from ecrec.control.etcd_lease import lease_ttl_s, parse_lease_store, servers_prefix
    from ecrec.control.etcd import etcd_url
    url = etcd_url(["10.0.0.1:2379", "10.0.0.2:2379"], "/jobs/a/")
    assert url == "etcd://10.0.0.1:2379,10.0.0.2:2379/jobs/a"
    assert parse_lease_store(url) == (["10.0.0.1:2379", "10.0.0.2:2379"], "/jobs/a")
    with pytest.raises(ValueError, match="not an etcd"):
        parse_lease_store("/tmp/state")
    assert servers_prefix("/jobs/a") == b"/jobs/a/servers/"
    assert prefix_end(b"/jobs/a/servers/") == b"/jobs/a/servers0" and prefix_end(b"a\xff") == b"b"
    assert [lease_ttl_s(x) for x in (0.5, 2.0, 2.1, 3.0)] == [2, 2, 3, 3]
    spec0 = ClusterSpec(num_servers=2)
    c = Coordinator(CoordinatorConfig(cluster=spec0, store="etcd://127.0.0.1:2379/x", lease_s=2.5))
    assert (c.map.lease_store, c.map.lease_s) == ("etcd://127.0.0.1:2379/x", 3.0)
    assert Coordinator(CoordinatorConfig(cluster=spec0)).map.lease_store == ""  # file store: leases on the coordinator
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
    # a file store named twice kept the --store path and ignored --state-path; one in no directory was refused only
    # at the first save (every registration failed)
    with pytest.raises(ValueError, match="--store file:///tmp/a and --state-path /tmp/b both name where the map is "
                                         "kept: choose one"):
        Coordinator(CoordinatorConfig(cluster=spec, store="file:///tmp/a", state_path="/tmp/b"))
    with pytest.raises(ValueError, match="--store /nonexistent/dir/x.state: no directory /nonexistent/dir to keep"):
        Coordinator(CoordinatorConfig(cluster=spec, store="/nonexistent/dir/x.state"))
    with pytest.raises(ValueError, match="--store file:///tmp is a directory: name the file"):
        Coordinator(CoordinatorConfig(cluster=spec, store="file:///tmp"))
    with pytest.raises(ValueError, match="at least 2"):
        Coordinator(CoordinatorConfig(cluster=spec, store="etcd://127.0.0.1:2379", election_ttl_s=1))


class EtcdLeaders:
    """A real one-member etcd and in-process coordinators that lead on it in turn (``lead``); ``client`` writes
    keys and leases as a server or an operator would.  Closed by the ``etcd_leaders`` fixture."""

    def __init__(self):
        from ecrec.control.etcd_local import LocalEtcd
        self.etcd = LocalEtcd(1)
        self.stop = threading.Event()
        self.stores: list = []
        self.client = None
        self.etcd.start()
        self.client = self.etcd.client()

    def lead(self, prefix: str, name: str, **options) -> tuple[Coordinator, state_store.EtcdStore]:
        """A coordinator on ``prefix`` that campaigns and takes over (the previous leader must have resigned)."""
        c = Coordinator(CoordinatorConfig(cluster=ClusterSpec(num_servers=2),
                                          store=f"etcd://{self.etcd.endpoints[0]}{prefix}", **options))
        store = state_store.EtcdStore(self.etcd.endpoints, prefix, name, f"127.0.0.1:{len(self.stores) + 1}")
        self.stores.append(store)
        assert store.campaign(self.stop)
        c.take_over(store)
        return c, store

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.stop.set()
        for store in self.stores:
            store.resign()  # its election's renewer stops
            store.close()
        self.etcd.close()


@pytest.fixture
def etcd_leaders():
    leaders = EtcdLeaders()
    try:
        yield leaders
    finally:
        leaders.close()


@pytest.mark.cluster
@needs_etcd
def test_a_new_leader_keeps_the_saved_ttl_and_times_a_failed_servers_end_from_when_it_sees_its_key_go(etcd_leaders):
    """A deposed leader (or an operator) may revoke a failed server's lease after a new leader took over: the
    server may serve a TTL after that, so the new leader counts a TTL from when it first sees the key gone; and
    it waits the TTL the servers were granted (the saved map's), however short its own --lease-s."""
    first, first_store = etcd_leaders.lead("/t", "a", lease_s=4.0)
    client = etcd_leaders.client
    lease = client.grant(60)  # the failed server's: still alive (it is paused, say)
    client.put(b"/t/servers/s1", b"127.0.0.1:9", lease=lease)
    with first.state.lock:  # a server the first leader declared failed, and did not get to revoke
        first.map.servers.add(server_id="s1", address="127.0.0.1:9", index=0, state=cluster_pb2.FAILED)
        first.state.bump_locked()
    first_store.resign()
    second, second_store = etcd_leaders.lead("/t", "b", lease_s=2.0)
    took_over = time.monotonic()
    assert second.map.lease_s == 4.0  # the servers hold 4 s leases: a 2 s wait would not cover them
    failed = [s for s in second.map.servers if s.server_id == "s1"]
    assert failed and failed[0].state == cluster_pb2.FAILED
    time.sleep(3.0)
    client.revoke(lease)  # the deposed leader's revocation lands now
    revoked = time.monotonic()
    while time.monotonic() < took_over + 4.5:  # a TTL after the takeover: not yet (it was revoked at 3 s)
        assert not second.promoter.safe_to_replace(failed, second.promoter.fence_etcd_leases())
        time.sleep(0.2)
    wait_for(lambda: second.promoter.safe_to_replace(failed, second.promoter.fence_etcd_leases()), 6.0, "s1 replaceable")
    assert time.monotonic() - revoked >= 4.0  # a whole TTL after the key went
    # a third coordinator started with a longer --lease-s waits that (and servers registering get it)
    second_store.resign()
    third, _ = etcd_leaders.lead("/t", "c", lease_s=6.0)
    assert third.map.lease_s == 6.0 and third.state.lease_wait_s == 6.0


@pytest.mark.cluster
@needs_etcd
def test_a_removed_standbys_revocation_that_etcd_did_not_answer_is_tried_again(etcd_leaders):
    """A standby declared failed leaves the map; its etcd lease is revoked so it stops.  When etcd does not answer
    that revocation (it may or may not have happened), the leader tries again, and stops trying once it is
    answered (it reads etcd only while there is something left to do)."""
    c, store = etcd_leaders.lead("/d", "a")
    client = etcd_leaders.client
    lease = client.grant(60)
    client.put(b"/d/servers/sb", b"127.0.0.1:9", lease=lease)
    with c.state.lock:
        c.map.servers.add(server_id="sb", address="127.0.0.1:9", index=-1, state=cluster_pb2.STANDBY)
        c.state.bump_locked()
    real, calls = store.revoke_lease, []

    def unanswered_once(lease_id):
        calls.append(lease_id)
        if len(calls) == 1:
            raise state_store.StoreUnavailable("etcd Revoke: outcome unknown (injected)")
        real(lease_id)

    store.revoke_lease = unanswered_once
    c.detector.declare_failed("127.0.0.1:9", why="a test")
    assert calls == [lease] and "sb" not in {s.server_id for s in c.map.servers}
    assert client.keep_alive_once(lease) > 0  # not revoked yet
    assert c.state.dropped == {"sb"}
    c.promoter.promote_standbys()  # the promoter's round: there is work left, so it reads etcd and tries again
    assert calls == [lease, lease] and client.keep_alive_once(lease) <= 0
    assert not c.state.dropped and not c.state.untimed


@pytest.mark.cluster
@needs_etcd
def test_a_fence_round_times_only_what_it_read_after_and_a_key_without_a_lease_is_no_servers(etcd_leaders):
    """The leader times a failed server's end from an etcd read that shows its key gone: only a read made after
    the server was marked failed says so (a server may register, and be marked failed, between a round's read
    and its lock).  And a key written by hand without a lease holds no server's lease."""
    c, store = etcd_leaders.lead("/r", "a")
    client = etcd_leaders.client
    client.put(b"/r/servers/by-hand", b"127.0.0.1:7")  # no lease
    assert "by-hand" not in store.server_leases()
    lease = client.grant(60)
    real = store.server_leases

    def read_then_a_registration():
        leases = real()  # read before "late" took its key
        client.put(b"/r/servers/late", b"127.0.0.1:9", lease=lease)
        with c.state.lock:  # it registered, and a registration at its address marked it failed, meanwhile
            c.map.servers.add(server_id="late", address="127.0.0.1:9", index=0, state=cluster_pb2.FAILED)
            c.state.untimed.add("late")
        return leases

    store.server_leases = read_then_a_registration
    c.promoter.fence_etcd_leases()
    assert "late" in c.state.untimed  # not timed from a read that predates it
    store.server_leases = real
    assert client.keep_alive_once(lease) > 0
    c.promoter.fence_etcd_leases()  # the next round sees its key, revokes it, and times it from the answer
    assert client.keep_alive_once(lease) <= 0 and "late" not in c.state.untimed
    late = [s for s in c.map.servers if s.server_id == "late"]
    assert not c.promoter.safe_to_replace(late, store.server_leases())  # a TTL from the revocation first


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
        try:
            value = predicate()
        except LookupError:  # no coordinator leads: a failover is under way
            value = None
        except grpc.RpcError as exc:  # no coordinator leads and etcd cannot be read yet (its quorum is returning)
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def holder(local, index):
    m = local.cluster_map()
    return next((s for s in m.servers if s.index == index and s.state != cluster_pb2.FAILED), None)


def serves(address: str) -> bool:
    """Whether the server at ``address`` serves now: an empty pull sent to it (not through the map) is refused for
    its content (INVALID_ARGUMENT) only by a server that still holds its lease; UNAVAILABLE otherwise, the
    process gone included."""
    from ecrec.wire import embedding_pb2, embedding_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            embedding_pb2_grpc.EmbeddingServerStub(channel).Pull(embedding_pb2.PullRequest(), timeout=1)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    return True


@pytest.mark.cluster
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


@pytest.mark.cluster
@needs_etcd
def test_servers_hold_etcd_leases_and_one_whose_lease_is_revoked_stops_and_is_replaced(make_cluster):
    from ecrec.control.etcd_lease import lease_ttl_s, servers_prefix
    import grpc
    local, client, initial = start(make_cluster, servers=3, standby=1, store="etcd", coordinators=2)
    counts = np.zeros(ROWS)
    counting_push(client, np.arange(ROWS))
    counts += 1
    m = local.cluster_map()
    assert m.lease_store.startswith("etcd://") and m.lease_s == lease_ttl_s(3.0)
    etcd = local.etcd.client()
    try:
        keys = {kv.key.decode().rpartition("/")[2]: kv for kv in etcd.get_prefix(servers_prefix(local.etcd_prefix))}
        assert set(keys) == {s.server_id for s in m.servers}  # every server and the standby, each its own lease
        assert len({kv.lease for kv in keys.values()}) == len(keys) and all(kv.lease for kv in keys.values())
        assert all(0 < etcd.keep_alive_once(kv.lease) <= m.lease_s for kv in keys.values())
        # the coordinator's home-made renewal is not what these servers use
        with pytest.raises(grpc.RpcError) as refused:
            coordinator_stub(local.coordinator_address).RenewLease(coordinator_pb2.RenewLeaseRequest(
                server_id=m.servers[0].server_id, index=0, epoch=m.epoch), timeout=5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # a registration without a lease, or naming another's, is refused and changes nothing
        for lease in (0, keys[m.servers[0].server_id].lease):
            with pytest.raises(grpc.RpcError) as bad:
                coordinator_stub(local.coordinator_address).Register(coordinator_pb2.RegisterRequest(
                    address="127.0.0.1:9", server_id="intruder", standby=True, etcd_lease=lease), timeout=5)
            assert bad.value.code() == grpc.StatusCode.FAILED_PRECONDITION, bad.value.details()
        assert "intruder" not in {s.server_id for s in local.cluster_map().servers}
        # revoke index 1's lease (as a deposed leader might have): it stops serving, its process ends, and the
        # standby takes the index
        victim = holder(local, 1)
        standby_id = next(s.server_id for s in m.servers if s.index < 0)
        proc = next(p for p in local.server_procs if p.pid == local.pid_of_index(1))
        assert serves(victim.address)
        etcd.revoke(keys[victim.server_id].lease)
        revoked = time.monotonic()
        wait_for(lambda: not serves(victim.address), 20, "the server whose lease was revoked to stop serving")
        stopped = time.monotonic() - revoked
        wait_for(lambda: proc.poll() is not None, 20, "the server whose lease was revoked to exit")
        h = wait_for(lambda: (h := holder(local, 1)) is not None and h.server_id == standby_id
                     and h.state in (cluster_pb2.ACTIVE, cluster_pb2.RECOVERING) and h, 40, "index 1 promoted")
        counting_push(client, np.arange(ROWS))
        counts += 1
        print(f"the server stopped serving {stopped:.2f} s after its etcd lease was revoked")
        assert stopped < m.lease_s  # at its next renewal, a third of the TTL apart
        assert h.server_id in {kv.key.decode().rpartition("/")[2]
                               for kv in etcd.get_prefix(servers_prefix(local.etcd_prefix))}
    finally:
        etcd.close()
    assert_counts(client, initial, counts)


@pytest.mark.cluster
@needs_etcd
def test_a_server_whose_key_is_deleted_by_hand_stops_and_is_replaced(make_cluster):
    """Deleting a server's key (etcdctl del) leaves its lease alive: the server renews it, but finds its key gone
    at that renewal and stops; the coordinator sees the key gone and promotes the standby a TTL later."""
    from ecrec.control.etcd_lease import servers_prefix
    local, client, initial = start(make_cluster, servers=3, standby=1, store="etcd")
    counts = np.zeros(ROWS)
    counting_push(client, np.arange(ROWS))
    counts += 1
    m = local.cluster_map()
    victim = holder(local, 2)
    standby_id = next(s.server_id for s in m.servers if s.index < 0)
    proc = next(p for p in local.server_procs if p.pid == local.pid_of_index(2))
    etcd = local.etcd.client()
    try:
        key = servers_prefix(local.etcd_prefix) + victim.server_id.encode()
        lease = etcd.get(key).lease
        assert serves(victim.address)
        # the server is held while its key is deleted, until the coordinator has seen the key gone: a server that
        # saw it first, at a renewal just after the deletion, and exited before the coordinator's next round was
        # found gone (its port refused) and rightly replaced at once (0.34 s in one CI run), not a TTL later
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            assert etcd.delete(key) == 1  # by hand: the lease lives on
            deleted = time.monotonic()
            wait_for(lambda: any(s.server_id == victim.server_id and s.state == cluster_pb2.FAILED
                                 for s in local.cluster_map().servers), 20, "the coordinator to see the key gone")
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        wait_for(lambda: not serves(victim.address), 20, "the server whose key was deleted to stop serving")
        stopped = time.monotonic() - resumed
        assert stopped < m.lease_s  # at its next renewal (or at the map that says it failed)
        wait_for(lambda: proc.poll() is not None, 20, "the server whose key was deleted to exit")
        assert etcd.keep_alive_once(lease) <= 0  # it revoked its lease on the way out
        wait_for(lambda: (h := holder(local, 2)) is not None and h.server_id == standby_id
                 and h.state in (cluster_pb2.ACTIVE, cluster_pb2.RECOVERING), 40, "index 2 promoted")
        promoted = time.monotonic() - deleted
        print(f"the server stopped serving {stopped:.2f} s after it resumed; its standby held the index "
              f"{promoted:.2f} s after its key was deleted")
        # the coordinator saw the key gone after it went, and waited a whole TTL from then
        assert promoted >= m.lease_s
    finally:
        etcd.close()
    counting_push(client, np.arange(ROWS))
    counts += 1
    assert_counts(client, initial, counts)


@pytest.mark.cluster
@needs_etcd
def test_registrations_slower_than_the_servers_lease_keep_it_alive(make_cluster):
    """Each map change takes longer than a server's 2 s etcd lease (a coordinator whose disk is slow): a server
    keeps its lease alive while its registration waits, so every server registers with the lease it took and
    serves."""
    from ecrec.control.etcd_lease import servers_prefix
    local, client, initial = start(make_cluster, servers=3, store="etcd", coordinator_options={"lease_s": 2.0},
                                   coordinator_env={"ECREC_COORDINATOR_FAULT": "record_map@1:delay=3.0"})
    counts = np.zeros(ROWS)
    counting_push(client, np.arange(ROWS))
    counts += 1
    m = local.cluster_map()
    assert [s.state for s in m.servers] == [cluster_pb2.ACTIVE] * 3, m
    assert all(p.poll() is None for p in local.server_procs)
    etcd = local.etcd.client()
    try:
        keys = {kv.key.decode().rpartition("/")[2] for kv in etcd.get_prefix(servers_prefix(local.etcd_prefix))}
        assert keys == {s.server_id for s in m.servers}
    finally:
        etcd.close()
    assert_counts(client, initial, counts)


@pytest.mark.cluster
@needs_etcd
def test_two_of_three_etcd_members_killed_the_data_plane_serves_within_a_lease_and_promotions_wait(make_cluster):
    lease_s = 8.0  # the servers ride out an etcd outage this long (a longer lease, a slower replacement of a hung one)
    local, client, initial = start(make_cluster, servers=3, standby=1, store="etcd", coordinators=2, etcd_members=3,
                                   coordinator_options={"lease_s": lease_s})
    counts = np.zeros(ROWS)
    counting_push(client, np.arange(ROWS))
    counts += 1
    standby_id = next(s.server_id for s in local.cluster_map().servers if s.index < 0)
    victim = local.pid_of_index(2)  # (the map cannot be read while etcd is down)
    local.etcd.kill_member(1)
    local.etcd.kill_member(2)
    lost = time.monotonic()
    steps = []
    while time.monotonic() - lost < lease_s / 2:  # training goes on without etcd
        began = time.monotonic()
        counting_push(client, np.arange(ROWS))
        counts += 1
        steps.append(time.monotonic() - began)
    assert max(steps) < 2.0, steps
    local.kill(victim)  # its process is gone, but no promotion can be recorded
    time.sleep(2.0)
    from ecrec.control.etcd import EtcdError
    with pytest.raises((LookupError, EtcdError)):  # etcd cannot say who leads: nobody can record a change
        local.leading_coordinator()
    local.etcd.start_member(1)
    local.etcd.start_member(2)
    back = time.monotonic()
    h = wait_for(lambda: (h := holder(local, 2)) is not None and h.server_id == standby_id
                 and h.state in (cluster_pb2.ACTIVE, cluster_pb2.RECOVERING) and h, 60, "index 2 promoted")
    promoted = next(e for e in local.cluster_map().events if e.kind == "promoted" and e.index == 2)
    assert promoted.wall_time > time.time() - (time.monotonic() - back)  # only once etcd was back
    counting_push(client, np.arange(ROWS))
    counts += 1
    print(f"{len(steps)} steps while 2/3 etcd members were down, slowest {max(steps):.2f} s; index 2 promoted "
          f"{time.monotonic() - back:.2f} s after etcd was back")
    assert_counts(client, initial, counts)


@pytest.mark.cluster
@needs_etcd
def test_a_failure_declared_while_etcd_loses_its_quorum_is_declared_again_once_it_is_back(make_cluster):
    """The health monitor read the store's refusal of its declaration (``StoreUnavailable``, a ``RuntimeError``)
    as its pool shut down and ended, silently: once etcd had its quorum back and the coordinator led again, a
    server killed as the quorum went was never declared failed, its standby never promoted (only a client's
    report would have), and no later failure would have been either."""
    lease_s = 8.0  # the servers ride out the outage
    local, client, initial = start(make_cluster, servers=3, standby=1, store="etcd", coordinators=1, etcd_members=3,
                                   coordinator_options={"lease_s": lease_s})
    standby_id = next(s.server_id for s in local.cluster_map().servers if s.index < 0)
    victim = local.pid_of_index(2)
    local.etcd.kill_member(1)
    local.etcd.kill_member(2)
    local.kill(victim)  # found by the next health round, while the coordinator still holds its leadership
    # the refusal is logged when a health round met it while the coordinator still led (it may have stepped down
    # first: then no round ran, and nothing is said); either way the promotion below is what is asserted
    said = lambda: any("was not recorded" in line for line in local.stderr_tail(local.coordinator_proc.pid))
    deadline = time.monotonic() + 8
    while not said() and time.monotonic() < deadline:
        time.sleep(0.2)
    local.etcd.start_member(1)
    local.etcd.start_member(2)
    wait_for(lambda: (h := holder(local, 2)) is not None and h.server_id == standby_id
             and h.state in (cluster_pb2.ACTIVE, cluster_pb2.RECOVERING), 60,
             "index 2 promoted by the coordinator alone (no client reported it)")
    counts = np.zeros(ROWS)
    counting_push(client, np.arange(ROWS))
    counts += 1
    assert_counts(client, initial, counts)


@pytest.mark.cluster
@needs_etcd
def test_a_coordinator_whose_flags_do_not_match_the_map_on_etcd_is_refused_at_its_start(make_cluster):
    """A coordinator started for another shape than the map etcd holds joined as a follower without a word (status
    listed it), and once elected logged a traceback and exited: the cluster was left without a coordinator."""
    import subprocess
    import sys

    local = make_cluster(servers=2, strategy="ecrec", k=1, m=1, store="etcd")
    store = f"etcd://{','.join(local.etcd.endpoints)}{local.etcd_prefix}"
    r = subprocess.run([sys.executable, "-m", "ecrec.cli", "coordinator", "--port", "0", "--servers", "3",
                        "--strategy", "none", "--store", store], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "holds a map for 2 servers, strategy 'ecrec', k=1, m=1; this coordinator was started for 3, 'none'" \
        in r.stderr and "ECREC_COORDINATOR" not in r.stdout and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert len(local.cluster_map().servers) == 2 and local.leading_coordinator()  # the cluster as it was


@pytest.mark.cluster
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


@pytest.mark.cluster
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


class CuttableProxy:
    """A TCP proxy on 127.0.0.1 in front of one etcd member: ``cut()`` drops every connection and refuses new
    ones (the coordinator behind it is cut off from etcd), ``heal()`` forwards again."""

    def __init__(self, target: str):
        import socket
        self.target = target.rsplit(":", 1)
        self._socket = socket
        self._lock = threading.Lock()
        self._conns: list = []
        self.cut_off = threading.Event()
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.address = f"127.0.0.1:{self.port}"
        self._listener = None
        self.heal()

    def heal(self):
        s = self._socket.socket()
        s.setsockopt(self._socket.SOL_SOCKET, self._socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        self.cut_off.clear()
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def cut(self):
        self.cut_off.set()
        try:
            self._listener.shutdown(self._socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(self._socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self, listener):
        while not self.cut_off.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = self._socket.create_connection((self.target[0], int(self.target[1])), timeout=2)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.close()
            except OSError:
                pass

    def close(self):
        self.cut()


@pytest.mark.cluster
@needs_etcd
def test_the_leader_cut_off_from_etcd_steps_down_and_a_follower_takes_over(make_cluster):
    proxies = {}

    def through_proxy(n, endpoints):  # each coordinator reaches etcd through a proxy (whichever leads is cut off)
        proxies[n] = CuttableProxy(endpoints[0])
        return [proxies[n].address]

    try:
        local, client, initial = start(make_cluster, servers=3, standby=1, store="etcd", coordinators=2,
                                       coordinator_etcd=through_proxy)
        watcher = MapWatcher(local)
        first = local.leading_coordinator()[1]  # the one that started first, unless a loaded machine let the other win
        leader = local.coordinator_addresses.index(first)
        second = local.coordinator_addresses[1 - leader]
        counts = np.zeros(ROWS)
        counting_push(client, np.arange(ROWS))
        counts += 1
        proxies[leader].cut()
        cut = time.monotonic()
        wait_for(lambda: local.leading_coordinator()[1] == second, 30, "the follower leads")
        took = time.monotonic() - cut
        # the deposed leader changes nothing: its calls are refused (it cannot even read etcd for a map)
        with pytest.raises(Exception, match="UNAVAILABLE"):
            coordinator_stub(first).ReportFailure(coordinator_pb2.ReportFailureRequest(address="x:1"), timeout=5)
        standby_id = next(s.server_id for s in local.cluster_map().servers if s.index < 0)
        local.kill(local.pid_of_index(1))
        wait_for(lambda: (h := holder(local, 1)) is not None and h.server_id == standby_id
                 and h.state in (cluster_pb2.ACTIVE, cluster_pb2.RECOVERING), 40, "index 1 promoted by the new leader")
        counting_push(client, np.arange(ROWS))
        counts += 1
        proxies[leader].heal()  # back, the old leader campaigns as a follower
        time.sleep(3)
        assert local.leading_coordinator()[1] == second
        counting_push(client, np.arange(ROWS))
        counts += 1
        print(f"the follower led {took:.2f} s after the leader was cut off from etcd")
        assert_counts(client, initial, counts)
        watcher.stop()
        assert not watcher.conflicts, f"two maps with one epoch: {watcher.conflicts}"
    finally:
        for p in proxies.values():
            p.close()


def test_the_control_plane_benchmark_summary_is_a_function_of_its_slices():
    from ecrec.bench import control_plane

    def slice_(r, store, total, wall):
        return {"round": r, "store": store, "steps": 10, "wall_s": wall,
                "cpu_s": {"servers": total * 0.6, "coordinators": total * 0.1, "etcd": 0.0, "worker": total * 0.3}}

    slices = [slice_(0, "file", 1.0, 2.0), slice_(0, "etcd", 1.1, 2.0), slice_(1, "etcd", 0.9, 3.0),
              slice_(1, "file", 1.0, 2.0), slice_(2, "file", 2.0, 2.0)]  # round 2 unpaired: no ratio
    s = control_plane.summarize(slices)
    assert s["cpu_ratio"]["pairs"] == pytest.approx([1.1, 0.9])
    assert s["cpu_ratio"]["median"] == pytest.approx(1.0)
    assert s["wall_ratio"]["max"] == pytest.approx(1.5)
    assert s["stores"]["file"]["total_cpu_s_per_step"] == pytest.approx(0.1)  # median of 0.1, 0.1, 0.2
    assert s["stores"]["etcd"]["cpu_s_per_step"]["servers"] == pytest.approx(0.06)
    import argparse
    args = argparse.Namespace(servers=4, rows=10, dim=4, batch=1, rounds=0, steps=1, coordinators=1, etcd_members=1)
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        control_plane._positive(args)


@pytest.mark.cluster
@needs_etcd
def test_the_coordinators_dial_etcd_with_tls_when_the_cluster_uses_it(make_cluster, tmp_path):
    trustme = pytest.importorskip("trustme")
    from helpers import issue

    from ecrec.control.etcd import EtcdClient, EtcdError
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, store="etcd", coordinators=2,
                         server_security=issue(ca, tmp_path, "ecrec-server"),
                         coordinator_security=issue(ca, tmp_path, "ecrec-coordinator"),
                         client_security=issue(ca, tmp_path, "trainer"), etcd_tls=issue(ca, tmp_path, "etcd"))
    assert all(u.startswith("https://") for u in local.etcd.client_urls)
    client = Cluster.connect(local.coordinator_address, config=local.client_config(rpc_timeout_s=60.0))
    client.create_table("t", ROWS, 4, optimizer="sgd", lr=1.0, init="zeros")
    initial = client.read_payload("t")[1].copy()
    counting_push(client, np.arange(ROWS))
    assert local.leading_coordinator()[1] in local.coordinator_addresses
    plain = EtcdClient(local.etcd.endpoints, timeout_s=2.0)  # no TLS: etcd does not answer it
    with pytest.raises(EtcdError):
        plain.get(f"{local.etcd_prefix}/state".encode())
    plain.close()
    assert_counts(client, initial, np.ones(ROWS))


@pytest.mark.cluster
@needs_etcd
def test_with_a_ca_of_its_own_etcd_refuses_every_worker_certificate(make_cluster, tmp_path):
    """etcd holds the control plane's keys, the server key among them, and admits every certificate its CA
    signed.  Given a CA of its own (``--etcd-ca/--etcd-cert/--etcd-key`` on the coordinators and servers), the
    cluster trains and fails over as before, while a worker's certificate -- signed by the cluster's CA -- can
    neither read nor write etcd, even with etcd's CA certificate in hand (on the cluster's CA, a "trainer"
    certificate read the server key)."""
    trustme = pytest.importorskip("trustme")
    from helpers import issue

    from ecrec.control.etcd import EtcdClient, EtcdError, EtcdTLS
    cluster_ca, etcd_ca = trustme.CA(), trustme.CA()
    (tmp_path / "cluster").mkdir()
    (tmp_path / "etcd").mkdir()
    cluster_ca.cert_pem.write_to_path(str(tmp_path / "cluster" / "ca.pem"))
    etcd_ca.cert_pem.write_to_path(str(tmp_path / "etcd" / "ca.pem"))
    control = issue(etcd_ca, tmp_path / "etcd", "ecrec-control")
    etcd_options = {"etcd_ca": control["tls_ca"], "etcd_cert": control["tls_cert"], "etcd_key": control["tls_key"]}
    trainer = issue(cluster_ca, tmp_path / "cluster", "trainer")
    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, store="etcd", coordinators=2,
                         server_security=issue(cluster_ca, tmp_path / "cluster", "ecrec-server"),
                         coordinator_security=issue(cluster_ca, tmp_path / "cluster", "ecrec-coordinator"),
                         client_security=trainer, etcd_tls=issue(etcd_ca, tmp_path / "etcd", "etcd"),
                         coordinator_options=etcd_options, server_options=etcd_options)
    client = Cluster.connect(local.coordinator_address, config=local.client_config(rpc_timeout_s=60.0))
    client.create_table("t", ROWS, 4, optimizer="sgd", lr=1.0, init="zeros")
    initial = client.read_payload("t")[1].copy()
    counting_push(client, np.arange(ROWS))
    state_key = f"{local.etcd_prefix}/state".encode()
    assert local.etcd.client().get(state_key) is not None  # the control plane's certificate reads it
    for ca in (trainer["tls_ca"], control["tls_ca"]):  # trusting either CA: the handshake fails at etcd
        worker = EtcdClient(local.etcd.endpoints, timeout_s=2.0, tls=EtcdTLS(ca, trainer["tls_cert"],
                                                                            trainer["tls_key"]))
        with pytest.raises(EtcdError):
            worker.get(state_key)
        with pytest.raises(EtcdError):
            worker.put(f"{local.etcd_prefix}/servers/evil".encode(), b"x")
        worker.close()
    assert_counts(client, initial, np.ones(ROWS))


def test_etcd_tls_options_name_what_is_missing():
    from ecrec.config import CoordinatorConfig, ClusterSpec

    spec = ClusterSpec(num_servers=2)
    assert CoordinatorConfig(cluster=spec).etcd_tls_files() == (None, False)
    assert CoordinatorConfig(cluster=spec, tls_ca="c", tls_cert="a", tls_key="b").etcd_tls_files() == (("c", "a", "b"),
                                                                                                       True)
    assert CoordinatorConfig(cluster=spec, tls_ca="c", etcd_ca="e", etcd_cert="x",
                             etcd_key="y").etcd_tls_files() == (("e", "x", "y"), False)
    with pytest.raises(ValueError, match="--etcd-cert and --etcd-key go together"):
        CoordinatorConfig(cluster=spec, etcd_ca="e", etcd_cert="x").etcd_tls_files()
    with pytest.raises(ValueError, match="need --etcd-ca"):
        CoordinatorConfig(cluster=spec, etcd_cert="x", etcd_key="y").etcd_tls_files()


def test_a_followers_refusal_names_the_leader_and_only_a_dialable_one_is_followed():
    from ecrec.net.peers import NOT_LEADER, leader_named

    assert leader_named(f"{NOT_LEADER}; the leader is 10.0.0.7:7001; retry there") == "10.0.0.7:7001"
    assert leader_named(f"{NOT_LEADER}; the leader is [::1]:7001; retry there") == "[::1]:7001"
    assert leader_named(f"{NOT_LEADER}; the leader is being elected; retry there") == ""
    assert leader_named(f"{NOT_LEADER}; the leader is 0.0.0.0:7001; retry there") == ""  # a bind address
    assert leader_named("the change was not recorded: the leader is 10.0.0.7:7001") == ""


@pytest.mark.cluster
@needs_etcd
def test_a_client_given_a_follower_follows_the_leader_and_status_names_every_coordinator(make_cluster):
    """A user who knows one coordinator's address, not the leader's: tables are created through the follower's
    hint, training runs, and ``ecrec-server status`` asked of the follower lists both coordinators and the one that
    leads (``--json`` too)."""
    import json
    import subprocess
    import sys

    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, store="etcd", coordinators=2)
    _, leader = local.leading_coordinator()
    follower = next(a for a in local.coordinator_addresses if a != leader)
    client = Cluster.connect(follower, worker="one-address")
    try:
        client.create_table("t", ROWS, 4, optimizer="sgd", lr=1.0, init="zeros")
        counting_push(client, np.arange(ROWS))
        assert client.read_payload("t")[1][:, :4].min() == -1.0
    finally:
        client.close()
    out = subprocess.run([sys.executable, "-m", "ecrec.cli", "status", "--coordinator", follower],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{leader} (leads)" in out.stdout and follower in out.stdout and f"{follower} (leads)" not in out.stdout
    report = json.loads(subprocess.run([sys.executable, "-m", "ecrec.cli", "status", "--coordinator", follower,
                                        "--json"], capture_output=True, text=True, timeout=60).stdout)
    assert report["leader"] == leader and report["store"].startswith("etcd")
    assert sorted(c["address"] for c in report["coordinators"]) == sorted(local.coordinator_addresses)
    assert [c["address"] for c in report["coordinators"] if c["leads"]] == [leader]


def test_a_damaged_state_file_is_refused_by_name(tmp_path):
    """A state file cut short after its map (no server key) was taken: the coordinator made a new key, and every
    standby registered after it could not prove itself to the servers (its promotion retried for ever).  An
    empty or garbage file raised a raw DecodeError, or read as a map for 0 servers."""
    spec = ClusterSpec(num_servers=2, strategy="ecrec", k=1, m=1)
    path = tmp_path / "map.pb"
    keyless = coordinator_pb2.CoordinatorState()
    keyless.map.CopyFrom(cluster_pb2.ClusterMap(num_servers=2, strategy="ecrec", k=1, m=1, epoch=12))
    keyless.map.servers.add(server_id="s0", address="127.0.0.1:1", index=0)
    path.write_bytes(keyless.SerializeToString())
    with pytest.raises(ValueError, match=r"holds a map of 1 servers \(epoch 12\) but no server key: the file is damaged"):
        Coordinator(CoordinatorConfig(cluster=spec, state_path=str(path)))
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty, not a saved coordinator state"):
        Coordinator(CoordinatorConfig(cluster=spec, state_path=str(path)))
    path.write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ValueError, match="is not a saved coordinator state"):
        Coordinator(CoordinatorConfig(cluster=spec, state_path=str(path)))


def test_a_data_loss_reported_round_by_round_is_one_event_per_table_and_index():
    """A rebuild reports the stripes it cannot rebuild round by round (32768 rows a round): each report that added
    stripes was an event of its own -- 92 for one incident on a 3M-row table, the map's history (the last 1000
    events) soon holding nothing else, its failed and promoted events and their metrics gone."""
    from ecrec.wire import coordinator_pb2 as pb

    c = Coordinator(CoordinatorConfig(cluster=ClusterSpec(num_servers=2, strategy="ecrec", k=1, m=1)))
    with c.state.lock:
        for index in (0, 1):
            c.state.map.servers.add(index=index, server_id=f"s{index}", address=f"127.0.0.1:{index + 1}",
                                    state=cluster_pb2.RECOVERING)
    report = lambda index, first, n: c.ReportDataLoss(pb.ReportDataLossRequest(index=index, server_id=f"s{index}", lost=[
        cluster_pb2.DataLoss(table="big", stripes=range(first, first + n), stripe_count=n, indices=[0, 1])]), None)
    epoch = c.state.map.epoch
    for round_ in range(5):
        report(0, round_ * 100, 100)
    report(1, 0, 100)  # the other index reports stripes known: no change, no event
    report(1, 600, 50)  # and new ones: more of the same incident
    m = c.state.snapshot()
    assert [e.kind for e in m.events].count("data_loss") == 1, list(m.events)
    [loss] = m.data_loss
    assert loss.stripe_count == 550 and list(loss.indices) == [0, 1]
    assert m.epoch == epoch + 6  # every report that added stripes still reaches servers and status
    c.ReportDataLoss(pb.ReportDataLossRequest(index=0, server_id="s0", lost=[
        cluster_pb2.DataLoss(table="other", stripes=[3], stripe_count=1, indices=[0])]), None)
    assert [e.kind for e in c.state.snapshot().events].count("data_loss") == 2  # another table: news


@pytest.mark.cluster
@needs_etcd
def test_status_does_not_name_a_dead_leader_as_leading(make_cluster):
    """Right after the leading coordinator died, ``status`` listed it as live and leading (etcd keeps its key until
    its election lease ends): the listed coordinators were not asked, only named ones missing from the list."""
    from ecrec.ops import status

    local = make_cluster(servers=2, strategy="none", store="etcd", coordinators=2)
    pid, leader = local.leading_coordinator()
    local.kill(pid)
    report = status.collect(local.coordinator_address, timeout_s=2.0)
    assert leader in {c["address"] for c in report["coordinators_not_answering"]}, report
    text = status._coordinators_text(report)
    assert f"{leader} (leads)" not in text, text


def test_a_candidate_that_cannot_reach_etcd_keeps_saying_so(monkeypatch, caplog):
    """A coordinator pointed at an etcd it cannot reach (a wrong port, TLS it does not speak) warned once and then
    said nothing while it waited, for ever."""
    import logging
    import socket

    from ecrec.control import etcd

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(etcd, "ELECTION_REMIND_S", 0.4, raising=False)
    election = etcd.Election(etcd.EtcdClient([f"127.0.0.1:{port}"], timeout_s=0.2), b"/x/leader", b"me", ttl_s=2)
    stop = threading.Event()
    timer = threading.Timer(1.5, stop.set)
    timer.start()
    with caplog.at_level(logging.WARNING, logger="ecrec"):
        assert election.campaign(stop, poll_s=0.05) is False
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("election: ")]
    assert len(said) >= 2, said
    assert any("etcd unreachable for" in m and "--store endpoints" in m for m in said), said


def test_a_round_that_keeps_failing_the_same_way_is_not_a_flood(caplog):
    """A monitor round that raises is logged and the next one runs; one that keeps raising the same error was a
    traceback every round (twice a second)."""
    import logging
    import types

    from ecrec.control.cluster_state import rounds_while_leading

    state = types.SimpleNamespace(leading=threading.Event())
    state.leading.set()
    stop, wake, rounds = threading.Event(), threading.Event(), []

    def one_round():
        rounds.append(1)
        if len(rounds) >= 20:
            stop.set()
        raise RuntimeError("etcd said no")

    with caplog.at_level(logging.ERROR, logger="ecrec.coordinator"):
        rounds_while_leading(state, stop, wake, 0.01, one_round)
    assert len(rounds) == 20  # every round ran
    assert len([r for r in caplog.records if "a round of" in r.getMessage()]) == 1


def test_ecrec_etcd_may_name_a_command_on_path(monkeypatch, tmp_path):
    """``ECREC_ETCD=etcd`` (a command name, found on PATH as Popen would) was refused once the variable was checked
    for a file."""
    from ecrec.control.etcd_local import etcd_binary

    binary = tmp_path / "etcd-test-build"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("ECREC_ETCD", "etcd-test-build")
    assert etcd_binary() == str(binary)
    monkeypatch.setenv("ECREC_ETCD", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no executable file there"):
        etcd_binary()


def test_a_coordinator_restarted_on_its_map_file_with_a_shorter_lease_waits_out_the_leases_granted_before(tmp_path):
    """A server keeps the longer of two grants: restarted with --lease-s 3 on a map whose servers were granted 60 s,
    the coordinator waited 3 s before promoting over one, which could serve 57 s more (two servers on an index).
    It waits the saved length now, keeps it in the map for a second restart, and a renewal at 3 s shortens no
    earlier grant."""
    from ecrec.config import MIN_LEASE_S
    from ecrec.control.coordinator import MIN_ETCD_TIMEOUT_S, etcd_timeout_s

    spec, path = ClusterSpec(num_servers=2), str(tmp_path / "map.pb")
    first = Coordinator(CoordinatorConfig(cluster=spec, state_path=path, lease_s=60.0))
    with first.state.lock:
        first.map.servers.add(server_id="s1", address="127.0.0.1:9", index=0, state=cluster_pb2.ACTIVE)
        first.state.bump_locked()
        first.state.save_locked()
    second = Coordinator(CoordinatorConfig(cluster=spec, state_path=path, lease_s=3.0))
    assert second.map.lease_s == 60.0 and second.state.lease_wait_s == 60.0
    s1 = [s for s in second.map.servers if s.server_id == "s1"]
    assert second.state.leases["s1"] >= time.monotonic() + 59.0
    reply = second.RenewLease(coordinator_pb2.RenewLeaseRequest(server_id="s1", index=0), None)
    assert reply.granted and reply.lease_s == 3.0  # granted leases are the new length
    assert second.state.leases["s1"] >= time.monotonic() + 59.0  # ... and shorten no earlier one
    assert not second.promoter.safe_to_replace(s1, None)
    with second.state.lock:
        second.state.save_locked()
    third = Coordinator(CoordinatorConfig(cluster=spec, state_path=path, lease_s=3.0))
    assert third.state.lease_wait_s == 60.0
    # once those longer leases have run out, the map goes back to --lease-s (a restart later waits only that)
    short = Coordinator(CoordinatorConfig(cluster=spec, state_path=str(tmp_path / "short.pb"), lease_s=2.0))
    with short.state.lock:
        short.map.servers.add(server_id="s2", address="127.0.0.1:8", index=0, state=cluster_pb2.ACTIVE)
        short.state.bump_locked()
        short.state.save_locked()
    restarted = Coordinator(CoordinatorConfig(cluster=spec, state_path=str(tmp_path / "short.pb"), lease_s=0.5))
    with restarted.state.lock:
        restarted.state.save_locked()  # within the 2 s: kept
    assert Coordinator(CoordinatorConfig(cluster=spec, state_path=str(tmp_path / "short.pb"),
                                         lease_s=0.5)).state.lease_wait_s == 2.0
    time.sleep(2.1)
    with restarted.state.lock:
        restarted.state.save_locked()
    assert restarted.map.lease_s == 0.5
    assert Coordinator(CoordinatorConfig(cluster=spec, state_path=str(tmp_path / "short.pb"),
                                         lease_s=0.5)).state.lease_wait_s == 0.5
    fresh = Coordinator(CoordinatorConfig(cluster=spec, state_path=str(tmp_path / "new.pb"), lease_s=3.0))
    assert fresh.state.lease_wait_s == 3.0 and fresh.map.lease_s == 3.0
    # a lease too short to serve between renewals, and an etcd deadline taken from a tiny health check: refused,
    # floored
    with pytest.raises(ValueError, match=f"--lease-s 0.01: at least {MIN_LEASE_S:g} s"):
        CoordinatorConfig(cluster=spec, lease_s=0.01)
    assert etcd_timeout_s(CoordinatorConfig(cluster=spec, health_timeout_s=0.005)) == MIN_ETCD_TIMEOUT_S
    assert etcd_timeout_s(CoordinatorConfig(cluster=spec)) == 1.5  # two health checks, at most half the TTL
