"""The parity servers' placement check (``place_rows``) at random slots, old code against new, side by side.

Run from the repository root with the old commit checked out in a worktree (``git worktree add OLD <commit>``):

    python3 docs/results/apply-prefetch/place_bench.py OLD > docs/results/apply-prefetch/place-bench.json

Each round runs the check in a fresh process of each code, alternately: 60 batches of ``n`` rows at random slots of
an arena of ``N`` slots, the caches evicted before each (as a server's other work does), the median ns per row.
"""

import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import sys, time, statistics, numpy as np
sys.path.insert(0, sys.argv[1])
from ecrec.strategies.erasure.parity_store import place_rows
N, n = int(sys.argv[2]), int(sys.argv[3])
stripes = np.arange(N, dtype=np.int64)
rng = np.random.default_rng(0)
junk = np.ones(64 << 20, np.uint8)
one = np.array([1], np.int64)
place_rows(np.zeros(1, np.int64), one, np.zeros(1, np.int64), np.array([N]), np.zeros(1, np.int64), 2, stripes)
times = []
for _ in range(60):
    local, positions = rng.integers(0, N, n), rng.integers(0, 2, n)
    junk += 1
    t = time.perf_counter()
    place_rows(local, np.array([n]), np.zeros(1, np.int64), np.array([N]), positions, 2, stripes)
    times.append(time.perf_counter() - t)
print(statistics.median(times) / n * 1e9)
"""


def main() -> None:
    old, new = sys.argv[1], os.getcwd()
    out = {"load_average_before": os.getloadavg(), "rounds": []}
    for N, n in ((500_000, 8192), (2_000_000, 8192), (20_000, 2000)):
        for round_ in range(3):
            row = {"arena_slots": N, "rows": n, "round": round_ + 1}
            for name, root in (("old", old), ("new", new)):
                run = subprocess.run([sys.executable, "-c", CHILD, root, str(N), str(n)], capture_output=True,
                                     text=True, check=True, cwd=root)
                row[f"{name}_ns_per_row"] = float(run.stdout)
            out["rounds"].append(row)
    out["load_average_after"] = os.getloadavg()
    for N in sorted({r["arena_slots"] for r in out["rounds"]}):
        rows = [r for r in out["rounds"] if r["arena_slots"] == N]
        out.setdefault("medians", []).append({
            "arena_slots": N, **{f"{v}_ns_per_row": statistics.median(r[f"{v}_ns_per_row"] for r in rows)
                                 for v in ("old", "new")}})
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
