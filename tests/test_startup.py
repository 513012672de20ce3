"""Start-up: a server the coordinator already counts can create tables at once.

The coordinator's map is "ready" (and ``LocalCluster.start`` / ``Cluster.connect`` return) as soon as every
index answered its Register; the server may not have read the reply, nor the map broadcast after it, when the
first ``create_table`` reaches it.  It used to wait 10 s for those messages and then fail with "holds no index
yet" (``tests/test_cpr.py`` retried around it).  Here the reply is never handed to the server at all: it must
learn its index from the coordinator.

A real coordinator process on 127.0.0.1; the registering server's state lives in this process, with a real
gRPC health service at the address it registers (so the coordinator keeps it alive), and no embedding
service there (so the coordinator's map broadcasts cannot reach it either).
"""

from __future__ import annotations

import uuid

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ecrec import errors
from ecrec.net import transport
from ecrec.config import ServerConfig
from ecrec.ops.local import LocalCluster, LocalClusterSpec
from ecrec.server.state import ServerState
from ecrec.tables.spec import TableSpec
from ecrec.wire import coordinator_pb2, coordinator_pb2_grpc

pytestmark = pytest.mark.cluster


@pytest.fixture
def coordinator():
    lc = LocalCluster(LocalClusterSpec(servers=1))
    try:
        lc.start_coordinator(["coordinator", "--host", "127.0.0.1", "--port", "0", "--servers", "1",
                              "--strategy", "none", "--health-interval", "0.2"])
        yield lc
    finally:
        lc.close()


@pytest.fixture
def health_only_address():
    server = transport.make_server(2)
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = transport.bind(server, "127.0.0.1", 0)
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0).wait()


def _register(coordinator_address: str, address: str, server_id: str, standby: bool = False):
    stub = coordinator_pb2_grpc.CoordinatorStub(transport.make_channel(coordinator_address))
    return stub.Register(coordinator_pb2.RegisterRequest(address=address, server_id=server_id, standby=standby,
                                                         want_index=-1, health_address=address), timeout=60)


def test_a_server_whose_register_reply_is_in_flight_creates_tables(coordinator, health_only_address):
    server_id = f"startup-test:{uuid.uuid4().hex[:8]}"
    state = ServerState(ServerConfig(coordinator=coordinator.coordinator_address), server_id)
    reply = _register(coordinator.coordinator_address, health_only_address, server_id)  # never given to `state`
    assert reply.index == 0 and reply.map.ready
    assert state.index == -1 and state.map is None  # nothing reached the server

    assert state.create_table(TableSpec("t", 10, 4)) is True
    assert state.index == 0 and state.strategy is not None and state.strategy.name == "none"
    assert [t.spec.name for t in state.tables()] == ["t"]
    assert state.create_table(TableSpec("t", 10, 4)) is False  # identical: nothing new


def test_a_standby_is_still_refused(coordinator, health_only_address):
    """The coordinator never sends a standby a CreateTable; if one arrives it is refused, naming why."""
    _register(coordinator.coordinator_address, health_only_address, "startup-test:active")
    server_id = f"startup-test:{uuid.uuid4().hex[:8]}"
    state = ServerState(ServerConfig(coordinator=coordinator.coordinator_address), server_id)
    reply = _register(coordinator.coordinator_address, "127.0.0.1:1", server_id, standby=True)
    assert reply.index == -1
    with pytest.raises(errors.FailedPrecondition, match=r"holds no index yet \(standby\)"):
        state.wait_for_index(timeout_s=0.5)
    assert state.tables() == [] and state.index == -1


@pytest.mark.parametrize("want", [1, 7, -2])
def test_an_index_the_cluster_does_not_have_is_refused_at_register(coordinator, health_only_address, want):
    """A server asking for an index beyond the cluster's (a typo in ``--index``) was given another (while the
    cluster formed) or made a standby waiting for it forever; now its Register is refused, naming the range,
    and nothing is registered."""
    stub = coordinator_pb2_grpc.CoordinatorStub(transport.make_channel(coordinator.coordinator_address))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Register(coordinator_pb2.RegisterRequest(address=health_only_address, server_id="startup-test:typo",
                                                      want_index=want, health_address=health_only_address), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"index {want} is not an index of this cluster (0 to 0)" in caught.value.details()
    reply = _register(coordinator.coordinator_address, health_only_address, "startup-test:fine")
    assert reply.index == 0 and [s.server_id for s in reply.map.servers] == ["startup-test:fine"]
