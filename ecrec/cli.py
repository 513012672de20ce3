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
import signal
import sys
import threading

from ecrec.config import ClusterSpec, CoordinatorConfig, ServerConfig


def _parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"ecrec-server: --option takes KEY=VALUE, got {pair!r}")
        options[key] = value
    return options


def _add_strategy_args(p: argparse.ArgumentParser) -> None:
    from ecrec.strategies import available

    names = ", ".join(available()) or "none"
    p.add_argument("--strategy", default="none", help=f"fault-tolerance strategy (installed: {names}); default none")
    p.add_argument("--k", type=int, default=0, help="data rows per stripe (erasure-coding strategies)")
    p.add_argument("--m", type=int, default=0, help="parity rows per stripe = failures survived (erasure-coding strategies)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a strategy option (repeatable), e.g. --option interval_s=30")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ecrec-server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING...); default INFO")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("coordinator", help="hold the cluster map and watch the servers")
    c.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    c.add_argument("--port", type=int, default=7000, help="port (0: any free port); default 7000")
    c.add_argument("--servers", type=int, required=True, help="number of active embedding servers in the cluster")
    _add_strategy_args(c)
    c.add_argument("--health-interval", type=float, default=0.5, help="seconds between health checks (default 0.5)")
    c.add_argument("--state-path", default=None, help="file where the map is persisted across coordinator restarts")

    s = sub.add_parser("serve", help="run one embedding server")
    s.add_argument("--coordinator", required=True, help="coordinator address host:port")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=0, help="port (default 0: any free port)")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where parity kernels run (default cpu)")
    s.add_argument("--standby", action="store_true", help="register as a spare that replaces a failed server")
    s.add_argument("--index", type=int, default=-1, help="take this index (a restarted server replacing itself)")

    lo = sub.add_parser("local", help="start a coordinator and N servers on this machine; Ctrl-C stops them all")
    lo.add_argument("--servers", type=int, default=4, help="active servers (default 4)")
    lo.add_argument("--standby", type=int, default=0, help="spare servers (default 0)")
    lo.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    lo.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where parity kernels run (default cpu)")
    lo.add_argument("--state-path", default=None, help="file where the coordinator persists the map")
    _add_strategy_args(lo)
    return parser


def _wait_for_signal(stop) -> None:
    done = threading.Event()

    def handler(signum, frame):
        done.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    done.wait()
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
            spec = ClusterSpec(num_servers=args.servers, strategy=args.strategy, k=args.k, m=args.m,
                               strategy_options=_parse_options(args.option))
            coordinator = Coordinator(CoordinatorConfig(cluster=spec, host=args.host, port=args.port,
                                                        health_interval_s=args.health_interval, state_path=args.state_path))
            running = coordinator.start()
        except (ValueError, OSError, TypeError) as exc:
            print(f"ecrec-server coordinator: {exc}", file=sys.stderr)
            return 2
        print(f"ECREC_COORDINATOR {running.address}", flush=True)
        _wait_for_signal(running.stop)
        return 0

    if args.command == "serve":
        from ecrec.server import EmbeddingServer

        config = ServerConfig(coordinator=args.coordinator, host=args.host, port=args.port, device=args.device,
                              standby=args.standby, want_index=args.index)
        try:
            server = EmbeddingServer(config)
            server.start()
        except (OSError, RuntimeError, ValueError) as exc:
            print(f"ecrec-server serve: {exc}", file=sys.stderr)
            return 2
        _wait_for_signal(server.stop)
        return 0

    # local
    from ecrec.local import LocalCluster, LocalClusterSpec

    cluster = LocalCluster(LocalClusterSpec(
        servers=args.servers, standby=args.standby, strategy=args.strategy, k=args.k, m=args.m,
        options=_parse_options(args.option), host=args.host, device=args.device, state_path=args.state_path,
        log_level=args.log_level,
    ))
    try:
        cluster.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"ecrec-server local: {exc}", file=sys.stderr)
        return 2
    print(f"coordinator at {cluster.coordinator_address} ({args.servers} servers, {args.standby} standby, "
          f"strategy {args.strategy}); Ctrl-C stops them all", flush=True)
    _wait_for_signal(cluster.close)
    return 0


if __name__ == "__main__":
    sys.exit(main())
