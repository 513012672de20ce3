"""``ecrec-bench server``: pull and push rows/s of the embedding servers beside a raw gRPC round trip.

Starts local clusters (one server, then ``--servers`` servers), and measures in one run:

- one server, raw stubs: a pull of ``--batch`` rows plus a push of their gradients, against
  two ``Echo`` calls carrying exactly the same request and reply bytes to the same server
  process (no table work).  The ratio is the server's efficiency: how close the pull/push
  path comes to the transport's own round trip.
- the whole cluster through the SDK (``Cluster.pull`` + ``Cluster.step``, fanned out to every
  server in parallel), against the same echo fan-out.

Each measurement alternates its two sides in rounds so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent import futures

import numpy as np

from ecrec.ops import console
from ecrec.net import transport
from ecrec.ops.local import LocalCluster, LocalClusterSpec
from ecrec.wire import embedding_pb2, embedding_pb2_grpc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--servers", type=int, default=4, help="servers of the cluster measurement (default 4)")
    p.add_argument("--rows", type=int, default=200_000, help="rows of the table (default 200000)")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension (default 64)")
    p.add_argument("--batch", type=int, default=4096, help="rows per pull/push (default 4096)")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per side per round (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def _rate(fn, rows_per_call: int, seconds: float) -> float:
    fn()  # warm up
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return calls * rows_per_call / elapsed


def _side_by_side(a, b, rows: int, seconds: float, rounds: int) -> tuple[float, float]:
    ra, rb = [], []
    for _ in range(rounds):
        ra.append(_rate(a, rows, seconds))
        rb.append(_rate(b, rows, seconds))
    return statistics.median(ra), statistics.median(rb)


def _single_server(args) -> dict:
    from ecrec.client import Cluster

    with LocalCluster(LocalClusterSpec(servers=1)) as local:
        client = Cluster.connect(local.coordinator_address)
        client.create_table("bench", args.rows, args.dim, optimizer="sgd", lr=0.01)
        stub = embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(client.map.servers[0].address))
        rng = np.random.default_rng(0)
        ids = np.sort(rng.choice(args.rows, args.batch, replace=False)).astype(np.int64)
        ids_b = transport.ids_to_bytes(ids)
        grads_b = (rng.standard_normal((args.batch, args.dim)).astype(np.float32) * 1e-3).tobytes()
        pull_req = embedding_pb2.PullRequest(tables=[embedding_pb2.TableIds(table="bench", ids=ids_b)])
        seq = iter(range(1, 1 << 62))

        def pull_push():
            reply = stub.Pull(pull_req, timeout=30)
            assert len(reply.values[0]) == 4 * args.dim * args.batch
            stub.Push(embedding_pb2.PushRequest(
                tables=[embedding_pb2.TableGrads(table="bench", ids=ids_b, grads=grads_b)],
                push_id=embedding_pb2.PushId(worker="bench", sequence=next(seq))), timeout=30)

        reply_bytes = 4 * args.dim * args.batch
        echo_pull = embedding_pb2.EchoMessage(data=pull_req.SerializeToString(), reply_bytes=reply_bytes)
        push_size = len(ids_b) + len(grads_b) + 32
        echo_push = embedding_pb2.EchoMessage(data=bytes(push_size), reply_bytes=8)

        def echo_pair():
            stub.Echo(echo_pull, timeout=30)
            stub.Echo(echo_push, timeout=30)

        print(f"  one server: pull+push vs echo of the same bytes ({args.rounds} rounds)...", file=sys.stderr)
        server_rate, echo_rate = _side_by_side(pull_push, echo_pair, args.batch, args.seconds, args.rounds)
        client.close()
    return {"pull_push_rows_per_s": server_rate, "raw_grpc_rows_per_s": echo_rate, "efficiency": server_rate / echo_rate}


def _cluster(args) -> dict:
    import torch

    from ecrec.client import Cluster, EmbeddingBag

    with LocalCluster(LocalClusterSpec(servers=args.servers)) as local:
        client = Cluster.connect(local.coordinator_address)
        client.create_table("bench", args.rows, args.dim, optimizer="sgd", lr=0.01)
        bag = EmbeddingBag(client, "bench")
        rng = np.random.default_rng(1)
        ids = torch.from_numpy(np.sort(rng.choice(args.rows, args.batch, replace=False)).astype(np.int64))
        offsets = torch.arange(0, args.batch, dtype=torch.int64)

        def sdk_step():
            bag(ids, offsets).sum().backward()
            client.step()

        stubs = [embedding_pb2_grpc.EmbeddingServerStub(transport.make_channel(s.address)) for s in client.map.servers]
        per_server = -(-args.batch // args.servers)
        echo_pull = embedding_pb2.EchoMessage(data=bytes(8 * per_server + 16), reply_bytes=4 * args.dim * per_server)
        echo_push = embedding_pb2.EchoMessage(data=bytes((8 + 4 * args.dim) * per_server + 32), reply_bytes=8)
        pool = futures.ThreadPoolExecutor(max_workers=2 * args.servers)

        def echo_fan_out():
            for message in (echo_pull, echo_push):
                list(pool.map(lambda s: s.Echo(message, timeout=30), stubs))

        print(f"  {args.servers} servers: SDK pull+step vs echo fan-out ({args.rounds} rounds)...", file=sys.stderr)
        sdk_rate, echo_rate = _side_by_side(sdk_step, echo_fan_out, args.batch, args.seconds, args.rounds)
        pool.shutdown()
        client.close()
    return {"servers": args.servers, "sdk_rows_per_s": sdk_rate, "raw_grpc_rows_per_s": echo_rate,
            "efficiency": sdk_rate / echo_rate}


def run(args) -> int:
    import torch  # here, not at import: the report of a saved JSON (docs/results.md) needs no torch

    torch.set_num_threads(1)  # the servers share this machine's cores with the client
    for name, value in (("--servers", args.servers), ("--rows", args.rows), ("--dim", args.dim),
                        ("--batch", args.batch), ("--rounds", args.rounds)):
        if value < 1:
            print(f"ecrec-bench server: {name} must be at least 1, got {value}", file=sys.stderr)
            return 2
    if not args.seconds > 0:
        print(f"ecrec-bench server: --seconds must be positive, got {args.seconds:g}", file=sys.stderr)
        return 2
    if args.batch > args.rows:
        print(f"ecrec-bench server: --batch must not exceed --rows ({args.batch} > {args.rows})", file=sys.stderr)
        return 2
    from ecrec.bench.checks import servers_problem, tables_problem
    from ecrec.config import ServerConfig

    defaults = ServerConfig(coordinator="")  # the servers' bounds, as the cluster starts them
    # the one-server measurement pulls and pushes a whole batch in one raw call: past the servers' bounds it was
    # refused with a gRPC traceback after a cluster had started
    most = min(defaults.max_ids_per_request, (defaults.max_message_bytes - (1 << 20)) // (4 * args.dim + 8))
    problem = (servers_problem(args.servers)
               or tables_problem(f"--rows {args.rows} x --dim {args.dim}", 1, args.rows, args.dim, "sgd")
               or (f"--batch {args.batch:,} x --dim {args.dim:,}: at most {most:,} rows of {args.dim:,} float32 go in "
                   f"one call (the servers' bounds: {defaults.max_ids_per_request:,} ids, "
                   f"{defaults.max_message_bytes:,}-byte messages)" if args.batch > most else None))
    if problem:
        print(f"ecrec-bench server: {problem}", file=sys.stderr)
        return 2
    print(f"ecrec-bench server: {args.rows} rows x {args.dim} float32, {args.batch} rows per pull/push", file=sys.stderr)
    load_before = os.getloadavg()  # the JSON keeps it: a figure measured beside other jobs is read as such
    single = _single_server(args)
    cluster = _cluster(args)
    report = {"config": {**{k: v for k, v in vars(args).items() if not k.startswith("_")},
                         "command": "server", "json": os.path.basename(args.json) if args.json else None,
                         "cpu_count": os.cpu_count(), "load_average_before": list(load_before),
                         "load_average_after": list(os.getloadavg())},
              "single_server": single, "cluster": cluster}
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def print_report(report: dict) -> None:
    """The table, from the report (the JSON ``--json`` writes)."""
    single, cluster = report["single_server"], report["cluster"]
    print()
    console.print_table(["measurement", "rows/s", "raw gRPC rows/s", "ratio"], [
        ["one server: pull+push (stubs)", f"{single['pull_push_rows_per_s']:,.0f}",
         f"{single['raw_grpc_rows_per_s']:,.0f}", f"{single['efficiency']:.2f}"],
        [f"{report['config']['servers']} servers: SDK pull+step", f"{cluster['sdk_rows_per_s']:,.0f}",
         f"{cluster['raw_grpc_rows_per_s']:,.0f}", f"{cluster['efficiency']:.2f}"],
    ])
