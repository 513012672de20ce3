"""Training data for the DLRM workload: batches, the Criteo TSV reader, a synthetic generator.

Everything the benchmark trains on goes through one format, the Criteo TSV
(Kaggle Display Advertising / Terabyte click logs)::

    label \\t I1 .. I13 \\t C1 .. C26 \\n

``label`` is 0 or 1, ``I*`` are integer counts (may be empty or negative), ``C*``
hexadecimal hashes (may be empty).  Features become:

- dense: ``log(1 + max(x, 0))`` as float32, an empty field is 0;
- categorical: ``int(hex, 16) % num_rows`` of that table, an empty field is row 0.

Pieces:

- :class:`Batch`: what a training step consumes (dense ``(B, 13)``, one
  ``(indices, offsets)`` pair per table as ``torch.nn.EmbeddingBag`` takes them,
  labels ``(B,)``).
- :class:`CriteoReader`: streams batches from a (possibly gzipped) TSV, parsing
  chunks of lines with numpy; malformed lines are reported with their line
  numbers and skipped (``on_malformed="skip"``) or refused (``"error"``);
  ``shard=(rank, world_size)`` gives torchrun workers disjoint lines.
- :func:`write_synthetic_criteo`: writes that format with Zipf-distributed ids
  and a planted signal (the default data set, sized for a laptop).
- :class:`InMemoryDataset`: a whole small file as arrays, for benchmarks that
  must not be parse-bound, with a train/test split.

MovieLens-100k is converted to the same arrays by ``ecrec.workload.movielens``.

This module holds :class:`InMemoryDataset` and gathers the others' names: :class:`Batch` is in
``ecrec.workload.batch``, the reader in ``ecrec.workload.criteo`` (its field decoding in
``ecrec.workload.tsv_fields``), the generator in ``ecrec.workload.synthetic``.
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import numpy as np

from ecrec.workload.batch import Batch
from ecrec.workload.criteo import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE, CriteoReader, ReadStats, criteo_batches
from ecrec.workload.synthetic import SyntheticInfo, write_synthetic_criteo


class InMemoryDataset:
    """A whole (small) data set as arrays; yields :class:`Batch` es without parsing.

    ``dense`` float32 ``(N, D)``, ``ids`` int64 ``(N, T)`` (one id per sample per
    table), ``labels`` float32 ``(N,)``; ``table_sizes`` (rows per table) is
    optional metadata for building the model.
    """

    def __init__(self, dense: np.ndarray, ids: np.ndarray, labels: np.ndarray,
                 table_sizes: Sequence[int] | None = None):
        dense = np.ascontiguousarray(dense, dtype=np.float32)
        ids = np.asarray(ids, dtype=np.int64)
        labels = np.ascontiguousarray(labels, dtype=np.float32).reshape(-1)
        if dense.ndim != 2 or ids.ndim != 2 or not (len(dense) == len(ids) == len(labels)):
            raise ValueError(f"dataset arrays disagree: dense {dense.shape}, ids {ids.shape}, labels {labels.shape}")
        self.dense = dense
        self._ids_by_table = np.ascontiguousarray(ids.T)  # (T, N): a table's ids of a batch are contiguous
        self.labels = labels
        self.table_sizes = None if table_sizes is None else [int(s) for s in table_sizes]
        if self.table_sizes is not None:
            if len(self.table_sizes) != ids.shape[1]:
                raise ValueError(f"{len(self.table_sizes)} table sizes for {ids.shape[1]} tables")
            if ids.size and (ids.min() < 0 or np.any(ids.max(axis=0) >= np.asarray(self.table_sizes))):
                raise ValueError("ids out of range of table_sizes")

    @classmethod
    def from_tsv(cls, path: str | os.PathLike, table_sizes: int | Sequence[int], on_malformed: str = "skip",
                 num_dense: int = CRITEO_NUM_DENSE, num_sparse: int = CRITEO_NUM_SPARSE,
                 max_samples: int | None = None, shard: tuple[int, int] = (0, 1)) -> "InMemoryDataset":
        """Loads a Criteo TSV once (see :class:`CriteoReader` for the arguments)."""
        reader = CriteoReader(path, table_sizes, on_malformed=on_malformed, shard=shard,
                              num_dense=num_dense, num_sparse=num_sparse)
        dense, ids, labels = reader.read_arrays(max_samples)
        ds = cls(dense, ids, labels, reader.table_sizes)
        ds.read_stats = reader.stats
        return ds

    def __len__(self) -> int:
        return int(self.labels.size)

    @property
    def ids(self) -> np.ndarray:
        """int64 ``(N, T)`` (a transposed view)."""
        return self._ids_by_table.T

    @property
    def num_dense(self) -> int:
        return int(self.dense.shape[1])

    @property
    def num_tables(self) -> int:
        return int(self._ids_by_table.shape[0])

    def subset(self, index: np.ndarray) -> "InMemoryDataset":
        index = np.asarray(index)
        return InMemoryDataset(self.dense[index], self._ids_by_table[:, index].T, self.labels[index], self.table_sizes)

    def split(self, test_fraction: float = 0.1, shuffle: bool = True, seed: int = 0) -> tuple["InMemoryDataset", "InMemoryDataset"]:
        """``(train, test)``: the last ``test_fraction`` of the samples (after a seeded shuffle, if ``shuffle``)."""
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        n = len(self)
        order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
        n_test = max(1, int(round(n * test_fraction)))
        if n_test >= n:
            raise ValueError(f"{n} samples are too few to split off {test_fraction:.0%}")
        return self.subset(np.sort(order[: n - n_test])), self.subset(np.sort(order[n - n_test:]))

    def shard(self, rank: int, world_size: int) -> "InMemoryDataset":
        """Samples ``i`` with ``i % world_size == rank`` (disjoint, complete)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got ({rank}, {world_size})")
        return self.subset(np.arange(rank, len(self), world_size))

    def batch(self, index: np.ndarray | slice) -> Batch:
        if isinstance(index, slice):
            return Batch._from_columns(self.dense[index], self._ids_by_table[:, index], self.labels[index], None)
        index = np.asarray(index)
        return Batch._from_columns(self.dense[index], self._ids_by_table[:, index], self.labels[index], None)

    def batches(self, batch_size: int, shuffle: bool = False, seed: int = 0, drop_last: bool = False) -> Iterator[Batch]:
        """One epoch of batches, in order or in a seeded random order."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        n = len(self)
        stop = (n // batch_size) * batch_size if drop_last else n
        order = np.random.default_rng(seed).permutation(n) if shuffle else None
        for s in range(0, stop, batch_size):
            e = min(s + batch_size, n)
            yield self.batch(slice(s, e) if order is None else order[s:e])

    def repeat(self, batch_size: int, steps: int, shuffle: bool = True, seed: int = 0) -> Iterator[Batch]:
        """Exactly ``steps`` full batches, cycling over epochs (each reshuffled with ``seed + epoch``)."""
        if len(self) < batch_size:
            raise ValueError(f"{len(self)} samples are fewer than one batch of {batch_size}")
        done, epoch = 0, 0
        while done < steps:
            for b in self.batches(batch_size, shuffle=shuffle, seed=seed + epoch, drop_last=True):
                yield b
                done += 1
                if done == steps:
                    return
            epoch += 1


__all__ = [
    "Batch", "CriteoReader", "ReadStats", "InMemoryDataset", "SyntheticInfo", "write_synthetic_criteo",
    "criteo_batches", "CRITEO_NUM_DENSE", "CRITEO_NUM_SPARSE",
]
