"""The benchmark model: DLRM (Naumov et al., 2019), trainable locally or through an ECRec cluster.

    bottom MLP(dense) ─┐
    EmbeddingBag_t(ids_t) for every table t ─┼─ pairwise dots ─ concat(bottom, dots) ─ top MLP ─ logit

The embedding bags come from a factory, so the same :class:`DLRM` runs with
local ``torch.nn.EmbeddingBag(num_rows, dim, mode="sum", sparse=True)`` (the
reference, :func:`local_embedding_factory`) or with
``ecrec.client.EmbeddingBag`` tables that live on the servers
(:func:`build_cluster_dlrm`).  Both start from the same values for the same seed:
the MLPs are initialized from a ``torch.Generator`` seeded with ``seed``, and the
local tables copy ``ecrec.tables.initial_weights`` of the table the cluster would
create (same name, seed and init).  :func:`local_optimizer` mirrors the servers'
optimizers (``sgd``, ``adagrad``) with ``torch.optim``, so a local run is the
reference trajectory of a cluster run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from ecrec.tables.spec import TableSpec, initial_weights
from ecrec.workload.metrics import auc, logloss

EmbeddingFactory = Callable[[int, int, int], nn.Module]


@dataclass(frozen=True)
class DLRMSpec:
    """The model's shape: what both a local and a cluster run build.

    ``bottom_mlp``: hidden widths of the bottom MLP (a last layer of width
    ``embedding_dim`` is appended, as the dot interaction needs); ``top_mlp``:
    hidden widths of the top MLP (a last layer of width 1, the logit, is appended).
    """

    num_dense: int = 13
    table_sizes: tuple[int, ...] = field(default_factory=lambda: (10_000,) * 26)
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64,)
    top_mlp: tuple[int, ...] = (64, 32)

    def __post_init__(self):
        object.__setattr__(self, "table_sizes", tuple(int(s) for s in self.table_sizes))
        object.__setattr__(self, "bottom_mlp", tuple(int(s) for s in self.bottom_mlp))
        object.__setattr__(self, "top_mlp", tuple(int(s) for s in self.top_mlp))

    def table_names(self, prefix: str = "emb") -> list[str]:
        return [f"{prefix}{i}" for i in range(len(self.table_sizes))]

    def build(self, embedding_factory: EmbeddingFactory | None = None, seed: int = 0) -> "DLRM":
        return DLRM(self.num_dense, list(self.table_sizes), self.embedding_dim, self.bottom_mlp, self.top_mlp,
                    embedding_factory=embedding_factory, seed=seed)


def _mlp(widths: Sequence[int], final_relu: bool, generator: torch.Generator) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        lin = nn.Linear(fan_in, fan_out)
        with torch.no_grad():  # the DLRM reference initialization, from our generator
            lin.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)), generator=generator)
            lin.bias.normal_(0.0, math.sqrt(1.0 / fan_out), generator=generator)
        layers.append(lin)
        if i < len(widths) - 2 or final_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM with dot interaction; ``forward(dense, sparse)`` returns logits ``(B,)``.

    ``dense``: float32 ``(B, num_dense)``; ``sparse``: per table an
    ``(indices, offsets)`` pair (``EmbeddingBag`` style).  ``embedding_factory(
    table_index, num_rows, dim)`` makes each table's bag module (default:
    :func:`local_embedding_factory` with ``seed``).
    """

    def __init__(self, num_dense: int, table_sizes: Sequence[int], embedding_dim: int,
                 bottom_mlp: Sequence[int] = (64,), top_mlp: Sequence[int] = (64, 32),
                 embedding_factory: EmbeddingFactory | None = None, seed: int = 0):
        super().__init__()
        if num_dense < 1:
            raise ValueError(f"num_dense must be >= 1, got {num_dense}")
        if embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {embedding_dim}")
        if not table_sizes:
            raise ValueError("need at least one embedding table")
        if any(int(s) < 1 for s in table_sizes):
            raise ValueError(f"table sizes must be >= 1, got {list(table_sizes)}")
        if any(int(w) < 1 for w in (*bottom_mlp, *top_mlp)):
            raise ValueError("MLP widths must be >= 1")
        self.num_dense = int(num_dense)
        self.table_sizes = [int(s) for s in table_sizes]
        self.embedding_dim = int(embedding_dim)
        generator = torch.Generator().manual_seed(int(seed))
        self.bottom_mlp = _mlp([self.num_dense, *bottom_mlp, self.embedding_dim], final_relu=True, generator=generator)
        num_features = len(self.table_sizes) + 1
        num_inputs = self.embedding_dim + num_features * (num_features - 1) // 2
        self.top_mlp = _mlp([num_inputs, *top_mlp, 1], final_relu=False, generator=generator)
        factory = embedding_factory or local_embedding_factory(seed=seed)
        bags = []
        for t, rows in enumerate(self.table_sizes):
            bag = factory(t, rows, self.embedding_dim)
            got = getattr(bag, "embedding_dim", self.embedding_dim)
            if got != self.embedding_dim:
                raise ValueError(f"embedding_factory made table {t} with dim {got}, expected {self.embedding_dim}")
            bags.append(bag)
        self.embeddings = nn.ModuleList(bags)
        #: optional module looking all tables up at once (``ecrec.client.EmbeddingBagCollection``)
        self.embedding_collection: nn.Module | None = None
        li, lj = torch.tril_indices(num_features, num_features, offset=-1)
        self.register_buffer("_pairs_i", li, persistent=False)
        self.register_buffer("_pairs_j", lj, persistent=False)

    def interact(self, bottom: torch.Tensor, embedded: list[torch.Tensor]) -> torch.Tensor:
        """``concat(bottom, <f_i, f_j> for i > j)`` over the features ``f = (bottom, e_1 .. e_T)``."""
        features = torch.stack([bottom, *embedded], dim=1)  # (B, F, d)
        dots = torch.bmm(features, features.transpose(1, 2))  # (B, F, F)
        return torch.cat([bottom, dots[:, self._pairs_i, self._pairs_j]], dim=1)

    def forward(self, dense: torch.Tensor, sparse: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
        if len(sparse) != len(self.embeddings):
            raise ValueError(f"got {len(sparse)} sparse features for {len(self.embeddings)} tables")
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise ValueError(f"dense must be (B, {self.num_dense}), got {tuple(dense.shape)}")
        bottom = self.bottom_mlp(dense)
        if self.embedding_collection is not None:  # all tables in one lookup (one pull per server)
            embedded = self.embedding_collection(sparse)
        else:
            embedded = [bag(indices, offsets) for bag, (indices, offsets) in zip(self.embeddings, sparse)]
        return self.top_mlp(self.interact(bottom, embedded)).squeeze(1)

    def forward_batch(self, batch) -> torch.Tensor:
        """Logits of a :class:`ecrec.workload.batch.Batch`."""
        return self(batch.dense, batch.sparse)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy on logits."""
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)


class _DenseParts(nn.Module):
    """The MLPs of a DLRM under their names in the model (parameters shared, not copied)."""

    def __init__(self, model: DLRM):
        super().__init__()
        self.bottom_mlp = model.bottom_mlp
        self.top_mlp = model.top_mlp


def dense_parameters(model: DLRM) -> nn.Module:
    """The dense part of ``model`` (bottom and top MLP) as one module: what a cluster run registers.

    Its ``named_parameters()`` are the model's own parameter objects, named as in
    the model (``bottom_mlp.0.weight`` ...), so ``cluster.register_dense(
    dense_parameters(model), ...)`` loads the servers' values into the model.
    (A TorchRec-built model, ``ecrec.workload.torchrec_dlrm``, names its own.)
    """
    if hasattr(model, "dense_module"):
        return model.dense_module()
    return _DenseParts(model)


def embedding_parameters(model: DLRM) -> list[nn.Parameter]:
    """The parameters of the embedding bags (empty for cluster-backed tables)."""
    return [p for bag in model.embeddings for p in bag.parameters()]


# --- local (reference) tables ----------------------------------------------------------------------

def local_embedding_factory(table_prefix: str = "emb", seed: int = 0, sparse: bool = True, init: str = "uniform",
                            init_scale: float = 0.0, mode: str = "sum") -> EmbeddingFactory:
    """Factory of ``torch.nn.EmbeddingBag(num_rows, dim, mode, sparse=sparse)`` initialized like cluster tables.

    Table ``t`` gets the initial values of the cluster table
    ``f"{table_prefix}{t}"`` created with the same ``seed``, ``init`` and
    ``init_scale`` (``ecrec.tables.initial_weights``).
    """

    def factory(table_index: int, num_rows: int, dim: int) -> nn.Module:
        spec = TableSpec(name=f"{table_prefix}{table_index}", num_rows=num_rows, dim=dim, init=init,
                         init_scale=init_scale, seed=seed).validate()
        bag = nn.EmbeddingBag(num_rows, dim, mode=mode, sparse=sparse)
        with torch.no_grad():
            bag.weight.copy_(torch.from_numpy(initial_weights(spec, np.arange(num_rows, dtype=np.int64))))
        return bag

    return factory


ARCHS = ("ecrec", "torchrec", "auto")


def _mlps_only(spec: DLRMSpec, seed: int) -> DLRM:
    """Our DLRM of ``spec`` and ``seed`` with a placeholder per table: its seeded MLPs initialize TorchRec's."""
    return DLRM(spec.num_dense, [1] * len(spec.table_sizes), spec.embedding_dim, spec.bottom_mlp, spec.top_mlp,
                embedding_factory=lambda t, rows, dim: nn.Identity(), seed=seed)


def resolve_arch(arch: str) -> str:
    """``ecrec`` (our :class:`DLRM`), ``torchrec`` (TorchRec's, ``ecrec.workload.torchrec_dlrm``), or ``auto``:
    TorchRec's when the ``torchrec`` extra is installed, else ours."""
    from ecrec.workload import torchrec_dlrm

    if arch not in ARCHS:
        raise ValueError(f"unknown DLRM arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if arch == "auto":
        return "torchrec" if torchrec_dlrm.available() else "ecrec"
    if arch == "torchrec" and not torchrec_dlrm.available():
        raise ValueError("arch 'torchrec' needs the torchrec extra: pip install -e '.[torchrec]' "
                         "&& pip install --no-deps torchrec==1.8.0")
    return arch


def build_local_dlrm(spec: DLRMSpec, table_prefix: str = "emb", seed: int = 0, init: str = "uniform",
                     init_scale: float = 0.0, sparse: bool = True, arch: str = "ecrec") -> DLRM:
    """The reference model: local sparse ``EmbeddingBag`` s (or, with ``arch="torchrec"``, TorchRec's DLRM and
    ``EmbeddingBagCollection``), same initial values as :func:`build_cluster_dlrm`."""
    if resolve_arch(arch) == "torchrec":
        from ecrec.workload import torchrec_dlrm

        if init != "uniform":
            raise ValueError(f"arch 'torchrec' initializes tables uniformly, got init {init!r}")
        names = spec.table_names(table_prefix)
        collection = torchrec_dlrm.local_collection(spec, names, seed=seed, init=init, init_scale=init_scale)
        return torchrec_dlrm.TorchRecDLRM(spec, collection, names, _mlps_only(spec, seed))
    factory = local_embedding_factory(table_prefix, seed=seed, sparse=sparse, init=init, init_scale=init_scale)
    return spec.build(factory, seed=seed)


class LocalOptimizer:
    """``torch.optim`` counterparts of the servers' optimizers, stepped together like ``cluster.step()``."""

    def __init__(self, model: DLRM, optimizer: str = "sgd", lr: float = 0.1, dense_optimizer: str | None = None,
                 dense_lr: float | None = None, eps: float = 1e-10, initial_accumulator_value: float = 0.0):
        self.optimizers = []
        emb = embedding_parameters(model)
        dense = list(dense_parameters(model).parameters())
        if emb:
            self.optimizers.append(_torch_optimizer(optimizer, emb, lr, eps, initial_accumulator_value))
        self.optimizers.append(_torch_optimizer(dense_optimizer or optimizer, dense, lr if dense_lr is None else dense_lr,
                                                eps, initial_accumulator_value))

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


def _torch_optimizer(name: str, params, lr: float, eps: float, initial_accumulator_value: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=eps, initial_accumulator_value=initial_accumulator_value)
    raise ValueError(f"unknown optimizer {name!r}; choose 'sgd' or 'adagrad'")


def local_optimizer(model: DLRM, optimizer: str = "sgd", lr: float = 0.1, dense_optimizer: str | None = None,
                    dense_lr: float | None = None, eps: float = 1e-10,
                    initial_accumulator_value: float = 0.0) -> LocalOptimizer:
    """Optimizers for a local model with the servers' semantics; ``step()`` / ``zero_grad()`` like a cluster."""
    return LocalOptimizer(model, optimizer, lr, dense_optimizer, dense_lr, eps, initial_accumulator_value)


# --- cluster tables --------------------------------------------------------------------------------

def build_cluster_dlrm(cluster, spec: DLRMSpec, table_prefix: str = "emb", optimizer: str = "sgd", lr: float = 0.1,
                       seed: int = 0, dense_optimizer: str | None = None, dense_lr: float | None = None,
                       init: str = "uniform", init_scale: float = 0.0, eps: float = 1e-10,
                       initial_accumulator_value: float = 0.0, dense_prefix: str | None = None,
                       arch: str = "ecrec", progress: str | None = None) -> DLRM:
    """Creates the tables on ``cluster``, builds the DLRM on them and registers its MLPs.

    Tables are ``f"{table_prefix}{t}"`` (``optimizer``/``lr``, initial values
    from ``seed``); the MLPs are registered with ``dense_optimizer``/``dense_lr``
    (default: the tables' ones) under ``dense_prefix`` (default
    ``f"{table_prefix}."``).  Every worker may call this: tables and dense tensors
    are created once, and every worker loads the first one's MLP values.  Train
    with ``loss.backward(); cluster.step()``.  ``arch="torchrec"`` builds TorchRec's
    DLRM over the cluster tables (see :func:`resolve_arch`); ``progress`` names a
    progress bar of the table creation (``ecrec.ops.console``).
    """
    from ecrec.ops import console
    from ecrec.client import EmbeddingBag, EmbeddingBagCollection  # the SDK pulls in gRPC: only for a cluster

    names = spec.table_names(table_prefix)
    if resolve_arch(arch) == "torchrec":
        from ecrec.workload import torchrec_dlrm

        if init != "uniform":
            raise ValueError(f"arch 'torchrec' initializes tables uniformly, got init {init!r}")
        configs = torchrec_dlrm.table_configs(spec, names)
        if init_scale:
            for config in configs:
                config.weight_init_min, config.weight_init_max = -init_scale, init_scale
        on_table = None
        if progress:
            on_table = lambda done, total: console.progress(progress, done, total, done=done == total, plain_steps=1)
        collection = EmbeddingBagCollection.from_configs(
            cluster, configs, optimizer=optimizer, lr=lr, eps=eps, initial_accumulator_value=initial_accumulator_value,
            seed=seed, on_table=on_table)
        model = torchrec_dlrm.TorchRecDLRM(spec, collection, names, _mlps_only(spec, seed))
    else:
        for n, (name, rows) in enumerate(zip(names, spec.table_sizes)):
            cluster.create_table(name, rows, spec.embedding_dim, optimizer=optimizer, lr=lr, eps=eps,
                                 initial_accumulator_value=initial_accumulator_value, init=init,
                                 init_scale=init_scale, seed=seed)
            if progress:
                console.progress(progress, n + 1, len(names), done=n + 1 == len(names), plain_steps=1)

        def factory(table_index: int, num_rows: int, dim: int) -> nn.Module:
            return EmbeddingBag(cluster, names[table_index], mode="sum")

        model = spec.build(factory, seed=seed)
        model.embedding_collection = EmbeddingBagCollection(cluster, names, mode="sum")
    cluster.register_dense(dense_parameters(model), optimizer=dense_optimizer or optimizer,
                           lr=lr if dense_lr is None else dense_lr, eps=eps,
                           initial_accumulator_value=initial_accumulator_value,
                           prefix=f"{table_prefix}." if dense_prefix is None else dense_prefix)
    return model


# --- evaluation ------------------------------------------------------------------------------------

def predict(model: DLRM, batches: Iterable) -> tuple[np.ndarray, np.ndarray]:
    """``(labels, logits)`` over ``batches`` (no gradients, nothing recorded for a cluster step)."""
    labels, logits = [], []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                logits.append(model(batch.dense, batch.sparse).numpy().astype(np.float64))
                labels.append(batch.labels.numpy().astype(np.float64))
    finally:
        model.train(was_training)
    if not labels:
        raise ValueError("no batches to evaluate")
    return np.concatenate(labels), np.concatenate(logits)


def evaluate(model: DLRM, batches: Iterable) -> dict:
    """``{"auc", "logloss", "samples", "positive_rate"}`` of ``model`` on ``batches``."""
    y, z = predict(model, batches)
    return {"auc": auc(y, z), "logloss": logloss(y, z, from_logits=True), "samples": int(y.size),
            "positive_rate": float(y.mean())}
