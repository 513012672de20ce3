"""Snapshots of a cluster's tables and dense tensors in ``torch.distributed.checkpoint`` (DCP) format, written
by the servers in parallel and restored onto a cluster of any shape (another number of servers, another k
and m, another strategy).

A snapshot is a DCP checkpoint (a directory, or any fsspec URL) that DCP's own API reads into a plain state
dict, no ECRec code needed::

    tables/<name>/weight    float32 (num_rows, dim)
    tables/<name>/state     float32 (num_rows, state columns): Adagrad's accumulators (absent for SGD)
    dense/<name>/payload    float32: a dense tensor's values then its optimizer state

Server ``i`` writes ``__i_0.distcp``: the rows of the ``i``-th contiguous range of every table (gathered from
their owners, :mod:`ecrec.snapshot.part`) in chunks of at most 64 MB, and the dense tensors it is primary of.
The client only plans, then writes DCP's ``.metadata`` and last ``manifest.json`` (the format, each table's and
dense tensor's spec, the cluster's shape and map epoch, and the SHA-256 of every chunk): a snapshot without
its manifest is incomplete and is never restored.

A restore reads one chunk at a time (the client holds a few chunks, never the model), checks every chunk
against the manifest before it writes anything, so a corrupted or truncated snapshot is refused naming the
tensor and the file and the cluster is left as it was.  A table no push changed (one the restore creates, or
one restored before) on a strategy that allows it (``ecrec``, ``none``) is then restored *in bulk*: every server
reads its rows and the data rows of its parity stripes from the files itself and encodes its parity once per
stripe (:mod:`ecrec.snapshot.bulk`), when every server reads the snapshot's local path.  Every other table (a
URL, a trained table, a checkpointing strategy) and every dense tensor is written as assignment pushes (parity,
replicas and checkpoints follow as for training).

A snapshot is a cut between steps whenever it is taken, workers training or not (:mod:`ecrec.snapshot.cut`):
the servers write their rows as they were at a moment no worker's step was half applied, while pushes go on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import re
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ecrec.snapshot import claim as save_claim
from ecrec.snapshot import files as snapshot_files
from ecrec.snapshot.cut import Cut, CutError
from ecrec.snapshot.tally import Tally
from ecrec.snapshot.part import CHUNK_BYTES
from ecrec.tables.values import check_dense_values, check_values

log = logging.getLogger("ecrec.snapshot")

FORMAT = "ecrec-snapshot/2"
FORMATS = ("ecrec-snapshot/1", FORMAT)
MANIFEST = "manifest.json"
METADATA = ".metadata"
#: written first by a save and removed once its manifest is in place: files beside it are this cluster's (an
#: interrupted save may be retried over them); files without it or a manifest are someone else's, never touched
WRITING = ".ecrec-save-in-progress"


#: how long a snapshot waits for a moment no worker's step is half applied (ecrec.snapshot.cut)
CUT_TIMEOUT_S = 60.0


class SnapshotError(ValueError):
    """A snapshot that cannot be written or restored here: missing, corrupted, or shaped for another model."""


def _ranges(num_rows: int, parts: int, block: int = 1) -> list[tuple[int, int]]:
    """``num_rows`` cut into at most ``parts`` contiguous ranges, each a multiple of ``block`` rows but the last."""
    per = -(-num_rows // parts)
    per = -(-per // block) * block
    return [(a, min(num_rows, a + per)) for a in range(0, num_rows, per)]


def save(cluster, path: str, on_progress=None, overwrite: bool = False, chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Has every server write its part of a snapshot of ``cluster`` to ``path`` (a directory or an fsspec URL
    every server can reach) at once; writes the DCP metadata and the manifest; returns the manifest.
    ``on_progress(text)`` as each server finishes.  A path that already holds a snapshot is refused unless
    ``overwrite``."""
    t0 = time.perf_counter()
    check_path(path)
    path = str(path) if snapshot_files.is_url(path) else os.path.abspath(path)  # every server resolves it alike
    local = snapshot_files.local_dir(path)
    if local is not None:
        # a link to the directory: the directory itself (an overwrite swaps it, and would replace the link by it);
        # that link only -- links above it stay as named (a shared file system reached through a per-host link)
        local = os.path.abspath(local)  # (no trailing separator)
        if os.path.islink(local):
            local = os.path.abspath(os.path.join(os.path.dirname(local), os.readlink(local)))
        # file://relative: as this client resolves it (each server resolved it against its own working directory:
        # the snapshot in two places, reported written)
        path = f"file://{local}" if snapshot_files.is_url(path) else local
    # DCP's metadata classes take a second to import: meanwhile the servers write
    importer = threading.Thread(target=_import_dcp, name="ecrec-import-dcp", daemon=True)
    importer.start()
    made = _missing_dirs(local) if local is not None else []  # removed again if the save fails, deepest first
    claim = None
    _refuse_a_file(path, "snapshot to ", "nothing was written")
    try:
        _refuse_a_snapshot_there(path, overwrite)
        if overwrite and local is not None and snapshot_files.exists(path, MANIFEST):
            _refuse_foreign_files(local)  # the overwrite replaces the whole directory
        present = [n for n in snapshot_files.listdir(path) if n == METADATA or n.endswith(".distcp")]
        if present and not (snapshot_files.exists(path, MANIFEST) or snapshot_files.exists(path, WRITING)):
            raise SnapshotError(f"{path} holds checkpoint files no save of ECRec wrote ({', '.join(present[:4])}"
                                f"{', ...' if len(present) > 4 else ''}: a DCP checkpoint of another program?); "
                                "nothing was changed: choose another path")
        snapshot_files.makedirs(path)
        claim = save_claim.take(path, WRITING)  # one save at a time to a path (ecrec.snapshot.claim)
        _refuse_a_snapshot_there(path, overwrite)  # again, now the path is held: another save may have ended
        present = [n for n in snapshot_files.listdir(path) if n == METADATA or n.endswith(".distcp")]
    except BaseException as exc:
        if claim is not None:
            claim.release()
        if isinstance(exc, OSError):  # a file where the directory would be, a place that cannot be written or reached
            raise SnapshotError(f"snapshot to {path}: {_os_error(exc)}; nothing was written") from None
        if isinstance(exc, save_claim.PathBusy):
            raise SnapshotError(f"{exc}; nothing was written") from None
        raise
    staging = None
    try:
        if local is not None:
            _remove_interrupted_overwrites(local, on_progress)
        if overwrite and local is not None and snapshot_files.exists(path, MANIFEST):
            # a snapshot over a whole one: written beside it, then swapped in, so that a save that fails (or is
            # stopped) leaves the old one as it was -- removing it first lost it with the new one
            staging = _staging(path, local)
            snapshot_files.makedirs(staging[0])
            manifest = _save(cluster, staging[0], on_progress, chunk_bytes, t0, importer, claim, shown=path,
                             release=False)
            try:
                claim.check()
            except save_claim.PathBusy as exc:
                raise SnapshotError(str(exc)) from None
            claim.abandon()  # no refresh may write a marker into the new snapshot once it is swapped in
            _exchange(local, staging[1])  # the old snapshot (and this save's marker) now where the new one was
            snapshot_files.sync_directory(os.path.dirname(local))
            shutil.rmtree(staging[1], ignore_errors=True)
            return manifest
        # what an interrupted save left, or an old snapshot on a store with no directory to swap: its manifest
        # goes first, so that no complete-looking snapshot is ever without its files
        for name in [MANIFEST, METADATA] + [n for n in present if n.endswith(".distcp")]:
            snapshot_files.remove(path, name)
        return _save(cluster, path, on_progress, chunk_bytes, t0, importer, claim)
    except BaseException:
        if staging is not None:  # the new files, or the old snapshot once swapped out: the path holds a whole one
            shutil.rmtree(staging[1], ignore_errors=True)
            claim.release()
            raise
        if not claim.held():
            claim.abandon()
            raise  # another save holds the path now (this one stalled): its files are not this save's to take
        try:
            whole = snapshot_files.exists(path, MANIFEST)
        except OSError:
            whole = False  # out of reach: what failed is said, not this
        if whole:
            claim.release()
            raise  # written whole (what failed came after): a snapshot, kept
        # a save that failed (refused, a server gone, a full disk) takes back what it wrote: its servers' files,
        # its marker, the directory it made (nothing it did not write; a server still writing ends by its deadline)
        for name in [f"__{i}_0.distcp" for i in range(cluster.layout.num_servers)]:
            try:
                snapshot_files.remove(path, name)
            except OSError as exc:
                log.warning("snapshot to %s failed; removing %s: %s", path, name, _os_error(exc))
        claim.release()
        for directory in made:
            try:
                os.rmdir(directory)
            except OSError:
                break  # not empty: a file someone else put there stays
        raise


#: the files a save writes in a snapshot's directory besides the manifest, the DCP metadata and the marker: its
#: servers' parts, and what a save killed while it wrote one of the others leaves (``.NAME.tmp``, the marker's
#: ``.NAME.<hex>.tmp`` and ``.NAME.<hex>.gone``)
SAVED_NAMES = re.compile(r"__\d+_\d+\.distcp|\.(manifest\.json|\.metadata|\.ecrec-save-in-progress)(\.[0-9a-f]{32})?"
                         r"\.(tmp|gone)")


def _refuse_foreign_files(local: str) -> None:
    """``SnapshotError`` naming the files in snapshot directory ``local`` that no save wrote: an overwrite swaps in a
    new directory and removes the old one, so a README or a log kept beside the snapshot would go with it."""
    foreign = sorted(n for n in os.listdir(local)
                     if n not in (MANIFEST, METADATA, WRITING) and not SAVED_NAMES.fullmatch(n))
    if foreign:
        raise SnapshotError(f"{local} holds files no snapshot wrote ({', '.join(foreign[:4])}"
                            f"{', ...' if len(foreign) > 4 else ''}); an overwrite replaces the whole directory, so "
                            "nothing was changed: move them, or write the snapshot elsewhere")


def _missing_dirs(local: str) -> list[str]:
    """The directories a save to ``local`` makes (it and every missing parent), deepest first."""
    missing, d = [], os.path.abspath(local)
    while not os.path.exists(d) and d != os.path.dirname(d):
        missing.append(d)
        d = os.path.dirname(d)
    return missing


def _remove_interrupted_overwrites(local: str, on_progress=None) -> None:
    """Removes what overwriting saves of ``local`` that were killed (SIGKILL: no failure path ran) left beside it:
    their staging directories (:func:`_staging`: ``.<name>.overwrite-<12 hex>``, and one's ``.old``), named exactly
    so, and only while ``local`` holds a whole snapshot (a save killed between the two renames of
    :func:`_exchange`'s fallback leaves the path empty and the old and new snapshots in exactly those directories:
    then they are the only copies, kept and named).  Called by a save that holds the path's claim."""
    parent, prefix = _staging_prefix(local)
    pattern = re.compile(rf"{re.escape(prefix)}[0-9a-f]{{{STAGING_HEX}}}(\.old)?")
    try:
        names = sorted(n for n in os.listdir(parent or os.sep) if pattern.fullmatch(n))
    except OSError:
        return
    if not names:
        return
    wheres = [os.path.join(parent, n) for n in names]
    if not snapshot_files.exists(local, MANIFEST):
        log.warning("%s holds no snapshot, and %s, left by an overwrite of it that was killed, may hold the only "
                    "copies: kept (move the one with a manifest.json back to the path, or remove them)", local,
                    ", ".join(wheres))
        return
    for where in wheres:
        if on_progress is not None:
            on_progress(f"removing {where}, left by an overwrite of {local} that was killed")
        try:
            shutil.rmtree(where)
        except FileNotFoundError:
            pass  # removed meanwhile (the save that made it, ending)
        except OSError as exc:
            log.warning("could not remove %s, left by an overwrite of %s that was killed: %s", where, local,
                        _os_error(exc))


#: hex digits that tell one overwriting save's staging directory from another's
STAGING_HEX = 12


def _staging_prefix(local: str) -> tuple[str, str]:
    """``(parent, prefix)``: the directory an overwrite of ``local`` stages in, and its staging names' start."""
    parent, base = os.path.split(local.rstrip(os.sep))
    return parent, f".{base}.overwrite-"


def _staging(path: str, local: str) -> tuple[str, str]:
    """Where an overwriting save writes (as the servers are told, as a local path): beside the old snapshot, in
    its directory's parent (under the same ``--snapshot-root``)."""
    parent, prefix = _staging_prefix(local)
    staged = os.path.join(parent, f"{prefix}{uuid.uuid4().hex[:STAGING_HEX]}")
    return (f"file://{staged}" if snapshot_files.is_url(path) else staged), staged


#: renameat2's flag that swaps two paths in one step (Linux 3.15)
RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> None:
    """Swaps directories ``a`` and ``b``: in one step where the kernel and the file system can
    (``renameat2(RENAME_EXCHANGE)``), else ``a`` moved aside, ``b`` moved in, the old ``a`` moved to ``b``."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        at_cwd = -100
        if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), RENAME_EXCHANGE) == 0:
            return
    aside = f"{b}.old"
    os.rename(a, aside)
    try:
        os.rename(b, a)
    except OSError:
        os.rename(aside, a)
        raise
    os.rename(aside, b)


def _refuse_a_file(path: str, what: str, outcome: str) -> None:
    """``SnapshotError`` where ``path`` names a file of the local file system: a snapshot is a directory of files
    (the OS's message named only the manifest inside it: 'Not a directory', or 'File exists')."""
    local = snapshot_files.local_dir(path)
    if local is not None and os.path.isfile(local):
        raise SnapshotError(f"{what}{path}: a file, not a directory (a snapshot is a directory of files); {outcome}")


def _refuse_a_snapshot_there(path: str, overwrite: bool) -> None:
    if snapshot_files.exists(path, MANIFEST) and not overwrite:
        raise SnapshotError(f"{path} already holds a snapshot; choose another path or pass overwrite=True "
                            "(ecrec-server snapshot --overwrite)")


def _save(cluster, path: str, on_progress, chunk_bytes: int, t0: float, importer: threading.Thread,
          claim: save_claim.Claim, shown: str | None = None, release: bool = True) -> dict:
    """:func:`save` once the directory is ready: the cut, every server's write, the metadata and the manifest
    (``shown``: the path the progress names; ``release``: let go of the claim at the end)."""
    import grpc

    from ecrec.tables.spec import DenseSpec, TableSpec
    from ecrec.wire import embedding_pb2

    cluster_map = cluster.refresh_map()
    layout = cluster.layout
    servers = layout.num_servers
    tables = [TableSpec.from_proto(t) for t in cluster_map.tables]
    denses = [DenseSpec.from_proto(d) for d in cluster_map.dense]
    requests = {i: embedding_pb2.WriteSnapshotRequest(path=path, file=f"__{i}_0.distcp", chunk_bytes=chunk_bytes)
                for i in range(servers)}
    for spec in tables:
        for i, (a, b) in enumerate(_ranges(spec.num_rows, servers, servers * layout.k)):
            requests[i].ranges.add(table=spec.name, start=a, stop=b)
    for spec in denses:
        requests[layout.dense_servers(spec.name)[0]].dense.append(spec.name)
    total = sum(s.num_rows * s.row_bytes for s in tables) + sum(s.numel * (1 + s.state_width) * 4 for s in denses)
    timeout_s = cluster.config.rpc_timeout_s + total / (5 << 20)  # at 5 MB/s a server still finishes
    lock, replies = threading.Lock(), {}

    def write(i: int):
        # one attempt, no failure report: a slow or refused write is not a dead server, and a retry would race
        # the first writer for the same file
        address = cluster.peers.address_of(i)
        if address is None:
            raise SnapshotError(f"snapshot to {path}: no live server holds index {i}")
        try:
            reply = cluster.peers.stub(address).WriteSnapshot(requests[i], timeout=timeout_s,
                                                              metadata=cluster.peers.metadata())
        except grpc.RpcError as exc:
            raise SnapshotError(f"snapshot to {path}: server {i} ({address}) WriteSnapshot: {exc.code().name}: "
                                f"{exc.details()}") from None
        with lock:
            replies[i] = reply
            if on_progress is not None:
                on_progress(f"server {i} wrote {reply.bytes / 1e6:,.1f} MB in {reply.seconds:.2f} s "
                            f"({len(replies)}/{servers})")

    # the cut: every server marks its rows at a moment no worker's step is half applied, then writes them as they
    # were at it while pushes go on (ecrec.snapshot.cut)
    # (a server drops it sooner once it is unused: ecrec.server.cut)
    cut = Cut(cluster, list(range(servers)), ttl_s=timeout_s + 60.0)
    try:
        cut.take(CUT_TIMEOUT_S)
    except CutError as exc:
        raise SnapshotError(f"snapshot to {path}: {exc}") from None
    for request in requests.values():
        request.cut = cut.holder
    try:
        with ThreadPoolExecutor(max_workers=servers, thread_name_prefix="ecrec-save") as pool:
            for future in [pool.submit(write, i) for i in range(servers)]:
                future.result()
    finally:
        cut.drop()
    importer.join()
    items = [item for i in sorted(replies) for item in json.loads(replies[i].items_json)]
    manifest = {"format": FORMAT, "created": time.time(), "epoch": cluster_map.epoch, "servers": servers,
                "strategy": cluster_map.strategy, "k": cluster_map.k, "m": cluster_map.m,
                "tables": {s.name: dataclasses.asdict(s) for s in tables},
                "dense": {s.name: dataclasses.asdict(s) | {"shape": list(s.shape)} for s in denses},
                "tensors": {}, "files": {requests[i].file: replies[i].bytes for i in sorted(replies)},
                "cut": {"attempts": cut.attempts, "admitted_parts": cut.admitted, "held_s": round(cut.held_s, 4),
                        "half_applied_steps": cut.abandoned},
                "parts": {str(i): json.loads(replies[i].parts_json or "{}") for i in sorted(replies)}}
    for spec in tables:
        manifest["tensors"][f"tables/{spec.name}/weight"] = {"shape": [spec.num_rows, spec.dim], "chunks": []}
        if spec.row_floats > spec.dim:
            manifest["tensors"][f"tables/{spec.name}/state"] = {"shape": [spec.num_rows, spec.row_floats - spec.dim],
                                                                 "chunks": []}
    for spec in denses:
        manifest["tensors"][f"dense/{spec.name}/payload"] = {"shape": [spec.numel * (1 + spec.state_width)],
                                                              "chunks": []}
    for item in items:
        manifest["tensors"][item.pop("key")]["chunks"].append(item)
    try:
        claim.check()  # still this save's path: no manifest over another save's files
    except save_claim.PathBusy as exc:
        raise SnapshotError(str(exc)) from None
    snapshot_files.write_atomically(path, METADATA, pickle.dumps(_dcp_metadata(manifest)))
    manifest["bytes"] = int(sum(manifest["files"].values()))
    manifest["seconds"] = time.perf_counter() - t0
    snapshot_files.write_atomically(path, MANIFEST, json.dumps(manifest, indent=1).encode())
    if release:
        claim.release()  # (a marker it cannot remove is logged: the snapshot is whole, the next save takes it over)
    if on_progress is not None:
        on_progress(f"wrote {manifest['bytes'] / 1e6:,.1f} MB to {shown or path} in {manifest['seconds']:.2f} s "
                    f"({manifest['bytes'] / 1e6 / max(manifest['seconds'], 1e-9):,.0f} MB/s)")
    return manifest


def _import_dcp() -> None:
    """Imports DCP's metadata classes ahead of need (a second), while the servers write.  Only a head start: an
    import that fails here (the process interrupted and exiting under it) is left to the real one, which says it."""
    try:
        import torch.distributed.checkpoint.filesystem  # noqa: F401
        import torch.distributed.checkpoint.metadata  # noqa: F401
    except BaseException:  # noqa: BLE001 - see above: an interrupted save printed this thread's traceback
        pass


def _dcp_metadata(manifest: dict):
    """DCP's ``Metadata`` for the manifest's chunks: what ``dcp.load`` and ``FileSystemReader`` read."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state, storage = {}, {}
    for key, info in manifest["tensors"].items():
        chunks = []
        for index, chunk in enumerate(info["chunks"]):
            offsets, sizes = torch.Size(chunk["offsets"]), torch.Size(chunk["sizes"])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            storage[MetadataIndex(key, offsets, index)] = _StorageInfo(chunk["file"], chunk["offset"], chunk["length"])
        state[key] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32),
                                           size=torch.Size(info["shape"]), chunks=chunks)
    return Metadata(state_dict_metadata=state, planner_data={key: (key,) for key in state}, storage_data=storage)


def read_manifest(path: str) -> dict:
    _refuse_a_file(path, "", "nothing was read")
    try:
        with snapshot_files.open_file(str(path), MANIFEST, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no {MANIFEST}; not an ECRec snapshot (or one whose writing did not "
                            "finish)") from None
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{path}/{MANIFEST} cannot be read: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS:
        raise SnapshotError(f"{path}/{MANIFEST}: format {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                            f"expected one of {FORMATS}")
    if manifest["format"] == "ecrec-snapshot/1":
        _chunks_of_version_1(path, manifest)
    return manifest


def _chunks_of_version_1(path: str, manifest: dict) -> None:
    """A version-1 snapshot (one tensor per item, written through DCP by the client) given version 2's chunk
    list, read from DCP's metadata."""
    try:
        with snapshot_files.open_file(path, METADATA, "rb") as f:
            metadata = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        raise SnapshotError(f"{path}/{METADATA} cannot be read: {exc}") from None
    for index, info in metadata.storage_data.items():
        tensor = manifest["tensors"].get(index.fqn)
        if tensor is not None:
            tensor["chunks"] = [{"offsets": list(index.offset), "sizes": list(tensor["shape"]),
                                 "file": info.relative_path, "offset": info.offset, "length": info.length,
                                 "sha256": tensor["sha256"]}]


def _check_specs(cluster, path: str, manifest: dict):
    """The snapshot's table and dense specs, checked against the manifest's tensors and the cluster's own."""
    from ecrec.tables.spec import DenseSpec, TableSpec

    cluster_map = cluster.refresh_map()
    existing = {t.name: TableSpec.from_proto(t) for t in cluster_map.tables}
    existing_dense = {d.name: DenseSpec.from_proto(d) for d in cluster_map.dense}
    tables, denses = {}, {}
    mismatched = []  # every table shaped otherwise here, named at once (one at a time took a restore per table)
    for name, fields in manifest.get("tables", {}).items():
        try:
            spec = TableSpec(**fields).validate()
        except (TypeError, ValueError) as exc:
            raise SnapshotError(f"{path}/{MANIFEST}: table {name!r} has no valid spec: {exc}") from None
        for key, width in [(f"tables/{name}/weight", spec.dim)] + (
                [(f"tables/{name}/state", spec.row_floats - spec.dim)] if spec.row_floats > spec.dim else []):
            _check_tensor(path, manifest, key, [spec.num_rows, width])
        have = existing.get(name)
        if have is not None and (have.num_rows, have.dim, have.optimizer) != (spec.num_rows, spec.dim, spec.optimizer):
            mismatched.append(f"table {name!r}: the snapshot holds {spec.num_rows:,} x {spec.dim} ({spec.optimizer}); "
                              f"this cluster's table is {have.num_rows:,} x {have.dim} ({have.optimizer})")
            continue
        _warn_if_hyperparameters_differ(f"table {name!r}", have, spec)
        tables[name] = spec
    if mismatched:
        raise SnapshotError("; ".join(mismatched))
    for name, fields in manifest.get("dense", {}).items():
        if "name" not in fields:  # version 1 kept only the shape and the optimizer: not restorable exactly
            log.warning("%s: dense tensor %r is not restored: the snapshot keeps only its shape and optimizer (an "
                        "earlier format), not its learning rate and state", path, name)
            continue
        try:
            spec = DenseSpec(**{f.name: fields[f.name] for f in dataclasses.fields(DenseSpec)}
                             | {"shape": tuple(fields["shape"])}).validate()
        except (KeyError, TypeError, ValueError) as exc:
            raise SnapshotError(f"{path}/{MANIFEST}: dense tensor {name!r} has no valid spec: {exc}") from None
        _check_tensor(path, manifest, f"dense/{name}/payload", [spec.numel * (1 + spec.state_width)])
        have = existing_dense.get(name)
        if have is not None and (have.shape, have.optimizer) != (spec.shape, spec.optimizer):
            raise SnapshotError(f"dense tensor {name!r}: the snapshot holds {spec.shape} ({spec.optimizer}); this "
                                f"cluster's is {have.shape} ({have.optimizer})")
        _warn_if_hyperparameters_differ(f"dense tensor {name!r}", have, spec)
        denses[name] = spec
    return tables, denses, existing, existing_dense


def _warn_if_hyperparameters_differ(what: str, have, saved) -> None:
    """A restore writes values and optimizer state into what the cluster holds, with the cluster's learning rate
    and the rest: where the snapshot was saved with others, say so (training goes on with the cluster's)."""
    if have is None:
        return
    names = [n for n in ("lr", "eps", "initial_accumulator_value") if hasattr(have, n) and hasattr(saved, n)]
    differ = [f"{n} {getattr(saved, n)!r} -> {getattr(have, n)!r}" for n in names if getattr(have, n) != getattr(saved, n)]
    if differ:
        log.warning("%s: the snapshot was saved with other optimizer settings than this cluster's (%s): its values "
                    "and optimizer state are restored, training goes on with this cluster's settings", what,
                    ", ".join(differ))


def _check_tensor(path: str, manifest: dict, key: str, shape: list[int]) -> None:
    """The manifest lists ``key`` with ``shape``, its chunks tile it (every row once) and name a data file."""
    info = manifest["tensors"].get(key)
    if info is None or list(info.get("shape", [])) != shape:
        raise SnapshotError(f"{path}/{MANIFEST}: {key} of shape {shape} expected, the manifest has "
                            f"{info and info.get('shape')}")
    covered = 0
    for chunk in sorted(info.get("chunks", []), key=lambda c: c["offsets"][0]):
        if chunk["offsets"][0] != covered or list(chunk["sizes"][1:]) != shape[1:] or \
                not snapshot_files.DATA_FILE.match(str(chunk.get("file", ""))):
            raise SnapshotError(f"{path}/{MANIFEST}: the chunks of {key} do not tile it (at row {covered})")
        covered += chunk["sizes"][0]
    if covered != shape[0]:
        raise SnapshotError(f"{path}/{MANIFEST}: the chunks of {key} cover {covered} of its {shape[0]} rows")


class _ChunkReader:
    """Reads and checks chunks of a snapshot: mapped from a local file, read from a URL."""

    def __init__(self, path: str):
        self.path = path

    def joined(self, item) -> np.ndarray:
        """A chunk of rows, weights and state side by side, read again and its checksums checked again (the
        file could have changed since the first pass)."""
        arrays = [self.read(key, chunk) for key, chunk in item[3]]
        if len(arrays) == 1:
            return np.array(arrays[0])
        # a table's weights and state side by side; a dense payload's chunks one after the other
        return np.concatenate(arrays, axis=1 if item[0] == "table" else 0)

    def read(self, key: str, chunk: dict) -> np.ndarray:
        rows = f"{key} rows {chunk['offsets'][0]}..{chunk['offsets'][0] + chunk['sizes'][0] - 1}"
        file = snapshot_files.join(self.path, chunk["file"])
        try:
            if snapshot_files.is_url(self.path):
                with snapshot_files.open_file(self.path, chunk["file"], "rb") as stream:
                    array = snapshot_files.read_tensor(stream, chunk["offset"], chunk["length"])
            else:  # mapped: the values straight from the page cache
                array = snapshot_files.map_tensor(self.path, chunk["file"], chunk["offset"], chunk["length"],
                                                  chunk["sizes"])
        except FileNotFoundError:
            raise SnapshotError(f"{self.path}: {chunk['file']} is missing ({key})") from None
        except Exception as exc:  # noqa: BLE001 - a truncated or garbled item: torch.load's many errors
            raise SnapshotError(f"{rows} cannot be read ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}) from {file}; nothing was "
                                "restored") from None
        if list(array.shape) != list(chunk["sizes"]) or array.dtype != np.float32:
            raise SnapshotError(f"{rows} cannot be read as the manifest says (float32 {chunk['sizes']}): "
                                f"{file} holds {array.dtype} {list(array.shape)}; nothing was restored")
        if snapshot_files.digest(array) != chunk["sha256"]:
            raise SnapshotError(f"{rows} does not match its checksum in {MANIFEST}: a corrupted file, {file}; "
                                "nothing was restored")
        return array


def _os_error(exc: OSError) -> str:
    """An OSError as one line: what failed, on which file."""
    text = exc.strerror or str(exc) or type(exc).__name__
    return f"{text}: {exc.filename}" if getattr(exc, "filename", None) else text


def check_path(path) -> None:
    """``SnapshotError`` unless ``path`` can hold a snapshot (checked before anything is asked of the cluster).
    A snapshot's path must name a place every server and this client reach alike: not empty (an unset variable
    would write into each process's working directory), not a filesystem that lives inside one process."""
    if path is None or not str(path).strip():
        raise SnapshotError("the snapshot path is empty: name a directory or an fsspec URL every server can reach")
    if snapshot_files.is_url(path):
        try:
            from fsspec.core import url_to_fs
            from fsspec.implementations.memory import MemoryFileSystem
        except ImportError:
            return  # opening it says what is missing
        try:
            fs, _ = url_to_fs(str(path))
        except (ValueError, ImportError) as exc:
            raise SnapshotError(f"snapshot URL {path!r}: {exc}") from None
        while fs is not None:  # cached or wrapped filesystems hold the target in ``.fs``
            if isinstance(fs, MemoryFileSystem):
                raise SnapshotError(f"snapshot URL {path!r}: fsspec's memory filesystem lives inside one process; "
                                    "each server writes its own part, so the snapshot would be in pieces nobody "
                                    "can read back: use a directory or a URL every server reaches")
            fs = getattr(fs, "fs", None)


def load(cluster, path: str, on_progress=None) -> dict:
    """See :func:`_load`; a manifest whose structure is not what :func:`save` writes is refused as such."""
    if path is None:  # what latest() answers for a directory with no complete snapshot
        raise SnapshotError("no snapshot to load (the path is None: latest() found no complete snapshot in the "
                            "directory, or it does not exist); nothing was restored")
    try:
        return _load(cluster, path, on_progress)
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        raise SnapshotError(f"{path}/{MANIFEST} is malformed ({type(exc).__name__}: {exc}); nothing was "
                            "restored") from None


def _load(cluster, path: str, on_progress=None) -> dict:
    """Restores the snapshot at ``path`` into ``cluster`` (any shape): tables and dense tensors the cluster
    lacks are created with the snapshot's specs, those it has must have the same shape and optimizer; every
    chunk is read and checked (checksum, finite values, Adagrad accumulators >= 0) before the first row is
    written.  The client holds a few chunks at a time.  Returns the manifest."""
    check_path(path)
    path = str(path)
    manifest = read_manifest(path)
    lost = list(cluster.refresh_map().data_loss)
    if lost:  # its replacements cannot rebuild those stripes, and refuse what would land on them: nothing written
        raise SnapshotError(
            f"this cluster lost data ({'; '.join(f'table {d.table!r}: {d.stripe_count} stripes' for d in lost)}: more "
            f"than m failures in a stripe): a snapshot is loaded into a new cluster, not into this one -- start one "
            f"(`ecrec-server local --restore {path}`, or `Cluster.load` on it); nothing was written here")
    tables, denses, existing, existing_dense = _check_specs(cluster, path, manifest)
    reader = _ChunkReader(path)
    order = []  # (table or dense, name, row offset, [(key, chunk)]): a chunk of rows, weights then state
    for name, spec in tables.items():
        weight = sorted(manifest["tensors"][f"tables/{name}/weight"]["chunks"], key=lambda c: c["offsets"][0])
        state = {c["offsets"][0]: c for c in manifest["tensors"].get(f"tables/{name}/state", {}).get("chunks", [])}
        for chunk in weight:
            row = chunk["offsets"][0]
            parts = [(f"tables/{name}/weight", chunk)]
            if spec.row_floats > spec.dim:
                partner = state.get(row)
                if partner is None or partner["sizes"][0] != chunk["sizes"][0]:
                    raise SnapshotError(f"{path}/{MANIFEST}: table {name!r}: no state chunk matches the weights "
                                        f"at row {row}")
                parts.append((f"tables/{name}/state", partner))
            order.append(("table", name, row, parts))
    for name in denses:  # a dense payload is written whole: all its chunks (they tile it: checked) in one item
        key = f"dense/{name}/payload"
        order.append(("dense", name, 0, [(key, c) for c in sorted(manifest["tensors"][key]["chunks"],
                                                                   key=lambda c: c["offsets"][0])]))
    total = sum(_values_bytes(c) for *_, parts in order for _, c in parts)

    # what each part took (``restore_parts`` of the manifest returned): wall seconds of the check of every chunk
    # (check_s), of creating missing tables (create_s), of the restores in bulk (bulk_s: its steps bulk_begin_s,
    # bulk_fill_s, bulk_finish_s; the servers' fills summed, servers_fill_s, and their CPU seconds by part,
    # servers_rows_cpu_s, servers_check_cpu_s, servers_parity_cpu_s), of the pushes (push_s) and of waiting for the
    # next chunk's read meanwhile (waiting_for_reads_s); CPU seconds of the client's threads that checked chunks
    # (check_cpu_s), read them again (read_cpu_s) and sent the pushes (push_cpu_s: the calling thread's)
    timing = Tally()

    def check(item) -> None:
        """A chunk's rows checked: checksums (in :meth:`_ChunkReader.read`), then values."""
        with timing.cpu("check_cpu_s"):
            _check(item)

    def joined(item) -> np.ndarray:
        with timing.cpu("read_cpu_s"):
            return reader.joined(item)

    def _check(item) -> None:
        kind, name, row, parts = item
        arrays = [reader.read(key, chunk) for key, chunk in parts]
        try:
            if kind == "table":
                check_values(tables[name], arrays[0], "weights")
                if len(arrays) > 1:
                    check_values(tables[name], arrays[1], "state")
            else:
                check_dense_values(denses[name], np.concatenate(arrays))
        except ValueError as exc:
            where = f"rows from {row} of " if kind == "table" else ""
            raise SnapshotError(f"{path}: {where}{exc}; nothing was restored") from None

    # the files' sizes and times as checked: a server restoring in bulk reads them only as they were
    stamps = _stamps(path, order)
    # 1. every chunk read and checked before anything is written (two at a time: checksums run in parallel)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ecrec-verify") as pool:
        window = [pool.submit(check, item) for item in order[:2]]
        for i in range(len(order)):
            window.pop(0).result()
            if i + 2 < len(order):
                window.append(pool.submit(check, order[i + 2]))
    timing.add("check_s", time.perf_counter() - started)
    if stamps is not None and _stamps(path, order) != stamps:
        raise SnapshotError(f"{path}: a file changed while the snapshot was checked; nothing was restored")
    if on_progress is not None:
        on_progress(f"checked {total / 1e6:,.1f} MB in {len(order)} chunks of {path}")
    # 2. written: missing tables and dense tensors created, then chunk after chunk (the next read meanwhile)
    started = time.perf_counter()
    chunks_of = {name: [(key, chunk) for kind, table, _, parts in order if kind == "table" and table == name
                        for key, chunk in parts] for name in tables}
    unresponsive: set[int] = set()
    for name, spec in tables.items():
        if name not in existing:
            cluster.create_table(name, spec.num_rows, spec.dim, optimizer=spec.optimizer, lr=spec.lr, eps=spec.eps,
                                 initial_accumulator_value=spec.initial_accumulator_value, init="blank",
                                 seed=spec.seed)
        if stamps is not None:  # restored in bulk, if it can be: refused from now until it is
            cluster.refresh_map()  # every index's server as the map names it now (a replacement, not the dead)
            _mark_for_bulk(cluster, path, name, chunks_of[name], stamps, unresponsive)
    for name, spec in denses.items():
        if name not in existing_dense:
            cluster.create_dense(spec)
    timing.add("create_s", time.perf_counter() - started)
    written = 0
    in_bulk = []  # tables every server restored from the files itself
    for name in (tables if stamps is not None else ()):
        chunks = chunks_of[name]
        with timing.wall("bulk_s"):  # (the servers' parts: _restore_in_bulk)
            done = _restore_in_bulk(cluster, path, name, chunks, stamps, timing, on_progress)
        if done:
            in_bulk.append(name)
            written += sum(_values_bytes(c) for _, c in chunks)  # (not the files' lengths: headers too)
    order = [item for item in order if not (item[0] == "table" and item[1] in in_bulk)]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ecrec-restore-read") as pool:
        ahead = pool.submit(joined, order[0]) if order else None
        for i, item in enumerate(order):
            with timing.wall("waiting_for_reads_s"):
                payload = ahead.result()
            if i + 1 < len(order):
                ahead = pool.submit(joined, order[i + 1])
            kind, name, row, _ = item
            with timing.wall("push_s"), timing.cpu("push_cpu_s"):
                if kind == "table":
                    cluster.write_rows(name, np.arange(row, row + len(payload), dtype=np.int64), payload,
                                       what="payload", checked=True)
                else:
                    cluster.write_dense(name, payload)
            written += payload.nbytes
            del payload
            if on_progress is not None:
                on_progress(f"restored {name!r} rows {row:,}.. ({written / 1e6:,.1f} of {total / 1e6:,.1f} MB)")
    manifest["restore_parts"] = timing.as_dict()
    manifest["restored_in_bulk"] = in_bulk
    return manifest


def _values_bytes(chunk: dict) -> int:
    """The bytes of float32 values a chunk of the manifest holds (what a restore's progress counts)."""
    return chunk["sizes"][0] * int(np.prod(chunk["sizes"][1:], dtype=np.int64)) * 4


def _local(path: str) -> str | None:
    """The absolute local path of a snapshot (a path, or a ``file://`` URL) the servers may read themselves; None
    for any other URL."""
    from ecrec.snapshot.part import _local as without_scheme

    local = without_scheme(path)  # a file:// URL as the path it names
    return None if snapshot_files.is_url(local) else os.path.abspath(local)


def _stamps(path: str, order) -> dict | None:
    """Each data file's size and modification time, for a local snapshot (None for a URL: no bulk restore)."""
    path = _local(path)
    if path is None:
        return None
    from ecrec.snapshot.bulk import file_stamp

    names = sorted({chunk["file"] for *_, parts in order for _, chunk in parts})
    try:
        return {name: file_stamp(path, name) for name in names}
    except OSError as exc:
        raise SnapshotError(f"{path}: {exc.filename or ''} cannot be read ({exc.strerror}); nothing was "
                            "restored") from None


#: how many rounds of FILL a restore in bulk tries (a server failed or was replaced meanwhile: it fills what is not
#: filled yet)
BULK_ATTEMPTS = 4
#: how long a restore in bulk waits for the cluster to be whole again (a server recovering, replaced: BEGIN waits,
#: without a round), from the last progress
BULK_WAIT_S = 120.0
#: the pause before a restore in bulk begins again
BULK_RETRY_S = 0.5


class _NoServer(Exception):
    """No live server holds an index of the map (a failure being handled)."""


def _bulk_source(chunks, stamps: dict) -> str:
    """A table's source in a restore in bulk (``RestoreTableRequest.source_json``): its chunks and the stamps of
    the files that hold them."""
    fields = ("offsets", "sizes", "file", "offset", "length")
    source = {"weight": [{f: c[f] for f in fields} for key, c in chunks if key.endswith("/weight")],
              "state": [{f: c[f] for f in fields} for key, c in chunks if key.endswith("/state")],
              "files": {f: stamps[f] for f in sorted({c["file"] for _, c in chunks})}}
    return json.dumps(source, sort_keys=True)


#: the deadline of a BEGIN that marks a table before its turn (:func:`_mark_for_bulk`): a server that does not
#: answer within it is reported and left out of the marks (its table's turn deals with it)
MARK_TIMEOUT_S = 30.0


def _mark_for_bulk(cluster, path: str, name: str, chunks, stamps: dict, unresponsive: set[int]) -> None:
    """BEGIN of a restore of table ``name`` in bulk on every server at once, before any table is filled: from now
    the table is refused (pushes and reads wait) until its restore finishes, so that a restore cut short before it
    reached this table leaves it refused, not served blank or as it was.  Best effort: a server that refuses (it
    cannot restore in bulk, it is being replaced) is dealt with when the table's turn comes (:func:`_restore_in_bulk`
    begins again, or aborts and pushes the rows); one that does not answer is reported to the coordinator and put
    in ``unresponsive``, not asked again for the next tables (a hung server costs one deadline, not one a table)."""
    import grpc

    from ecrec.wire import embedding_pb2

    request = embedding_pb2.RestoreTableRequest(step=embedding_pb2.RestoreTableRequest.BEGIN, table=name,
                                                path=_local(path), source_json=_bulk_source(chunks, stamps))
    timeout_s = min(cluster.config.rpc_timeout_s, MARK_TIMEOUT_S)

    def begin(i: int) -> None:
        address = cluster.peers.address_of(i)
        if address is None:
            return
        try:
            cluster.peers.stub(address).RestoreTable(request, timeout=timeout_s, metadata=cluster.peers.metadata())
        except grpc.RpcError as exc:
            log.debug("marking table %r for its restore on server %d: %s", name, i, exc.code().name)
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                unresponsive.add(i)
                cluster.peers.coordinator.report_failure(address, f"RestoreTable BEGIN: {exc.code().name}")

    indices = [i for i in range(cluster.layout.num_servers) if i not in unresponsive]
    with ThreadPoolExecutor(max_workers=max(1, len(indices)), thread_name_prefix="ecrec-mark") as pool:
        list(pool.map(begin, indices))


def _restore_in_bulk(cluster, path: str, name: str, chunks, stamps: dict, timing: Tally, on_progress) -> bool:
    """Table ``name`` restored in bulk by every server (:mod:`ecrec.snapshot.bulk`): BEGIN, FILL, FINISH on every
    server of the map, again from BEGIN when a server failed or was replaced meanwhile.  False, the table as it
    was, when a server cannot (a trained table, a checkpointing strategy, the files out of its reach, an older
    release): the caller pushes the rows instead."""
    import grpc

    from ecrec.snapshot.bulk import source_digest
    from ecrec.wire import embedding_pb2

    Step = embedding_pb2.RestoreTableRequest
    path = _local(path)  # every server resolves it alike
    source_json = _bulk_source(chunks, stamps)
    digest = source_digest(name, path, source_json)
    nbytes = sum(c["length"] for _, c in chunks)
    RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION)
    fill_timeout_s = cluster.config.rpc_timeout_s + nbytes / (5 << 20)  # at 5 MB/s a server still finishes

    def call_all(step, source: str = source_json) -> dict:
        """``{index: reply or exception}`` of ``step`` on every server of the map, at once."""
        cluster.refresh_map()
        servers = cluster.layout.num_servers
        request = embedding_pb2.RestoreTableRequest(step=step, table=name, path=path, source_json=source)

        def one(i):
            address = cluster.peers.address_of(i)
            if address is None:
                return i, _NoServer(f"no live server holds index {i}")
            try:
                return i, cluster.peers.stub(address).RestoreTable(
                    request, timeout=fill_timeout_s if step == Step.FILL else cluster.config.rpc_timeout_s,
                    metadata=cluster.peers.metadata())
            except grpc.RpcError as exc:
                return i, exc

        with ThreadPoolExecutor(max_workers=servers, thread_name_prefix="ecrec-bulk") as pool:
            return dict(pool.map(one, range(servers)))

    def failed(results: dict) -> dict:
        return {i: r for i, r in results.items() if isinstance(r, Exception)}

    def transient(errors: dict) -> bool:
        return all(isinstance(e, _NoServer) or e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                   for e in errors.values())

    def describe(errors: dict) -> str:
        return "; ".join(f"server {i}: {e}" if isinstance(e, _NoServer) else f"server {i}: {e.code().name}: {e.details()}"
                         for i, e in sorted(errors.items()))

    def finish(filled: dict, source: str = source_json) -> dict:
        """FINISH on every server (of this restore's source; ``""``: of whatever source every server filled); its
        failures (none: every server serves the table)."""
        with timing.wall("bulk_finish_s"):
            errors = failed(call_all(Step.FINISH, source))
        if errors or not source:
            return errors
        for reply in filled.values():  # the servers' fills, summed: wall seconds, CPU seconds by part
            parts = json.loads(reply.parts_json or "{}")
            timing.add("servers_fill_s", reply.seconds)
            for part, seconds in parts.get("cpu_s", {}).items():
                timing.add(f"servers_{part.removesuffix('_s')}_cpu_s", seconds)
        if on_progress is not None:
            on_progress(f"restored table {name!r} in bulk ({nbytes / 1e6:,.1f} MB)")
        return {}

    deadline = time.monotonic() + BULK_WAIT_S  # for the cluster to be whole again: from the last progress
    why, rounds = "", 0
    while time.monotonic() < deadline and rounds < BULK_ATTEMPTS:
        # a restore every server filled and some finished (a FINISH cut short) is finished first: a server that
        # finished may have trained since, so this restore then begins as any other
        status = call_all(Step.STATUS)
        if not failed(status) and len({r.source for r in status.values()}) == 1 and \
                all(r.state in ("filled", "serving") for r in status.values()) and \
                any(r.state == "filled" for r in status.values()):
            finish({}, "")
        with timing.wall("bulk_begin_s"):
            refused = failed(call_all(Step.BEGIN))
        if refused and transient(refused):
            why = describe(refused)  # a server recovering, or being replaced: wait for it, then begin again
            time.sleep(BULK_RETRY_S)
            continue
        if refused:  # a server cannot: where nothing was rewritten the table serves again as it was, then pushes
            aborted = call_all(Step.ABORT)
            if any(isinstance(r, Exception) or r.state != "serving" for r in aborted.values()):
                raise SnapshotError(f"table {name!r} cannot be restored in bulk ({describe(refused)}) and not every "
                                    f"server can go back ({describe(failed(aborted)) or 'a server is still marked'}): "
                                    "the table stays refused until a restore finishes; load the snapshot again")
            if on_progress is not None:
                on_progress(f"table {name!r}: restored by pushes, not in bulk ({describe(refused)})")
            return False
        rounds += 1
        with timing.wall("bulk_fill_s"):
            filled = call_all(Step.FILL)
        errors = failed(filled)
        if errors:  # a server failed or was replaced since BEGIN, or still rebuilds: every server again
            if all(isinstance(e, _NoServer) or e.code() in RETRIED for e in errors.values()):
                why = describe(errors)
                time.sleep(BULK_RETRY_S)
                continue
            raise SnapshotError(f"table {name!r}: the restore in bulk failed ({describe(errors)}); the table is "
                                "refused until a restore finishes: load the snapshot again") from None
        deadline = time.monotonic() + BULK_WAIT_S
        errors = finish(filled)
        if not errors:
            return True
        why = f"FINISH: {describe(errors)}"  # a server replaced meanwhile holds the table unfilled: every server again
    # given up: where nothing was rewritten the table serves again as it was (best effort)
    status = call_all(Step.STATUS)
    if not failed(status) and not any(r.rewritten for r in status.values()):
        call_all(Step.ABORT)
    raise SnapshotError(f"table {name!r}: the restore in bulk did not finish ({why}); the table is refused until a "
                        "restore finishes: load the snapshot again")


STEP_PREFIX = "step-"


def _step_of(name: str) -> int | None:
    number = name[len(STEP_PREFIX):]
    return int(number) if name.startswith(STEP_PREFIX) and number.isdigit() else None


def latest(directory: str) -> str | None:
    """The newest complete snapshot (``step-<n>`` with its manifest) under ``directory``, or None."""
    names = [n for n in snapshot_files.listdir(str(directory)) if _step_of(n) is not None]
    for name in sorted(names, key=_step_of, reverse=True):
        path = snapshot_files.join(str(directory), name)
        if snapshot_files.exists(path, MANIFEST):
            return path
    return None


class Periodic:
    """``Cluster.snapshot_every``: a snapshot every ``steps`` steps into ``directory/step-<n>``, the newest
    ``keep`` complete ones kept (an incomplete one, a save cut short, is removed with the old)."""

    def __init__(self, steps: int, directory: str, keep: int = 2, on_progress=None, base: int | None = None):
        for name, value in (("steps", steps), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"snapshot_every: {name} must be a whole number, at least 1, got {value!r}")
        check_path(directory)
        self.steps, self.directory, self.keep, self.on_progress = int(steps), directory, int(keep), on_progress
        self.saved: list[dict] = []
        try:  # a directory every snapshot goes under: made now, so that a path that cannot be one is said now
            snapshot_files.makedirs(directory)
            names = snapshot_files.listdir(directory)
        except OSError as exc:  # each step's snapshot fails (in its result, counted) until it can be written
            log.warning("snapshot_every: %s: %s: every snapshot fails until it can be written", directory,
                        _os_error(exc))
            names = []
        # numbered on from what the directory holds: a job restored from step-40 and training on writes
        # step-50, step-60 (never below an older run's snapshots, which pruning would keep instead); a schedule
        # this client set again on the same directory goes on with its numbering (``base``: its steps are not
        # counted twice)
        newest = max((_step_of(n) for n in names if _step_of(n) is not None), default=0)
        self.base = newest if base is None else int(base)

    def after_step(self, cluster, step: int) -> dict | None:
        if step % self.steps:
            return None
        step += self.base
        path = snapshot_files.join(self.directory, f"{STEP_PREFIX}{step:09d}")
        t0 = time.perf_counter()
        manifest = save(cluster, path, self.on_progress, overwrite=True)
        record = {"step": step, "path": path, "bytes": manifest["bytes"], "seconds": time.perf_counter() - t0}
        self.saved.append(record)
        self._prune()
        return record

    def _prune(self) -> None:
        names = sorted((n for n in snapshot_files.listdir(self.directory) if _step_of(n) is not None), key=_step_of)
        complete = [n for n in names if snapshot_files.exists(snapshot_files.join(self.directory, n), MANIFEST)]
        keep = set(complete[-self.keep:])
        for name in names:
            if name not in keep and (name in complete or _step_of(name) < _step_of(complete[-1] if complete else name)):
                _remove_tree(snapshot_files.join(self.directory, name))


def _remove_tree(path: str) -> None:
    if snapshot_files.is_url(path):
        import fsspec

        fs, root = fsspec.core.url_to_fs(path)
        fs.rm(root, recursive=True)
    else:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
