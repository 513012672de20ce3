"""The model in and out (``ecrec.client.model_state``, ``Cluster.read_table``/``write_rows``): ``state_dict`` /
``load_state_dict`` of the cluster modules, loaded into plain PyTorch and TorchRec modules and back; the
optimizer state, so that training resumes exactly on a cluster of another shape; warm starts; bad input.
Every test runs real servers on 127.0.0.1."""

from __future__ import annotations

import importlib.util

import grpc
import numpy as np
import pytest
import torch

from ecrec.client import Cluster, ClusterError, EmbeddingBag, EmbeddingBagCollection
from ecrec.client.model_state import EmbeddingOptimizer
from ecrec.wire import embedding_pb2

pytestmark = pytest.mark.cluster
needs_torchrec = pytest.mark.skipif(importlib.util.find_spec("torchrec") is None,
                                    reason="the torchrec extra is not installed")


def _batches(rows: int, steps: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, rows, (96,), generator=generator), torch.arange(0, 96, 4)) for _ in range(steps)]


def _train(cluster: Cluster, bags, batches) -> None:
    for ids, offsets in batches:
        loss = sum(bag(ids % bag.spec.num_rows, offsets).square().sum() for bag in bags)
        loss.backward()
        cluster.step()


def test_state_dict_holds_every_table_and_loads_into_plain_torch_and_back(shared_cluster, tmp_path):
    local = shared_cluster(servers=3, strategy="ecrec", k=2, m=1)  # tables of its own: user, item
    cluster = Cluster.connect(local.coordinator_address)
    cluster.create_table("user", 700, 8, optimizer="adagrad", lr=0.1, seed=1)
    cluster.create_table("item", 300, 4, optimizer="sgd", lr=0.1, seed=2)
    model = torch.nn.Module()
    model.user = EmbeddingBag(cluster, "user")
    model.both = EmbeddingBagCollection(cluster, ["item"])
    model.head = torch.nn.Linear(8, 1)
    _train(cluster, [model.user, EmbeddingBag(cluster, "item")], _batches(700, 4))
    saved = model.state_dict()
    assert set(saved) == {"user.weight", "both.embedding_bags.item.weight", "head.weight", "head.bias"}
    assert torch.equal(saved["user.weight"], cluster.pull("user", np.arange(700)))
    torch.save(saved, tmp_path / "model.pt")

    plain = torch.nn.Module()  # what serving loads: plain PyTorch modules, no cluster
    plain.user = torch.nn.EmbeddingBag(700, 8, mode="sum")
    plain.both = torch.nn.Module()
    plain.both.embedding_bags = torch.nn.ModuleDict({"item": torch.nn.EmbeddingBag(300, 4, mode="sum")})
    plain.head = torch.nn.Linear(8, 1)
    plain.load_state_dict(torch.load(tmp_path / "model.pt"))
    ids, offsets = _batches(700, 1, seed=5)[0]
    assert torch.allclose(plain.user(ids, offsets), model.user(ids, offsets), rtol=1e-6, atol=1e-6)

    # and back: new values into the cluster, the parity following them
    changed = {k: v + 1.0 for k, v in plain.state_dict().items()}
    model.load_state_dict(changed)
    assert torch.equal(cluster.pull("user", np.arange(700)), changed["user.weight"])
    assert torch.equal(cluster.pull("item", np.arange(300)), changed["both.embedding_bags.item.weight"])
    assert sum(r["mismatched"] for r in cluster.strategy_call("verify_parity").values()) == 0


def test_training_resumes_exactly_from_the_model_and_optimizer_state_on_another_cluster(make_cluster):
    """Trained 6 steps on 4 servers (ecrec, RS(2,1)), saved; 6 more there. The saved model and optimizer
    state loaded into a cluster of another shape and strategy (3 servers, none), 6 more steps: equal, bit for
    bit, rows and Adagrad accumulators."""
    first = make_cluster(servers=4, strategy="ecrec", k=2, m=1)
    second = make_cluster(servers=3, strategy="none")
    batches = _batches(1000, 12, seed=3)
    a = Cluster.connect(first.coordinator_address)
    a.create_table("t", 1000, 8, optimizer="adagrad", lr=0.05, initial_accumulator_value=0.1, seed=7)
    model_a = EmbeddingBag(a, "t")
    _train(a, [model_a], batches[:6])
    saved_model = model_a.state_dict()
    saved_opt = EmbeddingOptimizer(model_a).state_dict()
    assert saved_opt["param_groups"][0]["optimizer"] == "adagrad"
    assert saved_opt["state"]["weight"]["sum"].shape == (1000, 8)
    _train(a, [model_a], batches[6:])

    b = Cluster.connect(second.coordinator_address)
    b.create_table("t", 1000, 8, optimizer="adagrad", lr=0.05, initial_accumulator_value=0.1, seed=99)
    model_b = EmbeddingBag(b, "t")
    model_b.load_state_dict(saved_model)
    EmbeddingOptimizer(model_b).load_state_dict(saved_opt)
    assert np.array_equal(b.read_table("t", "payload").view(np.uint32),
                          np.concatenate([saved_model["weight"].numpy(), saved_opt["state"]["weight"]["sum"].numpy()],
                                         axis=1).view(np.uint32))
    _train(b, [model_b], batches[6:])
    assert np.array_equal(a.read_table("t", "payload").view(np.uint32), b.read_table("t", "payload").view(np.uint32))


def _dlrm(cluster: Cluster, dense_optimizer: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.emb = EmbeddingBag(cluster, "t")
    model.mlp = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    cluster.register_dense(model.mlp, optimizer=dense_optimizer, lr=0.05, initial_accumulator_value=0.1,
                           prefix="mlp.")
    return model


def _train_dlrm(cluster: Cluster, model, batches) -> None:
    for ids, offsets in batches:
        model.mlp(model.emb(ids, offsets)).square().sum().backward()
        cluster.step()


def _dense_payloads(cluster: Cluster) -> dict[str, np.ndarray]:
    return {n: cluster.read_dense_payload(n).view(np.uint32) for n in ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight")}


@pytest.mark.parametrize("dense_optimizer", ["adagrad", "sgd"])
def test_a_registered_mlp_resumes_exactly_from_the_model_and_optimizer_state(make_cluster, dense_optimizer):
    """``model.load_state_dict`` loaded a registered MLP's saved values into the local parameters only: the next
    step applied its gradient to the servers' newer values and loaded those over them (the load silently undone),
    and the MLP's Adagrad accumulators were in no state dict.  Now the load reaches the servers and
    ``EmbeddingOptimizer`` carries the dense state: resumed from step 4 on this cluster and on another shape
    (a plain ``torch.save`` round trip, the load with ``assign=True`` too), training ends bit for bit as the run
    that never stopped."""
    batches = _batches(600, 8, seed=4)
    a = Cluster.connect(make_cluster(servers=3, strategy="ecrec", k=2, m=1).coordinator_address)
    a.create_table("t", 600, 8, optimizer="adagrad", lr=0.05, initial_accumulator_value=0.1, seed=7)
    model_a = _dlrm(a, dense_optimizer)
    _train_dlrm(a, model_a, batches[:4])
    saved_model = {k: v.clone() for k, v in model_a.state_dict().items()}
    saved_opt = EmbeddingOptimizer(model_a).state_dict()
    assert "mlp.0.weight" in saved_opt["state"] and saved_opt["param_groups"][-1]["optimizer"] == dense_optimizer
    if dense_optimizer == "adagrad":
        assert saved_opt["state"]["mlp.0.weight"]["sum"].shape == (4, 8)
    before = _dense_payloads(a)
    _train_dlrm(a, model_a, batches[4:])
    final_table, final_dense = a.read_table("t", "payload").view(np.uint32), _dense_payloads(a)

    model_a.load_state_dict(saved_model)  # back to step 4 on the same cluster
    EmbeddingOptimizer(model_a).load_state_dict(saved_opt)
    assert all(np.array_equal(before[n], p) for n, p in _dense_payloads(a).items())
    _train_dlrm(a, model_a, batches[4:])
    assert np.array_equal(a.read_table("t", "payload").view(np.uint32), final_table)
    assert all(np.array_equal(final_dense[n], p) for n, p in _dense_payloads(a).items())

    b = Cluster.connect(make_cluster(servers=2, strategy="none").coordinator_address)
    b.create_table("t", 600, 8, optimizer="adagrad", lr=0.05, initial_accumulator_value=0.1, seed=99)
    model_b = _dlrm(b, dense_optimizer)
    model_b.load_state_dict(saved_model, assign=True)  # new Parameter objects: still the servers' tensors
    EmbeddingOptimizer(model_b).load_state_dict(saved_opt)
    _train_dlrm(b, model_b, batches[4:])
    assert np.array_equal(b.read_table("t", "payload").view(np.uint32), final_table)
    assert all(np.array_equal(final_dense[n], p) for n, p in _dense_payloads(b).items())
    assert torch.equal(model_b.mlp[0].weight, model_a.mlp[0].weight)


def test_bad_loads_into_a_registered_mlp_change_nothing_on_the_servers(make_cluster):
    cluster = Cluster.connect(make_cluster(servers=2, strategy="none").coordinator_address)
    cluster.create_table("t", 600, 8, optimizer="adagrad", lr=0.05, seed=7)
    model = _dlrm(cluster, "adagrad")
    before = _dense_payloads(cluster)
    state = model.state_dict()
    local_bias = model.state_dict()["mlp.0.bias"].clone()
    state["mlp.0.bias"] = torch.full((4,), float("nan"))
    with pytest.raises(ValueError, match="'bias' \\(dense tensor 'mlp.0.bias'.*NaN"):
        model.load_state_dict(state)
    # nor loaded into the module (a NaN left in the local copy made every next step refuse its gradient)
    assert torch.equal(model.state_dict()["mlp.0.bias"], local_bias)
    opt = EmbeddingOptimizer(model).state_dict()
    opt["state"]["mlp.2.weight"]["sum"] = -torch.ones(1, 4)
    with pytest.raises(ValueError, match="'mlp.2.weight'.*negative"):
        EmbeddingOptimizer(model).load_state_dict(opt)
    opt["state"]["mlp.2.weight"]["sum"] = torch.ones(4)
    with pytest.raises(ValueError, match="'mlp.2.weight'.*shape \\(1, 4\\)"):
        EmbeddingOptimizer(model).load_state_dict(opt)
    for malformed in ({"state": None, "param_groups": []}, {"state": {}, "param_groups": None},
                      {"state": {}, "param_groups": ["mlp.0.bias"]}):  # each was a TypeError from inside
        with pytest.raises(ValueError, match="not an optimizer state dict: 'state' must be a dict"):
            EmbeddingOptimizer(model).load_state_dict(malformed)
    assert all(np.array_equal(before[n], p) for n, p in _dense_payloads(cluster).items())
    dense_only = torch.nn.Sequential(torch.nn.Linear(2, 1))
    cluster.register_dense(dense_only, prefix="other.")
    assert set(EmbeddingOptimizer(dense_only).state_dict()["state"]) == {"0.weight", "0.bias"}


def test_dcp_get_and_set_model_state_dict_round_trip_a_model_of_cluster_modules(make_cluster, tmp_path):
    """``torch.distributed.checkpoint.state_dict.get_model_state_dict`` raised ``AttributeError: 'EmbeddingBag'
    object has no attribute 'weight'`` (it walks every key as attributes); it now gives ``state_dict()``'s keys and
    values, and ``dcp.save``, training on, ``dcp.load`` and ``set_model_state_dict`` bring every table back.  A
    table is still no attribute: a ``weight`` that took writes into a copy would lose them silently."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    cluster = Cluster.connect(make_cluster(servers=3, strategy="ecrec", k=2, m=1).coordinator_address)
    cluster.create_table("user", 700, 8, optimizer="adagrad", lr=0.1, seed=1)
    cluster.create_table("item", 300, 8, optimizer="sgd", lr=0.1, seed=2)
    model = torch.nn.Module()
    model.towers = torch.nn.Module()
    model.towers.user = EmbeddingBag(cluster, "user")
    model.both = EmbeddingBagCollection(cluster, ["item", "user"])
    model.head = torch.nn.Linear(8, 1)
    got = get_model_state_dict(model)
    plain = model.state_dict()
    assert list(got) == list(plain) and all(torch.equal(got[k], plain[k]) for k in plain)
    assert "both.embedding_bags.item.weight" in got and "towers.user.weight" in got
    dcp.save(got, checkpoint_id=str(tmp_path / "dcp"))
    _train(cluster, [model.towers.user, EmbeddingBag(cluster, "item")], _batches(700, 3))
    assert not torch.equal(cluster.pull("item", np.arange(300)), plain["both.embedding_bags.item.weight"])
    into = get_model_state_dict(model)
    dcp.load(into, checkpoint_id=str(tmp_path / "dcp"))
    set_model_state_dict(model, into)
    assert torch.equal(cluster.pull("item", np.arange(300)), plain["both.embedding_bags.item.weight"])
    assert torch.equal(cluster.pull("user", np.arange(700)), plain["towers.user.weight"])
    assert not hasattr(model.towers.user, "weight") and not hasattr(model.both, "embedding_bags")


def test_a_load_writes_only_the_registered_parameters_it_holds_and_a_copy_writes_nothing(make_cluster):
    """What a load reaching a registered MLP writes (review of the change above): only the parameters whose keys
    the state dict held -- a partial load (``strict=False``) wrote this worker's stale copy over another worker's
    newer update; a load into a submodule of the registered module reaches the servers (it was undone by the next
    step); a ``copy.deepcopy`` of the module (an EMA, a serving copy) loads locally only, and the original still
    trains."""
    import copy

    local = make_cluster(servers=2, strategy="none")
    a, b = Cluster.connect(local.coordinator_address), Cluster.connect(local.coordinator_address)
    a.create_table("t", 600, 8, optimizer="sgd", lr=0.05, seed=7)
    model_a, model_b = _dlrm(a, "sgd"), _dlrm(b, "sgd")
    _train_dlrm(b, model_b, _batches(600, 1, seed=1))  # worker b moves the MLP on; a's copy is stale
    newer = a.read_dense_payload("mlp.2.bias")
    assert newer[0] != model_a.mlp[2].bias.item()  # a's copy is older
    model_a.load_state_dict({"emb.weight": model_a.state_dict()["emb.weight"]}, strict=False)  # the table only
    assert np.array_equal(a.read_dense_payload("mlp.2.bias"), newer)
    five = torch.full((1,), 5.0)
    model_a.mlp[2].load_state_dict({"weight": model_a.mlp[2].weight.detach().clone(), "bias": five})
    assert a.read_dense_payload("mlp.2.bias")[0] == 5.0
    ema = copy.deepcopy(model_a.mlp)
    ema.load_state_dict({k: v + 1 for k, v in ema.state_dict().items()})
    assert a.read_dense_payload("mlp.2.bias")[0] == 5.0 and a._dense["mlp.2.bias"] is model_a.mlp[2].bias
    _train_dlrm(a, model_a, _batches(600, 1, seed=2))
    assert a.read_dense_payload("mlp.2.bias")[0] != 5.0 and model_a.mlp[2].bias.grad is None  # it trains on


def test_warm_start_from_a_tensor_an_npy_file_and_a_torch_file(shared_cluster, tmp_path):
    local = shared_cluster(servers=3, strategy="ecrec", k=2, m=1)  # tables of its own: from_*
    cluster = Cluster.connect(local.coordinator_address)
    pretrained = torch.randn(5000, 16, generator=torch.Generator().manual_seed(1))
    cluster.create_table("from_tensor", 5000, 16, optimizer="adagrad", initial_accumulator_value=0.1, init=pretrained)
    assert torch.equal(cluster.pull("from_tensor", np.arange(5000)), pretrained)
    state = cluster.read_table("from_tensor", "state")
    assert (state == np.float32(0.1)).all()  # the optimizer state starts where a new table's does
    np.save(tmp_path / "rows.npy", pretrained.numpy())
    progress = []
    cluster.create_table("from_npy", 5000, 16, init=str(tmp_path / "rows.npy"),
                         on_progress=lambda done, total: progress.append((done, total)))
    assert torch.equal(cluster.pull("from_npy", np.arange(5000)), pretrained)
    assert progress and progress[-1] == (5000, 5000)
    torch.save({"weight": pretrained}, tmp_path / "rows.pt")
    cluster.create_table("from_pt", 5000, 16, init=tmp_path / "rows.pt")
    assert torch.equal(cluster.pull("from_pt", np.arange(5000)), pretrained)
    assert sum(r["mismatched"] for r in cluster.strategy_call("verify_parity").values()) == 0

    tables = {t.name for t in cluster.refresh_map().tables}
    with pytest.raises(ClusterError, match="the table exists"):
        cluster.create_table("from_pt", 5000, 16, init=pretrained)  # never overwrites a trained table
    with pytest.raises(ValueError, match=r"'wrong'.*shape \(5000, 8\)"):
        cluster.create_table("wrong", 5000, 8, init=pretrained)
    bad = pretrained.clone()
    bad[4321, 3] = float("nan")
    with pytest.raises(ValueError, match="'nan'.*finite"):
        cluster.create_table("nan", 5000, 16, init=bad)
    with pytest.raises(FileNotFoundError, match="missing.npy"):
        cluster.create_table("missing", 5000, 16, init=str(tmp_path / "missing.npy"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pt"):
        cluster.create_table("junk", 5000, 16, init=tmp_path / "junk.pt")
    assert {t.name for t in cluster.refresh_map().tables} == tables  # none of them created


def test_bad_loads_name_the_table_and_change_nothing(make_cluster):
    local = make_cluster(servers=2, strategy="none")
    cluster = Cluster.connect(local.coordinator_address)
    cluster.create_table("a", 400, 4, optimizer="adagrad", seed=1)
    cluster.create_table("b", 200, 4, seed=2)
    collection = EmbeddingBagCollection(cluster, ["a", "b"])
    before = {name: cluster.read_table(name, "payload").copy() for name in ("a", "b")}

    def unchanged():
        return all(np.array_equal(cluster.read_table(n, "payload"), before[n]) for n in before)

    saved = collection.state_dict()
    wrong_shape = dict(saved, **{"embedding_bags.b.weight": torch.zeros(199, 4)})
    with pytest.raises(RuntimeError, match=r"size mismatch for embedding_bags.b.weight.*cluster table 'b'"):
        collection.load_state_dict({k: v for k, v in wrong_shape.items() if k != "embedding_bags.a.weight"},
                                   strict=False)
    nan = saved["embedding_bags.a.weight"].clone()
    nan[17, 2] = float("inf")
    with pytest.raises(RuntimeError, match=r"embedding_bags.a.weight.*'a'.*finite"):
        collection.load_state_dict({"embedding_bags.a.weight": nan, "embedding_bags.b.weight": saved["embedding_bags.b.weight"]})
    with pytest.raises(RuntimeError, match="Missing key.*embedding_bags.b.weight"):
        collection.load_state_dict({"embedding_bags.a.weight": saved["embedding_bags.a.weight"]})
    assert unchanged()
    with pytest.raises(RuntimeError, match="Unexpected key.*embedding_bags.c.weight"):
        collection.load_state_dict(dict(saved, **{"embedding_bags.c.weight": torch.zeros(3, 4)}))
    with pytest.raises(ValueError, match="row ids repeat"):
        cluster.write_rows("a", [1, 1], np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="'b'.*keeps no state"):
        cluster.write_rows("b", [1], np.zeros((1, 4), np.float32), what="state")
    with pytest.raises(ValueError, match="accumulator is negative"):
        cluster.write_rows("a", [1], -np.ones((1, 4), np.float32), what="state")
    opt = EmbeddingOptimizer(collection).state_dict()
    opt["param_groups"][0]["optimizer"] = "sgd"
    with pytest.raises(ValueError, match="'embedding_bags.a.weight'.*'sgd'.*'adagrad'"):
        EmbeddingOptimizer(collection).load_state_dict(opt)
    assert unchanged()

    # the server refuses a malformed assignment itself (a client that skipped the checks): nothing applied
    index = 0
    ids = cluster.layout.rows_of(index, 400)[0][:2]
    request = embedding_pb2.PushRequest(push_id=embedding_pb2.PushId(worker="w", sequence=1, incarnation="i"),
                                        epoch=cluster.map.epoch)
    request.tables.add(table="a", ids=ids.astype("<i8").tobytes(), grads=np.zeros(3, "<f4").tobytes(),
                       assign=embedding_pb2.PAYLOAD)
    with pytest.raises(grpc.RpcError) as info:
        cluster.peers.stub(cluster.map.servers[index].address).Push(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'a'" in info.value.details()
    assert "needs 64 bytes" in info.value.details()
    assert unchanged()


@needs_torchrec
def test_a_dlrm_trained_on_the_cluster_loads_into_plain_torchrec_with_the_same_predictions(shared_cluster):
    import torchrec
    from torchrec.models.dlrm import DLRM
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    local = shared_cluster(servers=3, strategy="ecrec", k=2, m=1)  # tables of its own: t0, t1
    cluster = Cluster.connect(local.coordinator_address)
    configs = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=60, feature_names=[f"f{i}"])
               for i in range(2)]
    torch.manual_seed(0)
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection.from_configs(cluster, configs, lr=0.3, seed=2),
                 dense_in_features=3, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1],
                 dense_device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)

    def batch():
        lengths = torch.randint(0, 4, (16,), generator=generator)
        values = torch.randint(0, 60, (int(lengths.sum()),), generator=generator)
        return torch.randn(8, 3, generator=generator), KeyedJaggedTensor.from_lengths_sync(
            keys=["f0", "f1"], values=values, lengths=lengths)

    for _ in range(3):
        model(*batch()).sum().backward()
        cluster.step()
    saved = model.state_dict()
    plain = DLRM(embedding_bag_collection=torchrec.EmbeddingBagCollection(tables=configs),
                 dense_in_features=3, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1],
                 dense_device=torch.device("cpu"))
    assert set(plain.state_dict()) == set(saved)
    plain.load_state_dict(saved)
    dense, sparse = batch()
    with torch.no_grad():
        assert torch.allclose(plain(dense, sparse), model(dense, sparse), rtol=1e-5, atol=1e-6)


def test_a_module_loads_all_its_tables_or_none_and_values_are_checked_as_float32(make_cluster):
    """A collection whose second table's value is bad writes neither; values are checked as the float32 they
    are sent as (1e39 is Inf); whole-row writes check Adagrad's accumulators too; bfloat16 loads; the
    module's load pre-hooks run, as torch.nn.Module's do."""
    local = make_cluster(servers=2, strategy="none")
    cluster = Cluster.connect(local.coordinator_address)
    cluster.create_table("a", 300, 4, optimizer="adagrad", seed=1)
    cluster.create_table("b", 200, 4, optimizer="adagrad", seed=2)
    collection = EmbeddingBagCollection(cluster, ["a", "b"])
    before = {n: cluster.read_table(n, "payload").copy() for n in ("a", "b")}

    def unchanged():
        return all(np.array_equal(cluster.read_table(n, "payload"), before[n]) for n in before)

    saved = collection.state_dict()
    huge = saved["embedding_bags.b.weight"].double()
    huge[199, 0] = 1e39  # finite as float64, Inf as float32
    with pytest.raises(RuntimeError, match=r"embedding_bags.b.weight.*finite float32"):
        collection.load_state_dict({"embedding_bags.a.weight": saved["embedding_bags.a.weight"] + 1,
                                    "embedding_bags.b.weight": huge})
    assert unchanged()  # a was not written either
    payload = cluster.read_table("a", "payload")
    payload[5, 4] = -1.0  # an accumulator
    with pytest.raises(ValueError, match="accumulator is negative"):
        cluster.write_rows("a", np.arange(300), payload, what="payload")
    opt = EmbeddingOptimizer(collection).state_dict()
    opt["state"]["embedding_bags.b.weight"]["sum"][0, 0] = float("nan")
    opt["state"]["embedding_bags.a.weight"]["sum"] += 1
    with pytest.raises(ValueError, match="'embedding_bags.b.weight'.*finite"):
        EmbeddingOptimizer(collection).load_state_dict(opt)
    assert unchanged()

    seen = []
    collection.register_load_state_dict_pre_hook(lambda module, state_dict, prefix, *rest: seen.append(prefix))
    halves = {k: v.to(torch.bfloat16) for k, v in saved.items()}
    collection.load_state_dict(halves)
    assert seen == [""]
    assert torch.equal(cluster.pull("a", np.arange(300)), halves["embedding_bags.a.weight"].float())


def test_other_optimizer_settings_in_a_state_dict_or_snapshot_are_said_not_taken_silently(make_cluster, tmp_path,
                                                                                          caplog):
    """torch.optim takes a saved param group's lr and eps; a cluster table's are set at its creation, for every
    worker: a state dict or a snapshot saved with others was restored without a word (the table's lr kept)."""
    source = Cluster.connect(make_cluster(servers=2, strategy="none").coordinator_address)
    source.create_table("a", 100, 4, optimizer="adagrad", lr=0.1, seed=1)
    source.save(str(tmp_path / "snap"))
    target = Cluster.connect(make_cluster(servers=2, strategy="none").coordinator_address)
    target.create_table("a", 100, 4, optimizer="adagrad", lr=0.5, seed=1)
    with caplog.at_level("WARNING", logger="ecrec"):
        target.load(str(tmp_path / "snap"))
    assert "table 'a': the snapshot was saved with other optimizer settings than this cluster's (lr 0.1 -> 0.5)" \
        in caplog.text
    assert target.table_spec("a").lr == 0.5  # the cluster's own, as documented
    caplog.clear()
    optimizer = EmbeddingOptimizer(EmbeddingBag(target, "a"))
    saved = optimizer.state_dict()
    saved["param_groups"][0]["lr"] = 0.001
    with caplog.at_level("WARNING", logger="ecrec"):
        optimizer.load_state_dict(saved)
    assert "saved with other optimizer settings (lr 0.001 -> 0.5)" in caplog.text


def test_a_module_follows_to_and_half_double_as_a_torch_module_does_and_still_trains(make_cluster):
    """``.double()``, ``.half()``, ``.to(dtype)`` left the outputs float32 (a half or double model then failed in
    its dense part) and ``.cuda()`` did nothing on a machine without CUDA; now the outputs follow, the state dict
    is unchanged, gradients still reach the servers, and ``.cuda()`` fails here as torch's own module does."""
    cluster = Cluster.connect(make_cluster(servers=2, strategy="none").coordinator_address)
    cluster.create_table("t", 20, 4, optimizer="sgd", lr=0.5, seed=3)
    bag = EmbeddingBag(cluster, "t")
    twin = torch.nn.EmbeddingBag(20, 4, mode="sum")
    with torch.no_grad():
        twin.weight.copy_(torch.from_numpy(cluster.read_table("t")))
    ids, offsets = torch.tensor([1, 2, 2, 7]), torch.tensor([0, 3])
    assert bag.double()(ids, offsets).dtype == torch.float64 and bag.device == torch.device("cpu")
    out = bag(ids, offsets)
    (out * torch.arange(8, dtype=torch.float64).view(2, 4)).sum().backward()
    cluster.step()
    (twin(ids, offsets) * torch.arange(8, dtype=torch.float32).view(2, 4)).sum().backward()
    with torch.no_grad():
        twin.weight -= 0.5 * twin.weight.grad
    assert torch.equal(torch.from_numpy(cluster.read_table("t")), twin.weight.detach())
    assert bag.half()(ids, offsets).dtype == torch.float16
    assert bag.to(torch.float32)(ids, offsets).dtype == torch.float32
    assert list(bag.state_dict()) == ["weight"]
    collection = EmbeddingBagCollection(cluster, ["t"]).double()
    assert [o.dtype for o in collection([(ids, offsets)])] == [torch.float64]
    assert bag.double()(ids, offsets, per_sample_weights=torch.ones(4, dtype=torch.float64)).dtype == torch.float64
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            torch.nn.EmbeddingBag(2, 2).cuda()  # what torch's own module does here ...
        with pytest.raises((AssertionError, RuntimeError)):
            bag.cuda()  # ... and this one now
