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

from ecrec.client import dense_state
from ecrec.tables.values import check_dense_values, check_values

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
    can stand where an optimizer stood.  Tables trained with SGD keep no state (``state[key] = {}``).  The
    model's parameters registered with ``Cluster.register_dense`` are in it too, keyed by their state-dict keys
    (an optimizer state saved without them loads, the servers' kept, said)."""

    def __init__(self, model: torch.nn.Module):
        self.tables = cluster_tables(model)
        self.dense = dense_state.registered(model)  # its parameters on the servers (Cluster.register_dense)
        if not self.tables and not self.dense:
            raise ValueError("the model holds no cluster table (ecrec.client.EmbeddingBag or EmbeddingBagCollection) "
                             "and no parameter registered with Cluster.register_dense")

    def _clusters(self):
        return list({id(c): c for c, _ in [*self.tables.values(), *self.dense.values()]}.values())

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
            groups.append(_group(key, spec, table=table))
        for key, (cluster, name) in self.dense.items():
            spec = cluster.dense_spec(name)
            state[key] = {} if spec.state_width == 0 else {
                "step": torch.tensor(0.0),
                "sum": torch.from_numpy(cluster.read_dense_payload(name)[spec.numel:].reshape(_dense_state_shape(spec)))}
            groups.append(_group(key, spec, dense=name))
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Writes each table's optimizer state (checked whole first: the same tables, optimizers and shapes;
        a mismatch raises ``ValueError`` naming the table, and nothing is written)."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("not an optimizer state dict: it needs 'state' and 'param_groups'")
        if not isinstance(state_dict["state"], dict) or not isinstance(state_dict["param_groups"], (list, tuple)) or \
                not all(isinstance(g, dict) for g in state_dict["param_groups"]):
            raise ValueError("not an optimizer state dict: 'state' must be a dict of entries and 'param_groups' a "
                             f"list of dicts (got {type(state_dict['state']).__name__} and "
                             f"{type(state_dict['param_groups']).__name__})")
        # every parameter's group (torch.optim puts them all in one; this class, one each)
        groups = {p: g for g in state_dict["param_groups"] for p in (g.get("params") or [])}
        todo = []
        for key, (cluster, table) in self.tables.items():
            spec = cluster.table_spec(table)
            if key not in state_dict["state"] or key not in groups:
                raise ValueError(f"the optimizer state has no entry for {key!r} (cluster table {table!r})")
            saved = _saved_optimizer(groups[key], state_dict["state"][key])
            if saved != spec.optimizer:
                raise ValueError(f"{key!r} (cluster table {table!r}): saved for optimizer {saved!r}, the table "
                                 f"trains with {spec.optimizer!r}")
            differ = [f"{n} {groups[key][n]!r} -> {getattr(spec, n)!r}" for n in ("lr", "eps", "initial_accumulator_value")
                      if n in groups[key] and groups[key][n] != getattr(spec, n)]
            if differ:  # torch.optim would take them; a table's settings are the cluster's, for every worker
                log.warning("%r (cluster table %r): saved with other optimizer settings (%s); the table trains on "
                            "with the cluster's (they are set when it is created)", key, table, ", ".join(differ))
            entry = state_dict["state"][key]
            if spec.state_width == 0:
                continue
            value = _saved_sum(entry, (spec.num_rows, spec.dim * spec.state_width),
                               f"{key!r} (cluster table {table!r})")
            try:
                check_values(spec, value, "state")  # finite, accumulators >= 0: before any write
            except ValueError as exc:
                raise ValueError(f"{key!r}: {exc}") from None
            todo.append((cluster, table, value))
        dense_todo = []
        for key, (cluster, name) in self.dense.items():
            spec = cluster.dense_spec(name)
            if key not in state_dict["state"] or key not in groups:
                # saved before dense tensors' state was (or by hand without it): the servers' stays, said
                log.warning("the optimizer state has no entry for %r (dense tensor %r): its optimizer state on the "
                            "servers is kept", key, name)
                continue
            saved = _saved_optimizer(groups[key], state_dict["state"][key])
            if saved != spec.optimizer:
                raise ValueError(f"{key!r} (dense tensor {name!r}): saved for optimizer {saved!r}, the tensor "
                                 f"trains with {spec.optimizer!r}")
            if spec.state_width == 0:
                continue
            value = _saved_sum(state_dict["state"][key], _dense_state_shape(spec),
                               f"{key!r} (dense tensor {name!r})")
            payload = cluster.read_dense_payload(name)
            with np.errstate(over="ignore", invalid="ignore"):
                payload[spec.numel:] = np.asarray(value, dtype=np.float32).reshape(-1)
            try:
                check_dense_values(spec, payload)  # finite, accumulators >= 0: before any write
            except ValueError as exc:
                raise ValueError(f"{key!r}: {exc}") from None
            dense_todo.append((cluster, name, payload))
        extra = set(state_dict["state"]) - set(self.tables) - set(self.dense)
        dense_extra = {key for key in extra if "dense" in groups.get(key, {})}
        if dense_extra:  # a registered parameter's state, this model's parameter not registered: its optimizer's
            log.warning("the optimizer state holds dense parameters this model has not registered with the cluster "
                        "(%s): not loaded", ", ".join(sorted(dense_extra)))
            extra -= dense_extra
        if extra:
            raise ValueError(f"the optimizer state has entries for tables or dense parameters this model does not "
                             f"hold: {sorted(extra)}")
        for cluster, table, value in todo:
            cluster.write_rows(table, np.arange(value.shape[0]), value, what="state", checked=True)
        for cluster, name, payload in dense_todo:
            cluster.write_dense(name, payload)


def _group(key: str, spec, **holder) -> dict:
    """A param group of the state dict: one table's or dense tensor's key and its optimizer settings."""
    return {"params": [key], **holder, "optimizer": spec.optimizer, "lr": spec.lr, "eps": spec.eps,
            "initial_accumulator_value": spec.initial_accumulator_value}


def _saved_optimizer(group: dict, entry) -> str:
    """The optimizer a saved entry is for: its group's ``optimizer`` (this class writes it); in a
    ``torch.optim`` state dict (with the state dict's keys for parameter ids), read off the entry: Adagrad's
    ``sum``, or plain SGD's nothing (a momentum buffer is SGD with momentum, which no table trains with)."""
    if group.get("optimizer") is not None:
        return group["optimizer"]
    fields = set(entry) - {"step"} if isinstance(entry, dict) else set()
    if fields == {"sum"}:
        return "adagrad"
    return "sgd" if not fields else f"one keeping {sorted(fields)}"


def _saved_sum(entry, shape: tuple[int, ...], what: str):
    """The accumulators a state entry saved (``entry["sum"]``), floating tensors as float32 (bfloat16 has no numpy
    form); ``ValueError`` naming ``what`` when they are missing or not of ``shape``."""
    value = entry.get("sum") if isinstance(entry, dict) else None
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = (value.to(torch.float32) if value.is_floating_point() else value).numpy()
    if value is None or tuple(getattr(value, "shape", ())) != shape:
        raise ValueError(f"{what}: the saved state must have shape {shape}, "
                         f"got {None if value is None else tuple(getattr(value, 'shape', ()))}")
    return value


def _dense_state_shape(spec) -> tuple[int, ...]:
    """A dense tensor's optimizer state as ``torch.optim.Adagrad`` keeps it: the parameter's shape (one value per
    weight; several: a leading axis)."""
    shape = tuple(spec.shape)
    return shape if spec.state_width == 1 else (spec.state_width, *shape)
