"""A real etcd cluster on this machine for ``ecrec-server local --store etcd``, the tests and the nemesis.

Runs the ``etcd`` binary (Debian's ``etcd-server``, or any etcd 3.4+ on PATH or at ``$ECREC_ETCD``) as N members
on loopback, each with its own data directory under one temporary folder, and stops them (by pid) at close.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

from ecrec.control.etcd import EtcdClient, EtcdError, EtcdTLS
from ecrec.net.transport import free_port_outside_ephemeral_range


def etcd_binary() -> str:
    """The etcd executable: ``$ECREC_ETCD``, else ``etcd`` on PATH, else ``/usr/bin/etcd``; raises naming how to
    install it."""
    given = os.environ.get("ECREC_ETCD")
    if given:
        given = shutil.which(given) or given  # a command name on PATH, or a path
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise FileNotFoundError(f"ECREC_ETCD={given}: no executable file there (it names the etcd binary; "
                                    "unset it to use etcd on PATH)")
        return given
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if not found:
        raise FileNotFoundError("no etcd binary: install etcd 3.4+ (Debian/Ubuntu: apt-get install etcd-server) or "
                                "set ECREC_ETCD to its path")
    return found


class LocalEtcd:
    """``members`` etcd members on ``host``, client and peer ports outside the ephemeral range (a restarted
    member gets its ports back).  With ``tls`` (:class:`ecrec.control.etcd.EtcdTLS`: the CA, and a certificate for
    ``host`` that the members serve and this object's own client presents) clients must speak TLS with a
    certificate the CA signed (``--client-cert-auth``)."""

    def __init__(self, members: int = 1, host: str = "127.0.0.1", tls: EtcdTLS | None = None,
                 prefix: list[str] | None = None, own_session: bool = False):
        self.own_session = own_session  # each member in a session of its own (LocalClusterSpec.own_process_groups)
        if members < 1:
            raise ValueError(f"etcd members must be >= 1, got {members}")
        self.host = host
        self.tls = tls
        self.prefix = list(prefix or [])  # before each member's command (ecrec.ops.parent.prefix: ends with us)
        scheme = "https" if tls is not None else "http"
        self.root = tempfile.mkdtemp(prefix="ecrec-etcd-")
        ports = set()
        while len(ports) < 2 * members:
            ports.add(free_port_outside_ephemeral_range(host))
        ports = sorted(ports)
        self.names = [f"m{i}" for i in range(members)]
        self.client_urls = [f"{scheme}://{host}:{ports[2 * i]}" for i in range(members)]
        self.peer_urls = [f"http://{host}:{ports[2 * i + 1]}" for i in range(members)]
        self.procs: list[subprocess.Popen | None] = [None] * members
        self.old_procs: list[subprocess.Popen] = []

    @property
    def endpoints(self) -> list[str]:
        return [u.partition("://")[2] for u in self.client_urls]

    def _args(self, i: int) -> list[str]:
        cluster = ",".join(f"{n}={u}" for n, u in zip(self.names, self.peer_urls))
        return [etcd_binary(), "--name", self.names[i], "--data-dir", os.path.join(self.root, self.names[i]),
                "--listen-client-urls", self.client_urls[i], "--advertise-client-urls", self.client_urls[i],
                "--listen-peer-urls", self.peer_urls[i], "--initial-advertise-peer-urls", self.peer_urls[i],
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", os.path.basename(self.root),
                "--heartbeat-interval", "100", "--election-timeout", "1000", "--logger", "zap",
                "--log-level", "error",
                *(["--client-cert-auth", "--trusted-ca-file", self.tls.ca, "--cert-file", self.tls.cert,
                   "--key-file", self.tls.key] if self.tls is not None else [])]

    def start(self, timeout_s: float = 30.0) -> "LocalEtcd":
        for i in range(len(self.names)):
            self.start_member(i)
        self.wait_healthy(timeout_s)
        return self

    def start_member(self, i: int) -> subprocess.Popen:
        """Starts member ``i`` (again: on its data directory, same ports)."""
        old = self.procs[i]
        if old is not None:
            if old.poll() is None:
                raise RuntimeError(f"etcd member {self.names[i]} (pid {old.pid}) is still running")
            self.old_procs.append(old)
        log = open(os.path.join(self.root, f"{self.names[i]}.log"), "ab")
        self.procs[i] = subprocess.Popen([*self.prefix, *self._args(i)], stdout=log, stderr=log,
                                         start_new_session=self.own_session)
        log.close()
        return self.procs[i]

    def kill_member(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            if sig not in (signal.SIGSTOP, signal.SIGCONT):
                proc.wait(timeout=10)

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Waits until a write through the members succeeds (a leader is elected); raises with the logs' tail."""
        client = self.client(timeout_s=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                for i, p in enumerate(self.procs):
                    if p is not None and p.poll() is not None and p.returncode not in (-signal.SIGKILL,):
                        raise RuntimeError(f"etcd member {self.names[i]} exited with code {p.returncode}: "
                                           f"{self.log_tail(i)}")
                try:
                    client.put(b"/ecrec-local/health", b"ok")
                    return
                except EtcdError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"etcd not healthy after {timeout_s:.0f} s: {self.log_tail(0)}") from None
                    time.sleep(0.1)
        finally:
            client.close()

    def client(self, timeout_s: float = 2.0) -> EtcdClient:
        """A client of these members (with their TLS, when they have it)."""
        return EtcdClient(self.endpoints, timeout_s=timeout_s, tls=self.tls)

    def log_tail(self, i: int, lines: int = 5) -> str:
        try:
            with open(os.path.join(self.root, f"{self.names[i]}.log"), "rb") as f:
                return " | ".join(f.read().decode(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        for p in [*self.procs, *self.old_procs]:
            if p is not None and p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                    p.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        shutil.rmtree(self.root, ignore_errors=True)
