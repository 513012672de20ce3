"""The training workload: Criteo TSV reader, synthetic generator, in-memory data, DLRM, metrics, MovieLens.

Nothing here uses the network; MovieLens is tested on tiny fake ml-100k folders
written by the tests.  The one cluster test (marked ``cluster``) checks that a
cluster-backed DLRM follows the local reference step for step.
"""

from __future__ import annotations

import gzip
import math
import re
import subprocess
import warnings
import zipfile

import numpy as np
import pytest
import torch

from ecrec.workload import movielens
from ecrec.workload.data import Batch, CriteoReader, InMemoryDataset, write_synthetic_criteo
from ecrec.workload.dlrm import (DLRM, DLRMSpec, build_local_dlrm, dense_parameters, evaluate, local_embedding_factory,
                                 local_optimizer, loss_fn)
from ecrec.workload.metrics import auc, logloss

ND, NS = 13, 26


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The models here are tiny: one intra-op thread is fastest, and far faster on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- a pure-Python reference parser ----------------------------------------------------------------

_INT = re.compile(r"[-+]?[0-9]{1,18}\Z", re.ASCII)
_HEXRE = re.compile(r"[0-9a-fA-F]{1,64}\Z", re.ASCII)


def ref_parse(line: str, sizes, nd=ND):
    """(label, dense list, ids list) or None when malformed."""
    f = line.rstrip("\r").split("\t")
    if len(f) != 1 + nd + len(sizes) or f[0] not in ("0", "1"):
        return None
    dense = []
    for x in f[1:1 + nd]:
        if x and not _INT.match(x):
            return None
        dense.append(math.log1p(max(int(x), 0)) if x else 0.0)
    ids = []
    for x, n in zip(f[1 + nd:], sizes):
        if x and not _HEXRE.match(x):
            return None
        ids.append(int(x, 16) % n if x else 0)
    return int(f[0]), dense, ids


def read_all(reader):
    batches = list(reader)
    if not batches:
        return np.zeros(0, np.int64), np.zeros((0, reader.num_dense)), np.zeros((0, reader.num_sparse), np.int64), np.zeros(0)
    return (np.concatenate([b.line_numbers for b in batches]), np.concatenate([b.dense.numpy() for b in batches]),
            np.concatenate([b.ids for b in batches]), np.concatenate([b.labels.numpy() for b in batches]))


def check_against_reference(lines: list[str], reader, sizes):
    got_lines, dense, ids, labels = read_all(reader)
    expected = {i + 1: ref_parse(l, sizes, reader.num_dense) for i, l in enumerate(lines)}
    rank, world = reader.shard
    good = [n for n, r in expected.items() if r is not None and lines[n - 1] != "" and (n - 1) % world == rank]
    assert got_lines.tolist() == good
    for k, n in enumerate(got_lines):
        label, d, i = expected[int(n)]
        assert labels[k] == label
        np.testing.assert_allclose(dense[k], d, rtol=1e-6, atol=1e-6)
        assert ids[k].tolist() == i, f"line {n}"
    bad = [n for n, r in expected.items() if r is None and lines[n - 1] != "" and (n - 1) % world == rank]
    assert [n for n, _ in reader.stats.malformed_lines] == bad
    assert reader.stats.malformed == len(bad)


@pytest.fixture(scope="module")
def small_tsv(tmp_path_factory):
    """A synthetic Criteo file of 300 lines with malformed lines injected at known line numbers."""
    d = tmp_path_factory.mktemp("criteo")
    src = d / "clean.tsv"
    info = write_synthetic_criteo(src, 300, rows_per_table=1000, seed=7)
    lines = src.read_text().splitlines()
    bad = {
        5: lines[4].rsplit("\t", 1)[0],                     # 39 columns
        17: lines[16] + "\tdeadbeef",                       # 41 columns
        40: "\t".join(lines[39].split("\t")[:20] + ["zz12"] + lines[39].split("\t")[21:]),   # bad hex (C7)
        77: "\t".join(lines[76].split("\t")[:3] + ["12a"] + lines[76].split("\t")[4:]),      # bad int (I3)
        123: "2" + lines[122][1:],                          # bad label
        124: lines[123][1:],                                # empty label
        250: "\t".join(lines[249].split("\t")[:30] + ["\u00e9\u00e9"] + lines[249].split("\t")[31:]),  # non-ASCII
    }
    for n, text in bad.items():
        lines[n - 1] = text
    path = d / "dirty.tsv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, lines, info.table_sizes, sorted(bad)


# --- the reader --------------------------------------------------------------------------------------

def test_reader_skip_reports_exact_line_numbers(small_tsv):
    path, lines, sizes, bad = small_tsv
    reader = CriteoReader(path, sizes, batch_size=32, on_malformed="skip")
    check_against_reference(lines, reader, sizes)
    assert [n for n, _ in reader.stats.malformed_lines] == bad
    reasons = dict(reader.stats.malformed_lines)
    assert "39 columns" in reasons[5] and "41 columns" in reasons[17]
    assert "C7" in reasons[40] and "'zz12'" in reasons[40]
    assert "I3" in reasons[77] and "'12a'" in reasons[77]
    assert "label" in reasons[123] and "label" in reasons[124]
    assert reader.stats.samples == 300 - len(bad) and reader.stats.lines == 300
    # every batch but the last is full
    sizes_seen = [len(b) for b in CriteoReader(path, sizes, batch_size=32)]
    assert all(s == 32 for s in sizes_seen[:-1]) and sum(sizes_seen) == 300 - len(bad)
    assert sum(len(b) for b in CriteoReader(path, sizes, batch_size=32, drop_last=True)) == 32 * ((300 - len(bad)) // 32)


def test_reader_error_names_file_and_line(small_tsv):
    path, _, sizes, bad = small_tsv
    with pytest.raises(ValueError, match=re.escape(f"{path}:{bad[0]}:") + ".*39 columns"):
        list(CriteoReader(path, sizes, batch_size=32, on_malformed="error"))
    with pytest.raises(ValueError, match="on_malformed"):
        CriteoReader(path, sizes, on_malformed="ignore")
    with pytest.raises(FileNotFoundError):
        CriteoReader(path.parent / "missing.tsv", sizes)
    with pytest.raises(ValueError, match="table_sizes"):
        CriteoReader(path, [10] * 25)


def test_reader_error_on_bad_hex_line(tmp_path, small_tsv):
    _, lines, sizes, _ = small_tsv
    clean = [l for i, l in enumerate(lines) if i + 1 not in (5, 17)]  # first bad line is now the bad hex (line 38)
    p = tmp_path / "x.tsv"
    p.write_text("\n".join(clean) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{p}:38:") + r".*C7.*'zz12'"):
        list(CriteoReader(p, sizes, on_malformed="error"))


def test_sharding_is_disjoint_and_complete(small_tsv):
    path, lines, sizes, bad = small_tsv
    world = 3
    seen, malformed = [], []
    for rank in range(world):
        reader = CriteoReader(path, sizes, batch_size=16, shard=(rank, world))
        got, *_ = read_all(reader)
        assert all((n - 1) % world == rank for n in got)
        seen.extend(got.tolist())
        malformed.extend(n for n, _ in reader.stats.malformed_lines)
        check_against_reference(lines, CriteoReader(path, sizes, batch_size=16, shard=(rank, world)), sizes)
    assert len(seen) == len(set(seen))
    assert sorted(seen) == [n for n in range(1, 301) if n not in bad]
    assert sorted(malformed) == bad
    with pytest.raises(ValueError, match="shard"):
        CriteoReader(path, sizes, shard=(3, 3))


@pytest.mark.slow
def test_reader_matches_reference_on_fuzzed_fields(tmp_path):
    """Odd fields of every kind: signs, long values (the general path), upper-case hex, control and non-ASCII bytes."""
    rng = np.random.default_rng(0)
    sizes = [1, 7, 1000, 2**31 - 1, 2**58, 12345] * 4 + [97, 2**40]

    def digits(k):
        return "".join(rng.choice(list("0123456789"), k))

    def int_field():
        r = rng.random()
        if r < 0.8:
            return digits(rng.integers(1, 9))
        if r < 0.995:  # valid but unusual
            return rng.choice(["", "-" + digits(rng.integers(1, 8)), "+" + digits(rng.integers(1, 6)), digits(12),
                               digits(18), "-" + digits(17), "00000000", "99999999", "9" * 18, "-0"])
        return rng.choice([digits(19), "-", "+", "1a", " 1", "1.5", "\u00e9", "\x11", "--1", "1-", "/", ":"])

    def hex_field():
        r = rng.random()
        if r < 0.8:
            return "%08x" % rng.integers(0, 2**32)
        if r < 0.997:  # valid but unusual: empty, short, upper case, long (the general paths)
            return rng.choice(["", "%x" % rng.integers(0, 2**20), ("%08X" % rng.integers(0, 2**32)),
                               "%x" % rng.integers(2**40, 2**60), "f" * 30, "Ab" * 20, "0123456789abcdefABCDEF"])
        return rng.choice(["g1", "0x1f", "\u00df", "\x11", "\x7f", "/", ":", "@", "G", "`", "\x10\x19", "f" * 65])

    lines = []
    for i in range(2000):
        label = "1" if rng.random() < 0.5 else ("0" if rng.random() < 0.98 else rng.choice(["2", "", "01", "a"]))
        fields = [label] + [int_field() for _ in range(ND)] + [hex_field() for _ in range(NS)]
        if rng.random() < 0.01:
            fields = fields[:-1]
        lines.append("\t".join(fields))
    lines[100] = ""  # a blank line is ignored
    lines[200] += "\r"  # one CRLF line
    p = tmp_path / "fuzz.tsv"
    p.write_bytes(("\n".join(lines)).encode("utf-8"))  # no newline at the end
    reader = CriteoReader(p, sizes, batch_size=100, chunk_bytes=4096, max_reported=10_000)
    check_against_reference(lines, reader, sizes)
    assert 100 < reader.stats.malformed < 1000 and reader.stats.blank == 1


def test_chunking_gzip_and_in_memory_agree(tmp_path, small_tsv):
    path, lines, sizes, bad = small_tsv
    whole = read_all(CriteoReader(path, sizes, batch_size=50, chunk_bytes=1 << 24))
    small = read_all(CriteoReader(path, sizes, batch_size=7, chunk_bytes=4096))
    gz = tmp_path / "dirty.tsv.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    zipped = read_all(CriteoReader(gz, sizes, batch_size=64))
    for other in (small, zipped):
        for a, b in zip(whole, other):
            np.testing.assert_array_equal(a, b)
    ds = InMemoryDataset.from_tsv(path, sizes)
    assert len(ds) == 300 - len(bad) and ds.read_stats.malformed == len(bad)
    np.testing.assert_array_equal(ds.ids, whole[2])
    np.testing.assert_array_equal(ds.dense, whole[1])
    np.testing.assert_array_equal(ds.labels, whole[3])


def test_reader_reads_a_large_file_in_batches(tmp_path):
    """30k lines across many 64 KiB chunks and 4096-line batches: every line read once, none malformed.
    (How fast is not asserted: a shared machine makes any threshold flaky.)"""
    p = tmp_path / "large.tsv"
    info = write_synthetic_criteo(p, 30_000, seed=1)
    reader = CriteoReader(p, info.table_sizes, batch_size=4096, chunk_bytes=1 << 16)
    sizes = [len(b) for b in reader]
    assert sizes == [4096] * 7 + [30_000 - 7 * 4096]
    assert reader.stats.lines == reader.stats.samples == 30_000 and reader.stats.malformed == 0


# --- in-memory data set ------------------------------------------------------------------------------

def test_in_memory_split_shard_and_batches():
    rng = np.random.default_rng(0)
    n = 103
    dense = rng.random((n, 4)).astype(np.float32)
    ids = np.stack([np.arange(n), np.arange(n) % 5], axis=1)
    ds = InMemoryDataset(dense, ids, (np.arange(n) % 2).astype(np.float32), table_sizes=[n, 5])
    train, test = ds.split(0.2, seed=1)
    assert len(train) + len(test) == n and len(test) == 21
    assert set(train.ids[:, 0]).isdisjoint(test.ids[:, 0])
    assert sorted([*train.ids[:, 0], *test.ids[:, 0]]) == list(range(n))
    again, _ = ds.split(0.2, seed=1)
    np.testing.assert_array_equal(again.ids, train.ids)
    shards = [ds.shard(r, 4) for r in range(4)]
    assert sorted(np.concatenate([s.ids[:, 0] for s in shards]).tolist()) == list(range(n))
    batches = list(ds.batches(10, shuffle=True, seed=3))
    assert [len(b) for b in batches] == [10] * 10 + [3]
    seen = np.concatenate([b.sparse[0][0].numpy() for b in batches])
    assert sorted(seen.tolist()) == list(range(n))
    b = batches[0]
    assert b.dense.shape == (10, 4) and b.dense.dtype == torch.float32 and b.labels.dtype == torch.float32
    assert all(idx.dtype == torch.int64 and off.tolist() == list(range(10)) for idx, off in b.sparse)
    np.testing.assert_array_equal(b.dense.numpy(), dense[b.ids[:, 0]])
    assert sum(1 for _ in ds.repeat(32, 7)) == 7
    with pytest.raises(ValueError, match="out of range"):
        InMemoryDataset(dense, ids, np.zeros(n), table_sizes=[n, 4])


# --- synthetic data ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_synthetic_generator_is_deterministic(tmp_path):
    a, b, c = tmp_path / "a.tsv", tmp_path / "b.tsv", tmp_path / "c.tsv"
    ia = write_synthetic_criteo(a, 40_000, num_tables=5, rows_per_table=[50, 100, 1000, 7, 2], seed=3)
    write_synthetic_criteo(b, 40_000, num_tables=5, rows_per_table=[50, 100, 1000, 7, 2], seed=3)
    write_synthetic_criteo(c, 40_000, num_tables=5, rows_per_table=[50, 100, 1000, 7, 2], seed=4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert ia.table_sizes == [50, 100, 1000, 7, 2] and 0.1 < ia.positive_rate < 0.6 and ia.oracle_auc > 0.75
    reader = CriteoReader(a, ia.table_sizes, batch_size=40_000, num_sparse=5, on_malformed="error")
    (batch,) = list(reader)
    ids = batch.ids
    assert len(batch) == 40_000 and reader.stats.malformed == 0
    assert all(ids[:, t].max() < s for t, s in enumerate(ia.table_sizes))
    assert ids[:, 4].max() == 1  # a 2-row table: row 0 (missing) and row 1
    counts = np.bincount(ids[:, 2], minlength=1000)[1:]
    top = np.sort(counts)[::-1]
    assert top[0] > 20 * np.median(top)  # Zipf: a few hot rows
    with pytest.raises(ValueError, match="rows_per_table"):
        write_synthetic_criteo(tmp_path / "d.tsv", 10, num_tables=2, rows_per_table=1)


@pytest.mark.slow
def test_synthetic_signal_is_learnable(tmp_path):
    torch.manual_seed(0)
    p = tmp_path / "s.tsv"
    info = write_synthetic_criteo(p, 20_000, num_tables=8, rows_per_table=1000, seed=3)
    train, test = InMemoryDataset.from_tsv(p, info.table_sizes, num_sparse=8).split(0.2, seed=0)
    spec = DLRMSpec(13, info.table_sizes, embedding_dim=8, bottom_mlp=(32,), top_mlp=(32,))
    model = build_local_dlrm(spec, seed=0)
    opt = local_optimizer(model, "sgd", lr=0.1)
    before = evaluate(model, test.batches(4096))
    for batch in train.repeat(128, 300, seed=1):
        opt.zero_grad()
        loss_fn(model.forward_batch(batch), batch.labels).backward()
        opt.step()
    after = evaluate(model, test.batches(4096))
    assert after["auc"] > 0.6, after
    assert after["auc"] > before["auc"] + 0.05 and after["logloss"] < before["logloss"]


# --- the model ---------------------------------------------------------------------------------------

def test_dlrm_forward_shapes_and_interaction():
    sizes = [10, 20, 30]
    model = DLRM(4, sizes, 6, bottom_mlp=(8,), top_mlp=(16, 8), seed=1)
    b = 5
    rng = np.random.default_rng(0)
    batch = Batch.from_arrays(rng.random((b, 4)), np.stack([rng.integers(0, s, b) for s in sizes], 1), np.ones(b))
    logits = model.forward_batch(batch)
    assert logits.shape == (b,) and logits.dtype == torch.float32
    # interaction: bottom output then the 6 pairwise dots of 4 features
    bottom = model.bottom_mlp(batch.dense)
    emb = [bag(i, o) for bag, (i, o) in zip(model.embeddings, batch.sparse)]
    z = model.interact(bottom, emb)
    assert z.shape == (b, 6 + 6)
    feats = [bottom, *emb]
    expected = [(feats[i] * feats[j]).sum(1) for i in range(4) for j in range(i)]
    torch.testing.assert_close(z[:, :6], bottom)
    torch.testing.assert_close(z[:, 6:], torch.stack(expected, 1))
    assert model.top_mlp[0].in_features == 12 and model.bottom_mlp[-2].out_features == 6
    # bags with several ids each (general offsets)
    bags = [(torch.tensor([0, 1, 2, 3, 4, 5, 6]), torch.tensor([0, 2, 3, 3, 5]))] * 3
    assert model(batch.dense, bags).shape == (b,)
    loss = loss_fn(logits, batch.labels)
    loss.backward()
    assert all(p.grad is not None for p in dense_parameters(model).parameters())
    assert model.embeddings[0].weight.grad.is_sparse
    with pytest.raises(ValueError, match="sparse features"):
        model(batch.dense, batch.sparse[:2])


def test_dlrm_init_is_deterministic_and_matches_cluster_tables():
    from ecrec.tables.spec import TableSpec, initial_weights

    spec = DLRMSpec(13, (50, 60), embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,))
    a, b, c = build_local_dlrm(spec, seed=3), build_local_dlrm(spec, seed=3), build_local_dlrm(spec, seed=4)
    for (na, pa), (nb, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert na == nb
        torch.testing.assert_close(pa, pb)
        assert not torch.equal(pa, pc)
    expected = initial_weights(TableSpec("emb1", 60, 4, seed=3), np.arange(60))
    np.testing.assert_array_equal(a.embeddings[1].weight.detach().numpy(), expected)
    names = [n for n, _ in dense_parameters(a).named_parameters()]
    assert names == [n for n, _ in a.named_parameters() if "mlp" in n] and names[0] == "bottom_mlp.0.weight"
    with pytest.raises(ValueError, match="dim"):
        DLRM(13, [5], 4, embedding_factory=lambda t, n, d: torch.nn.EmbeddingBag(n, d + 1))
    bag = local_embedding_factory("x", seed=1)(0, 9, 3)
    assert isinstance(bag, torch.nn.EmbeddingBag) and bag.sparse and bag.mode == "sum"


@pytest.mark.cluster
def test_cluster_dlrm_follows_local_reference(make_cluster, tmp_path):
    from ecrec.client import Cluster
    from ecrec.workload.dlrm import build_cluster_dlrm

    p = tmp_path / "s.tsv"
    info = write_synthetic_criteo(p, 2000, num_tables=3, rows_per_table=100, seed=1)
    ds = InMemoryDataset.from_tsv(p, info.table_sizes, num_sparse=3)
    spec = DLRMSpec(13, info.table_sizes, embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,))
    local = build_local_dlrm(spec, seed=5)
    opt = local_optimizer(local, "adagrad", lr=0.05)
    lc = make_cluster(servers=2)
    cluster = Cluster.connect(lc.coordinator_address)
    try:
        remote = build_cluster_dlrm(cluster, spec, optimizer="adagrad", lr=0.05, seed=5)
        probe = next(ds.batches(200))
        with torch.no_grad():
            torch.testing.assert_close(remote.forward_batch(probe), local.forward_batch(probe))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's sparse Adagrad warns about invariant checks
            for batch in ds.repeat(64, 10, seed=2):
                loss_fn(remote.forward_batch(batch), batch.labels).backward()
                cluster.step()
                opt.zero_grad()
                loss_fn(local.forward_batch(batch), batch.labels).backward()
                opt.step()
        with torch.no_grad():
            torch.testing.assert_close(remote.forward_batch(probe), local.forward_batch(probe), rtol=1e-4, atol=1e-5)
    finally:
        cluster.close()


# --- metrics -----------------------------------------------------------------------------------------

def test_auc_by_hand():
    assert auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == pytest.approx(0.75)
    assert auc([1, 0], [0.2, 0.9]) == 0.0 and auc([0, 1], [0.2, 0.9]) == 1.0
    # ties: the tied positive/negative pair counts 1/2 -> (1 + 0.5 + 1 + 1) / 4
    assert auc([0, 1, 0, 1], [0.1, 0.5, 0.5, 0.9]) == pytest.approx(0.875)
    assert auc([0, 1, 0, 1], [3, 3, 3, 3]) == pytest.approx(0.5)
    assert auc(np.array([1, 0, 1]), torch.tensor([2.0, -1.0, 0.0])) == 1.0  # logits work as scores
    assert math.isnan(auc([1, 1], [0.3, 0.4]))
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 300)
    s = rng.integers(0, 10, 300).astype(float)
    brute = np.mean([(sp > sn) + 0.5 * (sp == sn) for sp in s[y == 1] for sn in s[y == 0]])
    assert auc(y, s) == pytest.approx(brute)
    with pytest.raises(ValueError, match="length"):
        auc([0, 1], [0.5])
    with pytest.raises(ValueError, match="0 or 1"):
        auc([0, 2], [0.5, 0.1])


def test_logloss_by_hand():
    assert logloss([1, 0], [0.8, 0.4]) == pytest.approx(-(math.log(0.8) + math.log(0.6)) / 2)
    z = np.array([2.0, -1.0, 0.0, 30.0, -30.0])
    y = np.array([1, 0, 1, 0, 0])
    p = 1 / (1 + np.exp(-z))
    assert logloss(y, z, from_logits=True) == pytest.approx(float(np.mean(
        [math.log1p(math.exp(-2.0)), math.log1p(math.exp(-1.0)), math.log(2.0), 30.0 + math.log1p(math.exp(-30.0)),
         math.log1p(math.exp(-30.0))])))
    assert logloss(y[:3], p[:3]) == pytest.approx(logloss(y[:3], z[:3], from_logits=True))
    assert logloss([1], [0.0]) == pytest.approx(-math.log(1e-7))  # clipped, finite
    with pytest.raises(ValueError, match="from_logits"):
        logloss([1, 0], [2.0, -1.0])


# --- MovieLens ---------------------------------------------------------------------------------------

ATOMIC = {
    "ml-100k.inter": "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
                     "1\t10\t5\t874965758\n"      # 1997-09-22 22:02:38 UTC, a Monday
                     "2\t10\t3\t875000000\n"
                     "1\t20\t4\t875086400\n"
                     "3\t30\t1\t874965758\n",
    "ml-100k.user": "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
                    "1\t24\tM\ttechnician\t85711\n2\t53\tF\tother\t94043\n3\t17\tM\twriter\t32067\n",
    "ml-100k.item": "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
                    "10\tToy Story\t1995\tAnimation Children's Comedy\n"
                    "20\tGoldenEye\t1995\tThriller Action\n"
                    "30\tUnknown\t\tunknown\n",
}


def _grouplens(d):
    d.mkdir()
    (d / "u.data").write_text("1\t10\t5\t874965758\n2\t10\t3\t875000000\n1\t20\t4\t875086400\n3\t30\t1\t874965758\n")
    (d / "u.user").write_text("1|24|M|technician|85711\n2|53|F|other|94043\n3|17|M|writer|32067\n")
    flags = {"10": {3, 4, 5}, "20": {1, 16}, "30": {0}}
    rows = []
    for item, title, date in (("10", "Toy Story (1995)", "01-Jan-1995"), ("20", "GoldenEye (1995)", "01-Jan-1995"),
                              ("30", "unknown", "")):
        rows.append("|".join([item, title, date, "", "http://x"] + ["1" if g in flags[item] else "0" for g in range(19)]))
    (d / "u.item").write_bytes(("\n".join(rows) + "\n").encode("latin-1"))


@pytest.mark.parametrize("layout", ["atomic", "grouplens"])
def test_movielens_conversion(tmp_path, layout):
    d = tmp_path / "ml-100k"
    if layout == "atomic":
        d.mkdir()
        for name, text in ATOMIC.items():
            (d / name).write_text(text)
    else:
        _grouplens(d)
    data = movielens.load_movielens(tmp_path)  # finds the ml-100k subdirectory
    assert len(data) == 4
    assert data.labels.tolist() == [1, 0, 1, 0]
    assert data.table_names == movielens.TABLE_NAMES
    cols = {name: data.ids[:, k].tolist() for k, name in enumerate(data.table_names)}
    assert cols["user"] == [1, 2, 1, 3] and cols["item"] == [1, 1, 2, 3]
    assert cols["gender"] == [2, 1, 2, 2]  # F=1, M=2
    assert cols["occupation"] == [2, 1, 2, 3]  # other, technician, writer
    assert cols["age"] == [2, 3, 2, 1]  # buckets "0" (<18), "1" (18-24), "5" (50-55) -> ids 1, 2, 3
    assert cols["decade"] == [1, 1, 1, 0]  # 1990, missing for the item without a year
    # genres in canonical order: Animation, Children's / Action, Thriller / unknown
    assert cols["genre1"] == [2, 2, 1, 3] and cols["genre2"] == [1, 1, 2, 0]
    assert data.table_sizes == [4, 4, 4, 3, 4, 4, 2, 4, 3]
    raw = data.dense_raw
    assert raw[0, :6].tolist() == [22, 0, 0, 2, 3, 24]  # hour, weekday (Monday), day, movie age, genres, age
    assert raw[2, 2] == 2 and raw[3, 3] == 0 and raw[3, 4] == 1
    assert not raw[:, 6:].any()
    np.testing.assert_allclose(data.dense, np.log1p(raw))
    ds = data.dataset()
    assert len(ds) == 4 and ds.table_sizes == data.table_sizes
    # the TSV form reads back to the same arrays
    out = tmp_path / "ml.tsv"
    movielens.write_movielens_tsv(out, d)
    dense, ids, labels = movielens.read_movielens_tsv(out, data.table_sizes, on_malformed="error").read_arrays()
    np.testing.assert_array_equal(ids, data.ids)
    np.testing.assert_array_equal(labels, data.labels)
    np.testing.assert_allclose(dense, data.dense)


def test_movielens_missing_files_and_wheel_extraction(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="fetch"):
        movielens.find_ml100k(tmp_path)
    wheel = tmp_path / "recbole-9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in ATOMIC.items():
            zf.writestr(movielens.WHEEL_DIR + name, text)
        zf.writestr("recbole/__init__.py", "")
    dest = tmp_path / "data"
    assert movielens.main(["fetch", "--wheel", str(wheel), "--dest", str(dest)]) == 0
    assert len(movielens.load_movielens(dest)) == 4
    # a failing pip gives a clear error, and no network is touched
    def fake_run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies recbole\n")
    monkeypatch.setattr(movielens.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match=r"(?s)pip download recbole==1\.2\.1.*failed.*Could not find"):
        movielens.fetch(tmp_path / "nowhere")
    bad = tmp_path / "other.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("recbole/__init__.py", "")
    with pytest.raises(RuntimeError, match="has no"):
        movielens.extract_from_wheel(bad, tmp_path / "x")
