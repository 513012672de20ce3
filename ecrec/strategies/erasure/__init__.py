"""Strategy ``ecrec``: erasure-coded embedding rows, replicated dense tensors, recovery without pause.

One concept per module; a pushed gradient walks them in this order (``docs/push-path.md``):

- ``options``: the typed options and the spec's layout check (light: no server-side imports);
- ``strategy``: :class:`ErasureCoding`, the strategy the server calls; it only wires the parts;
- ``owner``: on the owning server, sequences each applied push into groups and keeps their batches in an
  outbox until every destination applied them;
- ``groups``: a group of pushes and what it becomes, one batch of row and dense deltas per destination
  (parity server or dense backup);
- ``sender``: delivers one owner's batches to one destination in sequence order;
- ``service``: the ``ParityService`` gRPC edge (ApplyParity, ResolveSource, ReadRows);
- ``receiver``: on a parity server, validates and applies batches, logs them per source;
- ``parity_store``: a table's parity rows with per-row version vectors (the kernel call);
- ``source_log``: the unconfirmed batches of one source, with what undoes them;
- ``resolution``: after an owner fails, which of its logged pushes stand and which are undone;
- ``rebuild``: a replacement's rows, rebuilt on demand and in the background from stripe members.

This package's ``__init__`` imports nothing, so reading the spec stays light.
"""
