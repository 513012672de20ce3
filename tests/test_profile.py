"""``ecrec-bench profile``: the step-time distribution and what a strategy adds per row update are functions of the
recorded figures (in-process); a run against ``none`` on tables of any size measures every part of the parity
path on real servers."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ecrec.bench import cli, profile_runs
from helpers import born, kill_born, started_at


def test_step_times_are_a_function_of_the_step_records():
    records = [(0.010, 0.004, [0.01, 0.0]), (0.012, 0.005, [0.0, 0.0]), (0.050, 0.002, [0.03, 0.01]),
               (0.008, 0.004, [0.0, 0.0])]
    t = profile_runs.step_records(records)
    assert t["steps"] == 4 and t["median_ms"] == pytest.approx(11.0) and t["max_ms"] == pytest.approx(50.0)
    assert t["stall_share"] == pytest.approx(50 / 80)  # one step over 30 ms, of 80 ms in all
    assert t["longest"] == {"ms": pytest.approx(50.0), "worker_cpu_ms": pytest.approx(2.0),
                            "servers_cpu_ms": pytest.approx(40.0), "each_server_cpu_ms": [30.0, 10.0], "index": 2}
    assert profile_runs.step_records([]) == {"steps": 0}


def _report(total_ms, rows, parts, worker=5.0, median=10.0, p99=20.0, stall=0.0, samples_per_s=1000.0, push_ms=3.0):
    servers = {"thread:total": total_ms, "rows:pushed": rows, "handler:Push": push_ms}
    servers.update({f"strategy:part_{name}_cpu_s": ms for name, ms in parts.items()})
    return {"servers_per_step": servers, "cpu_ms_per_step": {"worker": worker, "servers": total_ms, "coordinator": 0.0},
            "samples_per_s": samples_per_s,
            "step_times": {"median_ms": median, "p99_ms": p99, "stall_share": stall}}


def test_what_a_strategy_adds_per_row_update_is_a_function_of_two_reports():
    base = _report(7.0, 500, {})
    run = _report(9.0, 500, {"delta": 0.1, "merge": 0.2, "apply": 0.5}, median=11.0, p99=40.0, stall=0.05,
                  samples_per_s=900.0, push_ms=3.5)
    added = profile_runs.added_by(base, run)
    assert added["server_cpu_ms_per_step"] == pytest.approx(2.0)
    assert added["server_cpu_us_per_row_update"] == pytest.approx(4.0)  # 2 ms over 500 rows
    parts = added["parts_us_per_row_update"]
    assert parts["delta"] == pytest.approx(0.2) and parts["merge"] == pytest.approx(0.4)
    assert parts["apply"] == pytest.approx(1.0) and parts["build"] == 0.0
    assert parts["rest"] == pytest.approx(4.0 - 1.6)  # what the counters do not see
    assert sum(parts.values()) == pytest.approx(added["server_cpu_us_per_row_update"])
    assert added["total_cpu_ratio"] == pytest.approx(14.0 / 12.0)
    assert added["samples_per_s_ratio"] == pytest.approx(0.9)
    assert added["median_step_ratio"] == pytest.approx(1.1) and added["p99_step_ratio"] == pytest.approx(2.0)
    assert added["stall_share"] == pytest.approx(0.05)
    assert added["places_us_per_row_update"]["handler:Push"] == pytest.approx(1.0)  # 0.5 ms more over 500 rows
    assert added["places_us_per_row_update"]["thread:ecrec-parity-sender"] == 0.0
    assert math.isnan(profile_runs.added_by(base, _report(9.0, 0, {}))["server_cpu_us_per_row_update"])


def test_the_rounds_give_the_median_and_spread_of_each_figure():
    base = _report(7.0, 500, {})
    added = [profile_runs.added_by(base, _report(total, 500, {"merge": merge}))
             for total, merge in ((8.0, 0.1), (10.0, 0.3), (9.0, 0.2))]
    s = profile_runs.summarize(added)
    assert s["server_cpu_us_per_row_update"] == {"median": pytest.approx(4.0), "min": pytest.approx(2.0),
                                                 "max": pytest.approx(6.0), "n": 3}
    assert s["parts_us_per_row_update"]["merge"]["median"] == pytest.approx(0.4)
    assert s["parts_us_per_row_update"]["apply"]["max"] == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--against", "ecrec"], "another setting"),
    (["--against", "ecrec", "--option", "a=1", "--against-option", "a=1"], "another setting"),
    (["--against-option", "parity_transport=grpc"], "needs --against"),
    (["--against", "ecrec", "--against-option", "parity_transport"], "--against-option 'parity_transport': expected"),
    (["--against", "nosuch"], "is not a strategy"),
    (["--rows", "0"], "--rows must be >= 1"),
    (["--seconds", "0"], "--seconds must be > 0"),
    (["--server", "9"], "--server must be in"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--rate", "0"], "--rate must be >= 1"),  # py-spy at rate 0 never stopped: a traceback 60 s later
    (["--top", "0"], "--top must be >= 1"),
    (["--option", "coalesce_bytes"], "expected KEY=VALUE"),
    # what the coordinator would refuse, said before any cluster starts (a traceback from the start before)
    (["--option", "nosuch=1"], "unknown option(s) ['nosuch']"),
    (["--against", "ecrec", "--against-option", "coalesce_stagger=perhaps"], "coalesce_stagger='perhaps'"),
    (["--against", "none", "--against-option", "x=1"], "strategy 'none' takes no options"),
    (["--k", "4", "--m", "1"], "k + m = 5 exceeds the number of servers (4)"),
    (["--against-server-option", "no_gc_freeze=true"], "--against-server-option needs --against"),
    (["--against", "ecrec", "--server-option", "nosuch=1"], "--server-option nosuch: no such server setting"),
    (["--against", "ecrec", "--against-server-option", "no_gc_freeze=maybe"],
     "--against-server-option no_gc_freeze=maybe: expected true or false"),
    (["--against", "ecrec", "--against-server-option", "rpc_timeout_s=soon"], "expected a number"),
    (["--against", "ecrec", "--server-option", "no_gc_freeze"], "--server-option 'no_gc_freeze': expected KEY=VALUE"),
    (["--against", "ecrec", "--server-option", "no_gc_freeze=true", "--against-server-option", "no_gc_freeze=1"],
     "another setting"),
])
def test_profile_refuses_bad_arguments(argv, message, capsys):
    assert cli.main(["profile", "--no-py-spy", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.benchmark
@pytest.mark.cluster
def test_profile_against_none_on_tables_of_any_size_measures_every_part(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert cli.main(["profile", "--against", "none", "--rows", "3000", "--dim", "8", "--servers", "3",
                     "--batch-size", "64", "--no-py-spy", "--seconds", "4", "--rounds", "2", "--option", "coalesce_pushes=2", "--option", "relay=on",
                     "--out", str(tmp_path / "work"),
                     "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["workload"]["rows_per_table"] == 3000 and doc["workload"]["dim"] == 8
    assert doc["options"] == {"coalesce_pushes": "2", "relay": "on"} and doc["rounds"] == 2 and len(doc["rounds_added"]) == 2
    none, ecrec = doc["runs"]["none"], doc["runs"]["ecrec"]
    for report in (none, ecrec):
        assert report["steps"] > 0 and report["step_times"]["steps"] == report["steps"]
        assert len(report["step_times"]["longest"]["each_server_cpu_ms"]) == 3
        assert 0 < report["servers_per_step"]["rows:pushed"] <= 64 * 4  # at most the ids of a step
    assert not any(k.startswith("strategy:part_") for k in none["servers_per_step"])
    per_group = ecrec["servers_per_step"]["strategy:group_pushes"] / ecrec["servers_per_step"]["strategy:groups_closed"]
    assert 1 <= per_group <= 2  # the option reached the servers (by default a group holds up to 64 pushes)
    added = doc["added"]
    parts = added["parts_us_per_row_update"]
    for name in ("delta", "merge", "build", "serialize", "seal", "verify", "parse", "apply", "watermarks"):
        assert parts[name] > 0, name  # each part of the parity path ran and was counted (relayed: sealed, verified)
    assert added["server_cpu_us_per_row_update"] == pytest.approx(sum(parts.values()))
    spread = doc["summary"]["server_cpu_us_per_row_update"]
    assert spread["n"] == 2 and spread["min"] <= spread["median"] <= spread["max"]
    assert sorted(r["server_cpu_us_per_row_update"] for r in doc["rounds_added"]) == pytest.approx(
        [spread["min"], spread["max"]])
    printed = capsys.readouterr().out
    assert "ecrec over none:" in printed and "per row update, by part (us):" in printed


@pytest.mark.benchmark
@pytest.mark.cluster
def test_profile_one_server_setting_against_another(tmp_path, capsys):
    """``--against ecrec --against-server-option ...``: the baseline's servers run with the setting (here their
    start-up objects left in garbage collections), the profiled ones without; the file records both and counts
    the servers' full collections per step."""
    out = tmp_path / "profile.json"
    assert cli.main(["profile", "--against", "ecrec", "--against-server-option", "no_gc_freeze=true", "--rows", "3000",
                     "--dim", "8", "--servers", "3", "--batch-size", "64", "--no-py-spy", "--seconds", "2",
                     "--rounds", "2", "--out", str(tmp_path / "work"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["against"] == "ecrec (no_gc_freeze=true)" and doc["against_server_options"] == {"no_gc_freeze": True}
    assert "server_options" not in doc and "--against-server-option no_gc_freeze=true" in doc["flags"]
    for name, run in doc["runs"].items():
        assert run["servers_per_step"]["gc:full_collections"] >= 0 and run["servers_per_step"]["gc:pause_s"] >= 0
        frozen = [s["gc_frozen_objects"] for s in run["servers_gc"].values()]
        assert len(frozen) == 3, name
        # the setting reached the baseline's servers only: theirs froze nothing, the profiled ones their start-up
        assert all(n == 0 for n in frozen) if name == doc["against"] else all(n > 20_000 for n in frozen), name
    assert doc["added"]["gc_pause_ms_per_step"] >= 0 and doc["added"]["base_gc_full_collections_per_step"] >= 0
    assert "servers' full garbage collections" in capsys.readouterr().out


@pytest.mark.benchmark
@pytest.mark.cluster
def test_profile_one_setting_against_another_of_the_same_strategy(tmp_path):
    """``--against ecrec --against-option ...``: two clusters of ecrec side by side, each with its own options (here
    the direct path over parity channels against gRPC calls); the file names the baseline by its options."""
    out = tmp_path / "profile.json"
    assert cli.main(["profile", "--against", "ecrec", "--against-option", "parity_transport=grpc", "--against-option",
                     "direct_bytes=1", "--option", "direct_bytes=1", "--rows", "3000", "--dim", "8", "--servers", "3",
                     "--batch-size", "64", "--no-py-spy", "--seconds", "2", "--rounds", "2",
                     "--out", str(tmp_path / "work"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    base = "ecrec (parity_transport=grpc direct_bytes=1)"
    assert doc["against"] == base and doc["against_strategy"] == "ecrec" and set(doc["runs"]) == {base, "ecrec"}
    assert doc["against_options"] == {"parity_transport": "grpc", "direct_bytes": "1"}
    assert doc["options"] == {"direct_bytes": "1"}
    grpc_run, socket_run = doc["runs"][base]["servers_per_step"], doc["runs"]["ecrec"]["servers_per_step"]
    assert grpc_run["strategy:direct_batches"] > 0 and socket_run["strategy:direct_batches"] > 0
    assert grpc_run.get("strategy:channel_batches", 0) == 0
    assert socket_run["strategy:channel_batches"] == pytest.approx(socket_run["strategy:direct_batches"])
    assert "--against-option parity_transport=grpc" in doc["flags"]


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, their children...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


@pytest.mark.cluster
def test_a_benchmark_ended_by_sigterm_stops_its_clusters(tmp_path):
    """``kill`` (SIGTERM) ends a benchmark as Ctrl-C does: the clusters it started do not outlive it."""
    bench = subprocess.Popen([sys.executable, "-m", "ecrec.bench.cli", "profile", "--against", "none", "--rows", "2000",
                              "--dim", "8", "--servers", "3", "--batch-size", "32", "--no-py-spy", "--seconds", "120",
                              "--rounds", "1", "--out", str(tmp_path)], stderr=subprocess.PIPE, text=True)
    below: dict[int, str] = {}
    started = threading.Event()

    def read():  # drained to the end: a full pipe would stall the benchmark
        for line in bench.stderr:
            if "starting a cluster of ecrec" in line:
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(120), "the benchmark never started its second cluster"
        time.sleep(3)  # its warm steps under way
        below = born(_descendants(bench.pid))
        assert len(below) >= 6, f"expected two clusters below the benchmark, found {sorted(below)}"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=90) == 130
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(started_at(p) == t for p, t in below.items()):
            time.sleep(0.2)
        assert not [p for p, t in below.items() if started_at(p) == t], "processes of the benchmark's clusters outlived it"
    finally:  # on a failure: whatever of it still runs (a pid reaped already may be another process's by now)
        if bench.poll() is None:
            bench.kill()
            bench.wait(timeout=30)
        kill_born(below)


@pytest.mark.benchmark
@pytest.mark.cluster
def test_a_profile_of_the_quick_preset_closes_its_worker_before_its_cluster(tmp_path):
    """The quick preset's worker never finishes its run in a profile (slices of an endless one): closing the run
    must close its client too, or its idle keeper (which carries the confirmations of held pushes) goes on polling
    the stopped servers, warnings every few seconds."""
    import threading

    before = set(threading.enumerate())  # a keeper of an earlier test in this process is not this one's
    assert cli.main(["profile", "--strategy", "ecrec", "--servers", "3", "--no-py-spy", "--seconds", "1",
                     "--rounds", "1", "--out", str(tmp_path / "work")]) == 0
    keepers = [t for t in set(threading.enumerate()) - before if t.name == "ecrec-idle-keeper" and t.is_alive()]
    for t in keepers:
        t.join(timeout=10)  # a closed keeper ends at its next wake
    assert not [t for t in keepers if t.is_alive()], "the profile left its worker's idle keeper polling"


def test_a_recorder_that_does_not_end_is_stopped_and_its_samples_dropped(tmp_path):
    """py-spy recorders are waited for up to a bound, then stopped (none is left running), and each one that did not
    end well is named with its reason; one that ended well is not."""
    import subprocess
    import sys

    from ecrec.bench.profile import stop_recorders

    def start(code: str):
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    recorders = {"ok": start("pass"), "error": start("import sys; sys.stderr.write('no such pid'); sys.exit(1)"),
                 "stuck": start("import time; time.sleep(120)")}
    try:
        failed = stop_recorders(recorders, 5.0)
        assert set(failed) == {"error", "stuck"}
        assert failed["error"] == "no such pid" and "stopped, its samples dropped" in failed["stuck"]
        assert all(rec.poll() is not None for rec in recorders.values())
    finally:
        for rec in recorders.values():
            if rec.poll() is None:
                rec.kill()
                rec.wait()
