"""What a caller can make a server keep or do is bounded in bytes, and a bound is never kept by forgetting.

Real processes on 127.0.0.1, raw stubs where the SDK would refuse the request before sending it.  Huge worker
names are refused and leave every server's memory as it was; a flood of worker incarnations is refused once the
table of applied pushes is full, so an honest worker's retry of a confirmed push is still answered "already
applied"; a pull naming too many ids, or asking for a reply larger than a message, is refused before anything
is read; an epoch the coordinator never issued is refused.  The counting workload of ``test_safety``.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from ecrec.net import transport
from ecrec.wire import embedding_pb2, embedding_pb2_grpc
from helpers import refused
from helpers import DIM, ROWS, assert_counts, counting_push, start

pytestmark = pytest.mark.cluster

IA, RE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def stub_of(client, index: int):
    address = next(s.address for s in client.refresh_map().servers if s.index == index)
    return embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(address))


def owned(client, index: int) -> np.ndarray:
    return np.flatnonzero(client.layout.locate(np.arange(ROWS))[0] == index)


def push_request(ids, worker: str, sequence: int, incarnation: str = "", grad: float = 1.0, dim: int = 4):
    ids = np.asarray(ids, np.int64)
    return embedding_pb2.PushRequest(
        tables=[embedding_pb2.TableGrads(table="t", ids=transport.ids_to_bytes(ids),
                                         grads=np.full((len(ids), dim), grad, np.float32).tobytes())],
        push_id=embedding_pb2.PushId(worker=worker, sequence=sequence, incarnation=incarnation))


def test_pushes_with_huge_worker_names_are_refused_and_no_server_grows(make_cluster):
    """150 pushes whose worker name (or incarnation) is 2 MiB: each refused with INVALID_ARGUMENT, no row
    changes, and no server's resident memory grows by 64 MiB (it grew by hundreds when they were kept)."""
    local, client, initial = start(make_cluster, servers=3)
    counts = np.zeros(ROWS)
    for _ in range(3):  # warm: every path has run once
        counting_push(client, np.arange(ROWS))
        counts += 1
    pids = [p.pid for p in local.server_procs]
    stub, mine = stub_of(client, 0), owned(client, 0)
    huge = "w" * (2 << 20)

    def refuse_huge(first: int) -> None:
        for n in range(first, first + 150):
            request = (push_request(mine, huge, n + 1) if n % 2 else
                       push_request(mine, "w", n + 1, incarnation=huge))
            refused(lambda: stub.Push(request, timeout=30), IA, "bytes")

    # warm the refusal too: the allocator keeps the heaps its 2 MiB buffers came from (more of them on a busy
    # machine, one per thread that met one), which is not the growth measured here (kept names: 300 MiB per 150)
    refuse_huge(0)
    before = {pid: rss_bytes(pid) for pid in pids}
    refuse_huge(150)
    for _ in range(3):  # training goes on
        counting_push(client, np.arange(ROWS))
        counts += 1
    grown = {pid: rss_bytes(pid) - before[pid] for pid in pids}
    print("RSS growth (MiB):", {pid: round(g / 2**20, 1) for pid, g in grown.items()})
    assert all(g < 64 << 20 for g in grown.values()), grown
    assert_counts(client, initial, counts)


def test_a_flood_of_incarnations_is_refused_and_a_confirmed_push_never_applies_twice(make_cluster):
    """The table of applied pushes is bounded in bytes (here 64 KiB): once full, a new worker incarnation is
    refused with RESOURCE_EXHAUSTED and nothing is forgotten, so an honest worker's retry of a push applied and
    confirmed before the flood is still answered "already applied", and known workers keep training."""
    local, client, initial = start(make_cluster, servers=3, server_options={"max_applied_bytes": 64 << 10})
    counts = np.zeros(ROWS)
    counting_push(client, np.arange(ROWS))
    counts += 1
    stub, mine = stub_of(client, 0), owned(client, 0)
    honest = push_request(mine, "honest", 1, incarnation="a1")
    assert not stub.Push(honest, timeout=30).already_applied
    counts[mine] += 1
    for _ in range(2):  # the honest push is confirmed (its parity applied everywhere) by later pushes
        counting_push(client, np.arange(ROWS))
        counts += 1
    flooded = 0
    for n in range(2_000):
        try:
            stub.Push(push_request(mine, "flood", 1, incarnation=f"{n:064d}"), timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() == RE and "--max-applied-bytes" in exc.details(), exc.details()
            break
        flooded += 1
        counts[mine] += 1
    again = stub.Push(honest, timeout=30)  # the retry of a confirmed push after the flood
    assert again.already_applied and again.rows_updated == 0, "a confirmed push applied twice after a flood"
    assert 50 < flooded < 1_000, f"{flooded} incarnations admitted into a table of 64 KiB"
    refused(lambda: stub.Push(push_request(mine, "flood", 1, incarnation="z" * 64), timeout=30), RE,
            "--max-applied-bytes")
    for _ in range(2):  # a known worker keeps training
        counting_push(client, np.arange(ROWS))
        counts += 1
    assert_counts(client, initial, counts)


def test_a_pull_of_too_many_ids_or_too_large_a_reply_is_refused(make_cluster):
    """Ids per request are counted with their repeats; a reply that would not fit in one message is refused
    before it is allocated; both name their bound."""
    local, client, initial = start(make_cluster, servers=3,
                                   server_options={"max_ids_per_request": 100_000, "max_message_bytes": 1 << 20})
    stub, mine = stub_of(client, 0), owned(client, 0)

    def pull(n):
        ids = np.resize(mine, n).astype(np.int64)  # one row many times
        return lambda: stub.Pull(embedding_pb2.PullRequest(tables=[embedding_pb2.TableIds(
            table="t", ids=transport.ids_to_bytes(ids))]), timeout=30)

    assert len(pull(1_000)().values[0]) == 1_000 * 16
    refused(pull(100_001), IA, "100001 row ids", "--max-ids-per-request")
    too_many = push_request(np.resize(mine, 100_001), "w", 1)
    too_many.tables[0].grads = b""  # the count is checked first (and the gradients would not fit in a message)
    refused(lambda: stub.Push(too_many, timeout=30), IA, "--max-ids-per-request")
    refused(pull(70_000), IA, "--max-message-bytes")  # 70,000 rows of 16 bytes: more than 1 MiB
    counting_push(client, np.arange(ROWS))
    assert_counts(client, initial, np.ones(ROWS))


def test_an_epoch_never_issued_is_refused(make_cluster):
    """A request epoch far above the coordinator's makes the server fetch the map once, then is refused; calls
    at the current epoch go on."""
    local, client, initial = start(make_cluster, servers=3)
    stub, mine = stub_of(client, 0), owned(client, 0)
    request = embedding_pb2.PullRequest(epoch=1 << 62, tables=[embedding_pb2.TableIds(
        table="t", ids=transport.ids_to_bytes(mine[:2].astype(np.int64)))])
    t0 = time.monotonic()
    for _ in range(50):
        refused(lambda: stub.Pull(request, timeout=30), IA, "never issued")
    assert time.monotonic() - t0 < 20
    counting_push(client, np.arange(ROWS))
    assert_counts(client, initial, np.ones(ROWS))


def test_an_epoch_issued_after_the_servers_last_fetch_is_accepted(make_cluster):
    """A server that fetched the map moments ago (a caller's newer epoch made it) is not the judge of a newer
    epoch still: the coordinator may have issued it since.  With the refresh interval at 3 s, a table created
    right after such a fetch is written at once at its new epoch (the server waits out the interval and fetches
    again) -- while an epoch no map holds is still refused."""
    local, client, initial = start(make_cluster, servers=3, server_options={"map_refresh_interval_s": 3.0})
    stub, mine = stub_of(client, 0), owned(client, 0)
    forged = embedding_pb2.PullRequest(epoch=1 << 62, tables=[embedding_pb2.TableIds(
        table="t", ids=transport.ids_to_bytes(mine[:2].astype(np.int64)))])
    refused(lambda: stub.Pull(forged, timeout=30), IA, "never issued")  # every server fetched just now? server 0 did
    for index in (1, 2):
        refused(lambda: stub_of(client, index).Pull(forged, timeout=30), IA, "never issued")
    client.create_table("fresh", 64, DIM, optimizer="sgd", lr=1.0, init="zeros")  # a new epoch, within the 3 s
    values = np.arange(64 * DIM, dtype=np.float32).reshape(64, DIM)
    client.write_rows("fresh", np.arange(64), values)  # a push at the new epoch to every server
    np.testing.assert_array_equal(client.pull("fresh", np.arange(64)).numpy(), values)
    refused(lambda: stub.Pull(forged, timeout=30), IA, "never issued")
    counting_push(client, np.arange(ROWS))
    assert_counts(client, initial, np.ones(ROWS))


def test_a_table_or_dense_tensor_beyond_a_servers_memory_bound_is_refused_and_nothing_is_created(make_cluster):
    """Every server (and standby) holds a shard of every table: one near a server's memory would take them all
    down at once.  The coordinator refuses a table, or a dense tensor, that would take the map's demand on one
    server (rows with optimizer state, times 1 + m for parity) beyond ``--max-server-bytes``: RESOURCE_EXHAUSTED
    naming the bytes and the bound, no table in the map, no server holding any of it."""
    import torch

    from ecrec.client import Cluster, ClusterError

    local = make_cluster(servers=2, strategy="ecrec", k=1, m=1, coordinator_options={"max_server_bytes": 1 << 20})
    client = Cluster.connect(local.coordinator_address)
    client.create_table("a", 4096, 8, optimizer="adagrad")  # 2048 rows of 64 bytes, twice: 256 KiB a server
    with pytest.raises(ClusterError, match=r"RESOURCE_EXHAUSTED.*table 'b' would need 1048576 bytes.*"
                                           r"--max-server-bytes.*nothing created"):
        client.create_table("b", 16384, 8, optimizer="adagrad")
    with pytest.raises(ClusterError, match=r"dense tensor 'big.weight' would need .*--max-server-bytes"):
        client.register_dense(torch.nn.Linear(512, 512), prefix="big.")
    assert [t.name for t in client.refresh_map().tables] == ["a"] and not client.map.dense
    stats = client.strategy_call("stats")
    assert all(s["server"]["data_rows"] == 2048 for s in stats.values()), stats
    client.create_table("c", 4096, 8, optimizer="adagrad")  # what fits is still created
    client.register_dense(torch.nn.Linear(4, 2), prefix="small.")
    assert [t.name for t in client.refresh_map().tables] == ["a", "c"]


def test_idle_incarnations_are_forgotten_to_admit_new_ones_and_their_pushes_are_then_refused(make_cluster):
    """Made-up incarnations filled the table of applied pushes until every new worker was refused, for good.  Now
    marks idle past ``--forget-idle-marks-s`` (3 s here) with every push confirmed are forgotten to admit new
    incarnations; a push of a forgotten incarnation -- the honest worker's retry of its confirmed push -- is
    refused (FAILED_PRECONDITION), never applied twice; a known worker trains throughout."""
    local, client, initial = start(make_cluster, servers=3, server_options={"max_applied_bytes": 16 << 10,
                                                                            "forget_idle_marks_s": 3.0})
    counts = np.zeros(ROWS)
    counting_push(client, np.arange(ROWS))
    counts += 1
    stub, mine = stub_of(client, 0), owned(client, 0)
    honest = push_request(mine, "honest", 1, incarnation="a1")
    assert not stub.Push(honest, timeout=30).already_applied
    counts[mine] += 1
    from ecrec.client import Cluster
    sleeper = Cluster.connect(local.coordinator_address, worker="sleeper")  # an SDK worker that goes idle
    counting_push(sleeper, np.arange(ROWS))
    counts += 1
    first_incarnation = sleeper.incarnation
    for _ in range(2):  # confirmed by later pushes
        counting_push(client, np.arange(ROWS))
        counts += 1

    def flood(first: int) -> int:
        n = first
        while True:
            try:
                stub.Push(push_request(mine, "flood", 1, incarnation=f"{n:064d}"), timeout=30)
            except grpc.RpcError as exc:
                assert exc.code() == RE and "--forget-idle-marks-s" in exc.details(), exc.details()
                return n - first
            counts[mine] += 1
            n += 1
            if n - first > 1_000:
                raise AssertionError("the table took 1,000 incarnations of its 16 KiB")

    full = flood(0)  # nothing idle yet: refused once full, as before (a flood of ~30 takes well under 3 s)
    assert full > 10
    time.sleep(3.5)  # everything idle now (the counting worker too, between its pushes)
    counting_push(client, np.arange(ROWS))  # a known worker: its mark moves, it is not idle
    counts += 1
    more = flood(full)
    assert more > 10, f"only {more} new incarnations admitted after the old ones went idle"
    refused(lambda: stub.Push(honest, timeout=30), grpc.StatusCode.FAILED_PRECONDITION, "forgot worker incarnation")
    refused(lambda: stub.Push(push_request(mine, "honest", 2, incarnation="a1"), timeout=30),
            grpc.StatusCode.FAILED_PRECONDITION, "start a new incarnation")
    time.sleep(3.5)  # the flood idle too: room for a new incarnation
    counting_push(sleeper, np.arange(ROWS))  # the SDK goes on under a new incarnation where it was forgotten
    counts += 1
    assert sleeper.incarnation != first_incarnation
    sleeper.close()
    for _ in range(2):
        counting_push(client, np.arange(ROWS))
        counts += 1
    assert_counts(client, initial, counts)
