"""A model's cluster tables in and out: the servers' optimizer state as an optimizer-like object, and
pretrained values for a new table (a warm start).

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

import os
from pathlib import Path

import numpy as np
import torch


def cluster_tables(model: torch.nn.Module) -> dict[str, tuple]:
    """``{state-dict key: (cluster, table)}`` of every cluster table ``model`` holds (its ``EmbeddingBag`` and
    ``EmbeddingBagCollection`` modules, wherever they sit)."""
    from ecrec.client import EmbeddingBag, EmbeddingBagCollection

    out = {}
    modules = [("", model)] if isinstance(model, (EmbeddingBag, EmbeddingBagCollection)) else model.named_modules()
    for name, module in modules:
        prefix = f"{name}." if name else ""
        if isinstance(module, EmbeddingBag):
            out[prefix + "weight"] = (module.cluster, module.name)
        elif isinstance(module, EmbeddingBagCollection):
            out.update({key: (module.cluster, table) for key, table in module.state_dict_keys(prefix).items()})
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
            entry = state_dict["state"][key]
            if spec.state_width == 0:
                continue
            value = entry.get("sum") if isinstance(entry, dict) else None
            shape = (spec.num_rows, spec.dim * spec.state_width)
            if value is None or tuple(value.shape) != shape:
                raise ValueError(f"{key!r} (cluster table {table!r}): the saved state must have shape {shape}, "
                                 f"got {None if value is None else tuple(value.shape)}")
            todo.append((cluster, table, value))
        extra = set(state_dict["state"]) - set(self.tables)
        if extra:
            raise ValueError(f"the optimizer state has entries for tables this model does not hold: {sorted(extra)}")
        for cluster, table, value in todo:
            cluster.write_rows(table, np.arange(value.shape[0]), value, what="state")


def load_values(source, spec) -> np.ndarray:
    """A warm start's rows for table ``spec``: a tensor or array ``(num_rows, dim)``, or the path of a ``.npy``
    file (memory-mapped: read a push at a time) or of a ``.pt`` file holding one tensor (or a state dict with
    one ``weight``)."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"table {spec.name!r}: warm-start file {str(path)!r} does not exist")
        if path.suffix == ".npy":
            try:
                values = np.load(path, mmap_mode="r")
            except ValueError as exc:
                raise ValueError(f"table {spec.name!r}: {str(path)!r} is not a readable .npy file: {exc}") from None
        else:
            try:
                loaded = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - reported with the file's name
                raise ValueError(f"table {spec.name!r}: {str(path)!r} is not a .npy or torch file: {exc}") from None
            if isinstance(loaded, dict):
                weights = [v for k, v in loaded.items() if k == "weight" or k.endswith(".weight")]
                if len(weights) != 1:
                    raise ValueError(f"table {spec.name!r}: {str(path)!r} holds {len(weights)} weights; "
                                     "give a file with one tensor")
                loaded = weights[0]
            values = loaded
        where = f"{str(path)!r}"
    else:
        values, where = source, "the values given"
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().to(torch.float32).numpy()
    if not hasattr(values, "shape") or tuple(values.shape) != (spec.num_rows, spec.dim):
        raise ValueError(f"table {spec.name!r}: {where} must have shape {(spec.num_rows, spec.dim)}, got "
                         f"{tuple(getattr(values, 'shape', ()))}")
    return values
