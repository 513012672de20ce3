"""Embedding tables and dense tensors: their specs and row format (:mod:`.spec`: a row's payload is its weights
and optimizer state), the server-side optimizers (:mod:`.optim`), and a server's shard of rows (:mod:`.shards`)."""

from ecrec import forwarding
from ecrec.tables.spec import INITS, DenseSpec, TableSpec  # noqa: F401  (the specs, by their package's name)


#: where the names of this package's modules are found by their package's name, as earlier releases had them
#: in one module (``from ecrec.tables import warm_up`` keeps working)
__getattr__ = forwarding(__name__, ('ecrec.tables.spec',))
