"""End-to-end training through the SDK against real server processes on 127.0.0.1.

A tiny DLRM trained on the cluster must end with the same embedding rows, optimizer
state and dense weights (to float32 rounding) as the same model trained locally with
``torch.nn.EmbeddingBag(sparse=True)`` and ``torch.optim``; the result must not depend
on the number of servers; concurrent workers must lose no update.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from ecrec.client import Cluster, EmbeddingBag
from ecrec.tables.spec import TableSpec, initial_weights

pytestmark = pytest.mark.cluster

TABLES = [("user", 300, 8, "sum", 2), ("item", 120, 8, "mean", 3)]  # name, rows, dim, mode, ids per sample
STEPS, BATCH = 200, 16


class TinyDLRM(torch.nn.Module):
    def __init__(self, bags: dict[str, torch.nn.Module]):
        super().__init__()
        torch.manual_seed(1234)
        self.bags = bags  # not registered as submodules: the cluster holds them
        self.bottom = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
        self.top = torch.nn.Sequential(torch.nn.Linear(8 * 3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, dense, sparse):
        parts = [self.bottom(dense)] + [self.bags[name](ids) for name, ids in sparse.items()]
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(STEPS):
        dense = torch.from_numpy(rng.standard_normal((BATCH, 4)).astype(np.float32))
        sparse = {name: torch.from_numpy(rng.zipf(1.3, (BATCH, per)).astype(np.int64) % rows)
                  for name, rows, _, _, per in TABLES}
        label = torch.from_numpy((rng.random(BATCH) < 0.3).astype(np.float32))
        batches.append((dense, sparse, label))
    return batches


def optimizer_kwargs(name):
    return dict(lr=0.05) if name == "sgd" else dict(lr=0.05, eps=1e-8, initial_accumulator_value=0.1)


def train_local(optimizer):
    specs = {name: TableSpec(name, rows, dim, optimizer=optimizer, seed=5, **optimizer_kwargs(optimizer))
             for name, rows, dim, _, _ in TABLES}
    bags = {}
    for name, rows, dim, mode, _ in TABLES:
        bag = torch.nn.EmbeddingBag(rows, dim, mode=mode, sparse=True)
        with torch.no_grad():
            bag.weight.copy_(torch.from_numpy(initial_weights(specs[name], np.arange(rows))))
        bags[name] = bag
    model = TinyDLRM(bags)
    opt_cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adagrad
    sparse_opt = opt_cls([b.weight for b in bags.values()], **optimizer_kwargs(optimizer))
    dense_opt = opt_cls(model.parameters(), **optimizer_kwargs(optimizer))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for dense, sparse, label in make_data():
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss_fn(model(dense, sparse), label).backward()
        sparse_opt.step()
        dense_opt.step()
    state = {name: b.weight.detach().numpy().copy() for name, b in bags.items()}
    if optimizer == "adagrad":
        for name, b in bags.items():
            state[name + ".sum"] = sparse_opt.state[b.weight]["sum"].to_dense().numpy().copy()
    dense = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return state, dense


def train_cluster(address, optimizer):
    cluster = Cluster.connect(address)
    for name, rows, dim, _, _ in TABLES:
        cluster.create_table(name, rows, dim, optimizer=optimizer, seed=5, **optimizer_kwargs(optimizer))
    bags = {name: EmbeddingBag(cluster, name, mode=mode) for name, _, _, mode, _ in TABLES}
    model = TinyDLRM(bags)
    cluster.register_dense(model, optimizer=optimizer, **optimizer_kwargs(optimizer))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for dense, sparse, label in make_data():
        loss_fn(model(dense, sparse), label).backward()
        cluster.step()
    state = {}
    for name, _, dim, _, _ in TABLES:
        ids, payload = cluster.read_payload(name)
        assert (ids == np.arange(len(ids))).all()
        state[name] = payload[:, :dim]
        if optimizer == "adagrad":
            state[name + ".sum"] = payload[:, dim:]
    dense = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():  # the module's copy is the server's value
        np.testing.assert_array_equal(cluster.read_dense_payload(n)[: p.numel()], p.detach().numpy().reshape(-1))
    cluster.close()
    return state, dense


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_cluster_training_matches_local_torch(make_cluster, optimizer):
    local_rows, local_dense = train_local(optimizer)
    results = []
    for servers in (1, 4):
        cluster = make_cluster(servers=servers)
        results.append(train_cluster(cluster.coordinator_address, optimizer))
        cluster.close()
    for rows, dense in results:
        assert rows.keys() == local_rows.keys()
        for name in local_rows:
            moved = np.abs(local_rows[name] - initial_or_zero(name, local_rows)).max()
            assert moved > 1e-3, "training must have changed the rows, or the comparison proves nothing"
            np.testing.assert_allclose(rows[name], local_rows[name], rtol=2e-4, atol=2e-5, err_msg=name)
        for name in local_dense:
            np.testing.assert_allclose(dense[name], local_dense[name], rtol=2e-4, atol=2e-5, err_msg=name)
    # 1 and 4 servers: the same arithmetic per row, so the same bits
    for name in results[0][0]:
        np.testing.assert_array_equal(results[0][0][name], results[1][0][name])


def initial_or_zero(name, rows):
    base = name.split(".")[0]
    spec = next(t for t in TABLES if t[0] == base)
    if name.endswith(".sum"):
        return np.full_like(rows[name], 0.1)
    return initial_weights(TableSpec(base, spec[1], spec[2], seed=5), np.arange(spec[1]))


def _worker(address, worker_index, steps, queue):
    """Pushes gradient 1.0 for random rows; reports how often it pushed each row."""
    try:
        cluster = Cluster.connect(address, worker=f"w{worker_index}")
        bag = EmbeddingBag(cluster, "counts")
        rng = np.random.default_rng(worker_index)
        counts = np.zeros(64, dtype=np.int64)
        for _ in range(steps):
            ids = torch.from_numpy(rng.integers(0, 64, 10))
            bag(ids, torch.tensor([0])).sum().backward()  # one bag: d out / d row = multiplicity
            np.add.at(counts, ids.numpy(), 1)
            cluster.step()
        queue.put(("ok", counts))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        queue.put(("error", repr(exc)))


def test_concurrent_workers_lose_no_update(make_cluster):
    cluster = make_cluster(servers=3)
    client = Cluster.connect(cluster.coordinator_address)
    client.create_table("counts", 64, 4, optimizer="sgd", lr=1.0, init="zeros")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(cluster.coordinator_address, i, 60, queue)) for i in range(2)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(status == "ok" for status, _ in results), results
    expected = sum(counts for _, counts in results)
    _, payload = client.read_payload("counts")
    # every pushed gradient (1.0, lr 1.0) is in the rows: w = -count, exactly, in every column
    np.testing.assert_array_equal(payload, -np.repeat(expected[:, None], 4, axis=1).astype(np.float32))
    assert payload.sum() == -4 * 2 * 60 * 10


def test_collection_lookup_equals_per_table_bags(make_cluster):
    """EmbeddingBagCollection (one pull per server for every table) gives the same bags and the same
    updates as one EmbeddingBag per table."""
    from ecrec.client import EmbeddingBagCollection

    results = []
    for use_collection in (False, True):
        local = make_cluster(servers=3)  # a fresh cluster each: same table names, same initial rows
        cluster = Cluster.connect(local.coordinator_address)
        names = [n for n, *_ in TABLES]
        for name, (_, rows, dim, _, _) in zip(names, TABLES):
            cluster.create_table(name, rows, dim, optimizer="adagrad", lr=0.1, seed=3)
        bags = [EmbeddingBag(cluster, n) for n in names]
        collection = EmbeddingBagCollection(cluster, names)
        rng = np.random.default_rng(9)
        outs = []
        for _ in range(5):
            inputs = [(torch.from_numpy(rng.integers(0, rows, 12)), torch.tensor([0, 4, 9])) for _, rows, *_ in TABLES]
            got = collection(inputs) if use_collection else [b(i, o) for b, (i, o) in zip(bags, inputs)]
            outs.append(torch.cat(got, dim=1).detach().clone())
            torch.cat(got, dim=1).pow(2).sum().backward()
            cluster.step()
        rows_after = [cluster.read_payload(n)[1] for n in names]
        results.append((outs, rows_after))
        cluster.close()
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="distinct"):
        EmbeddingBagCollection(Cluster.connect(local.coordinator_address), ["user", "user"])


def _reference(rows: int, dim: int, seed: int = 0):
    weights = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))
    plain = torch.nn.EmbeddingBag(rows, dim, mode="sum", _weight=weights.clone(), sparse=True)
    return weights, plain, torch.optim.SGD(plain.parameters(), lr=0.1)


def test_gradients_reach_the_servers_in_every_order_torch_allows(make_cluster):
    """The orders of a torch loop in which the cluster lost embedding updates silently (the dense ones applied):
    ``zero_grad()`` between the forward and its backward (torch's own tutorial order) dropped the lookup, so the
    backward's gradient was never pushed; a ``step()`` before the backward did the same.  Each now ends where
    ``torch.optim.SGD`` on a plain ``torch.nn.EmbeddingBag`` ends, over several steps."""
    cluster = Cluster.connect(make_cluster(servers=3, strategy="ecrec", k=2, m=1).coordinator_address)
    weights, plain, sgd = _reference(100, 4)
    cluster.create_table("t", 100, 4, optimizer="sgd", lr=0.1, init=weights.clone())
    bag = EmbeddingBag(cluster, "t")
    generator = torch.Generator().manual_seed(5)
    for step in range(6):
        ids = torch.randint(0, 100, (12,), generator=generator)
        offsets = torch.arange(0, 12, 3)
        out, ref = bag(ids, offsets), plain(ids, offsets)
        if step % 2 == 0:  # forward, zero_grad, backward, step
            cluster.zero_grad()
            sgd.zero_grad()
            out.square().sum().backward()
            ref.square().sum().backward()
            assert cluster.step()["rows"] > 0
            sgd.step()
            sgd.zero_grad()  # (a cluster step takes the gradients it pushes; torch's stay until zeroed)
        else:  # forward, a step with nothing to push yet, backward, step
            assert cluster.step()["rows"] == 0
            sgd.step()
            sgd.zero_grad()
            out.square().sum().backward()
            ref.square().sum().backward()
            assert cluster.step()["rows"] > 0
            sgd.step()
            sgd.zero_grad()
        np.testing.assert_allclose(cluster.read_table("t"), plain.weight.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_lookups_whose_output_was_dropped_are_not_kept(make_cluster):
    """An evaluation loop with autograd on (``model.eval()`` without ``torch.no_grad()``): every lookup's rows
    were kept until the next step or zero_grad -- memory grew with every batch; torch frees them with the output.
    Now the cluster keeps only the rows a gradient can still reach, and a gradient recorded before them is still
    pushed."""
    import gc

    cluster = Cluster.connect(make_cluster(servers=2, strategy="none").coordinator_address)
    weights, plain, sgd = _reference(2000, 16)
    cluster.create_table("t", 2000, 16, optimizer="sgd", lr=0.1, init=weights.clone())
    bag = EmbeddingBag(cluster, "t").eval()
    ids, offsets = torch.arange(0, 2000, 7), torch.arange(0, 286, 11)
    bag(ids, offsets).sum().backward()  # a gradient recorded first
    plain(ids, offsets).sum().backward()
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        bag(torch.randint(0, 2000, (512,), generator=generator), torch.arange(0, 512, 8)).sum().item()
    gc.collect()
    held = [p for p in cluster._pending if (p.tensor() if hasattr(p, "tensor") else p.rows) is not None]
    assert len(held) <= 2, f"{len(held)} lookups' rows held"
    cluster.step()
    sgd.step()
    np.testing.assert_allclose(cluster.read_table("t"), plain.weight.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_a_step_whose_check_fails_keeps_every_gradient(make_cluster, monkeypatch):
    """An exception out of judging a step's gradients (before anything is sent) dropped every recorded lookup:
    the next step pushed nothing.  Now they are kept, and the next step pushes them."""
    from ecrec.client import cluster as cluster_module

    cluster = Cluster.connect(make_cluster(servers=2, strategy="none").coordinator_address)
    weights, plain, sgd = _reference(100, 4)
    cluster.create_table("t", 100, 4, optimizer="sgd", lr=0.1, init=weights.clone())
    bag = EmbeddingBag(cluster, "t")
    ids, offsets = torch.arange(0, 40, 3), torch.arange(0, 14, 7)
    bag(ids, offsets).square().sum().backward()
    plain(ids, offsets).square().sum().backward()
    real = cluster_module.bad_step

    def failing(*args):
        raise RuntimeError("the check failed")

    monkeypatch.setattr(cluster_module, "bad_step", failing)
    with pytest.raises(RuntimeError, match="the check failed"):
        cluster.step()
    monkeypatch.setattr(cluster_module, "bad_step", real)
    assert cluster.step()["rows"] > 0
    sgd.step()
    np.testing.assert_allclose(cluster.read_table("t"), plain.weight.detach().numpy(), rtol=1e-6, atol=1e-6)
