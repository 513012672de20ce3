"""The coordinator's state and its one rule: a change counts only once the store recorded it.

:class:`ClusterState` holds the cluster map (servers by index, standbys, tables, dense specs, data loss, events;
its **epoch** increases at every change), the promotions in progress, the server key and what the coordinator
knows of each server's lease and process.  Every change is made under :attr:`ClusterState.lock` and ends in
:meth:`ClusterState.bump_locked`, which records the new state in the store (``ecrec.control.stores``: a file, or
one etcd key written by compare-and-swap); a change the store refused (this coordinator does not lead, or the
store is unreachable) is rolled back and raised, so nothing unrecorded is acted on.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections import OrderedDict

from ecrec import faults
from ecrec.coding.layout import Layout
from ecrec.config import CoordinatorConfig, state_path_problem
from ecrec.control.etcd import etcd_url
from ecrec.control.etcd_lease import lease_ttl_s
from ecrec.control.stores import FileStore, NotLeader, parse_store
from ecrec.net import seal
from ecrec.strategies import get_spec
from ecrec.wire import cluster_pb2, coordinator_pb2

log = logging.getLogger("ecrec.coordinator")

ACTIVE = cluster_pb2.ACTIVE
STANDBY = cluster_pb2.STANDBY
FAILED = cluster_pb2.FAILED
RECOVERING = cluster_pb2.RECOVERING
PROMOTING = cluster_pb2.PROMOTING
#: lost stripes listed in a map's data-loss entry (all of them are counted)
DATA_LOSS_LISTED = 64
#: events kept in the map's history
EVENTS_KEPT = 1000


class ClusterState:
    """The map and everything the coordinator must agree on with its store (see the module)."""

    def __init__(self, config: CoordinatorConfig):
        self.config = config
        spec = config.cluster
        self.strategy_spec = get_spec(spec.strategy)
        k, m, options = self.strategy_spec.layout_params(spec.num_servers, spec.k, spec.m, dict(spec.strategy_options))
        self.layout = Layout(spec.num_servers, k, m)
        self.lock = threading.RLock()
        self.faults = faults.coordinator_from_environment()  # fault injection for tests (ecrec.faults); off
        self.dense: OrderedDict[str, coordinator_pb2.RegisterDenseRequest] = OrderedDict()
        self.wanted: dict[str, int] = {}  # standby server_id -> the index it asked for (a restarted server)
        self.leases: dict[str, float] = {}  # server_id -> when its lease runs out (monotonic, this clock)
        #: etcd leases (``map.lease_store``): failed servers whose end this leader has not timed yet.  A TTL is
        #: counted from this leader's own answered revocation, or from when it first sees the key gone (a deposed
        #: leader's revocation, or an operator's, may land at any moment before); none is replaced until then
        self.untimed: set[str] = set()
        #: standbys removed from the map whose etcd lease is still to be revoked (kept until etcd answers)
        self.dropped: set[str] = set()
        self.gone: set[str] = set()  # failed servers whose process is known gone (connection refused)
        self.lost_stripes: dict[str, set[int]] = {}  # table -> every lost stripe reported (the map lists some)
        self.promoting: dict[str, coordinator_pb2.PendingPromotion] = {}  # server_id -> promotion in progress
        self.map = cluster_pb2.ClusterMap(epoch=1, num_servers=spec.num_servers, strategy=spec.strategy, k=k, m=m)
        self.map.strategy_options.update({str(a): str(b) for a, b in options.items()})
        self.server_key = seal.new_key()  # servers seal what workers carry with it (ecrec.net.seal); never in the map
        #: the snapshot a coordinator's --restore put in this cluster (recorded with the map): a later leader, or a
        #: coordinator restarted with the same command line, restores nothing over what training did since
        self.restored_from = ""
        self.initial = cluster_pb2.ClusterMap()
        self.initial.CopyFrom(self.map)
        self.saved = b""  # the state the store holds (serialized): a change it refused is rolled back to this
        self.saved_sets: tuple[set, dict] = (set(), {})  # ... with the gone servers and wanted indices then
        #: set while this coordinator leads (always with a file store; with etcd once elected)
        self.leading = threading.Event()
        kind, store_args = parse_store(config.store)  # raises ValueError naming a bad --store
        if kind == "etcd" and config.state_path:
            raise ValueError("--store etcd://... and --state-path both name where the map is kept: choose one")
        if store_args.get("path") and config.state_path:  # (the --store path was taken, --state-path ignored)
            raise ValueError(f"--store {config.store} and --state-path {config.state_path} both name where the map "
                             "is kept: choose one")
        problem = state_path_problem(store_args.get("path"), f"--store {config.store}")  # (found at the first save)
        if problem:
            raise ValueError(problem)
        if kind == "etcd" and config.election_ttl_s < 2:
            raise ValueError(f"--election-ttl-s must be at least 2 (etcd's shortest lease), got {config.election_ttl_s}")
        self.store_args = store_args if kind == "etcd" else None
        # how long after a server's last renewal it may still serve: with etcd, the TTL of its etcd lease (a saved
        # map's, when longer: ``load``)
        self.own_lease_wait_s = lease_ttl_s(config.lease_s) if kind == "etcd" else config.lease_s
        self.lease_wait_s = self.own_lease_wait_s
        self.longer_lease_until = 0.0  # (file store) when the longer leases granted before a restart have run out
        for m in (self.map, self.initial):  # kept with the map: a restart waits at least the leases granted
            if kind == "etcd":  # servers hold etcd leases there (ecrec.control.etcd_lease)
                m.lease_store = etcd_url(store_args["endpoints"], store_args["prefix"])
            m.lease_s = self.lease_wait_s
        path = store_args.get("path") or config.state_path
        self.store = FileStore(path)
        if path and os.path.exists(path):
            self.load(self.store.load(), path)
        elif path:  # the first start of a cluster -- or a path given wrong to a restarted coordinator
            log.warning("no saved state at %s: starting a new cluster (servers of an older one at this address "
                        "keep their rows and wait: restart with the path that holds its state, or stop them)", path)
        self.saved = self.state_locked().SerializeToString()

    # --- persistence -----------------------------------------------------------------------------
    def check_shape(self, saved: cluster_pb2.ClusterMap, path: str) -> None:
        """Raises ValueError when the saved map is of another shape (servers, strategy, k, m) than this
        coordinator's: another cluster's, or flags that do not match it."""
        if (saved.num_servers, saved.strategy, saved.k, saved.m) != (self.map.num_servers, self.map.strategy, self.map.k, self.map.m):
            raise ValueError(
                f"{path} holds a map for {saved.num_servers} servers, strategy {saved.strategy!r}, k={saved.k}, m={saved.m}; "
                f"this coordinator was started for {self.map.num_servers}, {self.map.strategy!r}, k={self.map.k}, m={self.map.m}"
            )

    def load(self, state: coordinator_pb2.CoordinatorState, path: str) -> None:
        saved = state.map
        if saved.servers and not state.server_key:
            # its servers hold the key they registered with; a new one would make every later standby unable to
            # prove itself to them (its promotion retried for ever)
            raise ValueError(f"{path} holds a map of {len(saved.servers)} servers (epoch {saved.epoch}) but no "
                             "server key: the file is damaged (cut short?); restore it, or move it away to start a "
                             "new cluster")
        self.check_shape(saved, path)
        self.map.CopyFrom(saved)
        self.map.epoch = saved.epoch + 1
        if self.map.lease_store and saved.lease_s > self.own_lease_wait_s:
            # its servers were granted etcd leases that long: a shorter wait would not cover them.  Kept from now
            # on (servers that register later get it too): a shorter --lease-s takes effect with a new cluster
            log.warning("the saved map's servers hold %g s etcd leases, longer than this coordinator's %g s "
                        "(--lease-s): keeping %g s", saved.lease_s, self.own_lease_wait_s, saved.lease_s)
            self.lease_wait_s = lease_ttl_s(saved.lease_s)
        elif saved.lease_s > self.own_lease_wait_s:
            # the coordinator before granted leases that long, and a server keeps the longer of two grants: a
            # restart with a shorter --lease-s promoted over a server still serving on its old lease.  Waited here
            # and kept in the map (a second restart soon after must wait it too); granted leases are --lease-s
            log.warning("the saved map's servers were granted %g s leases, longer than this coordinator's %g s "
                        "(--lease-s): a server is replaced only once %g s have passed since its last renewal",
                        saved.lease_s, self.own_lease_wait_s, saved.lease_s)
            self.lease_wait_s = saved.lease_s
            self.longer_lease_until = time.monotonic() + saved.lease_s
        self.map.lease_s = self.lease_wait_s
        for d in state.dense:
            self.dense[d.spec.name] = d
        for p in state.promoting:
            self.promoting[p.server_id] = p
        if state.server_key:  # the servers registered with it hold it: a restarted coordinator keeps it
            self.server_key = seal.check_key(state.server_key)
        self.restored_from = state.restored_from
        # every server's lease is unknown: wait a whole lease before promoting over any of them
        now = time.monotonic()
        for s in self.map.servers:
            self.leases[s.server_id] = now + self.lease_wait_s
        log.info("restored the cluster map from %s (epoch %d, %d tables)", path, self.map.epoch, len(self.map.tables))

    def extend_lease_locked(self, server_id: str, length_s: float) -> None:
        """A lease granted to ``server_id`` now for ``length_s``: one never shortens an earlier, longer grant (the
        server keeps the longer of the two, so must the wait before a promotion over it)."""
        self.leases[server_id] = max(self.leases.get(server_id, 0.0), time.monotonic() + length_s)

    def take_over(self, store) -> cluster_pb2.ClusterMap:
        """This coordinator was elected through ``store`` (etcd): adopts the state it holds (a fresh map when
        there is none yet), records it with a new epoch, and leads.  Raises what the store raises; then it
        does not lead."""
        with self.lock:
            self.store = store
            state = store.load()
            self.map.CopyFrom(self.initial)
            for known in (self.dense, self.promoting, self.lost_stripes, self.gone, self.wanted, self.leases,
                          self.untimed, self.dropped):
                known.clear()
            self.lease_wait_s = self.own_lease_wait_s
            self.restored_from = ""
            if state is not None:
                self.load(state, store.describe())
                self.saved = state.SerializeToString()
                if self.map.lease_store:
                    # a deposed leader (or an operator) may revoke a failed server's lease at any moment: its end
                    # is timed from this leader's own revocation, or from when it sees the key gone
                    self.untimed.update(s.server_id for s in self.map.servers if s.state == FAILED)
            else:
                self.saved = self.state_locked().SerializeToString()
            if self.map.lease_store:  # servers reach etcd where this leader and etcd's member list say
                self.map.lease_store = store.lease_store_url()
            self.leading.set()
            try:
                snapshot = self.bump_locked()
            except BaseException:
                self.leading.clear()
                raise
        return snapshot

    def step_down(self, why: str) -> None:
        """This coordinator no longer leads (its etcd lease is gone): it changes nothing from now on."""
        with self.lock:
            if self.leading.is_set():
                log.error("coordinator steps down: %s", why)
            self.leading.clear()

    def leads(self) -> bool:
        return self.leading.is_set() and self.store.holds()

    def state_locked(self) -> coordinator_pb2.CoordinatorState:
        return coordinator_pb2.CoordinatorState(map=self.map, dense=list(self.dense.values()),
                                                promoting=list(self.promoting.values()), server_key=self.server_key,
                                                restored_from=self.restored_from)

    def save_locked(self) -> None:
        """Records the state in the store; when the store refuses it (not the leader, or unreachable) every change
        since the last recorded state is rolled back and the error raised, so nothing unrecorded is acted on."""
        if not self.map.lease_store and self.lease_wait_s > self.own_lease_wait_s and \
                time.monotonic() >= self.longer_lease_until:
            # every lease granted before the restart has run out (renewals since grant --lease-s): the map's
            # length goes back to it, and a later restart waits only that
            self.lease_wait_s = self.map.lease_s = self.own_lease_wait_s
        state = self.state_locked()
        try:
            self.faults.hit("record_map")
            if self.store.kind != "file" and not self.leading.is_set():
                raise NotLeader("this coordinator does not lead")
            self.store.save(state)
        except Exception:
            self.roll_back_locked()
            raise
        self.saved = state.SerializeToString()
        self.saved_sets = (set(self.gone), dict(self.wanted))

    def roll_back_locked(self) -> None:
        gone, wanted = self.saved_sets
        self.gone, self.wanted = set(gone), dict(wanted)
        saved = coordinator_pb2.CoordinatorState.FromString(self.saved)
        self.map.CopyFrom(saved.map)
        self.dense.clear()
        for d in saved.dense:
            self.dense[d.spec.name] = d
        self.promoting.clear()
        for p in saved.promoting:
            self.promoting[p.server_id] = p
        self.restored_from = saved.restored_from

    # --- reading and changing the map (call the *_locked ones with the lock held) --------------------------------
    def snapshot(self) -> cluster_pb2.ClusterMap:
        """A copy of the map as it is now."""
        with self.lock:
            return cluster_pb2.ClusterMap.FromString(self.map.SerializeToString())

    def at_index(self, index: int) -> cluster_pb2.ServerInfo | None:
        for s in self.map.servers:
            if s.index == index and s.state != FAILED:
                return s
        return None

    def holder_locked(self, index: int, server_id: str) -> cluster_pb2.ServerInfo | None:
        """The entry of ``server_id`` holding ``index`` (not failed), or None."""
        return next((s for s in self.map.servers if s.index == index and s.server_id == server_id
                     and s.state != FAILED), None)

    def event_locked(self, kind: str, index: int, address: str) -> None:
        self.map.events.add(kind=kind, index=index, address=address, wall_time=time.time(), epoch=self.map.epoch + 1)
        if len(self.map.events) > EVENTS_KEPT:
            del self.map.events[: len(self.map.events) - EVENTS_KEPT]

    def bump_locked(self) -> cluster_pb2.ClusterMap:
        """Ends a change: a new epoch, recorded in the store (or rolled back and raised); returns a copy."""
        self.map.epoch += 1
        live = {s.index for s in self.map.servers if s.index >= 0 and s.state in (ACTIVE, RECOVERING)}
        self.map.ready = len(live) == self.map.num_servers
        # keep servers sorted: by index, standbys last, failed entries dropped once replaced
        entries = sorted(self.map.servers, key=lambda s: (s.index < 0, s.index, s.state == FAILED))
        del self.map.servers[:]
        self.map.servers.extend(entries)
        self.save_locked()
        snapshot = cluster_pb2.ClusterMap()
        snapshot.CopyFrom(self.map)
        return snapshot

    def not_ready_message(self) -> str:
        live = sum(1 for s in self.map.servers if s.index >= 0 and s.state in (ACTIVE, RECOVERING))
        return f"cluster not ready: {live} of {self.map.num_servers} servers hold their index"

    def merge_data_loss_locked(self, report: cluster_pb2.DataLoss) -> tuple[cluster_pb2.DataLoss | None, bool]:
        """Folds one report into the map's single entry for its table (every replacement of a lost stripe's
        members reports it, some more than once): the union of the stripes (the first
        ``DATA_LOSS_LISTED`` listed, all counted), of the indices, the first report's time.  Returns
        ``(entry, news)``: the entry when the report added something (else None), and whether it is news -- the
        table's first report, or one from an index not named yet -- rather than more stripes of a loss known
        (a rebuild reports its lost stripes round by round: one incident is one event, not one per round)."""
        if not (report.stripes or report.stripe_count):
            return None, False  # reports no stripe: nothing to record
        lost = self.lost_stripes.setdefault(report.table, set())
        entry = next((d for d in self.map.data_loss if d.table == report.table), None)
        news = entry is None or not set(report.indices) <= set(entry.indices)
        if entry is None:
            entry = self.map.data_loss.add(table=report.table, wall_time=report.wall_time or time.time())
        elif not lost:  # a restarted coordinator: only the listed stripes are known
            lost.update(entry.stripes)
        before = (len(lost), entry.stripe_count, len(entry.indices))
        lost.update(report.stripes)
        entry.stripe_count = max(len(lost), entry.stripe_count, report.stripe_count)
        entry.stripes[:] = heapq.nsmallest(DATA_LOSS_LISTED, lost)
        entry.indices[:] = sorted(set(entry.indices) | set(report.indices))
        changed = (len(lost), entry.stripe_count, len(entry.indices)) != before
        return (entry if changed else None), news and changed

    def mark_redundant_locked(self, index: int, server_id: str) -> cluster_pb2.ClusterMap | None:
        """A ``RECOVERING`` server finished its rebuild: ``ACTIVE``, recorded; None when it is not recovering."""
        info = next((s for s in self.map.servers if s.index == index and s.server_id == server_id
                     and s.state == RECOVERING), None)
        if info is None:
            return None
        info.state = ACTIVE
        self.event_locked("redundant", info.index, info.address)
        return self.bump_locked()


#: a round that keeps failing the same way is logged again this often (each round would be a traceback a second)
ROUND_FAILURE_REPEAT_S = 30.0


def rounds_while_leading(state: ClusterState, stop: threading.Event, wake: threading.Event, interval_s: float,
                         one_round) -> None:
    """Runs ``one_round()`` every ``interval_s``, or at once when ``wake`` is set, while this coordinator leads,
    until ``stop`` (or until a round returns False).  A round that raises is logged and the next one runs: the
    thread is started once, and a monitor or promoter that ended would leave every later failure undeclared or
    unreplaced while this coordinator leads."""
    said, said_at = "", 0.0  # the last failure logged in full, and when: a failure that repeats is not a flood
    while not stop.is_set():
        wake.wait(interval_s)
        wake.clear()
        if stop.is_set():
            return
        if not state.leading.is_set():
            continue
        try:
            if one_round() is False:
                return
            said = ""
        except Exception as exc:  # noqa: BLE001 - reported, never swallowed; the next round tries again
            now, text = time.monotonic(), f"{type(exc).__name__}: {exc}"
            if text != said or now - said_at >= ROUND_FAILURE_REPEAT_S:
                log.exception("a round of %s failed; the next one runs in %.1f s%s", threading.current_thread().name,
                              interval_s, " (failing again)" if text == said else "")
                said, said_at = text, now
