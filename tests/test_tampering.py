"""A worker that tampers with what it carries between servers cannot change parity or confirm a push.

Under strategy ``ecrec`` with the relay (``relay=on``; by default, the relay carries batches only where the direct
path has no parity channel: TLS) an owner's parity batches reach their parity servers inside the worker's pulls,
and the parity servers' watermarks reach the owner inside its pushes (``docs/protocol.md``).  Everything the
worker carries is sealed by the server that made it (``ecrec.net.seal``).  Here the worker's courier is replaced
by one that tampers -- flips a bit of a delta, makes a batch up, replays an old one, forges watermarks,
sends a batch to the wrong server -- while it trains.  Each time: the tampering is refused and counted,
training goes on, and after the owner is killed (SIGKILL) every row equals the count of acknowledged pushes
and parity equals a fresh encode.  Real processes on 127.0.0.1.

The counting workload (as ``test_safety``): SGD with lr=1 and a gradient of 1 on every looked-up element, so a
row is exactly its initial value minus the number of acknowledged pushes that touched it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from ecrec.client import Cluster
from ecrec.config import ClientConfig
from ecrec.client.courier import Courier
from ecrec.wire import embedding_pb2, parity_pb2
from helpers import DIM, ROWS, assert_counts, counting_push, serving_pid, wait_for

pytestmark = pytest.mark.cluster

OWNER = 1  # the owner killed at the end
STEPS_BEFORE, STEPS_AFTER = 24, 6


class TamperingCourier(Courier):
    """A courier that hands every request to ``attack(courier, index, request)`` after filling it honestly."""

    def __init__(self, attack, cluster_map):
        super().__init__()
        self.attack = attack
        self.map = cluster_map  # () -> the worker's current map
        self.tampered = 0
        self.seen: list[embedding_pb2.RelayBatch] = []  # every genuine batch carried, oldest first
        self.last_seq: dict[int, int] = {}  # owner index -> the newest sequence it acknowledged
        self.genuine_marks: list[embedding_pb2.ParityWatermark] = []

    def attach(self, index: int, request, budget: int | None = None) -> int:
        added = super().attach(index, request, budget)
        self.seen.extend(request.relay)
        if isinstance(request, embedding_pb2.PushRequest):
            self.genuine_marks.extend(request.acks)
        self.attack(self, index, request)
        return added + 1  # (what an attack added is not counted: the request is measured again)

    def pushed(self, index, request, reply) -> None:
        self.last_seq[index] = max(self.last_seq.get(index, 0), reply.seq)
        super().pushed(index, request, reply)

    def server_ids(self) -> dict[int, str]:
        return {s.index: s.server_id for s in self.map().servers if s.index >= 0 and s.state in (1, 4)}


def _batch(relay: embedding_pb2.RelayBatch) -> parity_pb2.ParityBatch:
    return parity_pb2.ParityBatch.FromString(relay.batch)


def flip_a_bit(courier, index, request):
    """One bit of one relayed delta flipped (the seal left as it was)."""
    for r in request.relay:
        b = _batch(r)
        if b.tables and b.tables[0].deltas:
            deltas = bytearray(b.tables[0].deltas)
            deltas[len(deltas) // 2] ^= 0x04
            b.tables[0].deltas = bytes(deltas)
            r.batch = b.SerializeToString()
            courier.tampered += 1


def make_one_up(courier, index, request):
    """A batch of the worker's own making next to each genuine one: random deltas, the next sequence, a seal
    copied from the genuine batch (the worker has no key to make one)."""
    rng = np.random.default_rng(len(courier.seen))
    for r in list(request.relay):
        b = _batch(r)
        if not b.tables:
            continue
        b.prev_seq, b.first_seq, b.seq = b.seq, b.seq + 1, b.seq + 1
        b.tables[0].deltas = rng.integers(0, 256, len(b.tables[0].deltas), dtype=np.uint8).tobytes()
        b.tables[0].seqs = np.full(len(b.tables[0].seqs) // 8, b.seq, dtype=np.int64).tobytes()
        request.relay.add(destination=r.destination, destination_id=r.destination_id, batch=b.SerializeToString(),
                          mac=r.mac)
        courier.tampered += 1


def replay_old(courier, index, request):
    """Every genuine batch ever carried to this server, again, beside the new ones."""
    old = [r for r in courier.seen[:-len(request.relay) or None] if r.destination == index]
    if old:
        request.relay.extend(old[:8])
        courier.tampered += 1


def forge_watermarks(courier, index, request):
    """The parity batches dropped, and watermarks claiming every destination applied every push (random seals)."""
    if request.relay:
        del request.relay[:]
        courier.tampered += 1
    if isinstance(request, embedding_pb2.PushRequest) and index in courier.last_seq:
        ids = courier.server_ids()
        for d, sid in ids.items():
            if d != index:
                request.acks.add(source=index, source_id=ids[index], destination=d, destination_id=sid,
                                 applied_upto=courier.last_seq[index], mac=os.urandom(16))
        courier.tampered += 1


def huge_watermark(courier, index, request):
    """Watermarks of 2^62 for every destination, sealed with a genuine watermark's seal."""
    if isinstance(request, embedding_pb2.PushRequest) and courier.genuine_marks:
        real = courier.genuine_marks[-1]
        ids = courier.server_ids()
        for d, sid in ids.items():
            if d != index:
                request.acks.add(source=index, source_id=ids[index], destination=d, destination_id=sid,
                                 applied_upto=1 << 62, mac=real.mac)
        courier.tampered += 1


def wrong_destination(courier, index, request):
    """Every genuine batch for another server also handed to this one (re-labelled as for this server)."""
    for r in courier.seen[-6:]:
        if r.destination != index:
            request.relay.add(destination=index, destination_id=r.destination_id, batch=r.batch, mac=r.mac)
            courier.tampered += 1


ATTACKS = {
    # attack: (function, counter that must grow on some server, cluster options)
    "flip_a_bit": (flip_a_bit, "refused_relayed_batches", {}),
    "made_up_batch": (make_one_up, "refused_relayed_batches", {}),
    "replayed_old_group": (replay_old, "duplicate_batches", {"coalesce_pushes": "2"}),
    # the direct path held off, so only a forged watermark could confirm the pushes before the kill
    "forged_watermark": (forge_watermarks, "refused_watermarks", {"relay_timeout_s": "30"}),
    "watermark_2_pow_62": (huge_watermark, "refused_watermarks", {"max_unconfirmed": "16"}),
    "wrong_destination": (wrong_destination, "refused_relayed_batches", {}),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_tampering_worker_is_refused_and_no_acknowledged_push_is_lost(make_cluster, attack):
    tamper, counter, options = ATTACKS[attack]
    local = make_cluster(strategy="ecrec", k=2, m=1, standby=1, options={"coalesce_pushes": "4", "relay": "on", **options})
    setup = Cluster.connect(local.coordinator_address, config=ClientConfig(rpc_timeout_s=120.0))
    setup.create_table("t", ROWS, DIM, optimizer="sgd", lr=1.0, init="zeros")
    setup.close()
    client = Cluster.connect(local.coordinator_address, config=ClientConfig(rpc_timeout_s=4.0, retry_deadline_s=60.0),
                             worker="tamperer")
    initial = client.read_payload("t")[1].copy()
    courier = client.courier = TamperingCourier(tamper, lambda: client.map)
    rng = np.random.default_rng(7)
    counts = np.zeros(ROWS)
    for _ in range(STEPS_BEFORE):  # every push is acknowledged: the tampering does not stop training
        ids = rng.choice(ROWS, 12, replace=False)
        counting_push(client, ids)
        counts[ids] += 1
    assert courier.tampered > 0, "the attack never found anything to tamper with"
    # the owner dies holding whatever the tampering left unconfirmed; its replacement and the worker's replay
    # must account for every acknowledged push exactly once
    unconfirmed = client.stats["unconfirmed_pushes"]
    stats = client.strategy_call("stats")  # before the kill: the owner's own counters too
    old_pid = local.pid_of_index(OWNER)
    local.kill(old_pid)
    for _ in range(STEPS_AFTER):
        ids = rng.choice(ROWS, 12, replace=False)
        counting_push(client, ids)
        counts[ids] += 1
    wait_for(lambda: serving_pid(local, OWNER) not in (None, old_pid), 60, "a replacement of the killed owner")
    client.courier = Courier()  # an honest worker reads the result (verification flushes every owner)
    assert_counts(client, initial, counts)
    assert sum(s.get(counter, 0) for s in stats.values()) > 0, f"no server counted {counter}: {stats}"
    if attack == "forged_watermark":
        assert unconfirmed > 0, "nothing was unconfirmed at the kill: the test did not exercise the forgery"


def test_a_refused_batch_is_logged_with_the_worker_that_carried_it(make_cluster):
    local = make_cluster(strategy="ecrec", k=2, m=1, options={"coalesce_pushes": "2", "relay": "on"},
                         log_level="WARNING")
    setup = Cluster.connect(local.coordinator_address, config=ClientConfig(rpc_timeout_s=120.0))
    setup.create_table("t", ROWS, DIM, optimizer="sgd", lr=1.0, init="zeros")
    setup.close()
    client = Cluster.connect(local.coordinator_address, worker="tamperer")
    initial = client.read_payload("t")[1].copy()
    client.courier = TamperingCourier(flip_a_bit, lambda: client.map)
    counts = np.zeros(ROWS)
    for _ in range(6):
        counting_push(client, np.arange(0, ROWS, 3))
        counts[np.arange(0, ROWS, 3)] += 1
    lines = [line for p in local.server_procs for line in local.stderr_tail(p.pid)]
    assert any("refused" in line and "relayed by" in line for line in lines), lines
    client.courier = Courier()
    assert_counts(client, initial, counts)


def test_a_message_full_of_bogus_batches_is_one_log_line_and_counted_whole(make_cluster):
    """200 made-up relay entries in one pull: all refused and counted, one log line for the message (it was one
    WARNING line per entry: a cheap way to flood a server's log)."""
    from ecrec.net import transport
    from ecrec.wire import embedding_pb2_grpc

    local = make_cluster(strategy="ecrec", k=2, m=1, log_level="WARNING")
    setup = Cluster.connect(local.coordinator_address, config=ClientConfig(rpc_timeout_s=120.0))
    setup.create_table("t", ROWS, DIM, optimizer="sgd", lr=1.0, init="zeros")
    client = Cluster.connect(local.coordinator_address, worker="flooder")
    target = next(s for s in client.map.servers if s.index == 0)
    request = embedding_pb2.PullRequest(epoch=client.map.epoch)
    request.tables.add(table="t", ids=transport.ids_to_bytes(np.array([0], np.int64)))
    for n in range(200):
        request.relay.add(destination=0, destination_id=target.server_id, batch=bytes([n % 256]) * 40, mac=b"x" * 16)
    before = client.strategy_call("stats", indices=[0])[0].get("refused_relayed_batches", 0)
    embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(target.address)).Pull(request, timeout=30)
    after = client.strategy_call("stats", indices=[0])[0]["refused_relayed_batches"]
    assert after - before == 200
    pid = local.pid_of_index(0)
    wait_for(lambda: any("were refused" in line for line in local.stderr_tail(pid)), 10, "the refusal's log line")
    lines = [line for line in local.stderr_tail(pid) if "relayed by" in line and "refused" in line]
    assert len(lines) == 1 and "200 parity batches" in lines[0], lines
    setup.close()


def test_a_request_carries_at_most_max_relay_batches_that_are_checked_the_rest_dropped_unread(make_cluster):
    """One pull carrying 10,000 made-up relay entries and 10,000 made-up watermarks (one such pull of 200,000 took
    4 s of server time checking seals, and every refused watermark was a WARNING line): with
    ``--max-relay-batches 100`` the server checks 100 of each, drops the rest unread, counts all of them, and
    logs a line or two for the message; the pull itself is answered, and the dropped entries change nothing."""
    from ecrec.net import transport
    from ecrec.wire import embedding_pb2_grpc

    local = make_cluster(strategy="ecrec", k=2, m=1, log_level="WARNING", server_options={"max_relay_batches": 100})
    setup = Cluster.connect(local.coordinator_address, config=ClientConfig(rpc_timeout_s=120.0))
    setup.create_table("t", ROWS, DIM, optimizer="sgd", lr=1.0, init="zeros")
    client = Cluster.connect(local.coordinator_address, worker="flooder")
    initial = client.read_payload("t")[1].copy()
    target = next(s for s in client.map.servers if s.index == 0)
    request = embedding_pb2.PullRequest(epoch=client.map.epoch)
    request.tables.add(table="t", ids=transport.ids_to_bytes(np.array([0], np.int64)))
    mine = np.flatnonzero(client.layout.locate(np.arange(ROWS))[0] == 0)
    push = embedding_pb2.PushRequest(push_id=embedding_pb2.PushId(worker="flooder", sequence=1), epoch=client.map.epoch)
    push.tables.add(table="t", ids=transport.ids_to_bytes(mine), grads=np.ones((len(mine), DIM), np.float32).tobytes())
    for n in range(10_000):
        request.relay.add(destination=0, destination_id=target.server_id, batch=bytes([n % 256]) * 40, mac=b"x" * 16)
        push.acks.add(source=0, source_id=target.server_id, destination=1, applied_upto=n + 1, mac=b"y" * 16)
    keys = ("refused_relayed_batches", "relay_batches_unchecked", "refused_watermarks")
    before = {k: client.strategy_call("stats", indices=[0])[0].get(k, 0) for k in keys}
    stub = embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(target.address))
    assert len(stub.Pull(request, timeout=60).values) == 1
    assert stub.Push(push, timeout=60).rows_updated == len(mine)
    counts = np.zeros(ROWS)
    counts[mine] += 1
    after = client.strategy_call("stats", indices=[0])[0]
    assert {k: after.get(k, 0) - before[k] for k in keys} == {"refused_relayed_batches": 10_000,
                                                              "relay_batches_unchecked": 9_900,
                                                              "refused_watermarks": 10_000}
    pid = int(target.server_id.split(":")[1])  # the process that took the flood (not whatever the map says now)
    wait_for(lambda: any("dropped unread" in line for line in local.stderr_tail(pid)), 10, "the refusal's log line")
    lines = [line for line in local.stderr_tail(pid) if "relayed by" in line]
    assert 2 <= len(lines) <= 4, lines
    counting_push(client, np.arange(ROWS))
    assert_counts(client, initial, counts + 1)
    setup.close()
