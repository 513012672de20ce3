"""``ecrec-server``: run a coordinator, an embedding server, or a whole local cluster; show a cluster.

examples:
    ecrec-server coordinator --port 7000 --servers 4 --strategy ecrec --k 2 --m 1
    ecrec-server serve --coordinator 127.0.0.1:7000 [--standby] [--device cuda] [--metrics-port 9101]
    ecrec-server local --servers 4 --standby 1 --strategy ecrec --k 2 --m 1
    ecrec-server status --coordinator 127.0.0.1:7000 [--json] [--wait 60]
    ecrec-server snapshot --coordinator 127.0.0.1:7000 /backups/step-120000   # the model, in DCP format
    ecrec-server restore --coordinator 127.0.0.1:7000 /backups/step-120000    # onto a cluster of any shape

Every process binds 127.0.0.1 unless ``--host`` says otherwise and stops
cleanly on SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import math
import os
import shlex
import signal
import sys
import threading
import time

from ecrec.config import (MAX_SECONDS, WILDCARD_HOSTS, ClusterSpec, CoordinatorConfig, SecurityOptions, ServerConfig,
                          add_arguments, from_arguments, parse_key_values, state_path_problem)
from ecrec.ops.logs import FORMATS


def _add_strategy_args(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    from ecrec.strategies import available

    names = ", ".join(available()) or "none"
    add_arguments(p, ClusterSpec, defaults=defaults,
                  help_overrides={"strategy": f"fault-tolerance strategy (installed: {names}); default none"})


def _commands(parser: argparse.ArgumentParser):
    """Adds the options every ``ecrec-server`` command line takes (logging) and returns its required commands."""
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING...); default INFO")
    parser.add_argument("--log-format", default="text", choices=FORMATS,
                        help="log lines as text or as one JSON object per line (default text)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    return sub


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ecrec-server", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    sub = _commands(parser)

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
                        epilog="example: ecrec-server local --servers 4 --standby 1 --strategy ecrec --k 2 --m 1\n"
                               "example: ecrec-server local --servers 4 --standby 1 --strategy ecrec --k 2 --m 1 "
                               "--store etcd --coordinators 2 --etcd-members 3",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    lo.add_argument("--standby", type=int, default=0, help="spare servers (default 0)")
    lo.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    lo.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where parity kernels run (default cpu)")
    lo.add_argument("--state-path", default=None, help="file where the coordinator persists the map")
    lo.add_argument("--store", choices=["file", "etcd"], default="file",
                    help="file (default: --state-path, else memory) or etcd: start a real etcd here (the etcd binary: "
                         "Debian's etcd-server, or $ECREC_ETCD) and keep the map there")
    lo.add_argument("--coordinators", type=int, default=1,
                    help="coordinators on the etcd store (one leads, the others take over; default 1)")
    lo.add_argument("--etcd-members", type=int, default=None, help="etcd members with --store etcd (default 1; 3 "
                                                                "survive the loss of one)")
    lo.add_argument("--token-file", default=None,
                    help="shared secret every process checks on every call (ecrec.net.security); clients pass the same "
                         "file as ClientConfig(token_file=...)")
    lo.add_argument("--metrics-port", type=int, default=None,
                    help="serve Prometheus metrics: the coordinator on this port, server i on port+1+i, "
                         "standbys after them, then further coordinators (--coordinators) (default off)")
    lo.add_argument("--restore", default=None, metavar="PATH",
                    help="restore this snapshot once the servers are up (the coordinator's --restore)")
    _add_strategy_args(lo, defaults={"num_servers": 4})

    st = sub.add_parser("status", help="show a cluster's servers, rows, rebuild progress and events",
                        description="Show a cluster: every server's index, address, state, incarnation, epoch, "
                                    "rows held, rebuild progress, health and last events. Exits 0 when the "
                                    "cluster is fully redundant, 1 when it is not, 2 when the coordinator "
                                    "cannot be reached.",
                        epilog="example: ecrec-server status --coordinator 127.0.0.1:7000 --wait 120 && echo redundant")
    st.add_argument("--coordinator", required=True, help="coordinator address host:port")
    st.add_argument("--json", action="store_true", help="print the status as JSON instead of a table")
    add_arguments(st, SecurityOptions)
    st.add_argument("--timeout", type=float, default=5.0, help="deadline of each call in seconds (default 5)")
    st.add_argument("--wait", type=float, default=0.0,
                    help="poll up to this many seconds until the cluster is fully redundant (default 0: once)")
    # the client commands have a parser of their own (build_client_parser); --help lists them with the others
    listed = getattr(type(sub), "_ChoicesPseudoAction", None)  # how argparse lists a command in --help
    for name, text in (("snapshot", "write a running cluster's model to a directory (DCP format)"),
                       ("restore", "restore a snapshot onto a running cluster of any shape")):
        if listed is not None:
            sub._choices_actions.append(listed(name, (), text))
    return parser


#: commands of ``ecrec-server`` that are clients of a running cluster rather than processes of one: parsed on
#: their own (:func:`build_client_parser`), listed in ``ecrec-server --help``'s examples
CLIENT_COMMANDS = ("snapshot", "restore")


def build_client_parser() -> argparse.ArgumentParser:
    """``ecrec-server snapshot`` and ``ecrec-server restore``."""
    parser = argparse.ArgumentParser(prog="ecrec-server", description="Snapshot a cluster's model, or restore one.")
    sub = _commands(parser)
    for name, text, example in (
            ("snapshot", "write every table's weights and optimizer state (and the dense tensors) to PATH in "
                         "torch.distributed.checkpoint format, with a manifest of checksums; a consistent cut between "
                         "steps, also while workers train",
             "ecrec-server snapshot --coordinator 127.0.0.1:7000 /backups/step-120000"),
            ("restore", "restore a snapshot onto this cluster, whatever its shape (servers, k and m, strategy): "
                        "missing tables are created, every tensor is checked before anything is written",
             "ecrec-server restore --coordinator 127.0.0.1:7000 /backups/step-120000")):
        sp = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".", epilog=f"example: {example}")
        sp.add_argument("--coordinator", required=True, help="coordinator address host:port")
        sp.add_argument("path", help="a directory or an fsspec URL (s3://..., gs://..., file://...)")
        add_arguments(sp, SecurityOptions)
        sp.add_argument("--timeout", type=float, default=600.0, help="deadline of each call in seconds (default 600)")
        sp.add_argument("--wait", type=float, default=60.0,
                        help="seconds to wait for the cluster to be ready, every index served (default 60)")
        if name == "snapshot":
            sp.add_argument("--overwrite", action="store_true",
                            help="write over a snapshot PATH already holds (refused otherwise)")
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> dict:
    """The commands ``parser`` parses itself, by name."""
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _command_of(argv: list[str] | None) -> str | None:
    """The sub-command ``argv`` names (after the global options), or None."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--log-level")
    pre.add_argument("--log-format")
    _, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    return rest[0] if rest and not rest[0].startswith("-") else None


class _Interrupted(BaseException):
    """SIGTERM during ``snapshot``/``restore``: raised in the main thread as Ctrl-C's KeyboardInterrupt is."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, frame) -> None:
    raise _Interrupted(signum)


def _snapshot_command(args) -> int:
    """``ecrec-server snapshot`` / ``restore``: progress on stderr, the manifest's summary on stdout."""
    import grpc

    from ecrec.client import Cluster, ClusterError
    from ecrec.config import ClientConfig
    from ecrec.ops import logs
    from ecrec.snapshot import SnapshotError
    from ecrec.snapshot.cluster import check_path

    def progress(text: str) -> None:
        print(f"  {text}", file=sys.stderr)

    for flag, value in (("--timeout", args.timeout), ("--wait", args.wait)):
        if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
            logs.fatal(f"ecrec-server {args.command}: {flag} must be a positive number of seconds (at most "
                       f"{MAX_SECONDS:g}), got {value}")
            return 2
    try:
        check_path(args.path)  # before the cluster is waited for, and before the handler below is installed
    except SnapshotError as exc:  # (installed first, it stayed on in a program that called main() itself)
        logs.fatal(f"ecrec-server {args.command}: {exc}")
        return 2
    # SIGTERM (an orchestrator's stop, `timeout`) ends the command as Ctrl-C does: through the save's own
    # failure path, which takes back what it wrote once the servers' writes returned (it killed the process and
    # left the files and the in-progress marker)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _interrupt)
    manifest = None
    try:
        options = dataclasses.asdict(from_arguments(SecurityOptions, args))
        cluster = Cluster.connect(args.coordinator, ClientConfig(**options, rpc_timeout_s=args.timeout),
                                  worker=f"{args.command}-cli", wait_ready_s=args.wait, on_wait=progress)
        try:
            if args.command == "snapshot":
                manifest = cluster.save(args.path, on_progress=progress, overwrite=args.overwrite)
            else:
                manifest = cluster.load(args.path, on_progress=progress)
                kept = _not_restored(cluster.map, manifest)  # the newest map this client knows: no call
                stuck = _half_restored(cluster, set(t.name for t in cluster.map.tables) - set(manifest["tables"]))
                if stuck:  # a restore cut short left them refusing every pull and push: not "unchanged"
                    logs.fatal(f"ecrec-server restore: restored {args.path}, but {', '.join(map(repr, stuck))} "
                               "(not in this snapshot) was left half restored by an earlier restore that was cut "
                               "short (or is being restored by another now): it refuses pulls and pushes until the "
                               "snapshot it came from is restored again")
                    return 1
                if kept:  # the snapshot does not hold them: they are as training left them, not as it was saved
                    print(f"ecrec-server restore: not in the snapshot, left unchanged: {kept}", file=sys.stderr)
        finally:
            cluster.close(confirm_timeout_s=30.0)
    except (KeyboardInterrupt, _Interrupted) as exc:
        signum = exc.signum if isinstance(exc, _Interrupted) else signal.SIGINT
        if manifest is None:
            what = ("the snapshot was not taken: what it wrote is taken back" if args.command == "snapshot" else
                    "the restore did not complete: run it again (a table not reached yet may be refused until then)")
            logs.fatal(f"ecrec-server {args.command}: interrupted ({signal.Signals(signum).name}); {what}")
            return 128 + signum
        # done whole before the signal came (the client was closing, or checking the tables it left): the work
        # stands, and the status says so -- a script would take 143 for no snapshot and be refused the path again
        print(f"ecrec-server {args.command}: {signal.Signals(signum).name} after the "
              f"{'snapshot was written' if args.command == 'snapshot' else 'restore was done'}: it stands",
              file=sys.stderr)
    except (SnapshotError, ClusterError, OSError) as exc:  # (before ValueError: a SnapshotError is one)
        logs.fatal(f"ecrec-server {args.command}: {exc}")
        return 1
    except ValueError as exc:  # what was asked cannot be (an address with no port)
        logs.fatal(f"ecrec-server {args.command}: {exc}")
        return 2
    except grpc.RpcError as exc:  # a call with no retry of its own (the map's first read) ran out of time
        logs.fatal(f"ecrec-server {args.command}: the cluster at {args.coordinator}: {exc.code().name}: "
                   f"{exc.details()}")
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    verb = "wrote" if args.command == "snapshot" else "restored"
    print(f"{verb} {len(manifest['tables'])} table(s), {len(manifest['dense'])} dense tensor(s) "
          f"({'to' if verb == 'wrote' else 'from'} {args.path})")
    return 0


def _half_restored(cluster, names: set[str]) -> list[str]:
    """Of tables ``names``, those a server holds in the middle of a restore in bulk (``RestoreTable`` STATUS of
    every table, asked of each server): a restore killed midway leaves them so."""
    import json

    import grpc

    from ecrec.snapshot.bulk import Step
    from ecrec.wire import embedding_pb2

    stuck: set[str] = set()
    if not names:
        return []
    for index in range(cluster.layout.num_servers):
        address = cluster.peers.address_of(index)
        if address is None:
            continue
        try:
            reply = cluster.peers.stub(address).RestoreTable(embedding_pb2.RestoreTableRequest(step=Step.STATUS),
                                                             timeout=30.0, metadata=cluster.peers.metadata())
        except grpc.RpcError as exc:  # the restore itself is done: said, not turned into its failure
            logging.getLogger("ecrec").warning(
                "restored; server %d (%s) could not say whether a table outside the snapshot is left half restored "
                "(%s): `ecrec-server status`, or a pull of it, tells", index, address, exc.code().name)
            continue
        tables = json.loads(reply.parts_json or "{}").get("tables", {})
        stuck |= {name for name, info in tables.items() if name in names and info.get("state") != "serving"}
    return sorted(stuck)


def _not_restored(cluster_map, manifest: dict) -> str:
    """The tables and dense tensors of the cluster a restore of ``manifest`` did not write ("" when none)."""
    tables = sorted({t.name for t in cluster_map.tables} - set(manifest["tables"]))
    dense = sorted({d.name for d in cluster_map.dense} - set(manifest.get("dense", {})))
    parts = [f"{len(names)} {what}{'s' if len(names) > 1 else ''} of this cluster ({', '.join(names)})"
             for names, what in ((tables, "table"), (dense, "dense tensor")) if names]
    return " and ".join(parts)


def _served_map(coordinator):
    """The map this coordinator serves, for its metrics; None when it knows none (etcd cannot be read)."""
    from ecrec.control import leadership
    from ecrec.control.stores import StoreUnavailable

    try:
        return leadership.served_map(coordinator)
    except StoreUnavailable as exc:
        logging.getLogger("ecrec.coordinator").debug("metrics: the cluster map cannot be read: %s", exc)
        return None


def _check_snapshot(path: str) -> None:
    """``--restore PATH`` read before anything starts: a path holding no snapshot is said at once (a
    ``SnapshotError``, a ``ValueError``), not once every server has registered and the cluster looks up."""
    from ecrec.snapshot import SnapshotError
    from ecrec.snapshot.cluster import read_manifest

    try:
        read_manifest(path)
    except SnapshotError as exc:
        raise SnapshotError(f"--restore {path}: {exc}") from None


def _restore_when_ready(coordinator, address: str, path: str, config, done: threading.Event, outcome: dict) -> None:
    """``ecrec-server coordinator --restore PATH``: waits until every index has a server, then restores the
    snapshot as a client of this coordinator; a failure stops the coordinator (exit status 1)."""
    from ecrec.client import Cluster, ClusterError
    from ecrec.config import ClientConfig
    from ecrec.snapshot import SnapshotError

    log = logging.getLogger("ecrec.restore")
    log.info("waiting for %d servers before restoring %s", config.cluster.num_servers, path)
    while not done.is_set() and not coordinator.GetClusterMap(None, None).ready:
        time.sleep(0.2)
    if done.is_set():
        return
    if coordinator.state.restored_from:  # this coordinator leads a cluster restored once: never over its training
        log.info("this cluster was restored from %s already (its state records it): not restoring %s again",
                 coordinator.state.restored_from, path)
        return
    try:
        security = {f.name: getattr(config, f.name) for f in dataclasses.fields(SecurityOptions)}
        # (a coordinator stopped during the restore does not wait at exit for its pushes: the restore is cut short)
        cluster = Cluster.connect(address, ClientConfig(**security, rpc_timeout_s=600.0, confirm_at_exit_s=0),
                                  worker="coordinator-restore")
        try:
            manifest = cluster.load(path, on_progress=lambda text: log.info("restore: %s", text))
        finally:
            cluster.close(confirm_timeout_s=30.0)
    except Exception as exc:  # noqa: BLE001 - whatever stops the restore stops the coordinator, said
        log.error("restoring %s failed: %s; stopping", path, exc if isinstance(exc, (SnapshotError, ClusterError))
                  else f"{type(exc).__name__}: {exc}")
        outcome["exit"] = 1
        done.set()
        return
    try:
        coordinator.mark_restored(path)
    except Exception as exc:  # noqa: BLE001 - the restore is whole; only its record is missing: said, not fatal
        log.warning("restored %s, but the record of it was not kept (%s): a coordinator that leads next restores it "
                    "again", path, exc)
    log.info("restored %d table(s) and %d dense tensor(s) from %s", len(manifest["tables"]), len(manifest["dense"]),
             path)


def _wait_for_signal(stop, done: threading.Event | None = None) -> None:
    """Waits for SIGTERM/SIGINT (or ``done``: the process stopped on its own), then stops."""
    done = done or threading.Event()

    def handler(signum, frame):
        logging.getLogger("ecrec").info("received %s: stopping", signal.Signals(signum).name)
        done.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    while not done.wait(0.5):
        pass
    stop()


def _stop_all(*stops):
    def stop() -> None:
        for s in stops:
            if s is not None:
                s()
    return stop


def main(argv: list[str] | None = None) -> int:
    """``ecrec-server``: a Ctrl-C no command handles itself (during its imports, while ``local`` starts its
    cluster) ends it with status 130 and a line, not a traceback (what it started is stopped on the way out)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("ecrec-server: interrupted", file=sys.stderr)
        if argv is None:  # this process's own command line: its status is 130, whatever Python would make of it
            exit_now(130)
        return 130


def exit_now(code: int) -> None:
    """Ends this process with status ``code`` after its exit handlers, its logs and its streams are done.  After a
    Ctrl-C that was handled, Python itself may still end the process by SIGINT (status -2 instead of 130: seen
    about once in 40 Ctrl-Cs while ``local`` started, the interpreter raising SIGINT against itself 0.1 s after
    the line was printed); leaving through ``os._exit`` keeps the status a caller reads."""
    import atexit

    try:
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _main(argv: list[str] | None) -> int:
    from ecrec.ops import parent

    parent.follow()  # a child of `ecrec-server local`: it ends when local does, even by kill -9
    command = _command_of(argv)
    client_command = command in CLIENT_COMMANDS
    known = (*_subparsers(build_parser()), *CLIENT_COMMANDS)
    if command is not None and command not in known:
        build_parser().print_usage(sys.stderr)
        print(f"ecrec-server: {command!r} is no command: choose from {', '.join(known)}", file=sys.stderr)
        return 2
    args = (build_client_parser() if client_command else build_parser()).parse_args(argv)
    from ecrec.ops import logs
    from ecrec.net.transport import tune_allocator

    try:
        logs.configure(args.log_level, args.log_format, process_kind=args.command)
    except ValueError as exc:
        print(f"ecrec-server: {exc}", file=sys.stderr)
        return 2
    if args.command == "status":
        from ecrec.ops import status

        try:
            options = from_arguments(SecurityOptions, args)
        except ValueError as exc:  # an empty --token-file or --tls-*: what was asked cannot be
            logs.fatal(f"ecrec-server status: {exc}")
            return 2
        try:
            security = options.security
            outcome: dict = {}
            return status.run(args.coordinator, as_json=args.json, timeout_s=args.timeout, wait_s=args.wait,
                              security=security, outcome=outcome)
        except BrokenPipeError:  # `status | head`: the reader left; end quietly, as any Unix filter does
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit must not fail again
            # the cluster's state decides the exit status, not the reader (`set -o pipefail` scripts read it)
            return outcome.get("exit", 1)
        except (status.CoordinatorUnreachable, ValueError) as exc:
            logs.fatal(f"ecrec-server status: {exc}")
            return status.EXIT_UNREACHABLE

    if args.command in ("snapshot", "restore"):
        code = _snapshot_command(args)
        if argv is None:  # its work done (or refused) and said: no teardown of torch's and gRPC's modules (0.6 s)
            exit_now(code)  # in which a SIGTERM would make the status 143 after a snapshot was written whole
        return code

    tune_allocator()
    # a crash in native code (ISA-L, numba, gRPC core) prints the Python stacks of every thread on stderr
    # instead of ending the process without a word
    faulthandler.enable()
    if args.command == "coordinator":
        from ecrec.ops import metrics
        from ecrec.control import leadership
        from ecrec.control.coordinator import Coordinator

        try:
            spec = from_arguments(ClusterSpec, args)
            config = from_arguments(CoordinatorConfig, args, cluster=spec)
            etcd_only = [flag for flag, value in (("--etcd-ca", config.etcd_ca), ("--etcd-cert", config.etcd_cert),
                                                  ("--etcd-key", config.etcd_key)) if value]
            if etcd_only and not (config.store or "").startswith("etcd://"):  # (they were ignored without a word)
                kept = config.store or config.state_path or "memory"
                raise ValueError(f"{', '.join(etcd_only)}: how to dial etcd, and this coordinator keeps its map in "
                                 f"{kept}, not in etcd (--store etcd://HOST:PORT)")
            if config.restore:
                _check_snapshot(config.restore)
            coordinator = Coordinator(config)
            endpoint = None
            if config.metrics_port is not None:  # before the gRPC service starts: a port in use stops nothing
                endpoint = metrics.serve(metrics.CoordinatorCollector(lambda: _served_map(coordinator),
                                                                      lambda: leadership.leads(coordinator.state)),
                                         config.host, config.metrics_port)
            running = coordinator.start()
        except (ValueError, OSError, TypeError) as exc:
            logs.fatal(f"ecrec-server coordinator: {exc}")
            return 2
        print(f"ECREC_COORDINATOR {running.address}", flush=True)
        done, outcome = threading.Event(), {}
        if config.restore:
            threading.Thread(target=_restore_when_ready, args=(coordinator, running.address, config.restore, config,
                                                               done, outcome),
                             name="ecrec-restore", daemon=True).start()
        _wait_for_signal(_stop_all(running.stop, endpoint and endpoint.close), done)
        return outcome.get("exit", 0)

    if args.command == "serve":
        from ecrec import faults
        from ecrec.ops import metrics
        from ecrec.server.process import EmbeddingServer

        try:
            config = from_arguments(ServerConfig, args, fault_spec=os.environ.get(faults.ENV, ""))
            server = EmbeddingServer(config)
            endpoint = None
            if config.metrics_port is not None:
                endpoint = metrics.serve(metrics.ServerCollector(server.state), config.host, config.metrics_port)
                # where a scraper reaches it (the map's host: --advertise-host for a server bound to every interface)
                server.state.metrics_address = f"{config.public_host}:{endpoint.address.rsplit(':', 1)[1]}"
            server.start()
        except (OSError, RuntimeError, ValueError) as exc:
            logs.fatal(f"ecrec-server serve: {exc}")
            return 2
        _wait_for_signal(_stop_all(server.stop, endpoint and endpoint.close), server.stopped)
        return 1 if server.fenced else 0  # declared failed: a supervisor restarting on failure restarts it

    # local
    from ecrec.ops.local import LocalCluster, LocalClusterSpec

    try:
        options = parse_key_values(args.strategy_options)
    except ValueError as exc:
        logs.fatal(f"ecrec-server local: {exc}")
        return 2
    if args.standby < 0:
        logs.fatal(f"ecrec-server local: --standby {args.standby}: a number of spare servers is >= 0")
        return 2
    from ecrec.config import LOCAL_MEMBERS, MAX_LOCAL_SERVERS, empty_flag

    problem = None  # (each process of this host's cluster is started here: a typo must not start a thousand)
    if args.num_servers + args.standby > MAX_LOCAL_SERVERS:
        problem = (f"--servers and --standby ({args.num_servers + args.standby:,} processes): at most "
                   f"{MAX_LOCAL_SERVERS}")
    for flag, value in (("--coordinators", args.coordinators), ("--etcd-members", args.etcd_members or 0)):
        if problem is None and value > LOCAL_MEMBERS:
            problem = f"{flag} {value}: at most {LOCAL_MEMBERS}"
    for flag, value in (("--restore", args.restore), ("--token-file", args.token_file),
                        ("--state-path", args.state_path)):
        if problem is None and value is not None and not value.strip():
            problem = empty_flag(flag)
    if problem:
        logs.fatal(f"ecrec-server local: {problem}")
        return 2
    if args.store != "etcd" and args.etcd_members is not None:
        logs.fatal("ecrec-server local: --etcd-members is for --store etcd (the file store runs no etcd)")
        return 2
    if args.host.strip("[]") in WILDCARD_HOSTS:  # (serve's advice, --advertise-host, is no flag of local's)
        logs.fatal(f"ecrec-server local: --host {args.host} binds every interface, so it is no address local's "
                   "processes reach each other at: give one (127.0.0.1, the default, or this host's IP)")
        return 2
    problem = state_path_problem(args.state_path)
    if problem:
        logs.fatal(f"ecrec-server local: {problem}")
        return 2
    if args.state_path and os.path.exists(args.state_path) and os.path.getsize(args.state_path) > 0:
        # the map of a cluster whose servers are gone: its tables with new, empty servers are all lost stripes
        logs.fatal(f"ecrec-server local: --state-path {args.state_path} holds the map of an earlier cluster, and "
                   "local starts new, empty servers: its tables could not be rebuilt (DATA LOSS at once). Remove the "
                   "file or choose another path (to bring the model back: --restore a snapshot)")
        return 2
    if args.restore:
        try:
            _check_snapshot(args.restore)
        except ValueError as exc:
            logs.fatal(f"ecrec-server local: {exc}")
            return 2
    cluster = None
    try:
        cluster = LocalCluster(LocalClusterSpec(
            servers=args.num_servers, standby=args.standby, strategy=args.strategy, k=args.k, m=args.m,
            options=options, host=args.host, device=args.device, state_path=args.state_path,
            log_level=args.log_level, log_format=args.log_format, metrics_port=args.metrics_port,
            server_security={"token_file": args.token_file} if args.token_file else {},
            coordinator_options={"restore": args.restore} if args.restore else {},
            store=args.store, coordinators=args.coordinators,
            etcd_members=1 if args.etcd_members is None else args.etcd_members,
            # a kill -9 of this process stops them too (this thread starts them all); a Ctrl-C reaches this one only
            die_with_parent=True, own_process_groups=True,
        ))
        cluster.start()
    except (RuntimeError, TimeoutError, ValueError, FileNotFoundError) as exc:
        logs.fatal(f"ecrec-server local: {exc}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the cluster starts: what started is stopped
        if cluster is not None:
            cluster.close()
        raise
    print(f"coordinator at {cluster.coordinator_address} ({args.num_servers} servers, {args.standby} standby, "
          f"strategy {args.strategy}); Ctrl-C stops them all", flush=True)
    if args.restore:  # the restore's writes replace what a worker writes meanwhile
        print(f"restoring {args.restore}: start training once the coordinator logs 'restored' (at log level "
              "INFO; a restore that fails stops the cluster)", flush=True)
    print(ready_message(cluster.coordinator_address, cluster.metrics_addresses(), args.token_file), flush=True)
    done, gone = threading.Event(), []

    reported: set[int] = set()

    def watch() -> None:  # a cluster whose every coordinator exited serves nobody: it stops, and says why
        while not done.wait(0.5):
            for p in list(cluster.server_procs):  # a server that exited is reaped (no zombie) and said
                if p.pid not in reported and p.poll() is not None:
                    reported.add(p.pid)
                    logging.getLogger("ecrec").warning(
                        "server process %d exited (status %s); the coordinator replaces it with a standby, if any "
                        "(ecrec-server serve --coordinator %s adds one)", p.pid, p.returncode,
                        cluster.coordinator_address)
            procs = [p for p in (cluster.coordinator_procs or [cluster.coordinator_proc]) if p is not None]
            if procs and all(p.poll() is not None for p in procs):
                gone.append(procs[-1].returncode)
                logging.getLogger("ecrec").error("the coordinator exited (status %s): stopping the cluster",
                                                 procs[-1].returncode)
                done.set()

    threading.Thread(target=watch, name="ecrec-local-watch", daemon=True).start()
    _wait_for_signal(cluster.close, done)
    if gone:
        logs.fatal(f"ecrec-server local: the coordinator exited (status {gone[0]}); the cluster was stopped")
        return 1
    return 0


def ready_message(address: str, metrics_addresses: dict | None = None, token_file: str | None = None) -> str:
    """What ``ecrec-server local`` prints once the cluster is ready: how to connect, watch and inspect it (with
    the token file every call must carry, when the cluster asks for one)."""
    token = os.path.abspath(token_file) if token_file else None
    lines = [
        "",
        "Connect from Python (paste into a shell started from this environment):",
        "",
        "    import torch",
        "    from ecrec.client import Cluster, EmbeddingBag",
        *(["    from ecrec.config import ClientConfig",
           f'    cluster = Cluster.connect("{address}", config=ClientConfig(token_file={token!r}))'] if token
          else [f'    cluster = Cluster.connect("{address}")']),
        '    cluster.create_table("user", num_rows=100_000, dim=16, optimizer="adagrad", lr=0.05, seed=1)',
        '    emb = EmbeddingBag(cluster, "user", mode="sum")',
        "    out = emb(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]))   # two bags of two rows",
        "    out.sum().backward(); cluster.step()                           # push the gradients",
        "",
        f"Cluster state: ecrec-server status --coordinator {address}"
        + (f" --token-file {shlex.quote(token)}" if token else ""),
    ]
    if metrics_addresses:
        lines.append("Prometheus metrics: " + ", ".join(f"{name} http://{a}/metrics"
                                                       for name, a in metrics_addresses.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
