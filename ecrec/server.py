"""The embedding server: holds this server's shard of every table and its dense tensors.

One process per server.  It registers with the coordinator, receives the
cluster map (its index, the layout, the tables), and answers pulls and pushes
for the rows the layout gives it.  A push is validated whole before anything
changes, coalesced (duplicate ids summed), applied under the table's lock with a
``torch.optim`` compatible optimizer, handed to the active fault-tolerance
strategy with the old and new payload bytes, and acknowledged once the
strategy's completion (if any) is done.  Each push id is applied at most once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ecrec import faults, optim, transport
from ecrec.config import ServerConfig
from ecrec.layout import Layout
from ecrec.strategies import FaultToleranceStrategy, get_strategy
from ecrec.tables import DenseSpec, TableSpec, initial_payload
from ecrec.transport import RequestError, invalid
from ecrec.wire import cluster_pb2, coordinator_pb2, coordinator_pb2_grpc, embedding_pb2, embedding_pb2_grpc

log = logging.getLogger("ecrec.server")


class TableShard:
    """This server's rows of one table: a ``(slots, row_bytes)`` uint8 payload array."""

    def __init__(self, spec: TableSpec, layout: Layout, index: int, initial_values: bool = True):
        self.spec = spec
        self.layout = layout
        self.index = index
        self.lock = threading.Lock()
        self.owned_ids, self.owned_slots = layout.rows_of(index, spec.num_rows)
        self.payload = np.zeros((layout.data_slots_per_server(spec.num_rows), spec.row_bytes), dtype=np.uint8)
        self.floats = self.payload.view(np.float32)  # (slots, row_floats)
        if initial_values:  # a replacement whose strategy rebuilds every row skips this
            self.floats[self.owned_slots] = initial_payload(spec, self.owned_ids)
        self.versions = np.zeros(len(self.payload), dtype=np.int64)  # push sequence of each row's last update
        self.row_updates = 0  # distinct rows updated, summed over pushes

    def slots_for(self, ids: np.ndarray) -> np.ndarray:
        """Validates that ``ids`` are in range and owned here; returns their slots."""
        if ids.size == 0:
            raise invalid(f"table {self.spec.name!r}: no row ids")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.spec.num_rows:
            bad = lo if lo < 0 else hi
            raise invalid(f"table {self.spec.name!r}: row id {bad} out of range [0, {self.spec.num_rows})")
        servers, slots = self.layout.locate(ids)
        wrong = servers != self.index
        if wrong.any():
            i = int(np.argmax(wrong))
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"table {self.spec.name!r}: row {int(ids[i])} is owned by server {int(servers[i])}, "
                f"not by server {self.index}; refresh the cluster map",
            )
        return slots


class DenseShard:
    """One dense tensor held here: its payload is a single row ``[weights | optimizer state]``."""

    def __init__(self, spec: DenseSpec, initial_value: np.ndarray):
        self.spec = spec
        self.lock = threading.Lock()
        self.floats = np.zeros((1, spec.numel * (1 + spec.state_width)), dtype=np.float32)
        self.floats[0, : spec.numel] = initial_value.reshape(-1)
        self.floats[0, spec.numel :] = np.float32(spec.initial_accumulator_value)
        self.version = 0

    @property
    def weights(self) -> np.ndarray:
        return self.floats[0, : self.spec.numel]


class AppliedPushes:
    """Push ids applied on this server (bounded), each with what its acknowledgement waits for.

    A retry of an applied push is answered "already applied" once that completion is done,
    so a push is applied exactly once even when its first reply was lost.
    """

    def __init__(self, capacity: int = 1 << 20):
        self.capacity = capacity
        self._ids: OrderedDict[tuple[str, int], object] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]):
        """``(known, completion)``."""
        with self._lock:
            if key in self._ids:
                return True, self._ids[key]
            return False, None

    def add(self, key: tuple[str, int], completion=None) -> None:
        with self._lock:
            self._ids[key] = completion
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)


class ServerState:
    """Everything one embedding server holds; what a strategy sees of its server."""

    def __init__(self, config: ServerConfig, server_id: str):
        self.config = config
        self.server_id = server_id
        self.address = ""
        self.index = -1
        self.promoting = False  # True while Promote creates this server's tables (their rows get rebuilt)
        self.map: cluster_pb2.ClusterMap | None = None
        self.layout: Layout | None = None
        self.tables: dict[str, TableShard] = {}
        self.dense: dict[str, DenseShard] = {}
        self.strategy: FaultToleranceStrategy | None = None
        self.applied = AppliedPushes()
        self.apply_lock = threading.Lock()  # pushes apply one at a time (the strategy sees a total order)
        self.faults = faults.from_environment()
        self.lock = threading.RLock()  # guards map/index/tables dicts (not row data)
        self.index_set = threading.Condition(self.lock)
        self._peers: dict[str, embedding_pb2_grpc.EmbeddingServerStub] = {}

    @property
    def epoch(self) -> int:
        return self.map.epoch if self.map is not None else 0

    @functools.cached_property
    def coordinator(self) -> coordinator_pb2_grpc.CoordinatorStub:
        """A stub for the coordinator (one channel for the life of the server)."""
        return coordinator_pb2_grpc.CoordinatorStub(transport.make_channel(self.config.coordinator))

    def peer_by_address(self, address: str) -> embedding_pb2_grpc.EmbeddingServerStub:
        """A (cached) stub for another server."""
        with self.lock:
            stub = self._peers.get(address)
            if stub is None:
                stub = embedding_pb2_grpc.EmbeddingServerStub(
                    transport.make_channel(address, self.config.max_message_bytes)
                )
                self._peers[address] = stub
            return stub

    def table(self, name: str) -> TableShard:
        shard = self.tables.get(name)
        if shard is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"unknown table {name!r}")
        return shard

    def dense_tensor(self, name: str) -> DenseShard:
        dense = self.dense.get(name)
        if dense is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"unknown dense tensor {name!r} on server {self.index}")
        return dense

    def require_index(self) -> None:
        if self.index < 0 or self.layout is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "this server holds no index yet (standby)")

    # --- map changes -----------------------------------------------------------------------------
    def adopt_map(self, new_map: cluster_pb2.ClusterMap) -> None:
        with self.lock:
            if self.map is not None and new_map.epoch < self.map.epoch:
                return
            self.map = new_map
            self.layout = Layout(new_map.num_servers, new_map.k, new_map.m)
            if self.strategy is None:
                cls = get_strategy(new_map.strategy)
                self.strategy = cls(self, dict(new_map.strategy_options))
            if self.index < 0 and not self.promoting:  # the map may tell this server its index first
                mine = [s.index for s in new_map.servers if s.server_id == self.server_id and s.index >= 0
                        and s.state == cluster_pb2.ACTIVE]
                if mine and not new_map.tables:
                    self.index = mine[0]
            self.index_set.notify_all()

    def wait_for_index(self, timeout_s: float = 10.0) -> None:
        """Waits (a registration may be in flight) until this server holds an index and a strategy."""
        with self.lock:
            self.index_set.wait_for(lambda: self.index >= 0 and self.strategy is not None, timeout=timeout_s)
            self.require_index()

    def create_table(self, spec: TableSpec) -> bool:
        """Creates the shard of ``spec``; False when an identical table already exists."""
        self.wait_for_index()
        with self.lock:
            existing = self.tables.get(spec.name)
            if existing is not None:
                if existing.spec != spec:
                    raise RequestError(
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"table {spec.name!r} exists with a different spec ({existing.spec}); got {spec}",
                    )
                return False
            fill = not (self.promoting and self.strategy.rebuilds_rows)
            shard = TableShard(spec, self.layout, self.index, initial_values=fill)
            self.tables[spec.name] = shard
        self.strategy.on_table_created(shard)
        return True

    def create_dense(self, spec: DenseSpec, initial: np.ndarray) -> bool:
        self.wait_for_index()
        if self.index not in self.layout.dense_servers(spec.name):
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"dense tensor {spec.name!r} belongs to servers {self.layout.dense_servers(spec.name)}, not {self.index}",
            )
        with self.lock:
            existing = self.dense.get(spec.name)
            if existing is not None:
                if existing.spec != spec:
                    raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"dense tensor {spec.name!r} exists with a different spec")
                return False
            dense = DenseShard(spec, initial)
            self.dense[spec.name] = dense
        self.strategy.on_dense_created(dense)
        return True


def _parse_dense_spec(p: cluster_pb2.DenseSpec, value: bytes) -> tuple[DenseSpec, np.ndarray]:
    try:
        spec = DenseSpec.from_proto(p).validate()
        initial = transport.bytes_to_floats(value, spec.shape)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    if not np.isfinite(initial).all():
        raise invalid(f"dense tensor {spec.name!r}: initial value has NaN or Inf")
    return spec, initial


def _handle(fn):
    """Turns RequestError / ValueError into a gRPC status with the message; logs anything else."""

    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except RequestError as exc:
            context.abort(exc.code, exc.message)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except grpc.RpcError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported, never swallowed
            log.exception("%s failed", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__}: {type(exc).__name__}: {exc}")

    wrapper.__name__ = fn.__name__
    return wrapper


class EmbeddingServicer(embedding_pb2_grpc.EmbeddingServerServicer):
    """The gRPC face of a :class:`ServerState`."""

    def __init__(self, state: ServerState):
        self.state = state

    # --- data plane ------------------------------------------------------------------------------
    @_handle
    def Pull(self, request, context):
        st = self.state
        st.require_index()
        if not request.tables and not request.dense:
            raise invalid("empty pull: name at least one table or dense tensor")
        plans = []
        for t in request.tables:
            shard = st.table(t.table)
            ids = transport.bytes_to_ids(t.ids)
            plans.append((shard, shard.slots_for(ids)))
        dense = [st.dense_tensor(name) for name in request.dense]
        strategy = st.strategy
        strategy.ensure_rows(plans)
        for d in dense:
            strategy.ensure_dense(d)
        reply = embedding_pb2.PullReply()
        for shard, slots in plans:
            with shard.lock:
                rows = shard.floats[slots, : shard.spec.dim]
            reply.values.append(rows.tobytes())
        for d in dense:
            with d.lock:
                value = d.weights.tobytes()
            reply.dense.add(name=d.spec.name, value=value)
        return reply

    @_handle
    def Push(self, request, context):
        st = self.state
        st.require_index()
        if not request.tables and not request.dense:
            raise invalid("empty push: no table rows and no dense gradients")
        if not request.push_id.worker:
            raise invalid("push_id.worker is required (it makes retries safe)")
        # 1. validate everything before changing anything
        table_plans = []
        seen_tables = set()
        for t in request.tables:
            if t.table in seen_tables:
                raise invalid(f"table {t.table!r} appears twice in one push")
            seen_tables.add(t.table)
            shard = st.table(t.table)
            ids = transport.bytes_to_ids(t.ids)
            slots = shard.slots_for(ids)
            dim = shard.spec.dim
            if len(t.grads) != 4 * dim * len(ids):
                raise invalid(
                    f"table {t.table!r}: {len(ids)} ids of dim {dim} need {4 * dim * len(ids)} gradient bytes, "
                    f"got {len(t.grads)}"
                )
            grads = transport.bytes_to_floats(t.grads, (len(ids), dim))
            if not np.isfinite(grads).all():
                raise invalid(f"table {t.table!r}: gradient has NaN or Inf")
            ids, slots, grads = _coalesce(ids, slots, grads)
            table_plans.append((shard, ids, slots, grads))
        dense_plans = []
        seen_dense = set()
        for g in request.dense:
            if g.name in seen_dense:
                raise invalid(f"dense tensor {g.name!r} appears twice in one push")
            seen_dense.add(g.name)
            d = st.dense_tensor(g.name)
            if st.layout.dense_servers(g.name)[0] != st.index:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"server {st.index} is not the primary of {g.name!r}")
            if len(g.value) != 4 * d.spec.numel:
                raise invalid(f"dense tensor {g.name!r}: expected {4 * d.spec.numel} gradient bytes, got {len(g.value)}")
            grad = transport.bytes_to_floats(g.value)
            if not np.isfinite(grad).all():
                raise invalid(f"dense tensor {g.name!r}: gradient has NaN or Inf")
            dense_plans.append((d, grad))

        key = (request.push_id.worker, request.push_id.sequence)
        known, completion = st.applied.get(key)
        if known:  # a retry: answer once the first attempt is acknowledged everywhere
            if completion is not None:
                completion.result(timeout=st.config.rpc_timeout_s)
            return self._push_reply(request, already_applied=True, rows=0)
        strategy = st.strategy
        strategy.ensure_rows([(shard, slots) for shard, _, slots, _ in table_plans])
        for d, _ in dense_plans:
            strategy.ensure_dense(d)
        st.faults.hit("before_local_commit")
        # 2. apply, one push at a time; the strategy sees old and new bytes of every row
        need_old = strategy.needs_old_payload
        rows_updated = 0
        with st.apply_lock:
            known, completion = st.applied.get(key)  # a concurrent retry may have won
            if not known:
                strategy.begin_push(key)
                for shard, ids, slots, grads in table_plans:
                    spec = shard.spec
                    with shard.lock:
                        rows = shard.floats[slots]  # a copy: fancy indexing
                        old = rows.view(np.uint8).copy() if need_old else None
                        optim.apply(spec.optimizer, rows, grads, spec.dim, spec.lr, spec.eps)
                        shard.floats[slots] = rows
                        shard.row_updates += len(slots)
                        strategy.on_update(shard, ids, slots, old, rows.view(np.uint8))
                    rows_updated += len(slots)
                for d, grad in dense_plans:
                    spec = d.spec
                    with d.lock:
                        old = d.floats.view(np.uint8).copy() if need_old else None
                        optim.apply(spec.optimizer, d.floats, grad[None, :], spec.numel, spec.lr, spec.eps)
                        strategy.on_dense_update(d, old, d.floats.view(np.uint8))
                completion = strategy.end_push()
                st.applied.add(key, completion)
        # 3. acknowledged only when the strategy's work (parity acks...) is done
        if completion is not None:
            completion.result(timeout=st.config.rpc_timeout_s)
        st.faults.hit("after_parity_before_ack")
        return self._push_reply(request, already_applied=known, rows=rows_updated)

    def _push_reply(self, request, already_applied: bool, rows: int):
        reply = embedding_pb2.PushReply(already_applied=already_applied, rows_updated=rows)
        if request.return_dense:
            for g in request.dense:
                d = self.state.dense[g.name]
                with d.lock:
                    reply.dense.add(name=g.name, value=d.weights.tobytes())
        return reply

    @_handle
    def ReadPayload(self, request, context):
        st = self.state
        st.require_index()
        reply = embedding_pb2.ReadPayloadReply()
        if request.table:
            shard = st.table(request.table)
            if request.all_rows:
                order = np.argsort(shard.owned_ids, kind="stable")
                ids, slots = shard.owned_ids[order], shard.owned_slots[order]
            else:
                ids = transport.bytes_to_ids(request.ids)
                slots = shard.slots_for(ids)
            st.strategy.ensure_rows([(shard, slots)])
            with shard.lock:
                payload = shard.payload[slots]
            reply.ids = transport.ids_to_bytes(ids)
            reply.payload = payload.tobytes()
            reply.row_bytes = shard.spec.row_bytes
        for name in request.dense:
            d = st.dense_tensor(name)
            st.strategy.ensure_dense(d)
            with d.lock:
                reply.dense.add(name=name, value=d.floats.tobytes())
        return reply

    @_handle
    def StrategyCall(self, request, context):
        st = self.state
        if st.strategy is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "no cluster map yet")
        try:
            args = json.loads(request.args_json) if request.args_json else {}
        except json.JSONDecodeError as exc:
            raise invalid(f"args_json is not JSON: {exc}") from None
        if not isinstance(args, dict):
            raise invalid("args_json must be a JSON object")
        result = st.strategy.call(request.command, args)
        return embedding_pb2.StrategyCallReply(result_json=json.dumps(result))

    def _strategy_rpc(self, method, request, context):
        strategy = self.state.strategy
        if strategy is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "no cluster map yet")
        try:
            return strategy.handle_rpc(method, request, context)
        except NotImplementedError as exc:
            raise RequestError(grpc.StatusCode.UNIMPLEMENTED, str(exc)) from None

    @_handle
    def ApplyParity(self, request, context):
        return self._strategy_rpc("ApplyParity", request, context)

    @_handle
    def ResolveSource(self, request, context):
        return self._strategy_rpc("ResolveSource", request, context)

    @_handle
    def ReadRows(self, request, context):
        return self._strategy_rpc("ReadRows", request, context)

    @_handle
    def Echo(self, request, context):
        if request.reply_bytes > 0:
            if request.reply_bytes > self.state.config.max_message_bytes:
                raise invalid(f"reply_bytes {request.reply_bytes} exceeds the message limit")
            return embedding_pb2.EchoMessage(data=bytes(request.reply_bytes))
        return request

    # --- control plane ---------------------------------------------------------------------------
    @_handle
    def CreateTable(self, request, context):
        try:
            spec = TableSpec.from_proto(request).validate()
        except ValueError as exc:
            raise invalid(str(exc)) from None
        self.state.create_table(spec)
        return embedding_pb2.Ack(epoch=self.state.epoch)

    @_handle
    def CreateDense(self, request, context):
        spec, initial = _parse_dense_spec(request.spec, request.initial_value)
        self.state.create_dense(spec, initial)
        return embedding_pb2.Ack(epoch=self.state.epoch)

    @_handle
    def UpdateClusterMap(self, request, context):
        self.state.adopt_map(request)
        return embedding_pb2.Ack(epoch=self.state.epoch)

    @_handle
    def Promote(self, request, context):
        st = self.state
        with st.lock:
            if st.index >= 0 and st.index != request.index:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"this server already holds index {st.index}")
            st.adopt_map(request.map)
            st.index = request.index
            st.promoting = True
        log.info("promoted to index %d (epoch %d): creating %d tables", request.index, request.map.epoch, len(request.map.tables))
        for t in request.map.tables:
            st.create_table(TableSpec.from_proto(t))
        for d in request.dense:
            spec, initial = _parse_dense_spec(d.spec, d.initial_value)
            st.create_dense(spec, initial)
        try:
            recovering = bool(st.strategy.on_recovery(request.index))
        finally:
            st.promoting = False
        return embedding_pb2.Ack(epoch=st.epoch, recovering=recovering)


def _coalesce(ids: np.ndarray, slots: np.ndarray, grads: np.ndarray):
    """Sums the gradients of duplicate ids (like ``torch.sparse`` coalesce); returns sorted unique rows."""
    if len(ids) < 2 or bool((ids[1:] > ids[:-1]).all()):  # the SDK sends sorted unique ids
        return ids, slots, grads
    uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    if len(uniq) == len(ids):
        order = np.argsort(ids, kind="stable")
        return ids[order], slots[order], grads[order]
    summed = np.zeros((len(uniq), grads.shape[1]), dtype=np.float32)
    np.add.at(summed, inverse.reshape(-1), grads)
    return uniq, slots[first], summed


class EmbeddingServer:
    """Runs one embedding server: gRPC service, health, registration, strategy timer."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.state = ServerState(config, server_id=f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}")
        self._grpc = transport.make_server(config.max_workers, config.max_message_bytes)
        embedding_pb2_grpc.add_EmbeddingServerServicer_to_server(EmbeddingServicer(self.state), self._grpc)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        self.port = transport.bind(self._grpc, config.host, config.port)
        self.state.address = f"{config.host}:{self.port}"
        self._stop = threading.Event()
        self._timer_thread: threading.Thread | None = None

    def start(self, register_timeout_s: float = 60.0) -> None:
        self._grpc.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._register(register_timeout_s)
        self._timer_thread = threading.Thread(target=self._timer_loop, name="ecrec-strategy-timer", daemon=True)
        self._timer_thread.start()

    def _register(self, timeout_s: float) -> None:
        stub = self.state.coordinator
        deadline = time.monotonic() + timeout_s
        request = coordinator_pb2.RegisterRequest(
            address=self.state.address, standby=self.config.standby, server_id=self.state.server_id,
            want_index=self.config.want_index,
        )
        while True:
            try:
                reply = stub.Register(request, timeout=self.config.rpc_timeout_s)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise RuntimeError(f"cannot register with coordinator {self.config.coordinator}: {exc.details()}") from None
                time.sleep(0.2)
        with self.state.lock:
            if reply.index >= 0 and self.state.index < 0:
                self.state.index = reply.index
            self.state.adopt_map(reply.map)  # ignored when a broadcast brought a newer map first
        log.info("registered at %s as %s (epoch %d)", self.state.address,
                 f"index {reply.index}" if reply.index >= 0 else "standby", reply.map.epoch)

    def _timer_loop(self) -> None:
        while not self._stop.is_set():
            strategy = self.state.strategy
            interval = getattr(strategy, "timer_interval_s", None) if strategy else None
            if self._stop.wait(interval or 0.5):
                return
            if interval and self.state.index >= 0:
                try:
                    strategy.on_timer()
                except Exception:  # noqa: BLE001 - reported, never swallowed
                    log.exception("strategy %s: on_timer failed", strategy.name)

    def wait(self) -> None:
        self._grpc.wait_for_termination()

    def stop(self, grace_s: float = 2.0) -> None:
        self._stop.set()
        self._health.enter_graceful_shutdown()
        if self.state.strategy is not None:
            try:
                self.state.strategy.close()
            except Exception:  # noqa: BLE001
                log.exception("strategy close failed")
        self._grpc.stop(grace_s).wait()

