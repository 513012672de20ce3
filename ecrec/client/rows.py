"""Rows and dense payloads in bulk: whole tables read from every server at once, rows read or replaced by id,
a dense tensor's payload (:class:`RowIO`, behind ``Cluster.read_table``, ``read_rows``, ``write_rows``,
``read_dense_payload``, ``write_dense``), and the checks every written value passes first (finite, Adagrad
accumulators not negative).  A write is not a gradient: rows travel as *assignment* pushes, applied exactly once
and protected like training pushes (parity, replicas and checkpoints follow them)."""

from __future__ import annotations

import numpy as np
import torch

from ecrec.client.steps import StepPartlyApplied
from ecrec.net import transport
from ecrec.tables.values import check_dense_values, check_values, columns_of
from ecrec.wire import embedding_pb2

#: the largest reply of one ``ReadPayload`` call of :meth:`RowIO.read_table` (tables of any size are read in
#: pieces; the default message limit is 256 MiB)
READ_PAYLOAD_BYTES = 64 << 20
#: and at most this many ids (a server refuses more than ``--max-ids-per-request``, 1 << 22 by default)
READ_PAYLOAD_IDS = 1 << 20
#: the most bytes of values one push of :meth:`RowIO.write_rows` carries (all servers together)
WRITE_ROWS_BYTES = 16 << 20
def as_array(value):
    """A tensor as a numpy array (floating tensors as float32: bfloat16 and half have no numpy form), an
    array as it is; anything else unchanged (the caller refuses it)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.to(torch.float32) if value.is_floating_point() else value).numpy()
    return value


def list_as_array(values, what: str):
    """Nested lists (or tuples) of numbers as a float32 array; anything else unchanged.  Text, bools and numbers
    past float64 are refused, naming ``what``."""
    if not isinstance(values, (list, tuple)):
        return values
    try:
        array = np.asarray(values)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"{what} given as a list must be rows of numbers of one length: {exc}") from None
    if array.dtype.kind not in "iuf":
        raise ValueError(f"{what} given as a list must be rows of numbers of one length, got {array.dtype} values")
    return array.astype(np.float32)


class RowIO:
    """Bulk reads and writes of one :class:`~ecrec.client.cluster.Cluster`'s rows and dense payloads (its calls,
    its push ids, its map)."""

    def __init__(self, cluster):
        self._cluster = cluster

    def read_payload(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Every row of a table with its optimizer state: ``(ids, float32 (rows, row_floats))``, in id order
        (:meth:`read_table` of the whole payload)."""
        payload = self.read_table(name, "payload")
        return np.arange(len(payload), dtype=np.int64), payload

    def read_dense_payload(self, name: str) -> np.ndarray:
        """A dense tensor's payload (weights then optimizer state) from its primary."""
        primary = self._cluster.layout.dense_servers(name)[0]
        reply = self._cluster._call(primary, "ReadPayload", embedding_pb2.ReadPayloadRequest(dense=[name]))
        return np.frombuffer(reply.dense[0].value, dtype="<f4").copy()

    def write_dense(self, name: str, payload) -> None:
        """Replaces dense tensor ``name``'s whole payload (its weights then its optimizer state, float32, as
        :meth:`read_dense_payload` gives it): one push to its primary, replicated like a training push.
        Checked first (size, finite, Adagrad accumulators >= 0); a registered parameter of that name is
        reloaded."""
        spec = self._cluster.dense_spec(name)
        width = spec.numel * (1 + spec.state_width)
        values = np.asarray(payload)
        if values.dtype.kind not in "fiu" or values.size != width:
            raise ValueError(f"dense tensor {name!r}: a payload of {width} numbers ({spec.numel} weights and their "
                             f"optimizer state) is expected, got {values.dtype} {values.shape}")
        with np.errstate(over="ignore"):
            values = values.reshape(-1).astype(np.float32)
        check_dense_values(spec, values)
        request = embedding_pb2.PushRequest(push_id=self._cluster._next_push_id(), epoch=self._cluster.map.epoch,
                                            return_dense=name in self._cluster._dense)
        request.dense.add(name=name, value=transport.floats_to_bytes(values), assign=embedding_pb2.PAYLOAD)
        self._cluster._send_push({self._cluster.layout.dense_servers(name)[0]: request})
        self._cluster.dense_assigned += 1

    def read_table(self, name: str, what: str = "weights", out: np.ndarray | None = None,
                   on_progress=None) -> np.ndarray:
        """Every row of table ``name`` as float32 ``(num_rows, width)`` in id order: its ``weights`` (``dim``
        wide), its optimizer ``state`` or its whole ``payload`` (weights then state).  Read from every server at
        once, a message of at most :data:`READ_PAYLOAD_BYTES` at a time, each written straight into ``out`` (or
        a new array): the client holds the result and one message per server.  ``on_progress(rows, total)``
        after each round."""
        spec = self._cluster.table_spec(name)
        columns = columns_of(spec, what)
        width = columns.stop - columns.start
        if out is None:
            out = np.empty((spec.num_rows, width), dtype=np.float32)
        elif out.shape != (spec.num_rows, width) or out.dtype != np.float32:
            raise ValueError(f"table {name!r}: out must be float32 {(spec.num_rows, width)}, got {out.dtype} {out.shape}")
        per_message = self._rows_per_message(spec)
        owned = {i: self._cluster.layout.rows_of(i, spec.num_rows)[0] for i in range(self._cluster.layout.num_servers)}
        done = 0
        for start in range(0, max(len(v) for v in owned.values()), per_message):
            replies = self._cluster._fan_out("ReadPayload", {
                i: embedding_pb2.ReadPayloadRequest(table=name, ids=transport.ids_to_bytes(v[start:start + per_message]))
                for i, v in owned.items() if len(v) > start})
            for r in replies.values():
                ids = transport.bytes_to_ids(r.ids)
                out[ids] = np.frombuffer(r.payload, dtype="<f4").reshape(-1, spec.row_floats)[:, columns]
                done += len(ids)
            if on_progress is not None:
                on_progress(done, spec.num_rows)
        return out

    def _rows_per_message(self, spec) -> int:
        """Rows one ReadPayload reply carries: at most :data:`READ_PAYLOAD_BYTES`, and half this client's
        ``max_message_bytes`` (a client with a smaller limit could not read a table at all)."""
        budget = min(READ_PAYLOAD_BYTES, self._cluster.config.max_message_bytes // 2)
        return max(1, min(budget // (spec.row_bytes + 8), READ_PAYLOAD_IDS,
                          self._cluster.config.max_ids_per_request))

    def read_rows(self, name: str, ids, what: str = "weights") -> np.ndarray:
        """Rows ``ids`` of table ``name`` (float32 ``(len(ids), width)``, in the order given): their ``weights``,
        optimizer ``state`` or whole ``payload``, read from their owners at once, a message of at most
        :data:`READ_PAYLOAD_BYTES` each."""
        spec, ids = self._cluster._check_ids(name, ids)
        columns = columns_of(spec, what)
        out = np.empty((len(ids), columns.stop - columns.start), dtype=np.float32)
        per_message = self._rows_per_message(spec)
        groups = self._cluster._group_by_server(ids) if len(ids) else {}
        for start in range(0, max((len(pos) for pos in groups.values()), default=0), per_message):
            parts = {i: pos[start:start + per_message] for i, pos in groups.items() if len(pos) > start}
            replies = self._cluster._fan_out("ReadPayload", {
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
        spec, ids = self._cluster._check_ids(name, ids)
        columns = columns_of(spec, what)
        width = columns.stop - columns.start
        values = list_as_array(as_array(values), f"table {name!r}: {what}")
        if len(ids) == 0 and getattr(values, "size", None) == 0:  # nothing to write ([] has no second axis)
            return 0
        if not hasattr(values, "shape") or tuple(values.shape) != (len(ids), width):
            raise ValueError(f"table {name!r}: {what} of {len(ids)} rows must have shape {(len(ids), width)}, got "
                             f"{tuple(getattr(values, 'shape', ()))}")
        if len(ids) > 1 and not (ids[1:] > ids[:-1]).all() and len(np.unique(ids)) != len(ids):
            raise ValueError(f"table {name!r}: row ids repeat")
        chunk = max(1, min(min(WRITE_ROWS_BYTES, self._cluster.config.max_message_bytes // 2) // (4 * width + 8),
                           65536, self._cluster.config.max_ids_per_request))
        if not checked:  # ``checked``: the caller ran check_values on these very values
            check_values(spec, values, what)  # checked whole before anything is sent
        kind = {"weights": embedding_pb2.WEIGHTS, "payload": embedding_pb2.PAYLOAD, "state": embedding_pb2.STATE}[what]
        for start in range(0, len(ids), chunk):
            part_ids = ids[start:start + chunk]
            part = np.ascontiguousarray(np.asarray(values[start:start + chunk]), dtype=np.float32)
            push_id = self._cluster._next_push_id()
            requests = {}
            for i, pos in self._cluster._group_by_server(part_ids).items():
                request = embedding_pb2.PushRequest(push_id=push_id, epoch=self._cluster.map.epoch)
                request.tables.add(table=name, ids=transport.ids_to_bytes(part_ids[pos]),
                                   grads=transport.floats_to_bytes(part[pos]), assign=kind)
                requests[i] = request
            try:
                self._cluster.rows_assigned += self._cluster._send_push(requests)["rows"]
            except StepPartlyApplied as exc:  # what some servers applied stays applied: counted all the same
                self._cluster.rows_assigned += sum(exc.applied.values())
                raise
            if on_progress is not None:
                on_progress(min(start + chunk, len(ids)), len(ids))
        return len(ids)
