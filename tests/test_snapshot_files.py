"""A snapshot's parts in-process: the items a server writes (``ecrec.snapshot_files``) read back in place and by
DCP's own item format, and the rows a server gathers for its range (``ecrec.snapshot_part._gather``) placed
right for every layout, range and message size, the block-aligned path and the row-by-row one alike."""

from __future__ import annotations

import io
import itertools
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ecrec import snapshot_files, snapshot_part
from ecrec.layout import Layout
from ecrec.shards import TableShard
from ecrec.tables import TableSpec


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
                for state in states:
                    got = snapshot_part._gather(state, shards[state.index], start, stop, pool)
                    assert np.array_equal(got, want[start:stop]), (start, stop, state.index, read_bytes)
