"""The fast rebuild path (``erasure/bulk.py``): its choice of members, its decoding, and a whole replacement
rebuilt over many rounds, bit for bit; the initial rows written by the numba kernel."""

from __future__ import annotations

import time

import numpy as np
import pytest

import torch

from ecrec.bench.recovery import COORDINATOR_OPTIONS, wait_started
from ecrec.client import Cluster, EmbeddingBag
from ecrec.codec import Codec
from ecrec.config import ClientConfig
from ecrec.layout import Layout
from ecrec.strategies.erasure.bulk import position_plan
from ecrec.tables import TableSpec, _initial_payload_numpy, initial_payload



def test_strided_install_skips_rows_rebuilt_on_demand_and_rows_not_selected():
    """The fast path installs a round through one strided view; rows rebuilt on demand meanwhile (ready) and
    rows not selected (a member was not ready) keep what they hold, every other row gets the rebuilt bytes."""
    from ecrec.shards import TableShard

    layout = Layout(4, 2, 1)
    spec = TableSpec("t", 4_000, 4)
    shard = TableShard(spec, layout, index=1, initial_values=False)
    shard.mark_unready()
    rng = np.random.default_rng(5)
    slots = np.arange(1, shard.num_slots, layout.k)  # position 1 of every block: evenly spaced
    on_demand = slots[[3, 40, 41, 200]]
    early = rng.integers(0, 256, (len(on_demand), spec.row_bytes), dtype=np.uint8)
    assert shard.install(on_demand, early, np.full(len(on_demand), 7)) == len(on_demand)
    payload = rng.integers(0, 256, (len(slots), spec.row_bytes), dtype=np.uint8)
    versions = np.arange(len(slots), dtype=np.int64) + 100
    mask = np.ones(len(slots), bool)
    mask[[5, 6, 300]] = False
    installed = shard.install(slots, payload, versions, mask=mask)
    skipped = np.isin(slots, on_demand) | ~mask
    assert installed == int((~skipped).sum())
    got = shard.read(slots)
    assert np.array_equal(got.payload[~skipped], payload[~skipped])
    assert np.array_equal(got.versions[~skipped], versions[~skipped])
    assert np.array_equal(got.payload[np.isin(slots, on_demand)], early) and (got.versions[np.isin(slots, on_demand)] == 7).all()
    assert not got.ready[~mask].any() and got.ready[mask].all()
    assert not got.payload[~mask].any()  # never written
    assert shard.install(slots, payload, versions) == 3  # the unselected rows, later; nothing else again


@pytest.mark.parametrize("servers,k,m", [(3, 2, 1), (4, 2, 1), (5, 2, 2), (6, 3, 2), (7, 4, 1)])
def test_position_plan_names_the_right_member_of_every_stripe(servers, k, m):
    """For every replaced index, what the plan reads from (server, column) in block b is exactly the stripe
    member the decoder treats it as: checked against the layout's own functions."""
    layout = Layout(servers, k, m)
    blocks = np.arange(3)
    for index in range(servers):
        plan = position_plan(layout, index)
        assert index not in plan.data and index not in plan.parity

        def data_row_id(server, col, b):  # the row id a survivor sends at (server, column) of block b
            slot = b * k + plan.data[server][col]
            return int(layout.ids_of_slots(server, np.array([slot]))[0])

        for t, (others, (pserver, pcol)) in plan.data_source.items():
            for b in blocks:
                stripe = int(layout.ids_of_slots(index, np.array([b * k + t]))[0]) // k
                for u, (server, col) in others.items():
                    assert data_row_id(server, col, b) == stripe * k + u
                assert plan.parity[pserver][pcol] == 0
                assert int(layout.parity_servers(np.array([stripe]))[0, 0]) == pserver
        for j, members in plan.parity_source.items():
            stripes, pidx, slots = layout.parity_rows_of(index, 10 ** 6)
            for b in blocks:
                stripe = int(stripes[(slots == b * m + j)][0])
                for u, (server, col) in members.items():
                    assert data_row_id(server, col, b) == stripe * k + u


@pytest.mark.parametrize("k,m,backend", [(2, 1, "isa_l_rs_vand"), (3, 2, "isa_l_rs_vand"), (4, 2, "isa_l_rs_cauchy")])
def test_combine_decodes_and_encodes_like_pyeclib(k, m, backend):
    codec = Codec(k, m, backend, kernel="cpu")
    rng = np.random.default_rng(k * 10 + m)
    data = rng.integers(0, 256, (300, k, 96), dtype=np.uint8)
    parity = codec.encode_stripes(data)
    rows = {u: np.ascontiguousarray(data[:, u]) for u in range(k)}
    for j in range(m):
        encoded = codec.combine([(codec.coefficients[j][u], rows[u]) for u in range(k)])
        assert np.array_equal(encoded, parity[:, j])
        members = dict(rows) | {k + j: np.ascontiguousarray(parity[:, j])}
        for t in range(k):
            decoded = codec.combine([(a, members[u]) for u, a in codec.data_decode_coefficients(t, j).items()])
            assert np.array_equal(decoded, data[:, t])
            assert np.array_equal(decoded, codec.reconstruct_stripes(
                {u: members[u] for u in members if u != t}, [t])[t])
    with pytest.raises(ValueError, match="shapes"):
        codec.combine([(1, rows[0]), (1, rows[1][:10])])
    with pytest.raises(ValueError, match="lost"):
        codec.data_decode_coefficients(k, 0)


@pytest.mark.parametrize("spec", [
    TableSpec("t", 10_000, 16, seed=7),
    TableSpec("emb", 4_000_000, 64, optimizer="adagrad", initial_accumulator_value=0.1, seed=3),
    TableSpec("n", 500, 3, init="normal", seed=1),
    TableSpec("z", 500, 5, init="zeros", optimizer="adagrad", initial_accumulator_value=0.5),
])
def test_initial_rows_from_the_kernel_equal_the_numpy_reference(spec):
    ids = np.random.default_rng(0).integers(0, spec.num_rows, 20_000)
    assert np.array_equal(initial_payload(spec, ids).view(np.uint32), _initial_payload_numpy(spec, ids).view(np.uint32))


def _wait_redundant(local, index, since, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e.kind == "redundant" and e.index == index and e.wall_time >= since for e in local.cluster_map().events):
            return
        time.sleep(0.05)
    raise AssertionError("the replacement never became fully redundant")


@pytest.mark.cluster
@pytest.mark.parametrize("servers,k,m,victim", [(4, 2, 1, 1), (5, 2, 2, 3)])
def test_fast_rebuild_over_many_rounds_is_bit_exact(make_cluster, servers, k, m, victim):
    """Tables of two row widths, rebuilt in rounds of 600 rows (dozens of rounds, several messages each):
    every row and every parity row equal to before the failure, and most of them by the fast path."""
    local = make_cluster(servers=servers, standby=1, strategy="ecrec", k=k, m=m,
                         options={"rebuild_batch_rows": "600"}, coordinator_options=COORDINATOR_OPTIONS)
    cluster = Cluster.connect(local.coordinator_address, ClientConfig(rpc_timeout_s=120.0))
    wait_started(cluster, servers)  # a loaded machine may take longer than one creation deadline
    cluster.create_table("wide", 30_001, 24, optimizer="adagrad", lr=0.1, initial_accumulator_value=0.1, seed=4)
    cluster.create_table("narrow", 20_000, 8, optimizer="sgd", lr=0.1, seed=5)
    bags = {"wide": EmbeddingBag(cluster, "wide"), "narrow": EmbeddingBag(cluster, "narrow")}
    rng = np.random.default_rng(1)
    for _ in range(5):  # rows that differ from their initial values, with versions
        for name, bag in bags.items():
            ids = torch.from_numpy(rng.integers(0, bag.spec.num_rows, 3000))
            bag(ids, torch.arange(0, 3000, 10)).square().sum().backward()
        cluster.step()
    cluster.strategy_call("verify_parity")  # every pending parity batch delivered
    before = {name: cluster.read_payload(name)[1].copy() for name in ("wide", "narrow")}
    t_kill = time.time()
    local.kill(local.pid_of_index(victim))
    cluster.pull("narrow", np.arange(100))  # someone notices; the standby is promoted
    _wait_redundant(local, victim, t_kill)
    stats = cluster.strategy_call("stats", indices=[victim])[victim]
    held = stats["rows_rebuilt"] + stats["parity_rows_rebuilt"]
    # the rows the replayed pushes touched were rebuilt on demand first, row by row; the rest in bulk
    assert stats["bulk_rows_rebuilt"] >= 0.5 * held > 0
    assert stats["bulk_bytes_read"] > 10 * 600 * 24 * 8  # many rounds were read
    for name in before:
        assert np.array_equal(cluster.read_payload(name)[1].view(np.uint32), before[name].view(np.uint32)), name
    checked = cluster.strategy_call("verify_parity")
    assert sum(r["mismatched"] for r in checked.values()) == 0
    assert sum(r["checked"] for r in checked.values()) > 0
