"""A private network for partition tests: one bridge with an address of its own, and one network namespace
per server process, each on a veth link to the bridge.  Taking a server's link down cuts it off from
every other process (coordinator, workers, peers) while it keeps running; bringing it up heals it.

Needs root and ``ip netns`` (``NetLab.available()`` says why not).  Every name carries a random tag and
everything is deleted at ``close()``; no traffic leaves the bridge's /24.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import subprocess
import tempfile


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


@contextlib.contextmanager
def _machine_lock():
    """An exclusive lock shared by every NetLab on this machine (a file lock in the temp directory)."""
    with open(os.path.join(tempfile.gettempdir(), "ecrec-netlab.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _free_subnet() -> int:
    """A ``10.S.0.0/24`` (S in 200..249) that no interface or route on this machine uses."""
    used = _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    free = [s for s in range(200, 250) if f"10.{s}.0." not in used]
    if not free:
        raise RuntimeError("no free 10.S.0.0/24 (S in 200..249) for a test network")
    return free[secrets.randbelow(len(free))]


class NetLab:
    def __init__(self, subnet: int | None = None):
        self.tag = secrets.token_hex(2)
        self.bridge = f"ecb{self.tag}"
        self.links: dict[str, str] = {}  # server address (host) -> root-side veth
        self.namespaces: list[str] = []
        self._next = 10
        # two labs on one /24 (concurrent test runs on one machine) would route each other's traffic: a
        # connection to a live server then meets the other lab's namespace and is refused.  Pick a subnet no
        # address on this machine uses, under a machine-wide lock held until the bridge has its address.
        with _machine_lock():
            self.subnet = subnet if subnet is not None else _free_subnet()
            self.bridge_ip = f"10.{self.subnet}.0.1"
            _ip("link", "add", self.bridge, "type", "bridge")
            try:
                _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
                _ip("link", "set", self.bridge, "up")
            except Exception:
                self.close()
                raise

    @staticmethod
    def available() -> tuple[bool, str]:
        if os.geteuid() != 0:
            return False, "not root"
        try:
            probe = NetLab()
            ns = probe.place()
            probe.close()
            return bool(ns), ""
        except Exception as exc:  # noqa: BLE001 - the reason is the answer
            return False, f"ip netns does not work here: {exc}"

    def place(self) -> tuple[list[str], str]:
        """A new namespace on the bridge: ``(command prefix, its address)`` (LocalClusterSpec.server_placement)."""
        n = self._next
        self._next += 1
        if n > 250:
            raise RuntimeError("the lab's /24 is full")
        ns, host_end, ns_end = f"ecn{self.tag}{n}", f"ecv{self.tag}{n}h", f"ecv{self.tag}{n}n"
        address = f"10.{self.subnet}.0.{n}"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", ns_end, "netns", ns)
        _ip("link", "set", host_end, "master", self.bridge)
        _ip("link", "set", host_end, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", ns_end)
        _ip("-n", ns, "link", "set", ns_end, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.links[address] = host_end
        return ["ip", "netns", "exec", ns], address

    def cut(self, address: str) -> None:
        """Partitions the server at ``address`` (host part) from everything else."""
        _ip("link", "set", self.links[address], "down")

    def heal(self, address: str) -> None:
        _ip("link", "set", self.links[address], "up")

    def close(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)  # deletes its veth end, and with it the pair
        for link in self.links.values():
            _ip("link", "del", link, check=False)
        _ip("link", "del", self.bridge, check=False)
        self.namespaces, self.links = [], {}
