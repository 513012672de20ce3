"""Deltas held back for parity rows being rebuilt (``ecrec.strategies.erasure.held_deltas`` and the arena's use
of it): the same rows and versions as holding and applying them one by one, per row, in arrival order."""

from __future__ import annotations

import numpy as np
import pytest

from ecrec.coding.codec import Codec
from ecrec.coding.layout import Layout
from ecrec.strategies.erasure.held_deltas import INITIAL_CAPACITY, HeldDeltas
from ecrec.strategies.erasure.parity_store import ParityArena
from ecrec.tables.spec import TableSpec

SPEC = TableSpec("t", 400, 4, optimizer="adagrad", lr=0.1, eps=1e-8, initial_accumulator_value=0.1, seed=5)


class Reference:
    """The rule, one delta at a time: held per row whose rebuild read started, in arrival order (dropped
    before it); a build applies each whose sequence is
    newer than the row's version then (and moves the version on); an undo of a row not built drops it, of a
    built row holding it as its newest XORs it out."""

    def __init__(self, arena: ParityArena):
        self.codec = arena.codec
        self.k = arena.layout.k
        self.parity = arena.rows(np.arange(arena.size)).copy()
        self.versions = arena.versions.copy()
        self.built = arena.built.copy()
        self.reading = arena.reading.copy()
        self.pidx = arena.slot_to_parity_index
        self.held: dict[int, list] = {}

    def xor(self, slot, position, delta):
        coeff = int(self.codec.coefficients[self.pidx[slot], position])
        self.parity[slot] ^= self.codec.combine([(coeff, delta[None, :])])[0]

    def apply(self, seqs, slots, positions, deltas):
        for r, slot in enumerate(slots.tolist()):
            position, seq = int(positions[r]), int(seqs[r])
            if not self.built[slot]:
                if self.reading[slot]:  # before its read: the data read holds that push
                    self.held.setdefault(slot, []).append((position, seq, deltas[r].copy()))
            elif seq > self.versions[slot, position]:
                self.xor(slot, position, deltas[r])
                self.versions[slot, position] = seq

    def undo(self, seqs, slots, positions, deltas, old_versions):
        for r in range(len(slots) - 1, -1, -1):
            slot, position, seq = int(slots[r]), int(positions[r]), int(seqs[r])
            if not self.built[slot]:
                self.held[slot] = [p for p in self.held.get(slot, []) if not (p[0] == position and p[1] == seq)]
            elif self.versions[slot, position] == seq:
                self.xor(slot, position, deltas[r])
                self.versions[slot, position] = old_versions[r]

    def build(self, slots, rows, versions):
        for i, slot in enumerate(slots.tolist()):
            if self.built[slot]:
                continue
            self.parity[slot] = rows[i]
            self.versions[slot] = versions[i]
            for position, seq, delta in self.held.pop(slot, []):
                if seq > self.versions[slot, position]:
                    self.xor(slot, position, delta)
                    self.versions[slot, position] = seq
            self.built[slot] = True


def arena_for(layout: Layout, index: int = 1) -> ParityArena:
    arena = ParityArena(SPEC.row_bytes, layout, index, Codec(layout.k, layout.m, kernel="cpu"))
    arena.add_table(SPEC)
    return arena


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k,m", [(2, 1), (3, 2)])
def test_builds_apply_exactly_the_held_deltas_newer_than_the_rows_read(seed, k, m):
    rng = np.random.default_rng(seed)
    layout = Layout(k + m + 1, k, m)
    arena = arena_for(layout)
    arena.mark_unbuilt()
    ref = Reference(arena)
    slots_here = np.flatnonzero(~arena.built)
    seq = 0
    for _ in range(40):
        action = rng.random()
        j = int(rng.integers(0, m))  # a batch's (and an undo's) rows are of one parity index
        of_j = slots_here[arena.slot_to_parity_index[slots_here] == j]
        if action < 0.6:  # a batch: rows once per push, pushes in order, some repeated rows
            n = int(rng.integers(1, 30))
            slots = rng.choice(of_j, n)
            positions = rng.integers(0, k, n)
            seqs = np.sort(rng.integers(seq + 1, seq + 6, n))
            seq = int(seqs.max())
            if rng.random() < 0.1:  # an owner's new incarnation: sequences start low again
                seqs = rng.integers(1, 4, n)
            deltas = rng.integers(0, 256, (n, SPEC.row_bytes), dtype=np.uint8)
            arena.apply(seqs, slots, positions, j, deltas)
            ref.apply(seqs, slots, positions, deltas)
        elif action < 0.7 and len(arena.held):  # an undo of some held ones (and of rows never held)
            alive = np.flatnonzero(arena.held.alive[:arena.held.n])
            alive = alive[arena.slot_to_parity_index[arena.held.slots[alive]] == j]
            pick = rng.choice(alive, min(len(alive), 5), replace=False)
            slots = np.concatenate([arena.held.slots[pick], rng.choice(of_j, 2)])
            positions = np.concatenate([arena.held.positions[pick], rng.integers(0, k, 2)])
            seqs = np.concatenate([arena.held.seqs[pick], rng.integers(1, 50, 2)])
            deltas = rng.integers(0, 256, (len(slots), SPEC.row_bytes), dtype=np.uint8)
            old_versions = rng.integers(0, 3, len(slots))
            arena.undo(seqs, slots, positions, j, deltas, old_versions)
            ref.undo(seqs, slots, positions, deltas, old_versions)
        elif action < 0.8:  # a rebuild starts reading the data of some rows
            slots = rng.choice(slots_here, int(rng.integers(1, 60)))
            arena.begin_read(slots)
            ref.reading[slots] = True
        else:  # a build of some rows, read at random versions
            n = int(rng.integers(1, 40))
            slots = np.unique(rng.choice(slots_here, n))
            rows = rng.integers(0, 256, (len(slots), SPEC.row_bytes), dtype=np.uint8)
            versions = rng.integers(0, seq + 1, (len(slots), k))
            arena.build(slots, rows, versions)
            ref.build(slots, rows, versions)
    every = np.flatnonzero(~arena.built)
    arena.build(every, np.zeros((len(every), SPEC.row_bytes), np.uint8), np.zeros((len(every), k), np.int64))
    ref.build(every, np.zeros((len(every), SPEC.row_bytes), np.uint8), np.zeros((len(every), k), np.int64))
    np.testing.assert_array_equal(arena.rows(np.arange(arena.size)), ref.parity)
    np.testing.assert_array_equal(arena.versions, ref.versions)
    assert len(arena.held) == 0 and arena.unbuilt_count == 0


def test_a_batch_for_rows_being_read_is_held_in_one_copy_and_taken_by_the_build():
    layout = Layout(4, 2, 1)
    arena = arena_for(layout)
    arena.mark_unbuilt()
    slots = np.flatnonzero(~arena.built)[:3]
    deltas = np.full((3, SPEC.row_bytes), 7, dtype=np.uint8)
    assert arena.apply(np.array([4, 4, 4]), slots, np.array([0, 1, 0]), 0, deltas) == 0
    assert len(arena.held) == 0  # before the rebuild reads their data: dropped (that data holds push 4)
    arena.begin_read(slots)
    assert arena.apply(np.array([5, 5, 5]), slots, np.array([0, 1, 0]), 0, deltas) == 0
    deltas[:] = 0  # the caller's buffer reused: what is held is a copy
    assert all(arena.holds(int(s)) for s in slots) and len(arena.held) == 3
    assert arena.held.nbytes == 3 * SPEC.row_bytes
    arena.build(slots[:1], np.zeros((1, SPEC.row_bytes), np.uint8), np.zeros((1, 2), np.int64))
    assert not arena.holds(int(slots[0])) and arena.holds(int(slots[1])) and len(arena.held) == 2
    assert arena.rows(slots[:1]).any()  # the held delta (7s) was applied to the row built
    assert arena.versions[slots[0], 0] == 5


def test_held_arrays_grow_and_squeeze_without_losing_order():
    held = HeldDeltas(4)
    n = 3 * INITIAL_CAPACITY
    slots = np.arange(n, dtype=np.int64) % 97
    deltas = (np.arange(n)[:, None] + np.zeros((1, 4), np.int64)).astype(np.uint8)
    held.add(slots, slots % 2, np.arange(n), deltas)
    assert len(held) == n
    member = np.zeros(97, dtype=bool)
    member[:90] = True
    s, p, q, d = held.take(member)  # most of them: the rest are squeezed to the front
    assert len(s) == len(q) and (np.diff(q) > 0).all() and set(s.tolist()) == set(range(90))
    np.testing.assert_array_equal(d[:, 0], (q % 256).astype(np.uint8))
    assert held.n == len(held) == n - len(s)
    member[:] = True
    s2, _, q2, _ = held.take(member)
    assert set(s2.tolist()) == set(range(90, 97)) and (np.diff(q2) > 0).all() and len(held) == 0
    assert held.drop(np.array([1]), np.array([1]), np.array([1])) == 0


def test_rows_that_will_never_be_built_stop_holding_their_deltas():
    layout = Layout(4, 2, 1)
    arena = arena_for(layout)
    arena.mark_unbuilt()
    slots = np.flatnonzero(~arena.built)[:4]
    arena.begin_read(slots)
    deltas = np.ones((4, SPEC.row_bytes), dtype=np.uint8)
    arena.apply(np.array([3, 3, 3, 3]), slots, np.zeros(4, np.int64), 0, deltas)
    assert len(arena.held) == 4
    arena.end_read(slots[:2])  # their stripes lost more than m members
    assert len(arena.held) == 2 and not arena.holds(int(slots[0])) and arena.holds(int(slots[2]))
    arena.apply(np.array([4, 4]), slots[:2], np.zeros(2, np.int64), 0, deltas[:2])
    assert len(arena.held) == 2  # not held any more
    every = np.flatnonzero(~arena.built)
    arena.build(every, np.zeros((len(every), SPEC.row_bytes), np.uint8), np.zeros((len(every), 2), np.int64))
    assert arena.unbuilt_count == 0 and len(arena.held) == 0 and arena.held.n == 0
