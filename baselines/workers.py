"""One checkpoint driver for several workers: every worker's pushes counted, consistent cuts across workers.

With one worker :class:`baselines.driver.CheckpointDriver` sees every push of the job.  With several
(launched by torchrun, each with its own :class:`ecrec.client.Cluster`), :class:`GroupCheckpointDriver`
puts the workers in step at every step boundary through ``torch.distributed`` (gloo, CPU) and lets
rank 0's ``CheckpointDriver`` act for all of them:

    group = GroupCheckpointDriver(cluster, rank, world)   # the process group: torchrun's environment
    while step < num_steps:
        train_one_batch(data[step])
        result = cluster.step()
        resume = group.after_step(step, result)          # every rank, every step: two small collectives
        step = resume if resume is not None else step + 1

At each boundary, once every worker's push of the step is acknowledged:

1. every rank contributes (rows its push acknowledged, in all and by server, whether its client saw a server
   replaced) to one ``reduce`` to rank 0: the sums are what the job's pushes acknowledged in that step, so the
   driver's counts stay exact (``CheckpointDriver.add_acked`` semantics: every push of the job passes
   through the one driver, and nothing is pushed while it counts);
2. rank 0 refreshes its map when another rank saw a failure, then runs its driver's ``after_step`` with
   the summed rows: the initial checkpoint, a full save when due, a failure's recovery (partial: the
   lost updates counted; full: the newest complete cut restored on every server);
3. rank 0 ``broadcast``\\ s what happened (the step to resume at after a rollback, whether a failure was
   handled); the other ranks wait for it, so no push is in flight while rank 0 saves: a full save's cut
   is consistent across workers.  After a rollback every rank drops its pending gradients, reloads the
   dense parameters and rewinds its data position to the cut's step (the same step on every rank: the
   ranks move in step); after a partial recovery every rank reloads the dense parameters (with several
   workers the failed server's dense tensors come back from its checkpoint: no worker holds the one
   copy every worker's pushes built).

The price is that the workers move in step (a synchronous job, as CPR's trainers are), and the two
collectives per step, which the compare benchmark charges to the checkpointing strategies' overhead.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from baselines.driver import CheckpointDriver
from ecrec.client import Cluster

NO_RESUME = -1


def init_group(rank: int, world: int) -> None:
    """The gloo process group from torchrun's environment (``MASTER_ADDR``/``MASTER_PORT``), unless one exists;
    gloo's sockets on the loopback interface unless ``GLOO_SOCKET_IFNAME`` says otherwise."""
    if dist.is_initialized():
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)


class GroupCheckpointDriver:
    """``CheckpointDriver``'s interface for one of ``world`` workers (see the module docstring)."""

    def __init__(self, cluster: Cluster, rank: int, world: int, interval_steps: int | None = None,
                 interval_s: float | None = None, mtbf_s: float | None = None, recovery: str | None = None):
        init_group(rank, world)
        self.cluster, self.rank, self.world = cluster, rank, world
        self.driver: CheckpointDriver | None = None
        if rank == 0:
            # keep_dense=False: the workers' dense pushes interleave, so no one copy equals the servers'
            self.driver = CheckpointDriver(cluster, interval_steps=interval_steps, interval_s=interval_s,
                                           mtbf_s=mtbf_s, recovery=recovery, keep_dense=False)
        self._seen = len(cluster.replacements)
        self.rows_acked_here = 0  # row updates this rank's pushes acknowledged
        self.rollbacks: list[int] = []  # the steps this rank resumed at after a rollback
        self.failures_handled = 0

    # --- the training loop's hook -------------------------------------------------------------------------
    def after_step(self, step: int, result: dict | None = None) -> int | None:
        """Call on every rank after batch ``step`` was pushed; returns the step to resume from after a rollback."""
        rows = int(result.get("rows", 0)) if result else 0
        self.rows_acked_here += rows
        seen = len(self.cluster.replacements) > self._seen
        by_server = (result or {}).get("rows_by_server") or {}
        counts = torch.tensor([rows, int(seen)] + [int(by_server.get(str(i), by_server.get(i, 0)))
                                                   for i in range(self.cluster.layout.num_servers)], dtype=torch.int64)
        dist.reduce(counts, dst=0, op=dist.ReduceOp.SUM)
        decision = torch.tensor([NO_RESUME, 0], dtype=torch.int64)
        if self.rank == 0:
            total_rows, failures_seen = int(counts[0]), int(counts[1])
            if failures_seen:  # another rank's client followed a failure this one has not met yet
                self.cluster.refresh_map()
            before = len(self.driver.events)
            every = {"rows": total_rows, "rows_by_server": {str(i): int(n) for i, n in enumerate(counts[2:].tolist())}}
            resume = self.driver.after_step(step, every)
            decision[0] = NO_RESUME if resume is None else int(resume)
            decision[1] = len(self.driver.events) - before
        dist.broadcast(decision, src=0)
        resume, handled = int(decision[0]), int(decision[1])
        if handled:
            self.failures_handled += handled
            if self.rank != 0:
                self.cluster.refresh_map()
                if resume != NO_RESUME:
                    self.cluster.zero_grad()
                self.cluster.pull_dense()
            self._seen = len(self.cluster.replacements)
        if resume == NO_RESUME:
            return None
        self.rollbacks.append(resume)
        return resume

    # --- what the driver on rank 0 knows --------------------------------------------------------------
    def _need_driver(self, what: str) -> CheckpointDriver:
        if self.driver is None:
            raise RuntimeError(f"{what}: only rank 0 holds the checkpoint driver (this is rank {self.rank})")
        return self.driver

    @property
    def events(self) -> list:
        return self.driver.events if self.driver is not None else []

    @property
    def last_save_step(self) -> int | None:
        return self.driver.last_save_step if self.driver is not None else None

    @property
    def interval_steps(self) -> int | None:
        return self.driver.interval_steps if self.driver is not None else None

    @property
    def o_save_s(self) -> float | None:
        return self.driver.o_save_s if self.driver is not None else None

    def set_interval_steps(self, steps: int) -> None:
        """Rank 0 only: from now on a full save every ``steps`` steps (rank 0 alone decides when one is due)."""
        self._need_driver("set_interval_steps").set_interval_steps(steps)

    def report(self) -> dict:
        """Rank 0: the driver's report (every worker's rows counted) and the group's; other ranks: the group's."""
        group = {"world": self.world, "rank": self.rank, "rows_acked_here": self.rows_acked_here,
                 "rollbacks": list(self.rollbacks), "failures_handled": self.failures_handled}
        if self.driver is None:
            return {"group": group}
        return dict(self.driver.report(), group=group)

    def close(self) -> None:
        """Leaves the process group (at the end of training, on every rank)."""
        if dist.is_initialized():
            dist.destroy_process_group()
