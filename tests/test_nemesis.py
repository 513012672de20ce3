"""The nemesis: a seeded random schedule of faults while two workers train, then a check that every
acknowledged push was applied exactly once and every parity row equals a fresh encode.

Faults drawn: SIGKILL of a server; a SIGKILL and, the moment the replacement is fully redundant, a second one;
a SIGKILL and, while the replacement still rebuilds, the rebuilding replacement SIGKILLed or another server paused
or cut off for less than the failure timeout; SIGSTOP of a server longer than the failure timeout and lease, then
SIGCONT (the old process must serve and acknowledge nothing, and exit); the coordinator SIGKILLed while it
promotes a replacement, then restarted from its state file; a worker restarted under the same name; the standby
the coordinator would promote next paused while a server is killed (the promotion must skip it; resumed, it must
stop); a hostile caller (a push under a huge worker name or incarnation, parity calls without metadata or with a
live server's id and no proof; each must be refused).  The coordinator records slowly throughout (``ECREC_COORDINATOR_FAULT``: every map change and every
promotion's record delayed, so a replacement's report of redundancy often arrives first).  Two workers push at
once throughout, and after each fault training must go on within failure timeout + lease + 5 s (a liveness
check over the whole run: no worker goes longer than that without an acknowledged push, except while it
restarts or the coordinator itself restarts).  At the end, two servers of one stripe are killed at once (more than m):
the map must report DATA_LOSS naming the table within seconds, and a read of a lost row must fail with it.

Partitions: when the test runs as root and ``ip netns`` works, every server runs in a network namespace
of its own on a veth link to a bridge (``tests/netlab.py``), the coordinator and the workers on the bridge's
address, and a partition takes one server's link down for longer than the failure timeout and lease,
then up again (the cut-off server must stop serving and exit, like a paused one).  Otherwise the cluster
runs on 127.0.0.1 and partitions are left out of the schedule (the report says so).

The checker's workload counts: SGD with lr=1 on a table initialized to zeros, gradient 1 on every element
of each looked-up row, so a row must end at exactly minus the number of acknowledged pushes that touched
it (any order).  Run: ``pytest -m nemesis -n 0 -s`` (about 3 minutes; ``--nemesis-faults 200`` for a longer run,
``--nemesis-seed N`` to repeat a schedule).  A failure prints its seed; ``--nemesis-check-each-fault`` then
checks exactly-once after every fault too (the workers held meanwhile), naming the fault that broke it.
"""

from __future__ import annotations

import collections
import random
import threading
import time

import numpy as np
import pytest
import torch

import grpc

from ecrec.net import transport
from ecrec.client import Cluster, ClusterError, EmbeddingBag
from ecrec.config import ClientConfig
from ecrec.coding.layout import Layout
from ecrec.wire import cluster_pb2, embedding_pb2, embedding_pb2_grpc, parity_pb2, parity_pb2_grpc

pytestmark = [pytest.mark.nemesis, pytest.mark.cluster]

ROWS, DIM, BAG = 400, 4, 6
TIMING = dict(lease_s=2.0, failure_timeout_s=1.0, failures_before_dead=3, health_timeout_s=0.5)
# rebuilds a few rows at a time with a pause between (about a second for this table, not milliseconds), so that a
# fault can land inside one (Nemesis.inside_rebuild) and pushes meet rows not rebuilt yet
REBUILD_OPTIONS = {"rebuild_batch_rows": "8", "rebuild_pause_s": "0.04"}
WORKER = dict(rpc_timeout_s=2.0, retry_deadline_s=120.0)


class CountingWorker(threading.Thread):
    """Pushes bags of distinct random rows until stopped; records every acknowledged push; restarts itself
    (a new client under the same name) when asked."""

    def __init__(self, address: str, name: str, seed: int):
        super().__init__(name=f"nemesis-{name}", daemon=True)
        self.address, self.worker, self.rng = address, name, np.random.default_rng(seed)
        self.counts = np.zeros(ROWS, np.int64)
        self.acked = 0
        self.acked_at: list[float] = []  # monotonic time of each acknowledged push
        self.restart_windows: list[tuple[float, float]] = []
        self.restarts = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.restart = threading.Event()
        self.restarted = threading.Event()
        self.hold = threading.Event()  # set: wait before the next push (``holding`` says it waits)
        self.holding = threading.Event()

    def connect(self) -> Cluster:
        return Cluster.connect(self.address, config=ClientConfig(**WORKER), worker=self.worker)

    def run(self) -> None:
        torch.set_num_threads(1)
        try:
            client = self.connect()
            bag = EmbeddingBag(client, "t")
            while not self.stop.is_set():
                if self.restart.is_set():  # a clean restart: a new process would start its sequence at 1 again
                    began = time.monotonic()
                    client.close(confirm_timeout_s=60.0)
                    client = self.connect()
                    bag = EmbeddingBag(client, "t")
                    self.restart_windows.append((began, time.monotonic()))
                    self.restarts += 1
                    self.restart.clear()
                    self.restarted.set()
                if self.hold.is_set():  # every push so far is acknowledged: the checker reads the table
                    self.holding.set()
                    while self.hold.is_set() and not self.stop.is_set():
                        time.sleep(0.01)
                    self.holding.clear()
                ids = self.rng.choice(ROWS, BAG, replace=False)
                bag(torch.as_tensor(ids)[None, :]).sum().backward()
                client.step()  # returns only once acknowledged; raises if it cannot be
                self.counts[ids] += 1
                self.acked += 1
                self.acked_at.append(time.monotonic())
            client.close(confirm_timeout_s=60.0)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.error = exc


class Nemesis:
    def __init__(self, local, rng: random.Random, log, lab=None):
        self.local, self.rng, self.log, self.lab = local, rng, log, lab
        self.faults = collections.Counter()
        self.violations: list[str] = []
        self.ended: set[int] = set()  # pids this nemesis killed, or that stopped because they were replaced
        self.coordinator_restarts: list[tuple[float, float]] = []  # (killed, serving again), monotonic

    def unexpected_exits(self) -> list[str]:
        """Servers that ended without this nemesis ending them: exit code and their last words."""
        out = []
        for p in self.local.server_procs:
            if p.poll() is not None and p.pid not in self.ended:
                tail = "\n    ".join(self.local.stderr_tail(p.pid)[-15:])
                out.append(f"server pid {p.pid} exited with code {p.returncode}:\n    {tail}")
        return out

    def map(self):
        return self.local.cluster_map()

    def active(self, m) -> list:
        return [s for s in m.servers if s.index >= 0 and s.state == cluster_pb2.ACTIVE]

    def until_map(self, holds, timeout_s: float, what: str) -> None:
        """Until ``holds(map)`` (a map read may fail while the coordinator restarts); AssertionError naming
        ``what`` (and the last map) after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if holds(self.map()):
                    return
            except Exception:  # noqa: BLE001 - the coordinator may be restarting
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not within {timeout_s} s: {self.map()}")
            time.sleep(0.05)

    def wait_redundant(self, timeout_s: float = 60.0, standby: int = 1) -> None:
        """Until every index is active (no recovery running) and ``standby`` spares are registered."""
        self.until_map(lambda m: m.ready and len(self.active(m)) == m.num_servers and sum(
            1 for s in m.servers if s.index < 0 and s.state == cluster_pb2.STANDBY) >= standby,
                       timeout_s, "full redundancy after the last fault")

    def victim(self):
        m = self.map()
        s = self.rng.choice(self.active(m))
        return s, self.local.pid_of_index(s.index)

    def kill(self) -> None:
        s, pid = self.victim()
        self._sigkill(s, pid)
        self.faults["sigkill"] += 1

    def _sigkill(self, s, pid: int, why: str = "") -> None:
        """SIGKILLs server ``s`` (pid ``pid``), starts a spare, waits until the map no longer names it active."""
        self.log(f"SIGKILL server {s.index} (pid {pid}){why}")
        self.ended.add(pid)
        self.local.kill(pid)
        self.local.start_server(standby=True)
        # faults are spaced by full redundancy: a map read before the coordinator noticed this kill would let
        # the next fault take a second server of one stripe
        self.until_map(lambda m: not any(x.server_id == s.server_id and x.state == cluster_pb2.ACTIVE
                                         for x in m.servers), 20.0, f"server {s.index} noticed failed after its SIGKILL")

    def kill_after_rebuild(self) -> None:
        """A kill, then a second kill of another server the moment the first one's replacement is fully redundant
        (within milliseconds, workers pushing throughout): the second victim's rows were just read by that
        replacement's rebuild, with pushes the workers still hold unconfirmed.  A rebuild that embedded such a
        version in its parity left it there with no log entry to undo it: applied twice at the replay."""
        s, pid = self.victim()
        self._sigkill(s, pid, ", then another the moment its replacement is redundant")
        self.until_map(lambda m: any(x.index == s.index and x.server_id != s.server_id and x.state in
                                     (cluster_pb2.RECOVERING, cluster_pb2.ACTIVE) for x in m.servers), 30.0,
                       f"server {s.index} replaced")
        self.until_map(lambda m: m.ready and len(self.active(m)) == m.num_servers, 60.0,
                       f"the replacement of server {s.index} fully redundant")
        time.sleep(self.rng.uniform(0.0, 0.1))
        second = self.rng.choice([x for x in self.active(self.map()) if x.index != s.index])
        self._sigkill(second, self.local.pid_of_index(second.index), f" right after index {s.index}'s rebuild")
        self.faults["kill_after_rebuild"] += 1

    def inside_rebuild(self) -> None:
        """A kill, then a second fault while its replacement is still rebuilding (rebuilds are slowed here so that
        there is a window: ``REBUILD_OPTIONS``): the rebuilding replacement itself SIGKILLed (another standby
        resolves both incarnations and rebuilds from scratch), or another server paused or cut off for less than
        the failure timeout (not declared failed: the rebuild's reads, the owners' batches and the workers wait for
        it).  Pushes go on throughout, so the rebuild embeds rows that change while it reads them."""
        s, pid = self.victim()
        self._sigkill(s, pid, ", then a fault inside its replacement's rebuild")
        found = {}

        def rebuilding(m) -> bool:
            x = next((x for x in m.servers if x.index == s.index and x.server_id != s.server_id
                      and x.state in (cluster_pb2.RECOVERING, cluster_pb2.ACTIVE)), None)
            found["server"] = x
            return x is not None

        self.until_map(rebuilding, 30.0, f"server {s.index} replaced")
        new = found["server"]
        if new.state != cluster_pb2.RECOVERING:
            self.log(f"  index {s.index}'s replacement finished its rebuild before the second fault: none")
            self.faults["inside_rebuild_missed"] += 1
            return
        how = self.rng.choice(["kill_rebuilding", "pause_other"] + (["cut_other"] if self.lab is not None else []))
        if how == "kill_rebuilding":
            self._sigkill(new, self.local.pid_of_index(s.index), f" (index {s.index}'s replacement, rebuilding)")
        else:
            other = self.rng.choice([x for x in self.active(self.map()) if x.index != s.index])
            other_pid = self.local.pid_of_index(other.index)
            short_s = TIMING["failure_timeout_s"] * self.rng.uniform(0.3, 0.7)
            self.log(f"{'SIGSTOP' if how == 'pause_other' else 'partition'} server {other.index} (pid {other_pid}) "
                     f"for {short_s:.2f} s while index {s.index} rebuilds")
            if how == "pause_other":
                self.local.pause(other_pid)
                time.sleep(short_s)
                self.local.resume(other_pid)
            else:
                host = other.address.rsplit(":", 1)[0]
                self.lab.cut(host)
                try:
                    time.sleep(short_s)
                finally:
                    self.lab.heal(host)
        self.faults[f"inside_rebuild_{how}"] += 1

    def pause(self) -> None:
        s, pid = self.victim()
        pause_s = TIMING["failure_timeout_s"] + TIMING["lease_s"] + self.rng.uniform(0.5, 1.5)
        self.log(f"SIGSTOP server {s.index} (pid {pid}) for {pause_s:.1f} s")
        self.local.pause(pid)
        time.sleep(pause_s)
        self.local.resume(pid)
        self.faults["pause"] += 1
        self._back(s, pid, "paused")

    def partition(self) -> None:
        s, pid = self.victim()
        host = s.address.rsplit(":", 1)[0]
        cut_s = TIMING["failure_timeout_s"] + TIMING["lease_s"] + self.rng.uniform(0.5, 1.5)
        self.log(f"partition server {s.index} (pid {pid}, {host}) for {cut_s:.1f} s")
        self.lab.cut(host)
        try:
            time.sleep(cut_s)
        finally:
            self.lab.heal(host)
        self.faults["partition"] += 1
        self._back(s, pid, "partitioned")

    def _back(self, s, pid: int, how: str) -> None:
        """A server that was cut off is back: if it was replaced meanwhile it must stop (through its lease).  The
        coordinator may declare it failed only now, a moment after it is back (its checks and its lease ran out
        while it was away: CI saw one declared 80 ms after the heal), and a map read before that names it active:
        the next fault then took a second server of its stripes, more than m at once.  So the fault ends only once
        the coordinator has made up its mind: the server replaced, or alive and still holding its index a lease
        and a failure timeout after it is back."""
        proc = next(p for p in self.local.server_procs if p.pid == pid)
        settled = time.monotonic() + TIMING["lease_s"] + TIMING["failure_timeout_s"] + 1.0
        replaced = False
        while time.monotonic() < settled:
            try:
                replaced = any(x.index == s.index and x.server_id != s.server_id for x in self.map().servers)
            except Exception:  # noqa: BLE001 - the coordinator may be restarting
                replaced = False
            if replaced:
                break
            time.sleep(0.05)
        if replaced:
            self.ended.add(pid)
            try:
                proc.wait(timeout=20)  # it learns through its lease that it was replaced, and stops
            except Exception:  # noqa: BLE001
                self.violations.append(f"{how} server {s.index} (pid {pid}) still runs 20 s after its replacement")
        self.local.start_server(standby=True)

    def pause_standby(self) -> None:
        """Pauses the standby the coordinator would promote first, kills a server, resumes the standby later:
        the promotion must go to the other standby, and the paused one must stop once it is back."""
        deadline = time.monotonic() + 30
        while True:  # the standbys started after the last fault register within seconds
            standbys = [s for s in self.map().servers if s.state == cluster_pb2.STANDBY]
            if len(standbys) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if len(standbys) < 2:
            self.log("fewer than two standbys registered: a plain SIGKILL instead")
            return self.kill()
        paused = standbys[0]
        paused_pid = int(paused.server_id.split(":")[1])
        s, pid = self.victim()
        pause_s = TIMING["failure_timeout_s"] + 2 * TIMING["lease_s"] + self.rng.uniform(1.0, 4.0)
        self.log(f"SIGSTOP standby pid {paused_pid}, SIGKILL server {s.index} (pid {pid}); standby back after "
                 f"{pause_s:.1f} s")
        self.local.pause(paused_pid)
        self.ended.update((pid, paused_pid))
        self.local.kill(pid)
        try:
            time.sleep(pause_s)
        finally:
            self.local.resume(paused_pid)
        proc = next(p for p in self.local.server_procs if p.pid == paused_pid)
        holder = next((x for x in self.map().servers if x.index == s.index and x.state != cluster_pb2.FAILED), None)
        if holder is not None and holder.server_id == paused.server_id:
            self.violations.append(f"the paused standby (pid {paused_pid}) was promoted to index {s.index}")
        try:
            proc.wait(timeout=20)  # declared failed while paused: its lease renewal is refused, it stops
        except Exception:  # noqa: BLE001
            self.violations.append(f"paused standby pid {paused_pid} still runs 20 s after it was resumed")
        self.local.start_server(standby=True)
        self.local.start_server(standby=True)
        self.faults["paused_standby"] += 1

    def hostile(self) -> None:
        """A caller that is no server: a push under a 2 MiB worker name, parity calls (a resolution, a batch, a
        flush) without metadata or naming a live server without its proof, a pull from an epoch never issued.
        Each must be refused (UNAVAILABLE or DEADLINE_EXCEEDED also do: the server may be down meanwhile); the
        checks at the end show that nothing changed."""
        m = self.map()
        active = self.active(m)
        s = self.rng.choice(active)
        other = self.rng.choice([x for x in active if x.index != s.index])
        channel = transport.make_channel(s.address)
        embedding, parity = embedding_pb2_grpc.EmbeddingServerStub(channel), parity_pb2_grpc.ParityServiceStub(channel)
        row = int(np.flatnonzero(Layout(m.num_servers, m.k, m.m).locate(np.arange(ROWS))[0] == s.index)[0])
        ids = np.array([row], np.int64).tobytes()
        forged = (("ecrec-caller", other.server_id), ("ecrec-caller-proof", "0" * 32), ("ecrec-epoch", str(m.epoch)))
        # too long, too long in UTF-8 (a 2-byte character under the 256-character mark), a worker's own name under
        # an incarnation too long to be a client's
        name, incarnation = self.rng.choice([("x" * (2 << 20), "i"), ("\u00e9" * 200, "i"), ("w0", "i" * 65)])
        attempts = {
            f"a push under a {len(name.encode())}-byte worker name, {len(incarnation)}-byte incarnation":
                lambda: embedding.Push(embedding_pb2.PushRequest(
                    push_id=embedding_pb2.PushId(worker=name, sequence=1, incarnation=incarnation),
                    tables=[embedding_pb2.TableGrads(table="t", ids=ids, grads=np.zeros(DIM, np.float32).tobytes())],
                    epoch=m.epoch), timeout=5),
            "ResolveSource without metadata": lambda: parity.ResolveSource(
                parity_pb2.ResolveSourceRequest(source=other.index), timeout=5),
            "ResolveSource naming a live server without its proof": lambda: parity.ResolveSource(
                parity_pb2.ResolveSourceRequest(source=other.index, commit=True, undo_seqs=[1, 2, 3],
                                                replacement_id=other.server_id), metadata=forged, timeout=5),
            "ApplyParity naming a live server without its proof": lambda: parity.ApplyParity(
                parity_pb2.ParityBatches(source=other.index, source_id=other.server_id, confirmed_upto=1 << 40),
                metadata=forged, timeout=5),
            "Flush without metadata": lambda: parity.Flush(parity_pb2.FlushRequest(timeout_s=0.1), timeout=5),
        }
        self.log(f"hostile caller against server {s.index}: {len(attempts)} forged or oversized calls")
        for what, call in attempts.items():
            try:
                call()
            except grpc.RpcError:
                continue  # refused (or the server is down meanwhile)
            self.violations.append(f"hostile caller: {what} to server {s.index} was accepted")
        try:  # an epoch never issued: refused, or at most one map refresh; never a state change
            embedding.Pull(embedding_pb2.PullRequest(tables=[embedding_pb2.TableIds(table="t", ids=ids)], epoch=1 << 62),
                           timeout=5)
        except grpc.RpcError:
            pass
        channel.close()
        self.faults["hostile"] += 1

    def kill_coordinator_during_promotion(self) -> None:
        s, pid = self.victim()
        epoch = self.map().epoch
        self.log(f"SIGKILL server {s.index} (pid {pid}), then the coordinator while it promotes")
        self.ended.add(pid)
        self.local.kill(pid)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the failure is recorded: the promotion is under way
            m = self.map()
            if m.epoch > epoch and any(x.server_id == s.server_id and x.state == cluster_pb2.FAILED for x in m.servers):
                break
            time.sleep(0.005)
        killed = time.monotonic()
        if self.local.etcd is not None:  # the leader dies; a follower takes over; it comes back as a follower
            deadline = time.monotonic() + 30
            while True:
                try:
                    pid, address = self.local.leading_coordinator()
                    break
                except LookupError:  # a failover is under way
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            self.local.kill(pid)
            time.sleep(self.rng.uniform(0.0, 0.5))
            self.local.restart_coordinator_at(address)
        else:
            self.local.kill(self.local.coordinator_proc.pid)
            time.sleep(self.rng.uniform(0.0, 0.5))
            self.local.restart_coordinator()
        self.coordinator_restarts.append((killed, time.monotonic()))
        self.local.start_server(standby=True)
        self.faults["sigkill"] += 1
        self.faults["coordinator_killed_in_promotion"] += 1


    def kill_etcd_member(self) -> None:
        """SIGKILLs one etcd member of three, restarts it on its data directory a moment later: nothing may
        change for training (the two left keep the quorum)."""
        i = self.rng.randrange(len(self.local.etcd.procs))
        down = self.rng.uniform(0.5, 3.0)
        self.log(f"SIGKILL etcd member {self.local.etcd.names[i]} for {down:.1f} s")
        self.local.etcd.kill_member(i)
        time.sleep(down)
        self.local.etcd.start_member(i)
        self.faults["etcd_member_killed"] += 1


#: how long training may stop after a fault: the failure timeout, the lease, and 5 s for the rest
STALL_LIMIT_S = TIMING["failure_timeout_s"] + TIMING["lease_s"] + 5.0


def liveness_stalls(workers, coordinator_restarts, t0: float) -> list[str]:
    """Every gap between a worker's acknowledged pushes (from ``t0``, when they started) longer than
    ``STALL_LIMIT_S``, less the time spent in the worker's own restarts and in the coordinator's restarts (a new
    process loads and waits a lease)."""
    out = []
    for w in workers:
        times = [t0, *w.acked_at]
        for before, after in zip(times, times[1:]):
            excused = sum(max(0.0, min(after, b) - max(before, a))
                          for a, b in [*w.restart_windows, *coordinator_restarts])
            if after - before - excused > STALL_LIMIT_S:
                out.append(f"worker {w.worker}: no acknowledged push for {after - before:.1f} s "
                           f"(from {before - t0:.1f} s; {excused:.1f} s of restarts excused)")
    return out


def check_exactly_once(local, workers, log, fail) -> None:
    """Holds the workers (each between two acknowledged pushes), checks every row against the pushes
    acknowledged so far, and lets them go on; a violation fails the test with every server's last log lines."""
    for w in workers:
        w.hold.set()
    try:
        for w in workers:
            if not w.holding.wait(60) and w.error is None:
                fail(f"worker {w.worker} did not stop for the check within 60 s")
        checker = Cluster.connect(local.coordinator_address, config=ClientConfig(rpc_timeout_s=60.0))
        try:
            actual = -checker.read_payload("t")[1][:, :DIM]
        finally:
            checker.close()
        diff = actual - sum(w.counts for w in workers)[:, None]
        extra, lost = int(np.clip(diff, 0, None).sum()), int(np.clip(-diff, 0, None).sum())
        log(f"checked: {lost} updates lost, {extra} applied twice")
        if extra or lost:
            logs = [f"server pid {p.pid} (exit code {p.poll()}):\n    " + "\n    ".join(local.stderr_tail(p.pid))
                    for p in local.server_procs]
            fail(f"after the last fault: {lost} updates lost, {extra} applied twice, rows "
                 f"{np.flatnonzero(diff.any(axis=1)).tolist()}\n" + "\n".join(logs))
    finally:
        for w in workers:
            w.hold.clear()


@pytest.fixture
def netlab():
    """A bridge and namespaces for partitions, or None (with the reason printed) where they cannot be made."""
    from netlab import NetLab

    ok, why = NetLab.available()
    if not ok:
        print(f"partitions left out of the schedule: {why}")
        yield None
        return
    lab = NetLab()
    try:
        yield lab
    finally:
        lab.close()


@pytest.mark.timeout(1800)
def test_nemesis(netlab, make_cluster, tmp_path, request):
    seed = request.config.getoption("--nemesis-seed")
    seed = int(seed) if seed is not None else random.SystemRandom().randrange(1 << 30)
    want_faults = int(request.config.getoption("--nemesis-faults"))
    check_each = bool(request.config.getoption("--nemesis-check-each-fault"))
    store = request.config.getoption("--nemesis-store")
    print(f"\nnemesis seed {seed}, store {store} (rerun: pytest -m nemesis -n 0 -s --nemesis-seed {seed} --nemesis-store "
          f"{store})")
    rng = random.Random(seed)
    events: list[str] = []
    t0 = time.monotonic()

    def log(line: str) -> None:
        events.append(f"{time.monotonic() - t0:7.2f} {line}")

    placement = dict(host=netlab.bridge_ip, server_placement=netlab.place) if netlab is not None else {}
    # the coordinator records slowly: every map change, and more so a promotion's record after its standby answered
    slow = f"record_map@1:delay={rng.uniform(0.005, 0.05):.3f},record_promotion@1:delay={rng.uniform(0.1, 1.0):.2f}"
    log(f"coordinator fault injection: {slow}")
    control = (dict(store="etcd", coordinators=2, etcd_members=3, coordinator_options={**TIMING, "election_ttl_s": 2})
               if store == "etcd" else dict(state_path=str(tmp_path / "map.pb"), coordinator_options=TIMING))
    local = make_cluster(log_level="INFO" if check_each else "WARNING", servers=4, standby=2, strategy="ecrec", k=2, m=1,
                         health_interval_s=0.2, options=REBUILD_OPTIONS,
                         coordinator_env={"ECREC_COORDINATOR_FAULT": slow}, **control, **placement)
    setup = Cluster.connect(local.coordinator_address, config=ClientConfig(rpc_timeout_s=120.0))
    setup.create_table("t", ROWS, DIM, optimizer="sgd", lr=1.0, init="zeros")
    setup.close()
    workers = [CountingWorker(local.coordinator_address, f"w{i}", seed + i) for i in range(2)]
    training_started = time.monotonic()
    for w in workers:
        w.start()
    nemesis = Nemesis(local, rng, log, netlab)

    def fail(why: str) -> None:
        pytest.fail(f"nemesis seed {seed}: {why}\n" + "\n".join(events[-40:] + nemesis.unexpected_exits()),
                    pytrace=False)

    try:
        while sum(nemesis.faults.values()) < want_faults:
            kinds, weights = (["kill", "rebuild", "inside_rebuild", "pause", "coordinator", "worker", "standby",
                               "hostile"], [3, 2, 2, 2, 1, 3, 1, 1])
            if netlab is not None:
                kinds, weights = kinds + ["partition"], weights + [2]
            if store == "etcd":
                kinds, weights = kinds + ["etcd"], weights + [1]
            kind = rng.choices(kinds, weights=weights)[0]
            if kind == "worker":
                w = rng.choice(workers)
                log(f"restart worker {w.worker} under the same name")
                w.restarted.clear()
                w.restart.set()
                if not w.restarted.wait(120):
                    fail(f"worker {w.worker} did not restart")
                nemesis.faults["worker_restart"] += 1
                continue
            try:
                {"kill": nemesis.kill, "rebuild": nemesis.kill_after_rebuild, "inside_rebuild": nemesis.inside_rebuild,
                 "pause": nemesis.pause, "partition": nemesis.partition,
                 "coordinator": nemesis.kill_coordinator_during_promotion, "standby": nemesis.pause_standby,
                 "hostile": nemesis.hostile, "etcd": nemesis.kill_etcd_member}[kind]()
                nemesis.wait_redundant()
            except AssertionError as exc:
                fail(str(exc))
            # and training has gone on (every worker acknowledged a push since): each fault's stall is measured on
            # its own, not merged with the next fault's
            before, resumed_by = [w.acked for w in workers], time.monotonic() + 60
            while not all(w.acked > b or w.error is not None for w, b in zip(workers, before)):
                if time.monotonic() > resumed_by:
                    fail("training did not resume within 60 s of full redundancy")
                time.sleep(0.02)
            for w in workers:
                if w.error is not None:
                    fail(f"worker {w.worker} failed: {w.error!r}")
            if check_each:
                check_exactly_once(local, workers, log, fail)
        before = [w.acked for w in workers]
        time.sleep(0.5)
        if not all(w.acked > b for w, b in zip(workers, before)):
            fail("training stopped making progress")
    finally:
        for w in workers:
            w.stop.set()
        for w in workers:
            w.join(120)
    for w in workers:
        if w.error is not None:
            fail(f"worker {w.worker} failed: {w.error!r}")
    stalls = liveness_stalls(workers, nemesis.coordinator_restarts, training_started)
    if stalls:
        fail("training stalled: " + "; ".join(stalls))

    # exactly once: every row is minus the number of acknowledged pushes that touched it
    checker = Cluster.connect(local.coordinator_address, config=ClientConfig(rpc_timeout_s=60.0))
    counts = sum(w.counts for w in workers)
    ids, payload = checker.read_payload("t")
    actual = -payload[:, :DIM]
    lost = int(np.clip(counts[:, None] - actual, 0, None).sum())
    extra = int(np.clip(actual - counts[:, None], 0, None).sum())
    verify = checker.strategy_call("verify_parity")
    mismatched = sum(v["mismatched"] for v in verify.values())
    checked = sum(v["checked"] for v in verify.values())
    acked = sum(w.acked for w in workers)
    report = (f"nemesis seed {seed}: {acked} pushes acknowledged, {sum(nemesis.faults.values())} faults injected "
              f"({dict(nemesis.faults)}), {lost} updates lost, {extra} applied twice, {mismatched} parity rows "
              f"mismatched of {checked}, {time.monotonic() - t0:.0f} s")
    print(report)
    if lost or extra or mismatched or nemesis.violations or not checked:
        fail(report + "; " + "; ".join(nemesis.violations))

    # more failures than m in one stripe: a clear DATA_LOSS, within seconds, in the map and on a read
    nemesis.wait_redundant()
    victims = [s for s in nemesis.active(checker.refresh_map()) if s.index in (0, 1)]
    t_kill = time.monotonic()
    for s in victims:
        pid = local.pid_of_index(s.index)
        nemesis.ended.add(pid)
        local.kill(pid)
    while True:
        m = checker.refresh_map()
        if len(m.data_loss):
            break
        if time.monotonic() - t_kill > 30:
            fail(f"no data loss in the map 30 s after killing servers 0 and 1: {m}")
        time.sleep(0.05)
    print(f"data loss reported {time.monotonic() - t_kill:.2f} s after two servers of a stripe were killed: "
          f"{[(d.table, d.stripe_count, list(d.indices)) for d in m.data_loss]}")
    assert [d.table for d in m.data_loss] == ["t"]
    layout_servers = checker.layout.locate(np.arange(ROWS))[0]
    lost_rows = np.flatnonzero(np.isin(layout_servers, [0, 1]))[:4]
    with pytest.raises(ClusterError, match="DATA_LOSS"):
        checker.pull("t", lost_rows)
