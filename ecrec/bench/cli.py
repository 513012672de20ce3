"""``ecrec-bench``: the benchmark command line.

Each sub-command lives in its own module of ``ecrec.bench`` and exposes
``add_arguments(parser)`` and ``run(args) -> int``.  Benchmarks print ratios
measured side by side in one run; absolute numbers on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

# sub-command -> (module, one-line help)
SUBCOMMANDS = {
    "codec": ("ecrec.bench.codec", "erasure-codec throughput: delta update per kernel backend vs pyeclib encode/reconstruct"),
    "compare": ("ecrec.bench.compare", "train one DLRM under one failure with every strategy; report side by side"),
    "recovery": ("ecrec.bench.recovery", "kill one server of a cluster holding large tables: time until training goes "
                                         "on, until fully redundant, bytes restored per second, per strategy"),
    "report": ("ecrec.bench.report", "a compare JSON's table recomputed from the step records it keeps"),
    "profile": ("ecrec.bench.profile", "sample one server and the worker with py-spy while training; top functions"),
    "server": ("ecrec.bench.server", "pull/push rows/s of the servers beside a raw gRPC round trip of the same bytes"),
    "snapshot": ("ecrec.bench.snapshot", "save a snapshot of a cluster (every server at once) and restore it onto "
                                         "a cluster of another shape: MB/s, client memory, bit-exactness"),
    "simulate": ("ecrec.bench.simulate", "expected overhead per strategy at production scale: CPR's model fed with measured costs"),
    "control-plane": ("ecrec.bench.control_plane", "failure-free CPU per step with the map on etcd against a file, "
                                                   "paired rounds side by side"),
    "results": ("ecrec.bench.results_page", "render the page of measured results (docs/results.md) from the result "
                                            "JSONs; --check: exit 1 naming the sections that are stale"),
}

# sub-command -> an example shown at the end of its --help
EXAMPLES = {
    "codec": "ecrec-bench codec --size-mib 16 --k 4 --m 2 --json codec.json",
    "compare": "ecrec-bench compare --preset quick --strategies none,ecrec,cpr --json compare.json --plot compare.png",
    "report": "ecrec-bench report docs/results/compare-quick.json --cost-mtbf-hours 8",
    "profile": "ecrec-bench profile --strategy ecrec --server 1 --seconds 8",
    "recovery": "ecrec-bench recovery --rows 4000000 --strategies ecrec,full --during-training --json rec.json",
    "server": "ecrec-bench server --rows 200000 --json server.json",
    "snapshot": "ecrec-bench snapshot --rows 4000000 --dim 64 --json snapshot-4m-1.json",
    "simulate": "ecrec-bench simulate --servers 8,64,1024 --mtbf-hours 8 --from-compare compare.json",
    "control-plane": "ecrec-bench control-plane --rounds 6 --steps 150 --json control-plane.json",
    "results": "ecrec-bench results --check",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ecrec-bench",
        description="Benchmarks for ECRec. Each sub-command prints a table and can write JSON.",
        epilog="example: ecrec-bench compare --preset quick --json compare.json --plot compare.png",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        example = EXAMPLES.get(name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                           epilog=f"example: {example}" if example else None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def check_arguments(args) -> str | None:
    """What every sub-command refuses before it starts (exit 2), or None: a number that is not finite (NaN
    passed every ``<= 0`` check -- a profile of 0 steps exited 0 -- and inf ran for ever or failed at the end),
    and a file to write whose directory is missing or that is a directory (it failed after the whole run, the
    figures lost)."""
    import math
    import os

    for name, value in sorted(vars(args).items()):
        if name.startswith("_"):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            return f"--{name.replace('_', '-')} must be a finite number, got {value}"
    files = [("--json", getattr(args, "json", None)), ("--plot", getattr(args, "plot", None))]
    if getattr(args, "_module", None) is not None and args._module.__name__.endswith("results_page"):
        files.append(("--out", getattr(args, "out", None)))
    for flag, path in files:
        if not isinstance(path, str) or not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            return f"{flag} {path}: is a directory; name a file to write"
        if not os.path.isdir(folder):
            return f"{flag} {path}: no directory {folder} to write it in (nothing was run)"
        if not os.access(folder, os.W_OK):
            return f"{flag} {path}: the directory {folder} cannot be written (nothing was run)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = check_arguments(args)
    if problem is not None:
        parser.exit(2, f"ecrec-bench {args.command if hasattr(args, 'command') else ''}: error: {problem}\n")
    from ecrec.net.transport import tune_allocator

    tune_allocator()  # the benchmark's client side gets what the servers get
    # SIGTERM (kill, a job scheduler) ends a benchmark run from the command line as Ctrl-C does: its clusters are
    # stopped on the way out, not left running without it (called with arguments -- from a program, a test -- the
    # caller's handling of SIGTERM stands)
    installed = argv is None and _main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if installed else None
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
