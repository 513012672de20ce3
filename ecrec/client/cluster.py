"""The client SDK: what a PyTorch training loop uses to train against an ECRec cluster.

    cluster = Cluster.connect("127.0.0.1:7000")
    cluster.create_table("user", num_rows=1_000_000, dim=64, optimizer="adagrad", lr=0.05, seed=1)
    emb = EmbeddingBag(cluster, "user", mode="sum")          # like torch.nn.EmbeddingBag
    cluster.register_dense(mlp, optimizer="sgd", lr=0.1)     # the MLP lives on the servers too
    for batch in data:
        loss = loss_fn(mlp(emb(batch.indices, batch.offsets)), batch.labels)
        loss.backward()
        cluster.step()                                       # push every gradient; servers apply them

Rows are pulled from the server that owns them (``ecrec.coding.layout``); backward
records the gradient of every pulled row; ``step`` sends one push per server
carrying every table's rows and the dense gradients it is primary for, and
returns when the servers have applied them.  When a server fails, calls report
it to the coordinator, follow the map to the replacement and retry with the
same push id, so a push is applied exactly once and the loop sees no exception.
"""

from __future__ import annotations

import atexit
import functools

import json
import logging
import math
import multiprocessing
import multiprocessing.util
import operator
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from ecrec import errors
from ecrec.net import transport
from ecrec.net.cluster_map import live_address, live_servers
from ecrec.config import MAX_SECONDS, ClientConfig
from ecrec.client import dense_state, termination
from ecrec.client.courier import Courier
from ecrec.client.keeper import IdleKeeper
from ecrec.client.rows import RowIO
from ecrec.client.steps import ClusterError, StepPartlyApplied, bad_gradients, bad_step, collect, merge_lookups
from ecrec.coding.layout import Layout
from ecrec.net.security import tls_hint
from ecrec.net.peers import BUSY_RETRY_S, BusyWait, CoordinatorClient, PeerError, Peers, PeerUnreachable
from ecrec.tables import optim
from ecrec.tables.spec import INITS, DenseSpec, TableSpec
from ecrec.tables.values import check_values
from ecrec.wire import cluster_pb2, coordinator_pb2, embedding_pb2

log = logging.getLogger("ecrec.client")

#: a string ``init`` of ``create_table`` ending so (or holding a ``/``) is a warm start's file
WARM_START_SUFFIXES = (".npy", ".pt", ".pth")


#: how long a background poll (``poll_indices``) retries one server before it counts as failed (s)
POLL_RETRY_S = 10.0


#: recorded lookups are looked through for dead ones (outputs dropped, no gradient) once this many are pending
PRUNE_PENDING_AT = 64


@dataclass(eq=False)
class _Pending:
    """A lookup's pulled rows, waiting for their gradient: held weakly (a lookup whose output was dropped, an
    evaluation loop with autograd on, frees them as torch does), strongly once a backward accumulated a gradient
    into them (``rows``), until a step pushes it or ``zero_grad`` drops it."""

    table: str
    ids: np.ndarray
    rows: torch.Tensor | None  # the rows, once they hold a gradient
    lookups: np.ndarray | None = None  # per id: how many times the batch looked it up
    ref: weakref.ref | None = None  # the rows, while no gradient reached them
    done: bool = False  # pushed: a later backward (retain_graph) is not this lookup's any more

    def tensor(self) -> torch.Tensor | None:
        return self.rows if self.rows is not None else (self.ref() if self.ref is not None else None)

    def got_gradient(self, rows: torch.Tensor) -> None:
        if not self.done:
            self.rows = rows


@dataclass(frozen=True)
class Replacement:
    """A server index that moved to a new process (a failure this client has seen)."""

    index: int
    old_address: str
    new_address: str
    epoch: int
    wall_time: float


#: this process's clients not closed yet (weakly: a client dropped is not kept alive by it), closed at exit
_OPEN_CLIENTS: "weakref.WeakSet[Cluster]" = weakref.WeakSet()
#: how long the exit waits for confirmations before it says that it waits (s)
EXIT_QUIET_S = 1.0


def _open_clients() -> list["Cluster"]:
    """This process's clients not closed yet (not those a forked child inherited from its parent)."""
    return [c for c in list(_OPEN_CLIENTS) if not c._closed and c._pid == os.getpid()]


def _close_at_exit() -> None:
    """Closes every client this process leaves open.  Those holding unconfirmed pushes first wait, each on a thread
    of its own and all until one deadline (the longest of their ``confirm_at_exit_s``), for their pushes to be
    confirmed, as ``close()`` does: a script that ended after its last ``step()`` without ``close()`` left its
    acknowledged pushes to their owners alone, and one failing in the next moments lost them, with no worker
    left to replay them.  The deadline is kept whatever the calls do (a wait still going on is abandoned with
    its daemon thread); a wait of more than :data:`EXIT_QUIET_S` is said, once; Ctrl-C ends it.  (Registered
    again at each client's creation: it runs before the exit handlers registered earlier, such as the
    ``LocalCluster`` a script started its cluster with.)"""
    termination.note_exiting()
    clients = _open_clients()
    waiting = [c for c in clients if c.config.confirm_at_exit_s > 0 and c.courier.unconfirmed()]
    try:
        if waiting:
            _wait_confirmed_at_exit(waiting)
    except KeyboardInterrupt:
        log.warning("exit: stopped waiting for confirmations (interrupted)")
    finally:
        for cluster in clients:
            try:
                cluster.close(confirm_timeout_s=0)  # a push still unconfirmed is logged by name
            except BaseException as exc:  # noqa: BLE001 - one client's failure does not keep the others open
                log.warning("worker %s: closing at exit failed: %s", cluster.worker, exc)
        termination.end_if_terminating()  # a SIGTERM came meanwhile: the process ends by it, as it would have


def _wait_confirmed_at_exit(clients: list["Cluster"], deadline: float | None = None, say: bool = True) -> None:
    """Waits for the pushes of ``clients``, each on a thread of its own, until ``deadline`` (default: the longest
    of their ``confirm_at_exit_s`` from now); ``say``: a wait of more than :data:`EXIT_QUIET_S` is logged."""
    start = time.monotonic()
    if deadline is None:
        deadline = start + max(c.config.confirm_at_exit_s for c in clients)

    def wait(cluster: "Cluster") -> None:
        try:
            cluster.wait_confirmed(cluster.config.confirm_at_exit_s)
        except Exception as exc:  # noqa: BLE001 - what is left unconfirmed is logged when it is closed
            log.debug("worker %s: waiting for confirmations at exit: %s", cluster.worker, exc)

    threads = []
    for cluster in clients:
        t = threading.Thread(target=wait, args=(cluster,), name="ecrec-exit-confirm", daemon=True)
        t.start()
        threads.append(t)
    said = False
    for t in threads:
        while t.is_alive() and time.monotonic() < deadline:
            if say and not said and time.monotonic() >= start + EXIT_QUIET_S:
                said = True
                held = sum(c.courier.unconfirmed() for c in clients)
                log.warning("exiting without close(): waiting up to %.0f s more for %d unconfirmed pushes of worker(s) "
                            "%s to be confirmed (an owner failing after this process is gone would lose them; "
                            "Ctrl-C stops the wait)", deadline - time.monotonic(), held,
                            ", ".join(sorted(c.worker for c in clients)))
            t.join(min(0.1, max(0.0, deadline - time.monotonic())))


def _exit_handlers() -> None:
    """(Re-)registers :func:`_close_at_exit`: last registered, it runs first.  In a child of ``multiprocessing``
    started by fork, which ends without running exit handlers, it runs among the child's finalizers."""
    atexit.unregister(_close_at_exit)
    atexit.register(_close_at_exit)
    if multiprocessing.parent_process() is not None and os.getpid() not in _FINALIZERS:
        _FINALIZERS.add(os.getpid())
        multiprocessing.util.Finalize(None, _close_at_exit, exitpriority=100)


_FINALIZERS: set[int] = set()

#: the most ids one ``Pull`` of :meth:`Cluster.pull_many` names (a server refuses more than
#: ``--max-ids-per-request``, 1 << 22 by default)
PULL_IDS = 1 << 21
#: and the most bytes of rows its reply carries (the default message limit is 256 MiB)
PULL_BYTES = 64 << 20
#: an upper bound on the bytes of one field's tag and length in a push request (and of a number field); a table's
#: entry with megabytes of gradients measured 17-18 over its contents
PUSH_FIELD_BYTES = 24
#: room a push leaves for the watermarks that arrive between its check and its send (``Courier.ack_bytes``
#: counts those already waiting), at most this share of the message limit
ACK_ROOM_SHARE = 1 / 64


def _pull_rounds(per_server: dict[int, list], max_ids: int, max_bytes: int) -> list[dict[int, list]]:
    """``{server: [(table, spec, ids, positions)]}`` cut into rounds of requests that each fit: at most ``max_ids``
    ids, ``max_bytes`` of rows in the reply and of ids in the request (8 bytes each) per request; round ``r`` holds
    every server's ``r``-th piece.  One round when everything fits, as it does for a training batch."""
    max_ids = max(1, min(max_ids, max_bytes // 8))
    if all(sum(len(pos) for *_, pos in parts) <= max_ids and
           sum(len(pos) * 4 * spec.dim for _, spec, _, pos in parts) <= max_bytes for parts in per_server.values()):
        return [per_server] if per_server else []
    pieces: dict[int, list[list]] = {}
    for i, parts in per_server.items():
        current, ids_in, bytes_in = [], 0, 0
        out = pieces.setdefault(i, [])
        for name, spec, ids, pos in parts:
            row_bytes = 4 * spec.dim
            start = 0
            while start < len(pos):
                fit = min(max_ids - ids_in, (max_bytes - bytes_in) // row_bytes, len(pos) - start)
                if fit <= 0:
                    if not current:  # a row larger than a message: one at a time (the server says what is wrong)
                        fit = 1
                    else:
                        out.append(current)
                        current, ids_in, bytes_in = [], 0, 0
                        continue
                current.append((name, spec, ids, pos[start:start + fit]))
                ids_in, bytes_in = ids_in + fit, bytes_in + fit * row_bytes
                start += fit
        if current:
            out.append(current)
    return [{i: p[r] for i, p in pieces.items() if r < len(p)} for r in range(max((len(p) for p in pieces.values()),
                                                                                   default=0))]


def _open(method):
    """A method of a :class:`Cluster` that talks to the cluster: refused, naming why, once the client is closed (its
    channels were shut: some calls failed with gRPC's raw ValueError, others quietly reopened a channel and pushed)."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if self._closed:
            raise ClusterError(f"this client (worker {self.worker}) is closed: connect again with Cluster.connect")
        return method(self, *args, **kwargs)
    return guarded


#: what an UNAVAILABLE from the coordinators says when none can make a change now (a leader being elected, a
#: coordinator restarting or stopping) rather than why the change failed
COORDINATOR_AWAY = ("retry", "failed to connect", "Connection refused", "Socket closed", "does not lead",
                    "no coordinator leads")


#: how the coordinator starts refusing a change while a server index has no live holder (a failover under way)
NOT_READY = "cluster not ready"


class ClusterDataLoss(ClusterError):
    """A server answered DATA_LOSS: more than m servers of some stripe failed, and rows (or pushes this worker
    holds for them) cannot be rebuilt.  Training on this cluster cannot go on whole: restore the last snapshot."""


#: what a DATA_LOSS tells the training loop to do
DATA_LOSS_REMEDY = (". The cluster lost data (more than m servers of a stripe failed): restore the last snapshot -- "
                    "onto a new cluster: ecrec-server local/coordinator --restore PATH, or "
                    "Cluster.load(ecrec.snapshot.latest(DIR)) -- and train on from it")


class StepDataLoss(StepPartlyApplied, ClusterDataLoss):
    """A step some of whose parts met DATA_LOSS (servers failed between its pull and its push): partly applied,
    and the cluster lost data."""

    def __init__(self, step: int, applied: dict[int, int], refused: dict[int, str]):
        super().__init__(step, applied, refused)
        self.args = (self.args[0] + DATA_LOSS_REMEDY,)


def _cluster_error(exc: Exception) -> ClusterError:
    """What a failed call raises to the training loop: a DATA_LOSS says what to do about it."""
    if isinstance(exc, PeerError) and exc.code == grpc.StatusCode.DATA_LOSS:
        return ClusterDataLoss(f"{exc}{DATA_LOSS_REMEDY}")
    return ClusterError(str(exc))


def _whole(value, table: str, what: str, call: str = "create_table") -> int:
    """A size or seed given to create_table as an int: 10.9 rows made a table of 10 before, "12" one of 12."""
    if not isinstance(value, (bool, np.bool_, str, bytes)):
        try:
            return operator.index(value)  # int, a numpy integer, a 0-d integer tensor or array
        except TypeError:
            pass
        try:
            number = float(value)  # a float, or a 0-d float tensor or array, that is whole
        except (TypeError, ValueError):
            number = math.nan
        if number.is_integer():
            return int(number)
    raise ValueError(f"{call} {table!r}: {what} must be a whole number, got {value!r}")


def _indices(indices, n: int, call: str) -> list[int]:
    """Server indices a caller named, checked: each an integer in ``range(n)`` (one past it waited two minutes for a
    server that cannot come, after the call had run on the others)."""
    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
        raise TypeError(f"{call}: indices must be a list of server indices, not {indices!r}")
    out = []
    for i in indices:
        if isinstance(i, (bool, np.bool_)):
            raise TypeError(f"{call}: a server index is an integer, not {i!r}")
        try:
            i = operator.index(i)  # an int, a numpy integer, a 0-d integer tensor
        except TypeError:
            raise TypeError(f"{call}: a server index is an integer, not {i!r}") from None
        if not 0 <= i < n:
            raise ValueError(f"{call}: server index {i} is not one of this cluster's (0 to {n - 1})")
        out.append(i)
    return out


def _not_a_number(value) -> bool:
    """A string, a bool or anything float() does not take (a string or a bool is no learning rate)."""
    return isinstance(value, (bool, np.bool_, str, bytes)) or not hasattr(type(value), "__float__")


def _real(value, table: str, what: str) -> float:
    if _not_a_number(value):
        raise ValueError(f"create_table {table!r}: {what} must be a number, got {value!r}")
    return float(value)


class Cluster:
    """A connection to one ECRec cluster (coordinator plus embedding servers).

    One class, the SDK's one handle: every call shares its map, its push ids and its courier (what the worker
    holds until its owners confirm it), so a pull, a push and a replay stay in one order.  What needs none of that
    state lives beside it: the ``torch.nn`` modules (``ecrec.client.modules``), bulk row reads and writes
    (``ecrec.client.rows``), the checks of written values (``ecrec.tables.values``)."""

    def __init__(self, address: str, config: ClientConfig | None = None, worker: str | None = None):
        if isinstance(address, (list, tuple)):  # the coordinators' addresses, as a list or comma-separated
            address = ",".join(address)
        if not isinstance(address, str) or not address.strip():
            error = TypeError if not isinstance(address, str) else ValueError  # an empty string: a wrong value
            raise error(f"Cluster: address must be a coordinator's host:port (or several, a list or "
                        f"comma-separated), not {address!r}")
        if worker is not None and not isinstance(worker, str):
            raise TypeError(f"Cluster: worker must be a name (str), not {type(worker).__name__}")
        problem = transport.worker_name_problem(worker) if worker is not None else None
        if problem:  # refused here, not at the first push
            raise ValueError(f"Cluster: worker name {worker!r} {problem}")
        self.config = config or ClientConfig()
        if worker is not None and len(worker.encode()) > self.config.max_worker_name_bytes:
            raise ValueError(f"Cluster: worker name {worker[:40]!r}... is {len(worker.encode())} bytes (UTF-8), longer "
                             f"than {self.config.max_worker_name_bytes} (ClientConfig.max_worker_name_bytes, as the "
                             "servers' --max-worker-name-bytes): every push would be refused")
        self.address = address
        self.worker = worker or f"worker-{uuid.uuid4().hex[:12]}"
        # this process (a restarted worker with the same name is another); 128 random bits, a secret: it goes to
        # the servers only, which keep and relay a hash of it (ecrec.strategies.base.push_key)
        self.incarnation = uuid.uuid4().hex
        self._closed = False
        self._lock = threading.RLock()
        self._replaying: dict[int, threading.Lock] = {}  # index -> held while this worker replays its pushes there
        self.coordinator = CoordinatorClient(address, self.config.rpc_timeout_s, self.config.max_message_bytes,
                                             on_map=self._adopt, security=self.config.security)
        self._coordinator = self.coordinator.stub
        self.peers = Peers(lambda: self.map, self.coordinator, timeout_s=self.config.rpc_timeout_s,
                           retry_deadline_s=self.config.retry_deadline_s,
                           max_message_bytes=self.config.max_message_bytes, security=self.config.security,
                           watch_stalls=True)
        self.courier = Courier()
        if self.config.idle_poll_s < 0:
            raise ValueError(f"idle_poll_s must be >= 0 (0: no background polls), not {self.config.idle_poll_s}")
        self._keeper = IdleKeeper(self, self.config.idle_poll_s)
        self.steps_done = 0  # step() calls that returned
        self._periodic = None  # snapshot_every's schedule
        self._snapshot_bases: dict[str, int] = {}  # snapshot_every's numbering, per directory (set again: goes on)
        #: the gradient (float32, flattened) the last acknowledged step() pushed to each dense tensor: a checkpoint
        #: driver keeps the dense parameters from these (CPR keeps them on its trainers)
        self.last_dense_grads: dict[str, np.ndarray] = {}
        #: rows written by assignments (write_rows: warm starts, loads) and dense payloads written (write_dense),
        #: acknowledged: not gradients, yet a checkpointing strategy counts their rows as updates its state
        #: reflects (``baselines.driver`` adds them to what it was acknowledged)
        self.rows_assigned = 0
        self.dense_assigned = 0
        #: per table, the ids the last acknowledged step() updated and how many lookups of the batch each had
        #: (what a sample-weighted count of lost updates weighs them by); counted only while ``count_lookups``
        #: is set (a checkpoint driver sets it), so that the pull path pays nothing otherwise
        self.last_lookups: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.count_lookups = False
        self._pending: list[_Pending] = []
        self._prune_at = PRUNE_PENDING_AT  # the length of _pending at which dead lookups are dropped next
        self._dense: dict[str, torch.nn.Parameter] = {}
        self._sequence = 0
        self.map: cluster_pb2.ClusterMap | None = None
        self.layout: Layout | None = None
        self.replacements: list[Replacement] = []  # servers this client saw replaced, oldest first
        self._last_live: dict[int, str] = {}
        self._live_ids: dict[int, str] = {}  # index -> the server id serving it in the newest map
        self._stats = {"pushes": 0, "push_bytes": 0, "pull_bytes": 0, "snapshot_failures": 0,
                       "steps_partly_applied": 0}
        self._rows = RowIO(self)
        self._pid = os.getpid()
        self._push_gate = termination.PushGate()  # closed by a SIGTERM's wait (ecrec.client.termination)
        _OPEN_CLIENTS.add(self)
        _exit_handlers()
        if self.config.exit_on_sigterm and self.config.confirm_at_exit_s > 0:
            termination.install(_open_clients, functools.partial(_wait_confirmed_at_exit, say=False))

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc_info) -> None:
        """``with Cluster.connect(...) as cluster:`` closes it at the end of the block, as ``close()`` does."""
        self.close()

    @property
    def stats(self) -> dict:
        """Pushes made, calls retried after a failure, bytes pushed and pulled."""
        return self._stats | {"retries": self.peers.retries, "replayed": self.courier.stats["replayed"],
                              "unconfirmed_pushes": self.courier.unconfirmed()}

    @classmethod
    def connect(cls, address: str, config: ClientConfig | None = None, worker: str | None = None,
                wait_ready_s: float = 60.0, on_wait=None) -> "Cluster":
        """Connects and waits (up to ``wait_ready_s``, each poll of the coordinator at most 5 s of it) until every
        server index is served; ``on_wait(text)``, if given, hears what it waits for every few seconds (else it is
        logged once, as a warning), and the error at the deadline says it too.  A client that gives up closes what
        it opened."""
        if isinstance(wait_ready_s, bool) or not isinstance(wait_ready_s, (int, float)) or \
                not (0 <= wait_ready_s <= MAX_SECONDS or wait_ready_s == math.inf):  # NaN waited for ever unasked
            raise ValueError(f"Cluster.connect: wait_ready_s must be a number of seconds from 0 to {MAX_SECONDS:g} "
                             f"(or math.inf: for ever), not {wait_ready_s!r}")
        cluster = cls(address, config, worker)
        address = cluster.address  # a list joined
        start = time.monotonic()
        deadline, next_word = start + wait_ready_s, start + 5.0
        warn_at = None if on_wait is not None else start + min(5.0, wait_ready_s / 2)  # said once, logged
        try:
            while True:
                try:
                    left = max(0.05, deadline - time.monotonic())
                    cluster.coordinator.get_map(timeout_s=min(cluster.config.rpc_timeout_s, left, 5.0))  # adopted
                    if cluster.map.ready:
                        return cluster
                    why = f"{len(live_servers(cluster.map))} of {cluster.map.num_servers} server indices served"
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise ClusterError(f"coordinator {address}: {exc.details()}") from None
                    why = (f"the coordinator does not answer ({exc.details()})"
                           f"{tls_hint(exc, cluster.config.security)}")
                now = time.monotonic()
                if now >= deadline:
                    raise ClusterError(f"cluster at {address} not ready after {wait_ready_s:g} s: {why}")
                text = f"waiting for the cluster at {address} ({now - start:.0f} of {wait_ready_s:g} s): {why}"
                if on_wait is not None and now >= next_word:
                    on_wait(text)
                    next_word = now + 5.0
                if warn_at is not None and now >= warn_at:  # no on_wait: a wrong address is not a silent minute
                    log.warning("%s; still waiting (Cluster.connect's wait_ready_s)", text)
                    warn_at = None
                time.sleep(min(0.1, max(0.0, deadline - now)))
        except BaseException:
            cluster.close(confirm_timeout_s=0)  # nothing pushed yet: its channels and threads go
            raise

    # --- the map ---------------------------------------------------------------------------------
    @_open
    def refresh_map(self) -> cluster_pb2.ClusterMap:
        return self.coordinator.get_map()

    def _adopt(self, m: cluster_pb2.ClusterMap) -> None:
        with self._lock:
            if self.map is None or m.epoch >= self.map.epoch:
                self.map = m
                self.layout = Layout(m.num_servers, m.k, m.m)
                self._live_ids = {i: s.server_id for i, s in live_servers(m).items()}
                for index in range(m.num_servers):  # compare with the last live address seen, across FAILED maps
                    before, after = self._last_live.get(index), live_address(m, index)
                    if after is None:
                        continue
                    if before is not None and before != after:
                        self.replacements.append(Replacement(index, before, after, m.epoch, time.time()))
                    self._last_live[index] = after

    def _call(self, index: int, method: str, request):
        """Calls ``method`` on the server at ``index``; follows failures to the replacement and retries."""
        self._keeper.called()
        try:
            return self.peers.call(index, method, request, prepare=self._replay_if_replaced)
        except (PeerError, PeerUnreachable) as exc:
            raise _cluster_error(exc) from None

    def _fan_out(self, method: str, requests: dict[int, object], collect: bool = False) -> dict[int, object]:
        """One request per server index in parallel; a call whose server is gone follows the map to the
        replacement and retries the same request (same push id).  ``collect``: a server's error status is
        returned in its place (a ``PeerError``) once every call ended, instead of raised."""
        self._keeper.called()
        try:
            return self.peers.fan_out(method, requests, prepare=self._replay_if_replaced, collect=collect)
        except (PeerError, PeerUnreachable) as exc:
            raise _cluster_error(exc) from None

    @_open
    def poll_indices(self, indices, give_up=None, deadline: float | None = None) -> int:
        """Pulls, from each server index of ``indices``, one thing it serves -- the first row it owns of any table,
        else a dense tensor it holds -- for the courier's sake only (relays out, confirmations back, held pushes
        replayed to an owner's replacement; the idle keeper and :meth:`wait_confirmed`).  Returns how many
        indices it reached (an index that serves nothing yet cannot be asked).  ``deadline`` (``time.monotonic()``):
        no call or retry outlasts it."""
        with self._lock:
            m, layout = self.map, self.layout
        if m is None or layout is None:
            return 0
        left = set(indices)
        tables: dict[int, list] = {}
        for t in m.tables:  # a table smaller than a stripe per server has rows on some indices only
            if not left:
                break
            ids = np.arange(min(t.num_rows, layout.num_servers * layout.k), dtype=np.int64)
            owners, _ = layout.locate(ids)
            for index in list(left):
                found = np.flatnonzero(owners == index)
                if len(found):
                    tables[index] = [embedding_pb2.TableIds(table=t.name, ids=transport.ids_to_bytes(ids[found[:1]]))]
                    left.discard(index)
        dense: dict[int, list[str]] = {}
        for d in m.dense:  # pushes of dense gradients only go to their primaries, which hold them
            for index in list(left):
                if index in layout.dense_servers(d.name):
                    dense[index] = [d.name]
                    left.discard(index)
        requests_by_server = {i: embedding_pb2.PullRequest(tables=tables.get(i, []), dense=dense.get(i, []),
                                                           epoch=m.epoch) for i in set(tables) | set(dense)}
        self._poll(requests_by_server, give_up, deadline)
        return len(requests_by_server)

    def _poll(self, requests_by_server: dict, give_up=None, deadline: float | None = None) -> None:
        for i, request in requests_by_server.items():  # one index at a time, each retried for a short while only:
            self._attach(i, request)                   # a cluster that is gone must not hold a poll for minutes
            retry_s = min(self.config.retry_deadline_s, POLL_RETRY_S)
            timeout_s = None
            if deadline is not None:  # a caller's own bound (close's confirm_timeout_s): no call outlasts it
                left = max(0.05, deadline - time.monotonic())
                retry_s, timeout_s = min(retry_s, left), min(self.config.rpc_timeout_s, left)
            try:
                reply = self.peers.call(i, "Pull", request, retry_deadline_s=retry_s, give_up=give_up,
                                        timeout_s=timeout_s,
                                        prepare=functools.partial(self._replay_if_replaced, retry_deadline_s=retry_s))
            except (PeerError, PeerUnreachable) as exc:
                raise _cluster_error(exc) from exc  # the cause says which (wait_confirmed retries one)
            self.courier.received(i, reply)

    def _replay_if_replaced(self, index: int, retry_deadline_s: float | None = None) -> None:
        """Before anything goes to ``index``: if a new incarnation serves it, replays this worker's pushes the
        old one acknowledged and did not confirm, in order, with their push ids (``ecrec.client.courier``),
        retrying for up to ``retry_deadline_s`` (the client's own by default)."""
        if not self.courier.held_elsewhere(index, self._live_ids.get(index)):
            return
        # one replay of an index at a time: the step's call and the idle keeper's poll may both find the pushes held
        # (the second then finds them replayed, not sent twice)
        with self._replaying.setdefault(index, threading.Lock()):
            self._replay_held(index, retry_deadline_s)

    def _replay_held(self, index: int, retry_deadline_s: float | None) -> None:
        retry_s = self.config.retry_deadline_s if retry_deadline_s is None else retry_deadline_s
        deadline = time.monotonic() + retry_s
        said, busy = None, BusyWait()  # what was last logged; a server's busy answers
        while True:
            with self._lock:
                live = live_servers(self.map).get(index) if self.map is not None else None
            todo = self.courier.to_replay(index, live.server_id) if live is not None else []
            if not todo:
                return
            if said != live.server_id:  # once, not at every retry of a busy server (every 10 ms) or every round
                said = live.server_id
                log.warning("server index %d is served by a new process: replaying %d unconfirmed pushes", index,
                            len(todo))
            # in order, as many as one request holds (the server counts the ids of all of them against
            # --max-ids-per-request, and the message limit is gRPC's): the rest go in the next rounds
            request, ids, nbytes = embedding_pb2.ReplayRequest(), 0, 0
            for _, held in todo:
                push = embedding_pb2.PushRequest()
                push.CopyFrom(held)
                push.ClearField("relay")
                push.ClearField("acks")
                push.replay = True
                more_ids = sum(len(t.ids) // 8 for t in push.tables)
                more_bytes = push.ByteSize() + PUSH_FIELD_BYTES
                if request.pushes and (ids + more_ids > self.config.max_ids_per_request
                                       or nbytes + more_bytes > self.config.max_message_bytes):
                    break
                request.pushes.append(push)
                ids, nbytes = ids + more_ids, nbytes + more_bytes
            todo = todo[:len(request.pushes)]
            try:  # at this incarnation only: a replay must not continue at another one midway
                reply = self.peers.stub(live.address).Replay(request, timeout=self.config.rpc_timeout_s)
            except grpc.RpcError as exc:
                now = time.monotonic()
                if exc.code() == grpc.StatusCode.ABORTED and now < deadline:  # busy for a moment
                    busy.note(index, live.address, "Replay", exc.details(), deadline - now)
                    time.sleep(BUSY_RETRY_S)
                    continue
                busy.reset()
                if not transport.is_unavailable(exc):  # that index's answer (a step's other parts may be applied)
                    raise PeerError(index, live.address, "Replay", exc.code(),
                                    f"replaying {len(todo)} pushes: {exc.details()}") from None
                self.peers.report(live.address, f"Replay: {exc.code().name}")
                if time.monotonic() > deadline:
                    raise PeerUnreachable(f"server index {index} unreachable and not replaced within "
                                          f"{retry_s:.0f} s while replaying pushes") from None
                time.sleep(0.05)
                continue  # start over at whatever serves the index now
            for (key, _), push_reply in zip(todo, reply.replies):
                self.courier.replayed(index, key, push_reply)

    # --- tables ----------------------------------------------------------------------------------
    @_open
    def create_table(self, name: str, num_rows: int, dim: int, optimizer: str = "sgd", lr: float = 0.01,
                     eps: float = 1e-10, initial_accumulator_value: float = 0.0, init="uniform",
                     init_scale: float = 0.0, seed: int = 0, on_progress=None) -> TableSpec:
        """Creates a table on every server (idempotent for the same spec).

        ``init``: ``uniform``, ``normal`` or ``zeros`` (drawn on the servers from ``seed``), ``blank`` (every
        float zero, the optimizer state too, nothing computed: for a table whose every row is written next, as
        a restore does), or pretrained rows
        (a warm start): a tensor or array ``(num_rows, dim)``, or the path of a ``.npy`` file (read a push at
        a time) or a torch file.  A warm start creates a new table only (an existing one is refused: load
        into it with ``load_state_dict`` or :meth:`write_rows`) and writes the rows in pushes
        (``on_progress(rows, total)`` after each); its optimizer state starts at
        ``initial_accumulator_value``."""
        values = None
        if not isinstance(init, str) or (init not in INITS and ("/" in init or init.endswith(WARM_START_SUFFIXES))):
            from ecrec.client.warm_start import load_values

            shape_only = TableSpec(name=name, num_rows=_whole(num_rows, name, "num_rows"),
                                   dim=_whole(dim, name, "dim"), optimizer=optimizer,
                                   initial_accumulator_value=float(initial_accumulator_value)).validate()
            values = load_values(init, shape_only)
            if any(t.name == name for t in self.refresh_map().tables):
                raise ClusterError(f"create_table {name!r}: the table exists; a warm start creates a new table "
                                   "(load into an existing one with load_state_dict or Cluster.write_rows)")
            init = "zeros"
        spec = TableSpec(name=name, num_rows=_whole(num_rows, name, "num_rows"), dim=_whole(dim, name, "dim"),
                         optimizer=optimizer, lr=_real(lr, name, "lr"), eps=_real(eps, name, "eps"),
                         initial_accumulator_value=_real(initial_accumulator_value, name, "initial_accumulator_value"),
                         init=init, init_scale=_real(init_scale, name, "init_scale"),
                         seed=_whole(seed, name, "seed")).validate()
        if values is not None:  # every value checked before the table exists
            check_values(spec, values)
        m = self._coordinator_call("CreateTable", spec.to_proto(), f"create_table {name!r}")
        self._adopt(m)
        if values is not None:
            self.write_rows(name, np.arange(spec.num_rows), values, on_progress=on_progress, checked=True)
        return spec

    def _coordinator_call(self, method: str, request, what: str):
        """A change the coordinator makes (create a table, register a dense tensor: both idempotent), retried for
        up to ``retry_deadline_s`` while it cannot be made now -- the leader died and the next is being elected,
        the one coordinator is restarting, or a server index has no live holder until its standby is promoted
        ("cluster not ready") -- as calls to servers are retried through their failover."""
        deadline = time.monotonic() + self.config.retry_deadline_s
        warned = False
        while True:
            try:
                return getattr(self._coordinator, method)(request, timeout=self.config.create_timeout_s)
            except grpc.RpcError as exc:
                details = exc.details() or ""
                away = exc.code() == grpc.StatusCode.UNAVAILABLE and any(s in details for s in COORDINATOR_AWAY)
                failing_over = exc.code() == grpc.StatusCode.FAILED_PRECONDITION and NOT_READY in details
                if not (away or failing_over) or time.monotonic() > deadline:
                    raise ClusterError(f"{what}: {exc.code().name}: {details}") from None
                if not warned:
                    log.warning("%s: the change cannot be made now (%s); retrying for up to %.0f s", what,
                                details.splitlines()[0][:200], deadline - time.monotonic())
                    warned = True
                time.sleep(0.2)

    def table_spec(self, name: str) -> TableSpec:
        for t in self.map.tables:
            if t.name == name:
                return TableSpec.from_proto(t)
        self.refresh_map()
        for t in self.map.tables:
            if t.name == name:
                return TableSpec.from_proto(t)
        raise KeyError(f"unknown table {name!r}")

    def _check_ids(self, name: str, ids) -> tuple[TableSpec, np.ndarray]:
        spec = self.table_spec(name)
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        ids = np.asarray(ids)
        if ids.size == 0:  # no ids (``[]`` is float64 to numpy): an empty result, nothing sent
            return spec, np.empty(0, dtype=np.int64)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"table {name!r}: ids must be integers, got {ids.dtype}")
        if ids.dtype.kind == "u" and ids.max() >= spec.num_rows:  # before int64 wraps 2**64 - 1 round to -1
            raise IndexError(f"table {name!r}: row id {int(ids.max())} out of range [0, {spec.num_rows})")
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= spec.num_rows):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise IndexError(f"table {name!r}: row id {bad} out of range [0, {spec.num_rows})")
        return spec, ids

    def _group_by_server(self, ids: np.ndarray):
        servers, _ = self.layout.locate(ids)
        order = np.argsort(servers, kind="stable")
        bounds = np.searchsorted(servers[order], np.arange(self.layout.num_servers + 1))
        return {i: order[bounds[i]:bounds[i + 1]] for i in range(self.layout.num_servers) if bounds[i + 1] > bounds[i]}

    def pull(self, name: str, ids) -> torch.Tensor:
        """Current weights of rows ``ids`` as a float32 tensor ``(n, dim)``: ``n`` ids, of any shape, taken in
        flattened order (``[]`` gives ``(0, dim)``)."""
        return self.pull_many({name: ids})[name]

    @_open
    def pull_many(self, requests: dict) -> dict[str, torch.Tensor]:
        """Rows of several tables at once (``{table: ids}``): one request per server for all of them, or, where a
        server's part would not fit in one request (:data:`PULL_IDS` ids or ``max_ids_per_request``,
        :data:`PULL_BYTES` bytes of rows or half of ``max_message_bytes``), a few in turn, each server's pieces
        alongside the others'."""
        checked = {name: self._check_ids(name, ids) for name, ids in requests.items()}
        out = {name: np.empty((len(ids), spec.dim), dtype=np.float32) for name, (spec, ids) in checked.items()}
        per_server: dict[int, list] = {}
        for name, (spec, ids) in checked.items():
            if len(ids):
                for i, pos in self._group_by_server(ids).items():
                    per_server.setdefault(i, []).append((name, spec, ids, pos))
        rounds = _pull_rounds(per_server, min(PULL_IDS, self.config.max_ids_per_request),
                              min(PULL_BYTES, self.config.max_message_bytes // 2))
        for parts_by_server in rounds:
            requests_by_server = {
                i: embedding_pb2.PullRequest(
                    tables=[embedding_pb2.TableIds(table=name, ids=transport.ids_to_bytes(ids[pos]))
                            for name, _, ids, pos in parts], epoch=self.map.epoch)
                for i, parts in parts_by_server.items()}
            for i, request in requests_by_server.items():
                self._attach(i, request)
            replies = self._fan_out("Pull", requests_by_server)
            for i, reply in replies.items():
                self.courier.received(i, reply)
            for i, parts in parts_by_server.items():
                for (name, spec, _, pos), data in zip(parts, replies[i].values):
                    self._stats["pull_bytes"] += len(data)
                    out[name][pos] = transport.bytes_to_floats(data, (len(pos), spec.dim))
        return {name: torch.from_numpy(rows) for name, rows in out.items()}

    def dense_spec(self, name: str) -> DenseSpec:
        for m in (self.map, self.refresh_map()):
            for d in m.dense:
                if d.name == name:
                    return DenseSpec.from_proto(d)
        raise KeyError(f"unknown dense tensor {name!r}")

    # --- rows and dense payloads in bulk (ecrec.client.rows) ----------------------------------------------------
    @_open
    def read_table(self, name: str, what: str = "weights", out: np.ndarray | None = None,
                   on_progress=None) -> np.ndarray:
        """Every row of table ``name`` as float32 ``(num_rows, width)`` in id order: its ``weights``, optimizer
        ``state`` or whole ``payload`` (:meth:`ecrec.client.rows.RowIO.read_table`)."""
        return self._rows.read_table(name, what, out, on_progress)

    @_open
    def read_rows(self, name: str, ids, what: str = "weights") -> np.ndarray:
        """Rows ``ids`` of table ``name`` in the order given (:meth:`ecrec.client.rows.RowIO.read_rows`)."""
        return self._rows.read_rows(name, ids, what)

    @_open
    def write_rows(self, name: str, ids, values, what: str = "weights", on_progress=None,
                   checked: bool = False) -> int:
        """Replaces rows ``ids`` of table ``name`` with ``values``, checked whole first; not a gradient: a load, a
        warm start (:meth:`ecrec.client.rows.RowIO.write_rows`).  Returns the rows written."""
        return self._rows.write_rows(name, ids, values, what, on_progress, checked)

    @_open
    def read_payload(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Every row of a table with its optimizer state: ``(ids, float32 (rows, row_floats))``, in id order."""
        return self._rows.read_payload(name)

    @_open
    def read_dense_payload(self, name: str) -> np.ndarray:
        """A dense tensor's payload (weights then optimizer state) from its primary."""
        return self._rows.read_dense_payload(name)

    @_open
    def write_dense(self, name: str, payload) -> None:
        """Replaces dense tensor ``name``'s whole payload, checked first (:meth:`ecrec.client.rows.RowIO.write_dense`)."""
        self._rows.write_dense(name, payload)

    @_open
    def save(self, path: str, on_progress=None, overwrite: bool = False) -> dict:
        """A snapshot of every table (weights and optimizer state) and dense tensor, in
        ``torch.distributed.checkpoint`` format, to ``path`` (a directory or an fsspec URL every server can
        reach), written by every server at once; returns its manifest.  A path holding a snapshot is refused
        unless ``overwrite``.  A consistent cut: the servers hold pushes at a moment no worker's step is half
        applied, also while workers train (``ecrec.snapshot.cut``).  See :mod:`ecrec.snapshot`."""
        from ecrec import snapshot

        if not isinstance(overwrite, (bool, np.bool_)):  # "false" was taken, and replaced the snapshot there
            raise ValueError(f"save: overwrite must be True or False, not {overwrite!r}")
        return snapshot.save(self, path, on_progress, overwrite=bool(overwrite))

    @_open
    def load(self, path: str, on_progress=None) -> dict:
        """Restores a snapshot written by :meth:`save` onto this cluster, whatever its shape (servers, k and m,
        strategy): missing tables are created, every tensor is checked against the manifest before anything is
        written.  See :mod:`ecrec.snapshot`."""
        from ecrec import snapshot

        return snapshot.load(self, path, on_progress)

    @_open
    def strategy_call(self, command: str, args: dict | None = None, indices: list[int] | None = None) -> dict[int, dict]:
        """Runs a strategy command on servers (all by default); returns each server's JSON result."""
        request = embedding_pb2.StrategyCallRequest(command=command, args_json=json.dumps(args or {}))
        n = self.layout.num_servers
        indices = range(n) if indices is None else _indices(indices, n, "strategy_call")
        replies = self._fan_out("StrategyCall", {i: request for i in indices})
        return {i: json.loads(r.result_json) for i, r in replies.items()}

    # --- dense parameters ------------------------------------------------------------------------
    @_open
    def register_dense(self, module: torch.nn.Module, optimizer: str = "sgd", lr: float = 0.01, eps: float = 1e-10,
                       initial_accumulator_value: float = 0.0, prefix: str = "") -> list[str]:
        """Moves ``module``'s parameters to the servers: the first worker's values win, every worker loads them.

        Afterwards ``step()`` pushes their gradients and loads the updated values; a value loaded into them with
        ``load_state_dict`` (``module``'s or a model's holding it) is written to the servers as it is loaded (their
        optimizer state is ``EmbeddingOptimizer``'s).
        """
        planned = []  # every parameter checked before the first is registered: all of them, or none
        reals = {}
        for what, value in (("lr", lr), ("eps", eps), ("initial_accumulator_value", initial_accumulator_value)):
            if _not_a_number(value):  # lr=True was a learning rate of 1.0, lr="0.1" taken: create_table refuses them
                raise ValueError(f"register_dense: {what} must be a number, got {value!r}; nothing registered")
            reals[what] = float(value)
        registered_as = {id(p): n for n, p in self._dense.items()}
        for pname, param in module.named_parameters():
            if not param.requires_grad:
                continue
            name = prefix + pname
            # one name, one parameter: a second module whose parameters have the same names (two MLPs, no prefix)
            # took over the first one's tensors -- its own values replaced, the first one never trained again --
            # and one parameter under two names trained only one of them
            held = self._dense.get(name)
            if held is not None and held is not param:
                raise ValueError(f"register_dense: {name!r} is registered already, by another parameter of this "
                                 "worker (two modules with the same parameter names? give each its own prefix=); "
                                 "nothing registered")
            if registered_as.get(id(param), name) != name:
                raise ValueError(f"register_dense: parameter {name!r} is registered already as "
                                 f"{registered_as[id(param)]!r} (a parameter is registered once); nothing registered")
            try:
                spec = DenseSpec(name=name, shape=tuple(param.shape), optimizer=optimizer, lr=reals["lr"],
                                 eps=reals["eps"], initial_accumulator_value=reals["initial_accumulator_value"],
                                 ).validate()
            except ValueError as exc:
                raise ValueError(f"register_dense: parameter {name!r}: {exc}; nothing registered") from None
            value = param.detach().to(torch.float32).cpu().numpy()
            if not np.isfinite(value).all():
                raise ValueError(f"register_dense: parameter {name!r} holds NaN or Inf; nothing registered")
            planned.append((name, spec, value, param, pname))
        done = []  # registered by this call (not those an earlier call registered: registering again is harmless)
        try:
            for name, spec, value, param, _ in planned:
                self._register_dense(spec, value, "register_dense")
                if name not in self._dense:
                    self._dense[name] = param
                    dense_state.tag(param, self, name)
                    done.append(name)
        except BaseException:  # the coordinator refused one (another spec under that name): none of them is
            for name in done:  # this worker's, so no step pushes a parameter that never loaded the servers' values
                dense_state.untag(self._dense.pop(name))
            raise
        names = [name for name, *_ in planned]
        self.pull_dense(names)
        # a value loaded into them later (model.load_state_dict) goes to the servers (ecrec.client.dense_state)
        dense_state.watch_loads(self, module, [(pname, name) for name, *_, pname in planned])
        return names

    @_open
    def create_dense(self, spec: DenseSpec, initial=None) -> None:
        """Creates a dense tensor from its spec alone (zeros, or ``initial``), without a module: a restore
        creates the tensors a snapshot holds this way.  A tensor of that name that exists is kept."""
        spec = spec.validate()
        value = np.zeros(spec.shape, dtype=np.float32) if initial is None else np.asarray(initial, dtype=np.float32)
        self._register_dense(spec, value, "create_dense")

    def _register_dense(self, spec: DenseSpec, value: np.ndarray, caller: str) -> None:
        """The coordinator's RegisterDense (the first value wins); the map it answers is adopted."""
        m = self._coordinator_call(
            "RegisterDense",
            coordinator_pb2.RegisterDenseRequest(spec=spec.to_proto(), initial_value=transport.floats_to_bytes(value)),
            f"{caller} {spec.name!r}")
        self._adopt(m)

    @_open
    def pull_dense(self, names: list[str] | None = None) -> None:
        """Loads the servers' current values into the registered parameters (``names``: some of them)."""
        if isinstance(names, (str, bytes)):  # "abc" was read as the names "a", "b" and "c"
            raise TypeError(f"pull_dense: names must be a list of names, not the string {names!r}")
        names = list(self._dense) if names is None else list(names)
        unknown = [name for name in names if name not in self._dense]
        if unknown:  # a KeyError after the call, from the reply
            raise ValueError(f"pull_dense: {', '.join(map(repr, unknown[:8]))} not registered by this client "
                             f"(register_dense); registered: {sorted(self._dense)[:8]}")
        by_primary: dict[int, list[str]] = {}
        for name in names:
            by_primary.setdefault(self.layout.dense_servers(name)[0], []).append(name)
        requests = {i: embedding_pb2.PullRequest(dense=n, epoch=self.map.epoch) for i, n in by_primary.items()}
        for i, request in requests.items():
            self._attach(i, request)
        replies = self._fan_out("Pull", requests)
        for i, reply in replies.items():
            self.courier.received(i, reply)
            self._load_dense(reply.dense)

    def _load_dense(self, values) -> None:
        with torch.no_grad():
            for v in values:
                param = self._dense[v.name]
                param.copy_(torch.tensor(transport.bytes_to_floats(v.value, tuple(param.shape))))

    # --- training --------------------------------------------------------------------------------
    def _record(self, table: str, ids: np.ndarray, rows: torch.Tensor, lookups: np.ndarray | None = None) -> None:
        entry = _Pending(table, ids, None, lookups, weakref.ref(rows))
        rows.register_post_accumulate_grad_hook(entry.got_gradient)
        with self._lock:
            self._pending.append(entry)
            if len(self._pending) >= self._prune_at:
                # lookups whose rows are gone (their output dropped, no gradient) go; the rest wait for their
                # backward.  Pruned when the list doubled: O(1) a record, however many are alive
                self._pending = [p for p in self._pending if p.tensor() is not None]
                self._prune_at = max(PRUNE_PENDING_AT, 2 * len(self._pending))

    def zero_grad(self, tables=None) -> None:
        """Drops the row gradients and dense gradients recorded so far without pushing.  A lookup whose backward
        has not run yet stays recorded: its gradient, when it comes, is pushed by the next step (as
        ``torch.optim``'s ``zero_grad`` between a forward and its backward).  ``tables`` (a name or names): only
        those tables' row gradients, no dense one (a cluster module's own ``zero_grad()``)."""
        only = None if tables is None else {tables} if isinstance(tables, str) else set(tables)
        with self._lock:
            kept = []
            for p in self._pending:
                rows = p.tensor()
                if rows is None:
                    continue
                if only is None or p.table in only:
                    rows.grad = None
                    p.rows = None  # held weakly again: its graph decides how long it lives
                kept.append(p)
            self._pending = kept
        if only is None:
            for p in self._dense.values():
                p.grad = None

    @_open
    def step(self) -> dict:
        """Pushes every pending gradient (rows and dense) and returns when the servers applied them.

        A step applies whole or not at all where the worker can judge it: a gradient that is not finite (NaN or
        Inf) anywhere, or beyond what its optimizer keeps finite, raises ``ClusterError`` naming the tables and
        dense tensors before anything is sent, every gradient kept (:meth:`zero_grad` drops them).  A part a
        server refuses for its content (its result would not be finite given the rows' state) changes nothing
        there while the other parts apply: :class:`~ecrec.client.steps.StepPartlyApplied` names both."""
        with self._lock:
            pending, self._pending = self._pending, []
        ready, waiting = [], []  # lookups whose gradient came; those whose backward has not run yet
        for p in pending:
            rows = p.tensor()
            if rows is not None and rows.grad is not None:
                p.rows = rows
                ready.append(p)
            elif rows is not None:
                waiting.append(p)
        try:
            per_table, lookups = collect(ready)
            with self._lock:
                m = self.map
            bad = bad_step(m, per_table, self._dense)
            parts, summed = self._push_parts(per_table) if not bad else ({}, {})
            if summed:  # a sum of gradients that each were finite may not be: judged as the server would
                bad = bad_gradients(summed, {}, {t.name: t for t in m.tables} if m else {}, {})
            bad += self._push_too_large(parts)
            if bad:
                raise ClusterError(f"step refused before anything was sent: {'; '.join(bad)}; no server applied any "
                                   "part of it (the gradients are kept: cluster.zero_grad() drops them, or a "
                                   "cluster module's own zero_grad() its tables')")
        except BaseException:  # refused, or judging the gradients failed: nothing was sent, every lookup is kept
            with self._lock:
                self._pending[:0] = ready + waiting  # ahead of anything recorded since
            raise
        with self._lock:
            self._sequence += 1
            push_id = embedding_pb2.PushId(worker=self.worker, sequence=self._sequence, incarnation=self.incarnation)
            self._pending[:0] = waiting  # their backward comes later: the next step pushes it
            for p in ready:  # pushed by this step (a later backward into them is not pushed again)
                p.done, p.rows = True, None
        requests: dict[int, embedding_pb2.PushRequest] = {}

        def request_for(index: int) -> embedding_pb2.PushRequest:
            if index not in requests:
                requests[index] = embedding_pb2.PushRequest(push_id=push_id, epoch=self.map.epoch, return_dense=True)
            return requests[index]

        for i, table_parts in parts.items():
            for table, ids, grads in table_parts:
                request_for(i).tables.add(table=table, ids=transport.ids_to_bytes(ids),
                                          grads=transport.floats_to_bytes(grads))
        dense_grads: dict[str, np.ndarray] = {}
        for name, param in self._dense.items():
            if param.grad is None:
                continue
            dense_grads[name] = param.grad.detach().to(torch.float32).cpu().numpy().reshape(-1)  # dropped below
            request_for(self.layout.dense_servers(name)[0]).dense.add(
                name=name, value=transport.floats_to_bytes(dense_grads[name]))
            param.grad = None
        result = self._send_push(requests) if requests else {"servers": 0, "rows": 0, "rows_by_server": {},
                                                             "already_applied": 0}
        self.last_dense_grads = dense_grads  # what this (acknowledged) push applied to each dense tensor
        self.last_lookups = {t: merge_lookups(parts) for t, parts in lookups.items()}
        self.steps_done += 1
        if self._periodic is not None:
            # the step is applied: a failed snapshot must not look like a failed step (a loop that retried the
            # batch would apply it twice); reported in the result, counted, and logged
            try:
                result["snapshot"] = self._periodic.after_step(self, self.steps_done)
            except Exception as exc:  # noqa: BLE001 - reported, never raised as the step's failure
                self._stats["snapshot_failures"] += 1
                result["snapshot_error"] = f"{type(exc).__name__}: {exc}"
                log.warning("step %d was applied; its periodic snapshot failed (%d so far): %s", self.steps_done,
                            self._stats["snapshot_failures"], result["snapshot_error"])
        return result

    @_open
    def snapshot_every(self, steps: int, directory: str, keep: int = 2, on_progress=None) -> None:
        """From now on every ``steps``-th :meth:`step` ends with a snapshot (:meth:`save`) to
        ``directory/step-<n>`` (a directory or fsspec URL), between steps so the cut is consistent for this
        worker; the newest ``keep`` complete snapshots are kept.  ``steps=0`` stops.  The way back after more
        failures than the code tolerates: :func:`ecrec.snapshot.latest` and :meth:`load`."""
        from ecrec.snapshot.cluster import Periodic

        if not steps:
            self._periodic = None
            return
        # the same directory again: its numbering goes on (this client's steps are in its snapshots' names already)
        self._periodic = Periodic(steps, str(directory), keep, on_progress, self._snapshot_bases.get(str(directory)))
        self._snapshot_bases[str(directory)] = self._periodic.base

    def _attach(self, index: int, request) -> None:
        """What the courier carries for server ``index`` rides along on a pull or poll, within the room its message
        limit leaves (the batches a push had no room for all went on the next pull, past the limit: refused)."""
        self.courier.attach(index, request, budget=self.config.max_message_bytes - request.ByteSize())

    def _send_push(self, requests: dict[int, embedding_pb2.PushRequest]) -> dict:
        """Sends one push (a request per server, one push id) as :meth:`step` does: what the courier carries
        rides along, each reply's relay and confirmations go back to it.  Not started once a SIGTERM stops this
        process's pushes (a push in flight then is let finish, and held)."""
        with self._push_gate:
            return self._send_push_now(requests)

    def _send_push_now(self, requests: dict[int, embedding_pb2.PushRequest]) -> dict:
        nbytes = 0
        for i, request in requests.items():
            request.parts = len(requests)  # a snapshot's cut counts the parts of each worker's last push
            size = request.ByteSize()
            if self.courier.attach(i, request, budget=self.config.max_message_bytes - size):
                size = request.ByteSize()  # (batches or watermarks rode along)
            nbytes += size
        self._stats["push_bytes"] += nbytes
        replies = self._fan_out("Push", requests, collect=True)
        forgotten = {i: requests[i] for i, r in replies.items()
                     if isinstance(r, PeerError) and errors.FORGOTTEN_INCARNATION in r.details}
        if forgotten:  # a server forgot this idle incarnation (its table was full): its parts under a new one
            with self._lock:
                self.incarnation = uuid.uuid4().hex
            log.warning("servers %s forgot worker %s's incarnation after it was idle: going on under a new one",
                        sorted(forgotten), self.worker)
            for request in forgotten.values():
                request.push_id.incarnation = self.incarnation
                request.parts = len(forgotten)  # under the new incarnation the step is these parts
            replies.update(self._fan_out("Push", forgotten, collect=True))
        self._stats["pushes"] += 1
        refused = {i: r for i, r in replies.items() if isinstance(r, PeerError)}
        replies = {i: r for i, r in replies.items() if i not in refused}
        for i, reply in replies.items():
            self.courier.pushed(i, requests[i], reply)
            self._load_dense(reply.dense)
        if self.courier.unconfirmed():
            self._keeper.holding()
        if refused:
            self._stats["steps_partly_applied"] += 1
            lost = any(e.code == grpc.StatusCode.DATA_LOSS for e in refused.values())
            raise (StepDataLoss if lost else StepPartlyApplied)(
                self.steps_done + 1, {i: r.rows_updated for i, r in replies.items()},
                {i: f"{e.code.name}: {e.details}" for i, e in refused.items()})
        return {"servers": len(requests), "rows": sum(r.rows_updated for r in replies.values()),
                "rows_by_server": {i: r.rows_updated for i, r in replies.items()},
                "already_applied": sum(r.already_applied for r in replies.values())}

    def _push_parts(self, per_table: dict) -> tuple[dict[int, list[tuple[str, np.ndarray, np.ndarray]]], dict]:
        """A step's table gradients (:func:`~ecrec.client.steps.collect`) as each server's part: ``{index: [(table,
        ids, gradients)]}``, and ``{table: [summed gradients]}`` of the parts summed here.  Where several lookups
        of a table met in the step, the ids they share are summed here, as the server would sum them (the same
        code: ``optim.sum_by_inverse``): gradient accumulation over micro-batches sends each row once.  A part
        whose ids do not repeat goes as it is (so does every table looked up once: nothing to do)."""
        parts: dict[int, list] = {}
        summed: dict[str, list] = {}
        for table, (ids_list, grad_list) in per_table.items():
            ids = np.concatenate(ids_list) if len(ids_list) > 1 else ids_list[0]
            grads = np.concatenate(grad_list) if len(grad_list) > 1 else grad_list[0]
            for i, pos in self._group_by_server(ids).items():
                part_ids, part_grads = ids[pos], grads[pos]
                if len(ids_list) > 1 and len(part_ids) > 1:
                    unique, inverse = np.unique(part_ids, return_inverse=True)
                    if len(unique) < len(part_ids):
                        with np.errstate(over="ignore", invalid="ignore"):  # a sum past float32: judged below
                            part_ids, part_grads = unique, optim.sum_by_inverse(len(unique), inverse, part_grads)
                        summed.setdefault(table, []).append(part_grads)
                parts.setdefault(i, []).append((table, part_ids, part_grads))
        return parts, summed

    def _push_too_large(self, parts: dict) -> list[str]:
        """What keeps a step's parts from going as one push per server (empty: nothing): more ids than a request
        names, or more bytes than a message holds.  Judged before anything is sent: one server refusing its part
        while the others applied theirs would leave the step half applied.  (What the courier carries along is
        attached within what is left: :meth:`_send_push`.)"""
        dense_bytes: dict[int, int] = {}
        for name, param in self._dense.items():
            if param.grad is not None:
                index = self.layout.dense_servers(name)[0]
                dense_bytes[index] = (dense_bytes.get(index, 0) + 4 * param.grad.numel() + len(name.encode())
                                      + PUSH_FIELD_BYTES)
        too_many, too_large = [], []
        for i in sorted(set(parts) | set(dense_bytes)):
            ids = sum(len(part_ids) for _, part_ids, _ in parts.get(i, ()))
            nbytes = (self._push_bytes(parts.get(i, ()), dense_bytes.get(i, 0)) + self.courier.ack_bytes(i)
                      + int(self.config.max_message_bytes * ACK_ROOM_SHARE))
            if ids > self.config.max_ids_per_request:
                too_many.append(f"server {i}'s part would name {ids} row ids")
            if nbytes > self.config.max_message_bytes:
                too_large.append(f"server {i}'s part would take {nbytes} bytes")
        bad = []
        if too_many:
            bad.append(f"{', '.join(too_many)}, more than one push may ({self.config.max_ids_per_request}: "
                       "ClientConfig.max_ids_per_request, as the servers' --max-ids-per-request)")
        if too_large:
            bad.append(f"{', '.join(too_large)}, more than one message holds ({self.config.max_message_bytes}: "
                       "ClientConfig.max_message_bytes, as the servers' --max-message-bytes)")
        if bad:
            bad[-1] += ("; look up fewer rows between two steps (step more often, or smaller batches), or raise "
                        "those bounds on the servers and in ClientConfig alike")
        return bad

    def _push_bytes(self, table_parts, dense_bytes: int) -> int:
        """An upper bound on the bytes of a push request holding ``table_parts`` and ``dense_bytes`` (of dense
        gradients with their names and fields), before the courier attaches anything."""
        push_id = len(self.worker.encode()) + len(self.incarnation) + 4 * PUSH_FIELD_BYTES
        return push_id + dense_bytes + sum(a.nbytes + g.nbytes + len(t.encode()) + PUSH_FIELD_BYTES
                                           for t, a, g in table_parts)

    def _next_push_id(self) -> embedding_pb2.PushId:
        with self._lock:
            self._sequence += 1
            return embedding_pb2.PushId(worker=self.worker, sequence=self._sequence, incarnation=self.incarnation)

    @_open
    def wait_confirmed(self, timeout_s: float = 30.0) -> int:
        """Waits until every push this worker made is *confirmed* (its parity applied at every destination),
        so that its owner may fail later without the worker's help; returns how many are still unconfirmed
        after ``timeout_s``.  Confirmations ride on replies, so this pulls a few rows meanwhile."""
        if isinstance(timeout_s, (bool, np.bool_)) or _not_a_number(timeout_s) or not float(timeout_s) >= 0:
            # NaN never ended (close(confirm_timeout_s=1e9), "as long as it takes", still waits)
            raise ValueError(f"wait_confirmed: timeout_s must be a number of seconds, at least 0 (math.inf: until "
                             f"confirmed), not {timeout_s!r}")
        deadline = time.monotonic() + float(timeout_s)
        while self.courier.unconfirmed():
            if time.monotonic() > deadline:
                break
            # every index that holds this worker's pushes, asked for something it serves (a tiny first table has
            # rows on a few indices only; a worker that pushed dense gradients only asks for them)
            try:
                if not self.poll_indices(self.courier.held_indices(), deadline=deadline):
                    break  # nothing to ask any of them for
            except ClusterError as exc:  # an index between two incarnations: asked again while time is left; an
                if not isinstance(exc.__cause__, PeerUnreachable) or time.monotonic() > deadline:  # error status
                    raise                                                                          # is an answer
                time.sleep(0.1)
                continue
            time.sleep(0.02)
        return self.courier.unconfirmed()

    # --- copies: a connection is shared, never copied or pickled ------------------------------------------
    def __copy__(self) -> "Cluster":
        return self

    def __deepcopy__(self, memo) -> "Cluster":
        """A copy of a model holding this cluster's modules (an EMA, an evaluation copy) shares this connection:
        the tables are on the servers, one copy of them (a frozen copy of their values: ``model.state_dict()``)."""
        return self

    def __reduce__(self):
        raise TypeError(f"a Cluster (worker {self.worker}, coordinator {self.address}) is a connection and cannot be "
                        "pickled: save the model's state_dict(), or a snapshot of the cluster (Cluster.save), and "
                        "connect again where it is loaded")

    def close(self, confirm_timeout_s: float = 10.0) -> None:
        """Waits (up to ``confirm_timeout_s``) for this worker's pushes to be confirmed, then closes the channels.
        A push still unconfirmed is logged: its owner failing before delivering its parity would lose it.  Closing
        twice is harmless; every call after the first raises ``ClusterError``."""
        if self._closed:
            return
        self._keeper.close()
        try:
            left = self.wait_confirmed(confirm_timeout_s) if confirm_timeout_s > 0 else self.courier.unconfirmed()
        except Exception as exc:  # noqa: BLE001 - reported; closing goes on
            left = self.courier.unconfirmed()
            log.warning("closing worker %s: could not wait for confirmations: %s", self.worker, exc)
        if left:
            log.warning("closing worker %s with %d unconfirmed pushes: an owner that fails before it delivers their "
                        "parity loses them", self.worker, left)
        self._closed = True
        _OPEN_CLIENTS.discard(self)
        self.peers.close()
        self.coordinator.stub.close()
