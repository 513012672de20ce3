"""Reading the cluster map: which server serves each index now.

The map (``ClusterMap`` in ``proto/ecrec/wire/cluster.proto``) lists servers with their state;
an index is served by the entry that is ``ACTIVE`` or ``RECOVERING`` (a promoted replacement
still rebuilding).  A ``PROMOTING`` entry (a standby whose promotion is under way) holds its index
against a second promotion and is the server a fencing check names, but serves nothing yet.  Clients, servers, strategies and the checkpoint driver read it the same way.
"""

from __future__ import annotations

from ecrec.wire import cluster_pb2

LIVE_STATES = (cluster_pb2.ACTIVE, cluster_pb2.RECOVERING)


def live_servers(m: cluster_pb2.ClusterMap) -> dict[int, cluster_pb2.ServerInfo]:
    """Index -> the server now serving it (standbys and failed entries left out)."""
    return {s.index: s for s in m.servers if s.index >= 0 and s.state in LIVE_STATES}


def live_address(m: cluster_pb2.ClusterMap, index: int) -> str | None:
    server = live_servers(m).get(index)
    return server.address if server is not None else None


def fully_redundant(m: cluster_pb2.ClusterMap) -> bool:
    """Every index is held by an ``ACTIVE`` server: none missing, failed, or still rebuilding (``RECOVERING``),
    and no stripe was lost (``data_loss``)."""
    active = {s.index for s in m.servers if s.index >= 0 and s.state == cluster_pb2.ACTIVE}
    return bool(m.ready) and active == set(range(m.num_servers)) and not m.data_loss
