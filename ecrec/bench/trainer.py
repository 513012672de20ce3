"""One benchmark worker: trains the DLRM through the SDK and records every step.

Used in-process by ``ecrec-bench compare`` (one worker) and, for ``--workers W > 1``,
launched by torchrun as ``python -m ecrec.bench.trainer CONFIG.json`` (rank and world
size from the TorchElastic environment), each worker reading its own shard of the data.
Checkpointing strategies are driven through ``baselines.driver.CheckpointDriver``, which
may rewind the data position after a failure (full recovery); with several workers through
``baselines.workers.GroupCheckpointDriver`` (the ranks in step, one driver on rank 0, which
also chooses the interval after the warm steps when ``compare`` asks: ``extra["choose_interval"]``).
Records go to a JSON-lines file per rank so the parent can follow progress and trigger the failure.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class TrainConfig:
    address: str
    data_path: str  # .npz with dense, ids, labels, table_sizes (written by compare)
    strategy: str
    steps: int
    batch_size: int = 256
    embedding_dim: int = 16
    bottom_mlp: tuple = (32,)
    top_mlp: tuple = (32, 16)
    optimizer: str = "adagrad"
    lr: float = 0.05
    seed: int = 0
    test_fraction: float = 0.1
    checkpoint_interval_steps: int | None = None
    mtbf_s: float | None = None
    records_dir: str = ""
    snapshot_every: int = 0  # > 0: Cluster.snapshot_every(snapshot_every, snapshot_dir, keep=1) (rank 0)
    snapshot_dir: str = ""
    extra: dict = field(default_factory=dict)
    #: the DLRM: "ecrec" (ecrec.workload.dlrm.DLRM), "torchrec" (TorchRec's), "auto" (TorchRec's when installed)
    model: str = "auto"


def load_dataset(path: str):
    from ecrec.workload.data import InMemoryDataset

    with np.load(path) as f:
        return InMemoryDataset(f["dense"], f["ids"], f["labels"], [int(x) for x in f["table_sizes"]])


class Trainer:
    """One worker's training, advanced in pieces (``advance``) so a benchmark can interleave strategies."""

    def __init__(self, cfg: TrainConfig, rank: int = 0, world: int = 1):
        from ecrec.client import Cluster
        from ecrec.workload.dlrm import DLRMSpec, build_cluster_dlrm, resolve_arch

        torch.set_num_threads(1)
        self.cfg, self.rank = cfg, rank
        dataset = load_dataset(cfg.data_path)
        self.table_sizes = tuple(int(x) for x in dataset.table_sizes)
        train, self.test = dataset.split(cfg.test_fraction, shuffle=True, seed=cfg.seed)
        train = train.shard(rank, world)
        self.batches = list(train.repeat(cfg.batch_size, cfg.steps, shuffle=True, seed=cfg.seed + rank))
        spec = DLRMSpec(num_dense=dataset.num_dense, table_sizes=tuple(dataset.table_sizes),
                        embedding_dim=cfg.embedding_dim, bottom_mlp=tuple(cfg.bottom_mlp), top_mlp=tuple(cfg.top_mlp))
        self.cluster = Cluster.connect(cfg.address, worker=f"rank{rank}")
        self.arch = resolve_arch(cfg.model)
        self.model = build_cluster_dlrm(self.cluster, spec, optimizer=cfg.optimizer, lr=cfg.lr, seed=cfg.seed,
                                        eps=1e-8, initial_accumulator_value=0.1, arch=self.arch,
                                        progress=f"{cfg.strategy} tables" if rank == 0 else None)
        self.driver = None
        from ecrec.strategies import get_spec

        if get_spec(cfg.strategy).checkpoints and world > 1:  # one driver on rank 0, the ranks in step
            from baselines.workers import GroupCheckpointDriver

            self.driver = GroupCheckpointDriver(self.cluster, rank, world, interval_steps=cfg.checkpoint_interval_steps,
                                                mtbf_s=cfg.mtbf_s)
        elif get_spec(cfg.strategy).checkpoints:
            from baselines.driver import CheckpointDriver

            self.driver = CheckpointDriver(self.cluster, interval_steps=cfg.checkpoint_interval_steps,
                                           mtbf_s=cfg.mtbf_s)
        if cfg.snapshot_every and rank == 0:
            self.cluster.snapshot_every(cfg.snapshot_every, cfg.snapshot_dir, keep=1)
        records_path = os.path.join(cfg.records_dir, f"rank{rank}.jsonl") if cfg.records_dir else None
        self._out = open(records_path, "w") if records_path else None
        self.records: list[dict] = []
        self.step = 0
        self.start = time.time()

    def advance(self, until: int, on_step=None) -> int:
        """Trains until the next step to run is ``until`` (a rollback may repeat steps); returns samples done."""
        from ecrec.workload.dlrm import loss_fn

        samples = 0
        while self.step < min(until, self.cfg.steps):
            step = self.step
            if on_step is not None:
                on_step(step)
            t0 = time.time()
            batch = self.batches[step]
            loss = loss_fn(self.model.forward_batch(batch), batch.labels)
            loss.backward()
            result = self.cluster.step()
            resume = self.driver.after_step(step, result) if self.driver is not None else None
            t1 = time.time()
            record = {"step": step, "start": t0, "end": t1, "samples": len(batch), "loss": loss.item(),
                      "rows": result.get("rows", 0), "rows_by_server": result.get("rows_by_server", {}),
                      "rewind_to": resume}
            if result.get("snapshot"):
                record["snapshot_s"] = result["snapshot"]["seconds"]
            self.records.append(record)
            if self._out:
                self._out.write(json.dumps(record) + "\n")
                self._out.flush()
            samples += len(batch)
            self.step = resume if resume is not None else step + 1
        return samples

    def close(self) -> None:
        if self._out:
            self._out.close()
            self._out = None
        if hasattr(self.driver, "close"):  # several workers: leave their process group
            self.driver.close()

    def finish(self) -> dict:
        from ecrec.workload.dlrm import evaluate

        self.close()
        evaluation = evaluate(self.model, self.test.batches(4096)) if self.rank == 0 else {}
        return {"records": self.records, "evaluation": evaluation, "elapsed_s": time.time() - self.start,
                "model": self.arch,
                "driver": self.driver.report() if self.driver is not None else None,
                "client_bytes": self.cluster.stats["push_bytes"] + self.cluster.stats["pull_bytes"],
                "cluster": self.cluster}


def run(cfg: TrainConfig, rank: int = 0, world: int = 1, on_step=None) -> dict:
    """Trains ``cfg.steps`` steps on this rank's shard; returns the records and the evaluation."""
    trainer = Trainer(cfg, rank, world)
    try:
        trainer.advance(cfg.steps, on_step)
    except BaseException:
        trainer.close()
        raise
    return trainer.finish()


def main(argv: list[str] | None = None) -> int:
    """torchrun entry: ``python -m ecrec.bench.trainer CONFIG.json`` (rank/world from the environment)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m ecrec.bench.trainer CONFIG.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        raw = json.load(f)
    cfg = TrainConfig(**raw)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer(cfg, rank, world)
    chosen: dict = {}
    interval_cfg = cfg.extra.get("choose_interval")  # compare: rank 0 chooses the interval after the warm steps

    def on_step(step: int) -> None:
        if interval_cfg and rank == 0 and not chosen and step >= interval_cfg["after_steps"]:
            from ecrec.bench.intervals import choose_interval

            driver = getattr(trainer.driver, "driver", trainer.driver)  # rank 0's CheckpointDriver in the group
            chosen.update(choose_interval(cfg.strategy, interval_cfg["cfg"], trainer.records, driver))

    try:
        trainer.advance(cfg.steps, on_step)
        result = trainer.finish()
    finally:
        trainer.close()
    summary = {k: v for k, v in result.items() if k not in ("records", "cluster")}
    summary["interval"] = chosen or None
    with open(os.path.join(cfg.records_dir, f"rank{rank}.result.json"), "w") as f:
        json.dump(summary, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

