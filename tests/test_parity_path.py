"""The parity path's parts: seals (``ecrec.net.seal``), the merge of a group's deltas (``erasure/merge.py``) against a
plain reference, and, with real processes on 127.0.0.1, the direct path (bit-exact across an owner's failure), the
relay where asked for, and callers that claim a server's id without proving it.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ecrec.net import seal
from ecrec.strategies.erasure import batch_frames
from ecrec.strategies.erasure.merge import IN_PLACE_MIN_BYTES, merge_rows
from ecrec.wire import embedding_pb2, parity_pb2, parity_pb2_grpc


# --- seals ---------------------------------------------------------------------------------------------------------
def test_a_batch_seal_checks_only_for_the_same_bytes_and_key():
    sealer = seal.Sealer(bytes(range(32)))
    data = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    mac = sealer.batch_mac(data)
    assert len(mac) == seal.MAC_BYTES and sealer.batch_ok(data, mac)
    flipped = bytearray(data)
    flipped[1234] ^= 1
    assert not sealer.batch_ok(bytes(flipped), mac)
    assert not sealer.batch_ok(data, mac[:-1]) and not sealer.batch_ok(data, b"")
    assert not seal.Sealer(bytes(32)).batch_ok(data, mac), "another cluster's key checked"


def test_a_watermark_seal_covers_every_field_and_is_not_a_batch_seal():
    sealer = seal.Sealer(bytes(range(32)))
    wm = sealer.seal_watermark(embedding_pb2.ParityWatermark(source=1, source_id="a", destination=2,
                                                             destination_id="b", applied_upto=(3 << 32) | 7))
    assert sealer.watermark_ok(wm)
    for field, value in [("source", 0), ("source_id", "x"), ("destination", 3), ("destination_id", "c"),
                         ("applied_upto", 1 << 62)]:
        forged = embedding_pb2.ParityWatermark()
        forged.CopyFrom(wm)
        setattr(forged, field, value)
        assert not sealer.watermark_ok(forged), field
    message = (1).to_bytes(4, "little") + (2).to_bytes(4, "little") + ((3 << 32) | 7).to_bytes(8, "little") + b"a\0b"
    assert not sealer.batch_ok(message, wm.mac), "a watermark's MAC checked as a batch's"


def test_a_caller_proof_is_per_server_id_and_key():
    sealer = seal.Sealer(bytes(range(32)))
    proof = sealer.caller_proof("host:1:abc")
    assert sealer.caller_ok("host:1:abc", proof)
    assert not sealer.caller_ok("host:1:abd", proof) and not sealer.caller_ok("", proof)
    assert not sealer.caller_ok("host:1:abc", "") and not sealer.caller_ok("host:1:abc", "é" * 32)
    assert not seal.Sealer(bytes(32)).caller_ok("host:1:abc", proof)
    with pytest.raises(ValueError, match="32 bytes"):
        seal.Sealer(b"short")


# --- the merge ----------------------------------------------------------------------------------------------------
def reference_merge(segments, k, ntables):
    """Row by row: the XOR of a row's deltas, its first change's old version, its last change's sequence."""
    rows: dict[tuple[int, int], list] = {}
    for slots, table, seq, delta, old_versions in segments:
        for r, slot in enumerate(slots.tolist()):
            key = (table, slot)
            if key not in rows:
                rows[key] = [delta[r].copy(), int(old_versions[r]), seq]
            else:
                rows[key][0] ^= delta[r]
                rows[key][2] = seq
    return rows


@pytest.mark.parametrize("rows_per_segment,width", [(5, 24), (40, 16), (IN_PLACE_MIN_BYTES // 64 + 3, 64),
                                                    (200, 13)])
def test_merge_equals_the_xor_of_each_rows_deltas_grouped_by_position_and_table(rows_per_segment, width):
    rng = np.random.default_rng(rows_per_segment * width)
    k, ntables, slots_per_table = 3, 4, 2 * rows_per_segment
    segments = []
    for push in range(6):
        for table in rng.permutation(ntables)[:3].tolist():
            slots = rng.choice(slots_per_table, rows_per_segment, replace=False).astype(np.int64)
            delta = rng.integers(0, 256, (rows_per_segment, width), dtype=np.uint8)
            segments.append((slots, table, 100 + push, delta, rng.integers(0, 99, rows_per_segment)))
    counts, slots, deltas, old_versions, versions = merge_rows(
        [s[0] for s in segments], [s[1] for s in segments], [s[2] for s in segments], [s[3] for s in segments],
        [s[4] for s in segments], k, ntables)
    expected = reference_merge(segments, k, ntables)
    assert counts.shape == (k, ntables) and counts.sum() == len(slots) == len(expected)
    r = 0
    for p in range(k):  # grouped by position, then table
        for t in range(ntables):
            for _ in range(int(counts[p, t])):
                slot = int(slots[r])
                assert slot % k == p
                want = expected.pop((t, slot))
                np.testing.assert_array_equal(deltas[r], want[0])
                assert (old_versions[r], versions[r]) == (want[1], want[2])
                r += 1
    assert not expected


def test_a_batch_of_dense_deltas_only_is_built_as_a_frame():
    """A group sent directly is built for frames (``sections``): a destination that only backs up a dense tensor
    gets an (empty) entry too, so its batch goes as a frame like the others, not as a protobuf call."""
    from types import SimpleNamespace

    from ecrec.coding.layout import Layout
    from ecrec.strategies.base import AppliedPush, DenseUpdate
    from ecrec.strategies.erasure.groups import PushGroup, build_batches

    layout = Layout(4, 2, 1)
    backup = layout.dense_servers("mlp.weight")[1]
    delta = np.arange(16, dtype=np.uint8)
    push = AppliedPush(("w", 1), 7, dense=[DenseUpdate(SimpleNamespace(spec=SimpleNamespace(name="mlp.weight")), None,
                                                      delta.copy(), 3, delta=delta)])
    group = PushGroup(7, 7, 0.0)
    group.add(push)
    sections: dict = {}
    batches = build_batches(group, layout, 0, "s0", None, sections)
    assert list(batches) == [backup] and not batches[backup].tables
    assert sections == {backup: []}  # a frame of no table entries: its dense deltas travel in the metadata
    meta = parity_pb2.ParityBatches(batches=[batches[backup]])
    decoded, entries = batch_frames.decode(batch_frames.encode(meta, [sections[backup]]))
    assert decoded.batches[0].dense[0].value == delta.tobytes() and entries == [[]]


# --- real processes -------------------------------------------------------------------------------------------------
@pytest.mark.cluster
@pytest.mark.parametrize("transport_", ["socket", "grpc"])
def test_big_groups_sent_directly_recover_bit_exactly(make_cluster, transport_):
    """Every group built on the owner's closer thread and sent directly (``direct_bytes=1``), over parity channels
    (``parity_transport=socket``, the default) or gRPC calls: the same final state, bit for bit, as the
    failure-free run, across an owner killed mid-training."""
    from helpers import assert_same, baseline, final_state, kill_index, train, wait_redundant

    expected = baseline(make_cluster, 4, 2, 1)
    local = make_cluster(servers=4, standby=1, strategy="ecrec", k=2, m=1,
                         options={"direct_bytes": "1", "parity_transport": transport_})

    def on_step(step, cluster):
        if step == 25:
            kill_index(local, 1)

    cluster, names = train(local.coordinator_address, on_step)
    wait_redundant(cluster, 1)
    assert_same(final_state(cluster, names), expected)
    stats = cluster.strategy_call("stats")
    assert sum(s.get("direct_batches", 0) for s in stats.values()) > 0
    assert sum(s.get("relay_batches", 0) for s in stats.values()) == 0
    # as frames (batch_frames): the deltas never in protobuf, on the way out or in
    assert sum(s.get("framed_batches", 0) for s in stats.values()) == sum(s["direct_batches"] for s in stats.values())
    # over the parity channels (the replacement's too: its owners and survivors open new ones), or none at all
    channel = sum(s.get("channel_batches", 0) for s in stats.values())
    if transport_ == "socket":
        direct = sum(s["direct_batches"] for s in stats.values())
        assert channel >= 0.9 * direct, (channel, direct)  # a frame in flight to the killed server went by gRPC
        assert sum(s.get("channel_frames", 0) for s in stats.values()) > 0
    else:
        assert channel == 0 and sum(s.get("channels_opened", 0) for s in stats.values()) == 0


@pytest.mark.cluster
@pytest.mark.parametrize("relay", ["auto", "on", "off", "auto, parity_transport=grpc"])
def test_small_groups_go_directly_over_parity_channels_unless_the_relay_is_asked_for(make_cluster, relay):
    """With the defaults (``relay=auto``; parity channels, no TLS) every group, however small, is built off the push
    path and its batches go to their parity servers directly, over the channels: the worker carries none.  With
    ``relay=on`` -- or ``auto`` where the direct path would be gRPC calls -- small groups ride the worker, sealed.
    Either way: bit for bit the failure-free run's state, across an owner killed mid-training."""
    from helpers import assert_same, baseline, final_state, kill_index, train, wait_redundant

    expected = baseline(make_cluster, 4, 2, 1)
    options = {"auto": {}, "on": {"relay": "on"}, "off": {"relay": "off"},
               "auto, parity_transport=grpc": {"parity_transport": "grpc"}}[relay]
    if relay != "off":  # a worker whose steps a loaded machine slows past the 0.25 s default still relays its groups
        options = {**options, "relay_timeout_s": 2.0}
    options = {**options, "coalesce_pushes": 16}  # groups close before the kill at step 25 (by default: 64, or 0.5 s)
    local = make_cluster(servers=4, standby=1, strategy="ecrec", k=2, m=1, options=options)
    seen = {}

    def counters(cluster):
        stats = cluster.strategy_call("stats")
        return {key: sum(s.get(key, 0) for s in stats.values())
                for key in ("relay_batches", "parity_bytes_relayed", "direct_batches", "channel_batches")}

    def on_step(step, cluster):
        if step == 25:
            seen["before"] = counters(cluster)  # groups of this training's size, no server missing yet
            kill_index(local, 1)

    cluster, names = train(local.coordinator_address, on_step)
    wait_redundant(cluster, 1)
    assert_same(final_state(cluster, names), expected)
    before = seen["before"]
    if relay in ("on", "auto, parity_transport=grpc"):
        assert before["relay_batches"] > 0 and before["parity_bytes_relayed"] > 0, before
    else:
        assert before["relay_batches"] == 0 and before["parity_bytes_relayed"] == 0, before
        assert before["direct_batches"] > 0 and before["channel_batches"] > 0, before


def test_the_relay_option_is_checked():
    from ecrec.strategies.erasure import options

    assert options.parse({}).relay == "auto"
    assert options.parse({"relay": "off"}).relay == "off"
    with pytest.raises(ValueError, match=r"relay='sometimes': choose one of \['auto', 'on', 'off'\]"):
        options.parse({"relay": "sometimes"})


@pytest.mark.cluster
def test_while_a_server_recovers_every_group_goes_directly_not_through_the_worker(make_cluster):
    """While an index rebuilds, groups go to their parity servers directly (off the push path, as frames), never
    relayed through the worker (which would carry every push's deltas twice, sealed, and
    delay them a step).  The rebuild is slowed so that training runs beside it throughout."""
    from helpers import kill_index, train

    local = make_cluster(servers=4, standby=1, strategy="ecrec", k=2, m=1,
                         options={"rebuild_duty": "0.001", "rebuild_duty_training": "0.001",
                                  "rebuild_batch_rows": "3", "relay": "on"})  # small groups relayed until then
    seen = {}

    def counters(cluster):
        stats = cluster.strategy_call("stats")
        return {key: sum(s.get(key, 0) for s in stats.values()) for key in ("relay_batches", "direct_batches")}

    def on_step(step, cluster):
        if step == 10:
            kill_index(local, 1)
        if step == 20:
            seen["from"] = counters(cluster)
        if step == 59:
            seen["to"] = counters(cluster)
            seen["recovering"] = any(s.state == 4 for s in cluster.refresh_map().servers)  # 4 = RECOVERING

    train(local.coordinator_address, on_step)
    assert seen["recovering"], "the rebuild ended before the steps checked"
    assert seen["to"]["direct_batches"] - seen["from"]["direct_batches"] > 0, seen
    assert seen["to"]["relay_batches"] == seen["from"]["relay_batches"], seen


@pytest.mark.cluster
def test_a_worker_claiming_a_server_id_cannot_change_parity(make_cluster):
    """ApplyParity and ResolveSource from a caller that names a live server's id but cannot prove it (it has
    no server key) are refused; parity and the owners' chains are untouched and training goes on."""
    from ecrec.net import transport
    from ecrec.client import Cluster
    from helpers import DIM, ROWS, assert_counts, counting_push

    local = make_cluster(strategy="ecrec", k=2, m=1)
    client = Cluster.connect(local.coordinator_address)
    client.create_table("t", ROWS, DIM, optimizer="sgd", lr=1.0, init="zeros")
    initial = client.read_payload("t")[1].copy()
    counts = np.zeros(ROWS)
    for _ in range(4):
        counting_push(client, np.arange(ROWS))
        counts += 1
    m = client.refresh_map()
    victim, claimed = m.servers[0], m.servers[1]
    stub = parity_pb2_grpc.ParityServiceStub(transport.make_channel(victim.address))
    metadata = (("ecrec-caller", claimed.server_id), ("ecrec-epoch", str(m.epoch)))
    forged = parity_pb2.ParityBatch(source=1, source_id=claimed.server_id, seq=(1 << 40), first_seq=(1 << 40),
                                    destination=0, destination_id=victim.server_id)
    for call in (lambda: stub.ApplyParity(parity_pb2.ParityBatches(batches=[forged], source=1,
                                                                   source_id=claimed.server_id), timeout=5,
                                          metadata=metadata),
                 lambda: transport.make_channel(victim.address).unary_unary(batch_frames.FULL_METHOD)(
                     batch_frames.encode(parity_pb2.ParityBatches(batches=[forged], source=1,
                                                                  source_id=claimed.server_id), [[]]),
                     timeout=5, metadata=metadata),
                 lambda: stub.OpenParityChannel(parity_pb2.OpenParityChannelRequest(), timeout=5, metadata=metadata),
                 lambda: stub.ResolveSource(parity_pb2.ResolveSourceRequest(source=1), timeout=5, metadata=metadata),
                 lambda: stub.ResolveSource(parity_pb2.ResolveSourceRequest(source=1, commit=True, undo_seqs=[1]),
                                            timeout=5, metadata=metadata + (("ecrec-caller-proof", "0" * 32),))):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "prove" in info.value.details()
    for _ in range(4):  # the owners' chains were not closed: training goes on and parity keeps up
        counting_push(client, np.arange(ROWS))
        counts += 1
    assert_counts(client, initial, counts)
