"""What a step checks before it sends anything, and how it reports a part a server refused.

A step is one push with one push id, one request per server.  Everything the worker can judge alone is judged
before any request leaves: a gradient that is not finite, or one so large that the table's optimizer cannot
turn it into finite numbers whatever its state (:func:`ecrec.tables.optim.gradient_limit`).  What only a server
can judge -- an update whose result would not be finite given the rows' optimizer state -- is refused by that
server for its whole part, which changes nothing there; the other servers' parts are applied.  Such a step
raises :class:`StepPartlyApplied`, which names both.
"""

from __future__ import annotations

import numpy as np
import torch

from ecrec.tables import optim


class ClusterError(RuntimeError):
    """A cluster call failed for good (bad input, or no replacement within the retry deadline)."""


class StepPartlyApplied(ClusterError):
    """Some servers applied their parts of a step and others refused theirs (an error status, not "gone").

    ``applied``: server index -> rows updated there; ``refused``: server index -> the server's status and
    reason (its content -- a result that would not be finite --, a bound, the caller's rights).  A refused part
    changed nothing on its server; an applied part stays applied (and redundant) -- the step's gradients are
    spent, so do not retry the step: remove the cause and go on with the next one.  (A step every server refused
    -- ``applied`` empty -- says so: nothing of it was applied anywhere.)"""

    def __init__(self, step: int, applied: dict[int, int], refused: dict[int, str]):
        self.step, self.applied, self.refused = step, applied, refused
        parts = "; ".join(f"server {i}: {why}" for i, why in sorted(refused.items()))
        if not applied:  # every part it had was refused: nothing to keep, nothing half done
            super().__init__(f"step {step} refused by every server it went to, nothing applied anywhere: {parts}")
            return
        done = ", ".join(f"server {i} ({rows} rows)" for i, rows in sorted(applied.items()))
        super().__init__(f"step {step} partly applied: applied by {done}; refused, nothing changed there, by {parts}. "
                         "The applied parts stay applied: do not retry this step")


def bad_gradients(tables: dict[str, list[np.ndarray]], dense: dict[str, np.ndarray], specs: dict, dense_specs: dict
                  ) -> list[str]:
    """What is wrong with a step's gradients, one phrase per table or dense tensor (empty: nothing).

    ``tables``: name -> gradient arrays; ``dense``: name -> gradient; ``specs``/``dense_specs``: name -> the
    map's spec (``optimizer``, ``lr``), when known."""
    bad = []
    for kind, grads in (("table", tables), ("dense tensor", dense)):
        for name, parts in grads.items():
            parts = parts if isinstance(parts, list) else [parts]
            if not all(np.isfinite(p).all() for p in parts):
                bad.append(f"the gradient of {kind} {name!r} holds NaN or Inf")
                continue
            spec = (specs if kind == "table" else dense_specs).get(name)
            if spec is None:
                continue
            limit = optim.gradient_limit(spec.optimizer, spec.lr)
            largest = max((float(np.abs(p).max()) for p in parts if p.size), default=0.0)
            if largest > limit:
                bad.append(f"the gradient of {kind} {name!r} reaches {largest:.3g}, beyond what its optimizer "
                           f"({spec.optimizer}, lr {spec.lr:g}) keeps finite ({limit:.3g})")
    return bad


def collect(pending) -> tuple[dict[str, tuple[list, list]], dict[str, list]]:
    """A step's recorded lookups (``_Pending`` of :mod:`ecrec.client.cluster`) as ``{table: (ids arrays,
    gradient arrays)}`` of those that got a gradient, and ``{table: [(ids, lookups)]}``."""
    per_table: dict[str, tuple[list, list]] = {}
    lookups: dict[str, list] = {}
    for p in pending:
        if p.rows.grad is None:
            continue
        if p.lookups is not None:
            lookups.setdefault(p.table, []).append((p.ids, p.lookups))
        ids_list, grad_list = per_table.setdefault(p.table, ([], []))
        ids_list.append(p.ids)
        grad_list.append(p.rows.grad.detach().to(torch.float32).numpy())
    return per_table, lookups


def bad_step(cluster_map, per_table: dict, dense_params: dict) -> list[str]:
    """:func:`bad_gradients` of a step: its tables' gradients (:func:`collect`) and its dense parameters', judged
    by the specs of ``cluster_map``."""
    dense = {name: param.grad.detach().to(torch.float32).cpu().numpy() for name, param in dense_params.items()
             if param.grad is not None}
    specs = {t.name: t for t in cluster_map.tables} if cluster_map else {}
    dense_specs = {d.name: d for d in cluster_map.dense} if cluster_map else {}
    return bad_gradients({t: grads for t, (_, grads) in per_table.items()}, dense, specs, dense_specs)


def merge_lookups(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One table's ``(ids, lookups)`` of a step from those of its bags: unique ids, their lookups summed."""
    if len(parts) == 1:
        return parts[0]
    ids, inverse = np.unique(np.concatenate([i for i, _ in parts]), return_inverse=True)
    return ids, np.bincount(inverse, weights=np.concatenate([n for _, n in parts]), minlength=len(ids)).astype(np.int64)
