"""``ecrec-server status``: a cluster's state in one command, from its coordinator and every server.

The coordinator gives the map (indices, addresses, states, epoch, events) and the control plane's coordinators
(which one leads: any coordinator is enough to ask, leader or not); each server that is not
declared failed is asked, in parallel and with a deadline, for its gRPC health and its ``stats``
(``StrategyCall``): the epoch it holds, the rows it holds (data and parity) and, while it rebuilds,
how many rows are still to rebuild.  :func:`collect` returns all of it as a dict (``--json``);
:func:`render` prints it as a table.

A cluster is *fully redundant* when every index is held by an ``ACTIVE`` server that answers its
health check as serving and is not rebuilding, and no stripe was lost; the command exits 0 then, 1 otherwise (2 when the
coordinator cannot be reached), so a script can wait on it (``--wait``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ecrec.config import MAX_SECONDS
from ecrec.ops import console
from ecrec.net import transport
from ecrec.net.cluster_map import fully_redundant
from ecrec.net.security import tls_hint
from ecrec.wire import cluster_pb2, coordinator_pb2, coordinator_pb2_grpc, embedding_pb2, embedding_pb2_grpc

EXIT_REDUNDANT, EXIT_NOT_REDUNDANT, EXIT_UNREACHABLE = 0, 1, 2
EVENTS_PER_SERVER = 3


class CoordinatorUnreachable(RuntimeError):
    """The coordinator did not answer ``GetClusterMap``."""


def _probe(address: str, health_address: str, timeout_s: float, security=None) -> dict:
    """Health (asked on the server's health port when it has one, as the coordinator does) and stats of one
    server; errors are reported in the result, never raised."""
    channel = transport.make_channel(address, security=security)
    health_channel = transport.make_channel(health_address, security=security) if health_address else channel
    out: dict = {"health": "", "stats": None, "error": ""}
    try:
        try:
            reply = health_pb2_grpc.HealthStub(health_channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                     timeout=timeout_s)
            out["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as exc:
            out["health"] = "UNREACHABLE"
            out["error"] = f"health: {exc.code().name}: {exc.details()}"
            return out
        try:
            reply = embedding_pb2_grpc.EmbeddingServerStub(channel).StrategyCall(
                embedding_pb2.StrategyCallRequest(command="stats"), timeout=timeout_s)
            out["stats"] = json.loads(reply.result_json)
        except grpc.RpcError as exc:
            out["error"] = f"stats: {exc.code().name}: {exc.details()}"
        return out
    finally:
        channel.close()
        if health_channel is not channel:
            health_channel.close()


def collect(address: str, timeout_s: float = 5.0, security=None) -> dict:
    """The cluster behind the coordinator at ``address``, with what each server says of itself."""
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_SECONDS):
        raise ValueError(f"timeout must be > 0 and at most {MAX_SECONDS:g} seconds, got {timeout_s}")
    from ecrec.net.peers import coordinator_stub  # the coordinators at host:port[,host:port...]
    stub = coordinator_stub(address, security=security)
    try:
        cluster_map = stub.GetClusterMap(coordinator_pb2.GetClusterMapRequest(), timeout=timeout_s)
        control = _coordinators(stub, timeout_s)
    except grpc.RpcError as exc:
        raise CoordinatorUnreachable(f"coordinator {address}: {exc.code().name}: {exc.details()}"
                                     f"{tls_hint(exc, security)}") from None
    finally:
        stub.close()
    if not control.get("coordinators_error"):
        control["coordinators_not_answering"] = _named_not_listed(address, control, timeout_s, security)
    probed = [s for s in cluster_map.servers if s.state != cluster_pb2.FAILED]
    with futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(probed)))) as pool:
        probes = dict(zip((s.server_id for s in probed),
                          pool.map(lambda s: _probe(s.address, s.health_address, timeout_s, security), probed)))
    now = time.time()
    servers = [_server_row(info, probes.get(info.server_id), cluster_map, now) for info in cluster_map.servers]
    redundant = fully_redundant(cluster_map) and all(
        s["health"] == "SERVING" and not s["recovering"] for s in servers if s["state"] == "ACTIVE")
    # every index served, as the map says -- and as the servers answer: one that does not answer its health check
    # (killed or paused a moment ago, before the coordinator declared it failed) serves nothing now
    ready = cluster_map.ready and not any(s["health"] == "UNREACHABLE" for s in servers
                                          if s["index"] >= 0 and s["state"] in ("ACTIVE", "RECOVERING"))
    held = {s["index"] for s in servers if s["index"] >= 0 and s["state"] != "FAILED"}
    return {
        "unserved_indices": [i for i in range(cluster_map.num_servers) if i not in held],
        "standbys": sum(1 for s in servers if s["state"] == "STANDBY"),
        "coordinator": address, "epoch": cluster_map.epoch, "num_servers": cluster_map.num_servers,
        "strategy": cluster_map.strategy, "k": cluster_map.k, "m": cluster_map.m, "ready": ready,
        "fully_redundant": redundant, "tables": [t.name for t in cluster_map.tables],
        "dense_tensors": len(cluster_map.dense), "servers": servers, **control,
        "events": [{"kind": e.kind, "index": e.index, "address": e.address, "wall_time": e.wall_time,
                    "epoch": e.epoch} for e in cluster_map.events[-20:]],
        "data_loss": [{"table": d.table, "stripe_count": d.stripe_count, "stripes": list(d.stripes),
                       "indices": list(d.indices), "wall_time": d.wall_time} for d in cluster_map.data_loss],
    }


def _wildcard(address: str) -> bool:
    return address.rpartition(":")[0].strip("[]") in ("0.0.0.0", "::", "")


def _coordinators(stub, timeout_s: float) -> dict:
    """``{"leader", "coordinators": [{"address", "leads"}], "store"}`` as the coordinator answers it (an error in
    ``coordinators_error`` when it cannot: the map alone still makes a status)."""
    try:
        reply = stub.GetCoordinators(coordinator_pb2.GetCoordinatorsRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        return {"leader": None, "coordinators": [], "store": None,
                "coordinators_error": f"{exc.code().name}: {exc.details()}"}
    return {"leader": reply.leader or None, "store": reply.store,
            "coordinators": [{"address": c.address, "leads": c.leads} for c in reply.coordinators]}


def _named_not_listed(address: str, control: dict, timeout_s: float, security) -> list[dict]:
    """The coordinators ``address`` names or the cluster lists that do not answer, each asked itself:
    ``[{"address", "error"}]``.  Named but not listed: a follower that died, one never started.  Listed but silent:
    one that died or hangs within its election lease, the leader included (etcd lists it until the lease ends)."""
    from ecrec.net.peers import coordinator_stub

    # a coordinator lists itself by its bind address: one bound to every interface is no address to dial from here
    listed = [c["address"] for c in control["coordinators"] if not _wildcard(c["address"])]
    absent = [a for a in dict.fromkeys([*(part.strip() for part in address.split(",")), *listed]) if a]

    def ask(named: str) -> dict | None:
        stub = coordinator_stub(named, security=security)
        try:
            stub.GetCoordinators(coordinator_pb2.GetCoordinatorsRequest(), timeout=min(timeout_s, 2.0))
            return None
        except grpc.RpcError as exc:
            return {"address": named, "error": exc.code().name}
        finally:
            stub.close()

    if not absent:
        return []
    with futures.ThreadPoolExecutor(max_workers=min(8, len(absent))) as pool:
        return [r for r in pool.map(ask, absent) if r is not None]


def _coordinators_text(status: dict) -> str:
    if status.get("coordinators_error"):
        return f"coordinators: unknown ({status['coordinators_error']})"
    silent = status.get("coordinators_not_answering") or []
    quiet = {c["address"] for c in silent}
    listed = ", ".join(c["address"] + (" (leads)" if c["leads"] else "") for c in status["coordinators"]
                       if c["address"] not in quiet)
    leader = "" if status["leader"] else "; none leads now (being elected)"
    if status["leader"] and status["leader"] in quiet:
        leader = f"; the leader {status['leader']} does not answer (a follower takes over once its lease ends)"
    missing = ("; not answering: " + ", ".join(f"{c['address']} ({c['error']})" for c in silent)) if silent else ""
    return f"coordinators: {listed or '-'}{missing}{leader}; map kept in {status['store']}"


def _server_row(info, probe: dict | None, cluster_map, now: float) -> dict:
    stats = (probe or {}).get("stats") or {}
    server = stats.get("server", {})
    data_rows = server.get("data_rows")
    parity_rows = stats.get("parity_rows", 0)
    total, pending = stats.get("rebuild_rows_total"), stats.get("rebuild_rows_pending", 0)
    recovering = bool(stats.get("recovering", False)) or info.state == cluster_pb2.RECOVERING
    events = [e for e in cluster_map.events if info.index >= 0 and e.index == info.index][-EVENTS_PER_SERVER:]
    return {
        "index": info.index, "address": info.address, "health_address": info.health_address or None,
        "state": cluster_pb2.ServerState.Name(info.state),
        "incarnation": info.server_id, "epoch": server.get("epoch"),
        "rows_held": None if data_rows is None else data_rows + parity_rows,
        "data_rows": data_rows, "parity_rows": parity_rows if data_rows is not None else None,
        "recovering": recovering,
        "rebuild_rows_total": total, "rebuild_rows_pending": pending if total is not None else None,
        "health": (probe or {}).get("health") or ("-" if info.state == cluster_pb2.FAILED else "UNREACHABLE"),
        "metrics": server.get("metrics_address") or None,
        "lease_remaining_s": server.get("lease_remaining_s"),
        "error": (probe or {}).get("error", ""),
        "last_events": [{"kind": e.kind, "seconds_ago": round(now - e.wall_time, 1), "epoch": e.epoch}
                        for e in events],
    }


def _rebuild_text(row: dict) -> str:
    total, pending = row["rebuild_rows_total"], row["rebuild_rows_pending"]
    if total is None or (total == 0 and not row["recovering"]):
        return "-"
    if not row["recovering"]:
        return "complete"
    done = total - (pending or 0)
    return f"{done:,}/{total:,} ({100.0 * done / total if total else 100.0:.0f}%)"


def _events_text(row: dict) -> str:
    return ", ".join(f"{e['kind']} {e['seconds_ago']:.0f}s ago" for e in row["last_events"]) or "-"


def _redundancy_text(status: dict) -> str:
    if status["strategy"] == "none":  # nothing kept but the rows themselves: a failed server's rows start over
        return "every index served (strategy none keeps no redundancy)" if status["fully_redundant"] else \
            "NOT fully redundant (strategy none keeps no redundancy)"
    return "fully redundant" if status["fully_redundant"] else "NOT fully redundant"


def render(status: dict, stream=None) -> None:
    """Prints ``status`` (from :func:`collect`) as a summary line and a table of servers."""
    summary = (f"cluster at {status['coordinator']}: epoch {status['epoch']}, {status['num_servers']} indices, "
               f"strategy {status['strategy']}" + (f" (k={status['k']}, m={status['m']})" if status['m'] else "")
               + f", {len(status['tables'])} tables; "
               + _redundancy_text(status)
               + (f"; no server holds index {', '.join(map(str, status['unserved_indices']))}"
                  if status.get("unserved_indices") else "")
               + "".join(f"; DATA LOSS: {d['stripe_count']} stripes of {d['table']!r}" for d in status["data_loss"]))
    headers = ["index", "address", "state", "incarnation", "epoch", "rows held", "rebuild", "health", "last events"]
    rows = []
    for s in status["servers"]:
        rows.append([s["index"] if s["index"] >= 0 else "-", s["address"], s["state"], s["incarnation"],
                     "-" if s["epoch"] is None else s["epoch"],
                     "-" if s["rows_held"] is None else f"{s['rows_held']:,}", _rebuild_text(s), s["health"],
                     _events_text(s)])
    console.print_table(headers, rows, title=summary, align="rllrrrrll", stream=stream)
    print(_coordinators_text(status), file=stream if stream is not None else sys.stdout, flush=True)


def _show_rebuilds(status: dict, bars: dict, finished: bool) -> None:
    """Progress bars (stderr; ``ecrec.ops.console``) of the servers rebuilding, one per index, while ``--wait``
    polls; a bar closes when its server is rebuilt (or the wait ends)."""
    seen = set()
    for row in status["servers"]:
        total = row["rebuild_rows_total"]
        label = f"rebuild {row['index']}"
        if row["index"] < 0 or not total or not (row["recovering"] or label in bars):
            continue
        seen.add(label)
        done = total - (row["rebuild_rows_pending"] or 0) if row["recovering"] else total
        bars[label] = (done, total)
        console.progress(label, done, total, done=not row["recovering"], plain_steps=10)
        if not row["recovering"]:
            del bars[label]
    for label in [label for label in bars if label not in seen or finished]:
        done, total = bars.pop(label)
        console.progress(label, done, total, done=True, plain_steps=10)


#: how often a ``--wait`` that shows no rebuild's progress says what it waits for (s)
WAIT_SAY_S = 5.0


def _waiting_for(status: dict | None, error: str) -> str:
    """What keeps the cluster from being fully redundant, in a few words, for a waiting ``status --wait``."""
    if status is None:
        return f"the coordinator does not answer ({error})"
    if status.get("unserved_indices"):
        standby = "" if status["standbys"] else " and no standby is registered (ecrec-server serve --standby adds one)"
        return f"no server holds index {', '.join(map(str, status['unserved_indices']))}{standby}"
    recovering = [str(s["index"]) for s in status["servers"] if s["index"] >= 0 and s["recovering"]]
    unhealthy = [str(s["index"]) for s in status["servers"]
                 if s["index"] >= 0 and s["state"] == "ACTIVE" and s["health"] != "SERVING"]
    return "; ".join(([f"index {', '.join(recovering)} rebuilding"] if recovering else []) +
                     ([f"index {', '.join(unhealthy)} not serving"] if unhealthy else [])) or "the map is changing"


def run(address: str, as_json: bool = False, timeout_s: float = 5.0, wait_s: float = 0.0, stream=None,
        security=None, outcome: dict | None = None) -> int:
    """``ecrec-server status``: prints the cluster (polling up to ``wait_s`` until it is fully redundant, or data
    was lost, with a progress bar of each rebuild on stderr meanwhile); returns the exit status (also put in
    ``outcome["exit"]`` before printing: a reader that left does not change it)."""
    if not 0 <= wait_s <= MAX_SECONDS:  # NaN too
        raise ValueError(f"--wait must be >= 0 seconds, got {wait_s} (at most {MAX_SECONDS:g})")
    start = time.monotonic()
    deadline = start + wait_s
    bars: dict[str, tuple[int, int]] = {}  # rebuild progress shown while waiting: label -> (done, total)
    said_at = start
    while True:
        try:
            status = collect(address, timeout_s, security)
        except CoordinatorUnreachable as exc:
            status = None
            error = str(exc)
        # lost stripes stay lost (only a restore brings their rows back): no wait makes the cluster redundant
        lost = status is not None and bool(status["data_loss"])
        finished = (status is not None and status["fully_redundant"]) or lost or time.monotonic() >= deadline
        if wait_s > 0 and status is not None:
            _show_rebuilds(status, bars, finished)
        if finished:
            break
        if not bars and time.monotonic() - said_at >= WAIT_SAY_S:  # a wait with no bar to show says why it waits
            said_at = time.monotonic()
            print(f"  waiting for the cluster to be fully redundant ({deadline - said_at:.0f} s left): "
                  f"{_waiting_for(status, error if status is None else '')}", file=sys.stderr, flush=True)
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    if status is None:
        if outcome is not None:
            outcome["exit"] = EXIT_UNREACHABLE
        if as_json:  # a script reading stdout gets an object whatever happened
            print(json.dumps({"coordinator": address, "reachable": False, "error": error}, indent=2), file=stream,
                  flush=True)
        raise CoordinatorUnreachable(error)
    if wait_s > 0 and lost and not status["fully_redundant"]:
        print("  data was lost: no rebuild brings it back, so status stops waiting (restore the last snapshot)",
              file=sys.stderr)
    code = EXIT_REDUNDANT if status["fully_redundant"] else EXIT_NOT_REDUNDANT
    if outcome is not None:
        outcome["exit"] = code
    if as_json:
        print(json.dumps(status, indent=2), file=stream, flush=True)
    else:
        render(status, stream)
    return code
