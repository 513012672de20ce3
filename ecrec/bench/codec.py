"""Erasure-codec throughput, side by side in one run on the same buffers.

For one code (k, m) and --size-mib of data it measures: the delta update, the parity
server's hot path (a batch of --row-bytes row deltas at random parity slots through
Codec.apply_delta(..., slots=...), per kernel backend: cpu, gpu when usable, and the
numba and numpy baselines; also the one-stripe form, one delta into the m parity rows
of an (m, n) stripe), in GB/s of delta bytes applied; pyeclib bulk encode (Codec.encode
of one (k, n) stripe and encode_stripes of --row-bytes stripes), in GB/s of data bytes;
pyeclib reconstruct of one and of m lost data rows, in GB/s of rebuilt bytes; and the
ratio delta/encode.  Every figure is the best and the median of --repeat runs after a
warm-up run (numba JIT and first-touch page faults stay out of timing).  Before timing,
every kernel's result is checked against the cpu kernel.  Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

import numpy as np

from ecrec.ops import console

DEFAULT_KERNELS = ("cpu", "gpu", "numba", "numpy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mib", type=float, default=64.0, help="data bytes per measured call, MiB (default 64)")
    parser.add_argument("--k", type=int, default=4, help="data rows per stripe (default 4)")
    parser.add_argument("--m", type=int, default=2, help="parity rows per stripe (default 2)")
    parser.add_argument("--backend", default="isa_l_rs_vand", help="pyeclib ec_type (default isa_l_rs_vand)")
    parser.add_argument(
        "--row-bytes", type=int, default=1024, help="bytes per embedding row in the batched forms (default 1024)"
    )
    parser.add_argument(
        "--kernel",
        action="append",
        metavar="NAME",
        help="delta kernel to measure (repeatable; default: cpu, gpu if usable, numba, numpy)",
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per figure (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")


def _progress(text: str) -> None:
    print(f"[codec bench] {text}", file=sys.stderr, flush=True)


def _measure(fn: Callable[[], None], repeat: int, sync: Callable[[], None] | None = None) -> list[float]:
    """Seconds per run of ``fn`` after one warm-up run."""
    fn()
    if sync:
        sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return times


def _figure(op: str, impl: str, nbytes: int, times: list[float], unit: str) -> dict:
    return {
        "op": op,
        "impl": impl,
        "bytes": nbytes,
        "unit": unit,
        "best_gbps": nbytes / min(times) / 1e9,
        "median_gbps": nbytes / statistics.median(times) / 1e9,
        "times_s": times,
    }


def run(args: argparse.Namespace) -> int:
    from ecrec.coding.codec import Codec
    from ecrec.coding.kernels import get_kernel, kernel_class

    k, m, row = args.k, args.m, args.row_bytes
    if args.repeat < 1 or row < 1 or args.size_mib <= 0:
        print("error: --repeat, --row-bytes and --size-mib must be positive", file=sys.stderr)
        return 2
    if k < 1 or m < 1:
        print(f"error: --k and --m must be at least 1 (got k={k}, m={m})", file=sys.stderr)
        return 2
    total = int(args.size_mib * (1 << 20))
    n = max(1, total // k)  # one stripe of k rows of n bytes
    stripes = max(1, total // (k * row))  # stripes of row-sized rows
    rows = max(1, total // row)  # delta rows (and parity slots) in the batched form
    from ecrec.bench.checks import machine_memory

    # the buffers made below (data, stripes, parity, deltas, slots, positions, parity indexes), before any is made
    needed = k * n + stripes * k * row + 2 * rows * row + 3 * 8 * rows
    if needed > machine_memory():
        print(f"error: --size-mib {args.size_mib:g} (--row-bytes {row}, --k {k}) needs {needed / 1e9:,.3g} GB for its "
              f"buffers, more than this machine's {machine_memory() / 1e9:,.1f} GB of memory", file=sys.stderr)
        return 2
    try:
        codec = Codec(k, m, args.backend, kernel="cpu")
    except (TypeError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    names = list(args.kernel or DEFAULT_KERNELS)
    kernels = {}
    for name in names:
        try:
            kernel_class(name)  # unknown names are an error even among the defaults
            kernels[name] = get_kernel(name)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except RuntimeError as exc:  # known but not usable here
            if args.kernel:  # asked for explicitly
                print(f"error: {exc}", file=sys.stderr)
                return 2
            _progress(f"skipped: {exc}")

    load_before = os.getloadavg()  # the JSON keeps it: a figure measured beside other jobs is read as such
    rng = np.random.default_rng(args.seed)
    _progress(f"generating {total / 2**20:.0f} MiB of data, k={k}, m={m}, rows of {row} bytes")
    data = rng.integers(0, 256, (k, n), dtype=np.uint8)
    stripe_data = rng.integers(0, 256, (stripes, k, row), dtype=np.uint8)
    parity0 = rng.integers(0, 256, (rows, row), dtype=np.uint8)
    delta = rng.integers(0, 256, (rows, row), dtype=np.uint8)
    slots = rng.permutation(rows).astype(np.int64)
    positions = rng.integers(0, k, rows)
    pindex = rng.integers(0, m, rows)
    figures: list[dict] = []

    # --- correctness of every kernel against cpu, on a slice ------------------------------------
    probe_rows = min(rows, 4096)
    expect = parity0[:probe_rows].copy()
    dup_slots = rng.integers(0, probe_rows, probe_rows)  # duplicates on purpose
    codec.apply_delta(expect, positions[:probe_rows], delta[:probe_rows], slots=dup_slots,
                      parity_index=pindex[:probe_rows])  # fmt: skip
    for name, kernel in kernels.items():
        c = Codec(k, m, args.backend, kernel=kernel)
        got = _to_device(kernel, parity0[:probe_rows].copy())
        c.apply_delta(got, positions[:probe_rows], _to_device(kernel, delta[:probe_rows]),
                      slots=dup_slots, parity_index=pindex[:probe_rows])  # fmt: skip
        if not np.array_equal(_to_host(got), expect):
            print(f"error: kernel {name!r} disagrees with the cpu kernel", file=sys.stderr)
            return 1

    # --- delta updates ----------------------------------------------------------------------------
    for name, kernel in kernels.items():
        _progress(f"delta update, kernel {name} ({kernel.description})")
        c = Codec(k, m, args.backend, kernel=kernel)
        parity = _to_device(kernel, parity0.copy())
        d = _to_device(kernel, delta)
        sync = _sync_for(kernel)
        reps = args.repeat if name != "numpy" else min(args.repeat, 3)
        times = _measure(lambda: c.apply_delta(parity, positions, d, slots=slots, parity_index=pindex), reps, sync)
        figures.append(_figure("delta_batch", kernel.description, delta.nbytes, times, "delta bytes"))
        # one stripe: every parity row of (m, n) from one data row of n bytes
        stripe_parity = _to_device(kernel, np.zeros((m, n), dtype=np.uint8))
        row_delta = _to_device(kernel, data[0])
        # the stripe's last data position (k = 1 has only position 0)
        times = _measure(lambda: c.apply_delta(stripe_parity, k - 1, row_delta), reps, sync)
        figures.append(_figure("delta_stripe", kernel.description, n, times, f"delta bytes, into {m} parity rows"))
        del parity, d, stripe_parity, row_delta

    # --- pyeclib bulk encode ----------------------------------------------------------------------
    _progress(f"pyeclib encode of one ({k}, {n}) stripe")
    times = _measure(lambda: codec.encode(data), args.repeat)
    figures.append(_figure("encode", f"pyeclib {args.backend}", data.nbytes, times, "data bytes"))
    _progress(f"pyeclib encode_stripes of ({stripes}, {k}, {row})")
    times = _measure(lambda: codec.encode_stripes(stripe_data), args.repeat)
    figures.append(_figure("encode_stripes", f"pyeclib {args.backend}", stripe_data.nbytes, times, "data bytes"))

    # --- pyeclib reconstruct ----------------------------------------------------------------------
    parity = codec.encode(data)
    full = {i: data[i] for i in range(k)} | {k + j: parity[j] for j in range(m)}
    for lost in ([0], list(range(min(m, k)))) if m > 1 else ([0],):
        _progress(f"pyeclib reconstruct of data rows {lost}")
        avail = {i: a for i, a in full.items() if i not in lost}
        out = codec.reconstruct(avail, lost)
        if any(not np.array_equal(out[i], full[i]) for i in lost):
            print("error: reconstruct is not bit-exact", file=sys.stderr)
            return 1
        times = _measure(lambda: codec.reconstruct(avail, lost), args.repeat)
        figures.append(_figure(f"reconstruct_{len(lost)}", f"pyeclib {args.backend}", n * len(lost), times,
                               "rebuilt bytes"))  # fmt: skip

    encode_best = next(f["best_gbps"] for f in figures if f["op"] == "encode")
    ratios = {
        f["impl"]: f["best_gbps"] / encode_best for f in figures if f["op"] == "delta_batch"
    }
    report = {
        "benchmark": "codec",
        "config": {
            "size_mib": args.size_mib, "k": k, "m": m, "backend": args.backend, "row_bytes": row,
            "repeat": args.repeat, "stripe_n": n, "stripes": stripes, "delta_rows": rows,
            "python": platform.python_version(), "machine": platform.machine(), "processor": _cpu_name(),
            "cpu_count": os.cpu_count(), "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()),
        },
        "figures": figures,
        "delta_over_encode": ratios,
    }  # fmt: skip
    print_report(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
        _progress(f"wrote {args.json}")
    return 0


def _to_device(kernel, array: np.ndarray):
    if kernel.device == "gpu":
        return kernel._xp().asarray(array)
    return array


def _to_host(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else array


def _sync_for(kernel):
    if kernel.device != "gpu":
        return None
    cp = kernel._xp()
    return lambda: cp.cuda.Device().synchronize()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def print_report(report: dict) -> None:
    """The table and the ratios, from the report (the JSON ``--json`` writes)."""
    cfg = report["config"]
    print(
        f"codec bench: {cfg['backend']} k={cfg['k']} m={cfg['m']}, {cfg['size_mib']:g} MiB per call, "
        f"rows of {cfg['row_bytes']} B, best/median of {cfg['repeat']} ({cfg['processor']})"
    )
    console.print_table(["operation", "implementation", "best GB/s", "median GB/s", "unit"],
                        [[f["op"], f["impl"], f"{f['best_gbps']:.2f}", f"{f['median_gbps']:.2f}", f["unit"]]
                         for f in report["figures"]], align="llrrl")
    print()
    print("delta update / pyeclib encode (best GB/s over best GB/s):")
    for impl, ratio in report["delta_over_encode"].items():
        print(f"  {impl:<52} {ratio:6.2f}x")
