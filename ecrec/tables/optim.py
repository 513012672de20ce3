"""Server-side optimizers with ``torch.optim`` semantics, applied in place to payload rows.

A payload row is ``[weights (d) | state (state_width * d)]`` in float32.  The
same code updates embedding rows (after duplicate ids were summed, like a
coalesced sparse gradient) and dense tensors (one row holding the whole tensor).

- ``sgd``: ``w += -lr * g`` (``torch.optim.SGD``, no momentum).
- ``adagrad``: ``s += g*g; w += -lr * g / (sqrt(s) + eps)``
  (``torch.optim.Adagrad``, no lr decay / weight decay).
"""

from __future__ import annotations

import math

import numpy as np

OPTIMIZERS = {"sgd": 0, "adagrad": 1}  # name -> state floats per weight


def state_width(name: str) -> int:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}") from None


def sum_duplicates(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(sorted unique ids, where each first occurs, their gradients summed)``, like ``torch.sparse`` coalesce:
    each id's gradients added in the order they come, from zero.  The one summation the servers and the SDK (a
    step of several lookups of one table) both make, so a step's result does not depend on which made it."""
    uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    return uniq, first, sum_by_inverse(len(uniq), inverse, grads)


def sum_by_inverse(n: int, inverse: np.ndarray, grads: np.ndarray) -> np.ndarray:
    """Rows ``grads`` summed into ``n`` rows, row ``j`` into ``inverse[j]``, in order, from zero."""
    summed = np.zeros((n, grads.shape[1]), dtype=np.float32)
    np.add.at(summed, inverse.reshape(-1), grads)
    return summed


#: the largest float32
FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_params(name: str, lr: float, eps: float, initial_accumulator_value: float, what: str) -> None:
    state_width(name)
    # stored and applied in float32: a value past its largest is infinite there (rows of inf, every update refused)
    if not (math.isfinite(lr) and 0 < lr <= FLOAT32_MAX):
        raise ValueError(f"{what}: lr must be finite in float32 and > 0, got {lr}")
    if not (math.isfinite(eps) and 0 <= eps <= FLOAT32_MAX):
        raise ValueError(f"{what}: eps must be finite in float32 and >= 0, got {eps}")
    if not (math.isfinite(initial_accumulator_value) and 0 <= initial_accumulator_value <= FLOAT32_MAX):
        raise ValueError(f"{what}: initial_accumulator_value must be finite in float32 and >= 0, got "
                         f"{initial_accumulator_value}")
    if name == "adagrad" and np.float32(eps) == 0 and np.float32(initial_accumulator_value) == 0:
        raise ValueError(f"{what}: adagrad needs eps > 0 or initial_accumulator_value > 0 (division by zero)")



def gradient_limit(name: str, lr: float) -> float:
    """The largest gradient magnitude the optimizer ``name`` turns into finite numbers whatever the state:
    ``lr * g`` must be finite, and for adagrad ``g * g`` too.  A larger one is refused before it is sent (the
    servers would refuse the update as soon as its result is not finite; this catches it on the worker, so
    that no server applies any part of the step)."""
    limit = FLOAT32_MAX / max(float(lr), 1.0)
    if name == "adagrad":
        limit = min(limit, math.sqrt(FLOAT32_MAX))
    return limit


def apply(name: str, rows: np.ndarray, grads: np.ndarray, dim: int, lr: float, eps: float) -> None:
    """Updates ``rows`` (``(n, row_floats)`` float32, in place) with ``grads`` (``(n, dim)`` float32)."""
    w = rows[:, :dim]
    neg_lr = np.float32(-lr)
    if name == "sgd":
        w += neg_lr * grads
    elif name == "adagrad":
        s = rows[:, dim : 2 * dim]
        s += grads * grads
        std = np.sqrt(s)
        std += np.float32(eps)
        w += neg_lr * (grads / std)
    else:
        raise ValueError(f"unknown optimizer {name!r}")
