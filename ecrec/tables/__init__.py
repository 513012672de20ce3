"""Embedding tables and dense tensors: their specs and row format (:mod:`.spec`: a row's payload is its weights
and optimizer state), the server-side optimizers (:mod:`.optim`), and a server's shard of rows (:mod:`.shards`)."""

from ecrec.tables.spec import INITS, DenseSpec, TableSpec  # noqa: F401  (the specs, by their package's name)
