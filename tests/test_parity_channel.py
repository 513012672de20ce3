"""The parity channel's two ends (``ecrec.strategies.erasure.parity_channel``), in-process on 127.0.0.1: frames
arrive whole and in order, only a ticket's holder gets in (once), refusals come back as statuses, and a broken
connection fails the request instead of hanging."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import numpy as np
import pytest

from ecrec import errors
from ecrec.strategies.erasure import batch_frames, frame_socket, parity_channel
from ecrec.wire import parity_pb2


class Recorder:
    """A ``handle`` that keeps what arrived and answers the frame's size as ``applied_upto``."""

    def __init__(self, fail=None):
        self.frames: list[tuple[str, int, bytes]] = []
        self.fail = fail

    def __call__(self, caller, epoch, frame):
        if self.fail is not None:
            raise self.fail
        self.frames.append((caller, epoch, frame.tobytes()))
        return parity_pb2.ParityAck(applied_upto=len(frame), destination_id="dest")


@pytest.fixture
def listener():
    made = []

    def make(handle, max_frame_bytes=1 << 20, timeout_s=5.0):
        made.append(parity_channel.ChannelListener("127.0.0.1", handle, max_frame_bytes, timeout_s))
        return made[-1]

    yield make
    for lst in made:
        lst.close()


def connect(lst, caller="owner-1"):
    return parity_channel.Channel("127.0.0.1", lst.port, lst.ticket_for(caller), 5.0)


def test_frames_arrive_whole_in_order_with_the_caller_the_ticket_was_given_to(listener):
    rec = Recorder()
    lst = listener(rec)
    channel = connect(lst, "owner-7")
    rng = np.random.default_rng(1)
    sent = []
    for i in range(5):
        # many small parts and some large ones: more buffers than one sendmsg takes
        parts = [rng.integers(0, 256, int(n), dtype=np.uint8)
                 for n in (rng.integers(0, 900, 700) if i == 2 else rng.integers(0, 100_000, 9))]
        size = sum(p.nbytes for p in parts)
        ack = parity_pb2.ParityAck.FromString(channel.request(parts, size, 40 + i, 5.0))
        assert ack.applied_upto == size and ack.destination_id == "dest"
        sent.append(b"".join(p.tobytes() for p in parts))
    channel.close()
    assert [(c, e) for c, e, _ in rec.frames] == [("owner-7", 40 + i) for i in range(5)]
    assert [f for _, _, f in rec.frames] == sent


def test_a_parity_frame_travels_as_encode_parts_wrote_it(listener):
    """What the owner writes with ``encode_parts`` is the frame ``decode`` reads (the sections not joined first)."""
    got = []
    lst = listener(lambda caller, epoch, frame: got.append(batch_frames.decode(frame)) or parity_pb2.ParityAck())
    meta = parity_pb2.ParityBatches(source=2, source_id="s2", confirmed_upto=9, batches=[
        parity_pb2.ParityBatch(source=2, seq=10, tables=[parity_pb2.ParityDeltas(tables=["t"], parity=0)])])
    sections = [[(np.arange(3, dtype=np.int64), np.arange(3, dtype=np.int64) * 2, np.zeros(3, np.int64),
                  np.arange(3 * 13, dtype=np.uint8), np.ones(3, np.int64), np.full(3, 10, np.int64))]]
    parts = batch_frames.encode_parts(meta, sections)
    channel = connect(lst)
    channel.request(parts, sum(memoryview(p).nbytes for p in parts), 1, 5.0)
    channel.close()
    (decoded, views), = got
    assert decoded == meta
    for want, view in zip(sections[0][0], views[0][0]):
        assert bytes(view) == memoryview(want).cast("B").tobytes()


def test_only_the_tickets_holder_gets_in_and_only_once(listener):
    rec = Recorder()
    lst = listener(rec)
    ticket = lst.ticket_for("owner-1")
    # a stranger's bytes, and the fast rebuild's opening of the same ticket, are not this ticket's opening
    for first in (b"x" * frame_socket.OPENING_BYTES, frame_socket.opening(ticket)):
        with socket.create_connection(("127.0.0.1", lst.port), timeout=5) as s:
            s.sendall(first + parity_channel.REQUEST.pack(4, 1) + b"abcd")
            s.settimeout(5)
            try:
                answer = s.recv(64)
            except ConnectionResetError:  # closed with our bytes unread
                answer = b""
            assert answer == b""  # closed without an answer
    channel = parity_channel.Channel("127.0.0.1", lst.port, ticket, 5.0)
    channel.request([b"abcd"], 4, 1, 5.0)
    channel.close()
    with pytest.raises(OSError):  # used once already: the connection is closed unanswered
        again = parity_channel.Channel("127.0.0.1", lst.port, ticket, 5.0)
        again.request([b"abcd"], 4, 1, 2.0)
    assert [f for _, _, f in rec.frames] == [b"abcd"]


def test_a_refusal_comes_back_as_its_status_and_the_connection_stays_usable(listener):
    rec = Recorder(fail=errors.FailedPrecondition("caller s9 is not a server of the cluster map"))
    lst = listener(rec)
    channel = connect(lst)
    with pytest.raises(parity_channel.ChannelError) as info:
        channel.request([b"12345678"], 8, 1, 5.0)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not a server" in info.value.details()
    rec.fail = ValueError("bad frame")
    with pytest.raises(parity_channel.ChannelError) as info:
        channel.request([b"12345678"], 8, 1, 5.0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    rec.fail = None
    assert parity_pb2.ParityAck.FromString(channel.request([b"12345678"], 8, 1, 5.0)).applied_upto == 8
    channel.close()


def test_a_frame_over_the_limit_is_refused_before_it_is_read_and_the_connection_ends(listener):
    rec = Recorder()
    lst = listener(rec, max_frame_bytes=100)
    channel = connect(lst)
    with pytest.raises(parity_channel.ChannelError) as info:
        channel.request([b"\0" * 50], 101, 1, 5.0)  # announces more than the limit
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 100" in info.value.details()
    with pytest.raises(OSError):
        channel.request([b"\0" * 8], 8, 1, 2.0)
    channel.close()
    assert rec.frames == []


def test_a_request_fails_when_the_connection_is_closed_under_it_or_the_server_stops_answering(listener):
    started = threading.Event()

    def slow(caller, epoch, frame):
        started.set()
        time.sleep(3)
        return parity_pb2.ParityAck()

    lst = listener(slow)
    channel = connect(lst)
    failed = []

    def request():
        try:
            channel.request([b"abcdefgh"], 8, 1, 30.0)
        except OSError as exc:
            failed.append(exc)

    t = threading.Thread(target=request)
    t.start()
    assert started.wait(5)
    t0 = time.monotonic()
    channel.close()  # as cancel_stale does
    t.join(5)
    assert not t.is_alive() and failed and time.monotonic() - t0 < 2
    other = connect(lst)
    with pytest.raises(TimeoutError):  # the answer takes 3 s; the request's deadline is 0.5 s
        other.request([b"abcdefgh"], 8, 1, 0.5)
    other.close()


def test_a_closed_listener_refuses_connections():
    lst = parity_channel.ChannelListener("127.0.0.1", Recorder(), 1 << 20, 5.0)
    ticket = lst.ticket_for("owner-1")
    lst.close()
    with pytest.raises(OSError):
        parity_channel.Channel("127.0.0.1", lst.port, ticket, 2.0).request([b"x"], 1, 1, 2.0)


def test_an_opening_the_listener_does_not_accept_fails_when_the_channel_opens(listener, monkeypatch):
    """The parity server answers an opening it accepts; a wrong or expired ticket fails ``Channel()`` itself (the
    owner backs off and sends through gRPC) instead of its first frame."""
    lst = listener(Recorder())
    with pytest.raises(OSError):
        parity_channel.Channel("127.0.0.1", lst.port, b"\0" * frame_socket.TICKET_BYTES, 2.0)
    monkeypatch.setattr(parity_channel, "TICKET_TTL_S", 0.05)
    ticket = lst.ticket_for("owner-1")
    time.sleep(0.2)
    with pytest.raises(OSError):
        parity_channel.Channel("127.0.0.1", lst.port, ticket, 2.0)
    connect(lst).close()  # a fresh ticket still opens one


def test_connections_that_never_send_their_opening_are_bounded_and_do_not_stop_the_listener(listener):
    lst = listener(Recorder())
    silent = [socket.create_connection(("127.0.0.1", lst.port), timeout=5) for _ in range(parity_channel.MAX_OPENING)]
    time.sleep(0.2)
    extra = socket.create_connection(("127.0.0.1", lst.port), timeout=5)
    extra.settimeout(3)
    try:
        assert extra.recv(1) == b""  # over the bound: closed at once, not left waiting for its opening
    except ConnectionResetError:
        pass
    extra.close()
    for s in silent:
        s.close()
    time.sleep(0.2)
    channel = connect(lst)  # the slots came back
    assert parity_pb2.ParityAck.FromString(channel.request([b"abcdefgh"], 8, 1, 5.0)).applied_upto == 8
    channel.close()


def test_the_listener_goes_on_accepting_after_running_out_of_descriptors(tmp_path):
    """An accept that fails (EMFILE here) is not the end of the listener: once descriptors are free again, a
    channel opens and carries a frame.  In a child process whose descriptor limit the test lowers."""
    import subprocess
    import sys

    script = tmp_path / "emfile.py"
    script.write_text("""
import resource, socket, time
from ecrec.strategies.erasure import parity_channel
from ecrec.wire import parity_pb2
lst = parity_channel.ChannelListener("127.0.0.1", lambda c, e, f: parity_pb2.ParityAck(applied_upto=len(f)), 1 << 20, 5.0)
ticket = lst.ticket_for("owner")
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
client = socket.socket()  # the client's descriptor taken first: freeing one later raced with other threads for it
client.settimeout(2)
held = []
try:
    while True:
        held.append(open("/dev/null"))
except OSError:
    pass
client.connect(("127.0.0.1", lst.port))  # no descriptor left for the listener to accept it with
clients = [client]
time.sleep(0.5)  # the listener's accept fails with EMFILE meanwhile
for c in clients:
    c.close()
for f in held:
    f.close()
time.sleep(0.3)
channel = parity_channel.Channel("127.0.0.1", lst.port, ticket, 3.0)
print("ACK", parity_pb2.ParityAck.FromString(channel.request([b"abcdefgh"], 8, 1, 3.0)).applied_upto)
""")
    preexec = "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))"
    run = subprocess.run([sys.executable, "-c", f"{preexec}\nexec(open({str(script)!r}).read())"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ACK 8" in run.stdout
    assert "accept failed" in run.stderr  # it met the error and went on


def test_reads_go_to_the_read_handler_and_frames_to_theirs_on_one_connection(listener):
    """A request whose length has ``READ_BIT`` set is a read, answered by ``read`` (a ``ReadRowsReply``); frames on
    the same connection still go to ``handle``; a listener without ``read`` refuses reads UNIMPLEMENTED and its
    connection stays usable; a read over the size limit is refused before it is read."""
    rec, reads = Recorder(), []

    def read(caller, epoch, body):
        request = parity_pb2.ReadRowsRequest.FromString(bytes(body))
        reads.append((caller, epoch, request.table))
        return parity_pb2.ReadRowsReply(payload=request.table.encode() * 3)

    lst = listener(rec)
    lst.read = read
    channel = connect(lst, "replacement-3")
    for i in range(3):
        body = parity_pb2.ReadRowsRequest(table=f"t{i}").SerializeToString()
        reply = parity_pb2.ReadRowsReply.FromString(
            channel.request([body], len(body), 7, 5.0, kind=parity_channel.READ))
        assert reply.payload == f"t{i}".encode() * 3
        assert parity_pb2.ParityAck.FromString(channel.request([b"abcd"], 4, 8, 5.0)).applied_upto == 4
    assert reads == [("replacement-3", 7, f"t{i}") for i in range(3)]
    assert [(c, e, f) for c, e, f in rec.frames] == [("replacement-3", 8, b"abcd")] * 3
    # several connections' reads sent first, then their answers read (RowReader's one round trip for all)
    others = [connect(lst, "replacement-3") for _ in range(3)]
    body = parity_pb2.ReadRowsRequest(table="x").SerializeToString()
    for other in others:
        other.send([body], len(body), 9, parity_channel.READ, time.monotonic() + 5.0)
    assert [parity_pb2.ReadRowsReply.FromString(o.answer(time.monotonic() + 5.0)).payload for o in others] == [b"xxx"] * 3
    for other in [channel, *others]:
        other.close()

    plain = listener(Recorder())  # no read handler
    channel = connect(plain)
    with pytest.raises(parity_channel.ChannelError) as info:
        channel.request([b"\x0a\x01t"], 3, 1, 5.0, kind=parity_channel.READ)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert parity_pb2.ParityAck.FromString(channel.request([b"abcd"], 4, 1, 5.0)).applied_upto == 4
    channel.close()

    small = listener(Recorder(), max_frame_bytes=100)
    small.read = read
    channel = connect(small)
    with pytest.raises(parity_channel.ChannelError) as info:
        channel.request([b"\0" * 50], 101, 1, 5.0, kind=parity_channel.READ)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 100" in info.value.details()
    channel.close()


def test_an_answer_larger_than_the_reader_allows_fails_the_request(listener):
    lst = listener(Recorder())
    lst.read = lambda caller, epoch, body: parity_pb2.ReadRowsReply(payload=b"\1" * (3 << 20))
    channel = connect(lst)
    with pytest.raises(ConnectionError):
        channel.request([b""], 0, 1, 5.0, kind=parity_channel.READ, max_answer_bytes=2 << 20)
    channel.close()
    channel = connect(lst)
    reply = channel.request([b""], 0, 1, 5.0, kind=parity_channel.READ, max_answer_bytes=4 << 20)
    assert len(parity_pb2.ReadRowsReply.FromString(reply).payload) == 3 << 20
    channel.close()
