"""Checks of what callers send a server, before anything changes: push ids and id counts within their bounds, a
push's assignments (a restore's or a warm start's values) and coalesced gradients, a dense tensor's spec, a map
that could be this cluster's.  Each refusal is an ``InvalidRequest`` naming the problem."""

from __future__ import annotations

import dataclasses

import numpy as np

from ecrec import errors
from ecrec.config import ServerConfig
from ecrec.net import transport
from ecrec.tables import optim
from ecrec.tables.spec import DenseSpec, TableSpec
from ecrec.wire import cluster_pb2, embedding_pb2

def validate_map(new_map: cluster_pb2.ClusterMap, current: cluster_pb2.ClusterMap | None) -> None:
    """Raises ``InvalidRequest`` naming the problem when ``new_map`` cannot be a map of this cluster: a shape
    that differs from ``current`` (servers, k, m, strategy and its options are fixed at the cluster's start),
    or server entries with impossible indices or two live holders of one index."""
    if new_map.epoch < 0 or new_map.num_servers <= 0:
        raise errors.InvalidRequest(f"cluster map epoch {new_map.epoch} with {new_map.num_servers} servers is invalid")
    if new_map.k < 0 or new_map.m < 0 or new_map.k + new_map.m > new_map.num_servers:
        raise errors.InvalidRequest(f"cluster map k={new_map.k} m={new_map.m} does not fit {new_map.num_servers} "
                                    "servers")
    holders: dict[int, str] = {}
    for s in new_map.servers:
        if s.index < -1 or s.index >= new_map.num_servers:
            raise errors.InvalidRequest(f"cluster map names index {s.index} of {new_map.num_servers} servers")
        if s.index >= 0 and s.state != cluster_pb2.FAILED:
            if s.index in holders and holders[s.index] != s.server_id:
                raise errors.InvalidRequest(f"cluster map names two live holders of index {s.index}")
            holders[s.index] = s.server_id
    if current is None:
        return
    for field in ("num_servers", "k", "m", "strategy"):
        if getattr(new_map, field) != getattr(current, field):
            raise errors.InvalidRequest(f"cluster map changes {field} from {getattr(current, field)!r} to "
                                        f"{getattr(new_map, field)!r}; a cluster's shape is fixed at its start")
    if dict(new_map.strategy_options) != dict(current.strategy_options):
        raise errors.InvalidRequest("cluster map changes the strategy's options; they are fixed at the cluster's "
                                    "start")


def parse_dense_spec(p: cluster_pb2.DenseSpec, value: bytes) -> tuple[DenseSpec, np.ndarray]:
    try:
        spec = DenseSpec.from_proto(p).validate()
    except ValueError as exc:
        raise errors.InvalidRequest(str(exc)) from None
    initial = transport.bytes_to_floats(value, spec.shape)
    if not np.isfinite(initial).all():
        raise errors.InvalidRequest(f"dense tensor {spec.name!r}: initial value has NaN or Inf")
    return spec, initial


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Values that replace ``columns`` of a push's rows (``TableGrads.assign``), in place of gradients."""
    values: np.ndarray  # float32 (rows, width)
    columns: slice


def assignment(spec: TableSpec, t, ids: np.ndarray, slots: np.ndarray):
    """An assignment's ``(ids, slots, Assignment)``, sorted by id; refused (``InvalidRequest``, naming the
    table) when an id repeats, the bytes do not fit the width or a value is not finite."""
    kind = t.assign
    if kind == embedding_pb2.WEIGHTS:
        columns, what = slice(0, spec.dim), "weights"
    elif kind == embedding_pb2.PAYLOAD:
        columns, what = slice(0, spec.row_floats), "payload (weights and optimizer state)"
    elif kind == embedding_pb2.STATE:
        if spec.state_width == 0:
            raise errors.InvalidRequest(f"table {spec.name!r}: optimizer {spec.optimizer!r} keeps no state to assign")
        columns, what = slice(spec.dim, spec.row_floats), "optimizer state"
    else:
        raise errors.InvalidRequest(f"table {spec.name!r}: unknown assignment {kind}")
    width = columns.stop - columns.start
    if len(t.grads) != 4 * width * len(ids):
        raise errors.InvalidRequest(f"table {spec.name!r}: assigning the {what} of {len(ids)} rows needs "
                                    f"{4 * width * len(ids)} bytes ({width} floats a row), got {len(t.grads)}")
    order = np.argsort(ids, kind="stable")
    ids, slots = ids[order], slots[order]
    if len(ids) > 1 and (ids[1:] == ids[:-1]).any():
        raise errors.InvalidRequest(f"table {spec.name!r}: row {int(ids[1:][ids[1:] == ids[:-1]][0])} is assigned "
                                    "twice in one push")
    values = transport.bytes_to_floats(t.grads, (len(order), width))[order]
    if not np.isfinite(values).all():
        raise errors.InvalidRequest(f"table {spec.name!r}: an assigned value is NaN or Inf")
    state_from = {embedding_pb2.STATE: 0, embedding_pb2.PAYLOAD: spec.dim}.get(kind)
    if spec.optimizer == "adagrad" and state_from is not None and (values[:, state_from:] < 0).any():
        raise errors.InvalidRequest(f"table {spec.name!r}: an Adagrad accumulator is negative")
    return ids, slots, Assignment(values, columns)


def dense_assignment(spec: DenseSpec, g) -> Assignment:
    """A dense tensor's whole payload (weights then optimizer state) that replaces its own
    (``DenseValue.assign`` = PAYLOAD: a restore); refused naming the tensor when it does not fit."""
    if g.assign != embedding_pb2.PAYLOAD:
        raise errors.InvalidRequest(f"dense tensor {spec.name!r}: only its whole payload can be assigned")
    width = spec.numel * (1 + spec.state_width)
    if len(g.value) != 4 * width:
        raise errors.InvalidRequest(f"dense tensor {spec.name!r}: assigning its payload needs {4 * width} bytes "
                                    f"({spec.numel} weights and their optimizer state), got {len(g.value)}")
    values = transport.bytes_to_floats(g.value)
    if not np.isfinite(values).all():
        raise errors.InvalidRequest(f"dense tensor {spec.name!r}: an assigned value is NaN or Inf")
    if spec.optimizer == "adagrad" and (values[spec.numel:] < 0).any():
        raise errors.InvalidRequest(f"dense tensor {spec.name!r}: an Adagrad accumulator is negative")
    return Assignment(values, slice(0, width))


def coalesce(ids: np.ndarray, slots: np.ndarray, grads: np.ndarray):
    """Sums the gradients of duplicate ids (like ``torch.sparse`` coalesce); returns sorted unique rows."""
    if len(ids) < 2 or bool((ids[1:] > ids[:-1]).all()):  # the SDK sends sorted unique ids
        return ids, slots, grads
    uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    if len(uniq) == len(ids):
        order = np.argsort(ids, kind="stable")
        return ids[order], slots[order], grads[order]
    return uniq, slots[first], optim.sum_by_inverse(len(uniq), inverse, grads)  # as the SDK sums them


def caller_of(context, worker: str = "") -> str:
    """Who sent a request, for a log line: the worker's name (a push's) and its address."""
    peer = context.peer() if context is not None else ""
    return f"worker {worker[:64]!r} ({peer})" if worker else f"the worker at {peer}"


def utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_push_id(push_id, config: ServerConfig) -> None:
    """Raises ``InvalidRequest`` naming the bound when a push id's worker name or incarnation is missing or too
    long (``--max-worker-name-bytes``, ``--max-incarnation-bytes``): every server keeps them (a mark per
    incarnation, the push ids in parity logs), so their size is bounded before anything changes."""
    if not push_id.worker:
        raise errors.InvalidRequest("push_id.worker is required (it makes retries safe)")
    name = utf8_bytes(push_id.worker) if len(push_id.worker) <= config.max_worker_name_bytes else -1
    if name < 0 or name > config.max_worker_name_bytes:
        raise errors.InvalidRequest(f"push_id.worker is longer than {config.max_worker_name_bytes} bytes "
                                    "(--max-worker-name-bytes); push refused")
    problem = transport.worker_name_problem(push_id.worker)
    if problem:
        raise errors.InvalidRequest(f"push_id.worker {push_id.worker!r} {problem}; push refused")
    if len(push_id.incarnation) > config.max_incarnation_bytes or (
            utf8_bytes(push_id.incarnation) > config.max_incarnation_bytes):
        raise errors.InvalidRequest(f"push_id.incarnation is longer than {config.max_incarnation_bytes} bytes "
                                    "(--max-incarnation-bytes); push refused")


def check_ids(sections, config: ServerConfig, reply_row_bytes=None) -> None:
    """Raises ``InvalidRequest`` naming the bound when the ids of ``sections`` (messages with an ``ids`` field of
    int64) number more than ``--max-ids-per-request`` together, repeats included, or when the reply they ask
    for (``reply_row_bytes(section)`` bytes per id) would not fit in one message: checked before anything is
    read or allocated."""
    sections = list(sections)
    count = sum(len(section.ids) // 8 for section in sections)
    if count > config.max_ids_per_request:
        raise errors.InvalidRequest(f"{count} row ids in one request (repeats included); the bound is "
                                    f"{config.max_ids_per_request} (--max-ids-per-request): split the request "
                                    "(the SDK keeps its requests within ClientConfig.max_ids_per_request: set it "
                                    "to at most this)")
    if reply_row_bytes is not None:
        nbytes = sum(len(section.ids) // 8 * reply_row_bytes(section) for section in sections)
        if nbytes > config.max_message_bytes:
            raise errors.InvalidRequest(f"the reply would hold {nbytes} bytes of rows, more than one message "
                                        f"({config.max_message_bytes} bytes, --max-message-bytes): split the request")
