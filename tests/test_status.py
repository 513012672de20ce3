"""``ecrec-server status``: a real cluster shown as a table and as JSON, through a failure and a slow
rebuild; the exit status tells whether the cluster is fully redundant."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ecrec.client import Cluster


def status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ecrec.cli", "status", *args], capture_output=True, text=True,
                          timeout=120)


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.cluster
def test_status_through_a_failure_and_a_slow_rebuild(make_cluster):
    # a slow background rebuild (20 rows per batch, 0.25 s apart) so that the test sees it in progress
    local = make_cluster(servers=3, standby=1, strategy="ecrec", k=2, m=1,
                         options={"rebuild_batch_rows": 20, "rebuild_pause_s": 0.25})
    cluster = Cluster.connect(local.coordinator_address)
    cluster.create_table("t", 600, 8, seed=1)
    cluster.pull("t", list(range(10)))

    r = status("--coordinator", local.coordinator_address, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["fully_redundant"] is True and report["ready"] is True
    assert (report["strategy"], report["k"], report["m"], report["tables"]) == ("ecrec", 2, 1, ["t"])
    active = [s for s in report["servers"] if s["index"] >= 0]
    assert [s["index"] for s in active] == [0, 1, 2]
    for s in active:
        assert s["state"] == "ACTIVE" and s["health"] == "SERVING" and s["epoch"] == report["epoch"]
        assert s["data_rows"] == 200 and s["parity_rows"] == 100 and s["rows_held"] == 300
        assert s["incarnation"] and s["address"].startswith("127.0.0.1:")
    # the standard gRPC health service, on each server's own health port and on its main port
    for s in active:
        assert s["health_address"] and s["health_address"] != s["address"]
        for address in (s["health_address"], s["address"]):
            with grpc.insecure_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, address
    standby = [s for s in report["servers"] if s["index"] < 0]
    assert len(standby) == 1 and standby[0]["state"] == "STANDBY" and standby[0]["rows_held"] == 0

    r = status("--coordinator", local.coordinator_address)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "fully redundant" in lines[0] and "NOT" not in lines[0]
    for header in ("index", "address", "state", "incarnation", "epoch", "rows held", "rebuild", "last events"):
        assert header in lines[1]

    killed_address = next(s["address"] for s in active if s["index"] == 1)
    local.kill(local.pid_of_index(1))

    def recovering():
        report = json.loads(status("--coordinator", local.coordinator_address, "--json").stdout)
        row = next((s for s in report["servers"] if s["index"] == 1 and s["state"] == "RECOVERING"), None)
        return (report, row) if row is not None and row["rebuild_rows_pending"] else None

    report, row = wait_for(recovering, what="index 1 RECOVERING with rows pending")
    assert report["fully_redundant"] is False
    assert row["address"] != killed_address and row["rebuild_rows_total"] == 300
    assert 0 < row["rebuild_rows_pending"] <= 300
    assert [e["kind"] for e in row["last_events"]][-2:] == ["failed", "promoted"]
    r_mid = status("--coordinator", local.coordinator_address)
    if r_mid.returncode == 1:  # still rebuilding when the table was taken: it shows the progress
        assert "NOT fully redundant" in r_mid.stdout and "RECOVERING" in r_mid.stdout and "/300 (" in r_mid.stdout

    r = status("--coordinator", local.coordinator_address, "--wait", "60", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    bars = [line for line in r.stderr.splitlines() if line.strip().startswith("rebuild 1")]
    if bars:  # still rebuilding when --wait began: a plain progress bar (stderr is no terminal) up to complete
        assert bars[-1].split() == ["rebuild", "1", "[##########]", "300/300"], bars
    report = json.loads(r.stdout)
    row = next(s for s in report["servers"] if s["index"] == 1)
    assert row["state"] == "ACTIVE" and row["rebuild_rows_pending"] == 0 and row["rows_held"] == 300
    assert [e["kind"] for e in row["last_events"]] == ["failed", "promoted", "redundant"]


@pytest.mark.cluster
def test_status_is_not_redundant_without_a_replacement(make_cluster):
    local = make_cluster(servers=2, strategy="none")
    local.kill(local.pid_of_index(0))
    r = wait_for(lambda: (lambda r: r if "FAILED" in r.stdout else None)(
        status("--coordinator", local.coordinator_address)), what="index 0 FAILED")
    assert r.returncode == 1
    assert "NOT fully redundant" in r.stdout
    r = status("--coordinator", local.coordinator_address, "--wait", "6", "--json")
    assert r.returncode == 1
    # a wait that shows no rebuild said nothing for all of it: now what it waits for, every 5 s
    assert "waiting for the cluster to be fully redundant" in r.stderr and \
        "no server holds index 0 and no standby is registered" in r.stderr, r.stderr
    report = json.loads(r.stdout)
    assert report["fully_redundant"] is False and report["ready"] is False
    assert {s["index"]: s["state"] for s in report["servers"]} == {0: "FAILED", 1: "ACTIVE"}


def test_status_of_an_unreachable_coordinator_and_bad_arguments():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = status("--coordinator", f"127.0.0.1:{port}", "--timeout", "1")
    assert r.returncode == 2 and "coordinator 127.0.0.1:" in r.stderr and "UNAVAILABLE" in r.stderr
    r = status("--coordinator", f"127.0.0.1:{port}", "--wait", "-1")
    assert r.returncode == 2 and "--wait must be >= 0" in r.stderr
    r = status("--coordinator", f"127.0.0.1:{port}", "--wait", "1e308")  # waited for ever, saying nothing
    assert r.returncode == 2 and "--wait must be >= 0 seconds, got 1e+308 (at most 1e+08)" in r.stderr
    r = status("--coordinator", f"127.0.0.1:{port}", "--timeout", "1", "--wait", "6")
    assert r.returncode == 2 and "waiting for the cluster to be fully redundant" in r.stderr and \
        "the coordinator does not answer" in r.stderr, r.stderr
    r = status("--coordinator", f"127.0.0.1:{port}", "--timeout", "0")
    assert r.returncode == 2 and "timeout must be > 0" in r.stderr
    r = status()
    assert r.returncode == 2 and "--coordinator" in r.stderr


@pytest.mark.cluster
def test_a_server_that_does_not_answer_makes_the_cluster_not_ready_before_the_coordinator_says_so(make_cluster):
    """A server paused (or killed) a moment ago is ACTIVE in the map until the coordinator declares it failed:
    status said ``ready: true`` beside its ``health: UNREACHABLE``."""
    from ecrec.ops import status as status_module

    local = make_cluster(servers=2, strategy="none")
    paused = local.pid_of_index(1)
    local.pause(paused)
    try:
        report = status_module.collect(local.coordinator_address, timeout_s=0.3)
    finally:
        local.resume(paused)
    row = next(s for s in report["servers"] if s["index"] == 1)
    assert row["health"] == "UNREACHABLE" and row["state"] == "ACTIVE", row
    assert report["ready"] is False and report["fully_redundant"] is False


@pytest.mark.cluster
def test_a_named_coordinator_that_does_not_answer_is_said(make_cluster):
    """``--coordinator a,b`` with ``b`` dead (a follower killed, or never started): the live coordinators were
    listed and ``b`` was simply absent, a dead one and one never started alike; now it is named as not answering,
    in the table and the JSON, the cluster's status otherwise as it is."""
    local = make_cluster(servers=2, strategy="none")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = f"127.0.0.1:{port}"
    for named in (f"{local.coordinator_address},{dead}", f"{dead},{local.coordinator_address}"):
        r = status("--coordinator", named, "--timeout", "2")
        assert r.returncode == 0, r.stderr
        assert f"not answering: {dead} (UNAVAILABLE)" in r.stdout, r.stdout
        report = json.loads(status("--coordinator", named, "--timeout", "2", "--json").stdout)
        assert report["coordinators_not_answering"] == [{"address": dead, "error": "UNAVAILABLE"}]
        assert [c["address"] for c in report["coordinators"]] == [local.coordinator_address]
    report = json.loads(status("--coordinator", local.coordinator_address, "--json").stdout)
    assert report["coordinators_not_answering"] == []
    assert "not answering" not in status("--coordinator", local.coordinator_address).stdout


@pytest.mark.cluster
def test_status_names_an_index_no_server_holds_and_says_strategy_none_keeps_no_redundancy(make_cluster):
    """A coordinator for 2 indices with one server: the header said 'NOT fully redundant' and the table listed
    index 0 only, nothing of index 1.  And a ``none`` cluster was 'fully redundant' though a failed server's rows
    start over."""
    local = make_cluster(servers=2, strategy="none")
    r = status("--coordinator", local.coordinator_address)
    assert r.returncode == 0 and "every index served (strategy none keeps no redundancy)" in r.stdout, r.stdout
    local.kill(local.pid_of_index(1))
    r = wait_for(lambda: (lambda r: r if "FAILED" in r.stdout else None)(
        status("--coordinator", local.coordinator_address)), what="index 1 FAILED")
    assert r.returncode == 1 and "NOT fully redundant (strategy none keeps no redundancy)" in r.stdout
    assert "no server holds index 1" in r.stdout.splitlines()[0], r.stdout
    report = json.loads(status("--coordinator", local.coordinator_address, "--json").stdout)
    assert report["unserved_indices"] == [1] and report["standbys"] == 0


def test_status_neither_dials_a_wildcard_listed_coordinator_nor_loses_its_exit_status_to_a_reader():
    """A coordinator bound to every interface lists itself as 0.0.0.0:P: probed, it was named as not answering from
    any other host.  An unreachable coordinator's ``--json`` object written to a reader that left ended the command
    with 1 ("not redundant") instead of 2."""
    import io

    from ecrec.ops import status as status_mod

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    control = {"coordinators": [{"address": "0.0.0.0:7000", "leads": True}, {"address": "[::]:7001", "leads": False}]}
    assert status_mod._named_not_listed(dead, control, 1.0, None) == [{"address": dead, "error": "UNAVAILABLE"}]

    class Gone(io.StringIO):
        def write(self, text):
            raise BrokenPipeError

    outcome: dict = {}
    with pytest.raises((BrokenPipeError, status_mod.CoordinatorUnreachable)):
        status_mod.run(dead, as_json=True, timeout_s=1.0, stream=Gone(), outcome=outcome)
    assert outcome["exit"] == status_mod.EXIT_UNREACHABLE
