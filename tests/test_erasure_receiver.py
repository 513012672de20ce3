"""The parity path between real server objects in one process: an owner's coalesced batches reach a parity
server in any order, once or twice, from the right incarnations only, and parity ends equal to a fresh
encode.  No gRPC: the batches go straight from the owner's outbox to the receiver, as a worker would relay
them (the owners relay: ``relay=on``).
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from ecrec import errors
from ecrec.config import ServerConfig
from ecrec.server.state import ServerState
from ecrec.strategies.base import AppliedPush, TableUpdate
from ecrec.strategies.builtin import ECREC
from ecrec.tables.spec import TableSpec
from ecrec.wire import cluster_pb2, parity_pb2

S, K, M = 4, 2, 1
KEY = bytes(range(32))  # the cluster's server key (ecrec.net.seal)
TABLES = [TableSpec("a", 300, 4, optimizer="adagrad", lr=0.1, eps=1e-8, initial_accumulator_value=0.1, seed=1),
          TableSpec("b", 200, 4, optimizer="sgd", lr=0.1, seed=2),
          TableSpec("c", 120, 6, optimizer="sgd", lr=0.1, seed=3)]  # another row width: another arena


def cluster_map(epoch: int = 3, ids=None) -> cluster_pb2.ClusterMap:
    ids = ids or [f"s{i}" for i in range(S)]
    m = cluster_pb2.ClusterMap(epoch=epoch, num_servers=S, strategy="ecrec", k=K, m=M)
    m.strategy_options.update(ECREC.layout_params(S, K, M, {"coalesce_pushes": "3", "relay": "on"})[2])
    for i, sid in enumerate(ids):
        m.servers.add(index=i, address=f"127.0.0.1:{1 + i}", state=cluster_pb2.ACTIVE, server_id=sid)
    return m


@pytest.fixture
def servers():
    """Four server states (index i, id s<i>) with every table, initial parity encoded."""
    out = []
    for i in range(S):
        st = ServerState(ServerConfig(coordinator="127.0.0.1:1", rpc_timeout_s=0.5), server_id=f"s{i}")
        st.index = i
        st.set_server_key(KEY)  # what the coordinator's Register reply gives a server
        st.adopt_map(cluster_map())
        for spec in TABLES:
            st.create_table(spec)
        out.append(st)
    yield out
    for st in out:
        st.strategy.close()


def push(owner: ServerState, worker_seq: int, rng) -> AppliedPush:
    """Applies random gradients to some of ``owner``'s rows of every table (as the server's Push does)."""
    p = AppliedPush(("w", worker_seq), owner.sequencer.next(owner.epoch))
    for shard in owner.tables():
        ids = np.unique(rng.choice(shard.owned_ids, size=min(12, len(shard.owned_ids)), replace=True))
        grads = rng.standard_normal((len(ids), shard.spec.dim)).astype(np.float32)
        old, new, old_versions = shard.apply_gradients(shard.slots_for(ids), grads, p.seq, keep_old=True)
        p.tables.append(TableUpdate(shard, ids, shard.slots_for(ids), old, new, old_versions))
    return p


def relay_of(owner: ServerState, pushes) -> dict[int, list]:
    """Every relay batch the owner's replies carried for ``pushes``, by destination."""
    out: dict[int, list] = {}
    for p in pushes:
        for r in owner.strategy.on_push(p).relay:
            out.setdefault(r.destination, []).append(r)
    return out


def fresh_encode_matches(servers, index: int) -> None:
    """Every parity row held at ``index`` equals a fresh encode of its stripe's data rows."""
    st = servers[index]
    codec = st.strategy.codec
    for name, (arena, part) in st.strategy.receiver.parts.items():
        stripes = arena.slot_to_stripe[part.slots]
        ids = st.layout.stripe_row_ids(stripes)
        owners, slots = st.layout.locate(ids)
        data = np.zeros((len(stripes), K, part.spec.row_bytes), dtype=np.uint8)
        for r, t in np.argwhere(ids < part.spec.num_rows):
            data[r, t] = servers[int(owners[r, t])].table(name).read_payload(np.array([slots[r, t]]))[0]
        expected = codec.encode_stripes(data)[np.arange(len(stripes)), arena.slot_to_parity_index[part.slots]]
        np.testing.assert_array_equal(arena.rows(part.slots), expected, err_msg=f"table {name} at server {index}")


def test_coalesced_batches_applied_in_any_order_and_twice_give_a_fresh_encode(servers):
    rng = np.random.default_rng(0)
    owner = servers[0]
    relay = relay_of(owner, [push(owner, q, rng) for q in range(1, 10)])  # 9 pushes: 3 groups of 3
    assert relay and all(len(batches) == 3 for batches in relay.values())
    for d, batches in relay.items():
        receiver = servers[d].strategy.receiver
        order = list(reversed(batches)) + [batches[0]]  # newest first (held back), then a duplicate
        watermarks = receiver.on_relay(order)
        assert [(w.source, w.source_id, w.applied_upto) for w in watermarks] == [(0, "s0", (3 << 32) + 9)]
        assert receiver.counters["held_back_batches"] == 2 and receiver.counters["duplicate_batches"] == 1
        fresh_encode_matches(servers, d)
        base = 3 << 32  # the owner's first push came at epoch 3
        entries = receiver.logs[0].entries
        assert [(e.first_seq - base, e.seq - base, len(e.push_ids)) for e in entries.values()] == \
            [(1, 3, 3), (4, 6, 3), (7, 9, 3)]


def test_the_owner_confirms_once_every_destination_applied(servers):
    rng = np.random.default_rng(1)
    owner = servers[1]
    pushes = [push(owner, q, rng) for q in range(1, 4)]
    relay = relay_of(owner, pushes)
    before = pushes[0].seq - 1  # nothing of this incarnation before its first push
    assert owner.strategy.owner.confirmed_upto() == before and owner.strategy.owner.unconfirmed() == 3
    destinations = sorted(relay)
    assert len(destinations) >= 2
    first = servers[destinations[0]].strategy.receiver.on_relay(relay[destinations[0]])
    owner.strategy.on_acks(first)
    assert owner.strategy.owner.confirmed_upto() == before, "confirmed before every destination applied"
    for d in destinations[1:]:
        owner.strategy.on_acks(servers[d].strategy.receiver.on_relay(relay[d]))
    assert owner.strategy.owner.confirmed_upto() == pushes[-1].seq and owner.strategy.owner.unconfirmed() == 0


@pytest.mark.parametrize("relay", ["on", "off"])
def test_a_retried_push_carries_relay_batches_only_when_its_group_was_relayed(servers, relay):
    """The reply to a retry (its first reply was lost) carries the push's batches again only where they were
    relayed; a group sent directly (relay=off, or auto without TLS) gives the worker nothing to carry."""
    import dataclasses
    import time

    rng = np.random.default_rng(4)
    owner = servers[1]
    parity = owner.strategy.owner
    parity.options = dataclasses.replace(parity.options, relay=relay)
    pushes = [push(owner, q, rng) for q in range(1, 4)]
    first = relay_of(owner, pushes)
    deadline = time.monotonic() + 10
    while not all(e.built for e in parity.outbox.values()) and time.monotonic() < deadline:
        time.sleep(0.01)  # relay=off: the closer thread builds the group
    assert parity.outbox and all(e.built for e in parity.outbox.values())
    again = owner.strategy.on_retry(pushes[1].push_id, pushes[1].seq).relay
    if relay == "on":
        assert first and sorted(r.destination for r in again) == sorted(first)
    else:
        assert not first and again == []


def test_batches_for_another_incarnation_or_from_an_unknown_source_are_refused_and_change_nothing(servers):
    rng = np.random.default_rng(2)
    owner = servers[2]
    relay = relay_of(owner, [push(owner, q, rng) for q in range(1, 4)])
    d, batches = next(iter(relay.items()))
    receiver = servers[d].strategy.receiver
    before = {name: arena.rows(part.slots).copy() for name, (arena, part) in receiver.parts.items()}

    stale = parity_pb2.ParityBatch.FromString(batches[0].batch)
    stale.destination_id = "an-earlier-process"
    with pytest.raises(errors.FailedPrecondition, match="replaced"):
        receiver.receive([stale], strict=True)
    foreign = parity_pb2.ParityBatch.FromString(batches[0].batch)
    foreign.source_id = "not-in-the-map"
    with pytest.raises(errors.FailedPrecondition, match="does not name"):
        receiver.receive([foreign], strict=True)
    relayed = receiver.on_relay([r.__class__(destination=d, batch=stale.SerializeToString()) for r in batches[:1]])
    assert relayed == [] and receiver.counters["refused_relayed_batches"] == 1
    bad = parity_pb2.ParityBatch.FromString(batches[0].batch)
    bad.tables[0].positions = np.full(len(bad.tables[0].positions) // 8, K, dtype=np.int64).tobytes()
    with pytest.raises(errors.InvalidRequest, match="out of range"):
        receiver.receive([bad], strict=True)
    for name, (arena, part) in receiver.parts.items():
        np.testing.assert_array_equal(arena.rows(part.slots), before[name])
    assert 2 not in receiver.logs or not receiver.logs[2].entries


def test_resolution_undoes_a_suffix_and_refuses_the_resolved_incarnation(servers):
    rng = np.random.default_rng(3)
    owner = servers[3]
    pushes = [push(owner, q, rng) for q in range(1, 7)]
    relay = relay_of(owner, pushes)  # 2 groups of 3
    d = sorted(relay)[0]
    receiver = servers[d].strategy.receiver
    arenas = {name: (arena, part) for name, (arena, part) in receiver.parts.items()}
    snapshot = {name: arena.rows(part.slots).copy() for name, (arena, part) in arenas.items()}
    receiver.on_relay(relay[d][:1])  # group 1 (pushes 1-3)
    after_first = {name: arena.rows(part.slots).copy() for name, (arena, part) in arenas.items()}
    receiver.on_relay(relay[d][1:])  # group 2 (pushes 4-6)
    with pytest.raises(errors.FailedPrecondition, match="live owner"):  # s3 serves: its chain is not closed
        receiver.list_source(3, "s3-replacement")
    failed = cluster_map(epoch=4)
    failed.servers[3].state = cluster_pb2.FAILED
    servers[d].adopt_map(failed)
    listing = receiver.list_source(3, "s3-replacement")
    assert [len(e.push_ids) for e in listing.logged] == [3, 3]
    assert receiver.list_source(3, "s3-replacement") is listing  # asked again: the same answer
    with pytest.raises(errors.FailedPrecondition, match="follows its replacement's listing"):
        receiver.commit_resolution(3, [listing.logged[0].seq], "another-server")
    receiver.commit_resolution(3, [listing.logged[1].seq], "s3-replacement")  # keep group 1, undo group 2
    receiver.commit_resolution(3, [listing.logged[0].seq], "s3-replacement")  # repeated: no effect
    for name, (arena, part) in arenas.items():
        np.testing.assert_array_equal(arena.rows(part.slots), after_first[name], err_msg=name)
        assert not np.array_equal(after_first[name], snapshot[name]) or name == "c"
    with pytest.raises(errors.FailedPrecondition, match="resolved"):
        receiver.receive([parity_pb2.ParityBatch.FromString(relay[d][1].batch)], strict=True)
    assert receiver.logs[3].committed == {"w": 3}  # each worker incarnation's highest kept push


@pytest.mark.parametrize("kernel", ["generic", "fused"])
def test_a_row_repeated_with_newer_pushes_applies_in_order(kernel):
    """One batch may carry a row once per push; the versioned apply must take each newer one, skip the rest."""
    from ecrec.coding.kernels import KernelBackend, get_kernel

    impl = get_kernel("cpu")
    rng = np.random.default_rng(4)
    parity = rng.integers(0, 256, (6, 64), dtype=np.uint8)
    expect = parity.copy()
    versions = np.array([[5, 0], [0, 0], [2, 9], [0, 0], [0, 0], [0, 0]], dtype=np.int64)
    built = np.array([True, True, True, True, False, True])
    slots = np.array([0, 0, 2, 2, 4, 0])
    positions = np.array([0, 0, 0, 1, 0, 0])
    seqs = np.array([6, 7, 3, 9, 8, 5])
    coeff_row = np.array([7, 3], dtype=np.uint8)
    delta = rng.integers(0, 256, (6, 64), dtype=np.uint8)
    from ecrec.coding.kernels.base import gf_mul_table

    mul = gf_mul_table()
    for r in (0, 1, 2):  # seq 6 and 7 over version 5; seq 3 over 2; seq 9 not over 9; row 4 unbuilt; seq 5 old
        expect[slots[r]] ^= mul[coeff_row[positions[r]]][delta[r]]
    call = KernelBackend.apply_versioned if kernel == "generic" else type(impl).apply_versioned
    applied = call(impl, parity, slots, positions, coeff_row, delta, versions, built, seqs)
    assert applied == 3
    np.testing.assert_array_equal(parity, expect)
    assert versions[0, 0] == 7 and versions[2, 0] == 3 and versions[2, 1] == 9 and versions[4, 0] == 0


def test_every_arrival_order_of_three_groups_ends_the_same(servers):
    rng = np.random.default_rng(5)
    owner = servers[0]
    relay = relay_of(owner, [push(owner, q, rng) for q in range(1, 10)])
    d = sorted(relay)[0]
    receiver = servers[d].strategy.receiver
    results = set()
    for n, order in enumerate(itertools.permutations(relay[d])):
        # forget the previous round: resolve (as if index 0 had failed) keeping nothing applied, then re-apply
        live = servers[d].map
        failed = cluster_pb2.ClusterMap()
        failed.CopyFrom(live)
        failed.servers[0].state = cluster_pb2.FAILED
        servers[d].map = failed
        listing = receiver.list_source(0, f"round-{n}")
        receiver.commit_resolution(0, [e.seq for e in listing.logged], f"round-{n}")
        servers[d].map = live
        receiver.logs[0].resolved_ids.clear()
        receiver.on_relay(list(order))
        results.add(tuple(arena.rows(part.slots).tobytes() for arena, part in receiver.parts.values()))
    assert len(results) == 1
    fresh_encode_matches(servers, d)


def _rows_now(st: ServerState) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every slot of every table here: payload and versions, as they are now."""
    out = {}
    for shard in st.tables():
        rows = shard.read(np.arange(shard.num_slots))
        out[shard.spec.name] = (rows.payload, rows.versions)
    return out


def test_a_rebuild_reads_rows_as_they_were_at_the_last_closed_group(servers):
    """A merged delta is all or nothing, so a rebuild must read a row at a group boundary: here, with a group of
    two pushes still open (some rows changed by both), ``ReadRows`` and the fast path's frames give every row as it
    was after the last closed group -- the open group's deltas taken back out, the versions before its first push
    -- and leave the group open: the next push still closes it by count (its one delta per row then takes a parity
    built from those rows from their version to its last push).  Once it closed, the same reads give the rows as
    they are."""
    from ecrec.net import transport
    from ecrec.strategies.erasure import bulk, frames
    from ecrec.wire import parity_pb2 as pb

    owner, rng = servers[0], np.random.default_rng(11)
    strategy = owner.strategy
    relay_of(owner, [push(owner, q, rng) for q in range(1, 4)])  # a closed group of 3 (coalesce_pushes=3)
    closed = _rows_now(owner)
    open_pushes = [push(owner, q, rng) for q in range(4, 6)]
    relay_of(owner, open_pushes)  # two pushes of the next group: open
    twice = set(open_pushes[0].tables[0].slots.tolist()) & set(open_pushes[1].tables[0].slots.tolist())
    assert twice, "the open group changes no row twice: the test would not show a partial delta"
    now = _rows_now(owner)
    assert any((now[n][1] != closed[n][1]).any() for n in now)  # the open group changed rows
    groups = strategy.counters["groups_closed"]

    def read_rows() -> dict[str, tuple[np.ndarray, np.ndarray]]:
        out = {}
        for shard in owner.tables():  # every row, in a shuffled order, some twice
            ids = rng.permutation(np.concatenate([shard.owned_ids, shard.owned_ids[::3]]))
            reply = strategy.servicer._read_rows(pb.ReadRowsRequest(table=shard.spec.name,
                                                                    ids=transport.ids_to_bytes(ids)))
            out[shard.spec.name] = (np.frombuffer(reply.payload, np.uint8).reshape(len(ids), -1),
                                    transport.bytes_to_ids(reply.versions), shard.slots_for(ids))
        return out

    def read_frames() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        out = {}
        for shard in owner.tables():
            blocks = -(-owner.layout.num_stripes(shard.spec.num_rows) // S)
            request = pb.StreamStripesRequest(table=shard.spec.name, first_block=0, end_block=blocks,
                                              data_positions=list(range(K)), blocks_per_message=7)
            payload, versions, slots = [], [], []
            for buffer in bulk.read_blocks(owner, strategy.receiver, request, strategy.owner.settle_rows):
                frame = frames.parse(buffer, K, 0, shard.spec.row_bytes, K)
                b = np.arange(frame.first_block, frame.first_block + frame.blocks)
                for t in range(K):
                    payload.append(frame.data[t]), versions.append(frame.data_versions[t]), slots.append(t + b * K)
            out[shard.spec.name] = (np.concatenate(payload), np.concatenate(versions), np.concatenate(slots))
        return out

    for reads in (read_rows(), read_frames()):
        for name, (payload, versions, slots) in reads.items():
            np.testing.assert_array_equal(payload, closed[name][0][slots], err_msg=name)
            np.testing.assert_array_equal(versions, closed[name][1][slots], err_msg=name)
    assert strategy.counters["groups_closed"] == groups, "a read closed the open group"
    np.testing.assert_array_equal(_rows_now(owner)["a"][0], now["a"][0])  # the rows themselves unchanged
    relay_of(owner, [push(owner, 6, rng)])  # the third push closes the group, by count
    assert strategy.counters["groups_closed"] == groups + 1
    now = _rows_now(owner)
    for reads in (read_rows(), read_frames()):
        for name, (payload, versions, slots) in reads.items():
            np.testing.assert_array_equal(payload, now[name][0][slots], err_msg=name)
            np.testing.assert_array_equal(versions, now[name][1][slots], err_msg=name)


def test_a_frame_read_while_pushes_apply_is_settled_at_the_last_closed_group(servers):
    """The fast path copies a frame's rows without pausing pushes; a push that lands between the copy and the
    settling (pushes paused) changes rows' versions, and those rows are read again: the frame ends as the rows
    were at the last closed group when it settled, never a mix."""
    owner, rng = servers[1], np.random.default_rng(12)
    shard = owner.table("a")
    slots = np.arange(shard.num_slots)
    payload = np.empty((len(slots), shard.spec.row_bytes), np.uint8)
    versions, ready = np.empty(len(slots), np.int64), np.empty(len(slots), np.uint8)
    rewrites = shard.read_into(slots, payload, versions, ready)
    relay_of(owner, [push(owner, q, rng) for q in range(1, 4)])  # a closed group, after the copy
    closed = _rows_now(owner)["a"]
    relay_of(owner, [push(owner, q, rng) for q in range(4, 6)])  # and an open one
    again = owner.strategy.owner.settle_rows(shard, [(slots, payload, versions, ready, rewrites)])
    assert again > 0
    np.testing.assert_array_equal(payload, closed[0])
    np.testing.assert_array_equal(versions, closed[1])
    shard.write_payload(slots[:1], payload[:1] ^ 1)  # a rewrite outside pushes (a rollback): everything read again
    rewrites = shard.read_into(slots, payload, versions, ready)
    shard.write_payload(slots[:1], payload[:1] ^ 1)
    assert owner.strategy.owner.settle_rows(shard, [(slots, payload, versions, ready, rewrites)]) == len(slots)


def test_a_read_meeting_a_push_under_way_waits_for_it_and_still_reads_at_the_last_closed_group(servers):
    """A push numbered and written but not yet handed to the open group (it holds the apply lock between the two)
    is why a read cannot always settle without pausing pushes: then it waits for the push, and the rows it gives are
    still as they were at the last closed group (the push is in the open group by then, taken out with it)."""
    import threading

    owner, rng = servers[2], np.random.default_rng(14)
    shard, strategy = owner.table("a"), owner.strategy
    relay_of(owner, [push(owner, q, rng) for q in range(1, 4)])  # a closed group
    closed = _rows_now(owner)["a"]
    relay_of(owner, [push(owner, 4, rng)])  # the open group's first push
    slots = np.arange(shard.num_slots)
    payload = np.empty((len(slots), shard.spec.row_bytes), np.uint8)
    versions, ready = np.empty(len(slots), np.int64), np.empty(len(slots), np.uint8)
    rewrites = shard.read_into(slots, payload, versions, ready)
    written, release = threading.Event(), threading.Event()

    def push_under_way():
        with owner.apply_lock:  # as the server's Push: number and write, then hand over, in one hold
            p = push(owner, 5, rng)
            written.set()
            release.wait(5)
            strategy.on_push(p)

    thread = threading.Thread(target=push_under_way)
    thread.start()
    assert written.wait(5)
    pause = owner.pushes_paused

    def pushes_paused():  # the read is about to wait for the push: let the push go on now
        release.set()
        return pause()

    owner.pushes_paused = pushes_paused
    paused = strategy.counters["settled_paused"]
    try:
        strategy.owner.settle_rows(shard, [(slots, payload, versions, ready, rewrites)])
    finally:
        release.set()
        thread.join(5)
        del owner.pushes_paused
    assert strategy.counters["settled_paused"] == paused + 1
    np.testing.assert_array_equal(payload, closed[0])
    np.testing.assert_array_equal(versions, closed[1])


def test_a_dense_tensor_is_read_as_it_was_at_the_last_closed_group(servers):
    """A dense tensor's primary gives it, to a rebuild's read, as it was after its last closed group: the open
    group's deltas taken out, the version before its first push to it."""
    from ecrec.strategies.base import DenseUpdate
    from ecrec.tables.spec import DenseSpec
    from ecrec.wire import parity_pb2 as pb

    spec = DenseSpec("top", (3, 5), optimizer="sgd", lr=0.1)
    primary, *backups = servers[0].layout.dense_servers("top")
    for i in [primary, *backups]:
        servers[i].create_dense(spec, np.arange(15, dtype=np.float32).reshape(3, 5))
    owner, rng = servers[primary], np.random.default_rng(15)
    dense = owner.dense("top")

    def dense_push(q: int) -> AppliedPush:
        p = AppliedPush(("w", q), owner.sequencer.next(owner.epoch))
        old, new, old_version = dense.apply_gradient(rng.standard_normal(15).astype(np.float32), p.seq, keep_old=True)
        p.dense.append(DenseUpdate(dense, old, new, old_version))
        return p

    relay_of(owner, [dense_push(q) for q in range(1, 4)])  # a closed group of three
    closed_payload, closed_version, _ = dense.read()
    relay_of(owner, [dense_push(q) for q in range(4, 6)])  # two pushes of an open group
    assert dense.read()[1] != closed_version
    reply = owner.strategy.servicer._read_rows(pb.ReadRowsRequest(dense="top"))
    assert reply.payload == closed_payload.tobytes()
    assert int(np.frombuffer(reply.versions, np.int64)[0]) == closed_version


def test_while_a_server_recovers_groups_still_coalesce_and_go_directly(servers):
    """A rebuild reads rows at the last closed group, so a recovery does not make every group one push (a batch
    per push and destination cost training a third of its speed): groups close by count as before, and go to
    their parity servers directly, not back through the worker."""
    owner, rng = servers[0], np.random.default_rng(13)
    recovering = cluster_map(epoch=4)
    recovering.servers[1].state = cluster_pb2.RECOVERING
    owner.adopt_map(recovering)
    before = owner.strategy.counters["groups_closed"]
    relay = relay_of(owner, [push(owner, q, rng) for q in range(1, 7)])
    assert owner.strategy.counters["groups_closed"] - before == 2  # coalesce_pushes=3
    assert not relay, "a group was relayed while a server recovers"


def test_one_push_groups_of_a_rebuild_end_when_the_map_says_it_is_over(servers):
    """A verification's read of data rows here makes every group one push (``seal_for_read``: it must read at a
    group boundary), for ``READ_EAGER_S`` after the last read (a rebuild's read no longer does: it reads at the last
    closed group).  Once the map says every server is back and none recovers,
    the rebuild is over: groups close by count again at once, not seconds later (a group per push costs training a
    third of its speed at small rows).  A later read opens the window again."""
    owner, rng = servers[0], np.random.default_rng(5)

    def closes(first: int, count: int) -> int:
        before = owner.strategy.counters["groups_closed"]
        for q in range(first, first + count):
            owner.strategy.on_push(push(owner, q, rng))
        return owner.strategy.counters["groups_closed"] - before

    recovering = cluster_map(epoch=4)
    recovering.servers[1].state = cluster_pb2.RECOVERING
    owner.adopt_map(recovering)
    owner.strategy.owner.seal_for_read()  # a verification read rows here while index 1 recovers
    assert closes(1, 2) == 2  # one push each while it recovers
    owner.adopt_map(cluster_map(epoch=5))  # redundant again: every server active
    assert closes(3, 3) == 1  # coalesce_pushes=3, at once (the read was a moment ago)
    owner.strategy.owner.seal_for_read()  # a later read (a verification, a late retry)
    assert closes(6, 2) == 2


@pytest.mark.parametrize("stagger", [True, False])
def test_first_groups_close_at_sizes_staggered_by_server_so_later_groups_close_in_different_steps(stagger):
    """Every server gets a push at every step; with groups closed by size alone, every server's first group --
    and so every later one -- would close at the same push, the whole cluster's builds in one step.  The first
    group of index ``i`` of ``S`` closes at ``(i + 1) / S`` of ``coalesce_bytes`` instead, later ones at the
    whole size: the servers' closes fall in different steps -- again after one-push groups (a verification read
    data rows) and after groups closed by the timer (training paused).  ``coalesce_stagger=false``: all in one step."""
    per_push = 4 * 16 * 2 * 4  # 4 rows of a 16-wide Adagrad table, weights and state: 512 bytes
    options = {"coalesce_pushes": "1000", "coalesce_bytes": str(8 * per_push), "coalesce_s": "100",
               "relay": "on", "coalesce_stagger": str(stagger).lower()}
    spec = TableSpec("wide", 4000, 16, optimizer="adagrad", lr=0.1, eps=1e-8, initial_accumulator_value=0.1, seed=4)
    states = []
    try:
        for i in range(S):
            st = ServerState(ServerConfig(coordinator="127.0.0.1:1", rpc_timeout_s=0.5), server_id=f"s{i}")
            st.index = i
            st.set_server_key(KEY)
            m = cluster_map()
            m.strategy_options.update(ECREC.layout_params(S, K, M, options)[2])
            st.adopt_map(m)
            st.create_table(spec)
            states.append(st)
        closes = {i: [] for i in range(S)}  # the steps at which each server closed a group

        def train(steps):
            for step in steps:
                for i, st in enumerate(states):
                    shard = st.table("wide")
                    p = AppliedPush(("w", step), st.sequencer.next(st.epoch))
                    ids = shard.owned_ids[(step * 4 + np.arange(4)) % len(shard.owned_ids)]
                    grads = np.ones((4, 16), np.float32)
                    old, new, versions = shard.apply_gradients(shard.slots_for(ids), grads, p.seq, keep_old=True)
                    p.tables.append(TableUpdate(shard, ids, shard.slots_for(ids), old, new, versions))
                    before = st.strategy.counters["groups_closed"]
                    st.strategy.on_push(p)
                    if st.strategy.counters["groups_closed"] > before:
                        closes[i].append(step)

        def check(first_step):
            firsts = [c[0] - first_step for c in closes.values()]
            assert firsts == ([2, 4, 6, 8] if stagger else [8] * S)  # (i + 1) / 4 of 8 pushes' bytes
            for c in closes.values():
                assert np.diff(c).tolist() == [8] * (len(c) - 1)  # then every 8 pushes, keeping the phase
            assert len({c % 8 for cs in closes.values() for c in cs}) == (S if stagger else 1)
            for c in closes.values():
                c.clear()

        train(range(1, 41))
        check(0)
        # a verification read data rows everywhere: one-push groups (every server closes at every step) until the
        # read's window ends (ended here at once, not waited for)
        for st in states:
            st.strategy.owner.seal_for_read()
        train(range(41, 43))
        assert all(c == [41, 42] for c in closes.values())
        for st in states:
            with st.strategy.owner.lock:
                st.strategy.owner._eager_until = 0.0
        for c in closes.values():
            c.clear()
        train(range(43, 83))
        check(42)
        # training paused: the timer closed every open group (at different sizes) and every server's next group
        # starts at the same push
        for st in states:
            st.strategy.owner.close_group()
        train(range(83, 123))
        check(82)
    finally:
        for st in states:
            st.strategy.close()
