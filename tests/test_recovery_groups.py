"""After a rebuild, the survivors' parity groups return to their size at once (real processes).

A rebuild reads data rows at group boundaries.  It used to make every group one push while a server recovered and
for 5 s after each of its reads (``ParityOwner.seal_for_read``, now a verification's only); it now reads each row
as it was after its owner's last closed group and groups keep coalescing.  One-push groups cost every destination a
batch per push, training slower for as long as they last.  Here a worker trains through a kill and on after the
replacement is redundant: within a few steps of the all-clear, the survivors' groups close by count.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ecrec.client import Cluster
from helpers import BATCH, TABLES, Model, wait_redundant

pytestmark = pytest.mark.cluster


def test_after_a_rebuild_the_survivors_groups_return_to_their_size_at_once(make_cluster):
    local = make_cluster(servers=4, standby=1, strategy="ecrec", k=2, m=1,
                         options={"coalesce_pushes": "4", "coalesce_s": "30"})  # groups close at 4 pushes, not by age
    torch.set_num_threads(1)
    cluster = Cluster.connect(local.coordinator_address)
    rng = np.random.default_rng(5)
    survivors = [0, 2, 3]

    def groups_and_pushes(steps: int) -> dict[int, tuple[float, float]]:
        """Trains ``steps`` steps; per survivor, the groups it closed meanwhile and the pushes they held."""
        before = cluster.strategy_call("stats", indices=survivors)
        for _ in range(steps):
            sparse = {name: torch.from_numpy(rng.integers(0, rows, (BATCH, 2))) for name, rows, _, _ in TABLES}
            loss_fn(model(sparse), torch.from_numpy((rng.random(BATCH) < 0.4).astype(np.float32))).backward()
            cluster.step()
        after = cluster.strategy_call("stats", indices=survivors)
        return {i: (after[i].get("groups_closed", 0) - before[i].get("groups_closed", 0),
                    after[i].get("group_pushes", 0) - before[i].get("group_pushes", 0)) for i in survivors}

    try:
        for name, rows, dim, opt in TABLES:
            cluster.create_table(name, rows, dim, optimizer=opt, lr=0.05, eps=1e-8, initial_accumulator_value=0.1,
                                 seed=11)
        model = Model(cluster)
        cluster.register_dense(model.top, optimizer="sgd", lr=0.05)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        groups_and_pushes(12)
        for i, (closed, pushes) in groups_and_pushes(12).items():  # before any failure: groups of 4 pushes
            assert pushes >= 8 and closed <= pushes / 2, (i, closed, pushes)
        local.kill(local.pid_of_index(1))
        groups_and_pushes(10)  # through the failure (groups closed by count, or by the timer while index 1 recovers)
        wait_redundant(cluster, 1)
        groups_and_pushes(3)  # the all-clear reaches every survivor with these pushes (a newer epoch: a map refresh)
        for i, (closed, pushes) in groups_and_pushes(24).items():
            # groups of 4 pushes: about 6 closed; one-push groups (as in a 5 s window after a read): 24
            assert pushes >= 16 and closed <= pushes / 2, (i, closed, pushes)
    finally:
        cluster.close(confirm_timeout_s=0)  # open groups close by age only after 30 s here: no wait for them
