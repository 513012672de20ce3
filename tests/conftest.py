"""Shared fixtures: local clusters of real processes on 127.0.0.1, always cleaned up by pid."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from ecrec.ops import forks, local
from ecrec.ops.local import LocalCluster, LocalClusterSpec

# local clusters' servers and coordinators are forked from a warm parent (ecrec.ops.forks): the same processes,
# started with a tenth of the CPU; ECREC_FORK_SERVER=0 starts each one as `python -m ecrec.cli` instead
SPAWNER = forks.Spawner() if os.environ.get(forks.ENV, "1") != "0" else None
local.use_spawner(SPAWNER)


def _stop(clusters) -> None:
    """Ends every process of ``clusters`` at once (SIGKILL: the test is over, nothing of their shutdown is under
    test there) and waits for them, etcd members included."""
    procs = []
    for cluster in clusters:
        etcd = [*cluster.etcd.procs, *cluster.etcd.old_procs] if cluster.etcd is not None else []
        procs += [p for p in [*cluster.server_procs, *cluster.old_coordinator_procs, cluster.coordinator_proc,
                              *cluster.coordinator_procs, *etcd] if p is not None]
    for p in procs:
        if p.poll() is None:
            p.kill()  # through the handle: never a later process given a reaped child's pid
    for p in procs:
        try:
            p.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a process that cannot be reaped is the kernel's now
            pass
    for cluster in clusters:
        cluster.close()  # its own bookkeeping (etcd data directories, atexit); every process is gone already


def _needs_the_cluster_marker(request) -> None:
    if request.node.get_closest_marker("cluster") is None:
        pytest.fail(f"{request.node.nodeid} starts server processes: mark it @pytest.mark.cluster "
                    "(`-m 'not cluster'` must leave it out)", pytrace=False)


@pytest.fixture(autouse=True)
def _idle_keepers_end_with_their_test(monkeypatch):
    """The idle keepers of clients a test made (and often dropped without ``close()``) stop when it ends: left
    running they would poll clusters that the teardown killed, for a minute, beside the next tests."""
    from ecrec.client import keeper

    started = []
    original = keeper.IdleKeeper.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(keeper.IdleKeeper, "__init__", init)
    yield
    for k in started:
        k.close()


@pytest.fixture
def make_cluster(request):
    """Factory: ``make_cluster(servers=4, strategy="none", ...)`` -> a started LocalCluster.

    Every process started through it is killed by pid at teardown, even when the test fails.  The test must be
    marked ``cluster``.
    """
    _needs_the_cluster_marker(request)
    started: list[LocalCluster] = []
    request.node.ecrec_clusters = started  # (named in the test's report when it fails: _processes_of)

    def factory(**kwargs) -> LocalCluster:
        kwargs.setdefault("host", "127.0.0.1")
        cluster = LocalCluster(LocalClusterSpec(**kwargs))
        started.append(cluster)
        return cluster.start()

    yield factory
    _stop(started)


@pytest.fixture(scope="module")
def shared_cluster(request):
    """Factory of clusters one module's tests share: ``shared_cluster(**spec)`` starts a cluster the first time a
    spec is asked for and hands the same one out after.  For tests that kill, pause or restart none of its
    processes and use table names of their own (marked ``cluster``); killed by pid when the module's tests are
    done."""
    started: dict[str, LocalCluster] = {}

    def factory(**kwargs) -> LocalCluster:
        kwargs.setdefault("host", "127.0.0.1")
        key = repr(sorted(kwargs.items()))
        if key not in started:
            started[key] = LocalCluster(LocalClusterSpec(**kwargs)).start()
        return started[key]

    yield factory
    _stop(list(started.values()))


def _processes_of(clusters) -> str:
    """Each process of ``clusters``: its pid, whether it still runs or how it ended (a server gone from a cluster
    the test did not kill: its exit status tells a lease lost, 1, from a signal), its last stderr lines."""
    out = []
    for n, cluster in enumerate(clusters):
        procs = [("coordinator", p) for p in [*cluster.old_coordinator_procs, cluster.coordinator_proc,
                                              *cluster.coordinator_procs] if p is not None]
        procs += [("server", p) for p in cluster.server_procs]
        for role, p in dict((id(p), (role, p)) for role, p in procs).values():
            code = p.poll()
            out.append(f"cluster {n} {role} pid {p.pid}: {'running' if code is None else f'exited, status {code}'}")
            out += [f"    {line}" for line in cluster.stderr_tail(p.pid)[-5:]]
    return "\n".join(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that started clusters says what became of each of their processes (before the teardown kills
    them): a server that refused connections had exited, or was still running."""
    outcome = yield
    report = outcome.get_result()
    clusters = getattr(item, "ecrec_clusters", None)
    if report.when == "call" and report.failed and clusters:
        try:
            report.sections.append(("ecrec processes", _processes_of(clusters)))
        except Exception as exc:  # noqa: BLE001 - the failure is reported whatever this finds
            report.sections.append(("ecrec processes", f"could not be listed: {exc!r}"))


def pytest_collection_modifyitems(config, items):
    """Benchmark runs first (``benchmark`` marker: an ``ecrec-bench`` command end to end, tens of seconds): the
    workers (pytest-xdist) take tests in this order, so the longest ones do not start last."""
    items.sort(key=lambda item: item.get_closest_marker("benchmark") is None)


def pytest_sessionfinish(session, exitstatus):
    """Clients tests left open are closed here, quietly and without waiting for confirmations from clusters the
    teardowns killed (``ClientConfig.confirm_at_exit_s``; the tests of that wait run their workers as processes of
    their own).  Left to the exit handler, each logged its unconfirmed pushes after pytest had closed the streams
    its logging wrote to ("I/O operation on closed file")."""
    from ecrec.client import cluster

    clients = list(cluster._OPEN_CLIENTS)
    for client in clients:
        client.config.confirm_at_exit_s = 0
    logging.disable(logging.WARNING)
    try:
        for client in clients:
            try:
                client.close(confirm_timeout_s=0)
            except Exception:  # noqa: BLE001 - a client of a cluster already gone; the others are still closed
                pass
    finally:
        logging.disable(logging.NOTSET)


def pytest_addoption(parser):
    group = parser.getgroup("nemesis")
    group.addoption("--nemesis-seed", default=None, help="seed of the nemesis's fault schedule (default: random)")
    group.addoption("--nemesis-faults", default=50, type=int, help="faults the nemesis injects (default 50)")
    group.addoption("--nemesis-check-each-fault", action="store_true",
                    help="after every fault, hold the workers and check exactly-once then (not only at the end): "
                         "a violation names the fault that caused it, with every server's log (servers log at INFO)")
    group.addoption("--nemesis-store", default="file", choices=("file", "etcd"),
                    help="the control plane under the nemesis: file (one coordinator, restarted on its state file) "
                         "or etcd (three etcd members, two coordinators; leader and etcd member kills join the "
                         "schedule)")

    group = parser.getgroup("simulation")
    group.addoption("--sim-schedules", default=400, type=int,
                    help="schedules the protocol simulation runs (tests/sim; default 400; CI runs 10,000)")
    group.addoption("--sim-seed", default=None, type=int,
                    help="the first seed of the simulation's schedules (default: random, printed)")


def server_metadata(local, server_id: str, epoch: int = 0) -> tuple:
    """The identity metadata a server of ``local`` sends on a server-to-server call (``ecrec-caller`` with its
    proof under the cluster's server key, read from the coordinator's state file: ``local`` needs a
    ``state_path``), as a test acting as that server sends it."""
    from ecrec.net.seal import Sealer
    from ecrec.wire import coordinator_pb2

    with open(local.spec.state_path, "rb") as f:
        key = coordinator_pb2.CoordinatorState.FromString(f.read()).server_key
    return (("ecrec-caller", server_id), ("ecrec-caller-proof", Sealer(key).caller_proof(server_id)),
            ("ecrec-epoch", str(epoch)))


# --- CPU per test (ECREC_TEST_CPU=FILE): the test process's own CPU and its children's (servers, coordinators and
# etcd members it started and waited for, or had forked), which contention does not inflate as wall time -------
_cpu_report = os.environ.get("ECREC_TEST_CPU")


def _cpu_now() -> float:
    """This process's CPU, its waited-for children's, and that of the processes forked for it that ended."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = SPAWNER.children_cpu_s() if SPAWNER is not None else 0.0
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked


if _cpu_report:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        import json
        import time

        cpu0, wall0 = _cpu_now(), time.monotonic()
        yield
        with open(_cpu_report, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu_now() - cpu0, 2),
                                "wall_s": round(time.monotonic() - wall0, 2)}) + "\n")
