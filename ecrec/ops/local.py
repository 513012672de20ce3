"""A local cluster: one coordinator and N embedding servers as separate processes on loopback.

Used by ``ecrec-server local``, by the benchmarks and by the tests.  Every
process is started with ``python -m ecrec.cli`` and tracked by pid; ``close()``
(also on ``with`` exit and at interpreter exit) terminates them all and kills
any that do not stop in time.  Nothing binds outside 127.0.0.1 unless asked.
Each child's stderr is passed on to this process's stderr, and its last lines are
kept (:meth:`LocalCluster.stderr_tail`) so that an error about a child that did not
start or exited quotes the child's own message.
"""

from __future__ import annotations

import atexit
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc

from ecrec.net import transport
from ecrec.ops import parent
from ecrec.net.transport import free_port_outside_ephemeral_range
from ecrec.config import CoordinatorConfig, SecurityOptions, ServerConfig, bracketed_host, cli_fields, flag_of
from ecrec.wire import cluster_pb2, coordinator_pb2, coordinator_pb2_grpc

READY_PREFIX = "ECREC_COORDINATOR "
STDERR_TAIL_LINES = 20  # lines of each child's stderr kept for error messages


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
    log_format: str = "text"
    #: Prometheus metrics: the coordinator on this port, active server i on port + 1 + i, standby n after
    #: them (port + 1 + servers + n), further coordinators (etcd) after those; None: off
    metrics_port: int | None = None
    health_interval_s: float = 0.5
    extra_env: dict = field(default_factory=dict)
    #: extra environment of particular servers: key = index of an active server, "standby<n>" or "standby"
    #: (e.g. ``{1: {"ECREC_FAULT": "after_partial_parity@20"}}`` for fault-injection tests)
    server_env: dict = field(default_factory=dict)
    #: extra environment of the coordinator (e.g. ``{"ECREC_COORDINATOR_FAULT": "record_promotion@1:delay=0.5"}``)
    coordinator_env: dict = field(default_factory=dict)
    #: transport security (``ecrec.net.security``) as option name -> path (``tls_cert``, ``tls_key``, ``tls_ca``,
    #: ``token_file``) for the servers, the coordinator (default: the servers') and this object's own calls
    #: (default: the servers')
    server_security: dict = field(default_factory=dict)
    #: where each new server process runs: ``() -> (command prefix, host to bind)``, e.g. a fresh network
    #: namespace (``["ip", "netns", "exec", "ns3"]``, ``"10.213.0.13"``); None: here, on ``host``
    server_placement: object = None
    #: more coordinator settings as field name -> value (``lease_s``, ``failure_timeout_s``, ...)
    coordinator_options: dict = field(default_factory=dict)
    #: more settings of every server as field name -> value (``no_standby_reserve``, ``rpc_timeout_s``, ...)
    server_options: dict = field(default_factory=dict)
    #: where the coordinators keep the map: "file" (``state_path``, or memory) or "etcd" (a real etcd cluster of
    #: ``etcd_members`` members started here, and ``coordinators`` coordinators on it, one leading)
    store: str = "file"
    coordinators: int = 1
    etcd_members: int = 1
    #: the etcd endpoints coordinator n dials: ``(n, members' endpoints) -> endpoints`` (default: the members; a
    #: test puts a proxy in between to cut one coordinator off from etcd)
    coordinator_etcd: object = None
    #: TLS of the etcd members: {"tls_cert", "tls_key", "tls_ca"} (a certificate for ``host``); the coordinators
    #: dial etcd with their own certificate (``coordinator_security``, default the servers'), which the same CA
    #: must sign
    etcd_tls: dict | None = None
    coordinator_security: dict | None = None
    client_security: dict | None = None
    #: every child gets SIGTERM when the thread that started it ends, so that a ``kill -9`` of the process that
    #: holds this object (``ecrec-server local``) leaves none running (Linux: ``ecrec.ops.parent``); start and
    #: restart from one long-lived thread when set
    die_with_parent: bool = False
    #: each process in a process group of its own: a terminal's Ctrl-C (SIGINT to the foreground group) reaches
    #: the process that started them, which stops them, not processes still starting Python (their tracebacks)
    own_process_groups: bool = False

    def security_of(self, role: str) -> dict:
        """The security options of ``role`` (``server``, ``coordinator`` or ``client``)."""
        chosen = {"coordinator": self.coordinator_security, "client": self.client_security}.get(role)
        return dict(self.server_security if chosen is None else chosen)


class LocalCluster:
    def __init__(self, spec: LocalClusterSpec | None = None, **kwargs):
        self.spec = spec or LocalClusterSpec(**kwargs)
        port = self.spec.metrics_port
        ports = self.spec.servers + self.spec.standby + max(self.spec.coordinators, 1)
        if port is not None and not 1 <= port <= 65536 - ports:
            raise ValueError(f"metrics port must leave room for {ports} consecutive ports in 1..65535, got {port}")
        if self.spec.store not in ("file", "etcd"):
            raise ValueError(f"store {self.spec.store!r}: choose file or etcd")
        if self.spec.coordinators < 1:
            raise ValueError(f"{self.spec.coordinators} coordinators: a cluster needs at least 1")
        if self.spec.coordinators > 1 and self.spec.store != "etcd":
            raise ValueError(f"{self.spec.coordinators} coordinators: more than one needs store='etcd' (they share "
                             "the map through it)")
        if self.spec.store == "etcd" and self.spec.etcd_members < 1:
            raise ValueError(f"{self.spec.etcd_members} etcd members: an etcd store needs at least 1")
        self.coordinator_address: str | None = None
        self._coordinator_stub = None  # (address, stub): :meth:`_stub`'s
        self.coordinator_proc: subprocess.Popen | None = None
        #: with an etcd store: every coordinator's address and process (coordinator_address names them all)
        self.coordinator_addresses: list[str] = []
        self.coordinator_procs: list[subprocess.Popen] = []
        self.etcd = None  # ecrec.control.etcd_local.LocalEtcd with store="etcd"
        self.etcd_prefix = ""
        self.server_procs: list[subprocess.Popen] = []
        self.old_coordinator_procs: list[subprocess.Popen] = []
        self._stderr: dict[int, collections.deque] = {}  # pid -> its last lines of stderr
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
        return [sys.executable, "-m", "ecrec.cli", "--log-level", self.spec.log_level,
                "--log-format", self.spec.log_format, *args]

    def metrics_addresses(self) -> dict[str, str]:
        """``{"coordinator": host:port, "server 0": ..., "standby 0": ...}`` when metrics are on, else ``{}``."""
        base, s = self.spec.metrics_port, self.spec
        if base is None:
            return {}
        names = ["coordinator", *(f"server {i}" for i in range(s.servers)), *(f"standby {n}" for n in range(s.standby)),
                 *(f"coordinator {n}" for n in range(1, s.coordinators))]
        host = bracketed_host(s.host)  # ::1 -> [::1]: these go into URLs
        return {name: f"{host}:{base + offset}" for offset, name in enumerate(names)}

    @staticmethod
    def _flags(config_class: type, options: dict) -> list[str]:
        """``options`` (``{field: value}`` of ``config_class``'s command-line fields) as its flags
        (:func:`ecrec.config.flag_of`); an unknown field is a ValueError naming it."""
        fields = {f.name: f for f in cli_fields(config_class)}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise ValueError(f"{config_class.__name__} has no option {', '.join(unknown)}")
        out = []
        for name, value in sorted(options.items()):
            if isinstance(value, bool):  # a switch: present or not
                out += [flag_of(fields[name])] if value else []
            else:
                out += [flag_of(fields[name]), str(value)]
        return out

    def client_config(self, **overrides):
        """A :class:`~ecrec.config.ClientConfig` with this cluster's client security (and ``overrides``)."""
        from ecrec.config import ClientConfig
        return ClientConfig(**{**self.spec.security_of("client"), **overrides})

    def _stub(self):
        """A stub for the coordinator, kept while its address stays (made per call, each opened a connection of its
        own -- channels keep their own -- and left it open: a benchmark asks for the map every step after a kill)."""
        from ecrec.net.peers import coordinator_stub
        cached = self._coordinator_stub
        if cached is not None and cached[0] == self.coordinator_address:
            return cached[1]
        stub = coordinator_stub(self.coordinator_address, security=self.client_config().security)
        self._coordinator_stub = (self.coordinator_address, stub)
        if cached is not None:
            cached[1].close()
        return stub

    def start(self, timeout_s: float = 60.0) -> "LocalCluster":
        s = self.spec
        # a coordinator that may be restarted (state_path) must get its address back: take a port outside the
        # kernel's ephemeral range, which nothing else on this host is handed in the meantime
        port = free_port_outside_ephemeral_range(s.host) if s.state_path or s.store == "etcd" else 0
        args = ["coordinator", "--host", s.host, "--port", str(port), "--servers", str(s.servers),
                "--strategy", s.strategy, "--health-interval", str(s.health_interval_s)]
        if s.k:
            args += ["--k", str(s.k)]
        if s.m:
            args += ["--m", str(s.m)]
        for key, value in s.options.items():
            args += ["--option", f"{key}={value}"]
        if s.state_path:
            args += ["--state-path", s.state_path]
        args += self._flags(SecurityOptions, s.security_of("coordinator"))
        args += self._flags(CoordinatorConfig, s.coordinator_options)
        metrics = s.metrics_port is not None
        if metrics:
            args += ["--metrics-port", str(s.metrics_port)]
        if s.store == "etcd":
            self._start_etcd_control_plane(args, timeout_s)
        else:
            self.start_coordinator(args, timeout_s)
        for index in range(s.servers):  # each asks for its index, so per-index settings are deterministic
            self.start_server(index=index, env=s.server_env.get(index),
                              metrics_port=s.metrics_port + 1 + index if metrics else None)
        for n in range(s.standby):
            self.start_server(standby=True, env=s.server_env.get(f"standby{n}", s.server_env.get("standby")),
                              metrics_port=s.metrics_port + 1 + s.servers + n if metrics else None)
        self.wait_ready(timeout_s)
        return self

    def _start_etcd_control_plane(self, args: list[str], timeout_s: float) -> None:
        import uuid

        from ecrec.control.etcd_local import LocalEtcd
        s = self.spec
        from ecrec.control.etcd import EtcdTLS
        tls = EtcdTLS(s.etcd_tls["tls_ca"], s.etcd_tls["tls_cert"], s.etcd_tls["tls_key"]) if s.etcd_tls else None
        self.etcd = LocalEtcd(s.etcd_members, s.host, tls=tls, prefix=parent.prefix() if s.die_with_parent else [],
                              own_session=s.own_process_groups)
        try:
            self.etcd.start(timeout_s)
        except Exception:
            self.close()
            raise
        self.etcd_prefix = f"/ecrec/{uuid.uuid4().hex[:12]}"
        base = list(args)
        addresses = []
        self._coordinator_args_of = {}
        for n in range(s.coordinators):
            endpoints = s.coordinator_etcd(n, self.etcd.endpoints) if s.coordinator_etcd else self.etcd.endpoints
            args = [*base, "--store", f"etcd://{','.join(endpoints)}{self.etcd_prefix}"]
            # a port picked now, after etcd took its own (a restarted coordinator gets it back)
            args[args.index("--port") + 1] = str(free_port_outside_ephemeral_range(s.host))
            if n and "--metrics-port" in args:  # the first coordinator's port, the others' after the standbys'
                args[args.index("--metrics-port") + 1] = str(s.metrics_port + s.servers + s.standby + n)
            self.start_coordinator(args, timeout_s)
            self._coordinator_args_of[self.coordinator_address] = list(args)
            addresses.append(self.coordinator_address)
            self.coordinator_procs.append(self.coordinator_proc)
        self.coordinator_addresses = addresses
        self.coordinator_address = ",".join(addresses)

    def leading_coordinator(self) -> tuple[int, str]:
        """(pid, address) of the coordinator that leads now (etcd store); raises LookupError when none does."""
        client = self.etcd.client()
        try:
            kv = client.get(f"{self.etcd_prefix}/leader".encode())
        finally:
            client.close()
        if kv is None:
            raise LookupError("no coordinator leads")
        me, _, address = kv.value.decode().partition("@")  # me: host-pid
        for a, p in zip(self.coordinator_addresses, self.coordinator_procs):
            if a == address and p.poll() is None and me.endswith(f"-{p.pid}"):
                return p.pid, a
        raise LookupError(f"the leader {address} is not a live coordinator of this cluster")

    def restart_coordinator_at(self, address: str, timeout_s: float = 60.0) -> subprocess.Popen:
        """Starts a coordinator again at ``address`` (etcd store: one of ``coordinator_addresses``, whose process
        died); it campaigns like the others."""
        i = self.coordinator_addresses.index(address)
        old = self.coordinator_procs[i]
        if old.poll() is None:
            raise RuntimeError(f"coordinator {old.pid} at {address} is still running")
        args = list(self._coordinator_args_of[address])
        args[args.index("--port") + 1] = address.rsplit(":", 1)[1]
        joined = self.coordinator_address
        self.start_coordinator(args, timeout_s)
        self.coordinator_procs[i] = self.coordinator_proc
        self.coordinator_address = joined
        return self.coordinator_proc

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
        proc = self._spawn([], args, self._env(self.spec.coordinator_env), self.spec.coordinator_env, stdout=True)
        self._follow_stderr(proc)
        if self.coordinator_proc is not None:
            self.old_coordinator_procs.append(self.coordinator_proc)
        self.coordinator_proc = proc
        line = _read_line(proc, timeout_s)
        if not line.startswith(READY_PREFIX):
            try:
                code = proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                code = None
            self.close()
            said = f"; it printed on stdout {line.strip()!r}" if line.strip() else ""
            raise RuntimeError(f"coordinator did not start (exit code {code}){said}{self._tail_text(proc.pid)}")
        self.coordinator_address = line[len(READY_PREFIX):].strip()
        # keep draining its stdout so it never blocks on a full pipe
        threading.Thread(target=_drain, args=(proc,), daemon=True).start()

    def start_server(self, standby: bool = False, index: int = -1, env: dict | None = None,
                     metrics_port: int | None = None) -> subprocess.Popen:
        prefix, host = self.spec.server_placement() if self.spec.server_placement else ([], self.spec.host)
        args = ["serve", "--coordinator", self.coordinator_address, "--host", host, "--port", "0",
                "--device", self.spec.device, *self._flags(SecurityOptions, self.spec.server_security),
                *self._flags(ServerConfig, self.spec.server_options)]
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port)]
        if standby:
            args.append("--standby")
        if index >= 0:
            args += ["--index", str(index)]
        proc = self._spawn(prefix, args, self._env(env), env or {}, stdout=False)
        self._follow_stderr(proc)
        self.server_procs.append(proc)
        return proc

    def _spawn(self, prefix: list[str], args: list[str], env: dict, extra: dict, stdout: bool):
        """Starts ``ecrec-server ARGS`` (stderr piped; stdout piped or dropped): with the spawner installed by
        :func:`use_spawner` when the process runs here and the spawner takes it, else as ``python -m ecrec.cli``."""
        if _spawner is not None and not prefix:
            proc = _spawner(self._cmd(*args)[3:], env, stdout)
            if proc is not None:
                return proc
        if self.spec.die_with_parent:
            env = {**env, **parent.env()}
        return subprocess.Popen([*prefix, *self._cmd(*args)], stdout=subprocess.PIPE if stdout else subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=env, text=True,
                                start_new_session=self.spec.own_process_groups)  # (process_group: 3.11 only)

    def _follow_stderr(self, proc: subprocess.Popen) -> None:
        self._stderr[proc.pid] = follow_stderr(proc)

    def stderr_tail(self, pid: int) -> list[str]:
        """The last lines a child (by pid) wrote on stderr (its own messages: the reason it exited)."""
        tail = self._stderr.get(pid)
        return list(tail) if tail is not None else []

    def _tail_text(self, pid: int, wait_s: float = 1.0) -> str:
        deadline = time.monotonic() + wait_s  # the reader thread may still be behind the exit
        while not self.stderr_tail(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = self.stderr_tail(pid)
        return (":\n  " + "\n  ".join(lines)) if lines else " (it wrote nothing on stderr)"

    def wait_ready(self, timeout_s: float = 60.0):
        """Waits until every index has an active server; returns the map."""
        deadline = time.monotonic() + timeout_s
        stub = self._stub()
        want_standby = self.spec.standby
        while True:
            for p in [*(self.coordinator_procs or [self.coordinator_proc]), *self.server_procs]:
                if p.poll() is not None and p.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM):
                    tail = self._tail_text(p.pid)
                    self.close()
                    raise RuntimeError(f"process {p.pid} exited with code {p.returncode} while the cluster started{tail}")
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
        stub = self._stub()
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
        """Sends ``sig`` to one of this cluster's processes; waits for it to end when ``sig`` ends it."""
        # through its handle (which signals only a child not reaped yet: a reaped child's pid may be another
        # process's by now); by pid only for a process this cluster did not start
        handles = [p for p in [*self.server_procs, self.coordinator_proc, *self.coordinator_procs]
                   if p is not None and p.pid == pid]
        handle = next((p for p in handles if p.poll() is None), handles[-1] if handles else None)
        if handle is None:
            os.kill(pid, sig)
            return
        handle.send_signal(sig)
        if sig not in (signal.SIGSTOP, signal.SIGCONT):
            handle.wait(timeout=10)

    def pause(self, pid: int) -> None:
        """Freezes a process (SIGSTOP): it keeps its sockets but answers nothing, like a long GC pause."""
        self.kill(pid, signal.SIGSTOP)

    def resume(self, pid: int) -> None:
        self.kill(pid, signal.SIGCONT)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        cached, self._coordinator_stub = self._coordinator_stub, None
        if cached is not None:
            cached[1].close()
        procs = [p for p in [*self.server_procs, *self.old_coordinator_procs, self.coordinator_proc,
                             *self.coordinator_procs] if p is not None]
        procs = list({p.pid: p for p in procs}.values())
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)  # a paused process handles SIGTERM only once resumed
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
        if self.etcd is not None:
            self.etcd.close()
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


def follow_stderr(proc: subprocess.Popen, lines: int = STDERR_TAIL_LINES) -> collections.deque:
    """Passes a child's stderr (opened with ``stderr=PIPE``) on to ours from a thread; returns the deque
    that keeps its last ``lines`` lines, for error messages that quote the child."""
    tail: collections.deque = collections.deque(maxlen=lines)
    threading.Thread(target=_pass_on, args=(proc.stderr, tail), daemon=True, name=f"ecrec-stderr-{proc.pid}").start()
    return tail


def _pass_on(stream, tail: collections.deque) -> None:
    """Copies a child's stderr to ours, keeping its last lines in ``tail``."""
    try:
        for line in stream:
            tail.append(line.rstrip("\n"))
            try:
                sys.stderr.write(line)
            except (ValueError, OSError):  # our stderr was closed (interpreter exit): keep the tail only
                pass
    except (ValueError, OSError):
        pass


#: starts this process's local clusters' processes instead of subprocess when set (:func:`use_spawner`)
_spawner = None


def use_spawner(spawner) -> None:
    """From now on every LocalCluster of this process starts its servers and coordinators with
    ``spawner(args, env, stdout) -> a Popen-like handle, or None when it cannot`` (``ecrec.ops.forks.Spawner``:
    forked from a warm parent), where it can; None: as ``python -m ecrec.cli`` again."""
    global _spawner
    _spawner = spawner
