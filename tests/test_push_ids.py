"""A push id only its worker can use: what the servers keep and relay names a worker by a hash of its secret.

Real processes on 127.0.0.1 and raw stubs, as an attacker holding a worker's credentials would use them.  The
counting workload of ``test_safety``: after every attack each row is exactly its initial value minus the number
of acknowledged pushes that touched it.
"""

from __future__ import annotations

import uuid

import grpc
import numpy as np
import pytest

from ecrec.client import Cluster
from ecrec.config import ClientConfig
from ecrec.strategies.base import push_key
from ecrec.wire import embedding_pb2, parity_pb2
from helpers import ROWS, assert_counts, counting_push, issue, start
from test_bounds import owned, push_request, stub_of

pytestmark = pytest.mark.cluster


def relayed_push_ids(replies) -> list[str]:
    """The worker names inside every parity batch the replies carried (sealed, so readable by the worker)."""
    names = []
    for reply in replies:
        for relay in reply.relay:
            batch = parity_pb2.ParityBatch.FromString(relay.batch)
            names += [p.worker for p in batch.push_ids] + [p.incarnation for p in batch.push_ids]
    return names


def forgeries(seen: list[str], sequence: int) -> list[embedding_pb2.PushId]:
    """Every push id an attacker can make of what it read: each string whole, and split at each separator."""
    out = []
    for text in seen:
        out.append(embedding_pb2.PushId(worker=text, sequence=sequence))
        for sep in "@#":
            name, found, rest = text.partition(sep)
            if found:
                out.append(embedding_pb2.PushId(worker=name, sequence=sequence, incarnation=rest))
    return out


def test_push_keys_are_hashes_that_keep_names_and_incarnations_apart():
    """The key is the name's head and a 128-bit digest of (identity, name, incarnation), each length-prefixed:
    ``a@b`` with no incarnation is not ``a`` of incarnation ``b``, and the same id under another certificate is
    another worker."""
    def key(worker, incarnation, identity=""):
        return push_key(embedding_pb2.PushId(worker=worker, incarnation=incarnation, sequence=3), identity)

    name, sequence = key("alice", "s3cret")
    assert sequence == 3 and name.startswith("alice#") and len(name) == len("alice#") + 32
    assert "s3cret" not in name
    assert key("a@b", "") != key("a", "b") and key("ab", "") != key("a", "b") and key("", "ab") != key("a", "b")
    assert key("alice", "s3cret", "x509_common_name=alice") != key("alice", "s3cret")
    assert key("alice", "s3cret") == key("alice", "s3cret")  # a retry is the same push


def test_a_worker_cannot_cancel_anothers_pushes_with_ids_read_from_relayed_batches(make_cluster):
    """The victim's push ids travel in the parity batches every worker relays.  An attacker reads them and sends
    each server pushes under every id it can make of them, with sequence 2^62 (the old servers then answered
    "already applied" to everything the victim sent below that: acknowledged, never applied).  Now the batches
    hold only the servers' hashes, the victim's secret appears nowhere, and each of the victim's next pushes is
    applied, once."""
    # batches ride the worker; a group closes every 16 pushes (by default 64, or its age: more than this loop's)
    local, client, initial = start(make_cluster, servers=3, options={"relay": "on", "coalesce_pushes": "16"})
    counts = np.zeros(ROWS)
    counting_push(client, np.arange(ROWS))
    counts += 1
    stub, mine = stub_of(client, 0), owned(client, 0)
    secret = uuid.uuid4().hex
    replies, seen = [], []
    sequence = 0
    while not seen and sequence < 10:  # the owner relays a batch holding the victim's push within a few pushes
        sequence += 1
        reply = stub.Push(push_request(mine, "victim", sequence, incarnation=secret), timeout=30)
        assert not reply.already_applied
        counts[mine] += 1
        replies.append(reply)
        counting_push(client, np.arange(ROWS))  # other traffic: the relays go on
        counts += 1
        seen = [s for s in relayed_push_ids(replies) if "victim" in s]
    assert seen, "no relayed batch named the victim's pushes"
    assert not any(secret in s for s in relayed_push_ids(replies)), "the victim's secret is in what workers relay"

    attacks = 0
    for index in range(3):
        target = stub_of(client, index)
        for forged in forgeries(seen, 2 ** 62):
            request = push_request(owned(client, index), "x", 1, grad=0.0)
            request.push_id.CopyFrom(forged)
            try:
                target.Push(request, timeout=30)  # zero gradients: applied as some other worker's push, or refused
                attacks += 1
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
    assert attacks > 0
    for _ in range(10):  # the victim goes on: every push applied
        sequence += 1
        reply = stub.Push(push_request(mine, "victim", sequence, incarnation=secret), timeout=30)
        assert not reply.already_applied and reply.rows_updated == len(mine), "the victim's push was cancelled"
        counts[mine] += 1
    again = stub.Push(push_request(mine, "victim", sequence, incarnation=secret), timeout=30)
    assert again.already_applied  # its own retry is still recognised
    counting_push(client, np.arange(ROWS))
    counts += 1
    assert_counts(client, initial, counts)


@pytest.mark.parametrize("same_certificate", [True, False])
def test_on_tls_a_push_id_belongs_to_the_certificate_that_sent_it(make_cluster, tmp_path, same_certificate):
    """With TLS the caller's certificate names are part of the key: the same push id (name, incarnation,
    sequence) sent again under the same certificate is a retry ("already applied"); under another client
    certificate of the same CA it is another worker's push, so a stolen secret cancels nothing."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    srv, coord = issue(ca, tmp_path, "ecrec-server"), issue(ca, tmp_path, "ecrec-coordinator")
    alice, mallory = issue(ca, tmp_path, "alice"), issue(ca, tmp_path, "mallory")
    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, server_security=srv, coordinator_security=coord,
                         client_security=alice)
    client = Cluster.connect(local.coordinator_address, config=ClientConfig(**alice))
    client.create_table("t", ROWS, 4, optimizer="sgd", lr=1.0, init="zeros")
    from ecrec.net import transport
    from ecrec.wire import embedding_pb2_grpc

    def stub(who):
        address = next(s.address for s in client.refresh_map().servers if s.index == 0)
        return embedding_pb2_grpc.EmbeddingServerStub(
            transport.make_channel(address, security=ClientConfig(**who).security))

    mine = owned(client, 0)
    request = push_request(mine, "alice", 1, incarnation=uuid.uuid4().hex)
    assert not stub(alice).Push(request, timeout=30).already_applied
    again = stub(alice if same_certificate else mallory).Push(request, timeout=30)
    assert again.already_applied is same_certificate
    expected = np.zeros((ROWS, 4), np.float32)
    expected[mine] -= 1 if same_certificate else 2
    np.testing.assert_array_equal(client.read_payload("t")[1].view(np.float32)[:, :4], expected)
