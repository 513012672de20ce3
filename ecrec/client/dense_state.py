"""Registered dense parameters in and out of state dicts.

``Cluster.register_dense`` keeps a module's parameters on the servers: every step applies the gradient there and
loads the result back.  A value loaded into such a parameter (``model.load_state_dict``, DCP's
``set_model_state_dict``) is therefore written to the servers as it is loaded (:func:`watch_loads`), else the
next step would apply its gradient to the servers' old value and load that over it.  Their optimizer state
(Adagrad's accumulators) is in :class:`~ecrec.client.model_state.EmbeddingOptimizer` beside the tables'
(:func:`registered`).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

#: the attribute a registered parameter carries: ``(weak reference to its cluster, dense tensor name)``
TAG = "_ecrec_dense"


def tag(param: torch.nn.Parameter, cluster, name: str) -> None:
    setattr(param, TAG, (weakref.ref(cluster), name))


def untag(param: torch.nn.Parameter) -> None:
    if hasattr(param, TAG):
        delattr(param, TAG)


def registered(model: torch.nn.Module) -> dict[str, tuple]:
    """``{state-dict key: (cluster, dense tensor name)}`` of every parameter of ``model`` registered with
    ``register_dense`` on a client still open."""
    out = {}
    for key, param in model.named_parameters():
        entry = getattr(param, TAG, None)
        cluster = entry[0]() if entry is not None else None
        if cluster is not None and not cluster._closed:
            out[key] = (cluster, entry[1])
    return out


def watch_loads(cluster, module: torch.nn.Module, names: list[tuple[str, str]]) -> None:
    """After each ``load_state_dict`` that reaches a registered parameter's own module (that module's, ``module``'s
    or any model's holding it), the parameters whose keys the state dict held are written to the servers (their
    optimizer state kept), all checked before the first is written.  ``names``: ``(parameter name in module,
    dense tensor name)``.  A parameter the state dict did not hold is not written (the servers' value may be
    newer than this worker's copy); a copy of the module (``copy.deepcopy``: an EMA, a serving copy) writes
    nothing."""
    ref = weakref.ref(cluster)
    by_owner: dict[str, list[tuple[str, str]]] = {}
    for pname, name in names:
        owner, _, local = pname.rpartition(".")
        by_owner.setdefault(owner, []).append((local, name))
    for owner_name, owned in by_owner.items():
        owner = module.get_submodule(owner_name) if owner_name else module
        _watch(ref, weakref.ref(owner), owned)


def _watch(cluster_ref, owner_ref, owned: list[tuple[str, str]]) -> None:
    loading: dict[int, list[tuple[str, str]]] = {}  # id(module) -> what the load in progress holds for it

    def before_load(mod, state_dict, prefix, *_) -> None:
        if mod is owner_ref():
            present = [(local, name) for local, name in owned if prefix + local in state_dict]
            for local, name in present:  # refused before torch copies it in: the local copy keeps its value too
                value = state_dict[prefix + local]
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.device.type != "meta" \
                        and not bool(torch.isfinite(value).all()):
                    raise ValueError(f"load_state_dict: parameter {local!r} (dense tensor {name!r} on the cluster) "
                                     "was given NaN or Inf; its module's parameters were neither written to the "
                                     "servers nor loaded (what the load reached before this module was)")
            loading[id(mod)] = present

    def after_load(mod, incompatible_keys) -> None:
        present = loading.pop(id(mod), None)
        client = cluster_ref()
        if mod is not owner_ref() or not present or client is None or client._closed:
            return  # a copy, nothing of its parameters loaded, or a model kept for serving after its client closed
        write_loaded(client, mod, present)

    owner = owner_ref()
    owner._register_load_state_dict_pre_hook(before_load, with_module=True)
    owner.register_load_state_dict_post_hook(after_load)


def write_loaded(cluster, module: torch.nn.Module, names: list[tuple[str, str]]) -> None:
    """Writes the loaded values of ``module``'s parameters ``names`` (``(attribute, dense tensor)``) that differ
    from the servers' there, every one checked first."""
    todo = []
    for local, name in names:
        param = module._parameters.get(local)
        if param is None:
            continue  # removed from the module since: nothing of it is loaded
        if param is not cluster._dense.get(name):  # load_state_dict(assign=True) put a new Parameter there
            tag(param, cluster, name)
            cluster._dense[name] = param
        value = param.detach().to(torch.float32).cpu().numpy().reshape(-1)
        if not np.isfinite(value).all():
            raise ValueError(f"load_state_dict: parameter {local!r} (dense tensor {name!r} on the cluster) was given "
                             "NaN or Inf; nothing was written to the servers")
        payload = cluster.read_dense_payload(name)
        if not np.array_equal(payload[:value.size].view(np.uint32), value.view(np.uint32)):
            payload[:value.size] = value
            todo.append((name, payload))
    for name, payload in todo:
        cluster.write_dense(name, payload)
