"""The benchmark's DLRM built from TorchRec's (``torchrec.models.dlrm.DLRM``), when the ``torchrec`` extra is
installed.

:class:`TorchRecDLRM` computes the same function as :class:`ecrec.workload.dlrm.DLRM` of the same
:class:`~ecrec.workload.dlrm.DLRMSpec` and seed, from the same initial values: TorchRec's dense arch, its
interaction (pairwise dots of the dense output and every table's bag) and its over arch, with the MLP weights
copied from our DLRM's seeded initialization.  TorchRec lists the pairs ``(i, j), i < j`` where we list
``(i, j), i > j``, so the first over-arch layer takes our weight columns in TorchRec's pair order.  The tables
are a ``torchrec.EmbeddingBagCollection`` (local reference) or our cluster collection built from the same
``EmbeddingBagConfig`` s (``EmbeddingBagCollection.from_configs``): the cluster stands where TorchRec's
collection stood.  ``forward(dense, sparse)`` takes the benchmark's ``(indices, offsets)`` pairs and makes
the ``KeyedJaggedTensor`` TorchRec's model expects.
"""

from __future__ import annotations

import importlib.util
from typing import Sequence

import numpy as np
import torch
from torch import nn

from ecrec.tables.spec import TableSpec, initial_weights


def available() -> bool:
    """Whether TorchRec can be imported here (the ``torchrec`` extra)."""
    return importlib.util.find_spec("torchrec") is not None


def table_configs(spec, names: Sequence[str]) -> list:
    """One ``torchrec.EmbeddingBagConfig`` per table of ``spec`` (sum pooling), feature named like its table."""
    import torchrec

    return [torchrec.EmbeddingBagConfig(name=name, embedding_dim=spec.embedding_dim, num_embeddings=rows,
                                        feature_names=[name], pooling=torchrec.PoolingType.SUM)
            for name, rows in zip(names, spec.table_sizes)]


class _DenseArchs(nn.Module):
    """The dense arch and over arch of a TorchRec DLRM (parameters shared): what a cluster run registers."""

    def __init__(self, model):
        super().__init__()
        self.dense_arch = model.dense_arch
        self.over_arch = model.over_arch


class TorchRecDLRM(nn.Module):
    """``torchrec.models.dlrm.DLRM`` over ``collection``, its MLPs initialized from ``ours`` (our
    ``ecrec.workload.dlrm.DLRM`` of the same ``spec``; tables not needed); ``forward(dense, sparse)`` returns
    logits ``(B,)``.  ``ecrec.workload.dlrm.build_local_dlrm``/``build_cluster_dlrm(arch="torchrec")`` make one."""

    def __init__(self, spec, collection: nn.Module, feature_names: Sequence[str], ours: nn.Module):
        super().__init__()
        from torchrec.models.dlrm import DLRM as TorchRecModel

        if not spec.top_mlp:
            raise ValueError("TorchRec's over arch needs at least one hidden layer (top_mlp must not be empty)")
        self.feature_names = list(feature_names)
        self.num_dense = spec.num_dense
        self.model = TorchRecModel(embedding_bag_collection=collection, dense_in_features=spec.num_dense,
                                   dense_arch_layer_sizes=[*spec.bottom_mlp, spec.embedding_dim],
                                   over_arch_layer_sizes=[*spec.top_mlp, 1], dense_device=torch.device("cpu"))
        self._copy_mlps(ours)  # our DLRM's seeded MLPs give the initial values
        self.embeddings = nn.ModuleList([collection])  # what ecrec.workload.dlrm.embedding_parameters reads

    def _copy_mlps(self, ours) -> None:
        ours_bottom = [m for m in ours.bottom_mlp if isinstance(m, nn.Linear)]
        theirs_bottom = [p._linear for p in self.model.dense_arch.model._mlp]
        ours_top = [m for m in ours.top_mlp if isinstance(m, nn.Linear)]
        theirs_top = [p._linear for p in self.model.over_arch.model[0]._mlp] + [self.model.over_arch.model[1]]
        if len(ours_bottom) != len(theirs_bottom) or len(ours_top) != len(theirs_top):
            raise RuntimeError("TorchRec's DLRM layers do not match ours; this TorchRec version is not supported")
        # the first over-arch layer's inputs: dense output, then TorchRec's pairs (i < j) = our pairs (j, i)
        features = len(self.feature_names) + 1
        ours_i, ours_j = torch.tril_indices(features, features, offset=-1).tolist()
        position = {(i, j): p for p, (i, j) in enumerate(zip(ours_i, ours_j))}
        theirs_i, theirs_j = torch.triu_indices(features, features, offset=1).tolist()
        dim = ours.embedding_dim
        columns = list(range(dim)) + [dim + position[(j, i)] for i, j in zip(theirs_i, theirs_j)]
        with torch.no_grad():
            for src, dst in zip(ours_bottom, theirs_bottom):
                dst.weight.copy_(src.weight)
                dst.bias.copy_(src.bias)
            for n, (src, dst) in enumerate(zip(ours_top, theirs_top)):
                dst.weight.copy_(src.weight[:, columns] if n == 0 else src.weight)
                dst.bias.copy_(src.bias)

    def features(self, sparse: Sequence[tuple[torch.Tensor, torch.Tensor | None]]):
        """The benchmark's per-table ``(indices, offsets)`` as one ``KeyedJaggedTensor``."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        if len(sparse) != len(self.feature_names):
            raise ValueError(f"got {len(sparse)} sparse features for {len(self.feature_names)} tables")
        values, lengths = [], []
        for indices, offsets in sparse:
            indices = indices.reshape(-1)
            if offsets is None:
                raise ValueError("sparse features need offsets (1-D indices with offsets)")
            ends = torch.cat([offsets[1:], torch.tensor([indices.numel()], dtype=offsets.dtype)])
            values.append(indices)
            lengths.append(ends - offsets)
        return KeyedJaggedTensor.from_lengths_sync(keys=self.feature_names, values=torch.cat(values).to(torch.int64),
                                                   lengths=torch.cat(lengths).to(torch.int32))

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise ValueError(f"dense must be (B, {self.num_dense}), got {tuple(dense.shape)}")
        return self.model(dense, self.features(sparse)).squeeze(1)

    def forward_batch(self, batch) -> torch.Tensor:
        """Logits of a :class:`ecrec.workload.batch.Batch`."""
        return self(batch.dense, batch.sparse)

    def dense_module(self) -> nn.Module:
        """The dense arch and over arch (bottom and top MLP) as one module (``dense_parameters``)."""
        return _DenseArchs(self.model)


def local_collection(spec, names: Sequence[str], seed: int = 0, init: str = "uniform", init_scale: float = 0.0):
    """``torchrec.EmbeddingBagCollection`` holding the initial values the cluster tables of ``names`` get."""
    import torchrec

    collection = torchrec.EmbeddingBagCollection(tables=table_configs(spec, names), device=torch.device("cpu"))
    with torch.no_grad():
        for name, rows in zip(names, spec.table_sizes):
            table = TableSpec(name=name, num_rows=rows, dim=spec.embedding_dim, init=init, init_scale=init_scale,
                              seed=seed).validate()
            collection.embedding_bags[name].weight.copy_(
                torch.from_numpy(initial_weights(table, np.arange(rows, dtype=np.int64))))
    return collection
