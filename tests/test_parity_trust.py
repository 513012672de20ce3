"""The parity plane answers only servers that prove it, and resolution acts only for the replacement of the
index it names, once.

Every ``ParityService`` call (reads included) must carry ``ecrec-caller`` with its proof under the server key,
on every cluster (plain and token-only).  ``ResolveSource`` closes and undoes a failed owner's chain only when
the caller is that index's replacement: not with no metadata, not from another server of the map, never the
chain of a live owner; the replacement asking again (a late or duplicated list or commit) gets the same answer
and nothing changes.  Real processes on 127.0.0.1; a test acting as a server reads the server key from the
coordinator's state file (``conftest.server_metadata``).  The counting workload of ``test_safety``.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from conftest import server_metadata
from ecrec.net import transport
from ecrec.client import Cluster
from ecrec.config import ClientConfig
from ecrec.wire import parity_pb2, parity_pb2_grpc
from helpers import FAST, ROWS, assert_counts, counting_push, start
from helpers import refused

pytestmark = pytest.mark.cluster

FP = grpc.StatusCode.FAILED_PRECONDITION


def parity_stub(address: str, security=None):
    return parity_pb2_grpc.ParityServiceStub(transport.make_channel(address, security=security))


def ids_of(m) -> dict[int, str]:
    return {s.index: s.server_id for s in m.servers if s.index >= 0 and s.state in (1, 4)}


def test_resolution_by_anyone_but_the_replacement_is_refused_and_the_live_chain_goes_on(make_cluster, tmp_path):
    """ResolveSource of a live owner: with no metadata, and from another server of the map (proven), refused;
    the owner's chain stays open (training goes on past ``max_unconfirmed`` pushes), parity stays exact."""
    local, client, initial = start(make_cluster, servers=3, state_path=str(tmp_path / "map.pb"),
                                   options={"max_unconfirmed": "8", "coalesce_pushes": "1"})
    counts = np.zeros(ROWS)
    for _ in range(3):
        counting_push(client, np.arange(ROWS))
        counts += 1
    m = client.refresh_map()
    ids = ids_of(m)
    survivor = parity_stub(next(s.address for s in m.servers if s.index == 0))
    listing = parity_pb2.ResolveSourceRequest(source=1)
    commit = parity_pb2.ResolveSourceRequest(source=1, commit=True, undo_seqs=[(1 << 32) | 1, (2 << 32) | 1])
    for request in (listing, commit):
        refused(lambda: survivor.ResolveSource(request, timeout=10), FP, "does not prove")
        other = server_metadata(local, ids[2], m.epoch)  # a server of the map, but not a replacement of index 1
        refused(lambda: survivor.ResolveSource(request, timeout=10, metadata=other), FP, "live owner")
        itself = server_metadata(local, ids[1], m.epoch)  # the owner itself: its chain is live
        refused(lambda: survivor.ResolveSource(request, timeout=10, metadata=itself), FP)
    for _ in range(12):  # more than max_unconfirmed pushes: every one of them needs the chain open
        counting_push(client, np.arange(ROWS))
        counts += 1
    assert_counts(client, initial, counts)
    verify = client.strategy_call("verify_parity")
    assert all(v["mismatched"] == 0 for v in verify.values()), verify


def test_a_duplicated_resolution_after_its_commit_changes_nothing(make_cluster, tmp_path):
    """After index 1's owner died and its replacement resolved it and serves, the replacement's list and commit
    sent again (late or duplicated) get the first listing back and change nothing -- the replacement's own chain
    stays open, no batch is undone -- and another server's list is refused; training goes on, exact."""
    local, client, initial = start(make_cluster, servers=3, standby=1, state_path=str(tmp_path / "map.pb"))
    counts = np.zeros(ROWS)
    for _ in range(4):
        counting_push(client, np.arange(ROWS))
        counts += 1
    old_id = ids_of(client.refresh_map())[1]
    local.kill(local.pid_of_index(1))
    deadline = time.monotonic() + 60
    while True:  # pushes go on through the failure; the SDK replays what the dead owner did not confirm
        counting_push(client, np.arange(ROWS))
        counts += 1
        m = client.refresh_map()
        replacement = next((s for s in m.servers if s.index == 1 and s.state in (1, 4)), None)
        if replacement is not None and replacement.server_id != old_id:
            break
        assert time.monotonic() < deadline, "no replacement promoted"
    for _ in range(3):  # the replacement's own chain to the survivors is running
        counting_push(client, np.arange(ROWS))
        counts += 1
    m = client.refresh_map()
    ids = ids_of(m)
    survivor = parity_stub(next(s.address for s in m.servers if s.index == 0))
    me = server_metadata(local, ids[1], m.epoch)
    listing = survivor.ResolveSource(parity_pb2.ResolveSourceRequest(source=1, replacement_id=ids[1]), timeout=10,
                                     metadata=me)
    again = survivor.ResolveSource(parity_pb2.ResolveSourceRequest(source=1), timeout=10, metadata=me)
    assert again == listing  # the same answer
    undo_everything = [e.seq for e in listing.logged] + [(1 << 32) | n for n in range(1, 64)]
    survivor.ResolveSource(parity_pb2.ResolveSourceRequest(source=1, commit=True, undo_seqs=undo_everything),
                           timeout=10, metadata=me)
    refused(lambda: survivor.ResolveSource(parity_pb2.ResolveSourceRequest(source=1), timeout=10,
                                           metadata=server_metadata(local, ids[2], m.epoch)), FP, "live owner")
    refused(lambda: survivor.ResolveSource(parity_pb2.ResolveSourceRequest(source=1, replacement_id="someone-else"),
                                           timeout=10, metadata=me), grpc.StatusCode.INVALID_ARGUMENT, "is not the caller")
    for _ in range(6):
        counting_push(client, np.arange(ROWS))
        counts += 1
    assert_counts(client, initial, counts)
    stats = client.strategy_call("stats")
    assert sum(s.get("repeated_resolutions", 0) for s in stats.values()) >= 2, stats
    verify = client.strategy_call("verify_parity")
    assert all(v["mismatched"] == 0 for v in verify.values()), verify


def test_parity_reads_without_a_server_proof_are_refused_on_a_token_cluster(make_cluster, tmp_path):
    """A worker holds the cluster's token, so on a token-only cluster the token proves nothing about the caller:
    ReadRows and StreamStripes without ``ecrec-caller-proof`` are refused (with a claimed server id too); with a
    server's proof they are answered."""
    (tmp_path / "token").write_text("s3cret-token\n")
    security = {"token_file": str(tmp_path / "token")}
    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, server_security=security,
                         state_path=str(tmp_path / "map.pb"))
    client = Cluster.connect(local.coordinator_address, config=ClientConfig(**FAST, **security))
    client.create_table("t", ROWS, 4, optimizer="sgd", lr=1.0, init="zeros")
    counting_push(client, np.arange(ROWS))
    m = client.refresh_map()
    ids = ids_of(m)
    sec = ClientConfig(**security).security
    server = next(s for s in m.servers if s.index == 0)
    stub = parity_stub(server.address, security=sec)
    ids_bytes = transport.ids_to_bytes(np.flatnonzero(client.layout.locate(np.arange(ROWS))[0] == 0)[:2])
    read = parity_pb2.ReadRowsRequest(table="t", ids=ids_bytes)
    stream = transport.make_channel(server.address, security=sec).unary_stream(
        "/ecrec.wire.ParityService/StreamStripes",
        request_serializer=parity_pb2.StreamStripesRequest.SerializeToString)
    blocks = parity_pb2.StreamStripesRequest(table="t", first_block=0, end_block=1, data_positions=[0],
                                             blocks_per_message=1)
    claimed = (("ecrec-caller", ids[1]), ("ecrec-epoch", str(m.epoch)))
    for metadata in ((), claimed, claimed + (("ecrec-caller-proof", "0" * 32),)):
        refused(lambda: stub.ReadRows(read, timeout=10, metadata=metadata), FP, "does not prove")
        refused(lambda: list(stream(blocks, timeout=10, metadata=metadata)), FP, "does not prove")
    proven = server_metadata(local, ids[1], m.epoch)
    assert len(stub.ReadRows(read, timeout=10, metadata=proven).payload) == 2 * 4 * 4
    assert len(list(stream(blocks, timeout=10, metadata=proven))) == 1


def test_a_parity_channel_is_fenced_frame_by_frame(make_cluster, tmp_path):
    """A parity channel (``parity_channel``) opened by a proven server carries its frames and reads only while
    that incarnation is a server of the map: once index 1's owner is replaced, a frame or a read on the channel its
    old incarnation opened is refused (``FAILED_PRECONDITION``, nothing applied) and it cannot open another; a
    worker cannot open one at all.  Training goes on, exact."""
    from ecrec.strategies.erasure import batch_frames, parity_channel

    local, client, initial = start(make_cluster, servers=3, standby=1, state_path=str(tmp_path / "map.pb"))
    counts = np.zeros(ROWS)
    for _ in range(3):
        counting_push(client, np.arange(ROWS))
        counts += 1
    m = client.refresh_map()
    ids = ids_of(m)
    target = next(s for s in m.servers if s.index == 0)
    stub = parity_stub(target.address)
    refused(lambda: stub.OpenParityChannel(parity_pb2.OpenParityChannelRequest(), timeout=10), FP, "does not prove")
    old = server_metadata(local, ids[1], m.epoch)
    reply = stub.OpenParityChannel(parity_pb2.OpenParityChannelRequest(), timeout=10, metadata=old)
    channel = parity_channel.Channel(target.address.rsplit(":", 1)[0], reply.port, reply.ticket, 5.0)
    # a confirmation-only frame of index 1's old incarnation (what its sender sends an idle destination)
    frame = batch_frames.encode_parts(parity_pb2.ParityBatches(source=1, source_id=ids[1]), [])
    size = sum(memoryview(p).nbytes for p in frame)
    ack = parity_pb2.ParityAck.FromString(channel.request(frame, size, m.epoch, 10.0))
    assert ack.destination_id == ids[0]
    # a read on the same channel (``read_channel.py``) answers as ReadRows does
    read = parity_pb2.ReadRowsRequest(table="t", ids=transport.ids_to_bytes(client.layout.rows_of(0, ROWS)[0]))
    body = read.SerializeToString()
    over_channel = parity_pb2.ReadRowsReply.FromString(
        channel.request([body], len(body), m.epoch, 10.0, kind=parity_channel.READ))
    assert over_channel == stub.ReadRows(read, timeout=10, metadata=old) and len(over_channel.payload) > 0
    local.kill(local.pid_of_index(1))
    deadline = time.monotonic() + 60
    while True:
        counting_push(client, np.arange(ROWS))
        counts += 1
        m = client.refresh_map()
        if ids_of(m).get(1, ids[1]) != ids[1]:
            break
        assert time.monotonic() < deadline, "no replacement promoted"
    with pytest.raises(parity_channel.ChannelError) as info:  # the old incarnation's channel, after the map moved on
        channel.request(frame, size, m.epoch, 10.0)
    assert info.value.code() == FP and "not a server of the cluster map" in info.value.details()
    with pytest.raises(parity_channel.ChannelError) as info:  # and so is a read
        channel.request([body], len(body), m.epoch, 10.0, kind=parity_channel.READ)
    assert info.value.code() == FP and "not a server of the cluster map" in info.value.details()
    channel.close()
    refused(lambda: stub.OpenParityChannel(parity_pb2.OpenParityChannelRequest(), timeout=10,
                                           metadata=server_metadata(local, ids[1], m.epoch)), FP, "not a server")
    for _ in range(4):
        counting_push(client, np.arange(ROWS))
        counts += 1
    assert_counts(client, initial, counts)
