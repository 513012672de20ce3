"""Our hand-written AUC and log loss (``ecrec.workload.metrics``, numpy only) against the libraries that do the
same: scikit-learn's ``roc_auc_score`` and ``log_loss``, and torch's ``binary_cross_entropy_with_logits``.

They are kept because they agree to 1e-12 on random scores, on heavily tied scores (where AUC counts a
positive/negative tie as one half) and on logits, and they need neither scikit-learn nor scipy at run time.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ecrec.workload.metrics import auc, logloss

sklearn_metrics = pytest.importorskip("sklearn.metrics")

CASES = [  # (name, labels, scores)
    ("random", lambda r: r.random(5000) < 0.3, lambda r, y: r.standard_normal(y.size) + y),
    ("tied: 5 distinct scores", lambda r: r.random(5000) < 0.2, lambda r, y: np.round(r.random(y.size) * 4 + y)),
    ("tied: 2 distinct scores", lambda r: r.random(999) < 0.5, lambda r, y: (r.random(y.size) < 0.4 + 0.2 * y) * 1.0),
    ("all tied", lambda r: r.random(100) < 0.5, lambda r, y: np.full(y.size, 0.25)),
    ("perfect", lambda r: np.arange(200) % 2 == 0, lambda r, y: y * 2.0 - 1.0),
    ("few positives", lambda r: np.arange(10_000) < 3, lambda r, y: r.random(y.size)),
]


@pytest.mark.parametrize("name, make_labels, make_scores", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_equals_scikit_learn(name, make_labels, make_scores, seed):
    rng = np.random.default_rng(seed)
    labels = make_labels(rng).astype(np.float64)
    scores = make_scores(rng, labels)
    expected = sklearn_metrics.roc_auc_score(labels, scores)
    assert abs(auc(labels, scores) - expected) <= 1e-12
    assert abs(auc(labels, 1 / (1 + np.exp(-scores))) - expected) <= 1e-12  # any monotone transform: the same


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_log_loss_equals_scikit_learn_and_torch(seed):
    rng = np.random.default_rng(seed)
    labels = (rng.random(4000) < 0.3).astype(np.float64)
    logits = rng.standard_normal(labels.size) * 3
    probabilities = 1 / (1 + np.exp(-logits))
    probabilities = np.clip(probabilities, 1e-6, 1 - 1e-6)  # inside our clipping: the same inputs for both
    assert abs(logloss(labels, probabilities) - sklearn_metrics.log_loss(labels, probabilities)) <= 1e-12
    reference = torch.nn.functional.binary_cross_entropy_with_logits(
        torch.from_numpy(logits), torch.from_numpy(labels)).item()
    assert abs(logloss(labels, logits, from_logits=True) - reference) <= 1e-12
    tied = np.round(probabilities, 1).clip(0.05, 0.95)
    assert abs(logloss(labels, tied) - sklearn_metrics.log_loss(labels, tied)) <= 1e-12


def test_one_class_and_bad_input():
    assert np.isnan(auc([1, 1, 1], [0.1, 0.2, 0.3]))  # scikit-learn raises here; we report "undefined"
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        auc([0, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match="differ in length"):
        auc([0, 1], [0.1])
    with pytest.raises(ValueError, match="scores must be finite"):
        logloss([0, 1], [0.1, np.nan])
    with pytest.raises(ValueError, match="probabilities must lie in"):
        logloss([0, 1], [0.1, 1.5])
