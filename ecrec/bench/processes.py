"""What the benchmarks read of a local cluster's processes: their memory, and whether its standbys are ready."""

from __future__ import annotations

import json
import time

from ecrec.wire import cluster_pb2, embedding_pb2


def memory_of(pids: list[int]) -> dict:
    """Resident and peak resident bytes summed over processes (``/proc/PID/status``; 0 when unreadable)."""
    rss = hwm = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("VmHWM:"):
                        hwm += int(line.split()[1]) * 1024
        except OSError:
            pass
    return {"rss_bytes": rss, "peak_rss_bytes": hwm}


def standby_status(cluster, request=None) -> list[dict]:
    """Every standby's ``stats`` status, each with ``settled``: whether it has seen the map the coordinator holds
    now (or a later one) and prepared that map's reserve.  Not pending alone: a standby that has not yet
    received the map naming a new table is not pending either, and holds nothing for it."""
    request = request or embedding_pb2.StrategyCallRequest(command="stats")
    current = cluster.refresh_map()
    out = []
    for address in [s.address for s in current.servers if s.state == cluster_pb2.STANDBY]:
        st = json.loads(cluster.peers.stub(address).StrategyCall(request, timeout=30).result_json)["server"]
        st["settled"] = int(st.get("epoch", 0)) >= current.epoch and not st.get("standby_reserve_pending")
        out.append(st)
    return out


def wait_standby_reserve(cluster, timeout_s: float = 120.0) -> dict:
    """Waits until every standby holds its tables' memory ready (:mod:`ecrec.server.reserve`), so that the failure
    meets a settled cluster rather than one whose tables were created a moment ago; returns the reserve's size
    and the wait."""
    t0 = time.monotonic()
    request = embedding_pb2.StrategyCallRequest(command="stats")
    while True:
        status = standby_status(cluster, request)
        if all(st["settled"] for st in status) or time.monotonic() - t0 > timeout_s:
            return {"standby_reserve_bytes": sum(int(st.get("standby_reserve_bytes", 0)) for st in status),
                    "standby_reserve_wait_s": time.monotonic() - t0}
        time.sleep(0.05)
