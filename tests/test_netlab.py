"""The partition lab (``tests/netlab.py``) that the nemesis relies on: labs made at the same time on one machine
never share a subnet (two labs on one /24 route each other's traffic, and a live server then looks gone),
a cut link isolates one server and a heal restores it (within seconds), and ``close`` leaves nothing behind."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import pytest

from netlab import NetLab, _free_subnet

ok, why = NetLab.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"needs root and ip netns: {why}")


def test_labs_made_at_once_get_different_subnets_and_close_cleanly():
    labs: list[NetLab] = []
    lock = threading.Lock()

    def make():
        lab = NetLab()
        with lock:
            labs.append(lab)

    threads = [threading.Thread(target=make) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        subnets = [lab.subnet for lab in labs]
        assert len(set(subnets)) == len(labs) == 6
        taken = set(subnets)
        assert all(_free_subnet() not in taken for _ in range(40))
    finally:
        for lab in labs:
            lab.close()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not any(lab.bridge in links for lab in labs)


def test_a_cut_isolates_one_namespace_and_a_heal_restores_it():
    lab = NetLab()
    try:
        prefix, address = lab.place()
        listener = subprocess.Popen([*prefix, "python3", "-c",
                                     "import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 0)); s.listen();"
                                     "print(s.getsockname()[1], flush=True); import time; time.sleep(60)", address],
                                    stdout=subprocess.PIPE, text=True)
        try:
            port = int(listener.stdout.readline())

            def reachable() -> bool:
                try:
                    with socket.create_connection((address, port), timeout=0.5):
                        return True
                except OSError:
                    return False

            def reachable_within(seconds: float) -> bool:  # a link brought up takes a moment to forward again
                deadline = time.monotonic() + seconds
                while not reachable():
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.1)
                return True

            assert reachable_within(10)
            lab.cut(address)
            assert not reachable()
            lab.heal(address)
            assert reachable_within(10)
        finally:
            listener.kill()
            listener.wait(timeout=10)
    finally:
        lab.close()
