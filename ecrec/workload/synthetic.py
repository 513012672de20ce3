"""The default data set: :func:`write_synthetic_criteo` writes Criteo-format lines with Zipf-distributed ids and a
planted, learnable signal (sized for a laptop), deterministic from its seed."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ecrec.workload.criteo import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE, normalize_table_sizes


@dataclass(frozen=True)
class SyntheticInfo:
    """What :func:`write_synthetic_criteo` wrote. Read it back with ``table_sizes`` to map ids one to one."""

    path: str
    num_samples: int
    num_dense: int
    table_sizes: list[int]
    seed: int
    positive_rate: float
    oracle_auc: float  # AUC of the true click probabilities: the best any model can reach


_SYNTH_CHUNK = 1 << 15


def _zipf_cdf(rows: int, a: float) -> np.ndarray:
    p = np.arange(1, rows + 1, dtype=np.float64) ** (-a)
    c = np.cumsum(p)
    return c / c[-1]


def write_synthetic_criteo(path: str | os.PathLike, num_samples: int = 100_000, num_tables: int = CRITEO_NUM_SPARSE,
                           rows_per_table: int | Sequence[int] = 10_000, zipf_a: float = 1.05, seed: int = 0,
                           num_dense: int = CRITEO_NUM_DENSE, signal_tables: int | None = None,
                           signal_scale: float = 0.8, dense_signal_scale: float = 0.5,
                           missing_rate: float = 0.05) -> SyntheticInfo:
    """Writes ``num_samples`` Criteo-format lines with a learnable planted signal; deterministic from ``seed``.

    Table ``t`` has ``rows_per_table[t]`` rows; row 0 stands for "missing" (an
    empty field, probability ``missing_rate``), the others are drawn with a
    bounded Zipf law of exponent ``zipf_a`` over popularity ranks, scattered over
    the row ids by a fixed permutation, and written as 8-digit hex (the row id
    itself, so reading with ``table_sizes = rows_per_table`` recovers it).
    Integer features are heavy-tailed counts (empty with ``missing_rate``).

    The label is drawn from ``sigmoid(b + sum_t w_t[id_t] + sum_j beta_j z_j)``:
    ``w_t`` are hidden per-row weights (N(0, ``signal_scale``²)) of the first
    ``signal_tables`` tables (default ``min(8, num_tables)``), ``z_j`` the
    standardized ``log1p`` dense features, ``beta_j ~ N(0, dense_signal_scale²)``.
    """
    path = os.fspath(path)
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if num_tables < 1 or num_dense < 0:
        raise ValueError("need num_tables >= 1 and num_dense >= 0")
    sizes = normalize_table_sizes(rows_per_table, num_tables)
    if min(sizes) < 2:
        raise ValueError("rows_per_table must be >= 2 (row 0 is reserved for missing values)")
    if max(sizes) > 1 << 32:
        raise ValueError("rows_per_table must be <= 2**32 (ids are written as 8-digit hex)")
    if not zipf_a > 0:
        raise ValueError(f"zipf_a must be > 0, got {zipf_a}")
    if not 0.0 <= missing_rate < 1.0:
        raise ValueError(f"missing_rate must be in [0, 1), got {missing_rate}")
    n_signal = min(8, num_tables) if signal_tables is None else int(signal_tables)
    if not 0 <= n_signal <= num_tables:
        raise ValueError(f"signal_tables must be in [0, {num_tables}], got {signal_tables}")

    rng = np.random.default_rng(seed)
    cdfs = [_zipf_cdf(s - 1, zipf_a) for s in sizes]
    perms = [rng.permutation(s - 1) + 1 for s in sizes]  # popularity rank -> row id (1 .. s-1)
    weights = [rng.normal(0.0, signal_scale, s).astype(np.float64) if t < n_signal else None
               for t, s in enumerate(sizes)]
    for w in weights:
        if w is not None:
            w[0] = 0.0
    dense_mu = rng.uniform(0.0, 2.0, num_dense)
    dense_sigma = rng.uniform(0.8, 1.6, num_dense)
    beta = rng.normal(0.0, dense_signal_scale, num_dense)
    bias = -1.5
    pop_mean, pop_std = _dense_moments(dense_mu, dense_sigma, missing_rate)

    scores, labels_all = [], []
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii", newline="\n") as f:
        for chunk_index, start in enumerate(range(0, num_samples, _SYNTH_CHUNK)):
            n = min(_SYNTH_CHUNK, num_samples - start)
            crng = np.random.default_rng([seed, chunk_index])
            logit = np.full(n, bias)
            columns: list[list[str]] = []
            # dense: log-normal counts, so log1p(x) ~ roughly normal
            z = crng.standard_normal((n, num_dense))
            counts = np.floor(np.expm1(np.maximum(dense_mu + dense_sigma * z, 0.0))).astype(np.int64)
            dense_missing = crng.random((n, num_dense)) < missing_rate
            logf = np.where(dense_missing, 0.0, np.log1p(counts))
            logit += ((logf - pop_mean) / pop_std) @ beta  # population moments: chunk independent
            # categorical
            cat_cols = []
            for t, s in enumerate(sizes):
                ranks = np.searchsorted(cdfs[t], crng.random(n), side="right")
                ranks = np.minimum(ranks, s - 2)
                ids = perms[t][ranks]
                ids[crng.random(n) < missing_rate] = 0
                if weights[t] is not None:
                    logit += weights[t][ids]
                cat_cols.append(ids)
            p = 1.0 / (1.0 + np.exp(-logit))
            labels = (crng.random(n) < p).astype(np.int64)
            scores.append(p)
            labels_all.append(labels)
            columns.append(labels.astype(str).tolist())
            for j in range(num_dense):
                col = counts[:, j].astype(str).astype(object)
                col[dense_missing[:, j]] = ""
                columns.append(col.tolist())
            for ids in cat_cols:
                columns.append(["" if i == 0 else f"{i:08x}" for i in ids.tolist()])
            f.write("\n".join(map("\t".join, zip(*columns))))
            f.write("\n")
    os.replace(tmp, path)
    from ecrec.workload.metrics import auc  # local import: metrics is tiny, avoid a cycle at import time

    y = np.concatenate(labels_all) if labels_all else np.zeros(0)
    s = np.concatenate(scores) if scores else np.zeros(0)
    oracle = auc(y, s) if y.size and 0 < y.sum() < y.size else float("nan")
    return SyntheticInfo(path=path, num_samples=int(num_samples), num_dense=int(num_dense), table_sizes=sizes,
                         seed=int(seed), positive_rate=float(y.mean()) if y.size else float("nan"), oracle_auc=oracle)


def _dense_moments(mu: np.ndarray, sigma: np.ndarray, missing_rate: float) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std of ``log1p(floor(expm1(max(mu + sigma z, 0))))`` with missing as 0, by quadrature."""
    z = np.linspace(-8, 8, 4001)
    w = np.exp(-0.5 * z * z)
    w /= w.sum()
    x = np.maximum(mu[:, None] + sigma[:, None] * z[None, :], 0.0)
    v = np.log1p(np.floor(np.expm1(x)))
    m1 = (1 - missing_rate) * (v * w).sum(axis=1)
    m2 = (1 - missing_rate) * (v * v * w).sum(axis=1)
    std = np.sqrt(np.maximum(m2 - m1 * m1, 1e-12))
    return m1, std

