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


def test_a_new_channel_reaches_a_server_restarted_on_its_port_while_an_old_one_waits_out_its_backoff():
    """gRPC pools connections process-wide: a new channel to an address used to share an older channel's connection,
    and failed at once (UNAVAILABLE, connection refused) while that one waited out its reconnect backoff after the
    process serving there stopped -- though another served the address by then (CI lost a run to it: a test's
    in-process coordinator got a port an earlier test's server had used)."""
    import grpc

    def serve(port):
        server = transport.make_server(2)
        echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", {"Echo": echo})])
        port = bind(server, "127.0.0.1", port, None)
        server.start()
        return server, port

    def call(channel):
        return channel.unary_unary("/test.Echo/Echo")(b"ping", timeout=5)

    first, port = serve(0)
    old = transport.make_channel(f"127.0.0.1:{port}")
    second = new = None
    try:
        assert call(old) == b"ping"
        first.stop(0).wait()
        with pytest.raises(grpc.RpcError) as failed:  # the old channel now knows the address refuses, and backs off
            call(old)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        second, _ = serve(port)
        new = transport.make_channel(f"127.0.0.1:{port}")
        assert call(new) == b"ping"  # not UNAVAILABLE from the old channel's connection
    finally:
        for channel in (old, new):
            if channel is not None:
                channel.close()
        for server in (first, second):
            if server is not None:
                server.stop(0)
