"""Table specs, deterministic initial rows and the torch-compatible optimizers."""

import numpy as np
import pytest
import torch

from ecrec.tables import optim
from ecrec.coding.layout import Layout
from ecrec.tables.spec import DenseSpec, TableSpec, initial_payload, initial_weights


def test_initial_rows_depend_only_on_seed_name_and_id():
    spec = TableSpec("t", 10_000, 16, seed=7)
    ids = np.arange(10_000)
    full = initial_weights(spec, ids)
    for servers in (1, 3, 4):
        layout = Layout(servers, servers)
        for s in range(servers):
            owned, _ = layout.rows_of(s, spec.num_rows)
            assert np.array_equal(initial_weights(spec, owned), full[owned])
    assert not np.array_equal(full, initial_weights(TableSpec("t", 10_000, 16, seed=8), ids))
    assert not np.array_equal(full, initial_weights(TableSpec("u", 10_000, 16, seed=7), ids))
    bound = 1 / np.sqrt(10_000)
    assert full.min() >= -bound and full.max() <= bound and abs(full.mean()) < 1e-3


def test_adagrad_payload_carries_state():
    spec = TableSpec("t", 10, 4, optimizer="adagrad", initial_accumulator_value=0.25)
    p = initial_payload(spec, np.arange(3))
    assert p.shape == (3, 8) and spec.row_bytes == 32
    assert (p[:, 4:] == np.float32(0.25)).all()


@pytest.mark.parametrize("bad", [
    dict(num_rows=0), dict(dim=0), dict(optimizer="adam"), dict(lr=-1.0), dict(lr=float("nan")),
    dict(init="xavier"), dict(name=""), dict(optimizer="adagrad", eps=0.0),
])
def test_invalid_table_specs(bad):
    fields = dict(name="t", num_rows=10, dim=4)
    fields.update(bad)
    with pytest.raises(ValueError):
        TableSpec(**fields).validate()


def test_invalid_dense_spec():
    with pytest.raises(ValueError):
        DenseSpec("w", (0, 3)).validate()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_optimizer_matches_torch_sparse(name):
    rng = np.random.default_rng(0)
    n, dim, lr, eps = 50, 8, 0.05, 1e-8
    w0 = rng.standard_normal((n, dim)).astype(np.float32)
    emb = torch.nn.Embedding(n, dim, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(w0))
    opt = torch.optim.SGD(emb.parameters(), lr=lr) if name == "sgd" else torch.optim.Adagrad(emb.parameters(), lr=lr, eps=eps)
    rows = np.zeros((n, dim * (1 + optim.state_width(name))), dtype=np.float32)
    rows[:, :dim] = w0
    for _ in range(20):
        ids = rng.integers(0, n, 30)
        g = rng.standard_normal((30, dim)).astype(np.float32)
        opt.zero_grad()
        out = emb(torch.from_numpy(ids))
        out.backward(torch.from_numpy(g))
        opt.step()
        uniq, inv = np.unique(ids, return_inverse=True)
        gs = np.zeros((len(uniq), dim), np.float32)
        np.add.at(gs, inv, g)
        sub = rows[uniq]
        optim.apply(name, sub, gs, dim, lr, eps)
        rows[uniq] = sub
    np.testing.assert_allclose(rows[:, :dim], emb.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    if name == "adagrad":
        np.testing.assert_allclose(rows[:, dim:], opt.state[emb.weight]["sum"].to_dense().numpy(), rtol=1e-5)
