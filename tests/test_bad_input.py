"""Every bad request gets a clear gRPC status with a message and changes nothing.

Requests are sent to real server processes with raw stubs (the SDK would refuse most of
them before sending); after each, every server's rows and dense payloads are compared
with a snapshot taken before.  Under strategy ``ecrec`` the snapshot also holds the parity
side: every parity row still equals a fresh encode of its stripe, and no server built,
sent or logged a parity batch for a refused push.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from ecrec.net import transport
from ecrec.client import Cluster, ClusterError
from ecrec.wire import cluster_pb2, coordinator_pb2, coordinator_pb2_grpc, embedding_pb2, embedding_pb2_grpc

pytestmark = pytest.mark.cluster

ROWS, DIM = 50, 4


@pytest.fixture(scope="module", params=["none", "ecrec"])
def env(request):
    from ecrec.ops.local import LocalCluster, LocalClusterSpec

    extra = {"k": 1, "m": 1} if request.param == "ecrec" else {}
    local = LocalCluster(LocalClusterSpec(servers=2, host="127.0.0.1", strategy=request.param, **extra)).start()
    try:
        client = Cluster.connect(local.coordinator_address)
        client.create_table("t", ROWS, DIM, optimizer="adagrad", lr=0.1)
        client.register_dense(torch.nn.Linear(3, 2), prefix="mlp.")
        yield local, client
    finally:
        local.close()


def stub_for(client, index):
    address = next(s.address for s in client.map.servers if s.index == index)
    return embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(address))


PARITY_COUNTERS = ("batches_built", "relay_batches", "log_entries", "unconfirmed_pushes", "confirmed_upto")


def snapshot(client):
    ids, payload = client.read_payload("t")
    dense = {n: client.read_dense_payload(n) for n in ("mlp.weight", "mlp.bias")}
    return ids, payload.copy(), dense, parity_state(client)


def parity_state(client):
    """Under ``ecrec``: each server's parity counters, after checking every parity row against a fresh encode."""
    if client.map.strategy != "ecrec":
        return None
    verify = client.strategy_call("verify_parity")
    assert all(v["mismatched"] == 0 and v["checked"] > 0 for v in verify.values()), verify
    return {i: {k: s.get(k, 0) for k in PARITY_COUNTERS} for i, s in client.strategy_call("stats").items()}


def assert_unchanged(client, before, description=""):
    after = snapshot(client)
    np.testing.assert_array_equal(after[0], before[0], err_msg=description)
    np.testing.assert_array_equal(after[1], before[1], err_msg=description)
    for n in before[2]:
        np.testing.assert_array_equal(after[2][n], before[2][n], err_msg=description)
    assert after[3] == before[3], description


def owned(client, index, n=3):
    servers, _ = client.layout.locate(np.arange(ROWS))
    return np.flatnonzero(servers == index)[:n]


def push(ids, grads=None, table="t", worker="w", seq=1, dense=()):
    ids = np.asarray(ids, dtype=np.int64)
    grads = np.ones((len(ids), DIM), np.float32) if grads is None else grads
    return embedding_pb2.PushRequest(
        tables=[embedding_pb2.TableGrads(table=table, ids=transport.ids_to_bytes(ids), grads=np.asarray(grads).tobytes())],
        dense=list(dense), push_id=embedding_pb2.PushId(worker=worker, sequence=seq))


def expect_error(call, code, words):
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    for w in words:
        assert w in info.value.details(), info.value.details()


def bad_pushes(client):
    """(description, index, request, status, words in the message)."""
    mine, other = owned(client, 0), owned(client, 1)
    IA, NF, FP = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION
    nan = np.ones((len(mine), DIM), np.float32)
    nan[1, 2] = np.nan
    inf = np.ones((len(mine), DIM), np.float32)
    inf[0, 0] = np.inf
    primary = client.layout.dense_servers("mlp.weight")[0]
    good_dense = embedding_pb2.DenseValue(name="mlp.weight", value=np.ones(6, np.float32).tobytes())
    return [
        ("unknown table", 0, push(mine, table="nope"), NF, ["nope"]),
        ("id out of range", 0, push([ROWS + 7]), IA, ["out of range", str(ROWS + 7)]),
        ("negative id", 0, push([-1]), IA, ["-1", "out of range"]),
        ("wrong dimension", 0, push(mine, np.ones((len(mine), DIM + 1), np.float32)), IA, ["gradient bytes"]),
        ("NaN gradient", 0, push(mine, nan), IA, ["NaN"]),
        ("Inf gradient", 0, push(mine, inf), IA, ["Inf"]),
        ("empty push", 0, embedding_pb2.PushRequest(push_id=embedding_pb2.PushId(worker="w", sequence=1)), IA, ["empty push"]),
        ("no ids", 0, push([]), IA, ["no row ids"]),
        ("ids not int64 bytes", 0, embedding_pb2.PushRequest(
            tables=[embedding_pb2.TableGrads(table="t", ids=b"\x01\x02\x03", grads=b"")],
            push_id=embedding_pb2.PushId(worker="w", sequence=1)), IA, ["multiple of 8"]),
        ("push to a non-owner", 0, push(other), FP, ["owned by server 1"]),
        ("missing push id", 0, embedding_pb2.PushRequest(tables=push(mine).tables), IA, ["push_id"]),
        ("more parts than servers", 0, embedding_pb2.PushRequest(tables=push(mine).tables, parts=3,
                                                                  push_id=embedding_pb2.PushId(worker="w", sequence=4)),
         IA, ["push parts 3", "2 servers"]),
        ("worker name too long", 0, push(mine, worker="w" * 257), IA, ["longer than 256 bytes", "--max-worker-name-bytes"]),
        ("worker name too long in UTF-8", 0, push(mine, worker="\u00e9" * 129), IA, ["--max-worker-name-bytes"]),
        ("worker name of 2 MiB", 0, push(mine, worker="w" * (2 << 20)), IA, ["--max-worker-name-bytes"]),
        ("worker name with a newline", 0, push(mine, worker="w\n1"), IA, ["control character", "push refused"]),
        ("worker name reversed by a text-direction control", 0, push(mine, worker="w\u202e1"), IA,
         ["text-direction formatting character", "U+202E", "push refused"]),
        ("incarnation too long", 0, embedding_pb2.PushRequest(tables=push(mine).tables, push_id=embedding_pb2.PushId(
            worker="w", sequence=1, incarnation="i" * 65)), IA, ["longer than 64 bytes", "--max-incarnation-bytes"]),
        ("valid table + invalid table in one push", 0, embedding_pb2.PushRequest(
            tables=[push(mine).tables[0], push(mine, table="nope").tables[0]],
            push_id=embedding_pb2.PushId(worker="w", sequence=9)), NF, ["nope"]),
        ("valid rows + NaN dense gradient", primary, push(owned(client, primary), dense=[embedding_pb2.DenseValue(
            name="mlp.weight", value=np.full(6, np.nan, np.float32).tobytes())]), IA, ["NaN"]),
        ("dense gradient of wrong size", primary, embedding_pb2.PushRequest(dense=[embedding_pb2.DenseValue(
            name="mlp.weight", value=np.ones(5, np.float32).tobytes())], push_id=embedding_pb2.PushId(worker="w", sequence=2)),
         IA, ["24 gradient bytes"]),
        # without replicas the other server has no such tensor; with ecrec it holds a backup, not the primary
        ("dense push to a non-primary", 1 - primary, embedding_pb2.PushRequest(
            dense=[good_dense], push_id=embedding_pb2.PushId(worker="w", sequence=3)),
         *((FP, [f"server {1 - primary} is not the primary of 'mlp.weight'"]) if client.map.strategy == "ecrec"
           else (NF, ["unknown dense tensor 'mlp.weight'"]))),
    ]


def test_bad_pushes_are_refused_and_change_nothing(env):
    _, client = env
    before = snapshot(client)
    for description, index, request, code, words in bad_pushes(client):
        expect_error(lambda: stub_for(client, index).Push(request, timeout=10), code, words)
        assert_unchanged(client, before, description)


def test_bad_pulls(env):
    _, client = env
    stub = stub_for(client, 0)
    IA = grpc.StatusCode.INVALID_ARGUMENT
    pull = lambda ids, table="t": embedding_pb2.PullRequest(tables=[embedding_pb2.TableIds(table=table, ids=transport.ids_to_bytes(np.asarray(ids, np.int64)))])
    expect_error(lambda: stub.Pull(pull([1], "nope"), timeout=10), grpc.StatusCode.NOT_FOUND, ["nope"])
    expect_error(lambda: stub.Pull(pull([ROWS]), timeout=10), IA, ["out of range"])
    expect_error(lambda: stub.Pull(embedding_pb2.PullRequest(), timeout=10), IA, ["empty pull"])
    expect_error(lambda: stub.Pull(pull(owned(client, 1)), timeout=10), grpc.StatusCode.FAILED_PRECONDITION, ["owned by server 1"])


def test_malformed_message_is_refused(env):
    _, client = env
    address = next(s.address for s in client.map.servers if s.index == 0)
    channel = transport.make_channel(address)
    raw = channel.unary_unary("/ecrec.wire.EmbeddingServer/Push", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    before = snapshot(client)
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff\xff\xff not a protobuf", timeout=10)
    # grpc refuses it before any handler runs
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INTERNAL, "Exception deserializing request!")
    assert_unchanged(client, before, "malformed Push")


def test_retried_push_applied_once(env):
    _, client = env
    stub = stub_for(client, 0)
    before = snapshot(client)
    request = push(owned(client, 0, 2), worker="retry-test", seq=42)
    first = stub.Push(request, timeout=10)
    middle = snapshot(client)
    second = stub.Push(request, timeout=10)
    assert not first.already_applied and second.already_applied and first.rows_updated == 2
    assert not np.array_equal(middle[1], before[1])
    np.testing.assert_array_equal(snapshot(client)[1], middle[1])


def test_table_spec_conflicts(env):
    local, client = env
    again = client.create_table("t", ROWS, DIM, optimizer="adagrad", lr=0.1)  # identical: fine
    assert again.num_rows == ROWS
    with pytest.raises(ClusterError, match="different spec"):
        client.create_table("t", ROWS, DIM + 1, optimizer="adagrad", lr=0.1)
    stub = coordinator_pb2_grpc.CoordinatorStub(transport.make_channel(local.coordinator_address))
    expect_error(lambda: stub.CreateTable(cluster_pb2.TableSpec(name="z", num_rows=-5, dim=4, optimizer="sgd", lr=0.1,
                                                                init="uniform"), timeout=10),
                 grpc.StatusCode.INVALID_ARGUMENT, ["num_rows"])
    expect_error(lambda: stub.CreateTable(cluster_pb2.TableSpec(name="z", num_rows=5, dim=4, optimizer="adamw", lr=0.1,
                                                                init="uniform"), timeout=10),
                 grpc.StatusCode.INVALID_ARGUMENT, ["adamw"])
    # a name that writes a line of its own into the coordinator's log (any worker could), or a NUL
    for name in ("a\nb", "a\x00b"):
        expect_error(lambda: stub.CreateTable(cluster_pb2.TableSpec(name=name, num_rows=5, dim=4, optimizer="sgd",
                                                                    lr=0.1, init="uniform"), timeout=10),
                     grpc.StatusCode.INVALID_ARGUMENT, ["control or format character"])
    names = [t.name for t in stub.GetClusterMap(coordinator_pb2.GetClusterMapRequest(), timeout=10).tables]
    assert names == ["t"]


def test_client_side_errors(env):
    _, client = env
    with pytest.raises(IndexError, match="out of range"):
        client.pull("t", [ROWS])
    with pytest.raises(TypeError, match="integers"):
        client.pull("t", np.array([0.5]))
    with pytest.raises(KeyError, match="nope"):
        client.pull("nope", [0])


def test_no_ids_give_an_empty_result_and_huge_unsigned_ids_are_named_as_they_are(env):
    """``[]`` (float64 to numpy) is no ids, as an empty int64 array is: pull and read_rows give ``(0, dim)``,
    write_rows writes nothing; an unsigned id beyond int64 is refused naming it, not its wrapped -1."""
    _, client = env
    before = client.read_payload("t")[1].copy()
    for ids in ([], (), np.array([], dtype=np.int64), torch.tensor([], dtype=torch.int64)):
        assert tuple(client.pull("t", ids).shape) == (0, DIM)
        assert client.pull_many({"t": ids})["t"].shape[0] == 0
        assert len(client.read_rows("t", ids)) == 0
    assert client.write_rows("t", [], np.zeros((0, DIM), np.float32)) == 0
    with pytest.raises(IndexError, match=str(2**64 - 1)):
        client.pull("t", np.array([2**64 - 1], dtype=np.uint64))
    np.testing.assert_array_equal(client.read_payload("t")[1], before)  # nothing changed


def test_a_step_every_server_refuses_says_nothing_was_applied():
    from ecrec.client import StepPartlyApplied

    text = str(StepPartlyApplied(7, {}, {0: "INVALID_ARGUMENT: non-finite", 1: "INVALID_ARGUMENT: non-finite"}))
    assert "nothing applied anywhere" in text and "partly" not in text and "server 1" in text
    text = str(StepPartlyApplied(7, {1: 3}, {0: "INVALID_ARGUMENT: non-finite"}))
    assert "partly applied" in text and "server 1 (3 rows)" in text and "do not retry" in text


def test_a_step_with_a_nan_in_one_row_applies_nowhere(env):
    """One row's gradient holds a NaN: ``step()`` refused it before sending, naming the table, and no server
    applied any part of the step (the server holding the NaN row refused its part while the other applied
    its own, and the step's other gradients were dropped); the gradients are kept until ``zero_grad()``, then a
    clean step applies everywhere."""
    from ecrec.client import EmbeddingBag

    _, client = env
    before = snapshot(client)
    bag = EmbeddingBag(client, "t", mode="sum")
    ids = torch.arange(ROWS)[None, :]  # every row: both servers hold some
    others = torch.tensor([[i for i in range(ROWS) if i != 7]])
    (bag(others).sum() + bag(torch.tensor([[7]])).sum() * float("nan")).backward()  # row 7's gradient: NaN
    with pytest.raises(ClusterError, match="'t' holds NaN or Inf.*no server applied"):
        client.step()
    assert_unchanged(client, before, "a step with a NaN gradient")
    with pytest.raises(ClusterError, match="NaN or Inf"):  # still held: the same step again is refused again
        client.step()
    client.zero_grad()
    bag(ids).sum().backward()
    result = client.step()
    assert result["servers"] == 2 and result["rows"] == ROWS


def test_an_update_whose_result_would_not_be_finite_is_refused_whole(env):
    """A finite gradient of 1e20 on an Adagrad row makes its accumulator ``inf`` (every later snapshot then
    failed to load: "state must be finite").  A server refuses such a push whole -- rows, other tables and
    dense tensors alike -- before it writes anything; ``step()`` refuses a gradient beyond what the optimizer
    keeps finite before it sends anything."""
    from ecrec.client import EmbeddingBag

    _, client = env
    client.register_dense(torch.nn.Linear(2, 1), optimizer="adagrad", lr=0.1, prefix="ada.")
    before = snapshot(client)
    mine = owned(client, 0)
    huge = np.ones((len(mine), DIM), np.float32)
    huge[1, 3] = 1e20
    expect_error(lambda: stub_for(client, 0).Push(push(mine, huge, seq=101), timeout=10),
                 grpc.StatusCode.INVALID_ARGUMENT, ["non-finite", "nothing applied"])
    assert_unchanged(client, before, "a gradient of 1e20 on an adagrad row")
    primary = client.layout.dense_servers("ada.weight")[0]
    rows_and_dense = push(owned(client, primary), seq=102, dense=[embedding_pb2.DenseValue(
        name="ada.weight", value=np.full(2, 1e20, np.float32).tobytes())])
    ada = client.read_dense_payload("ada.weight").copy()
    expect_error(lambda: stub_for(client, primary).Push(rows_and_dense, timeout=10),
                 grpc.StatusCode.INVALID_ARGUMENT, ["dense tensor 'ada.weight'", "non-finite"])
    assert_unchanged(client, before, "valid rows with a dense gradient that overflows")  # the rows too
    np.testing.assert_array_equal(client.read_dense_payload("ada.weight"), ada)

    bag = EmbeddingBag(client, "t", mode="sum")
    pushes = client.stats["pushes"]
    (bag(torch.tensor([[0, 1]])).sum() * 1e20).backward()
    with pytest.raises(ClusterError, match="'t' reaches 1e\\+20, beyond what its optimizer.*no server applied"):
        client.step()
    assert client.stats["pushes"] == pushes
    assert_unchanged(client, before, "step() with a gradient of 1e20")
    client.zero_grad()


def test_a_part_refused_for_its_content_is_reported_with_what_was_applied(env, tmp_path):
    """What only a server can judge -- a gradient that overflows given the row's accumulated state -- is refused
    by that server for its whole part while the other server applies its own: the step raises
    ``StepPartlyApplied`` naming both, the refusing server's rows are unchanged and finite, and a snapshot of
    the cluster still loads."""
    from ecrec.client import EmbeddingBag, StepPartlyApplied

    _, client = env
    r0, r1 = int(owned(client, 0)[0]), int(owned(client, 1)[0])
    grads = np.zeros((1, DIM), np.float32)
    grads[0, 0] = 1.5e19  # under what adagrad keeps finite alone (1.8e19): the accumulator becomes 2.25e38
    stub_for(client, 0).Push(push([r0], grads, worker="pump", seq=1), timeout=10)
    bag = EmbeddingBag(client, "t", mode="sum")
    def rows():
        ids, payload = client.read_payload("t")
        return payload[np.searchsorted(ids, [r0, r1])].copy()

    before = rows()
    weight = bag(torch.tensor([[r0]])).sum() * 0  # the row's first element gets 1.5e19 again: 4.5e38 overflows
    (bag(torch.tensor([[r0]]))[0, 0] * 1.5e19 + bag(torch.tensor([[r1]])).sum() + weight).backward()
    with pytest.raises(StepPartlyApplied) as info:
        client.step()
    assert set(info.value.applied) == {1} and info.value.applied[1] == 1, info.value.applied
    assert set(info.value.refused) == {0} and "non-finite" in info.value.refused[0], info.value.refused
    assert "do not retry" in str(info.value)
    after = rows()
    np.testing.assert_array_equal(after[0], before[0])  # refused: unchanged
    assert not np.array_equal(after[1], before[1])  # applied
    ids, payload = client.read_payload("t")
    assert np.isfinite(payload.view(np.float32)).all()
    parity_state(client)  # parity still the encoding of the rows
    client.save(str(tmp_path / "snap"))
    client.load(str(tmp_path / "snap"))  # refused "state must be finite" when an accumulator became inf
    np.testing.assert_array_equal(client.read_payload("t")[1], payload)


def test_an_echo_cannot_ask_for_a_huge_reply(env):
    """``Echo`` with ``reply_bytes`` of 200 MiB (under the 256 MiB message limit): a 5-byte request made the server
    allocate and send 200 MB (four of them: +1.4 GB); refused now, a measurement-sized one still answered."""
    _, client = env
    stub = stub_for(client, 0)
    expect_error(lambda: stub.Echo(embedding_pb2.EchoMessage(reply_bytes=200 << 20), timeout=30),
                 grpc.StatusCode.INVALID_ARGUMENT, ["Echo's bound"])
    assert len(stub.Echo(embedding_pb2.EchoMessage(reply_bytes=1000), timeout=10).data) == 1000


def test_all_rows_cannot_ask_for_more_than_a_message(make_cluster):
    """``ReadPayload(all_rows=True)`` of more rows than a message holds skipped the reply bound (+299 MB of RSS,
    then gRPC refused to send): refused with INVALID_ARGUMENT before anything is read."""
    local = make_cluster(servers=2, strategy="none", server_options={"max_message_bytes": 1 << 20})
    client = Cluster.connect(local.coordinator_address)
    client.create_table("big", 8000, 64, optimizer="adagrad", lr=0.1)  # 4,000 rows x 520 bytes a server: 2 MB
    expect_error(lambda: stub_for(client, 0).ReadPayload(
        embedding_pb2.ReadPayloadRequest(table="big", all_rows=True), timeout=30),
        grpc.StatusCode.INVALID_ARGUMENT, ["all_rows", "read by ids"])
    client.close()


def test_connecting_to_an_address_nobody_serves_says_so_while_it_waits(caplog):
    import logging
    import socket

    with socket.socket() as s:  # a port nothing listens on (bound, never listening: connections are refused)
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
        with caplog.at_level(logging.WARNING, logger="ecrec.client"):
            with pytest.raises(ClusterError, match="not ready after 1.2 s: the coordinator does not answer"):
                Cluster.connect(address, wait_ready_s=1.2)
    said = [r.getMessage() for r in caplog.records if "waiting for the cluster" in r.getMessage()]
    assert len(said) == 1 and address in said[0], said  # once, naming the address


def test_a_closed_client_refuses_every_call_naming_why_and_changes_nothing(make_cluster):
    """After ``close()`` some calls failed with gRPC's raw ``ValueError`` and others quietly reopened a channel --
    a step even pushed; now each raises ``ClusterError`` saying the client is closed, and closing again is harmless.
    A client used as a context manager is closed at the end of its block."""
    from ecrec.client import EmbeddingBag

    local = make_cluster(servers=2)
    client = Cluster.connect(local.coordinator_address)
    client.create_table("t", 10, 2, optimizer="sgd", lr=1.0)
    with Cluster.connect(local.coordinator_address) as scoped:
        assert scoped.pull("t", [1]).shape == (1, 2)
    with pytest.raises(ClusterError, match="is closed: connect again"):
        scoped.pull("t", [1])
    bag = EmbeddingBag(client, "t")
    watcher = Cluster.connect(local.coordinator_address)
    try:
        before = watcher.read_payload("t")[1].copy()
        bag(torch.tensor([[1, 2]])).sum().backward()  # a gradient recorded before close, pushed by no one
        client.close()
        client.close()
        for call in (lambda: client.pull("t", [1]), lambda: client.step(), lambda: client.refresh_map(),
                     lambda: client.create_table("u", 5, 2), lambda: client.read_rows("t", [0]),
                     lambda: client.save("/nonexistent/x"), lambda: bag(torch.tensor([[3]]))):
            with pytest.raises(ClusterError, match="is closed: connect again"):
                call()
        np.testing.assert_array_equal(watcher.read_payload("t")[1], before)
        assert "u" not in {t.name for t in watcher.refresh_map().tables}
    finally:
        watcher.close()


def test_register_dense_checks_every_parameter_before_registering_any(make_cluster):
    """A scalar parameter (a shape servers do not take) or a NaN initial value was found after the parameters
    before it were registered (the NaN came back as UNAVAILABLE); now refused first, naming it, nothing registered."""
    local = make_cluster(servers=2)
    client = Cluster.connect(local.coordinator_address)
    try:
        module = torch.nn.Module()
        module.first = torch.nn.Parameter(torch.ones(3))
        module.scalar = torch.nn.Parameter(torch.tensor(2.5))
        with pytest.raises(ValueError, match="parameter 'scalar'.*nothing registered"):
            client.register_dense(module)
        bad = torch.nn.Linear(2, 2)
        with torch.no_grad():
            bad.bias[0] = float("nan")
        with pytest.raises(ValueError, match="parameter 'bias' holds NaN or Inf; nothing registered"):
            client.register_dense(bad)
        assert len(client.refresh_map().dense) == 0
    finally:
        client.close()
