"""A group of consecutive pushes on the owning server and the parity batches it becomes: :class:`PushGroup` keeps
the pushes as the server handed them over, :func:`group_deltas` merges them into one delta per row
(``ecrec.strategies.erasure.merge``), :func:`build_batches` makes one ``ParityBatch`` per destination (each row's
``m`` parity servers, each dense tensor's backups).  The owner (``ecrec.strategies.erasure.owner``) decides when a
group closes and what happens to its batches."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ecrec.strategies.base import AppliedPush
from ecrec.strategies.erasure.merge import merge_rows
from ecrec.wire import embedding_pb2, parity_pb2


@dataclass
class PushGroup:
    """Consecutive pushes ``first_seq``..``last_seq`` whose deltas go out as one batch per destination.

    It keeps each push as the server handed it over (no copy, no work per row: the rows' slots, their deltas
    -- computed by the server while the rows were in cache -- and their versions before it); one delta per row
    is made when the group closes."""

    first_seq: int
    last_seq: int
    started: float
    last_push: float = 0.0
    pushes: list[AppliedPush] = field(default_factory=list)
    nbytes: int = 0  # delta bytes the pushes hold (a bound on the group's)

    def add(self, push: AppliedPush) -> None:
        self.last_seq = push.seq
        self.pushes.append(push)
        self.nbytes += push.nbytes or (sum(u.new.nbytes for u in push.tables) + sum(u.new.nbytes for u in push.dense))

    @property
    def push_ids(self) -> list[tuple[str, int]]:
        return [p.push_id for p in self.pushes]

    def dense_deltas(self) -> dict[str, tuple[np.ndarray, int, int]]:
        """Per dense tensor: its delta over the group (XOR of its pushes' deltas), its version before the group's
        first push to it, and the last one's sequence."""
        out: dict[str, list] = {}
        for p in self.pushes:
            for u in p.dense:
                found = out.get(u.dense.spec.name)
                if found is None:
                    out[u.dense.spec.name] = [delta_of(u).reshape(-1).copy(), u.old_version, p.seq]
                else:
                    np.bitwise_xor(found[0], delta_of(u).reshape(-1), out=found[0])
                    found[2] = p.seq
        return {name: tuple(v) for name, v in out.items()}


@dataclass
class WidthDeltas:
    """One delta per row of one width the group changed, grouped by stripe position, then table (by name): the
    rows of position ``p`` are ``bounds[p]:bounds[p + 1]``, ``counts[p, t]`` of them of table ``t``."""

    names: list[str]
    bounds: np.ndarray  # (k + 1,)
    counts: np.ndarray  # (k, tables)
    slots: np.ndarray  # data slots here
    deltas: np.ndarray  # (rows, width) uint8: payload before the group's first push XOR after its last
    old_versions: np.ndarray  # each row's version before the group's first push to it
    versions: np.ndarray  # the sequence of the group's last push to it


def delta_of(u) -> np.ndarray:
    """A change's delta: the server's (``needs_delta``), or ``old XOR new`` when it handed over both."""
    return u.delta if u.delta is not None else np.bitwise_xor(u.old, u.new)


@dataclass
class OpenChanges:
    """Every change an open group made to one table, for reads at the last closed group (:func:`before_group`):
    sorted by slot (a slot's changes in push order), each with its segment (a push's update of the table), its row
    there and the row's version before it.  Made once per group size (:meth:`of`), searched per read."""

    slots: np.ndarray
    segment: np.ndarray
    row: np.ndarray
    old_versions: np.ndarray
    updates: list  # the segments (``TableUpdate``), in push order

    @classmethod
    def of(cls, pushes: list[AppliedPush], shard) -> "OpenChanges":
        empty = np.zeros(0, np.int64)
        return cls(empty, empty, empty, empty, []).extended(pushes, shard)

    def extended(self, pushes: list[AppliedPush], shard) -> "OpenChanges":
        """These changes and those of ``pushes`` (later pushes of the same group) to ``shard``'s table: the new
        ones sorted and merged after the old (a stable sort of two sorted runs is a merge: linear)."""
        updates = [u for p in pushes for u in p.tables if u.shard is shard and len(u.slots)]
        if not updates:
            return self
        lengths = np.array([len(u.slots) for u in updates], np.int64)
        slots = np.concatenate([self.slots] + [u.slots for u in updates]).astype(np.int64, copy=False)
        segment = np.concatenate([self.segment, len(self.updates) + np.repeat(np.arange(len(updates)), lengths)])
        row = np.concatenate([self.row, np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths,
                                                                                   lengths)])
        old = np.concatenate([self.old_versions] + [u.old_versions for u in updates])
        n = len(self.slots)  # the first n are sorted already: sort the new ones, then merge the two runs
        runs = np.concatenate([np.arange(n), n + np.argsort(slots[n:], kind="stable")])
        order = runs[np.argsort(slots[runs], kind="stable")]  # stable: a slot's older changes stay first
        return OpenChanges(slots[order], segment[order], row[order], old[order], self.updates + updates)


def before_group(changes: OpenChanges, slots: np.ndarray, payload: np.ndarray, versions: np.ndarray) -> None:
    """Rows ``slots`` of a table as they are now (``payload`` and ``versions``, changed in place) made what they
    were before an open group (``changes``: what it changed in that table): a row it changed gets its deltas XORed
    back out (they XOR to ``payload before the group's first push to it XOR payload now``) and the version it had
    before that push.  Rows it did not change stay as they are.  ``slots`` may repeat, in any order."""
    if not len(changes.slots) or not len(slots):
        return
    lo = np.searchsorted(changes.slots, slots, "left")
    count = np.searchsorted(changes.slots, slots, "right") - lo
    read = np.flatnonzero(count)  # the rows read that the group changed
    if not len(read):
        return
    versions[read] = changes.old_versions[lo[read]]  # before the group's first change to each
    counts = count[read]
    at = np.repeat(read, counts)  # each change to a row read, and where that row is in the read
    change = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(lo[read], counts)
    segment = changes.segment[change]
    for s in np.unique(segment):
        mine = segment == s  # within one segment every row read is at most once
        payload[at[mine]] ^= delta_of(changes.updates[s])[changes.row[change[mine]]]


def dense_before_group(pushes: list[AppliedPush], name: str, payload: np.ndarray) -> int | None:
    """Dense tensor ``name``'s payload bytes as they are now (changed in place) made what they were before
    ``pushes``; returns its version then, or None when none of them changed it (``payload`` unchanged)."""
    version = None
    for push in reversed(pushes):
        for u in push.dense:
            if u.dense.spec.name == name:
                np.bitwise_xor(payload, delta_of(u).reshape(-1), out=payload)
                version = u.old_version
    return version


def group_deltas(group: PushGroup, k: int) -> list[WidthDeltas]:
    """The group's deltas, one per row it changed, per row width (see :class:`WidthDeltas`), merged in one compiled
    pass over the pushes' own arrays (:func:`~ecrec.strategies.erasure.merge.merge_rows`)."""
    segments = [(u, p.seq) for p in group.pushes for u in p.tables if len(u.slots)]
    by_width: dict[int, dict] = {}
    for u, _ in segments:
        shard = u.shard
        by_width.setdefault(shard.spec.row_bytes, {})[shard] = shard.spec.name
    out = []
    for shards in by_width.values():
        names = sorted(shards.values())
        rank = {shard: names.index(name) for shard, name in shards.items()}
        mine = segments if len(by_width) == 1 else [seg for seg in segments if seg[0].shard in rank]
        counts, slots, deltas, old_versions, versions = merge_rows(
            [u.slots for u, _ in mine], [rank[u.shard] for u, _ in mine], [seq for _, seq in mine],
            [delta_of(u) for u, _ in mine], [u.old_versions for u, _ in mine], k, len(names))
        bounds = np.concatenate(([0], np.cumsum(counts.sum(axis=1))))
        out.append(WidthDeltas(names, bounds, counts, slots, deltas, old_versions, versions))
    return out


def build_batches(group: PushGroup, layout, source: int, source_id: str, counters=None,
                  sections: dict | None = None) -> dict[int, parity_pb2.ParityBatch]:
    """One :class:`ParityBatch` per destination index holding every delta of ``group`` meant for it (the merge's
    and the messages' CPU added to ``counters``' ``part_merge_cpu_s`` and ``part_build_cpu_s``).  With
    ``sections`` (a dict), the table entries' bulk fields stay arrays, in ``sections[destination]`` (one tuple
    per table entry, in :data:`~ecrec.strategies.erasure.batch_frames.FIELDS` order), and the batches carry the
    rest: what a frame carries (:mod:`~ecrec.strategies.erasure.batch_frames`), with no copy into protobuf.

    A data slot ``s`` of this server holds position ``p = s % k`` of a stripe in block ``s // k``; parity ``j``
    of that stripe is on server ``(source - p + k + j) % S`` at parity slot ``(s // k) * m + j``: the rows of
    one position go to one destination per parity index (:func:`group_deltas` keeps them together)."""
    batches: dict[int, parity_pb2.ParityBatch] = {}
    push_ids = [embedding_pb2.PushId(worker=w, sequence=q) for w, q in group.push_ids]

    def batch(destination: int) -> parity_pb2.ParityBatch:
        b = batches.get(destination)
        if b is None:
            b = batches[destination] = parity_pb2.ParityBatch(source=source, source_id=source_id, seq=group.last_seq,
                                                              first_seq=group.first_seq, push_ids=push_ids)
        return b

    k, m, servers = layout.k, layout.m, layout.num_servers
    t0 = time.thread_time()
    widths = group_deltas(group, k)
    t1 = time.thread_time()
    for w in widths:
        block = w.slots // k
        for p in range(k):
            b0, b1 = int(w.bounds[p]), int(w.bounds[p + 1])
            if b0 == b1:
                continue
            counts = w.counts[p].astype(np.int64)
            positions = np.full(b1 - b0, p, dtype=np.int64)
            block_p = block[b0:b1] * m
            if sections is not None:
                for j in range(m):  # parity j of each row's stripe; a row's parities are on distinct servers
                    d = (source - p + k + j) % servers
                    batch(d).tables.add(tables=w.names, parity=j)
                    sections.setdefault(d, []).append((counts, block_p + j, positions, w.deltas[b0:b1],
                                                       w.old_versions[b0:b1], w.versions[b0:b1]))
                continue
            fields = dict(tables=w.names, table_rows=counts.tobytes(), positions=positions.tobytes(),
                          deltas=w.deltas[b0:b1].tobytes(), old_versions=w.old_versions[b0:b1].tobytes(),
                          seqs=w.versions[b0:b1].tobytes())
            for j in range(m):  # parity j of each row's stripe; a row's parities are on distinct servers
                batch((source - p + k + j) % servers).tables.add(parity_slots=(block_p + j).tobytes(), parity=j,
                                                                 **fields)
    for name, (delta, old_version, version) in sorted(group.dense_deltas().items()):
        delta = delta.tobytes()
        for d in layout.dense_servers(name)[1:]:
            batch(d).dense.add(name=name, value=delta, old_version=old_version, seq=version)
            if sections is not None:  # a batch of dense deltas only is a frame too (no table entries)
                sections.setdefault(d, [])
    if counters is not None:
        counters.add("part_merge_cpu_s", t1 - t0)
        counters.add("part_build_cpu_s", time.thread_time() - t1)
    return batches
