"""The ``ecrec-server`` command line: a local cluster starts, serves, and stops every process on Ctrl-C / SIGTERM."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from ecrec.client import Cluster
from helpers import born as _born, children as children_of, kill_born, started_at as _started

pytestmark = pytest.mark.cluster





def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """One line of ``proc``'s stdout, or "" when none comes within ``timeout_s`` (``readline`` alone can block forever)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if ready else ""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_local_cluster_serves_and_stops_every_process(sig):
    proc = subprocess.Popen([sys.executable, "-m", "ecrec.cli", "--log-level", "WARNING", "local", "--servers", "2",
                             "--standby", "1"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    children: dict[int, str] = {}
    try:
        line = _read_line(proc, timeout_s=120)  # a start that hangs fails here, not at CI's limit
        assert line.startswith("coordinator at 127.0.0.1:"), line
        address = line.split()[2]
        cluster = Cluster.connect(address, wait_ready_s=60)
        assert cluster.map.ready and cluster.map.num_servers == 2
        assert all(s.address.startswith("127.0.0.1:") for s in cluster.map.servers)
        cluster.create_table("t", 10, 4)
        assert cluster.pull("t", [1, 2]).shape == (2, 4)
        children = _born(children_of(proc.pid))
        assert len(children) == 4  # coordinator, 2 servers, 1 standby
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        assert _all_end(children, within_s=10)
    finally:
        _kill_alive(proc, children)


def _all_end(born: dict[int, str], within_s: float) -> bool:
    """Whether every process of ``born`` (:func:`_born`) has ended within ``within_s``."""
    deadline = time.monotonic() + within_s
    while any(_started(p) == t for p, t in born.items()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_started(p) == t for p, t in born.items())


def _kill_alive(proc: subprocess.Popen, born: dict[int, str]) -> None:
    """Kills ``proc`` (our child: its pid is its own until we reap it) and what of ``born`` still runs (never a
    later process given one of their pids)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    kill_born(born)


def test_local_reaps_a_server_that_exits_and_says_so(tmp_path):
    """A server of ``local`` killed by a signal stayed a zombie until local exited, and local said nothing of it."""
    err_path = tmp_path / "local.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ecrec.cli", "--log-level", "WARNING", "local", "--servers",
                                 "2", "--standby", "1", "--strategy", "ecrec", "--k", "1", "--m", "1"],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    children: dict[int, str] = {}
    try:
        line = proc.stdout.readline()
        assert line.startswith("coordinator at "), line
        children = _born(children_of(proc.pid))
        servers = [p for p in children if "serve" in open(f"/proc/{p}/cmdline").read().split("\0")]
        assert len(servers) == 3, servers  # two and a standby
        pid = servers[0]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (_state(pid) == "Z" or f"server process {pid} exited" not in
                                               err_path.read_text()):
            time.sleep(0.2)
        assert _state(pid) != "Z", "a zombie"
        assert f"server process {pid} exited (status -9)" in err_path.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "server process" not in err_path.read_text().split(f"server process {pid} exited", 1)[1]  # stopping: none
    finally:
        _kill_alive(proc, children)


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_local_stops_its_cluster_and_fails_when_its_coordinator_exits(tmp_path):
    """A coordinator that stops (here: its restore finds a snapshot whose table has no valid spec) leaves servers
    serving nobody; ``local`` used to keep them running, logging failed lease renewals three times a second, until
    someone noticed."""
    from ecrec import snapshot
    (tmp_path / "nowhere").mkdir()  # a manifest read at start, whose table is refused once the cluster is up
    (tmp_path / "nowhere" / "manifest.json").write_text(json.dumps({"format": snapshot.FORMAT, "tables": {"a": {}}}))
    proc = subprocess.Popen([sys.executable, "-m", "ecrec.cli", "--log-level", "WARNING", "local", "--servers", "3",
                             "--strategy", "ecrec", "--k", "2", "--m", "1", "--restore", str(tmp_path / "nowhere")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: dict[int, str] = {}  # pid -> start time: `local`'s children, told apart from later users of the pid
    ours = lambda: [pid for pid, started in children.items() if _started(pid) == started]
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in children_of(proc.pid) - set(children):
                started = _started(pid)
                if started is not None:
                    children[pid] = started
            time.sleep(0.2)
        err = proc.stderr.read()
        # 1: it exited once the cluster was up; 2: before `local` saw it ready (a fast failure on a loaded machine)
        assert (proc.returncode, "the coordinator exited" in err) == (1, True) or \
            (proc.returncode == 2 and "exited with code" in err), (proc.returncode, err[-2000:])
        if proc.returncode == 1:  # it was ready: its banner said a restore was under way, not to start training yet
            out = proc.stdout.read()
            assert f"restoring {tmp_path / 'nowhere'}: start training once the coordinator logs 'restored'" in out, out
        deadline = time.monotonic() + 10
        while ours() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert children and not ours()
    finally:
        _kill_local_and_its_children(proc, ours)


def _kill_local_and_its_children(proc: subprocess.Popen, ours) -> None:
    """Kills ``local`` and the processes it started that still run (``ours()``: never a pid another process took
    since)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in ours():
        os.kill(pid, signal.SIGKILL)


def _etcd_missing() -> bool:
    from ecrec.control.etcd_local import etcd_binary

    try:
        etcd_binary()
    except FileNotFoundError:
        return True
    return False


@pytest.mark.parametrize("store", ["file", pytest.param("etcd", marks=pytest.mark.skipif(
    _etcd_missing(), reason="needs the etcd binary (apt-get install etcd-server)"))])
def test_a_kill_9_of_local_leaves_none_of_its_processes_running(store):
    """SIGKILL gives ``local`` no chance to stop its cluster: its children (coordinators, servers, standby, etcd
    members) used to go on serving, orphans holding their ports, until someone found their pids."""
    extra = ["--store", "etcd", "--coordinators", "2", "--etcd-members", "1"] if store == "etcd" else []
    proc = subprocess.Popen([sys.executable, "-m", "ecrec.cli", "--log-level", "WARNING", "local", "--servers", "2",
                             "--standby", "1", *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    children: dict[int, str] = {}
    ours = lambda: [pid for pid, started in children.items() if _started(pid) == started]
    try:
        line = _read_line(proc, timeout_s=120)
        assert line.startswith("coordinator at 127.0.0.1:"), line
        for pid in children_of(proc.pid):
            started = _started(pid)
            if started is not None:
                children[pid] = started
        # coordinator(s), 2 servers, 1 standby (and the etcd member)
        assert len(children) == (4 if store == "file" else 6), children
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while ours() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not ours(), f"still running after local was killed: {ours()}"
    finally:
        _kill_local_and_its_children(proc, ours)


def test_bad_command_lines_fail_clearly():
    run = lambda *a: subprocess.run([sys.executable, "-m", "ecrec.cli", *a], capture_output=True, text=True, timeout=60)
    r = run("coordinator", "--port", "0", "--servers", "3", "--strategy", "ecrec", "--k", "3", "--m", "1")
    assert r.returncode == 2 and "exceeds" in r.stderr
    r = run("coordinator", "--port", "0", "--servers", "3", "--strategy", "nope")
    assert r.returncode == 2 and "unknown fault-tolerance strategy 'nope'" in r.stderr
    r = run("coordinator", "--port", "0", "--servers", "2", "--option", "novalue")
    assert r.returncode == 2 and "ecrec-server coordinator: --option takes KEY=VALUE, got 'novalue'" in r.stderr
    # a checkpoint directory only one process can see is refused before anything starts
    r = run("coordinator", "--port", "0", "--servers", "2", "--strategy", "cpr", "--option", "dir=memory://ckpt",
            "--option", "interval_s=5")
    assert r.returncode == 2 and r.stdout == ""
    assert "ecrec-server coordinator: option dir='memory://ckpt': fsspec's memory filesystem lives inside one process" \
        in r.stderr
    # a wildcard bind address is no address to reach a server at: refused before anything binds or registers
    r = run("serve", "--coordinator", "127.0.0.1:1", "--host", "0.0.0.0")
    assert r.returncode == 2 and "--host 0.0.0.0 binds every interface" in r.stderr and "--advertise-host" in r.stderr
    r = run("status", "--coordinator", "127.0.0.1:93241")  # gRPC would take it modulo 65536: another port
    assert r.returncode == 2 and "'127.0.0.1:93241': not host:port with a port in 1-65535" in r.stderr
    # an IPv6 address without brackets: gRPC read ::1:50051 as ::0.1.0.1 on port 443 and timed out after seconds
    r = run("status", "--coordinator", "::1:50051")
    assert r.returncode == 2 and "'::1:50051': an IPv6 address goes in brackets before its port ([::1]:50051)" \
        in r.stderr
    # a NaN, 0 or negative deadline, interval or bound made a process loop, wait forever or refuse every call
    r = run("serve", "--coordinator", "127.0.0.1:1", "--max-message-bytes", "0")  # looped on RESOURCE_EXHAUSTED
    assert r.returncode == 2 and "max_message_bytes (--max-message-bytes) 0: must be at least 65536" in r.stderr
    r = run("serve", "--coordinator", "127.0.0.1:1", "--rpc-timeout-s", "nan")
    assert r.returncode == 2 and "rpc_timeout_s (--rpc-timeout-s) nan: must be a finite number > 0" in r.stderr
    # a --state-path the coordinator cannot keep its map in: said at its first save before, naming a temporary file
    r = run("coordinator", "--port", "0", "--servers", "2", "--state-path", "/nonexistent/dir/map.pb")
    assert r.returncode == 2 and "--state-path /nonexistent/dir/map.pb: no directory /nonexistent/dir" in r.stderr
    r = run("coordinator", "--port", "0", "--servers", "2", "--state-path", "/tmp")
    assert r.returncode == 2 and "--state-path /tmp is a directory: name the file" in r.stderr
    r = run("coordinator", "--port", "0", "--servers", "2", "--health-interval", "0")
    assert r.returncode == 2 and "health_interval_s (--health-interval) 0.0: must be a finite number > 0" in r.stderr
    r = run("status", "--coordinator", "127.0.0.1:1", "--timeout", "nan")  # DEADLINE_EXCEEDED before
    assert r.returncode == 2 and "timeout must be > 0 and at most 1e+08 seconds, got nan" in r.stderr
    r = run("status", "--coordinator", "127.0.0.1:1", "--timeout", "1e10")  # DEADLINE_EXCEEDED at once before
    assert r.returncode == 2 and "got 10000000000.0" in r.stderr
    r = run("serve", "--coordinator", "127.0.0.1:1", "--rpc-timeout-s", "1e10")  # could not register before
    assert r.returncode == 2 and "must be a finite number > 0 and at most 1e+08 (seconds)" in r.stderr
    r = run("snapshot", "--coordinator", "127.0.0.1:1", "--timeout", "1e10", "/tmp/x")  # a traceback before
    assert r.returncode == 2 and "--timeout must be a positive number of seconds (at most 1e+08)" in r.stderr
    # usage errors of snapshot/restore are usage errors (status 1 before), found before the cluster is waited for
    r = run("snapshot", "--coordinator", "foo", "/tmp/x")
    assert r.returncode == 2 and "coordinator address 'foo': not host:port" in r.stderr, r.stderr
    for command, path in (("snapshot", "memory://x"), ("restore", "memory://x"), ("snapshot", "")):
        r = run(command, "--coordinator", "127.0.0.1:1", "--wait", "30", path)
        assert r.returncode == 2 and ("memory filesystem lives inside one process" in r.stderr or
                                      "the snapshot path is empty" in r.stderr), r.stderr
    r = run("--log-format", "json", "snapshot", "--coordinator", "127.0.0.1:1", "--timeout", "-1", "/tmp/x")
    last = json.loads(r.stderr.strip().splitlines()[-1])  # a command's last word is a JSON object (plain text before)
    assert r.returncode == 2 and "--timeout must be a positive number" in last["message"], r.stderr
    r = run("status", "--coordinator", "127.0.0.1:1", "--wait", "nan")
    assert r.returncode == 2 and "--wait must be >= 0 seconds, got nan" in r.stderr
    r = run("local", "--servers", "2", "--standby", "-1")
    assert r.returncode == 2 and "--standby -1: a number of spare servers is >= 0" in r.stderr
    r = run("local", "--servers", "2", "--option", "novalue")
    assert r.returncode == 2 and "ecrec-server local: --option takes KEY=VALUE, got 'novalue'" in r.stderr
    # a port number out of range is refused before anything binds or registers (a server waited on before)
    r = run("serve", "--coordinator", "127.0.0.1:1", "--port", "70000")
    assert r.returncode == 2 and "ecrec-server serve: --port 70000 is not a port (0-65535" in r.stderr
    r = run("serve", "--coordinator", "127.0.0.1:1", "--metrics-port", "-1")
    assert r.returncode == 2 and "--metrics-port -1 is not a port" in r.stderr
    r = run("serve", "--coordinator", "127.0.0.1:1", "--index", "-2")  # waited on its coordinator before
    assert r.returncode == 2 and "ecrec-server serve: --index -2: an index is >= 0" in r.stderr
    r = run("coordinator", "--servers", "2", "--port", "65536")
    assert r.returncode == 2 and "ecrec-server coordinator: --port 65536 is not a port" in r.stderr


def test_a_servers_address_in_the_map_is_its_advertised_host():
    from ecrec.config import ServerConfig

    assert ServerConfig(coordinator="c:1", host="0.0.0.0", advertise_host="10.1.2.3").public_host == "10.1.2.3"
    assert ServerConfig(coordinator="c:1", host="127.0.0.1").public_host == "127.0.0.1"
    assert ServerConfig(coordinator="c:1", host="127.0.0.1", advertise_host="h.example").public_host == "h.example"
    for wildcard in ("0.0.0.0", "::", "[::]"):
        with pytest.raises(ValueError, match="--advertise-host"):
            ServerConfig(coordinator="c:1", host=wildcard).public_host


def test_a_server_whose_coordinator_is_gone_warns_now_and_then_not_at_every_try(make_cluster):
    """Renewals go on every lease/3 seconds: a server and a standby whose coordinator died logged a warning each
    (three a second by default) for as long as they ran; now one line, then one every UNREACHABLE_LOG_S."""
    local = make_cluster(servers=1, standby=1, strategy="none", log_level="WARNING")
    local.kill(local.coordinator_proc.pid)
    time.sleep(4.0)
    for proc in local.server_procs:
        lines = [line for line in local.stderr_tail(proc.pid) if "WARNING" in line]
        assert len(lines) == 1, lines  # was about a dozen by now
        assert "serving until" in lines[0] or "a standby, it waits" in lines[0], lines
    from ecrec.server.process import UNREACHABLE_LOG_S

    assert UNREACHABLE_LOG_S > 4.0


def test_status_piped_into_a_reader_that_leaves_ends_without_a_traceback(make_cluster):
    """``ecrec-server status | head`` ended in a BrokenPipeError traceback."""
    local = make_cluster(servers=2, strategy="ecrec", k=1, m=1)
    run = subprocess.run(f"{sys.executable} -m ecrec.cli status --coordinator {local.coordinator_address} | true",
                         shell=True, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr, run.stderr
    # and its exit status is the cluster's (it was 1, "not redundant", whatever the cluster; a `set -o pipefail`
    # script read a healthy cluster as degraded)
    for command in ("status", "status --json"):
        run = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m ecrec.cli {command} --coordinator "
                              f"{local.coordinator_address} | true"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, (command, run.returncode, run.stderr)


def test_status_json_of_a_coordinator_that_does_not_answer_is_an_object_too():
    """``status --json`` printed nothing on stdout when the coordinator did not answer (exit status 2): a script
    parsing stdout failed on empty input."""
    import json
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "ecrec.cli", "status", "--json", "--timeout", "1", "--coordinator",
                        f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    answer = json.loads(r.stdout)
    assert answer["reachable"] is False and answer["coordinator"] == f"127.0.0.1:{port}" and answer["error"]


def test_local_refuses_a_state_path_holding_an_earlier_clusters_map(tmp_path):
    """``local --state-path`` reused after a run brought that cluster's map back with new, empty servers: DATA LOSS
    of every table at once, under a banner saying the cluster was ready."""
    state = tmp_path / "map.pb"
    state.write_bytes(b"\x08\x01")  # any map an earlier coordinator left
    r = subprocess.run([sys.executable, "-m", "ecrec.cli", "local", "--servers", "2", "--state-path", str(state)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
    assert f"--state-path {state} holds the map of an earlier cluster" in r.stderr and "--restore" in r.stderr
    assert state.read_bytes() == b"\x08\x01"


def test_restore_of_a_path_holding_no_snapshot_is_refused_before_anything_starts(tmp_path):
    """``local --restore`` and ``coordinator --restore`` of a path with no snapshot started the whole cluster,
    printed its banner, and stopped it once every server had registered (seconds later, on a cluster of hosts:
    whenever the last one came up)."""
    for command in (["local", "--servers", "3"], ["coordinator", "--servers", "3", "--port", "0"]):
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "ecrec.cli", *command, "--strategy", "ecrec", "--k", "2", "--m", "1",
                            "--restore", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stdout == "", (command, r.returncode, r.stdout, r.stderr[-1000:])
        assert f"--restore {tmp_path / 'nowhere'}: " in r.stderr and "no manifest.json" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and time.monotonic() - t0 < 30
    assert not (tmp_path / "nowhere").exists()


def test_serve_with_an_index_another_server_holds_says_it_waits_as_a_standby_for_it(make_cluster):
    """``serve --index N`` with N held became a standby saying only 'registered as standby'."""
    from ecrec.client import Cluster
    from helpers import wait_for

    local = make_cluster(servers=2, strategy="none")
    proc = local.start_server(index=0)
    said = wait_for(lambda: [line for line in local.stderr_tail(proc.pid) if "index 0 is held by another server" in line],
                    60, "the warning of a taken --index")
    assert "this server is a standby, promoted into index 0 first should it fail" in said[0]
    cluster = Cluster.connect(local.coordinator_address)
    try:
        standbys = [s for s in cluster.refresh_map().servers if s.index < 0]
        assert len(standbys) == 1
    finally:
        cluster.close()


def test_local_refuses_coordinator_and_etcd_counts_that_cannot_be():
    """``--coordinators 0`` said 'more than one needs store=etcd'; ``--etcd-members`` with the file store was
    silently ignored; ``--etcd-members 0`` with etcd failed later."""
    run = lambda *a: subprocess.run([sys.executable, "-m", "ecrec.cli", "local", "--servers", "2", *a],
                                    capture_output=True, text=True, timeout=60)
    for args, said in [(["--coordinators", "0"], "0 coordinators: a cluster needs at least 1"),
                       (["--etcd-members", "3"], "--etcd-members is for --store etcd"),
                       (["--store", "etcd", "--etcd-members", "0"], "0 etcd members: an etcd store needs at least 1"),
                       # serve's advice (--advertise-host) was given, a flag local does not take
                       (["--host", "0.0.0.0"], "--host 0.0.0.0 binds every interface, so it is no address local's"),
                       # a directory was said to hold 'the map of an earlier cluster ... DATA LOSS'
                       (["--state-path", "/tmp"], "--state-path /tmp is a directory: name the file"),
                       # failed after the start naming a temporary file
                       (["--state-path", "/nonexistent/dir/map.pb"], "no directory /nonexistent/dir to keep it in")]:
        r = run(*args)
        assert r.returncode == 2 and said in r.stderr and r.stdout == "", (args, r.returncode, r.stderr[-500:])


@pytest.mark.parametrize("started", [1, 3])
def test_ctrl_c_while_local_starts_ends_it_with_a_line_and_no_process_left(started):
    """Ctrl-C while ``local`` started its cluster (its coordinator started; its servers too) printed a
    KeyboardInterrupt traceback.  (One during Python's own imports, before any of its code runs, is Python's.)"""
    proc = subprocess.Popen([sys.executable, "-m", "ecrec.cli", "local", "--servers", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    children: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while len(children_of(proc.pid)) < started and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        children = _born(children_of(proc.pid))
        assert len(children) >= started, children
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
        out, err = proc.communicate(timeout=60)
        assert "Traceback" not in err, err[-3000:]
        assert proc.returncode == 130 and "interrupted" in err or proc.returncode == 0, (proc.returncode, err[-2000:])
        assert _all_end(children, within_s=10)
    finally:
        _kill_alive(proc, children)


def test_local_with_an_etcd_binary_path_that_holds_none_names_it(tmp_path):
    """``ECREC_ETCD=/nonexistent local --store etcd`` printed a fragment of a child's traceback
    ('FileNotFoundError: [Errno 2] No such file or directory') naming no path."""
    r = subprocess.run([sys.executable, "-m", "ecrec.cli", "local", "--servers", "2", "--store", "etcd"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "ECREC_ETCD": str(tmp_path / "nonexistent")})
    assert r.returncode == 2, (r.returncode, r.stderr[-1000:])
    assert f"ECREC_ETCD={tmp_path / 'nonexistent'}: no executable file there" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("argv, said", [
    # an unset shell variable gave an empty flag: no token, no TLS CA, no restore, and no word of it
    (["coordinator", "--port", "0", "--servers", "4", "--token-file", ""], "--token-file is empty"),
    (["coordinator", "--port", "0", "--servers", "4", "--restore", ""], "--restore is empty"),
    (["serve", "--coordinator", "127.0.0.1:9", "--port", "0", "--tls-ca", ""], "--tls-ca is empty"),
    (["local", "--servers", "2", "--restore", ""], "--restore is empty"),
    (["local", "--servers", "2", "--token-file", ""], "--token-file is empty"),
    # past what one map or one host holds: accepted, then memory or processes ran out
    (["coordinator", "--port", "0", "--servers", "1000000000"], "--servers 1,000,000,000: at most 4,096"),
    (["local", "--servers", "100", "--standby", "1"], "--servers and --standby (101 processes): at most 64"),
    (["local", "--servers", "2", "--store", "etcd", "--coordinators", "20"], "--coordinators 20: at most 9"),
    # a wait past what a timer takes (a server's timer thread died of an OverflowError), a batch past a message
    (["coordinator", "--port", "0", "--servers", "4", "--strategy", "ecrec", "--k", "2", "--m", "1", "--option",
      "relay_timeout_s=2e10"], "relay_timeout_s 2e+10 must be at most 1e+08 (seconds)"),
    (["coordinator", "--port", "0", "--servers", "4", "--strategy", "ecrec", "--k", "2", "--m", "1", "--option",
      "max_batch_bytes=100000000000"], "max_batch_bytes 100,000,000,000 must be at most 2,147,483,647"),
    # --k of a strategy with no stripes was ignored (--m was refused)
    (["coordinator", "--port", "0", "--servers", "4", "--k", "2"], "keeps no stripes"),
    # how to dial etcd, given to a coordinator whose map is not in etcd: ignored without a word
    (["coordinator", "--port", "0", "--servers", "2", "--etcd-ca", "ca.pem"],
     "--etcd-ca: how to dial etcd, and this coordinator keeps its map in memory, not in etcd"),
    (["coordinator", "--port", "0", "--servers", "2", "--etcd-cert", "c.pem", "--etcd-key", "k.pem"],
     "--etcd-cert, --etcd-key: how to dial etcd"),
])
def test_server_commands_refuse_what_they_would_run_wrongly_before_anything_serves(argv, said):
    """Each of these was taken: it started serving (a coordinator, a server, a local cluster) without what was
    asked, or with a bound it could not keep.  Each is a usage error now, exit 2, one line, nothing started."""
    try:
        r = subprocess.run([sys.executable, "-m", "ecrec.cli", *argv], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv} was taken: it started and served")
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, (r.returncode, r.stderr[-800:])


def test_a_bad_snapshot_path_leaves_the_callers_sigterm_handler_and_empty_security_flags_are_refused(tmp_path,
                                                                                                      capsys):
    """``main()`` called in a program: a path refused at once used to leave its SIGTERM handler installed (a later
    SIGTERM raised its exception in whatever ran next); ``status``, ``snapshot`` and ``restore`` took an empty
    ``--token-file`` or ``--tls-*`` (an unset shell variable) as none, and called a TLS cluster in plaintext."""
    from ecrec import cli
    from ecrec.config import ClientConfig

    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["snapshot", "--coordinator", "127.0.0.1:1", " "]) == 2
    assert signal.getsignal(signal.SIGTERM) is before
    for argv in (["status", "--coordinator", "127.0.0.1:1", "--token-file", ""],
                 ["snapshot", "--coordinator", "127.0.0.1:1", "--tls-ca", " ", str(tmp_path / "s")],
                 ["restore", "--coordinator", "127.0.0.1:1", "--token-file", "", str(tmp_path / "s")]):
        assert cli.main(argv) == 2, argv
        assert "is empty" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is before
    assert not (tmp_path / "s").exists()
    with pytest.raises(ValueError, match="--token-file is empty"):
        ClientConfig(token_file="")
