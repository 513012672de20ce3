"""The optimizer's pass over a push's rows (``optim_kernel.update_rows``, Adagrad, 64 dimensions: 512-byte rows) at
random slots, old code against new, side by side.

Run from the repository root with the old commit checked out in a worktree (``git worktree add OLD <commit>``):

    python3 docs/results/apply-prefetch/optim_bench.py OLD > docs/results/apply-prefetch/optim-bench.json

Each round runs the pass in a fresh process of each code, alternately: 60 pushes of ``n`` rows at random slots of a
table of ``N`` rows, the caches evicted before each (as a server's other work does), without and with the delta
parity needs, the median ns per row.
"""

import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time, statistics, numpy as np
sys.path.insert(0, sys.argv[1])
from ecrec.tables import optim_kernel
N, n, dim = int(sys.argv[2]), int(sys.argv[3]), 64
table = np.ones((N, 2 * dim), np.float32)
rng = np.random.default_rng(0)
junk = np.ones(64 << 20, np.uint8)
grads = rng.standard_normal((n, dim)).astype(np.float32) * np.float32(0.01)
optim_kernel.update_rows(table, np.arange(4), grads[:4], "adagrad", dim, 0.01, 1e-8, False, True)
out = {}
for delta in (False, True):
    times = []
    for _ in range(60):
        slots = rng.choice(N, n, replace=False).astype(np.int64)
        junk += 1
        t = time.perf_counter()
        optim_kernel.update_rows(table, slots, grads, "adagrad", dim, 0.01, 1e-8, False, delta)
        times.append(time.perf_counter() - t)
    out["delta" if delta else "plain"] = statistics.median(times) / n * 1e9
print(json.dumps(out))
"""


def main() -> None:
    old, new = sys.argv[1], os.getcwd()
    out = {"load_average_before": os.getloadavg(), "rounds": []}
    for N, n in ((1_000_000, 512), (20_000, 300)):
        for round_ in range(3):
            row = {"table_rows": N, "rows": n, "round": round_ + 1}
            for name, root in (("old", old), ("new", new)):
                run = subprocess.run([sys.executable, "-c", CHILD, root, str(N), str(n)], capture_output=True,
                                     text=True, check=True, cwd=root)
                for kind, ns in json.loads(run.stdout).items():
                    row[f"{name}_{kind}_ns_per_row"] = ns
            out["rounds"].append(row)
    out["load_average_after"] = os.getloadavg()
    keys = [k for k in out["rounds"][0] if k.endswith("_ns_per_row")]
    out["medians"] = [{"table_rows": N, **{k: statistics.median(r[k] for r in out["rounds"] if r["table_rows"] == N)
                                           for k in keys}}
                      for N in sorted({r["table_rows"] for r in out["rounds"]})]
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
