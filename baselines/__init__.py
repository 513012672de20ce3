"""CPR-style checkpointing baselines for ECRec, run on the same embedding servers.

- ``baselines.cpr``: the strategies ``full``, ``cpr``, ``cpr-mfu``, ``cpr-ssu`` (registered as
  ``ecrec.strategies`` entry points in ``pyproject.toml``);
- ``baselines.driver``: the worker-side :class:`~baselines.driver.CheckpointDriver` (consistent
  cuts, rollback, interval choice, exact lost-update counting);
- ``baselines.storage``: checkpoint files (atomic writes, manifest with sha256, verified loads);
- ``baselines.overhead``: the overhead model (Young/Daly, O_full, O_partial, PLS -> interval).
"""
