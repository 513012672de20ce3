"""The worker's copy of the dense parameters, for a partial recovery of the checkpointing baselines: CPR keeps the
dense model on its trainers, so a failure of an embedding server loses embedding rows only.  The copy is read
from the servers once and advanced with every acknowledged step's dense gradients by the servers' own optimizer
code, so it equals the servers' payloads bit for bit (``baselines.driver.CheckpointDriver`` keeps it and puts it
back after a failure)."""

from __future__ import annotations

import numpy as np

from ecrec.client import Cluster
from ecrec.tables import optim


class DenseCopy:
    """The worker's copy of every dense tensor's payload (weights then optimizer state, float32).

    Read from the servers once (:meth:`reload`), then advanced with each acknowledged step's dense
    gradients (``Cluster.last_dense_grads``) through ``ecrec.tables.optim.apply``, the code the primary runs,
    on the same float32 layout: the copy stays equal to the primary's payload bit for bit as long as
    every push to the dense tensors passes through :meth:`advance`.
    """

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.payloads: dict[str, np.ndarray] = {}
        self.specs: dict = {}

    def reload(self) -> None:
        """Reads every dense tensor's payload from its primary (at a step boundary)."""
        self.payloads, self.specs = {}, {}
        for d in self.cluster.refresh_map().dense:
            spec = self.cluster.dense_spec(d.name)
            self.specs[d.name] = spec
            self.payloads[d.name] = self.cluster.read_dense_payload(d.name)[None, :].copy()

    def advance(self, grads: dict[str, np.ndarray]) -> None:
        for name, grad in grads.items():
            payload = self.payloads.get(name)
            if payload is None:  # registered after the copy was read: read it now (it holds this step)
                self.reload()
                return
            spec = self.specs[name]
            optim.apply(spec.optimizer, payload, np.asarray(grad, dtype=np.float32).reshape(1, -1), spec.numel,
                        spec.lr, spec.eps)

    def put_back(self, names: list[str]) -> list[str]:
        """Writes the copy of ``names`` to their (new) primaries; returns the names written."""
        written = []
        for name in names:
            if name in self.payloads:
                self.cluster.write_dense(name, self.payloads[name][0])
                written.append(name)
        return written
