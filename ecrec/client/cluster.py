"""The client SDK: what a PyTorch training loop uses to train against an ECRec cluster.

    cluster = Cluster.connect("127.0.0.1:7000")
    cluster.create_table("user", num_rows=1_000_000, dim=64, optimizer="adagrad", lr=0.05, seed=1)
    emb = EmbeddingBag(cluster, "user", mode="sum")          # like torch.nn.EmbeddingBag
    cluster.register_dense(mlp, optimizer="sgd", lr=0.1)     # the MLP lives on the servers too
    for batch in data:
        loss = loss_fn(mlp(emb(batch.indices, batch.offsets)), batch.labels)
        loss.backward()
        cluster.step()                                       # push every gradient; servers apply them

Rows are pulled from the server that owns them (``ecrec.coding.layout``); backward
records the gradient of every pulled row; ``step`` sends one push per server
carrying every table's rows and the dense gradients it is primary for, and
returns when the servers have applied them.  When a server fails, calls report
it to the coordinator, follow the map to the replacement and retry with the
same push id, so a push is applied exactly once and the loop sees no exception.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from ecrec.net import transport
from ecrec.net.cluster_map import live_address, live_servers
from ecrec.config import ClientConfig
from ecrec.client.courier import Courier
from ecrec.coding.layout import Layout
from ecrec.net.peers import CoordinatorClient, PeerError, Peers, PeerUnreachable
from ecrec.tables.spec import INITS, DenseSpec, TableSpec
from ecrec.wire import cluster_pb2, coordinator_pb2, embedding_pb2

log = logging.getLogger("ecrec.client")

#: the largest reply of one ``ReadPayload`` call of :meth:`Cluster.read_payload` (tables of any size are read
#: in pieces; the default message limit is 256 MiB)
READ_PAYLOAD_BYTES = 64 << 20
#: and at most this many ids (a server refuses more than ``--max-ids-per-request``, 1 << 22 by default)
READ_PAYLOAD_IDS = 1 << 20
#: the most bytes of values one push of :meth:`Cluster.write_rows` carries (all servers together)
WRITE_ROWS_BYTES = 16 << 20
#: a string ``init`` of ``create_table`` ending so (or holding a ``/``) is a warm start's file
WARM_START_SUFFIXES = (".npy", ".pt", ".pth")
#: what :meth:`Cluster.read_table` and :meth:`Cluster.write_rows` read or replace of each row
ROW_PARTS = ("weights", "state", "payload")


def _columns(spec: TableSpec, what: str) -> slice:
    """The columns of a row's float32 payload that ``what`` (:data:`ROW_PARTS`) names."""
    if what == "weights":
        return slice(0, spec.dim)
    if what == "payload":
        return slice(0, spec.row_floats)
    if what == "state":
        if spec.row_floats == spec.dim:
            raise ValueError(f"table {spec.name!r}: optimizer {spec.optimizer!r} keeps no state")
        return slice(spec.dim, spec.row_floats)
    raise ValueError(f"what must be one of {ROW_PARTS}, got {what!r}")


class ClusterError(RuntimeError):
    """A cluster call failed for good (bad input, or no replacement within the retry deadline)."""


@dataclass
class _Pending:
    table: str
    ids: np.ndarray
    rows: torch.Tensor
    lookups: np.ndarray | None = None  # per id: how many times the batch looked it up


@dataclass(frozen=True)
class Replacement:
    """A server index that moved to a new process (a failure this client has seen)."""

    index: int
    old_address: str
    new_address: str
    epoch: int
    wall_time: float


class Cluster:
    """A connection to one ECRec cluster (coordinator plus embedding servers)."""

    def __init__(self, address: str, config: ClientConfig | None = None, worker: str | None = None):
        self.config = config or ClientConfig()
        self.address = address
        self.worker = worker or f"worker-{uuid.uuid4().hex[:12]}"
        self.incarnation = uuid.uuid4().hex[:12]  # this process: a restarted worker with the same name is another
        self._lock = threading.RLock()
        self.coordinator = CoordinatorClient(address, self.config.rpc_timeout_s, self.config.max_message_bytes,
                                             on_map=self._adopt, security=self.config.security)
        self._coordinator = self.coordinator.stub
        self.peers = Peers(lambda: self.map, self.coordinator, timeout_s=self.config.rpc_timeout_s,
                           retry_deadline_s=self.config.retry_deadline_s,
                           max_message_bytes=self.config.max_message_bytes, security=self.config.security)
        self.courier = Courier()
        self.steps_done = 0  # step() calls that returned
        self._periodic = None  # snapshot_every's schedule
        #: the gradient (float32, flattened) the last acknowledged step() pushed to each dense tensor: a checkpoint
        #: driver keeps the dense parameters from these (CPR keeps them on its trainers)
        self.last_dense_grads: dict[str, np.ndarray] = {}
        #: per table, the ids the last acknowledged step() updated and how many lookups of the batch each had
        #: (what a sample-weighted count of lost updates weighs them by); counted only while ``count_lookups``
        #: is set (a checkpoint driver sets it), so that the pull path pays nothing otherwise
        self.last_lookups: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.count_lookups = False
        self._pending: list[_Pending] = []
        self._dense: dict[str, torch.nn.Parameter] = {}
        self._sequence = 0
        self.map: cluster_pb2.ClusterMap | None = None
        self.layout: Layout | None = None
        self.replacements: list[Replacement] = []  # servers this client saw replaced, oldest first
        self._last_live: dict[int, str] = {}
        self._live_ids: dict[int, str] = {}  # index -> the server id serving it in the newest map
        self._stats = {"pushes": 0, "push_bytes": 0, "pull_bytes": 0}

    @property
    def stats(self) -> dict:
        """Pushes made, calls retried after a failure, bytes pushed and pulled."""
        return self._stats | {"retries": self.peers.retries, "replayed": self.courier.stats["replayed"],
                              "unconfirmed_pushes": self.courier.unconfirmed()}

    @classmethod
    def connect(cls, address: str, config: ClientConfig | None = None, worker: str | None = None,
                wait_ready_s: float = 60.0) -> "Cluster":
        """Connects and waits (up to ``wait_ready_s``) until every server index is served."""
        cluster = cls(address, config, worker)
        deadline = time.monotonic() + wait_ready_s
        while True:
            try:
                cluster.refresh_map()
                if cluster.map.ready:
                    return cluster
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise ClusterError(f"coordinator {address}: {exc.details()}") from None
            if time.monotonic() > deadline:
                raise ClusterError(f"cluster at {address} not ready after {wait_ready_s:.0f} s")
            time.sleep(0.1)

    # --- the map ---------------------------------------------------------------------------------
    def refresh_map(self) -> cluster_pb2.ClusterMap:
        return self.coordinator.get_map()

    def _adopt(self, m: cluster_pb2.ClusterMap) -> None:
        with self._lock:
            if self.map is None or m.epoch >= self.map.epoch:
                self.map = m
                self.layout = Layout(m.num_servers, m.k, m.m)
                self._live_ids = {i: s.server_id for i, s in live_servers(m).items()}
                for index in range(m.num_servers):  # compare with the last live address seen, across FAILED maps
                    before, after = self._last_live.get(index), live_address(m, index)
                    if after is None:
                        continue
                    if before is not None and before != after:
                        self.replacements.append(Replacement(index, before, after, m.epoch, time.time()))
                    self._last_live[index] = after

    def _call(self, index: int, method: str, request):
        """Calls ``method`` on the server at ``index``; follows failures to the replacement and retries."""
        try:
            return self.peers.call(index, method, request, prepare=self._replay_if_replaced)
        except (PeerError, PeerUnreachable) as exc:
            raise ClusterError(str(exc)) from None

    def _fan_out(self, method: str, requests: dict[int, object]) -> dict[int, object]:
        """One request per server index in parallel; a call whose server is gone follows the map to the
        replacement and retries the same request (same push id)."""
        try:
            return self.peers.fan_out(method, requests, prepare=self._replay_if_replaced)
        except (PeerError, PeerUnreachable) as exc:
            raise ClusterError(str(exc)) from None

    def _replay_if_replaced(self, index: int) -> None:
        """Before anything goes to ``index``: if a new incarnation serves it, replays this worker's pushes the
        old one acknowledged and did not confirm, in order, with their push ids (``ecrec.client.courier``)."""
        if not self.courier.held_elsewhere(index, self._live_ids.get(index)):
            return
        deadline = time.monotonic() + self.config.retry_deadline_s
        while True:
            with self._lock:
                live = live_servers(self.map).get(index) if self.map is not None else None
            todo = self.courier.to_replay(index, live.server_id) if live is not None else []
            if not todo:
                return
            log.warning("server index %d is served by a new process: replaying %d unconfirmed pushes", index, len(todo))
            request = embedding_pb2.ReplayRequest()
            for _, held in todo:
                push = request.pushes.add()
                push.CopyFrom(held)
                push.ClearField("relay")
                push.ClearField("acks")
                push.replay = True
            try:  # at this incarnation only: a replay must not continue at another one midway
                reply = self.peers.stub(live.address).Replay(request, timeout=self.config.rpc_timeout_s)
            except grpc.RpcError as exc:
                if not transport.is_unavailable(exc):
                    raise ClusterError(f"replaying {len(todo)} pushes to server {index} ({live.address}): "
                                       f"{exc.code().name}: {exc.details()}") from None
                self.peers.report(live.address, f"Replay: {exc.code().name}")
                if time.monotonic() > deadline:
                    raise ClusterError(f"server index {index} unreachable and not replaced within "
                                       f"{self.config.retry_deadline_s:.0f} s while replaying pushes") from None
                time.sleep(0.05)
                continue  # start over at whatever serves the index now
            for (key, _), push_reply in zip(todo, reply.replies):
                self.courier.replayed(index, key, push_reply)

    # --- tables ----------------------------------------------------------------------------------
    def create_table(self, name: str, num_rows: int, dim: int, optimizer: str = "sgd", lr: float = 0.01,
                     eps: float = 1e-10, initial_accumulator_value: float = 0.0, init="uniform",
                     init_scale: float = 0.0, seed: int = 0, on_progress=None) -> TableSpec:
        """Creates a table on every server (idempotent for the same spec).

        ``init``: ``uniform``, ``normal`` or ``zeros`` (drawn on the servers from ``seed``), ``blank`` (every
        float zero, the optimizer state too, nothing computed: for a table whose every row is written next, as
        a restore does), or pretrained rows
        (a warm start): a tensor or array ``(num_rows, dim)``, or the path of a ``.npy`` file (read a push at
        a time) or a torch file.  A warm start creates a new table only (an existing one is refused: load
        into it with ``load_state_dict`` or :meth:`write_rows`) and writes the rows in pushes
        (``on_progress(rows, total)`` after each); its optimizer state starts at
        ``initial_accumulator_value``."""
        values = None
        if not isinstance(init, str) or (init not in INITS and ("/" in init or init.endswith(WARM_START_SUFFIXES))):
            from ecrec.client.warm_start import load_values

            shape_only = TableSpec(name=name, num_rows=int(num_rows), dim=int(dim), optimizer=optimizer,
                                   initial_accumulator_value=float(initial_accumulator_value)).validate()
            values = load_values(init, shape_only)
            if any(t.name == name for t in self.refresh_map().tables):
                raise ClusterError(f"create_table {name!r}: the table exists; a warm start creates a new table "
                                   "(load into an existing one with load_state_dict or Cluster.write_rows)")
            init = "zeros"
        spec = TableSpec(name=name, num_rows=int(num_rows), dim=int(dim), optimizer=optimizer, lr=float(lr), eps=float(eps),
                         initial_accumulator_value=float(initial_accumulator_value), init=init,
                         init_scale=float(init_scale), seed=int(seed)).validate()
        if values is not None:  # every value checked before the table exists
            self._check_values(spec, values)
        try:
            m = self._coordinator.CreateTable(spec.to_proto(), timeout=self.config.create_timeout_s)
        except grpc.RpcError as exc:
            raise ClusterError(f"create_table {name!r}: {exc.code().name}: {exc.details()}") from None
        self._adopt(m)
        if values is not None:
            self.write_rows(name, np.arange(spec.num_rows), values, on_progress=on_progress, checked=True)
        return spec

    @staticmethod
    def _check_values(spec: TableSpec, values, what: str = "weights") -> None:
        """Raises ``ValueError`` naming the table and the rows when ``values`` are not finite numbers (read a
        push's worth at a time: a memory-mapped file stays on disk)."""
        width = _columns(spec, what).stop - _columns(spec, what).start
        chunk = max(1, min(WRITE_ROWS_BYTES // (4 * width), 65536))
        # Adagrad's accumulators: the state columns (all of them for "state", past dim for "payload")
        state_from = {"state": 0, "payload": spec.dim}.get(what) if spec.optimizer == "adagrad" else None
        for start in range(0, len(values), chunk):
            piece = np.asarray(values[start:start + chunk])
            if piece.dtype.kind not in "fiu":
                raise ValueError(f"table {spec.name!r}: {what} must be numbers, got {piece.dtype}")
            with np.errstate(over="ignore"):
                piece = piece.astype(np.float32, copy=False)  # as sent: 1e39 is Inf in float32
            if not np.isfinite(piece).all():
                raise ValueError(f"table {spec.name!r}: {what} must be finite float32 numbers (rows {start}.."
                                 f"{min(start + chunk, len(values)) - 1} are not)")
            if state_from is not None and (piece[:, state_from:] < 0).any():
                raise ValueError(f"table {spec.name!r}: an Adagrad accumulator is negative (rows from {start})")

    @staticmethod
    def _check_dense_values(spec: DenseSpec, payload: np.ndarray) -> None:
        """Raises ``ValueError`` naming the tensor when a dense payload (weights then optimizer state, float32)
        is not finite or holds a negative Adagrad accumulator."""
        if not np.isfinite(payload).all():
            raise ValueError(f"dense tensor {spec.name!r}: the payload must be finite float32 numbers")
        if spec.optimizer == "adagrad" and (payload[spec.numel:] < 0).any():
            raise ValueError(f"dense tensor {spec.name!r}: an Adagrad accumulator is negative")

    def table_spec(self, name: str) -> TableSpec:
        for t in self.map.tables:
            if t.name == name:
                return TableSpec.from_proto(t)
        self.refresh_map()
        for t in self.map.tables:
            if t.name == name:
                return TableSpec.from_proto(t)
        raise KeyError(f"unknown table {name!r}")

    def _check_ids(self, name: str, ids) -> tuple[TableSpec, np.ndarray]:
        spec = self.table_spec(name)
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"table {name!r}: ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= spec.num_rows):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise IndexError(f"table {name!r}: row id {bad} out of range [0, {spec.num_rows})")
        return spec, ids

    def _group_by_server(self, ids: np.ndarray):
        servers, _ = self.layout.locate(ids)
        order = np.argsort(servers, kind="stable")
        bounds = np.searchsorted(servers[order], np.arange(self.layout.num_servers + 1))
        return {i: order[bounds[i]:bounds[i + 1]] for i in range(self.layout.num_servers) if bounds[i + 1] > bounds[i]}

    def pull(self, name: str, ids) -> torch.Tensor:
        """Current weights of rows ``ids`` as a float32 tensor ``(len(ids), dim)``."""
        return self.pull_many({name: ids})[name]

    def pull_many(self, requests: dict) -> dict[str, torch.Tensor]:
        """Rows of several tables at once (``{table: ids}``): one request per server for all of them."""
        checked = {name: self._check_ids(name, ids) for name, ids in requests.items()}
        out = {name: np.empty((len(ids), spec.dim), dtype=np.float32) for name, (spec, ids) in checked.items()}
        per_server: dict[int, list] = {}
        for name, (spec, ids) in checked.items():
            if len(ids):
                for i, pos in self._group_by_server(ids).items():
                    per_server.setdefault(i, []).append((name, spec, ids, pos))
        if per_server:
            requests_by_server = {
                i: embedding_pb2.PullRequest(
                    tables=[embedding_pb2.TableIds(table=name, ids=transport.ids_to_bytes(ids[pos]))
                            for name, _, ids, pos in parts], epoch=self.map.epoch)
                for i, parts in per_server.items()}
            for i, request in requests_by_server.items():
                self.courier.attach(i, request)
            replies = self._fan_out("Pull", requests_by_server)
            for i, reply in replies.items():
                self.courier.received(i, reply)
            for i, parts in per_server.items():
                for (name, spec, _, pos), data in zip(parts, replies[i].values):
                    self._stats["pull_bytes"] += len(data)
                    out[name][pos] = transport.bytes_to_floats(data, (len(pos), spec.dim))
        return {name: torch.from_numpy(rows) for name, rows in out.items()}

    def read_payload(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Every row of a table with its optimizer state: ``(ids, float32 (rows, row_floats))``, in id order
        (:meth:`read_table` of the whole payload)."""
        payload = self.read_table(name, "payload")
        return np.arange(len(payload), dtype=np.int64), payload

    def read_dense_payload(self, name: str) -> np.ndarray:
        """A dense tensor's payload (weights then optimizer state) from its primary."""
        primary = self.layout.dense_servers(name)[0]
        reply = self._call(primary, "ReadPayload", embedding_pb2.ReadPayloadRequest(dense=[name]))
        return np.frombuffer(reply.dense[0].value, dtype="<f4").copy()

    def dense_spec(self, name: str) -> DenseSpec:
        for m in (self.map, self.refresh_map()):
            for d in m.dense:
                if d.name == name:
                    return DenseSpec.from_proto(d)
        raise KeyError(f"unknown dense tensor {name!r}")

    def write_dense(self, name: str, payload) -> None:
        """Replaces dense tensor ``name``'s whole payload (its weights then its optimizer state, float32, as
        :meth:`read_dense_payload` gives it): one push to its primary, replicated like a training push.
        Checked first (size, finite, Adagrad accumulators >= 0); a registered parameter of that name is
        reloaded."""
        spec = self.dense_spec(name)
        width = spec.numel * (1 + spec.state_width)
        values = np.asarray(payload)
        if values.dtype.kind not in "fiu" or values.size != width:
            raise ValueError(f"dense tensor {name!r}: a payload of {width} numbers ({spec.numel} weights and their "
                             f"optimizer state) is expected, got {values.dtype} {values.shape}")
        with np.errstate(over="ignore"):
            values = values.reshape(-1).astype(np.float32)
        self._check_dense_values(spec, values)
        request = embedding_pb2.PushRequest(push_id=self._next_push_id(), epoch=self.map.epoch,
                                            return_dense=name in self._dense)
        request.dense.add(name=name, value=transport.floats_to_bytes(values), assign=embedding_pb2.PAYLOAD)
        self._send_push({self.layout.dense_servers(name)[0]: request})

    def read_table(self, name: str, what: str = "weights", out: np.ndarray | None = None,
                   on_progress=None) -> np.ndarray:
        """Every row of table ``name`` as float32 ``(num_rows, width)`` in id order: its ``weights`` (``dim``
        wide), its optimizer ``state`` or its whole ``payload`` (weights then state).  Read from every server at
        once, a message of at most :data:`READ_PAYLOAD_BYTES` at a time, each written straight into ``out`` (or
        a new array): the client holds the result and one message per server.  ``on_progress(rows, total)``
        after each round."""
        spec = self.table_spec(name)
        columns = _columns(spec, what)
        width = columns.stop - columns.start
        if out is None:
            out = np.empty((spec.num_rows, width), dtype=np.float32)
        elif out.shape != (spec.num_rows, width) or out.dtype != np.float32:
            raise ValueError(f"table {name!r}: out must be float32 {(spec.num_rows, width)}, got {out.dtype} {out.shape}")
        per_message = max(1, min(READ_PAYLOAD_BYTES // spec.row_bytes, READ_PAYLOAD_IDS))
        owned = {i: self.layout.rows_of(i, spec.num_rows)[0] for i in range(self.layout.num_servers)}
        done = 0
        for start in range(0, max(len(v) for v in owned.values()), per_message):
            replies = self._fan_out("ReadPayload", {
                i: embedding_pb2.ReadPayloadRequest(table=name, ids=transport.ids_to_bytes(v[start:start + per_message]))
                for i, v in owned.items() if len(v) > start})
            for r in replies.values():
                ids = transport.bytes_to_ids(r.ids)
                out[ids] = np.frombuffer(r.payload, dtype="<f4").reshape(-1, spec.row_floats)[:, columns]
                done += len(ids)
            if on_progress is not None:
                on_progress(done, spec.num_rows)
        return out

    def read_rows(self, name: str, ids, what: str = "weights") -> np.ndarray:
        """Rows ``ids`` of table ``name`` (float32 ``(len(ids), width)``, in the order given): their ``weights``,
        optimizer ``state`` or whole ``payload``, read from their owners at once, a message of at most
        :data:`READ_PAYLOAD_BYTES` each."""
        spec, ids = self._check_ids(name, ids)
        columns = _columns(spec, what)
        out = np.empty((len(ids), columns.stop - columns.start), dtype=np.float32)
        per_message = max(1, min(READ_PAYLOAD_BYTES // spec.row_bytes, READ_PAYLOAD_IDS))
        groups = self._group_by_server(ids) if len(ids) else {}
        for start in range(0, max((len(pos) for pos in groups.values()), default=0), per_message):
            parts = {i: pos[start:start + per_message] for i, pos in groups.items() if len(pos) > start}
            replies = self._fan_out("ReadPayload", {
                i: embedding_pb2.ReadPayloadRequest(table=name, ids=transport.ids_to_bytes(ids[pos]))
                for i, pos in parts.items()})
            for i, reply in replies.items():
                out[parts[i]] = np.frombuffer(reply.payload, dtype="<f4").reshape(-1, spec.row_floats)[:, columns]
        return out

    def write_rows(self, name: str, ids, values, what: str = "weights", on_progress=None,
                   checked: bool = False) -> int:
        """Replaces rows ``ids`` of table ``name`` with ``values`` (float32 ``(len(ids), width)``): their
        ``weights`` (the optimizer state is kept), their optimizer ``state`` or their whole ``payload``
        (weights then state, as :meth:`read_table` gives it).  Not a gradient: a load, a warm start.

        Sent as pushes of at most ``WRITE_ROWS_BYTES`` (each applied exactly once and protected like a
        training push: parity, replicas, checkpoints); everything is checked before the first is sent (shape,
        ids in range and distinct, finite values), so bad input changes nothing.  ``values`` may be any array
        (a ``numpy.memmap`` of a file included: it is read a push at a time).  Returns the rows written."""
        spec, ids = self._check_ids(name, ids)
        columns = _columns(spec, what)
        width = columns.stop - columns.start
        values = _as_array(values)
        if not hasattr(values, "shape") or tuple(values.shape) != (len(ids), width):
            raise ValueError(f"table {name!r}: {what} of {len(ids)} rows must have shape {(len(ids), width)}, got "
                             f"{tuple(getattr(values, 'shape', ()))}")
        if len(ids) > 1 and not (ids[1:] > ids[:-1]).all() and len(np.unique(ids)) != len(ids):
            raise ValueError(f"table {name!r}: row ids repeat")
        chunk = max(1, min(WRITE_ROWS_BYTES // (4 * width), 65536))
        if not checked:  # ``checked``: the caller ran _check_values on these very values
            self._check_values(spec, values, what)  # checked whole before anything is sent
        kind = {"weights": embedding_pb2.WEIGHTS, "payload": embedding_pb2.PAYLOAD, "state": embedding_pb2.STATE}[what]
        for start in range(0, len(ids), chunk):
            part_ids = ids[start:start + chunk]
            part = np.ascontiguousarray(np.asarray(values[start:start + chunk]), dtype=np.float32)
            push_id = self._next_push_id()
            requests = {}
            for i, pos in self._group_by_server(part_ids).items():
                request = embedding_pb2.PushRequest(push_id=push_id, epoch=self.map.epoch)
                request.tables.add(table=name, ids=transport.ids_to_bytes(part_ids[pos]),
                                   grads=transport.floats_to_bytes(part[pos]), assign=kind)
                requests[i] = request
            self._send_push(requests)
            if on_progress is not None:
                on_progress(min(start + chunk, len(ids)), len(ids))
        return len(ids)

    def save(self, path: str, on_progress=None, overwrite: bool = False) -> dict:
        """A snapshot of every table (weights and optimizer state) and dense tensor, in
        ``torch.distributed.checkpoint`` format, to ``path`` (a directory or an fsspec URL every server can
        reach), written by every server at once; returns its manifest.  A path holding a snapshot is refused
        unless ``overwrite``.  Consistent when no push runs meanwhile (call it between steps).  See
        :mod:`ecrec.snapshot`."""
        from ecrec import snapshot

        return snapshot.save(self, path, on_progress, overwrite=overwrite)

    def load(self, path: str, on_progress=None) -> dict:
        """Restores a snapshot written by :meth:`save` onto this cluster, whatever its shape (servers, k and m,
        strategy): missing tables are created, every tensor is checked against the manifest before anything is
        written.  See :mod:`ecrec.snapshot`."""
        from ecrec import snapshot

        return snapshot.load(self, path, on_progress)

    def strategy_call(self, command: str, args: dict | None = None, indices: list[int] | None = None) -> dict[int, dict]:
        """Runs a strategy command on servers (all by default); returns each server's JSON result."""
        request = embedding_pb2.StrategyCallRequest(command=command, args_json=json.dumps(args or {}))
        indices = range(self.layout.num_servers) if indices is None else indices
        replies = self._fan_out("StrategyCall", {i: request for i in indices})
        return {i: json.loads(r.result_json) for i, r in replies.items()}

    # --- dense parameters ------------------------------------------------------------------------
    def register_dense(self, module: torch.nn.Module, optimizer: str = "sgd", lr: float = 0.01, eps: float = 1e-10,
                       initial_accumulator_value: float = 0.0, prefix: str = "") -> list[str]:
        """Moves ``module``'s parameters to the servers: the first worker's values win, every worker loads them.

        Afterwards ``step()`` pushes their gradients and loads the updated values.
        """
        names = []
        for pname, param in module.named_parameters():
            if not param.requires_grad:
                continue
            name = prefix + pname
            spec = DenseSpec(name=name, shape=tuple(param.shape), optimizer=optimizer, lr=float(lr), eps=float(eps),
                             initial_accumulator_value=float(initial_accumulator_value)).validate()
            self._register_dense(spec, param.detach().to(torch.float32).cpu().numpy(), "register_dense")
            self._dense[name] = param
            names.append(name)
        self.pull_dense(names)
        return names

    def create_dense(self, spec: DenseSpec, initial=None) -> None:
        """Creates a dense tensor from its spec alone (zeros, or ``initial``), without a module: a restore
        creates the tensors a snapshot holds this way.  A tensor of that name that exists is kept."""
        spec = spec.validate()
        value = np.zeros(spec.shape, dtype=np.float32) if initial is None else np.asarray(initial, dtype=np.float32)
        self._register_dense(spec, value, "create_dense")

    def _register_dense(self, spec: DenseSpec, value: np.ndarray, caller: str) -> None:
        """The coordinator's RegisterDense (the first value wins); the map it answers is adopted."""
        try:
            m = self._coordinator.RegisterDense(
                coordinator_pb2.RegisterDenseRequest(spec=spec.to_proto(), initial_value=transport.floats_to_bytes(value)),
                timeout=self.config.create_timeout_s)
        except grpc.RpcError as exc:
            raise ClusterError(f"{caller} {spec.name!r}: {exc.code().name}: {exc.details()}") from None
        self._adopt(m)

    def pull_dense(self, names: list[str] | None = None) -> None:
        """Loads the servers' current values into the registered parameters."""
        names = list(self._dense) if names is None else names
        by_primary: dict[int, list[str]] = {}
        for name in names:
            by_primary.setdefault(self.layout.dense_servers(name)[0], []).append(name)
        requests = {i: embedding_pb2.PullRequest(dense=n, epoch=self.map.epoch) for i, n in by_primary.items()}
        for i, request in requests.items():
            self.courier.attach(i, request)
        replies = self._fan_out("Pull", requests)
        for i, reply in replies.items():
            self.courier.received(i, reply)
            self._load_dense(reply.dense)

    def _load_dense(self, values) -> None:
        with torch.no_grad():
            for v in values:
                param = self._dense[v.name]
                param.copy_(torch.tensor(transport.bytes_to_floats(v.value, tuple(param.shape))))

    # --- training --------------------------------------------------------------------------------
    def _record(self, table: str, ids: np.ndarray, rows: torch.Tensor, lookups: np.ndarray | None = None) -> None:
        with self._lock:
            self._pending.append(_Pending(table, ids, rows, lookups))

    def zero_grad(self) -> None:
        """Drops recorded row gradients and dense gradients without pushing."""
        with self._lock:
            self._pending.clear()
        for p in self._dense.values():
            p.grad = None

    def step(self) -> dict:
        """Pushes every pending gradient (rows and dense) and returns when the servers applied them."""
        with self._lock:
            pending, self._pending = self._pending, []
            self._sequence += 1
            push_id = embedding_pb2.PushId(worker=self.worker, sequence=self._sequence, incarnation=self.incarnation)
        per_table: dict[str, tuple[list, list]] = {}
        lookups: dict[str, list] = {}
        for p in pending:
            if p.rows.grad is None:
                continue
            if p.lookups is not None:
                lookups.setdefault(p.table, []).append((p.ids, p.lookups))
            ids_list, grad_list = per_table.setdefault(p.table, ([], []))
            ids_list.append(p.ids)
            grad_list.append(p.rows.grad.detach().to(torch.float32).numpy())
        requests: dict[int, embedding_pb2.PushRequest] = {}

        def request_for(index: int) -> embedding_pb2.PushRequest:
            if index not in requests:
                requests[index] = embedding_pb2.PushRequest(push_id=push_id, epoch=self.map.epoch, return_dense=True)
            return requests[index]

        for table, (ids_list, grad_list) in per_table.items():
            ids = np.concatenate(ids_list)
            grads = np.concatenate(grad_list)
            for i, pos in self._group_by_server(ids).items():
                request_for(i).tables.add(table=table, ids=transport.ids_to_bytes(ids[pos]),
                                          grads=transport.floats_to_bytes(grads[pos]))
        dense_grads: dict[str, np.ndarray] = {}
        for name, param in self._dense.items():
            if param.grad is None:
                continue
            dense_grads[name] = param.grad.detach().to(torch.float32).numpy().reshape(-1)  # grad is dropped below
            request_for(self.layout.dense_servers(name)[0]).dense.add(
                name=name, value=transport.floats_to_bytes(dense_grads[name]))
            param.grad = None
        result = self._send_push(requests) if requests else {"servers": 0, "rows": 0, "rows_by_server": {},
                                                             "already_applied": 0}
        self.last_dense_grads = dense_grads  # what this (acknowledged) push applied to each dense tensor
        self.last_lookups = {t: _merge_lookups(parts) for t, parts in lookups.items()}
        self.steps_done += 1
        if self._periodic is not None:
            result["snapshot"] = self._periodic.after_step(self, self.steps_done)
        return result

    def snapshot_every(self, steps: int, directory: str, keep: int = 2, on_progress=None) -> None:
        """From now on every ``steps``-th :meth:`step` ends with a snapshot (:meth:`save`) to
        ``directory/step-<n>`` (a directory or fsspec URL), between steps so the cut is consistent for this
        worker; the newest ``keep`` complete snapshots are kept.  ``steps=0`` stops.  The way back after more
        failures than the code tolerates: :func:`ecrec.snapshot.latest` and :meth:`load`."""
        from ecrec.snapshot.cluster import Periodic

        self._periodic = Periodic(steps, str(directory), keep, on_progress) if steps else None

    def _send_push(self, requests: dict[int, embedding_pb2.PushRequest]) -> dict:
        """Sends one push (a request per server, one push id) as :meth:`step` does: what the courier carries
        rides along, each reply's relay and confirmations go back to it."""
        for i, request in requests.items():
            self.courier.attach(i, request)
        self._stats["push_bytes"] += sum(r.ByteSize() for r in requests.values())
        replies = self._fan_out("Push", requests)
        self._stats["pushes"] += 1
        for i, reply in replies.items():
            self.courier.pushed(i, requests[i], reply)
            self._load_dense(reply.dense)
        return {"servers": len(requests), "rows": sum(r.rows_updated for r in replies.values()),
                "rows_by_server": {i: r.rows_updated for i, r in replies.items()},
                "already_applied": sum(r.already_applied for r in replies.values())}

    def _next_push_id(self) -> embedding_pb2.PushId:
        with self._lock:
            self._sequence += 1
            return embedding_pb2.PushId(worker=self.worker, sequence=self._sequence, incarnation=self.incarnation)

    def wait_confirmed(self, timeout_s: float = 30.0) -> int:
        """Waits until every push this worker made is *confirmed* (its parity applied at every destination),
        so that its owner may fail later without the worker's help; returns how many are still unconfirmed
        after ``timeout_s``.  Confirmations ride on replies, so this pulls a few rows meanwhile."""
        deadline = time.monotonic() + timeout_s
        while self.courier.unconfirmed():
            if time.monotonic() > deadline or not self.map or not self.map.tables:
                break
            t = self.map.tables[0]
            self.pull(t.name, np.arange(min(t.num_rows, 8 * self.map.num_servers)))
            time.sleep(0.02)
        return self.courier.unconfirmed()

    def close(self, confirm_timeout_s: float = 10.0) -> None:
        """Waits (up to ``confirm_timeout_s``) for this worker's pushes to be confirmed, then closes the channels.
        A push still unconfirmed is logged: its owner failing before delivering its parity would lose it."""
        try:
            left = self.wait_confirmed(confirm_timeout_s) if confirm_timeout_s > 0 else self.courier.unconfirmed()
        except Exception as exc:  # noqa: BLE001 - reported; closing goes on
            left = self.courier.unconfirmed()
            log.warning("closing worker %s: could not wait for confirmations: %s", self.worker, exc)
        if left:
            log.warning("closing worker %s with %d unconfirmed pushes: an owner that fails before it delivers their "
                        "parity loses them", self.worker, left)
        self.peers.close()


class EmbeddingBag(torch.nn.Module):
    """``torch.nn.EmbeddingBag`` whose table lives on an ECRec cluster.

    Call it like ``torch.nn.EmbeddingBag`` (``indices`` 1-D with ``offsets``, or
    2-D fixed-length bags). The rows it touches are pulled from their servers;
    backward records their gradients, which ``cluster.step()`` pushes.
    """

    def __init__(self, cluster: Cluster, name: str, mode: str = "sum"):
        super().__init__()
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
        self.cluster = cluster
        self.name = name
        self.mode = mode
        self.spec = cluster.table_spec(name)

    @property
    def embedding_dim(self) -> int:
        return self.spec.dim

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return _lookup(self.cluster, [self.name], [(input, offsets)], self.mode, per_sample_weights)[0]

    def extra_repr(self) -> str:
        return f"{self.name!r}, {self.spec.num_rows}, {self.spec.dim}, mode={self.mode!r}"

    # --- state_dict: the table's weights, as torch.nn.EmbeddingBag keeps them ----------------------------
    def state_dict_keys(self, prefix: str = "") -> dict[str, str]:
        """The table's state-dict key (``weight``, as in ``torch.nn.EmbeddingBag``) -> the table."""
        return {prefix + "weight": self.name}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = torch.from_numpy(self.cluster.read_table(self.name))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        _load_tables(self, self.cluster, self.state_dict_keys(prefix), state_dict, prefix, local_metadata, strict,
                     missing_keys, unexpected_keys, error_msgs)


class EmbeddingBagCollection(torch.nn.Module):
    """Several cluster tables looked up together: one pull per server for all of them per call.

    Two shapes of input:

    - ``EmbeddingBagCollection(cluster, names, mode)`` over existing tables; ``forward([(indices, offsets),
      ...])`` returns one bag tensor per table, in order, exactly as the tables' :class:`EmbeddingBag`
      modules would, with a single fan-out instead of one per table.
    - TorchRec's: :meth:`from_configs` takes ``torchrec.EmbeddingBagConfig`` s (one cluster table per config,
      created here), and ``forward(KeyedJaggedTensor)`` returns a ``KeyedTensor``, as
      ``torchrec.EmbeddingBagCollection`` does, so it can stand where TorchRec's collection stood (in
      ``torchrec.models.dlrm.DLRM`` for one).  :meth:`lookup_jagged` is the same lookup on plain
      ``(keys, values, lengths)`` tensors, without TorchRec.
    """

    def __init__(self, cluster: Cluster, names: list[str], mode: str | list[str] = "sum"):
        super().__init__()
        modes = [mode] * len(names) if isinstance(mode, str) else list(mode)
        if len(modes) != len(names):
            raise ValueError(f"got {len(modes)} modes for {len(names)} tables")
        for m in modes:
            if m not in ("sum", "mean"):
                raise ValueError(f"mode must be 'sum' or 'mean', got {m!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be distinct, got {names}")
        self.cluster = cluster
        self.names = list(names)
        self.mode = mode
        self.modes = modes
        self.specs = [cluster.table_spec(n) for n in self.names]
        #: (feature name, table position) in output order; by default one feature per table, named like it
        self.features: list[tuple[str, int]] = [(n, i) for i, n in enumerate(self.names)]
        self._configs: list | None = None

    @classmethod
    def from_configs(cls, cluster: Cluster, tables, *, optimizer: str = "sgd", lr: float = 0.01, eps: float = 1e-10,
                     initial_accumulator_value: float = 0.0, seed: int = 0,
                     on_table=None) -> "EmbeddingBagCollection":
        """A collection shaped like ``torchrec.EmbeddingBagCollection(tables=tables)``: one cluster table per
        ``torchrec.EmbeddingBagConfig`` (``name``, ``num_embeddings``, ``embedding_dim``, ``pooling`` SUM or
        MEAN, ``feature_names``; created, or reused when it exists with the same spec), trained on the servers
        with ``optimizer``/``lr``.  Initial values are uniform in ``[weight_init_min, weight_init_max]`` (default
        ``±sqrt(1/num_embeddings)``, TorchRec's default range), drawn from ``seed``.  ``on_table(created,
        total)`` is called after each table is created (a progress bar).
        """
        tables = list(tables)
        if not tables:
            raise ValueError("need at least one EmbeddingBagConfig")
        seen_features: dict[str, str] = {}
        modes, scales = [], []
        for config in tables:
            name = getattr(config, "name", None)
            if not name or not isinstance(name, str):
                raise ValueError(f"an EmbeddingBagConfig needs a name, got {config!r}")
            pooling = getattr(getattr(config, "pooling", None), "name", str(getattr(config, "pooling", "SUM")))
            if pooling not in ("SUM", "MEAN"):
                raise ValueError(f"table {name!r}: pooling {pooling} is not supported (SUM or MEAN)")
            modes.append(pooling.lower())
            data_type = getattr(getattr(config, "data_type", None), "name", "FP32")
            if data_type != "FP32":
                raise ValueError(f"table {name!r}: data_type {data_type} is not supported (FP32 only)")
            features = list(getattr(config, "feature_names", []) or [])
            if not features:
                raise ValueError(f"table {name!r}: feature_names is empty")
            for feature in features:
                if feature in seen_features:
                    raise ValueError(f"feature {feature!r} is in tables {seen_features[feature]!r} and {name!r}")
                seen_features[feature] = name
            low, high = getattr(config, "weight_init_min", None), getattr(config, "weight_init_max", None)
            if low is None and high is None:
                scale = 0.0  # the cluster default: 1/sqrt(num_rows), TorchRec's default range
            elif low is not None and high is not None and high > 0 and abs(low + high) <= 1e-12 * high:
                scale = float(high)
            else:
                raise ValueError(f"table {name!r}: weight_init_min/max must be unset or symmetric (-a, a), "
                                 f"got ({low}, {high})")
            scales.append(scale)
        for n, (config, scale) in enumerate(zip(tables, scales)):  # every config checked before anything is created
            cluster.create_table(config.name, config.num_embeddings, config.embedding_dim, optimizer=optimizer, lr=lr,
                                 eps=eps, initial_accumulator_value=initial_accumulator_value, init="uniform",
                                 init_scale=scale, seed=seed)
            if on_table is not None:
                on_table(n + 1, len(tables))
        collection = cls(cluster, [c.name for c in tables], modes)
        collection._configs = tables
        collection.features = [(f, i) for i, c in enumerate(tables) for f in c.feature_names]
        return collection

    # --- what TorchRec's models ask of a collection -------------------------------------------------------
    def embedding_bag_configs(self) -> list:
        """The ``torchrec.EmbeddingBagConfig`` s this collection was built from (:meth:`from_configs`)."""
        if self._configs is None:
            raise AttributeError("embedding_bag_configs(): this collection was built from table names; "
                                 "use EmbeddingBagCollection.from_configs for TorchRec's shape")
        return list(self._configs)

    def is_weighted(self) -> bool:
        return False

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    # --- lookups ------------------------------------------------------------------------------------------
    def forward(self, inputs):
        """``[(indices, offsets), ...]`` (one per table) -> list of bag tensors; or a ``KeyedJaggedTensor`` ->
        ``KeyedTensor`` (one ``(B, dim)`` block per feature, in this collection's feature order)."""
        if _is_keyed_jagged(inputs):
            if inputs.weights_or_none() is not None:
                raise ValueError("weighted features (per-sample weights) are not supported")
            from torchrec.sparse.jagged_tensor import KeyedTensor

            pooled = self.lookup_jagged(inputs.keys(), inputs.values(), inputs.lengths())
            keys = [feature for feature, _ in self.features]
            return KeyedTensor(keys=keys, length_per_key=[self.specs[t].dim for _, t in self.features],
                               values=torch.cat([pooled[k] for k in keys], dim=1))
        if len(inputs) != len(self.names):
            raise ValueError(f"got {len(inputs)} inputs for {len(self.names)} tables")
        return _lookup(self.cluster, self.names, inputs, self.modes)

    def lookup_jagged(self, keys, values, lengths) -> dict[str, torch.Tensor]:
        """TorchRec's jagged layout without TorchRec: ``values`` holds, feature after feature (in ``keys``
        order), the ids of ``B`` bags, bag ``b`` of feature ``f`` having ``lengths[f * B + b]`` ids.  Returns
        ``{feature: (B, dim)}`` pooled bags, every table in one pull per server."""
        keys = list(keys)
        values = torch.as_tensor(values).reshape(-1)
        lengths = torch.as_tensor(lengths).reshape(-1).to(torch.int64)
        table_of = {feature: t for feature, t in self.features}
        unknown = [k for k in keys if k not in table_of]
        if unknown:
            raise ValueError(f"unknown features {unknown}; this collection has {list(table_of)}")
        missing = [f for f in table_of if f not in keys]
        if missing:
            raise ValueError(f"features {missing} are missing from the input")
        if len(set(keys)) != len(keys):
            raise ValueError(f"features appear twice in the input: {keys}")
        if lengths.numel() % len(keys):
            raise ValueError(f"{lengths.numel()} lengths do not split into {len(keys)} features of equal batch size")
        if bool((lengths < 0).any()):
            raise ValueError("lengths must be >= 0")
        if int(lengths.sum()) != values.numel():
            raise ValueError(f"lengths add up to {int(lengths.sum())}, but there are {values.numel()} values")
        if values.numel() and (values.is_floating_point() or values.is_complex()):
            raise TypeError(f"ids must be integers, got {values.dtype}")
        batch = lengths.numel() // len(keys)
        per_feature = lengths.view(len(keys), batch)
        ends = torch.cumsum(per_feature.sum(dim=1), 0).tolist()
        starts = [0, *ends[:-1]]
        # the features of one table are looked up together: ids concatenated, bags one after another
        parts: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
        for f, key in enumerate(keys):
            offsets = torch.cumsum(per_feature[f], 0) - per_feature[f]
            parts.setdefault(table_of[key], []).append((key, values[starts[f]:ends[f]], offsets))
        tables = sorted(parts)
        inputs = []
        for t in tables:
            base, all_values, all_offsets = 0, [], []
            for _, feature_values, offsets in parts[t]:
                all_values.append(feature_values)
                all_offsets.append(offsets + base)
                base += feature_values.numel()
            inputs.append((torch.cat(all_values).to(torch.int64), torch.cat(all_offsets)))
        pooled = _lookup(self.cluster, [self.names[t] for t in tables], inputs, [self.modes[t] for t in tables])
        out = {}
        for t, bags in zip(tables, pooled):
            for n, (key, _, _) in enumerate(parts[t]):
                out[key] = bags[n * batch:(n + 1) * batch]
        return out

    def extra_repr(self) -> str:
        return f"{len(self.names)} tables, mode={self.mode!r}"

    # --- state_dict: TorchRec's keys, embedding_bags.<table>.weight ------------------------------------
    def state_dict_keys(self, prefix: str = "") -> dict[str, str]:
        """The state-dict key of each table (``embedding_bags.<table>.weight``, as in
        ``torchrec.EmbeddingBagCollection``) -> the table."""
        return {f"{prefix}embedding_bags.{name}.weight": name for name in self.names}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, name in self.state_dict_keys(prefix).items():
            destination[key] = torch.from_numpy(self.cluster.read_table(name))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        _load_tables(self, self.cluster, self.state_dict_keys(prefix), state_dict, prefix, local_metadata, strict,
                     missing_keys, unexpected_keys, error_msgs)


def _load_tables(module: torch.nn.Module, cluster: Cluster, keys: dict[str, str], state_dict, prefix: str,
                 local_metadata, strict: bool, missing_keys, unexpected_keys, error_msgs) -> None:
    """``Module._load_from_state_dict`` for cluster modules: the module's load pre-hooks run first, as
    ``torch.nn.Module``'s do; each of ``keys`` (state-dict key -> table) found in ``state_dict`` is checked (a
    tensor or array of the table's ``(num_rows, dim)``, finite as float32); only when every one of the module's
    tables checked are they written to the tables' weights (:meth:`Cluster.write_rows`, in pushes; the optimizer
    state is kept).  A key missing, a key under ``prefix`` that is not a table's, or a mismatch is reported as
    ``torch.nn.Module`` reports it (``load_state_dict`` raises with every message)."""
    for hook in module._load_state_dict_pre_hooks.values():
        hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    checked, errors = [], []
    for key, table in keys.items():
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            continue
        spec = cluster.table_spec(table)
        shape = (spec.num_rows, spec.dim)
        value = _as_array(state_dict[key])
        if not isinstance(value, np.ndarray):
            errors.append(f'While copying the parameter named "{key}" (cluster table {table!r}), expected a '
                          f"tensor or array, got {type(state_dict[key]).__name__}.")
            continue
        if tuple(value.shape) != shape:
            errors.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                          f"checkpoint, the shape in current model (cluster table {table!r}) is {shape}.")
            continue
        try:
            Cluster._check_values(spec, value)
        except ValueError as exc:
            errors.append(f'While copying the parameter named "{key}" (cluster table {table!r}): {exc}')
            continue
        checked.append((key, table, spec, value))
    if errors:  # nothing of this module is written
        error_msgs.extend(errors)
    else:
        for key, table, spec, value in checked:
            try:
                cluster.write_rows(table, np.arange(spec.num_rows), value, checked=True)
            except (ValueError, ClusterError) as exc:
                error_msgs.append(f'While copying the parameter named "{key}" (cluster table {table!r}): {exc}')
    if strict:  # these modules hold nothing else: any other key under their prefix is not theirs
        unexpected_keys.extend(key for key in state_dict if key.startswith(prefix) and key not in keys)


def _as_array(value):
    """A tensor as a numpy array (floating tensors as float32: bfloat16 and half have no numpy form), an
    array as it is; anything else unchanged (the caller refuses it)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.to(torch.float32) if value.is_floating_point() else value).numpy()
    return value


def _is_keyed_jagged(x) -> bool:
    """A ``torchrec.KeyedJaggedTensor`` (duck-typed: TorchRec is imported only when one is passed)."""
    return all(callable(getattr(x, name, None)) for name in ("keys", "values", "lengths", "weights_or_none"))


def _merge_lookups(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One table's ``(ids, lookups)`` of a step from those of its bags: unique ids, their lookups summed."""
    if len(parts) == 1:
        return parts[0]
    ids, inverse = np.unique(np.concatenate([i for i, _ in parts]), return_inverse=True)
    return ids, np.bincount(inverse, weights=np.concatenate([n for _, n in parts]), minlength=len(ids)).astype(np.int64)


def _lookup(cluster: Cluster, names: list[str], inputs, mode: str | list[str],
            per_sample_weights=None) -> list[torch.Tensor]:
    """Bags of several tables (``mode``: one for all, or one per table) from one pull per server; with autograd
    on, records the rows' gradients."""
    modes = [mode] * len(names) if isinstance(mode, str) else mode
    uniques = [torch.unique(indices, return_inverse=True) for indices, _ in inputs]
    rows = cluster.pull_many({name: unique for name, (unique, _) in zip(names, uniques)})
    outputs = []
    for name, (unique, inverse), (_, offsets), table_mode in zip(names, uniques, inputs, modes):
        r = rows[name]
        if torch.is_grad_enabled():
            r.requires_grad_(True)
            lookups = (torch.bincount(inverse.reshape(-1), minlength=len(unique)).numpy()
                       if cluster.count_lookups else None)
            cluster._record(name, unique.numpy().astype(np.int64), r, lookups)
        outputs.append(torch.nn.functional.embedding_bag(inverse, r, offsets, mode=table_mode,
                                                         per_sample_weights=per_sample_weights))
    return outputs
