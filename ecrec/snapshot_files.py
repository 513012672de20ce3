"""The files of a snapshot, in a local directory or at any fsspec URL, written and read item by item the way
``torch.distributed.checkpoint``'s ``FileSystemWriter`` does (each item a ``torch.save`` of one tensor at an
offset of a ``.distcp`` file), so DCP's own reader reads what the servers write.

Shared by the servers (each writes its own file, :mod:`ecrec.snapshot_part`) and the client that plans the
snapshot, writes its metadata and restores it (:mod:`ecrec.snapshot`).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path

import numpy as np
import torch

#: the name a server's file may have: a plain ``.distcp`` name, never a path
DATA_FILE = re.compile(r"^[A-Za-z0-9_.-]+\.distcp$")


def is_url(path: str) -> bool:
    return "://" in str(path)


def join(path: str, name: str) -> str:
    return f"{str(path).rstrip('/')}/{name}" if is_url(path) else str(Path(path) / name)


def makedirs(path: str) -> None:
    if is_url(path):
        import fsspec

        fs, root = fsspec.core.url_to_fs(str(path))
        fs.makedirs(root, exist_ok=True)
    else:
        Path(path).mkdir(parents=True, exist_ok=True)


def exists(path: str, name: str) -> bool:
    if is_url(path):
        import fsspec

        fs, target = fsspec.core.url_to_fs(join(path, name))
        return fs.exists(target)
    return (Path(path) / name).exists()


def remove(path: str, name: str) -> None:
    if is_url(path):
        import fsspec

        fs, target = fsspec.core.url_to_fs(join(path, name))
        if fs.exists(target):
            fs.rm(target)
    else:
        (Path(path) / name).unlink(missing_ok=True)


def listdir(path: str) -> list[str]:
    if is_url(path):
        import fsspec

        fs, root = fsspec.core.url_to_fs(str(path))
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) if fs.exists(root) else []
    return sorted(p.name for p in Path(path).iterdir()) if Path(path).is_dir() else []


def open_file(path: str, name: str, mode: str):
    if is_url(path):
        import fsspec

        return fsspec.open(join(path, name), mode).open()
    return open(Path(path) / name, mode)


def durable(stream) -> None:
    """Flushes ``stream`` and, for a local file, fsyncs it (one fsync per file)."""
    stream.flush()
    if hasattr(stream, "fileno"):
        try:
            os.fsync(stream.fileno())
        except (OSError, io.UnsupportedOperation):
            pass


def sync_directory(path: str) -> None:
    """Makes a local directory's new names durable (nothing to do for a URL)."""
    if not is_url(path):
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomically(path: str, name: str, data: bytes) -> None:
    """``name`` appears whole or not at all: written beside, fsynced, renamed (a local directory); an fsspec
    store's put is already whole."""
    if is_url(path):
        with open_file(path, name, "wb") as f:
            f.write(data)
        return
    tmp = Path(path) / f".{name}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        durable(f)
    os.replace(tmp, Path(path) / name)
    sync_directory(path)


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).reshape(-1)).hexdigest()


def write_tensor(stream, array: np.ndarray) -> dict:
    """Writes ``array`` (float32) at the stream's position as DCP's ``FileSystemWriter`` writes a tensor item
    (``torch.save``); returns ``{offset, length, sha256}`` (the checksum of the values, not of the bytes)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    offset = stream.tell()
    torch.save(torch.from_numpy(array), stream)
    return {"offset": offset, "length": stream.tell() - offset, "sha256": digest(array)}


def read_tensor(stream, offset: int, length: int) -> np.ndarray:
    """The tensor item at ``offset`` of an open ``.distcp`` file (as DCP's ``FileSystemReader`` reads it)."""
    stream.seek(offset)
    data = stream.read(length)
    if len(data) != length:
        raise EOFError(f"{length} bytes at offset {offset} wanted, the file holds {len(data)}")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True).numpy()
