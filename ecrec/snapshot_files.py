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
import struct
import zipfile
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


class _Window(io.RawIOBase):
    """A read-only file over a buffer (a memory map): what :mod:`zipfile` needs to read a zip's directory."""

    def __init__(self, buffer):
        self._buffer, self._pos = memoryview(buffer), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: len(self._buffer)}[whence] + offset
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._buffer) - self._pos))
        b[:n] = self._buffer[self._pos:self._pos + n]
        self._pos += n
        return n


def map_tensor(path: str, name: str, offset: int, length: int, shape) -> np.ndarray:
    """The float32 tensor item at ``offset`` of a local ``.distcp`` file, mapped, not read: the values of a
    ``torch.save`` zip are stored uncompressed, so they are viewed in place (the page cache, no copy).  Raises
    ``ValueError`` when the item is not one uncompressed float32 storage of ``shape``."""
    count = int(np.prod(shape, dtype=np.int64))
    item = np.memmap(Path(path) / name, dtype=np.uint8, mode="r", offset=offset, shape=(length,))
    with zipfile.ZipFile(_Window(item)) as archive:
        data = [i for i in archive.infolist() if i.filename.rsplit("/", 2)[-2:-1] == ["data"]]
        if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED or data[0].file_size != 4 * count:
            raise ValueError(f"not one uncompressed storage of {4 * count} bytes")
        header = bytes(item[data[0].header_offset:data[0].header_offset + 30])
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise ValueError("no local file header where the directory points")
        start = data[0].header_offset + 30 + sum(struct.unpack("<HH", header[26:30]))
    if start + 4 * count > length:
        raise ValueError(f"the storage runs past the item ({start + 4 * count} > {length} bytes)")
    return np.frombuffer(item, dtype="<f4", count=count, offset=start).reshape(shape)
