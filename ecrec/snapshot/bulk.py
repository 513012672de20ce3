"""A server's part of a restore in bulk (``RestoreTable``): the rows it owns and the data rows of the stripes it
keeps parity of, read from the snapshot's files straight into its arrays, and its parity rows encoded from them,
one encode per stripe: no pushes, no deltas, no rows between servers.

A restore in bulk is only for a table no push ever changed (every row and parity row at version 0: no delta of
it exists anywhere), and it rewrites data and parity outside the protocol, so it runs in steps the client
(:func:`ecrec.snapshot.cluster.load`) drives on every server of the map, each guarded here so that no caller --
a worker included -- can make a server serve the table while its data and parity may disagree:

``BEGIN``
    this server not rebuilding (else it waits: ``UNAVAILABLE``), the table untouched here (no push applied) unless
    it is marked already, and the source readable (every file named, of the size, times and inode the client
    checked): the table is *marked*, and from now pushes and pulls of it are refused here as busy (``ABORTED``: a
    caller retries until its deadline).  A mark ``filled`` for a restore some peer finished is not replaced.
``FILL``
    only once every other server of the map has marked the table for the same source (each asked, server to
    server, after this one marked itself ``filling``): every owned row and parity row rewritten from the files,
    the rows checked as a push's are (finite, Adagrad accumulators >= 0), the files' sizes and times checked
    again after.  From its start the table is *rewritten* here until a FINISH.
``FINISH``
    only once every other server has filled it from the same source (or finished already): the table serves
    again.  A FINISH naming a source finishes only that one.
``ABORT``
    only where nothing was rewritten, and only while no other server fills or has filled (each asked after this
    one marked itself ``aborting``): the table serves again as it was.  A FILL and an ABORT on two servers each
    mark themselves before they ask the other, so at least one of them sees the other and refuses.

Every other server means every index of the map: one no server serves (failed, its replacement on its way) is a
refusal.  A server promoted while a restore is marked on its peers marks its own table too: ``filled`` when a
peer finished that restore (every server had filled it: the rebuild reads the files' rows), else ``begun``, as
rewritten where a peer is past BEGIN (what its rebuild read may be half filled), so the next restore fills it.  A
restore cut short leaves the table refused, never served half restored; loading the snapshot again (once the
cluster is redundant) finishes it.  A source is named by its digest (the table, the path, and the client's list
of chunks and of the files' sizes, times and inodes).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time

import numpy as np

from ecrec import errors
from ecrec.snapshot import files as snapshot_files
from ecrec.snapshot.tally import Tally
from ecrec.tables.values import check_values
from ecrec.net.cluster_map import live_servers
from ecrec.wire import embedding_pb2

Step = embedding_pb2.RestoreTableRequest
#: rows rewritten per hold of a shard's lock
FILL_BLOCK_ROWS = 1 << 16
#: how long a server waits for a peer's STATUS at FINISH
STATUS_TIMEOUT_S = 10.0
_NO_STATE = np.zeros((0, 0), np.float32)  # an SGD table's rows: weights only


@dataclasses.dataclass
class RestoreMark:
    """A table being restored in bulk here: the source's digest and this server's step: ``begun``, ``filling``,
    ``filled``, ``finishing`` or ``aborting`` (changed under the server's apply lock).  Whether rows were rewritten
    since the last FINISH is the shard's own (``TableShard.rewritten``): it outlives a mark replaced by another
    restore's BEGIN."""

    source: str
    state: str = "begun"


#: the steps in which a server holds the table for a restore (a peer that must not serve meanwhile)
MARKED = ("begun", "filling", "filled", "finishing", "aborting")


def source_digest(table: str, path: str, source_json: str) -> str:
    return hashlib.sha256(b"\0".join(s.encode() for s in (table, path, source_json))).hexdigest()[:32]


def file_stamp(path: str, name: str) -> list[int]:
    """What a file's identity is checked on: its size, modification and change times (ns; no program sets the
    change time) and inode."""
    st = os.stat(os.path.join(path, name))
    return [int(st.st_size), int(st.st_mtime_ns), int(st.st_ctime_ns), int(st.st_ino)]


def _integer(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _chunk(chunk: dict) -> dict:
    """A chunk of the source: its first row, rows, file, offset and length, checked as non-negative integers."""
    return {"start": _integer(chunk["offsets"][0]), "rows": _integer(chunk["sizes"][0]), "file": str(chunk["file"]),
            "offset": _integer(chunk["offset"]), "length": _integer(chunk["length"])}


class SnapshotRows:
    """A table's rows in a snapshot's files, mapped (the page cache, no copy): :meth:`gather` copies the rows of
    any ids into place."""

    def __init__(self, path: str, spec, source: dict, root: str | None = None):
        self.path, self.spec = path, spec
        state_width = spec.row_floats - spec.dim
        try:
            weights = [_chunk(c) for c in source["weight"]]
            states = {c["start"]: c for c in map(_chunk, source.get("state") or [])}
            self.stamps = {str(name): [_integer(v) for v in stamp] for name, stamp in source["files"].items()}
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise errors.InvalidRequest(f"source_json is malformed ({type(exc).__name__}: {exc})") from None
        for name, stamp in self.stamps.items():
            if not snapshot_files.DATA_FILE.match(name) or len(stamp) != 4:
                raise errors.InvalidRequest(f"file {name!r}: a plain name ending in .distcp with [size, mtime_ns, "
                                            "ctime_ns, inode] is expected")
            if root and not _within(os.path.realpath(os.path.join(path, name)), root):  # a link out of the root
                raise errors.PermissionDenied(f"{path}/{name} leads outside this server's --snapshot-root {root!r}")
        self.check_unchanged("before it is read")
        self.chunks = []  # (first row, one past the last, weights, state or an empty array), tiling the table
        covered = 0
        for chunk in sorted(weights, key=lambda c: c["start"]):
            start, rows = chunk["start"], chunk["rows"]
            state = states.get(start)
            if start != covered or rows <= 0 or (state_width and (state is None or state["rows"] != rows)):
                raise errors.InvalidRequest(f"table {spec.name!r}: the chunks do not tile its rows (at row {covered})")
            self.chunks.append((start, start + rows, self._map(chunk, [rows, spec.dim]),
                                self._map(state, [rows, state_width]) if state_width else _NO_STATE))
            covered += rows
        if covered != spec.num_rows:
            raise errors.InvalidRequest(f"table {spec.name!r}: the chunks cover {covered} of its {spec.num_rows} rows")

    def _map(self, chunk: dict, shape: list[int]) -> np.ndarray:
        name = chunk["file"]
        if name not in self.stamps:
            raise errors.InvalidRequest(f"file {name!r} of a chunk has no size and time in the source")
        try:
            array = snapshot_files.map_tensor(self.path, name, chunk["offset"], chunk["length"], shape)
        except FileNotFoundError:
            raise errors.FailedPrecondition(f"{self.path}/{name} cannot be read here") from None
        except (OSError, ValueError) as exc:
            raise errors.FailedPrecondition(f"{self.path}/{name}: the item at {chunk['offset']} is not float32 "
                                            f"{shape} ({type(exc).__name__}: {exc})") from None
        if list(array.shape) != shape or array.dtype != np.float32:
            raise errors.FailedPrecondition(f"{self.path}/{name}: the item at {chunk['offset']} holds {array.dtype} "
                                            f"{list(array.shape)}, not float32 {shape}")
        return np.asarray(array)  # a plain array over the mapping (what the gather kernel takes)

    def check_unchanged(self, when: str) -> None:
        """Every file as the client checked it (:func:`file_stamp`): else ``FailedPrecondition``."""
        for name, stamp in self.stamps.items():
            try:
                now = file_stamp(self.path, name)
            except OSError as exc:
                raise errors.FailedPrecondition(f"{self.path}/{name} cannot be read here ({exc.strerror})") from None
            if now != stamp:
                raise errors.FailedPrecondition(f"{self.path}/{name} changed since the restore checked it ({when}: "
                                                f"size, mtime_ns, ctime_ns, inode {now}, checked {stamp}); nothing "
                                                "is trusted")

    def gather(self, ids: np.ndarray, out: np.ndarray, at: np.ndarray) -> None:
        """Rows ``ids`` (weights then state) into ``out[at]`` (float32 ``(n, row_floats)``), each row copied once
        from the mapped file; ids past the table (a stripe's virtual rows) are left as they are."""
        kernel = gather_kernel()
        for start, stop, weights, state in self.chunks:
            where = np.flatnonzero((ids >= start) & (ids < stop))
            if len(where):
                kernel(weights, state, ids[where] - start, out, at[where])


def warm_up() -> None:
    """Compiles (or loads from numba's disk cache) the gather for a snapshot's mapped arrays (read-only) of
    both kinds of table: a server does this before it registers, a restore's fill does not wait for it."""
    kernel = gather_kernel()
    mapped = np.zeros((1, 2), np.float32)
    mapped.flags.writeable = False
    none, out = np.zeros(0, np.int64), np.zeros((0, 4), np.float32)
    kernel(mapped, mapped, none, out, none)
    kernel(mapped, _NO_STATE, none, out, none)


@functools.lru_cache(maxsize=1)
def gather_kernel():
    """``kernel(weights, state, rows, out, places)``: ``out[places[r]] = weights[rows[r]] | state[rows[r]]`` (numba,
    cached on disk; ``nogil``): one copy per row, no temporaries.  A server loads it before it registers
    (:func:`warm_up`)."""
    from numba import njit

    @njit(cache=True, nogil=True, boundscheck=False)
    def gather(weights, state, rows, out, places):  # pragma: no cover - numba
        dim, width = weights.shape[1], state.shape[1]
        for r in range(rows.shape[0]):
            target = out[places[r]]
            source = weights[rows[r]]
            for c in range(dim):
                target[c] = source[c]
            if width:
                source = state[rows[r]]
                for c in range(width):
                    target[dim + c] = source[c]
    return gather


def handle(state, request) -> embedding_pb2.RestoreTableReply:
    """One step of a restore in bulk here (see the module docstring)."""
    step = request.step
    if step == Step.STATUS and not request.table:  # every table here (a promoted peer's question)
        tables = {}
        for shard in state.tables():
            mark = shard.restore
            tables[shard.name] = {"state": mark.state if mark else "serving", "rewritten": shard.rewritten,
                                  "source": mark.source if mark else shard.restored_from}
        return embedding_pb2.RestoreTableReply(state="", parts_json=json.dumps({"tables": tables}))
    shard = state.table(request.table)
    if step == Step.STATUS:
        return _reply(shard)
    if step == Step.ABORT:
        return _abort(state, shard)
    if step == Step.FINISH:
        return _finish(state, shard, source_digest(shard.name, request.path, request.source_json)
                       if request.source_json else None)
    if step not in (Step.BEGIN, Step.FILL):
        raise errors.InvalidRequest(f"step {step}: one of STATUS, BEGIN, FILL, FINISH, ABORT")
    path = _check_path(state, request.path)
    try:
        source = json.loads(request.source_json)
    except ValueError as exc:
        raise errors.InvalidRequest(f"source_json is not JSON: {exc}") from None
    if not isinstance(source, dict):
        raise errors.InvalidRequest("source_json must be a JSON object")
    digest = source_digest(shard.name, path, request.source_json)
    strategy = state.strategy
    if not strategy.fills_in_bulk:
        raise errors.FailedPrecondition(f"strategy {strategy.name!r} restores tables by pushes, not in bulk")
    rows = SnapshotRows(path, shard.spec, source, root=state.config.snapshot_root)  # readable, as checked, tiling
    if step == Step.BEGIN:
        mark = shard.restore
        if mark is not None and mark.state == "filled" and mark.source != digest:
            # a restore every server filled and a peer may have finished: finish it first (FINISH of any source)
            for index, reply in _peer_statuses(state, shard):
                if reply.state == "serving" and reply.source == mark.source:
                    raise errors.FailedPrecondition(f"table {shard.name!r} is filled here by a restore server {index} "
                                                    "finished: FINISH it before another restore begins")
        with state.apply_lock:  # no push applies meanwhile: after this, none of this table does
            if strategy.is_recovering():
                raise errors.Unavailable("this server rebuilds after a promotion: a restore in bulk begins once it "
                                         "is redundant again; retry")
            if shard.restore is not mark:
                raise errors.Unavailable(f"table {shard.name!r}: another restore's step came meanwhile; retry")
            if mark is None:
                if not shard.rewritten:
                    strategy.check_fill(shard)
                    if shard.touched():
                        raise errors.FailedPrecondition(f"table {shard.name!r} has rows changed by pushes here: a "
                                                        "restore into it goes by pushes")
            elif mark.state in ("filling", "finishing", "aborting"):  # never two sources, never mid-step
                raise errors.Unavailable(f"table {shard.name!r} is {mark.state} here for a restore; retry when "
                                         "that ends")
            if mark is None or mark.source != digest:
                shard.restore = RestoreMark(digest)
        return _reply(shard)
    return _fill(state, shard, rows, digest)


def _fill(state, shard, rows: "SnapshotRows", digest: str) -> embedding_pb2.RestoreTableReply:
    strategy = state.strategy
    with state.apply_lock:
        mark = shard.restore
        if mark is None or mark.source != digest:
            raise errors.FailedPrecondition(f"table {shard.name!r} was not begun for this restore here (BEGIN first)")
        if mark.state == "filled":  # its rows and parity hold the files already (nothing served them since)
            return _reply(shard)
        if mark.state != "begun":
            raise errors.Unavailable(f"table {shard.name!r} is {mark.state} here; retry when that ends")
        strategy.check_fill(shard)  # not rebuilding (its rows would be installed over the files'), no delta
        before, mark.state = mark.state, "filling"  # first; then the peers (an ABORT there sees this)
    try:
        _peers_agree(state, shard, digest, ("begun", "filling", "filled"), "begun for this restore")
    except BaseException:
        with state.apply_lock:
            mark.state = before  # nothing was written
        raise
    t0 = time.perf_counter()
    tally = Tally()
    try:
        with state.apply_lock:
            shard.rewritten = True
            shard.fills += 1  # a read that began before sees it changed (ecrec.server.state.serving_table)
        with tally.cpu("rows_s"):
            filled = shard.fill_from(rows.gather, FILL_BLOCK_ROWS, check=lambda block: _check(shard, block, tally))
        with tally.cpu("parity_s"):
            parity_rows = strategy.fill_redundancy(shard, rows.gather)
        rows.check_unchanged("after it was read")
    except BaseException:
        with state.apply_lock:
            mark.state = "begun"  # rows rewritten in part: filled again before anything serves them
        raise
    with state.apply_lock:
        mark.state = "filled"
    parts = {"cpu_s": tally.as_dict(), "rows": int(filled), "parity_rows": int(parity_rows)}
    return _reply(shard, seconds=time.perf_counter() - t0, parts=parts)


def _check(shard, block: np.ndarray, tally: Tally) -> None:
    with tally.cpu("check_s"):
        try:
            check_values(shard.spec, block, "payload")
        except ValueError as exc:
            raise errors.InvalidRequest(f"the snapshot's rows cannot be restored: {exc}; the table stays refused "
                                        "until a restore finishes") from None


def _finish(state, shard, wanted: str | None) -> embedding_pb2.RestoreTableReply:
    """FINISH of the restore marked here; ``wanted``: the digest of the source the caller restores (None: any)."""
    with state.apply_lock:
        mark = shard.restore
        source = mark.source if mark is not None else shard.restored_from
        if wanted is not None and source != wanted:
            raise errors.FailedPrecondition(f"table {shard.name!r} is {mark.state if mark else 'serving'} here for "
                                            "another restore's source")
        if mark is None:
            if shard.restored_from:
                return _reply(shard)  # finished already (a retried FINISH)
            raise errors.FailedPrecondition(f"table {shard.name!r} is not being restored here")
        if mark.state != "filled":
            raise errors.FailedPrecondition(f"table {shard.name!r} is {mark.state} here, not filled: FILL first")
        mark.state = "finishing"  # a FILL or BEGIN meanwhile waits
    try:
        _peers_agree(state, shard, mark.source, ("filled", "finishing", "serving"), "filled from this restore")
    except BaseException:
        with state.apply_lock:
            mark.state = "filled"
        raise
    with state.apply_lock:
        shard.restore, shard.rewritten, shard.restored_from = None, False, mark.source
    return _reply(shard)


def _abort(state, shard) -> embedding_pb2.RestoreTableReply:
    with state.apply_lock:
        mark = shard.restore
        if mark is None:
            return _reply(shard)
        if shard.rewritten or mark.state != "begun":
            raise errors.FailedPrecondition(f"table {shard.name!r} was {'rewritten' if shard.rewritten else mark.state} "
                                            "here: it serves again only once every server filled it (FINISH)")
        mark.state = "aborting"  # first; then the peers (a FILL there sees this)
    try:
        for index, reply in _peer_statuses(state, shard):
            if reply.state not in ("begun", "aborting", "serving") or reply.rewritten:
                raise errors.FailedPrecondition(f"server {index} {'rewrote' if reply.rewritten else 'is ' + reply.state} "
                                                f"table {shard.name!r}: it serves again only once every server filled "
                                                "it (FINISH)")
    except BaseException:
        with state.apply_lock:
            mark.state = "begun"
        raise
    with state.apply_lock:
        shard.restore = None
    return _reply(shard)


def _peer_statuses(state, shard):
    """``(index, RestoreTableReply)`` of STATUS of ``shard`` at the server serving every other index of the map; an
    index no server serves (failed, its replacement being promoted) is a refusal: what it will hold is unknown."""
    request = embedding_pb2.RestoreTableRequest(step=Step.STATUS, table=shard.name)
    m = state.map
    live = live_servers(m) if m is not None else {}
    for index in range(m.num_servers if m is not None else 0):
        s = live.get(index)
        if s is None:
            raise errors.Unavailable(f"no server serves index {index} now (a failure being handled); retry")
        if s.server_id == state.server_id:
            continue
        try:
            reply = state.peers.stub(s.address).RestoreTable(request, timeout=STATUS_TIMEOUT_S,
                                                              metadata=state.peers.metadata())
        except Exception as exc:  # noqa: BLE001 - any failure to confirm is a refusal
            code = getattr(exc, "code", lambda: None)()
            raise errors.Unavailable(f"server {s.index} ({s.address}) could not say where it is with table "
                                     f"{shard.name!r} ({code.name if code else type(exc).__name__}); retry") from None
        yield s.index, reply


def _peers_agree(state, shard, digest: str, states: tuple, what: str) -> None:
    for index, reply in _peer_statuses(state, shard):
        if reply.source != digest or reply.state not in states:
            raise errors.FailedPrecondition(f"server {index} has not {what} table {shard.name!r} (it is "
                                            f"{reply.state}): data and parity could disagree; nothing changed here")


def adopt_marks(state) -> None:
    """A promoted server's tables marked as its peers' are: where a peer holds a restore of a table (any step), this
    server marks it too -- ``filled`` when a peer already finished that restore (every server had filled it, so
    the rebuild reads the files' rows), else ``begun``, as rewritten when a peer rewrote its rows or is past
    BEGIN (what the rebuild reads may be half filled).  One STATUS per peer; a peer that cannot answer is
    skipped."""
    request = embedding_pb2.RestoreTableRequest(step=Step.STATUS)
    m = state.map
    seen: dict[str, list[dict]] = {}
    for s in (live_servers(m).values() if m is not None else ()):
        if s.server_id == state.server_id:
            continue
        try:
            reply = state.peers.stub(s.address).RestoreTable(request, timeout=STATUS_TIMEOUT_S,
                                                              metadata=state.peers.metadata())
            for name, table in json.loads(reply.parts_json or "{}").get("tables", {}).items():
                seen.setdefault(name, []).append(table)
        except Exception:  # noqa: BLE001 - an older release, or a peer gone: nothing to adopt from it
            continue
    for name, tables in seen.items():
        marked = [t for t in tables if t.get("state") in MARKED]
        if not marked:
            continue
        source = marked[0]["source"]
        finished = any(t.get("state") == "serving" and t.get("source") == source for t in tables)
        rewritten = finished or any(t.get("rewritten") or t.get("state") in ("filling", "filled", "finishing")
                                    for t in tables)
        try:
            shard = state.table(name)
        except errors.NotFound:
            continue
        with state.apply_lock:
            shard.restore = RestoreMark(source, "filled" if finished else "begun")
            shard.rewritten = rewritten


def _reply(shard, seconds: float = 0.0, parts: dict | None = None) -> embedding_pb2.RestoreTableReply:
    mark = shard.restore
    if mark is None:
        return embedding_pb2.RestoreTableReply(state="serving", source=shard.restored_from or "",
                                               rewritten=shard.rewritten)
    return embedding_pb2.RestoreTableReply(state=mark.state, source=mark.source, seconds=seconds,
                                           parts_json=json.dumps(parts or {}), rewritten=shard.rewritten)


def _check_path(state, path: str) -> str:
    if not path or snapshot_files.is_url(path) or not os.path.isabs(path):
        raise errors.InvalidRequest(f"snapshot path {path!r}: a restore in bulk reads a local absolute path")
    root = state.config.snapshot_root
    if root and not _within(path, root):
        raise errors.PermissionDenied(f"snapshot path {path!r} is outside this server's --snapshot-root {root!r}")
    return path


def _within(path: str, root: str) -> bool:
    from ecrec.snapshot.part import _within as within

    return within(path, root)
