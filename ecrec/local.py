"""A local cluster: one coordinator and N embedding servers as separate processes on loopback.

Used by ``ecrec-server local``, by the benchmarks and by the tests.  Every
process is started with ``python -m ecrec.cli`` and tracked by pid; ``close()``
(also on ``with`` exit and at interpreter exit) terminates them all and kills
any that do not stop in time.  Nothing binds outside 127.0.0.1 unless asked.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc

from ecrec import transport
from ecrec.wire import cluster_pb2, coordinator_pb2, coordinator_pb2_grpc

READY_PREFIX = "ECREC_COORDINATOR "


@dataclass
class LocalClusterSpec:
    servers: int = 4
    standby: int = 0
    strategy: str = "none"
    k: int = 0
    m: int = 0
    options: dict = field(default_factory=dict)
    host: str = "127.0.0.1"
    device: str = "cpu"
    state_path: str | None = None
    log_level: str = "WARNING"
    health_interval_s: float = 0.5
    extra_env: dict = field(default_factory=dict)
    #: extra environment of particular servers: key = index of an active server, "standby<n>" or "standby"
    #: (e.g. ``{1: {"ECREC_FAULT": "after_partial_parity@20"}}`` for fault-injection tests)
    server_env: dict = field(default_factory=dict)
    #: extra command-line arguments of the coordinator (e.g. ``["--lease-s", "10"]`` on a loaded machine)
    coordinator_args: list = field(default_factory=list)


class LocalCluster:
    def __init__(self, spec: LocalClusterSpec | None = None, **kwargs):
        self.spec = spec or LocalClusterSpec(**kwargs)
        self.coordinator_address: str | None = None
        self.coordinator_proc: subprocess.Popen | None = None
        self.server_procs: list[subprocess.Popen] = []
        self.old_coordinator_procs: list[subprocess.Popen] = []
        self._closed = False
        atexit.register(self.close)

    # --- processes -------------------------------------------------------------------------------
    def _env(self, extra: dict | None = None) -> dict:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # one compute thread per server process: they share the machine's cores
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("NUMBA_NUM_THREADS", "1")
        env.update({k: str(v) for k, v in self.spec.extra_env.items()})
        env.update({k: str(v) for k, v in (extra or {}).items()})
        return env

    def _cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "ecrec.cli", "--log-level", self.spec.log_level, *args]

    def start(self, timeout_s: float = 60.0) -> "LocalCluster":
        s = self.spec
        args = ["coordinator", "--host", s.host, "--port", "0", "--servers", str(s.servers), "--strategy", s.strategy,
                "--health-interval", str(s.health_interval_s)]
        if s.k:
            args += ["--k", str(s.k)]
        if s.m:
            args += ["--m", str(s.m)]
        for key, value in s.options.items():
            args += ["--option", f"{key}={value}"]
        if s.state_path:
            args += ["--state-path", s.state_path]
        args += [str(a) for a in s.coordinator_args]
        self.start_coordinator(args, timeout_s)
        for index in range(s.servers):  # each asks for its index, so per-index settings are deterministic
            self.start_server(index=index, env=s.server_env.get(index))
        for n in range(s.standby):
            self.start_server(standby=True, env=s.server_env.get(f"standby{n}", s.server_env.get("standby")))
        self.wait_ready(timeout_s)
        return self

    def restart_coordinator(self, timeout_s: float = 60.0) -> None:
        """Starts a new coordinator on the same address (after the old one died); it reloads ``state_path``."""
        if not self.spec.state_path:
            raise ValueError("restart_coordinator needs state_path, or the map is lost")
        old = self.coordinator_proc
        if old is not None and old.poll() is None:
            raise RuntimeError(f"coordinator {old.pid} is still running")
        args = list(self._coordinator_args)
        args[args.index("--port") + 1] = self.coordinator_address.rsplit(":", 1)[1]
        self.start_coordinator(args, timeout_s)

    def start_coordinator(self, args: list[str], timeout_s: float = 60.0) -> None:
        self._coordinator_args = args
        proc = subprocess.Popen(self._cmd(*args), stdout=subprocess.PIPE, stderr=None, env=self._env(), text=True)
        if self.coordinator_proc is not None:
            self.old_coordinator_procs.append(self.coordinator_proc)
        self.coordinator_proc = proc
        line = _read_line(proc, timeout_s)
        if not line.startswith(READY_PREFIX):
            self.close()
            raise RuntimeError(f"coordinator did not start (exit code {proc.poll()}): {line!r}")
        self.coordinator_address = line[len(READY_PREFIX):].strip()
        # keep draining its stdout so it never blocks on a full pipe
        threading.Thread(target=_drain, args=(proc,), daemon=True).start()

    def start_server(self, standby: bool = False, index: int = -1, env: dict | None = None) -> subprocess.Popen:
        args = ["serve", "--coordinator", self.coordinator_address, "--host", self.spec.host, "--port", "0",
                "--device", self.spec.device]
        if standby:
            args.append("--standby")
        if index >= 0:
            args += ["--index", str(index)]
        proc = subprocess.Popen(self._cmd(*args), stdout=subprocess.DEVNULL, stderr=None, env=self._env(env))
        self.server_procs.append(proc)
        return proc

    def wait_ready(self, timeout_s: float = 60.0):
        """Waits until every index has an active server; returns the map."""
        deadline = time.monotonic() + timeout_s
        stub = coordinator_pb2_grpc.CoordinatorStub(transport.make_channel(self.coordinator_address))
        want_standby = self.spec.standby
        while True:
            for p in [self.coordinator_proc, *self.server_procs]:
                if p.poll() is not None and p.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM):
                    self.close()
                    raise RuntimeError(f"process {p.pid} exited with code {p.returncode} while the cluster started")
            try:
                m = stub.GetClusterMap(coordinator_pb2.GetClusterMapRequest(), timeout=5)
                standbys = sum(1 for s in m.servers if s.index < 0)
                if m.ready and standbys >= want_standby:
                    return m
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"cluster not ready after {timeout_s:.0f} s")
            time.sleep(0.1)

    def cluster_map(self):
        stub = coordinator_pb2_grpc.CoordinatorStub(transport.make_channel(self.coordinator_address))
        return stub.GetClusterMap(coordinator_pb2.GetClusterMapRequest(), timeout=10)

    def pid_of_index(self, index: int) -> int:
        """The pid of the local process now serving ``index`` (server ids are ``host:pid:nonce``)."""
        m = self.cluster_map()
        for s in m.servers:
            if s.index == index and s.state != cluster_pb2.FAILED:
                pid = int(s.server_id.split(":")[1])
                if any(p.pid == pid and p.poll() is None for p in self.server_procs):
                    return pid
        raise LookupError(f"no live local process serves index {index}")

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        os.kill(pid, sig)
        for p in [*self.server_procs, self.coordinator_proc]:
            if p.pid == pid:
                p.wait(timeout=10)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        procs = [p for p in [*self.server_procs, *self.old_coordinator_procs, self.coordinator_proc] if p is not None]
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> "LocalCluster":
        return self.start() if self.coordinator_address is None else self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout_s)
    return result[0] if result else ""


def _drain(proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        sys.stdout.write(line)
