"""Restores in bulk (``ecrec.snapshot.bulk``): every server reads its rows and its parity stripes' data rows from
the snapshot's files and encodes its parity itself; the rows and parity come back bit for bit, a lost server is
rebuilt from them bit for bit, a trained table is restored by pushes, and nobody can make data and parity
disagree (a server filled alone is never served; files changed since the client checked them are refused).
Real servers on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import os
import re

import grpc
import numpy as np
import pytest

from ecrec.client import Cluster
from ecrec.config import ClientConfig
from ecrec.snapshot import bulk
from ecrec.wire import embedding_pb2
from helpers import kill_index, refused, wait_redundant

pytestmark = pytest.mark.cluster

Step = embedding_pb2.RestoreTableRequest
ROWS, DIM = 30_000, 16


def _saved(make_cluster, tmp_path) -> tuple[str, np.ndarray, np.ndarray]:
    """A snapshot of tables ``t`` (Adagrad, every row a value of its own) and ``s`` (SGD) from 2 servers."""
    source = Cluster.connect(make_cluster(servers=2, strategy="none").coordinator_address)
    source.create_table("t", ROWS, DIM, optimizer="adagrad", lr=0.05, initial_accumulator_value=0.1, seed=3)
    source.create_table("s", 777, 4, optimizer="sgd", seed=4)
    t = np.random.default_rng(7).random((ROWS, 2 * DIM), dtype=np.float32)
    s = np.random.default_rng(8).standard_normal((777, 4), dtype=np.float32)
    source.write_rows("t", np.arange(ROWS), t, what="payload", checked=True)
    source.write_rows("s", np.arange(777), s, what="payload", checked=True)
    path = str(tmp_path / "snap")
    source.save(path)
    return path, t, s


def _payload(cluster: Cluster, name: str, rows: int) -> np.ndarray:
    return cluster.read_rows(name, np.arange(rows), "payload").view(np.uint32)


def _parity_ok(cluster: Cluster) -> bool:
    verify = cluster.strategy_call("verify_parity")
    return all(v["mismatched"] == 0 for v in verify.values()) and sum(v["checked"] for v in verify.values()) > 0


def test_a_restore_in_bulk_is_exact_and_a_lost_server_rebuilds_from_it_bit_for_bit(make_cluster, tmp_path):
    """4 servers, RS(2,1): both tables restored in bulk (no pushes), rows and parity exact; a server killed after,
    its replacement rebuilds every row from the parity the servers encoded from the files."""
    path, t, s = _saved(make_cluster, tmp_path)
    local = make_cluster(servers=4, standby=1, strategy="ecrec", k=2, m=1)
    target = Cluster.connect(local.coordinator_address)
    messages = []
    manifest = target.load(path, on_progress=messages.append)
    assert manifest["restored_in_bulk"] == ["t", "s"], messages
    assert any("in bulk" in m for m in messages)
    parts = manifest["restore_parts"]
    assert parts["bulk_s"] >= parts["bulk_fill_s"] > 0 and parts.get("push_s", 0) == 0
    assert parts["servers_rows_cpu_s"] > 0 and parts["servers_fill_s"] > 0
    assert parts["servers_parity_cpu_s"] > 0  # the servers encoded their parity rows
    assert sum(r["server"]["rows"].get("pushed", 0) for r in target.strategy_call("stats").values()) == 0
    assert np.array_equal(_payload(target, "t", ROWS), t.view(np.uint32))
    assert np.array_equal(_payload(target, "s", 777), s.view(np.uint32))
    assert _parity_ok(target)
    kill_index(local, 1)
    wait_redundant(target, 1)
    assert np.array_equal(_payload(target, "t", ROWS), t.view(np.uint32))
    assert np.array_equal(_payload(target, "s", 777), s.view(np.uint32))
    assert _parity_ok(target)
    # and training goes on from it: a push after the restore is applied and kept in parity
    target.write_rows("s", np.arange(10), np.ones((10, 4), np.float32), what="weights", checked=True)
    assert _parity_ok(target)


def test_a_trained_table_is_restored_by_pushes_and_a_none_cluster_in_bulk(make_cluster, tmp_path):
    path, t, s = _saved(make_cluster, tmp_path)
    target = Cluster.connect(make_cluster(servers=3, strategy="ecrec", k=2, m=1).coordinator_address)
    target.create_table("t", ROWS, DIM, optimizer="adagrad", lr=0.05, initial_accumulator_value=0.1, seed=3)
    target.write_rows("t", np.arange(5), np.zeros((5, DIM), np.float32), what="weights", checked=True)
    messages = []
    manifest = target.load(path, on_progress=messages.append)
    assert manifest["restored_in_bulk"] == ["s"]  # t was trained: its rows and deltas go by pushes
    assert any("'t': restored by pushes" in m and "changed by pushes" in m for m in messages), messages
    assert np.array_equal(_payload(target, "t", ROWS), t.view(np.uint32))
    assert _parity_ok(target)
    plain = Cluster.connect(make_cluster(servers=2, strategy="none").coordinator_address)
    assert plain.load(path)["restored_in_bulk"] == ["t", "s"]
    assert np.array_equal(_payload(plain, "t", ROWS), t.view(np.uint32))


def test_a_restore_killed_after_one_table_leaves_the_next_refused_not_blank(make_cluster, tmp_path, caplog):
    """The client killed as the first table's restore in bulk finished: the next table, created blank by the
    restore, served its zeros (pushes applied to them, ``status`` fully redundant) with nothing to tell an operator
    that a restore was cut short.  Now every table to restore in bulk is refused from its creation until its
    restore finishes; loading again restores both bit for bit."""
    import subprocess
    import sys

    path, t, s = _saved(make_cluster, tmp_path)
    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1)
    script = ("import os, signal, sys\n"
              "from ecrec.client import Cluster\n"
              "def progress(text):\n"
              "    if text.startswith(\"restored table 't' in bulk\"):\n"
              "        os.kill(os.getpid(), signal.SIGKILL)\n"
              "Cluster.connect(sys.argv[1]).load(sys.argv[2], on_progress=progress)\n")
    run = subprocess.run([sys.executable, "-c", script, local.coordinator_address, path], timeout=300,
                         capture_output=True, text=True)
    assert run.returncode == -9, run.stderr[-2000:]
    target = Cluster.connect(local.coordinator_address, config=ClientConfig(retry_deadline_s=1.0))
    assert np.array_equal(_payload(target, "t", ROWS), t.view(np.uint32))
    with pytest.raises(Exception, match="being restored"):
        target.pull("s", [0, 1])  # refused: not the zeros of a blank table
    # a longer deadline waits, and says why: the server's reason, logged once the wait outlasts a moment
    waiting = Cluster.connect(local.coordinator_address, config=ClientConfig(retry_deadline_s=3.5))
    with caplog.at_level(logging.DEBUG, logger="ecrec.peers"), pytest.raises(Exception, match="being restored"):
        waiting.pull("s", [0, 1])
    said = [r for r in caplog.records if "busy for" in r.getMessage()]  # once: not a line per retry (every 10 ms)
    assert len(said) == 1 and said[0].levelno == logging.WARNING, caplog.text[-2000:]
    assert "loading the snapshot again" in said[0].getMessage()
    assert Cluster.connect(local.coordinator_address).load(path)["restored_in_bulk"] == ["t", "s"]
    assert np.array_equal(_payload(target, "s", 777), s.view(np.uint32))
    assert np.array_equal(_payload(target, "t", ROWS), t.view(np.uint32))
    assert _parity_ok(target)


def test_a_restores_progress_counts_values_and_ends_at_its_total(make_cluster, tmp_path):
    """A table restored in bulk was counted by its chunks' lengths in the files (headers too: ~1.3 KB a chunk), the
    rest by their values: the progress of a restore of many small chunks went past its total ("0.7 of 0.6 MB")."""
    from ecrec.snapshot import cluster as snapshot_cluster

    source = Cluster.connect(make_cluster(servers=2, strategy="none").coordinator_address)
    source.create_table("a", 20_000, 4, optimizer="sgd", seed=1)
    source.create_table("z", 5_000, 4, optimizer="sgd", seed=2)
    path = str(tmp_path / "small-chunks")
    snapshot_cluster.save(source, path, chunk_bytes=1024)  # ~16 rows a chunk: hundreds of chunks
    target = Cluster.connect(make_cluster(servers=2, strategy="none").coordinator_address)
    target.create_table("z", 5_000, 4, optimizer="sgd", seed=2)
    target.write_rows("z", np.arange(3), np.zeros((3, 4), np.float32), what="weights", checked=True)  # trained
    messages = []
    manifest = target.load(path, on_progress=messages.append)
    assert manifest["restored_in_bulk"] == ["a"], messages  # then z by pushes, counted after a
    counts = [re.search(r"\(([\d.,]+) of ([\d.,]+) MB\)", m) for m in messages]
    counts = [(float(c[1].replace(",", "")), float(c[2].replace(",", ""))) for c in counts if c]
    assert counts and all(done <= total for done, total in counts), messages
    assert counts[-1][0] == counts[-1][1] == round((20_000 + 5_000) * 4 * 4 / 1e6, 1), messages


def _source(path: str, manifest: dict, table: str) -> str:
    fields = ("offsets", "sizes", "file", "offset", "length")
    chunks = {kind: [{f: c[f] for f in fields} for c in manifest["tensors"][f"tables/{table}/{kind}"]["chunks"]]
              for kind in ("weight", "state")}
    files = sorted({c["file"] for kind in chunks.values() for c in kind})
    return json.dumps(chunks | {"files": {f: bulk.file_stamp(path, f) for f in files}}, sort_keys=True)


def _by_hand(make_cluster, tmp_path, path: str, standby: int = 0, retry_deadline_s: float = 1.0):
    """A 3-server RS(2,1) cluster with a blank table ``t`` of the snapshot's shape, and ``call(index, step,
    source_json)``: one step of a restore of ``t`` sent to server ``index`` as any client could."""
    local = make_cluster(servers=3, standby=standby, strategy="ecrec", k=2, m=1)
    target = Cluster.connect(local.coordinator_address, config=ClientConfig(retry_deadline_s=retry_deadline_s))
    target.create_table("t", ROWS, DIM, optimizer="adagrad", lr=0.05, initial_accumulator_value=0.1, seed=3,
                        init="blank")
    source = _source(path, json.loads((tmp_path / "snap" / "manifest.json").read_text()), "t")

    def call(index, step, source_json=source):
        return target.peers.stub(target.peers.address_of(index)).RestoreTable(
            embedding_pb2.RestoreTableRequest(step=step, table="t", path=path, source_json=source_json),
            timeout=30, metadata=target.peers.metadata())

    return local, target, source, call


def test_no_caller_can_make_a_table_serve_with_data_and_parity_that_disagree(make_cluster, tmp_path):
    """Driving the steps by hand as a worker could: a FILL on a server whose peers have not begun is refused with
    nothing written (an ABORT then serves the table as it was); once a server has rewritten its rows, no ABORT
    (there or on a peer, under another source too) and no FINISH before every peer filled serves the table, and
    reads and pushes of it wait (refused as busy); a file changed since BEGIN is refused at FILL; loading the
    snapshot again restores the table exactly, parity verified."""
    path, t, _ = _saved(make_cluster, tmp_path)
    local, target, source, call = _by_hand(make_cluster, tmp_path, path)
    before = _payload(target, "t", ROWS).copy()

    # 1. one server begun: its FILL is refused before anything is written, its ABORT serves the table as it was
    assert call(0, Step.BEGIN).state == "begun"
    refused(lambda: call(0, Step.FILL), grpc.StatusCode.FAILED_PRECONDITION, "has not begun", "nothing changed")
    assert call(0, Step.ABORT).state == "serving"
    assert np.array_equal(_payload(target, "t", ROWS), before) and _parity_ok(target)
    # 2. every server begun, one filled: nothing serves the table again short of every server filling it
    for index in range(3):
        assert call(index, Step.BEGIN).state == "begun"
    filled = call(0, Step.FILL)
    assert filled.state == "filled" and filled.rewritten
    refused(lambda: call(0, Step.FINISH), grpc.StatusCode.FAILED_PRECONDITION, "has not filled")
    refused(lambda: call(0, Step.ABORT), grpc.StatusCode.FAILED_PRECONDITION, "rewritten")
    refused(lambda: call(1, Step.ABORT), grpc.StatusCode.FAILED_PRECONDITION, "server 0 rewrote")
    assert call(0, Step.BEGIN, source + " ").state == "begun"  # another source: the rows stay rewritten
    refused(lambda: call(0, Step.ABORT), grpc.StatusCode.FAILED_PRECONDITION, "rewritten")
    ids = np.arange(3)
    with pytest.raises(Exception, match="being restored"):
        target.read_rows("t", ids)
    with pytest.raises(Exception, match="being restored"):
        target.write_rows("t", ids, np.zeros((3, DIM), np.float32), what="weights", checked=True)
    # 3. a file changed after BEGIN is refused at FILL, nothing trusted
    assert call(1, Step.BEGIN).state == "begun"
    name = sorted(json.loads(source)["files"])[0]
    stat = os.stat(os.path.join(path, name))
    os.utime(os.path.join(path, name), ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    refused(lambda: call(1, Step.FILL), grpc.StatusCode.FAILED_PRECONDITION, "changed since the restore checked it")
    bad = embedding_pb2.RestoreTableRequest(step=Step.BEGIN, table="t", path="relative/snap", source_json=source)
    refused(lambda: target.peers.stub(target.peers.address_of(1)).RestoreTable(
        bad, timeout=30, metadata=target.peers.metadata()), grpc.StatusCode.INVALID_ARGUMENT, "local absolute path")
    malformed = json.loads(source)
    malformed["weight"][0]["length"] = 1e999
    refused(lambda: call(2, Step.BEGIN, json.dumps(malformed)), grpc.StatusCode.INVALID_ARGUMENT, "malformed")
    # 4. the user loads the snapshot again: every server filled, the table served, exact
    manifest = Cluster.connect(local.coordinator_address).load(path)
    assert "t" in manifest["restored_in_bulk"]
    assert np.array_equal(_payload(target, "t", ROWS), t.view(np.uint32))
    assert _parity_ok(target)
    assert {call(i, Step.STATUS).state for i in range(3)} == {"serving"}


def test_a_server_promoted_in_the_middle_of_a_restore_marks_the_table_and_a_new_restore_fills_it(
        make_cluster, tmp_path):
    """Every server begins, servers 0 and 2 fill; server 1 is killed and a standby takes its index. The
    replacement marks the table as its peers do (rewritten: what its rebuild read was half filled), so it is
    refused there too and FINISH is refused; loading the snapshot again fills every server, the replacement
    included, and the table comes back exact, parity verified."""
    path, t, _ = _saved(make_cluster, tmp_path)
    local, target, _, call = _by_hand(make_cluster, tmp_path, path, standby=1)

    for index in range(3):
        assert call(index, Step.BEGIN).state == "begun"
    for index in (0, 2):
        assert call(index, Step.FILL).state == "filled"
    kill_index(local, 1)
    wait_redundant(target, 1)
    adopted = call(1, Step.STATUS)
    assert adopted.state == "begun" and adopted.rewritten and adopted.source == call(0, Step.STATUS).source
    refused(lambda: call(0, Step.FINISH), grpc.StatusCode.FAILED_PRECONDITION, "server 1", "has not filled")
    ids_of_1 = np.arange(ROWS)[target.layout.locate(np.arange(ROWS))[0] == 1][:3]
    with pytest.raises(Exception, match="being restored"):
        target.read_rows("t", ids_of_1)
    manifest = Cluster.connect(local.coordinator_address).load(path)
    assert manifest["restored_in_bulk"] == ["t", "s"]
    assert {call(i, Step.STATUS).state for i in range(3)} == {"serving"}
    assert np.array_equal(_payload(target, "t", ROWS), t.view(np.uint32))
    assert _parity_ok(target)


def test_a_restore_finished_on_one_server_then_a_failure_finishes_on_the_rest(make_cluster, tmp_path):
    """Every server filled, only server 0 finished (the client cut short) and trains on (a push to one of its rows);
    server 2 is then killed: its replacement takes the table as filled (server 0 finished it, so every server had
    filled it); loading the snapshot again finishes it on the rest, then restores the trained table by pushes:
    every row exact, parity verified.  A FINISH naming another source is refused."""
    path, t, _ = _saved(make_cluster, tmp_path)
    local, target, source, call = _by_hand(make_cluster, tmp_path, path, standby=1, retry_deadline_s=120.0)

    for step in (Step.BEGIN, Step.FILL):
        for index in range(3):
            call(index, step)
    refused(lambda: call(0, Step.FINISH, source + " "), grpc.StatusCode.FAILED_PRECONDITION, "another restore")
    assert call(0, Step.FINISH).state == "serving"
    row = int(np.arange(ROWS)[target.layout.locate(np.arange(ROWS))[0] == 0][0])
    target.write_rows("t", [row], np.full((1, DIM), 7.0, np.float32), what="weights", checked=True)
    kill_index(local, 2)
    wait_redundant(target, 1)
    adopted = call(2, Step.STATUS)
    assert adopted.state == "filled" and adopted.source == call(0, Step.STATUS).source
    manifest = Cluster.connect(local.coordinator_address).load(path)
    assert {call(i, Step.STATUS).state for i in range(3)} == {"serving"}
    assert "t" not in manifest["restored_in_bulk"]  # server 0 trained since it finished: the rows go by pushes
    assert np.array_equal(_payload(target, "t", ROWS), t.view(np.uint32))
    assert _parity_ok(target)


def test_a_server_that_does_not_answer_a_mark_is_reported_and_not_asked_for_every_table():
    """The marks before a restore (one BEGIN per table on every server) went one server after another and asked a
    hung server for every table, a whole deadline each (ten tables: ten deadlines before the first fill).  Now a
    table's marks go to every server at once, and a server that does not answer is reported and skipped."""
    import types

    from ecrec.snapshot import cluster as snapshot_cluster

    calls: dict[int, int] = {0: 0, 1: 0, 2: 0}
    reports = []

    class Hung(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

    def stub(address):
        index = int(address.rsplit(":", 1)[1])

        def restore_table(request, timeout, metadata):
            calls[index] += 1
            if index == 1:
                raise Hung()
        return types.SimpleNamespace(RestoreTable=restore_table)

    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(rpc_timeout_s=600.0), layout=types.SimpleNamespace(num_servers=3),
        peers=types.SimpleNamespace(address_of=lambda i: f"127.0.0.1:{i}", stub=stub, metadata=lambda: (),
                                    coordinator=types.SimpleNamespace(report_failure=lambda a, d: reports.append(a))))
    unresponsive: set[int] = set()
    chunks = [("tables/t/weight", {"offsets": [0, 0], "sizes": [1, 1], "file": "f", "offset": 0, "length": 4})]
    for _ in range(4):
        snapshot_cluster._mark_for_bulk(fake, "/x", "t", chunks, {"f": [1, 2, 3, 4]}, unresponsive)
    assert calls == {0: 4, 1: 1, 2: 4} and reports == ["127.0.0.1:1"] and unresponsive == {1}


def test_a_restore_of_another_snapshot_names_a_table_an_earlier_restore_left_half_restored(make_cluster, tmp_path,
                                                                                            capsys):
    """A restore killed while it filled table ``t`` in bulk leaves ``t`` refusing every pull and push until that
    snapshot is restored again.  Restoring another snapshot, one without ``t``, exited 0 and called ``t`` "left
    unchanged"; it exits 1 now and names ``t`` as half restored."""
    from ecrec import cli as server_cli

    path, _, _ = _saved(make_cluster, tmp_path)
    local, target, source, call = _by_hand(make_cluster, tmp_path, path)
    other = Cluster.connect(make_cluster(servers=2, strategy="none").coordinator_address)
    other.create_table("u", 50, 4, optimizer="sgd", seed=5)
    other.save(str(tmp_path / "other"))
    for index in range(3):  # what a restore killed after its first FILL leaves
        assert call(index, Step.BEGIN).state == "begun"
    assert call(0, Step.FILL).state == "filled"
    capsys.readouterr()
    assert server_cli.main(["restore", "--coordinator", local.coordinator_address, str(tmp_path / "other")]) == 1
    err = capsys.readouterr().err
    assert "'t' (not in this snapshot) was left half restored by an earlier restore that was cut short" in err, err
    assert "left unchanged" not in err
    assert [r.name for r in target.refresh_map().tables if r.name == "u"] == ["u"]  # the snapshot's own table
    assert server_cli.main(["restore", "--coordinator", local.coordinator_address, path]) == 0  # the way back
    assert _parity_ok(target)
