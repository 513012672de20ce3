"""Resolution of a failed owner's in-flight pushes: which stand (rolled forward) and which are undone.

Run by the replacement of failed index ``f`` before it serves (``docs/protocol.md``, "A failed owner").  Every live
server closes ``f``'s chain (later batches of that incarnation are refused) and lists the batches of
``f`` it applied.  ``f``'s pushes are numbered consecutively; the *kept* pushes are the longest prefix
in which every push is confirmed or applied at every surviving destination that received it from
``f``: the rebuilt rows include them, and their push ids join the replacement's applied pushes (a
worker's replay of one is answered "already applied").  Every later push is *undone* wherever it was
applied (XOR cancels, versions go back; newest first) and the workers' replay applies it once, in
their order.  A prefix, not every complete push: a later push may share rows with an earlier
incomplete one, and a row must never hold a later push without the earlier.  A destination is a
witness only while the server that received the batch still holds its index: a replacement promoted
since rebuilt its rows from data that held ``f``'s pushes, and ``f`` re-sent it the rest.

:func:`decide` is the rule, as a pure function; :class:`Resolver` runs the protocol over the peers.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ecrec import errors
from ecrec.net.cluster_map import live_servers
from ecrec.net.peers import PARITY
from ecrec.strategies.base import StrategyHost
from ecrec.wire import parity_pb2

log = logging.getLogger("ecrec.strategies.erasure")


@dataclass
class Decision:
    kept: list[tuple[str, int]] = field(default_factory=list)  # push ids that stand (logged ones)
    undo: list[int] = field(default_factory=list)  # sequences to undo everywhere
    committed: list[tuple[str, int]] = field(default_factory=list)  # push ids confirmed earlier
    kept_upto: int = 0  # every push of the failed incarnation up to this sequence stands


def decide(listings: dict[int, parity_pb2.ResolveSourceReply], current_ids: dict[int, str]) -> Decision:
    """The keep-or-undo rule.  ``listings``: each surviving server's answer; ``current_ids``: index ->
    server id of the server holding it now.  A logged batch covers consecutive pushes ``first_seq``..``seq``."""
    survivors = set(listings)
    confirmed = max((r.confirmed_upto for r in listings.values()), default=0)
    holders: dict[int, set[int]] = defaultdict(set)
    info: dict[int, parity_pb2.LoggedPush] = {}
    committed: set[tuple[str, int]] = set()
    for i, r in listings.items():
        for e in r.logged:
            holders[e.seq].add(i)
            info[e.seq] = e
        committed.update((c.worker, c.sequence) for c in r.committed)
    decision = Decision(committed=sorted(committed))
    if not info:
        return decision
    starts = {e.first_seq: e for e in info.values()}
    # the first push of this incarnation is (seq base | 1): every push from there on must be accounted for
    kept_upto = confirmed if confirmed else ((min(info) >> 32) << 32)
    while kept_upto + 1 in starts:
        e = starts[kept_upto + 1]
        needed = {d for d, sid in zip(e.destinations, e.destination_ids) if d in survivors and current_ids.get(d) == sid}
        if not needed <= holders[e.seq]:
            break
        kept_upto = e.seq
    for seq in sorted(info):
        ids = [(p.worker, p.sequence) for p in info[seq].push_ids]
        if seq <= kept_upto:
            decision.kept.extend(ids)
        else:
            decision.undo.append(seq)
    decision.kept_upto = kept_upto
    return decision


def embeddable(versions: np.ndarray, bounds) -> np.ndarray:
    """Which data versions a rebuilt parity row or dense replica may hold: those at or below their owner's
    confirmed bound (``ReadRowsReply.confirmed_upto``), which every resolution keeps.  A version above it may be
    undone if its owner fails, and a copy rebuilt from it would keep the push with no log entry to undo it by:
    the worker's replay would then apply it a second time."""
    return np.asarray(versions) <= np.asarray(bounds)


class Resolver:
    """Runs resolution from the replacement of a failed index (see the module docstring)."""

    def __init__(self, host: StrategyHost, options, counters):
        self.host = host
        self.options = options
        self.counters = counters

    def _ask_all(self, request, servers: list[int], deadline: float) -> dict[int, object]:
        """``request`` to every server in ``servers``, retried until each answers or the coordinator's map no
        longer lists it (it failed too); raises ``Unavailable`` at ``deadline`` naming those that did not."""
        host = self.host
        answers: dict[int, object] = {}
        todo = list(servers)
        pause, attempt = 0.05, 0
        while True:
            attempt += 1
            replies = host.peers.call_many([(i, "ResolveSource", request) for i in todo], PARITY, tolerate_errors=True)
            for i, reply in zip(todo, replies):
                if reply is not None:
                    answers[i] = reply
            host.refresh_map()
            live = live_servers(host.cluster_map)
            todo = [i for i in todo if i not in answers and i in live]
            if not todo:
                return answers
            if time.monotonic() > deadline:
                raise errors.Unavailable(f"resolution of a failed index: servers {todo} did not answer within "
                                         f"{self.options.resolve_deadline_s:.0f} s and are not declared failed")
            if attempt in (1, 10) or attempt % 50 == 0:
                log.warning("resolution: servers %s did not answer yet (attempt %d); retrying until %.0f s", todo,
                            attempt, self.options.resolve_deadline_s)
            time.sleep(pause)
            pause = min(1.0, pause * 1.5)

    def resolve(self, failed: int) -> list[tuple[str, int]]:
        """Lists, decides and commits; returns every push id that stands (kept and recently committed).

        Every live server must answer: one that is slow is waited for (it may hold a batch that decides
        what stands), not taken for failed; only the coordinator declares a server failed."""
        host = self.host
        deadline = time.monotonic() + self.options.resolve_deadline_s
        live = live_servers(host.cluster_map)
        peers = [i for i in live if i != host.index]
        request = parity_pb2.ResolveSourceRequest(source=failed, replacement_id=host.server_id)
        listings = self._ask_all(request, peers, deadline)
        current = {i: s.server_id for i, s in live_servers(host.cluster_map).items()}
        decision = decide(listings, current)
        commit = parity_pb2.ResolveSourceRequest(source=failed, commit=True, undo_seqs=decision.undo,
                                                 replacement_id=host.server_id)
        self._ask_all(commit, list(listings), deadline)
        self.counters["resolved_kept"] = len(decision.kept)
        self.counters["resolved_undone"] = len(decision.undo)
        log.info("resolved index %d: %d logged pushes kept (up to seq %d), %d undone (%d servers)", failed,
                 len(decision.kept), decision.kept_upto, len(decision.undo), len(listings))
        return decision.kept + decision.committed
