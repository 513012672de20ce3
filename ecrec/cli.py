"""``ecrec-server``: run a coordinator, an embedding server, or a whole local cluster.

    ecrec-server coordinator --port 7000 --servers 4 --strategy ecrec --k 2 --m 1
    ecrec-server serve --coordinator 127.0.0.1:7000 [--standby] [--device cuda]
    ecrec-server local --servers 4 --standby 1 --strategy ecrec --k 2 --m 1

Every process binds 127.0.0.1 unless ``--host`` says otherwise and stops
cleanly on SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from ecrec.config import ClusterSpec, CoordinatorConfig, ServerConfig, add_arguments, from_arguments, parse_key_values


def _add_strategy_args(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    from ecrec.strategies import available

    names = ", ".join(available()) or "none"
    add_arguments(p, ClusterSpec, defaults=defaults,
                  help_overrides={"strategy": f"fault-tolerance strategy (installed: {names}); default none"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ecrec-server", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING...); default INFO")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("coordinator", help="hold the cluster map and watch the servers",
                       description="Hold the cluster map and watch the servers.",
                       epilog="example: ecrec-server coordinator --port 7000 --servers 4 --strategy ecrec --k 2 --m 1")
    _add_strategy_args(c)
    add_arguments(c, CoordinatorConfig)

    s = sub.add_parser("serve", help="run one embedding server", description="Run one embedding server.",
                       epilog="example: ecrec-server serve --coordinator 127.0.0.1:7000 --standby")
    add_arguments(s, ServerConfig)

    lo = sub.add_parser("local", help="start a coordinator and N servers on this machine; Ctrl-C stops them all",
                        description="Start a coordinator and N servers on this machine; Ctrl-C stops them all.",
                        epilog="example: ecrec-server local --servers 4 --standby 1 --strategy ecrec --k 2 --m 1")
    lo.add_argument("--standby", type=int, default=0, help="spare servers (default 0)")
    lo.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    lo.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where parity kernels run (default cpu)")
    lo.add_argument("--state-path", default=None, help="file where the coordinator persists the map")
    _add_strategy_args(lo, defaults={"num_servers": 4})
    return parser


def _wait_for_signal(stop, done: threading.Event | None = None) -> None:
    """Waits for SIGTERM/SIGINT (or ``done``: the process stopped on its own), then stops."""
    done = done or threading.Event()

    def handler(signum, frame):
        done.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    while not done.wait(0.5):
        pass
    stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ecrec.transport import tune_allocator

    tune_allocator()
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    if args.command == "coordinator":
        from ecrec.coordinator import Coordinator

        try:
            spec = from_arguments(ClusterSpec, args)
            coordinator = Coordinator(from_arguments(CoordinatorConfig, args, cluster=spec))
            running = coordinator.start()
        except (ValueError, OSError, TypeError) as exc:
            print(f"ecrec-server coordinator: {exc}", file=sys.stderr)
            return 2
        print(f"ECREC_COORDINATOR {running.address}", flush=True)
        _wait_for_signal(running.stop)
        return 0

    if args.command == "serve":
        from ecrec import faults
        from ecrec.server import EmbeddingServer

        try:
            config = from_arguments(ServerConfig, args, fault_spec=os.environ.get(faults.ENV, ""))
            server = EmbeddingServer(config)
            server.start()
        except (OSError, RuntimeError, ValueError) as exc:
            print(f"ecrec-server serve: {exc}", file=sys.stderr)
            return 2
        _wait_for_signal(server.stop, server.stopped)
        return 0

    # local
    from ecrec.local import LocalCluster, LocalClusterSpec

    try:
        options = parse_key_values(args.strategy_options)
    except ValueError as exc:
        print(f"ecrec-server local: {exc}", file=sys.stderr)
        return 2
    cluster = LocalCluster(LocalClusterSpec(
        servers=args.num_servers, standby=args.standby, strategy=args.strategy, k=args.k, m=args.m,
        options=options, host=args.host, device=args.device, state_path=args.state_path,
        log_level=args.log_level,
    ))
    try:
        cluster.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"ecrec-server local: {exc}", file=sys.stderr)
        return 2
    print(f"coordinator at {cluster.coordinator_address} ({args.num_servers} servers, {args.standby} standby, "
          f"strategy {args.strategy}); Ctrl-C stops them all", flush=True)
    _wait_for_signal(cluster.close)
    return 0


if __name__ == "__main__":
    sys.exit(main())
