"""A model's cluster tables in and out: the servers' optimizer state as an optimizer-like object (a warm
start's values: ``ecrec.client.warm_start``; snapshots of a whole cluster: ``ecrec.snapshot``).

``EmbeddingBag`` and ``EmbeddingBagCollection`` put their tables' weights in ``model.state_dict()`` (keys
``weight`` and TorchRec's ``embedding_bags.<table>.weight``) and load them back; the optimizer state, which
the servers keep beside each row, is :class:`EmbeddingOptimizer`'s, keyed by the same names, in
``torch.optim.Adagrad``'s shape (``state[key]["sum"]``), so that training resumes exactly::

    sparse = EmbeddingOptimizer(model)                 # every cluster table the model holds
    torch.save({"model": model.state_dict(), "sparse": sparse.state_dict()}, "ckpt.pt")
    ...
    saved = torch.load("ckpt.pt")
    model.load_state_dict(saved["model"]); sparse.load_state_dict(saved["sparse"])
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ecrec.tables.values import check_values

log = logging.getLogger("ecrec.client")


def cluster_tables(model: torch.nn.Module) -> dict[str, tuple]:
    """``{state-dict key: (cluster, table)}`` of every cluster table ``model`` holds (its ``EmbeddingBag`` and
    ``EmbeddingBagCollection`` modules, wherever they sit: each says which through ``state_dict_keys``)."""
    out = {}
    for name, module in model.named_modules():
        keys = getattr(module, "state_dict_keys", None)
        if keys is not None and hasattr(module, "cluster"):
            out.update({key: (module.cluster, table) for key, table in keys(f"{name}." if name else "").items()})
    return out


class EmbeddingOptimizer:
    """The servers' optimizer of a model's cluster tables, as an object with ``state_dict()`` and
    ``load_state_dict()`` (``torch.optim.Adagrad``'s shape: ``state[key] = {"step", "sum"}``, one param group
    per table with its ``lr``, ``eps`` and optimizer), and ``step()``/``zero_grad()`` (the cluster's), so it
    can stand where an optimizer stood.  Tables trained with SGD keep no state (``state[key] = {}``)."""

    def __init__(self, model: torch.nn.Module):
        self.tables = cluster_tables(model)
        if not self.tables:
            raise ValueError("the model holds no cluster table (ecrec.client.EmbeddingBag or EmbeddingBagCollection)")

    def _clusters(self):
        return list({id(c): c for c, _ in self.tables.values()}.values())

    def step(self) -> list[dict]:
        return [cluster.step() for cluster in self._clusters()]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for cluster in self._clusters():
            cluster.zero_grad()

    def state_dict(self) -> dict:
        state, groups = {}, []
        for key, (cluster, table) in self.tables.items():
            spec = cluster.table_spec(table)
            state[key] = {} if spec.state_width == 0 else {
                "step": torch.tensor(0.0), "sum": torch.from_numpy(cluster.read_table(table, "state"))}
            groups.append({"params": [key], "table": table, "optimizer": spec.optimizer, "lr": spec.lr,
                           "eps": spec.eps, "initial_accumulator_value": spec.initial_accumulator_value})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Writes each table's optimizer state (checked whole first: the same tables, optimizers and shapes;
        a mismatch raises ``ValueError`` naming the table, and nothing is written)."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("not an optimizer state dict: it needs 'state' and 'param_groups'")
        groups = {g["params"][0]: g for g in state_dict["param_groups"] if g.get("params")}
        todo = []
        for key, (cluster, table) in self.tables.items():
            spec = cluster.table_spec(table)
            if key not in state_dict["state"] or key not in groups:
                raise ValueError(f"the optimizer state has no entry for {key!r} (cluster table {table!r})")
            if groups[key].get("optimizer") != spec.optimizer:
                raise ValueError(f"{key!r} (cluster table {table!r}): saved for optimizer "
                                 f"{groups[key].get('optimizer')!r}, the table trains with {spec.optimizer!r}")
            differ = [f"{n} {groups[key][n]!r} -> {getattr(spec, n)!r}" for n in ("lr", "eps", "initial_accumulator_value")
                      if n in groups[key] and groups[key][n] != getattr(spec, n)]
            if differ:  # torch.optim would take them; a table's settings are the cluster's, for every worker
                log.warning("%r (cluster table %r): saved with other optimizer settings (%s); the table trains on "
                            "with the cluster's (they are set when it is created)", key, table, ", ".join(differ))
            entry = state_dict["state"][key]
            if spec.state_width == 0:
                continue
            value = entry.get("sum") if isinstance(entry, dict) else None
            if isinstance(value, torch.Tensor):  # floating tensors as float32 (bfloat16 has no numpy form)
                value = value.detach().cpu()
                value = (value.to(torch.float32) if value.is_floating_point() else value).numpy()
            shape = (spec.num_rows, spec.dim * spec.state_width)
            if value is None or tuple(getattr(value, "shape", ())) != shape:
                raise ValueError(f"{key!r} (cluster table {table!r}): the saved state must have shape {shape}, "
                                 f"got {None if value is None else tuple(getattr(value, 'shape', ()))}")
            try:
                check_values(spec, value, "state")  # finite, accumulators >= 0: before any write
            except ValueError as exc:
                raise ValueError(f"{key!r}: {exc}") from None
            todo.append((cluster, table, value))
        extra = set(state_dict["state"]) - set(self.tables)
        if extra:
            raise ValueError(f"the optimizer state has entries for tables this model does not hold: {sorted(extra)}")
        for cluster, table, value in todo:
            cluster.write_rows(table, np.arange(value.shape[0]), value, what="state", checked=True)
