"""A snapshot's parts in-process: the items a server writes (``ecrec.snapshot.files``) read back in place and by
DCP's own item format, and the rows a server gathers for its range (``ecrec.snapshot.part._gather``) placed
right for every layout, range and message size, the block-aligned path and the row-by-row one alike."""

from __future__ import annotations

import errno
import io
import itertools
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ecrec.snapshot import files as snapshot_files, part as snapshot_part
from ecrec.coding.layout import Layout
from ecrec.tables.shards import TableShard
from ecrec.tables.spec import TableSpec


def test_an_item_reads_back_in_place_and_as_dcp_reads_it(tmp_path):
    a = np.random.default_rng(0).random((1000, 16), dtype=np.float32)
    with open(tmp_path / "x.distcp", "wb") as f:
        f.write(b"header")
        first = snapshot_files.write_tensor(f, a)
        second = snapshot_files.write_tensor(f, a[:10] * 2)
    mapped = snapshot_files.map_tensor(str(tmp_path), "x.distcp", first["offset"], first["length"], (1000, 16))
    assert np.array_equal(mapped, a) and snapshot_files.digest(mapped) == first["sha256"]
    with open(tmp_path / "x.distcp", "rb") as f:  # what DCP's FileSystemReader does with an item: torch.load
        f.seek(second["offset"])
        loaded = torch.load(io.BytesIO(f.read(second["length"])), weights_only=True)
    assert np.array_equal(loaded.numpy(), a[:10] * 2)
    with pytest.raises(ValueError, match="uncompressed storage"):
        snapshot_files.map_tensor(str(tmp_path), "x.distcp", first["offset"], first["length"], (1000, 17))
    data = (tmp_path / "x.distcp").read_bytes()
    (tmp_path / "cut.distcp").write_bytes(data[: first["offset"] + first["length"] // 2])
    with pytest.raises(ValueError):
        snapshot_files.map_tensor(str(tmp_path), "cut.distcp", first["offset"], first["length"], (1000, 16))


@pytest.mark.parametrize("shape", [(1000, 16), (3,), (0, 5), (1, 7), (5, 1), (2, 3, 4)])
def test_the_item_format_is_torch_saves_both_ways(shape):
    """Servers write items without torch: torch.load reads them (as DCP's reader does, after other items), and
    what torch.save writes reads back here; a tensor that is not one contiguous float32 storage is refused."""
    a = np.random.default_rng(1).random(shape, dtype=np.float32)
    stream = io.BytesIO(b"x" * 37)
    stream.seek(37)
    items = [snapshot_files.write_tensor(stream, a), snapshot_files.write_tensor(stream, a * 3)]
    for item, want in zip(items, (a, a * 3)):
        data = stream.getvalue()[item["offset"]:item["offset"] + item["length"]]
        loaded = torch.load(io.BytesIO(data), weights_only=True)
        assert loaded.dtype == torch.float32 and tuple(loaded.shape) == shape and np.array_equal(loaded.numpy(), want)
        assert np.array_equal(snapshot_files.read_tensor(stream, item["offset"], item["length"]), want)
    saved = io.BytesIO()
    torch.save(torch.from_numpy(a), saved)
    assert np.array_equal(snapshot_files.read_tensor(saved, 0, len(saved.getvalue())), a)


@pytest.mark.parametrize("tensor, why", [
    (torch.arange(12.0).reshape(3, 4).t(), "not contiguous"),
    (torch.arange(12, dtype=torch.float64), "DoubleStorage"),
    (torch.arange(12.0)[2:], "not contiguous"),
])
def test_an_item_that_is_not_one_contiguous_float32_tensor_is_refused(tensor, why):
    saved = io.BytesIO()
    torch.save(tensor, saved)
    with pytest.raises(ValueError, match=why):
        snapshot_files.read_tensor(saved, 0, len(saved.getvalue()))


def _servers(layout: Layout, spec: TableSpec) -> list:
    shards = [TableShard(spec, layout, i) for i in range(layout.num_servers)]
    for shard in shards:  # every row's payload tells its id
        shard._floats[shard.owned_slots] = shard.owned_ids[:, None].astype(np.float32) + \
            np.arange(spec.row_floats, dtype=np.float32) / 64

    def state_of(index: int):
        def call(owner, method, request):
            ids = np.frombuffer(request.ids, dtype="<i8")
            return SimpleNamespace(payload=shards[owner].read_payload_bytes(shards[owner].slots_for(ids)))

        return SimpleNamespace(layout=layout, index=index, table=lambda name: shards[index],
                               peers=SimpleNamespace(call=call), config=SimpleNamespace(max_ids_per_request=1 << 22),
                               strategy=SimpleNamespace(ensure_rows=lambda items: None))

    return [state_of(i) for i in range(layout.num_servers)], shards


@pytest.mark.parametrize("servers, k, m", [(1, 1, 0), (3, 3, 0), (4, 2, 1), (5, 3, 2), (6, 3, 1)])
def test_a_server_gathers_every_row_of_its_range_in_id_order(servers, k, m, monkeypatch):
    layout = Layout(servers, k, m)
    block = servers * k
    rows = 7 * block + 3  # whole blocks then a tail
    spec = TableSpec("t", rows, 2, optimizer="adagrad").validate()
    states, shards = _servers(layout, spec)
    want = np.arange(rows, dtype=np.float32)[:, None] + np.arange(spec.row_floats, dtype=np.float32) / 64
    with ThreadPoolExecutor(4) as pool:
        for read_bytes in (4 << 20, 3 * spec.row_bytes):  # one message per peer, or many small ones
            monkeypatch.setattr(snapshot_part, "READ_BYTES", read_bytes)
            for start, stop in itertools.chain([(0, rows), (block, 5 * block), (2 * block, rows)],
                                               [(a, a + n) for a in (0, 1, block - 1) for n in (1, block, 2 * block + 1)]):
                for state in states:  # into a chunk's arrays (weights, state), as a server gathers them
                    buffers = snapshot_part._chunk_buffers(spec, stop - start + 5)
                    for buffer, _ in buffers:
                        buffer.fill(np.nan)
                    snapshot_part._gather(state, shards[state.index], start, stop, pool, "", buffers,
                                          snapshot_part.Parts())
                    got = np.concatenate([buffer[:stop - start] for buffer, _ in buffers], axis=1)
                    assert np.array_equal(got, want[start:stop]), (start, stop, state.index, read_bytes)
                    assert all(np.isnan(buffer[stop - start:]).all() for buffer, _ in buffers)  # nothing past it


def test_an_item_whose_pickle_is_compressed_or_large_is_refused_before_it_is_read():
    """A crafted item's data.pkl could inflate to gigabytes: only a small uncompressed record is read."""
    import zipfile

    a = np.ones((4, 3), np.float32)
    good = io.BytesIO()
    item = snapshot_files.write_tensor(good, a)
    with zipfile.ZipFile(io.BytesIO(good.getvalue())) as source:
        records = {i.filename: source.read(i) for i in source.infolist()}
    for compress, pad in ((zipfile.ZIP_DEFLATED, b""), (zipfile.ZIP_STORED, b"\x80" * (128 << 10))):
        crafted = io.BytesIO()
        with zipfile.ZipFile(crafted, "w") as target:
            for name, data in records.items():
                target.writestr(name, data + (pad if name.endswith("data.pkl") else b""),
                                compress_type=compress if name.endswith("data.pkl") else zipfile.ZIP_STORED)
        with pytest.raises(ValueError, match="data.pkl is not a small uncompressed record"):
            snapshot_files.read_tensor(crafted, 0, len(crafted.getvalue()))
    assert np.array_equal(snapshot_files.read_tensor(good, item["offset"], item["length"]), a)


def _direct_or_skip(path, name):
    with open(path / name, "wb") as f:
        fd = snapshot_files.open_direct(f)
    if fd is None:
        pytest.skip(f"{path}'s file system takes no O_DIRECT writes")
    return fd


def test_large_items_go_to_the_file_past_the_page_cache_and_read_back_as_dcp_reads_them(tmp_path, monkeypatch):
    """Items of a megabyte and more, in aligned memory, go by direct writes (whole blocks at aligned offsets);
    their tail, the small ones and unaligned memory through the stream: every item reads back in place and by
    torch.load, with the checksum of its values."""
    import os

    direct_writes = []
    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):
        direct_writes.append((offset, len(data)))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    rng = np.random.default_rng(4)
    aligned = snapshot_files.aligned_empty((4096, 64), np.float32)  # 1 MB, whole blocks
    aligned[...] = rng.random(aligned.shape, dtype=np.float32)
    tail = snapshot_files.aligned_empty((4099, 64), np.float32)  # and a part of a block
    tail[...] = rng.random(tail.shape, dtype=np.float32)
    raw = np.empty(4096 * 64 + 1, np.float32)  # 1 MB, memory not aligned
    unaligned = raw[1:] if raw[1:].ctypes.data % 4096 else raw[:-1]
    unaligned = unaligned.reshape(4096, 64)
    unaligned[...] = rng.random(unaligned.shape, dtype=np.float32)
    small = rng.random((10, 64), dtype=np.float32)
    again = snapshot_files.aligned_empty((4096, 64), np.float32)
    again[...] = aligned * 2
    fd = _direct_or_skip(tmp_path, "x.distcp")
    try:
        with open(tmp_path / "x.distcp", "r+b") as f:
            f.write(b"header")
            items = []
            for array in (aligned, small, tail, unaligned, again):
                before = len(direct_writes)
                items.append(snapshot_files.write_item(f, array, fd) | {"sha256": snapshot_files.digest(array)})
                items[-1]["direct"] = sum(n for _, n in direct_writes[before:])
    finally:
        os.close(fd)
    assert [item["direct"] for item in items] == [aligned.nbytes, 0, tail.nbytes // 4096 * 4096, 0, aligned.nbytes]
    assert all(offset % 4096 == 0 and n % 4096 == 0 for offset, n in direct_writes)
    for item, want in zip(items, (aligned, small, tail, unaligned, again)):
        mapped = snapshot_files.map_tensor(str(tmp_path), "x.distcp", item["offset"], item["length"], want.shape)
        assert np.array_equal(mapped, want) and snapshot_files.digest(mapped) == item["sha256"]
        with open(tmp_path / "x.distcp", "rb") as f:
            f.seek(item["offset"])
            loaded = torch.load(io.BytesIO(f.read(item["length"])), weights_only=True)
        assert np.array_equal(loaded.numpy(), want)


def test_a_file_system_that_refuses_direct_writes_gets_them_through_the_stream(tmp_path, monkeypatch):
    import errno
    import os

    def refuse(fd, data, offset):
        raise OSError(errno.EINVAL, "Invalid argument")

    calls = []
    real_pwrite = os.pwrite

    def partly(fd, data, offset):  # a block written, then the file system refuses the rest
        calls.append(offset)
        if len(calls) == 1:
            return real_pwrite(fd, data[:4096], offset)
        raise OSError(errno.EINVAL, "Invalid argument")

    a, b = (snapshot_files.aligned_empty((8192, 64), np.float32) for _ in range(2))
    a[...] = np.random.default_rng(5).random(a.shape, dtype=np.float32)
    b[...] = a + 1
    fd = _direct_or_skip(tmp_path, "x.distcp")
    try:
        with open(tmp_path / "x.distcp", "r+b") as f:
            monkeypatch.setattr(os, "pwrite", refuse)
            items = [snapshot_files.write_item(f, a, fd)]
            monkeypatch.setattr(os, "pwrite", partly)
            items.append(snapshot_files.write_item(f, b, fd))
    finally:
        os.close(fd)
    assert len(calls) == 2  # the second item: one block direct, the rest through the stream
    for item, want in zip(items, (a, b)):
        assert np.array_equal(snapshot_files.map_tensor(str(tmp_path), "x.distcp", item["offset"], item["length"],
                                                        want.shape), want)


def test_a_disk_error_in_a_direct_write_or_an_fsync_fails_the_write(tmp_path, monkeypatch):
    """EIO is the disk's failure, not a file system that takes no direct writes: raised, never written around."""
    import os

    def broken(fd, data, offset):
        raise OSError(errno.EIO, "Input/output error")

    a = snapshot_files.aligned_empty((8192, 64), np.float32)
    a[...] = 1.0
    fd = _direct_or_skip(tmp_path, "x.distcp")
    try:
        with open(tmp_path / "x.distcp", "r+b") as f:
            monkeypatch.setattr(os, "pwrite", broken)
            with pytest.raises(OSError) as info:
                snapshot_files.write_item(f, a, fd)
            assert info.value.errno == errno.EIO
    finally:
        os.close(fd)

    def fsync(fd, code=[errno.EIO]):
        raise OSError(code[0], os.strerror(code[0]))

    monkeypatch.setattr(os, "fsync", fsync)
    with open(tmp_path / "y", "wb") as f:
        with pytest.raises(OSError, match="Input/output"):
            snapshot_files.durable(f)
        fsync.__defaults__[0][0] = errno.EINVAL  # a file that takes no fsync (a pipe): skipped
        snapshot_files.durable(f)


def test_a_ticket_opens_only_a_connection_of_its_own_purpose():
    """A snapshot read's listener takes no opening made for the fast rebuild's frames with the same ticket (and
    gives up at its deadline however many wrong ones come)."""
    import threading

    from ecrec.strategies.erasure import frame_socket

    with frame_socket.FrameListener("127.0.0.1", 1.0, snapshot_part.DELIVERY_PURPOSE) as listener:
        sender = threading.Thread(target=lambda: frame_socket.send_frames(
            "127.0.0.1", listener.port, listener.ticket, [np.ones(16, np.uint8)], 2.0))  # the stripe frames' purpose
        sender.start()
        with pytest.raises(OSError):
            listener.receive_into(memoryview(np.empty(16, np.uint8)))
        sender.join(5)
    with frame_socket.FrameListener("127.0.0.1", 5.0, snapshot_part.DELIVERY_PURPOSE) as listener:
        sender = threading.Thread(target=lambda: frame_socket.send_frames(
            "127.0.0.1", listener.port, listener.ticket, [np.arange(16, dtype=np.uint8)], 2.0,
            purpose=snapshot_part.DELIVERY_PURPOSE))
        sender.start()
        got = np.empty(16, np.uint8)
        listener.receive_into(memoryview(got))
        sender.join(5)
    assert np.array_equal(got, np.arange(16))


def test_arrays_for_direct_writes_start_at_a_block():
    for shape in [(1,), (3, 5), (1000, 64), (0, 4)]:
        a = snapshot_files.aligned_empty(shape, np.float32)
        assert a.shape == shape and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
        assert a.size == 0 or a.ctypes.data % snapshot_files.DIRECT_ALIGNMENT == 0
