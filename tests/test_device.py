"""``--device`` means what it says: ``cpu`` runs parity work on the CPU kernel even where a GPU works;
``cuda`` without a usable GPU refuses to start before it registers (so it takes no index), naming the cause;
``cuda`` with a GPU keeps parity rows in device memory and recovers bit-exactly like the CPU path.

Real processes on 127.0.0.1.  The GPU test is marked ``gpu``; ``scripts/gpu_check.sh`` fails when it skips
on a machine with a GPU.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ecrec.coding.kernels import gpu as gpu_mod
from ecrec.ops.local import LocalCluster, LocalClusterSpec
from ecrec.wire import cluster_pb2
from helpers import assert_same, baseline, final_state, kill_index, train, wait_redundant

pytestmark = pytest.mark.cluster


def _coordinator_only(servers: int = 1) -> LocalCluster:
    lc = LocalCluster(LocalClusterSpec(servers=servers))
    lc.start_coordinator(["coordinator", "--host", "127.0.0.1", "--port", "0", "--servers", str(servers),
                          "--strategy", "none"])
    return lc


@pytest.mark.skipif(gpu_mod.probe()[0], reason="a GPU works here: the cuda path is tested by test_cuda_cluster_*")
def test_serve_device_cuda_without_a_gpu_fails_before_registering():
    _, why = gpu_mod.probe()
    lc = _coordinator_only()
    try:
        before = lc.cluster_map()
        assert len(before.servers) == 0
        proc = subprocess.run([sys.executable, "-m", "ecrec.cli", "--log-level", "WARNING", "serve", "--coordinator",
                               lc.coordinator_address, "--host", "127.0.0.1", "--device", "cuda"],
                              capture_output=True, text=True, timeout=120)
        after = lc.cluster_map()
        assert proc.returncode == 2, (proc.returncode, proc.stderr)
        assert f"ecrec-server serve: --device cuda: no usable GPU for the parity kernel: {why}" in proc.stderr
        # nothing registered: no index taken, no epoch spent
        assert len(after.servers) == 0 and after.epoch == before.epoch and not after.ready
        # the same coordinator still takes a CPU server at index 0
        lc.start_server(index=0)
        m = lc.wait_ready(60)
        assert [(s.index, s.state) for s in m.servers] == [(0, cluster_pb2.ACTIVE)]
    finally:
        lc.close()


@pytest.mark.skipif(gpu_mod.probe()[0], reason="a GPU works here: the cuda path is tested by test_cuda_cluster_*")
def test_serve_device_cuda_is_refused_by_the_local_cluster_too():
    """``LocalCluster(device="cuda")`` (``ecrec-server local --device cuda``) reports the servers' refusal."""
    lc = LocalCluster(LocalClusterSpec(servers=2, device="cuda", strategy="none"))
    with pytest.raises(RuntimeError, match=r"exited with code 2 while the cluster started"):
        lc.start(timeout_s=120)
    assert all(p.poll() is not None for p in [lc.coordinator_proc, *lc.server_procs])


def test_device_cpu_runs_parity_on_the_cpu_kernel(make_cluster):
    """Before: ``--device cpu`` picked the GPU kernel whenever one worked (kernel ``auto``)."""
    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1, device="cpu")
    from ecrec.client import Cluster

    c = Cluster.connect(local.coordinator_address)
    c.create_table("t", 30, 4)
    stats = c.strategy_call("stats")
    assert sorted(stats) == [0, 1, 2]
    assert {s["kernel"] for s in stats.values()} == {"cpu"}
    assert not any(s["parity_on_device"] for s in stats.values())


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_mod.probe()[0], reason="needs cupy and a usable CUDA device")
def test_cuda_cluster_recovers_bit_exactly_like_the_cpu_path(make_cluster):
    """4 servers with ``--device cuda`` (parity rows in GPU memory), server 1 killed at step 20, a standby
    rebuilds it: every row, optimizer state, dense tensor and parity row equals the failure-free CPU run."""
    expected = baseline(make_cluster, 4, 2, 1)  # --device cpu, no failure
    local = make_cluster(servers=4, standby=1, strategy="ecrec", k=2, m=1, device="cuda")
    cluster, names = train(local.coordinator_address, lambda step, cluster: step == 20 and kill_index(local, 1))
    wait_redundant(cluster, 1)
    stats = cluster.strategy_call("stats")
    assert {s["kernel"] for s in stats.values()} == {"gpu"}
    assert all(s["parity_on_device"] for s in stats.values())
    assert stats[1]["rows_rebuilt"] > 0
    assert_same(final_state(cluster, names), expected)
