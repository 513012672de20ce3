"""Checkpoint files: atomic writes, a manifest with checksums, verified loads.

Layout under the checkpoint root (a local directory, or any URL fsspec understands)::

    server-<index>/ckpt-<seq:08d>/                 a full checkpoint of one server's shard
        table-<j:03d>.bin                          ids (int64 LE) | payload rows (uint8) [| counts (int64 LE)]
        dense-<j:03d>.bin                          one dense tensor's payload (float32 LE)
        MANIFEST.json                              written last: files, sizes, sha256, counters
    server-<index>/ckpt-<seq:08d>.delta-<k:06d>/   a partial save (MFU/SSU) on top of base <seq>

or, *packed* (``write_checkpoint(..., packed=True)``; the strategies' ``files=one``), every table and
dense tensor of a checkpoint in one file written once and fsynced once, each at its offset::

    server-<index>/ckpt-<seq:08d>/
        data.bin                                   the table and dense records above, one after another
        MANIFEST.json                              written last: each record's offset, size, sha256

(a packed checkpoint costs one data file and its fsync, then the manifest's, where the per-file layout
costs a file, an fsync and a directory fsync per table and dense tensor).

A table file holds the owned rows' global ids and their payload (weights then optimizer
state); a delta's table file also holds, per row, the number of row updates since the
base snapshot that its payload reflects (the exact loss accounting of ``baselines.cpr``).

Every file of the per-file layout is written to a temporary name and renamed (``os.replace`` plus fsync of the
file and directory on a local path; ``fs.mv`` through fsspec elsewhere).  The manifest is
written last, so a checkpoint without one is *incomplete* (torn: the writer died), and a
checkpoint whose files do not match the manifest's sizes and sha256 is *corrupt*.  Neither
is ever loaded: :func:`load_checkpoint` verifies every file before returning anything and
raises :class:`CheckpointCorrupt` / :class:`CheckpointIncomplete` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

FORMAT = "ecrec-cpr/1"  # the per-file layout's manifest
FORMAT_PACKED = "ecrec-cpr/2"  # a packed checkpoint's manifest: its records have offsets into one data file
FORMATS = (FORMAT, FORMAT_PACKED)
MANIFEST = "MANIFEST.json"
PACKED = "data.bin"  # the one data file of a packed checkpoint
INT64 = np.dtype("<i8")
FLOAT32 = np.dtype("<f4")
_CKPT = re.compile(r"^ckpt-(\d{8})(?:\.delta-(\d{6}))?$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (missing, incomplete, corrupt, or for another layout)."""


class CheckpointIncomplete(CheckpointError):
    """The checkpoint has no manifest: its writer died before committing it (a torn write)."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file does not match its manifest (size or sha256), or the manifest is unreadable."""


# --- storage backends ---------------------------------------------------------------------------------

class Storage:
    """Relative-path file operations under one root; :meth:`open` picks the backend for a URL."""

    url: str

    @staticmethod
    def open(url: str) -> "Storage":
        if not url:
            raise ValueError("checkpoint directory is empty")
        if "://" in url:
            return FsspecStorage(url)
        return LocalStorage(url)

    def describe(self, rel: str) -> str:
        return f"{self.url.rstrip('/')}/{rel}"

    @property
    def process_local(self) -> str | None:
        """Why only this process sees what is written here (e.g. fsspec's ``memory://``), or None when other
        processes on the same hosts see it too."""
        return None

    def write_atomic(self, rel: str, chunks: list) -> tuple[int, str]:  # pragma: no cover - interface
        raise NotImplementedError

    def write_new(self, rel: str, chunks: list, digest: bool = True) -> tuple[int, str | None]:
        """Writes a new file (never over an existing one) durably, without a temporary name and a rename: for a
        file nothing reads before a manifest written after it names it (a packed checkpoint's data).  Returns
        ``(size, sha256 hex)`` (``digest=False``: ``(size, None)``, for a caller that hashed the parts)."""
        raise NotImplementedError  # pragma: no cover - interface

    def drop_cache(self, rel: str) -> None:
        """Evicts the file from the page cache where that is possible (a local file), so that the next read
        comes from the device, as a reload on another machine would."""

    def read(self, rel: str) -> bytes:  # pragma: no cover - interface
        raise NotImplementedError

    def listdir(self, rel: str) -> list[str]:  # pragma: no cover - interface
        raise NotImplementedError

    def remove_tree(self, rel: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def _byte_views(chunks: list):
    """Byte views of the chunks; empty ones are skipped (a zero-size array view cannot be cast)."""
    for c in chunks:
        if getattr(c, "nbytes", len(c)):
            yield memoryview(c).cast("B")


def _write_chunks(f, chunks: list, digest: bool = True) -> tuple[int, str | None]:
    """Writes the chunks to ``f`` (None: only hashes them); returns ``(size, sha256 hex)`` (``digest=False``:
    ``(size, None)``, nothing hashed)."""
    h = hashlib.sha256() if digest else None
    size = 0
    for mv in _byte_views(chunks):
        if f is not None:
            f.write(mv)
        if h is not None:
            h.update(mv)
        size += mv.nbytes
    return size, h.hexdigest() if h is not None else None


def _hash_chunks(chunks: list) -> tuple[int, str]:
    return _write_chunks(None, chunks)



class LocalStorage(Storage):
    """A local directory: temp file in the same directory, fsync, ``os.replace``, fsync of the directory."""

    def __init__(self, root: str):
        self.url = os.path.abspath(root)
        self.root = self.url

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/"))

    def write_atomic(self, rel: str, chunks: list) -> tuple[int, str]:
        path = self._path(rel)
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-" + os.path.basename(path) + ".")
        try:
            with os.fdopen(fd, "wb") as f:
                size, digest = _write_chunks(f, chunks)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return size, digest

    def write_new(self, rel: str, chunks: list, digest: bool = True) -> tuple[int, str | None]:
        path = self._path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "xb") as f:  # never over an existing file
            out = _write_chunks(f, chunks, digest)
            f.flush()
            os.fsync(f.fileno())
        return out

    def drop_cache(self, rel: str) -> None:
        try:
            fd = os.open(self._path(rel), os.O_RDONLY)
        except OSError:
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages (fsynced) are dropped
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)

    def read(self, rel: str) -> bytes:
        with open(self._path(rel), "rb") as f:
            return f.read()

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(rel)))
        except FileNotFoundError:
            return []

    def remove_tree(self, rel: str) -> None:
        shutil.rmtree(self._path(rel), ignore_errors=False)


class FsspecStorage(Storage):
    """Any fsspec URL (``s3://``, ``gs://``, ``file://``, ``memory://``...): write a temp object, then ``mv``.

    On object stores ``mv`` is a copy and a delete, not atomic; safety comes from the
    manifest, written last and trusted only when every file it lists verifies.
    """

    def __init__(self, url: str):
        try:
            import fsspec  # noqa: F401  (an optional dependency: only URLs need it)
            from fsspec.core import url_to_fs
        except ImportError:  # pragma: no cover - fsspec ships with torch
            raise ValueError(f"checkpoint URL {url!r} needs fsspec: pip install fsspec") from None
        self.url = url
        try:
            self.fs, self.root = url_to_fs(url)
        except (ValueError, ImportError) as exc:
            raise ValueError(f"checkpoint URL {url!r}: {exc}") from None
        self.root = self.root.rstrip("/")

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    @property
    def process_local(self) -> str | None:
        from fsspec.implementations.memory import MemoryFileSystem

        fs = self.fs
        while fs is not None:  # cached or wrapped filesystems hold the target in ``.fs``
            if isinstance(fs, MemoryFileSystem):
                return "fsspec's memory filesystem lives inside one process"
            fs = getattr(fs, "fs", None)
        return None

    def write_atomic(self, rel: str, chunks: list) -> tuple[int, str]:
        path = self._path(rel)
        parent = path.rsplit("/", 1)[0]
        tmp = f"{parent}/.tmp-{path.rsplit('/', 1)[1]}.{uuid.uuid4().hex[:8]}"
        self.fs.makedirs(parent, exist_ok=True)
        try:
            with self.fs.open(tmp, "wb") as f:
                size, digest = _write_chunks(f, chunks)
            self.fs.mv(tmp, path)
        except BaseException:
            try:
                if self.fs.exists(tmp):
                    self.fs.rm(tmp)
            except Exception:  # noqa: BLE001 - best effort cleanup; the original error is raised
                pass
            raise
        return size, digest

    def write_new(self, rel: str, chunks: list, digest: bool = True) -> tuple[int, str | None]:
        """Straight to its name (an object store's ``mv`` is a copy and a delete: the data would be written
        twice); the manifest written after it is the commit, and a file already there is never written over."""
        path = self._path(rel)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        if self.fs.exists(path):
            raise FileExistsError(f"{self.describe(rel)} exists; a checkpoint file is never written over")
        with self.fs.open(path, "wb") as f:
            return _write_chunks(f, chunks, digest)

    def drop_cache(self, rel: str) -> None:
        from fsspec.implementations.local import LocalFileSystem

        if isinstance(self.fs, LocalFileSystem):  # file://: a local file, as LocalStorage drops it
            LocalStorage(self.root).drop_cache(rel)

    def read(self, rel: str) -> bytes:
        return self.fs.cat_file(self._path(rel))

    def listdir(self, rel: str) -> list[str]:
        path = self._path(rel)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def remove_tree(self, rel: str) -> None:
        self.fs.rm(self._path(rel), recursive=True)


class Throttled(Storage):
    """Another storage at most ``bytes_per_s`` each way, shared by every caller of this object (one server's
    link): each write or read books its bytes' time on its direction's link after the bookings before it and
    returns when that time is over.  A remote store's bandwidth on a local disk, for benchmarks."""

    def __init__(self, inner: Storage, bytes_per_s: float):
        if not (bytes_per_s > 0 and math.isfinite(bytes_per_s)):
            raise ValueError(f"bandwidth must be finite and > 0 bytes/s, got {bytes_per_s!r}")
        self.inner, self.bytes_per_s, self.url = inner, float(bytes_per_s), inner.url
        self._lock = threading.Lock()
        self._free_at = {"write": 0.0, "read": 0.0}  # when each direction's link is free again

    @property
    def process_local(self) -> str | None:
        return self.inner.process_local

    def _wait(self, direction: str, nbytes: int, t0: float) -> None:
        with self._lock:
            end = max(self._free_at[direction], t0) + nbytes / self.bytes_per_s
            self._free_at[direction] = end
        rest = end - time.perf_counter()
        if rest > 0:
            time.sleep(rest)

    def write_atomic(self, rel: str, chunks: list) -> tuple[int, str]:
        t0 = time.perf_counter()
        out = self.inner.write_atomic(rel, chunks)
        self._wait("write", out[0], t0)
        return out

    def write_new(self, rel: str, chunks: list, digest: bool = True) -> tuple[int, str | None]:
        t0 = time.perf_counter()
        out = self.inner.write_new(rel, chunks, digest)
        self._wait("write", out[0], t0)
        return out

    def drop_cache(self, rel: str) -> None:
        self.inner.drop_cache(rel)

    def read(self, rel: str) -> bytes:
        t0 = time.perf_counter()
        data = self.inner.read(rel)
        self._wait("read", len(data), t0)
        return data

    def listdir(self, rel: str) -> list[str]:
        return self.inner.listdir(rel)

    def remove_tree(self, rel: str) -> None:
        self.inner.remove_tree(rel)


# --- what a checkpoint holds --------------------------------------------------------------------------

@dataclass
class TableSnapshot:
    name: str
    spec: dict  # num_rows, dim, optimizer, row_bytes (checked against the live table on load)
    ids: np.ndarray  # int64 global row ids
    payload: np.ndarray  # (len(ids), row_bytes) uint8
    row_updates: int  # the table's row-update counter at snapshot time (updates this payload reflects)
    counts: np.ndarray | None = None  # deltas: per row, updates since the base snapshot it reflects


@dataclass
class DenseSnapshot:
    name: str
    floats: np.ndarray  # 1-D float32 payload (weights then optimizer state)


@dataclass
class Snapshot:
    server_index: int
    seq: int
    kind: str  # "full" | "delta"
    strategy: str
    tables: list[TableSnapshot] = field(default_factory=list)
    dense: list[DenseSnapshot] = field(default_factory=list)
    delta: int | None = None  # delta number (kind == "delta")
    cut: int | None = None  # the driver's consistent-cut id (worker-driven saves)
    step: int | None = None  # the worker's next step at that cut
    wall_time: float = 0.0
    snapshot_s: float = 0.0
    cluster: str = ""  # the cluster it was saved by (``StrategyHost.cluster_id``): no other cluster restores it

    @property
    def dirname(self) -> str:
        return checkpoint_dir(self.server_index, self.seq, self.delta if self.kind == "delta" else None)


@dataclass
class LoadedCheckpoint:
    dirname: str
    manifest: dict
    tables: dict[str, TableSnapshot]
    dense: dict[str, np.ndarray]
    bytes_read: int


def server_dir(index: int) -> str:
    return f"server-{int(index)}"


def checkpoint_dir(index: int, seq: int, delta: int | None = None) -> str:
    name = f"ckpt-{int(seq):08d}" + (f".delta-{int(delta):06d}" if delta is not None else "")
    return f"{server_dir(index)}/{name}"


# --- write ----------------------------------------------------------------------------------------------

def write_checkpoint(storage: Storage, snap: Snapshot, packed: bool = False) -> dict:
    """Writes every file (``packed``: the one data file) then the manifest; returns the manifest (with
    ``bytes`` written)."""
    if packed:
        return _write_packed(storage, snap)
    d = snap.dirname
    tables, dense = [], []
    total = 0
    for j, t in enumerate(snap.tables):
        fname = f"table-{j:03d}.bin"
        size, digest = storage.write_atomic(f"{d}/{fname}", _table_chunks(t))
        total += size
        tables.append(_table_entry(t, file=fname, size=size, sha256=digest))
    for j, dn in enumerate(snap.dense):
        floats = np.ascontiguousarray(dn.floats, dtype=FLOAT32).reshape(-1)
        fname = f"dense-{j:03d}.bin"
        size, digest = storage.write_atomic(f"{d}/{fname}", [floats])
        total += size
        dense.append({"name": dn.name, "file": fname, "floats": int(floats.size), "size": size, "sha256": digest})
    return _commit(storage, snap, tables, dense, total)


def _table_entry(t: TableSnapshot, **where) -> dict:
    return {"name": t.name, **where, "rows": int(len(t.ids)), "row_bytes": int(t.spec["row_bytes"]), "spec": t.spec,
            "row_updates": int(t.row_updates), "has_counts": t.counts is not None}


def _table_chunks(t: TableSnapshot) -> list:
    ids = np.ascontiguousarray(t.ids, dtype=INT64)
    payload = np.ascontiguousarray(t.payload, dtype=np.uint8)
    if payload.shape != (len(ids), int(t.spec["row_bytes"])):
        raise ValueError(f"table {t.name!r}: payload {payload.shape} does not match {len(ids)} ids x {t.spec['row_bytes']} bytes")
    chunks = [ids, payload]
    if t.counts is not None:
        counts = np.ascontiguousarray(t.counts, dtype=INT64)
        if counts.shape != ids.shape:
            raise ValueError(f"table {t.name!r}: {len(counts)} counts for {len(ids)} ids")
        chunks.append(counts)
    return chunks


def _write_packed(storage: Storage, snap: Snapshot) -> dict:
    """One data file (every record at its offset, hashed record by record while written), then the manifest."""
    records = [(t, _table_chunks(t)) for t in snap.tables]
    records += [(dn, [np.ascontiguousarray(dn.floats, dtype=FLOAT32).reshape(-1)]) for dn in snap.dense]
    entries, offset, chunks = [], 0, []
    for item, parts in records:
        size, digest = _hash_chunks(parts)
        entries.append((item, offset, size, digest))
        offset += size
        chunks += parts
    total, _ = storage.write_new(f"{snap.dirname}/{PACKED}", chunks, digest=False)  # each record hashed above
    tables, dense = [], []
    for item, off, size, digest in entries:
        where = {"file": PACKED, "offset": off, "size": size, "sha256": digest}
        if isinstance(item, TableSnapshot):
            tables.append(_table_entry(item, **where))
        else:
            dense.append({"name": item.name, "floats": int(np.asarray(item.floats).size), **where})
    return _commit(storage, snap, tables, dense, total, FORMAT_PACKED)


def _commit(storage: Storage, snap: Snapshot, tables: list, dense: list, total: int, fmt: str = FORMAT) -> dict:
    manifest = {
        "format": fmt, "kind": snap.kind, "server_index": snap.server_index, "seq": snap.seq,
        "delta": snap.delta, "cut": snap.cut, "step": snap.step, "strategy": snap.strategy, "cluster": snap.cluster,
        "wall_time": snap.wall_time, "snapshot_s": snap.snapshot_s, "written_at": time.time(),
        "tables": tables, "dense": dense,
    }
    body = json.dumps(manifest, indent=1, sort_keys=True).encode()
    size, _ = storage.write_atomic(f"{snap.dirname}/{MANIFEST}", [body])
    manifest["bytes"] = total + size
    return manifest


# --- read -----------------------------------------------------------------------------------------------

def read_manifest(storage: Storage, dirname: str) -> dict:
    """The manifest of ``dirname``; raises :class:`CheckpointIncomplete` or :class:`CheckpointCorrupt`."""
    where = storage.describe(f"{dirname}/{MANIFEST}")
    try:
        raw = storage.read(f"{dirname}/{MANIFEST}")
    except FileNotFoundError:
        raise CheckpointIncomplete(f"checkpoint {storage.describe(dirname)} has no {MANIFEST}: "
                                   "its write never finished (torn); refusing to load it") from None
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointCorrupt(f"{where} is not valid JSON ({exc}); refusing to load the checkpoint") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS:
        raise CheckpointCorrupt(f"{where}: not an {' or '.join(FORMATS)} manifest; refusing to load the checkpoint")
    return manifest


def _verified(storage: Storage, dirname: str, entry: dict, files: dict | None = None) -> bytes:
    """The bytes of one manifest entry, checked against its size and sha256 (``files``: the files read so far,
    so that the records of a packed checkpoint are read from one read of its data file)."""
    where = storage.describe(f"{dirname}/{entry['file']}")
    files = {} if files is None else files
    try:
        whole = files.get(entry["file"])
        if whole is None:
            storage.drop_cache(f"{dirname}/{entry['file']}")
            whole = files[entry["file"]] = storage.read(f"{dirname}/{entry['file']}")
    except FileNotFoundError:
        raise CheckpointCorrupt(f"checkpoint file {where} listed in the manifest is missing; refusing to load") from None
    data = whole
    if "offset" in entry:
        off = int(entry["offset"])
        data = memoryview(whole)[off:off + int(entry["size"])]
        where += f" (record at offset {off})"
    if len(data) != entry["size"]:
        raise CheckpointCorrupt(f"checkpoint file {where} has {len(data)} bytes, the manifest says {entry['size']} "
                                "(truncated or torn); refusing to load")
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise CheckpointCorrupt(f"checkpoint file {where} is corrupt: sha256 {digest[:16]}... does not match the "
                                f"manifest's {entry['sha256'][:16]}...; refusing to load")
    return data


def load_checkpoint(storage: Storage, dirname: str) -> LoadedCheckpoint:
    """Reads and verifies every file of ``dirname`` (nothing is returned unless all verify)."""
    manifest = read_manifest(storage, dirname)
    tables: dict[str, TableSnapshot] = {}
    dense: dict[str, np.ndarray] = {}
    files: dict[str, bytes] = {}
    nbytes = 0
    try:
        for e in manifest["tables"]:
            data = _verified(storage, dirname, e, files)
            nbytes += len(data)
            n, rb = int(e["rows"]), int(e["row_bytes"])
            want = n * 8 + n * rb + (n * 8 if e["has_counts"] else 0)
            if want != len(data):
                raise CheckpointCorrupt(f"{storage.describe(dirname + '/' + e['file'])}: {len(data)} bytes but "
                                        f"{n} rows x {rb} bytes need {want}")
            ids = np.frombuffer(data, dtype=INT64, count=n).astype(np.int64)
            payload = np.frombuffer(data, dtype=np.uint8, count=n * rb, offset=n * 8).reshape(n, rb)
            counts = (np.frombuffer(data, dtype=INT64, count=n, offset=n * 8 + n * rb).astype(np.int64)
                      if e["has_counts"] else None)
            tables[e["name"]] = TableSnapshot(e["name"], e["spec"], ids, payload, int(e["row_updates"]), counts)
        for e in manifest["dense"]:
            data = _verified(storage, dirname, e, files)
            nbytes += len(data)
            dense[e["name"]] = np.frombuffer(data, dtype=FLOAT32).astype(np.float32)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointCorrupt(f"{storage.describe(dirname + '/' + MANIFEST)} is malformed ({type(exc).__name__}: {exc}); "
                                "refusing to load") from None
    return LoadedCheckpoint(dirname, manifest, tables, dense, nbytes)


@dataclass
class Entry:
    """One checkpoint directory of a server, as listed (``complete``: its manifest exists)."""

    seq: int
    delta: int | None
    dirname: str
    complete: bool


def scan(storage: Storage, index: int) -> list[Entry]:
    """Every checkpoint directory of server ``index``, ordered by (seq, delta); full before its deltas."""
    out = []
    base = server_dir(index)
    for name in storage.listdir(base):
        m = _CKPT.match(name)
        if not m:
            continue
        seq, delta = int(m.group(1)), (int(m.group(2)) if m.group(2) else None)
        rel = f"{base}/{name}"
        out.append(Entry(seq, delta, rel, MANIFEST in storage.listdir(rel)))
    out.sort(key=lambda e: (e.seq, -1 if e.delta is None else e.delta))
    return out


def saved_by(storage: Storage, entry: Entry, cluster: str) -> bool:
    """Whether complete checkpoint ``entry`` was saved by ``cluster`` ("": any cluster's will do).  A manifest
    that names no cluster, or another, is another cluster's: a job that reuses a directory never restores the
    rows of an earlier one (a failure before its own first save starts the shard from initial values)."""
    if not cluster:
        return True
    try:
        return read_manifest(storage, entry.dirname).get("cluster") == cluster
    except CheckpointError:  # a manifest that cannot be read is kept: loading it says what is wrong with it
        return True


def latest_chain(storage: Storage, index: int, cluster: str = "",
                 before: int | None = None) -> tuple[Entry | None, list[Entry], list[Entry]]:
    """``(base, deltas, skipped)``: the newest complete full checkpoint (of ``cluster``: :func:`saved_by`; older
    than sequence ``before`` if given), its complete deltas in order, and the incomplete (torn) directories newer
    than it, which are skipped and must be reported."""
    return chain_of([e for e in scan(storage, index) if (before is None or e.seq < before)
                     and (not e.complete or saved_by(storage, e, cluster))])


def chain_of(entries: list[Entry]) -> tuple[Entry | None, list[Entry], list[Entry]]:
    """:func:`latest_chain` of entries already listed (and filtered)."""
    fulls = [e for e in entries if e.delta is None and e.complete]
    if not fulls:
        return None, [], [e for e in entries if not e.complete]
    base = fulls[-1]
    deltas = [e for e in entries if e.seq == base.seq and e.delta is not None and e.complete]
    skipped = [e for e in entries if not e.complete and (e.seq > base.seq or (e.seq == base.seq and e.delta is not None))]
    return base, deltas, skipped
