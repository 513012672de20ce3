"""Evaluation metrics for click prediction: ROC AUC and log loss, numpy only.

Used by the workload (``ecrec.workload.dlrm.evaluate``) and by the benchmarks
to compare a model trained on an ECRec cluster with the local reference.
"""

from __future__ import annotations

import numpy as np


def _as_1d(name: str, x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().numpy()
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    return a


def _check(labels, scores) -> tuple[np.ndarray, np.ndarray]:
    y = _as_1d("labels", labels)
    s = _as_1d("scores", scores)
    if y.shape != s.shape:
        raise ValueError(f"labels and scores differ in length: {y.size} vs {s.size}")
    if y.size == 0:
        raise ValueError("no samples")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 0 or 1")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite")
    return y, s


def auc(labels, scores) -> float:
    """Area under the ROC curve: P(score of a random positive > score of a random negative).

    Rank based (Mann-Whitney U); tied scores get their average rank, so a tie
    between a positive and a negative counts 1/2.  Any monotone transform of the
    scores (logits or probabilities) gives the same value.  Returns ``nan`` when
    only one class is present.
    """
    y, s = _check(labels, scores)
    n_pos = float(y.sum())
    n_neg = float(y.size - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    # average 1-based rank of each run of equal scores
    starts = np.flatnonzero(np.concatenate(([True], sorted_s[1:] != sorted_s[:-1])))
    ends = np.concatenate((starts[1:], [s.size]))
    avg_rank = (starts + 1 + ends) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(s.size, dtype=np.float64)
    ranks[order] = np.repeat(avg_rank, ends - starts)
    u = ranks[y == 1].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def logloss(labels, scores, from_logits: bool = False, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy (natural log).

    ``scores`` are probabilities (clipped to ``[eps, 1 - eps]``), or logits when
    ``from_logits`` (computed stably, no clipping).
    """
    y, s = _check(labels, scores)
    if from_logits:
        # softplus(z) - y z
        return float(np.mean(np.maximum(s, 0.0) - y * s + np.log1p(np.exp(-np.abs(s)))))
    if np.any((s < 0) | (s > 1)):
        raise ValueError("probabilities must lie in [0, 1] (pass from_logits=True for logits)")
    p = np.clip(s, eps, 1.0 - eps)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))
