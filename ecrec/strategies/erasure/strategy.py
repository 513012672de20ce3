"""The ``ecrec`` strategy as the server sees it: wires the owner, receiver, resolution and rebuild parts.

Every hook of :class:`~ecrec.strategies.base.FaultToleranceStrategy` delegates to the part that owns
the state it touches (see the package docstring); this class holds only the wiring, the ``stats`` and
``verify_parity`` commands.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ecrec import errors
from ecrec.coding.codec import Codec
from ecrec.strategies.base import AppliedPush, FaultToleranceStrategy, PushOutcome, StrategyHost
from ecrec.strategies.erasure.counters import Counters
from ecrec.strategies.erasure.options import ErasureOptions
from ecrec.strategies.erasure.owner import ParityOwner
from ecrec.strategies.erasure.rebuild import RebuildEngine, gather_members
from ecrec.strategies.erasure.receiver import ParityReceiver
from ecrec.strategies.erasure.resolution import Resolver
from ecrec.strategies.erasure.service import ParityServicer, add_to_server
from ecrec.wire import parity_pb2


#: the timer's period while this server's owner has nothing to watch (s)
IDLE_TIMER_S = 0.5
#: the data rows ``verify_parity`` gathers and encodes at once
VERIFY_BYTES = 32 << 20


class ErasureCoding(FaultToleranceStrategy):
    name = "ecrec"
    needs_delta = True
    rebuilds_rows = True
    fills_in_bulk = True

    def __init__(self, host: StrategyHost, options: ErasureOptions):
        super().__init__(host, options)
        layout = host.layout
        kernel = "gpu" if host.config.device == "cuda" else "cpu"  # --device says where parity work runs
        self.codec = Codec(layout.k, layout.m, backend=options.backend, kernel=kernel)
        self.closed = threading.Event()
        self._verifying = threading.Lock()  # one verify_parity at a time here (it flushes every owner's pushes)
        self.counters = Counters()
        self.owner = ParityOwner(host, options, self.closed, self.counters)
        self.receiver = ParityReceiver(host, self.codec, self.counters)
        self.resolver = Resolver(host, options, self.counters)
        self.rebuild = RebuildEngine(host, self.codec, self.receiver, options, self.closed, self.counters)
        self.servicer = ParityServicer(host, self.owner, self.receiver, options.rebuild_nice)

    @property
    def timer_interval_s(self) -> float:
        """How often the server calls :meth:`on_timer`: while the owner has something to watch (an open group, a
        batch not applied everywhere), twice per ``relay_timeout_s``; else every half second (as for a strategy without a timer)."""
        if self.owner.needs_timer():
            return max(0.005, self.options.relay_timeout_s / 2)
        return IDLE_TIMER_S

    def services(self):
        return [(add_to_server, self.servicer)]

    # --- creation ----------------------------------------------------------------------------------------------
    def reserve_shapes(self, specs: list) -> dict:
        """The parity rows of the first table of each row width (the arena of that width starts with its rows;
        later tables of the width are appended to a copy); none when they live on the GPU."""
        if self.codec.kernel.name == "gpu":
            return {}
        first = {}
        for spec in specs:
            first.setdefault(spec.row_bytes, spec)
        return {spec.name: [((self.host.layout.parity_slots_per_server(spec.num_rows), spec.row_bytes), "uint8")]
                for spec in first.values()}

    def on_table_created(self, shard) -> None:
        t0 = time.perf_counter()
        encode = not self.host.promoting
        self.receiver.add_table(shard, encode=encode)
        if encode:
            self.counters.add("initial_encode_s", time.perf_counter() - t0)

    def check_fill(self, shard) -> None:
        if self.is_recovering():
            raise errors.Unavailable("this server rebuilds after a promotion: a restore in bulk waits until it is "
                                     "redundant again; retry")
        arena, part = self.receiver.part(shard.spec.name)
        if arena.touched(part):
            raise errors.FailedPrecondition(f"table {shard.spec.name!r}: parity rows here hold pushes' deltas (or are "
                                            "being rebuilt): a restore into it goes by pushes")

    def fill_redundancy(self, shard, gather) -> int:
        """This server's parity rows of ``shard`` encoded from the snapshot's data rows, one encode per stripe."""
        t0 = time.perf_counter()
        arena, part = self.receiver.part(shard.spec.name)
        arena.encode_from(part, gather)
        self.counters.add("initial_encode_s", time.perf_counter() - t0)
        return len(part.slots)

    # --- the hot path ------------------------------------------------------------------------------------------
    def admit_push(self) -> None:
        self.owner.admit()

    def on_push(self, push: AppliedPush):
        t0 = time.thread_time()
        try:
            self.rebuild.note_push()
            return self.owner.on_push(push)
        finally:
            self.counters.add("on_push_cpu_s", time.thread_time() - t0)

    def on_retry(self, push_id, seq: int):
        return PushOutcome(relay=self.owner.relay_for(seq), seq=seq, confirmed_upto=self.owner.confirmed_upto())

    def on_relay(self, relay, worker: str = ""):
        t0 = time.thread_time()
        try:
            return self.receiver.on_relay(relay, worker)
        finally:
            self.counters.add("on_relay_cpu_s", time.thread_time() - t0)

    def on_acks(self, acks, worker: str = "") -> None:
        t0 = time.thread_time()
        try:
            self.owner.on_acks(acks, worker)
        finally:
            self.counters.add("on_acks_cpu_s", time.thread_time() - t0)

    def on_map_change(self) -> None:
        self.owner.on_map_change()

    def confirmed_upto(self) -> int:
        return self.owner.confirmed_upto()

    def on_timer(self) -> None:
        self.owner.on_timer()

    def ensure_rows(self, items) -> None:
        self.rebuild.ensure_rows(items)

    def ensure_dense(self, dense) -> None:
        self.rebuild.ensure_dense(dense)

    # --- recovery ----------------------------------------------------------------------------------------------
    def is_recovering(self) -> bool:
        return self.rebuild.recovering.is_set()

    def on_recovery(self, failed_index: int) -> bool:
        t0 = time.perf_counter()
        started = time.time()
        self.rebuild.start()
        standing = self.resolver.resolve(failed_index)
        for push_id in standing:
            self.host.mark_applied(push_id)
        self.owner.note_committed(standing)  # they stand in the rows rebuilt here: a rebuild that embeds them takes them
        self.counters["resolve_s"] = time.perf_counter() - t0
        self.counters["promoted_wall_time"] = started
        self.rebuild.run_in_background()
        return True

    # --- commands, stats -----------------------------------------------------------------------------------------
    def call(self, command: str, args: dict) -> dict:
        if command == "verify_parity":
            timeout_s = args.get("timeout_s", 30.0)
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
                raise errors.InvalidRequest(f"verify_parity: timeout_s must be a number of seconds in (0, 3600], "
                                            f"not {timeout_s!r}")
            if not self._verifying.acquire(timeout=float(timeout_s)):  # one at a time: the next waits its turn
                raise errors.ResourceExhausted(
                    f"a parity verification already runs on server {self.host.index} and did not end within this "
                    f"one's timeout_s ({timeout_s:g} s): one at a time (each flushes every owner's pending parity, "
                    "pausing their pushes meanwhile); retry when it ends")
            try:
                return self.verify_parity(float(timeout_s))
            finally:
                self._verifying.release()
        return super().call(command, args)

    def verify_parity(self, timeout_s: float = 30.0) -> dict:
        """Compares every parity row held here with a fresh encode of its stripe's current data rows, and
        every dense replica with its primary, once every server has delivered its pending batches and this
        server's rebuild (if one runs) is done; ``FailedPrecondition`` if that takes longer than ``timeout_s``."""
        host, layout = self.host, self.host.layout
        deadline = time.monotonic() + timeout_s
        self.flush_cluster(timeout_s)
        self._wait_rebuilt(max(0.0, deadline - time.monotonic()))
        self.owner.seal_for_read()  # this server's own data rows are read below too
        mismatched, checked = 0, 0
        for name, (arena, part) in self.receiver.parts.items():
            # a bounded number of stripes at a time: a table of gigabytes is never gathered, encoded and compared
            # whole (memory, and seconds-long native calls that would starve this server's health checks)
            chunk = max(1, VERIFY_BYTES // (layout.k * part.spec.row_bytes))
            for start in range(0, len(part.slots), chunk):
                slots = part.slots[start:start + chunk]
                stripes = arena.slot_to_stripe[slots]
                want = np.ones((layout.k, len(slots)), dtype=bool)
                members = gather_members(host, part.spec, stripes, want, want_parity=False, local=host.table(name))
                if not members.answered[: layout.k].all():
                    raise errors.Unavailable(f"a server is unavailable for verification of table {name!r}")
                data = np.ascontiguousarray(members.payload[: layout.k].transpose(1, 0, 2))
                expected = self.codec.encode_stripes(data)[np.arange(len(slots)), arena.slot_to_parity_index[slots]]
                actual = arena.read(slots)[0]
                mismatched += int((expected != actual).any(axis=1).sum())
                checked += len(slots)
        for dense in host.dense_tensors():
            primary = layout.dense_servers(dense.spec.name)[0]
            if primary == host.index:
                continue
            reply = host.peers.call_once(primary, "ReadRows", parity_pb2.ReadRowsRequest(dense=dense.spec.name), "parity")
            checked += 1
            if reply is None or reply.payload != dense.read()[0].tobytes():
                mismatched += 1
        return {"checked": checked, "mismatched": mismatched}

    def _wait_rebuilt(self, timeout_s: float = 30.0) -> None:
        """Waits for this server's rebuild to finish: until then its parity rows are not all built (a rebuilt
        parity row embeds a version only once its owner confirmed it, so the rebuild may be waiting on the batches
        the flush just delivered)."""
        deadline = time.monotonic() + timeout_s
        while self.rebuild.recovering.is_set():
            counters = self.rebuild.counters
            if counters["rows_lost"] or counters["parity_rows_lost"]:
                raise errors.DataLoss(f"server {self.host.index} lost {counters['rows_lost']} data rows and "
                                      f"{counters['parity_rows_lost']} parity rows in its rebuild: nothing to verify")
            if time.monotonic() > deadline or self.closed.is_set():
                # not UNAVAILABLE: this server is alive, and a caller would take that for "gone" and report it
                raise errors.FailedPrecondition(
                    f"server {self.host.index} is still rebuilding ({self._rebuild_progress(True)['rebuild_rows_pending']}"
                    " rows to go): its parity is verified once the map shows it ACTIVE again; retry then")
            time.sleep(0.02)

    def flush_cluster(self, timeout_s: float = 30.0) -> None:
        """Every server (this one included) delivers its unconfirmed batches directly and waits for them."""
        from ecrec.net.cluster_map import live_servers

        peers = [i for i in live_servers(self.host.cluster_map) if i != self.host.index]
        request = parity_pb2.FlushRequest(timeout_s=timeout_s)
        left = self.owner.flush(timeout_s)
        replies = self.host.peers.call_many([(i, "Flush", request) for i in peers], "parity")
        if left or any(r is None or r.unconfirmed for r in replies):
            raise errors.Unavailable("some servers could not deliver their pending parity batches; retry")

    def stats(self) -> dict:
        layout = self.host.layout
        parity_bytes = sum(len(part.slots) * arena.row_bytes for arena, part in self.receiver.parts.values())
        replica_bytes = sum(d.nbytes for d in self.host.dense_tensors()
                            if layout.dense_servers(d.spec.name)[0] != self.host.index)
        log_entries = sum(len(lg.entries) for lg in self.receiver.logs.values())
        recovering = self.rebuild.recovering.is_set()
        delta_s = (sum(shard.delta_cpu_s for shard in self.host.tables())
                   + sum(d.delta_cpu_s for d in self.host.dense_tensors()))
        return dict(self.counters) | {"part_delta_cpu_s": delta_s, "recovering": recovering,
                                      "redundancy_bytes": parity_bytes + replica_bytes,
                                      "unconfirmed_pushes": self.owner.unconfirmed(), "log_entries": log_entries,
                                      "confirmed_upto": self.owner.confirmed_upto(), "kernel": self.codec.kernel.name,
                                      "parity_on_device": any(arena.on_device for arena, _ in self.receiver.parts.values())
                                      } | self._rebuild_progress(recovering)

    def _rebuild_progress(self, recovering: bool) -> dict:
        """Rows this server holds (data and parity) and how many still wait for the rebuild (0 when none runs)."""
        data_rows = sum(len(shard.owned_ids) for shard in self.host.tables())
        parity_rows = sum(len(part.slots) for _, part in self.receiver.parts.values())
        pending = 0
        if recovering:
            pending = (sum(len(shard.unready_owned()) for shard in self.host.tables())
                       + sum(arena.unbuilt_count for arena in list(self.receiver.arenas.values())))
        return {"parity_rows": parity_rows, "rebuild_rows_total": data_rows + parity_rows,
                "rebuild_rows_pending": pending}

    def close(self) -> None:
        self.closed.set()
        self.owner.close()
        self.rebuild.close()
        self.servicer.close()
