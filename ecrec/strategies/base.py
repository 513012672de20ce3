"""The fault-tolerance strategy interface: how a strategy plugs into an embedding server.

The server calls its active strategy

- when a table or dense tensor is created (``on_table_created``, ``on_dense_created``);
- on every applied update, with the old and new payload bytes of the touched rows
  (``on_update``, ``on_dense_update``), under the table's lock; the strategy may return
  a :class:`Completion` that the server waits on -- outside the lock -- before it
  acknowledges the worker (parity acknowledgements sit on this path);
- periodically (``on_timer``, every ``timer_interval_s`` seconds when that is set);
- when this server replaces a failed one (``on_recovery``), and at shutdown (``close``);
- on a command from a client (``call``: the ``StrategyCall`` RPC, JSON in and out), e.g. the
  checkpointing baselines' ``save`` and ``restore`` at a step boundary.

Strategies are found by name through the ``ecrec.strategies`` entry-point group
(``ecrec.strategies.registry``), so ``baselines/`` adds its own without touching the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from ecrec.server import DenseShard, ServerState, TableShard


class Completion(Protocol):
    """Something the server waits on before acknowledging a push."""

    def result(self, timeout: float | None = None) -> object: ...


class FaultToleranceStrategy:
    """Base class; the default of every hook does nothing."""

    name: ClassVar[str] = "?"
    #: whether the old payload bytes of updated rows must be captured for ``on_update``
    needs_old_payload: ClassVar[bool] = False
    #: whether a promoted replacement rebuilds every row itself (then its tables skip initial values)
    rebuilds_rows: ClassVar[bool] = False
    #: seconds between ``on_timer`` calls (None: never)
    timer_interval_s: float | None = None

    # --- cluster-level (coordinator side: no instance) ---------------------------------------------
    @classmethod
    def layout_params(cls, num_servers: int, k: int, m: int, options: dict) -> tuple[int, int, dict]:
        """Validates the user's ``k``, ``m`` and options; returns the layout's ``(k, m)`` and options.

        Strategies without parity spread rows round-robin: ``k = num_servers``, ``m = 0``.
        """
        if m:
            raise ValueError(f"strategy {cls.name!r} keeps no parity: do not pass --m")
        if options:
            raise ValueError(f"strategy {cls.name!r} takes no options, got {sorted(options)}")
        return num_servers, 0, {}

    # --- server side -----------------------------------------------------------------------------
    def __init__(self, server: "ServerState", options: dict):
        self.server = server
        self.options = dict(options)

    def on_table_created(self, shard: "TableShard") -> None:
        pass

    def on_dense_created(self, dense: "DenseShard") -> None:
        pass

    def begin_push(self, push_id: tuple[str, int]) -> None:
        """A push starts applying (pushes apply one at a time on a server, in this order)."""

    def on_update(
        self, shard: "TableShard", ids: np.ndarray, slots: np.ndarray, old: np.ndarray | None, new: np.ndarray
    ) -> Completion | None:
        """``old``/``new``: ``(len(slots), row_bytes)`` uint8 payloads (``old`` None unless needed)."""
        return None

    def on_dense_update(self, dense: "DenseShard", old: np.ndarray | None, new: np.ndarray) -> Completion | None:
        return None

    def end_push(self) -> Completion | None:
        """Every update of the push was applied locally; what to wait for before acknowledging it."""
        return None

    def ensure_rows(self, items: "list[tuple[TableShard, np.ndarray]]") -> None:
        """Called with ``(shard, slots)`` of every table a request touches, before the rows are read or
        updated: a recovering server rebuilds them first."""

    def ensure_dense(self, dense: "DenseShard") -> None:
        """Called before a dense tensor is read or updated."""

    def handle_rpc(self, method: str, request, context):
        """Strategy-specific RPCs (``ApplyParity``, ``ResolveSource``, ``ReadRows``)."""
        raise NotImplementedError(f"strategy {self.name!r} does not serve {method}")

    def on_timer(self) -> None:
        pass

    def on_recovery(self, failed_index: int) -> bool:
        """This server was just promoted to hold ``failed_index``; tables exist with initial values.

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
