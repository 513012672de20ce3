"""TorchRec interop: our collection built from ``torchrec.EmbeddingBagConfig`` s, fed ``KeyedJaggedTensor`` s,
matches ``torchrec.EmbeddingBagCollection`` step for step (same initial weights, SGD and Adagrad), and stands
in TorchRec's own DLRM.  The jagged lookup itself is also tested without TorchRec.

The TorchRec tests skip where the ``torchrec`` extra is not installed (``pip install -e '.[torchrec]'`` then
``pip install --no-deps torchrec==1.8.0``, see docs/sdk.md).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from ecrec.client import Cluster, EmbeddingBagCollection

HAS_TORCHREC = importlib.util.find_spec("torchrec") is not None
needs_torchrec = pytest.mark.skipif(not HAS_TORCHREC, reason="the torchrec extra is not installed")


def random_jagged(generator: torch.Generator, keys: list[str], rows: dict[str, int], batch: int):
    """Per feature ``batch`` bags of 0..4 ids (some empty), feature after feature."""
    lengths = torch.randint(0, 5, (len(keys) * batch,), generator=generator)
    values = []
    for f, key in enumerate(keys):
        n = int(lengths[f * batch:(f + 1) * batch].sum())
        values.append(torch.randint(0, rows[key], (n,), generator=generator))
    return torch.cat(values), lengths


@pytest.mark.cluster
def test_lookup_jagged_without_torchrec(make_cluster):
    local = make_cluster(servers=2)
    cluster = Cluster.connect(local.coordinator_address)
    cluster.create_table("a", 50, 4, seed=1)
    cluster.create_table("b", 30, 4, seed=2)
    collection = EmbeddingBagCollection(cluster, ["a", "b"], mode=["sum", "mean"])
    weights = {name: cluster.pull(name, np.arange(n)) for name, n in (("a", 50), ("b", 30))}
    generator = torch.Generator().manual_seed(0)
    keys = ["b", "a"]  # any order of the features
    values, lengths = random_jagged(generator, keys, {"a": 50, "b": 30}, batch=6)
    with torch.no_grad():
        got = collection.lookup_jagged(keys, values, lengths)
    start = 0
    for f, key in enumerate(keys):
        feature_lengths = lengths[f * 6:(f + 1) * 6]
        ids = values[start:start + int(feature_lengths.sum())]
        start += ids.numel()
        offsets = torch.cumsum(feature_lengths, 0) - feature_lengths
        expected = torch.nn.functional.embedding_bag(ids, weights[key], offsets, mode="sum" if key == "a" else "mean")
        assert torch.equal(got[key], expected), key
    with pytest.raises(ValueError, match="unknown features"):
        collection.lookup_jagged(["a", "b", "c"], values, torch.cat([lengths, lengths[:6]]))
    with pytest.raises(ValueError, match="missing from the input"):
        collection.lookup_jagged(["a"], values[:3], torch.tensor([3]))
    with pytest.raises(ValueError, match="do not split into 2 features"):
        collection.lookup_jagged(["a", "b"], values[:3], torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="lengths add up to"):
        collection.lookup_jagged(["a", "b"], values[:3], torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="lengths must be integers, got torch.float32"):  # 1.5 + 1.5 "added up"
        collection.lookup_jagged(["a", "b"], values[:3], torch.tensor([1.5, 1.5]))
    with pytest.raises(ValueError, match="mode must be 'sum' or 'mean'"):
        EmbeddingBagCollection(cluster, ["a"], mode="max")


def _torchrec_twin(cluster, configs):
    """``torchrec.EmbeddingBagCollection`` over ``configs`` holding the cluster tables' current rows."""
    import torchrec

    reference = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    with torch.no_grad():
        for config in configs:
            reference.embedding_bags[config.name].weight.copy_(
                cluster.pull(config.name, np.arange(config.num_embeddings)))
    return reference


@pytest.mark.cluster
@needs_torchrec
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_matches_torchrec_collection_step_for_step(make_cluster, optimizer):
    import torchrec
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    local = make_cluster(servers=3, strategy="ecrec", k=2, m=1)
    cluster = Cluster.connect(local.coordinator_address)
    configs = [
        torchrec.EmbeddingBagConfig(name="users", embedding_dim=8, num_embeddings=200, feature_names=["user", "friend"]),
        torchrec.EmbeddingBagConfig(name="products", embedding_dim=4, num_embeddings=120, feature_names=["item"],
                                    pooling=torchrec.PoolingType.MEAN),
    ]
    lr = 0.1
    ours = EmbeddingBagCollection.from_configs(cluster, configs, optimizer=optimizer, lr=lr, seed=5)
    theirs = _torchrec_twin(cluster, configs)
    torch_optimizer = (torch.optim.SGD(theirs.parameters(), lr=lr) if optimizer == "sgd"
                       else torch.optim.Adagrad(theirs.parameters(), lr=lr, eps=1e-10))
    generator = torch.Generator().manual_seed(1)
    readout = torch.randn(20, generator=generator)
    keys = ["item", "user", "friend"]  # not the collection's order: both reorder by feature name
    for step in range(6):
        values, lengths = random_jagged(generator, keys, {"user": 200, "friend": 200, "item": 120}, batch=16)
        features = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
        out_ours, out_theirs = ours(features), theirs(features)
        assert isinstance(out_ours, torchrec.KeyedTensor)
        assert out_ours.keys() == out_theirs.keys() == ["user", "friend", "item"]
        assert out_ours.length_per_key() == out_theirs.length_per_key() == [8, 8, 4]
        torch.testing.assert_close(out_ours.values(), out_theirs.values(), rtol=1e-6, atol=1e-6)
        (out_ours.values() @ readout).pow(2).mean().backward()
        (out_theirs.values() @ readout).pow(2).mean().backward()
        cluster.step()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    for config in configs:
        ids, payload = cluster.read_payload(config.name)
        weight = theirs.embedding_bags[config.name].weight.detach().numpy()
        np.testing.assert_allclose(payload[:, :config.embedding_dim], weight[ids], rtol=1e-5, atol=1e-6)
        if optimizer == "adagrad":  # the optimizer state too: Adagrad's sum of squared gradients
            state = torch_optimizer.state[theirs.embedding_bags[config.name].weight]["sum"].numpy()
            np.testing.assert_allclose(payload[:, config.embedding_dim:], state[ids], rtol=1e-5, atol=1e-7)
    assert not np.allclose(cluster.pull("users", np.arange(200)).numpy(),
                           _torchrec_twin_initial(configs[0], seed=5)), "training changed nothing"


def _torchrec_twin_initial(config, seed: int) -> np.ndarray:
    from ecrec.tables.spec import TableSpec, initial_weights

    spec = TableSpec(name=config.name, num_rows=config.num_embeddings, dim=config.embedding_dim, seed=seed).validate()
    return initial_weights(spec, np.arange(config.num_embeddings, dtype=np.int64))


@pytest.mark.cluster
@needs_torchrec
def test_from_configs_refuses_what_it_cannot_do(make_cluster):
    import torchrec

    local = make_cluster(servers=2)
    cluster = Cluster.connect(local.coordinator_address)
    config = lambda **kw: torchrec.EmbeddingBagConfig(**{"name": "t", "embedding_dim": 4, "num_embeddings": 10,
                                                         "feature_names": ["f"], **kw})
    with pytest.raises(ValueError, match="pooling NONE is not supported"):
        EmbeddingBagCollection.from_configs(cluster, [config(pooling=torchrec.PoolingType.NONE)])
    with pytest.raises(ValueError, match="must be unset or symmetric"):
        EmbeddingBagCollection.from_configs(cluster, [config(weight_init_min=0.0, weight_init_max=0.1)])
    with pytest.raises(ValueError, match="must be unset or symmetric"):  # one side set: TorchRec fills the other
        EmbeddingBagCollection.from_configs(cluster, [config(weight_init_max=0.5)])
    with pytest.raises(ValueError, match="feature 'f' is in tables 't' and 'u'"):
        EmbeddingBagCollection.from_configs(cluster, [config(), config(name="u")])
    with pytest.raises(ValueError, match="at least one EmbeddingBagConfig"):
        EmbeddingBagCollection.from_configs(cluster, [])
    # every config checked before any table is created: a bad size, a table that exists with another spec
    with pytest.raises(ValueError, match="table .z.: .*dim"):
        EmbeddingBagCollection.from_configs(cluster, [config(name="c3", feature_names=["g"]),
                                                      config(name="z", embedding_dim=0, feature_names=["h"])])
    # sizes create_table refuses, refused here first (int() took 1000.5; the table before it was made)
    for field, value in (("num_embeddings", 1000.5), ("embedding_dim", 4.5)):
        with pytest.raises(ValueError, match=f"from_configs: table 'z2': {field} must be a whole number, got "
                                             f"{value!r}"):
            EmbeddingBagCollection.from_configs(cluster, [config(name="c5", feature_names=["g"]),
                                                          config(name="z2", feature_names=["h"], **{field: value})])
    cluster.create_table("other", 5, 2)
    with pytest.raises(ValueError, match="table 'other' exists with another spec"):
        EmbeddingBagCollection.from_configs(cluster, [config(name="c4", feature_names=["g"]),
                                                      config(name="other", feature_names=["h"])])
    assert {t.name for t in cluster.refresh_map().tables} == {"other"}  # nothing created
    collection = EmbeddingBagCollection.from_configs(cluster, [config(weight_init_min=-0.5, weight_init_max=0.5)])
    assert 10 ** -0.5 < float(cluster.pull("t", np.arange(10)).abs().max()) <= 0.5  # not the default range
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    weighted = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([2]),
                                                   weights=torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="weighted features"):
        collection(weighted)


@pytest.mark.cluster
@needs_torchrec
def test_stands_in_torchrec_dlrm(make_cluster):
    """TorchRec's DLRM, given our collection instead of its own, trains through the cluster."""
    import torchrec
    from torchrec.models.dlrm import DLRM
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    local = make_cluster(servers=2)
    cluster = Cluster.connect(local.coordinator_address)
    configs = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=50, feature_names=[f"f{i}"])
               for i in range(2)]
    collection = EmbeddingBagCollection.from_configs(cluster, configs, lr=0.5, seed=2)
    model = DLRM(embedding_bag_collection=collection, dense_in_features=3, dense_arch_layer_sizes=[8, 4],
                 over_arch_layer_sizes=[8, 1], dense_device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    before = cluster.pull("t0", np.arange(50)).clone()
    values, lengths = random_jagged(generator, ["f0", "f1"], {"f0": 50, "f1": 50}, batch=8)
    logits = model(torch.randn(8, 3, generator=generator),
                   KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=values, lengths=lengths))
    assert logits.shape == (8, 1)
    logits.sum().backward()
    assert cluster.step()["rows"] > 0
    assert not torch.equal(cluster.pull("t0", np.arange(50)), before)


def _dlrm_batches(spec, steps: int, batch: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        dense = torch.randn(batch, spec.num_dense, generator=generator)
        sparse = []
        for rows in spec.table_sizes:
            lengths = torch.randint(0, 4, (batch,), generator=generator)
            sparse.append((torch.randint(0, rows, (int(lengths.sum()),), generator=generator),
                           torch.cumsum(lengths, 0) - lengths))
        labels = (torch.rand(batch, generator=generator) < 0.3).float()
        out.append((dense, sparse, labels))
    return out


@needs_torchrec
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_torchrec_dlrm_computes_our_dlrm(optimizer):
    """The benchmark's DLRM built from TorchRec's has our DLRM's initial function and training trajectory."""
    from ecrec.workload.dlrm import DLRMSpec, build_local_dlrm, local_optimizer, loss_fn

    spec = DLRMSpec(num_dense=5, table_sizes=(40, 30, 20), embedding_dim=4, bottom_mlp=(8,), top_mlp=(8, 6))
    ours = build_local_dlrm(spec, seed=3)
    theirs = build_local_dlrm(spec, seed=3, arch="torchrec")
    assert type(theirs).__name__ == "TorchRecDLRM"
    optimizers = [local_optimizer(m, optimizer, lr=0.1, eps=1e-8, initial_accumulator_value=0.1) for m in (ours, theirs)]
    for dense, sparse, labels in _dlrm_batches(spec, steps=8, batch=16):
        logits = [m(dense, sparse) for m in (ours, theirs)]
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-6)
        for model, out, opt in zip((ours, theirs), logits, optimizers):
            opt.zero_grad()
            loss_fn(out, labels).backward()
            opt.step()
    table = theirs.embeddings[0].embedding_bags["emb1"].weight.detach()
    torch.testing.assert_close(table, ours.embeddings[1].weight.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.cluster
@needs_torchrec
def test_torchrec_dlrm_on_the_cluster_matches_the_local_one(make_cluster):
    """``build_cluster_dlrm(arch="torchrec")``: TorchRec's DLRM over cluster tables trains like the local one."""
    from ecrec.workload.dlrm import DLRMSpec, build_cluster_dlrm, build_local_dlrm, local_optimizer, loss_fn

    spec = DLRMSpec(num_dense=5, table_sizes=(40, 30), embedding_dim=4, bottom_mlp=(8,), top_mlp=(6,))
    local = make_cluster(servers=2)
    cluster = Cluster.connect(local.coordinator_address)
    remote = build_cluster_dlrm(cluster, spec, optimizer="adagrad", lr=0.1, seed=4, arch="torchrec")
    reference = build_local_dlrm(spec, seed=4, arch="torchrec")
    optimizer = local_optimizer(reference, "adagrad", lr=0.1)
    for dense, sparse, labels in _dlrm_batches(spec, steps=5, batch=8, seed=1):
        out_remote, out_local = remote(dense, sparse), reference(dense, sparse)
        torch.testing.assert_close(out_remote, out_local, rtol=1e-5, atol=1e-6)
        loss_fn(out_remote, labels).backward()
        cluster.step()
        optimizer.zero_grad()
        loss_fn(out_local, labels).backward()
        optimizer.step()
    weight = reference.embeddings[0].embedding_bags["emb0"].weight.detach()
    torch.testing.assert_close(cluster.pull("emb0", np.arange(40)), weight, rtol=1e-5, atol=1e-6)


@pytest.mark.cluster
@needs_torchrec
def test_the_documented_snippet_runs(make_cluster):
    """The TorchRec example of docs/sdk.md, run as printed against a real cluster (its address swapped in)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "sdk.md").read_text()
    section = readme.split("\n## TorchRec\n", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    local = make_cluster(servers=2)
    assert '"127.0.0.1:7000"' in snippet
    namespace: dict = {}
    exec(compile(snippet.replace('"127.0.0.1:7000"', f'"{local.coordinator_address}"'), "docs/sdk.md", "exec"),
         namespace)
    cluster, ebc, model = namespace["cluster"], namespace["ebc"], namespace["model"]
    assert namespace["logits"].shape == (2, 1)
    assert not list(ebc.parameters())  # nothing of the tables was registered as a dense tensor
    assert cluster.table_spec("users").num_rows == 100_000 and cluster.table_spec("items").dim == 16
    registered = {name for name, _ in model.named_parameters()}
    assert registered and all(not name.startswith("sparse_arch") for name in registered)
    cluster.close()


@pytest.mark.cluster
@needs_torchrec
def test_kjts_torchrec_takes_are_taken_alike_or_refused_never_read_wrong(make_cluster):
    """A KJT carrying features of another collection was refused (TorchRec takes the ones it has: one KJT feeds
    several collections); one with a batch size per feature or inverse_indices was read as one batch for all --
    bags pooled into other features' samples, silently; an init_fn was ignored; torch.compile failed in Dynamo."""
    import torchrec
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    local = make_cluster(servers=2)
    cluster = Cluster.connect(local.coordinator_address)
    configs = [torchrec.EmbeddingBagConfig(name="ta", embedding_dim=2, num_embeddings=10, feature_names=["a"]),
               torchrec.EmbeddingBagConfig(name="tb", embedding_dim=2, num_embeddings=10, feature_names=["b"])]
    ours = EmbeddingBagCollection.from_configs(cluster, configs, seed=2)
    theirs = _torchrec_twin(cluster, configs)
    mixed = KeyedJaggedTensor.from_lengths_sync(keys=["a", "x", "b"], values=torch.tensor([1, 2, 3, 4, 5, 6]),
                                                lengths=torch.tensor([2, 1, 1, 0, 1, 1]))
    with torch.no_grad():
        expected = theirs(mixed)
        assert ours(mixed).keys() == expected.keys() == ["a", "b"]
        torch.testing.assert_close(ours(mixed).values(), expected.values(), rtol=0, atol=0)
    variable = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3, 4, 5]),
                                 lengths=torch.tensor([2, 1, 1, 1]), stride_per_key_per_rank=[[1], [3]])
    inverse = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1, 0]),
                                inverse_indices=(["a", "b"], torch.tensor([[0, 1, 1], [0, 1, 1]])))
    for kjt in (variable, inverse):
        with pytest.raises(ValueError, match="batch size per feature .* or inverse_indices is not supported"):
            ours(kjt)
    with pytest.raises(ValueError, match="table 'tc': init_fn is not supported"):
        EmbeddingBagCollection.from_configs(cluster, [torchrec.EmbeddingBagConfig(
            name="tc", embedding_dim=2, num_embeddings=10, feature_names=["c"],
            init_fn=lambda w: torch.nn.init.constant_(w, 0.5))])
    assert "tc" not in {t.name for t in cluster.refresh_map().tables}
    compiled = torch.compile(ours, backend="eager")  # Dynamo traces the model, the pull is a graph break
    out = compiled(mixed)
    torch.testing.assert_close(out.values(), expected.values(), rtol=0, atol=0)
    out.values().sum().backward()
    cluster.step()
    assert not torch.equal(cluster.pull("ta", [1]), theirs.embedding_bags["ta"].weight[1:2].detach())


@pytest.mark.cluster
@needs_torchrec
def test_embedding_optimizer_loads_a_torch_adagrad_state_dict_keyed_by_the_state_dicts_keys(make_cluster):
    """torch.optim puts every parameter in one group: only the first of each group was found ('no entry for' the
    others, which were there), and a group without ECRec's own 'optimizer' entry was 'saved for optimizer None'."""
    import torchrec

    from ecrec.client.model_state import EmbeddingOptimizer

    local = make_cluster(servers=2)
    cluster = Cluster.connect(local.coordinator_address)
    configs = [torchrec.EmbeddingBagConfig(name=n, embedding_dim=2, num_embeddings=8, feature_names=[f])
               for n, f in (("m1", "f1"), ("m2", "f2"))]
    ours = EmbeddingBagCollection.from_configs(cluster, configs, optimizer="adagrad", lr=0.2, seed=3)
    theirs = _torchrec_twin(cluster, configs)
    optimizer = torch.optim.Adagrad(theirs.parameters(), lr=0.2, eps=1e-10)
    for p in theirs.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    names = [n for n, _ in theirs.named_parameters()]
    saved = optimizer.state_dict()
    saved = {"state": {names[i]: v for i, v in saved["state"].items()},
             "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
    assert len(saved["param_groups"]) == 1
    EmbeddingOptimizer(ours).load_state_dict(saved)
    for config, name in zip(configs, names):
        np.testing.assert_array_equal(cluster.read_table(config.name, "state"), saved["state"][name]["sum"].numpy())
    momentum = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    for p in theirs.parameters():
        p.grad = torch.randn_like(p)
    momentum.step()
    other = momentum.state_dict()
    other = {"state": {names[i]: v for i, v in other["state"].items()},
             "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in other["param_groups"]]}
    with pytest.raises(ValueError, match="saved for optimizer \"one keeping \\['momentum_buffer'\\]\""):
        EmbeddingOptimizer(ours).load_state_dict(other)
