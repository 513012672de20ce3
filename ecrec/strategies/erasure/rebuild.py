"""Rebuilding a replacement's rows from the survivors, on demand and in the background.

After a promotion every data row, parity row and dense replica held at the failed index is *not
ready*.  A request touching a row that is not ready rebuilds it first (``ensure_rows``,
``ensure_dense``: training never waits for the whole shard, and a request reads only the members of
the rows it touches); a background thread rebuilds the rest and then reports full redundancy to the
coordinator.  The background first takes the fast path (:mod:`~ecrec.strategies.erasure.bulk`: whole
blocks of stripes streamed from every survivor at once, decoded and encoded in bulk), then rebuilds
whatever that left (members unavailable, deltas in flight, lost stripes) row by row, as below.

- data rows: ``Codec.reconstruct`` from ``k`` ready members of each stripe whose versions agree (a
  parity row's version vector must equal the data rows' versions, else a delta is in flight: retry);
- parity rows: re-encode the stripe's ``k`` data rows, at the versions read; deltas newer than that
  snapshot, held back meanwhile by the parity store, are applied after, older ones skipped;
- dense replicas: copy another replica, then the held-back newer deltas.

Reads of stripe members go to every member server at once (:func:`gather_members`).  While a failed
owner's batches are unresolved (``receiver.suspect_sources``) the rows they touched are not read.
:func:`plan_data_rebuild` is the choice of members, as a pure function.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict

import grpc
import numpy as np

from ecrec import errors
from ecrec.net import transport
from ecrec.coding.codec import Codec
from ecrec.net.peers import PARITY
from ecrec.tables.shards import DenseShard, TableShard
from ecrec.strategies.base import StrategyHost
from ecrec.strategies.erasure.bulk import BulkRebuild, lower_priority
from ecrec.strategies.erasure.members import (StripeMembers, StripeRead, gather_many,  # noqa: F401 (re-exported)
                                               gather_members)
from ecrec.strategies.erasure.parity_store import ParityArena, TableParity
from ecrec.strategies.erasure.receiver import ParityReceiver
from ecrec.strategies.erasure.owner import EVERY_VERSION
from ecrec.strategies.erasure.pacing import RebuildPacer
from ecrec.strategies.erasure.read_channel import RowReader
from ecrec.strategies.erasure.resolution import embeddable
from ecrec.net.cluster_map import live_servers
from ecrec.wire import cluster_pb2, coordinator_pb2, parity_pb2

log = logging.getLogger("ecrec.strategies.erasure")

#: a paced rest is slept in slices of this much, ending early when training stops (s)
REST_SLICE_S = 0.25
#: the work a paced rest is measured against is capped at this (a round that waited long on a stream is not work)
MAX_PACED_WORK_S = 2.0


# --- choosing members --------------------------------------------------------------------------------------------
def lost_stripe_rows(members: StripeMembers, stripes: np.ndarray, my_member: np.ndarray, unavailable: set[int],
                     layout) -> np.ndarray:
    """Rows (of the rebuilding server, member ``my_member`` of each stripe: a data position, or ``k + j`` for
    parity ``j``) whose stripes lost more than ``m`` members: this server's own, plus every member on an
    ``unavailable`` index that could not be read (or was not rebuilt there).  A member merely slow to answer, on
    a live server, does not count: it may answer later."""
    k, m = layout.k, layout.m
    n = len(stripes)
    lost = np.ones(n, dtype=np.int64)  # this server's own member
    for t in range(k + m):
        server = layout.member_server(stripes, t)
        on_unavailable = np.isin(server, list(unavailable)) if unavailable else np.zeros(n, dtype=bool)
        lost += ((my_member != t) & on_unavailable & ~members.ready[t]).astype(np.int64)
    return lost > m


def plan_data_rebuild(members: StripeMembers, my_pos: np.ndarray, k: int, m: int):
    """Which members rebuild each lost data row.

    Returns ``(groups, versions)``: ``groups`` maps ``(position, data members, parity indices)`` to the
    rows (indices into the stripes) rebuilt from exactly those members; ``versions`` is each row's
    version after the rebuild.  A row is left out when fewer than ``k`` usable members agree: every
    used parity's version vector must equal the used data rows' versions (else a delta is in flight).
    """
    n = len(my_pos)
    groups: dict[tuple, list] = defaultdict(list)
    row_version = np.zeros(n, dtype=np.int64)
    ready = members.ready
    # fast path (vectorized): every other data member ready + the first ready parity agrees
    own = np.arange(k)[:, None] == my_pos[None, :]
    all_data = (ready[:k] | own).all(axis=0)
    parity_ready = ready[k:]
    has_parity = parity_ready.any(axis=0)
    j0 = np.argmax(parity_ready, axis=0)
    pv0 = members.parity_versions[j0, np.arange(n)]  # (n, k)
    agree = ((members.data_versions.T == pv0) | own.T).all(axis=1)
    fast = all_data & has_parity & agree
    row_version[fast] = pv0[fast, my_pos[fast]]
    for i in range(k):
        for j in range(m):
            rows = np.flatnonzero(fast & (my_pos == i) & (j0 == j))
            if len(rows):
                groups[(i, tuple(t for t in range(k) if t != i), (j,))].append(rows)
    # slow path, row by row: lost data members, parities that must agree with each other
    for r in np.flatnonzero(~fast & has_parity).tolist():
        i = int(my_pos[r])
        data_members = [t for t in range(k) if t != i and ready[t, r]]
        parities = [j for j in range(m) if ready[k + j, r]]
        if len(data_members) + len(parities) < k:
            continue
        chosen = parities[: k - len(data_members)]
        pv = members.parity_versions[chosen, r]  # (len(chosen), k)
        if (pv != pv[0]).any():
            continue  # parities disagree: a delta is in flight, retry
        if any(members.data_versions[t, r] != pv[0, t] for t in data_members):
            continue  # a data row is newer than the parity: its delta is in flight
        row_version[r] = pv[0, i]
        groups[(i, tuple(data_members), tuple(chosen))].append(np.array([r]))
    return {key: np.concatenate(parts) for key, parts in groups.items()}, row_version


# --- the engine --------------------------------------------------------------------------------------------------
class RebuildEngine:
    """A replacement's rebuild: on demand for requests, in the background for the rest."""

    def __init__(self, host: StrategyHost, codec: Codec, receiver: ParityReceiver, options, closed: threading.Event,
                 counters):
        self.host = host
        self.codec = codec
        self.receiver = receiver
        self.options = options
        self.closed = closed
        self.counters = counters
        self.recovering = threading.Event()
        self.lock = threading.Lock()  # one background batch at a time (on-demand rebuilds do not take it)
        self.foreground = 0  # requests rebuilding their rows right now (the background yields to them)
        self.lost: dict[str, np.ndarray] = {}  # table -> slots whose stripes lost more than m members
        self.lost_parity: dict[int, np.ndarray] = {}  # arena -> parity slots that can never be encoded
        self.last_request = 0.0  # when a pull or push last came in (monotonic)
        self.bulk: BulkRebuild | None = None  # the fast path (made at the first rebuild: it needs the index)
        self.pacer: RebuildPacer | None = None  # paces the background by training's rate (rebuild_slowdown)
        self.reader = RowReader(host, counters, options.rebuild_transport)  # members read over parity channels
        self._coefficients: dict[tuple[int, int], dict[int, int]] = {}  # (lost row, parity) -> decode coefficients

    def start(self) -> None:
        """Marks everything held here not ready and starts the background rebuild."""
        for shard in self.host.tables():
            shard.mark_unready()
        for arena in list(self.receiver.arenas.values()):
            arena.mark_unbuilt()
        for dense in self.host.dense_tensors():
            dense.mark_unready()
        self.last_request = time.monotonic()  # a promotion usually meets training: start gently
        if self.options.rebuild_slowdown > 0:
            self.pacer = RebuildPacer(self.options.rebuild_slowdown)
        self.recovering.set()

    def run_in_background(self) -> None:
        threading.Thread(target=self._background, name="ecrec-rebuild", daemon=True).start()

    def close(self) -> None:
        if self.bulk is not None:
            self.bulk.close()
        self.reader.close()

    def note_push(self) -> None:
        """A push reached this server: training's rate, for the pacer."""
        pacer = self.pacer
        if pacer is not None and self.recovering.is_set():
            pacer.on_push()

    # --- on demand -------------------------------------------------------------------------------------------
    def ensure_rows(self, items) -> None:
        if not self.recovering.is_set():
            return
        self.last_request = time.monotonic()
        work = []
        for shard, slots in items:
            missing = shard.unready(slots)
            lost = self.lost.get(shard.spec.name)
            if lost is not None and len(missing) and lost[missing].any():
                raise errors.DataLoss(self._describe_lost([(shard, np.unique(missing[lost[missing]]))]))
            if len(missing):
                work.append((shard, np.unique(missing)))
        if not work:
            return
        self.foreground += 1
        try:
            self.rebuild_data(work, foreground=True)
        finally:
            self.foreground -= 1

    def ensure_dense(self, dense: DenseShard) -> None:
        if self.recovering.is_set():
            self.last_request = time.monotonic()
        if self.recovering.is_set() and not dense.ready:
            self.foreground += 1
            try:
                self.rebuild_dense(dense)
            finally:
                self.foreground -= 1

    # --- data rows -------------------------------------------------------------------------------------------
    def rebuild_data(self, work: list[tuple[TableShard, np.ndarray]], foreground: bool = False) -> None:
        """Rebuilds this server's data rows (``(shard, slots)`` per table) from ``k`` consistent members of their
        stripes: one round of reads for every table, repeated for rows whose members do not agree yet.

        A row whose stripe lost more than ``m`` members (failed, or replaced and not rebuilt themselves) can
        never be rebuilt: it is marked lost, reported to the coordinator, and a request for it fails at once
        with ``DataLoss`` naming the table and stripes."""
        layout = self.host.layout
        k, m = layout.k, layout.m
        deadline = time.monotonic() + self.options.rebuild_deadline_s
        lost_now: list[tuple[TableShard, np.ndarray]] = []
        started = time.perf_counter()
        rounds = 0
        while work:
            rounds += 1
            with self.lock if not foreground else contextlib.nullcontext():
                work = self._still_to_do(work)
                if not work:
                    break
                reads, positions = [], []
                for shard, slots in work:
                    stripes, my_pos = np.divmod(layout.ids_of_slots(self.host.index, slots), k)
                    reads.append(StripeRead(shard.spec, stripes, np.arange(k)[:, None] != my_pos[None, :], True))
                    positions.append(my_pos)
                unavailable = self._unavailable_members()
                gathered = gather_many(self.host, reads, self.reader)
                for (shard, slots), members, my_pos, read in zip(work, gathered, positions, reads):
                    groups, row_version = plan_data_rebuild(members, my_pos, k, m)
                    done_rows, payloads = [], []
                    for (i, data_members, chosen), rows in groups.items():
                        payloads.append(self._decode(members, i, data_members, chosen, rows))
                        done_rows.append(rows)
                    rebuilt = np.zeros(len(slots), dtype=bool)
                    if done_rows:
                        rows = np.concatenate(done_rows)
                        rebuilt[rows] = True
                        installed = shard.install(slots[rows], np.concatenate(payloads), row_version[rows])
                        self.counters.add("rows_rebuilt", installed)
                    hopeless = ~rebuilt & lost_stripe_rows(members, read.stripes, my_pos, unavailable, layout)
                    if hopeless.any():
                        self._mark_lost(shard, slots[hopeless])
                        lost_now.append((shard, slots[hopeless]))
                work = self._still_to_do(work)
            if work:
                if time.monotonic() > deadline:
                    left = ", ".join(f"{shard.spec.name!r}: {len(slots)}" for shard, slots in work)
                    raise errors.Unavailable(f"rows cannot be rebuilt yet (members unavailable or in flight): {left}")
                time.sleep(0.01)
        if foreground:
            self.counters.add("on_demand_calls", 1)
            self.counters.add("on_demand_rounds", rounds)
            self.counters.add("on_demand_s", time.perf_counter() - started)
        if lost_now:
            self._report_lost(lost_now)
            if foreground:
                raise errors.DataLoss(self._describe_lost(lost_now))

    def _decode(self, members: StripeMembers, i: int, data_members: tuple, chosen: tuple, rows: np.ndarray):
        """Data row ``i`` of the stripes ``rows`` from the members the plan chose.  The common case, the other data
        rows and one parity, is one linear combination over the rows (ISA-L, as the fast path's decode); any other
        choice goes through the code's own reconstruction."""
        k = self.host.layout.k
        if len(chosen) == 1 and len(data_members) == k - 1:
            key = (i, chosen[0])
            coefficients = self._coefficients.get(key)
            if coefficients is None:
                coefficients = self._coefficients[key] = self.codec.data_decode_coefficients(i, chosen[0])
            return self.codec.combine([(a, members.payload[u, rows]) for u, a in coefficients.items()])
        available = {t: members.payload[t, rows] for t in data_members}
        available.update({k + j: members.payload[k + j, rows] for j in chosen})
        return self.codec.reconstruct_stripes(available, [i])[i]

    def _still_to_do(self, work):
        out = []
        for shard, slots in work:
            slots = shard.unready(slots)
            lost = self.lost.get(shard.spec.name)
            if lost is not None and len(slots):
                slots = slots[~lost[slots]]
            if len(slots):
                out.append((shard, slots))
        return out

    def _unavailable_members(self) -> set[int]:
        """Indices whose rows cannot be read now and may never be: failed (no server holds them) or held by a
        replacement that is still rebuilding (its rows not rebuilt yet are as lost as a failed server's)."""
        m = self.host.cluster_map
        live = live_servers(m)
        out = {i for i in range(m.num_servers) if i not in live}
        out |= {i for i, s in live.items() if s.state == cluster_pb2.RECOVERING and i != self.host.index}
        return out

    def _mark_lost(self, shard: TableShard, slots: np.ndarray) -> None:
        flags = self.lost.get(shard.spec.name)
        if flags is None:
            flags = self.lost[shard.spec.name] = np.zeros(shard.num_slots, dtype=bool)
        flags[slots] = True
        self.counters.add("rows_lost", len(slots))

    def _describe_lost(self, lost: list[tuple[TableShard, np.ndarray]]) -> str:
        layout, parts = self.host.layout, []
        for shard, slots in lost:
            stripes = np.unique(layout.ids_of_slots(self.host.index, slots) // layout.k)
            parts.append(f"table {shard.spec.name!r}: {len(stripes)} stripes ({', '.join(map(str, stripes[:8]))}"
                         f"{', ...' if len(stripes) > 8 else ''})")
        return (f"data lost: more than m={layout.m} members of these stripes failed before they could be rebuilt "
                f"(index {self.host.index} and {sorted(self._unavailable_members() - {self.host.index})}): "
                + "; ".join(parts))

    def _report_lost(self, lost: list[tuple[TableShard, np.ndarray]]) -> None:
        """Tells the coordinator (the map shows it to every client); logged, never raised here."""
        layout = self.host.layout
        request = coordinator_pb2.ReportDataLossRequest(index=self.host.index, server_id=self.host.server_id)
        unavailable = sorted(self._unavailable_members() | {self.host.index})
        for shard, slots in lost:
            stripes = np.unique(layout.ids_of_slots(self.host.index, slots) // layout.k)
            request.lost.add(table=shard.spec.name, stripes=stripes.tolist(), stripe_count=len(stripes),
                             indices=unavailable, wall_time=time.time())
        log.error("%s", self._describe_lost(lost))
        threading.Thread(target=self._send_loss_report, args=(request,), name="ecrec-data-loss-report",
                         daemon=True).start()

    def _send_loss_report(self, request, give_up_s: float = 120.0) -> None:
        """Sends a data-loss report, retried while the coordinator is unreachable (it may be restarting): the
        map must show the loss.  On its own thread: a read that found the loss fails at once meanwhile."""
        deadline, pause = time.monotonic() + give_up_s, 0.1
        while not self.closed.is_set():
            try:
                self.host.coordinator.stub.ReportDataLoss(request, timeout=self.host.config.coordinator_timeout_s)
                return
            except Exception as exc:  # noqa: BLE001 - reported, never swallowed
                if not transport.is_unavailable(exc) or time.monotonic() > deadline:
                    log.error("reporting data loss to the coordinator failed: %s", exc)
                    return
            time.sleep(pause)
            pause = min(2.0, pause * 2)

    # --- parity rows -----------------------------------------------------------------------------------------
    def rebuild_parity(self, arena: ParityArena, part: TableParity, slots: np.ndarray) -> int:
        """Re-encodes a table's parity rows (arena ``slots``) from their stripes' data rows; returns how many
        were built."""
        spec, layout = part.spec, self.host.layout
        suspects = self.receiver.suspect_sources()
        if suspects:
            slots = slots[~np.isin(slots, self.receiver.unresolved_slots(arena, suspects))]
        stripes = arena.slot_to_stripe[slots]
        pidx = arena.slot_to_parity_index[slots]
        want = np.ones((layout.k, len(slots)), dtype=bool)
        unavailable = self._unavailable_members()
        # with another index failed or rebuilding, read the other parities too: they tell a stripe that lost
        # more than m members (never encodable) from one whose data rows are merely being rebuilt
        generations = {i: self.receiver.generation(i) for i in range(layout.num_servers)}  # before the read
        arena.begin_read(slots)  # deltas for these rows are held back from now on (before the data is read)
        members = gather_members(self.host, spec, stripes, want, want_parity=bool(unavailable), confirmed=True)
        ready = members.ready[: layout.k].all(axis=0) & members.answered[: layout.k].all(axis=0)
        # only versions a resolution of their owner keeps or can undo here: at or below the owner's confirmed
        # bound, or whose batches are in this server's log (the owner sends them: retried until then)
        limit = self._embed_limits(members, stripes)
        unconfirmed = ready & ~embeddable(members.data_versions, limit).all(axis=0)
        if unconfirmed.any():
            self.counters.add("parity_rebuild_unconfirmed", int(unconfirmed.sum()))
            ready &= ~unconfirmed
        if unavailable:
            hopeless = ~ready & lost_stripe_rows(members, stripes, layout.k + pidx, unavailable, layout)
            if hopeless.any():
                flags = self.lost_parity.setdefault(arena.row_bytes, np.zeros(arena.size, dtype=bool))
                if len(flags) < arena.size:
                    flags = self.lost_parity[arena.row_bytes] = np.concatenate(
                        [flags, np.zeros(arena.size - len(flags), dtype=bool)])
                flags[slots[hopeless]] = True
                arena.end_read(slots[hopeless])  # never built: their deltas are not held
                self.counters.add("parity_rows_lost", int(hopeless.sum()))
        if not ready.any():
            return 0
        data = np.ascontiguousarray(members.payload[: layout.k, ready].transpose(1, 0, 2))
        parity = self.codec.encode_stripes(data)
        rows = parity[np.arange(int(ready.sum())), pidx[ready]]
        with self.receiver.lock:  # the owners' bounds and ids kept, and the rows built, with no resolution between
            if not all(self.receiver.adopt_locked(srv, sid, bound, committed.items(), generations[srv])
                       for srv, (sid, bound, committed) in members.owners.items()):
                return 0  # an owner was resolved since the read: read again
            built = arena.build(slots[ready], rows, members.data_versions[:, ready].T)
        self.counters.add("parity_rows_rebuilt", built)
        return built

    def _embed_limits(self, members: StripeMembers, stripes: np.ndarray) -> np.ndarray:
        """Per data member (``(k, n)``), the highest version a rebuilt parity may hold: its owner's confirmed
        bound, or what this server's log holds of that owner's incarnation, whichever is higher (members past the
        table's end, or of owners that did not answer: no limit; they are ready or not as read)."""
        layout = self.host.layout
        limit = np.full(members.data_versions.shape, EVERY_VERSION, dtype=np.int64)
        for t in range(layout.k):
            servers = layout.member_server(stripes, t)
            for srv, (sid, bound, _) in members.owners.items():
                limit[t, servers == srv] = max(bound, self.receiver.logged_upto(srv, sid))
        return limit

    # --- dense replicas --------------------------------------------------------------------------------------
    def rebuild_dense(self, dense: DenseShard) -> None:
        name = dense.spec.name
        with self.lock:
            if dense.ready:
                return
            deadline = time.monotonic() + self.options.rebuild_deadline_s
            while True:
                if self._copy_dense(dense):
                    return
                if time.monotonic() > deadline:
                    raise errors.Unavailable(f"dense tensor {name!r}: no replica available")
                time.sleep(0.02)

    def _copy_dense(self, dense: DenseShard) -> bool:
        """One try at copying a dense replica: from the primary, a version at or below its confirmed bound or
        logged here; from a backup only while the primary is not live (then one holding no logged delta of it),
        with the push ids that stand in it.  True when installed."""
        name = dense.spec.name
        replicas = self.host.layout.dense_servers(name)
        primary = replicas[0]
        # the primary's replacement (this server), or a primary that is gone: a backup is the source
        primary_serves = primary != self.host.index and primary in live_servers(self.host.cluster_map)
        for index in replicas:
            if index == self.host.index or (index != primary and primary_serves):
                continue
            generation = self.receiver.generation(primary)
            reply = self.host.peers.call_once(index, "ReadRows", parity_pb2.ReadRowsRequest(dense=name, confirmed=True),
                                              PARITY)
            if reply is None or reply.ready != b"\x01":
                continue
            version = int(transport.bytes_to_ids(reply.versions)[0])
            committed = [(c.worker, c.sequence) for c in reply.committed]
            with self.receiver.lock:
                if index == primary:
                    limit = max(reply.confirmed_upto, self.receiver.logged_upto_locked(primary, reply.server_id))
                    if not embeddable(version, limit):
                        self.counters.add("dense_rebuild_unconfirmed", 1)
                        continue
                    if not self.receiver.adopt_locked(primary, reply.server_id, reply.confirmed_upto, committed,
                                                      generation):
                        continue
                else:
                    self.receiver.commit_locked(primary, committed)
                dense.install(np.frombuffer(reply.payload, dtype=np.uint8), version)
            return True
        return False

    # --- in the background -----------------------------------------------------------------------------------
    def training_active(self) -> bool:
        """Whether a pull or push came in the last quarter second (the background rebuild then holds back)."""
        return time.monotonic() - self.last_request < 0.25

    def _background(self) -> None:
        lower_priority(self.options.rebuild_nice)  # this thread only: requests (on demand included) go first
        t0 = time.perf_counter()
        # the worker that met the failure replays its unconfirmed pushes right after the promotion: let that
        # (and the rows it needs, rebuilt on demand) go first
        self.closed.wait(0.05)
        while self.foreground > 0 and not self.closed.is_set():
            time.sleep(0.001)
        pause, failures = 0.1, 0
        while not self.closed.is_set():
            try:
                self._rebuild_everything()
                break
            except Exception as exc:  # noqa: BLE001 - reported, never swallowed: retried with backoff
                # a peer or the coordinator may answer an error for a while (a restart, a map catching up, a
                # deadline): nothing is lost by trying again, rows already rebuilt stay rebuilt
                if self.closed.is_set():  # the server stopped under it (its pools shut): nothing to retry
                    log.info("background rebuild stopped with the server (%s: %s)", type(exc).__name__, exc)
                    return
                failures += 1
                if failures in (1, 10) or failures % 50 == 0:
                    log.warning("background rebuild interrupted (attempt %d: %s: %s); retrying in %.1f s", failures,
                                type(exc).__name__, exc, pause, exc_info=failures == 1)
                self.counters.add("rebuild_retries", 1)
                self.closed.wait(pause)
                pause = min(5.0, pause * 2)
        if self.closed.is_set():
            return
        elapsed = time.perf_counter() - t0
        self.counters["rebuild_s"] = elapsed
        if self.counters["rows_lost"] or self.counters["parity_rows_lost"]:
            log.error("rebuild ended in %.2f s with %d data rows and %d parity rows lost (more than m failures in "
                      "their stripes); this index stays RECOVERING", elapsed, self.counters["rows_lost"],
                      self.counters["parity_rows_lost"])
            return
        self.recovering.clear()
        self.reader.release()
        log.info("rebuild done in %.2f s: %d data rows, %d parity rows; on demand: %d requests, %d rounds of reads, "
                 "%.2f s", elapsed, self.counters["rows_rebuilt"], self.counters["parity_rows_rebuilt"],
                 self.counters["on_demand_calls"], self.counters["on_demand_rounds"], self.counters["on_demand_s"])
        self._report_redundant(elapsed)

    def _rebuild_everything(self) -> None:
        """One pass over what is not rebuilt yet: the fast path, then data rows, dense replicas, parity rows."""
        faults = self.host.faults
        shards = self.host.tables()
        self._fast_path(shards)
        while True:  # data rows: every table's next rows in one round of reads
            todo = self._still_to_do([(shard, shard.unready_owned()) for shard in shards])
            if not todo:
                break
            per_table = max(1, self.options.rebuild_batch_rows // len(todo))
            started = time.perf_counter()
            self.rebuild_data([(shard, slots[:per_table]) for shard, slots in todo])
            faults.hit("during_rebuild")
            self._yield(time.perf_counter() - started)
        for dense in self.host.dense_tensors():
            self.rebuild_dense(dense)
        for arena, part in list(self.receiver.parts.values()):
            while not self.closed.is_set():
                todo = arena.unbuilt(part)
                lost = self.lost_parity.get(arena.row_bytes)
                if lost is not None and len(todo):
                    todo = todo[~lost[todo]]
                if not len(todo):
                    break
                started = time.perf_counter()
                built = self.rebuild_parity(arena, part, todo[:self.options.rebuild_batch_rows])
                worked = time.perf_counter() - started
                if built == 0:
                    time.sleep(0.02)  # members not ready or deltas in flight: a moment (not work)
                faults.hit("during_rebuild")
                self._yield(worked)

    def _report_redundant(self, elapsed: float) -> None:
        """Tells the coordinator this index is fully redundant again, retried (with backoff) until the map names
        this server ``ACTIVE``: the coordinator may be restarting, or not have recorded the promotion yet.  (It
        also asks recovering servers for their state, so a report that never arrives is not fatal either.)"""
        pause, attempt = 0.1, 0
        while not self.closed.is_set():
            attempt += 1
            try:
                self.host.coordinator.report_redundant(self.host.index, self.host.server_id, elapsed)
                return
            except Exception as exc:  # noqa: BLE001 - reported; retried
                if self._named_active():
                    return
                if attempt in (1, 10) or attempt % 50 == 0:
                    log.warning("reporting full redundancy failed (attempt %d: %s); retrying", attempt,
                                f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else exc)
            self.closed.wait(pause)
            pause = min(2.0, pause * 2)

    def _named_active(self) -> bool:
        m = self.host.cluster_map
        return m is not None and any(s.server_id == self.host.server_id and s.index == self.host.index
                                     and s.state == cluster_pb2.ACTIVE for s in m.servers)

    def _fast_path(self, shards: list[TableShard]) -> None:
        """Every table's data and parity rows, round by round (``rebuild_batch_rows`` rows of this server per
        round), the next round's reads in flight while this one is decoded; rows it cannot do are left to the
        row-by-row loops."""
        if self.bulk is None:
            self.bulk = BulkRebuild(self.host, self.codec, self.receiver, self.counters, self.options.rebuild_frame_bytes,
                                    self.options.rebuild_transport, self.options.rebuild_nice)
        layout = self.host.layout
        per_round = max(1, self.options.rebuild_batch_rows // (layout.k + layout.m))
        rounds = []
        for shard in shards:
            found = self.receiver.parts.get(shard.spec.name)
            if found is None:
                continue
            blocks = -(-layout.num_stripes(shard.spec.num_rows) // layout.num_servers)
            rounds += [(shard, *found, b0, min(blocks, b0 + per_round)) for b0 in range(0, blocks, per_round)]
        if not rounds:
            return
        t0 = time.perf_counter()
        pending = self._fetch(rounds[0])
        active = time.perf_counter()  # since the last rest: what the pacer counts as work (the streams' too)
        for n, (shard, arena, part, _, _) in enumerate(rounds):
            waited = time.perf_counter()
            read = pending.result()
            self.counters.add("bulk_wait_s", time.perf_counter() - waited)
            # the next round's streams go now, beside this round's decoding -- unless training paces the rebuild:
            # then they go after the rest (a survivor streaming while the pacer rests would not be paced)
            paced = self.pacer is not None and self.training_active()
            if n + 1 < len(rounds) and not paced:
                pending = self._fetch(rounds[n + 1])
            started = time.perf_counter()
            with self.lock:
                data_rows, parity_rows = self.bulk.rebuild_round(shard, arena, part, read)
            self.counters.add("rows_rebuilt", data_rows)
            self.counters.add("parity_rows_rebuilt", parity_rows)
            self.counters.add("bulk_rows_rebuilt", data_rows + parity_rows)
            del read
            self.host.faults.hit("during_rebuild")
            if self.closed.is_set():
                return
            # paced: the round's whole time since the last rest (its streams' too); else its decoding, as always
            self._yield(time.perf_counter() - (active if paced else started))
            active = time.perf_counter()
            if n + 1 < len(rounds) and paced and not self.closed.is_set():
                pending = self._fetch(rounds[n + 1])
        self.counters["bulk_s"] = time.perf_counter() - t0
        log.info("fast path: %d rows in %.2f s, %.2f s of it waiting for the survivors' streams",
                 self.counters["bulk_rows_rebuilt"], self.counters["bulk_s"], self.counters["bulk_wait_s"])

    def _fetch(self, round_):
        """Starts the fast path's reads of one round, its parity rows' deltas held back from now on."""
        shard, arena, part, b0, b1 = round_
        m = self.host.layout.m
        blocks = np.arange(b0, b1, dtype=np.int64)
        arena.begin_read(part.arena_slots((blocks[:, None] * m + np.arange(m)).reshape(-1)))
        return self.bulk.fetch(shard.spec, b0, b1)

    def _yield(self, worked_s: float) -> None:
        """Lets training go first: wait while a foreground request rebuilds, then rest so that the
        background rebuild keeps to ``rebuild_duty`` of the wall time (``rebuild_duty_training`` while training
        requests come in; at least ``rebuild_pause_s``) -- or, with ``rebuild_slowdown``, while training requests
        come in, as long as the pacer answers (:mod:`~ecrec.strategies.erasure.pacing`)."""
        while self.foreground > 0 and not self.closed.is_set():
            time.sleep(0.001)
        pacer = self.pacer
        if pacer is not None and self.training_active():
            pacer.max_duty = self.options.rebuild_duty  # the pacer never works more than rebuild_duty allows
            rest = pacer.rest_after(time.monotonic(), min(worked_s, MAX_PACED_WORK_S))
            # in slices: a rest ends as soon as training stops (redundancy then comes back at full speed)
            while rest > 0 and not self.closed.is_set() and self.training_active():
                self.closed.wait(min(rest, REST_SLICE_S))
                rest -= min(rest, REST_SLICE_S)
                if rest <= 0:
                    rest = pacer.after_rest(time.monotonic())
            state = pacer.state()
            self.counters["rebuild_duty"] = state.duty
            self.counters["rebuild_probes"] = state.probes
            self.counters["rebuild_reference_pushes_per_s"] = state.reference_rate
            self.counters["rebuild_loaded_pushes_per_s"] = state.loaded_rate
            return
        duty = self.options.rebuild_duty_training if self.training_active() else self.options.rebuild_duty
        duty = min(duty, self.options.rebuild_duty)
        rest = max(self.options.rebuild_pause_s, worked_s * (1.0 / duty - 1.0))
        if rest:
            self.closed.wait(rest)
