"""A port another process serves is refused, never shared: gRPC's servers turn SO_REUSEPORT on by default on Linux,
so a second server on a coordinator's port used to start without a word and take half its calls (the map gave
the coordinator's address as a server's; ``status`` answered UNIMPLEMENTED every other time)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from ecrec.net import transport
from ecrec.net.security import bind

pytestmark = pytest.mark.cluster


def test_a_second_server_on_a_served_port_is_refused_naming_it():
    first = transport.make_server(2)
    port = bind(first, "127.0.0.1", 0, None)
    first.start()
    try:
        second = transport.make_server(2)
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}: in use"):
            bind(second, "127.0.0.1", port, None)
    finally:
        first.stop(0)


def test_the_cli_refuses_a_coordinators_port_for_a_second_coordinator_and_a_server():
    coordinator = subprocess.Popen([sys.executable, "-m", "ecrec.cli", "coordinator", "--host", "127.0.0.1", "--port",
                                    "0", "--servers", "2"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([coordinator.stdout], [], [], 60)  # a coordinator that never starts fails here
        assert ready, "the coordinator did not print its address within 60 s"
        line = coordinator.stdout.readline()
        assert line.startswith("ECREC_COORDINATOR "), line
        address = line.split()[1]
        port = address.rsplit(":", 1)[1]
        run = lambda *a: subprocess.run([sys.executable, "-m", "ecrec.cli", *a], capture_output=True, text=True,
                                        timeout=60)
        r = run("coordinator", "--host", "127.0.0.1", "--port", port, "--servers", "2")
        assert r.returncode != 0 and f"127.0.0.1:{port}: in use" in r.stderr, r.stderr[-2000:]
        r = run("serve", "--coordinator", address, "--host", "127.0.0.1", "--port", port)
        assert r.returncode != 0 and f"127.0.0.1:{port}: in use" in r.stderr, r.stderr[-2000:]
        assert coordinator.poll() is None  # the first one serves on
    finally:
        os.kill(coordinator.pid, signal.SIGTERM)
        try:
            coordinator.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(coordinator.pid, signal.SIGKILL)
            coordinator.wait()
