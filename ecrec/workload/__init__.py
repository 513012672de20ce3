"""The training workload of ECRec's benchmarks: a DLRM, its data sources and metrics.

- ``ecrec.workload.dlrm``: the DLRM model, runnable with local sparse
  ``torch.nn.EmbeddingBag`` s (the reference) or with tables on an ECRec
  cluster through ``ecrec.client`` (same initial values for the same seed).
- ``ecrec.workload.data``: the data's format and an in-memory data set for
  benchmarks that must not be parse-bound; it gathers the names of
  ``batch`` (what a step consumes), ``criteo`` (the Criteo TSV reader: chunked
  numpy parsing, malformed-line reporting, sharding for torchrun workers; its
  field decoding in ``tsv_fields``) and ``synthetic`` (the Criteo-format
  generator, the default data set).
- ``ecrec.workload.movielens``: MovieLens-100k as click data (rating >= 4),
  fetched from the recbole wheel on PyPI.
- ``ecrec.workload.metrics``: AUC and log loss (numpy).
"""
