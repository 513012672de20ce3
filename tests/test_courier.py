"""The worker's courier (ecrec/client/courier.py) in one process: which held pushes wait for a replay.

``held_elsewhere`` is asked before every request a worker sends (pull and push, every server, every step), so it
answers from a count per incarnation instead of scanning the held pushes; these tests drive acknowledgements,
confirmations, retries and replays in random orders and check it against the definition -- a held push of that
index acknowledged by another incarnation than the one serving it -- and against ``to_replay``.
"""

from __future__ import annotations

import random

import pytest

from ecrec.client.courier import Courier
from ecrec.wire import embedding_pb2


def _request(worker: str, sequence: int) -> embedding_pb2.PushRequest:
    return embedding_pb2.PushRequest(push_id=embedding_pb2.PushId(worker=worker, sequence=sequence))


def _key(request) -> tuple:
    return (request.push_id.worker, request.push_id.incarnation, request.push_id.sequence)


def _by_definition(courier: Courier, index: int, server_id) -> bool:
    return any(h.server_id != server_id for h in courier._held.get(index, {}).values())


def test_held_elsewhere_is_what_the_held_pushes_say_through_acks_confirmations_retries_and_replays():
    rng = random.Random(7)
    courier = Courier()
    incarnations = {0: "a0", 1: "b0"}
    seqs = {0: 0, 1: 0}
    sent: dict[int, list] = {0: [], 1: []}
    checked = 0
    for step in range(3000):
        index = rng.randrange(2)
        op = rng.random()
        sid = incarnations[index]
        if op < 0.45:  # a new push, acknowledged (unconfirmed, or durable at once)
            seqs[index] += 1
            request = _request("w", step)
            confirmed = seqs[index] - rng.randrange(0, 4)
            courier.pushed(index, request, embedding_pb2.PushReply(seq=seqs[index], confirmed_upto=max(0, confirmed),
                                                                   server_id=sid))
            sent[index].append(request)
        elif op < 0.55 and sent[index]:  # a retry of an earlier push, answered by the incarnation serving now
            request = rng.choice(sent[index])
            courier.pushed(index, request, embedding_pb2.PushReply(seq=seqs[index], confirmed_upto=max(0, seqs[index] - 1),
                                                                   server_id=sid))
        elif op < 0.75:  # a reply that confirms a prefix
            courier.received(index, embedding_pb2.PushReply(server_id=sid, confirmed_upto=max(0, seqs[index] - rng.randrange(3))))
        elif op < 0.82:  # the owner fails: a new incarnation serves the index
            incarnations[index] = f"{'ab'[index]}{step}"
            seqs[index] = 0
        else:  # replays to the incarnation serving now: kept by recovery, or applied anew
            for key, request in courier.to_replay(index, sid)[: rng.randrange(1, 4)]:
                if rng.random() < 0.5:
                    reply = embedding_pb2.PushReply(already_applied=True, seq=0, server_id=sid)
                else:
                    seqs[index] += 1
                    reply = embedding_pb2.PushReply(seq=seqs[index], confirmed_upto=max(0, seqs[index] - 1), server_id=sid)
                courier.replayed(index, key, reply)
        for i in (0, 1):
            for server_id in (incarnations[i], "someone else", None):
                expected = _by_definition(courier, i, server_id)
                assert courier.held_elsewhere(i, server_id) == expected, (step, i, server_id)
                assert bool(courier.to_replay(i, server_id or "")) == _by_definition(courier, i, server_id or "")
                checked += expected
    assert checked > 100  # replays were pending often, not only at the start


def test_a_retry_acknowledged_by_a_new_incarnation_moves_its_push_there():
    courier = Courier()
    request = _request("w", 1)
    courier.pushed(0, request, embedding_pb2.PushReply(seq=5, confirmed_upto=4, server_id="old"))
    assert courier.held_elsewhere(0, "new") and not courier.held_elsewhere(0, "old")
    courier.pushed(0, request, embedding_pb2.PushReply(seq=1, confirmed_upto=0, server_id="new"))
    assert not courier.held_elsewhere(0, "new") and courier.held_elsewhere(0, "old")
    assert courier.unconfirmed(0) == 1
    courier.received(0, embedding_pb2.PushReply(server_id="new", confirmed_upto=1))
    assert courier.unconfirmed(0) == 0 and not courier.held_elsewhere(0, "old")


@pytest.mark.parametrize("already_applied", [True, False])
def test_a_replayed_push_is_released_or_held_by_the_incarnation_that_answered(already_applied):
    courier = Courier()
    request = _request("w", 1)
    courier.pushed(0, request, embedding_pb2.PushReply(seq=3, confirmed_upto=1, server_id="old"))
    [(key, _)] = courier.to_replay(0, "new")
    reply = (embedding_pb2.PushReply(already_applied=True, seq=0, server_id="new") if already_applied
             else embedding_pb2.PushReply(seq=2, confirmed_upto=1, server_id="new"))
    courier.replayed(0, key, reply)
    assert not courier.held_elsewhere(0, "new")
    assert courier.unconfirmed(0) == (0 if already_applied else 1)
    assert courier.held_elsewhere(0, "old") == (not already_applied)


def test_batches_ride_along_within_the_room_a_request_has_and_the_rest_wait_in_order():
    """The courier put every batch it held for a server into the worker's next request there, whatever its size:
    a step's part could grow past the message limit and be refused while the other parts were applied."""
    courier = Courier()
    batches = [embedding_pb2.RelayBatch(destination=2, destination_id="d", batch=bytes([n]) * 1000) for n in range(5)]
    reply = embedding_pb2.PushReply(relay=batches)
    courier.received(0, reply)
    request = embedding_pb2.PushRequest()
    added = courier.attach(2, request, budget=2500)
    assert [r.batch[0] for r in request.relay] == [0, 1] and 2000 < added <= 2500
    assert request.ByteSize() <= 2500
    later = embedding_pb2.PushRequest()
    courier.received(0, embedding_pb2.PushReply(relay=[embedding_pb2.RelayBatch(destination=2, batch=b"\x09")]))
    courier.attach(2, later)  # no budget: everything, oldest first
    assert [r.batch[0] for r in later.relay] == [2, 3, 4, 9]
    assert courier.pending_relay() == 0


def test_what_a_push_had_no_room_for_rides_on_pulls_within_their_limit_and_a_step_keeps_room_for_watermarks():
    """Batches a push left in the courier all went on the worker's next pull, past the message limit (refused, and
    the forward failed); a step's size check did not count the watermarks every push carries."""
    from ecrec.client import Cluster
    from ecrec.config import ClientConfig

    cluster = Cluster("127.0.0.1:1", ClientConfig(max_message_bytes=65536))  # (connects to nothing until called)
    try:
        batches = [embedding_pb2.RelayBatch(destination=2, destination_id="d", batch=bytes([n]) * 16000)
                   for n in range(9)]
        cluster.courier.received(0, embedding_pb2.PushReply(relay=batches))
        sent = []
        for _ in range(4):
            request = embedding_pb2.PullRequest(tables=[embedding_pb2.TableIds(table="t", ids=b"\0" * 80)])
            cluster._attach(2, request)
            assert request.ByteSize() <= 65536
            sent += [r.batch[0] for r in request.relay]
        assert sent == list(range(9)) and cluster.courier.pending_relay() == 0  # all of them, in order, once
        watermarks = [embedding_pb2.ParityWatermark(source=1, destination=d, destination_id="x" * 40)
                      for d in range(5)]
        cluster.courier.received(3, embedding_pb2.PullReply(watermarks=watermarks))
        assert cluster.courier.ack_bytes(1) > 5 * 40 and cluster.courier.ack_bytes(0) == 0
    finally:
        cluster.close()


@pytest.mark.cluster
def test_a_worker_gets_its_confirmations_whatever_table_comes_first_and_with_dense_only_pushes(make_cluster):
    """``wait_confirmed`` (and ``close``) ask every index that holds the worker's pushes for something it serves:
    a first table of one row has rows on one index only (the others were never asked: the wait ran out and
    close warned of pushes it would lose), and a worker that pushed dense gradients only asks for them."""
    import time

    import numpy as np
    import torch

    from ecrec.client import Cluster, EmbeddingBag
    from ecrec.config import ClientConfig

    # groups close after 3 s without pushes: the steps' own replies do not confirm them
    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, options={"coalesce_s": "3"})
    client = Cluster.connect(local.coordinator_address, config=ClientConfig(idle_poll_s=0), worker="w")
    try:
        linear = torch.nn.Linear(4, 4)
        client.register_dense(linear)
        linear(torch.ones(1, 4)).sum().backward()
        client.step()
        assert client.wait_confirmed(20) == 0
        client.create_table("tiny", 1, 4)
        client.create_table("big", 3000, 4)
        bag = EmbeddingBag(client, "big")
        ids = torch.as_tensor(np.arange(0, 3000, 7))
        for _ in range(3):
            bag(ids[None, :]).sum().backward()
            client.step()
        assert client.courier.held_indices() == {0, 1, 2}  # every index holds pushes to confirm
        assert client.courier.unconfirmed() >= 3
        t0 = time.monotonic()
        assert client.wait_confirmed(20) == 0
        assert time.monotonic() - t0 < 15
    finally:
        client.close(confirm_timeout_s=0)
