"""How a server writes its part of a snapshot: its peers' rows delivered over connections they open to it (never
to an address a request names, never for a worker, never in clear on a TLS cluster), large items written past
the page cache, and what each part took reported in the manifest.  Real servers on 127.0.0.1."""

from __future__ import annotations

import secrets
import socket

import grpc
import numpy as np
import pytest
import trustme

from ecrec.client import Cluster
from ecrec.config import ClientConfig
from ecrec.net import transport
from ecrec.snapshot import part as snapshot_part
from ecrec.wire import embedding_pb2, embedding_pb2_grpc
from helpers import issue

pytestmark = pytest.mark.cluster


def _table(cluster: Cluster, rows: int = 40_000, dim: int = 32) -> np.ndarray:
    """Table ``t`` (Adagrad) with every row's payload set to values of its own; returns them."""
    cluster.create_table("t", rows, dim, optimizer="adagrad", lr=0.05, initial_accumulator_value=0.1, seed=3)
    payload = np.random.default_rng(7).random((rows, 2 * dim), dtype=np.float32)
    cluster.write_rows("t", np.arange(rows, dtype=np.int64), payload, what="payload", checked=True)
    return payload


def _snapshot_payload(path, rows: int, dim: int) -> np.ndarray:
    """Table ``t``'s weights and state in the snapshot at ``path``, read by DCP's own reader (no ECRec code)."""
    import torch
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    plain = {key: torch.empty(tuple(meta.size)) for key, meta in metadata.state_dict_metadata.items()}
    dcp.load(plain, checkpoint_id=str(path))
    return np.concatenate([plain["tables/t/weight"].numpy(), plain["tables/t/state"].numpy()], axis=1)


def test_a_server_takes_its_peers_rows_over_connections_and_reports_what_each_part_took(make_cluster, tmp_path):
    """Four servers: each writes a quarter of the rows, three quarters of them its peers', every byte of those
    delivered over a connection (none in a reply); items of a megabyte and more go past the page cache; what DCP
    reads back is the table, bit for bit."""
    local = make_cluster(servers=4, strategy="ecrec", k=2, m=1)
    cluster = Cluster.connect(local.coordinator_address)
    rows, dim = 40_000, 32
    payload = _table(cluster, rows, dim)
    manifest = cluster.save(str(tmp_path / "snap"))
    assert set(manifest["parts"]) == {"0", "1", "2", "3"}
    for index, parts in manifest["parts"].items():
        written = sum(c["sizes"][0] for c in manifest["tensors"]["tables/t/weight"]["chunks"]
                      if c["file"] == f"__{index}_0.distcp") * 2 * dim * 4  # its rows' weights and state
        assert parts["bytes"]["own"] + parts["bytes"]["delivered"] == written, (index, parts)
        assert parts["bytes"]["in_replies"] == 0 and parts["bytes"]["delivered"] >= written // 2, (index, parts)
        assert set(parts["cpu_s"]) == set(snapshot_part.CPU_PARTS) and set(parts["wall_s"]) == set(snapshot_part.WALL_PARTS)
        assert all(v >= 0 for v in (*parts["cpu_s"].values(), *parts["wall_s"].values()))
        assert parts["cpu_s"]["place"] > 0 and parts["cpu_s"]["checksum"] > 0
    chunks = manifest["tensors"]["tables/t/weight"]["chunks"]
    assert all(c["sizes"][0] * dim * 4 >= 1 << 20 for c in chunks)  # big enough to be written past the page cache
    assert np.array_equal(_snapshot_payload(tmp_path / "snap", rows, dim).view(np.uint32), payload.view(np.uint32))
    target = Cluster.connect(make_cluster(servers=3, strategy="ecrec", k=2, m=1).coordinator_address)
    target.load(str(tmp_path / "snap"))
    assert np.array_equal(target.read_rows("t", np.arange(rows), "payload").view(np.uint32), payload.view(np.uint32))
    assert all(v["mismatched"] == 0 for v in target.strategy_call("verify_parity").values())


def _listener():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    sock.settimeout(1.0)
    return sock


def test_rows_are_delivered_to_no_worker_and_to_no_address_a_request_names(make_cluster):
    """A worker asking a server to deliver rows to a port of its choosing is refused, and nothing connects to
    that port; malformed delivery requests are refused before anything is read."""
    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1)
    cluster = Cluster.connect(local.coordinator_address)
    cluster.create_table("t", 600, 4, optimizer="sgd", lr=0.1)
    server = cluster.map.servers[0]
    stub = embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(server.address))
    owners, _ = cluster.layout.locate(np.arange(600))
    ids = transport.ids_to_bytes(np.flatnonzero(owners == 0)[:3].astype(np.int64))  # rows server 0 holds
    with _listener() as sock:
        port = sock.getsockname()[1]
        cases = [
            (dict(table="t", ids=ids, deliver_port=port, ticket=secrets.token_bytes(16)),
             grpc.StatusCode.FAILED_PRECONDITION, "does not prove it is a server"),
            (dict(table="t", ids=ids, deliver_port=80, ticket=secrets.token_bytes(16)),
             grpc.StatusCode.INVALID_ARGUMENT, "port in [1024, 65535]"),
            (dict(table="t", ids=ids, deliver_port=port, ticket=b"short"),
             grpc.StatusCode.INVALID_ARGUMENT, "ticket of 16 bytes"),
            (dict(table="t", ids=ids, ticket=secrets.token_bytes(16)),
             grpc.StatusCode.INVALID_ARGUMENT, "port in [1024, 65535]"),
            (dict(table="t", all_rows=True, deliver_port=port, ticket=secrets.token_bytes(16)),
             grpc.StatusCode.INVALID_ARGUMENT, "by ids"),
            (dict(dense=["x"], deliver_port=port, ticket=secrets.token_bytes(16)),
             grpc.StatusCode.INVALID_ARGUMENT, "by ids"),
        ]
        for fields, code, text in cases:
            with pytest.raises(grpc.RpcError) as info:
                stub.ReadPayload(embedding_pb2.ReadPayloadRequest(**fields), timeout=10)
            assert info.value.code() == code and text in info.value.details(), (fields, info.value.details())
        with pytest.raises(socket.timeout):  # nobody connected to the port
            sock.accept()
    # the plain read still answers in its reply
    reply = stub.ReadPayload(embedding_pb2.ReadPayloadRequest(table="t", ids=ids), timeout=10)
    assert len(reply.payload) == 3 * reply.row_bytes > 0


def test_on_a_tls_cluster_rows_travel_in_the_replies(make_cluster, tmp_path):
    """Rows never leave a TLS cluster's channels: each server's peers' rows come in their replies."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    srv, coord, alice = (issue(ca, tmp_path, name) for name in ("ecrec-server", "ecrec-coordinator", "alice"))
    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, server_security=srv, coordinator_security=coord,
                         client_security=alice)
    cluster = Cluster.connect(local.coordinator_address, config=ClientConfig(**alice))
    payload = _table(cluster, rows=3_000, dim=4)
    manifest = cluster.save(str(tmp_path / "snap"))
    for index, parts in manifest["parts"].items():
        assert parts["bytes"]["delivered"] == 0 and parts["bytes"]["in_replies"] > 0, (index, parts)
    assert np.array_equal(_snapshot_payload(tmp_path / "snap", 3_000, 4).view(np.uint32), payload.view(np.uint32))
    # and a TLS cluster restores it in bulk (its servers ask each other where they are over their own channels)
    other = make_cluster(servers=3, strategy="ecrec", k=2, m=1, server_security=srv, coordinator_security=coord,
                         client_security=alice)
    target = Cluster.connect(other.coordinator_address, config=ClientConfig(**alice))
    assert target.load(str(tmp_path / "snap"))["restored_in_bulk"] == ["t"]
    assert np.array_equal(target.read_rows("t", np.arange(3_000), "payload").view(np.uint32), payload.view(np.uint32))
    assert all(v["mismatched"] == 0 for v in target.strategy_call("verify_parity").values())
