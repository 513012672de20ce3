"""One benchmark worker: trains the DLRM through the SDK and records every step.

Used in-process by ``ecrec-bench compare`` (one worker) and, for ``--workers W > 1``,
launched by torchrun as ``python -m ecrec.bench.trainer CONFIG.json`` (rank and world
size from the TorchElastic environment), each worker reading its own shard of the data.
Checkpointing strategies are driven through ``baselines.driver.CheckpointDriver``, which
may rewind the data position after a failure (full recovery).  Records go to a JSON-lines
file per rank so the parent can follow progress and trigger the failure.
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
    extra: dict = field(default_factory=dict)


def load_dataset(path: str):
    from ecrec.workload.data import InMemoryDataset

    with np.load(path) as f:
        return InMemoryDataset(f["dense"], f["ids"], f["labels"], [int(x) for x in f["table_sizes"]])


def run(cfg: TrainConfig, rank: int = 0, world: int = 1, on_step=None) -> dict:
    """Trains ``cfg.steps`` steps on this rank's shard; returns the records and the evaluation."""
    from ecrec.client import Cluster
    from ecrec.workload.dlrm import DLRMSpec, build_cluster_dlrm, evaluate, loss_fn

    torch.set_num_threads(1)
    dataset = load_dataset(cfg.data_path)
    train, test = dataset.split(cfg.test_fraction, shuffle=True, seed=cfg.seed)
    train = train.shard(rank, world)
    batches = list(train.repeat(cfg.batch_size, cfg.steps, shuffle=True, seed=cfg.seed + rank))
    spec = DLRMSpec(num_dense=dataset.num_dense, table_sizes=tuple(dataset.table_sizes), embedding_dim=cfg.embedding_dim,
                    bottom_mlp=tuple(cfg.bottom_mlp), top_mlp=tuple(cfg.top_mlp))
    cluster = Cluster.connect(cfg.address, worker=f"rank{rank}")
    model = build_cluster_dlrm(cluster, spec, optimizer=cfg.optimizer, lr=cfg.lr, seed=cfg.seed, eps=1e-8,
                               initial_accumulator_value=0.1)
    driver = None
    if cfg.strategy in ("full", "cpr", "cpr-mfu", "cpr-ssu"):
        from baselines.driver import CheckpointDriver

        driver = CheckpointDriver(cluster, interval_steps=cfg.checkpoint_interval_steps, mtbf_s=cfg.mtbf_s)
    records_path = os.path.join(cfg.records_dir, f"rank{rank}.jsonl") if cfg.records_dir else None
    out = open(records_path, "w") if records_path else None
    records = []
    rows_by_server: dict[int, int] = {}
    step, start = 0, time.time()
    try:
        while step < cfg.steps:
            if on_step is not None:
                on_step(step)
            t0 = time.time()
            batch = batches[step]
            loss = loss_fn(model.forward_batch(batch), batch.labels)
            loss.backward()
            result = cluster.step()
            resume = driver.after_step(step, result) if driver is not None else None
            t1 = time.time()
            for i, n in result.get("rows_by_server", {}).items():
                rows_by_server[i] = rows_by_server.get(i, 0) + n
            record = {"step": step, "start": t0, "end": t1, "samples": len(batch), "loss": loss.item(),
                      "rows": result.get("rows", 0), "rows_by_server": result.get("rows_by_server", {}),
                      "rewind_to": resume}
            records.append(record)
            if out:
                out.write(json.dumps(record) + "\n")
                out.flush()
            step = resume if resume is not None else step + 1
        evaluation = evaluate(model, test.batches(4096)) if rank == 0 else {}
    finally:
        if out:
            out.close()
    return {"records": records, "evaluation": evaluation, "elapsed_s": time.time() - start,
            "driver": driver.report() if driver is not None else None,
            "client_bytes": cluster.stats["push_bytes"] + cluster.stats["pull_bytes"], "cluster": cluster}


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
    result = run(cfg, rank, world)
    summary = {k: v for k, v in result.items() if k not in ("records", "cluster")}
    with open(os.path.join(cfg.records_dir, f"rank{rank}.result.json"), "w") as f:
        json.dump(summary, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

