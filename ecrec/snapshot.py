"""Snapshots of a cluster's tables in ``torch.distributed.checkpoint`` (DCP) format, restored onto a cluster of
any shape (another number of servers, another k and m, another strategy).

A snapshot is a DCP checkpoint (a directory, or any fsspec URL) that DCP's own API reads into a plain state
dict, no ECRec code needed::

    tables/<name>/weight    float32 (num_rows, dim)
    tables/<name>/state     float32 (num_rows, state columns): Adagrad's accumulators (absent for SGD)
    dense/<name>/payload    float32: a dense tensor's values then its optimizer state

and ``manifest.json`` beside it: the format version, each table's spec, each dense tensor's spec, the
cluster's shape and map epoch when saved, and the SHA-256 of every tensor.  A restore checks every tensor
against the manifest before it writes anything, so a corrupted or truncated snapshot is refused naming the
tensor and the file, and the cluster is left as it was.

The snapshot is consistent when no push runs while it is read: save from the (only) worker between steps,
or with the other workers paused.  The client gathers each tensor in memory before DCP writes it (the
model's size: this is not yet the servers writing their own shards in parallel).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import warnings
from pathlib import Path

import numpy as np
import torch

FORMAT = "ecrec-snapshot/1"
MANIFEST = "manifest.json"


class SnapshotError(ValueError):
    """A snapshot that cannot be restored here: missing, corrupted, or shaped for another model."""


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).reshape(-1)).hexdigest()


def _is_url(path: str) -> bool:
    return "://" in str(path)


def _writer(path: str):
    import torch.distributed.checkpoint as dcp

    if _is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # noqa: PLC0415 - only for URLs

        return FsspecWriter(path)
    Path(path).mkdir(parents=True, exist_ok=True)
    return dcp.FileSystemWriter(path)


def _reader(path: str):
    import torch.distributed.checkpoint as dcp

    if _is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # noqa: PLC0415

        return FsspecReader(path)
    return dcp.FileSystemReader(path)


def _open(path: str, name: str, mode: str):
    if _is_url(path):
        import fsspec

        return fsspec.open(f"{str(path).rstrip('/')}/{name}", mode).open()
    return open(Path(path) / name, mode)


def save(cluster, path: str, on_progress=None) -> dict:
    """Writes a snapshot of every table and dense tensor of ``cluster`` to ``path`` (a directory or an fsspec
    URL); returns the manifest.  ``on_progress(text)`` after each table."""
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    cluster_map = cluster.refresh_map()
    from ecrec.tables import DenseSpec, TableSpec

    state: dict[str, torch.Tensor] = {}
    manifest = {"format": FORMAT, "created": time.time(), "epoch": cluster_map.epoch,
                "servers": cluster_map.num_servers, "strategy": cluster_map.strategy, "k": cluster_map.k,
                "m": cluster_map.m, "tables": {}, "dense": {}, "tensors": {}}
    for t in cluster_map.tables:
        spec = TableSpec.from_proto(t)
        manifest["tables"][spec.name] = dataclasses.asdict(spec)
        parts = ["weights"] + (["state"] if spec.row_floats > spec.dim else [])
        for part in parts:
            array = cluster.read_table(spec.name, part)
            key = f"tables/{spec.name}/{'weight' if part == 'weights' else 'state'}"
            state[key] = torch.from_numpy(array)
            manifest["tensors"][key] = {"shape": list(array.shape), "sha256": _digest(array)}
        if on_progress is not None:
            on_progress(f"read table {spec.name!r} ({spec.num_rows:,} x {spec.dim})")
    for d in cluster_map.dense:
        spec = DenseSpec.from_proto(d)
        array = cluster.read_dense_payload(spec.name)
        key = f"dense/{spec.name}/payload"
        state[key] = torch.from_numpy(array)
        manifest["dense"][spec.name] = {"shape": list(spec.shape), "optimizer": spec.optimizer}
        manifest["tensors"][key] = {"shape": list(array.shape), "sha256": _digest(array)}
    with warnings.catch_warnings():  # DCP warns that it runs in one process: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=_writer(str(path)))
    manifest["bytes"] = int(sum(v.numel() * 4 for v in state.values()))
    manifest["seconds"] = time.perf_counter() - t0
    with _open(str(path), MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
    if on_progress is not None:
        on_progress(f"wrote {manifest['bytes'] / 1e6:,.1f} MB to {path} in {manifest['seconds']:.2f} s")
    return manifest


def read_manifest(path: str) -> dict:
    try:
        with _open(str(path), MANIFEST, "r") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no {MANIFEST}; not an ECRec snapshot") from None
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"{path}/{MANIFEST} cannot be read: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise SnapshotError(f"{path}/{MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def load(cluster, path: str, on_progress=None) -> dict:
    """Restores the snapshot at ``path`` into ``cluster`` (any shape): tables the cluster lacks are created
    with the snapshot's specs, tables it has must have the same rows, dim and optimizer; every tensor is read
    and checked against the manifest's SHA-256 before the first row is written.  Returns the manifest.
    Dense tensors are not restored yet (registered dense modules keep the cluster's values)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ecrec.tables import TableSpec

    manifest = read_manifest(path)
    existing = {t.name: TableSpec.from_proto(t) for t in cluster.refresh_map().tables}
    specs = {}
    for name, fields in manifest["tables"].items():
        try:
            spec = TableSpec(**fields).validate()
        except (TypeError, ValueError) as exc:
            raise SnapshotError(f"{path}/{MANIFEST}: table {name!r} has no valid spec: {exc}") from None
        wanted = [f"tables/{name}/weight"] + ([f"tables/{name}/state"] if spec.row_floats > spec.dim else [])
        for key in wanted:
            info = manifest["tensors"].get(key)
            width = spec.dim if key.endswith("/weight") else spec.row_floats - spec.dim
            if info is None or list(info.get("shape", [])) != [spec.num_rows, width]:
                raise SnapshotError(f"{path}/{MANIFEST}: table {name!r} needs {key} of shape "
                                    f"[{spec.num_rows}, {width}], the manifest has {info and info.get('shape')}")
        have = existing.get(name)
        if have is not None and (have.num_rows, have.dim, have.optimizer) != (spec.num_rows, spec.dim, spec.optimizer):
            raise SnapshotError(f"table {name!r}: the snapshot holds {spec.num_rows:,} x {spec.dim} ({spec.optimizer}); "
                                f"this cluster's table is {have.num_rows:,} x {have.dim} ({have.optimizer})")
        specs[name] = spec
    tables = {key: torch.empty(info["shape"], dtype=torch.float32) for key, info in manifest["tensors"].items()
              if key.startswith("tables/")}
    reader = _reader(str(path))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tables, storage_reader=reader)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's own errors (CheckpointException
        # is a BaseException), named with the snapshot
        raise SnapshotError(f"{path}: the snapshot's tensors cannot be read ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}); {_files(path)}") from None
    for key, tensor in tables.items():
        if _digest(tensor.numpy()) != manifest["tensors"][key]["sha256"]:
            raise SnapshotError(f"{path}: {key} does not match its checksum in {MANIFEST} (a corrupted file: "
                                f"{_files(path)}); nothing was restored")
    for name, spec in specs.items():
        if name not in existing:
            cluster.create_table(name, spec.num_rows, spec.dim, optimizer=spec.optimizer, lr=spec.lr, eps=spec.eps,
                                 initial_accumulator_value=spec.initial_accumulator_value, init="zeros",
                                 seed=spec.seed)
        ids = np.arange(spec.num_rows)
        weight, state = tables.pop(f"tables/{name}/weight").numpy(), tables.pop(f"tables/{name}/state", None)
        if state is None:
            cluster.write_rows(name, ids, weight)
        else:  # weights and state in one pass: no moment with new weights and old accumulators
            cluster.write_rows(name, ids, np.concatenate([weight, state.numpy()], axis=1), what="payload")
        del weight, state
        if on_progress is not None:
            on_progress(f"restored table {name!r} ({spec.num_rows:,} x {spec.dim})")
    return manifest


def _files(path: str) -> str:
    if _is_url(path):
        return f"files under {path}"
    names = sorted(p.name for p in Path(path).glob("*.distcp"))
    return f"files {', '.join(names) or '(none)'} in {path}"
