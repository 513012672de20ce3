"""In-process unit tests of the erasure-coding strategy's parts, without processes or gRPC.

The parity store (deltas, idempotence, undo, rows held back while rebuilt), the source log, the owner's
batch building (each delta reaches the right parity row and parity then equals a fresh encode), the
resolution rule, and the rebuild's choice of stripe members.  The multi-process tests
(``test_ecrec_recovery.py``) check the same parts through the protocol.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ecrec.coding.codec import Codec
from ecrec.coding.layout import Layout
from ecrec.tables.shards import DenseShard, TableShard
from ecrec.strategies.base import AppliedPush, DenseUpdate, TableUpdate
from ecrec.strategies.erasure import batch_frames
from ecrec.strategies.erasure.groups import PushGroup, build_batches
from ecrec.strategies.erasure.parity_store import ParityArena, place_rows
from ecrec.strategies.erasure.rebuild import StripeMembers, plan_data_rebuild
from ecrec.strategies.erasure.resolution import decide
from ecrec.strategies.erasure.source_log import LogEntry, SourceLog, TableEntry
from ecrec.tables.spec import DenseSpec, TableSpec
from ecrec.wire import embedding_pb2, parity_pb2

SPEC = TableSpec("t", 37, 4, optimizer="adagrad", lr=0.1, eps=1e-8, initial_accumulator_value=0.1, seed=5)


@functools.lru_cache(maxsize=None)
def codec(k: int, m: int) -> Codec:
    return Codec(k, m, kernel="cpu")


def all_rows(layout: Layout) -> dict[int, TableShard]:
    return {s: TableShard(SPEC, layout, s) for s in range(layout.num_servers)}


def data_rows(shards: dict[int, TableShard], layout: Layout, stripes: np.ndarray) -> np.ndarray:
    """``(n, k, row_bytes)`` current data rows of ``stripes`` (virtual rows are zeros)."""
    ids = layout.stripe_row_ids(stripes)
    out = np.zeros((len(stripes), layout.k, SPEC.row_bytes), dtype=np.uint8)
    servers, slots = layout.locate(ids)
    for r, t in np.argwhere(ids < SPEC.num_rows):
        out[r, t] = shards[int(servers[r, t])].read_payload(np.array([slots[r, t]]))[0]
    return out


class Store:
    """One server's arena holding table ``SPEC`` (what the receiver builds for each row width)."""

    def __init__(self, layout: Layout, index: int):
        self.arena = ParityArena(SPEC.row_bytes, layout, index, codec(layout.k, layout.m))
        self.part = self.arena.add_table(SPEC)
        self.arena.encode_initial(self.part)
        self.slots = self.part.slots

    def rows(self, slots):
        return self.arena.rows(slots)


def fresh_parity(shards, layout: Layout, store: Store) -> np.ndarray:
    stripes = store.arena.slot_to_stripe[store.slots]
    encoded = codec(layout.k, layout.m).encode_stripes(data_rows(shards, layout, stripes))
    return encoded[np.arange(len(stripes)), store.arena.slot_to_parity_index[store.slots]]


def stores_for(layout: Layout) -> dict[int, Store]:
    return {s: Store(layout, s) for s in range(layout.num_servers)}


def push(shards, layout, seq: int, ids, rng) -> AppliedPush:
    """Applies random gradients to ``ids`` on their owners (as a server would) and returns the pushes, one per
    owner, as ``{owner: AppliedPush}``."""
    ids = np.unique(np.asarray(ids, dtype=np.int64))
    owners, slots = layout.locate(ids)
    out = {}
    for owner in np.unique(owners).tolist():
        sel = owners == owner
        grads = rng.standard_normal((int(sel.sum()), SPEC.dim)).astype(np.float32)
        old, new, old_versions = shards[owner].apply_gradients(slots[sel], grads, seq, keep_old=True)
        out[owner] = AppliedPush(("w", seq), seq, [TableUpdate(shards[owner], ids[sel], slots[sel], old, new, old_versions)])
    return out


def batches_of(*pushes: AppliedPush, layout, source: int, source_id: str = "o") -> dict:
    """The owner's batches for consecutive ``pushes`` coalesced into one group."""
    group = PushGroup(pushes[0].seq, pushes[0].seq, 0.0)
    for p in pushes:
        group.add(p)
    return build_batches(group, layout, source, source_id)


def apply_batch(stores, destination: int, batch: parity_pb2.ParityBatch):
    """Applies a batch to the destination's arena (placed as the receiver places it); returns
    ``[(args, old_versions, rows changed)]`` per delta group."""
    results = []
    store = stores[destination]
    for t in batch.tables:
        assert list(t.tables) == [SPEC.name]
        n = len(t.parity_slots) // 8
        local, positions = np.frombuffer(t.parity_slots, np.int64), np.frombuffer(t.positions, np.int64)
        counts = np.frombuffer(t.table_rows, np.int64)
        slots, checked = place_rows(local, counts, np.array([store.part.offset]), np.array([store.part.count]),
                                    positions, store.arena.layout.k, store.arena.slot_to_stripe)
        assert checked == n
        seqs = np.frombuffer(t.seqs, np.int64)
        args = (slots, positions, int(t.parity), np.frombuffer(t.deltas, np.uint8).reshape(n, SPEC.row_bytes))
        results.append(((seqs, *args), np.frombuffer(t.old_versions, np.int64), store.arena.apply(seqs, *args)))
    return results


def _place_reference(local, counts, offsets, limits, positions, k, slot_to_stripe):
    """``place_rows``'s contract in plain Python: the arena slots, and how many rows passed before the first bad one
    (-1 when the counts do not add up to the rows)."""
    out, r = [], 0
    for t, count in enumerate(counts):
        for _ in range(count):
            if r >= len(local):
                return out, -1
            s, p = int(local[r]), int(positions[r])
            if not (0 <= s < limits[t] and 0 <= p < k) or slot_to_stripe[s + offsets[t]] < 0:
                return out, r
            out.append(s + offsets[t])
            r += 1
    return out, (len(local) if r == len(local) else -1)


@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 40])
def test_the_placement_check_finds_the_first_bad_row_around_its_fetch_distance(rows):
    """The check fetches the entry ``FETCH_ROWS`` rows ahead (from a slot nobody checked yet, of the table that row is
    in): batches shorter, as long and longer than that, over three tables (the middle one empty), valid or with one
    bad row first, in the middle or last (a slot out of its table, far out of range, negative, a stripe position not
    below k, a slot holding no parity row), give the contract's answer; the same loop with bounds checks reads
    nothing past a batch's end or its tables."""
    from numba import njit

    from ecrec.strategies.erasure import place_kernel

    assert place_kernel.FETCH_ROWS == 16  # the distance these sizes are chosen around
    checked_place = njit(boundscheck=True, cache=False)(place_kernel.place.py_func)
    rng = np.random.default_rng(rows)
    k, offsets, limits = 3, np.array([0, 50, 30], np.int64), np.array([30, 5, 20], np.int64)
    slot_to_stripe = np.arange(55, dtype=np.int64)
    holes = [3, 52, 35]  # one per table, at offsets[t] + a slot in range
    slot_to_stripe[holes] = -1
    counts = np.array([rows // 2, 0, rows - rows // 2], np.int64)
    table = np.repeat([0, 1, 2], counts)
    local = np.array([rng.choice([s for s in range(limits[t]) if s + offsets[t] not in holes]) for t in table],
                     dtype=np.int64)
    positions = rng.integers(0, k, rows).astype(np.int64)
    cases = [(local, positions, counts)]
    for at in sorted({0, rows // 2, rows - 1}) if rows else []:
        t = table[at]
        for bad in (limits[t], 2**40, -1, "position", holes[t] - offsets[t]):
            bad_local, bad_positions = local.copy(), positions.copy()
            if bad == "position":
                bad_positions[at] = k
            else:
                bad_local[at] = bad
            cases.append((bad_local, bad_positions, counts))
    cases.append((local, positions, counts + np.array([0, 0, 1])))  # the counts name one row more than there are
    for case_local, case_positions, case_counts in cases:
        want_slots, want = _place_reference(case_local, case_counts, offsets, limits, case_positions, k, slot_to_stripe)
        for place in (place_rows, checked_place):
            slots, got = place(case_local, case_counts, offsets, limits, case_positions, k, slot_to_stripe)
            assert got == want
            assert slots[:len(want_slots)].tolist() == want_slots


@pytest.mark.parametrize("servers,k,m", [(4, 2, 1), (5, 2, 2), (6, 3, 3)])
def test_batches_keep_every_parity_row_equal_to_a_fresh_encode(servers, k, m):
    layout = Layout(servers, k, m)
    shards, stores = all_rows(layout), stores_for(layout)
    rng = np.random.default_rng(servers * 10 + m)
    for seq in range(1, 8):
        for owner, applied in push(shards, layout, seq, rng.integers(0, SPEC.num_rows, 9), rng).items():
            batches = batches_of(applied, layout=layout, source=owner, source_id=f"owner{owner}")
            stripes, _ = layout.stripe_of(applied.tables[0].ids)
            expected = set(layout.parity_servers(stripes).reshape(-1).tolist())
            assert set(batches) == expected and owner not in batches
            for destination, batch in batches.items():
                assert batch.seq == batch.first_seq == seq and batch.source == owner
                assert [(p.worker, p.sequence) for p in batch.push_ids] == [("w", seq)]
                apply_batch(stores, destination, batch)
    for s, store in stores.items():
        np.testing.assert_array_equal(store.rows(store.slots), fresh_parity(shards, layout, store), err_msg=f"server {s}")


@pytest.mark.parametrize("servers,k,m", [(4, 2, 1), (6, 3, 3)])
def test_a_frame_carries_exactly_the_batches_protobuf_would(servers, k, m):
    """The direct path's frames (``batch_frames``): built without copying the deltas into protobuf, a batch's
    metadata and sections make the very ``ParityBatch`` of the protobuf path, and a frame decodes to them."""
    layout = Layout(servers, k, m)
    shards = all_rows(layout)
    rng = np.random.default_rng(7)
    pushes = [push(shards, layout, seq, rng.integers(0, SPEC.num_rows, 40), rng)[0] for seq in (1, 2)]
    group = PushGroup(1, 1, 0.0)
    for p in pushes:
        group.add(p)
    full = build_batches(group, layout, 0, "o")
    sections: dict = {}
    meta = build_batches(group, layout, 0, "o", sections=sections)
    assert set(meta) == set(full) == set(sections)
    for d, batch in meta.items():
        assert all(not t.deltas and not t.parity_slots for t in batch.tables)  # the bulk stayed arrays
        assert batch_frames.fill(batch, sections[d]) == full[d]
        message = parity_pb2.ParityBatches(batches=[batch], source=0, source_id="o", confirmed_upto=3)
        frame = batch_frames.encode(message, [sections[d]])
        decoded, got = batch_frames.decode(frame)
        assert decoded == message and len(got) == 1 and len(got[0]) == len(full[d].tables)
        for t, entry in zip(full[d].tables, got[0]):
            assert [bytes(x) for x in entry] == [getattr(t, name) for name in batch_frames.FIELDS]
            assert all(np.frombuffer(x, np.uint8).ctypes.data % 8 == 0 for x in entry)  # int64 sections aligned
        assert batch_frames.sections_nbytes(sections[d]) == sum(len(bytes(x)) for e in got[0] for x in e)


def test_a_frame_that_does_not_add_up_is_refused():
    batch = parity_pb2.ParityBatch(seq=1, first_seq=1)
    batch.tables.add(tables=["t"], parity=0)
    message = parity_pb2.ParityBatches(batches=[batch])
    sections = [[tuple(np.arange(i + 1, dtype=np.int64) for i in range(6))]]
    frame = batch_frames.encode(message, sections)
    assert batch_frames.decode(frame)[0] == message
    bulky = parity_pb2.ParityBatches()
    bulky.CopyFrom(message)
    bulky.batches[0].tables[0].deltas = b"x"
    for bad, why in [(frame[:-8], "ends before|runs past"), (frame + b"\0" * 8, "beyond its last section"),
                     (b"XXXX" + frame[4:], "not a parity frame"), (frame[:10], "shorter than its header"),
                     (batch_frames.encode(bulky, sections), "carries bulk bytes")]:
        with pytest.raises(batch_frames.FrameError, match=why):
            batch_frames.decode(bad)
    with pytest.raises(ValueError, match="table entries"):
        batch_frames.encode(message, [[]])


def test_a_batch_applied_twice_changes_nothing_and_undo_restores_bytes_and_versions():
    layout = Layout(4, 2, 1)
    shards, stores = all_rows(layout), stores_for(layout)
    rng = np.random.default_rng(1)
    before = {s: (st.rows(st.slots).copy(), st.arena.versions.copy()) for s, st in stores.items()}
    (owner, applied), = push(shards, layout, 5, [0, 7, 8], rng).items()  # rows 0, 7, 8: all on server 0
    batches = batches_of(applied, layout=layout, source=owner)
    applied_once = {}
    for d, b in batches.items():
        applied_once[d] = apply_batch(stores, d, b)
    after_once = {s: st.rows(st.slots).copy() for s, st in stores.items()}
    for d, b in batches.items():  # the re-sent batch: the versions say it is in already
        for _, _, changed in apply_batch(stores, d, b):
            assert changed == 0
    for s, st in stores.items():
        np.testing.assert_array_equal(st.rows(st.slots), after_once[s])
    assert any((after_once[s] != before[s][0]).any() for s in stores)
    for d, results in applied_once.items():
        for args, old_versions, changed in results:
            assert changed == len(args[1])
            assert stores[d].arena.undo(*args, old_versions) == len(args[1])
    for s, st in stores.items():
        np.testing.assert_array_equal(st.rows(st.slots), before[s][0])
        np.testing.assert_array_equal(st.arena.versions, before[s][1])


def _two_pushes_while_rebuilt(seed: int, read_first: bool):
    """Push 3 reaches a parity row not rebuilt yet, whose rebuild starts reading the stripe's data before it
    (``read_first``) or after it; the rebuild reads the data (at version 3), push 4 arrives, the row is built.
    Returns ``(changed by push 3, (its row holds it, deltas held), rows built, the row, its expected parity, its version of the
    position pushed)``."""
    layout = Layout(4, 2, 1)
    shards, stores = all_rows(layout), stores_for(layout)
    rng = np.random.default_rng(seed)
    (owner, first), = push(shards, layout, 3, [1], rng).items()
    (d, b1), = batches_of(first, layout=layout, source=owner).items()
    store = stores[d]
    store.arena.mark_unbuilt()
    if read_first:
        store.arena.begin_read(store.slots)  # the rebuild reads their data from now on
    (args, _, changed), = apply_batch(stores, d, b1)
    slots, positions = args[1], args[2]
    held = (store.arena.holds(int(slots[0])), len(store.arena.held))
    store.arena.begin_read(slots)
    snapshot = data_rows(shards, layout, store.arena.slot_to_stripe[slots])  # the rebuild reads at version 3
    (_, second), = push(shards, layout, 4, [1], rng).items()
    (_, b2), = batches_of(second, layout=layout, source=owner).items()
    apply_batch(stores, d, b2)
    versions = np.zeros((1, layout.k), dtype=np.int64)
    versions[0, positions[0]] = 3
    built = store.arena.build(slots, codec(2, 1).encode_stripes(snapshot)[:, 0], versions)
    expected = fresh_parity(shards, layout, store)[np.searchsorted(store.slots, slots)]
    return changed, held, built, store.rows(slots), expected, store.arena.versions[slots[0], positions[0]], store


def test_rows_being_rebuilt_hold_deltas_back_and_apply_only_the_newer_ones():
    changed, held, built, row, expected, version, _ = _two_pushes_while_rebuilt(2, read_first=True)
    assert changed == 0 and held[0]
    assert built == 1
    # seq 3 was in the snapshot (skipped), seq 4 was not (applied after)
    np.testing.assert_array_equal(row, expected)
    assert version == 4


def test_a_delta_before_the_rebuild_reads_its_row_is_dropped_and_the_row_built_after_is_exact():
    """A parity row not rebuilt yet: a delta that arrives before the rebuild starts reading the stripe's data is
    of a push that data holds (an owner sends a delta after applying its push): dropped, nothing held; one
    that arrives between the read and the build is held and applied.  The built row is a fresh encode."""
    changed, held, built, row, expected, version, store = _two_pushes_while_rebuilt(12, read_first=False)
    assert changed == 0 and not held[0] and held[1] == 0
    assert built == 1
    np.testing.assert_array_equal(row, expected)
    assert version == 4 and len(store.arena.held) == 0


def test_undo_of_a_delta_the_rebuilt_row_already_held_restores_the_row_before_it():
    """A replacement parity server rebuilt a row from data that already held push 4; the owner re-sent push 4
    (skipped: the row holds it); resolution then undoes push 4: the row must lose it all the same."""
    layout = Layout(4, 2, 1)
    shards, stores = all_rows(layout), stores_for(layout)
    rng = np.random.default_rng(9)
    (owner, applied), = push(shards, layout, 4, [3], rng).items()
    (d, batch), = batches_of(applied, layout=layout, source=owner).items()
    store = stores[d]
    before = store.rows(store.slots).copy()
    store.arena.mark_unbuilt()
    stripes = store.arena.slot_to_stripe[store.slots]
    versions = np.zeros((len(stripes), layout.k), dtype=np.int64)
    ids = layout.stripe_row_ids(stripes)
    versions[ids == 3] = 4  # the data row of id 3 holds push 4
    encoded = codec(2, 1).encode_stripes(data_rows(shards, layout, stripes))[:, 0]
    assert store.arena.build(store.slots, encoded, versions) == len(stripes)
    (args, old_versions, changed), = apply_batch(stores, d, batch)
    assert changed == 0  # the rebuilt row holds it already
    assert store.arena.undo(*args, old_versions) == 1
    np.testing.assert_array_equal(store.rows(store.slots), before)
    assert store.arena.versions[args[1][0], args[2][0]] == 0


def test_dense_replica_holds_deltas_back_while_rebuilt():
    spec = DenseSpec("w", (3,), optimizer="sgd", lr=0.5)
    primary, replica = DenseShard(spec, np.arange(3, dtype=np.float32)), DenseShard(spec, np.arange(3, dtype=np.float32))
    old, new, old_version = primary.apply_gradient(np.ones(3, np.float32), 7, keep_old=True)
    assert old_version == 0
    replica.mark_unready()
    assert replica.apply_delta(np.bitwise_xor(old, new), 7) == (False, 0)
    replica.install(old, 0)  # a copy of another replica taken before seq 7
    payload, version, ready = replica.read()
    assert ready and version == 7 and payload.tobytes() == primary.read()[0].tobytes()
    assert replica.undo_delta(np.bitwise_xor(old, new), 7, 0)  # resolution drops push 7 again
    assert replica.read()[0].tobytes() == old.tobytes() and replica.version == 0
    assert not replica.undo_delta(np.bitwise_xor(old, new), 7, 0)  # not held any more: nothing changes


def test_source_log_confirmation_trims_and_remembers_push_ids():
    log = SourceLog(2)
    for seq in (11, 12, 13):
        entry = LogEntry(seq, seq, [("w", seq)], (0, 1))
        entry.tables.append(TableEntry(SPEC.row_bytes, np.array([seq % 3]), np.zeros(1, np.int64), 0,
                                       np.zeros((1, 4), np.uint8), np.zeros(1, np.int64), np.array([seq])))
        log.entries[seq] = entry
    np.testing.assert_array_equal(log.affected_slots(SPEC.row_bytes), [0, 1, 2])
    log.confirm(12)
    assert list(log.entries) == [13] and log.committed == {"w": 12}
    np.testing.assert_array_equal(log.affected_slots(SPEC.row_bytes), [1])
    log.confirm(5)  # an older confirmation changes nothing
    assert list(log.entries) == [13] and log.confirmed_upto == 12


def test_source_log_core_applies_in_order_holds_back_and_skips_duplicates():
    """The receiver's decisions, as its sans-I/O core makes them: no lock, no arena, only what to do."""
    from ecrec.strategies.erasure.source_log import APPLY, DUPLICATE, FULL, HELD

    log = SourceLog(1, max_held=2)
    assert log.incarnation("a", named_live=True) == "restarted" and log.source_id == "a"
    assert log.offer(12, 11, "b12", 10).kind == HELD  # its predecessor 11 has not arrived
    assert log.offer(13, 12, "b13", 10).kind == HELD
    assert log.offer(14, 13, "b14", 10).kind == FULL  # beyond max_held: refused, nothing held
    offer = log.offer(11, 0, "b11", 10)
    assert offer.kind == APPLY and offer.ready == [(11, "b11"), (12, "b12"), (13, "b13")]
    assert log.held == {} and log.held_bytes == 0
    for seq, _ in offer.ready:
        log.record(seq, LogEntry(seq, seq, [("w", seq)], (1,)))
    assert log.applied_upto == 13 and log.logged_upto("a") == 13 and log.logged_upto("b") == 0
    assert log.offer(12, 11, "b12", 10).kind == DUPLICATE


def test_source_log_core_incarnations_resolution_and_adoption():
    from ecrec.strategies.erasure.source_log import CLOSED, FOREIGN, RESOLVED, RESTARTED, SAME

    log = SourceLog(1)
    assert log.incarnation("a", named_live=False) == FOREIGN and log.source_id == ""  # not named by the map yet
    assert log.incarnation("a", named_live=True) == RESTARTED
    for seq in (1, 2, 3):
        log.record(seq, LogEntry(seq, seq, [("w", seq)], (1,)))
    assert log.incarnation("a", named_live=True) == SAME
    log.close_for_resolution()
    assert log.incarnation("a", named_live=True) == CLOSED and log.logged_upto("a") == 0
    assert not log.adopt("a", 5, [])  # being resolved: a rebuild reads the rows again
    listing = parity_pb2.ResolveSourceReply()
    log.listing(listing)
    assert [e.seq for e in listing.logged] == [1, 2, 3]
    undone = log.resolve({2, 3})
    assert [e.seq for e in undone] == [3, 2] and log.committed == {"w": 1}  # newest first; the rest kept
    assert log.incarnation("a", named_live=True) == RESOLVED
    assert not log.adopt("a", 5, [])
    assert log.adopt("b", 7, [("v", 4)]) and log.source_id == "b" and log.confirmed_upto == 7
    assert log.committed == {"w": 1, "v": 4}
    log.record(8, LogEntry(8, 8, [("w", 9)], (1,)))
    # resolution of "b" never reached this server and "c" serves the index: b's batch is kept, committed
    assert log.incarnation("c", named_live=True) == RESTARTED and log.committed["w"] == 9


def test_outbox_core_confirms_in_push_order_and_restarts_a_replaced_chain_with_everything_unconfirmed():
    """The owner's decisions, as its sans-I/O core makes them: chains, acknowledgements, confirmation, restarts."""
    from ecrec.strategies.erasure.outbox import ACKED, BEYOND, EVERY_VERSION, STALE, Outbox, OutboxEntry

    box = Outbox()
    assert box.bound() == EVERY_VERSION  # nothing numbered: every version held stands
    live = {1: "a", 2: "b"}
    for seq in (B | 1, B | 2):
        box.numbered(seq)
        entry = OutboxEntry(seq, seq, 0.0, {}, push_ids=[("w", seq & 0xFF)])
        box.add(entry)
        batches = {d: parity_pb2.ParityBatch(source=0, seq=seq, first_seq=seq) for d in (1, 2)}
        assert box.install(entry, batches, lambda d: live.get(d, ""), group_open=False) == [1, 2]
    assert box.confirmed == B and box.bound() == B and box.unconfirmed(False) == 2
    assert [e.batches[1].prev_seq for e in box.entries.values()] == [0, B | 1]  # chained per destination
    assert box.ack(1, "a", B | 3, False) == BEYOND  # never sent that far
    assert box.ack(1, "x", B | 1, False) == STALE  # another incarnation
    assert box.ack(1, "a", B | 2, False) == ACKED and box.confirmed == B  # destination 2 has applied nothing
    assert box.ack(2, "b", B | 1, False) == ACKED and box.confirmed == B | 1 and box.committed == {"w": 1}
    # destination 1 is replaced ("a" -> "c"): its new chain gets every entry not confirmed everywhere, including
    # the one "a" acknowledged, re-addressed from the start
    in_a_sender = box.entries[B | 2].batches[1]  # being serialized outside the owner's lock
    assert box.restart({1: "c", 2: "b"}) == [1]
    entry = box.entries[B | 2]
    assert entry.pending == {1, 2} and entry.batches[1].destination_id == "c" and entry.batches[1].prev_seq == 0
    # re-addressed as a copy: the sender's batch keeps its destination and prev_seq together (issue: a new
    # destination with an old prev_seq)
    assert (in_a_sender.destination_id, in_a_sender.prev_seq) == ("a", B | 1)
    assert [e.seq for e in box.due(1, everything=False, cutoff=-1.0)] == [B | 2]  # once, after the restart
    assert box.ack(2, "b", B | 2, False) == ACKED and box.confirmed == B | 1
    assert box.ack(1, "c", B | 2, True) == ACKED and box.confirmed == B | 2 and not box.entries
    assert box.unconfirmed(group_open=True) == 0  # everything numbered is confirmed


def _listing(logged, confirmed=0, committed=()):
    """A survivor's answer; ``logged``: ``(seq, destinations, ids)`` (one push) or ``(first, seq, destinations,
    ids)`` (a batch of pushes first..seq)."""
    reply = parity_pb2.ResolveSourceReply(confirmed_upto=confirmed)
    for item in logged:
        first, seq, destinations, ids = item if len(item) == 4 else (item[0], *item)
        reply.logged.add(seq=seq, first_seq=first, destinations=destinations, destination_ids=ids,
                         push_ids=[embedding_pb2.PushId(worker="w", sequence=q) for q in range(first, seq + 1)])
    for s in committed:
        reply.committed.add(worker="w", sequence=s)
    return reply


B = 7 << 32  # the failed incarnation's sequence base: its pushes are B|1, B|2, ...


def test_resolution_keeps_the_longest_complete_prefix_and_undoes_everything_after():
    current = {0: "a", 2: "c", 3: "d"}  # index 1 failed; no other replaced
    listings = {
        0: _listing([(B + 5, [0, 2], ["a", "c"]), (B + 6, [0, 2], ["a", "c"]), (B + 7, [0, 3], ["a", "d"])],
                    confirmed=B + 4, committed=[3]),
        2: _listing([(B + 5, [0, 2], ["a", "c"])], confirmed=B + 4),
        3: _listing([(B + 7, [0, 3], ["a", "d"])], confirmed=B + 4),
    }
    d = decide(listings, current)
    assert d.kept == [("w", B + 5)] and d.kept_upto == B + 5  # at every destination
    assert d.undo == [B + 6, B + 7]  # 6 is at 0 only; 7 is complete but follows an incomplete push
    assert d.committed == [("w", 3)]


def test_resolution_stops_at_a_push_no_survivor_holds():
    listings = {0: _listing([(B + 1, [0], ["a"]), (B + 3, [0], ["a"])]), 2: _listing([])}
    d = decide(listings, {0: "a", 2: "c"})
    assert d.kept == [("w", B + 1)] and d.undo == [B + 3]  # B|2 went to a server that is gone with it


def test_resolution_keeps_or_undoes_a_coalesced_batch_whole():
    listings = {0: _listing([(B + 1, B + 3, [0, 2], ["a", "c"]), (B + 4, B + 6, [0, 2], ["a", "c"])]),
                2: _listing([(B + 1, B + 3, [0, 2], ["a", "c"])])}
    d = decide(listings, {0: "a", 2: "c"})
    assert d.kept == [("w", B + 1), ("w", B + 2), ("w", B + 3)] and d.undo == [B + 6] and d.kept_upto == B + 3


def test_resolution_ignores_a_destination_replaced_since_and_keeps_confirmed_pushes():
    listings = {0: _listing([(B + 5, [0, 2], ["a", "old-c"]), (B + 6, [0, 2], ["a", "c"])], confirmed=B + 6),
                2: _listing([])}
    d = decide(listings, {0: "a", 2: "c"})
    assert sorted(d.kept) == [("w", B + 5), ("w", B + 6)] and d.undo == []  # 5: 2 was replaced; 6: confirmed
    d = decide({0: _listing([(B + 5, [0, 2], ["a", "c"])], confirmed=B + 4), 2: _listing([])}, {0: "a", 2: "c"})
    assert d.kept == [] and d.undo == [B + 5]


def _members(k, m, n, row_bytes=8, seed=0):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, k, row_bytes), dtype=np.uint8)
    parity = codec(k, m).encode_stripes(data)
    payload = np.concatenate([data.transpose(1, 0, 2), parity.transpose(1, 0, 2)])
    versions = rng.integers(1, 100, (k, n))
    members = StripeMembers(payload.copy(), np.ones((k + m, n), bool), np.ones((k + m, n), bool), versions.copy(),
                            np.repeat(versions.T[None], m, axis=0).copy())
    return data, members


def _rebuild(members, groups, k):
    out = {}
    for (i, data_members, chosen), rows in groups.items():
        available = {t: members.payload[t, rows] for t in data_members} | {k + j: members.payload[k + j, rows] for j in chosen}
        for r, row in zip(rows, codec(k, len(members.parity_versions)).reconstruct_stripes(available, [i])[i]):
            out[int(r)] = row
    return out


def test_rebuild_plan_uses_agreeing_members_and_skips_rows_with_a_delta_in_flight():
    k, m, n = 2, 1, 6
    data, members = _members(k, m, n)
    my_pos = np.array([0, 1, 0, 1, 0, 1])
    members.parity_versions[0, 2, 1] += 1  # row 2: the parity has a delta the data row does not (in flight)
    members.ready[1, 4] = False  # row 4: the other data member is not ready
    groups, versions = plan_data_rebuild(members, my_pos, k, m)
    rebuilt = _rebuild(members, groups, k)
    assert sorted(rebuilt) == [0, 1, 3, 5]
    for r, row in rebuilt.items():
        np.testing.assert_array_equal(row, data[r, my_pos[r]])
        assert versions[r] == members.parity_versions[0, r, my_pos[r]]


def test_rebuild_plan_with_a_lost_data_member_uses_two_parities_that_agree():
    k, m, n = 2, 2, 4
    data, members = _members(k, m, n, seed=3)
    my_pos = np.zeros(n, dtype=np.int64)
    members.ready[1] = False  # the other data member of every stripe is lost too (m = 2)
    members.parity_versions[1, 3, 0] += 1  # row 3: the parities disagree
    groups, _ = plan_data_rebuild(members, my_pos, k, m)
    assert all(key[1] == () and key[2] == (0, 1) for key in groups)
    rebuilt = _rebuild(members, groups, k)
    assert sorted(rebuilt) == [0, 1, 2]
    for r, row in rebuilt.items():
        np.testing.assert_array_equal(row, data[r, 0])


@pytest.mark.parametrize("k, m", [(2, 1), (3, 2), (4, 2)])
def test_the_engine_decodes_each_choice_of_members_to_the_lost_data_row(k, m):
    """``RebuildEngine._decode``: the other data rows and one parity (a linear combination over the rows, as the
    fast path decodes) and any other choice (the code's reconstruction) give back the data row bit for bit."""
    from types import SimpleNamespace

    from ecrec.strategies.erasure.rebuild import RebuildEngine

    n = 50
    data, members = _members(k, m, n, row_bytes=24, seed=k * 10 + m)
    engine = SimpleNamespace(host=SimpleNamespace(layout=Layout(k + m, k, m)), codec=codec(k, m), _coefficients={})
    rows = np.arange(0, n, 3)
    for i in range(k):
        others = tuple(t for t in range(k) if t != i)
        choices = [(others, (j,)) for j in range(m)]  # the common case, each parity
        choices.append((others[1:], tuple(range(2))) if m >= 2 else (others, (0,)))  # one more data row lost
        for data_members, chosen in choices:
            got = RebuildEngine._decode(engine, members, i, data_members, chosen, rows)
            np.testing.assert_array_equal(got, data[rows, i])
    assert set(engine._coefficients) == {(i, j) for i in range(k) for j in range(m)}  # made once each


@pytest.mark.parametrize("width, k, seed, in_place", [(16, 2, 0, False), (24, 3, 1, True), (5, 2, 2, False),
                                                       (512, 4, 3, False), (512, 2, 4, True)])
def test_the_merge_gives_each_row_the_xor_of_its_deltas_its_first_old_version_and_last_sequence(width, k, seed,
                                                                                                in_place, monkeypatch):
    """``merge_rows`` (the compiled merge of a group's changes) against a dictionary built change by change: one
    entry per row, grouped by stripe position then table, in order of first change within each; its delta the XOR
    of the row's deltas, its old version that of its first change, its version the last change's sequence.  Small
    segments are concatenated first, large ones read in place (``in_place``: every one)."""
    from ecrec.strategies.erasure import merge
    from ecrec.strategies.erasure.merge import merge_rows

    if in_place:
        monkeypatch.setattr(merge, "IN_PLACE_MIN_BYTES", 0)

    rng = np.random.default_rng(seed)
    ntables = 3
    slots, tables, seqs, deltas, olds = [], [], [], [], []
    for seq in range(1, 9):
        for t in rng.permutation(ntables)[: int(rng.integers(1, ntables + 1))]:
            s = rng.choice(40, size=int(rng.integers(1, 20)), replace=False).astype(np.int64)  # rows repeat across
            slots.append(s)
            tables.append(int(t))
            seqs.append(seq)
            deltas.append(rng.integers(0, 256, (len(s), width), dtype=np.uint8))
            olds.append(rng.integers(0, 1000, len(s)).astype(np.int64))
    expected: dict = {}  # (table, slot) -> [delta, old version, last sequence, order of first change]
    for s, t, q, d, o in zip(slots, tables, seqs, deltas, olds):
        for slot, row, old in zip(s.tolist(), d, o.tolist()):
            entry = expected.get((t, slot))
            if entry is None:
                expected[(t, slot)] = [row.copy(), old, q, len(expected)]
            else:
                entry[0] ^= row
                entry[2] = q
    counts, out_slots, merged, out_old, out_versions = merge_rows(slots, tables, seqs, deltas, olds, k, ntables)
    order = sorted(expected, key=lambda key: ((key[1] % k), key[0], expected[key][3]))
    assert counts.shape == (k, ntables) and counts.sum() == len(expected)
    assert [int(x) for x in out_slots] == [slot for _, slot in order]
    assert np.array_equal(merged, np.stack([expected[key][0] for key in order]))
    assert out_old.tolist() == [expected[key][1] for key in order]
    assert out_versions.tolist() == [expected[key][2] for key in order]
    for p in range(k):
        for t in range(ntables):
            assert counts[p, t] == sum(1 for table, slot in expected if table == t and slot % k == p)
