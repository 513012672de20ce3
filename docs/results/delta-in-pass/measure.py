"""The delta in the optimizer's pass against the numpy pass it replaced, side by side in one process.

A push's rows of one table through ``TableShard.prepare_gradients`` + ``commit(delta=True)``, as a server's
``Push`` handler runs them: "before" keeps the old bytes in the compiled pass and XORs them with the new ones in
numpy in ``commit`` (how every delta was made until this change; still the path of rows prepared without the pass),
"now" has the compiled pass write the delta itself.  Alternated round by round, thread CPU per row; prints the
medians and writes every round to the JSON named on the command line.

    python docs/results/delta-in-pass/measure.py docs/results/delta-in-pass/delta-in-pass.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from ecrec.coding.layout import Layout
from ecrec.net.transport import tune_allocator
from ecrec.tables.shards import TableShard
from ecrec.tables.spec import TableSpec

#: (rows per table, dim, rows a push updates on one server): the quick preset's shape (8 tables x 20,000, dim 16,
#: ~38 rows of a table per server and push) and the recovery benchmark's 4M x 64 (~512 rows per server and push;
#: a table of 1M rows per server)
SHAPES = [(20_000, 16, 38), (1_000_000, 64, 512)]
ROUNDS, PUSHES = 9, 400


def measure(rows: int, dim: int, n: int) -> dict:
    shard = TableShard(TableSpec("t", rows, dim, optimizer="adagrad", lr=0.05, eps=1e-10, seed=1),
                       Layout(num_servers=4, k=2, m=1), 0)
    rng = np.random.default_rng(0)
    work = []
    for _ in range(PUSHES):
        ids = shard.owned_ids[rng.choice(len(shard.owned_ids), n, replace=False)]
        work.append((shard.slots_for(ids), rng.standard_normal((n, dim)).astype(np.float32) * np.float32(1e-3)))
    out: dict[str, list[float]] = {"before": [], "now": []}
    version = 0
    for _ in range(ROUNDS):
        for name in out:
            t0 = time.thread_time()
            for slots, grads in work:
                version += 1
                prepared = shard.prepare_gradients(slots, grads, keep_old=True, delta=name == "now")
                shard.commit(prepared, version, delta=True)
            out[name].append((time.thread_time() - t0) / PUSHES / n * 1e9)
    return {"rows": rows, "dim": dim, "rows_per_push": n, "ns_per_row": out}


def main() -> None:
    tune_allocator()  # as a server does
    report = {"load_average_before": list(os.getloadavg()), "cpu_count": os.cpu_count(), "rounds": ROUNDS,
              "pushes_per_round": PUSHES, "shapes": [measure(*shape) for shape in SHAPES],
              "load_average_after": None}
    report["load_average_after"] = list(os.getloadavg())
    for s in report["shapes"]:
        b, a = (s["ns_per_row"][k] for k in ("before", "now"))
        print(f"{s['rows']:>9,} x {s['dim']:<3} {s['rows_per_push']:4d} rows a push: before {np.median(b):.0f} ns/row "
              f"[{min(b):.0f}, {max(b):.0f}], now {np.median(a):.0f} [{min(a):.0f}, {max(a):.0f}], "
              f"saved {np.median(b) - np.median(a):.0f} ns/row ({1 - np.median(a) / np.median(b):.0%})")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
