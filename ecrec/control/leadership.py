"""Leadership: which coordinator may change the map, and the process that serves one.

With a file store the one coordinator leads from its start.  With an etcd store several run on one etcd key: each
campaigns (``ecrec.control.etcd.Election``), the elected one takes over the state etcd holds and leads until its
lease is lost, then campaigns again.  While a coordinator does not lead, every call but ``GetClusterMap`` is
answered UNAVAILABLE naming the leader (clients follow it), and ``GetClusterMap`` reads the map from etcd; a change
the store refused is answered UNAVAILABLE too, never with a map nobody recorded.
"""

from __future__ import annotations

import logging
import os
import threading

import grpc

from ecrec.control.stores import NotLeader, StoreUnavailable
from ecrec.net import transport
from ecrec.net.peers import NOT_LEADER
from ecrec.net.refusals import REFUSALS
from ecrec.wire import coordinator_pb2_grpc

log = logging.getLogger("ecrec.coordinator")


def leads(state) -> bool:
    """Whether this coordinator may change the map now (it leads, its lease surely current)."""
    return state.leading.is_set() and state.store.holds()


def follower_map(state):
    """The map a coordinator that does not lead serves: the one etcd holds now (None with a file store, or while
    etcd holds none yet); raises ``StoreUnavailable`` when etcd cannot be read."""
    if state.store.kind == "file":
        return None
    saved = state.store.peek()
    return None if saved is None else saved.map


def served_map(coordinator):
    """The map ``GetClusterMap`` answers here (the metrics read it too): the coordinator's own while it leads, a
    follower's from etcd (:func:`follower_map`), None when it knows none; raises ``StoreUnavailable``."""
    if leads(coordinator.state):
        return coordinator.GetClusterMap(None, None)
    return follower_map(coordinator.state)


#: answered by the coordinator but not counted as refusals (``ecrec_requests_refused``): the caller is not at fault
NOT_REFUSALS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.INTERNAL)


class _Counted:
    """A servicer context whose ``abort`` counts the refusal (``ecrec.net.refusals``) before aborting, as the
    servers' ``transport.service_method`` does for theirs."""

    def __init__(self, context, method: str):
        self._context, self._method = context, method

    def abort(self, code, details):
        if code not in NOT_REFUSALS:
            REFUSALS.add(self._method, code)
        self._context.abort(code, details)

    def __getattr__(self, name: str):
        return getattr(self._context, name)


class Guarded:
    """The coordinator's RPCs as served, behind the leadership check (see the module); a request it refuses is
    counted (``ecrec_requests_refused``)."""

    def __init__(self, coordinator):
        self._c = coordinator

    def __getattr__(self, name: str):
        method = getattr(self._c, name)
        state = self._c.state

        def guarded(request, context):
            if not leads(state):
                if name == "GetClusterMap":
                    try:
                        saved = follower_map(state)
                    except StoreUnavailable as exc:
                        context.abort(grpc.StatusCode.UNAVAILABLE, f"no coordinator leads and etcd cannot be read: {exc}")
                    if saved is not None:
                        return saved
                if name == "GetCoordinators":
                    return method(request, context)
                leader = state.store.leader_address()
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"{NOT_LEADER}; the leader is {leader or 'being elected'}; retry there")
            try:
                return method(request, _Counted(context, name) if context is not None else None)
            except (NotLeader, StoreUnavailable) as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"the change was not recorded: {exc}; retry")
        return guarded


class CoordinatorServer:
    """Runs a coordinator (``ecrec.control.coordinator.Coordinator``) behind a gRPC server with its health monitor
    and promoter.  With an etcd store it first campaigns for the leadership (serving maps meanwhile), leads until
    it loses its lease, then campaigns again."""

    def __init__(self, coordinator, store_factory=None):
        self.coordinator = coordinator
        state = coordinator.state
        config = state.config
        self._grpc = transport.make_server(max_workers=16, security=config.security)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(Guarded(coordinator), self._grpc)
        self.port = transport.bind(self._grpc, config.host, config.port, config.security)
        self.address = f"{config.host}:{self.port}"
        coordinator.address = self.address
        self._leadership = None
        if store_factory is not None:
            state.store = store_factory(self.address)
            self._check_saved_shape(state)
            self._grpc.start()
            self._leadership = threading.Thread(target=self._lead, name="ecrec-leadership", daemon=True)
            self._leadership.start()
        else:
            with state.lock:
                snapshot = state.bump_locked()
                state.leading.set()
            self._grpc.start()
            coordinator.links.broadcast(snapshot)
        self._monitor = threading.Thread(target=coordinator.detector.run, name="ecrec-health-monitor", daemon=True)
        self._monitor.start()
        self._promoter = threading.Thread(target=coordinator.promoter.run, name="ecrec-promoter", daemon=True)
        self._promoter.start()

    def _check_saved_shape(self, state) -> None:
        """A coordinator whose flags do not match the map etcd holds is refused at its start (a ValueError), not
        once it is elected, when it could only stop and leave the cluster without a coordinator.  With etcd
        unreachable now, the check is left to its election."""
        try:
            saved = state.store.peek()
        except StoreUnavailable as exc:
            log.warning("etcd cannot be read at start (%s): the map it holds is checked against this "
                        "coordinator's flags once it is elected", exc)
            return
        if saved is None:
            return
        try:
            state.check_shape(saved.map, state.store.describe())
        except ValueError:
            self._grpc.stop(None)
            state.store.close()
            raise

    def _lead(self) -> None:
        """Campaign, take over, lead until the lease is lost; again, until the coordinator stops."""
        c = self.coordinator
        state, stop = c.state, c.stopping
        store = state.store
        while not stop.is_set():
            if not store.campaign(stop):
                return
            try:
                snapshot = c.take_over(store)
            except (NotLeader, StoreUnavailable) as exc:
                log.warning("elected, but could not take over: %s", exc)
                store.resign()
                stop.wait(0.5)
                continue
            except ValueError as exc:  # e.g. etcd holds another cluster's map: this coordinator cannot lead it
                log.critical("elected, but the state in %s cannot be used: %s; stopping this coordinator",
                             store.describe(), exc)
                store.resign()
                os._exit(2)
            except Exception:  # noqa: BLE001 - reported, never swallowed
                log.critical("elected, but the state in %s cannot be used; stopping this coordinator",
                             store.describe(), exc_info=True)
                store.resign()
                os._exit(2)
            log.info("leading the cluster from %s (epoch %d, %d servers, %d tables)", self.address, snapshot.epoch,
                     len(snapshot.servers), len(snapshot.tables))
            c.links.broadcast(snapshot)
            c.detector.wake.set()
            c.promoter.wake.set()
            while not stop.is_set() and not store.lost.wait(0.2):
                pass
            state.step_down("its etcd lease is gone, or a write's outcome was unknown" if not stop.is_set()
                            else "stopping")
            store.resign()  # the key goes now: a follower (or this one again) takes over from what etcd holds

    def wait(self) -> None:
        self._grpc.wait_for_termination()

    def stop(self, grace_s: float = 1.0) -> None:
        c = self.coordinator
        c.stopping.set()
        c.state.leading.clear()
        c.state.store.resign()
        if self._leadership is not None:
            self._leadership.join(timeout=2.0)
        c.state.store.resign()  # in case a campaign won meanwhile
        c.detector.wake.set()
        c.promoter.wake.set()
        self._grpc.stop(grace_s).wait()
        c.links.close()
        c.detector.close()
