"""The fault-tolerance strategy interface: what a strategy sees of its server, and what it is told.

A strategy runs inside an embedding server.  It sees the server only through the narrow
:class:`StrategyHost` protocol (its index, layout and map, its shards through their methods, the
peers, the coordinator, a pause of pushes) and imports nothing from ``ecrec.server``.  The server
calls the strategy

- when a table or dense tensor is created (``on_table_created``, ``on_dense_created``);
- once per applied push with everything it changed (``on_push`` with an :class:`AppliedPush`:
  the old and new payload bytes and old versions of every touched row and dense tensor), under the
  server's apply lock, so the strategy sees pushes in one total order; it returns a
  :class:`PushOutcome` (what goes back in the reply: batches for the worker to relay, the push's
  sequence and the confirmation watermark) whose ``completion``, if any, the server waits on --
  outside the lock -- before acknowledging;
- with what a worker relays from other servers (``on_relay``: batches addressed to this server;
  ``on_acks``: other servers' watermarks of this server's batches), before a pull or push is handled;
- when the cluster map changes (``on_map_change``);
- before rows or dense tensors are read or updated (``ensure_rows``, ``ensure_dense``): a
  recovering server rebuilds them first;
- periodically (``on_timer``, every ``timer_interval_s`` seconds when that is set);
- when this server replaces a failed one (``on_recovery``), and at shutdown (``close``);
- on a command from a client (``call``: the ``StrategyCall`` RPC, JSON in and out).

A strategy that needs its own RPCs returns gRPC servicers from ``services()``; the server
registers them when the strategy starts (the erasure-coding strategy's ``ParityService``).

Strategies are found by name through light specs (``ecrec.strategies.spec``), so the
coordinator and the benchmarks never import these classes.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from ecrec.config import ServerConfig
    from ecrec.faults import FaultInjector
    from ecrec.coding.layout import Layout
    from ecrec.net.peers import CoordinatorClient, Peers
    from ecrec.net.seal import Sealer
    from ecrec.tables.shards import DenseShard, TableShard
    from ecrec.wire import cluster_pb2


#: hex digits of the digest that names a worker incarnation on the servers (128 bits)
PUSH_KEY_DIGEST_HEX = 32
#: characters of the worker's name kept in front of that digest, for people reading logs and stats
PUSH_KEY_NAME_CHARS = 32


def push_key(push_id, identity: str = "") -> tuple[str, int]:
    """A push's identity on the servers: ``("name#digest", sequence)`` (``PushId`` message in).

    The digest is a hash of what the caller proved (``identity``: its TLS certificate's names, "" without
    TLS), the worker's name and its incarnation, each length-prefixed.  The incarnation is the worker's
    secret (the SDK draws 128 random bits per process) and never leaves the worker: the servers keep and
    relay only the digest, in their applied marks and in the push ids inside parity batches, and no push
    id a caller can send hashes to a digest it read there.  So a worker can apply, retry and replay only its
    own pushes: another's digest, read from a relayed batch, names nobody it can be (and, with TLS, another
    certificate makes another digest even from the same secret).  A restarted worker that keeps its name is
    another incarnation, so its first pushes are not taken for retries of the old process's pushes; names
    and incarnations are hashed apart, so worker ``a@b`` is never worker ``a`` of incarnation ``b``."""
    h = hashlib.blake2b(digest_size=PUSH_KEY_DIGEST_HEX // 2, person=b"ecrec-push-id")
    for part in (identity, push_id.worker, push_id.incarnation):
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return f"{push_id.worker[:PUSH_KEY_NAME_CHARS]}#{h.hexdigest()}", int(push_id.sequence)


def push_key_chars() -> int:
    """The most characters a push key's worker part has (parity batches carrying longer ones are refused)."""
    return PUSH_KEY_NAME_CHARS + 1 + PUSH_KEY_DIGEST_HEX


class Completion(Protocol):
    """Something the server waits on before acknowledging a push."""

    def result(self, timeout: float | None = None) -> object: ...


@dataclass
class TableUpdate:
    """The rows of one table a push changed: ``old``/``new`` are ``(len(slots), row_bytes)`` uint8 payloads
    (``old`` is None unless the strategy asked for it with ``needs_old_payload``); ``old_versions`` the
    rows' versions before the push; ``delta`` is ``old XOR new`` when the strategy asked for it with
    ``needs_delta`` (computed while the rows are in cache; ``old`` is then None)."""

    shard: "TableShard"
    ids: np.ndarray
    slots: np.ndarray
    old: np.ndarray | None
    new: np.ndarray
    old_versions: np.ndarray | None = None
    delta: np.ndarray | None = None


@dataclass
class DenseUpdate:
    """A dense tensor a push changed (this server is its primary); payload bytes as for rows."""

    dense: "DenseShard"
    old: np.ndarray | None
    new: np.ndarray
    old_version: int = 0
    delta: np.ndarray | None = None


@dataclass
class PushOutcome:
    """What a strategy answers for a push: what the server waits on before acknowledging (``completion``),
    and what goes back in the reply (batches for the worker to relay, the push's sequence here, and the
    sequence up to which this server's pushes are durable at their redundancy)."""

    completion: Completion | None = None
    relay: list = field(default_factory=list)  # with RelayBatch's fields (destination, destination_id, batch, mac)
    seq: int = 0
    confirmed_upto: int = 0


@dataclass
class AppliedPush:
    """One push as applied on this server: its id, the sequence it got here (also the version now
    stamped on every row it changed) and what it changed."""

    push_id: tuple[str, int]
    seq: int
    tables: list[TableUpdate] = field(default_factory=list)
    dense: list[DenseUpdate] = field(default_factory=list)
    nbytes: int = 0  # bytes of the payload copies it holds (old and new), when the server counted them


class StrategyHost(Protocol):
    """What a strategy may use of its embedding server."""

    config: "ServerConfig"
    faults: "FaultInjector"
    peers: "Peers"
    coordinator: "CoordinatorClient"

    @property
    def index(self) -> int: ...  # -1 while a standby

    @property
    def server_id(self) -> str: ...  # this process's incarnation

    @property
    def cluster_id(self) -> str: ...  # the cluster's (a new cluster, a new id; "" before registering)

    @property
    def layout(self) -> "Layout | None": ...

    @property
    def cluster_map(self) -> "cluster_pb2.ClusterMap | None": ...

    @property
    def epoch(self) -> int: ...

    @property
    def promoting(self) -> bool: ...  # tables being created by a promotion (their rows get rebuilt)

    def require_index(self) -> None: ...  # raises FailedPrecondition on a standby

    def require_serving(self, caller_epoch: int = 0) -> None: ...  # raises Unavailable without a lease

    def check_peer(self, context, changes_parity: bool = True) -> str: ...  # a proven server of the map: its id

    def check_member(self, caller: str, caller_epoch: int = 0) -> None: ...  # a proven caller still of the map

    @property
    def sealer(self) -> "Sealer | None": ...  # MACs under the server key (ecrec.net.seal); None before registering

    def refresh_map(self) -> None: ...  # fetch the coordinator's map now

    def allocate(self, table: str, shape: tuple, dtype) -> np.ndarray: ...  # zeroed; from a standby's reserve

    def tables(self) -> "list[TableShard]": ...  # every table shard, by name

    def table(self, name: str) -> "TableShard": ...  # raises NotFound

    def dense_tensors(self) -> "list[DenseShard]": ...

    def dense(self, name: str) -> "DenseShard": ...  # raises NotFound

    def pushes_paused(self) -> contextlib.AbstractContextManager: ...  # no push applies inside

    def mark_applied(self, push_id: tuple[str, int]) -> None: ...  # a retry of it is "already applied"

    def last_push_seq(self) -> int: ...  # the sequence of the last push numbered here (0: none in this incarnation)


class FaultToleranceStrategy:
    """Base class; the default of every hook does nothing.  ``options`` is the strategy's typed options
    (the dataclass of its spec)."""

    name: ClassVar[str] = "?"
    #: whether the old payload bytes of updated rows must be captured for ``on_push``
    needs_old_payload: ClassVar[bool] = False
    #: whether ``old XOR new`` of updated rows must be captured for ``on_push`` (``TableUpdate.delta``)
    needs_delta: ClassVar[bool] = False
    #: whether a promoted replacement rebuilds every row itself (then its tables skip initial values)
    rebuilds_rows: ClassVar[bool] = False
    #: whether a table no push changed may be restored in bulk (``ecrec.snapshot.bulk``): every server rewrites its
    #: rows from a snapshot's files, then the strategy its redundancy (:meth:`fill_redundancy`)
    fills_in_bulk: ClassVar[bool] = False
    #: seconds between ``on_timer`` calls (None: never)
    timer_interval_s: float | None = None

    def __init__(self, host: StrategyHost, options: Any):
        self.host = host
        self.options = options

    def services(self) -> list[tuple[Callable, object]]:
        """``(add_XServicer_to_server, servicer)`` pairs the server registers for this strategy."""
        return []

    def reserve_shapes(self, specs: list) -> dict[str, list[tuple[tuple[int, ...], str]]]:
        """Large zeroed arrays (``(shape, dtype name)`` by table name) this strategy allocates when a promoted
        replacement creates ``specs`` in this order, for a standby to prepare in advance (:mod:`ecrec.server.reserve`;
        taken through ``host.allocate``)."""
        return {}

    def on_table_created(self, shard: "TableShard") -> None:
        pass

    def on_dense_created(self, dense: "DenseShard") -> None:
        pass

    def check_fill(self, shard: "TableShard") -> None:
        """Raises (``FailedPrecondition``, ``Unavailable``) unless ``shard``'s redundancy can be rewritten from a
        snapshot's files now (called under the apply lock, before a restore in bulk begins)."""

    def fill_redundancy(self, shard: "TableShard", gather) -> int:
        """Rewrites what this server keeps for ``shard``'s redundancy from ``gather(ids, out, at)`` (the rows of
        any ids, ``ecrec.snapshot.bulk.SnapshotRows.gather``); returns the rows written."""
        return 0

    def admit_push(self) -> None:
        """Called before a push is applied (not under the apply lock): may wait, or raise ``Unavailable``,
        while too much earlier work is pending (backpressure).  Nothing is changed yet when it raises."""

    def on_push(self, push: AppliedPush) -> PushOutcome | None:
        """A push was applied locally; what to wait for before acknowledging it and what the reply carries."""
        return None

    def on_retry(self, push_id: tuple[str, int], seq: int) -> PushOutcome | None:
        """A retry of an applied push (``seq``: the sequence it got here, 0 if before this incarnation)."""
        return None

    def on_relay(self, relay: list, worker: str = "") -> list:
        """Batches of other servers a worker (named ``worker``, for the log) relayed to this one (``RelayBatch``,
        sealed); returns the watermarks (``ParityWatermark``, sealed) the worker takes back to their owners."""
        return []

    def on_acks(self, acks: list, worker: str = "") -> None:
        """Watermarks of this server's own batches (``ParityWatermark``, sealed), relayed by worker ``worker``."""

    def on_map_change(self) -> None:
        """The server adopted a newer cluster map."""

    def confirmed_upto(self) -> int:
        """Every push applied here up to this sequence is durable at its redundancy (0: not tracked)."""
        return 0

    def ensure_rows(self, items: "list[tuple[TableShard, np.ndarray]]") -> None:
        """Called with ``(shard, slots)`` of every table a request touches, before the rows are read or
        updated: a recovering server rebuilds them first."""

    def ensure_dense(self, dense: "DenseShard") -> None:
        """Called before a dense tensor is read or updated."""

    def on_timer(self) -> None:
        pass

    def is_recovering(self) -> bool:
        """Whether this server still rebuilds after a promotion."""
        return False

    def on_recovery(self, failed_index: int) -> bool:
        """This server was just promoted to hold ``failed_index``; tables exist (with initial values
        unless ``rebuilds_rows``).

        Returns True when it keeps rebuilding in the background (it reports full redundancy
        to the coordinator when done), False when the server is complete on return.
        """
        return False

    def call(self, command: str, args: dict) -> dict:
        """A strategy command sent by a client or the benchmark (``StrategyCall``); ``stats`` by default."""
        if command == "stats":
            return self.stats()
        raise ValueError(f"strategy {self.name!r} has no command {command!r}")

    def stats(self) -> dict:
        """Counters worth reporting (bytes written, rows saved, lost updates...)."""
        return {}

    def close(self) -> None:
        pass
