"""What a training step consumes: :class:`Batch` (dense features, one ``(indices, offsets)`` pair per table as
``torch.nn.EmbeddingBag`` takes them, labels), whatever the data came from."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Batch:
    """One training step's worth of samples.

    ``dense``: float32 ``(B, num_dense)``; ``sparse``: per table an
    ``(indices, offsets)`` pair of int64 tensors, as ``EmbeddingBag`` takes them
    (one id per sample per table here, so ``offsets`` is ``arange(B)``);
    ``labels``: float32 ``(B,)``; ``line_numbers``: for batches from a file, the
    1-based line each sample came from (else ``None``).
    """

    dense: torch.Tensor
    sparse: list[tuple[torch.Tensor, torch.Tensor]]
    labels: torch.Tensor
    line_numbers: np.ndarray | None = None

    @classmethod
    def from_arrays(cls, dense: np.ndarray, ids: np.ndarray, labels: np.ndarray,
                    line_numbers: np.ndarray | None = None) -> "Batch":
        """Builds a batch from ``dense (B, D)``, ``ids (B, T)`` (one id per sample per table), ``labels (B,)``."""
        dense = np.ascontiguousarray(dense, dtype=np.float32)
        labels = np.ascontiguousarray(labels, dtype=np.float32).reshape(-1)
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 2 or dense.ndim != 2 or not (len(dense) == len(ids) == len(labels)):
            raise ValueError(f"batch arrays disagree: dense {dense.shape}, ids {ids.shape}, labels {labels.shape}")
        return cls._from_columns(dense, np.ascontiguousarray(ids.T), labels, line_numbers)

    @classmethod
    def _from_columns(cls, dense: np.ndarray, ids_by_table: np.ndarray, labels: np.ndarray,
                      line_numbers: np.ndarray | None) -> "Batch":
        offsets = torch.arange(len(labels), dtype=torch.int64)
        sparse = [(torch.from_numpy(np.ascontiguousarray(ids_by_table[t])), offsets) for t in range(len(ids_by_table))]
        return cls(torch.from_numpy(dense), sparse, torch.from_numpy(labels), line_numbers)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def ids(self) -> np.ndarray:
        """The ids as an int64 ``(B, T)`` array (one id per sample per table)."""
        return np.stack([idx.numpy() for idx, _ in self.sparse], axis=1) if self.sparse else np.zeros((len(self), 0), np.int64)
