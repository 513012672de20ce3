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


#: flags that are spans of time (attribute -> seconds per unit), at most ``ecrec.config.MAX_SECONDS`` long: 1e308
#: passed every other check and then never ended (``profile --seconds``) or overflowed
DURATIONS = {"seconds": 1.0, "before_s": 1.0, "after_s": 1.0, "max_s": 1.0, "cpr_interval_s": 1.0,
             "reschedule_s": 1.0, "mtbf_hours": 3600.0, "cost_mtbf_hours": 3600.0, "job_mtbf_hours": 3600.0}
#: sub-command -> its durations bounded by their own type instead (a modelled server's MTBF may be decades)
OWN_BOUNDS = {"simulate": ("mtbf_hours", "job_mtbf_hours")}
#: sub-command -> the directories it writes in (attribute, flag), created and written to before anything runs
DIRECTORIES = {"compare": (("work_dir", "--work-dir"),), "recovery": (("work_dir", "--work-dir"),),
               "profile": (("out", "--out"),)}


def given_flags(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The attributes the command line ``argv`` set itself: parsed again with every default suppressed (a flag
    given with its default value counts as given; an abbreviation counts as the flag)."""
    saved = []

    def suppress(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    suppress(sub)
            elif action.dest is not argparse.SUPPRESS:
                saved.append((action, action.default))
                action.default = argparse.SUPPRESS

    suppress(parser)
    try:
        return {name for name in vars(parser.parse_args(argv)) if not name.startswith("_")}
    finally:
        for action, default in saved:
            action.default = default


def ignored_flag(args) -> str | None:
    """A flag the command line gave (``args._given``, set by :func:`main`) where its sub-command would ignore it
    (``ONLY_WITH`` of the sub-command's module: ``(attributes, what they need, whether the arguments have it)``),
    as a sentence, or None: ``profile --dim 128`` without ``--rows`` profiled the quick preset's DLRM and said
    nothing.  Called by a sub-command's own checks, after those of the values."""
    given = getattr(args, "_given", None) or set()
    for names, needs, has in getattr(getattr(args, "_module", None), "ONLY_WITH", ()):
        if not has(args):
            for name in names:
                if name in given:
                    return f"--{name.replace('_', '-')} needs {needs}; without it, it would be ignored"
    return None


def check_arguments(args) -> str | None:
    """What every sub-command refuses before it starts (exit 2), or None: a number that is not finite (NaN
    passed every ``<= 0`` check -- a profile of 0 steps exited 0 -- and inf ran for ever or failed at the end), a
    duration past ``MAX_SECONDS``, a file to write or a directory to write in that cannot be (it failed after the
    whole run, the figures lost)."""
    import math

    from ecrec.bench.checks import directory_problem, file_problem
    from ecrec.config import MAX_SECONDS

    command = getattr(args, "command", None)
    for name, value in sorted(vars(args).items()):
        if name.startswith("_"):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            return f"--{name.replace('_', '-')} must be a finite number, got {value}"
        unit = DURATIONS.get(name)
        if isinstance(value, (int, float)) and unit and name not in OWN_BOUNDS.get(command, ()) \
                and value * unit > MAX_SECONDS:
            what = "seconds" if unit == 1.0 else f"hours ({MAX_SECONDS:g} s)"
            return f"--{name.replace('_', '-')} must be at most {MAX_SECONDS / unit:.6g} {what}, got {value:g}"
    files = [("--json", getattr(args, "json", None)), ("--plot", getattr(args, "plot", None))]
    if command == "results" and not getattr(args, "check", False):  # --check writes nothing
        files.append(("--out", getattr(args, "out", None)))
    for flag, path in files:
        if isinstance(path, str):
            problem = file_problem(flag, path)
            if problem:
                return problem
    for name, flag in DIRECTORIES.get(command, ()):
        path = getattr(args, name, None)
        if isinstance(path, str):
            problem = directory_problem(flag, path)
            if problem:
                return problem
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._given = given_flags(parser, argv)
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
    interrupted = False
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        interrupted = True
        return 130
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        if interrupted and argv is None:  # this process's own command line: status 130, whatever Python makes of
            from ecrec.cli import exit_now  # the Ctrl-C it caught (ecrec.cli.exit_now)

            exit_now(130)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
