"""Embedding tables and dense tensors: their specs and row format (:mod:`.spec`: a row's payload is its weights
and optimizer state), the server-side optimizers (:mod:`.optim`), and a server's shard of rows (:mod:`.shards`)."""

from ecrec.tables.spec import INITS, DenseSpec, TableSpec  # noqa: F401  (the specs, by their package's name)


#: where the names of this package's modules are found by their package's name, as earlier releases had them
#: in one module (``from ecrec.tables import warm_up`` keeps working)
_FORWARD = ('ecrec.tables.spec',)


def __getattr__(name: str):
    import importlib

    for module in _FORWARD:
        value = getattr(importlib.import_module(module), name, _MISSING)
        if value is not _MISSING:
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MISSING = object()
