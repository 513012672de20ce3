"""Prometheus metrics: a real cluster's endpoints scraped over HTTP while it trains, and the mapping of a
strategy's stats to metrics in one process."""

from __future__ import annotations

import re

import threading
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ecrec.ops import metrics
from ecrec.client import Cluster, EmbeddingBag
from helpers import free_port_range





def scrape(address: str) -> dict[tuple, float]:
    """``{(sample name, (label, value)...): value}`` of one endpoint."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _train(cluster, emb, steps: int, generator: torch.Generator) -> None:
    for _ in range(steps):
        ids = torch.randint(0, 600, (64,), generator=generator)
        emb(ids, torch.arange(0, 64, 4)).pow(2).sum().backward()
        cluster.step()


@pytest.mark.cluster
def test_endpoints_count_while_training_and_through_a_failure(make_cluster):
    base = free_port_range(5)
    local = make_cluster(servers=3, standby=1, strategy="ecrec", k=2, m=1, metrics_port=base,
                         options={"coalesce_pushes": 1})
    addresses = local.metrics_addresses()
    assert addresses["coordinator"] == f"127.0.0.1:{base}" and addresses["standby 0"] == f"127.0.0.1:{base + 4}"
    cluster = Cluster.connect(local.coordinator_address)
    cluster.create_table("t", 600, 8, optimizer="adagrad", lr=0.1, seed=3)
    emb = EmbeddingBag(cluster, "t")
    generator = torch.Generator().manual_seed(0)

    # scrape from another thread while the loop trains: the endpoints answer under load
    scrapes: list[dict] = []
    stop = threading.Event()

    def scraper():
        while not stop.is_set():
            scrapes.append(scrape(addresses["server 0"]))
            stop.wait(0.05)

    thread = threading.Thread(target=scraper)
    thread.start()
    try:
        _train(cluster, emb, 10, generator)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert scrapes, "no scrape completed during training"
    servers_before = [scrape(addresses[f"server {i}"]) for i in range(3)]
    coordinator_before = scrape(addresses["coordinator"])
    _train(cluster, emb, 10, generator)
    # every server delivers its pending parity batches (and the parity checks out)
    assert cluster.strategy_call("verify_parity", indices=[0])[0]["mismatched"] == 0
    servers_after = [scrape(addresses[f"server {i}"]) for i in range(3)]

    for before, after in zip(servers_before, servers_after):
        for method in ("Pull", "Push"):
            assert value(after, "ecrec_server_requests_total", method=method) >= \
                value(before, "ecrec_server_requests_total", method=method) + 10
            assert value(after, "ecrec_server_request_duration_seconds_count", method=method) == \
                value(after, "ecrec_server_requests_total", method=method)
            assert value(after, "ecrec_server_request_duration_seconds_bucket", method=method, le="+Inf") == \
                value(after, "ecrec_server_request_duration_seconds_count", method=method)
            assert value(after, "ecrec_server_request_duration_seconds_sum", method=method) > 0
        assert value(after, "ecrec_server_rows_pulled_total") > value(before, "ecrec_server_rows_pulled_total")
        assert value(after, "ecrec_server_rows_pushed_total") > value(before, "ecrec_server_rows_pushed_total")
        assert value(after, "ecrec_server_data_rows") == 200  # 600 rows over 3 servers
        assert value(after, "ecrec_recovering") == 0 and value(after, "ecrec_rebuild_progress_ratio") == 1.0
        assert value(after, "ecrec_parity_rows") > 0
        assert 0 < value(after, "ecrec_server_lease_remaining_seconds") <= 3  # holds a lease from the coordinator
    sent = lambda scraped: sum(value(s, "ecrec_parity_batches_sent_total") for s in scraped)
    applied = lambda scraped: sum(value(s, "ecrec_parity_batches_applied_total") for s in scraped)
    delta_bytes = lambda scraped: sum(value(s, "ecrec_parity_delta_bytes_applied_total") for s in scraped)
    assert sent(servers_after) > sent(servers_before)
    assert applied(servers_after) > applied(servers_before) and delta_bytes(servers_after) > delta_bytes(servers_before)
    assert value(coordinator_before, "ecrec_cluster_ready") == 1
    assert value(coordinator_before, "ecrec_cluster_fully_redundant") == 1
    assert value(coordinator_before, "ecrec_cluster_servers", state="active") == 3
    assert value(coordinator_before, "ecrec_cluster_servers", state="standby") == 1
    assert value(coordinator_before, "ecrec_cluster_tables") == 1

    # a failure: the coordinator's epoch and events move; the standby takes index 1 and rebuilds
    local.kill(local.pid_of_index(1))
    _train(cluster, emb, 5, generator)
    deadline = time.monotonic() + 60
    while True:
        coordinator_after = scrape(addresses["coordinator"])
        if value(coordinator_after, "ecrec_cluster_fully_redundant") == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert value(coordinator_after, "ecrec_cluster_epoch") > value(coordinator_before, "ecrec_cluster_epoch")
    assert value(coordinator_after, "ecrec_cluster_events", kind="failed") == 1
    assert value(coordinator_after, "ecrec_cluster_events", kind="promoted") == 1
    assert value(coordinator_after, "ecrec_cluster_fully_redundant") == 1
    replacement = scrape(addresses["standby 0"])
    assert value(replacement, "ecrec_server_index") == 1
    assert value(replacement, "ecrec_server_epoch") == value(coordinator_after, "ecrec_cluster_epoch")
    rebuilt = value(replacement, "ecrec_rebuild_data_rows_total") + value(replacement, "ecrec_rebuild_parity_rows_total")
    assert rebuilt == value(replacement, "ecrec_rebuild_rows") > 0
    assert value(replacement, "ecrec_rebuild_rows_pending") == 0 and value(replacement, "ecrec_recovering") == 0
    assert value(replacement, "process_cpu_seconds_total") > 0  # this process's own CPU and memory too


def test_checkpoint_stats_become_metrics():
    stats = {"saves": 3, "partial_saves": 1, "bytes_written": 4096, "persist_s_total": 0.5, "persist_s_last": 0.2,
             "loads": 1, "load_s_last": 0.04, "load_bytes_last": 2048, "interval_s": None, "dir": "/tmp/x"}
    got = {m.name: m for m in metrics.strategy_metrics(stats)}
    assert got["ecrec_checkpoint_saves"].type == "counter"
    assert got["ecrec_checkpoint_saves"].samples[0].value == 3
    assert got["ecrec_checkpoint_bytes_written"].samples[0].value == 4096
    assert got["ecrec_checkpoint_last_load_seconds"].type == "gauge"
    assert got["ecrec_checkpoint_last_load_bytes"].samples[0].value == 2048
    assert got["ecrec_checkpoint_write_errors"].samples[0].value == 0  # not reported yet: 0, never missing
    assert not any(name.startswith("ecrec_parity") for name in got)  # no ecrec group without its marker


def test_rebuild_progress_and_recovering_from_stats():
    stats = {"redundancy_bytes": 10, "recovering": True, "rebuild_rows_total": 200, "rebuild_rows_pending": 50,
             "rows_rebuilt": 120, "parity_rows_rebuilt": 30}
    got = {m.name: m.samples[0].value for m in metrics.strategy_metrics(stats)}
    assert got["ecrec_recovering"] == 1.0
    assert got["ecrec_rebuild_progress_ratio"] == pytest.approx(0.75)
    assert got["ecrec_rebuild_data_rows"] == 120 and got["ecrec_parity_batches_sent"] == 0
    assert {m.name for m in metrics.strategy_metrics({})} == set()  # strategy "none": nothing to export


def test_bad_metrics_port_is_refused():
    with pytest.raises(ValueError, match="--metrics-port must be 0..65535"):
        metrics.serve(metrics.CoordinatorCollector(lambda: None), "127.0.0.1", 70000)
    import socket

    with socket.socket() as taken:  # a port in use: named as the metrics port (only "[Errno 98]" before)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"--metrics-port {port}: cannot serve metrics on 127.0.0.1:{port}: "
                                          "Address already in use"):
            metrics.serve(metrics.CoordinatorCollector(lambda: None), "127.0.0.1", port)


def test_an_ipv6_host_is_taken_bare_or_in_brackets_and_malformed_brackets_are_refused():
    """``--host ::1`` went into gRPC's bind and the cluster map as ``::1:PORT`` (no port gRPC can read); the servers
    and coordinators now take it as ``[::1]``; brackets that do not enclose the whole host are refused by name,
    by the configurations and by the metrics endpoint (before, ``[::1`` was shown as ``[[::1]:PORT``)."""
    from ecrec.config import CoordinatorConfig, ServerConfig

    server = ServerConfig(coordinator="127.0.0.1:1", host="::1", advertise_host="fe80::1")
    assert (server.host, server.public_host) == ("[::1]", "[fe80::1]")
    assert ServerConfig(coordinator="127.0.0.1:1", host="[::1]").public_host == "[::1]"
    assert ServerConfig(coordinator="127.0.0.1:1", host="127.0.0.1").public_host == "127.0.0.1"
    with pytest.raises(ValueError, match="binds every interface"):
        ServerConfig(coordinator="127.0.0.1:1", host="::").public_host
    for bad in ("[::1", "::1]", "[a]b]"):
        with pytest.raises(ValueError, match="brackets go around a whole IPv6 address"):
            ServerConfig(coordinator="127.0.0.1:1", host=bad)
        with pytest.raises(ValueError, match="brackets go around a whole IPv6 address"):
            metrics.serve(metrics.CoordinatorCollector(lambda: None), bad, 0)
    with pytest.raises(ValueError, match="--advertise-host"):
        ServerConfig(coordinator="127.0.0.1:1", advertise_host="[::1")
    with pytest.raises(ValueError, match="a port goes in its own flag"):
        ServerConfig(coordinator="127.0.0.1:1", host="myhost:7000")  # not taken for an IPv6 address
    assert ServerConfig(coordinator="127.0.0.1:1", host="fe80::1%lo").host == "[fe80::1%lo]"
    from ecrec.config import ClusterSpec

    assert CoordinatorConfig(cluster=ClusterSpec(num_servers=3), host="::1").host == "[::1]"


def test_metrics_are_served_on_an_ipv6_host_in_either_form():
    """``--host [::1]`` (the bracketed form gRPC addresses take) failed to serve metrics ("Name or service not
    known"), and a bare ``::1`` was shown as ``::1:PORT``.  Both now serve, shown as ``[::1]:PORT``; scraped inside
    a network namespace this test creates (its own loopback), removed at the end."""
    import secrets
    import subprocess
    import sys

    from netlab import NetLab

    import socket

    ok, why = NetLab.available()
    if not ok or not socket.has_ipv6:
        pytest.skip(why or "no IPv6 in this Python")
    ns = f"ecrec-v6-{secrets.token_hex(4)}"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, timeout=10)
        script = ("import urllib.request\n"
                  "from ecrec.ops import metrics\n"
                  "for host in ('[::1]', '::1'):\n"
                  "    e = metrics.serve(metrics.CoordinatorCollector(lambda: None), host, 0)\n"
                  "    body = urllib.request.urlopen(f'http://{e.address}/metrics', timeout=10).read().decode()\n"
                  "    print(e.address, 'process_cpu_seconds_total' in body)\n")
        run = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", script], capture_output=True,
                             text=True, timeout=60)
        if run.returncode and ("Address family not supported" in run.stderr or "Cannot assign" in run.stderr):
            pytest.skip(f"IPv6 is off on this machine: {run.stderr.strip().splitlines()[-1]}")
        assert run.returncode == 0, run.stderr[-2000:]
        lines = run.stdout.split()
        assert len(lines) == 4 and all(a.startswith("[::1]:") for a in lines[::2]) and lines[1::2] == ["True"] * 2
    finally:
        subprocess.run(["ip", "netns", "delete", ns], timeout=10)


@pytest.mark.cluster
def test_refused_requests_are_counted_by_method_and_status(make_cluster):
    """A server counts what it refuses -- a push with a NaN gradient, a pull of an unknown table -- by method and
    status (``ecrec_requests_refused_total``); requests it serves are not counted there."""
    import grpc
    import numpy as np

    from ecrec.net import transport
    from ecrec.wire import embedding_pb2, embedding_pb2_grpc

    base = free_port_range(3)
    local = make_cluster(servers=2, strategy="none", metrics_port=base)
    cluster = Cluster.connect(local.coordinator_address)
    cluster.create_table("t", 10, 2, optimizer="sgd", lr=0.1)
    address = next(s.address for s in cluster.map.servers if s.index == 0)
    stub = embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(address))
    ids = np.flatnonzero(cluster.layout.locate(np.arange(10))[0] == 0)[:1]
    nan = embedding_pb2.PushRequest(tables=[embedding_pb2.TableGrads(
        table="t", ids=transport.ids_to_bytes(ids), grads=np.full(2, np.nan, np.float32).tobytes())],
        push_id=embedding_pb2.PushId(worker="w", sequence=1))
    for _ in range(3):
        with pytest.raises(grpc.RpcError):
            stub.Push(nan, timeout=10)
    with pytest.raises(grpc.RpcError):
        stub.Pull(embedding_pb2.PullRequest(tables=[embedding_pb2.TableIds(table="nope", ids=transport.ids_to_bytes(
            ids))]), timeout=10)
    cluster.pull("t", ids)  # served: not a refusal
    scraped = scrape(local.metrics_addresses()["server 0"])
    assert value(scraped, "ecrec_requests_refused_total", method="Push", code="INVALID_ARGUMENT") == 3
    assert value(scraped, "ecrec_requests_refused_total", method="Pull", code="NOT_FOUND") == 1


@pytest.mark.cluster
def test_every_coordinator_exports_the_map_it_serves_and_counts_what_it_refuses(make_cluster):
    """A follower coordinator's endpoint exported its own stale map (ready 0, epoch 1, no server) while ``status``
    through it said fully redundant; ``local`` gave only its first coordinator a metrics port; a coordinator's
    refusals were never exported; ``/metrics?name[]=...`` answered nothing for every name."""
    import grpc

    from helpers import wait_for
    from ecrec.net.peers import coordinator_stub
    from ecrec.wire import cluster_pb2

    from ecrec.control.etcd_local import etcd_binary

    try:
        etcd_binary()
    except FileNotFoundError:
        pytest.skip("needs the etcd binary (apt-get install etcd-server)")
    base = free_port_range(5)
    local = make_cluster(servers=2, strategy="ecrec", k=1, m=1, store="etcd", coordinators=2, metrics_port=base)
    addresses = local.metrics_addresses()
    assert addresses["coordinator 1"] == f"127.0.0.1:{base + 3}", addresses
    leader = local.leading_coordinator()[1]
    epoch = local.cluster_map().epoch
    by_address = dict(zip(local.coordinator_addresses, [addresses["coordinator"], addresses["coordinator 1"]]))
    for address, endpoint in by_address.items():
        scraped = wait_for(lambda: (got := scrape(endpoint)) and value(got, "ecrec_cluster_epoch") >= epoch and got,
                           20, f"{address}'s metrics at epoch {epoch}")
        assert value(scraped, "ecrec_coordinator_leading") == (1.0 if address == leader else 0.0), address
        assert value(scraped, "ecrec_coordinator_map_known") == 1.0
        assert value(scraped, "ecrec_cluster_ready") == 1.0 and value(scraped, "ecrec_cluster_fully_redundant") == 1.0
        assert value(scraped, "ecrec_cluster_servers", state="active") == 2.0, address
    stub = coordinator_stub(leader)
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as refused:
            stub.CreateTable(cluster_pb2.TableSpec(name="bad\nname", num_rows=10, dim=2), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    scraped = scrape(by_address[leader])
    assert value(scraped, "ecrec_requests_refused_total", method="CreateTable", code="INVALID_ARGUMENT") == 2
    with urllib.request.urlopen(f"http://{by_address[leader]}/metrics?name[]=ecrec_cluster_epoch", timeout=10) as r:
        only = [family.name for family in text_string_to_metric_families(r.read().decode())]
    assert only == ["ecrec_cluster_epoch"], only


@pytest.mark.cluster
def test_a_servers_metrics_address_is_the_one_scrapers_reach(make_cluster):
    """A server's metrics address (in ``status``) was its bind address: ``0.0.0.0:P`` for a server bound to every
    interface, not the ``--advertise-host`` the map names it by."""
    import json
    import subprocess
    import sys

    from helpers import wait_for

    local = make_cluster(servers=1, strategy="none")
    proc = subprocess.Popen([sys.executable, "-m", "ecrec.cli", "serve", "--coordinator", local.coordinator_address,
                             "--standby", "--host", "127.0.0.1", "--advertise-host", "localhost", "--port", "0",
                             "--metrics-port", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def standby():
            r = subprocess.run([sys.executable, "-m", "ecrec.cli", "status", "--json", "--coordinator",
                                local.coordinator_address], capture_output=True, text=True, timeout=60)
            return next((s for s in json.loads(r.stdout)["servers"] if s["state"] == "STANDBY" and s["metrics"]), None)
        row = wait_for(standby, 60, "the standby in status with its metrics address")
        host, port = row["metrics"].rsplit(":", 1)
        assert host == "localhost" and row["address"].startswith("localhost:"), row
        assert "ecrec_server_index" in {k[0] for k in scrape(f"127.0.0.1:{port}")}
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_the_docs_list_every_metric():
    """Every metric a server's strategy or the coordinator exports is in the list of docs/operations.md."""
    from pathlib import Path

    from ecrec.wire import cluster_pb2

    readme = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    names = {name + ("_total" if kind == "counter" else "")
             for _, entries in metrics.STRATEGY_METRICS.values() for name, kind, _ in entries.values()}
    names |= {family.name + ("_total" if family.type == "counter" else "")
              for family in metrics.CoordinatorCollector(lambda: cluster_pb2.ClusterMap()).collect()}
    names |= {"ecrec_rebuild_progress_ratio", "ecrec_server_requests_total", "ecrec_server_request_duration_seconds",
              "ecrec_server_rows_pulled_total", "ecrec_server_rows_pushed_total", "ecrec_server_epoch",
              "ecrec_server_lease_remaining_seconds", "ecrec_requests_refused_total"}
    # and every family a collector of this module builds (a hand-kept list missed a server's gauge)
    source = (Path(metrics.__file__)).read_text()
    for kind, name in re.findall(r'(Counter|Gauge|Histogram)MetricFamily\(\s*"(ecrec_[a-z_]+)"', source):
        names.add(name + ("_total" if kind == "Counter" else ""))
    assert "ecrec_server_standby_reserve_bytes" in names
    missing = sorted(name for name in names if f"`{name}`" not in readme)
    assert not missing, f"not in the metrics list of docs/operations.md: {missing}"


def test_local_metrics_urls_bracket_an_ipv6_host():
    """``local --host ::1 --metrics-port P`` printed ``http://::1:P/metrics``: no URL a browser or a scraper takes."""
    from ecrec.cli import ready_message
    from ecrec.ops.local import LocalCluster

    addresses = LocalCluster(servers=2, host="::1", metrics_port=19100).metrics_addresses()
    assert addresses == {"coordinator": "[::1]:19100", "server 0": "[::1]:19101", "server 1": "[::1]:19102"}
    assert "coordinator http://[::1]:19100/metrics" in ready_message("[::1]:7000", addresses)
    assert LocalCluster(servers=1, metrics_port=19100).metrics_addresses()["server 0"] == "127.0.0.1:19101"
