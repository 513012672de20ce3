"""The ``torch.nn`` faces of cluster tables: :class:`EmbeddingBag` (called like ``torch.nn.EmbeddingBag``) and
:class:`EmbeddingBagCollection` (called like TorchRec's, with a ``KeyedJaggedTensor``).  Their rows live on the
servers: forward pulls them, backward records their gradients, ``Cluster.step`` pushes them; ``state_dict`` holds
their tables so a model saves and loads as a plain PyTorch model would."""

from __future__ import annotations

import math

import numpy as np
import torch

from ecrec.client.cluster import Cluster, ClusterError, _whole
from ecrec.client.rows import as_array
from ecrec.tables.spec import TableSpec
from ecrec.tables.values import check_values

class _Placed(torch.nn.Module):
    """A module whose rows live on the servers but whose outputs follow ``.to()``, ``.cuda()``, ``.half()`` and
    ``.double()`` as a ``torch.nn`` module's do: an empty buffer (not in the state dict) keeps the place and the
    floating dtype asked for; the lookups run in float32 on the CPU and their results are moved there (their
    gradients come back to the servers in float32)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("_place", torch.empty(0), persistent=False)
        self.trains = True  # requires_grad_(False) freezes the tables: lookups then record no gradient

    def requires_grad_(self, requires_grad: bool = True) -> "_Placed":
        """As a ``torch.nn`` module's: ``False`` freezes its tables (its lookups' outputs need no gradient and
        ``step`` pushes none for them; a frozen ``torch.nn.EmbeddingBag``'s weight gets no gradient either)."""
        self.trains = bool(requires_grad)
        return super().requires_grad_(requires_grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As a ``torch.nn`` module's, called on this module (a parent's ``model.zero_grad()`` walks parameters
        only, and this module has none: ``cluster.zero_grad()`` drops every table's): drops the gradients recorded
        for its tables and not pushed yet (a lookup whose backward has not run yet stays recorded).  Dropped, not
        zeroed, whatever ``set_to_none``."""
        super().zero_grad(set_to_none)
        self.cluster.zero_grad(tables=self._tables())

    def _tables(self) -> list[str]:
        return [self.name] if isinstance(getattr(self, "name", None), str) else list(getattr(self, "names", ()))

    @property
    def device(self) -> torch.device:
        return self._place.device

    def _placed(self, out: torch.Tensor) -> torch.Tensor:
        place = self._place
        if out.device != place.device or out.dtype != place.dtype:
            return out.to(device=place.device, dtype=place.dtype)
        return out

    # --- the state dict's keys as DCP's get_model_state_dict walks them ------------------------------------
    def _fqn_modifiers(self) -> dict[str, str]:
        """``torch.distributed.checkpoint.state_dict`` resolves each state-dict key as a path of attributes
        (``ebc.embedding_bags.t.weight``); a cluster table is no attribute (its rows are on the servers, and a
        ``weight`` attribute would be a copy that writes went to silently).  DCP's hook for keys that are not
        attributes sends its walk through :attr:`_state_dict_names` instead: the keys' names, nothing else."""
        return {key.split(".", 1)[0]: "_state_dict_names" for key in self.state_dict_keys("")}

    @property
    def _state_dict_names(self):
        """The module's state-dict keys as nested namespaces (``.weight``, ``.embedding_bags.<table>.weight``)."""
        from types import SimpleNamespace

        # DCP reads it once per key: built once per set of tables (what the keys are made of), not per read
        signature = (getattr(self, "name", None), tuple(getattr(self, "names", ())))
        cached = self.__dict__.get("_names_of_keys")
        if cached is not None and cached[0] == signature:
            return cached[1]
        root = SimpleNamespace()
        for key in self.state_dict_keys(""):
            node = root
            for part in key.split("."):
                if not hasattr(node, part):
                    setattr(node, part, SimpleNamespace())
                node = getattr(node, part)
        self.__dict__["_names_of_keys"] = (signature, root)
        return root


class EmbeddingBag(_Placed):
    """``torch.nn.EmbeddingBag`` whose table lives on an ECRec cluster.

    Call it like ``torch.nn.EmbeddingBag`` (``indices`` 1-D with ``offsets``, or
    2-D fixed-length bags); its ``mode`` is ``"sum"`` by default, as TorchRec's
    pooling (``torch.nn.EmbeddingBag``'s is ``"mean"``). The rows it touches are pulled from their servers;
    backward records their gradients, which ``cluster.step()`` pushes.
    """

    def __init__(self, cluster: Cluster, name: str, mode: str = "sum"):
        super().__init__()
        _check_cluster(cluster, "EmbeddingBag")
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
        self.cluster = cluster
        self.name = name
        self.mode = mode
        self.spec = cluster.table_spec(name)

    @property
    def embedding_dim(self) -> int:
        return self.spec.dim

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return self._placed(_lookup(self.cluster, [self.name], [(input, offsets)], self.mode, per_sample_weights,
                                    self.trains)[0])

    def extra_repr(self) -> str:
        return f"{self.name!r}, {self.spec.num_rows}, {self.spec.dim}, mode={self.mode!r}"

    # --- state_dict: the table's weights, as torch.nn.EmbeddingBag keeps them ----------------------------
    def state_dict_keys(self, prefix: str = "") -> dict[str, str]:
        """The table's state-dict key (``weight``, as in ``torch.nn.EmbeddingBag``) -> the table."""
        return {prefix + "weight": self.name}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = torch.from_numpy(self.cluster.read_table(self.name))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        _load_tables(self, self.cluster, self.state_dict_keys(prefix), state_dict, prefix, local_metadata, strict,
                     missing_keys, unexpected_keys, error_msgs)


class EmbeddingBagCollection(_Placed):
    """Several cluster tables looked up together: one pull per server for all of them per call.

    Two shapes of input:

    - ``EmbeddingBagCollection(cluster, names, mode)`` over existing tables; ``forward([(indices, offsets),
      ...])`` returns one bag tensor per table, in order, exactly as the tables' :class:`EmbeddingBag`
      modules would, with a single fan-out instead of one per table.
    - TorchRec's: :meth:`from_configs` takes ``torchrec.EmbeddingBagConfig`` s (one cluster table per config,
      created here), and ``forward(KeyedJaggedTensor)`` returns a ``KeyedTensor``, as
      ``torchrec.EmbeddingBagCollection`` does, so it can stand where TorchRec's collection stood (in
      ``torchrec.models.dlrm.DLRM`` for one).  :meth:`lookup_jagged` is the same lookup on plain
      ``(keys, values, lengths)`` tensors, without TorchRec.
    """

    def __init__(self, cluster: Cluster, names: list[str], mode: str | list[str] = "sum"):
        super().__init__()
        _check_cluster(cluster, "EmbeddingBagCollection")
        if isinstance(names, (str, bytes)):  # list("ab") is two tables, 'a' and 'b'
            raise TypeError(f"EmbeddingBagCollection: names must be a list of table names, not one string ({names!r})")
        modes = [mode] * len(names) if isinstance(mode, str) else list(mode)
        if len(modes) != len(names):
            raise ValueError(f"got {len(modes)} modes for {len(names)} tables")
        for m in modes:
            if m not in ("sum", "mean"):
                raise ValueError(f"mode must be 'sum' or 'mean', got {m!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be distinct, got {names}")
        self.cluster = cluster
        self.names = list(names)
        self.mode = mode
        self.modes = modes
        self.specs = [cluster.table_spec(n) for n in self.names]
        #: (feature name, table position) in output order; by default one feature per table, named like it
        self.features: list[tuple[str, int]] = [(n, i) for i, n in enumerate(self.names)]
        self._configs: list | None = None

    @classmethod
    def from_configs(cls, cluster: Cluster, tables, *, optimizer: str = "sgd", lr: float = 0.01, eps: float = 1e-10,
                     initial_accumulator_value: float = 0.0, seed: int = 0,
                     on_table=None) -> "EmbeddingBagCollection":
        """A collection shaped like ``torchrec.EmbeddingBagCollection(tables=tables)``: one cluster table per
        ``torchrec.EmbeddingBagConfig`` (``name``, ``num_embeddings``, ``embedding_dim``, ``pooling`` SUM or
        MEAN, ``feature_names``; created, or reused when it exists with the same spec), trained on the servers
        with ``optimizer``/``lr``.  Initial values are uniform in ``[weight_init_min, weight_init_max]`` (default
        ``±sqrt(1/num_embeddings)``, TorchRec's default range), drawn from ``seed``.  ``on_table(created,
        total)`` is called after each table is created (a progress bar).
        """
        tables = list(tables)
        if not tables:
            raise ValueError("need at least one EmbeddingBagConfig")
        seen_features: dict[str, str] = {}
        modes, scales, sizes = [], [], []
        for config in tables:
            name = getattr(config, "name", None)
            if not name or not isinstance(name, str):
                raise ValueError(f"an EmbeddingBagConfig needs a name, got {config!r}")
            # sizes as create_table takes them: 1000.5 passed int() here, and was refused there, after the tables
            # before it were made
            sizes.append(tuple(_whole(getattr(config, size, None), name, size, "from_configs: table")
                               for size in ("num_embeddings", "embedding_dim")))
            pooling = getattr(getattr(config, "pooling", None), "name", str(getattr(config, "pooling", "SUM")))
            if pooling not in ("SUM", "MEAN"):
                raise ValueError(f"table {name!r}: pooling {pooling} is not supported (SUM or MEAN)")
            modes.append(pooling.lower())
            data_type = getattr(getattr(config, "data_type", None), "name", "FP32")
            if data_type != "FP32":
                raise ValueError(f"table {name!r}: data_type {data_type} is not supported (FP32 only)")
            features = list(getattr(config, "feature_names", []) or [])
            if not features:
                raise ValueError(f"table {name!r}: feature_names is empty")
            for feature in features:
                if feature in seen_features:
                    raise ValueError(f"feature {feature!r} is in tables {seen_features[feature]!r} and {name!r}")
                seen_features[feature] = name
            for option, default in (("need_pos", False), ("num_embeddings_post_pruning", None)):
                if getattr(config, option, default) != default:  # was taken and ignored, silently
                    raise ValueError(f"table {name!r}: {option} is not supported")
            if not _default_init_fn(config):
                raise ValueError(f"table {name!r}: init_fn is not supported (it was ignored): the rows are drawn on "
                                 "the servers, uniform in [weight_init_min, weight_init_max] from seed; to start from "
                                 "given rows, Cluster.create_table(name, ..., init=tensor)")
            low, high = getattr(config, "weight_init_min", None), getattr(config, "weight_init_max", None)
            if low is None and high is None:
                scale = 0.0  # the cluster default: 1/sqrt(num_rows), TorchRec's default range
            elif low is not None and high is not None and high > 0 and abs(low + high) <= 1e-12 * high:
                scale = float(high)
            else:
                raise ValueError(f"table {name!r}: weight_init_min/max must be unset or symmetric (-a, a), "
                                 f"got ({low}, {high})")
            scales.append(scale)
        specs = []
        for config, scale, (rows, dim) in zip(tables, scales, sizes):  # shapes and optimizer too, and against
            try:                                                         # tables that exist
                specs.append(TableSpec(name=config.name, num_rows=rows, dim=dim, optimizer=optimizer, lr=float(lr),
                                       eps=float(eps), initial_accumulator_value=float(initial_accumulator_value),
                                       init="uniform", init_scale=float(scale), seed=int(seed)).validate())
            except (TypeError, ValueError) as exc:
                raise ValueError(f"table {config.name!r}: {exc}") from None
        existing = {t.name: TableSpec.from_proto(t) for t in cluster.refresh_map().tables}
        for spec in specs:
            if spec.name in existing and existing[spec.name] != spec:
                raise ValueError(f"table {spec.name!r} exists with another spec ({existing[spec.name]}); nothing "
                                 "was created")
        for n, (spec, scale) in enumerate(zip(specs, scales)):  # every config checked before anything is created
            cluster.create_table(spec.name, spec.num_rows, spec.dim, optimizer=optimizer, lr=lr,
                                 eps=eps, initial_accumulator_value=initial_accumulator_value, init="uniform",
                                 init_scale=scale, seed=seed)
            if on_table is not None:
                on_table(n + 1, len(tables))
        collection = cls(cluster, [c.name for c in tables], modes)
        collection._configs = tables
        collection.features = [(f, i) for i, c in enumerate(tables) for f in c.feature_names]
        return collection

    # --- what TorchRec's models ask of a collection -------------------------------------------------------
    def embedding_bag_configs(self) -> list:
        """The ``torchrec.EmbeddingBagConfig`` s this collection was built from (:meth:`from_configs`)."""
        if self._configs is None:
            raise AttributeError("embedding_bag_configs(): this collection was built from table names; "
                                 "use EmbeddingBagCollection.from_configs for TorchRec's shape")
        return list(self._configs)

    def is_weighted(self) -> bool:
        return False

    # --- lookups ------------------------------------------------------------------------------------------
    def forward(self, inputs):
        """``[(indices, offsets), ...]`` (one per table) -> list of bag tensors; or a ``KeyedJaggedTensor`` ->
        ``KeyedTensor`` (one ``(B, dim)`` block per feature, in this collection's feature order)."""
        if _is_keyed_jagged(inputs):
            if inputs.weights_or_none() is not None:
                raise ValueError("weighted features (per-sample weights) are not supported")
            variable = getattr(inputs, "variable_stride_per_key", None)
            inverse = getattr(inputs, "inverse_indices_or_none", None)
            if (callable(variable) and variable()) or (callable(inverse) and inverse() is not None):
                # read as one batch size for all, its bags went to other features' samples, silently
                raise ValueError("a KeyedJaggedTensor with a batch size per feature (stride_per_key_per_rank) or "
                                 "inverse_indices is not supported: give every feature the same batch")
            from torchrec.sparse.jagged_tensor import KeyedTensor

            ours = {feature for feature, _ in self.features}
            keys = list(inputs.keys())
            if any(k not in ours for k in keys):  # as TorchRec: one KJT may feed several collections
                split = inputs.to_dict()
                keys = [k for k in keys if k in ours]
                values = torch.cat([split[k].values() for k in keys]) if keys else inputs.values()[:0]
                lengths = torch.cat([split[k].lengths() for k in keys]) if keys else inputs.lengths()[:0]
            else:
                values, lengths = inputs.values(), inputs.lengths()
            pooled = self.lookup_jagged(keys, values, lengths)
            keys = [feature for feature, _ in self.features]
            return KeyedTensor(keys=keys, length_per_key=[self.specs[t].dim for _, t in self.features],
                               values=torch.cat([pooled[k] for k in keys], dim=1))
        if len(inputs) != len(self.names):
            raise ValueError(f"got {len(inputs)} inputs for {len(self.names)} tables")
        for name, given in zip(self.names, inputs):
            if not isinstance(given, (tuple, list)) or len(given) != 2:
                size = f" of {len(given)}" if isinstance(given, (tuple, list)) else ""
                raise TypeError(f"the input of table {name!r} must be a pair (indices, offsets), got "
                                f"{type(given).__name__}{size}")
        return [self._placed(out) for out in _lookup(self.cluster, self.names, inputs, self.modes, record=self.trains)]

    @torch.compiler.disable  # its checks read the lengths (a graph break each): one break for all, quietly
    def lookup_jagged(self, keys, values, lengths) -> dict[str, torch.Tensor]:
        """TorchRec's jagged layout without TorchRec: ``values`` holds, feature after feature (in ``keys``
        order), the ids of ``B`` bags, bag ``b`` of feature ``f`` having ``lengths[f * B + b]`` ids.  Returns
        ``{feature: (B, dim)}`` pooled bags, every table in one pull per server."""
        if isinstance(keys, (str, bytes)):  # list("f1") is two features, 'f' and '1'
            raise TypeError(f"keys must be a list of feature names, not one string ({keys!r})")
        keys = list(keys)
        values = torch.as_tensor(values).reshape(-1)
        lengths = torch.as_tensor(lengths).reshape(-1)
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise TypeError(f"lengths must be integers, got {lengths.dtype}")  # 1.7 ids is no count of ids
        lengths = lengths.to(torch.int64)
        table_of = {feature: t for feature, t in self.features}
        unknown = [k for k in keys if k not in table_of]
        if unknown:
            raise ValueError(f"unknown features {unknown}; this collection has {list(table_of)}")
        missing = [f for f in table_of if f not in keys]
        if missing:
            raise ValueError(f"features {missing} are missing from the input")
        if len(set(keys)) != len(keys):
            raise ValueError(f"features appear twice in the input: {keys}")
        if lengths.numel() % len(keys):
            raise ValueError(f"{lengths.numel()} lengths do not split into {len(keys)} features of equal batch size")
        if bool((lengths < 0).any()):
            raise ValueError("lengths must be >= 0")
        if int(lengths.sum()) != values.numel():
            raise ValueError(f"lengths add up to {int(lengths.sum())}, but there are {values.numel()} values")
        if values.numel() and (values.is_floating_point() or values.is_complex() or values.dtype == torch.bool):
            raise TypeError(f"ids must be integers, got {values.dtype}")
        batch = lengths.numel() // len(keys)
        per_feature = lengths.view(len(keys), batch)
        ends = torch.cumsum(per_feature.sum(dim=1), 0).tolist()
        starts = [0, *ends[:-1]]
        # the features of one table are looked up together: ids concatenated, bags one after another
        parts: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
        for f, key in enumerate(keys):
            offsets = torch.cumsum(per_feature[f], 0) - per_feature[f]
            parts.setdefault(table_of[key], []).append((key, values[starts[f]:ends[f]], offsets))
        tables = sorted(parts)
        inputs = []
        for t in tables:
            base, all_values, all_offsets = 0, [], []
            for _, feature_values, offsets in parts[t]:
                if feature_values.numel() and not feature_values.is_signed():  # before int64 wraps 2**64 - 1 to -1
                    top = int(feature_values.detach().cpu().numpy().max())
                    if top >= self.specs[t].num_rows:
                        raise IndexError(f"table {self.names[t]!r}: row id {top} out of range "
                                         f"[0, {self.specs[t].num_rows})")
                all_values.append(feature_values)
                all_offsets.append(offsets + base)
                base += feature_values.numel()
            inputs.append((torch.cat(all_values).to(torch.int64), torch.cat(all_offsets)))
        pooled = _lookup(self.cluster, [self.names[t] for t in tables], inputs, [self.modes[t] for t in tables],
                         record=self.trains)
        out = {}
        for t, bags in zip(tables, pooled):
            for n, (key, _, _) in enumerate(parts[t]):
                out[key] = self._placed(bags[n * batch:(n + 1) * batch])
        return out

    def extra_repr(self) -> str:
        return f"{len(self.names)} tables, mode={self.mode!r}"

    # --- state_dict: TorchRec's keys, embedding_bags.<table>.weight ------------------------------------
    def state_dict_keys(self, prefix: str = "") -> dict[str, str]:
        """The state-dict key of each table (``embedding_bags.<table>.weight``, as in
        ``torchrec.EmbeddingBagCollection``) -> the table."""
        return {f"{prefix}embedding_bags.{name}.weight": name for name in self.names}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for key, name in self.state_dict_keys(prefix).items():
            destination[key] = torch.from_numpy(self.cluster.read_table(name))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        _load_tables(self, self.cluster, self.state_dict_keys(prefix), state_dict, prefix, local_metadata, strict,
                     missing_keys, unexpected_keys, error_msgs)


def _load_tables(module: torch.nn.Module, cluster: Cluster, keys: dict[str, str], state_dict, prefix: str,
                 local_metadata, strict: bool, missing_keys, unexpected_keys, error_msgs) -> None:
    """``Module._load_from_state_dict`` for cluster modules: the module's load pre-hooks run first, as
    ``torch.nn.Module``'s do; each of ``keys`` (state-dict key -> table) found in ``state_dict`` is checked (a
    tensor or array of the table's ``(num_rows, dim)``, finite as float32); only when every one of the module's
    tables checked are they written to the tables' weights (:meth:`Cluster.write_rows`, in pushes; the optimizer
    state is kept).  A key missing, a key under ``prefix`` that is not a table's, or a mismatch is reported as
    ``torch.nn.Module`` reports it (``load_state_dict`` raises with every message)."""
    for hook in module._load_state_dict_pre_hooks.values():
        hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    checked, errors = [], []
    for key, table in keys.items():
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            continue
        spec = cluster.table_spec(table)
        shape = (spec.num_rows, spec.dim)
        given = state_dict[key]
        if isinstance(given, torch.Tensor) and given.device.type == "meta":
            errors.append(f'While copying the parameter named "{key}" (cluster table {table!r}): a tensor on the '
                          "meta device holds no data.")
            continue
        value = as_array(given)
        if not isinstance(value, np.ndarray):
            errors.append(f'While copying the parameter named "{key}" (cluster table {table!r}), expected a '
                          f"tensor or array, got {type(state_dict[key]).__name__}.")
            continue
        if tuple(value.shape) != shape:
            errors.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                          f"checkpoint, the shape in current model (cluster table {table!r}) is {shape}.")
            continue
        try:
            check_values(spec, value)
        except ValueError as exc:
            errors.append(f'While copying the parameter named "{key}" (cluster table {table!r}): {exc}')
            continue
        checked.append((key, table, spec, value))
    if errors:  # nothing of this module is written
        error_msgs.extend(errors)
    else:
        for key, table, spec, value in checked:
            try:
                cluster.write_rows(table, np.arange(spec.num_rows), value, checked=True)
            except (ValueError, ClusterError) as exc:
                error_msgs.append(f'While copying the parameter named "{key}" (cluster table {table!r}): {exc}')
    if strict:  # these modules hold nothing else: any other key under their prefix is not theirs
        unexpected_keys.extend(key for key in state_dict if key.startswith(prefix) and key not in keys)


def _default_init_fn(config) -> bool:
    """Whether an ``EmbeddingBagConfig``'s ``init_fn`` is TorchRec's own default (unset, or the uniform in
    ``[weight_init_min, weight_init_max]`` it fills in): what the servers draw."""
    import functools

    fn = getattr(config, "init_fn", None)
    if fn is None:
        return True
    if not (isinstance(fn, functools.partial) and getattr(fn.func, "__name__", "") == "uniform_" and not fn.args
            and set(fn.keywords) == {"a", "b"}):
        return False
    default = math.sqrt(1.0 / int(config.num_embeddings))  # TorchRec's default bound, each side filled alone
    low, high = getattr(config, "weight_init_min", None), getattr(config, "weight_init_max", None)
    low, high = -default if low is None else low, default if high is None else high
    return math.isclose(fn.keywords["a"], low, rel_tol=1e-9) and math.isclose(fn.keywords["b"], high, rel_tol=1e-9)


def _is_keyed_jagged(x) -> bool:
    """A ``torchrec.KeyedJaggedTensor`` (duck-typed: TorchRec is imported only when one is passed)."""
    return all(callable(getattr(x, name, None)) for name in ("keys", "values", "lengths", "weights_or_none"))


def _on_cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) and x.device.type != "cpu" else x


def _check_cluster(cluster, what: str) -> None:
    """A module's tables are reached through a connected ``Cluster``: an address passed where it belongs failed
    later with an AttributeError."""
    if not hasattr(cluster, "table_spec") or isinstance(cluster, (str, bytes)):
        raise TypeError(f"{what}: cluster must be a connected ecrec.client.Cluster (Cluster.connect(address)), got "
                        f"{type(cluster).__name__} {cluster!r}")


@torch.compiler.disable  # torch.compile: the pull runs as Python (a graph break), the model around it compiles
def _lookup(cluster: Cluster, names: list[str], inputs, mode: str | list[str],
            per_sample_weights=None, record: bool = True) -> list[torch.Tensor]:
    """Bags of several tables (``mode``: one for all, or one per table) from one pull per server; with autograd
    on (and ``record``: the module is not frozen), records the rows' gradients."""
    modes = [mode] * len(names) if isinstance(mode, str) else mode
    # ids from a CUDA model: looked up here, on the CPU, where the pulled rows are
    inputs = [(_on_cpu(indices), _on_cpu(offsets)) for indices, offsets in inputs]
    uniques = [torch.unique(indices, return_inverse=True) for indices, _ in inputs]
    rows = cluster.pull_many({name: unique for name, (unique, _) in zip(names, uniques)})
    outputs = []
    for name, (unique, inverse), (_, offsets), table_mode in zip(names, uniques, inputs, modes):
        r = rows[name]
        if record and torch.is_grad_enabled():
            r.requires_grad_(True)
            lookups = (torch.bincount(inverse.reshape(-1), minlength=len(unique)).numpy()
                       if cluster.count_lookups else None)
            cluster._record(name, unique.numpy().astype(np.int64), r, lookups)
        weights = per_sample_weights
        if weights is not None and (weights.dtype != r.dtype or weights.device != r.device):
            weights = weights.to(device=r.device, dtype=r.dtype)  # a half or CUDA model's weights, to the rows
        outputs.append(torch.nn.functional.embedding_bag(inverse, r, offsets, mode=table_mode,
                                                         per_sample_weights=weights))
    return outputs
