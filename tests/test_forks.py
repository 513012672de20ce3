"""The warm parent that forks local clusters' processes in the tests (``ecrec.ops.forks``): its children are the
processes ``python -m ecrec.cli`` would be, seen through a Popen-like handle; an environment it cannot give is
left to a process of its own; its children do not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from ecrec.ops import forks

pytestmark = pytest.mark.cluster


def _env() -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")


def test_a_forked_command_line_has_its_streams_exit_status_and_cpu():
    server = forks.ForkServer(_env())
    try:
        bad = server.spawn(["--log-level", "WARNING", "serve"], _env(), stdout=True)  # --coordinator is required
        assert bad.wait(timeout=30) == 2
        assert "--coordinator" in bad.stderr.read()
        helped = server.spawn(["status", "--help"], _env(), stdout=True)
        assert helped.wait(timeout=30) == 0 and "example: ecrec-server status" in helped.stdout.read()
        waiting = server.spawn(["--log-level", "WARNING", "serve", "--coordinator", "127.0.0.1:9",
                                "--register-timeout-s", "60"], dict(_env(), ECREC_FAULT=""))
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=0.5)
        assert waiting.poll() is None
        waiting.send_signal(signal.SIGKILL)
        assert waiting.wait(timeout=30) == -signal.SIGKILL
        assert server.children_cpu_s() > 0
    finally:
        server.close()


def test_children_die_with_the_warm_parent_and_read_as_killed():
    server = forks.ForkServer(_env())
    child = server.spawn(["--log-level", "WARNING", "serve", "--coordinator", "127.0.0.1:9",
                          "--register-timeout-s", "60"], _env())
    os.kill(server._proc.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL  # read as killed at once
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"child {child.pid} outlived its warm parent")
    with pytest.raises(RuntimeError, match="has ended"):
        server.spawn(["status", "--help"], _env())
    server.close()


def test_a_child_whose_parent_died_before_it_asked_to_die_with_it_ends_itself():
    """The race the parent-death signal leaves open: the warm parent killed between its fork and the child's
    prctl.  Played out in a process of its own that adopts orphans (PR_SET_CHILD_SUBREAPER), so it can wait for
    the orphaned child and read how it ended."""
    import ctypes

    reaper = os.fork()
    if reaper == 0:  # the reaper: forks a parent that forks the child and dies before the child asks
        code = 3
        try:
            ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
            ready_r, ready_w = os.pipe()
            parent = os.fork()
            if parent == 0:
                me = os.getpid()
                if os.fork() == 0:
                    os.close(ready_w)
                    os.read(ready_r, 1)  # EOF: the parent is gone (and the reaper let go of the pipe)
                    try:
                        forks._die_with_parent(me)
                    finally:
                        os._exit(0)  # outlived its parent
                os._exit(0)
            os.close(ready_r)
            os.waitpid(parent, 0)
            os.close(ready_w)
            _, status = os.wait()  # the orphan, adopted by this reaper
            code = 0 if os.waitstatus_to_exitcode(status) == -signal.SIGKILL else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(reaper, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the orphaned child did not end itself"


def test_an_environment_the_warm_parent_cannot_give_is_left_to_a_process_of_its_own():
    spawner = forks.Spawner()
    try:
        first = spawner(["status", "--help"], dict(_env(), PYTEST_CURRENT_TEST="a", ECREC_FAULT="x@1"), True)
        assert first is not None and first.wait(timeout=30) == 0
        assert spawner(["status", "--help"], dict(_env(), PYTEST_CURRENT_TEST="b"), True) is not None
        assert spawner(["status", "--help"], dict(_env(), ECREC_ISAL_LIBRARY="/elsewhere.so"), True) is None
    finally:
        spawner._server.close()


NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def _spawn_with_pid(server: forks.ForkServer, pid: int, timeout_s: float = 180.0) -> forks.Forked | None:
    """A child of ``server`` given ``pid`` (the kernel hands out ``ns_last_pid + 1`` next: another process may fork,
    or start a thread, between the write and the warm parent's fork, so it is tried again, for as long as
    ``timeout_s``: beside a loaded test run's gRPC servers, 200 tries in a row once all lost that race); None when
    it never came."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(NS_LAST_PID, "w") as f:
            f.write(str(pid - 1))
        child = server.spawn(["--log-level", "WARNING", "serve", "--coordinator", "127.0.0.1:9",
                              "--register-timeout-s", "60"], _env())
        if child.pid == pid:
            return child
        child.kill()
        child.wait(timeout=30)
    return None


@pytest.mark.skipif(not os.access(NS_LAST_PID, os.W_OK), reason="choosing the next pid needs root")
def test_a_child_given_the_pid_of_one_that_exited_is_not_read_as_exited():
    """A pid is reused once its child is reaped, and a test run forks thousands: a later child with an earlier
    one's pid was read as that one's exit -- taken for dead, so a test never found the server it started serving
    and a cluster's teardown left it running, an orphan logging failed lease renewals."""
    server = forks.ForkServer(_env())
    try:
        first = server.spawn(["status", "--help"], _env(), stdout=True)
        assert first.wait(timeout=30) == 0
        second = _spawn_with_pid(server, first.pid)
        assert second is not None, f"no child was given pid {first.pid} again in 180 s of tries"
        assert second.poll() is None, "the new child was read as the exit of the one that had its pid before"
        with pytest.raises(subprocess.TimeoutExpired):
            second.wait(timeout=0.2)
        first.kill()  # the exited one's handle signals nothing (its pid is the new child's now)
        # nor does a signal for it that reaches the warm parent before its exit reached this end: it goes by the
        # child (one the warm parent has not reaped), never by pid
        server.signal(first._id, signal.SIGKILL)
        assert second.poll() is None
        os.kill(second.pid, 0)
        second.kill()
        assert second.wait(timeout=30) == -signal.SIGKILL
        assert first.poll() == 0
    finally:
        server.close()
