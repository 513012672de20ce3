"""The files of a snapshot, in a local directory or at any fsspec URL, written and read item by item the way
``torch.distributed.checkpoint``'s ``FileSystemWriter`` does (each item a ``torch.save`` of one tensor at an
offset of a ``.distcp`` file), so DCP's own reader reads what the servers write.

An item is written and read here without torch (a server process never imports it): ``torch.save``'s format is
a zip archive of uncompressed records (the tensor's pickle, its storage's bytes aligned to 64, a few one-line
records); the pickle is written opcode by opcode and, when read, parsed (never executed) and checked to describe
one contiguous float32 tensor of the expected shape.  ``tests/test_snapshot_files.py`` holds the format against
``torch.save`` and ``torch.load`` both ways.

Shared by the servers (each writes its own file, :mod:`ecrec.snapshot.part`) and the client that plans the
snapshot, writes its metadata and restores it (:mod:`ecrec.snapshot`).  A server writes an item's values past the
page cache when it can (:func:`open_direct`, :func:`write_item`): the item then starts at a block, and so do its
values (a larger alignment than ``torch.save``'s 64 bytes, which it includes).
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import pickle
import pickletools
import re
import secrets
import struct
import zipfile
from pathlib import Path

import numpy as np

#: the name a server's file may have: a plain ``.distcp`` name, never a path
DATA_FILE = re.compile(r"^[A-Za-z0-9_.-]+\.distcp$")


def is_url(path: str) -> bool:
    return "://" in str(path)


def local_dir(path: str) -> str | None:
    """The local directory ``path`` names (a path, or a ``file://`` URL), None on another store."""
    if not is_url(path):
        return str(path)
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, target = fsspec.core.url_to_fs(str(path))
    return target if isinstance(fs, LocalFileSystem) else None


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


#: what a file system answers a request it does not support (fsync of a pipe, ``O_DIRECT`` on tmpfs): not a
#: failure of the data, unlike every other error (EIO above all), which is raised
UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def durable(stream) -> None:
    """Flushes ``stream`` and, for a local file, fsyncs it (one fsync per file); an fsync the file does not
    support is skipped, any other error (a disk's EIO) raised."""
    stream.flush()
    if hasattr(stream, "fileno"):
        try:
            fd = stream.fileno()
        except (OSError, io.UnsupportedOperation):
            return  # not a file (an fsspec store's stream, a buffer)
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in UNSUPPORTED:
                raise


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


#: the largest ``data.pkl`` an item may hold (one tensor's pickle is a few hundred bytes): read before anything
MAX_PICKLE_BYTES = 64 << 10
#: the folder of an item's records, as ``torch.save`` names it for a stream
_ARCHIVE = "archive"
#: storages start at multiples of this many bytes from the item's start (``torch.save``'s alignment)
_ALIGNMENT = 64
#: the records ``torch.save`` writes beside the pickle and the storage, in its order (the storage goes after
#: ``byteorder``)
_RECORDS_BEFORE = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))
_RECORDS_AFTER = (("version", b"3\n"),)


def _pickled_int(value: int) -> bytes:
    return pickle.dumps(int(value), protocol=2)[2:-1]  # the int's own opcodes (no memo, no frame)


def _pickled_tuple(values) -> bytes:
    return b"(" + b"".join(_pickled_int(v) for v in values) + b"t"


def _pickled_text(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _tensor_pickle(shape: tuple[int, ...]) -> bytes:
    """The ``data.pkl`` of ``torch.save(tensor)`` for a contiguous float32 CPU tensor of ``shape`` whose storage is
    record ``data/0``: ``torch._utils._rebuild_tensor_v2(storage, 0, shape, stride, False, OrderedDict())``."""
    count = int(np.prod(shape, dtype=np.int64))
    strides = [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
    storage = (b"(" + _pickled_text("storage") + b"ctorch\nFloatStorage\n" + _pickled_text("0") + _pickled_text("cpu")
               + _pickled_int(count) + b"tQ")
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" + storage + _pickled_int(0) + _pickled_tuple(shape)
            + _pickled_tuple(strides) + b"\x89ccollections\nOrderedDict\n)Rt" + b"R.")


def _parse_tensor_pickle(data: bytes) -> tuple[tuple[int, ...], int]:
    """(shape, element count) of the tensor a ``data.pkl`` describes, read from its opcodes without running them;
    ValueError unless it is one contiguous float32 CPU tensor at offset 0 of storage ``0``."""
    globals_, args = [], []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name == "GLOBAL":
            globals_.append(arg)
        elif opcode.name in ("BININT", "BININT1", "BININT2", "LONG1", "BINUNICODE", "SHORT_BINUNICODE"):
            args.append(arg)
        elif opcode.name not in ("PROTO", "MARK", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE", "BINPUT",
                                 "LONG_BINPUT", "MEMOIZE", "BINPERSID", "NEWFALSE", "REDUCE", "STOP", "FRAME"):
            raise ValueError(f"the item's pickle holds {opcode.name}: not one float32 tensor")
    if globals_ != ["torch._utils _rebuild_tensor_v2", "torch FloatStorage", "collections OrderedDict"]:
        raise ValueError(f"the item's pickle names {globals_}: not one float32 tensor")
    if args[:3] != ["storage", "0", "cpu"] or len(args) < 5 or (len(args) - 5) % 2:
        raise ValueError("the item's pickle is not one tensor on storage 0")
    count, offset, dims = args[3], args[4], args[5:]
    shape, strides = tuple(dims[:len(dims) // 2]), tuple(dims[len(dims) // 2:])
    contiguous = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
    # a dimension of one element may have any stride, and an empty tensor any strides (as torch makes them)
    laid_out = count == 0 or all(n == 1 or s == c for n, s, c in zip(shape, strides, contiguous))
    if offset != 0 or not laid_out or int(np.prod(shape, dtype=np.int64)) != count:
        raise ValueError(f"the item's tensor {shape} (strides {strides}, offset {offset}) is not contiguous")
    return shape, count


#: what a write that bypasses the page cache (``O_DIRECT``) aligns: the file offset, the length and the memory
#: of what it writes (the logical block size of every common file system divides it)
DIRECT_ALIGNMENT = 4096
#: values smaller than this are written through the page cache whatever the file
DIRECT_MIN_BYTES = 1 << 20


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised array whose memory starts at a multiple of :data:`DIRECT_ALIGNMENT` (what a direct
    write takes)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + DIRECT_ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % DIRECT_ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def open_direct(stream) -> int | None:
    """A second descriptor of the local file ``stream`` writes, for :func:`write_item`'s large values to bypass the
    page cache (``O_DIRECT``: no copy into the kernel's memory, none of it evicted for the snapshot); opened
    through the stream's own descriptor (the same file whatever its name has become since).  None for a stream
    of no local file, or a file system that takes no direct writes (tmpfs): then everything goes through
    ``stream``."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return None


def _padding(position: int, name: str, alignment: int = _ALIGNMENT) -> bytes:
    """A local header's extra field that starts the record's data at a multiple of ``alignment``."""
    pad = (-(position + 30 + len(name.encode()) + 4)) % alignment
    return struct.pack("<HH", 0x4246, pad) + b"Z" * pad


def write_tensor(stream, array: np.ndarray) -> dict:
    """Writes ``array`` (float32) at the stream's position as DCP's ``FileSystemWriter`` writes a tensor item
    (``torch.save``'s format); returns ``{offset, length, sha256}`` (the checksum of the values, not of the
    bytes).  The values go from the array to the stream once, unbuffered."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    return {**write_item(stream, array), "sha256": digest(array)}


def write_item(stream, array: np.ndarray, direct: int | None = None) -> dict:
    """:func:`write_tensor` without the checksum (a caller that times the two apart): ``{offset, length}``.
    With ``direct`` (:func:`open_direct` of the stream's file), the item starts at a multiple of
    :data:`DIRECT_ALIGNMENT` (the gap before it is no item's) and so do its values, which go to the file
    without the page cache when their memory is aligned too (:func:`aligned_empty`)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    alignment = _ALIGNMENT
    if direct is not None and array.nbytes >= DIRECT_MIN_BYTES:
        alignment = DIRECT_ALIGNMENT
        gap = -stream.tell() % alignment
        stream.write(b"\0" * gap)
    offset = stream.tell()
    records = [("data.pkl", _tensor_pickle(array.shape)), *_RECORDS_BEFORE, ("data/0", None), *_RECORDS_AFTER,
               (".data/serialization_id", str(secrets.randbits(128)).zfill(40).encode())]
    item = _Item(stream, offset, direct if alignment == DIRECT_ALIGNMENT else None)
    with zipfile.ZipFile(item, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            name = f"{_ARCHIVE}/{name}"
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.extra = _padding(item.tell(), name, alignment if data is None else _ALIGNMENT)
            if data is None:
                info.file_size = array.nbytes
                with archive.open(info, "w") as record:
                    record.write(array.reshape(-1).view(np.uint8).data)
            else:
                archive.writestr(info, data)
    return {"offset": offset, "length": stream.tell() - offset}


def _item_values(buffer, shape=None) -> np.ndarray:
    """The float32 values of the tensor item in ``buffer`` (bytes or a memory map), viewed in place: the storage
    of a ``torch.save`` zip is stored uncompressed.  Raises ``ValueError`` when the item is not one uncompressed,
    contiguous float32 storage (of ``shape``, when given)."""
    with zipfile.ZipFile(_Window(buffer)) as archive:
        infos = archive.infolist()
        pickled = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
        data = [i for i in infos if i.filename.rsplit("/", 2)[-2:-1] == ["data"]]
        if len(pickled) != 1 or len(data) != 1 or data[0].filename.rsplit("/", 1)[1] != "0":
            raise ValueError("not one tensor item: no single data.pkl and storage 0")
        if pickled[0].compress_type != zipfile.ZIP_STORED or pickled[0].file_size > MAX_PICKLE_BYTES:
            raise ValueError(f"the item's data.pkl is not a small uncompressed record ({pickled[0].file_size} bytes, "
                             f"compression {pickled[0].compress_type})")
        found, count = _parse_tensor_pickle(archive.read(pickled[0]))
        if shape is not None and tuple(found) != tuple(int(s) for s in shape):
            raise ValueError(f"not one uncompressed storage of {4 * int(np.prod(shape))} bytes: the item holds "
                             f"a tensor of shape {list(found)}")
        if data[0].compress_type != zipfile.ZIP_STORED or data[0].file_size != 4 * count:
            raise ValueError(f"not one uncompressed storage of {4 * count} bytes")
        header = bytes(buffer[data[0].header_offset:data[0].header_offset + 30])
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise ValueError("no local file header where the directory points")
        start = data[0].header_offset + 30 + sum(struct.unpack("<HH", header[26:30]))
    if start + 4 * count > len(buffer):
        raise ValueError(f"the storage runs past the item ({start + 4 * count} > {len(buffer)} bytes)")
    return np.frombuffer(buffer, dtype="<f4", count=count, offset=start).reshape(found)


def read_tensor(stream, offset: int, length: int) -> np.ndarray:
    """The tensor item at ``offset`` of an open ``.distcp`` file (what DCP's ``FileSystemReader`` reads)."""
    stream.seek(offset)
    data = stream.read(length)
    if len(data) != length:
        raise EOFError(f"{length} bytes at offset {offset} wanted, the file holds {len(data)}")
    return _item_values(data)


class _Item(io.RawIOBase):
    """The part of a writable stream from ``start`` on, as a stream of its own: an item's zip records offsets from
    the item's start (as ``torch.save`` does), wherever in the ``.distcp`` file it lies."""

    def __init__(self, stream, start: int, direct: int | None = None):
        self._stream, self._start, self._direct = stream, start, direct

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._stream.tell() - self._start

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0:
            offset += self._start
        return self._stream.seek(offset, whence) - self._start

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        if self._direct is None or len(view) < DIRECT_MIN_BYTES:
            return self._stream.write(b)
        return self._write_direct(view)

    def _write_direct(self, view: memoryview) -> int:
        """``view``'s whole blocks written past the page cache where the file offset and the memory are aligned,
        the rest (and everything, when they are not or the file system refuses) through the stream."""
        self._stream.flush()
        position = self._stream.tell()
        whole = len(view) // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT
        if position % DIRECT_ALIGNMENT or np.frombuffer(view, np.uint8).ctypes.data % DIRECT_ALIGNMENT or not whole:
            return self._stream.write(view)
        done = 0
        try:
            while done < whole:
                n = os.pwrite(self._direct, view[done:whole], position + done)
                if n <= 0:
                    raise OSError(errno.EINVAL, "a direct write made no progress")
                done += n
        except OSError as exc:
            if exc.errno not in UNSUPPORTED:
                raise  # the disk's failure (EIO, ENOSPC): the snapshot fails, naming it
            self._direct = None  # this file system takes no direct writes (or not these): through the stream
        self._stream.seek(position + done)
        if done < len(view):
            self._stream.write(view[done:])
        return len(view)

    def flush(self) -> None:
        self._stream.flush()


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
    """The float32 tensor item at ``offset`` of a local ``.distcp`` file, mapped, not read (the page cache, no
    copy).  Raises ``ValueError`` when the item is not one uncompressed float32 storage of ``shape``.  The disk is
    asked for the whole item at once (``POSIX_FADV_WILLNEED``): a snapshot written past the page cache, or one on
    a fresh machine, is read in large requests, not page by page as the values are touched."""
    mapped = np.memmap(Path(path) / name, dtype=np.uint8, mode="r", offset=offset, shape=(length,))
    if hasattr(os, "posix_fadvise"):
        try:
            with open(Path(path) / name, "rb") as f:
                os.posix_fadvise(f.fileno(), offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # advice only
    return _item_values(mapped, shape)
