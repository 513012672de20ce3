"""What several test modules share: the counting workload (exact integer counts per row, so an update applied
twice or lost shows), the training workload compared bit for bit with a failure-free run, and small process,
port, certificate and error helpers."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time

import grpc
import numpy as np
import pytest
import torch

from ecrec.client import Cluster, EmbeddingBag
from ecrec.config import ClientConfig

# --- the counting workload: SGD with lr=1 and a gradient of 1 on every looked-up element, so after n
# acknowledged pushes touching a row, the row is exactly its initial value minus n (float32 is exact) -----------
ROWS, DIM = 60, 4
FAST = dict(rpc_timeout_s=4.0, retry_deadline_s=60.0)  # a call to a paused server gives up after 4 s


def counting_push(client: Cluster, ids) -> None:
    """One acknowledged push of gradient 1 on every element of rows ``ids`` (distinct)."""
    bag = EmbeddingBag(client, "t")
    bag(torch.as_tensor(np.asarray(ids, np.int64))[None, :]).sum().backward()
    client.step()


def start(make_cluster, **kwargs):
    local = make_cluster(strategy="ecrec", k=2, m=1, **kwargs)
    setup = Cluster.connect(local.coordinator_address, config=ClientConfig(rpc_timeout_s=120.0))
    setup.create_table("t", ROWS, DIM, optimizer="sgd", lr=1.0, init="zeros")  # integer counts: exact in float32
    setup.close()
    client = Cluster.connect(local.coordinator_address, config=ClientConfig(**FAST), worker="counter")
    initial = client.read_payload("t")[1].copy()
    return local, client, initial


def assert_counts(client, initial, counts):
    payload = client.read_payload("t")[1]
    expected = initial.copy()
    expected[:, :DIM] -= counts[:, None]
    np.testing.assert_array_equal(payload.view(np.uint32), expected.view(np.uint32))
    verify = client.strategy_call("verify_parity")
    assert all(v["mismatched"] == 0 for v in verify.values()), verify


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.05)


def serving_pid(local, index: int) -> int | None:
    """The pid of the live local process serving ``index``, None while none does (right after a kill, the map
    still names the killed one until the coordinator declares it failed and promotes a standby)."""
    try:
        return local.pid_of_index(index)
    except LookupError:
        return None


# --- the training workload: two tables and a dense MLP; recovery must leave every bit as a failure-free run ----
TABLES = [("user", 600, 8, "adagrad"), ("item", 300, 8, "sgd")]
STEPS, BATCH = 60, 24


class Model(torch.nn.Module):
    def __init__(self, cluster):
        super().__init__()
        torch.manual_seed(7)
        self.bags = {name: EmbeddingBag(cluster, name) for name, *_ in TABLES}
        self.top = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, sparse):
        return self.top(torch.cat([self.bags[n](ids) for n, ids in sparse.items()], dim=1)).squeeze(1)


def data():
    rng = np.random.default_rng(3)
    for _ in range(STEPS):
        sparse = {name: torch.from_numpy(rng.integers(0, rows, (BATCH, 2))) for name, rows, _, _ in TABLES}
        yield sparse, torch.from_numpy((rng.random(BATCH) < 0.4).astype(np.float32))


def train(address, on_step=None):
    """Trains STEPS steps; ``on_step(step, cluster)`` runs before each step (to kill servers)."""
    torch.set_num_threads(1)
    cluster = Cluster.connect(address)
    for name, rows, dim, opt in TABLES:
        cluster.create_table(name, rows, dim, optimizer=opt, lr=0.05, eps=1e-8, initial_accumulator_value=0.1, seed=11)
    model = Model(cluster)
    names = cluster.register_dense(model.top, optimizer="adagrad", lr=0.05, eps=1e-8, initial_accumulator_value=0.1)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step, (sparse, label) in enumerate(data()):
        if on_step:
            on_step(step, cluster)
        loss_fn(model(sparse), label).backward()
        cluster.step()
    return cluster, names


def wait_redundant(cluster, failures: int, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        m = cluster.refresh_map()
        redundant = sum(1 for e in m.events if e.kind == "redundant")
        if redundant >= failures and all(s.state != 4 for s in m.servers):  # 4 = RECOVERING
            return m
        assert time.monotonic() < deadline, f"not fully redundant after {timeout_s} s: {list(m.events)}"
        time.sleep(0.1)


def final_state(cluster, names):
    state = {}
    for name, *_ in TABLES:
        ids, payload = cluster.read_payload(name)
        state[name] = payload.view(np.uint32).copy()  # bits, not values
    for n in names:
        state["dense:" + n] = cluster.read_dense_payload(n).view(np.uint32).copy()
    verify = cluster.strategy_call("verify_parity")
    assert all(v["mismatched"] == 0 for v in verify.values()), verify
    assert sum(v["checked"] for v in verify.values()) > 0
    return state


_baselines: dict = {}


def baseline(make_cluster, servers, k, m):
    key = (servers, k, m)
    if key not in _baselines:
        local = make_cluster(servers=servers, strategy="ecrec", k=k, m=m)
        cluster, names = train(local.coordinator_address)
        _baselines[key] = final_state(cluster, names)
        local.close()
    return _baselines[key]


def assert_same(state, expected):
    assert state.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(state[name], expected[name], err_msg=f"{name} differs from the failure-free run")


def kill_index(local, index):
    local.kill(local.pid_of_index(index))


# --- small helpers -------------------------------------------------------------------------------------------
def refused(call, code, *words) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    for w in words:
        assert w in info.value.details(), info.value.details()
    return info.value.details()


def children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(x) for x in out.split()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def started_at(pid: int) -> str | None:
    """A process's start time (``/proc/PID/stat``), None when it is gone: with its pid, who it is (a pid is reused)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def born(pids) -> dict[int, str]:
    """``pids`` with their start times: who they are (a pid is reused once its process is gone)."""
    return {pid: started for pid in pids if (started := started_at(pid)) is not None}


def kill_born(processes: dict[int, str]) -> None:
    """SIGKILL to each of ``processes`` (:func:`born`) still running: never to a later process given its pid (a
    test run forks thousands, pids wrap at 32768 here, and test_forks hands out a reaped pid again on purpose)."""
    for pid, started in processes.items():
        if started_at(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def free_port_range(count: int) -> int:
    """A base port such that ``base .. base + count - 1`` are free on 127.0.0.1 right now."""
    for _ in range(200):
        base = random.randint(20_000, 60_000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def issue(ca, directory, name: str) -> dict:
    cert = ca.issue_cert("127.0.0.1", "localhost", common_name=name)
    cert.cert_chain_pems[0].write_to_path(str(directory / f"{name}.pem"))
    cert.private_key_pem.write_to_path(str(directory / f"{name}.key"))
    return {"tls_cert": str(directory / f"{name}.pem"), "tls_key": str(directory / f"{name}.key"),
            "tls_ca": str(directory / "ca.pem")}
