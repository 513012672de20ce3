"""The fast rebuild path (``erasure/bulk.py``): its choice of members, its decoding, and a whole replacement
rebuilt over many rounds, bit for bit; the initial rows written by the numba kernel."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

import torch

from ecrec.bench.recovery import COORDINATOR_OPTIONS, wait_standby_reserve, wait_started
from ecrec.client import Cluster, EmbeddingBag
from ecrec.coding.codec import Codec
from ecrec.config import ClientConfig
from ecrec.coding.layout import Layout
from ecrec.strategies.erasure import frame_socket, frames
from ecrec.net.peers import Peers
from ecrec.strategies.erasure.bulk import BulkRebuild, position_plan
from ecrec.strategies.erasure.counters import Counters
from ecrec.wire import cluster_pb2, parity_pb2
from ecrec.tables.spec import TableSpec, _initial_payload_numpy, initial_payload
from ecrec.net.transport import make_channel
from conftest import server_metadata



def test_strided_install_skips_rows_rebuilt_on_demand_and_rows_not_selected():
    """The fast path installs a round through one strided view; rows rebuilt on demand meanwhile (ready) and
    rows not selected (a member was not ready) keep what they hold, every other row gets the rebuilt bytes."""
    from ecrec.tables.shards import TableShard

    layout = Layout(4, 2, 1)
    spec = TableSpec("t", 4_000, 4)
    shard = TableShard(spec, layout, index=1, initial_values=False)
    shard.mark_unready()
    rng = np.random.default_rng(5)
    slots = np.arange(1, shard.num_slots, layout.k)  # position 1 of every block: evenly spaced
    on_demand = slots[[3, 40, 41, 200]]
    early = rng.integers(0, 256, (len(on_demand), spec.row_bytes), dtype=np.uint8)
    assert shard.install(on_demand, early, np.full(len(on_demand), 7)) == len(on_demand)
    payload = rng.integers(0, 256, (len(slots), spec.row_bytes), dtype=np.uint8)
    versions = np.arange(len(slots), dtype=np.int64) + 100
    mask = np.ones(len(slots), bool)
    mask[[5, 6, 300]] = False
    installed = shard.install(slots, payload, versions, mask=mask)
    skipped = np.isin(slots, on_demand) | ~mask
    assert installed == int((~skipped).sum())
    got = shard.read(slots)
    assert np.array_equal(got.payload[~skipped], payload[~skipped])
    assert np.array_equal(got.versions[~skipped], versions[~skipped])
    assert np.array_equal(got.payload[np.isin(slots, on_demand)], early) and (got.versions[np.isin(slots, on_demand)] == 7).all()
    assert not got.ready[~mask].any() and got.ready[mask].all()
    assert not got.payload[~mask].any()  # never written
    assert shard.install(slots, payload, versions) == 3  # the unselected rows, later; nothing else again


def test_a_frame_round_trips_and_a_frame_not_as_asked_is_refused():
    rng = np.random.default_rng(2)
    buffer, frame = frames.allocate(7, 5, 2, 1, 16, 3)
    for name in ("data", "data_versions", "parity", "parity_versions"):
        view = getattr(frame, name)
        view[...] = rng.integers(0, 1 << 40 if view.dtype == np.int64 else 256, view.shape)
    frame.data_ready[...] = rng.integers(0, 2, frame.data_ready.shape)
    frame.parity_ready[...] = rng.integers(0, 2, frame.parity_ready.shape)
    raw = buffer.tobytes()
    assert len(raw) == frames.frame_bytes(5, 2, 1, 16, 3)
    got = frames.parse(raw, 2, 1, 16, 3)
    assert (got.first_block, got.blocks) == (7, 5)
    for name in ("data", "data_versions", "parity", "parity_versions", "data_ready", "parity_ready"):
        assert np.array_equal(getattr(got, name), getattr(frame, name)), name
    assert got.data.shape == (2, 5, 16) and got.parity_versions.shape == (1, 5, 3) and got.data_ready.dtype == bool
    for bad, args, match in [(raw, (1, 1, 16, 3), "asked for"), (raw, (2, 1, 16, 2), "asked for"),
                             (raw[:-1], (2, 1, 16, 3), "expected"), (b"XXXX" + raw[4:], (2, 1, 16, 3), "magic"),
                             (raw[:10], (2, 1, 16, 3), "shorter")]:
        with pytest.raises(frames.FrameError, match=match):
            frames.parse(bad, *args)


@pytest.mark.cluster
def test_stream_stripes_sends_the_rows_asked_as_frames_and_refuses_bad_requests(make_cluster, monkeypatch, tmp_path):
    """A survivor's side of the fast path, called as the replacement calls it: frames of the blocks asked, each
    position's rows those of the layout, each parity row the encoding of its stripe; bad requests refused with
    a status that names the problem."""
    servers, k, m, index = 4, 2, 1, 2
    # the replacement of index 0 (later in the test) rebuilds very slowly: it stays RECOVERING, as a caller of
    # deliveries must be
    local = make_cluster(servers=servers, standby=1, strategy="ecrec", k=k, m=m,
                         options={"rebuild_duty": "0.001", "rebuild_batch_rows": "16"},
                         coordinator_options=COORDINATOR_OPTIONS, state_path=str(tmp_path / "map.pb"))
    cluster = Cluster.connect(local.coordinator_address, ClientConfig(rpc_timeout_s=120.0))
    wait_started(cluster, servers)
    cluster.create_table("t", 1_001, 4, seed=9)
    spec, layout = cluster.table_spec("t"), Layout(servers, k, m)
    ids, rows = cluster.read_payload("t")
    payload = np.ascontiguousarray(rows).view(np.uint8)
    assert np.array_equal(ids, np.arange(spec.num_rows))
    monkeypatch.setattr("ecrec.client.rows.READ_PAYLOAD_BYTES", 7 * spec.row_bytes)  # 7 rows per message: many
    paged_ids, paged = cluster.read_payload("t")
    assert np.array_equal(paged_ids, ids) and np.array_equal(paged.view(np.uint32), rows.view(np.uint32))
    address = next(s.address for s in cluster.refresh_map().servers if s.index == index)
    # a read of the parity plane proves that a server makes it: here as index 0's server
    reader = server_metadata(local, next(s.server_id for s in cluster.refresh_map().servers if s.index == 0))
    with pytest.raises(grpc.RpcError) as caught:  # without the proof: refused, on this plain cluster too
        list(make_channel(address).unary_stream(frames.FULL_METHOD, request_serializer=parity_pb2.StreamStripesRequest
                                                .SerializeToString)(parity_pb2.StreamStripesRequest(table="t"), timeout=30))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "prove" in caught.value.details()
    call = make_channel(address).unary_stream(frames.FULL_METHOD,
                                              request_serializer=parity_pb2.StreamStripesRequest.SerializeToString)
    blocks = -(-layout.num_stripes(spec.num_rows) // servers)  # 126: the last block partly past the end
    request = parity_pb2.StreamStripesRequest(table="t", first_block=100, end_block=blocks, data_positions=[1, 0],
                                              parity_indices=[0], blocks_per_message=10)
    got = [frames.parse(raw, 2, 1, spec.row_bytes, k) for raw in call(request, timeout=30, metadata=reader)]
    assert [(f.first_block, f.blocks) for f in got] == [(100, 10), (110, 10), (120, 6)]
    codec = Codec(k, m, "isa_l_rs_vand", kernel="cpu")
    for f in got:
        b = np.arange(f.first_block, f.first_block + f.blocks)
        for c, t in enumerate([1, 0]):
            ids = layout.ids_of_slots(index, b * k + t)
            real = ids < spec.num_rows
            assert np.array_equal(f.data[c][real], payload[ids[real]]) and f.data_ready[c][real].all()
        stripes = b * servers + (index - k) % servers
        real = stripes < layout.num_stripes(spec.num_rows)
        members = np.zeros((len(b), k, spec.row_bytes), np.uint8)
        for u in range(k):
            ids = stripes * k + u
            members[ids < spec.num_rows, u] = payload[ids[ids < spec.num_rows]]
        assert np.array_equal(f.parity[0][real], codec.encode_stripes(members)[:, 0][real])
        assert f.parity_ready[0][real].all() and not f.parity_ready[0][~real].any()
    for bad, code, match in [
        (dict(end_block=blocks + 1), grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
        (dict(data_positions=[k]), grpc.StatusCode.INVALID_ARGUMENT, "data positions must be < k=2"),
        (dict(blocks_per_message=-1), grpc.StatusCode.INVALID_ARGUMENT, "blocks_per_message must be >= 0"),
        (dict(blocks_per_message=1 << 30), grpc.StatusCode.INVALID_ARGUMENT, "makes frames of"),
        (dict(table="nope"), grpc.StatusCode.NOT_FOUND, "unknown table 'nope'"),
        (dict(data_positions=[0, 0]), grpc.StatusCode.INVALID_ARGUMENT, "must not repeat"),
        (dict(data_positions=[0, 1], parity_indices=[0, 0], blocks_per_message=0), grpc.StatusCode.INVALID_ARGUMENT,
         "must not repeat"),
    ]:
        fields = dict(table="t", first_block=0, end_block=blocks, data_positions=[0], blocks_per_message=10) | bad
        with pytest.raises(grpc.RpcError) as caught:
            list(call(parity_pb2.StreamStripesRequest(**fields), timeout=30, metadata=reader))
        assert caught.value.code() == code and match in caught.value.details(), caught.value.details()

    # the replacement's side falls back to the gRPC stream when a survivor refuses the connection (here: the
    # caller, index 0's server, is not rebuilding) and gets the same frames, for this round and the next
    m_now = cluster.refresh_map()
    caller_id = next(s.server_id for s in m_now.servers if s.index == 0)
    host = SimpleNamespace(layout=layout, index=0, config=SimpleNamespace(host="127.0.0.1"),
                           peers=Peers(lambda: m_now, None, timeout_s=30, retry_deadline_s=30,
                                       identity=lambda: server_metadata(local, caller_id)))
    counters = Counters()
    fast = BulkRebuild(host, Codec(k, m, "isa_l_rs_vand", kernel="cpu"), None, counters, frame_bytes=1)
    server = next(s for s in fast.plan.data if fast.plan.data[s] and fast.plan.parity.get(s))
    for _ in range(2):
        fell_back = fast._stream(server, spec, 100, blocks)
        assert fell_back is not None and fast.transport == "grpc"
        assert [(f.first_block, f.blocks) for f in fell_back] == [(b, 1) for b in range(100, blocks)]
    assert counters["bulk_bytes_read"] > 0 and counters["bulk_bytes_over_socket"] == 0
    fast.close()
    host.peers.close()

    # over a connection: to the calling server's host as the map lists it (a rebuilding server: the
    # replacement of index 0), opened with the ticket's MAC; the same frames, none on the reply stream
    local.kill(local.pid_of_index(0))
    cluster.pull("t", np.arange(4))  # someone notices; the standby is promoted and rebuilds (slowly)
    m_now = cluster.refresh_map()
    replacement = next(s for s in m_now.servers if s.index == 0 and s.state == cluster_pb2.RECOVERING)
    caller = server_metadata(local, replacement.server_id, m_now.epoch)
    active = server_metadata(local, next(s.server_id for s in m_now.servers if s.index == 1))
    with frame_socket.FrameListener("127.0.0.1", 30) as listener:
        request.deliver_port, request.ticket = listener.port, listener.ticket
        stream = call(request, timeout=30, metadata=caller)
        delivered = listener.receive(len(got), 2, 1, spec.row_bytes, k, frames.frame_bytes(10, 2, 1, spec.row_bytes, k))
        assert list(stream) == []
    for a, b in zip(delivered, got):
        for name in ("first_block", "blocks", "data", "data_versions", "data_ready", "parity", "parity_versions",
                     "parity_ready"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    ticket = bytes(frame_socket.TICKET_BYTES)
    for metadata, fields, code, match in [
        ((), dict(deliver_port=closed_port, ticket=ticket), grpc.StatusCode.FAILED_PRECONDITION, "does not prove"),
        (active, dict(deliver_port=closed_port, ticket=ticket), grpc.StatusCode.FAILED_PRECONDITION,
         "rebuilding server"),
        ((("ecrec-caller", "stranger"),), dict(deliver_port=closed_port, ticket=ticket),
         grpc.StatusCode.FAILED_PRECONDITION, "does not prove"),
        (server_metadata(local, "stranger"), dict(deliver_port=closed_port, ticket=ticket),
         grpc.StatusCode.FAILED_PRECONDITION, "not a server of the cluster map"),
        (caller, dict(deliver_port=closed_port, ticket=b"x"), grpc.StatusCode.INVALID_ARGUMENT, "ticket of 16 bytes"),
        (caller, dict(deliver_port=70000, ticket=ticket), grpc.StatusCode.INVALID_ARGUMENT, "[1024, 65535]"),
        (caller, dict(deliver_port=80, ticket=ticket), grpc.StatusCode.INVALID_ARGUMENT, "[1024, 65535]"),
        (caller, dict(deliver_port=closed_port, ticket=ticket), grpc.StatusCode.FAILED_PRECONDITION,
         f"delivering frames to 127.0.0.1:{closed_port} failed"),
    ]:
        fields = dict(table="t", first_block=0, end_block=blocks, data_positions=[0], blocks_per_message=10) | fields
        with pytest.raises(grpc.RpcError) as caught:
            list(call(parity_pb2.StreamStripesRequest(**fields), timeout=30, metadata=metadata))
        assert caught.value.code() == code and match in caught.value.details(), caught.value.details()
    assert any(s.index == 0 and s.state == cluster_pb2.RECOVERING for s in cluster.refresh_map().servers)


def test_a_frame_listener_takes_only_the_connection_with_its_ticket():
    rng = np.random.default_rng(4)
    buffers = []
    for b0 in (0, 3):
        buffer, frame = frames.allocate(b0, 3, 1, 0, 8, 2)
        frame.data[...] = rng.integers(0, 256, frame.data.shape)
        frame.data_versions[...] = rng.integers(0, 99, frame.data_versions.shape)
        frame.data_ready[...] = 1
        buffers.append(buffer)
    size = frames.frame_bytes(3, 1, 0, 8, 2)
    with frame_socket.FrameListener("127.0.0.1", 10) as listener:
        stranger = socket.create_connection(("127.0.0.1", listener.port))  # first in line, the wrong ticket
        stranger.sendall(listener.ticket + bytes(frame_socket.OPENING_BYTES - frame_socket.TICKET_BYTES))  # not the MAC
        sender = threading.Thread(target=frame_socket.send_frames,
                                  args=("127.0.0.1", listener.port, listener.ticket, buffers, 10))
        sender.start()
        got = listener.receive(2, 1, 0, 8, 2, size)
        sender.join()
        stranger.close()
    for frame, buffer in zip(got, buffers):
        assert np.array_equal(frame.data, frames.parse(buffer.tobytes(), 1, 0, 8, 2).data)
    assert [(f.first_block, f.blocks) for f in got] == [(0, 3), (3, 3)]
    with frame_socket.FrameListener("127.0.0.1", 10) as listener:  # a sender that stops early
        sender = threading.Thread(target=frame_socket.send_frames,
                                  args=("127.0.0.1", listener.port, listener.ticket, buffers[:1], 10))
        sender.start()
        with pytest.raises(ConnectionError, match="before its last frame"):
            listener.receive(2, 1, 0, 8, 2, size)
        sender.join()
    with frame_socket.FrameListener("127.0.0.1", 10) as listener:  # a frame larger than asked for
        sender = threading.Thread(target=frame_socket.send_frames,
                                  args=("127.0.0.1", listener.port, listener.ticket, buffers, 10))
        sender.start()
        with pytest.raises(frames.FrameError, match="announced"):
            listener.receive(2, 1, 0, 8, 2, size - 1)
        sender.join()
    with frame_socket.FrameListener("127.0.0.1", 0.3) as listener:  # nobody comes
        with pytest.raises(OSError):
            listener.receive(1, 1, 0, 8, 2, size)


@pytest.mark.parametrize("servers,k,m", [(3, 2, 1), (4, 2, 1), (5, 2, 2), (6, 3, 2), (7, 4, 1)])
def test_position_plan_names_the_right_member_of_every_stripe(servers, k, m):
    """For every replaced index, what the plan reads from (server, column) in block b is exactly the stripe
    member the decoder treats it as: checked against the layout's own functions."""
    layout = Layout(servers, k, m)
    blocks = np.arange(3)
    for index in range(servers):
        plan = position_plan(layout, index)
        assert index not in plan.data and index not in plan.parity

        def data_row_id(server, col, b):  # the row id a survivor sends at (server, column) of block b
            slot = b * k + plan.data[server][col]
            return int(layout.ids_of_slots(server, np.array([slot]))[0])

        for t, (others, (pserver, pcol)) in plan.data_source.items():
            for b in blocks:
                stripe = int(layout.ids_of_slots(index, np.array([b * k + t]))[0]) // k
                for u, (server, col) in others.items():
                    assert data_row_id(server, col, b) == stripe * k + u
                assert plan.parity[pserver][pcol] == 0
                assert int(layout.parity_servers(np.array([stripe]))[0, 0]) == pserver
        for j, members in plan.parity_source.items():
            stripes, pidx, slots = layout.parity_rows_of(index, 10 ** 6)
            for b in blocks:
                stripe = int(stripes[(slots == b * m + j)][0])
                for u, (server, col) in members.items():
                    assert data_row_id(server, col, b) == stripe * k + u


@pytest.mark.parametrize("k,m,backend", [(2, 1, "isa_l_rs_vand"), (3, 2, "isa_l_rs_vand"), (4, 2, "isa_l_rs_cauchy")])
def test_combine_decodes_and_encodes_like_pyeclib(k, m, backend):
    codec = Codec(k, m, backend, kernel="cpu")
    rng = np.random.default_rng(k * 10 + m)
    data = rng.integers(0, 256, (300, k, 96), dtype=np.uint8)
    parity = codec.encode_stripes(data)
    rows = {u: np.ascontiguousarray(data[:, u]) for u in range(k)}
    for j in range(m):
        encoded = codec.combine([(codec.coefficients[j][u], rows[u]) for u in range(k)])
        assert np.array_equal(encoded, parity[:, j])
        members = dict(rows) | {k + j: np.ascontiguousarray(parity[:, j])}
        for t in range(k):
            decoded = codec.combine([(a, members[u]) for u, a in codec.data_decode_coefficients(t, j).items()])
            assert np.array_equal(decoded, data[:, t])
            assert np.array_equal(decoded, codec.reconstruct_stripes(
                {u: members[u] for u in members if u != t}, [t])[t])
    with pytest.raises(ValueError, match="shapes"):
        codec.combine([(1, rows[0]), (1, rows[1][:10])])
    with pytest.raises(ValueError, match="lost"):
        codec.data_decode_coefficients(k, 0)


@pytest.mark.parametrize("spec", [
    TableSpec("t", 10_000, 16, seed=7),
    TableSpec("emb", 4_000_000, 64, optimizer="adagrad", initial_accumulator_value=0.1, seed=3),
    TableSpec("n", 500, 3, init="normal", seed=1),
    TableSpec("z", 500, 5, init="zeros", optimizer="adagrad", initial_accumulator_value=0.5),
])
def test_initial_rows_from_the_kernel_equal_the_numpy_reference(spec):
    ids = np.random.default_rng(0).integers(0, spec.num_rows, 20_000)
    assert np.array_equal(initial_payload(spec, ids).view(np.uint32), _initial_payload_numpy(spec, ids).view(np.uint32))


def _wait_redundant(local, index, since, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e.kind == "redundant" and e.index == index and e.wall_time >= since for e in local.cluster_map().events):
            return
        time.sleep(0.05)
    raise AssertionError("the replacement never became fully redundant")


@pytest.mark.cluster
@pytest.mark.parametrize("servers,k,m,victim,transport,backend", [
    (4, 2, 1, 1, "socket", "isa_l_rs_vand"), (5, 2, 2, 3, "socket", "isa_l_rs_vand"),
    (4, 2, 1, 2, "grpc", "isa_l_rs_vand"),
    # a code whose first parity is not plain XOR: survivors taken in the wrong order decode to wrong rows (with
    # isa_l_rs_vand's XOR parity and RS(2,1) the order does not show); Adagrad's accumulators start at 0 here,
    # where sqrt(s) + eps and sqrt(s + eps) differ
    (4, 2, 1, 1, "socket", "isa_l_rs_cauchy"), (5, 3, 2, 4, "grpc", "isa_l_rs_cauchy"),
])
def test_fast_rebuild_over_many_rounds_is_bit_exact(make_cluster, servers, k, m, victim, transport, backend):
    """Tables of two row widths, rebuilt in rounds of 600 rows (dozens of rounds, several 8 kB frames each):
    every row and every parity row equal to before the failure, and most of them by the fast path, its
    frames over the transport chosen.  The standby prepared its tables' memory before (ecrec.server.reserve; not
    with --no-standby-reserve, the gRPC case) and the promotion took all of it."""
    reserve = transport == "socket"
    local = make_cluster(servers=servers, standby=1, strategy="ecrec", k=k, m=m,
                         options={"rebuild_batch_rows": "600", "rebuild_frame_bytes": "8000",
                                  "rebuild_transport": transport, "backend": backend},
                         coordinator_options=COORDINATOR_OPTIONS, server_options={"no_standby_reserve": not reserve})
    cluster = Cluster.connect(local.coordinator_address, ClientConfig(rpc_timeout_s=120.0))
    wait_started(cluster, servers)  # a loaded machine may take longer than one creation deadline
    cluster.create_table("wide", 30_001, 24, optimizer="adagrad", lr=0.1, seed=4,
                         initial_accumulator_value=0.0 if backend == "isa_l_rs_cauchy" else 0.1)
    cluster.create_table("narrow", 20_000, 8, optimizer="sgd", lr=0.1, seed=5)
    bags = {"wide": EmbeddingBag(cluster, "wide"), "narrow": EmbeddingBag(cluster, "narrow")}
    rng = np.random.default_rng(1)
    for _ in range(5):  # rows that differ from their initial values, with versions
        for name, bag in bags.items():
            ids = torch.from_numpy(rng.integers(0, bag.spec.num_rows, 3000))
            bag(ids, torch.arange(0, 3000, 10)).square().sum().backward()
        cluster.step()
    cluster.strategy_call("verify_parity")  # every pending parity batch delivered
    before = {name: cluster.read_payload(name)[1].copy() for name in ("wide", "narrow")}
    layout = Layout(servers, k, m)
    specs = [TableSpec.from_proto(t) for t in cluster.refresh_map().tables]  # wait_started's probe table too
    first_of_width = {}
    for spec in specs:  # the parity arena of a row width starts with its first table's rows
        first_of_width.setdefault(spec.row_bytes, spec.name)
    shard_bytes = sum(layout.data_slots_per_server(spec.num_rows) * spec.row_bytes for spec in specs) + sum(
        layout.parity_slots_per_server(spec.num_rows) * spec.row_bytes for spec in specs
        if first_of_width[spec.row_bytes] == spec.name)
    prepared = wait_standby_reserve(cluster)["standby_reserve_bytes"]
    assert prepared == (shard_bytes if reserve else 0)
    t_kill = time.time()
    local.kill(local.pid_of_index(victim))
    cluster.pull("narrow", np.arange(100))  # someone notices; the standby is promoted
    _wait_redundant(local, victim, t_kill)
    stats = cluster.strategy_call("stats", indices=[victim])[victim]
    held = stats["rows_rebuilt"] + stats["parity_rows_rebuilt"]
    # the rows the replayed pushes touched were rebuilt on demand first, row by row; the rest in bulk
    assert stats["bulk_rows_rebuilt"] >= 0.5 * held > 0
    assert stats["bulk_bytes_read"] > 10 * 600 * 24 * 8  # many rounds were read
    assert stats["bulk_bytes_over_socket"] == (stats["bulk_bytes_read"] if transport == "socket" else 0)
    assert stats["server"]["standby_reserve_used_bytes"] == prepared  # the promotion took all of it
    assert stats["server"]["standby_reserve_bytes"] == 0 and not stats["server"]["standby_reserve_pending"]
    for name in before:
        assert np.array_equal(cluster.read_payload(name)[1].view(np.uint32), before[name].view(np.uint32)), name
    checked = cluster.strategy_call("verify_parity")
    assert sum(r["mismatched"] for r in checked.values()) == 0
    assert sum(r["checked"] for r in checked.values()) > 0


def test_counters_keep_increments_made_while_another_amount_is_computed():
    """The background rebuild and on-demand rebuilds add to the same counters; an amount that takes a while to
    compute (an install waiting on the lock) must not swallow another thread's increment meanwhile."""
    counters = Counters()

    def slow_install(rows: int) -> int:
        time.sleep(0.002)
        return rows

    def rebuild(rows: int) -> None:
        for _ in range(25):
            counters.add("rows_rebuilt", slow_install(rows))

    threads = [threading.Thread(target=rebuild, args=(rows,)) for rows in (1, 10, 100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counters["rows_rebuilt"] == 25 * 111
    assert dict(counters) == {"rows_rebuilt": 25 * 111}


@pytest.mark.cluster
@pytest.mark.parametrize("transport", ["socket", "grpc"])
def test_rows_rebuilt_on_demand_are_read_over_parity_channels_and_exact(make_cluster, transport):
    """While the replacement's background rebuild barely runs (``rebuild_duty=0.01``), pulls of its rows rebuild
    them on demand: with ``rebuild_transport=socket`` every read of their stripes' members goes over parity
    channels (``read_channel.py``), with ``grpc`` through ``ReadRows`` calls; either way the rows pulled, and the
    rows after more training, are bit for bit what a cluster that never failed holds."""
    options = {"rebuild_transport": transport, "rebuild_duty": "0.01", "rebuild_batch_rows": "64"}
    local = make_cluster(servers=4, standby=1, strategy="ecrec", k=2, m=1, options=options,
                         coordinator_options=COORDINATOR_OPTIONS)
    cluster = Cluster.connect(local.coordinator_address, ClientConfig(rpc_timeout_s=120.0))
    wait_started(cluster, 4)
    cluster.create_table("t", 40_000, 8, optimizer="adagrad", lr=0.1, seed=2, initial_accumulator_value=0.1)
    bag = EmbeddingBag(cluster, "t")
    rng = np.random.default_rng(3)

    def train(steps):
        for _ in range(steps):
            ids = torch.from_numpy(rng.integers(0, 40_000, 4000))
            bag(ids, torch.arange(0, 4000, 8)).square().sum().backward()
            cluster.step()

    train(4)
    cluster.strategy_call("verify_parity")  # every pending parity batch delivered
    before = cluster.read_payload("t")[1].copy()
    local.kill(local.pid_of_index(1))
    ids = np.arange(0, 40_000, 7)
    pulled = cluster.pull("t", ids).numpy()  # the replacement rebuilds its rows of these on demand
    assert np.array_equal(pulled.view(np.uint32), before[ids, :8].view(np.uint32))
    train(3)  # pushes to rows rebuilt on demand, and to rows rebuilt by the pushes' own pulls
    stats = cluster.strategy_call("stats", indices=[1])[1]
    assert stats["recovering"]  # the background rebuild is far from done: the rows above came on demand
    assert stats["on_demand_calls"] >= 4
    if transport == "socket":  # (a channel that could not open in time under load sends a few through gRPC)
        assert stats["reads_over_channel"] >= stats["on_demand_calls"] > 0
        assert stats.get("reads_over_grpc", 0) <= stats["reads_over_channel"] // 4
    else:
        assert stats["reads_over_grpc"] >= stats["on_demand_calls"] and stats.get("reads_over_channel", 0) == 0
    after = cluster.read_payload("t")[1]
    local.close()
    # the same training on a cluster that never failed, from the same rows: the optimizer applied in the same order
    reference = make_cluster(servers=4, strategy="ecrec", k=2, m=1)
    ref = Cluster.connect(reference.coordinator_address, ClientConfig(rpc_timeout_s=120.0))
    wait_started(ref, 4)
    ref.create_table("t", 40_000, 8, optimizer="adagrad", lr=0.1, seed=2, initial_accumulator_value=0.1)
    ref_bag, rng = EmbeddingBag(ref, "t"), np.random.default_rng(3)
    for _ in range(7):
        ids = torch.from_numpy(rng.integers(0, 40_000, 4000))
        ref_bag(ids, torch.arange(0, 4000, 8)).square().sum().backward()
        ref.step()
    assert np.array_equal(after.view(np.uint32), ref.read_payload("t")[1].view(np.uint32))
