"""The gRPC face of a server (:class:`EmbeddingServicer`): the data plane (pull, push, replay, reads, snapshot
parts, strategy calls) and the control plane's calls (tables, dense tensors, maps, promotion).

A push is validated whole before anything changes, coalesced (duplicate ids summed), applied with a
``torch.optim`` compatible optimizer (``ecrec.tables.shards``), handed once to the active fault-tolerance
strategy with the old and new payload bytes (``on_push``), and acknowledged once the strategy's completion (if
any) is done.  Each push id is applied at most once.
"""

from __future__ import annotations

import json

import numpy as np

from ecrec import errors
from ecrec.net import security, transport
from ecrec.server.counters import threads_cpu_s
from ecrec.server.requests import (
    Assignment, assignment, caller_of, check_ids, check_push_id, coalesce, dense_assignment, parse_dense_spec,
)
from ecrec.server.state import ServerState, restoring
from ecrec.snapshot import bulk as snapshot_bulk
from ecrec.snapshot import part as snapshot_part
from ecrec.strategies.base import AppliedPush, DenseUpdate, TableUpdate, push_key
from ecrec.tables.spec import TableSpec
from ecrec.wire import embedding_pb2, embedding_pb2_grpc

#: the largest reply an ``Echo`` (a network measurement: ``ecrec-bench server``) may ask for
ECHO_MAX_REPLY_BYTES = 32 << 20


class EmbeddingServicer(embedding_pb2_grpc.EmbeddingServerServicer):
    """The gRPC face of a :class:`ServerState`."""

    def __init__(self, state: ServerState):
        self.state = state

    # --- data plane ------------------------------------------------------------------------------------------
    @transport.service_method
    def Pull(self, request, context):
        with self.state.handlers.measure("Pull"):
            return self._pull(request, context)

    def _pull(self, request, context):
        st = self.state
        st.require_index()
        st.require_serving(request.epoch)
        if not request.tables and not request.dense:
            raise errors.InvalidRequest("empty pull: name at least one table or dense tensor")
        check_ids(request.tables, st.config, lambda t: 4 * st.table(t.table).spec.dim)
        watermarks = st.strategy.on_relay(request.relay, caller_of(context)) if request.relay else []
        plans = []
        for t in request.tables:
            shard = st.serving_table(t.table)
            plans.append((shard, shard.slots_for(transport.bytes_to_ids(t.ids))))
        fills = [(shard, shard.fills) for shard, _ in plans]  # a restore in bulk that begins now is seen below
        dense = [st.dense(name) for name in request.dense]
        strategy = st.strategy
        strategy.ensure_rows(plans)
        for d in dense:
            strategy.ensure_dense(d)
        reply = embedding_pb2.PullReply(watermarks=watermarks, server_id=st.server_id,
                                        confirmed_upto=strategy.confirmed_upto())
        for shard, slots in plans:
            reply.values.append(shard.weights(slots).tobytes())
        st.still_serving(fills)  # no restore began while the rows were read
        st.handlers.count_rows("pulled", sum(len(slots) for _, slots in plans))
        for d in dense:
            reply.dense.add(name=d.spec.name, value=d.weights_bytes())
        st.require_serving(request.epoch)  # fenced again right before the reply: a pause since the check above
        return reply

    def _validate_push(self, request):
        """Checks the whole push before anything changes; returns the coalesced table and dense plans."""
        st = self.state
        table_plans = []
        seen_tables = set()
        for t in request.tables:
            if t.table in seen_tables:
                raise errors.InvalidRequest(f"table {t.table!r} appears twice in one push")
            seen_tables.add(t.table)
            shard = st.serving_table(t.table)
            ids = transport.bytes_to_ids(t.ids)
            slots = shard.slots_for(ids)
            if t.assign != embedding_pb2.GRADIENT:
                table_plans.append((shard, *assignment(shard.spec, t, ids, slots)))
                continue
            dim = shard.spec.dim
            if len(t.grads) != 4 * dim * len(ids):
                raise errors.InvalidRequest(
                    f"table {t.table!r}: {len(ids)} ids of dim {dim} need {4 * dim * len(ids)} gradient bytes, "
                    f"got {len(t.grads)}")
            grads = transport.bytes_to_floats(t.grads, (len(ids), dim))
            if not np.isfinite(grads).all():
                raise errors.InvalidRequest(f"table {t.table!r}: gradient has NaN or Inf")
            table_plans.append((shard, *coalesce(ids, slots, grads)))
        dense_plans = []
        seen_dense = set()
        for g in request.dense:
            if g.name in seen_dense:
                raise errors.InvalidRequest(f"dense tensor {g.name!r} appears twice in one push")
            seen_dense.add(g.name)
            d = st.dense(g.name)
            if st.layout.dense_servers(g.name)[0] != st.index:
                raise errors.FailedPrecondition(f"server {st.index} is not the primary of {g.name!r}")
            if g.assign != embedding_pb2.GRADIENT:
                dense_plans.append((d, dense_assignment(d.spec, g)))
                continue
            if len(g.value) != 4 * d.spec.numel:
                raise errors.InvalidRequest(
                    f"dense tensor {g.name!r}: expected {4 * d.spec.numel} gradient bytes, got {len(g.value)}")
            grad = transport.bytes_to_floats(g.value)
            if not np.isfinite(grad).all():
                raise errors.InvalidRequest(f"dense tensor {g.name!r}: gradient has NaN or Inf")
            dense_plans.append((d, grad))
        return table_plans, dense_plans

    @transport.service_method
    def Push(self, request, context):
        with self.state.handlers.measure("Push"):
            identity = security.caller_identity(context)
            try:
                plans = self._validate(request)
                watermarks = self._receive_relayed(request, context)
                return self._apply(request, plans, watermarks, identity=identity)
            except errors.EcrecError as exc:
                self._note_refused(request, identity, exc)
                raise

    def _note_refused(self, request, identity: str, exc: errors.EcrecError) -> None:
        """A push of a step (``parts`` said) refused here for good -- its content, a bound --, not for this
        server's state: a snapshot's cut then counts its part here as ended (``ecrec.snapshot.cut``)."""
        layout = self.state.layout
        if (layout is not None and 0 < request.parts <= layout.num_servers and request.push_id.worker
                and not isinstance(exc, (errors.Unavailable, errors.DeadlineExceeded, errors.Busy))):
            self.state.applied.refused(push_key(request.push_id, identity), request.parts)

    @transport.service_method
    def Replay(self, request, context):
        """A worker's unconfirmed pushes, in order: validated whole, the rows they touch rebuilt once (a
        replacement rebuilds on demand), then each applied exactly once as :meth:`Push` would."""
        with self.state.handlers.measure("Replay"):
            if not request.pushes:
                raise errors.InvalidRequest("empty replay")
            check_ids([t for push in request.pushes for t in push.tables], self.state.config)
            plans = [self._validate(push) for push in request.pushes]
            strategy = self.state.strategy
            identity = security.caller_identity(context)
            needed: dict[str, tuple] = {}
            for table_plans, _ in plans:
                for shard, _, slots, _ in table_plans:
                    shard_slots = needed.setdefault(shard.spec.name, (shard, []))[1]
                    shard_slots.append(slots)
            strategy.ensure_rows([(shard, np.unique(np.concatenate(parts))) for shard, parts in needed.values()])
            reply = embedding_pb2.ReplayReply()
            for push, push_plans in zip(request.pushes, plans):
                reply.replies.append(self._apply(push, push_plans, [], replayed=True, identity=identity))
            self.state.require_serving()
            return reply

    def _validate(self, request):
        st = self.state
        st.require_index()
        st.require_serving(request.epoch)
        if not request.tables and not request.dense:
            raise errors.InvalidRequest("empty push: no table rows and no dense gradients")
        check_push_id(request.push_id, st.config)
        if request.parts > st.layout.num_servers:
            raise errors.InvalidRequest(f"push parts {request.parts}: a push goes to at most the cluster's "
                                        f"{st.layout.num_servers} servers")
        check_ids(request.tables, st.config)
        return self._validate_push(request)

    def _receive_relayed(self, request, context) -> list:
        """What the worker carries from other servers (sealed batches for this server, sealed watermarks of its
        own batches): handed to the strategy, which refuses whatever a server did not seal."""
        strategy = self.state.strategy
        if not request.relay and not request.acks:
            return []
        worker = caller_of(context, request.push_id.worker)
        watermarks = strategy.on_relay(request.relay, worker) if request.relay else []
        if request.acks:
            strategy.on_acks(request.acks, worker)
        return watermarks

    def _apply(self, request, plans, watermarks, replayed: bool = False, identity: str = ""):
        """Applies one validated push once (a known push id is answered "already applied"); ``identity`` is
        what the caller proved (:func:`ecrec.net.security.caller_identity`), part of the push's key."""
        st = self.state
        table_plans, dense_plans = plans
        strategy = st.strategy
        for d, _ in dense_plans:  # rebuilt before anything reads them, the reply of a retry included
            strategy.ensure_dense(d)
        key = push_key(request.push_id, identity)
        seq = st.applied.get(key)
        if seq is not None:  # a retry (or a replay) of a push applied here or kept by recovery
            if replayed or request.replay:  # a replay's passage, whether or not its push was still to apply
                st.faults.hit("during_replay")
            return self._push_reply(request, True, 0, strategy.on_retry(key, seq), watermarks)
        strategy.ensure_rows([(shard, slots) for shard, _, slots, _ in table_plans])
        strategy.admit_push()  # waits (or refuses) while too many pushes wait for their redundancy
        st.faults.hit("before_local_commit")
        # apply, one push at a time; the strategy sees the old and new bytes of everything it changed
        keep_old, want_delta = strategy.needs_old_payload, strategy.needs_delta
        rows_updated = 0
        with st.apply_lock:
            if st.hold.holder:  # a snapshot looks for its cut: wait unless admitted (the lock released meanwhile)
                st.hold.wait_locked(key)
                st.require_serving()
            seq = st.applied.get(key)  # a concurrent retry may have won
            if seq is not None:
                return self._push_reply(request, True, 0, strategy.on_retry(key, seq), watermarks)
            for shard, *_ in table_plans:  # a restore in bulk began since the push was checked: no delta now
                if shard.restore is not None:
                    raise errors.Busy(restoring(shard))
            st.applied.admit(key[0])  # a new incarnation beyond the table's bound is refused, nothing applied
            # every part computed and checked before anything is written: an update whose result would not be
            # finite is refused whole (InvalidRequest), here as on the parts of other tables
            keep = keep_old or want_delta
            prepared_tables = [(shard, ids, shard.prepare_assignment(slots, g.values, g.columns, keep)
                                if isinstance(g, Assignment) else shard.prepare_gradients(slots, g, keep, want_delta))
                               for shard, ids, slots, g in table_plans]
            prepared_dense = [(d, d.prepare_assignment(g.values, keep) if isinstance(g, Assignment)
                               else d.prepare_gradient(g, keep)) for d, g in dense_plans]
            push = AppliedPush(key, st.sequencer.next(st.epoch))
            for shard, ids, prepared in prepared_tables:
                slots = prepared.slots
                old, new, old_versions = shard.commit(prepared, push.seq, want_delta)
                push.tables.append(TableUpdate(shard, ids, slots, None, new, old_versions, delta=old) if want_delta
                                   else TableUpdate(shard, ids, slots, old, new, old_versions))
                rows_updated += len(slots)
                push.nbytes += new.nbytes
            for d, prepared in prepared_dense:
                old, new, old_version = d.commit(prepared, push.seq, want_delta)
                push.dense.append(DenseUpdate(d, None, new, old_version, delta=old) if want_delta
                                  else DenseUpdate(d, old, new, old_version))
                push.nbytes += new.nbytes
            outcome = strategy.on_push(push)
            st.applied.add(key, push.seq, parts=request.parts)
            if outcome is not None and outcome.confirmed_upto:
                st.applied.confirmed(outcome.confirmed_upto)
        st.handlers.count_rows("pushed", rows_updated)
        if replayed or request.replay:
            st.faults.hit("during_replay")
        # acknowledged once the strategy's completion (if any) is done
        if outcome is not None and outcome.completion is not None:
            outcome.completion.result(timeout=st.config.rpc_timeout_s)
        st.faults.hit("after_parity_before_ack")
        st.require_serving()  # no acknowledgement from a server whose lease ran out meanwhile
        return self._push_reply(request, False, rows_updated, outcome, watermarks)

    def _push_reply(self, request, already_applied: bool, rows: int, outcome, watermarks):
        reply = embedding_pb2.PushReply(already_applied=already_applied, rows_updated=rows,
                                        server_id=self.state.server_id, watermarks=watermarks)
        if outcome is not None:
            for r in outcome.relay:  # sealed batches for the worker to carry (one copy, into the reply)
                reply.relay.add(destination=r.destination, destination_id=r.destination_id, batch=r.batch, mac=r.mac)
            reply.seq = outcome.seq
            reply.confirmed_upto = outcome.confirmed_upto
        if request.return_dense:
            for g in request.dense:
                reply.dense.add(name=g.name, value=self.state.dense(g.name).weights_bytes())
        return reply

    @transport.service_method
    def HoldPushes(self, request, context):
        """A snapshot's cut here (``ecrec.server.cut``): takes or extends its hold on pushes, admits the pushes that
        complete half-applied steps, marks the cut and ends the hold, drops a cut, or ends a hold; answers each
        worker's last push applied here, read while no push is halfway applied."""
        st = self.state
        st.require_index()
        st.require_serving()
        holder = request.holder
        if not holder or len(holder) > 128:
            raise errors.InvalidRequest("HoldPushes: holder must be 1 to 128 characters (a snapshot's random id)")
        for name, value, top in (("hold_s", request.hold_s, 86400.0), ("cut_ttl_s", request.cut_ttl_s, 1e9),
                                 ("max_age_s", request.max_age_s, 86400.0)):
            if not 0 <= value <= top:
                raise errors.InvalidRequest(f"HoldPushes: {name} must be in [0, {top:g}] seconds, not {value}")
        if len(request.admit) > st.config.max_relay_batches:
            raise errors.InvalidRequest(f"HoldPushes: {len(request.admit)} pushes to admit; at most "
                                        f"{st.config.max_relay_batches} (--max-relay-batches)")
        if request.mark_cut and not request.cut_ttl_s:
            raise errors.InvalidRequest("HoldPushes: mark_cut needs cut_ttl_s (how long the snapshot may take)")
        with st.apply_lock:
            if request.drop_cut:
                st.cuts.drop(holder)
                held = False
            elif request.mark_cut:
                held = st.hold.holds_for(holder)
                if not held:
                    raise errors.FailedPrecondition("HoldPushes: this snapshot's hold on pushes expired (or was never "
                                                    "taken) before its cut: take the cut again")
                st.cuts.mark(holder, st.sequencer.floor(st.epoch), request.cut_ttl_s, st.tables(), st.dense_tensors())
                st.hold.release(holder)
            elif request.hold_s > 0:
                st.hold.take(holder, request.hold_s)
                if request.admit:
                    st.hold.admit(holder, {m.worker: m.sequence for m in request.admit})
                held = True
            else:
                held = st.hold.holds_for(holder)
                st.hold.release(holder)
            marks = st.applied.marks(request.max_age_s or None)
        reply = embedding_pb2.HoldPushesReply(held_throughout=held, server_id=st.server_id)
        for worker, sequence, parts, age_s, refused in marks:
            reply.marks.add(worker=worker, sequence=sequence, parts=parts, age_s=age_s, refused=refused)
        return reply

    @transport.service_method
    def ReadPayload(self, request, context):
        st = self.state
        st.require_index()
        st.require_serving()
        reply = embedding_pb2.ReadPayloadReply()
        # a peer's snapshot read whose rows go over a connection to it: checked before anything is read
        deliver_to = snapshot_part.check_delivery(st, context, request) if request.deliver_port or request.ticket \
            else None
        if request.table:
            shard = st.serving_table(request.table)
            fills = shard.fills  # a restore in bulk that begins now is seen below
            if request.all_rows:
                nbytes = len(shard.owned_ids) * (shard.spec.row_bytes + 8)
                if nbytes > st.config.max_message_bytes:  # checked before anything is read or allocated
                    raise errors.InvalidRequest(
                        f"all_rows of table {request.table!r}: the reply would hold {nbytes} bytes, more than one "
                        f"message ({st.config.max_message_bytes} bytes, --max-message-bytes): read by ids instead")
                order = np.argsort(shard.owned_ids, kind="stable")
                ids, slots = shard.owned_ids[order], shard.owned_slots[order]
            else:
                check_ids([request], st.config, lambda _: shard.spec.row_bytes)
                ids = transport.bytes_to_ids(request.ids)
                slots = shard.slots_for(ids)
            st.strategy.ensure_rows([(shard, slots)])
            reply.ids = transport.ids_to_bytes(ids)
            reply.row_bytes = shard.spec.row_bytes
            if deliver_to is not None:  # the rows over a connection to the caller, not in the reply
                snapshot_part.deliver(st, deliver_to, request, shard, slots)
                st.still_serving([(shard, fills)])
                st.require_serving()
                return reply
            if request.cut:  # a snapshot's read: the rows as they were at its cut
                reply.payload = shard.read_payload_bytes_at(slots, st.cuts.get(request.cut, "table", shard.name))
            else:
                reply.payload = shard.read_payload_bytes(slots)
            st.still_serving([(shard, fills)])  # no restore began while the rows were read
        for name in request.dense:
            d = st.dense(name)
            st.strategy.ensure_dense(d)
            value = d.read_at(st.cuts.get(request.cut, "dense", name)) if request.cut else d.read()[0]
            reply.dense.add(name=name, value=value.tobytes())
        st.require_serving()
        return reply

    @transport.service_method
    def WriteSnapshot(self, request, context):
        st = self.state
        st.require_index()
        st.require_serving()
        with st.cuts.kept(request.cut):  # (no cut: nothing kept)
            items, size, seconds, parts = snapshot_part.write(st, request)
        return embedding_pb2.WriteSnapshotReply(items_json=json.dumps(items), bytes=size, seconds=seconds,
                                                parts_json=json.dumps(parts))

    @transport.service_method
    def RestoreTable(self, request, context):
        st = self.state
        st.require_index()
        st.require_serving()
        return snapshot_bulk.handle(st, request)

    @transport.service_method
    def StrategyCall(self, request, context):
        st = self.state
        if st.strategy is None:
            raise errors.FailedPrecondition("no cluster map yet")
        try:
            args = json.loads(request.args_json) if request.args_json else {}
        except json.JSONDecodeError as exc:
            raise errors.InvalidRequest(f"args_json is not JSON: {exc}") from None
        if not isinstance(args, dict):
            raise errors.InvalidRequest("args_json must be a JSON object")
        result = st.strategy.call(request.command, args)
        if request.command == "stats":
            result = dict(result, server=st.handlers.snapshot() | st.status() | {"threads_cpu_s": threads_cpu_s()})
        return embedding_pb2.StrategyCallReply(result_json=json.dumps(result))

    @transport.service_method
    def Echo(self, request, context):
        if request.reply_bytes > 0:
            limit = min(self.state.config.max_message_bytes, ECHO_MAX_REPLY_BYTES)
            if request.reply_bytes > limit:  # a few bytes asking for hundreds of MB, again and again: bounded
                raise errors.InvalidRequest(f"reply_bytes {request.reply_bytes} exceeds Echo's bound of {limit} bytes")
            return embedding_pb2.EchoMessage(data=bytes(request.reply_bytes))
        return request

    # --- control plane ---------------------------------------------------------------------------------------
    @transport.service_method
    def CreateTable(self, request, context):
        try:
            spec = TableSpec.from_proto(request).validate()
        except ValueError as exc:
            raise errors.InvalidRequest(str(exc)) from None
        self.state.faults.hit("during_create")
        self.state.create_table(spec)
        return embedding_pb2.Ack(epoch=self.state.epoch)

    @transport.service_method
    def CreateDense(self, request, context):
        spec, initial = parse_dense_spec(request.spec, request.initial_value)
        self.state.create_dense(spec, initial)
        return embedding_pb2.Ack(epoch=self.state.epoch)

    @transport.service_method
    def UpdateClusterMap(self, request, context):
        st = self.state
        st.adopt_map(request)
        recovering = st.promoting or (st.index >= 0 and st.strategy is not None and st.strategy.is_recovering())
        return embedding_pb2.Ack(epoch=st.epoch, recovering=recovering, index=-1 if st.promoting else st.index)

    @transport.service_method
    def Promote(self, request, context):
        recovering = self.state.promote(request.index, request.map, request.dense)
        return embedding_pb2.Ack(epoch=self.state.epoch, recovering=recovering)
